"""Run untrusted Python (model output) in a contained child process.

    res = run_python("print(sum(range(10)))")
    res.ok, res.stdout, res.reason          # True, "45\\n", "ok"

Every run gets a fresh temporary workspace, a scrubbed environment, a new process
session, resource limits, a memory cap on the whole sandbox, and `python -I -S -B` (no
site-packages, no user site, no PYTHON* variables, no .pyc writes). On top of that come
as many of these layers as the machine allows:

| layer | what it stops | "root" | "userns" | "none" |
|---|---|---|---|---|
| new network namespace (no interfaces up) | any network access | yes | yes | audit hook only |
| new mount namespace + chroot into a tmpfs holding only /usr, the Python install (read-only) and the workspace | reading host files and secrets, writing outside the workspace | yes | yes | audit hook; as root also the uid |
| new pid namespace (the program is pid 1; when it dies the kernel kills everything it started) | stray or escaped children, signals to host processes | yes | yes | subreaper bootstrap + supervisor kill of every descendant; as root the uid |
| unprivileged uid / capabilities dropped (no_new_privs) | undoing the above (chroot again, mount, ptrace), signalling host processes | own uid | caps dropped | own uid as root (keeping CAP_DAC_READ_SEARCH only where the Python install is not world-readable); the caller's uid otherwise |
| rlimits: CPU, address space, file size, open files, core=0, processes | CPU burn, one process's memory flood, huge files, fork bombs | yes | yes | yes (NPROC: see below) |
| whole-sandbox memory cap: a memory cgroup where one can be made, else the supervisor summing the tree's RSS every POLL_S | many processes each under RLIMIT_AS | yes | yes | yes |
| workspace is a size-capped tmpfs | filling the host disk | yes | yes | file-count cap in the audit hook |
| wall-clock timeout, SIGKILL to every descendant | hangs (sleep, blocking reads), sessions left behind | yes | yes | yes |
| audit hook (`sys.addaudithook`), installed before the program runs | opening files outside the workspace and the stdlib (writes: workspace only), listing directories, creating/removing/renaming/chmod-ing files outside the workspace, symlinks and hard links, sockets, fork/exec/spawn/subprocess/os.system, os.kill, ctypes and other native escape modules, raising rlimits, tampering with the hook (function code/defaults rewrites, gc walks, tracing) | yes | yes | yes |

Isolation modes, picked once per process by probing the namespace modes (best first), or
chosen with `$MOPD_SANDBOX_ISOLATION` (root | userns | none) or the `isolation=` argument:
- "root": the host runs as real root (a container): mount/net/pid/ipc/uts namespaces
  are made directly, then the program drops to a unique unprivileged uid (so
  RLIMIT_NPROC counts only this sandbox's processes; root itself is exempt from it).
- "userns": an unprivileged user namespace (ns-uid 0 mapped to the caller) plus the
  same namespaces; the capability bounding set is emptied, SECBIT_NOROOT is locked and
  no_new_privs set before the program is exec'd, so it holds no capabilities at all.
  RLIMIT_NPROC is counted per user namespace, so it bounds this sandbox alone (except
  when the caller is real root, which the kernel exempts; then "root" is used anyway).
- "none" is never picked by itself: where no namespace mode works, run_python raises
  SandboxUnavailable unless "none" was chosen explicitly (then a warning is logged once).
  It has rlimits, scrubbed env, tempdir cwd, the memory cap, a bootstrap that stays
  behind as subreaper (everything the program starts, setsid or not, stays below it and
  is killed when the program ends) and the audit hook; as root the program also gets
  its own unprivileged uid (so it can signal no host process, and RLIMIT_NPROC counts
  this sandbox alone; otherwise NPROC is the caller's task count + nproc). The hook is
  hardened against tampering (see rewards/sandbox_runner.py) but is NOT a security boundary against
  a determined attacker: crafted bytecode loaded with marshal.loads (not blocked:
  imports need it), an interpreter bug, a thread racing the hook's path check against a
  rename, or a module copy rebuilt with _imp.create_builtin (which brings back the
  stripped pidfd/setsid functions) are out of its reach; os.stat and friends are not
  audited, so a program can learn whether a host path exists (not its content). Not as
  root, a program past the hook runs as the caller and could signal the caller's
  processes.

Checked on the development machine (Linux 6.18, running as root in a VM): "root" and
"userns" (the latter both as root and as an unprivileged user, where it is what CI
machines get) hold every layer above; tests/unit/rewards/test_sandbox.py and
test_sandbox_hostile.py run the hostile programs in every mode that works where they
run, and always in "none". One sandboxed run costs ~0.1-0.2 s on a loaded 2-core machine.

For test writers: `audit=False` (OS layers alone) is refused in "none" mode, where
os.kill(-1, 9) or a fork bomb would reach the host; as real root in "userns" mode the
kernel does not apply RLIMIT_NPROC, so never run a fork bomb there without the hook.

`available_isolations()` lists the modes that work here; `default_isolation()` is the
one `run_python` uses; `check_isolation()` resolves a mode and raises the errors above
(call it at the start of a run).

Results: `SandboxResult(ok, returncode, stdout, stderr, timed_out, reason, result,
isolation, wall_s, truncated, peak_memory_mb)`. stdout/stderr are cut to `Limits.max_output_bytes`; `result` is
what the program wrote to file descriptor 3, a side channel for trusted harnesses
(rewards/code.py writes a per-run secret token there only after the tests passed).

Trusted harnesses: with `trusted=True` the source runs *before* the audit hook is
installed and gets a `sandbox_lockdown()` function in its globals that installs it
(irreversibly). rewards/code.py forks, locks down the child, runs the candidate there,
and keeps the test code in the parent, which the candidate can neither see nor touch.

When the host dies (SIGKILL, OOM kill), nothing is left to enforce the wall clock, so
the bootstrap and the program each ask the kernel for a signal at their parent's death
(PR_SET_PDEATHSIG) as their first step, and then check that the parent is still there
(it may have died before the request was in place). The bootstrap gets SIGTERM when the
host thread that started it exits; it then SIGKILLs the program (pid 1 in the namespace
modes: the kernel kills the rest) and, in "none" mode, every process below it (their
subreaper: the program's forks and all their orphans), and exits. The program gets
SIGKILL when the bootstrap dies (re-armed after the uid change, which clears it), in
case the bootstrap itself is SIGKILLed. (Not PR_SET_PDEATHSIG in the processes a trusted
harness forks in "none" mode: it would take ctypes there, left loaded within reach of
the candidate they run.) The kernel sends the signal when the parent *thread* exits:
run_python starts the bootstrap from the calling thread and does not return before it
is reaped, so a thread-pool worker outlives its sandbox.
Each run's host folder is <tmp>/mopd-sandbox-<host pid>-XXXXXXXX, flock()ed by the host
for the whole run; the first run of a later process removes those (of its own uid) whose
lock it can take (`clean_stale_run_dirs`).
"""
from __future__ import annotations

