"""Stage `report` (always run): DIR/eval.json, DIR/report.{json,md}, DIR/retention.png,
DIR/kl_curves.png from every eval stage, MOPD's history and the stage timings."""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from evals.report import build_report
from evals.run import EvalColumn, eval_json
from pipeline.runner import Stage, StageContext
from pipeline.stages.baselines import SEQ_KD
from pipeline.stages.common import Tracking, log_artifact

FILES = ("report.json", "report.md", "retention.png", "kl_curves.png", "eval.json")


def stage(root: Path, cols: list[EvalColumn], evals: dict[str, str], teachers: dict[str, str],
          seq_kd: bool, tracking: Tracking) -> Stage:
    """`evals`: model -> its eval stage; `teachers`: key -> its RL expert stage."""
    return Stage("report", None, partial(run, root=root, cols=cols, evals=evals, teachers=teachers, tracking=tracking),
                 deps=["mopd", *teachers.values(), *evals.values(), *([SEQ_KD] if seq_kd else [])], always=True)


def run(ctx: StageContext, root: Path, cols: list[EvalColumn], evals: dict[str, str], teachers: dict[str, str],
        tracking: Tracking) -> dict:
    scores = {m: ctx.inputs[s]["scores"] for m, s in evals.items()}
    models = {m: ctx.inputs[s]["model"] for m, s in evals.items()}
    ev = eval_json(scores, cols, models)
    (root / "eval.json").write_text(json.dumps(ev, indent=1))
    hist_path = Path(ctx.inputs["mopd"]["history"])
    hist = json.loads(hist_path.read_text()) if hist_path.exists() else []
    tokens = {"mopd": ctx.inputs["mopd"]["tokens"],
              "seq_kd": ctx.inputs[SEQ_KD]["tokens"] if SEQ_KD in ctx.inputs else None}
    build_report(ev, hist, root, student_tokens=tokens, stage_seconds=ctx.seconds, wall_seconds=ctx.wall_seconds,
                 mlflow={"tracking_uri": tracking.uri, "parent_run_id": ctx.parent_run_id},
                 extra={"teacher_models": {k: ctx.inputs[s].get("model_uri") for k, s in teachers.items()}})
    with tracking.stage_run(ctx, "report"):
        for f in FILES:
            log_artifact(root / f)
    return {"report": str(root / "report.json")}
