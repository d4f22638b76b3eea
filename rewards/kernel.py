"""Reward of the `kernel` domain: is the model's `kernel(*inputs)` right on fresh inputs,
how fast is it against the naive PyTorch reference and the expert kernel, and did it cheat?

Columns (from experts/kernel/data.py): `reference` (code defining `reference(...)`, the
correctness gate and the speed floor), `expert` (code defining `kernel(...)`, the speed
ceiling), `spec` (JSON: the inputs, their shapes and dtypes, below), `domain`.

Scores (documented in docs/experts.md, "The kernel reward"):
  -1.0  a cheat, with its reason logged (CHEATS below);
   0.0  no kernel, an exception, a wrong type / shape / dtype / device, any value outside
        tolerance on any call (the timed calls too), a timeout;
   FLOOR .. 1.0  correct: FLOOR at the reference's speed, 1.0 at the expert's speed,
        log-linear in between (score_of_speed), FLOOR * r below the reference's speed.

How a batch is scored (rewards/kernel_harness.py, a trusted sandbox program): one sandbox per chunk of
completions imports torch once, fixes one intra-op thread, then forks one child per
completion, sequentially (so the timings do not share the CPU with each other). The child
builds the reference and the expert from their code, captures every function it will use
later (clock, RNG, torch checks, builtins), snapshots the torch/time/os/builtins
namespaces and the global torch state, installs an audit hook of its own (frame and
object-graph introspection is denied and recorded) and the sandbox's, and only then runs
the completion's code, in a namespace holding `torch`, `math`, `F` (torch.nn.functional)
and a copy of builtins.

  correctness: one call per (shape, dtype) of the spec on fresh inputs, compared with the
      reference on the same inputs (torch.allclose, RTOL/ATOL per dtype);
  speed: WARMUP + TRIALS trials at the spec's timing shape (float32); in each trial CALLS
      fresh input sets, the reference, the expert and the candidate each run on all of
      them in a random order, each timed as one batch, every output checked afterwards.
      The clock is CPU time (captured before the candidate existed), so time spent
      preempted by other processes on a busy machine, the main noise of wall-clock time,
      is not counted; it is the whole process's (every thread, ended ones too) plus its
      waited-for children's, so work moved to a thread, an executor or a native pool is
      charged to the candidate. CPU time on other threads outside the candidate's calls is
      background_thread; processes are spawned_process (docs/experts.md, "Work off the
      timed thread").
      r_expert = median over trials of t_reference / t_expert; the candidate's r is its
      median ratio against whichever of the two is nearer in speed, times that one's r;
      the score is score_of_speed(r, r_expert).

Inputs come from a torch.Generator seeded from os.urandom per call, so an output computed
before the call (or recorded from an earlier one) cannot be right. The child reports to
its parent through a pipe, prefixed with a per-child secret token; anything else on that
pipe is a forged result.

Cheats (score CHEAT_SCORE, `reason` says which): called_reference (NameError on the
reference's name), introspection (sys._getframe, traceback/generator frames, gc walks,
tracing), patched_torch / patched_clock / patched_builtins (an attribute of torch, its
functional/special/linalg modules, torch.Tensor, time, os, math, random or builtins
replaced or removed, or anything but an imported submodule added there), global_state (threads, default dtype, grad or inference mode,
torch function/dispatch modes, ... changed), background_thread (a thread alive or working
after its call), spawned_process (fork, subprocess, exec, spawn), aliased_input (the output
shares memory with an input), mutated_input, lazy_result (a Tensor subclass, a
__torch_function__ object, a callable, generator or meta tensor instead of a tensor),
cached_output (the same object or storage as an earlier output), stored_output (the
output is reachable from the completion's own globals, defaults, closures: kept or
precomputed), replayed_output (the output equals an earlier call's expected output, not
this one's), benchmark_detected (right on the correctness calls, wrong on a timed call
of the same shape and dtype), forged_result (bytes on the result pipe not from the
harness).

Not covered (see the results page): the audit hook is not a boundary against a
determined attacker (docs/sandbox.md), torch's own raw-memory and operator-registration
APIs (torch.library) are not watched, and only CPU is supported (no CUDA/Triton yet).
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from core.completions import completion_text
from rewards.columns import column
from rewards.sandbox import Limits, check_isolation, run_python

log = logging.getLogger(__name__)

DOMAIN = "kernel"
FLOOR = 0.2            # the score of a correct kernel exactly as fast as the reference
CHEAT_SCORE = -1.0
NOISE_BAND = 0.5       # speed ratios within a factor 1 + NOISE_BAND count as equal (docs)
TRIALS = 21
WARMUP = 2
CALLS = 8              # input sets per timed batch
MAX_COMPLETION_CHARS = 8_000
CHUNK = 32             # completions per sandbox (one torch import each)
MAX_WORKERS = 1        # sandboxes at once; more share the CPU and add timing noise
RTOL = {"float32": 1e-4, "float64": 1e-7}
ATOL = {"float32": 1e-4, "float64": 1e-7}

WRONG = ("no_kernel", "exec_error", "not_callable", "exception", "wrong_type", "wrong_shape", "wrong_dtype",
         "wrong_device", "wrong_layout", "requires_grad", "mismatch", "timeout", "crashed")
CHEATS = ("called_reference", "introspection", "patched_torch", "patched_clock", "patched_builtins",
          "global_state", "background_thread", "spawned_process", "aliased_input", "mutated_input", "lazy_result",
          "cached_output", "stored_output", "replayed_output", "benchmark_detected", "forged_result")


def score_of_speed(r: float, r_expert: float, floor: float = FLOOR, band: float = NOISE_BAND) -> float:
    """The score of a correct kernel with speed-up `r` over the reference when the expert's
    is `r_expert`: FLOOR at r = 1, 1.0 at r = r_expert, linear in log r in between, with a
    dead band of a factor (1 + band) at both ends so that timing noise of that size moves
    neither the reference off the floor nor the expert off 1.0; FLOOR * r * (1 + band)
    below the reference's speed. Monotone non-decreasing in r."""
    if not (r > 0 and math.isfinite(r)):
        return 0.0
    lo = math.log1p(band)
    if math.log(r) < -lo:
        return floor * min(1.0, r * (1.0 + band))
    hi = math.log(max(r_expert, 1e-9)) - lo
    if hi <= lo:   # the expert is not measurably faster than the reference here
        return 1.0 if math.log(r) >= hi else floor
    u = (math.log(r) - lo) / (hi - lo)
    return floor + (1.0 - floor) * min(1.0, max(0.0, u))


