"""Reward of the `kernel` domain: is the model's `kernel(*inputs)` right on fresh inputs,
how fast is it against the naive PyTorch reference and the expert kernel, and did it cheat?

Columns (from experts/kernel/data.py): `reference` (code defining `reference(...)`, the
correctness gate and the speed floor), `expert` (code defining `kernel(...)`, the comparison:
timed in the same trials, reported as a fraction of the speed of light), `spec` (JSON: the
inputs, their shapes and dtypes, the timing shape and `sol`, below), `domain`.

Scores (documented in docs/experts.md, "The kernel reward"):
   0.0  a cheat the harness catches, named in `reason` and logged as a warning (CHEATS
        below): a cheat earns nothing, like a wrong kernel, and is told apart from one by
        its reason (until issue 45 it scored -1);
   0.0  no kernel, an exception, a wrong type / shape / dtype / device, any value outside
        tolerance on any call (the timed calls too), a timeout;
   0.0  a time clearly below the task's speed of light (`below_speed_of_light`, logged as a
        cheat: no honest kernel is faster than the machine's peaks allow, so the output was
        cached, looked up or computed where the clock does not see it);
   FLOOR .. 1.0  correct: FLOOR at the reference's speed, 1.0 at the speed of light,
        log-linear in between (score_of_speed), FLOOR * r below the reference's speed.
        The expert is no cap: it is timed in the same trials and reported as a fraction of
        the speed of light (`frac_sol_expert`); a kernel faster than it scores more.

The speed of light of a task is max(bytes / peak bandwidth, FLOPs / peak compute): the
sizes are the spec's `sol` ({"bytes", "flops"} at the timing shape, experts/kernel/data.py
Task.sol), the peaks this machine's, measured once by a calibration in the harness's own
conditions (rewards/kernel_calibrate.py, machine_peaks) and cached per machine in
$MOPD_CACHE_DIR/kernel_peaks.json (default ~/.cache/mopd), logged as params of the active
MLflow run. With r_sol = t_reference / t_sol, the score of a correct kernel with speed-up
r is score_of_speed(r, r_sol); r > SOL_MARGIN * r_sol is `below_speed_of_light`.

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
      the score is score_of_speed(r, r_sol), r_sol = t_reference (median per call) / t_sol.

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
cached_output (the same object or storage as an earlier output), below_speed_of_light (faster
than the machine allows), stored_output (the
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
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from core.completions import completion_text
from rewards.columns import column
from rewards.sandbox import Limits, check_isolation, run_python

log = logging.getLogger(__name__)

DOMAIN = "kernel"
FLOOR = 0.2            # the score of a correct kernel exactly as fast as the reference
# Every cheat scores 0, what a wrong kernel scores (issue 45: "scores zero and is named"):
# the reason tells them apart in the logs and the eval's report, not the reward's sign.
CHEAT_SCORE = 0.0
NOISE_BAND = 0.5       # speed ratios within a factor 1 + NOISE_BAND count as equal (docs)
# A time below t_sol / SOL_MARGIN is `below_speed_of_light`. The margin is beyond the noise:
# a kernel's measured speed-up moves by less than the factor NOISE_BAND between calls on a
# busy machine (docs/results/2026-12-02-kernel-verifier.md), and the peaks are the best of
# several trials, so an honest kernel's time can only err above the speed of light.
SOL_MARGIN = 2.0
SOL_CHEAT, SOL_CHEAT_SCORE = "below_speed_of_light", CHEAT_SCORE
CALIBRATION_TRIALS = 5
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
          "cached_output", "stored_output", "replayed_output", "benchmark_detected", "forged_result", SOL_CHEAT)


def score_of_speed(r: float, r_sol: float, floor: float = FLOOR, band: float = NOISE_BAND) -> float:
    """The score of a correct kernel with speed-up `r` over the reference when the speed of
    light's is `r_sol` (t_reference / t_sol): FLOOR at r = 1, 1.0 at r = r_sol, linear in
    log r in between, with a dead band of a factor (1 + band) at both ends so that timing
    noise of that size moves neither the reference off the floor nor a kernel at the
    physical limit off 1.0; FLOOR * r * (1 + band) below the reference's speed. Monotone
    non-decreasing in r (the expert's speed plays no part: a faster kernel scores more)."""
    if not (r > 0 and math.isfinite(r)):
        return 0.0
    lo = math.log1p(band)
    if math.log(r) < -lo:
        return floor * min(1.0, r * (1.0 + band))
    hi = math.log(max(r_sol, 1e-9)) - lo
    if hi <= lo:   # the speed of light is not measurably faster than the reference
        return 1.0 if math.log(r) >= hi else floor
    u = (math.log(r) - lo) / (hi - lo)
    return floor + (1.0 - floor) * min(1.0, max(0.0, u))


# ------------------------------------------------------------------ speed of light

def sol_problem(spec) -> str | None:
    """What is wrong with a kernel row's `spec` for its speed of light; None when its `sol`
    sizes are there. Checked on a team's files before any model loads (experts/kernel/data.py
    check_row, through experts/files.py) and here, per row."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            return f"column 'spec' is not JSON ({e})"
    sol = spec.get("sol") if isinstance(spec, dict) else None
    if not isinstance(sol, dict):
        return ("spec has no 'sol': the bytes the op must move and the FLOPs it must do at the timing shape "
                "(float32), which the kernel reward's speed of light needs; add "
                '"sol": {"bytes": <int>, "flops": <int>} to every row\'s spec (experts/kernel/data.py Task.sol '
                "computes them for the built-in ops)")
    bad = [k for k in ("bytes", "flops") if isinstance(sol.get(k), bool) or not isinstance(sol.get(k), (int, float))
           or not sol[k] >= 0]
    if bad or not sol["bytes"] + sol["flops"] > 0:
        return f'spec.sol must be {{"bytes": <number >= 0>, "flops": <number >= 0>}}, not both 0; got {json.dumps(sol)[:120]}'
    return None


@dataclass(frozen=True)
class Peaks:
    """This machine's peak memory bandwidth and compute in the harness's conditions."""
    bytes_per_s: float
    flops_per_s: float
    key: str = ""                 # the machine it was measured on (machine_key)
    source: str = ""              # "measured", the cache file it came from, or "given"
    detail: dict = field(default_factory=dict, compare=False)   # which size / op gave each peak

    def sol_us(self, sol: dict) -> float:
        """The speed of light of a task's `sol` sizes, in microseconds."""
        return 1e6 * max(float(sol["bytes"]) / self.bytes_per_s, float(sol["flops"]) / self.flops_per_s)

    def params(self) -> dict[str, str]:
        return {"kernel.peak_bytes_per_s": f"{self.bytes_per_s:.4g}", "kernel.peak_flops_per_s": f"{self.flops_per_s:.4g}",
                "kernel.peaks_machine": self.key[:250], "kernel.peaks_source": self.source[:250]}


def machine_key(isolation: str) -> str:
    """What the peaks depend on: the CPU model, its core count, torch's version, the
    harness's one thread, the sandbox mode and the calibration program itself."""
    import torch   # only its version

    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith(("model name", "Model"))), "")
    except OSError:
        pass
    import hashlib
    import platform
    calibration = hashlib.sha256(CALIBRATION.encode()).hexdigest()[:8]   # a changed calibration measures again
    return f"{model or platform.processor() or platform.machine()}|cpus={os.cpu_count()}|threads=1|" \
           f"torch={torch.__version__}|isolation={isolation}|calibration={calibration}"