import fcntl
import itertools
import logging
import marshal
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from rewards.sandbox_boot import descendants

log = logging.getLogger(__name__)

ISOLATIONS = ("root", "userns", "none")
SETUP_FAILED = 125  # exit code of the bootstrap when it could not build the sandbox
WORKDIR = "/work"   # the workspace path inside the namespace modes

# Unprivileged uids for "root" mode: one per run, so RLIMIT_NPROC counts one sandbox.
_UID_BASE = 1_700_000_000
_uid_counter = itertools.count()
_run_counter = itertools.count()


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0          # wall clock, then SIGKILL to the whole process group
    cpu_s: int = 10               # RLIMIT_CPU per process (SIGXCPU, SIGKILL one second later)
    memory_mb: int = 1024         # RLIMIT_AS per process
    total_memory_mb: int = 2048   # resident memory of all the sandbox's processes together
    nproc: int = 32               # processes + threads the program may have (RLIMIT_NPROC)
    fsize_mb: int = 16            # largest file it may write, stdout/stderr included
    nofile: int = 64              # open file descriptors
    workspace_mb: int = 64        # size of the tmpfs workspace (namespace modes)
    max_write_files: int = 256    # files it may open for writing (audit hook)
    max_output_bytes: int = 64 * 1024  # stdout/stderr returned; the rest is dropped


