"""`mopd eval --models name=path_or_uri,... --domains all --out DIR`: every domain's
held-out suite for several models, greedy and deterministic -> DIR/eval.json.

One column per teacher: a domain with reasoning efforts (math: low, high) is scored per
effort, as "math/low" and "math/high", never averaged: each effort has its own system
prompt, its own token budget and its own teacher, and an average would hide a student
that learned one effort and not the other. Domains without efforts are one column each
("code", "chat", ...).

Each column's settings come from the domain's expert recipe
(recipes/experts/<domain>/rl[-<effort>].yaml): data.difficulty, data.seed, data.dataset,
eval.max_new_tokens, eval.batch_size and rl.reward_kwargs (the chat reward model's folder,
for instance); `--n` (default 200) sets how many held-out rows each column scores. Every
column is scored through the domain's own `evals/<domain>.py:evaluate` (HF greedy
decoding); `--backend vllm` decodes greedily with a vLLM engine instead (procedural test
sets only) and scores with the same reward.

Beside each score, what a task cost (core.task_cost): completion tokens per task, mean
and 90th percentile (nearest rank), counted in the tokenizer's ids up to and including the
EOS; an agent column's episodes also count turns and tool calls per episode.

eval.json:
    {"domains": [column, ...], "models": {name: ref}, "scores": {name: {column: score}},
     "cost": {name: {column: {"tokens": {"mean", "p90"}, "n"[, "turns": {...}, "tool_calls": {...}]}}},
     "settings": {column: {...}}, "backend": "hf", "seconds": {name: s}}
A column whose suite decodes outside core.rollout.greedy_texts (and is no agent domain) has
"tokens": null: not counted, never zero.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.table import Table

from experts import registry
from core import ranks
from core.config import load_config
from core.domain import load_ref
from core.dryrun import DryRun, check_accelerate_config
from core.outdir import hold_out_dir
from core.task_cost import record_tokens, token_cost

# agent domains: the held-out harness kinds scored beside a column (evals/agent.py harness_scores)
HELD_OUT_KINDS = ("held_out_combo", "held_out_novel")
# where harness_scores keeps each kind's episode stats (its cost among them)
HELD_OUT_STATS = {"held_out_combo": "held_out_combo_harness", "held_out_novel": "held_out_harness"}

# Imports kept inside functions below (torch, transformers, mlflow, vLLM, experts.run,
# teachers.resolve, whose package loads the scoring backends): the `mopd` CLI imports
# this module at start-up for `add_parser`.


# ----------------------------------------------------------------------------- columns
def load_evaluate(domain: str) -> Callable:
    """The domain's held-out suite, its Domain object's `eval` ('module:function': the
    built-ins' evals/<domain>.py, a team's in its own package), imported here: the
    registry (experts/, a layer below) only names it."""
    d = registry.get(domain)
    fn = load_ref(d.eval, f"domain {d.name!r} ({registry.package_of(d.name)}): eval")
    if not callable(fn):
        raise ValueError(f"domain {d.name!r}: eval {d.eval} is not callable")
    return fn


@dataclass
class EvalColumn:
    name: str                      # "math/low" or "code"
    domain: str
    effort: str | None
    n: int
    seed: int = 0
    difficulty: int = 1
    dataset: str = "procedural"
    max_new_tokens: int = 64
    batch_size: int = 64
    reward_kwargs: dict = field(default_factory=dict)
    episode: dict = field(default_factory=dict)   # agent domains: harnesses, max_turns, max_context_tokens


def columns_for(domains: list[str], *, recipes_dir: str | Path = registry.RECIPES, n: int = 200,
                n_per_domain: dict[str, int] | None = None, max_new_tokens: dict[str, int] | None = None,
                batch_size: int | None = None, recipe_overrides: dict[str, list[str]] | None = None,
                reward_kwargs: dict[str, dict] | None = None) -> list[EvalColumn]:
    """One EvalColumn per teacher key of `domains`, settings read from each key's RL
    expert recipe (plus `recipe_overrides[key]`, key=value strings). `n_per_domain`,
    `max_new_tokens` and `reward_kwargs` are keyed by column ("math/low") or domain
    ("math"); the column's own entry wins."""
    from experts.run import ExpertConfig  # torch, mlflow: see the note at the top

    cols = []
    for d in domains:
        for key, effort in registry.teacher_keys(d):
            rcfg = load_config(ExpertConfig, registry.expert_recipe(recipes_dir, d, effort, "rl"),
                               list((recipe_overrides or {}).get(key, [])))
            cols.append(column_from_config(key, rcfg, n=n, n_per_domain=n_per_domain,
                                           max_new_tokens=max_new_tokens, batch_size=batch_size,
                                           reward_kwargs=reward_kwargs))
    return cols


