"""Held-out eval of the `instruction_following` domain: greedy completions of the test
split, scored by rewards/instruction_following.py (mean fraction of constraints met)."""
from __future__ import annotations

import functools

from experts.instruction_following.data import DATASETS, DOMAIN, make_dataset
from core.evaluate import evaluate as _evaluate
from rewards.instruction_following import reward

# Budget of new tokens: references are <= ~45 tokens at difficulty 1-2, <= ~85 above.
MAX_NEW_TOKENS = {1: 64, 2: 96}
MAX_NEW_TOKENS_HARD = 128


def evaluate(model, *, n: int = 200, seed: int = 0, difficulty: int = 1,
             effort: str | None = None, dataset: str = "procedural",
             max_new_tokens: int | None = None, batch_size: int = 64, tokenizer=None,
             **reward_kwargs) -> dict:
    """Greedy, deterministic held-out score of `model` (an HF model or a checkpoint
    path) on `n` test prompts. Returns {"domain", "effort", "dataset", "n", "score"}."""
    if effort is not None:
        raise ValueError(f"evals.instruction_following: the domain has no reasoning efforts; got effort={effort!r}")
    if dataset != "procedural" and dataset not in DATASETS:
        raise ValueError(f"evals.instruction_following: unknown dataset {dataset!r}; expected 'procedural'"
                         + (f" or one of {sorted(DATASETS)}" if DATASETS else ""))
    if dataset == "procedural":
        ds = make_dataset("test", n, seed=seed, difficulty=difficulty)
    else:
        ds = DATASETS[dataset]()
        if n < len(ds):
            ds = ds.shuffle(seed=seed).select(range(n))
    fn = functools.partial(reward, **reward_kwargs) if reward_kwargs else reward
    score = _evaluate(model, ds, fn, max_new_tokens=max_new_tokens or MAX_NEW_TOKENS.get(difficulty, MAX_NEW_TOKENS_HARD),
                      batch_size=batch_size, tokenizer=tokenizer)
    return {"domain": DOMAIN, "effort": None, "dataset": dataset, "n": len(ds), "score": float(score)}
