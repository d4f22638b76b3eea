"""Run untrusted Python (model output) in a contained child process.

    res = run_python("print(sum(range(10)))")
    res.ok, res.stdout, res.reason          # True, "45\\n", "ok"

Every run gets a fresh temporary workspace, a scrubbed environment, a new process
session (so the whole group can be killed), resource limits, and `python -I -S -B`
(no site-packages, no user site, no PYTHON* variables, no .pyc writes). On top of that
come as many of these layers as the machine allows:

| layer | what it stops | "root" | "userns" | "none" |
|---|---|---|---|---|
| new network namespace (no interfaces up) | any network access | yes | yes | audit hook only |
| new mount namespace + chroot into a tmpfs holding only /usr, the Python install (read-only) and the workspace | reading host files and secrets, writing outside the workspace | yes | yes | audit hook only |
| new pid namespace (the program is pid 1; when it dies the kernel kills everything it started) | stray or escaped children | yes | yes | process-group kill |
| unprivileged uid / capabilities dropped (no_new_privs) | undoing the above (chroot again, mount, ptrace) | own uid | caps dropped | - |
| rlimits: CPU, address space, file size, open files, core=0, processes | CPU burn, memory floods, huge files, fork bombs | yes | yes | yes (NPROC: see below) |
| workspace is a size-capped tmpfs | filling the host disk | yes | yes | file-count cap in the audit hook |
| wall-clock timeout, SIGKILL to the process group | hangs (sleep, blocking reads) | yes | yes | yes |
| audit hook (`sys.addaudithook`), installed before the program runs | opening files outside the workspace and the stdlib (writes: workspace only), listing directories, creating/removing/renaming/chmod-ing files outside the workspace, symlinks and hard links, sockets, fork/exec/spawn/subprocess/os.system, os.kill, ctypes and other native escape modules, raising rlimits | yes | yes | yes |

Isolation modes, picked once per process by probing (best first), or forced with
`$MOPD_SANDBOX_ISOLATION` (root | userns | none) or the `isolation=` argument:
- "root": the host runs as real root (a container): mount/net/pid/ipc/uts namespaces
  are made directly, then the program drops to a unique unprivileged uid (so
  RLIMIT_NPROC counts only this sandbox's processes; root itself is exempt from it).
- "userns": an unprivileged user namespace (ns-uid 0 mapped to the caller) plus the
  same namespaces; the capability bounding set is emptied, SECBIT_NOROOT is locked and
  no_new_privs set before the program is exec'd, so it holds no capabilities at all.
  RLIMIT_NPROC is counted per user namespace, so it bounds this sandbox alone (except
  when the caller is real root, which the kernel exempts; then "root" is used anyway).
- "none" (fallback, e.g. a container whose seccomp forbids unshare): rlimits, scrubbed
  env, tempdir cwd, process-group kill and the audit hook. The audit hook is NOT a
  security boundary against a determined attacker: crafted bytecode loaded with
  marshal.loads (not blocked: imports need it), an interpreter bug, or a thread racing
  the hook's path check against a rename are out of its reach; os.stat and friends are
  not audited, so a program can learn whether a host path exists (not its content).
  It blocks the ordinary ways. RLIMIT_NPROC is set to (the caller's current task count
  + nproc) when not root, because in this mode it counts all the caller's processes;
  as root it has no effect. A program that calls setsid() leaves the process group and
  can outlive the run, bounded by RLIMIT_CPU (forks are blocked by the hook, so only the
  program's own process could do that).

Checked on the development machine (Linux 6.18, running as root in a VM): "root" and
"userns" (the latter both as root and as an unprivileged user, where it is what CI
machines get) hold every layer above; tests/test_sandbox.py runs the hostile programs
in every mode that works where it runs. One sandboxed run costs ~0.1 s (two Python
start-ups and the mounts) on a loaded 2-core machine.

For test writers: `audit=False` (OS layers alone) is refused in "none" mode, where
os.kill(-1, 9) or a fork bomb would reach the host; as real root in "userns" mode the
kernel does not apply RLIMIT_NPROC, so never run a fork bomb there without the hook.

`available_isolations()` lists the modes that work here; `default_isolation()` is the
one `run_python` uses. A warning is logged once when only "none" works.

Results: `SandboxResult(ok, returncode, stdout, stderr, timed_out, reason, result,
isolation, wall_s)`. stdout/stderr are cut to `Limits.max_output_bytes`; `result` is
what the program wrote to file descriptor 3, a side channel for trusted harnesses
(rewards/code.py writes a per-run secret token there only after the tests passed).

Trusted harnesses: with `trusted=True` the source runs *before* the audit hook is
installed and gets a `sandbox_lockdown()` function in its globals that installs it
(irreversibly). rewards/code.py forks, locks down the child, runs the candidate there,
and keeps the test code in the parent, which the candidate can neither see nor touch.
"""
from __future__ import annotations

