"""rewards/sandbox.py when its host dies outright (SIGKILL, an OOM kill): no process of a
sandbox outlives the host (PR_SET_PDEATHSIG along the whole chain, including the moments
before it is armed), and the run folders such hosts leave in the temp dir are removed by
the next process's first run, never a live process's folder, never through a symlink.

Safety: every process the tests look for carries MOPD_SANDBOX_RUN=<host pid>- in its
environment (set by the sandbox), and whatever a failing test leaves is SIGKILLed by that
tag. Waits are polls against generous deadlines; nothing asserts how fast things happen."""
from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rewards import sandbox
from rewards.sandbox import Limits, available_isolations, run_python

REPO = Path(__file__).resolve().parents[3]
MODES = sorted(set(available_isolations()) | {"none"})
DEADLINE_S = 60.0

# What the sandboxed program does while its host is killed; each process of it prints
# "ready" first (to the run's stdout file, on the host), so that a program that failed
# early cannot pass a test by having nothing left to kill. "fork": a trusted harness's
# shape (rewards/code.py): a forked child locks itself down and sleeps, so does the parent.
# "unarmed": a program that got past the audit hook (here: trusted code, before it) and
# cleared its own death signal.
READY = "print('ready', flush=True)\n"
PROGRAMS = {
    "sleep": (READY + "import time\ntime.sleep(300)\n", False, 1),
    "loop": (READY + "while True:\n    pass\n", False, 1),
    "fork": ("import os, time\n"
             "if os.fork() == 0:\n"
             "    sandbox_lockdown()\n"
             "    print('ready', flush=True)\n"
             "    time.sleep(300)\n"
             "    os._exit(0)\n"
             "sandbox_lockdown()\n" + READY +
             "time.sleep(300)\n", True, 2),
    "unarmed": ("import ctypes, time\n"
                "prctl = ctypes.CDLL(None).prctl\n"
                "prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4\n"
                "assert prctl(1, 0, 0, 0, 0) == 0\n"   # PR_SET_PDEATHSIG: none
                "sandbox_lockdown()\n" + READY +
                "time.sleep(300)\n", True, 1),
}

_HOST = textwrap.dedent("""
    import sys, time
    from concurrent.futures import ThreadPoolExecutor
    from rewards.sandbox import Limits, run_python
    mode, src, trusted, pooled = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1"

    def go():
        return run_python(src, isolation=mode, trusted=trusted, limits=Limits(wall_s=600, cpu_s=600))

    if pooled:   # the way rewards/workspace.py and the evals run episodes
        ThreadPoolExecutor(max_workers=2).submit(go)
        time.sleep(600)
    else:
        go()
""")


