"""One writer per output folder (issue #20, part 2): a second run on the same --out is
refused at once with an error naming the holder, the first is untouched; a lock left by
a killed process does not block; a pipeline's own stages (in-process or subprocesses)
write inside its folder, a stranger may not."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ENV, LOCK_NAME = "MOPD_LOCK_TOKENS", ".mopd.lock"     # core.outdir's (imported in the tests that need it)

REPO = Path(__file__).resolve().parents[3]
PY = sys.executable

HOLD = """
import sys, time
from core.outdir import hold_out_dir
lock = hold_out_dir(sys.argv[1], "test holder")
print("held", flush=True)
time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 120)
"""


def _env(**more) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", ENV)}
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e.update(more)
    return e


def _holder(folder: Path, env: dict | None = None) -> subprocess.Popen:
    p = subprocess.Popen([PY, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True, env=env or _env(),
                         cwd=REPO)
    assert p.stdout.readline().strip() == "held"
    return p


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    t0 = time.time()
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the first run ended ({proc.returncode}) before writing {path}:\n"
                                 f"{proc.stderr.read()[-3000:] if proc.stderr else ''}")
        if time.time() - t0 > timeout:
            raise AssertionError(f"{path} never appeared")
        time.sleep(0.2)


def test_second_process_is_refused_and_told_who_holds_the_folder(tmp_path):
    from core.outdir import OutDirError, hold_out_dir

    out = tmp_path / "run"
    first = _holder(out)
    try:
        t0 = time.perf_counter()
        with pytest.raises(OutDirError) as e:
            hold_out_dir(out, "second")
        refused_s = time.perf_counter() - t0
        msg = str(e.value)
        assert f"pid {first.pid}" in msg and "in use by another run" in msg
        print(f"refused in {refused_s * 1000:.1f} ms")          # no wait: flock(LOCK_NB)
        info = json.loads((out / LOCK_NAME).read_text())
        assert info["pid"] == first.pid and info["host"] and info["started"] and info["command"]
    finally:
        first.kill()
        first.wait()


def test_a_lock_left_by_a_killed_process_does_not_block(tmp_path, capsys):
    from core.outdir import hold_out_dir

    out = tmp_path / "run"
    first = _holder(out)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == first.pid    # the dead holder's file is still there
    with hold_out_dir(out, "after a crash"):
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert f"taking over the lock of pid {first.pid}" in capsys.readouterr().err
    assert (out / LOCK_NAME).read_text() == ""         # released cleanly: an empty file


def test_the_holders_own_stages_go_through_a_stranger_does_not(tmp_path):
    """A pipeline holds DIR; its in-process stages and the subprocesses it starts (they
    inherit $MOPD_LOCK_TOKENS) lock their own subfolders; an unrelated process writing
    inside DIR is refused, naming the pipeline."""
    from core.outdir import hold_out_dir

    root = tmp_path / "pipeline"
    before = os.environ.get(ENV)   # earlier in-process runs in this session may still hold theirs
    with hold_out_dir(root, "pipeline"):
        with hold_out_dir(root / "mopd", "in-process stage"):       # in-process nested stage
            with hold_out_dir(root / "mopd", "same process again"):  # re-entrant within a process
                pass
        child = subprocess.run([PY, "-c", HOLD, str(root / "experts" / "math" / "sft"), "0"],
                               capture_output=True, text=True, cwd=REPO,
                               env={**_env(), ENV: os.environ[ENV]})
        assert child.returncode == 0, child.stderr
        stranger = subprocess.run([PY, "-c", HOLD, str(root / "mopd"), "0"], capture_output=True, text=True,
                                  cwd=REPO, env=_env())
        assert stranger.returncode != 0
        assert f"is inside {root.resolve()}, which another run is writing to: pid {os.getpid()}" in stranger.stderr
    assert os.environ.get(ENV) == before     # this test's tokens are gone again


def test_a_folder_holding_a_running_one_is_refused(tmp_path):
    """Issue 38: the lock also looks down. `mopd pipeline --out DIR` while another run
    writes to DIR/a/b is refused, naming that run; a lock its holder left when it was
    killed (any depth) does not block; once the run ends, DIR is free."""
    from core.outdir import OutDirError, hold_out_dir

    root = tmp_path / "outer"
    dead = _holder(root / "old" / "run")
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    inner = _holder(root / "a" / "b")
    try:
        with pytest.raises(OutDirError) as e:
            hold_out_dir(root, "outer run")
        assert f"holds {(root / 'a' / 'b').resolve()}, which another run is writing to: pid {inner.pid}" in str(e.value)
    finally:
        inner.kill()
        inner.wait()
    with hold_out_dir(root, "outer run"):
        assert json.loads((root / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_out_that_is_a_file_is_refused(tmp_path):
    from core.outdir import OutDirError, hold_out_dir

    f = tmp_path / "out"
    f.write_text("x")
    with pytest.raises(OutDirError, match="is a file, not a folder"):
        hold_out_dir(f, "test")
    with pytest.raises(OutDirError, match="cannot be created: .* is a file"):
        hold_out_dir(f / "sub", "test")


# ----------------------------------------------------------------------------- the real commands
@pytest.fixture(scope="module")
def distill_setup(tmp_path_factory):
    from core.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("lock_distill")
    student = build_tiny_model(root / "student", seed=0)
    teacher = build_tiny_model(root / "teacher", seed=1)
    data = root / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": [{"role": "user", "content": f"say {i}"}], "domain": "a"})
                              for i in range(16)) + "\n")
    cfg = root / "run.yaml"
    cfg.write_text(f"""