def peaks_cache() -> Path:
    """$MOPD_CACHE_DIR/kernel_peaks.json, default ~/.cache/mopd/kernel_peaks.json."""
    return Path(os.environ.get("MOPD_CACHE_DIR") or Path.home() / ".cache" / "mopd") / "kernel_peaks.json"


CALIBRATION = (Path(__file__).resolve().parent / "kernel_calibrate.py").read_text(encoding="utf-8")


def calibrate(isolation: str, trials: int = CALIBRATION_TRIALS) -> dict:
    """Run rewards/kernel_calibrate.py in the sandbox: {"bytes_per_s", "flops_per_s", ...}."""
    token = secrets.token_hex(16)
    res = run_python(CALIBRATION, trusted=True, stdin=json.dumps({"token": token, "trials": int(trials)}),
                     limits=Limits(wall_s=300.0, cpu_s=240, memory_mb=2048, total_memory_mb=2048, nproc=64, nofile=256),
                     isolation=isolation, import_paths=_import_paths())
    if res.result.startswith(token.encode()):
        out = json.loads(res.result[len(token):].decode())
        if out.get("bytes_per_s", 0) > 0 and out.get("flops_per_s", 0) > 0:
            return out
    raise RuntimeError(f"rewards.kernel: the calibration of this machine's peaks failed ({res.reason}): "
                       f"{res.stderr[-1500:]}")