def _host(tmp: Path, mode: str, program: str, pooled: bool = False) -> subprocess.Popen:
    src, trusted, _ = PROGRAMS[program]
    tmp.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp)}
    return subprocess.Popen([sys.executable, "-c", _HOST, mode, src, "1" if trusted else "0", "1" if pooled else "0"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _tagged(host_pid: int) -> dict[int, bytes]:
    """{pid: cmdline} of the live processes of `host_pid`'s sandboxes (zombies have no
    environment left to read: they are dead already)."""
    tag = f"MOPD_SANDBOX_RUN={host_pid}-".encode()
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if not any(v.startswith(tag) for v in f.read().split(b"\0")):
                        continue
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    out[int(name)] = f.read()
            except OSError:
                pass
    return out


def _ready(tmp: Path, host_pid: int) -> int:
    """How many of the host's sandboxed processes said they are ready (the run folder's
    stdout file, which the host reads once the run is over)."""
    n = 0
    for out in tmp.glob(f"{sandbox.RUN_DIR_PREFIX}{host_pid}-*/stdout"):
        try:
            n += out.read_text().count("ready")
        except OSError:
            pass
    return n


def _wait_for(cond, what: str, host: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        if host is not None and host.poll() is not None:
            pytest.fail(f"the host ended before {what}: {host.stdout.read().decode(errors='replace')[-2000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.05)


def _kill_leftovers(host_pid: int) -> None:
    for pid in _tagged(host_pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _kill_host(host: subprocess.Popen) -> None:
    host.kill()
    assert host.wait(timeout=DEADLINE_S) == -signal.SIGKILL


# ------------------------------------------------------------------ processes

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_nothing_outlives_a_killed_host(mode, program, tmp_path):
    host = _host(tmp_path / "tmp", mode, program)
    try:
        want = PROGRAMS[program][2]
        _wait_for(lambda: _ready(tmp_path / "tmp", host.pid) >= want, "the program to run", host)
        _kill_host(host)
        _wait_for(lambda: not _tagged(host.pid), "the sandbox's processes to die with their host")
    finally:
        host.kill()
        host.wait()
        _kill_leftovers(host.pid)


@pytest.mark.parametrize("mode", MODES)
def test_nothing_outlives_a_host_killed_while_building_the_sandbox(mode, tmp_path):
    """The host dies as soon as the bootstrap exists, wherever its setup is: each process
    either had its death signal armed in time or sees its parent gone right after."""
    host = _host(tmp_path / "tmp", mode, "sleep")
    try:
        _wait_for(lambda: bool(_tagged(host.pid)), "the bootstrap to start", host)
        _kill_host(host)
        _wait_for(lambda: not _tagged(host.pid), "the sandbox's processes to die with their host")
    finally:
        host.kill()
        host.wait()
        _kill_leftovers(host.pid)


@pytest.mark.parametrize("mode", MODES)
def test_nothing_outlives_a_killed_host_that_ran_it_from_a_thread_pool(mode, tmp_path):
    host = _host(tmp_path / "tmp", mode, "sleep", pooled=True)
    try:
        _wait_for(lambda: _ready(tmp_path / "tmp", host.pid) >= 1, "the program to run", host)
        _kill_host(host)
        _wait_for(lambda: not _tagged(host.pid), "the sandbox's processes to die with their host")
    finally:
        host.kill()
        host.wait()
        _kill_leftovers(host.pid)


@pytest.mark.parametrize("mode", MODES)
def test_runs_from_pool_workers_are_not_cut_short(mode):
    """The death signal follows the thread that started the bootstrap, which waits for it:
    runs made from pool workers finish normally."""
    src = "import time\ntime.sleep(0.5)\nprint('done')"

    def one(_):
        return run_python(src, isolation=mode, limits=Limits(wall_s=30))

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(one, range(4)))
    assert all(r.ok and r.stdout == "done\n" for r in results), [(r.reason, r.stderr[-300:]) for r in results]


def test_bootstrap_exits_when_its_host_is_already_gone(monkeypatch):
    """The race PR_SET_PDEATHSIG alone misses: the host died before the bootstrap armed it.
    The bootstrap is told a host pid that is not its parent, as if its parent had died
    and it had been reparented: it exits before building anything, the program never runs."""
    real_getpid = os.getpid
    monkeypatch.setattr(os, "getpid", lambda: real_getpid() + 1_000_000)
    res = run_python("print('ran')", isolation="none", limits=Limits(wall_s=30))
    monkeypatch.undo()
    assert res.stdout == "" and res.returncode == sandbox.SETUP_FAILED and not res.ok


# ------------------------------------------------------------------ run folders

def _run_dirs(tmp: Path, pid: int) -> list[Path]:
    return sorted(tmp.glob(f"{sandbox.RUN_DIR_PREFIX}{pid}-*"))


def _cgroups(pid: int) -> list[str]:
    """The memory cgroups of `pid`'s sandboxes (named mopd-sandbox-<host pid>-...)."""
    return sorted(e.path for base, _ in sandbox._Cgroup.bases() if os.path.isdir(base)
                  for e in os.scandir(base) if e.name.startswith(f"{sandbox.RUN_DIR_PREFIX}{pid}-"))


def test_a_killed_hosts_run_folder_goes_at_the_next_start_and_a_live_ones_stays(tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    live = _host(tmp, "none", "sleep")
    dead = _host(tmp, "none", "sleep")
    try:
        for h in (live, dead):
            _wait_for(lambda: _ready(tmp, h.pid) >= 1, "the program to run", h)
        _kill_host(dead)
        _wait_for(lambda: not _tagged(dead.pid), "the killed host's sandbox to die")
        [dead_dir] = _run_dirs(tmp, dead.pid)   # SIGKILL ran no clean-up
        [live_dir] = _run_dirs(tmp, live.pid)
        # ... nor of its memory cgroup, where this machine lets a sandbox make one
        cgroups = bool(sandbox.USE_CGROUP and sandbox._Cgroup.bases())
        if cgroups:
            assert _cgroups(dead.pid) and _cgroups(live.pid)

        # the next process's first run sweeps its temp dir (here: this process, told so)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        monkeypatch.setattr(sandbox, "_cleaned", set())
        res = run_python("print('ok')", isolation="none", limits=Limits(wall_s=30))
        assert res.ok
        assert not dead_dir.exists()
        assert live_dir.is_dir()            # its owner is alive and mid-run
        assert _tagged(live.pid)            # and its run goes on
        assert _run_dirs(tmp, os.getpid()) == []   # the new run cleaned up after itself
        if cgroups:                         # the dead host's cgroup went with its folder
            assert _cgroups(dead.pid) == [] and _cgroups(live.pid)

        _kill_host(live)
        _wait_for(lambda: not _tagged(live.pid), "the second host's sandbox to die")
        assert sandbox.clean_stale_run_dirs(str(tmp)) == [str(live_dir)]
    finally:
        for h in (live, dead):
            h.kill()
            h.wait()
            _kill_leftovers(h.pid)


def test_the_sweep_leaves_everything_but_dead_owners_folders_alone(tmp_path):
    base = tmp_path / "tmp"
    base.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    prefix = sandbox.RUN_DIR_PREFIX

    stale = base / f"{prefix}999999999-abcd1234"      # no lock held: its owner is gone
    (stale / "files").mkdir(parents=True)
    (stale / "files" / "link").symlink_to(outside)    # a link inside is removed, not followed
    held = base / f"{prefix}999999998-abcd1234"       # a live owner holds the lock
    held.mkdir()
    fd = os.open(held, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    link = base / f"{prefix}999999997-abcd1234"       # a symlink with the name of a run folder
    link.symlink_to(outside, target_is_directory=True)
    legacy = base / f"{prefix}abcd1234"               # an older version's name: owner unknown
    legacy.mkdir()
    plain = base / f"{prefix}999999996-abcd1234"      # not a folder
    plain.write_text("x")
    other = base / "unrelated-999999999-x"
    other.mkdir()
    foreign = None
    if os.geteuid() == 0:                             # another uid's folder
        foreign = base / f"{prefix}999999995-abcd1234"
        foreign.mkdir()
        os.chown(foreign, 12345, 12345)
    try:
        assert sandbox.clean_stale_run_dirs(str(base)) == [str(stale)]
    finally:
        os.close(fd)
    assert not stale.exists()
    assert held.is_dir() and link.is_symlink() and legacy.is_dir() and plain.is_file() and other.is_dir()
    assert (outside / "keep.txt").read_text() == "keep"
    if foreign is not None:
        assert foreign.is_dir()
    assert sandbox.clean_stale_run_dirs(str(base)) == [str(held)]   # its lock is free now
