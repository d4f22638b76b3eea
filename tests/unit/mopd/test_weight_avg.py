"""mopd.baselines.weight_avg: checkpoints that differ only in run settings saved in their
config (use_cache: TRL-trained experts were saved with false, the agent experts with true; the
first whole tiny pipeline run stopped there) are averaged; another architecture is refused."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from mopd.baselines.weight_avg import weight_average
from tests.conftest import build_tiny


def _set(path, **kv):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(kv)
    (path / "config.json").write_text(json.dumps(cfg))


def test_use_cache_does_not_make_another_architecture(tmp_path):
    a, b = build_tiny(tmp_path / "a", seed=0), build_tiny(tmp_path / "b", seed=1)
    _set(a, use_cache=False)
    weight_average([a, b], tmp_path / "avg")
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "avg", dtype=torch.float32).state_dict()
    wa = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32).state_dict()
    wb = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32).state_dict()
    k = "model.layers.0.mlp.up_proj.weight"
    torch.testing.assert_close(got[k], (wa[k] + wb[k]) / 2)


def test_another_architecture_is_refused(tmp_path):
    a, b = build_tiny(tmp_path / "a", seed=0), build_tiny(tmp_path / "b", seed=1)
    _set(b, rms_norm_eps=1e-3)
    with pytest.raises(ValueError, match="another architecture.*rms_norm_eps"):
        weight_average([a, b], tmp_path / "avg")
