"""Held-out eval of the `kernel` domain: greedy completions of the procedural test split,
scored by rewards/kernel.py (right on fresh inputs, speed between the reference's floor and
1.0 at the task's speed of light, cheats 0 and named in the reward's log), so the mean is
in [0, 1]."""
from __future__ import annotations

import functools

from experts.kernel.data import DATASETS, DOMAIN, make_dataset
from core.evaluate import evaluate as _evaluate
from rewards.kernel import reward

# Expert kernels are one line, under 80 tokens of the project tokenizer (its BPE splits
# `torch.nn.functional` finely).
MAX_NEW_TOKENS = 96


def evaluate(model, *, n: int = 200, seed: int = 0, difficulty: int = 1,
             effort: str | None = None, dataset: str = "procedural",
             max_new_tokens: int | None = None, batch_size: int = 64, tokenizer=None,
             **reward_kwargs) -> dict:
    """Greedy, deterministic held-out score of `model` (an HF model or a checkpoint path) on
    `n` test tasks. reward_kwargs go to the reward (trials, calls, timeout_s, isolation,
    ...). Returns {"domain", "effort", "dataset", "n", "score"}; effort is always None."""
    if effort is not None:
        raise ValueError(f"evals.kernel: this domain has no efforts, got effort={effort!r}")
    if dataset != "procedural" and dataset not in DATASETS:
        raise ValueError(f"evals.kernel: unknown dataset {dataset!r}; expected 'procedural' or one of "
                         f"{sorted(DATASETS)}")
    ds = make_dataset("test", n, seed=seed, difficulty=difficulty) if dataset == "procedural" else DATASETS[dataset]()
    fn = functools.partial(reward, **reward_kwargs) if reward_kwargs else reward
    score = _evaluate(model, ds, fn, max_new_tokens=max_new_tokens or MAX_NEW_TOKENS,
                      batch_size=batch_size, tokenizer=tokenizer)
    return {"domain": DOMAIN, "effort": None, "dataset": dataset, "n": len(ds), "score": float(score)}
