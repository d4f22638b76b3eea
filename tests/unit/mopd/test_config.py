import dataclasses
from pathlib import Path

import pytest

from core.config import ConfigError, flatten, load_config
from mopd.distill.config import DistillConfig

REPO = Path(__file__).resolve().parents[3]

MINIMAL = """
model: {path: /tmp/student}
data:
  datasets: [{path: /tmp/prompts}]
teachers:
  add: {path: /tmp/teacher_add}
train: {max_steps: 3}
"""


def write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_loads_and_overrides(tmp_path):
    cfg = load_config(DistillConfig, write(tmp_path, MINIMAL),
                      ["train.max_steps=7", "loss.discount=0.5", "rollout.backend=hf", "train.lr=1e-3"])
    assert cfg.train.max_steps == 7 and cfg.loss.discount == 0.5 and cfg.rollout.backend == "hf"
    assert cfg.train.lr == 1e-3
    assert cfg.teachers["add"].path == "/tmp/teacher_add" and cfg.teachers["add"].backend == "hf"


def test_unknown_key_names_key_and_file(tmp_path):
    p = write(tmp_path, MINIMAL + "rollout: {max_new_tokenz: 3}\n")
    with pytest.raises(ConfigError) as e:
        load_config(DistillConfig, p)
    assert "max_new_tokenz" in str(e.value) and str(p) in str(e.value)


def test_unknown_override_key(tmp_path):
    with pytest.raises(ConfigError, match="nope"):
        load_config(DistillConfig, write(tmp_path, MINIMAL), ["train.nope=1"])


@pytest.mark.parametrize("override, field", [
    ("train.max_steps=abc", "train.max_steps"),
    ("train.lr=true", "train.lr"),
    ("rollout.backend=sglang", "rollout.backend"),
    ("train.resume=3", "train.resume"),
])
def test_wrong_type_names_field(tmp_path, override, field):
    with pytest.raises(ConfigError) as e:
        load_config(DistillConfig, write(tmp_path, MINIMAL), [override])
    assert field in str(e.value)


def test_staleness_bound_checked(tmp_path):
    with pytest.raises(ConfigError, match="max_staleness"):
        load_config(DistillConfig, write(tmp_path, MINIMAL), ["train.minibatches=4", "loss.max_staleness=1"])


def test_async_steps_need_staleness(tmp_path):
    """rollout.async_steps trains the next batch one whole batch (train.minibatches
    updates) late: loss.max_staleness must cover 2 * minibatches - 1 versions."""
    c = write(tmp_path, MINIMAL)
    assert load_config(DistillConfig, c).rollout.async_steps is False
    assert load_config(DistillConfig, c, ["rollout.async_steps=true"]).rollout.async_steps is True
    with pytest.raises(ConfigError, match="async_steps.*max_staleness=0"):
        load_config(DistillConfig, c, ["rollout.async_steps=true", "loss.max_staleness=0"])
    with pytest.raises(ConfigError, match="raise loss.max_staleness to 3"):
        load_config(DistillConfig, c, ["rollout.async_steps=true", "train.minibatches=2", "loss.max_staleness=2"])
    with pytest.raises(ConfigError, match="correct_below"):
        load_config(DistillConfig, c, ["rollout.async_steps=true", "loss.kl=full", "rollout.correct_below=0.1",
                                       "rollout.backend=hf"])


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config(DistillConfig, "/nonexistent.yaml")


def test_flatten():
    assert flatten({"a": {"b": 1, "c": {"d": 2}}, "e": []}) == {"a.b": 1, "a.c.d": 2, "e": []}


def test_every_recipe_loads():
    """Every YAML under recipes/ is loaded with the config class it is for."""
    from pipeline.recipes import config_class_for

    found = sorted((REPO / "recipes").rglob("*.yaml"))
    assert found, "no recipes found"
    for path in found:
        cls = config_class_for(path)
        if cls is None:  # accelerate configs: plain YAML for `accelerate launch`
            import yaml
            assert isinstance(yaml.safe_load(path.read_text()), dict), path
            continue
        cfg = load_config(cls, path)
        assert dataclasses.is_dataclass(cfg)
        if hasattr(cfg, "train"):   # run configs; a harness mix (recipes/harnesses/) is not one
            assert cfg.train.max_steps >= 1, path
