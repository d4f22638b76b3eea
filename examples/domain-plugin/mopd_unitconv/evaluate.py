"""Held-out eval of the `unitconv` domain: greedy answers to the procedural test split,
scored by the reward."""
from __future__ import annotations

import functools

from core.evaluate import evaluate as _evaluate
from mopd_unitconv.data import DOMAIN, make_dataset
from mopd_unitconv.reward import reward

MAX_NEW_TOKENS = 8


def evaluate(model, *, n: int = 200, seed: int = 0, difficulty: int = 1, effort: str | None = None,
             dataset: str = "procedural", max_new_tokens: int | None = None, batch_size: int = 64, tokenizer=None,
             **reward_kwargs) -> dict:
    """Greedy held-out score of `model` (an HF model or a checkpoint path) on n test tasks."""
    if effort is not None or dataset != "procedural":
        raise ValueError(f"unitconv eval: no efforts and no named datasets (got effort={effort!r}, "
                         f"dataset={dataset!r})")
    ds = make_dataset("test", n, seed=seed, difficulty=difficulty)
    fn = functools.partial(reward, **reward_kwargs) if reward_kwargs else reward
    score = _evaluate(model, ds, fn, max_new_tokens=max_new_tokens or MAX_NEW_TOKENS, batch_size=batch_size,
                      tokenizer=tokenizer)
    return {"domain": DOMAIN, "effort": None, "dataset": dataset, "n": len(ds), "score": float(score)}