_PEAKS: dict[tuple[str, str], Peaks] = {}


def machine_peaks(isolation: str | None = None, *, cache: str | Path | None = None, refresh: bool = False) -> Peaks:
    """This machine's peaks: from the cache file when it holds this machine's key, else
    measured (calibrate) and written there; once per process."""
    isolation = check_isolation(isolation)
    key, path = machine_key(isolation), Path(cache) if cache else peaks_cache()
    if not refresh and (key, str(path)) in _PEAKS:
        return _PEAKS[(key, str(path))]
    try:
        table = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        table = {}   # unreadable: measured again and rewritten
    table = table if isinstance(table, dict) else {}
    got = table.get(key)
    if refresh or not (isinstance(got, dict) and got.get("bytes_per_s", 0) > 0 and got.get("flops_per_s", 0) > 0):
        log.info("rewards.kernel: measuring this machine's peak bandwidth and compute (once; cached in %s)", path)
        got = calibrate(isolation)
        table[key] = got
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1))
            tmp.replace(path)
        except OSError as e:
            log.warning("rewards.kernel: could not cache the peaks in %s (%s): measured again next time", path, e)
        source = "measured"
    else:
        source = str(path)
    peaks = Peaks(float(got["bytes_per_s"]), float(got["flops_per_s"]), key, source,
                  {k: v for k, v in got.items() if k not in ("bytes_per_s", "flops_per_s")})
    _PEAKS[(key, str(path))] = peaks
    return peaks


def parse_peaks(peaks) -> Peaks | None:
    """The `peaks` reward setting: None (measure), a Peaks, or "BYTES_PER_S,FLOPS_PER_S"."""
    if peaks is None or isinstance(peaks, Peaks):
        return peaks
    try:
        b, f = (float(x) for x in str(peaks).split(","))
    except ValueError:
        b = f = 0.0
    if not (b > 0 and f > 0 and math.isfinite(b) and math.isfinite(f)):
        raise ValueError(f"rewards.kernel: peaks={peaks!r} must be 'BYTES_PER_S,FLOPS_PER_S' (two positive numbers, "
                         f"e.g. 2e10,5e10), or unset to measure this machine")
    return Peaks(b, f, "given", "given")


_RECORDED: set[tuple[str, str]] = set()


def record_peaks(peaks: Peaks) -> None:
    """The peaks as params of the active MLflow run (once per run), if there is one."""
    mlflow = sys.modules.get("mlflow")   # not imported: no run can be active
    run = mlflow.active_run() if mlflow is not None else None
    if run is None or (run.info.run_id, peaks.key) in _RECORDED:
        return
    _RECORDED.add((run.info.run_id, peaks.key))
    try:
        mlflow.log_params(peaks.params())
    except Exception as e:   # e.g. a param logged before with another value: the run keeps the first
        log.warning("rewards.kernel: could not log the peaks to MLflow (%s)", e)


def judge(res: dict, sol: dict, peaks: Peaks) -> dict:
    """A harness result with its speed of light and its score: adds sol_us, r_sol,
    frac_sol (the candidate's speed as a fraction of the speed of light), frac_sol_expert,
    score; a time below t_sol / SOL_MARGIN becomes `below_speed_of_light`."""
    out = dict(res)
    if res.get("reason") != "ok":
        out["score"] = score_result(res)
        return out
    t_sol, t_ref = peaks.sol_us(sol), float(res["t_ref_us"])
    r_sol = t_ref / t_sol if t_sol > 0 else math.inf
    r, r_exp = float(res["r"]), float(res["r_expert"])
    out.update(sol_us=t_sol, r_sol=r_sol, frac_sol=r / r_sol, frac_sol_expert=r_exp / r_sol)
    if r_exp > SOL_MARGIN * r_sol or r_sol < 1.0 / SOL_MARGIN:
        raise RuntimeError(
            f"rewards.kernel: the task's own {'expert' if r_exp > SOL_MARGIN * r_sol else 'reference'} runs faster "
            f"than its speed of light ({t_ref / max(r_exp, 1e-12):.3g} us expert, {t_ref:.3g} us reference, speed of "
            f"light {t_sol:.3g} us from spec.sol {sol} and peaks {peaks.bytes_per_s:.3g} B/s, {peaks.flops_per_s:.3g} "
            f"FLOP/s ({peaks.source})): the row's spec.sol is too large or the peaks are stale; fix the row or delete "
            f"{peaks_cache()} to measure again")
    if r > SOL_MARGIN * r_sol:
        out.update(reason=SOL_CHEAT, score=SOL_CHEAT_SCORE,
                   detail=f"{t_ref / r:.3g} us per call, under the speed of light {t_sol:.3g} us / {SOL_MARGIN:g}")
    else:
        out["score"] = score_of_speed(r, r_sol)
    return out


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
    """The reward of one harness result that is not "ok" (those: judge)."""
    reason = r.get("reason")
    if reason == "ok":
        raise ValueError("rewards.kernel: an 'ok' result is scored against its speed of light: judge()")
    if reason in CHEATS:
        return CHEAT_SCORE
    return 0.0


