"""Held-out eval of the `agent` domain: greedy episodes on held-out tasks, run by the same
episode runner MOPD samples with (core/agent/episode.py) in the environment of
rewards/agent.py; an episode scores 1 when the final state and answer pass the check
(BFCL's multi-turn way), else 0.

The score is the success rate through the train harnesses (each episode's harness drawn,
seeded, from the recipe's mix); the held-out harness (renamed tools and arguments,
another call syntax, another system prompt) is scored on the same tasks and reported
beside it as `held_out`, never averaged in. Also reported: the share of episodes with at
least one failed call, the recovery rate (success among those), turns per episode, and
what an episode cost: student tokens, turns and tool calls (mean and p90, under "cost").
"""
from __future__ import annotations

import json
import random
from functools import partial

import torch

from experts.agent.data import DOMAIN, make_dataset
from core.agent.episode import Episode, run_episodes
from core.agent.harness import load_harnesses
from core.rollout import HFRollout, eos_ids
from core.task_cost import episode_cost
from rewards.agent import make_env

HARNESSES = "recipes/harnesses/agent.yaml"


def episode_stats(episodes: list[Episode]) -> dict:
    """Success, failed-call share, recovery after the first failed call, turns, cut share,
    and the episodes' cost (core.task_cost.episode_cost)."""
    n = max(1, len(episodes))
    failed = [e for e in episodes if e.failed_calls > 0]
    return {"success": sum(e.success for e in episodes) / n,
            "failed_call_share": len(failed) / n,
            "recovery_rate": (sum(e.success for e in failed) / len(failed)) if failed else None,
            "turns": sum(e.turns for e in episodes) / n,
            "cut": sum(e.cut is not None for e in episodes) / n,
            "env_errors": sum(e.env_error is not None for e in episodes) / n,
            "n": len(episodes),
            # tokens, turns and tool calls per episode (mean, p90): what a task cost
            "cost": episode_cost(episodes)}


def model_and_tokenizer(model, tokenizer):
    """An HF model and its tokenizer from a checkpoint path or a loaded model (every agent
    domain's eval takes either)."""
    if isinstance(model, str):
        from core.evaluate import load_model

        model, tok = load_model(model)
        return model, tokenizer or tok
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model.config._name_or_path)
    return model, tokenizer


def harness_scores(run, tasks: list[dict], harnesses: str, *, seed: int, held_out: bool, domain: str,
                   dataset: str) -> dict:
    """An agent eval's result: `run(tasks, harness_cfgs) -> episodes` through the train
    harnesses (each episode's drawn, seeded, from the mix in `harnesses`) is the score; the
    two held-out kinds on the same tasks go beside it, never averaged in: `held_out_combo`
    (seen module values, unseen combinations) and `held_out_novel` (unseen names and
    syntax; also under its older key `held_out`), each harness of a kind in turn."""
    mix = load_harnesses(harnesses)
    rng = random.Random(seed)
    train_stats = episode_stats(run(tasks, [mix.sample(rng) for _ in tasks]))
    out = {"domain": domain, "effort": None, "dataset": dataset, "n": len(tasks), "score": train_stats["success"],
           "cost": train_stats["cost"], "train_harness": train_stats, "held_out": None, "held_out_harness": None,
           "held_out_novel": None, "held_out_combo": None, "held_out_combo_harness": None}
    if held_out and mix.held_out_combo:
        combo = episode_stats(run(tasks, [mix.held_out_combo[i % len(mix.held_out_combo)] for i in range(len(tasks))]))
        out.update(held_out_combo=combo["success"], held_out_combo_harness=combo)
    if held_out and mix.held_out:
        ho_stats = episode_stats(run(tasks, [mix.held_out[i % len(mix.held_out)] for i in range(len(tasks))]))
        out.update(held_out=ho_stats["success"], held_out_novel=ho_stats["success"], held_out_harness=ho_stats)
    return out


@torch.inference_mode()
def run_tasks(model, tokenizer, tasks: list[dict], harness_cfgs: list, *, max_new_tokens: int, max_turns: int,
              max_context_tokens: int, batch_size: int = 64, temperature: float = 0.0,
              seeds: list[int] | None = None, make_env=make_env, processor=None) -> list[Episode]:
    """One episode per (task, harness config), greedy unless a temperature is given, each in
    `make_env(harness_cfg)` (default: the agent domain's environment; every agent domain's
    eval passes its own). An environment with a `close` (a coding_agent workspace) is closed
    afterwards, also when its episode was cut by max_turns or the context. `processor`: a
    vision-language model's (core.vision), for environments with image observations."""
    rollout = HFRollout(model, tokenizer, batch_size=batch_size)
    envs = [make_env(h) for h in harness_cfgs]
    try:
        return run_episodes(rollout, tokenizer, envs, tasks, seeds=seeds or [0] * len(tasks),
                            temperature=temperature, top_p=1.0, max_turns=max_turns,
                            max_context_tokens=max_context_tokens, max_new_tokens=max_new_tokens,
                            eos_ids=eos_ids(tokenizer), processor=processor)
    finally:
        for e in envs:
            close = getattr(e, "close", None)
            if callable(close):
                close()



def refuse_settings(domain: str, effort, dataset: str, reward_kwargs: dict, datasets: tuple = ("procedural",),
                    note: str = "") -> None:
    """An agent domain's eval takes no effort, one of `datasets` and no reward settings: anything
    else is refused before its model loads (`note` says where the other data is scored)."""
    if effort is not None:
        raise ValueError(f"evals.{domain}: the domain has no reasoning efforts; got effort={effort!r}")
    if dataset not in datasets:
        raise ValueError(f"evals.{domain}: dataset must be one of {list(datasets)}, got {dataset!r}{note}")
    if reward_kwargs:
        raise ValueError(f"evals.{domain}: unknown settings {sorted(reward_kwargs)}")


def evaluate(model, *, n: int | None = 200, seed: int = 0, difficulty: int = 8, effort: str | None = None,
             dataset: str = "procedural", max_new_tokens: int | None = None, batch_size: int = 64, tokenizer=None,
             harnesses: str = HARNESSES, max_turns: int | None = None, max_context_tokens: int = 1536,
             held_out: bool = True, **reward_kwargs) -> dict:
    """Greedy held-out success rate of `model` (an HF model or a checkpoint path) at
    horizon `difficulty`. Returns {"domain", "effort", "dataset", "n", "score",
    "held_out", "train_harness": {stats}, "held_out_harness": {stats}}."""
    refuse_settings("agent", effort, dataset, reward_kwargs, note=" (only the procedural tasks are scored by "
                    "episodes; BFCL's multi-turn tasks are replayed by `mopd rewards check --domain agent`)")
    model, tokenizer = model_and_tokenizer(model, tokenizer)
    ds = make_dataset("test", 200 if n is None else n, seed=seed, difficulty=difficulty)
    tasks = [json.loads(t) for t in ds["task"]]
    kw = dict(max_new_tokens=max_new_tokens or 48, max_turns=max_turns or 2 * difficulty + 6,
              max_context_tokens=max_context_tokens, batch_size=batch_size)
    return harness_scores(partial(run_tasks, model, tokenizer, **kw), tasks, harnesses, seed=seed,
                          held_out=held_out, domain=DOMAIN, dataset=dataset)
