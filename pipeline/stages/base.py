"""Stage `base`: the common base every expert and the student start from: the tiny base
trained by experts.base.build_base on the recipe in `base.recipe` -> DIR/base/model, or,
with `base.path`, that checkpoint as it is (a local HF folder or a models:/ reference,
resolved and checked at plan time; nothing is trained or copied)."""
from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

from experts.base import BaseConfig, build_base
from experts.registry import is_agent_domain
from core.config import ConfigError, checked, load_config
from mopd.distill import DistillConfig
from mopd.distill.preflight import max_positions
from pipeline.config import PipelineConfig
from pipeline.runner import Stage, StageContext
from pipeline.stages import experts
from pipeline.stages.common import (MLFLOW_OWNED, Scope, find, overridden, refuse, resolve_checkpoint, settings,
                                    with_parent)

def resolve(cfg: PipelineConfig, tracking_uri: str) -> str:
    """The local folder of `base.path` ("" when the pipeline trains its base), checked
    as a causal LM with a tokenizer and a chat template, before anything runs."""
    ref = cfg.base.path
    if not ref:
        return ""
    if cfg.base.overrides:
        raise ConfigError(f"pipeline: base.overrides {list(cfg.base.overrides)} have no effect with base.path "
                          f"(nothing is trained: the checkpoint is used as it is); drop them")
    return resolve_checkpoint(ref, "base.path", tracking_uri)


def positions(scope: Scope, cfg: BaseConfig | None) -> tuple[int | None, str]:
    """The base's positions (which every expert and the student keep) and how to name them."""
    if cfg is not None:
        return cfg.model.max_positions, "the base (base.model.max_positions)"
    return max_positions(scope.base_checkpoint), f"the base ({scope.base_checkpoint})"


def config(scope: Scope) -> BaseConfig | None:
    """The tiny base's BaseConfig, or None with `base.path` (then an agent domain's episodes
    must fit the checkpoint's positions)."""
    if scope.base_checkpoint:
        n = max_positions(scope.base_checkpoint)
        for d in scope.domains:
            if n is not None and is_agent_domain(d) and agent_context(scope, d) > n:
                raise ConfigError(f"pipeline: {d}'s episodes take up to {agent_context(scope, d)} tokens, more "
                                  f"than base.path's max_position_embeddings {n}: lower agent.max_context_tokens")
        return None
    refuse(overridden(list(scope.cfg.base.overrides)), {
        "model.path": "the tiny base is trained from base.recipe; to start from a checkpoint, set base.path "
                      "(a local HF folder or a models:/ reference) instead", **MLFLOW_OWNED}, "base.overrides")
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


def stage(scope: Scope, cfg: BaseConfig | None) -> Stage:
    if cfg is None:
        ckpt = scope.base_checkpoint
        return Stage("base", {"path": ckpt, "files": fingerprint(ckpt)}, partial(use_checkpoint, path=ckpt),
                     shows={"model": ckpt, "note": "base.path, not trained"})
    return Stage("base", scope.layout.hashed(settings(cfg)), partial(run, cfg=cfg), out=scope.layout.root / "base",
                 shows={"model": f"tiny Qwen2 trained from {scope.cfg.base.recipe}", "dtype": "float32"})


def fingerprint(path: str) -> list:
    """[name, size, mtime] of the checkpoint folder's files: new weights in the same folder
    make a new hash, so the experts and everything after them are redone."""
    return sorted([f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in Path(path).iterdir() if f.is_file())


def use_checkpoint(ctx: StageContext, path: str) -> dict:
    return {"checkpoint": path, "mlflow_run_id": None}


def run(ctx: StageContext, cfg: BaseConfig) -> dict:
    s = build_base(with_parent(cfg, ctx.parent_run_id), ctx.out)
    return {"checkpoint": str(Path(s["checkpoint"])), "mlflow_run_id": s.get("mlflow_run_id")}
