"""`mopd teachers serve` with a fake `vllm` on PATH (tests/unit/teachers/fake_vllm_server.py):
servers start, their URLs are written and answer, and nothing is left behind after
Ctrl-C or after the serve command itself is killed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import mopd_in_process

REPO = Path(__file__).resolve().parents[3]
FAKE = Path(__file__).with_name("fake_vllm_server.py")


@pytest.fixture
def fake_vllm_path(tmp_path):
    b = tmp_path / "bin"
    b.mkdir()
    exe = b / "vllm"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    exe.chmod(0o755)
    return f"{b}{os.pathsep}{os.environ['PATH']}"


def _recipe(tmp_path, teacher_dir, keys=("code", "math")) -> Path:
    teachers = "\n".join(f"  {k}: {{path: {teacher_dir}, backend: server, model: {k}-expert}}" for k in keys)
    f = tmp_path / "recipe.yaml"
    f.write_text(f"model: {{path: {teacher_dir}}}\ndata: {{datasets: [{{path: /nowhere.jsonl}}]}}\n"
                 f"rollout: {{backend: hf}}\nteachers:\n{teachers}\n")
    return f


def _serve(recipe, out, path_env, *extra):
    env = {**os.environ, "PATH": path_env}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", "teachers", "serve", "--config", str(recipe),
                             "--out", str(out), "--timeout", "120", *extra], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(f: Path, p: subprocess.Popen, timeout: float = 150) -> None:
    t0 = time.monotonic()
    while not f.exists():
        if p.poll() is not None:
            raise AssertionError(f"serve exited {p.returncode}: {p.stderr.read()[-3000:]}")
        assert time.monotonic() - t0 < timeout, "servers not up in time"
        time.sleep(0.2)


def _descendants(pid: int) -> list[psutil.Process]:
    # the servers run in their own sessions but are still children of the serve process
    return psutil.Process(pid).children(recursive=True)


@pytest.mark.subprocess
def test_serve_writes_urls_that_answer_and_ctrl_c_leaves_nothing(tmp_path, fake_vllm_path, tiny_teacher_dir,
                                                                tiny_tokenizer):
    from teachers.server import ServerTeacher

    out = tmp_path / "srv"
    p = _serve(_recipe(tmp_path, tiny_teacher_dir), out, fake_vllm_path)
    try:
        _wait_for(out / "teachers.yaml", p)
        kids = _descendants(p.pid)
        assert len(kids) == 2
        urls = yaml.safe_load((out / "teachers.yaml").read_text())["teachers"]
        assert set(urls) == {"code", "math"} and urls["code"] != urls["math"]
        lines = (out / "overrides.txt").read_text().split()
        assert lines == [f"teachers.code.urls=[{urls['code']['urls'][0]}]",
                         f"teachers.math.urls=[{urls['math']['urls'][0]}]"]
        for k in ("code", "math"):
            t = ServerTeacher(k, urls[k]["urls"], f"{k}-expert", timeout_s=10, max_retries=0)
            t.check_tokenizer(tiny_tokenizer)
            (lp,) = t.score([[5, 6, 7]], [[8, 9]])
            assert lp.shape == (2,) and bool((lp < 0).all())
            t.close()
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=60) == 0
        assert not any(k.is_running() and k.status() != psutil.STATUS_ZOMBIE for k in kids)
        assert not (out / "teachers.yaml").exists()     # its URLs are dead
        assert "stopped by SIGINT" in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.mark.subprocess
def test_killed_serve_takes_its_servers_along(tmp_path, fake_vllm_path, tiny_teacher_dir):
    """SIGKILL leaves no handler to run: PR_SET_PDEATHSIG ends the servers. (`--only`
    serves one of the recipe's teachers, as one node of a multi-node job does.)"""
    out = tmp_path / "srv"
    p = _serve(_recipe(tmp_path, tiny_teacher_dir), out, fake_vllm_path, "--only", "math")
    try:
        _wait_for(out / "teachers.yaml", p)
        assert set(yaml.safe_load((out / "teachers.yaml").read_text())["teachers"]) == {"math"}
        kids = _descendants(p.pid)
        assert len(kids) == 1
        p.kill()
        p.wait()
        _, alive = psutil.wait_procs(kids, timeout=20)
        assert not alive, alive
    finally:
        if p.poll() is None:
            p.kill()


def test_a_server_that_cannot_start_is_a_clear_error(tmp_path, tiny_teacher_dir):
    bad = tmp_path / "bin"
    bad.mkdir()
    (bad / "vllm").write_text("#!/bin/sh\necho 'CUDA out of memory (pretend)' >&2\nexit 3\n")
    (bad / "vllm").chmod(0o755)
    out = tmp_path / "srv"
    p = mopd_in_process(["teachers", "serve", "--config", str(_recipe(tmp_path, tiny_teacher_dir, keys=("code",))),
                         "--out", str(out), "--timeout", "120"], env={"PATH": f"{bad}{os.pathsep}{os.environ['PATH']}"})
    err = p.stderr
    assert p.returncode == 2
    assert "['code']" in err and "exited with 3" in err and "CUDA out of memory (pretend)" in err
    assert not (out / "teachers.yaml").exists()


def test_serve_needs_a_path_and_a_server_teacher(tmp_path, tiny_teacher_dir, capsys):
    from pipeline.cli import main

    r = tmp_path / "r.yaml"
    r.write_text(f"model: {{path: {tiny_teacher_dir}}}\ndata: {{datasets: [{{path: /x.jsonl}}]}}\n"
                 f"teachers: {{code: {{backend: server, model: m, urls: ['http://h:1']}}}}\n")
    assert main(["teachers", "serve", "--config", str(r), "--out", str(tmp_path / "o")]) == 2
    assert "teacher 'code': `mopd teachers serve` needs its path" in capsys.readouterr().err
    r.write_text(f"model: {{path: {tiny_teacher_dir}}}\ndata: {{datasets: [{{path: /x.jsonl}}]}}\n"
                 f"teachers: {{code: {{path: {tiny_teacher_dir}}}}}\n")
    assert main(["teachers", "serve", "--config", str(r), "--out", str(tmp_path / "o")]) == 2
    assert "no teacher with backend server" in capsys.readouterr().err
    r.write_text(f"model: {{path: {tiny_teacher_dir}}}\ndata: {{datasets: [{{path: /x.jsonl}}]}}\n"
                 f"teachers: {{code: {{path: {tiny_teacher_dir}, backend: server, model: m}}}}\n")
    assert main(["teachers", "serve", "--config", str(r), "--out", str(tmp_path / "o"), "--only", "math"]) == 2
    assert "--only ['math']: not teachers of backend server" in capsys.readouterr().err
