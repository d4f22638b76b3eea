"""MOPD of a text student from the `frontend_loop` expert, end to end, with retention.

    python -m bench.frontend_loop_mopd --student runs/base/model \
        --teacher runs/experts/frontend_loop/sft/model --out runs/frontend_loop_mopd --steps 100 --n-eval 30

Writes OUT/rows.jsonl (train page tasks with their `task` column), runs
recipes/opt_in/frontend_loop/mopd.yaml (mopd.distill.loop.run) with the student and the
teacher given, then scores the teacher, the student before and the student after on the
same held-out episodes (evals/frontend_loop.py, greedy): final score, first-turn score,
gain; retention = student after / teacher (final score). Writes OUT/mopd.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "opt_in" / "frontend_loop" / "mopd.yaml"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.frontend_loop_mopd", description=__doc__.split("\n\n")[0])
    ap.add_argument("--student", required=True)
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--n-train", type=int, default=400)
    ap.add_argument("--n-eval", type=int, default=30)
    ap.add_argument("overrides", nargs="*", help="more recipe overrides (key=value)")
    a = ap.parse_args(argv)
    from core.config import load_config
    from evals.frontend_loop import evaluate
    from experts.frontend_loop.data import make_tasks
    from rewards.frontend_loop import DOMAIN
    from mopd.distill.config import DistillConfig
    from mopd.distill.loop import run

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = out / "rows.jsonl"
    # the loop needs the request and the task only: no oracle episode rendered (make_dataset
    # renders one per task, ~10 min for 480 on a loaded 2-core box)
    rows.write_text("\n".join(json.dumps({"prompt": [{"role": "user", "content": t["user"]}], "domain": DOMAIN,
                                          "task": json.dumps(t)}) for t in make_tasks("train", a.n_train, seed=0)))
    cfg = load_config(DistillConfig, RECIPE, [f"model.path={a.student}", f"teachers.frontend_loop.path={a.teacher}",
                                              f"data.datasets=[{{path: {rows}}}]", f"train.max_steps={a.steps}",
                                              *a.overrides])
    res = run(cfg, out / "run", progress=False)
    scores = {name: evaluate(str(path), n=a.n_eval, seed=0)
              for name, path in (("teacher", a.teacher), ("student_before", a.student),
                                 ("student_after", out / "run" / "final"))}
    t = scores["teacher"]["score"]
    summary = {k: {m: v[m] for m in ("score", "first_score", "gain")} for k, v in scores.items()}
    summary["retention"] = scores["student_after"]["score"] / t if t > 0 else None
    summary["steps"] = len(res["history"])
    last = res["history"][-1]
    summary["last_step"] = {k: v for k, v in last.items() if "frontend_loop" in k}
    (out / "mopd.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