import itertools
import logging
import marshal
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

ISOLATIONS = ("root", "userns", "none")
SETUP_FAILED = 125  # exit code of the bootstrap when it could not build the sandbox
WORKDIR = "/work"   # the workspace path inside the namespace modes

# Unprivileged uids for "root" mode: one per run, so RLIMIT_NPROC counts one sandbox.
_UID_BASE = 1_700_000_000
_uid_counter = itertools.count()


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0          # wall clock, then SIGKILL to the whole process group
    cpu_s: int = 10               # RLIMIT_CPU per process (SIGXCPU, SIGKILL one second later)
    memory_mb: int = 1024         # RLIMIT_AS per process
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
    reason: str                   # ok | timeout | exit:N | signal:NAME | cpu_limit | setup_failed | error:...
    result: bytes = b""           # what the program wrote to fd 3 (trusted harnesses)
    isolation: str = ""
    wall_s: float = 0.0
    truncated: dict = field(default_factory=dict)  # {"stdout": bool, "stderr": bool}


# ------------------------------------------------------------------ in-sandbox code
# Both programs run under `python -I -S -B -c SRC CONFIG`, CONFIG a hex-encoded marshal
# of a dict of builtins written by the host (marshal needs no import; json costs ~10-30
# ms of startup per process here).

