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
  hardened against tampering (see _RUNNER_SRC) but is NOT a security boundary against
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
# Both programs run under `python -I -S -B -c SRC CONFIG`, CONFIG a hex-encoded marshal
# of a dict of builtins written by the host (marshal needs no import; json costs ~10-30
# ms of startup per process here).

# The bootstrap: builds the namespaces (if any), drops privileges, sets the rlimits and
# execs the runner. Runs with the caller's privileges; any failure exits SETUP_FAILED.
_BOOT_SRC = r'''
import _signal, marshal, os, sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
ST_KEEP = MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048 | 4096  # + noatime, nodiratime, relatime
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 24, 28, 38
PR_SET_CHILD_SUBREAPER, PR_SET_KEEPCAPS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE = 36, 8, 47, 2
CAP_DAC_READ_SEARCH = 2
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


def die_with_parent(lib, ctypes, parent_alive, sig=9):
    """Signal `sig` when the parent thread exits. A parent that died before the request
    was in place sends nothing, hence the check after it; nobody is left to report to."""
    check(ctypes, lib.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0), "pdeathsig")
    if not parent_alive():
        os._exit(125)


def pipe_open(r):
    """Does the other end of the pipe still have a writer? (EOF: no.) Unlike getppid(),
    this works across the pid namespace, where pid 1 sees its parent as pid 0."""
    os.set_blocking(r, False)
    try:
        return os.read(r, 1) != b""
    except BlockingIOError:
        return True


def isolate(cfg, lib, ctypes):
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
    # /usr, the Python install, ... read-only at their own paths; import paths (packages
    # such as torch) under /opt/mopd-import/<i>, clear of the workspace's /work
    for src, at in [(p, p) for p in cfg["ro_binds"]] + cfg["import_binds"]:
        dst = root + at
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


def keep_read_search(lib, ctypes):
    """Through the uid change and the exec, keep CAP_DAC_READ_SEARCH alone (for an
    interpreter installed where others cannot read, e.g. under /root): ambient."""
    for cap in range(64):
        if cap != CAP_DAC_READ_SEARCH:
            lib.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    check(ctypes, lib.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0), "keepcaps")
    return ctypes


def raise_read_search(lib, ctypes):
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
    bit = 1 << CAP_DAC_READ_SEARCH
    data = (Data * 2)(Data(bit, bit, bit), Data(0, 0, 0))
    check(ctypes, lib.capset(ctypes.byref(Header(0x20080522, 0)), data), "capset")
    check(ctypes, lib.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_DAC_READ_SEARCH, 0, 0), "ambient")


def drop_privileges(cfg, lib, ctypes):
    if cfg["mode"] == "root" or (cfg["mode"] == "none" and os.geteuid() == 0):
        keep = cfg["mode"] == "none" and cfg["needs_read_search"]
        if keep:
            keep_read_search(lib, ctypes)
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])          # real, effective and saved: every capability is gone
        if keep:
            raise_read_search(lib, ctypes)
    elif cfg["mode"] == "userns":
        for cap in range(64):          # empty the bounding set (EINVAL past the last cap)
            lib.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
        check(ctypes, lib.prctl(PR_SET_SECUREBITS, SECBITS_LOCKED_NOROOT, 0, 0, 0), "securebits")
    check(ctypes, lib.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


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
    if cfg["mode"] == "none" and os.getuid() != cfg["uid"]:
        nproc += user_tasks(os.getuid())   # the caller's uid: NPROC counts all its tasks
    cap(r.RLIMIT_NPROC, nproc)


def descendants(root):
    """Every process below `root` (by /proc parent links), deepest last."""
    kids = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    ppid = int(f.read().rpartition(b")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        for k in kids.get(todo.pop(), ()):
            out.append(k)
            todo.append(k)
    return out


def kill_descendants():
    """SIGKILL everything below this process until nothing is left, reaping as it goes
    (as the subreaper, orphans of the program are our children)."""
    me = os.getpid()
    for _ in range(200):
        left = descendants(me)
        for pid in left:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if not left:
            return


child = []   # the program's pid, once forked


def on_host_death(none_mode):
    """Take the whole sandbox down, then go. Not left to the program's own death signal:
    a program past the audit hook could clear that (prctl), never ours."""
    if child:
        try:
            os.kill(child[0], 9)       # namespace modes: pid 1, whose death ends the rest
        except OSError:
            pass
    if none_mode:                      # everything is below us, its subreaper
        kill_descendants()
    os._exit(125)


def fork_program():
    """fork(), the child's pid recorded before a host-death signal can be handled."""
    _signal.pthread_sigmask(_signal.SIG_BLOCK, [15])
    pid = os.fork()
    if pid:
        child.append(pid)
    else:
        _signal.signal(15, _signal.SIG_DFL)
    _signal.pthread_sigmask(_signal.SIG_UNBLOCK, [15])
    return pid


def supervise(pid, sweep):
    while True:
        try:
            status = os.waitpid(pid, 0)[1]
            break
        except InterruptedError:
            continue
    if sweep:
        kill_descendants()
    forward(status)


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
    lib, ctypes = libc()
    # First of all: a host killed outright leaves nobody to enforce the wall clock. SIGTERM
    # rather than SIGKILL, so that we take the sandbox with us (on_host_death): in "none"
    # mode the program's forks and their orphans are tied to nothing but us.
    none_mode = cfg["mode"] == "none"
    _signal.signal(15, lambda *_: on_host_death(none_mode))
    die_with_parent(lib, ctypes, lambda: os.getppid() == cfg["host_pid"], 15)
    if cfg["cgroup_procs"]:            # before any other process: every later one is charged there
        try:
            with open(cfg["cgroup_procs"], "w") as f:
                f.write(str(os.getpid()))
        except OSError:                # the supervisor sees an empty cgroup and samples instead
            pass
    if cfg["result_fd"] != 3:
        os.dup2(cfg["result_fd"], 3)
        os.close(cfg["result_fd"])
    # We keep the write end for as long as we live: the program's way to see we are gone
    # (made after fd 3 is in place, so it cannot take that number).
    r, w = os.pipe()
    if cfg["mode"] != "none":
        isolate(cfg, lib, ctypes)
        pid = fork_program()
        if pid:                        # outside the pid namespace: wait, pass the status on
            os.close(r)
            supervise(pid, False)      # pid 1's death kills the namespace
        os.close(w)                    # pid 1 of the new pid namespace
        die_with_parent(lib, ctypes, lambda: pipe_open(r))
        drop_privileges(cfg, lib, ctypes)
    else:
        # No pid namespace: stay behind as the subreaper, so that whatever the program
        # starts stays below us (setsid, double forks), and kill all of it when the
        # program ends, whatever it patched in itself (os._exit, signal handlers).
        check(ctypes, lib.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "subreaper")
        if os.geteuid() == 0:          # the program gets its own unprivileged uid
            for dirpath, dirnames, filenames in os.walk("."):
                for name in [dirpath] + [os.path.join(dirpath, n) for n in filenames]:
                    os.chown(name, cfg["uid"], cfg["uid"])
        pid = fork_program()
        if pid:
            os.close(r)
            supervise(pid, True)
        os.close(w)
        die_with_parent(lib, ctypes, lambda: pipe_open(r))
        drop_privileges(cfg, lib, ctypes)
    # again: a uid change clears it (and survives setsid() and the exec that follow)
    die_with_parent(lib, ctypes, lambda: pipe_open(r))
    os.close(r)
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
# main.py from the workspace as __main__.
#
# The program can reach the hook function (frames, tracebacks of the errors it raises),
# so the hook is built to be useless to tamper with: no closure cells (their contents
# can be rebound without any audit event), no global or builtin lookups (the program
# can rebind builtins.any or posixpath._joinrealpath); everything it uses is a default
# argument bound at install time, holding only immutable values and C functions. What
# is left (rebinding __code__ / __defaults__ of a function) raises an audit event, which
# the hook denies, and the object-graph walks that would find it (gc) are denied too.
_RUNNER_SRC = r'''
import sys


