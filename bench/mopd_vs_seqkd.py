"""MOPD against seq-KD on one prompt stream and one student-token budget, after a pipeline run.

    python -m bench.mopd_vs_seqkd --pipeline runs/pipeline --out runs/bench/mt \\
        'data.mix={chat: 0, code: 0, instruction_following: 0, math: 1, tool_use: 1}' train.max_steps=500

Trains a MOPD student with the pipeline's MOPD config (DIR/mopd/config.yaml: its base, its
teachers) plus the overrides, then the pipeline's seq-KD baseline (its settings from
DIR/pipeline.yaml) on that run's prompt stream with that run's token count, then scores both
greedy on the held-out rows of every domain the run trained. It prints the table and writes
OUT/result.json. This is the loop for trying a MOPD change against seq-KD without rerunning
the pipeline: the full recipe takes ~12 + 8 minutes on 2 cores; math with tool_use at 500
steps (the example above) about 12 minutes in all, and reproduces the full run's gap
(docs/results/2026-11-30-math-tool-use-interference.md). A benchmark, not a test: scores are comparable only on one set of experts.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipeline", required=True, help="a finished `mopd pipeline` folder")
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=500, help="held-out rows per column (default 500)")
    ap.add_argument("overrides", nargs="*", help="key=value for the MOPD config")
    args = ap.parse_args(argv)

    root = Path(args.pipeline)
    need = [root / "mopd" / "config.yaml", root / "pipeline.yaml", root / "base" / "model"]
    missing = [str(p) for p in need if not p.exists()]
    if missing:
        print(f"[bench] {root} is not a finished pipeline folder: missing {missing}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if (out / "mopd").exists():
        print(f"[bench] {out / 'mopd'} exists; choose a new --out", file=sys.stderr)
        return 2

    # imported here, after the checks above: bad input is named in a second, before torch loads
    import yaml
    from transformers import AutoTokenizer

    from evals.run import main as eval_main
    from mopd.baselines import mopd_prompt_stream, seq_kd
    from core.config import load_config
    from mopd.distill import DistillConfig, run
    from pipeline.config import SeqKDSection

    cfg = load_config(DistillConfig, str(root / "mopd" / "config.yaml"),
                      [*args.overrides, "train.save_every=0", "mlflow.log_model=false",
                       f"mlflow.tracking_uri=sqlite:///{(out / 'mlflow.db').resolve()}"])
    baselines = yaml.safe_load((root / "pipeline.yaml").read_text()).get("baselines") or {}
    sk = SeqKDSection(**(baselines.get("seq_kd") or {}))
    # the pipeline's seq-KD: exported on the experts' (= the student's) INT4 grid unless baselines.quantize is off
    quant = cfg.quant if cfg.quant.enabled and baselines.get("quantize", True) else None
    domains = sorted({d for d, w in cfg.data.mix.items() if w > 0}) if cfg.data.mix else None
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    res = run(cfg, out / "mopd")
    budget = int(sum(h["tokens"] for h in res["history"]))
    t_mopd = time.perf_counter() - t0

    t0 = time.perf_counter()
    base = cfg.model.path
    stream = mopd_prompt_stream(cfg, AutoTokenizer.from_pretrained(base))
    s = seq_kd(base, {k: t.path for k, t in cfg.teachers.items()}, stream, out / "seq_kd", budget_tokens=budget,
               quant=quant, match=sk.match, budget_updates=len(res["history"]),
               **sk.seq_kd_kwargs(cfg.rollout.max_new_tokens))
    s.pop("losses", None)
    t_sk = time.perf_counter() - t0

    ev = ["--models", f"mopd={res['final']},seq_kd={out / 'seq_kd' / 'model'}",
          "--domains", ",".join(domains) if domains else "all", "--n", str(args.n), "--out", str(out / "eval")]
    if (root / "chat_rm").exists() and (not domains or "chat" in domains):
        ev += ["--reward-kwarg", f"chat.reward_model={root / 'chat_rm'}"]
    rc = eval_main(ev)
    if rc:
        return rc
    scores = json.loads((out / "eval" / "eval.json").read_text())
    result = {"overrides": args.overrides, "seq_kd_matched": s["match"],   # baselines.seq_kd.match
              "updates": {"mopd": len(res["history"]), "seq_kd": s["steps"]},
              "student_tokens": {"mopd": budget, "seq_kd": s["tokens"]},
              "seconds": {"mopd": round(t_mopd, 1), "seq_kd": round(t_sk, 1)}, "eval": scores}
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "eval"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
