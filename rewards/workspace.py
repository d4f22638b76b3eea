"""A sandbox per agent episode that persists across its turns: the episode's own workspace
on the host, edited by trusted tool code, and every run of the episode's code in a fresh
rewards/sandbox.py sandbox over a copy of it.

    ws = Workspace({"m.py": src, "test_m.py": tests})      # at env reset
    ws.read("m.py"); ws.replace("m.py", "- 2", "- 1")       # the model's edits (host side)
    ws.run_tests(["test_m.py"])                             # a sandboxed run: "1 failed, 2 passed ..."
    ws.close()                                              # at the episode's end

Why the workspace lives on the host and each run is a fresh sandbox (rather than one
sandbox process kept alive for the whole episode): the file tools are plain, bounded file
operations that need no untrusted code, and a run that starts from a copy and is killed
with everything it started when it ends leaves nothing behind that a later turn could
meet: no background process, no half-written file outside what the tools wrote, no state
in memory. What a run writes is dropped with its sandbox; the workspace holds what the
model wrote through the tools.

Isolation is rewards/sandbox.py's (namespaces or the audit-hook fallback, rlimits, the
memory cap, no network, scrubbed environment), with `WorkspaceLimits.sandbox` as limits.
What ends an episode as failed (the env turns these exceptions into a failed episode,
core/agent/env.py), while every other episode goes on:

    SandboxKilled   a run was killed or crashed: wall-clock timeout (hangs, infinite loops,
                    sleeping threads or children), CPU limit, memory cap, a signal, a
                    nonzero exit (os._exit, an interpreter crash); "setup_failed" is the
                    machine's fault and raises RuntimeError instead (when a trivial
                    program fails the same way)
    QuotaExceeded   the tools would take the workspace over its quota (files, bytes)

Contained without ending the episode (the run reports them as test errors): one
allocation past RLIMIT_AS (MemoryError), fork/exec/kill/sockets (the audit hook), a
write past fsize_mb or the run's tmpfs (EFBIG/ENOSPC: Python ignores SIGXFSZ).

`WorkspaceError` is the model's mistake (a path outside the workspace, a missing file,
text that does not occur exactly once): the env shows it as an error observation.

Paths are relative, of at most `max_depth` plain components ([A-Za-z0-9_.-], no "..", no
hidden names); the resolved path must stay inside the workspace (the tools never create
links, and the sandbox copies only regular files). Reads are cut to `max_read_chars`,
test output to `max_output_chars`.

Lifetime: each workspace is a directory under one root per process
(<tmp>/mopd-ws-<pid>-XXXX, or under $MOPD_WORKSPACE_DIR), which holds an exclusive
flock on <root>/.lock for as long as the process lives. A workspace is removed by
close(), when it is garbage-collected (weakref.finalize), and with the whole root at
interpreter exit (atexit) and on SIGTERM (a handler installed once, chaining to the
previous one). A process killed outright (SIGKILL, OOM) runs none of these: its root's
lock is released by the kernel, and the next process that makes a root removes every
root whose lock it can take (`clean_stale_roots`), after killing what a run in flight at
that moment left running (`kill_orphan_runs`).
"""
from __future__ import annotations

import atexit
import fcntl
import os
import re
import shutil
import signal
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from rewards.sandbox import Limits, SandboxResult, check_isolation, run_python

ROOT_PREFIX = "mopd-ws-"
LOCK_NAME = ".lock"
RESERVED = ("main.py",)   # run_python writes the program there
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


class WorkspaceError(Exception):
    """A tool call the model got wrong (bad path, missing file, ambiguous edit): shown to it."""


class QuotaExceeded(RuntimeError):
    """The episode tried to take its workspace over its quota: the episode fails."""


