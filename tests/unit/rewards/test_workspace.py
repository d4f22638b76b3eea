"""rewards/workspace.py: one episode's workspace. The file tools refuse paths outside it
and cut long reads and test output; going over the quota or a run the sandbox stops
raises what ends the episode; workspaces go at close(), garbage collection, SIGTERM, and,
for a process killed outright, at the next process's start."""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rewards.sandbox import Limits
from rewards.workspace import (QuotaExceeded, SandboxKilled, Workspace, WorkspaceError, WorkspaceLimits,
                               clean_stale_roots, cut_text, process_root)

REPO = Path(__file__).resolve().parents[3]
MODULE = "def last(xs):\n    return xs[len(xs) - 2]\n"
TESTS = "from m import last\n\n\ndef test_last():\n    assert last([4, 7, 1]) == 1\n\n\ndef test_two():\n" \
        "    assert last([2, 2]) == 2\n"
FAST = WorkspaceLimits(sandbox=Limits(wall_s=3.0, cpu_s=3, memory_mb=512, total_memory_mb=1024, nproc=16,
                                      fsize_mb=1, workspace_mb=8))


@pytest.fixture
def ws(tmp_path):
    w = Workspace({"m.py": MODULE, "test_m.py": TESTS}, FAST, base_dir=tmp_path)
    yield w
    w.close()


# ----------------------------------------------------------------------------- paths
@pytest.mark.parametrize("path", ["../x.py", "/etc/passwd", "a/../../x.py", "..", ".", "", "   ", ".hidden",
                                  "a\\b.py", "a//b.py", "a/./b.py", "x\x00.py", "a/b/c/d.py", "a" * 101,
                                  "m.py/../../../etc/passwd", "~/x.py"])
def test_paths_outside_the_workspace_are_refused(ws, path):
    for call in (lambda: ws.read(path), lambda: ws.write(path, "x"), lambda: ws.replace(path, "a", "b")):
        with pytest.raises(WorkspaceError):
            call()
    assert sorted(ws.files()) == ["m.py", "test_m.py"]   # nothing written anywhere


def test_non_string_paths_are_refused(ws):
    for bad in (None, 3, ["m.py"], {"p": 1}):
        with pytest.raises(WorkspaceError):
            ws.read(bad)


