"""Greedy generation and reward evaluation with plain transformers (no vLLM).

Meant for tiny models on CPU and for tests: batched greedy decoding with left padding
and a KV cache, stopping each row at EOS. Position ids come from the attention mask, so
a left-padded prompt is decoded exactly as if it were alone (up to float rounding).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from mopd.sft import encode_prompt


@torch.inference_mode()
def greedy_generate(model, tokenizer, prompts: list[list[dict]], *, max_new_tokens: int,
                    batch_size: int = 64) -> list[str]:
    """Greedy completions (text before EOS, special tokens dropped) of chat `prompts`."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ValueError("greedy_generate: tokenizer has no eos_token")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    encoded = [encode_prompt(tokenizer, p) for p in prompts]
    out: list[str] = []
    try:
        for start in range(0, len(encoded), batch_size):
            chunk = encoded[start:start + batch_size]
            B, T = len(chunk), max(len(x) for x in chunk)
            ids_BT = torch.full((B, T), pad_id, dtype=torch.long)
            mask_BT = torch.zeros((B, T), dtype=torch.long)
            for i, x in enumerate(chunk):
                ids_BT[i, T - len(x):] = torch.tensor(x)
                mask_BT[i, T - len(x):] = 1
            ids_BT, mask_BT = ids_BT.to(device), mask_BT.to(device)
            pos_BT = (mask_BT.cumsum(-1) - 1).clamp(min=0)
            res = model(input_ids=ids_BT, attention_mask=mask_BT, position_ids=pos_BT, use_cache=True)
            past = res.past_key_values
            next_pos_B1 = pos_BT[:, -1:] + 1
            done_B = torch.zeros(B, dtype=torch.bool, device=device)
            new_tokens = []
            for t in range(max_new_tokens):
                next_B = res.logits[:, -1].argmax(-1)
                next_B = torch.where(done_B, torch.full_like(next_B, pad_id), next_B)
                new_tokens.append(next_B)
                done_B |= next_B == eos_id
                if bool(done_B.all()) or t == max_new_tokens - 1:
                    break
                mask_BT = torch.cat([mask_BT, torch.ones((B, 1), dtype=mask_BT.dtype, device=device)], dim=1)
                res = model(input_ids=next_B[:, None], attention_mask=mask_BT, position_ids=next_pos_B1,
                            past_key_values=past, use_cache=True)
                past = res.past_key_values
                next_pos_B1 = next_pos_B1 + 1
            gen_BN = torch.stack(new_tokens, dim=1).tolist()
            for row in gen_BN:
                if eos_id in row:
                    row = row[:row.index(eos_id)]
                out.append(tokenizer.decode(row, skip_special_tokens=True))
    finally:
        if was_training:
            model.train()
    return out


def load_model(path: str | os.PathLike):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
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
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(name)
        else:
            from mopd.tiny import load_tokenizer
            tokenizer = load_tokenizer()
    if "prompt" not in dataset.column_names:
        raise ValueError(f"evaluate: dataset has no 'prompt' column (columns: {dataset.column_names})")
    if len(dataset) == 0:
        raise ValueError("evaluate: dataset is empty")
    prompts = list(dataset["prompt"])
    completions = greedy_generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                  batch_size=batch_size)
    columns = {c: list(dataset[c]) for c in dataset.column_names if c not in ("prompt", "completion")}
    scores = reward_fn(prompts=prompts, completions=completions, **columns)
    missing = [i for i, s in enumerate(scores) if s is None]
    if missing:
        name = getattr(reward_fn, "__name__", repr(reward_fn))
        raise ValueError(f"evaluate: {name} returned None (not its domain) for {len(missing)} rows, "
                         f"first row {missing[0]}; evaluate each domain with its own reward")
    mean = float(sum(scores) / len(scores))
    if return_completions:
        return mean, completions, scores
    return mean
