"""Two teams, one registry (issue 35 item 5): a real `mlflow server` on a free localhost
port (sqlite backend, proxied artifacts, as docs/experts.md sets it up); two processes,
one per team, each `mopd teachers register` its teacher into it at the same time; a MOPD
recipe resolves both by alias, runs one step, and the student is registered there with
the teachers' versions in its tags. Slow: the server takes up to a minute to start here."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from test_registry import two_teacher_recipe

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    port = _free_port()
    store = tmp_path / "server"
    store.mkdir()
    mlflow_bin = Path(sys.executable).with_name("mlflow")
    p = subprocess.Popen([str(mlflow_bin), "server", "--backend-store-uri", f"sqlite:///{store}/mlflow.db",
                          "--artifacts-destination", str(store / "artifacts"), "--host", "127.0.0.1",
                          "--port", str(port), "--workers", "1"],
                         stdout=subprocess.DEVNULL, stderr=open(store / "server.log", "w"), start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            try:
                urllib.request.urlopen(uri + "/health", timeout=2).close()
                break
            except OSError:
                if p.poll() is not None or time.monotonic() - t0 > 240:
                    raise AssertionError(f"mlflow server did not start: {(store / 'server.log').read_text()[-2000:]}")
                time.sleep(1)
        yield uri
    finally:
        p.terminate()
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_two_teams_register_into_one_server_and_mopd_resolves_both(mlflow_server, tmp_path, tiny_student_dir,
                                                                    tiny_teacher_dir):
    import mlflow

    uri = mlflow_server
    # each team has only its own checkpoint folder, and is a process of its own
    team = {}
    for d, src in (("alpha", tiny_teacher_dir), ("beta", tiny_student_dir)):
        team[d] = tmp_path / f"team_{d}"
        team[d].mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "MOPD_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("MLFLOW_TRACKING_URI", None)
    procs = {d: subprocess.Popen([sys.executable, "-m", "pipeline.cli", "teachers", "register", "--domain", d,
                                  "--path", str(src), "--tracking-uri", uri, "--score", "0.5"],
                                 cwd=team[d], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for d, src in (("alpha", tiny_teacher_dir), ("beta", tiny_student_dir))}
    for d, p in procs.items():
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        assert f"registered models:/{d}-expert/1 (@teacher -> version 1)" in out
        assert not list(team[d].iterdir()), "a team's working directory got a store"
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    for d in ("alpha", "beta"):
        mv = client.get_model_version_by_alias(f"{d}-expert", "teacher")
        assert mv.tags["eval_score"] == "0.5" and mv.source.startswith("models:/m-")

    recipe, data = two_teacher_recipe(tmp_path, tiny_student_dir, uri)
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "distill", "--config", str(recipe), "--out",
                        str(tmp_path / "out")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    mv = client.get_model_version_by_alias("two-teams-student", "student")
    assert mv.tags["teacher.alpha"] == "models:/alpha-expert/1"
    assert mv.tags["teacher.beta"] == "models:/beta-expert/1"
    assert "recipe_hash" in mv.tags and json.loads(mv.tags["data_mix"])["datasets"] == [str(data)]
    # the teachers came from the server (downloaded once into the cache), not from the teams' folders
    assert len([p for p in (tmp_path / "cache" / "teachers").iterdir() if not p.name.startswith(".")]) == 2
