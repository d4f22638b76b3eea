"""Stage `report` (always run): DIR/eval.json, DIR/report.{json,md}, DIR/retention.png,
DIR/kl_curves.png, DIR/budgets.png from every eval stage, MOPD's history, the baselines'
summaries (their budgets) and the stage timings."""
from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

from evals.report import build_report, on_policy_tokens_from_history
from evals.run import EvalColumn, eval_json
from mopd.baselines.budget import checkpoint_params, mopd_budget, no_training_budget, seq_kd_budget
from mopd.distill import DistillConfig
from pipeline.runner import Stage, StageContext
from pipeline.stages.baselines import SEQ_KD
from pipeline.stages.common import Tracking, key_dir, log_artifact

FILES = ("report.json", "report.md", "retention.png", "kl_curves.png", "budgets.png", "cost.png", "eval.json")


def stage(root: Path, cols: list[EvalColumn], evals: dict[str, str], teachers: dict[str, str],
          seq_kd: bool, tracking: Tracking, baselines: dict[str, str] | None = None,
          mopd_cfg: DistillConfig | None = None, seeds: dict[str, list[str]] | None = None) -> Stage:
    """`evals`: model -> its eval stage; `teachers`: key -> its RL expert stage;
    `baselines`: name -> its stage (their summaries carry the budgets); `seeds`: method ->
    its models over the training seeds (pipeline/stages/seeds.py)."""
    baselines = baselines or {}
    return Stage("report", None, partial(run, root=root, cols=cols, evals=evals, teachers=teachers, tracking=tracking,
                                         baselines=baselines, mopd_cfg=mopd_cfg, seeds=seeds or {}),
                 deps=["base", "mopd", *teachers.values(), *evals.values(),
                       *sorted(set(baselines.values()) | ({SEQ_KD} if seq_kd else set()))], always=True)


def budgets(ctx: StageContext, teachers: dict[str, str], baselines: dict[str, str],
            mopd_cfg: DistillConfig | None) -> dict[str, dict]:
    """{model: budget} (mopd.baselines.budget) of the student and every baseline, each with
    its stage's wall-clock (`seconds`) and that of the expert stages it needs first
    (`teacher_seconds`: every expert and the chat RM for the distilled ones and the
    average; the chat RM alone for the RL ones, which need no teacher)."""
    n_student = checkpoint_params(ctx.inputs["base"]["checkpoint"])
    n_teachers = [checkpoint_params(ctx.inputs[s]["checkpoint"]) for s in teachers.values()]
    n_teacher = round(sum(n_teachers) / len(n_teachers)) if n_teachers else 0
    secs = ctx.seconds
    experts_s = sum(v for k, v in secs.items() if k.startswith("expert/") or k == "chat_rm")
    rm_s = secs.get("chat_rm", 0.0)
    m = ctx.inputs["mopd"]
    hist_path = Path(m["history"])
    hist = json.loads(hist_path.read_text()) if hist_path.exists() else []
    samples = None
    if mopd_cfg is not None:
        samples = (math.ceil(int(m["steps"]) / mopd_cfg.train.minibatches) * mopd_cfg.train.prompts_per_step
                   * mopd_cfg.rollout.samples_per_prompt)
    out = {"student": {**mopd_budget(n_student=n_student, n_teacher=n_teacher, tokens=int(m["tokens"]),
                                     on_policy_tokens=on_policy_tokens_from_history(hist) if hist else None,
                                     samples=samples),
                       "seconds": secs.get("mopd"), "teacher_seconds": experts_s}}
    for name, st in baselines.items():
        o = ctx.inputs.get(st, {})
        if o.get("budget"):
            b = o["budget"]
        elif name == "seq_kd":    # a summary written before the stages wrote their budgets
            b = seq_kd_budget(n_student=n_student, n_teacher=n_teacher, tokens=int(o["tokens"]), rows=o.get("rows"))
        elif name == "weight_avg":
            b = no_training_budget(n_student)
        else:
            continue
        rl = name in ("mix_rl", "cascade_rl")
        # a method of several stages (warm-up then MOPD) names them all; its wall-clock is their sum
        parts = o.get("budget_stages") or [st]
        took = [secs[p] for p in parts if secs.get(p) is not None]
        out[name] = {**b, "seconds": sum(took) if took else None, "teacher_seconds": rm_s if rl else experts_s}
        if o.get("budget_match"):
            out[name]["match"] = o["budget_match"]
        if name == "seq_kd":   # which budget it equals of MOPD's (baselines.seq_kd.match), and its updates
            out[name]["matched"] = o.get("match", "tokens")
            out[name]["updates"] = o.get("steps")
    out["student"]["updates"] = m.get("steps")
    return out


