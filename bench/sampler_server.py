"""The sampler as a server against the colocated engine: MOPD step time and weight-push
time, measured in one run.

    python -m bench.sampler_server --out runs/bench/sampler_server [--hidden 512 --layers 4] [--repeats 2]

The student and teacher are bench.async_steps' (a tiny random Qwen2 and the same init
with a sharper lm_head). One sampler server is started the way `mopd teachers serve`
starts it (teachers/serve.py `sampler_server`, eager, its own process); each repeat runs
the real loop (`mopd.distill.loop.run`, `--steps` steps) in three arms, the order
rotating between repeats so drift of a shared machine hits every arm:

- colocated: `rollout.backend: vllm`, the engine in the trainer's process, weights synced
  in memory;
- server: `rollout.backend: server`, sampling over HTTP, weights pushed over gloo through
  vLLM's weight-update API after every update;
- server_async: the same with `rollout.async_steps: true` (the next batch sampled by the
  server while this batch's update runs).

Step time is between the ends of consecutive steps (step 1 is left out). The weight push
is timed apart: `--pushes` pushes of the student's weights into the in-process engine
(`VLLMRollout.sync_weights`) and into the server (`ServerRollout.sync_weights`),
alternating. Ratios are against colocated. On a 2-core machine the server and the
trainer share the cores, so this measures the protocol's overhead, not the scaling the
server is for (sampling on other nodes). Writes OUT/sampler_server.json after every run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ARMS = ("colocated", "server", "server_async")


def one_run(cfg: Path, out: Path, overrides: list[str]) -> dict:
    from core.config import load_config
    from mopd.distill.config import DistillConfig
    from mopd.distill.loop import run

    ends: list[float] = []
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    hist = run(load_config(DistillConfig, cfg, overrides), out, progress=False,
               callbacks=[lambda step, m: ends.append(time.perf_counter())])["history"]
    later = hist[1:]
    return {"step_s": [b - a for a, b in zip(ends, ends[1:])],
            "sample_s": [h["time/sample_s"] for h in later], "update_s": [h["time/update_s"] for h in later],
            "teacher_s": [h["time/teacher_s"] for h in later], "sync_s": [h["time/sync_s"] for h in later],
            "mismatch_max": max(h["mismatch/abs_max/chat"] for h in hist),
            "reverse_kl_last": hist[-1]["reverse_kl/chat"]}


def push_times(student: Path, url: str, n: int) -> dict:
    from transformers import AutoModelForCausalLM

    from core.rollout import ServerRollout, VLLMRollout

    m = AutoModelForCausalLM.from_pretrained(str(student))
    local = VLLMRollout(str(student), max_model_len=256, kv_cache_gb=0.5, enforce_eager=True)
    remote = ServerRollout([url], group_port=29700)
    t = {"colocated": [], "server": []}
    try:
        for _ in range(n):
            for name, r in (("colocated", local), ("server", remote)):
                t0 = time.perf_counter()
                r.sync_weights(m.named_parameters())
                t[name].append(time.perf_counter() - t0)
    finally:
        local.close()
        remote.close()
    t["bytes"] = sum(p.numel() * p.element_size() for p in m.parameters())
    return t


def main(argv: list[str] | None = None) -> int:
    from bench.async_steps import build_models, write_config

    ap = argparse.ArgumentParser(prog="bench.sampler_server", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=512, help="hidden size (a multiple of 64)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6, help="MOPD steps per run (step 1 is not timed)")
    ap.add_argument("--prompts-per-step", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--pushes", type=int, default=5)
    a = ap.parse_args(argv)
    if a.steps < 3 or a.hidden < 64 or a.hidden % 64 or min(a.repeats, a.pushes, a.layers) < 1:
        ap.error("need --steps >= 3, --hidden a positive multiple of 64, --repeats/--pushes/--layers >= 1")
    from teachers import serve

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    student, teacher = build_models(out / "models", a.hidden, a.layers)
    cfg = write_config(out, student, teacher, a)
    srv = serve.sampler_server(str(student), out / "server", max_model_len=256, kv_cache_gb=0.5,
                               vllm=f"{sys.executable} -m {serve.API_SERVER}", extra_args=["--enforce-eager"])
    common = ["rollout.max_model_len=256", "rollout.kv_cache_gb=0.5", "rollout.enforce_eager=true",
              "data.max_prompt_tokens=128"]
    arm_overrides = {"colocated": ["rollout.backend=vllm"],
                     "server": ["rollout.backend=server", f"rollout.server.urls=[{srv.url}]"],
                     "server_async": ["rollout.backend=server", f"rollout.server.urls=[{srv.url}]",
                                      "rollout.async_steps=true", "loss.max_staleness=1"]}
    runs: list[dict] = []
    result = {"settings": vars(a), "load_avg_start": os.getloadavg(), "runs": runs}
    serve.start([srv])
    try:
        serve.wait_healthy([srv], timeout_s=900)
        result["push_s"] = push_times(student, srv.url, a.pushes)
        for rep in range(a.repeats):
            order = ARMS[rep % 3:] + ARMS[:rep % 3]
            for arm in order:
                print(f"[bench] repeat {rep + 1}/{a.repeats}: {arm}", file=sys.stderr, flush=True)
                r = one_run(cfg, out / "runs" / f"{rep}_{arm}", common + arm_overrides[arm])
                runs.append({"repeat": rep, "arm": arm, **r})
                result["load_avg_end"] = os.getloadavg()
                (out / "sampler_server.json").write_text(json.dumps(result, indent=1))
    finally:
        serve.stop([srv])

    def pooled(arm, key):
        return statistics.mean(x for r in runs if r["arm"] == arm for x in r[key])

    s = {arm: {k: pooled(arm, k) for k in ("step_s", "sample_s", "update_s", "teacher_s", "sync_s")} for arm in ARMS}
    p = result["push_s"]
    s["ratios"] = {f"step_{arm}_over_colocated": s[arm]["step_s"] / s["colocated"]["step_s"] for arm in ARMS[1:]}
    s["ratios"]["push_server_over_colocated"] = statistics.median(p["server"]) / statistics.median(p["colocated"])
    s["mismatch_max"] = {arm: max(r["mismatch_max"] for r in runs if r["arm"] == arm) for arm in ARMS}
    result["summary"] = s
    (out / "sampler_server.json").write_text(json.dumps(result, indent=1))
    print(f"[bench] step s: " + ", ".join(f"{arm} {s[arm]['step_s']:.3f}" for arm in ARMS)
          + f"; push s (median): colocated {statistics.median(p['colocated']):.3f}, server "
          f"{statistics.median(p['server']):.3f} ({p['bytes'] / 1e6:.0f} MB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