@dataclass
class SandboxResult:
    ok: bool                      # exited with status 0 in time
    returncode: int | None        # exit status; -N when killed by signal N
    stdout: str
    stderr: str
    timed_out: bool
    # ok | timeout | memory_limit | exit:N | signal:NAME | cpu_limit | file_size_limit | setup_failed | error:...
    reason: str
    result: bytes = b""           # what the program wrote to fd 3 (trusted harnesses)
    isolation: str = ""
    wall_s: float = 0.0
    truncated: dict = field(default_factory=dict)  # {"stdout": bool, "stderr": bool}
    peak_memory_mb: float = 0.0   # largest resident total of the sandbox's processes seen


# ------------------------------------------------------------------ in-sandbox code
# The bootstrap (rewards/sandbox_boot.py) and the runner (rewards/sandbox_runner.py) are
# files of this package, each run as `python -I -S -B -c SOURCE CONFIG`: their source is
# read here once and passed on, since the runner starts inside a chroot where no file of
# the host's is visible.
def _program(name: str) -> str:
    return (Path(__file__).resolve().parent / name).read_text(encoding="utf-8")


_BOOT_SRC = _program("sandbox_boot.py")
_RUNNER_SRC = _program("sandbox_runner.py")


# ------------------------------------------------------------------------ host side

def _python() -> str:
    """The real interpreter (a venv's python is a symlink; -S does not need the venv)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _runtime_paths() -> tuple[list[str], list[list[str]]]:
    """(read-only bind mounts, symlinks) that make up the namespace modes' root."""
    binds: set[str] = {"/usr"}
    links: list[list[str]] = []
    for p in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(p):
            links.append([p, os.readlink(p)])
        elif os.path.isdir(p):
            binds.add(p)
    binds.add(os.path.realpath(sys.base_prefix))
    binds.add(os.path.dirname(_python()))
    if os.path.isfile("/etc/ld.so.cache"):
        binds.add("/etc/ld.so.cache")
    # drop paths inside another bind (it is visible already, and nested read-only
    # mounts cannot create their mount points)
    kept = [p for p in sorted(binds) if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in binds)]
    return kept, links


def _others_can_read(paths: list[str]) -> bool:
    """Can a uid of nobody's read and search `paths` and every folder above them?"""
    seen: set[str] = set()
    for p in paths:
        while p not in seen:
            seen.add(p)
            try:
                mode = os.stat(p).st_mode
            except OSError:
                return False
            if mode & 0o004 == 0 or (os.path.isdir(p) and mode & 0o001 == 0):
                return False
            p = os.path.dirname(p)
    return True


def _clean_env(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "HOME": workdir, "TMPDIR": workdir, "PYTHONIOENCODING": "utf-8"}


def _read_capped(path: str, cap: int) -> tuple[bytes, bool]:
    try:
        with open(path, "rb") as f:
            data = f.read(cap + 1)
    except OSError:
        return b"", False
    return data[:cap], len(data) > cap


def _write_files(work: str, files: dict[str, str | bytes]) -> None:
    for name, content in files.items():
        norm = os.path.normpath(name)
        if os.path.isabs(norm) or norm.startswith(".."):
            raise ValueError(f"sandbox: file name {name!r} must be relative and stay inside the workspace")
        path = os.path.join(work, norm)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)


def _reason(returncode: int | None, timed_out: bool, stderr: str) -> str:
    if timed_out:
        return "timeout"
    if returncode == 0:
        return "ok"
    if returncode == SETUP_FAILED and "sandbox setup failed" in stderr:
        return "setup_failed"
    if returncode is not None and returncode < 0:
        sig = -returncode
        if sig == signal.SIGXCPU:
            return "cpu_limit"
        if sig == signal.SIGXFSZ:
            return "file_size_limit"
        try:
            return f"signal:{signal.Signals(sig).name}"
        except ValueError:
            return f"signal:{sig}"
    return f"exit:{returncode}"


