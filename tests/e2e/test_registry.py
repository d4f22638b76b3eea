"""`mopd teachers register` (issue 35 item 4), the student registered with its lineage
(item 6) and models logged as MLflow transformers models (issue 41 item 5), through the
CLI on tiny models in a local sqlite registry (the shared-server version of the same
story is tests/e2e/test_shared_registry.py, slow)."""
from __future__ import annotations

import getpass
import json
from pathlib import Path

import mlflow
import pytest

from pipeline.cli import main


@pytest.fixture
def reg(tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    uri = f"sqlite:///{tmp_path}/reg/mlflow.db"
    return {"uri": uri, "client": mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri), "cwd": cwd}


def _register(reg, *args: str) -> int:
    return main(["teachers", "register", "--tracking-uri", reg["uri"], *args])


def two_teacher_recipe(root: Path, student: Path, uri: str) -> tuple[Path, Path]:
    """A one-step MOPD recipe (HF sampler) whose teachers are models:/alpha-expert@teacher
    and models:/beta-expert@teacher of the store at `uri`; its student is registered as
    two-teams-student. Returns (recipe, prompt file)."""
    data = root / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": [{"role": "user", "content": f"hi {i}"}],
                                          "domain": ["alpha", "beta"][i % 2]}) for i in range(8)))
    recipe = root / "r.yaml"
    recipe.write_text(f"""
model: {{path: {student}}}
data: {{datasets: [{{path: {data}}}], mix: {{alpha: 1.0, beta: 1.0}}}}
teachers: {{alpha: {{path: "models:/alpha-expert@teacher"}}, beta: {{path: "models:/beta-expert@teacher"}}}}
rollout: {{backend: hf, max_new_tokens: 6}}
train: {{max_steps: 1, prompts_per_step: 2}}
mlflow: {{tracking_uri: "{uri}", registered_name: two-teams}}
""")
    return recipe, data


def _generates(model_uri: str) -> str:
    """mlflow.transformers.load_model opens it as a text-generation pipeline, which generates."""
    import mlflow.transformers

    pipe = mlflow.transformers.load_model(model_uri)
    prompt = pipe.tokenizer("the answer is")["input_ids"]
    # min_new_tokens: the tiny models' EOS is made likely (tests/conftest.py)
    ids = pipe("the answer is", max_new_tokens=4, min_new_tokens=4, do_sample=False,
               return_tensors=True)[0]["generated_token_ids"]
    assert list(ids[:len(prompt)]) == list(prompt) and len(ids) == len(prompt) + 4
    return pipe.tokenizer.decode(ids[len(prompt):])


def test_register_checks_tags_and_moves_the_alias(reg, tiny_student_dir, standins, capsys):
    c = reg["client"]
    assert _register(reg, "--domain", "alpha", "--path", str(tiny_student_dir), "--score", "0.25") == 0
    assert "registered models:/alpha-expert/1 (@teacher -> version 1)" in capsys.readouterr().out
    mv = c.get_model_version_by_alias("alpha-expert", "teacher")
    assert mv.tags["source"] == str(tiny_student_dir.resolve())
    assert mv.tags["registered_by"] == getpass.getuser() and mv.tags["eval_score"] == "0.25"
    # the version is an MLflow transformers model: it loads and generates, and resolves for a recipe
    _generates("models:/alpha-expert@teacher")
    from teachers.resolve import resolve_ref
    assert (resolve_ref("models:/alpha-expert@teacher", tracking_uri=reg["uri"]) / "config.json").exists()

    # again: a new version, the alias moves; --keep-alias leaves it; --effort names <d>-<e>-expert
    assert _register(reg, "--domain", "alpha", "--path", str(tiny_student_dir)) == 0
    assert str(c.get_model_version_by_alias("alpha-expert", "teacher").version) == "2"
    assert _register(reg, "--domain", "alpha", "--path", str(tiny_student_dir), "--keep-alias") == 0
    assert str(c.get_model_version_by_alias("alpha-expert", "teacher").version) == "2"
    assert str(c.get_model_version("alpha-expert", "3").version) == "3"
    assert _register(reg, "--domain", "alpha", "--effort", "low", "--path", str(tiny_student_dir)) == 0
    assert str(c.get_model_version_by_alias("alpha-low-expert", "teacher").version) == "1"
    capsys.readouterr()

    # a checkpoint whose tokenizer differs from the registry's is refused, naming what it does not fit
    assert _register(reg, "--domain", "beta", "--path", str(standins["llama3"])) == 2
    err = capsys.readouterr().err
    assert "does not fit models:/alpha-expert@teacher" in err and "tokenizer" in err
    assert _register(reg, "--domain", "beta", "--path", str(standins["llama3"]), "--student",
                     str(tiny_student_dir)) == 2
    assert f"does not fit --student {tiny_student_dir}" in capsys.readouterr().err
    # a folder that is not a checkpoint: named, nothing registered
    assert _register(reg, "--domain", "beta", "--path", str(reg["cwd"])) == 2
    assert "config.json" in capsys.readouterr().err
    assert "beta-expert" not in {m.name for m in c.search_registered_models()}

    # --run: a run's logged model becomes a version (here the first registration's run)
    run_id = c.get_model_version("alpha-expert", "1").run_id
    assert _register(reg, "--domain", "gamma", "--run", run_id) == 0
    g = c.get_model_version_by_alias("gamma-expert", "teacher")
    assert g.run_id == run_id and g.tags["source"] == f"runs:/{run_id}/model"
    assert (resolve_ref("models:/gamma-expert@teacher", tracking_uri=reg["uri"]) / "tokenizer_config.json").exists()
    assert not list(reg["cwd"].iterdir())


