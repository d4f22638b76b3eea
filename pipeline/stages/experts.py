"""Stages `expert/<key>/sft` and `expert/<key>/rl`: each teacher key's expert, SFT from
the base, then RL from the SFT checkpoint, QAT on (pipeline.expert: train, score,
register the RL checkpoint as <domain>[-<effort>]-expert@teacher) -> DIR/experts/<key>/.

Each stage's config is its recipe (experts.recipes/<domain>/{sft,rl}[-<effort>].yaml, else
the domain's own recipes folder)
with the pipeline's overrides, then the fields the pipeline owns: where it starts, QAT,
the step cap, the MLflow store, the chat reward model."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import asdict
from functools import partial
from pathlib import Path

from experts.registry import data_module, expert_recipe, get as get_domain, ref_of
from experts.files import load_rows, resolve_files
from experts.run import ExpertConfig
from core.config import ConfigError, checked, load_config
from mopd.distill.preflight import check_model_dir
from core.quant import QuantConfig
from pipeline.expert import run_expert
from pipeline.runner import Stage, StageContext, run_in_subprocess
from pipeline.stages.common import (MLFLOW_OWNED, Key, Scope, check_checkpoint, find, names, overridden, refuse,
                                    settings, with_parent)

STAGES = ("sft", "rl")
OUTPUTS = ("checkpoint", "score", "score_sft", "score_base", "model_uri", "mlflow_run_id", "train_seconds")


def name(key: str, st: str) -> str:
    return f"expert/{key}/{st}"


def configs(scope: Scope) -> dict[str, dict[str, ExpertConfig]]:
    """{key: {"sft": ExpertConfig, "rl": ExpertConfig}} for every teacher key."""
    return {k.key: {st: config(scope, k, st) for st in STAGES} for k in scope.keys}


def config(scope: Scope, k: Key, st: str) -> ExpertConfig:
    x, L = scope.cfg.experts, scope.layout
    # overrides: every domain's, then the domain's, then the domain/effort's
    per = [x.domains.get(k.domain), x.domains.get(k.key) if k.key != k.domain else None]
    overrides = list(getattr(x, st)) + [o for p in per if p is not None for o in getattr(p, st)]
    path = expert_recipe(find(x.recipes), k.domain, k.effort, st)
    where = f"experts.{st} / experts.domains.<{k.key}>.{st} ({path})"
    named = overridden(overrides)
    refuse(named, {**owned(st), **({"rl.reward_kwargs.reward_model": "chat is scored with the pipeline's own "
                                    "reward model (the chat_rm stage)"} if k.domain == "chat" else {})}, where)
    c = load_config(ExpertConfig, path, overrides)
    if get_domain(c.domain).name != k.domain or c.effort != k.effort or c.stage != st:
        raise ConfigError(f"{path}: says domain={c.domain!r} effort={c.effort!r} "
                          f"stage={c.stage!r}, expected {k.domain!r} {k.effort!r} {st!r}")
    rl, ev = c.rl, c.eval
    if k.domain == "chat":
        rl = dataclasses.replace(rl, reward_kwargs={**rl.reward_kwargs, "reward_model": str(L.chat_rm)})
        if st == "sft" and scope.rm_from_sft:   # the RL stage scores this checkpoint instead
            ev = dataclasses.replace(ev, score=False)
    # SFT starts from the base unless an override names another start (a checkpoint the team
    # has: it must exist now, not when the stage starts); RL from its SFT checkpoint
    start = L.expert_model(k.key, "sft") if st == "rl" else scope.base_model
    if "model.path" in named:
        start = c.model.path
        if not start.startswith(("models:/", "runs:/")):
            check_checkpoint(check_model_dir(start, key=f"pipeline: {where}: model.path"), f"{where}: model.path")
            if scope.base_checkpoint:
                fits_base(scope.base_checkpoint, start, f"{where}: model.path")
    # a team's files: as given, else beside the recipe, else under the repository; checked
    # now (a missing file, column or bad row), not when the stage starts
    files = resolve_files(c.data.files, path)
    for split, f in files.items():
        if not Path(f).exists():
            raise ConfigError(f"pipeline: {path}: data.files.{split}: {c.data.files[split]!r} does not exist")
    if files:
        c = dataclasses.replace(c, data=dataclasses.replace(c.data, files=files))
        check_rows(str(path), k, st, tuple(files.items()), tuple(c.data.columns.items()), c.data.n_train)
    # QAT from SFT onward unless the overrides turn it off (then in every expert alike:
    # common_quant, since the student's quant is the teachers')
    quant = c.quant if names(named, "quant.enabled") else dataclasses.replace(c.quant, enabled=True)
    c = dataclasses.replace(
        c, domain=k.domain, model=dataclasses.replace(c.model, base=str(scope.base_model), path=str(start)),
        quant=quant, rl=rl, eval=ev,
        train=dataclasses.replace(c.train, max_steps=min(c.train.max_steps, scope.cap)),
        mlflow=scope.tracking.section(c.mlflow, register=st == "rl"))
    return checked(c, str(path))


@functools.lru_cache(maxsize=64)   # the plan resolves a stage's config several times
def check_rows(recipe: str, k: Key, st: str, files: tuple, columns: tuple, n: int):
    """The training rows of a team's file, read and checked as the stage will (file, row, column)."""
    try:
        load_rows(dict(files), dict(columns), "train", domain=k.domain, effort=k.effort, stage=st,
                  data_module=data_module(k.domain), n=n)
    except ValueError as e:
        raise ConfigError(f"pipeline: {recipe}: {e}") from None