_PAGE = os.sysconf("SC_PAGE_SIZE")
POLL_S = 0.02   # how often the supervisor sums the sandbox's memory
# A memory cgroup per sandbox where one can be made ($MOPD_SANDBOX_CGROUP=0: the
# supervisor's sampling alone).
USE_CGROUP = os.environ.get("MOPD_SANDBOX_CGROUP", "1").strip() != "0"


def _rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm", "rb") as f:
                total += int(f.read().split()[1]) * _PAGE
        except (OSError, ValueError, IndexError):
            pass
    return total


class _Cgroup:
    """A memory cgroup for one sandbox, where this process may make one (v2 with the
    memory controller delegated, or v1's memory hierarchy, e.g. as root in a container):
    the kernel then holds the whole sandbox to the cap and records its exact peak. The
    bootstrap moves itself in before anything else runs, so everything the program
    starts is charged there, wherever it moves in the process tree."""

    def __init__(self, path: str, v2: bool):
        self.path, self.v2 = path, v2

    @staticmethod
    def bases() -> list[tuple[str, bool]]:
        """(folder, is v2) of each memory cgroup hierarchy this process sits in, where a
        sandbox's cgroup would be made."""
        try:
            with open("/proc/self/cgroup") as f:
                lines = f.read().splitlines()
        except OSError:
            return []
        out = []
        for line in lines:
            _, controllers, rel = line.split(":", 2)
            if controllers == "" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
                base = "/sys/fs/cgroup" + rel
                try:
                    with open(os.path.join(base, "cgroup.subtree_control")) as f:
                        if "memory" in f.read().split():
                            out.append((base, True))
                except OSError:
                    pass
            elif "memory" in controllers.split(",") and os.path.isdir("/sys/fs/cgroup/memory"):
                out.append(("/sys/fs/cgroup/memory" + rel, False))
        return out

    @classmethod
    def create(cls, name: str, limit: int) -> "_Cgroup | None":
        for base, v2 in cls.bases():
            path = os.path.join(base, name)
            try:
                os.mkdir(path)
            except OSError:
                continue
            cg = cls(path, v2)
            try:
                if v2:
                    cg._write("memory.max", limit)
                    if os.path.exists(os.path.join(path, "memory.swap.max")):
                        cg._write("memory.swap.max", 0)
                else:
                    cg._write("memory.limit_in_bytes", limit)
                    if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
                        cg._write("memory.memsw.limit_in_bytes", limit)
                return cg
            except OSError:
                cg.remove()
        return None

    def _write(self, name: str, value: int) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(str(value))

    def _read(self, name: str) -> str:
        try:
            with open(os.path.join(self.path, name)) as f:
                return f.read()
        except OSError:
            return ""

    def procs(self) -> bool:
        return bool(self._read("cgroup.procs").split())

    def oom_kills(self) -> int:
        text = self._read("memory.events" if self.v2 else "memory.oom_control")
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def peak(self) -> int:
        text = self._read("memory.peak" if self.v2 else "memory.max_usage_in_bytes").strip()
        return int(text) if text.isdigit() else 0

    def kill(self) -> None:
        if self.v2 and os.path.exists(os.path.join(self.path, "cgroup.kill")):
            try:
                self._write("cgroup.kill", 1)
            except OSError:
                pass
        for pid in self._read("cgroup.procs").split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (OSError, ValueError):
                pass

    def remove(self) -> None:
        for _ in range(200):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                self.kill()
                time.sleep(0.005)
        log.warning("sandbox: could not remove cgroup %s", self.path)


def _kill_sandbox(root: int) -> None:
    """SIGKILL every process of the sandbox: the descendants first (while the root is
    alive its orphans are reparented to it or to pid 1 of its namespace, so they stay
    findable), then the root and its process group."""
    for _ in range(100):
        left = descendants(root)
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.001)
    for kill in (lambda: os.killpg(root, signal.SIGKILL), lambda: os.kill(root, signal.SIGKILL)):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass


