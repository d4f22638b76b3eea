"""Registry faults (issue 35 item 7), through the commands users run, in process: a
tracking server that does not answer is named (URI and exit code 3) by every command that
talks to one, before any model loads, instead of MLflow's minutes of retries; a command
that only reads never creates a store (MLflow's default is ./mlflow.db of the working
directory); a `models:/` name or alias that is not registered lists what is."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest
from conftest import one_domain_recipe

from pipeline.cli import main

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def dead_uri() -> str:
    """http:// on a localhost port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def cwd(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "cwd"
    d.mkdir()
    monkeypatch.chdir(d)
    return d


@pytest.fixture
def recipe(tmp_path, tiny_student_dir) -> Path:
    return one_domain_recipe(tmp_path, tiny_student_dir, tiny_student_dir)


def _commands(uri: str, recipe: Path, tmp: Path, tiny: Path) -> dict[str, list[str]]:
    return {
        "teachers list": ["teachers", "list", "--tracking-uri", uri],
        "teachers validate": ["teachers", "validate", "--config", str(recipe), f"mlflow.tracking_uri={uri}"],
        "distill": ["distill", "--config", str(recipe), "--out", str(tmp / "d"), f"mlflow.tracking_uri={uri}"],
        "expert": ["expert", "--config", str(REPO / "recipes/experts/math/sft-low.yaml"), "--out", str(tmp / "e"),
                   f"model.path={tiny}", f"mlflow.tracking_uri={uri}"],
        "pipeline": ["pipeline", "--config", str(REPO / "recipes/pipeline/tiny.yaml"), "--out", str(tmp / "p"),
                     f"mlflow.tracking_uri={uri}"],
        "eval": ["eval", "--models", "s=models:/math-expert@teacher", "--domains", "math", "--out", str(tmp / "v"),
                 "--tracking-uri", uri],
        "teachers register": ["teachers", "register", "--domain", "math", "--path", str(tiny), "--tracking-uri", uri],
    }


@pytest.mark.parametrize("cmd", ["teachers list", "teachers validate", "distill", "expert", "pipeline", "eval",
                                 "teachers register"])
def test_a_dead_tracking_server_is_named_before_any_model_loads(cmd, dead_uri, recipe, tmp_path, cwd,
                                                                tiny_student_dir, no_model_loads, capsys):
    argv = _commands(dead_uri, recipe, tmp_path, tiny_student_dir)[cmd]
    try:
        rc = main(argv)
    except SystemExit as e:   # `mopd expert` exits from its own entry point
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 3, err
    assert f"MLflow tracking server at {dead_uri} does not answer" in err
    assert "Traceback" not in err
    assert not list(cwd.iterdir()), "a store was created in the working directory"


@pytest.mark.parametrize("entry", ["python -m mopd.distill", "python -m pipeline.expert", "models:/ reference"])
def test_entry_points_without_the_cli_probe_too(entry, dead_uri, recipe, tmp_path, cwd, tiny_student_dir,
                                                no_model_loads, monkeypatch, capsys):
    """What `accelerate launch -m ...` runs (no `mopd` front door) checks the store itself."""
    from core.tracking import StoreUnreachable

    monkeypatch.setenv("MLFLOW_TRACKING_URI", dead_uri)
    with pytest.raises((StoreUnreachable, SystemExit)) as e:
        if entry == "python -m mopd.distill":
            from mopd.distill.loop import main as distill_main
            distill_main(["--config", str(recipe), "--out", str(tmp_path / "d")])
        elif entry == "python -m pipeline.expert":
            from pipeline.expert import main as expert_main
            expert_main(["--config", str(REPO / "recipes/experts/math/sft-low.yaml"), "--out", str(tmp_path / "e"),
                         f"model.path={tiny_student_dir}"])
        else:
            from teachers.resolve import resolve_ref
            resolve_ref("models:/math-expert@teacher")
    text = str(e.value) if e.type is StoreUnreachable else capsys.readouterr().err
    assert e.type is StoreUnreachable or e.value.code == 3
    assert f"MLflow tracking server at {dead_uri} does not answer" in text
    assert not list(cwd.iterdir())


def test_the_cli_reads_the_uri_without_loading_the_config_class(tmp_path, monkeypatch):
    from core.store_probe import configured_uri

    r = tmp_path / "r.yaml"
    r.write_text("mlflow: {tracking_uri: 'http://recipe:1'}\n")
    assert configured_uri(str(r), []) == "http://recipe:1"
    assert configured_uri(str(r), ["mlflow.tracking_uri=http://override:2"]) == "http://override:2"
    assert configured_uri(str(r), [], given="http://flag:3") == "http://flag:3"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env:4")   # it wins everywhere (core.tracking.resolve_uri)
    assert configured_uri(str(r), ["mlflow.tracking_uri=http://override:2"]) == "http://env:4"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert configured_uri(str(tmp_path / "missing.yaml"), []) is None
    assert configured_uri(None, None) is None


def test_read_only_commands_never_create_a_store(tmp_path, cwd, monkeypatch, capsys):
    assert main(["teachers", "list"]) == 2
    err = capsys.readouterr().err
    assert "no MLflow store given" in err and "--tracking-uri" in err and "MLFLOW_TRACKING_URI" in err
    missing = tmp_path / "none" / "mlflow.db"
    assert main(["teachers", "list", "--tracking-uri", f"sqlite:///{missing}"]) == 2
    assert f"there is no MLflow store at sqlite:///{missing}" in capsys.readouterr().err
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{missing}")
    assert main(["teachers", "list"]) == 2
    assert not missing.parent.exists()
    assert not list(cwd.iterdir())
    # registering creates a store, so only the one named
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert main(["teachers", "register", "--domain", "math", "--path", str(tmp_path)]) == 2
    assert "no MLflow store given" in capsys.readouterr().err
    assert not list(cwd.iterdir())


def test_an_unknown_name_or_alias_lists_what_is_registered(tmp_path, tiny_student_dir):
    from teachers.registry import register_teacher
    from teachers.resolve import TeacherError, resolve_ref

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    register_teacher("alpha", path=str(tiny_student_dir), tracking_uri=uri)
    register_teacher("alpha", path=str(tiny_student_dir), tracking_uri=uri, keep_alias=True)
    with pytest.raises(TeacherError) as e:
        resolve_ref("models:/gamma-expert@teacher", tracking_uri=uri)
    assert "has no model named 'gamma-expert'" in str(e.value)
    assert "registered: alpha-expert (@teacher -> v1; versions 1, 2)" in str(e.value)
    with pytest.raises(TeacherError, match=r"no alias @best of 'alpha-expert'.*alpha-expert \(@teacher -> v1"):
        resolve_ref("models:/alpha-expert@best", tracking_uri=uri)
    with pytest.raises(TeacherError, match=r"no version 7 of 'alpha-expert'"):
        resolve_ref("models:/alpha-expert/7", tracking_uri=uri)