def _pick(table, key, domain, default):
    table = table or {}
    return table.get(key, table.get(domain, default))


def column_from_config(key: str, rcfg, *, n: int = 200, n_per_domain: dict | None = None,
                       max_new_tokens: dict | None = None, batch_size: int | None = None,
                       reward_kwargs: dict | None = None) -> EvalColumn:
    """The EvalColumn of teacher key `key` from its (RL) ExpertConfig `rcfg`."""
    d = rcfg.domain
    kw = dict(rcfg.rl.reward_kwargs)
    kw.update(_pick(reward_kwargs, key, d, {}))
    return EvalColumn(
        name=key, domain=d, effort=rcfg.effort, n=int(_pick(n_per_domain, key, d, n)),
        seed=rcfg.data.seed, difficulty=rcfg.data.difficulty,
        # rows from a team's files train the expert; the held-out column stays the domain's suite
        dataset="procedural" if rcfg.data.dataset == "files" else rcfg.data.dataset,
        max_new_tokens=int(_pick(max_new_tokens, key, d, rcfg.eval.max_new_tokens)),
        batch_size=batch_size or rcfg.eval.batch_size, reward_kwargs=kw,
        episode=({"harnesses": rcfg.agent.harnesses, "max_turns": rcfg.agent.max_turns,
                  "max_context_tokens": rcfg.agent.max_context_tokens} if registry.is_agent_domain(d) else {}))


# ----------------------------------------------------------------------------- scoring
def resolve_model(ref: str, name: str | None = None) -> str:
    """A local HF folder for a path or an MLflow URI (models:/..., runs:/...); errors
    name the model by its --models `name`."""
    from teachers.resolve import resolve_ref  # see the note at the top

    return str(resolve_ref(ref, what=f"--models {name}: checkpoint" if name else "model checkpoint"))


def _eval_kwargs(col: EvalColumn) -> dict:
    kw = dict(n=col.n, seed=col.seed, difficulty=col.difficulty, max_new_tokens=col.max_new_tokens,
              batch_size=col.batch_size, **col.reward_kwargs, **col.episode)
    if col.effort:
        kw["effort"] = col.effort
    if col.dataset != "procedural":
        kw["dataset"] = col.dataset
    return kw


def column_cost(res, counts: list[int]) -> dict:
    """One column's cost: the suite's own (an agent domain's episodes: tokens, turns, tool
    calls) if it reports one, else the completion tokens greedy_texts recorded for it."""
    if isinstance(res, dict) and res.get("cost") is not None:
        return res["cost"]
    return token_cost(counts)


