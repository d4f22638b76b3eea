"""Held-out eval of the `math` domain: greedy completions of the test split, scored by
rewards/math.py (final answer correct). One effort per call: each effort has its own
system prompt and its own teacher, so their scores are reported apart."""
from __future__ import annotations

import functools

from experts.math.data import DATASETS, DOMAIN, EFFORTS, make_dataset
from core.evaluate import evaluate as _evaluate
from rewards.math import reward

# Budget of new tokens: a high-effort reference is at most ~25 tokens at difficulty 2.
MAX_NEW_TOKENS = {"low": 12, "high": 48}


def evaluate(model, *, n: int = 200, seed: int = 0, difficulty: int = 1,
             effort: str | None = None, dataset: str = "procedural",
             max_new_tokens: int | None = None, batch_size: int = 64, tokenizer=None,
             **reward_kwargs) -> dict:
    """Greedy, deterministic held-out score of `model` (an HF model or a checkpoint
    path) on `n` test problems of one `effort` ("low" or "high", required). Returns
    {"domain", "effort", "dataset", "n", "score"}."""
    if effort not in EFFORTS:
        raise ValueError(f"evals.math: effort is required and must be one of {EFFORTS}, got {effort!r}")
    if dataset != "procedural" and dataset not in DATASETS:
        raise ValueError(f"evals.math: unknown dataset {dataset!r}; expected 'procedural' or one of "
                         f"{sorted(DATASETS)}")
    if dataset == "procedural":
        ds = make_dataset("test", n, seed=seed, difficulty=difficulty, effort=effort)
    else:
        ds = DATASETS[dataset]()
        if "effort" in ds.column_names:
            ds = ds.filter(lambda e: e == effort, input_columns="effort")
        ds = ds.select(range(min(n, len(ds))))
    fn = functools.partial(reward, **reward_kwargs) if reward_kwargs else reward
    score = _evaluate(model, ds, fn, max_new_tokens=max_new_tokens or MAX_NEW_TOKENS[effort], batch_size=batch_size,
                      tokenizer=tokenizer)
    return {"domain": DOMAIN, "effort": effort, "dataset": dataset, "n": len(ds), "score": float(score)}
