"""Stage `base`: the common tiny base every expert and the student start from
(experts.base.build_base on the recipe in `base.recipe`) -> DIR/base/model."""
from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

from experts.base import BaseConfig, build_base
from experts.registry import is_agent_domain
from mopd.config import checked, load_config
from mopd.distill import DistillConfig
from pipeline.runner import Stage, StageContext
from pipeline.stages import experts
from pipeline.stages.common import Scope, find, settings, with_parent


def config(scope: Scope) -> BaseConfig:
    recipe = find(scope.cfg.base.recipe)
    c = load_config(BaseConfig, recipe, list(scope.cfg.base.overrides))
    # an agent domain's episodes must fit the base's positions (and so every model's)
    positions = max([c.model.max_positions, *(agent_context(scope, d) for d in scope.domains if is_agent_domain(d))])
    c = dataclasses.replace(
        c, model=dataclasses.replace(c.model, max_positions=positions),
        data=dataclasses.replace(c.data, domains=list(c.data.domains or scope.domains)),
        train=dataclasses.replace(c.train, max_steps=min(c.train.max_steps, scope.cap)),
        mlflow=scope.tracking.section(c.mlflow))
    return checked(c, str(recipe))


def agent_context(scope: Scope, domain: str) -> int:
    """The longest episode the agent domain allows: its experts' agent.max_context_tokens (the
    recipes with the pipeline's expert overrides, as the expert stages run them) and the
    MOPD recipe's agents.<domain>.max_context_tokens (the student's episodes)."""
    ctx = [experts.config(scope, k, st).agent.max_context_tokens
           for k in scope.keys if k.domain == domain for st in experts.STAGES]
    m = load_config(DistillConfig, find(scope.cfg.mopd.recipe), list(scope.cfg.mopd.overrides))
    if domain in m.agents:
        ctx.append(m.agents[domain].max_context_tokens)
    return max(ctx)


def stage(scope: Scope, cfg: BaseConfig) -> Stage:
    return Stage("base", scope.layout.hashed(settings(cfg)), partial(run, cfg=cfg), out=scope.layout.root / "base")


def run(ctx: StageContext, cfg: BaseConfig) -> dict:
    s = build_base(with_parent(cfg, ctx.parent_run_id), ctx.out)
    return {"checkpoint": str(Path(s["checkpoint"])), "mlflow_run_id": s.get("mlflow_run_id")}
