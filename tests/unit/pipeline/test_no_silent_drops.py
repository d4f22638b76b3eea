"""Every pipeline setting reaches the stage it names or is an error before anything runs
(issue #33, item 2): `base.path` makes a checkpoint the base, an expert's SFT start is
applied and checked, and each setting the pipeline sets itself (where an override used
to be replaced without a word) is refused naming the key. Through `build_plan`, and the
CLI's `--dry-run` in-process where the error message is what a user sees."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from core.config import ConfigError, load_config
from pipeline.cli import main as cli_main
from pipeline.config import PipelineConfig
from pipeline.plan import build_plan

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "recipes" / "pipeline" / "tiny.yaml"


def plan(tmp_path, *overrides):
    cfg = load_config(PipelineConfig, TINY, ["domains=[math]", *overrides])
    return build_plan(cfg, tmp_path / "run")


def stage(p, name):
    return next(s for s in p.stages if s.name == name)


def dry_run(tmp_path, capsys, *overrides) -> tuple[int, str]:
    rc = cli_main(["pipeline", "--config", str(TINY), "--out", str(tmp_path / "run"), "--dry-run",
                   "domains=[math]", *overrides])
    return rc, capsys.readouterr().err


# ------------------------------------------------------------------ base.path
def test_base_path_is_every_experts_and_the_students_start(tmp_path, tiny_student_dir):
    p = plan(tmp_path, f"base.path={tiny_student_dir}")
    ckpt = str(Path(tiny_student_dir).resolve())
    assert stage(p, "base").shows["model"] == ckpt
    assert stage(p, "base").settings["path"] == ckpt          # nothing trained: the stage hands it on
    for key in ("math/low", "math/high"):
        assert stage(p, f"expert/{key}/sft").settings["model"]["path"] == ckpt
        assert stage(p, f"expert/{key}/sft").settings["model"]["base"] == ckpt
    assert p.mopd_cfg.model.path == ckpt
    assert stage(p, "mopd").shows["model"] == ckpt


def test_without_base_path_the_tiny_base_is_trained(tmp_path):
    p = plan(tmp_path)
    assert "hidden_size" in stage(p, "base").settings["model"]   # the BaseConfig, as before
    assert p.mopd_cfg.model.path == str(tmp_path / "run" / "base" / "model")


def test_dry_run_prints_each_stages_model_dtype_quant_and_teachers(tmp_path, capsys, tiny_student_dir):
    rc, err = dry_run(tmp_path, capsys, f"base.path={tiny_student_dir}")
    assert rc == 0
    ckpt = str(Path(tiny_student_dir).resolve())
    assert ckpt in err and "base.path, not trained" in err
    assert f"expert/math/low/sft: {ckpt}  [float32, quant int4 g32 llm-compressor]" in err
    assert "teacher math/low" in err and "experts/math-low/rl/model" in err


def broken(tmp_path, tiny_student_dir, drop: str) -> Path:
    d = tmp_path / f"no-{drop}"
    shutil.copytree(tiny_student_dir, d)
    (d / drop).unlink()
    return d


@pytest.mark.parametrize("make, says", [
    (lambda t, s: t / "missing", "does not exist"),
    (lambda t, s: broken(t, s, "config.json"), "no config.json"),
    (lambda t, s: broken(t, s, "tokenizer.json"), "has no tokenizer"),
    (lambda t, s: broken(t, s, "chat_template.jinja"), "has no chat template"),
])
def test_a_bad_base_path_is_refused_at_dry_run_naming_it(tmp_path, capsys, tiny_student_dir, make, says):
    path = make(tmp_path, tiny_student_dir)
    rc, err = dry_run(tmp_path, capsys, f"base.path={path}")
    assert rc == 2
    assert "base.path" in err and str(path.name) in err and says in err
    assert not (tmp_path / "run" / "stages").exists()


def test_base_path_that_is_not_a_causal_lm_is_refused(tmp_path, tiny_student_dir):
    d = tmp_path / "encoder"
    shutil.copytree(tiny_student_dir, d)
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**c, "architectures": ["BertModel"]}))
    with pytest.raises(ConfigError, match="not a causal LM"):
        plan(tmp_path, f"base.path={d}")


def test_base_overrides_with_base_path_are_refused(tmp_path, tiny_student_dir):
    with pytest.raises(ConfigError, match=r"base.overrides .* no effect with base.path"):
        plan(tmp_path, f"base.path={tiny_student_dir}", "base.overrides=[model.num_layers=4]")


def test_base_overrides_model_path_points_at_base_path(tmp_path):
    # was: "model: unknown key 'path'"
    with pytest.raises(ConfigError, match=r"base.overrides: model.path=.*set base.path"):
        plan(tmp_path, "base.overrides=[model.path=/ckpt/Qwen3-8B]")


# ------------------------------------------------------------------ expert overrides
def test_an_experts_sft_start_is_applied(tmp_path, tiny_student_dir):
    p = plan(tmp_path, f"experts.domains={{math/low: {{sft: [model.path={tiny_student_dir}]}}}}")
    assert stage(p, "expert/math/low/sft").settings["model"]["path"] == str(tiny_student_dir)
    assert stage(p, "expert/math/high/sft").settings["model"]["path"] == "$OUT/base/model"


def test_a_missing_expert_start_is_an_error_at_dry_run(tmp_path, capsys):
    # was: passed --dry-run, then silently replaced with the tiny base
    rc, err = dry_run(tmp_path, capsys, "experts.sft=[model.path=/missing/ckpt]")
    assert rc == 2
    assert "experts.sft" in err and "model.path" in err and "/missing/ckpt" in err


@pytest.mark.parametrize("override, says", [
    ("experts.rl=[model.path=/x]", "starts from its SFT stage's checkpoint"),
    ("experts.sft=[model.base=/x]", "set base.path"),
    ("experts.sft=[mlflow.experiment=mine]", "top-level mlflow.experiment"),
    ("experts.rl=[mlflow.register=false]", "registers each RL expert"),
])
def test_expert_settings_the_pipeline_owns_are_refused(tmp_path, override, says):
    with pytest.raises(ConfigError, match=says) as e:
        plan(tmp_path, override)
    assert override.split("[")[1].split("=")[0] in str(e.value)


def test_quant_off_in_every_expert_reaches_experts_and_student(tmp_path):
    # was: quant.enabled forced back to true
    p = plan(tmp_path, "experts.sft=[quant.enabled=false]", "experts.rl=[quant.enabled=false]")
    assert stage(p, "expert/math/low/sft").settings["quant"]["enabled"] is False
    assert stage(p, "expert/math/low/rl").shows["quant"] == "off"
    assert p.mopd_cfg.quant.enabled is False


def test_quant_off_in_sft_alone_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="quant sections differ"):
        plan(tmp_path, "experts.sft=[quant.enabled=false]")


# ------------------------------------------------------------------ mopd.overrides
@pytest.mark.parametrize("override, says", [
    ("model.path=/ckpt/other", "set mopd.student to start it from a checkpoint of your own"),
    ("data.datasets=[{path: /x}]", "prompts are the pipeline's"),
    ("teachers.math/low.path=/ckpt/t", "is the pipeline's math/low expert"),
    ("teachers.code.backend=hf", "'code' is not a teacher key of this run"),
    ("quant.group_size=128", "its quant is the experts'"),
    ("mlflow.experiment=mine", "top-level mlflow.experiment"),
])
def test_mopd_settings_the_pipeline_owns_are_refused(tmp_path, capsys, override, says):
    # was: model.path, teachers and quant replaced without a word
    rc, err = dry_run(tmp_path, capsys, f"mopd.overrides=[{override!r}]")
    assert rc == 2
    assert says in err and override.split("=")[0] in err


def test_mopd_teacher_setting_and_agreeing_quant_are_applied(tmp_path):
    server = '{backend: server, urls: ["http://127.0.0.1:9"], model: t, top_k: 8}'
    p = plan(tmp_path, f"mopd.overrides=['teachers.math/high={server}', quant.group_size=32]")
    t = p.mopd_cfg.teachers
    assert (t["math/high"].backend, t["math/high"].top_k, t["math/low"].backend) == ("server", 8, "hf")
    assert t["math/high"].path == str(tmp_path / "run" / "experts" / "math-high" / "rl" / "model")
    assert "(server)" in stage(p, "mopd").shows["teachers"]["math/high"]


def test_stage_hashes_of_runs_without_the_new_settings_are_unchanged(tmp_path):
    # data.files / data.columns (new) stay out of a procedural expert's hashed settings, so
    # existing run folders keep reusing their experts and everything after them
    p = plan(tmp_path)
    for s in p.stages:
        if s.name.startswith("expert/"):
            assert "files" not in s.settings["data"] and "columns" not in s.settings["data"], s.name


def test_an_expert_start_with_another_tokenizer_than_the_base_is_refused(tmp_path, standins):
    base = standins["qwen3"]
    with pytest.raises(ConfigError, match=r"math/low.*cannot teach a student of base.path.*vocabulary differs"):
        plan(tmp_path, f"base.path={base}",
             f"experts.domains={{math/low: {{sft: [model.path={standins['llama3']}]}}}}")
    # a larger expert of the same family and tokenizer is fine
    p = plan(tmp_path, f"base.path={base}",
             f"experts.domains={{math/low: {{sft: [model.path={standins['qwen3-teacher']}]}}}}")
    assert stage(p, "expert/math/low/sft").settings["model"]["path"] == str(standins["qwen3-teacher"])


# ------------------------------------------------------------------ mopd.student
def test_mopd_student_is_the_students_start_and_the_seq_kd_and_mix_rl_baselines(tmp_path, standins):
    """mopd.student (a checkpoint with the base's tokenizer, here ~5x the base) is where
    MOPD, seq-KD and Mix-RL start; the experts still start from the base."""
    base, student = (str(Path(standins[f]).resolve()) for f in ("qwen3", "qwen3-teacher"))
    p = plan(tmp_path, f"base.path={base}", f"mopd.student={student}", "baselines.mix_rl.enabled=true")  # off in tiny
    assert p.mopd_cfg.model.path == student == stage(p, "mopd").settings["model"]["path"]
    assert stage(p, "mopd").shows["model"] == student
    assert stage(p, "baseline/seq_kd").settings["student"] == student
    assert stage(p, "baseline/seq_kd").shows["model"].startswith(student)
    assert stage(p, "baseline/mix_rl").settings["start"] == student
    assert stage(p, "expert/math/low/sft").settings["model"]["path"] == base
    # without it: the base, and the seq-KD baseline's hash as before (no `student` key)
    q = plan(tmp_path, f"base.path={base}")
    assert q.mopd_cfg.model.path == base and "student" not in stage(q, "baseline/seq_kd").settings
    assert stage(q, "mopd").settings != stage(p, "mopd").settings


def test_mopd_student_shows_in_the_dry_run(tmp_path, capsys, standins):
    base, student = (str(Path(standins[f]).resolve()) for f in ("qwen3", "qwen3-teacher"))
    rc, err = dry_run(tmp_path, capsys, f"base.path={base}", f"mopd.student={student}")
    assert rc == 0
    assert f"mopd: {student}  [" in err, err


@pytest.mark.parametrize("base, student, says", [
    ("qwen3", "llama3", "tokenizer vocabulary differs"),        # another tokenizer than base.path's
    (None, "qwen3", "the tiny base trained from"),               # the tiny base's tokenizer is the project's
    ("qwen3", "missing", "'{missing}' does not exist"),
])
def test_a_mopd_student_that_cannot_learn_from_the_experts_is_refused(tmp_path, capsys, standins, no_model_loads,
                                                                      base, student, says):
    missing = str(tmp_path / "nope")
    path = missing if student == "missing" else str(standins[student])
    rc, err = dry_run(tmp_path, capsys, *([f"base.path={standins[base]}"] if base else []), f"mopd.student={path}")
    assert rc == 2
    assert "mopd.student" in err and says.format(missing=missing) in err, err


@pytest.mark.slow   # a real 1-step MOPD stage, ~40 s here
def test_the_mopd_stage_writes_the_student_into_its_config_yaml(tmp_path, standins):
    """The stage itself (data stage run, the experts stood in by the base's copies): its
    config.yaml, what `mopd distill` wrote, names the mopd.student checkpoint."""
    import yaml

    from pipeline.runner import StageContext

    base, student = (str(Path(standins[f]).resolve()) for f in ("qwen3", "qwen3-teacher"))
    p = plan(tmp_path, f"base.path={base}", f"mopd.student={student}", "train.max_steps=1", "mopd.n_prompts=2",
             "mopd.overrides=[rollout.backend=hf, rollout.max_new_tokens=4, rollout.correct_below=0, "
             "train.prompts_per_step=2, train.minibatches=1, quant.group_size=32]", "experts.sft=[quant.group_size=32]",
             "experts.rl=[quant.group_size=32]")
    root = tmp_path / "run"

    def ctx(name):
        return StageContext(name=name, out=stage(p, name).out, resume=False, inputs={}, hash="h", seconds={})
    stage(p, "data").fn(ctx("data"))
    for k in ("math-low", "math-high"):
        (root / "experts" / k / "rl").mkdir(parents=True)
        (root / "experts" / k / "rl" / "model").symlink_to(base)
    stage(p, "mopd").fn(ctx("mopd"))
    assert yaml.safe_load((root / "mopd" / "config.yaml").read_text())["model"]["path"] == student