class SandboxKilled(RuntimeError):
    """A run of the episode's code was killed or crashed: the episode fails."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"sandbox: the run was stopped ({reason}){': ' + detail if detail else ''}")
        self.reason = reason


@dataclass(frozen=True)
class WorkspaceLimits:
    max_files: int = 32
    max_file_bytes: int = 64 * 1024
    max_total_bytes: int = 256 * 1024
    max_depth: int = 3
    max_path_chars: int = 100
    max_read_chars: int = 4000      # longer files are shown cut, with a note to read a line range
    max_output_chars: int = 2000    # test output shown to the model
    sandbox: Limits = field(default_factory=lambda: Limits(
        wall_s=5.0, cpu_s=5, memory_mb=1024, total_memory_mb=1536, nproc=16, fsize_mb=4, nofile=64,
        workspace_mb=16, max_write_files=64, max_output_bytes=64 * 1024))


# ------------------------------------------------------------------ the per-process root

_lock = threading.Lock()
_roots: dict[str, tuple[Path, int]] = {}   # base dir -> (root, fd holding its flock)
_owner_pid = os.getpid()
_atexit_installed = False
_sigterm_installed = False


def _base(base_dir: str | Path | None) -> Path:
    return Path(base_dir or os.environ.get("MOPD_WORKSPACE_DIR") or tempfile.gettempdir())


def clean_stale_roots(base_dir: str | Path | None = None) -> list[Path]:
    """Remove the roots under `base_dir` whose process is gone (their lock can be taken);
    returns what was removed. A root without a lock file is removed when the pid in its
    name no longer exists (a process killed between making the root and locking it)."""
    base = _base(base_dir)
    mine = {str(r) for r, _fd in _roots.values()}
    removed = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    for p in entries:
        if not p.name.startswith(ROOT_PREFIX) or str(p) in mine or not p.is_dir() or p.is_symlink():
            continue
        lock = p / LOCK_NAME
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:
            pid = p.name[len(ROOT_PREFIX):].split("-", 1)[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)   # its process is alive
            continue
        try:
            pid = p.name[len(ROOT_PREFIX):].split("-", 1)[0]
            if pid.isdigit():
                kill_orphan_runs(int(pid))
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
        finally:
            os.close(fd)
    return removed


def kill_orphan_runs(host_pid: int) -> list[int]:
    """SIGKILL the sandbox processes that a dead process `host_pid` left running (a run in
    flight when it was killed outright: nothing was left to enforce the wall clock on a
    program that sleeps). rewards/sandbox.py tags every run's environment with
    MOPD_SANDBOX_RUN=<host pid>-...; a tagged process with a live `host_pid` among its
    ancestors belongs to a new process that reuses the pid and is left alone."""
    tag = f"MOPD_SANDBOX_RUN={host_pid}-".encode()
    parent, tagged = {}, []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                parent[int(name)] = int(f.read().rpartition(b")")[2].split()[1])
            with open(f"/proc/{name}/environ", "rb") as f:
                if tag in f.read():
                    tagged.append(int(name))
        except (OSError, ValueError, IndexError):
            continue

    def owned_by_live_host(pid: int) -> bool:
        for _ in range(64):
            pid = parent.get(pid, 0)
            if pid <= 1:
                return False
            if pid == host_pid:
                return True
        return False

    killed = []
    for pid in tagged:
        if not owned_by_live_host(pid):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:
                pass
    return killed


def process_root(base_dir: str | Path | None = None) -> Path:
    """This process's root under `base_dir` (made, locked and its stale neighbours removed
    on first use)."""
    base = _base(base_dir)
    key = str(base.resolve())
    with _lock:
        if os.getpid() != _owner_pid:
            _forget_parent_roots()
        if key in _roots:
            _install_hooks()
            return _roots[key][0]
        base.mkdir(parents=True, exist_ok=True)
        clean_stale_roots(base)
        root = Path(tempfile.mkdtemp(prefix=f"{ROOT_PREFIX}{os.getpid()}-", dir=base))
        fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        _roots[key] = (root, fd)
        _install_hooks()
        return root


def _forget_parent_roots() -> None:
    """In a forked child: the roots (and their cleanup) belong to the parent."""
    global _owner_pid
    for _root, fd in _roots.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _roots.clear()
    _owner_pid = os.getpid()


def cleanup_roots() -> None:
    """Remove every root this process made (at exit, on SIGTERM; safe to call twice)."""
    if os.getpid() != _owner_pid:
        return
    for key, (root, fd) in list(_roots.items()):
        shutil.rmtree(root, ignore_errors=True)
        try:
            os.close(fd)
        except OSError:
            pass
        _roots.pop(key, None)


def _install_hooks() -> None:
    """atexit once; the SIGTERM handler once, from the first call made in the main thread
    (signal handlers can only be set there; reward workers make workspaces in threads)."""
    global _atexit_installed, _sigterm_installed
    if not _atexit_installed:
        _atexit_installed = True
        atexit.register(cleanup_roots)
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    _sigterm_installed = True
    prev = signal.getsignal(signal.SIGTERM)
    if prev is signal.SIG_IGN:
        return

    def on_term(signum, frame):
        cleanup_roots()
        if callable(prev):
            prev(signum, frame)
            return
        # the default action (die by SIGTERM), as if no handler had been installed
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)


# ------------------------------------------------------------------ the visible-test runner

# Runs in the sandbox (audit hook on, untrusted): imports each test file and calls its
# test_* functions in definition order; a failure shows the failing line of the test file.
# Everything the tests raise is caught, so a nonzero exit means the program killed itself.
TEST_RUNNER = r'''
import os, sys, linecache, importlib

sys.path.insert(0, os.getcwd())
sys.dont_write_bytecode = True
FILES = %r


def where(tb, path):
    line = ""
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == path:
            line = linecache.getline(path, tb.tb_lineno).strip()
        tb = tb.tb_next
    return line


def describe(e, tb, path):
    line = where(tb, path)
    if type(e) is AssertionError and not str(e):
        return line
    msg = f"{type(e).__name__}: {str(e)[:200]}" if str(e) else type(e).__name__
    return f"{line} -> {msg}" if line else msg


passed = failed = 0
out = []
for name in FILES:
    path = os.path.join(os.getcwd(), name)
    if not os.path.isfile(path):
        out.append(f"ERROR {name}: missing")
        failed += 1
        continue
    try:
        mod = importlib.import_module(name[:-3].replace("/", "."))
    except BaseException as e:
        out.append(f"ERROR {name}: {describe(e, e.__traceback__, path)}")
        failed += 1
        continue
    for test, fn in list(vars(mod).items()):
        if not test.startswith("test") or not callable(fn):
            continue
        try:
            fn()
            passed += 1
        except BaseException as e:
            out.append(f"FAIL {test}: {describe(e, e.__traceback__, path)}")
            failed += 1
parts = ([f"{failed} failed"] if failed else []) + [f"{passed} passed"]
out.append(", ".join(parts))
sys.stdout.write("\n".join(out) + "\n")
'''


def cut_text(text: str, limit: int, what: str = "characters") -> str:
    """`text`, or its head and tail with a note of how much was left out."""
    if len(text) <= limit:
        return text
    tail = min(200, limit // 4)
    head = limit - tail
    return f"{text[:head]}\n...({len(text) - head - tail} {what} cut)...\n{text[-tail:]}"


# ------------------------------------------------------------------ the workspace

class Workspace:
    """One episode's files (module doc). Not thread-safe: one episode, one caller."""

    def __init__(self, files: dict[str, str], limits: WorkspaceLimits | None = None, isolation: str | None = None,
                 base_dir: str | Path | None = None):
        self.limits = limits or WorkspaceLimits()
        self.isolation = check_isolation(isolation)   # a bad setting is an error before any run
        root = process_root(base_dir)
        self.dir = Path(tempfile.mkdtemp(prefix="ep-", dir=root))
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        self.runs = 0
        try:
            for name, content in files.items():
                self.write(name, content)
        except Exception:
            self.close()
            raise

    # ---------------------------------------------------------------- lifetime
    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Remove the workspace (idempotent)."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _open(self) -> None:
        if self.closed:
            raise RuntimeError("workspace: used after close()")

    # ---------------------------------------------------------------- paths
    def resolve(self, path) -> Path:
        """The host path of a workspace-relative `path`; WorkspaceError for anything else."""
        self._open()
        if not isinstance(path, str) or not path.strip():
            raise WorkspaceError("path must be a non-empty string like 'm.py'")
        p = path.strip()
        if p.startswith("./"):
            p = p[2:]
        if len(p) > self.limits.max_path_chars:
            raise WorkspaceError(f"path is too long (at most {self.limits.max_path_chars} characters)")
        if p.startswith("/") or "\\" in p or "\x00" in p:
            raise WorkspaceError(f"{path!r}: paths are relative to the workspace, like 'm.py'")
        parts = p.split("/")
        if len(parts) > self.limits.max_depth:
            raise WorkspaceError(f"{path!r}: at most {self.limits.max_depth} levels of folders")
        for part in parts:
            if part in ("", ".", "..") or part.startswith(".") or not _NAME.fullmatch(part):
                raise WorkspaceError(f"{path!r} is outside the workspace or not a plain name "
                                     "(letters, digits, _ . -)")
        full = self.dir.joinpath(*parts)
        real = Path(os.path.realpath(full))
        if real != self.dir.resolve() and self.dir.resolve() not in real.parents:
            raise WorkspaceError(f"{path!r} is outside the workspace")
        return full

    def files(self) -> dict[str, int]:
        """{relative path: size in bytes} of every regular file, sorted."""
        self._open()
        out = {}
        for dirpath, dirnames, filenames in os.walk(self.dir):
            dirnames.sort()
            for n in sorted(filenames):
                p = Path(dirpath) / n
                if p.is_file() and not p.is_symlink():
                    out[p.relative_to(self.dir).as_posix()] = p.stat().st_size
        return dict(sorted(out.items()))

    def snapshot(self) -> dict[str, bytes]:
        """Every file's content (what a sandboxed run gets a copy of)."""
        return {name: (self.dir / name).read_bytes() for name in self.files()}

    # ---------------------------------------------------------------- the tools
    def list_files(self) -> str:
        files = self.files()
        return "\n".join(files) if files else "(no files)"

    def read(self, path: str, start: int | None = None, end: int | None = None) -> str:
        """The file's text, or lines start..end (1-based, inclusive); cut to max_read_chars."""
        full = self.resolve(path)
        if not full.is_file():
            raise WorkspaceError(f"no file {path!r}; files: {', '.join(self.files()) or 'none'}")
        text = full.read_bytes().decode("utf-8", "replace")
        if start is not None or end is not None:
            lines = text.splitlines(keepends=True)
            s = 1 if start is None else start
            e = len(lines) if end is None else end
            if not (isinstance(s, int) and isinstance(e, int)) or s < 1 or e < s:
                raise WorkspaceError(f"lines {start}..{end}: start must be >= 1 and end >= start")
            if s > len(lines):
                raise WorkspaceError(f"{path} has {len(lines)} lines")
            text = "".join(lines[s - 1:e])
        if len(text) > self.limits.max_read_chars:
            shown = text[:self.limits.max_read_chars]
            n_lines = shown.count("\n")
            return (f"{shown}\n...(cut: {len(text) - len(shown)} more characters; read a line range, "
                    f"e.g. start={n_lines + 1})")
        return text

    def write(self, path: str, content) -> str:
        """Create or overwrite a file. Over the quota: QuotaExceeded (the episode fails)."""
        if not isinstance(content, str):
            raise WorkspaceError("content must be a string")
        full = self.resolve(path)
        if Path(path.strip()).name in RESERVED and "/" not in path.strip():
            raise WorkspaceError(f"{path!r} is a reserved name")
        if full.exists() and not full.is_file():
            raise WorkspaceError(f"{path!r} is a folder")
        data = content.encode("utf-8", "surrogatepass")
        files = self.files()
        rel = full.relative_to(self.dir).as_posix()
        lim = self.limits
        if len(data) > lim.max_file_bytes:
            raise QuotaExceeded(f"workspace: {path!r} would be {len(data)} bytes (at most {lim.max_file_bytes})")
        if rel not in files and len(files) + 1 > lim.max_files:
            raise QuotaExceeded(f"workspace: more than {lim.max_files} files")
        total = sum(files.values()) - files.get(rel, 0) + len(data)
        if total > lim.max_total_bytes:
            raise QuotaExceeded(f"workspace: {total} bytes in all (at most {lim.max_total_bytes})")
        for parent in reversed(full.relative_to(self.dir).parents):
            d = self.dir / parent
            if d.exists() and not d.is_dir():
                raise WorkspaceError(f"{parent.as_posix()!r} is a file, not a folder")
        full.parent.mkdir(parents=True, exist_ok=True)
        tmp = full.with_name(f".{full.name}.tmp")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, full)   # a reader (a run's snapshot) never sees half a file
        finally:
            tmp.unlink(missing_ok=True)
        return "ok"

    def replace(self, path: str, old, new) -> str:
        """Replace the one occurrence of `old` in the file with `new`."""
        if not isinstance(old, str) or not isinstance(new, str):
            raise WorkspaceError("old and new must be strings")
        if not old:
            raise WorkspaceError("old must not be empty")
        full = self.resolve(path)
        if not full.is_file():
            raise WorkspaceError(f"no file {path!r}; files: {', '.join(self.files()) or 'none'}")
        text = full.read_bytes().decode("utf-8", "replace")
        n = text.count(old)
        if n == 0:
            raise WorkspaceError(f"the text to replace does not occur in {path}")
        if n > 1:
            raise WorkspaceError(f"the text to replace occurs {n} times in {path}; include more of it")
        return self.write(path, text.replace(old, new, 1))

    # ---------------------------------------------------------------- runs
    def run(self, source: str, *, extra_files: dict[str, str | bytes] | None = None,
            trusted: bool = False) -> SandboxResult:
        """Run `source` in a fresh sandbox over a copy of the workspace (plus `extra_files`);
        SandboxKilled when the run was killed or crashed (module doc)."""
        self._open()
        self.runs += 1
        files = {**self.snapshot(), **(extra_files or {})}
        res = run_python(source, files=files, limits=self.limits.sandbox, isolation=self.isolation, trusted=trusted)
        check_run(res, self.isolation)
        return res

    def run_tests(self, test_files: list[str]) -> str:
        """Run the test_* functions of `test_files` (failures and a count), cut to
        max_output_chars."""
        res = self.run(TEST_RUNNER % (list(test_files),))
        text = res.stdout
        if res.stderr.strip():
            text += "\n" + res.stderr.strip()
        return cut_text(text.rstrip("\n"), self.limits.max_output_chars)


def check_run(res: SandboxResult, isolation: str) -> None:
    """Raise SandboxKilled for a run that was killed or crashed, RuntimeError when the sandbox
    itself cannot be built here."""
    if res.ok:
        return
    if res.reason == "setup_failed":
        # a program can fake the bootstrap's exit code and message: the machine is at fault
        # only when a trivial program fails the same way
        probe = run_python("print('ok')", isolation=isolation, limits=Limits(wall_s=20))
        if probe.reason == "setup_failed":
            raise RuntimeError(f"workspace: the sandbox ({isolation}) could not be built: {probe.stderr[-500:]}")
    raise SandboxKilled(res.reason or "unknown", res.stderr.strip()[-300:])


__all__ = ["QuotaExceeded", "SandboxKilled", "TEST_RUNNER", "Workspace", "WorkspaceError", "WorkspaceLimits",
           "check_run", "clean_stale_roots", "cleanup_roots", "cut_text", "kill_orphan_runs", "process_root"]
