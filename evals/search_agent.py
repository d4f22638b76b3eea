"""Held-out eval of the `search_agent` domain: greedy episodes on held-out questions, run by
the same episode runner MOPD samples with (core/agent/episode.py) in the environment of
rewards/search_agent.py; an episode scores 1 when its answer matches the reference
(normalized exact match), else 0.

As in evals/agent.py: the score is the success rate through the train harnesses (each
episode's harness drawn, seeded, from the recipe's mix); the held-out harness (renamed
tools and arguments, another call syntax and prompt) is scored on the same tasks and
reported beside it as `held_out`, never averaged in; plus the failed-call share, the
recovery rate and turns per episode (evals.agent.episode_stats).
"""
from __future__ import annotations

import json
from functools import partial

from evals import agent as agent_eval
from evals.agent import episode_stats, harness_scores, model_and_tokenizer
from experts.search_agent.data import DOMAIN, make_dataset
from core.agent.episode import Episode
from rewards.search_agent import make_env

HARNESSES = "recipes/harnesses/search_agent.yaml"

__all__ = ["evaluate", "episode_stats", "run_tasks"]


def run_tasks(model, tokenizer, tasks: list[dict], harness_cfgs: list, **kw) -> list[Episode]:
    """evals.agent.run_tasks in the search_agent environment."""
    return agent_eval.run_tasks(model, tokenizer, tasks, harness_cfgs, make_env=make_env, **kw)


def evaluate(model, *, n: int | None = 200, seed: int = 0, difficulty: int = 2, effort: str | None = None,
             dataset: str = "procedural", max_new_tokens: int | None = None, batch_size: int = 64, tokenizer=None,
             harnesses: str = HARNESSES, max_turns: int | None = None, max_context_tokens: int = 1536,
             held_out: bool = True, **reward_kwargs) -> dict:
    """Greedy held-out success rate of `model` (an HF model or a checkpoint path) at
    `difficulty` hops. Returns {"domain", "effort", "dataset", "n", "score", "held_out",
    "train_harness": {stats}, "held_out_harness": {stats}}."""
    agent_eval.refuse_settings("search_agent", effort, dataset, reward_kwargs)
    model, tokenizer = model_and_tokenizer(model, tokenizer)
    ds = make_dataset("test", 200 if n is None else n, seed=seed, difficulty=difficulty)
    tasks = [json.loads(t) for t in ds["task"]]
    # 2 calls per hop, the answer, and room for as many failed calls again
    kw = dict(max_new_tokens=max_new_tokens or 48, max_turns=max_turns or 4 * difficulty + 3,
              max_context_tokens=max_context_tokens, batch_size=batch_size)
    return harness_scores(partial(run_tasks, model, tokenizer, **kw), tasks, harnesses, seed=seed,
                          held_out=held_out, domain=DOMAIN, dataset=dataset)
