"""Held-out eval of the `code` domain: greedy completions of the procedural test split
(or of HumanEval), scored by rewards/code.py (the tests pass in the sandbox)."""
from __future__ import annotations

import functools

from experts.code.data import DATASETS, DOMAIN, make_dataset
from core.evaluate import evaluate as _evaluate
from rewards.code import reward

# Budget of new tokens: procedural references are under 40 tokens; HumanEval's canonical
# solutions are mostly under 200 (a few reach ~400).
MAX_NEW_TOKENS = {"procedural": 64, "humaneval": 384}


def evaluate(model, *, n: int = 200, seed: int = 0, difficulty: int = 1,
             effort: str | None = None, dataset: str = "procedural",
             max_new_tokens: int | None = None, batch_size: int = 64, tokenizer=None,
             **reward_kwargs) -> dict:
    """Greedy, deterministic held-out score of `model` (an HF model or a checkpoint
    path) on `n` test tasks (the first n of a named dataset). reward_kwargs go to the
    reward (timeout_s, memory_mb, max_workers, isolation). Returns {"domain", "effort",
    "dataset", "n", "score"}; effort is always None (this domain has none)."""
    if effort is not None:
        raise ValueError(f"evals.code: this domain has no efforts, got effort={effort!r}")
    if dataset != "procedural" and dataset not in DATASETS:
        raise ValueError(f"evals.code: unknown dataset {dataset!r}; expected 'procedural' or one of "
                         f"{sorted(DATASETS)}")
    if dataset == "procedural":
        ds = make_dataset("test", n, seed=seed, difficulty=difficulty)
    else:
        ds = DATASETS[dataset]()
        ds = ds.select(range(min(n, len(ds))))
    fn = functools.partial(reward, **reward_kwargs) if reward_kwargs else reward
    score = _evaluate(model, ds, fn, max_new_tokens=max_new_tokens or MAX_NEW_TOKENS[dataset],
                      batch_size=batch_size, tokenizer=tokenizer)
    return {"domain": DOMAIN, "effort": None, "dataset": dataset, "n": len(ds), "score": float(score)}
