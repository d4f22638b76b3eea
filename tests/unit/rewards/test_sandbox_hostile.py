"""rewards/sandbox.py against a hostile program that attacks the sandbox itself (issue #20):
tampering with the in-process guard (the audit hook), signals through pidfds, sessions
that outlive the run, process-group enumeration and multi-process memory bombs.

Every attack runs in every isolation mode that works here and always in "none" (the
audit-hook-only fallback must hold against the same attacks). A program prints
"PWNED:<what>" for each thing it managed and exits 0 only if something worked, so each
test checks both that the host is unharmed and that the run is not a pass.

Safety: the attacks aim only at things the test owns (a `sleep` it started, files in its
tmp_path, a socket it listens on), so even a broken sandbox cannot hurt the machine."""
from __future__ import annotations

import ast
import dis
import os
import socket
import subprocess
import time
import types

import pytest

from rewards import sandbox
from rewards.sandbox import Limits, available_isolations, run_python

MODES = sorted(set(available_isolations()) | {"none"})
FAST = Limits(wall_s=8, cpu_s=4, memory_mb=512)


@pytest.fixture
def victim():
    """A host process (in its own process group) the program will try to kill."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    yield server
    server.close()


def _proofs(tmp_path, victim_pid: int, port: int) -> str:
    """What a program does once it believes the guard is gone: each step on its own."""
    secret = tmp_path / "secret.txt"
    secret.write_text("file-secret-0815")
    return f"""
def _try(name, fn):
    try:
        fn()
        print("PWNED:" + name, flush=True)
        return True
    except BaseException as e:
        print("blocked:", name, type(e).__name__, e, flush=True)
        return False

def _read():
    print(open({str(secret)!r}).read())
def _write():
    open({str(tmp_path / 'pwned.txt')!r}, "w").write("x")
def _connect():
    import socket
    socket.create_connection(("127.0.0.1", {port}), timeout=1).sendall(b"leak")
def _kill():
    import os
    os.kill({victim_pid}, 9)

_hits = [_try(n, f) for n, f in (("read", _read), ("write", _write), ("connect", _connect), ("kill", _kill))]
import sys
sys.stdout.flush()
if True in _hits:   # not any(): an attack may have rebound it
    import os
    os._exit(0)
raise SystemExit(1)
"""


def _assert_unharmed(res, tmp_path, victim, listener):
    assert "PWNED" not in res.stdout, res.stdout + res.stderr
    assert "file-secret-0815" not in res.stdout
    assert not (tmp_path / "pwned.txt").exists()
    assert victim.poll() is None, "the host process was killed"
    with pytest.raises(BlockingIOError):
        listener.accept()
    assert not res.ok, res


# ------------------------------------------------------------------ tampering with the guard

NOOP = """
def _noop_code(n):
    # a do-nothing code object with n free variables: a function's __code__ may only be
    # replaced by one with as many free variables as the function has cells
    names = [f"v{i}" for i in range(n)]
    src = "def outer():\\n" + "".join(f"    {v} = None\\n" for v in names)
    src += "    def noop(*a, **k):\\n        " + (", ".join(names) if names else "pass")
    src += "\\n        return None\\n    return noop\\n"
    ns = {}
    exec(src, ns)
    return ns["outer"]().__code__
"""

TAMPER = {
    # the report's attack: find the hook through the garbage collector, swap its code
    "gc_code_swap": """
import gc
for o in gc.get_objects():
    if type(o) is type(_noop_code) and o.__code__.co_name in ("hook", "allow", "inside"):
        o.__code__ = _noop_code(len(o.__code__.co_freevars))
""",
    "gc_object_setattr": """
import gc
for o in gc.get_objects():
    if type(o) is type(_noop_code) and o.__code__.co_name in ("hook", "allow", "inside"):
        object.__setattr__(o, "__code__", _noop_code(len(o.__code__.co_freevars)))
""",
    # rebind the closure cells the guard reads (no audit event for cell_contents)
    "gc_closure_cells": """
import gc
for o in gc.get_objects():
    if type(o) is type(gc.get_objects) or not hasattr(o, "__closure__") or not o.__closure__:
        continue
    for name, cell in zip(o.__code__.co_freevars, o.__closure__):
        if name in ("workspace",):
            cell.cell_contents = "/"
        elif name in ("deny_events", "deny_modules", "one_path_write"):
            cell.cell_contents = frozenset()
        elif name == "deny_prefixes":
            cell.cell_contents = ("\\0",)
""",
    "gc_referents_walk": """
