"""Kill / resume chaos on a tiny MOPD setting: is every resume bit-identical?

    python -m bench.resume_chaos --out runs/bench_chaos [--n 20] [--steps 8] [--seed 0]

Runs the MOPD loop once uninterrupted, then until N runs were interrupted: start it, and
once a random step has finished send it a random signal among SIGKILL / SIGTERM / SIGINT
after a random delay (0-2 step times, measured on the uninterrupted run: it may land
inside a step, a checkpoint write or between steps), then resume it (`train.resume=true`) to the end. Each time it checks

- the final weights equal the uninterrupted run's, tensor by tensor (`torch.equal`);
- SIGTERM / SIGINT: the run exits 143 / 130, its checkpoint is the last step it finished
  (so the resume redoes no step: it says "at step <that step>", and every step's metrics
  are in MLflow exactly once), and its MLflow run is KILLED, then FINISHED after the
  resume; SIGKILL: the resume starts from a good checkpoint (a kill mid-save leaves none
  half-written) and ends FINISHED (killed before the first checkpoint: the restart is a
  new run, and the killed one is marked KILLED).

The setting is the e2e tests' (tiny random student and two teachers, HF sampling, CPU),
built in OUT/setup, with save_every=3 so SIGKILL loses a few steps. Writes
OUT/resume_chaos.json (after every trial) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}
REPO = Path(__file__).resolve().parents[1]

# the child: train, and after step k send `sig` to itself after `delay` seconds
CHILD = """
import os, sys, threading, time
from core.config import load_config
from mopd.distill import DistillConfig, run
cfg, out, k, sig, delay = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
log = open(os.path.join(out + ".steps"), "a")
timers = []
def cb(step, m):
    log.write(f"{step} {time.time()}\\n"); log.flush()
    if step == k:
        timers.append(threading.Timer(delay, os.kill, (os.getpid(), sig)))
        timers[-1].start()
run(load_config(DistillConfig, cfg), out, progress=False, callbacks=[cb])
for t in timers:   # the run is over: a signal not yet sent has nothing left to interrupt
    t.cancel()
"""


def build_setting(root: Path, steps: int) -> Path:
    """Tiny student + two teachers + 24 two-domain prompts + the recipe; reused if there."""
    cfg = root / "run.yaml"
    if cfg.exists():
        return cfg
    import torch
    from core.tiny import build_tiny_model
    from safetensors.torch import load_file, save_file

    def scaled(path: Path, factor: float) -> Path:
        w = load_file(str(path / "model.safetensors"))
        key = "lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight"
        w[key] = (w[key] * factor).contiguous()
        save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path

    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    student = scaled(build_tiny_model(root / "student", seed=0), 3.0)
    ta = scaled(build_tiny_model(root / "teacher_a", seed=0), 6.0)
    tb = scaled(build_tiny_model(root / "teacher_b", seed=0), 1.5)
    rows = [{"prompt": [{"role": "user", "content": f"say something about {i}"}],
             "domain": "alpha" if i % 2 else "beta"} for i in range(24)]
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    cfg.write_text(f"""
model: {{path: {student}}}
data:
  datasets: [{{path: {root / 'prompts.jsonl'}}}]
teachers:
  alpha: {{path: {ta}}}
  beta: {{path: {tb}}}
rollout: {{backend: hf, max_new_tokens: 6}}
train: {{max_steps: {steps}, prompts_per_step: 4, lr: 1.0e-3, save_every: 3}}
mlflow: {{experiment: chaos, log_model: false}}
""")
    return cfg


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}


def _distill(cfg: Path, out: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "distill", "--config", str(cfg), "--out",
                           str(out), *overrides], capture_output=True, text=True, env=_env(), cwd=REPO)


def _mlflow(out: Path) -> tuple[list[str], dict[int, int]]:
    """Statuses of the runs in OUT's store, and how often each step's loss was logged."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{out}/mlflow.db")
    exp = client.get_experiment_by_name("chaos")
    runs = client.search_runs([exp.experiment_id]) if exp else []
    counts: dict[int, int] = {}
    for r in runs:
        for m in client.get_metric_history(r.info.run_id, "loss"):
            counts[m.step] = counts.get(m.step, 0) + 1
    return [r.info.status for r in runs], counts