def evaluate_model(ref: str, columns: list[EvalColumn], *, backend: str = "hf",
                   progress: bool = True, label: str | None = None,
                   out_dir: str | Path | None = None, with_cost: bool = False):
    """{column: score} of one model (path or MLflow URI), greedy. The model is loaded
    once and handed to every domain's `evaluate`. With `out_dir`, a domain whose evaluate
    takes `screenshots_dir` (frontend) saves its pages under out_dir/pages/<label>/<column>/.
    With `with_cost`, returns (scores, cost): {column: what a task cost} (module note)."""
    import torch  # see the note at the top

    from core.evaluate import load_model

    path = resolve_model(ref, label)
    scores: dict[str, float] = {}
    cost: dict[str, dict | None] = {}
    if backend == "vllm":
        scores, cost = _evaluate_vllm(path, columns, progress=progress, label=label or ref)
        return (scores, cost) if with_cost else scores
    if backend != "hf":
        raise ValueError(f"eval backend must be 'hf' or 'vllm', got {backend!r}")
    model, tok = load_model(path)
    for col in columns:
        ev = load_evaluate(col.domain)
        kw = _eval_kwargs(col)
        if "tokenizer" in inspect.signature(ev).parameters:
            kw["tokenizer"] = tok
        if out_dir is not None and "screenshots_dir" in inspect.signature(ev).parameters:
            kw["screenshots_dir"] = str(Path(out_dir) / "pages" / (label or "model") / col.name.replace("/", "-"))
        torch.manual_seed(0)
        t0 = time.perf_counter()
        with record_tokens() as counts:
            res = ev(model, **kw)
        scores[col.name] = float(res["score"] if isinstance(res, dict) else res)
        cost[col.name] = column_cost(res, counts)
        for kind in HELD_OUT_KINDS:
            if isinstance(res, dict) and res.get(kind) is not None:
                # agent domains: each held-out harness kind beside the train harnesses' score, never averaged in
                scores[f"{col.name}/{kind}"] = float(res[kind])
                cost[f"{col.name}/{kind}"] = (res.get(HELD_OUT_STATS[kind]) or {}).get("cost")
        if progress:
            print(f"[eval] {label or ref} {col.name}: {scores[col.name]:.3f} ({col.n} rows, "
                  f"{_tokens_text(cost[col.name])} tokens/task, {time.perf_counter() - t0:.1f} s)",
                  file=sys.stderr, flush=True)
    del model
    return (scores, cost) if with_cost else scores


def _tokens_text(c: dict | None) -> str:
    """'12.5 (p90 20)' of a column's cost, '-' when its tokens were not counted."""
    t = (c or {}).get("tokens")
    return "-" if not t else f"{t['mean']:.1f} (p90 {t['p90']:g})"


def _evaluate_vllm(path: str, columns: list[EvalColumn], *, progress: bool,
                   label: str) -> tuple[dict[str, float], dict[str, dict]]:
    """(scores, cost) of greedy decoding with a vLLM engine, scored with the domain's reward:
    the procedural test split only (the same rows evals/<domain>.py builds)."""
    # vLLM is an optional heavy dependency; transformers: see the note at the top
    from transformers import AutoTokenizer

    from core.evaluate import mean_reward
    from core.rollout import greedy_texts, make_rollout
    from core.sft import encode_prompt

    agents = [c.name for c in columns if registry.is_agent_domain(c.domain)]
    if agents:
        raise ValueError(f"{agents}: agent domains are scored by episodes (evals/<domain>.py), which the vllm eval "
                         "backend does not run; use --backend hf")
    tok = AutoTokenizer.from_pretrained(path)
    rollout = make_rollout("vllm", model_path=path, dtype="float32", seed=0, enforce_eager=True)
    scores, cost = {}, {}
    try:
        for col in columns:
            if col.dataset != "procedural":
                raise ValueError(f"{col.name}: the vllm eval backend handles procedural test sets only "
                                 f"(dataset={col.dataset!r}); use --backend hf")
            dom = registry.load_domain(col.domain)
            kw = {"effort": col.effort} if col.effort else {}
            ds = dom.data.make_dataset("test", col.n, seed=col.seed, difficulty=col.difficulty, **kw)
            with record_tokens() as counts:
                texts = greedy_texts(rollout, tok, [encode_prompt(tok, p) for p in ds["prompt"]],
                                     max_new_tokens=col.max_new_tokens)
            cost[col.name] = token_cost(counts)
            fn = functools.partial(dom.reward, **col.reward_kwargs) if col.reward_kwargs else dom.reward
            scores[col.name], _ = mean_reward(ds, texts, fn)
            if progress:
                print(f"[eval] {label} {col.name}: {scores[col.name]:.3f} (vllm)", file=sys.stderr)
    finally:
        rollout.close()
    return scores, cost


def eval_json(scores: dict[str, dict[str, float]], columns: list[EvalColumn], models: dict[str, str],
              *, backend: str = "hf", seconds: dict[str, float] | None = None,
              cost: dict[str, dict[str, dict | None]] | None = None) -> dict:
    return {"domains": [c.name for c in columns], "models": dict(models), "scores": scores,
            "cost": cost or {}, "settings": {c.name: dataclasses.asdict(c) for c in columns}, "backend": backend,
            "seconds": {k: round(v, 1) for k, v in (seconds or {}).items()}}