# ------------------------------------------------------------------ in-sandbox harness
# rewards/kernel_harness.py, run as a trusted sandbox program (its source is handed over:
# the sandbox's root may not hold this package's files).
HARNESS = (Path(__file__).resolve().parent / "kernel_harness.py").read_text(encoding="utf-8")
KNOWN = WRONG + CHEATS + ("expert_failed", "harness_error")   # the verdicts a result may carry


# ------------------------------------------------------------------------ host side

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\r?\n(.*?)(?:```|\Z)", re.S | re.I)
_DEFINES = re.compile(r"^(?:def[ \t]+kernel[ \t]*\(|kernel[ \t]*=)", re.M)


def extract_code(text: str) -> str | None:
    """The completion's kernel code: the first fenced block that defines `kernel`, else the
    whole text if it does; None when there is none."""
    for block in _FENCE.findall(text) if "```" in text else ():
        if _DEFINES.search(block):
            return block
    return text if _DEFINES.search(text) else None


@dataclass(frozen=True)
class Job:
    code: str
    reference: str
    expert: str
    spec: dict


def _import_paths() -> tuple[str, ...]:
    """Where torch is installed (put on the sandbox's sys.path, read-only)."""
    import torch  # only for its location; the host never runs model code with it
    return (os.path.dirname(os.path.dirname(os.path.realpath(torch.__file__))),)


def run_jobs(jobs: list[Job], *, isolation: str | None = None, trials: int = TRIALS, warmup: int = WARMUP,
             calls: int = CALLS, timeout_s: float = 20.0, memory_mb: int = 4096) -> list[dict]:
    """Run `jobs` in one sandbox, one forked child each, in order; one result dict each
    ({"reason", "detail", "r", "r_expert", "t_ref_us", "t_exp_us", "t_cand_us"})."""
    if not jobs:
        return []
    token = secrets.token_hex(16)
    # timeout_s is CPU time per completion (an infinite loop dies after it however busy the
    # machine is); the wall-clock limit, for hangs that use no CPU, is three times that
    settings = {"trials": int(trials), "warmup": int(warmup), "calls": int(calls), "wall_s": 3 * float(timeout_s) + 2,
                "cpu_s": max(1, round(float(timeout_s))), "rtol": RTOL, "atol": ATOL, "known": list(KNOWN)}
    payload = json.dumps({"token": token, "settings": settings,
                          "jobs": [{"code": j.code, "reference": j.reference, "expert": j.expert, "spec": j.spec}
                                   for j in jobs]})
    # the torch import (~2 s on a loaded machine) plus each job's own limit
    limits = Limits(wall_s=60.0 + len(jobs) * (3 * float(timeout_s) + 3.0), cpu_s=60 + len(jobs) * (round(float(timeout_s)) + 1),
                    memory_mb=int(memory_mb), total_memory_mb=max(2048, int(memory_mb)), nproc=64, nofile=256)
    res = run_python(HARNESS, trusted=True, stdin=payload, limits=limits, isolation=isolation,
                     import_paths=_import_paths())
    if res.result.startswith(token.encode()):
        out = json.loads(res.result[len(token):].decode())
        if isinstance(out, list) and len(out) == len(jobs):
            return out
    if res.reason == "setup_failed":
        probe = run_python("print('ok')", isolation=isolation, limits=Limits(wall_s=20))
        if probe.reason == "setup_failed":
            raise RuntimeError(f"rewards.kernel: the sandbox ({isolation}) could not be built: {probe.stderr[-500:]}")
    raise RuntimeError(f"rewards.kernel: the harness failed ({res.reason}): {res.stderr[-1500:]}")


def score_result(r: dict) -> float:
    """The reward of one harness result (module docstring)."""
    reason = r.get("reason")
    if reason == "ok":
        return score_of_speed(float(r["r"]), float(r["r_expert"]))
    if reason in CHEATS:
        return CHEAT_SCORE
    return 0.0


def _column(columns: dict, name: str, n: int):
    return column(columns, name, n, "rewards.kernel")


def score_kernels(prompts, completions, *, isolation: str | None = None, max_workers: int = MAX_WORKERS,
                  chunk: int = CHUNK, trials: int = TRIALS, warmup: int = WARMUP, calls: int = CALLS,
                  timeout_s: float = 20.0, **columns) -> list[dict | None]:
    """Per completion: None (another domain's row) or {"score", "reason", "detail", "r",
    "r_expert", "t_ref_us", "t_exp_us", "t_cand_us"}; `reward` returns the scores."""
    completions = list(completions)
    n = len(completions)
    domains = _column(columns, "domain", n) or [None] * n
    refs, experts, specs = (_column(columns, c, n) for c in ("reference", "expert", "spec"))
    out: list[dict | None] = [None] * n
    jobs: list[tuple[int, Job]] = []
    for i in range(n):
        if domains[i] is not None and domains[i] != DOMAIN:
            continue
        if refs is None or experts is None or specs is None or not refs[i] or not experts[i] or not specs[i]:
            raise ValueError(f"rewards.kernel: row {i} has no `reference` / `expert` / `spec` (kernel rows need all three)")
        spec = json.loads(specs[i]) if isinstance(specs[i], str) else specs[i]
        for key in ("args", "shapes", "dtypes", "time"):
            if key not in spec:
                raise ValueError(f"rewards.kernel: row {i}: spec has no {key!r}")
        text = completion_text(completions[i])
        code = extract_code(text) if text and len(text) <= MAX_COMPLETION_CHARS and "\x00" not in text else None
        if code is None:
            out[i] = {"score": 0.0, "reason": "no_kernel", "detail": ""}
            continue
        jobs.append((i, Job(code, refs[i], experts[i], spec)))
    if not jobs:
        return out
    isolation = check_isolation(isolation)
    chunk = max(1, int(chunk))
    parts = [jobs[s:s + chunk] for s in range(0, len(jobs), chunk)]

    def run(part):
        return part, run_jobs([j for _, j in part], isolation=isolation, trials=int(trials), warmup=int(warmup),
                              calls=int(calls), timeout_s=float(timeout_s))

    max_workers = int(max_workers)
    if len(parts) == 1 or max_workers <= 1:
        done = [run(p) for p in parts]
    else:
        with ThreadPoolExecutor(max_workers=min(max_workers, len(parts))) as pool:
            done = list(pool.map(run, parts))
    for part, results in done:
        for (i, _), r in zip(part, results):
            if r.get("reason") in ("expert_failed", "harness_error"):
                raise RuntimeError(f"rewards.kernel: row {i}: the task's own expert or reference failed "
                                   f"({r.get('reason')}: {r.get('detail')}): a broken task row")
            s = score_result(r)
            out[i] = {"score": s, **r}
            if s < 0:
                log.warning("rewards.kernel: row %d cheats: %s (%s)", i, r.get("reason"), r.get("detail"))
            elif r.get("reason") != "ok":
                log.info("rewards.kernel: row %d scores 0: %s (%s)", i, r.get("reason"), r.get("detail"))
    return out


def reward(prompts, completions, *, isolation: str | None = None, max_workers: int = MAX_WORKERS,
           chunk: int = CHUNK, trials: int = TRIALS, warmup: int = WARMUP, calls: int = CALLS,
           timeout_s: float = 20.0, **columns) -> list[float | None]:
    """CHEAT_SCORE for a cheat, 0.0 for a wrong or failing kernel, FLOOR..1.0 for a correct
    one by its speed between the reference's and the expert's; None for rows of another
    domain (module docstring). timeout_s: CPU seconds per completion (wall: 3x + 2)."""
    completions = list(completions)
    res = score_kernels(prompts, completions, isolation=isolation, max_workers=max_workers, chunk=chunk,
                        trials=trials, warmup=warmup, calls=calls, timeout_s=timeout_s, **columns)
    return [None if r is None else float(r["score"]) for r in res]


def _preflight(*, isolation: str | None = None, **_kwargs) -> None:
    """Before any model loads: a bad or missing sandbox isolation is an error now."""
    check_isolation(isolation)


reward.preflight = _preflight
