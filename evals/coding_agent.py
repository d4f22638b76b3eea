"""Held-out eval of the `coding_agent` domain: greedy episodes on held-out tasks, run by
the episode runner MOPD samples with (core/agent/episode.py) in the environment of
rewards/coding_agent.py, each in its own sandboxed workspace; an episode scores 1 when
the hidden tests pass after it submits, else 0.

The score is the success rate through the train harnesses (each episode's harness drawn,
seeded, from the recipe's mix); the held-out harness (renamed tools and arguments,
another call syntax, another prompt) is scored on the same tasks and reported beside it
as `held_out`, never averaged in. Also reported (evals/agent.py's episode_stats): the
share of episodes with a failed call, the recovery rate, turns, cut and env-error shares
(an env error here is a run the sandbox killed or a workspace over its quota).
`dataset="humaneval"` plays the 164 HumanEval tasks with injected bugs instead.
"""
from __future__ import annotations

import json
from functools import partial

from evals import agent as agent_eval
from evals.agent import harness_scores, model_and_tokenizer
from experts.coding_agent.data import DOMAIN, make_dataset
from core.agent.episode import Episode
from rewards.coding_agent import make_env

HARNESSES = "recipes/harnesses/coding_agent.yaml"


def run_tasks(model, tokenizer, tasks: list[dict], harness_cfgs: list, *, isolation: str | None = None,
              **kw) -> list[Episode]:
    """evals.agent.run_tasks in coding_agent workspaces (sandbox `isolation`), every one
    removed afterwards, also of episodes cut by max_turns or the context."""
    return agent_eval.run_tasks(model, tokenizer, tasks, harness_cfgs, make_env=partial(make_env, isolation=isolation),
                                **kw)


def evaluate(model, *, n: int | None = 200, seed: int = 0, difficulty: int = 1, effort: str | None = None,
             dataset: str = "procedural", max_new_tokens: int | None = None, batch_size: int = 64, tokenizer=None,
             harnesses: str = HARNESSES, max_turns: int | None = None, max_context_tokens: int = 1536,
             held_out: bool = True, isolation: str | None = None, partial_credit: bool | str = False,
             **reward_kwargs) -> dict:
    """Greedy held-out success rate of `model` (an HF model or a checkpoint path) at
    `difficulty`. Returns {"domain", "effort", "dataset", "n", "score", "held_out",
    "train_harness": {stats}, "held_out_harness": {stats}}. `partial_credit` (a training
    reward setting that reaches here with the recipe's rl.reward_kwargs) changes nothing:
    the held-out score stays the share of episodes whose hidden tests all pass."""
    agent_eval.refuse_settings("coding_agent", effort, dataset, reward_kwargs, datasets=("procedural", "humaneval"))
    if dataset == "humaneval":
        from experts.coding_agent.humaneval import humaneval_tasks

        tasks = humaneval_tasks()[: 164 if n is None else n]
    else:
        ds = make_dataset("test", 200 if n is None else n, seed=seed, difficulty=difficulty)
        tasks = [json.loads(t) for t in ds["task"]]
    model, tokenizer = model_and_tokenizer(model, tokenizer)
    kw = dict(max_new_tokens=max_new_tokens or 64, max_turns=max_turns or 12,
              max_context_tokens=max_context_tokens, batch_size=batch_size, isolation=isolation)
    return harness_scores(partial(run_tasks, model, tokenizer, **kw), tasks, harnesses, seed=seed,
                          held_out=held_out, domain=DOMAIN, dataset=dataset)