def fits_base(base: str, start: str, key: str):
    """An expert becomes a teacher of a student that starts from the base: its tokenizer
    must be the base's (ids, special tokens, chat template); known now, not at MOPD."""
    from transformers import AutoTokenizer

    from teachers.resolve import check_fit

    fit = check_fit(AutoTokenizer.from_pretrained(base), start)
    if not fit.ok:
        raise ConfigError(f"pipeline: {key}: {start} cannot teach a student of base.path {base}: "
                          f"{'; '.join(fit.problems)}")


def owned(st: str) -> dict[str, str]:
    """Expert settings the pipeline sets itself: an override of one is an error."""
    out = {"model.base": "it is the pipeline's base (scored as score_base): set base.path", **MLFLOW_OWNED,
           "mlflow.register": "the pipeline registers each RL expert as its teacher"}
    if st == "rl":
        out["model.path"] = ("the RL stage starts from its SFT stage's checkpoint; to start an expert elsewhere, "
                             "set model.path in experts.sft (or experts.domains.<domain>.sft)")
    return out


def shows(cfg: ExpertConfig) -> dict:
    return {"model": cfg.model.path, "dtype": cfg.model.dtype, "quant": quant_label(cfg.quant)}


def quant_label(q: QuantConfig | None) -> str:
    if q is None or not q.enabled:
        return "off"
    return f"int{q.bits} g{q.group_size} {q.convention}" if q.format == "int4" else f"{q.format} g{q.group_size}"


def common_quant(experts: dict[str, dict[str, ExpertConfig]]) -> QuantConfig:
    """The experts' one quant section (the student's must equal the teachers')."""
    quants = {k: asdict(e["rl"].quant) for k, e in experts.items()}
    first = next(iter(quants))
    for k, q in quants.items():
        if q != quants[first] or asdict(experts[k]["sft"].quant) != q:
            raise ConfigError(f"pipeline: the experts' quant sections differ ({first}: {quants[first]}, "
                              f"{k}: {q}); the student's quant must equal the teachers', so they must agree")
    return experts[first]["rl"].quant


def stages(scope: Scope, experts: dict[str, dict[str, ExpertConfig]], rm: Stage | None) -> list[Stage]:
    """Every key's SFT and RL stage, with the chat RM stage `rm` where it belongs: first when
    it starts from the base or random, else right after the chat SFT it starts from."""
    out = [rm] if rm is not None and not scope.rm_from_sft else []
    for k in scope.keys:
        rm_deps = [rm.name] if rm is not None and k.domain == "chat" else []
        after_rm = k.domain == "chat" and scope.rm_from_sft
        out.append(_stage(scope, k, "sft", experts[k.key]["sft"], ["base", *([] if after_rm else rm_deps)]))
        if after_rm:
            out.append(rm)
        out.append(_stage(scope, k, "rl", experts[k.key]["rl"], [name(k.key, "sft"), *rm_deps]))
    return out


def _stage(scope: Scope, k: Key, st: str, cfg: ExpertConfig, deps: list[str]) -> Stage:
    s = settings(cfg)
    for key in ("files", "columns"):   # data from files: kept out of the hashes of runs without (which predate it)
        if not s["data"][key]:
            s["data"].pop(key)
    return Stage(name(k.key, st), scope.layout.hashed(s), partial(run, cfg=cfg), deps=deps,
                 out=scope.layout.expert(k.key, st), concurrent=True, cost=cost(cfg), shows=shows(cfg))


def run(ctx: StageContext, cfg: ExpertConfig) -> dict:
    cfg = with_parent(cfg, ctx.parent_run_id)
    if ctx.concurrent:
        # a domain a recipe named by 'module:attribute' is known in this process only: the
        # stage's process gets the path
        cfg = dataclasses.replace(cfg, domain=ref_of(cfg.domain))
        # its own process: torch threads and MLflow's active run are per process
        s = run_in_subprocess(ctx, "pipeline.expert", cfg)
    else:
        s = run_expert(cfg, ctx.out)
    return {k: s.get(k) for k in OUTPUTS}


def cost(cfg: ExpertConfig) -> float:
    """Rough work of an expert stage, to start the longest first (the critical path):
    rows seen times the characters of a few of its rows (tool_use prompts carry the tool
    list), RL counting its generations."""
    n = cfg.train.max_steps * cfg.train.batch_size
    try:
        kw = {"effort": cfg.effort} if cfg.effort else {}
        rows = data_module(cfg.domain).make_dataset("train", 8, seed=cfg.data.seed, difficulty=cfg.data.difficulty,
                                                    **kw)
        chars = sum(len(str(r.get("prompt", ""))) + len(str(r.get("completion", ""))) for r in rows) / len(rows)
    except Exception:  # only a scheduling hint: never fail the plan over it
        chars = 100.0
    return float(n * chars * (4 if cfg.stage == "rl" else 1))
