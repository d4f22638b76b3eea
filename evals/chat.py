"""Held-out eval of the `chat` domain: greedy answers to test-split prompts, scored by
the reward model through rewards/chat.py (mean calibrated reward in [0, 1])."""
from __future__ import annotations

import functools

from experts.chat.data import DATASETS, DOMAIN, make_dataset
from core.evaluate import evaluate as _evaluate
from rewards.chat import load_reward_model, reward

MAX_NEW_TOKENS = 48  # a two-fact reference is ~40 tokens


def evaluate(model, *, n: int = 200, seed: int = 0, difficulty: int = 1, effort: str | None = None,
             dataset: str = "procedural", max_new_tokens: int = MAX_NEW_TOKENS, batch_size: int = 64,
             tokenizer=None, reward_model: str | None = None, **reward_kwargs) -> dict:
    """Greedy, deterministic held-out score of `model` (an HF model or a checkpoint
    path) on `n` test prompts. `reward_model`, the reward-model folder, is required
    (from `mopd eval`: --reward-kwarg chat.reward_model=DIR). Returns
    {"domain", "effort", "dataset", "n", "score"}."""
    if effort is not None:
        raise ValueError(f"evals.chat: the chat domain has no reasoning efforts; got effort={effort!r}")
    if dataset != "procedural" and dataset not in DATASETS:
        raise ValueError(f"evals.chat: unknown dataset {dataset!r}; expected 'procedural' or one of "
                         f"{sorted(DATASETS)}")
    load_reward_model(reward_model, reward_kwargs.get("reward_device"))  # a missing model fails before generating
    ds = make_dataset("test", n, seed=seed, difficulty=difficulty) if dataset == "procedural" else DATASETS[dataset]()
    ds = ds.select(range(min(n, len(ds))))
    fn = functools.partial(reward, reward_model=reward_model, **reward_kwargs)
    fn.__name__ = "rewards.chat.reward"  # named in evaluate's errors
    score = _evaluate(model, ds, fn, max_new_tokens=max_new_tokens, batch_size=batch_size, tokenizer=tokenizer)
    return {"domain": DOMAIN, "effort": None, "dataset": dataset, "n": len(ds), "score": float(score)}