def test_a_link_planted_in_the_workspace_leads_nowhere(ws, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    os.symlink(secret, ws.dir / "link.py")
    os.symlink(tmp_path, ws.dir / "out")
    for path in ("link.py", "out/secret.txt"):
        with pytest.raises(WorkspaceError, match="outside"):
            ws.read(path)
        with pytest.raises(WorkspaceError, match="outside"):
            ws.write(path, "overwritten")
    assert secret.read_text() == "host secret"
    assert "link.py" not in ws.files()   # links are not files of the workspace (runs never see them)


def test_nested_paths_and_listing(ws):
    assert ws.write("pkg/a.py", "X = 1\n") == "ok"
    assert ws.list_files().splitlines() == ["m.py", "pkg/a.py", "test_m.py"]
    assert ws.read("./pkg/a.py") == "X = 1\n"
    with pytest.raises(WorkspaceError, match="folder"):
        ws.write("pkg", "x")
    with pytest.raises(WorkspaceError, match="not a folder"):
        ws.write("m.py/x.py", "x")
    with pytest.raises(WorkspaceError, match="reserved"):
        ws.write("main.py", "print(1)")   # run_python's own program file


# ----------------------------------------------------------------------------- read / replace
def test_large_files_are_cut_and_ranges_read(tmp_path):
    lines = "".join(f"line {i}\n" for i in range(1, 2001))
    w = Workspace({"big.txt": lines}, WorkspaceLimits(max_read_chars=500), base_dir=tmp_path)
    try:
        out = w.read("big.txt")
        assert out.startswith("line 1\nline 2\n") and "...(cut:" in out and "line 2000" not in out
        assert len(out) < 700
        assert w.read("big.txt", 1999, 2000) == "line 1999\nline 2000\n"
        assert w.read("big.txt", 2000) == "line 2000\n"
        assert w.read("big.txt", None, 2) == "line 1\nline 2\n"
        with pytest.raises(WorkspaceError, match="2000 lines"):
            w.read("big.txt", 2001, 2002)
        for s, e in ((0, 3), (5, 4)):
            with pytest.raises(WorkspaceError, match="start"):
                w.read("big.txt", s, e)
        with pytest.raises(WorkspaceError, match="no file"):
            w.read("nope.py")
    finally:
        w.close()


def test_replace_needs_exactly_one_occurrence(ws):
    with pytest.raises(WorkspaceError, match="does not occur"):
        ws.replace("m.py", "len(xs) - 3", "x")
    ws.write("d.py", "a = 1\na = 1\n")
    with pytest.raises(WorkspaceError, match="2 times"):
        ws.replace("d.py", "a = 1", "a = 2")
    with pytest.raises(WorkspaceError, match="empty"):
        ws.replace("m.py", "", "x")
    with pytest.raises(WorkspaceError, match="strings"):
        ws.replace("m.py", 3, "x")
    assert ws.replace("m.py", "len(xs) - 2", "len(xs) - 1") == "ok"
    assert ws.read("m.py") == MODULE.replace("- 2", "- 1")


# ----------------------------------------------------------------------------- quota
def test_the_quota_ends_the_episode(tmp_path):
    lim = WorkspaceLimits(max_files=4, max_file_bytes=100, max_total_bytes=250)
    w = Workspace({"a.py": "x" * 90}, lim, base_dir=tmp_path)
    try:
        with pytest.raises(QuotaExceeded):
            w.write("b.py", "y" * 101)               # one file too large
        w.write("b.py", "y" * 90)
        with pytest.raises(QuotaExceeded):
            w.write("c.py", "z" * 90)                # 270 bytes in all
        w.write("a.py", "x")                         # overwriting frees space
        w.write("c.py", "z" * 90)
        w.write("d.py", "")
        with pytest.raises(QuotaExceeded):
            w.write("e.py", "")                      # a fifth file
        with pytest.raises(QuotaExceeded):
            w.replace("b.py", "y" * 90, "y" * 150)   # an edit is a write too
        assert w.files() == {"a.py": 1, "b.py": 90, "c.py": 90, "d.py": 0}
    finally:
        w.close()
    with pytest.raises(QuotaExceeded):
        Workspace({f"f{i}.py": "" for i in range(5)}, lim, base_dir=tmp_path)
    assert not any((tmp_path).glob("mopd-ws-*/ep-*"))   # the refused one was removed at once


# ----------------------------------------------------------------------------- runs
def test_run_tests_reports_failures_and_a_count(ws):
    assert ws.run_tests(["test_m.py"]) == "FAIL test_last: assert last([4, 7, 1]) == 1\n1 failed, 1 passed"
    ws.replace("m.py", "- 2", "- 1")
    assert ws.run_tests(["test_m.py"]) == "2 passed"
    ws.write("test_m.py", "import m\n\ndef test_raise():\n    assert m.last([]) == 0\n")
    out = ws.run_tests(["test_m.py", "test_gone.py"])
    assert out.splitlines() == ["FAIL test_raise: assert m.last([]) == 0 -> IndexError: list index out of range",
                                "ERROR test_gone.py: missing", "2 failed, 0 passed"]
    ws.write("m.py", "def last(xs:\n")
    assert ws.run_tests(["test_m.py"]).startswith("ERROR test_m.py:")   # a syntax error is reported, not fatal


def test_test_output_is_cut(tmp_path):
    tests = "".join(f"def test_{i}():\n    assert False, 'x' * 150\n\n" for i in range(40))
    w = Workspace({"test_a.py": tests}, WorkspaceLimits(max_output_chars=600, sandbox=FAST.sandbox), base_dir=tmp_path)
    try:
        out = w.run_tests(["test_a.py"])
        assert len(out) < 700 and "characters cut" in out and out.endswith("40 failed, 0 passed")
    finally:
        w.close()
    assert cut_text("abc", 10) == "abc"


@pytest.mark.parametrize("body,reason", [
    ("while True:\n    pass\n", "timeout"),
    ("import time\ntime.sleep(60)\n", "timeout"),
    ("import os\nos._exit(3)\n", "exit:3"),
])
def test_a_run_that_hangs_or_dies_raises_sandbox_killed(ws, body, reason):
    ws.write("m.py", body)
    with pytest.raises(SandboxKilled) as e:
        ws.run_tests(["test_m.py"])
    assert e.value.reason == reason
    assert not ws.closed   # the backend decides to end the episode; the workspace is still there


def test_a_run_that_fills_the_disk_fails_its_write_and_leaves_nothing(ws):
    # Python ignores SIGXFSZ: past fsize_mb the write fails (EFBIG) instead of killing the run
    ws.write("m.py", "open('fill.bin', 'wb').write(b'x' * (8 << 20))\n")
    out = ws.run_tests(["test_m.py"])
    assert out.startswith("ERROR test_m.py:") and "File too large" in out
    assert "fill.bin" not in ws.files()


def test_runs_do_not_change_the_workspace(ws):
    ws.write("test_w.py", "def test_w():\n    open('m.py', 'w').write('gone')\n    open('new.txt', 'w').write('x')\n")
    assert ws.run_tests(["test_w.py"]) == "1 passed"
    assert ws.read("m.py") == MODULE and "new.txt" not in ws.files()


# ----------------------------------------------------------------------------- lifetime
def test_close_and_garbage_collection_remove_the_workspace(tmp_path):
    w = Workspace({"a.py": "x"}, base_dir=tmp_path)
    d = w.dir
    assert d.is_dir() and d.parent == process_root(tmp_path)
    w.close()
    w.close()
    assert not d.exists() and w.closed
    with pytest.raises(RuntimeError, match="after close"):
        w.read("a.py")
    w2 = Workspace({"a.py": "x"}, base_dir=tmp_path)
    d2 = w2.dir
    del w2
    gc.collect()
    assert not d2.exists()


_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {repo!r})
    from rewards.workspace import Workspace
    w = Workspace({{"a.py": "x = 1\\n"}}, base_dir={base!r})
    print(w.dir, flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[1] == "kill_mid_run":   # a run in flight that would sleep past any clean-up
        import threading
        w.write("a.py", "import time\\ntime.sleep(1000)\\n")
        w.write("test_a.py", "import a\\n")
        threading.Thread(target=w.run_tests, args=(["test_a.py"],), daemon=True).start()
        time.sleep(1.5)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
""")


def _child(base: Path, how: str) -> tuple[subprocess.Popen, Path]:
    # TMPDIR: rewards/sandbox.py's own per-run folder, which a SIGKILL mid-run leaves behind,
    # goes to the test's folder rather than /tmp
    tmp = base / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen([sys.executable, "-c", _CHILD.format(repo=str(REPO), base=str(base)), how],
                         stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp)})
    return p, Path(p.stdout.readline().strip())


def test_sigterm_removes_the_process_root(tmp_path):
    p, d = _child(tmp_path, "wait")
    assert d.is_dir()
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == -signal.SIGTERM   # the default action still happens
    assert not d.parent.exists()


def test_a_killed_process_root_is_removed_by_the_next_start(tmp_path):
    alive, d_alive = _child(tmp_path, "wait")
    killed, d_killed = _child(tmp_path, "kill")
    assert killed.wait(timeout=30) == -signal.SIGKILL
    assert d_killed.is_dir()   # SIGKILL runs no cleanup
    try:
        removed = clean_stale_roots(tmp_path)
        assert removed == [d_killed.parent] and not d_killed.parent.exists()
        assert d_alive.is_dir()   # a live process keeps its root
        # a root left before its lock was made: its pid is checked
        orphan = tmp_path / "mopd-ws-999999999-abc"
        orphan.mkdir()
        w = Workspace({"a.py": ""}, base_dir=tmp_path / "other")   # another base: untouched
        w.close()
        assert orphan.exists()
        assert clean_stale_roots(tmp_path) == [orphan]
    finally:
        alive.kill()
        alive.wait(timeout=30)
    assert clean_stale_roots(tmp_path) == [d_alive.parent]


def _tagged(host_pid: int) -> list[int]:
    tag = f"MOPD_SANDBOX_RUN={host_pid}-".encode()
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if tag in f.read():
                        out.append(int(pid))
            except OSError:
                pass
    return out


def test_a_process_killed_mid_run_leaves_nothing_after_the_next_start(tmp_path):
    p, d = _child(tmp_path, "kill_mid_run")
    assert p.wait(timeout=60) == -signal.SIGKILL
    try:
        assert clean_stale_roots(tmp_path) == [d.parent]
        assert not d.parent.exists()
        for _ in range(100):   # SIGKILL is delivered asynchronously
            if not _tagged(p.pid):
                break
            time.sleep(0.05)
        assert _tagged(p.pid) == []
    finally:
        for pid in _tagged(p.pid):
            os.kill(pid, signal.SIGKILL)
