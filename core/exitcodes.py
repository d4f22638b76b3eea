"""The exit codes of every `mopd` command, defined once, and how a fatal error becomes one.

    0    done
    1    an unexpected error (a bug, or a failure with no better code): the traceback is printed
    2    bad command line, recipe, data or teacher (fix the input and run again)
    3    a dependency unreachable: a teacher or sampler server, the MLflow tracking store, the
         sandbox or browser (the run's checkpoints are intact; resume when it is back)
    130  interrupted by Ctrl-C (SIGINT); 143 by SIGTERM (a training loop saves a checkpoint first)

A scheduler can tell a bad command line (2, do not retry) from a lost server (3, retry
later). An error class says it is a dependency's by deriving from `Unreachable`."""
from __future__ import annotations

import signal
import sys
import time
import traceback

from core import ranks

OK = 0
ERROR = 1
USAGE = 2
UNREACHABLE = 3
INTERRUPTED = 128 + signal.SIGINT     # 130
TERMINATED = 128 + signal.SIGTERM     # 143

# how long a rank other than 0 waits before saying an expected error itself (see report)
OTHER_RANKS_WAIT_S = 30.0


class Unreachable(Exception):
    """Mixed into the error classes of a dependency that cannot be reached or used (a
    server, a store, a container runtime): the commands exit with UNREACHABLE."""


def close_progress_bars() -> None:
    """Close the progress bars still on the terminal, so that what is printed next starts
    on its own line (a fatal error would otherwise be glued to the end of the bar)."""
    tqdm_mod = sys.modules.get("tqdm.std")
    if tqdm_mod is not None:
        for bar in list(getattr(tqdm_mod.tqdm, "_instances", ())):
            try:
                bar.close()
            except Exception:  # noqa: BLE001 - a half-built bar must not hide the error
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def code_for(e: BaseException) -> int:
    """The exit code of a fatal error `e` (see the module docstring)."""
    from core.config import ConfigError   # ConfigError is a ValueError; named for the reader

    if isinstance(e, SystemExit):
        return e.code if isinstance(e.code, int) else (ERROR if e.code else OK)
    if isinstance(e, KeyboardInterrupt):
        return INTERRUPTED
    if isinstance(e, Unreachable):
        return UNREACHABLE
    if isinstance(e, (ConfigError, ValueError)):
        return USAGE
    return ERROR


def report(e: BaseException, prog: str = "mopd") -> int:
    """Print the fatal error `e` on its own line (after closing the progress bars; with
    its traceback when unexpected) and return its exit code."""
    close_progress_bars()
    code = code_for(e)
    prefix = ""
    if code != ERROR and not ranks.is_main():
        # Under a launcher every rank meets the same bad input: rank 0 says it, once (a bug,
        # code 1, is printed by the rank it happened on). This rank may get there first, and
        # its exit makes the launcher stop rank 0 before it prints: it waits, to be stopped
        # when rank 0 fails too, and says it after all when the input was bad for it alone.
        if code == INTERRUPTED:
            return code
        time.sleep(OTHER_RANKS_WAIT_S)
        prefix = f"[rank {ranks.rank()}] "
    if code == INTERRUPTED:
        print(f"\n{prog}: interrupted", file=sys.stderr)
    elif code == ERROR:
        traceback.print_exception(e, file=sys.stderr)
        print(f"{prog}: error: {type(e).__name__}: {e}", file=sys.stderr)
    else:
        print(f"{prefix}{prog}: error: {e}", file=sys.stderr)
    sys.stderr.flush()
    return code
