"""Settings that used to train silently on wrong data, and common mistakes that used to
end in a raw traceback (often after every model had loaded), are clear errors before
any model loads (issue #20, parts 3 and 6)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from core.config import ConfigError, load_config
from mopd.distill.config import DistillConfig
from pipeline.cli import main as cli_main


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny student and teacher (512 positions), and a valid prompt file."""
    from core.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("validation")
    student = build_tiny_model(root / "student", seed=0)
    teacher = build_tiny_model(root / "teacher", seed=1)
    data = root / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": [{"role": "user", "content": f"hi {i}"}], "domain": "a"})
                              for i in range(4)) + "\n")
    return {"root": root, "student": student, "teacher": teacher, "data": data}


def _recipe(tmp_path: Path, models: dict, data: Path | str | None = None, backend: str = "hf") -> Path:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"""
model: {{path: {models['student']}}}
data:
  datasets: [{{path: {data or models['data']}}}]
teachers:
  a: {{path: {models['teacher']}}}
rollout: {{backend: {backend}, max_new_tokens: 8}}
train: {{max_steps: 1, prompts_per_step: 2}}
""")
    return cfg


# ----------------------------------------------------------------------------- numeric ranges
@pytest.mark.parametrize("override, says", [
    ("rollout.temperature=-1", "rollout.temperature must be >= 0"),
    ("rollout.temperature=.nan", "rollout.temperature must be a finite number"),
    ("rollout.top_p=0", "rollout.top_p must be in (0, 1]"),
    ("rollout.top_p=2", "rollout.top_p must be in (0, 1]"),
    ("rollout.samples_per_prompt=0", "rollout.samples_per_prompt must be >= 1"),
    ("rollout.max_new_tokens=0", "rollout.max_new_tokens must be >= 1"),
    ("rollout.by_domain={a: {temperature: -0.5}}", "by_domain.a: rollout.temperature must be >= 0"),
    ("rollout.by_domain={a: {top_p: 0}}", "by_domain.a: rollout.top_p"),
    ("data.mix={a: -1.0}", "data.mix.a=-1.0: a weight must be a finite number >= 0"),
    ("data.mix={a: .nan}", "data.mix.a=nan"),
    ("data.mix={a: .inf}", "data.mix.a=inf"),
    ("data.mix={a: 0.0}", "at least one must be > 0"),
    ("data.max_prompt_tokens=0", "data.max_prompt_tokens must be >= 1"),
    ("train.lr=-0.001", "train.lr must be > 0"),
    ("train.lr=.nan", "train.lr must be a finite number"),
    ("train.keep_checkpoints=0", "train.keep_checkpoints must be >= 1"),
    ("loss.is_truncation=0", "loss.is_truncation must be > 0"),
])
def test_out_of_range_settings_are_refused_when_the_config_loads(tmp_path, models, override, says):
    """temperature -1 sampled the *least* likely tokens (HF), top_p 0 was a silent greedy,
    a NaN or negative mix weight silently dropped the domain, samples_per_prompt=0 ended
    in 'max() arg is an empty sequence' after the models loaded: now each is a ConfigError
    naming the key and the file, when the config loads."""
    cfg = _recipe(tmp_path, models)
    with pytest.raises(ConfigError) as e:
        load_config(DistillConfig, cfg, [override])
    assert says in str(e.value) and "run.yaml" in str(e.value)


def test_prompt_plus_completion_must_fit_vllm_max_model_len(tmp_path, models):
    cfg = _recipe(tmp_path, models, backend="vllm")
    with pytest.raises(ConfigError, match=r"max_prompt_tokens=500 \+ rollout.max_new_tokens=64 = 564 tokens is "
                                          r"above rollout.max_model_len=512"):
        load_config(DistillConfig, cfg, ["data.max_prompt_tokens=500", "rollout.max_new_tokens=64"])
    load_config(DistillConfig, cfg, ["data.max_prompt_tokens=400", "rollout.max_new_tokens=64"])


def _check_inputs(cfg: DistillConfig, out: Path):
    from accelerate import Accelerator

    from mopd.distill.inputs import check_inputs
    return check_inputs(cfg, out, Accelerator(cpu=True))


def test_prompt_plus_completion_must_fit_the_students_positions(tmp_path, models):
    """A 512-position student with data.max_prompt_tokens=1500 trained on 1,511-token
    prompts: the student's config.json (read without the weights) now refuses it."""
    cfg = load_config(DistillConfig, _recipe(tmp_path, models), ["data.max_prompt_tokens=1500"])
    with pytest.raises(ConfigError, match="1508 tokens is above the student .model.path.'s "
                                          "max_position_embeddings=512"):
        _check_inputs(cfg, tmp_path / "out")
    assert not (tmp_path / "out" / "config.yaml").exists()


# ----------------------------------------------------------------------------- clear errors
def test_missing_student_path_is_a_clear_error(tmp_path, models):
    cfg = load_config(DistillConfig, _recipe(tmp_path, models), [f"model.path={tmp_path / 'nope'}"])
    with pytest.raises(ConfigError, match="model.path: .*nope' does not exist"):
        _check_inputs(cfg, tmp_path / "out")


