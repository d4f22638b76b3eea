"""Killing `accelerate launch` (even with SIGKILL) must not leave its ranks training:
each rank asks the kernel for SIGTERM when its launcher dies (mopd.distill.signals.follow_launcher)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")

RANK = textwrap.dedent("""
    import signal, sys, time
    from mopd.distill.signals import follow_launcher
    got = []
    signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    print("armed" if follow_launcher() else "not armed", flush=True)
    t = time.time()
    while not got and time.time() - t < 30:
        time.sleep(0.05)
    print("SIGTERM" if got else "orphan", flush=True)
""")

LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys
    env = dict(os.environ, LOCAL_RANK="0")
    p = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env, stdout=open(sys.argv[2], "w"))
    print(p.pid, flush=True)
    p.wait()
""")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_rank_gets_sigterm_when_its_launcher_is_killed(tmp_path):
    log = tmp_path / "rank.log"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, RANK, str(log)], stdout=subprocess.PIPE, text=True)
    rank_pid = int(launcher.stdout.readline())
    t = time.time()
    while "armed" not in (log.read_text() if log.exists() else "") and time.time() - t < 60:
        time.sleep(0.05)
    assert log.read_text().startswith("armed"), log.read_text()
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    t = time.time()
    while _pid_alive(rank_pid) and time.time() - t < 20:
        time.sleep(0.05)
    assert not _pid_alive(rank_pid), "the rank outlived its launcher"
    assert log.read_text().split() == ["armed", "SIGTERM"]


def test_outside_a_launcher_nothing_is_armed(monkeypatch):
    from mopd.distill.signals import follow_launcher

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert follow_launcher() is False
