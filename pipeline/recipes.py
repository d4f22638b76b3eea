"""Which config class a recipe YAML is for, decided by where it lives under recipes/."""
from __future__ import annotations

from pathlib import Path

from experts.base import BaseConfig
from experts.run import ExpertConfig
from core.agent.harness import HarnessMix
from mopd.distill.config import DistillConfig
from pipeline.baseline import BaselineConfig
from pipeline.config import PipelineConfig

CONFIG_CLASSES = {"mopd": DistillConfig, "experts": ExpertConfig, "base": BaseConfig, "pipeline": PipelineConfig,
                  "baselines": BaselineConfig,   # mopd baseline seq-kd|mix-rl|warmup
                  "harnesses": HarnessMix,   # agent harness mixes, named by DistillConfig.agents.<d>.harnesses
                  "accelerate": None}   # accelerate: plain YAML for `accelerate launch`


def config_class_for(path: str | Path):
    """recipes/<kind>/..., recipes/real/<family>/ holding the same kinds for one model
    family (<kind>/... in folders, pipeline.yaml at its top), and recipes/opt_in/<domain>/."""
    parts = Path(path).resolve().parts
    if "recipes" not in parts:
        return None
    i = parts.index("recipes")
    sub = parts[i + 1]
    if sub == "real" and len(parts) > i + 3:
        sub = parts[i + 3] if len(parts) > i + 4 else Path(parts[-1]).stem
    if sub == "opt_in":   # recipes/opt_in/<domain>/{sft,rl,mopd}.yaml: a domain "every domain" leaves out
        sub = "mopd" if Path(parts[-1]).stem == "mopd" else "experts"
    if sub not in CONFIG_CLASSES:
        raise ValueError(f"{path}: no config class is known for recipes/{sub}/")
    return CONFIG_CLASSES[sub]