def test_every_missing_path_is_named_at_once(tmp_path, models, capsys):
    """Issue 38: `mopd distill` named only the first missing path, so a recipe with three
    took three runs to fix; now one error lists them all (an MLflow URI is not a path)."""
    cfg = _recipe(tmp_path, models)
    rc = cli_main(["distill", "--config", str(cfg), "--out", str(tmp_path / "out"),
                   f"model.path={tmp_path / 'no-student'}", f"data.datasets=[{{path: {tmp_path / 'no-data.jsonl'}}}]",
                   f"teachers={{a: {{path: {tmp_path / 'no-teacher'}}}, b: {{path: 'models:/b-expert@teacher'}}}}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "problems before anything loads" in err, err
    for key, name in (("model.path", "no-student"), ("data.datasets[0].path", "no-data.jsonl"),
                      ("teachers.a.path", "no-teacher")):
        assert f"{key}: '{tmp_path / name}' does not exist" in err, err
    assert "'models:/b-expert@teacher' does not exist" not in err   # looked up in the store, not on disk


@pytest.mark.parametrize("content, says", [
    (b"", "has no rows"),
    (b"\n\n", "has no rows"),
    (b'{"prompt": "hi", "domain": "a"}\nnot json at all\n', "line 2: not valid JSON"),
    (b'[1, 2]\n', "line 1: a row must be a JSON object"),
    (b'{"prompt": "caf\xe9", "domain": "a"}\n', "not UTF-8 text"),
])
def test_empty_junk_or_non_utf8_jsonl_names_the_file(tmp_path, models, content, says):
    from mopd.distill.data import load_prompts
    from core.tiny import load_tokenizer

    data = tmp_path / "bad.jsonl"
    data.write_bytes(content)
    cfg = load_config(DistillConfig, _recipe(tmp_path, models, data=data))
    with pytest.raises(ConfigError) as e:
        load_prompts(cfg, load_tokenizer(models["student"]))
    assert says in str(e.value) and "bad.jsonl" in str(e.value)


def test_a_folder_that_is_not_a_dataset_is_a_clear_error(tmp_path, models):
    from mopd.distill.data import load_prompts
    from core.tiny import load_tokenizer

    folder = tmp_path / "not_a_dataset"
    folder.mkdir()
    (folder / "notes.txt").write_text("hello")
    cfg = load_config(DistillConfig, _recipe(tmp_path, models, data=folder))
    with pytest.raises(ConfigError, match="not_a_dataset is a folder but not a dataset saved with save_to_disk"):
        load_prompts(cfg, load_tokenizer(models["student"]))


def test_a_message_whose_content_is_not_a_string_is_a_clear_error(tmp_path, models):
    from mopd.distill.data import load_prompts
    from core.tiny import load_tokenizer

    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": 42}], "domain": "a"}) + "\n")
    cfg = load_config(DistillConfig, _recipe(tmp_path, models, data=data))
    with pytest.raises(ConfigError, match=r"p.jsonl row 0: message 0 of 'prompt' has a int content"):
        load_prompts(cfg, load_tokenizer(models["student"]))


def test_non_utf8_yaml_names_the_file(tmp_path):
    cfg = tmp_path / "latin1.yaml"
    cfg.write_bytes("model: {path: caf\xe9}\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="latin1.yaml: not a UTF-8 text file"):
        load_config(DistillConfig, cfg)


def test_out_being_a_file_is_a_clear_error(tmp_path, models, capsys):
    out = tmp_path / "out.txt"
    out.write_text("my notes")
    rc = cli_main(["distill", "--config", str(_recipe(tmp_path, models)), "--out", str(out)])
    assert rc == 2
    assert "mopd: error: --out" in capsys.readouterr().err
    assert out.read_text() == "my notes"


def test_checkpoint_folder_that_cannot_be_written_is_refused_before_loading(tmp_path, models, monkeypatch):
    cfg = load_config(DistillConfig, _recipe(tmp_path, models))
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoints").write_text("")      # a file where the checkpoints go
    with pytest.raises(ConfigError, match="checkpoints is a file"):
        _check_inputs(cfg, out)
    (out / "checkpoints").unlink()
    (out / "checkpoints").mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == out / "checkpoints"
                        else real(p, mode, **kw))    # tests run as root, for whom chmod changes nothing
    with pytest.raises(ConfigError, match="checkpoints is not writable"):
        _check_inputs(cfg, out)


def test_corrupt_mlflow_db_names_the_file(tmp_path):
    from core.outdir import OutDirError, check_store

    db = tmp_path / "mlflow.db"
    db.write_bytes(b"this is not a sqlite database, just junk " * 100)
    with pytest.raises(OutDirError, match="mlflow.db is not a readable sqlite database"):
        check_store(f"sqlite:///{db}")
    check_store(f"sqlite:///{tmp_path / 'absent.db'}")     # a new store is fine