import gc, sys
seen, todo = set(), [sys.modules["__main__"]]
while todo:
    o = todo.pop()
    if id(o) in seen or len(seen) > 200000:
        continue
    seen.add(id(o))
    if type(o) is type(_noop_code) and o.__code__.co_name in ("hook", "allow", "inside"):
        o.__code__ = _noop_code(len(o.__code__.co_freevars))
    todo.extend(gc.get_referents(o))
""",
    # walk the frames up to the runner and tamper with every function and cell found
    "frame_walk": """
import sys
def _tamper(obj):
    if type(obj) is type(_noop_code) and obj is not _noop_code:
        for attr, val in (("__code__", _noop_code(len(obj.__code__.co_freevars))), ("__defaults__", None),
                          ("__kwdefaults__", None)):
            try:
                setattr(obj, attr, val)
            except BaseException:
                pass
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            if name == "workspace":
                cell.cell_contents = "/"
f = sys._getframe()
while f is not None:
    for v in list(f.f_locals.values()) + list(f.f_globals.values()):
        _tamper(v)
        for d in getattr(v, "__defaults__", None) or ():
            _tamper(d)
    f = f.f_back
""",
    # the hook's own frames, from the traceback of the error it raised
    "traceback_walk": """
try:
    open("/etc/passwd")
except BaseException as e:
    tb = e.__traceback__
    while tb is not None:
        loc = tb.tb_frame.f_locals
        for v in list(loc.values()):
            if type(v) is type(_noop_code):
                for name, cell in zip(v.__code__.co_freevars, v.__closure__ or ()):
                    if name == "workspace":
                        cell.cell_contents = "/"
                try:
                    v.__code__ = _noop_code(len(v.__code__.co_freevars))
                except BaseException:
                    pass
        tb = tb.tb_next
""",
    # a new function around the hook's code with our own defaults (types.FunctionType)
    "function_type_rebuild": """
import gc, types
for o in gc.get_objects():
    if type(o) is types.FunctionType and o.__code__.co_name == "hook" and o.__defaults__:
        o.__defaults__ = tuple(None for _ in o.__defaults__)
""",
    # rebind the builtins and library functions the guard calls
    "builtins_and_posixpath": """
import builtins, posixpath, os
builtins.any = lambda *a, **k: True
builtins.isinstance = lambda *a, **k: False
posixpath.realpath = os.path.realpath = lambda p, *a, **k: os.getcwd() + "/x"
posixpath._joinrealpath = lambda *a, **k: (os.getcwd() + "/x", True)
""",
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("attack", sorted(TAMPER))
def test_guard_survives_tampering(mode, attack, tmp_path, victim, listener):
    src = NOOP + TAMPER[attack] + _proofs(tmp_path, victim.pid, listener.getsockname()[1])
    res = run_python(src, isolation=mode, limits=FAST)
    _assert_unharmed(res, tmp_path, victim, listener)


PATH_TRICKS = {
    # a str subclass that lies to the guard's string checks
    "str_subclass": """
class S(str):
    def startswith(self, *a):
        return True
    def __eq__(self, o):
        return True
    __hash__ = str.__hash__
    def rstrip(self, *a):
        return "/"
print(open(S({secret!r})).read())
""",
    # __fspath__ answers the guard with a workspace file, the real open with the secret
    "fspath_toctou": """
class P:
    n = 0
    def __fspath__(self):
        P.n += 1
        return {secret!r} if P.n % 2 == 1 else "harmless.txt"
print(open(P()).read())
""",
    # a descriptor of a readable directory outside the workspace, then a write through dir_fd
    "dir_fd_write": """
