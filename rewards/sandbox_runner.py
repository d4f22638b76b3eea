"""The sandbox's runner (the bootstrap, rewards/sandbox_boot.py, execs it): installs the
audit hook (now, or when a trusted harness asks) and runs main.py from the workspace as
__main__. Run as `python -I -S -B -c <this file's source> CONFIG`, like the bootstrap,
inside the sandbox (where this file's own path may not exist: a chroot); it imports
nothing from the project.

The program can reach the hook function (frames, tracebacks of the errors it raises),
so the hook is built to be useless to tamper with: no closure cells (their contents
can be rebound without any audit event), no global or builtin lookups (the program
can rebind builtins.any or posixpath._joinrealpath); everything it uses is a default
argument bound at install time, holding only immutable values and C functions. What
is left (rebinding __code__ / __defaults__ of a function) raises an audit event, which
the hook denies, and the object-graph walks that would find it (gc) are denied too.
"""
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


if __name__ == "__main__":
    _main()
