"""Greedy generation and reward evaluation with plain transformers (no vLLM).

Meant for tiny models on CPU and for tests: the HF rollout backend at temperature 0
(batched, left-padded, with a KV cache, each row stopping at EOS; position ids come from
the attention mask, so a left-padded prompt is decoded exactly as if it were alone, up
to float rounding), then the domain's reward.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoTokenizer

from core.rollout import HFRollout, greedy_texts
from core.sft import encode_prompt
from core.tiny import load_tokenizer


@torch.inference_mode()
def greedy_generate(model, tokenizer, prompts: list[list[dict]], *, max_new_tokens: int,
                    batch_size: int = 64) -> list[str]:
    """Greedy completions (text before EOS, special tokens dropped) of chat `prompts`,
    through the HF rollout backend at temperature 0 (the project's one decoding path)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if tokenizer.eos_token_id is None:
        raise ValueError("greedy_generate: tokenizer has no eos_token")
    rollout = HFRollout(model, tokenizer, batch_size=batch_size)
    return greedy_texts(rollout, tokenizer, [encode_prompt(tokenizer, p) for p in prompts],
                        max_new_tokens=max_new_tokens)


def load_model(path: str | os.PathLike):
    from core.vision import load_model as load_checkpoint   # a vision-language checkpoint gets its own class

    model = load_checkpoint(path, torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(str(path))


def evaluate(model_or_path, dataset, reward_fn, *, max_new_tokens: int, batch_size: int = 64,
             tokenizer=None, return_completions: bool = False):
    """Mean reward of greedy completions over `dataset` (columns: prompt, plus whatever
    the reward needs, e.g. answer). Every other column is passed to `reward_fn` by
    name, as TRL does. A `None` score (row not in the reward's domain) is an error.
    With `return_completions`, returns (mean, completions, scores)."""
    if isinstance(model_or_path, (str, os.PathLike)):
        model, path_tokenizer = load_model(model_or_path)
        tokenizer = tokenizer or path_tokenizer
    else:
        model = model_or_path
    if tokenizer is None:  # a model object: its checkpoint's tokenizer, else the project's
        name = getattr(model.config, "_name_or_path", "") or ""
        if name and Path(name).is_dir():
            tokenizer = AutoTokenizer.from_pretrained(name)
        else:
            tokenizer = load_tokenizer()
    if "prompt" not in dataset.column_names:
        raise ValueError(f"evaluate: dataset has no 'prompt' column (columns: {dataset.column_names})")
    if len(dataset) == 0:
        raise ValueError("evaluate: dataset is empty")
    prompts = list(dataset["prompt"])
    completions = greedy_generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                  batch_size=batch_size)
    mean, scores = mean_reward(dataset, completions, reward_fn)
    if return_completions:
        return mean, completions, scores
    return mean


def mean_reward(dataset, completions: list[str], reward_fn) -> tuple[float, list[float]]:
    """(mean, scores) of `reward_fn` on the completions of `dataset`'s prompts; every
    other column but `completion` goes to the reward by name, as TRL does. A `None`
    score (row not in the reward's domain) is an error."""
    prompts = list(dataset["prompt"])
    columns = {c: list(dataset[c]) for c in dataset.column_names if c not in ("prompt", "completion")}
    scores = reward_fn(prompts=prompts, completions=completions, **columns)
    missing = [i for i, s in enumerate(scores) if s is None]
    if missing:
        name = getattr(reward_fn, "__name__", repr(reward_fn))
        raise ValueError(f"evaluate: {name} returned None (not its domain) for {len(missing)} rows, "
                         f"first row {missing[0]}; evaluate each domain with its own reward")
    return float(sum(scores) / len(scores)), scores
