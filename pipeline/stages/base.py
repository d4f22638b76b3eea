"""Stage `base`: the common tiny base every expert and the student start from
(experts.base.build_base on the recipe in `base.recipe`) -> DIR/base/model."""
from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

from experts.base import BaseConfig, build_base
from mopd.config import checked, load_config
from pipeline.runner import Stage, StageContext
from pipeline.stages.common import Scope, find, settings, with_parent


def config(scope: Scope) -> BaseConfig:
    recipe = find(scope.cfg.base.recipe)
    c = load_config(BaseConfig, recipe, list(scope.cfg.base.overrides))
    c = dataclasses.replace(
        c, data=dataclasses.replace(c.data, domains=list(c.data.domains or scope.domains)),
        train=dataclasses.replace(c.train, max_steps=min(c.train.max_steps, scope.cap)),
        mlflow=scope.tracking.section(c.mlflow))
    return checked(c, str(recipe))


def stage(scope: Scope, cfg: BaseConfig) -> Stage:
    return Stage("base", scope.layout.hashed(settings(cfg)), partial(run, cfg=cfg), out=scope.layout.root / "base")


def run(ctx: StageContext, cfg: BaseConfig) -> dict:
    s = build_base(with_parent(cfg, ctx.parent_run_id), ctx.out)
    return {"checkpoint": str(Path(s["checkpoint"])), "mlflow_run_id": s.get("mlflow_run_id")}
