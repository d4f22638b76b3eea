"""Which config class a recipe YAML is for, decided by where it lives under recipes/."""
from __future__ import annotations

from pathlib import Path


def config_class_for(path: str | Path):
    parts = Path(path).resolve().parts
    if "recipes" not in parts:
        return None
    sub = parts[parts.index("recipes") + 1]
    if sub == "mopd":
        from mopd.train import DistillConfig
        return DistillConfig
    if sub == "experts":
        from experts.run import ExpertConfig
        return ExpertConfig
    if sub == "base":
        from experts.base import BaseConfig
        return BaseConfig
    if sub == "pipeline":
        from mopd.pipeline import PipelineConfig
        return PipelineConfig
    if sub == "accelerate":
        return None
    raise ValueError(f"{path}: no config class is known for recipes/{sub}/")