import os
fd = os.open({outside_dir!r}, os.O_RDONLY)
os.write(os.open({probe_name!r}, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), b"x")
print("PWNED:dir_fd")
""",
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("attack", sorted(PATH_TRICKS))
def test_path_checks_cannot_be_fooled(mode, attack, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("file-secret-0815")
    outside_dir = os.path.dirname(os.__file__)   # the stdlib: readable in every mode
    probe_name = f"mopd_sandbox_probe_{os.getpid()}.txt"
    src = PATH_TRICKS[attack].format(secret=str(secret), outside_dir=outside_dir, probe_name=probe_name)
    try:
        res = run_python(src, isolation=mode, limits=FAST)
        assert not os.path.exists(os.path.join(outside_dir, probe_name))
    finally:
        if os.path.exists(os.path.join(outside_dir, probe_name)):
            os.remove(os.path.join(outside_dir, probe_name))
    assert "file-secret-0815" not in res.stdout and "PWNED" not in res.stdout, res.stdout + res.stderr
    assert not res.ok


def _code_objects(code: types.CodeType):
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _code_objects(c)


def test_guard_functions_hold_no_mutable_state():
    """Static check of the runner: the hook and its helpers have no closure cells and
    make no global or builtin lookups, so rebinding a cell, a builtin or a library
    function cannot change what they decide."""
    code = compile(sandbox._RUNNER_SRC, "<runner>", "exec")
    make_hook = next(c for c in _code_objects(code) if c.co_name == "_make_hook")
    guards = [c for c in _code_objects(make_hook) if c.co_name in ("hook", "allow", "real", "inside")]
    assert sorted(c.co_name for c in guards) == ["allow", "hook", "inside", "real"]
    for c in guards:
        assert c.co_freevars == () and c.co_cellvars == (), c.co_name
        lookups = {i.opname for i in dis.get_instructions(c)} & {"LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF",
                                                                   "LOAD_CLASSDEREF", "STORE_GLOBAL"}
        assert not lookups, (c.co_name, lookups)
    ast.parse(sandbox._RUNNER_SRC)


# ------------------------------------------------------------------ processes

PIDFD = {
    "pidfd_send_signal": """
import os, signal
signal.pidfd_send_signal(os.pidfd_open({pid}), 9)
print("PWNED:pidfd")
""",
    # the stripped functions rebuilt from a fresh copy of the builtin modules
    "pidfd_fresh_modules": """
import _imp, importlib.machinery as m
posix = _imp.create_builtin(m.BuiltinImporter.find_spec("posix"))
_signal = _imp.create_builtin(m.BuiltinImporter.find_spec("_signal"))
_signal.pidfd_send_signal(posix.pidfd_open({pid}), 9)
print("PWNED:pidfd")
""",
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("attack", sorted(PIDFD))
def test_pidfd_signals_do_not_reach_the_host(mode, attack, victim):
    if attack == "pidfd_fresh_modules" and mode == "none" and os.geteuid() != 0:
        pytest.xfail("'none' as an unprivileged caller: the program runs as the caller's uid, and "
                     "pidfd_send_signal raises no audit event (docs/sandbox.md, what 'none' cannot stop)")
    res = run_python(PIDFD[attack].format(pid=victim.pid), isolation=mode, limits=FAST)
    time.sleep(0.05)
    assert victim.poll() is None, "the host process was killed"
    assert "PWNED" not in res.stdout and not res.ok


@pytest.mark.parametrize("mode", MODES)
def test_process_groups_cannot_be_enumerated_or_killed(mode, victim):
    pgid = os.getpgid(victim.pid)
    src = f"""
import os
found = []
def attempt(name, fn):
    try:
        fn()
        print("PWNED:" + name, flush=True)
    except BaseException as e:
        print("blocked:", name, type(e).__name__)
attempt("getpgid", lambda: [os.getpgid(p) for p in ({victim.pid}, 1)])
attempt("getsid", lambda: os.getsid({victim.pid}))
attempt("list_proc", lambda: os.listdir("/proc"))
attempt("read_proc", lambda: open("/proc/{victim.pid}/stat").read())
attempt("killpg", lambda: os.killpg({pgid}, 9))
attempt("kill_minus_pgid", lambda: os.kill(-{pgid}, 9))
raise SystemExit(1)
"""
    res = run_python(src, isolation=mode, limits=FAST)
    time.sleep(0.05)
    assert victim.poll() is None
    assert not res.ok
    # in the namespace modes getpgid/getsid/proc may "work" but only see the sandbox itself
    bad = {"killpg", "kill_minus_pgid"} if mode != "none" else {"getpgid", "getsid", "list_proc", "read_proc",
                                                                 "killpg", "kill_minus_pgid"}
    for name in bad:
        assert f"PWNED:{name}" not in res.stdout, res.stdout


def _survivors(marker: str) -> list[int]:
    """Host processes that carry this run's marker in their (unchangeable) environment."""
    out = []
    needle = f"MOPD_SANDBOX_RUN={marker}".encode()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        out.append(int(name))
            except OSError:
                pass
    return out