def _wait(proc: subprocess.Popen, wall_s: float, total_memory_mb: int,
          cgroup: _Cgroup | None = None) -> tuple[bool, bool, float]:
    """Wait for the sandbox's first process; every POLL_S, check its memory cgroup for an
    OOM kill or, without one, sum the resident memory of its whole process tree; kill
    the whole sandbox when it exits, times out or goes over `total_memory_mb`. Returns
    (timed_out, over_memory, peak MB). The exit is
    observed without reaping (a pidfd, else waitid with WNOWAIT), so the group id and
    the parent links stay valid until everything is dead."""
    deadline = time.monotonic() + wall_s
    cap = int(total_memory_mb) << 20
    timed_out = over = in_cgroup = False
    peak = 0
    pidfd = None
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        pass
    poller = None
    if pidfd is not None:   # readable once the process has exited
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            step = min(left, POLL_S)
            if poller is not None:
                try:
                    if poller.poll(max(1, int(step * 1000))):
                        break
                except InterruptedError:
                    continue
            else:
                try:
                    info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                except ChildProcessError:
                    info = True
                if info is not None:
                    break
                time.sleep(step)
            if cgroup is not None and (in_cgroup or cgroup.procs()):
                in_cgroup = True     # the kernel holds the cap; stop at its first OOM kill
                if cgroup.oom_kills():
                    over = True
                    break
                continue
            rss = _rss_bytes([proc.pid, *descendants(proc.pid)])
            peak = max(peak, rss)
            if rss > cap:
                over = True
                break
    finally:
        if pidfd is not None:
            os.close(pidfd)
    _kill_sandbox(proc.pid)
    if cgroup is not None:
        cgroup.kill()
    proc.wait()
    if cgroup is not None and cgroup.oom_kills() > 0:
        over = True
    if cgroup is not None and (in_cgroup or cgroup.peak() > 0):
        peak = cgroup.peak()   # exact, where the sandbox was charged there at all
    return timed_out, over, peak / (1 << 20)


def run_python(source: str, *, files: dict[str, str | bytes] | None = None, stdin: bytes | str = b"",
               limits: Limits | None = None, isolation: str | None = None, trusted: bool = False,
               audit: bool = True, import_paths: tuple[str, ...] = ()) -> SandboxResult:
    """Run `source` as __main__ in a fresh sandbox (see the module docstring).

    files:     extra files for the workspace, {relative name: content}
    stdin:     what the program reads on stdin
    isolation: "root" | "userns" | "none"; default: $MOPD_SANDBOX_ISOLATION, else the
               best namespace mode that works here ("none" is never picked by itself)
    trusted:   run `source` before the audit hook, with `sandbox_lockdown()` to install it
    audit:     False leaves the audit hook out (tests of the OS layers alone; refused
               with isolation "none"). Never run a fork bomb with audit=False in
               "userns" mode as real root: the kernel exempts root from RLIMIT_NPROC.
    import_paths: folders of installed packages (e.g. torch's site-packages) put on the
               program's sys.path, mounted read-only in the namespace modes and readable
               (never writable) through the audit hook, like the stdlib
    Never raises for anything the program does; a failure to build the sandbox is
    reported as reason "setup_failed". Raises ValueError for an unknown isolation and
    SandboxUnavailable when no namespace mode works and "none" was not chosen."""
    return _run(source, check_isolation(isolation), files=files, stdin=stdin, limits=limits or Limits(),
                trusted=trusted, audit=audit, import_paths=import_paths)


RUN_DIR_PREFIX = "mopd-sandbox-"
_cleaned_lock = threading.Lock()
_cleaned: set[str] = set()   # temp dirs swept for stale run folders by this process


def clean_stale_run_dirs(base: str | None = None) -> list[str]:
    """Remove the run folders under `base` (default: the temp dir) that processes of this
    uid left when they died mid-run (SIGKILL, OOM: no clean-up of theirs ran); returns
    what was removed. A folder goes only when its lock can be taken, which its owner
    holds for as long as it lives (the kernel drops it at its death, whatever pid it
    had, and in any pid namespace). Symlinks, other uids' folders and names of another
    shape (older versions of this module) are left alone."""
    base = base or tempfile.gettempdir()
    removed: list[str] = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    for entry in entries:
        pid, sep, _ = entry.name[len(RUN_DIR_PREFIX):].partition("-")
        if not entry.name.startswith(RUN_DIR_PREFIX) or not sep or not pid.isdigit():
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if not _same_file(st, os.fstat(fd)):
                continue                 # replaced since the stat
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue                 # its owner is alive
            shutil.rmtree(entry.path, ignore_errors=True)   # never follows links
            if not os.path.lexists(entry.path):
                removed.append(entry.path)
        finally:
            os.close(fd)
    return removed


