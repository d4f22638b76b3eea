"""`models:/` teacher references are resolved in the run's own store (never ./mlflow.db of
the working directory), used in place when their files are local, downloaded once into
the teacher cache otherwise, and never leave a temporary copy behind."""
from __future__ import annotations

import os

import mlflow
import pytest

import teachers.resolve as R
from teachers.resolve import TeacherError, resolve_ref


@pytest.fixture
def store(tmp_path, tiny_student_dir, monkeypatch):
    """A store with `alpha-expert@teacher` registered from a run's `model` artifacts, and
    a working directory without any store."""
    from core.tracking import start_run

    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    (tmp_path / "store").mkdir()
    with start_run(experiment="e", uri=uri) as run:
        mlflow.log_artifacts(str(tiny_student_dir), "model")
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    client.create_registered_model("alpha-expert")
    mv = client.create_model_version("alpha-expert", source=f"runs:/{run.info.run_id}/model",
                                     run_id=run.info.run_id)
    client.set_registered_model_alias("alpha-expert", "teacher", mv.version)
    mlflow.set_tracking_uri("")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return {"uri": uri, "cwd": cwd, "cache": tmp_path / "cache", "run_id": run.info.run_id}


def test_models_ref_resolves_in_the_given_store_not_the_cwd(store):
    path = resolve_ref("models:/alpha-expert@teacher", tracking_uri=store["uri"], cache_dir=store["cache"])
    assert (path / "config.json").exists()
    assert not (store["cwd"] / "mlflow.db").exists(), "a store was created in the working directory"
    assert not list(store["cwd"].iterdir())
    # a local store's files are used where they are: no copy at all
    assert not store["cache"].exists() or not list(store["cache"].iterdir())
    v1 = resolve_ref("models:/alpha-expert/1", tracking_uri=store["uri"], cache_dir=store["cache"])
    assert (v1 / "config.json").exists()


def test_remote_artifacts_are_downloaded_once_into_the_cache(store, monkeypatch):
    monkeypatch.setattr(R, "_local_dir", lambda uri: None)     # as if the artifacts were on a server
    calls = []
    real = mlflow.artifacts.download_artifacts

    def counting(**kw):
        calls.append(kw)
        return real(**kw)

    monkeypatch.setattr(mlflow.artifacts, "download_artifacts", counting)
    a = resolve_ref("models:/alpha-expert@teacher", tracking_uri=store["uri"], cache_dir=store["cache"])
    b = resolve_ref("models:/alpha-expert@teacher", tracking_uri=store["uri"], cache_dir=store["cache"])
    assert a == b and (a / "config.json").exists()
    assert len(calls) == 1
    assert store["cache"] in a.parents
    assert not [p for p in store["cache"].iterdir() if p.name.startswith(".tmp")], "temporary copy left"
    assert not (store["cwd"] / "mlflow.db").exists()


def test_mlflow_ref_needs_a_store(store, tmp_path):
    with pytest.raises(TeacherError, match="no MLflow store given"):
        resolve_ref("models:/alpha-expert@teacher", cache_dir=store["cache"])
    with pytest.raises(TeacherError, match="no MLflow store at"):
        resolve_ref("models:/alpha-expert@teacher", tracking_uri=f"sqlite:///{tmp_path}/none/mlflow.db",
                    cache_dir=store["cache"])
    assert not (tmp_path / "none").exists() and not (store["cwd"] / "mlflow.db").exists()
    assert os.environ.get("MLFLOW_TRACKING_URI") is None


def test_resolve_teachers_uses_the_runs_store(store, tiny_student_dir):
    from types import SimpleNamespace

    from core.tiny import load_tokenizer
    from teachers.routing import resolve_teachers

    specs = {"alpha": SimpleNamespace(path="models:/alpha-expert@teacher")}
    paths = resolve_teachers(specs, ["alpha"], load_tokenizer(tiny_student_dir), str(tiny_student_dir),
                             tracking_uri=store["uri"], cache_dir=store["cache"])
    assert (paths["alpha"] / "config.json").exists()
    assert not (store["cwd"] / "mlflow.db").exists()