ORPHANS = {
    # the report's attack, through the code harness's shape: a forked child (the
    # candidate's process) leaves the session and patches os._exit, so the harness's
    # final os._exit does nothing and the child sleeps on
    "setsid_patched_exit": """
import os, sys, time
print(os.environ["MOPD_SANDBOX_RUN"], flush=True)
if os.fork() == 0:
    sandbox_lockdown()
    try:
        os.setsid()
    except BaseException as e:
        print("blocked setsid", type(e).__name__, flush=True)
    os._exit = lambda *a: time.sleep(30)
    try:
        time.sleep(30)
    finally:
        os._exit(0)
sandbox_lockdown()
time.sleep(0.3)
""",
    # the same with setsid done before the guard (as if it had been bypassed) and a
    # double fork, so that the sleeper is nobody's child in the sandbox
    "double_fork_new_session": """
import os, time
print(os.environ["MOPD_SANDBOX_RUN"], flush=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        sandbox_lockdown()
        os._exit = lambda *a: time.sleep(30)
        signal = __import__("signal")
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        time.sleep(30)
    os._exit(0)
sandbox_lockdown()
time.sleep(0.3)
""",
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("attack", sorted(ORPHANS))
def test_nothing_outlives_the_run(mode, attack):
    res = run_python(ORPHANS[attack], isolation=mode, trusted=True, limits=FAST)
    marker = res.stdout.split()[0]
    assert marker
    time.sleep(0.2)
    assert _survivors(marker) == [], f"processes of the sandbox survived the run ({mode}, {attack})"
    assert not res.timed_out


@pytest.mark.parametrize("mode", MODES)
def test_setsid_is_denied_to_the_program(mode):
    for src in ("import os\nos.setsid()", "import os\nos.setpgid(0, 0)", "import os\nos.setpgrp()"):
        res = run_python(src, isolation=mode, limits=FAST)
        assert not res.ok and "AttributeError" in res.stderr, (src, res.stderr)


# ------------------------------------------------------------------ memory

BOMB_MB, BOMB_CHILDREN, CAP_MB = 96, 6, 256


def _cgroups_work() -> bool:
    if not hasattr(sandbox, "_Cgroup"):   # a sandbox without them (the tests must still collect)
        return False
    cg = sandbox._Cgroup.create(f"mopd-sandbox-probe-{os.getpid()}", 64 << 20)
    if cg is None:
        return False
    cg.remove()
    return True


CAP_KINDS = (["cgroup"] if _cgroups_work() else []) + ["sampling"]


@pytest.mark.parametrize("how", CAP_KINDS)
@pytest.mark.parametrize("mode", MODES)
def test_multi_process_memory_bomb_stays_under_the_sandbox_cap(mode, how, monkeypatch):
    """Six processes of 96 MB each (576 MB, each under its own 512 MB RLIMIT_AS) in a
    sandbox capped at 256 MB in all: the sandbox is killed. With a memory cgroup the
    kernel's own peak stays at or under the cap; with the supervisor's sampling (no
    cgroup here) the sampled peak passes it by at most what was allocated between two
    samples (POLL_S). The forks happen before the guard (trusted=True) so that the
    namespace modes and "none" face the same processes."""
    monkeypatch.setattr(sandbox, "USE_CGROUP", how == "cgroup")
    src = f"""
import os, time
for _ in range({BOMB_CHILDREN}):
    if os.fork() == 0:
        block = bytearray({BOMB_MB} << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        time.sleep(30)
        os._exit(0)
sandbox_lockdown()
time.sleep(30)
print("survived")
"""
    limits = Limits(wall_s=20, cpu_s=10, memory_mb=512, total_memory_mb=CAP_MB, nproc=32)
    t0 = time.monotonic()
    res = run_python(src, isolation=mode, trusted=True, limits=limits)
    elapsed = time.monotonic() - t0
    print(f"\n[{mode}, {how}] memory bomb: reason={res.reason} peak={res.peak_memory_mb:.1f} MB "
          f"(cap {CAP_MB} MB, attempted {BOMB_MB * BOMB_CHILDREN} MB) in {elapsed:.2f} s")
    assert not res.ok and res.reason == "memory_limit" and "survived" not in res.stdout
    assert not res.timed_out          # ended by the memory cap, not by the wall clock
    if how == "cgroup":
        assert 0 < res.peak_memory_mb <= CAP_MB, res.peak_memory_mb
    else:
        assert 0 < res.peak_memory_mb <= CAP_MB + 2 * BOMB_MB, res.peak_memory_mb


@pytest.mark.parametrize("how", CAP_KINDS)
def test_memory_cap_leaves_ordinary_programs_alone(how, monkeypatch):
    monkeypatch.setattr(sandbox, "USE_CGROUP", how == "cgroup")
    src = "x = bytearray(100 << 20)\nx[::4096] = b'1' * len(x[::4096])\nprint(len(x))"
    res = run_python(src, isolation="none", limits=Limits(wall_s=10, total_memory_mb=256))
    assert res.ok and res.stdout == f"{100 << 20}\n" and res.reason == "ok"


# ------------------------------------------------------------------ choosing the mode

def test_no_silent_fallback_to_none(monkeypatch, caplog):
    """Where no namespace works, the sandbox refuses instead of quietly running with
    the audit hook alone; choosing "none" explicitly works and says so once."""
    monkeypatch.delenv("MOPD_SANDBOX_ISOLATION", raising=False)
    monkeypatch.setattr(sandbox, "_probed", {"root": False, "userns": False, "none": True})
    monkeypatch.setattr(sandbox, "_default", [])
    monkeypatch.setattr(sandbox, "_warned", [])
    with pytest.raises(sandbox.SandboxUnavailable, match="MOPD_SANDBOX_ISOLATION=none"):
        run_python("print(1)")
    with pytest.raises(sandbox.SandboxUnavailable):
        sandbox.check_isolation()
    with caplog.at_level("WARNING", logger="rewards.sandbox"):
        assert sandbox.check_isolation("none") == "none"
        res = run_python("print(1)", isolation="none", limits=FAST)
    assert res.ok and res.isolation == "none"
    assert sum("not a security boundary" in r.getMessage() for r in caplog.records) == 1
    monkeypatch.setenv("MOPD_SANDBOX_ISOLATION", "none")
    assert sandbox.check_isolation() == "none"


@pytest.mark.parametrize("euid, says", [(0, False), (1000, True)])
def test_none_as_non_root_says_in_the_log_that_the_hook_stands_alone(monkeypatch, caplog, euid, says):
    """Issue 38: where the host is not root, `none` has no uid of its own to fall back
    on; the run's log says the audit hook is the only layer, and what it does not stop."""
    monkeypatch.setattr(sandbox, "_warned", [])
    with monkeypatch.context() as m, caplog.at_level("WARNING", logger="rewards.sandbox"):
        m.setattr(sandbox.os, "geteuid", lambda: euid)
        assert sandbox.check_isolation("none") == "none"
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "not a security boundary" in text
    assert ("the audit hook is the only layer" in text and "os.stat is not audited" in text) == says, text


def test_bad_isolation_setting_is_an_error(monkeypatch):
    monkeypatch.setenv("MOPD_SANDBOX_ISOLATION", "userns ")   # stripped: fine
    assert sandbox._env_isolation() == "userns"
    monkeypatch.setenv("MOPD_SANDBOX_ISOLATION", "usrns")
    with pytest.raises(ValueError, match="MOPD_SANDBOX_ISOLATION.*root, userns, none"):
        sandbox.check_isolation()
    with pytest.raises(ValueError, match="MOPD_SANDBOX_ISOLATION"):
        run_python("print(1)")
    with pytest.raises(ValueError, match="isolation"):
        sandbox.check_isolation("chroot")


def test_code_reward_raises_on_a_bad_isolation_setting(monkeypatch):
    """A typo must stop the run, not turn every code reward into 0.0."""
    from rewards.code import reward
    monkeypatch.setenv("MOPD_SANDBOX_ISOLATION", "usrns")
    cols = {"test": ["def check(c):\n    assert c(1) == 2\n"], "entry_point": ["f"], "domain": ["code"]}
    with pytest.raises(ValueError, match="MOPD_SANDBOX_ISOLATION"):
        reward([""], ["def f(x):\n    return x + 1\n"], **cols)
    with pytest.raises(ValueError, match="isolation"):
        reward([""], ["def f(x):\n    return x + 1\n"], isolation="chroot", **cols)
    monkeypatch.delenv("MOPD_SANDBOX_ISOLATION")
    assert reward([""], ["def f(x):\n    return x + 1\n"], isolation=MODES[0], **cols) == [1.0]


def test_code_reward_refuses_a_silent_fallback(monkeypatch):
    from rewards.code import reward
    monkeypatch.delenv("MOPD_SANDBOX_ISOLATION", raising=False)
    monkeypatch.setattr(sandbox, "_probed", {"root": False, "userns": False, "none": True})
    monkeypatch.setattr(sandbox, "_default", [])
    cols = {"test": ["def check(c):\n    assert c(1) == 2\n"], "entry_point": ["f"], "domain": ["code"]}
    with pytest.raises(sandbox.SandboxUnavailable):
        reward([""], ["def f(x):\n    return x + 1\n"], **cols)
    assert reward([""], ["def f(x):\n    return x + 1\n"], isolation="none", **cols) == [1.0]