def _make_hook(workspace, roots, max_writes):
    import itertools, os
    FunctionType = type(_make_hook)
    o_write = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC

    def real(p, lstat=os.lstat, readlink=os.readlink, PE=PermissionError, OSE=OSError):
        """os.path.realpath of an absolute str, from C calls only."""
        todo = p.split("/")[::-1]
        out = []
        links = 0
        while todo:
            name = todo.pop()
            if not name or name == ".":
                continue
            if name == "..":
                if out:
                    out.pop()
                continue
            cand = "/" + "/".join(out) + ("/" if out else "") + name
            try:
                is_link = (lstat(cand).st_mode & 0o170000) == 0o120000
            except OSE:
                is_link = False
            if not is_link:
                out.append(name)
                continue
            links += 1
            if links > 40:
                raise PE("sandbox: too many levels of symbolic links")
            target = readlink(cand)
            if target.startswith("/"):
                out = []
            todo.extend(target.split("/")[::-1])
        return "/" + "/".join(out)

    def inside(p, root):
        return p == root or p.startswith(root.rstrip("/") + "/")

    def allow(path, write, is_os_open=False, workspace=workspace, roots=roots, max_writes=max_writes,
              count=itertools.count(1).__next__, T=type, sub=issubclass, S=str, B=bytes, I=int,
              s_copy=str.__str__, b_decode=bytes.decode, getcwd=os.getcwd, stat=os.stat,
              real=real, inside=inside, PE=PermissionError, OSE=OSError):
        if path is None or sub(T(path), I):
            return                      # an already open descriptor
        # Exact str/bytes only: a str subclass could answer startswith() falsely, a
        # path-like object's __fspath__ could name another file for the real call.
        t = T(path)
        if sub(t, S):
            p = s_copy(path)
        elif sub(t, B):
            p = b_decode(path, "utf-8", "surrogateescape")
        else:
            raise PE("sandbox: paths must be str or bytes here")   # no code of theirs in the hook
        rp = real(p if p.startswith("/") else getcwd() + "/" + p)
        if inside(rp, workspace):
            if write and count() > max_writes:
                raise PE(f"sandbox: more than {max_writes} files written")
            return
        if not write:
            for r in roots:
                if inside(rp, r):
                    if is_os_open:
                        # A descriptor of a directory outside the workspace would let
                        # os.open(..., dir_fd=) write anywhere (the event has no dir_fd).
                        try:
                            is_dir = (stat(rp).st_mode & 0o170000) == 0o040000
                        except OSE:
                            is_dir = False
                        if is_dir:
                            raise PE(f"sandbox: no descriptor for directory {p!r}")
                    return
        raise PE(f"sandbox: no {'write' if write else 'read'} access to {p!r}")

    deny_events = frozenset((
        "os.system", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.startfile",
        "os.kill", "os.killpg", "signal.pthread_kill", "pty.spawn", "subprocess.Popen",
        "resource.setrlimit", "resource.prlimit", "os.symlink", "os.link", "code.__new__", "os.chroot",
        "sys.remote_exec", "os.setuid", "os.setgid",
        # ways to find and rewrite the hook, or to watch every frame
        "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
        "sys._current_exceptions", "sys.settrace", "sys.setprofile", "sys.addaudithook",
    ))
    deny_prefixes = ("socket.", "ctypes.", "_posixsubprocess", "urllib.", "http.", "ftplib.",
                     "smtplib.", "poplib.", "imaplib.", "nntplib.", "telnetlib.", "webbrowser.")
    deny_modules = frozenset(("ctypes", "_ctypes", "_posixsubprocess", "_xxsubinterpreters",
                              "_xxinterpchannels", "_interpreters", "cffi", "_cffi_backend"))
    one_path_write = frozenset(("os.mkdir", "os.rmdir", "os.remove", "os.truncate", "os.chmod",
                                "os.chown", "os.utime", "os.chflags", "os.lchflags", "os.mkfifo",
                                "os.mknod", "os.setxattr", "os.removexattr", "shutil.rmtree",
                                "shutil.chown"))
    func_attrs = frozenset(("__code__", "__defaults__", "__kwdefaults__", "__globals__", "__closure__"))

    def hook(event, args, allow=allow, deny_events=deny_events, deny_prefixes=deny_prefixes,
             deny_modules=deny_modules, one_path_write=one_path_write, func_attrs=func_attrs,
             o_write=o_write, FunctionType=FunctionType, T=type, sub=issubclass, S=str, I=int,
             s_copy=str.__str__, tuple_=tuple, PE=PermissionError, IE=ImportError):
        if event == "open":
            a = tuple_(args) + (None, None, None)
            path, mode, flags = a[0], a[1], a[2]
            if sub(T(mode), S):
                m = s_copy(mode)
                write = "w" in m or "a" in m or "x" in m or "+" in m
            else:
                write = False
            if sub(T(flags), I) and flags & o_write:
                write = True
            allow(path, write, mode is None)
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
        elif event == "object.__setattr__" or event == "object.__delattr__":
            if args and sub(T(args[0]), FunctionType) and args[1] in func_attrs:
                raise PE(f"sandbox: rewriting a function's {args[1]} is not allowed")
        elif event in deny_events or event.startswith(deny_prefixes):
            raise PE(f"sandbox: {event} is not allowed")
        elif event == "import":
            name = args[0]
            top = s_copy(name).partition(".")[0] if sub(T(name), S) else ""
            if top in deny_modules or top.startswith("_test") or top.startswith("_xx"):
                raise IE(f"sandbox: import of {top} is not allowed")

    return hook


