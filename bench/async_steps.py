"""Asynchronous steps against synchronous ones: the MOPD loop's step time when the next
batch is sampled during this batch's update (`rollout.async_steps: true`).

    python -m bench.async_steps --out runs/bench/async [--hidden 512 --layers 4] [--repeats 2]

One tiny random student (`--hidden`, `--layers`; head_dim 64) and a teacher (the same
init with a sharper lm_head, so the reverse KL is clear) are built here; each repeat
runs the real loop (`mopd.distill.loop.run`, HF sampler, one domain, `--steps` steps)
synchronously and asynchronously, interleaved A/B then B/A, so drift of a shared machine
hits both arms.

Step wall time is the time between the ends of consecutive steps, taken by a step
callback (step 1 is left out: it loads the models and samples its batch before any
update in both arms). Sample / update / teacher seconds are the loop's own metrics
(`time/sample_s`, `time/update_s`, `time/teacher_s`); `async/overlap_s` is the time the
next batch's sampling and this batch's update ran at once. Ratios are async over sync,
per repeat and over the pooled steps.

The sampler is HF (the async arm samples with its own copy of the weights,
`HFCopyRollout`): the colocated vLLM engine was not tried in a thread here. Sampling and
the update only overlap where there are cores for both: at `--threads` 1 the two arms
use one core each, so the gain needs two free cores. Writes OUT/async_steps.json after
every run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def build_models(out: Path, hidden: int, layers: int) -> tuple[Path, Path]:
    from safetensors.torch import load_file, save_file

    from core.tiny import build_tiny_model

    paths = []
    for name, scale in (("student", 2.0), ("teacher", 5.0)):
        p = build_tiny_model(out / name, seed=0, hidden_size=hidden, num_layers=layers, num_heads=hidden // 64)
        w = load_file(str(p / "model.safetensors"))
        w["lm_head.weight"] = w["lm_head.weight"] * scale
        save_file(w, str(p / "model.safetensors"), metadata={"format": "pt"})
        paths.append(p)
    return paths[0], paths[1]


def write_config(out: Path, student: Path, teacher: Path, a) -> Path:
    rows = [{"prompt": [{"role": "user", "content": f"tell me about item {i} of the list"}], "domain": "chat"}
            for i in range(256)]
    data = out / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = out / "run.yaml"
    cfg.write_text(f"""
model: {{path: {student}}}
data:
  datasets: [{{path: {data}}}]
teachers:
  chat: {{path: {teacher}}}
rollout: {{backend: hf, max_new_tokens: {a.max_new_tokens}}}
train: {{max_steps: {a.steps}, prompts_per_step: {a.prompts_per_step}, lr: 1.0e-4, save_every: 0}}
mlflow: {{experiment: bench_async, log_model: false}}
""")
    return cfg


def one_run(cfg: Path, out: Path, async_on: bool) -> dict:
    from core.config import load_config
    from mopd.distill.config import DistillConfig
    from mopd.distill.loop import run

    ends: list[float] = []
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    hist = run(load_config(DistillConfig, cfg, [f"rollout.async_steps={str(async_on).lower()}"]), out,
               progress=False, callbacks=[lambda step, m: ends.append(time.perf_counter())])["history"]
    later = hist[1:]
    res = {"step_s": [b - a for a, b in zip(ends, ends[1:])],
           "sample_s": [h["time/sample_s"] for h in later], "update_s": [h["time/update_s"] for h in later],
           "teacher_s": [h["time/teacher_s"] for h in later],
           "reverse_kl_last": hist[-1]["reverse_kl/chat"]}
    if async_on:
        res["overlap_s"] = [h["async/overlap_s"] for h in later]
        res["token_age_mean"] = [h["async/token_age_mean"] for h in later]
    return res


def summarize(runs: list[dict]) -> dict:
    def pooled(arm, key):
        xs = [x for r in runs if r["arm"] == arm for x in r[key]]
        return statistics.mean(xs) if xs else float("nan")

    s = {arm: {k: pooled(arm, k) for k in ("step_s", "sample_s", "update_s", "teacher_s")}
         for arm in ("sync", "async")}
    s["async"]["overlap_s"] = pooled("async", "overlap_s")
    s["ratios"] = {
        "step_async_over_sync": s["async"]["step_s"] / s["sync"]["step_s"],
        "gain": 1.0 - s["async"]["step_s"] / s["sync"]["step_s"],
        # the most async can save: the sampling hidden behind the update
        "overlap_over_sync_step": s["async"]["overlap_s"] / s["sync"]["step_s"],
        "sample_share_sync": s["sync"]["sample_s"] / s["sync"]["step_s"],
        "update_share_sync": s["sync"]["update_s"] / s["sync"]["step_s"],
    }
    per_rep = []
    for rep in sorted({r["repeat"] for r in runs}):
        arms = {r["arm"]: statistics.mean(r["step_s"]) for r in runs if r["repeat"] == rep}
        if len(arms) == 2:
            per_rep.append(arms["async"] / arms["sync"])
    s["ratios"]["step_async_over_sync_per_repeat"] = per_rep
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.async_steps", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=512, help="hidden size (a multiple of 64)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6, help="MOPD steps per run (step 1 is not timed)")
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="sync/async pairs, the order alternating")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    a = ap.parse_args(argv)
    if a.steps < 3:
        ap.error("--steps must be >= 3 (step 1 is not timed, and a step time needs two step ends)")
    if a.hidden < 64 or a.hidden % 64:
        ap.error("--hidden must be a positive multiple of 64 (head_dim 64)")
    if a.repeats < 1 or a.layers < 1 or a.prompts_per_step < 1 or a.max_new_tokens < 1:
        ap.error("--repeats, --layers, --prompts-per-step and --max-new-tokens must be >= 1")
    import torch

    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    student, teacher = build_models(out / "models", a.hidden, a.layers)
    cfg = write_config(out, student, teacher, a)
    runs: list[dict] = []
    result = {"settings": vars(a), "sampler": "hf", "load_avg_start": os.getloadavg(), "runs": runs}
    for rep in range(a.repeats):
        for arm in (("sync", "async") if rep % 2 == 0 else ("async", "sync")):
            print(f"[bench] repeat {rep + 1}/{a.repeats}: {arm}", file=sys.stderr, flush=True)
            r = one_run(cfg, out / "runs" / f"{rep}_{arm}", arm == "async")
            runs.append({"repeat": rep, "arm": arm, **r})
            result["load_avg_end"] = os.getloadavg()
            if {x["arm"] for x in runs} == {"sync", "async"}:
                result["summary"] = summarize(runs)
            (out / "async_steps.json").write_text(json.dumps(result, indent=1))
    s = result["summary"]
    print(f"[bench] step s: sync {s['sync']['step_s']:.3f}, async {s['async']['step_s']:.3f} "
          f"(async/sync {s['ratios']['step_async_over_sync']:.3f}); overlap {s['async']['overlap_s']:.3f} s; "
          f"sync: sample {s['sync']['sample_s']:.3f} s, update {s['sync']['update_s']:.3f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