# The bootstrap: builds the namespaces (if any), drops privileges, sets the rlimits and
# execs the runner. Runs with the caller's privileges; any failure exits SETUP_FAILED.
_BOOT_SRC = r'''
import marshal, os, sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
ST_KEEP = MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048 | 4096  # + noatime, nodiratime, relatime
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 24, 28, 38
SECBITS_LOCKED_NOROOT = 0x2f  # NOROOT, NO_SETUID_FIXUP and KEEP_CAPS, all locked


def libc():
    import ctypes
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    lib.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return lib, ctypes


def check(ctypes, rc, what):
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def isolate(cfg):
    lib, ctypes = libc()
    enc = lambda s: None if s is None else os.fsencode(s)
    def mount(src, dst, fstype, flags, data=None):
        check(ctypes, lib.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), f"mount {src} -> {dst}")
    userns = cfg["mode"] == "userns"
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    check(ctypes, lib.unshare(flags | (CLONE_NEWUSER if userns else 0)), "unshare")
    if userns:
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    os.umask(0o022)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = cfg["root_dir"]
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=755")
    for src in cfg["ro_binds"]:            # /usr, the Python install, ... read-only
        dst = root + src
        if os.path.isdir(src):
            os.makedirs(dst, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            open(dst, "w").close()
        mount(src, dst, None, MS_BIND | MS_REC)
        keep = os.statvfs(src).f_flag & ST_KEEP   # flags the kernel locks must be kept
        mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | keep)
    for link, target in cfg["symlinks"]:   # /bin -> usr/bin and friends
        os.makedirs(os.path.dirname(root + link), exist_ok=True)
        os.symlink(target, root + link)
    os.makedirs(root + "/dev", exist_ok=True)
    for dev in cfg["dev_nodes"]:
        if os.path.exists(dev):
            open(root + dev, "w").close()
            mount(dev, root + dev, None, MS_BIND)
    work = root + cfg["workdir"]
    os.makedirs(work)
    opts = f"size={cfg['limits']['workspace_mb']}m,mode=0700"
    if not userns:
        opts += f",uid={cfg['uid']},gid={cfg['uid']}"
    mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    files = cfg["files_dir"]
    for dirpath, dirnames, filenames in os.walk(files):
        rel = os.path.relpath(dirpath, files)
        dst_dir = work if rel == "." else os.path.join(work, rel)
        os.makedirs(dst_dir, exist_ok=True)
        if not userns:
            os.chown(dst_dir, cfg["uid"], cfg["uid"])
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                data = f.read()
            dst = os.path.join(dst_dir, name)
            with open(dst, "wb") as f:
                f.write(data)
            if not userns:
                os.chown(dst, cfg["uid"], cfg["uid"])
    mount(None, root, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chroot(root)
    os.chdir(cfg["workdir"])
    return lib, ctypes


def drop_privileges(cfg, lib, ctypes):
    if cfg["mode"] == "root":
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])          # real, effective and saved: every capability is gone
    else:
        for cap in range(64):          # empty the bounding set (EINVAL past the last cap)
            lib.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
        check(ctypes, lib.prctl(PR_SET_SECUREBITS, SECBITS_LOCKED_NOROOT, 0, 0, 0), "securebits")
    check(ctypes, lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    # after the uid change (which clears it): die with the bootstrap, even after setsid()
    check(ctypes, lib.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "pdeathsig")


def user_tasks(uid):
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    n += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                pass
    return n


def set_limits(cfg):
    import resource as r
    lim = cfg["limits"]
    def cap(kind, soft, hard=None):
        hard = soft if hard is None else hard
        old_soft, old_hard = r.getrlimit(kind)
        if old_hard != r.RLIM_INFINITY:
            hard, soft = min(hard, old_hard), min(soft, old_hard)
        r.setrlimit(kind, (soft, hard))
    cap(r.RLIMIT_CPU, lim["cpu_s"], lim["cpu_s"] + 1)
    cap(r.RLIMIT_AS, lim["memory_mb"] << 20)
    cap(r.RLIMIT_FSIZE, lim["fsize_mb"] << 20)
    cap(r.RLIMIT_NOFILE, lim["nofile"])
    cap(r.RLIMIT_CORE, 0)
    nproc = lim["nproc"]
    if cfg["mode"] == "none" and os.geteuid() != 0:
        nproc += user_tasks(os.getuid())   # here NPROC counts all the caller's tasks
    cap(r.RLIMIT_NPROC, nproc)


def forward(status):
    if os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status))
    sig = os.WTERMSIG(status)
    import signal
    try:
        signal.signal(sig, signal.SIG_DFL)
    except (OSError, ValueError):
        pass
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)


def main():
    cfg = marshal.loads(bytes.fromhex(sys.argv[1]))
    if cfg["result_fd"] != 3:
        os.dup2(cfg["result_fd"], 3)
        os.close(cfg["result_fd"])
    if cfg["mode"] != "none":
        lib, ctypes = isolate(cfg)
        pid = os.fork()
        if pid:                        # outside the pid namespace: wait, pass the status on
            while True:
                try:
                    forward(os.waitpid(pid, 0)[1])
                except InterruptedError:
                    continue
        drop_privileges(cfg, lib, ctypes)   # pid 1 of the new pid namespace
    set_limits(cfg)
    py = cfg["python"]
    os.execve(py, [py, "-I", "-S", "-B", "-c", cfg["runner_src"], marshal.dumps(cfg["runner"]).hex()], cfg["env"])


try:
    main()
except BaseException as e:
    try:
        os.write(2, f"sandbox setup failed: {e!r}\n".encode())
    finally:
        os._exit(125)
'''

