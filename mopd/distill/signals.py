"""How a run stops: SIGTERM / SIGINT finish the step and save a checkpoint
(`StopOnSignal`), and each rank of a launcher follows it when it dies (`follow_launcher`)."""
from __future__ import annotations

import os
import signal
import sys

import torch
from accelerate import Accelerator


def follow_launcher(signum: int = signal.SIGTERM) -> bool:
    """Under `accelerate launch` / torchrun (LOCAL_RANK set), ask the kernel to send
    `signum` to this rank when its launcher dies, so that killing the launcher (even with
    SIGKILL) stops every rank (SIGTERM: the step finishes and a checkpoint is saved)
    instead of leaving them training as orphans. Linux only; True when armed."""
    if "LOCAL_RANK" not in os.environ or not sys.platform.startswith("linux"):
        return False
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signum), 0, 0, 0) != 0:      # PR_SET_PDEATHSIG = 1
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:     # the launcher died before the request was in place
        os.kill(os.getpid(), signum)
    return True


class StopOnSignal:
    """SIGTERM (what a scheduler sends before preemption) and SIGINT (Ctrl-C) set a flag:
    the loop finishes its step, saves a checkpoint and exits with 128 + the signal's
    number (143, 130). A second signal stops at once. Before training started (`start`:
    models loading, the MLflow run opening) there is no step to finish and nothing to
    save: the first signal stops at once, and the caller marks its run KILLED. Only the
    main thread can install handlers; elsewhere (a thread of a caller) signals keep their
    default. `prefix` starts its messages ([mopd], [expert]). `at_once`: a loop that
    keeps no checkpoints (the experts' TRL stages) stops at once after the start too."""

    def __init__(self, prefix: str = "[mopd]", at_once: bool = False):
        self.signum: int | None = None
        self.started = False
        self.prefix, self.at_once = prefix, at_once
        self._old: dict = {}
        for s in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:
                pass

    def start(self):
        """Training starts: from now on a first signal finishes the step."""
        self.started = True

    def _handle(self, signum, frame):
        if not self.started or self.at_once:
            if self.signum is not None:   # already stopping: the caller's cleanup (ending the run) goes on
                return
            self.signum = signum
            when = ("during training: stopping now (this stage keeps no checkpoint)" if self.started else
                    "before training started: stopping now (no step to finish, nothing to save)")
            print(f"\n{self.prefix} {signal.Signals(signum).name} {when}", file=sys.stderr, flush=True)
            raise Interrupted(signum)
        if self.signum is not None:
            self.restore()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise Interrupted(signum)
        self.signum = signum
        print(f"\n{self.prefix} {signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
              f"(send it again to stop now)", file=sys.stderr)

    def requested(self, accelerator: Accelerator) -> bool:
        """Whether any rank got a signal (all ranks must stop at the same step)."""
        flag = self.signum is not None
        if accelerator.num_processes > 1:
            t = torch.tensor([float(flag)], device=accelerator.device)
            flag = accelerator.reduce(t, reduction="sum").item() > 0
            if flag and self.signum is None:
                self.signum = signal.SIGTERM
        return flag

    def restore(self):
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}


class Interrupted(SystemExit):
    """The run stopped on a signal (after saving a checkpoint); exit code 128 + signum."""

    def __init__(self, signum: int):
        super().__init__(128 + int(signum))
        self.signum = int(signum)