# The page picture: these models' pages side by side, when they were scored on a column
# of a domain that saves its pages (frontend).
GRID_MODELS = (("base", "base"), ("teacher", "teacher"), ("student", "MOPD student"), ("seq_kd", "seq-KD"))
GRID_ROWS = 4


def page_grid_picture(ctx: StageContext, evals: dict[str, str], cols: list[EvalColumn], root: Path) -> list[str]:
    """DIR/pages-<column>.png for each frontend column: the first GRID_ROWS held-out tasks as
    rendered by the base, the column's teacher, the student and seq-KD (those scored).
    Returns the report.md lines that show them ([] when there is no such column)."""
    from evals.frontend import INDEX, page_grid

    lines: list[str] = []
    for col in (c for c in cols if c.domain == "frontend"):
        columns, titles = {}, None
        for model, label in GRID_MODELS:
            model = f"teacher/{col.name}" if model == "teacher" else model
            o = ctx.inputs.get(evals.get(model, ""), {})
            f = Path(o.get("out", "/nonexistent")) / "pages" / model / key_dir(col.name) / INDEX
            if not f.exists():
                continue
            index = json.loads(f.read_text())[:GRID_ROWS]
            columns[label] = [r["png"] for r in index]
            titles = titles or [r["prompt"] for r in index]
        if not columns or len({len(v) for v in columns.values()}) != 1:
            continue
        png = root / f"pages-{col.name.replace('/', '-')}.png"
        page_grid(columns, png, titles)
        lines += [f"## Pages ({col.name})", "",
                  f"The first {len(titles)} held-out tasks, as each model's page renders in Chromium "
                  f"(every page's screenshot: evals/<model>/pages/).", "", f"![pages]({png.name})", ""]
    return lines


def run(ctx: StageContext, root: Path, cols: list[EvalColumn], evals: dict[str, str], teachers: dict[str, str],
        tracking: Tracking, baselines: dict[str, str] | None = None, mopd_cfg: DistillConfig | None = None,
        seeds: dict[str, list[str]] | None = None) -> dict:
    scores = {m: ctx.inputs[s]["scores"] for m, s in evals.items()}
    models = {m: ctx.inputs[s]["model"] for m, s in evals.items()}
    # an eval stage cached from before costs were recorded has none: its row shows "–" (--force eval/<model>)
    cost = {m: ctx.inputs[s]["cost"] for m, s in evals.items() if ctx.inputs[s].get("cost") is not None}
    ev = eval_json(scores, cols, models, cost=cost)
    (root / "eval.json").write_text(json.dumps(ev, indent=1))
    hist_path = Path(ctx.inputs["mopd"]["history"])
    hist = json.loads(hist_path.read_text()) if hist_path.exists() else []
    tokens = {"mopd": ctx.inputs["mopd"]["tokens"],
              "seq_kd": ctx.inputs[SEQ_KD]["tokens"] if SEQ_KD in ctx.inputs else None}
    skipped = sorted({d for st in (baselines or {}).values()
                      for d in ctx.inputs.get(st, {}).get("skipped_domains", [])})
    build_report(ev, hist, root, student_tokens=tokens, stage_seconds=ctx.seconds, wall_seconds=ctx.wall_seconds,
                 mlflow={"tracking_uri": tracking.uri, "parent_run_id": ctx.parent_run_id},
                 budgets=budgets(ctx, teachers, baselines or {}, mopd_cfg), seeds=seeds,
                 extra={"teacher_models": {k: ctx.inputs[s].get("model_uri") for k, s in teachers.items()},
                        "rl_skipped_domains": skipped})
    pages = page_grid_picture(ctx, evals, cols, root)
    if pages:
        with open(root / "report.md", "a") as f:
            f.write("\n" + "\n".join(pages))
    with tracking.stage_run(ctx, "report"):
        for f in (*FILES, *sorted(p.name for p in root.glob("pages-*.png"))):
            log_artifact(root / f)
    return {"report": str(root / "report.json")}