# The runner: installs the audit hook (now, or when a trusted harness asks) and runs
# main.py from the workspace as __main__. Its state lives in closures of _main, out of
# reach of the program (no module globals; the hook cannot be removed).
_RUNNER_SRC = r'''
import sys


def _main():
    import builtins, marshal, os
    cfg = marshal.loads(bytes.fromhex(sys.argv[1]))
    sys.argv[:] = [cfg["main"]]
    workspace = os.path.realpath(os.getcwd())
    roots = [os.path.realpath(p) for p in sys.path if p]
    roots += ["/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/usr/share/zoneinfo"]
    roots = tuple(sorted(set(roots)))
    max_writes = cfg["max_write_files"]
    audit = cfg["audit"]
    writes = [0]
    o_write = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    realpath, join, getcwd, fsdecode = os.path.realpath, os.path.join, os.getcwd, os.fsdecode

    def inside(p, root):
        return p == root or p.startswith(root.rstrip("/") + "/")

    def allow(path, write):
        if path is None or isinstance(path, int):
            return                      # an already open descriptor
        p = fsdecode(path)
        rp = realpath(join(getcwd(), p))
        if inside(rp, workspace):
            if write:
                writes[0] += 1
                if writes[0] > max_writes:
                    raise PermissionError(f"sandbox: more than {max_writes} files written")
            return
        if not write and any(inside(rp, r) for r in roots):
            return
        raise PermissionError(f"sandbox: no {'write' if write else 'read'} access to {p!r}")

    deny_events = frozenset((
        "os.system", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.startfile",
        "os.kill", "os.killpg", "signal.pthread_kill", "pty.spawn", "subprocess.Popen",
        "resource.setrlimit", "resource.prlimit", "os.symlink", "os.link", "code.__new__", "os.chroot",
        "sys.remote_exec", "os.setuid", "os.setgid",
    ))
    deny_prefixes = ("socket.", "ctypes.", "_posixsubprocess", "urllib.", "http.", "ftplib.",
                     "smtplib.", "poplib.", "imaplib.", "nntplib.", "telnetlib.", "webbrowser.")
    deny_modules = frozenset(("ctypes", "_ctypes", "_posixsubprocess", "_xxsubinterpreters",
                              "_xxinterpchannels", "_interpreters", "cffi", "_cffi_backend"))
    one_path_write = frozenset(("os.mkdir", "os.rmdir", "os.remove", "os.truncate", "os.chmod",
                                "os.chown", "os.utime", "os.chflags", "os.lchflags", "os.mkfifo",
                                "os.mknod", "os.setxattr", "os.removexattr", "shutil.rmtree",
                                "shutil.chown"))

    def hook(event, args):
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            write = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & o_write)
            allow(path, write)
        elif event in ("os.listdir", "os.scandir", "os.chdir", "glob.glob", "glob.glob/2"):
            allow(args[0] if args and args[0] is not None else ".", False)
        elif event in one_path_write:
            allow(args[0], True)
        elif event in ("os.rename", "shutil.move"):   # both ends change
            allow(args[0], True)
            allow(args[1], True)
        elif event == "shutil.copyfile":
            allow(args[0], False)
            allow(args[1], True)
        elif event in deny_events or event.startswith(deny_prefixes):
            raise PermissionError(f"sandbox: {event} is not allowed")
        elif event == "import":
            top = str(args[0]).partition(".")[0]
            if top in deny_modules or top.startswith(("_test", "_xx")):
                raise ImportError(f"sandbox: import of {args[0]} is not allowed")

    installed = [False]

    def sandbox_lockdown():
        """Install the audit hook (idempotent, irreversible)."""
        if audit and not installed[0]:
            sys.addaudithook(hook)
        installed[0] = True

    with open(cfg["main"], "rb") as f:
        src = f.read()
    code = compile(src, cfg["main"], "exec")
    g = {"__name__": "__main__", "__file__": cfg["main"], "__builtins__": builtins}
    if cfg["trusted"]:
        g["sandbox_lockdown"] = sandbox_lockdown
    else:
        sandbox_lockdown()
    del cfg, src, f
    exec(code, g)


_main()
'''


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


def _wait(proc: subprocess.Popen, wall_s: float) -> bool:
    """Wait for the sandbox's first process; kill its whole group when it exits or times
    out. Returns timed_out. The exit is observed without reaping (a pidfd, else waitid
    with WNOWAIT) so that the group id cannot be reused by an unrelated process before
    the group is killed."""
    deadline = time.monotonic() + wall_s
    timed_out = False
    pidfd = None
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        pass
    try:
        if pidfd is not None:   # readable once the process has exited
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                try:
                    if poller.poll(max(1, int(left * 1000))):
                        break
                except InterruptedError:
                    continue
        else:
            delay = 0.002
            while True:
                try:
                    info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                except ChildProcessError:
                    info = True
                if info is not None:
                    break
                if time.monotonic() >= deadline:
                    timed_out = True
                    break
                time.sleep(delay)
                delay = min(delay * 1.5, 0.02)
    finally:
        if pidfd is not None:
            os.close(pidfd)
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), lambda: os.kill(proc.pid, signal.SIGKILL)):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()
    return timed_out