# Process calls that raise no audit event: pidfd_send_signal (a signal to any process by
# pid), setsid/setpgid (leaving the process group the supervisor kills), getpgid/getsid
# (enumerating other processes' groups), scheduling of other processes. Removing them
# is only a speed bump (a fresh copy of the module can be built through _imp); what
# holds is the OS: a pid namespace, or in "none" mode an unprivileged uid (as root) and
# the supervisor killing every descendant, wherever it moved to.
_STRIP = {"posix": ("pidfd_open", "setsid", "setpgid", "setpgrp", "getpgid", "getsid", "tcsetpgrp",
                    "setpriority", "sched_setscheduler", "sched_setparam", "sched_setaffinity",
                    "setns", "unshare", "killpg"),
          "_signal": ("pidfd_send_signal", "pthread_kill", "sigqueue")}


def _strip():
    for mod_name, names in _STRIP.items():
        mods = [sys.modules.get(mod_name), sys.modules.get({"posix": "os", "_signal": "signal"}[mod_name])]
        for mod in mods:
            for name in names:
                if mod is not None and name in mod.__dict__:
                    delattr(mod, name)


def _main():
    import builtins, marshal, os
    cfg = marshal.loads(bytes.fromhex(sys.argv[1]))
    sys.argv[:] = [cfg["main"]]
    sys.path.extend(cfg.get("import_paths", ()))   # read-only, like the stdlib (run_python's import_paths)
    workspace = os.path.realpath(os.getcwd())
    roots = [os.path.realpath(p) for p in sys.path if p]
    roots += ["/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/usr/share/zoneinfo"]
    roots = tuple(sorted(set(roots)))
    hook_args = (workspace, roots, cfg["max_write_files"])
    audit = cfg["audit"]

    with open(cfg["main"], "rb") as f:
        src = f.read()
    code = compile(src, cfg["main"], "exec")
    g = {"__name__": "__main__", "__file__": cfg["main"], "__builtins__": builtins}
    if cfg["trusted"]:
        g["sandbox_lockdown"] = _lockdown(g, hook_args, audit)
    else:
        _strip()
        if audit:
            sys.addaudithook(_make_hook(*hook_args))   # no local keeps the hook
    del cfg, src, f, hook_args
    exec(code, g)


