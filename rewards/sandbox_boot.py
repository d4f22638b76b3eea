"""The sandbox's bootstrap (rewards/sandbox.py runs it): builds the namespaces (if any),
drops privileges, sets the rlimits and execs the runner (rewards/sandbox_runner.py). It
runs with the caller's privileges; any failure exits SETUP_FAILED (125).

Run as `python -I -S -B -c <this file's source> CONFIG` (isolated, no site: nothing of
the environment or the venv is imported), CONFIG a hex-encoded marshal of a dict of
builtins written by the host (marshal needs no import; json costs ~10-30 ms of startup
per process here). It imports nothing from the project, so that it runs the same
whichever interpreter and path the host has; importing it (the host does, for
descendants()) runs nothing.
"""
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
    """Every process below `root`, found through /proc parent links, deepest last (a
    program that calls setsid() or double-forks is still below the sandbox's first
    process: in the namespace modes below pid 1, in "none" mode below the bootstrap, a
    subreaper). The host's supervisor uses this one too (rewards/sandbox.py)."""
    kids = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
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


if __name__ == "__main__":
    try:
        main()
    except BaseException as e:
        try:
            os.write(2, f"sandbox setup failed: {e!r}\n".encode())
        finally:
            os._exit(125)