def run_python(source: str, *, files: dict[str, str | bytes] | None = None, stdin: bytes | str = b"",
               limits: Limits | None = None, isolation: str | None = None, trusted: bool = False,
               audit: bool = True) -> SandboxResult:
    """Run `source` as __main__ in a fresh sandbox (see the module docstring).

    files:     extra files for the workspace, {relative name: content}
    stdin:     what the program reads on stdin
    isolation: "root" | "userns" | "none"; default: the best mode that works here
    trusted:   run `source` before the audit hook, with `sandbox_lockdown()` to install it
    audit:     False leaves the audit hook out (tests of the OS layers alone; refused
               with isolation "none"). Never run a fork bomb with audit=False in
               "userns" mode as real root: the kernel exempts root from RLIMIT_NPROC.
    Never raises for anything the program does; a failure to build the sandbox is
    reported as reason "setup_failed"."""
    limits = limits or Limits()
    mode = isolation or default_isolation()
    if mode not in ISOLATIONS:
        raise ValueError(f"sandbox: unknown isolation {mode!r}; expected one of {ISOLATIONS}")
    if not audit and mode == "none":
        # Nothing but rlimits would be left: os.kill(-1, 9) or a fork bomb run as the
        # caller (as root: unlimited) would take the host down.
        raise ValueError("sandbox: audit=False needs a namespace isolation ('root' or 'userns')")
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="mopd-sandbox-")
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
        uid = _UID_BASE + (os.getpid() % 1000) * 100_000 + next(_uid_counter) % 100_000
        env = _clean_env(workdir)
        out_path, err_path, res_path = (os.path.join(tmp, n) for n in ("stdout", "stderr", "result"))
        cfg = {
            "mode": mode, "python": _python(), "runner_src": _RUNNER_SRC, "env": env,
            "root_dir": root_dir, "files_dir": files_dir, "workdir": WORKDIR,
            "ro_binds": binds, "symlinks": links,
            "dev_nodes": ["/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"],
            "uid": uid, "limits": {
                "cpu_s": int(limits.cpu_s), "memory_mb": int(limits.memory_mb), "nproc": int(limits.nproc),
                "fsize_mb": int(limits.fsize_mb), "nofile": int(limits.nofile),
                "workspace_mb": int(limits.workspace_mb)},
            "runner": {"main": "main.py", "trusted": bool(trusted), "audit": bool(audit),
                       "max_write_files": int(limits.max_write_files)},
        }
        with open(stdin_path, "rb") as fin, open(out_path, "wb") as fout, open(err_path, "wb") as ferr, \
                open(res_path, "wb") as fres:
            cfg["result_fd"] = fres.fileno()
            cmd = [_python(), "-I", "-S", "-B", "-c", _BOOT_SRC, marshal.dumps(cfg).hex()]
            try:
                proc = subprocess.Popen(cmd, stdin=fin, stdout=fout, stderr=ferr, cwd=files_dir, env=env,
                                        start_new_session=True, close_fds=True, pass_fds=(fres.fileno(),))
            except OSError as e:
                return SandboxResult(False, None, "", str(e), False, f"error:{type(e).__name__}",
                                     isolation=mode, wall_s=time.perf_counter() - t0)
            timed_out = _wait(proc, limits.wall_s)
        cap = limits.max_output_bytes
        out, out_cut = _read_capped(out_path, cap)
        err, err_cut = _read_capped(err_path, cap)
        result, _ = _read_capped(res_path, cap)
        stderr = err.decode("utf-8", "replace")
        rc = proc.returncode
        return SandboxResult(ok=(rc == 0 and not timed_out), returncode=rc,
                             stdout=out.decode("utf-8", "replace"), stderr=stderr, timed_out=timed_out,
                             reason=_reason(rc, timed_out, stderr), result=result, isolation=mode,
                             wall_s=time.perf_counter() - t0, truncated={"stdout": out_cut, "stderr": err_cut})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- picking the mode

_probe_lock = threading.Lock()
_probed: dict[str, bool] = {}


def _probe(mode: str) -> bool:
    with _probe_lock:
        if mode not in _probed:
            if mode == "root" and os.geteuid() != 0:
                _probed[mode] = False
            else:
                res = run_python("print('sandbox-ok')", isolation=mode, limits=Limits(wall_s=20))
                _probed[mode] = res.ok and res.stdout == "sandbox-ok\n"
                if not _probed[mode]:
                    log.info("sandbox isolation %r unavailable here: %s %s", mode, res.reason, res.stderr.strip()[-300:])
        return _probed[mode]


def available_isolations() -> list[str]:
    """The isolation modes that work on this machine, best first (probed once each)."""
    return [m for m in ISOLATIONS if _probe(m)]


_default: list[str] = []


def default_isolation() -> str:
    """$MOPD_SANDBOX_ISOLATION if set, else the best mode that works here."""
    forced = os.environ.get("MOPD_SANDBOX_ISOLATION", "").strip()
    if forced:
        if forced not in ISOLATIONS:
            raise ValueError(f"MOPD_SANDBOX_ISOLATION={forced!r}; expected one of {ISOLATIONS}")
        return forced
    if not _default:
        best = next((m for m in ISOLATIONS if _probe(m)), "none")
        if best == "none":
            log.warning("sandbox: no namespaces available (unshare refused); running untrusted code with "
                        "rlimits and an audit hook only. See rewards/sandbox.py for what that leaves open.")
        _default.append(best)
    return _default[0]