def test_distill_registers_the_student_with_its_teachers_versions(reg, tmp_path, tiny_student_dir,
                                                                  tiny_teacher_dir, capsys):
    """Two teachers by alias, one `mopd distill` step: the student is `<name>-student@student`
    with each teacher's concrete version, the data mix and the recipe's hash in its tags;
    its run's model loads with mlflow.transformers and generates; `teachers list` shows
    teachers and student and checks their fit."""
    assert _register(reg, "--domain", "alpha", "--path", str(tiny_teacher_dir)) == 0
    assert _register(reg, "--domain", "beta", "--path", str(tiny_teacher_dir)) == 0
    assert _register(reg, "--domain", "beta", "--path", str(tiny_teacher_dir)) == 0   # @teacher -> v2
    recipe, data = two_teacher_recipe(tmp_path, tiny_student_dir, reg["uri"])
    assert main(["distill", "--config", str(recipe), "--out", str(tmp_path / "out")]) == 0
    assert "registered the student as models:/two-teams-student/1" in capsys.readouterr().err
    c = reg["client"]
    mv = c.get_model_version_by_alias("two-teams-student", "student")
    assert mv.tags["teacher.alpha"] == "models:/alpha-expert/1"
    assert mv.tags["teacher.beta"] == "models:/beta-expert/2"
    assert json.loads(mv.tags["data_mix"]) == {"datasets": [str(data)], "mix": {"alpha": 1.0, "beta": 1.0}}
    from core.config import flatten, load_config, to_dict
    from mopd.distill import DistillConfig
    from mopd.distill.checkpoints import settings_hash, training_settings
    cfg = load_config(DistillConfig, recipe, [])
    assert mv.tags["recipe_hash"] == settings_hash(training_settings(flatten(to_dict(cfg))))
    assert mv.tags["domains"] == "alpha,beta"
    _generates(f"runs:/{mv.run_id}/model")
    from teachers.resolve import resolve_ref
    assert (resolve_ref("models:/two-teams-student@student", tracking_uri=reg["uri"]) / "config.json").exists()

    assert main(["teachers", "list", "--tracking-uri", reg["uri"], "--student", str(tiny_student_dir)]) == 0
    from teachers.registry import list_teachers
    entries = list_teachers(student=str(tiny_student_dir), tracking_uri=reg["uri"])
    assert [(e.kind, e.name, e.version, e.fit) for e in entries] == [
        ("teacher", "alpha-expert", "1", "ok"), ("teacher", "beta-expert", "2", "ok"),
        ("student", "two-teams-student", "1", "ok")]
    assert not list(reg["cwd"].iterdir())


def test_a_path_teacher_is_tagged_by_its_path_and_old_plain_file_models_still_resolve(reg, tmp_path,
                                                                                     tiny_student_dir):
    """A model registered before this change (plain files from log_artifacts) and one
    logged with the transformers flavor both resolve; a path teacher's lineage is its path."""
    from core.tracking import log_hf_model, start_run
    from teachers.registry import lineage, register_version
    from teachers.resolve import resolve_ref

    with start_run(experiment="e", uri=reg["uri"]) as old:
        mlflow.log_artifacts(str(tiny_student_dir), "model")
    with start_run(experiment="e", uri=reg["uri"]) as new:
        model_uri = log_hf_model(tiny_student_dir)
    register_version(reg["client"], "old-expert", source=f"runs:/{old.info.run_id}/model", run_id=old.info.run_id)
    register_version(reg["client"], "new-expert", source=model_uri, run_id=new.info.run_id,
                     model_id=model_uri.split("/")[-1])
    for ref in ("models:/old-expert@teacher", "models:/new-expert@teacher", "models:/new-expert/1",
                f"runs:/{old.info.run_id}/model", f"runs:/{new.info.run_id}/model"):
        assert (resolve_ref(ref, tracking_uri=reg["uri"]) / "model.safetensors").exists(), ref
    from types import SimpleNamespace
    tags = lineage({"a": SimpleNamespace(path=str(tiny_student_dir), adapter=""),
                    "b": SimpleNamespace(path="models:/new-expert@teacher", adapter="")}, reg["uri"])
    assert tags == {"teacher.a": str(Path(tiny_student_dir).resolve()), "teacher.b": "models:/new-expert/1"}


def test_a_baseline_stage_logs_its_model_as_an_mlflow_model(reg, tmp_path, tiny_student_dir, tiny_teacher_dir):
    """The weight-average baseline (the cheapest stage with a final checkpoint), run as the
    pipeline runs it: its run's `model` loads with mlflow.transformers and generates."""
    from pipeline.runner import StageContext
    from pipeline.stages.baselines import run_weight_avg
    from pipeline.stages.common import Tracking

    ctx = StageContext(name="weight_avg", out=tmp_path / "wa", resume=False, hash="h", seconds={},
                       inputs={"a": {"checkpoint": str(tiny_student_dir)}, "b": {"checkpoint": str(tiny_teacher_dir)}})
    ctx.out.mkdir()
    run_weight_avg(ctx, teachers=["a", "b"], quant=None, tracking=Tracking(uri=reg["uri"], experiment="e"))
    run = mlflow.MlflowClient(tracking_uri=reg["uri"]).search_runs(
        [mlflow.get_experiment_by_name("e").experiment_id])[0]
    _generates(f"runs:/{run.info.run_id}/model")