def run_eval(models: dict[str, str], columns: list[EvalColumn], out: str | Path, *, backend: str = "hf",
             progress: bool = True) -> dict:
    """Every model on every column; writes DIR/eval.json after each model (a crash keeps
    the models already scored) and returns its content."""
    out = Path(out)
    main, rank, world = ranks.is_main(), ranks.rank(), ranks.world_size()
    lock = hold_out_dir(out, "mopd eval") if main else None  # noqa: F841 - one writer per --out (rank 0)
    scores: dict[str, dict[str, float]] = {}
    cost: dict[str, dict[str, dict | None]] = {}
    seconds: dict[str, float] = {}
    result: dict = {}
    for name, ref in models.items():
        t0 = time.perf_counter()
        # under a launcher each rank scores its share of the columns; rank 0 writes them all
        mine = columns[rank::world]
        part = (evaluate_model(ref, mine, backend=backend, progress=progress, label=name, out_dir=out, with_cost=True)
                if mine else ({}, {}))
        parts = ranks.gather(part)
        merged = {k: v for p, _ in parts for k, v in p.items()}
        merged_cost = {k: v for _, c in parts for k, v in c.items()}
        keys = [k for c in columns for k in (c.name, *(f"{c.name}/{h}" for h in HELD_OUT_KINDS)) if k in merged]
        scores[name] = {k: merged[k] for k in keys}
        cost[name] = {k: merged_cost.get(k) for k in keys}
        seconds[name] = time.perf_counter() - t0
        result = eval_json(scores, columns, models, backend=backend, seconds=seconds, cost=cost)
        if main:
            (out / "eval.json").write_text(json.dumps(result, indent=1))
    return result


def print_scores(result: dict, title: str = "held-out scores (greedy)"):
    t = Table(title=title)
    t.add_column("model")
    for d in result["domains"]:
        t.add_column(d, justify="right")
    for name, s in result["scores"].items():
        t.add_row(name, *[("-" if s.get(d) is None else f"{s[d]:.3f}") for d in result["domains"]])
    Console(stderr=True).print(t)
    c = Table(title="completion tokens per task: mean (p90)")
    c.add_column("model")
    for d in result["domains"]:
        c.add_column(d, justify="right")
    for name, per in (result.get("cost") or {}).items():
        c.add_row(name, *[_tokens_text(per.get(d)) for d in result["domains"]])
    Console(stderr=True).print(c)


# ----------------------------------------------------------------------------- CLI
def parse_models(text: str) -> dict[str, str]:
    models = {}
    for part in [p for p in text.split(",") if p.strip()]:
        if "=" not in part:
            raise ValueError(f"--models: {part!r} is not name=path_or_uri")
        name, ref = part.split("=", 1)
        if not name.strip() or not ref.strip():
            raise ValueError(f"--models: {part!r} is not name=path_or_uri")
        if name.strip() in models:
            raise ValueError(f"--models: model name {name.strip()!r} given twice")
        models[name.strip()] = ref.strip()
    if not models:
        raise ValueError("--models is empty")
    return models


def parse_domains(text: str, recipes_dir: str | Path = registry.RECIPES) -> list[str]:
    """'all': the domains with recipes under `recipes_dir` (the built-ins by default); else
    the named ones, each with recipes there or a registered domain (a team's package, or a
    'module:attribute' path), as their names."""
    known = registry.all_domains(recipes_dir)
    if text.strip() in ("all", ""):
        return known
    doms = [d.strip() for d in text.split(",") if d.strip()]
    out, bad = [], []
    for d in doms:
        try:
            out.append(d if d in known else registry.get(d).name)
        except ValueError:
            bad.append(d)
    if bad:
        raise ValueError(f"--domains: {bad} have no recipes under {recipes_dir} (known: {known}) and are no "
                         f"registered domains (registered: {registry.names()})")
    return out


def _parse_reward_kwargs(items: list[str] | None) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for it in items or []:
        key, sep, val = it.partition("=")
        dom, dot, name = key.rpartition(".")
        if not sep or not dot or not dom:
            raise ValueError(f"--reward-kwarg {it!r}: expected <domain>.<name>=<value> "
                             "(e.g. chat.reward_model=runs/pipeline/chat_rm)")
        out.setdefault(dom, {})[name] = val
    return out


