"""`--dry-run` of every command (`mopd distill`, `expert`, `eval`; the pipeline has its
plan): what would run, and every problem at once, one line each, before any model loads.

A command's dry run fills one `DryRun`: `show` lines (the effective model path, the
teachers, quant, dtype, steps, processes) and `problem`s; `check(fn, ...)` runs one
check and turns the error it raises into a problem, so one bad path does not hide the
next. `finish` prints the lines (stdout) and the problems (stderr) and returns the exit
code: 0, or USAGE (2) when anything is wrong. The real runs call the same checks
(`raise_if_any`), so they refuse what the dry run names before loading anything.

`check_accelerate_config` reads an accelerate config file (`--accelerate-config`, what
`accelerate launch --config_file` would get) from its YAML alone: it exists, parses,
has only keys accelerate knows, and its process counts are sane.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Callable

import yaml

from core import exitcodes
from core.config import ConfigError

# accelerate's ClusterConfig fields (accelerate/commands/config/config_args.py; a test keeps
# this list equal to the installed accelerate's): read here without importing accelerate,
# which imports torch. An unknown key is a TypeError in `accelerate launch`.
ACCELERATE_KEYS = frozenset((
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug", "num_processes",
    "machine_rank", "num_machines", "gpu_ids", "main_process_ip", "main_process_port", "rdzv_backend",
    "same_network", "main_training_function", "enable_cpu_affinity", "fp8_config", "deepspeed_config",
    "fsdp_config", "parallelism_config", "megatron_lm_config", "mpirun_config", "downcast_bf16", "tpu_name",
    "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env",
    "dynamo_config"))
DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
                     "MULTI_HPU", "MULTI_XPU", "DEEPSPEED", "FSDP", "XLA", "MEGATRON_LM")
MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")


class DryRun:
    """What a dry run found: lines saying what would run, and problems (one line each)."""

    def __init__(self, command: str):
        self.command = command
        self.lines: list[str] = []
        self.problems: list[str] = []
        self.unreachable: list[BaseException] = []   # problems that are a dependency's (exit 3, not 2)
        self.t0 = time.perf_counter()

    def show(self, label: str, value) -> None:
        self.lines.append(f"  {label:<18s} {value}")

    def problem(self, msg: str) -> None:
        """One line per problem: a multi-line message (a list of them) is split."""
        for line in str(msg).splitlines():
            line = line.strip().removeprefix("- ").strip()
            if line and not line.endswith(":"):   # a list's header says nothing its lines do not
                self.problems.append(line)

    def check(self, fn: Callable, *args, **kwargs):
        """fn(*args, **kwargs), or None with its error recorded as a problem (bad input:
        ValueError, ConfigError, TeacherError; a file that cannot be read: OSError; a server
        or store that cannot be reached: exitcodes.Unreachable)."""
        try:
            return fn(*args, **kwargs)
        except (ValueError, OSError, exitcodes.Unreachable) as e:
            self.problem(str(e) or type(e).__name__)
            if isinstance(e, exitcodes.Unreachable):
                self.unreachable.append(e)
            return None

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def raise_if_any(self) -> None:
        """The real run's preflight: every problem in one ConfigError, before any model loads
        (a server or store that cannot be reached, when that is all: its own error, exit 3)."""
        if self.unreachable and len(self.unreachable) == len(self.problems):
            raise self.unreachable[0]
        if len(self.problems) == 1:
            raise ConfigError(self.problems[0])
        if self.problems:
            raise ConfigError(f"{len(self.problems)} problems before anything loads:\n"
                              + "\n".join(f"  {p}" for p in self.problems))

    def finish(self) -> int:
        print(f"{self.command}: nothing loaded or written", flush=True)
        for line in self.lines:
            print(line, flush=True)
        if self.problems:
            exitcodes.close_progress_bars()
            print(f"{len(self.problems)} problem(s) ({self.seconds:.1f} s):", file=sys.stderr)
            for p in self.problems:
                print(f"  {p}", file=sys.stderr, flush=True)
            return exitcodes.UNREACHABLE if len(self.unreachable) == len(self.problems) else exitcodes.USAGE
        print(f"ok ({self.seconds:.1f} s)", flush=True)
        return exitcodes.OK


def describe_quant(q) -> str:
    """A quant section as one short line: off, or its settings."""
    if q is None or not getattr(q, "enabled", False):
        return "off"
    d = dataclasses.asdict(q) if dataclasses.is_dataclass(q) else dict(vars(q))
    d.pop("enabled", None)
    return "on, " + ", ".join(f"{k} {v}" for k, v in d.items())


def check_accelerate_config(path: str | Path | None, dry: DryRun) -> int:
    """The number of processes `accelerate launch --config_file path` would start (when
    `path` is empty: this launch's WORLD_SIZE, else 1), each problem of the file recorded in `dry`."""
    if not path:
        import os

        world = os.environ.get("WORLD_SIZE", "")   # this process was started by a launcher
        if world.isdigit() and int(world) > 1:
            dry.show("processes", f"{world} (WORLD_SIZE of this launch)")
            return int(world)
        dry.show("processes", "1 (no accelerate config given: --accelerate-config FILE checks one)")
        return 1
    p = Path(path)
    where = f"accelerate config {p}"
    if not p.is_file():
        dry.problem(f"{where} does not exist" if not p.exists() else f"{where} is not a file")
        return 1
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        dry.problem(f"{where}: not valid YAML: {' '.join(str(e).split())}")
        return 1
    if not isinstance(data, dict):
        dry.problem(f"{where}: top level must be a mapping of accelerate's settings")
        return 1
    for key in sorted(set(data) - ACCELERATE_KEYS):
        import difflib

        near = difflib.get_close_matches(key, sorted(ACCELERATE_KEYS), n=1)
        dry.problem(f"{where}: unknown key {key!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
                    + ": accelerate launch would refuse it")

    def whole(key, default, low):
        v = data.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            dry.problem(f"{where}: {key} must be a whole number >= {low}, got {v!r}")
            return None
        return v
    n, machines, rank = whole("num_processes", 1, 1), whole("num_machines", 1, 1), whole("machine_rank", 0, 0)
    kind = str(data.get("distributed_type", "NO"))
    if kind not in DISTRIBUTED_TYPES:
        dry.problem(f"{where}: distributed_type {kind!r} is not one of {', '.join(DISTRIBUTED_TYPES)}")
    mp = str(data.get("mixed_precision", "no"))
    if mp not in MIXED_PRECISION:
        dry.problem(f"{where}: mixed_precision {mp!r} is not one of {', '.join(MIXED_PRECISION)}")
    if machines is not None and rank is not None and rank >= machines:
        dry.problem(f"{where}: machine_rank {rank} is not below num_machines {machines}")
    if n is not None and machines is not None and n % machines:
        dry.problem(f"{where}: num_processes {n} (all machines together) is not a multiple of num_machines "
                    f"{machines}")
    if n is not None and n > 1 and kind == "NO":
        dry.problem(f"{where}: num_processes {n} with distributed_type NO: one process would run; set "
                    f"distributed_type (MULTI_GPU, MULTI_CPU, FSDP)")
    dry.show("processes", f"{n or '?'} ({kind}, {machines or '?'} machine(s), mixed_precision {mp}) from {p}")
    return n or 1
