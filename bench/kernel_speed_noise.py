"""How much does the kernel reward's speed score move on a busy machine?

    python -m bench.kernel_speed_noise --out runs/bench_kernel_noise [--repeats 10] [--burners 2]

Scores one mid-speed candidate (the expert's one-line op applied to blocks of --block rows
in a Python loop: faster than the reference's row loop, slower than the expert) on one
fixed task, --repeats times, each time in a fresh reward call (a fresh sandbox, fresh
secret inputs), while --burners processes spin on the CPU (default: one per core) so the
machine is busy. The expert kernel and the reference itself (the floor) are scored in the
same calls (1.0 is the task's speed of light, which no kernel here reaches). The claim it
checks: the candidate's score varies by less than the gap between floor and ceiling
(rewards/kernel.py: 1 - FLOOR).

Writes OUT/kernel_speed_noise.json: the task, every run's three scores and speed-ups, and
the candidate's min / max / spread / standard deviation against the gap.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from experts.kernel import data
from rewards.kernel import FLOOR, NOISE_BAND, TRIALS, score_kernels

COLS = ("reference", "expert", "spec", "domain")


def task_row(rows: int = 64, cols: int = 128) -> dict:
    """The fixed task: layer_norm (eps=1e-5) of x [rows, cols] with weight w and bias b."""
    task = data.Task("layer_norm", (("eps", "1e-5"),), (("x", "x"), ("w", "w"), ("b", "b")),
                     (("R", rows), ("C", cols)))
    return data._row(task)


def blocked_candidate(block: int) -> str:
    """The expert's op on blocks of `block` rows in a Python loop: a mid-speed kernel."""
    return ("```python\ndef kernel(x, w, b):\n    out = torch.empty_like(x)\n"
            f"    for i in range(0, x.shape[0], {block}):\n"
            f"        out[i:i + {block}] = F.layer_norm(x[i:i + {block}], x.shape[-1:], w, b, eps=1e-5)\n"
            "    return out\n```")


def start_burners(n: int) -> list[subprocess.Popen]:
    """n processes spinning on the CPU (at the lowest priority, as the bench itself runs)."""
    code = "import os\nos.nice(19)\nwhile True:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def stop_burners(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def run(out: Path, *, repeats: int = 10, burners: int | None = None, block: int = 8, trials: int = TRIALS,
        isolation: str | None = None, progress: bool = True) -> dict:
    row = task_row()
    completions = [row["completion"][0]["content"], data.reference_completion(row), blocked_candidate(block)]
    names = ("expert", "reference", "candidate")
    n_burn = (os.cpu_count() or 1) if burners is None else burners
    procs = start_burners(n_burn)
    runs = []
    t0 = time.perf_counter()
    try:
        for k in range(repeats):
            order = list(range(3))
            random.Random(k).shuffle(order)   # no fixed position in the sandbox's sequence
            res = score_kernels(None, [completions[i] for i in order], **{c: [row[c]] * 3 for c in COLS},
                                trials=trials, isolation=isolation)
            by_name = {names[i]: r for i, r in zip(order, res)}
            runs.append({n: {"score": r["score"], "reason": r["reason"], "r": r.get("r"), "r_expert": r.get("r_expert")}
                         for n, r in by_name.items()})
            if progress:
                print(f"run {k + 1}/{repeats}: " + "  ".join(f"{n}={runs[-1][n]['score']:.3f}" for n in names),
                      file=sys.stderr)
    finally:
        stop_burners(procs)
    cand = [r["candidate"]["score"] for r in runs]
    gap = 1.0 - FLOOR
    result = {
        "task": "layer_norm eps=1e-5, x [64, 128] float32 timing shape",
        "candidate": f"F.layer_norm on blocks of {block} rows in a Python loop",
        "repeats": repeats, "burners": n_burn, "cpu_count": os.cpu_count(), "trials": trials,
        "floor": FLOOR, "ceiling": 1.0, "gap": gap, "noise_band": NOISE_BAND,
        "expert_scores": [r["expert"]["score"] for r in runs],
        "reference_scores": [r["reference"]["score"] for r in runs],
        "candidate_scores": cand,
        "candidate_min": min(cand), "candidate_max": max(cand), "candidate_spread": max(cand) - min(cand),
        "candidate_std": statistics.pstdev(cand),
        "spread_below_gap": (max(cand) - min(cand)) < gap,
        "runs": runs, "seconds": round(time.perf_counter() - t0, 1),
        "loadavg_end": list(os.getloadavg()),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_speed_noise.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--burners", type=int, default=None, help="CPU-burning processes (default: one per core)")
    p.add_argument("--block", type=int, default=8, help="rows per block of the candidate")
    p.add_argument("--trials", type=int, default=TRIALS, help="timing trials per score (the reward's default)")
    p.add_argument("--isolation", default=None)
    a = p.parse_args(argv)
    if a.repeats < 1 or a.block < 1 or (a.burners is not None and a.burners < 0):
        p.error("--repeats and --block must be >= 1, --burners >= 0")
    res = run(Path(a.out), repeats=a.repeats, burners=a.burners, block=a.block, trials=a.trials,
              isolation=a.isolation)
    print(f"floor {res['floor']}  ceiling {res['ceiling']}  expert {min(res['expert_scores']):.3f}.."
          f"{max(res['expert_scores']):.3f}  reference {min(res['reference_scores']):.3f}.."
          f"{max(res['reference_scores']):.3f}")
    print(f"candidate over {res['repeats']} runs with {res['burners']} burners: {res['candidate_min']:.3f}.."
          f"{res['candidate_max']:.3f} (spread {res['candidate_spread']:.3f}, std {res['candidate_std']:.3f}) "
          f"vs gap {res['gap']:.2f}: {'below' if res['spread_below_gap'] else 'NOT below'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
