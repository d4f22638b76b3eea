"""Who this process is in a launch: its rank, the world size, whether it is the main
process. Every entry point (mopd distill, the experts' SFT and RL, the baselines, mopd
eval) asks here, so one rank writes the lock, the MLflow run, the checkpoints and the
summary, and every rank reads its own shard.

Why not `accelerate.PartialState()`: under `accelerate launch --config_file
recipes/accelerate/cpu_ddp2.yaml` on a machine without a GPU (distributed_type MULTI_GPU,
torchrun's launcher, gloo), a bare `PartialState()` finds no GPU and answers "process 0
of 1, main" on every rank. Asked with `cpu=True` it sets up the gloo group and answers
right. PartialState is a process-wide singleton that keeps the first answer, so it must be
built here first, before transformers' TrainingArguments or TRL build theirs.

Before the process group is set up (a config error caught in the first second, a lock
taken before the heavy imports), the launcher's environment answers: torchrun and
`accelerate launch` set RANK / WORLD_SIZE / LOCAL_RANK in every rank."""
from __future__ import annotations

import os
import sys

_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_WORLD_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def _env_int(names: tuple[str, ...], default: int) -> int:
    for n in names:
        v = os.environ.get(n, "")
        if v.strip().isdigit():
            return int(v)
    return default


def launched() -> bool:
    """Whether a launcher started this process as one rank of several."""
    return _env_int(_WORLD_VARS, 1) > 1


def state():
    """The process-wide `accelerate.PartialState`, set up for this machine (on CPU with
    `cpu=True`, the only way it sees the launcher's ranks there)."""
    import torch
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def accelerator(**kw):
    """An `accelerate.Accelerator` on the same state (`cpu=True` without a GPU)."""
    import torch
    from accelerate import Accelerator

    state()   # the shared state first, so a later PartialState() anywhere agrees
    return Accelerator(cpu=not torch.cuda.is_available(), **kw)


def _initialized():
    from accelerate.state import PartialState

    return PartialState._shared_state != {}


def _from_state(attr: str):
    """The set-up state's answer, or None before (or after a failed) set-up: an error
    reported from inside it must not fail again here."""
    if "accelerate.state" not in sys.modules or not _initialized():
        return None
    try:
        return getattr(state(), attr)
    except Exception:  # noqa: BLE001 - the launcher's variables answer instead
        return None


def rank() -> int:
    """This process's global rank (0 without a launcher)."""
    r = _from_state("process_index")
    return _env_int(_RANK_VARS, 0) if r is None else r


def world_size() -> int:
    """How many processes the launch has (1 without a launcher)."""
    n = _from_state("num_processes")
    return _env_int(_WORLD_VARS, 1) if n is None else n


def is_main() -> bool:
    """Whether this is the rank that writes (rank 0; True without a launcher)."""
    return rank() == 0


def per_rank(total: int, what: str) -> int:
    """`total` rows of a global batch split evenly over the ranks, so that a step trains
    on the same rows whatever the number of processes; a total that does not split is a
    config error naming `what`."""
    n = world_size()
    if total % n:
        raise ValueError(f"{what} = {total} does not split over {n} processes: make it a multiple of {n} "
                         f"(it is the global batch, shared by the ranks)")
    return total // n


def gather(obj) -> list:
    """`obj` from every rank, in rank order (just [obj] without a launcher): each rank
    scores its own shard, rank 0 writes the whole."""
    if world_size() == 1:
        return [obj]
    import torch.distributed as dist

    state()   # the process group, if nothing set it up yet
    got: list = [None] * world_size()
    dist.all_gather_object(got, obj)
    return got


def barrier() -> None:
    """Wait for every rank (nothing without a launcher): rank 0 has written what the others read next."""
    if world_size() == 1:
        return
    import torch.distributed as dist

    state()
    dist.barrier()