def clean_stale_cgroups() -> list[str]:
    """Remove the sandbox cgroups (`mopd-sandbox-<host pid>-...`) whose host process is
    gone: a host killed mid-run (SIGKILL, OOM) leaves its empty cgroup behind, since its
    own clean-up never ran. The kernel refuses to remove a cgroup that still has a
    process, so a live sandbox's is never taken; one of a live pid is left alone (it may
    be a live host's, just made). Returns what was removed."""
    removed = []
    for base, _ in _Cgroup.bases():
        try:
            entries = list(os.scandir(base))
        except OSError:
            continue
        for entry in entries:
            pid, sep, _ = entry.name[len(RUN_DIR_PREFIX):].partition("-")
            if not entry.name.startswith(RUN_DIR_PREFIX) or not sep or not pid.isdigit():
                continue
            try:
                os.kill(int(pid), 0)
                continue                 # its host is alive (or the pid was reused: left)
            except ProcessLookupError:
                pass
            except OSError:
                continue                 # alive, another uid's
            try:
                os.rmdir(entry.path)
                removed.append(entry.path)
            except OSError:
                pass
    return removed


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _make_run_dir() -> tuple[str, int]:
    """(a fresh run folder, a descriptor holding an exclusive flock on it). The first
    call in a process (per temp dir) sweeps stale folders first. A sweeper of another
    process may take a folder in the moment between mkdtemp and flock: it holds the
    lock while it removes the folder, so a folder is used only when the lock was
    taken and the path still names it; else another one is made."""
    base = tempfile.gettempdir()
    with _cleaned_lock:
        sweep = base not in _cleaned
        _cleaned.add(base)
    if sweep:
        removed = clean_stale_run_dirs(base)
        if removed:
            log.info("sandbox: removed %d run folder(s) of dead processes from %s", len(removed), base)
        if USE_CGROUP:
            removed = clean_stale_cgroups()
            if removed:
                log.info("sandbox: removed %d memory cgroup(s) of dead processes", len(removed))
    for _ in range(100):
        path = tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-", dir=base)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _same_file(os.stat(path, follow_symlinks=False), os.fstat(fd)):
                return path, fd
        except OSError:
            pass
        os.close(fd)
    raise OSError(f"sandbox: could not make a locked run folder in {base}")