def _lockdown(g, hook_args, audit):
    def sandbox_lockdown():
        """Install the audit hook (irreversible; later calls do nothing)."""
        _strip()
        if audit:
            sys.addaudithook(_make_hook(*hook_args))
        g["sandbox_lockdown"] = _done   # drop this closure: the hook's arguments go with it
    return sandbox_lockdown


def _done():
    pass


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


def _descendants(root: int) -> list[int]:
    """Every process below `root`, found through /proc parent links (a program that
    calls setsid() or double-forks is still below the sandbox's first process: in the
    namespace modes below pid 1, in "none" mode below the bootstrap, a subreaper)."""
    kids: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rpartition(b")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        for k in kids.get(todo.pop(), ()):
            out.append(k)
            todo.append(k)
    return out


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

    @classmethod
    def create(cls, name: str, limit: int) -> "_Cgroup | None":
        try:
            with open("/proc/self/cgroup") as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        for line in lines:
            _, controllers, rel = line.split(":", 2)
            if controllers == "" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
                base, v2 = "/sys/fs/cgroup" + rel, True
                try:
                    with open(os.path.join(base, "cgroup.subtree_control")) as f:
                        if "memory" not in f.read().split():
                            continue
                except OSError:
                    continue
            elif "memory" in controllers.split(",") and os.path.isdir("/sys/fs/cgroup/memory"):
                base, v2 = "/sys/fs/cgroup/memory" + rel, False
            else:
                continue
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
        left = _descendants(root)
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
            rss = _rss_bytes([proc.pid, *_descendants(proc.pid)])
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
    return mode
