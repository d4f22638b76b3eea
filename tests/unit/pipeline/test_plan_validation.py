"""`mopd pipeline` and `mopd toy` check their MOPD settings (and every stage config they
can) at plan time, before any stage runs (issue #20, parts 3 and 6): a pipeline with a
bad MOPD setting fails in seconds, not after forty minutes of experts."""
from __future__ import annotations

from pathlib import Path

import pytest

from core.config import ConfigError, load_config
from pipeline.cli import main as cli_main
from pipeline.config import PipelineConfig, ToyConfig
from pipeline.plan import build_plan

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "recipes" / "pipeline" / "tiny.yaml"


@pytest.mark.parametrize("overrides, says", [
    (["mopd.overrides=[rollout.temperature=-1]"], "rollout.temperature must be >= 0"),
    (["mopd.overrides=[rollout.top_p=0]"], "rollout.top_p must be in (0, 1]"),
    (["mopd.overrides=[rollout.samples_per_prompt=0]"], "rollout.samples_per_prompt must be >= 1"),
    (["mopd.overrides=['data.mix={math: .nan}']"], "data.mix.math=nan"),
    (["mopd.overrides=[data.max_prompt_tokens=1500]"], "is above rollout.max_model_len=512"),
    (["base.overrides=[model.max_positions=256]"], "is above the base (base.model.max_positions)'s "
                                                   "max_position_embeddings=256"),
])
def test_a_bad_mopd_setting_fails_at_plan_time(tmp_path, overrides, says):
    cfg = load_config(PipelineConfig, TINY, ["domains=[math]", *overrides])
    with pytest.raises(ConfigError) as e:
        build_plan(cfg, tmp_path / "run")
    assert says in str(e.value)
    assert not (tmp_path / "run" / "stages").exists()


@pytest.mark.parametrize("override, says", [
    ("jobs=0", "jobs must be >= 1"),
    ("eval.n=0", "eval.n must be >= 1"),
    ("baselines.seq_kd.lr=-1", "baselines.seq_kd.lr must be > 0"),
    ("baselines.seq_kd.temperature=-1", "baselines.seq_kd.temperature must be >= 0"),
    ("experts.chat_rm.steps=0", "experts.chat_rm.steps must be >= 1"),
])
def test_pipeline_numeric_settings_in_range(override, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        load_config(PipelineConfig, TINY, [override])


@pytest.mark.parametrize("override, says", [
    ("experts.sft=[train.lr=-1]", "train.lr must be > 0"),
    ("experts.rl=[rl.temperature=-1]", "rl.temperature must be >= 0"),
    ("base.overrides=[train.batch_size=0]", "train.batch_size must be >= 1"),
])
def test_every_stage_config_is_checked_at_plan_time(tmp_path, override, says):
    cfg = load_config(PipelineConfig, TINY, ["domains=[math]", override])
    with pytest.raises(ConfigError, match=says):
        build_plan(cfg, tmp_path / "run")


def test_pipeline_with_a_corrupt_mlflow_db_names_the_file(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "mlflow.db").write_bytes(b"not a database " * 200)
    rc = cli_main(["pipeline", "--config", str(TINY), "--out", str(out), "domains=[math]", "train.max_steps=1"])
    err = capsys.readouterr().err
    assert rc == 2 and "mopd: error:" in err and "mlflow.db is not a readable sqlite database" in err
    assert not (out / "stages").exists() and not (out / "pipeline.yaml").exists()


def test_pipeline_out_being_a_file_is_a_clear_error(tmp_path, capsys):
    out = tmp_path / "run"
    out.write_text("notes")
    rc = cli_main(["pipeline", "--config", str(TINY), "--out", str(out)])
    assert rc == 2 and "is a file, not a folder" in capsys.readouterr().err
    assert out.read_text() == "notes"


# ----------------------------------------------------------------------------- mopd toy
@pytest.mark.parametrize("override, says", [
    ("rollout.top_p=0", "rollout.top_p must be in (0, 1]"),
    ("rollout.temperature=-1", "rollout.temperature must be >= 0"),
    ("rollout.by_domain={revrse: {temperature: 0.5}}", "rollout.by_domain names ['revrse'], which are not toy tasks"),
    ("data.mix={reverse: 1.0, rotat: 1.0}", "data.mix names ['rotat']"),
    ("rewards={reverse: 'nosuchmodule:reward'}", "cannot import 'nosuchmodule:reward'"),
    ("data.max_prompt_tokens=600", "624 tokens is above rollout.max_model_len=512"),
    ("data.max_prompt_tokens=600;rollout.max_model_len=2048", "above the toy's base's max_position_embeddings=512"),
])
def test_toy_checks_its_mopd_overrides_before_building_anything(tmp_path, monkeypatch, override, says):
    import pipeline.toy as toy

    def no_stage_may_run(self, stages):
        raise AssertionError("a stage ran before the MOPD overrides were checked")
    monkeypatch.setattr(toy.StageRunner, "run", no_stage_may_run)
    with pytest.raises(ConfigError) as e:
        toy.run_toy(ToyConfig(overrides=override.split(";"), rollout_backend="hf"), tmp_path / "toy")
    assert says in str(e.value)
    assert not (tmp_path / "toy" / "base").exists()