def _run(source: str, mode: str, *, files: dict[str, str | bytes] | None, stdin: bytes | str, limits: Limits,
         trusted: bool, audit: bool, import_paths: tuple[str, ...] = ()) -> SandboxResult:
    if not audit and mode == "none":
        # Nothing but rlimits would be left: os.kill(-1, 9) or a fork bomb run as the
        # caller (as root: unlimited) would take the host down.
        raise ValueError("sandbox: audit=False needs a namespace isolation ('root' or 'userns')")
    t0 = time.perf_counter()
    cgroup = None
    tmp, tmp_lock = _make_run_dir()
    try:
        files_dir = os.path.join(tmp, "files")
        os.mkdir(files_dir, 0o700)
        _write_files(files_dir, {**(files or {}), "main.py": source})
        root_dir = os.path.join(tmp, "root")
        os.mkdir(root_dir, 0o700)
        workdir = WORKDIR if mode != "none" else files_dir
        stdin_path = os.path.join(tmp, "stdin")
        with open(stdin_path, "wb") as f:
            f.write(stdin.encode() if isinstance(stdin, str) else stdin)
        binds, links = _runtime_paths()
        extra = [os.path.realpath(p) for p in import_paths]
        for p in extra:
            if not os.path.isdir(p):
                raise ValueError(f"sandbox: import path {p!r} is not a folder")
        import_binds = [[p, f"/opt/mopd-import/{i}"] for i, p in enumerate(extra)] if mode != "none" else []
        uid = _UID_BASE + (os.getpid() % 1000) * 100_000 + next(_uid_counter) % 100_000
        env = _clean_env(workdir)
        # names this run's processes in /proc/*/environ, which they cannot rewrite: a
        # way for an operator (and the tests) to find anything that outlived a run
        env["MOPD_SANDBOX_RUN"] = f"{os.getpid()}-{next(_run_counter)}-{os.urandom(4).hex()}"
        out_path, err_path, res_path = (os.path.join(tmp, n) for n in ("stdout", "stderr", "result"))
        cfg = {
            "mode": mode, "python": _python(), "runner_src": _RUNNER_SRC, "env": env,
            "root_dir": root_dir, "files_dir": files_dir, "workdir": WORKDIR,
            "ro_binds": binds, "symlinks": links, "import_binds": import_binds,
            "dev_nodes": ["/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"],
            "uid": uid, "needs_read_search": not _others_can_read([_python(), *binds, *extra]), "limits": {
                "cpu_s": int(limits.cpu_s), "memory_mb": int(limits.memory_mb), "nproc": int(limits.nproc),
                "fsize_mb": int(limits.fsize_mb), "nofile": int(limits.nofile),
                "workspace_mb": int(limits.workspace_mb)},
            "runner": {"main": "main.py", "trusted": bool(trusted), "audit": bool(audit),
                       "max_write_files": int(limits.max_write_files),
                       "import_paths": [at for _, at in import_binds] if import_binds else extra},
            "host_pid": os.getpid(),
        }
        cgroup = _Cgroup.create("mopd-sandbox-" + env["MOPD_SANDBOX_RUN"], int(limits.total_memory_mb) << 20) \
            if USE_CGROUP else None
        cfg["cgroup_procs"] = os.path.join(cgroup.path, "cgroup.procs") if cgroup else ""
        with open(stdin_path, "rb") as fin, open(out_path, "wb") as fout, open(err_path, "wb") as ferr, \
                open(res_path, "wb") as fres:
            cfg["result_fd"] = fres.fileno()
            cmd = [_python(), "-I", "-S", "-B", "-c", _BOOT_SRC, marshal.dumps(cfg).hex()]
            # The bootstrap dies when *this thread* exits (PR_SET_PDEATHSIG follows the
            # thread that forked it), so it is started, waited for and reaped here, in
            # one call: a pool worker that runs a sandbox cannot finish before it.
            try:
                proc = subprocess.Popen(cmd, stdin=fin, stdout=fout, stderr=ferr, cwd=files_dir, env=env,
                                        start_new_session=True, close_fds=True, pass_fds=(fres.fileno(),))
            except OSError as e:
                return SandboxResult(False, None, "", str(e), False, f"error:{type(e).__name__}",
                                     isolation=mode, wall_s=time.perf_counter() - t0)
            try:
                timed_out, over_memory, peak_mb = _wait(proc, limits.wall_s, limits.total_memory_mb, cgroup)
            except BaseException:
                # e.g. KeyboardInterrupt while waiting: the sandbox must not outlive the call
                _kill_sandbox(proc.pid)
                if cgroup is not None:
                    cgroup.kill()
                proc.wait()
                raise
        cap = limits.max_output_bytes
        out, out_cut = _read_capped(out_path, cap)
        err, err_cut = _read_capped(err_path, cap)
        result, _ = _read_capped(res_path, cap)
        stderr = err.decode("utf-8", "replace")
        rc = proc.returncode
        if over_memory:
            stderr += f"\nsandbox: killed, its processes held more than {limits.total_memory_mb} MB together\n"
        return SandboxResult(ok=(rc == 0 and not timed_out and not over_memory), returncode=rc,
                             stdout=out.decode("utf-8", "replace"), stderr=stderr, timed_out=timed_out,
                             reason="memory_limit" if over_memory else _reason(rc, timed_out, stderr),
                             result=b"" if over_memory else result, isolation=mode,
                             wall_s=time.perf_counter() - t0, truncated={"stdout": out_cut, "stderr": err_cut},
                             peak_memory_mb=peak_mb)
    finally:
        if cgroup is not None:
            cgroup.remove()
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(tmp_lock)   # only now: the folder is gone


# ---------------------------------------------------------------- picking the mode

