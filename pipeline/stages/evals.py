"""Stages `eval/<model>`: greedy held-out scores (evals.run.evaluate_model) of the base,
each teacher (on its own column unless eval.teachers_on_all_domains), the student and
the baselines -> DIR/evals/<model>/scores.json (each column's score and cost: tokens per
task, and turns and tool calls per agent episode, mean and p90; MLflow metrics score/<column>,
tokens_mean/<column>, tokens_p90/<column>, ...). One column per teacher key, its settings
from the key's RL expert config as the pipeline resolved it (so the chat columns score
with the pipeline's reward model)."""
from __future__ import annotations

import json
from dataclasses import asdict
from functools import partial

from evals.run import EvalColumn, column_from_config, evaluate_model
from experts.registry import all_domains
from experts.run import ExpertConfig
from core.config import ConfigError
from core.task_cost import cost_metrics
from pipeline.runner import Stage, StageContext
from pipeline.stages.common import Scope, Tracking, find, log_metrics, log_params


def columns(scope: Scope, experts: dict[str, dict[str, ExpertConfig]]) -> list[EvalColumn]:
    e = scope.cfg.eval
    cols = [column_from_config(k.key, experts[k.key]["rl"], n=e.n, n_per_domain=e.n_per_domain,
                               max_new_tokens=e.max_new_tokens, batch_size=e.batch_size or None)
            for k in scope.keys]
    known = all_domains(find(scope.cfg.experts.recipes))
    keys = {k.key for k in scope.keys}
    for name in list(e.n_per_domain) + list(e.max_new_tokens):
        # an entry of a domain this run leaves out is fine (the recipe covers every domain);
        # a name that is no domain at all is a typo
        if name not in keys and name not in scope.domains and name.split("/")[0] not in known:
            raise ConfigError(f"pipeline: eval settings name {name!r}, not a domain or domain/effort "
                              f"(domains: {known})")
    return cols


def models(scope: Scope, cols: list[EvalColumn], teachers: dict[str, str],
           baselines: dict[str, str]) -> list[tuple[str, str, list[EvalColumn]]]:
    """[(model, the stage whose checkpoint it is, the columns it is scored on)]: the base,
    each teacher (its own column unless eval.teachers_on_all_domains), the student, the
    baselines. `teachers`: key -> RL expert stage; `baselines`: name -> stage."""
    by_key = {c.name: c for c in cols}
    every = scope.cfg.eval.teachers_on_all_domains
    return [("base", "base", cols),
            *[(f"teacher/{k}", st, cols if every else [by_key[k]]) for k, st in teachers.items()],
            ("student", "mopd", cols),
            *[(name, st, cols) for name, st in baselines.items()]]


def stages(scope: Scope, scored: list[tuple[str, str, list[EvalColumn]]], rm: str | None) -> dict[str, Stage]:
    """{model: its eval stage} for `scored` (see `models`); `rm`: the chat RM stage, which a
    stage scoring a chat column waits for."""
    out = {}
    for model, src, cols in scored:
        needs_rm = rm is not None and any(c.domain == "chat" for c in cols)
        out[model] = Stage(f"eval/{model}", scope.layout.hashed([asdict(c) for c in cols]),
                           partial(run, model=model, src=src, cols=cols, tracking=scope.tracking),
                           deps=[src, *([rm] if needs_rm else [])], out=scope.layout.eval(model),
                           shows={"model": f"the {src} stage's checkpoint"})
    return out


def run(ctx: StageContext, model: str, src: str, cols: list[EvalColumn], tracking: Tracking) -> dict:
    o = ctx.inputs[src]
    ref = o.get("checkpoint") or o.get("final")
    with tracking.stage_run(ctx, f"eval-{model.replace('/', '-')}"):
        log_params({"model": ref})
        # out_dir: a domain that renders its outputs (frontend) saves them under
        # out/pages/<model>/<column>/ for the report's picture
        scores, cost = evaluate_model(ref, cols, label=model, out_dir=ctx.out, with_cost=True)
        log_metrics({**{f"score/{c}": v for c, v in scores.items()}, **cost_metrics(cost)})
    ctx.out.mkdir(parents=True, exist_ok=True)
    (ctx.out / "scores.json").write_text(json.dumps({"model": ref, "scores": scores, "cost": cost}, indent=1))
    return {"model": ref, "scores": scores, "cost": cost, "out": str(ctx.out)}
