"""Held-out eval of the `tool_use` domain: greedy completions scored by
rewards/tool_use.py (BFCL's AST check of the JSON call, 1 or 0 per prompt).

dataset="procedural": the test split of experts/tool_use/data.make_dataset.
dataset="bfcl": BFCL's single-turn categories with answers (needs `bfcl-eval`); `n`
rows drawn by a seeded shuffle over all categories (n=None: all 2501)."""
from __future__ import annotations

import functools

from experts.tool_use.data import DATASETS, DOMAIN, make_dataset
from core.evaluate import evaluate as _evaluate
from rewards.tool_use import reward

# Budget of new tokens. A procedural call is <= ~45 tokens at difficulty 1-2 and two
# calls <= ~110 at difficulty 3-4; BFCL's references run longer (nested arguments).
MAX_NEW_TOKENS = {1: 64, 2: 96}  # procedural, by difficulty
MAX_NEW_TOKENS_HARD = 160        # procedural, difficulty >= 3
MAX_NEW_TOKENS_BFCL = 256


def _default_max_new_tokens(dataset: str, difficulty: int) -> int:
    if dataset != "procedural":
        return MAX_NEW_TOKENS_BFCL
    return MAX_NEW_TOKENS.get(difficulty, MAX_NEW_TOKENS_HARD)


def evaluate(model, *, n: int | None = 200, seed: int = 0, difficulty: int = 1,
             effort: str | None = None, dataset: str = "procedural",
             max_new_tokens: int | None = None, batch_size: int = 64, tokenizer=None,
             **reward_kwargs) -> dict:
    """Greedy, deterministic held-out score of `model` (an HF model or a checkpoint
    path). Returns {"domain", "effort", "dataset", "n", "score"}."""
    if effort is not None:
        raise ValueError(f"evals.tool_use: the domain has no reasoning efforts; got effort={effort!r}")
    if dataset != "procedural" and dataset not in DATASETS:
        raise ValueError(f"evals.tool_use: unknown dataset {dataset!r}; expected 'procedural' or one of "
                         f"{sorted(DATASETS)}")
    if dataset == "procedural":
        ds = make_dataset("test", 200 if n is None else n, seed=seed, difficulty=difficulty)
    else:
        ds = DATASETS[dataset]()
        if n is not None and n < len(ds):
            ds = ds.shuffle(seed=seed).select(range(n))
    fn = functools.partial(reward, **reward_kwargs) if reward_kwargs else reward
    score = _evaluate(model, ds, fn, max_new_tokens=max_new_tokens or _default_max_new_tokens(dataset, difficulty),
                      batch_size=batch_size, tokenizer=tokenizer)
    return {"domain": DOMAIN, "effort": None, "dataset": dataset, "n": len(ds), "score": float(score)}