def add_parser(sub):
    p = sub.add_parser("eval", help="held-out score of several models on every domain -> DIR/eval.json")
    p.add_argument("--models", required=True, help="name=path_or_uri,... (HF folders or models:/ URIs)")
    p.add_argument("--domains", default="all", help="comma-separated domains, or 'all' (default)")
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=200, help="held-out rows per column (default 200)")
    p.add_argument("--backend", default="hf", choices=["hf", "vllm"])
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--recipes", default=str(registry.RECIPES), help="expert recipe folder the settings come from")
    p.add_argument("--reward-kwarg", action="append",
                   help="<domain>.<name>=<value> for a domain's reward, e.g. chat.reward_model=DIR")
    p.add_argument("--tracking-uri", help="MLflow tracking URI to resolve models:/ URIs "
                   "(default: $MLFLOW_TRACKING_URI)")
    p.add_argument("--dry-run", action="store_true", help="check every model (path or models:/ URI, config and "
                   "tokenizer files), domain and column, and print what would be scored; loads no model")
    p.add_argument("--accelerate-config", default="", metavar="FILE", help="with --dry-run: also check the "
                   "accelerate config `accelerate launch --config_file FILE` would use")
    p.set_defaults(fn=main_args)
    return p


def check_args(args, dry: DryRun) -> tuple[dict[str, str], list[EvalColumn]]:
    """Every model, domain and column of a `mopd eval` command line, each problem recorded in
    `dry` (the dry run prints them; the real run raises them together before any model loads)."""
    from core.hf_dirs import hf_dir_problem

    if args.tracking_uri:
        import mlflow  # see the note at the top

        mlflow.set_tracking_uri(args.tracking_uri)
    models = dry.check(parse_models, args.models) or {}
    for name, ref in models.items():
        path = dry.check(_named, name, resolve_model, ref, name)
        problem = path and hf_dir_problem(path, vllm=args.backend == "vllm", backend_key="--backend")
        if problem:
            dry.problem(f"--models {name}: {problem}")
        dry.show(f"model {name}", path if path and path != ref else ref)
    domains = dry.check(parse_domains, args.domains, args.recipes)
    if domains is None:   # the unknown ones are named; the known ones are still checked
        known = set(dry.check(registry.all_domains, args.recipes) or ())
        domains = [d.strip() for d in args.domains.split(",") if d.strip() in known]
    reward_kwargs = dry.check(_parse_reward_kwargs, args.reward_kwarg) or {}
    columns = []
    for d in domains:   # one domain's bad recipe or suite does not hide the next one's
        if dry.check(load_evaluate, d) is not None:
            columns += dry.check(columns_for, [d], recipes_dir=args.recipes, n=args.n, batch_size=args.batch_size,
                                 reward_kwargs=reward_kwargs) or []
    dry.show("columns", ", ".join(f"{c.name} ({c.n} rows)" for c in columns) or "-")
    dry.show("backend", args.backend)
    return models, columns


def _named(name: str, fn: Callable, *args):
    """fn(*args), its error prefixed with the --models name it is about (a models:/ lookup's is not)."""
    try:
        return fn(*args)
    except ValueError as e:
        if str(e).startswith("--models"):
            raise
        raise ValueError(f"--models {name}: {e}") from None


def main_args(args) -> int:
    if args.dry_run:
        dry = DryRun("mopd eval --dry-run")
        check_args(args, dry)
        check_accelerate_config(args.accelerate_config, dry)
        dry.show("out", f"{args.out}/eval.json")
        return dry.finish()
    # one writer per --out (rank 0 of a launch), before any model loads
    lock = hold_out_dir(args.out, "mopd eval") if ranks.is_main() else None  # noqa: F841
    dry = DryRun("mopd eval")
    models, columns = check_args(args, dry)   # every model found before the first is scored
    dry.raise_if_any()
    result = run_eval(models, columns, args.out, backend=args.backend)
    if ranks.is_main():
        print_scores(result)
        print(str(Path(args.out) / "eval.json"))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evals.run")
    add_parser(ap.add_subparsers(dest="cmd", required=True))
    return main_args(ap.parse_args(["eval", *(argv or sys.argv[1:])]))


if __name__ == "__main__":
    sys.exit(main())
