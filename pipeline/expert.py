"""`mopd expert --config recipes/experts/<domain>/{sft,rl}.yaml --out DIR`: one stage of
a domain expert, with TRL. Also `python -m pipeline.expert --config ... --out DIR` and
`accelerate launch -m pipeline.expert --config ... --out DIR`.

Reads top to bottom: load the config, check the domain's pieces exist (data and reward
through experts.run.check, the held-out suite, the domain's eval, here), build the data and
the model (LoRA, QAT), train with experts.run (SFT or GRPO) into DIR/model, score it on
the held-out split with the domain's eval (and the base, and the SFT checkpoint when the
SFT stage did not score itself), log and register in MLflow, write DIR/summary.json:

    {"domain", "effort", "stage", "score_base", "score_sft", "score", "cost", "checkpoint",
     "model_uri", "train_seconds", "mlflow_run_id", "tracking_uri"}
("cost": the checkpoint's completion tokens per held-out task, mean and p90, and an agent
domain's turns and tool calls per episode; MLflow metrics tokens_mean, tokens_p90, ...)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Callable

import mlflow
import torch

from evals.run import column_cost, load_evaluate
from experts.files import resolve_files
from experts.registry import is_agent_domain
from experts.run import (ExpertConfig, build_dataset, check, load_model, log_config, lora_base_ref, register,
                         registered_name, resolve_model, say, start_mlflow, train)
from core import exitcodes, ranks
from core.config import ConfigError, load_config
from core.outdir import hold_out_dir
from core.task_cost import cost_metrics, record_tokens
from core.tracking import check_store, end_run, log_hf_model, resolve_uri
from mopd.distill.signals import Interrupted, StopOnSignal


def score(cfg: ExpertConfig, evaluate: Callable, model_path: str) -> tuple[float, dict]:
    """(held-out score, its cost per task: evals.run.column_cost) of the checkpoint at
    `model_path` with the domain's `evaluate`, on the recipe's data settings, eval budget
    and reward settings."""
    kw = dict(n=cfg.data.n_test, seed=cfg.data.seed, difficulty=cfg.data.difficulty,
              max_new_tokens=cfg.eval.max_new_tokens, batch_size=cfg.eval.batch_size, **cfg.rl.reward_kwargs)
    if cfg.effort:
        kw["effort"] = cfg.effort
    if cfg.data.dataset not in ("procedural", "files"):   # files: the training rows; held out: the suite's
        kw["dataset"] = cfg.data.dataset
    if is_agent_domain(cfg.domain):   # episodes: the recipe's harnesses, turns and context
        kw.update(harnesses=cfg.agent.harnesses, max_turns=cfg.agent.max_turns,
                  max_context_tokens=cfg.agent.max_context_tokens)
        if cfg.agent.env:   # the recipe's environment (experts/run.py: only a domain that takes it)
            kw["env"] = cfg.agent.env
    with record_tokens() as counts:
        res = evaluate(model_path, **kw)
    return float(res["score"] if isinstance(res, dict) else res), column_cost(res, counts)


def run_expert(cfg: ExpertConfig, out: str | Path) -> dict:
    """Train, score, log and register one expert stage; returns DIR/summary.json's content
    ({} on the non-main processes of a multi-process launch)."""
    out = Path(out)
    check_store(resolve_uri(cfg.mlflow.tracking_uri, out))   # a dead tracking server: said now, not after training
    domain = check(cfg, out)
    # a recipe may name its domain by a 'module:attribute' path: from here on, by its name
    cfg = dataclasses.replace(cfg, domain=domain.name)
    evaluate = load_evaluate(cfg.domain)
    main = ranks.state().is_main_process   # before TRL builds its own state (core/ranks.py: why)
    lock = hold_out_dir(out, "mopd expert") if main else None  # noqa: F841 - one writer per --out
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    t0 = time.perf_counter()
    # SIGTERM / SIGINT stop at once (before training: nothing to finish; during: no checkpoint
    # to save), the MLflow run marked KILLED
    stop, run, status = StopOnSignal("[expert]", at_once=True), None, "FAILED"
    try:
        train_ds = build_dataset(cfg, domain, "train", cfg.data.n_train)
        model, tok = load_model(cfg)
        if main:
            run = start_mlflow(cfg, out)
            log_config(cfg, out)
        say(f"{cfg.domain}{'/' + cfg.effort if cfg.effort else ''} {cfg.stage}: {cfg.train.max_steps} steps "
            f"from {cfg.model.path} ({len(train_ds)} training rows)")
        stop.start()
        model_dir = train(cfg, domain, model, tok, train_ds, out, is_main_process=main)
        del model
        train_s = time.perf_counter() - t0
        if model_dir is None:
            status = "FINISHED"
            return {}

        s = s_base = cost = None
        if cfg.eval.score:
            say("scoring on the held-out split")
            s, cost = score(cfg, evaluate, str(model_dir))
            base_ref = cfg.model.base or (cfg.model.path if cfg.stage == "sft" else "")
            s_base = score(cfg, evaluate, resolve_model(base_ref))[0] if (base_ref and cfg.eval.score_base) else None
        if cfg.stage == "sft":
            s_sft = s
        else:
            prev = Path(resolve_model(cfg.model.path)).parent / "summary.json"
            s_sft = json.loads(prev.read_text()).get("score") if prev.exists() else None
            if s_sft is None and cfg.eval.score:  # the SFT stage did not score itself
                s_sft = score(cfg, evaluate, resolve_model(cfg.model.path))[0]
        mlflow.log_metrics({k: v for k, v in {"score": s, "score_base": s_base, "score_sft": s_sft,
                                              "train_seconds": train_s}.items() if v is not None}
                           | cost_metrics({"": cost}))
        # an MLflow transformers model (load_model("runs:/<id>/model") opens it); plain files if the flavor fails
        model_uri = log_hf_model(model_dir)
        if model_uri is None:
            mlflow.log_artifacts(str(model_dir), "model")
        uri, lora = None, {}
        if cfg.model.keep_adapter:   # the expert is registered as base + adapter (teachers.lora)
            mlflow.log_artifacts(str(out / "adapter"), "adapter")
            lora = {"base": lora_base_ref(cfg), "adapter": "true"}
        if cfg.mlflow.register:
            uri = register(run.info.run_id, cfg.mlflow.registered_name or registered_name(cfg.domain, cfg.effort),
                           tags={**lora, **({"eval_score": f"{s:g}"} if s is not None else {})},
                           artifact="adapter" if lora else "model", model_uri=None if lora else model_uri)
        summary = {"domain": cfg.domain, "effort": cfg.effort, "stage": cfg.stage, "score_base": s_base,
                   "score_sft": s_sft, "score": s, "checkpoint": str(model_dir.resolve()), "model_uri": uri,
                   **({"adapter": str((out / "adapter").resolve()), "base": lora["base"]} if lora else {}),
                   "cost": cost, "train_seconds": round(train_s, 1), "mlflow_run_id": run.info.run_id,
                   "tracking_uri": mlflow.get_tracking_uri()}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        mlflow.log_artifact(str(out / "summary.json"))
        _print(summary)
        status = "FINISHED"
        return summary
    except (KeyboardInterrupt, Interrupted):
        status = "KILLED"
        raise
    finally:
        if run is not None:
            end_run(status)
        stop.restore()


def _print(s: dict):
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    say(f"{s['domain']}{'/' + s['effort'] if s['effort'] else ''} {s['stage']}: base {fmt(s['score_base'])}"
        f"  sft {fmt(s['score_sft'])}  now {fmt(s['score'])}  -> {s['checkpoint']}"
        + (f"  registered {s['model_uri']}" if s["model_uri"] else ""))


def files_beside(cfg: ExpertConfig, recipe: str | Path) -> ExpertConfig:
    """`cfg` with its relative data.files read from the working directory, else beside the
    recipe (a team's package ships its data with its recipes)."""
    if not cfg.data.files:
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, files=resolve_files(cfg.data.files, recipe)))


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(prog="mopd expert", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    a = p.parse_args(argv)
    try:
        run_expert(files_beside(load_config(ExpertConfig, a.config, a.overrides), a.config), a.out)
    except (exitcodes.Unreachable, ConfigError, ValueError) as e:   # expected: one line and its documented code
        sys.exit(exitcodes.report(e, "mopd expert"))


if __name__ == "__main__":
    main()