def _weights(out: Path):
    from safetensors.torch import load_file

    return load_file(str(out / "final" / "model.safetensors"))


def _steps(path: Path) -> list[tuple[int, float]]:
    """(step, time it finished) as the child logged them."""
    if not path.exists():
        return []
    return [(int(a), float(b)) for a, b in (ln.split() for ln in path.read_text().splitlines() if ln.strip())]


def trial(cfg: Path, ref: dict, out: Path, steps: int, sig_name: str, k: int, delay: float) -> dict:
    import torch

    t0 = time.perf_counter()
    sig = SIGNALS[sig_name]
    p = subprocess.run([sys.executable, "-c", CHILD, str(cfg), str(out), str(k), str(int(sig)), str(delay)],
                       capture_output=True, text=True, env=_env(), cwd=REPO)
    steps_file = Path(str(out) + ".steps")
    done = [s for s, _ in _steps(steps_file)]
    r = {"signal": sig_name, "after_step": k, "delay_s": round(delay, 3), "rc": p.returncode,
         "last_finished_step": done[-1] if done else 0, "problems": []}
    finished = (len(done) == steps and (out / "final" / "model.safetensors").exists()
                and p.returncode in (0, -int(sig)) and _mlflow(out)[0] == ["FINISHED"])
    if finished:   # the signal came after the run had ended (rc 0) or while the process exited
        r["interrupted"] = False
    else:
        r["interrupted"] = True
        expect_rc = {"SIGKILL": -9, "SIGTERM": 143, "SIGINT": 130}[sig_name]
        if p.returncode != expect_rc:
            r["problems"].append(f"exit code {p.returncode}, expected {expect_rc}: {p.stderr[-1500:]}")
        statuses, _ = _mlflow(out)
        r["mlflow_after_interrupt"] = statuses
        if sig_name != "SIGKILL" and statuses != ["KILLED"]:
            r["problems"].append(f"MLflow status after {sig_name}: {statuses}")
        q = _distill(cfg, out, "train.resume=true")
        if q.returncode != 0:
            r["problems"].append(f"resume failed ({q.returncode}): {q.stderr[-3000:]}")
            r["seconds"] = round(time.perf_counter() - t0, 1)
            return r
        m = re.search(r"resuming from \S+ at step (\d+)", q.stderr)
        r["resumed_at"] = int(m.group(1)) if m else 0
        r["steps_redone"] = r["last_finished_step"] - r["resumed_at"]
        if sig_name != "SIGKILL" and r["steps_redone"] != 0:
            r["problems"].append(f"{sig_name}: {r['steps_redone']} step(s) redone")
        statuses, counts = _mlflow(out)
        r["mlflow_after_resume"] = statuses
        # a resume continues the checkpoint's run; a SIGKILL before the first checkpoint leaves
        # nothing to continue, so the restart is a new run and the killed one is marked KILLED
        expect = ["FINISHED", "KILLED"] if sig_name == "SIGKILL" and not r["resumed_at"] else ["FINISHED"]
        if sorted(statuses) != expect:
            r["problems"].append(f"MLflow status after the resume: {statuses}, expected {expect}")
        if sig_name != "SIGKILL" and counts != {s: 1 for s in range(1, steps + 1)}:
            r["problems"].append(f"metrics per step: {counts}")
    w = _weights(out)
    r["bit_identical"] = w.keys() == ref.keys() and all(torch.equal(w[n], ref[n]) for n in ref)
    if not r["bit_identical"]:
        r["problems"].append("final weights differ from the uninterrupted run")
    r["seconds"] = round(time.perf_counter() - t0, 1)
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=20, help="interruptions, each followed by a resume")
    ap.add_argument("--steps", type=int, default=8, help="train.max_steps of every run")
    ap.add_argument("--seed", type=int, default=0, help="seeds the choice of signal, step and delay")
    args = ap.parse_args(argv)
    out = Path(args.out)
    cfg = build_setting(out / "setup", args.steps)
    full = out / "full"
    if not (full / "final" / "model.safetensors").exists():
        shutil.rmtree(full, ignore_errors=True)
        Path(str(full) + ".steps").unlink(missing_ok=True)
        p = subprocess.run([sys.executable, "-c", CHILD, str(cfg), str(full), "0", "0", "0"],
                           capture_output=True, text=True, env=_env(), cwd=REPO)
        if p.returncode:
            raise SystemExit(f"the uninterrupted run failed:\n{p.stderr[-3000:]}")
    ref = _weights(full)
    # delays are drawn in units of this machine's step time, so that signals land inside
    # steps, checkpoint writes and the gaps between them on a fast machine as on a slow one
    times = [t for _, t in _steps(Path(str(full) + ".steps"))]
    step_s = sorted(b - a for a, b in zip(times, times[1:]))[(len(times) - 1) // 2] if len(times) > 1 else 1.0
    print(f"[chaos] one step takes {step_s:.2f} s here; delays are drawn in 0-2 steps", flush=True)
    rng = random.Random(args.seed)
    results = []
    i = 0
    # --n counts interruptions: a signal that lands after the last step (the run simply
    # finishes) is recorded and checked, but another trial is drawn
    while sum(r["interrupted"] for r in results) < args.n and i < 5 * args.n + 5:
        sig_name = rng.choice(sorted(SIGNALS))
        k, delay = rng.randint(1, args.steps - 2), rng.uniform(0.0, 2.0 * step_s)
        d = out / "trials" / f"{i:02d}-{sig_name}-{k}"
        shutil.rmtree(d, ignore_errors=True)
        d.parent.mkdir(parents=True, exist_ok=True)
        Path(str(d) + ".steps").unlink(missing_ok=True)
        r = trial(cfg, ref, d, args.steps, sig_name, k, delay)
        results.append(r)
        i += 1
        n_int = sum(x["interrupted"] for x in results)
        print(f"[chaos] trial {i} ({n_int}/{args.n} interruptions) {sig_name} after step {k} (+{r['delay_s']} s): "
              f"{'interrupted at ' + str(r['last_finished_step']) if r['interrupted'] else 'not interrupted'}, "
              f"resumed at {r.get('resumed_at', '-')}, bit-identical {r.get('bit_identical')}"
              f"{'; PROBLEMS: ' + ' | '.join(r['problems']) if r['problems'] else ''}", flush=True)
        summary = {"n": len(results), "steps": args.steps, "seed": args.seed,
                   "interrupted": sum(r["interrupted"] for r in results),
                   "bit_identical": sum(bool(r.get("bit_identical")) for r in results),
                   "by_signal": {s: sum(r["signal"] == s and r["interrupted"] for r in results) for s in SIGNALS},
                   "steps_redone_after_sigterm_or_sigint": sum(r.get("steps_redone", 0) for r in results
                                                               if r["signal"] != "SIGKILL"),
                   "with_problems": sum(bool(r["problems"]) for r in results), "trials": results}
        (out / "resume_chaos.json").write_text(json.dumps(summary, indent=1))
    print(f"[chaos] {summary['interrupted']} interruptions ({summary['by_signal']}), "
          f"{summary['bit_identical']}/{summary['n']} bit-identical, "
          f"{summary['steps_redone_after_sigterm_or_sigint']} steps redone after SIGTERM/SIGINT, "
          f"{summary['with_problems']} with problems")
    return 1 if summary["with_problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