model: {{path: {student}}}
data: {{datasets: [{{path: {data}}}]}}
teachers: {{a: {{path: {teacher}}}}}
rollout: {{backend: hf, max_new_tokens: 4}}
train: {{max_steps: 100000, prompts_per_step: 2}}          # no checkpoint while it runs
mlflow: {{experiment: lock-test}}
""")
    return cfg


@pytest.mark.subprocess
def test_two_mopd_distill_on_one_out(tmp_path, distill_setup):
    """The second `mopd distill` on a running run's --out refuses before it loads
    anything, naming the first's pid; the first's config.yaml is not overwritten and it
    keeps training."""
    out = tmp_path / "run"
    first = subprocess.Popen([PY, "-m", "pipeline.cli", "distill", "--config", str(distill_setup), "--out", str(out)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
    try:
        _wait_for(out / "config.yaml", first)
        before = (out / "config.yaml").read_text()
        t0 = time.perf_counter()
        try:
            second = subprocess.run([PY, "-m", "pipeline.cli", "distill", "--config", str(distill_setup), "--out",
                                     str(out), "train.lr=0.5", "train.seed=7", "train.max_steps=1"],
                                    capture_output=True, text=True, env=_env(), cwd=REPO, timeout=240)
        except subprocess.TimeoutExpired:
            raise AssertionError("the second run was not refused: it went on running") from None
        print(f"second run: exit {second.returncode} after {time.perf_counter() - t0:.1f} s (process start included)")
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"in use by another run: pid {first.pid}" in second.stderr
        assert "process(es)" not in second.stderr          # refused before check_inputs: nothing loaded
        assert (out / "config.yaml").read_text() == before
        assert first.poll() is None                         # the first is still training
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # killed: its lock is stale and does not block the next run on the folder
    from core.outdir import hold_out_dir
    with hold_out_dir(out, "after the kill"):
        pass


@pytest.mark.subprocess
def test_two_mopd_pipeline_on_one_out(tmp_path):
    out = tmp_path / "pipe"
    args = ["pipeline", "--config", str(REPO / "recipes/pipeline/tiny.yaml"), "--out", str(out), "domains=[math]",
            "train.max_steps=1", "jobs=1"]
    first = subprocess.Popen([PY, "-m", "pipeline.cli", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, env=_env(), cwd=REPO, start_new_session=True)
    try:
        _wait_for(out / "pipeline.yaml", first)
        before = (out / "pipeline.yaml").read_text()
        t0 = time.perf_counter()
        second = subprocess.Popen([PY, "-m", "pipeline.cli", *args, "eval.n=3"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO, start_new_session=True)
        try:
            _, err = second.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(second.pid, signal.SIGKILL)
            second.wait()
            raise AssertionError("the second pipeline was not refused: it went on running") from None
        print(f"second pipeline: exit {second.returncode} after {time.perf_counter() - t0:.1f} s (process start "
              "included)")
        assert second.returncode == 2, err[-3000:]
        assert f"in use by another run: pid {first.pid}" in err
        assert (out / "pipeline.yaml").read_text() == before
        assert first.poll() is None
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()


@pytest.mark.parametrize("argv", [
    ["distill", "--config", "recipes/mopd/toy.yaml"],
    ["pipeline", "--config", "recipes/pipeline/tiny.yaml"],
    ["toy"],
    ["expert", "--config", "recipes/experts/math/sft.yaml"],
    ["base", "--config", "recipes/base/tiny.yaml"],
    ["eval", "--models", "base=runs/none"],
])
def test_every_writing_subcommand_is_refused_on_a_held_out(tmp_path, capsys, argv):
    from pipeline.cli import main as cli_main

    out = tmp_path / "run"
    first = _holder(out)
    try:
        rc = cli_main([*argv, "--out", str(out)])
        err = capsys.readouterr().err
        assert rc == 2 and f"mopd: error: --out {out} is in use by another run: pid {first.pid}" in err
    finally:
        first.kill()
        first.wait()


def test_a_run_that_wrote_nothing_leaves_no_folder_it_made(tmp_path):
    from core.outdir import LOCK_NAME, hold_out_dir

    made = tmp_path / "new"
    hold_out_dir(made, "test").release()
    assert not made.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    hold_out_dir(kept, "test").release()
    assert kept.is_dir() and (kept / LOCK_NAME).exists()       # not ours to remove
    used = tmp_path / "used"
    lock = hold_out_dir(used, "test")
    (used / "config.yaml").write_text("x")
    lock.release()
    assert (used / "config.yaml").exists()