def _column(columns: dict, name: str, n: int):
    return column(columns, name, n, "rewards.kernel")


def score_kernels(prompts, completions, *, isolation: str | None = None, max_workers: int = MAX_WORKERS,
                  chunk: int = CHUNK, trials: int = TRIALS, warmup: int = WARMUP, calls: int = CALLS,
                  timeout_s: float = 20.0, peaks: Peaks | str | None = None, **columns) -> list[dict | None]:
    """Per completion: None (another domain's row) or {"score", "reason", "detail", "r",
    "r_expert", "t_ref_us", "t_exp_us", "t_cand_us"}, with, for a correct kernel, "sol_us",
    "r_sol", "frac_sol" and "frac_sol_expert" (judge); `reward` returns the scores.
    peaks: this machine's (machine_peaks) unless given (parse_peaks)."""
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
        problem = sol_problem(spec)
        if problem:
            raise ValueError(f"rewards.kernel: row {i}: {problem}")
        text = completion_text(completions[i])
        code = extract_code(text) if text and len(text) <= MAX_COMPLETION_CHARS and "\x00" not in text else None
        if code is None:
            out[i] = {"score": 0.0, "reason": "no_kernel", "detail": ""}
            continue
        jobs.append((i, Job(code, refs[i], experts[i], spec)))
    if not jobs:
        return out
    isolation = check_isolation(isolation)
    peaks = parse_peaks(peaks) or machine_peaks(isolation)
    record_peaks(peaks)
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
        for (i, job), r in zip(part, results):
            if r.get("reason") in ("expert_failed", "harness_error"):
                raise RuntimeError(f"rewards.kernel: row {i}: the task's own expert or reference failed "
                                   f"({r.get('reason')}: {r.get('detail')}): a broken task row")
            out[i] = r = judge(r, job.spec["sol"], peaks)
            if r.get("reason") in CHEATS:
                log.warning("rewards.kernel: row %d cheats: %s (%s)", i, r.get("reason"), r.get("detail"))
            elif r.get("reason") != "ok":
                log.info("rewards.kernel: row %d scores 0: %s (%s)", i, r.get("reason"), r.get("detail"))
    return out


def reward(prompts, completions, *, isolation: str | None = None, max_workers: int = MAX_WORKERS,
           chunk: int = CHUNK, trials: int = TRIALS, warmup: int = WARMUP, calls: int = CALLS,
           timeout_s: float = 20.0, peaks: str | None = None, **columns) -> list[float | None]:
    """0.0 for a cheat (CHEAT_SCORE; its reason is logged), a wrong or failing kernel or one
    below the speed of light, FLOOR..1.0 for a correct one by its speed between the reference's and the speed
    of light; None for rows of another domain (module docstring). timeout_s: CPU seconds per
    completion (wall: 3x + 2). peaks: 'BYTES_PER_S,FLOPS_PER_S' instead of this machine's
    measured (cached) peaks."""
    completions = list(completions)
    res = score_kernels(prompts, completions, isolation=isolation, max_workers=max_workers, chunk=chunk,
                        trials=trials, warmup=warmup, calls=calls, timeout_s=timeout_s, peaks=peaks, **columns)
    return [None if r is None else float(r["score"]) for r in res]


def _preflight(*, isolation: str | None = None, peaks: str | None = None, **_kwargs) -> None:
    """Before any model loads: a bad or missing sandbox isolation, or a malformed `peaks`
    setting, is an error now."""
    check_isolation(isolation)
    parse_peaks(peaks)


reward.preflight = _preflight