_probe_lock = threading.Lock()
_probed: dict[str, bool] = {}


def _probe(mode: str) -> bool:
    with _probe_lock:
        if mode not in _probed:
            if mode == "root" and os.geteuid() != 0:
                _probed[mode] = False
            else:
                res = _run("print('sandbox-ok')", mode, files=None, stdin=b"", limits=Limits(wall_s=20),
                           trusted=False, audit=True)
                _probed[mode] = res.ok and res.stdout == "sandbox-ok\n"
                if not _probed[mode]:
                    log.info("sandbox isolation %r unavailable here: %s %s", mode, res.reason, res.stderr.strip()[-300:])
        return _probed[mode]


def available_isolations() -> list[str]:
    """The isolation modes that work on this machine, best first (probed once each)."""
    return [m for m in ISOLATIONS if _probe(m)]


class SandboxUnavailable(RuntimeError):
    """No namespace isolation works here and the audit-hook-only mode was not chosen."""


_default: list[str] = []
_warned: list[bool] = []
_NONE_RISK = ("isolation 'none' runs model-written code directly on this host, guarded only by an "
              "in-process audit hook, rlimits, a memory-capped supervisor and (as root) an unprivileged "
              "uid; it is not a security boundary (see docs/sandbox.md)")


# What a non-root host gives up in "none" (docs/sandbox.md, "Not root: the hook alone").
_NONE_UNPRIVILEGED = (
    "this host is not root, so in isolation 'none' the audit hook is the only layer between the program "
    "and your account: the program runs as your own uid, with no namespace and no uid of its own. Code that "
    "gets past the hook (crafted bytecode, an interpreter bug, a path check raced by a rename) can read and "
    "write every file your uid can (keys, checkpoints), reach the network, read other processes of yours "
    "through /proc and signal them (the training job). Even with the hook in place it can learn which host "
    "paths exist (os.stat is not audited) and share RLIMIT_NPROC with all of your processes")


def _env_isolation() -> str:
    forced = os.environ.get("MOPD_SANDBOX_ISOLATION", "").strip()
    if forced and forced not in ISOLATIONS:
        raise ValueError(f"MOPD_SANDBOX_ISOLATION={forced!r} is not an isolation mode; "
                         f"expected one of {', '.join(ISOLATIONS)}")
    return forced


def default_isolation() -> str:
    """$MOPD_SANDBOX_ISOLATION if set, else the best namespace mode that works here.
    Never "none" unless asked for: raises SandboxUnavailable instead."""
    forced = _env_isolation()
    if forced:
        return forced
    if not _default:
        best = next((m for m in ISOLATIONS if m != "none" and _probe(m)), None)
        if best is None:
            raise SandboxUnavailable(
                "sandbox: no namespace isolation works on this machine (unshare refused: a container's "
                "default seccomp profile, or unprivileged user namespaces switched off). Refusing to "
                f"fall back silently: {_NONE_RISK}. To accept that, set MOPD_SANDBOX_ISOLATION=none "
                "(or pass isolation='none'); better, allow user namespaces "
                "(sysctl kernel.unprivileged_userns_clone=1) or run the container with a seccomp "
                "profile that permits unshare.")
        _default.append(best)
    return _default[0]


def check_isolation(isolation: str | None = None) -> str:
    """The mode `run_python(isolation=isolation)` will use; call it before expensive work
    starts. Raises ValueError for an unknown mode (argument or $MOPD_SANDBOX_ISOLATION)
    and SandboxUnavailable when only "none" would work and it was not chosen; logs a
    warning, once per process, when "none" is in use."""
    if isolation is not None and isolation not in ISOLATIONS:
        raise ValueError(f"sandbox: unknown isolation {isolation!r}; expected one of {', '.join(ISOLATIONS)}")
    mode = isolation or default_isolation()
    if mode == "none" and not _warned:
        _warned.append(True)
        log.warning("sandbox: %s. Chosen explicitly (MOPD_SANDBOX_ISOLATION or isolation=).", _NONE_RISK)
        if os.geteuid() != 0:
            log.warning("sandbox: %s", _NONE_UNPRIVILEGED)
    return mode
