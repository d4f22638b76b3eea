"""Reward for the `chat` domain: a learned reward model (experts/chat/train_rm.py) reads
the prompt and the answer; the score is its calibrated probability that the answer is
a good one (helpful and on topic, or a refusal of an unsafe request).

    reward = sigmoid((s - mid) / scale)

with `s` the model's raw score and mid/scale from the `rm_info.json` the trainer wrote
beside the model (held-out chosen answers map to ~0.95 on average, rejected ones to
~0.05); a folder without calibration gets plain sigmoid(s).

The reward model is the required `reward_model` keyword (a folder; in an expert recipe
`rl.reward_kwargs.reward_model`, in `mopd eval` `--reward-kwarg chat.reward_model=DIR`). It
is loaded once per (path, device) and kept. Over-long answers are cut to fit the model
(keeping the end of the turn); empty, huge or odd output is scored like any other text
and never raises. Rows whose `domain` is not "chat" get None.

`rm_inputs` and `score_batch` are how the reward model reads a (prompt, answer) pair;
the trainer (experts/chat/train_rm.py) scores its held-out pairs with the same two.
"""
from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from core.completions import completion_text
from core.models import pad_batch

DOMAIN = "chat"
MAX_COMPLETION_CHARS = 8_000  # longer text is cut before tokenizing (the model reads ~512 tokens)

_CACHE: dict[tuple[str, str], tuple[object, object, float, float]] = {}
_LOCK = threading.Lock()


def _resolve(reward_model: str | os.PathLike | None) -> Path:
    if not reward_model:
        raise ValueError("rewards.chat.reward needs reward_model=<folder of a trained reward model>: in an "
                         "expert recipe rl.reward_kwargs.reward_model, in `mopd eval` --reward-kwarg "
                         "chat.reward_model=DIR, in Python reward(..., reward_model=DIR); train one with "
                         "`python -m experts.chat.train_rm --out DIR`")
    p = Path(reward_model)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"rewards.chat: no reward model at {str(p)!r} (no config.json); train one with "
                                f"`python -m experts.chat.train_rm --out {p}`")
    return p.resolve()


def load_reward_model(reward_model: str | os.PathLike | None, device: str | None = None):
    """(model, tokenizer, mid, scale) for the folder, loaded once and cached."""
    path = _resolve(reward_model)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    key = (str(path), device)
    with _LOCK:
        if key not in _CACHE:
            model = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32)
            if model.config.num_labels != 1:
                raise ValueError(f"rewards.chat: {path} has num_labels={model.config.num_labels}; a reward "
                                 "model has one output")
            tok = AutoTokenizer.from_pretrained(str(path))
            if model.config.pad_token_id is None:
                model.config.pad_token_id = tok.pad_token_id
            model.to(device).eval()
            mid, scale = 0.0, 1.0
            info = path / "rm_info.json"
            if info.is_file():
                data = json.loads(info.read_text())
                if data.get("calibrated"):
                    mid, scale = float(data["mid"]), float(data["scale"])
            _CACHE[key] = (model, tok, mid, scale)
        return _CACHE[key]


def rm_inputs(tokenizer, prompt: list[dict], answer: str, max_length: int) -> list[int]:
    """Token ids the reward model scores: the chat template over prompt + answer, the
    way RewardTrainer tokenizes its pairs. Too long an answer is cut, keeping the end of
    the template, so the score is still read at the end of an assistant turn."""
    messages = list(prompt) + [{"role": "assistant", "content": answer}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    if len(ids) <= max_length:
        return list(ids)
    head = tokenizer.apply_chat_template(list(prompt), tokenize=True, add_generation_prompt=True,
                                         return_dict=True)["input_ids"]
    tail = tokenizer("<|im_end|>\n", add_special_tokens=False)["input_ids"]
    body = tokenizer(answer, add_special_tokens=False)["input_ids"]
    keep = max(0, max_length - len(head) - len(tail))
    return (list(head) + body[:keep] + list(tail))[-max_length:]


@torch.inference_mode()
def score_batch(model, tokenizer, prompts: list[list[dict]], answers: list[str], *,
                batch_size: int = 64, max_length: int | None = None) -> list[float]:
    """Raw reward-model scores of (prompt, answer) pairs, batched with right padding."""
    max_length = max_length or int(getattr(model.config, "max_position_embeddings", 512))
    pad_id = tokenizer.pad_token_id
    device = next(model.parameters()).device
    out: list[float] = []
    for start in range(0, len(prompts), batch_size):
        seqs = [rm_inputs(tokenizer, p, a, max_length)
                for p, a in zip(prompts[start:start + batch_size], answers[start:start + batch_size])]
        ids_BT, mask_BT = pad_batch(seqs, pad_id, side="right")
        logits_B1 = model(input_ids=ids_BT.to(device), attention_mask=mask_BT.to(device)).logits
        out.extend(logits_B1[:, 0].float().cpu().tolist())
    return out


def _sigmoid(x: float) -> float:
    if x != x:  # nan
        return 0.0
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def _prompt_messages(prompt) -> list[dict]:
    """The prompt as chat messages (a plain string becomes one user message)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple)):
        return [{"role": str(m.get("role", "user")), "content": str(m.get("content") or "")}
                for m in prompt if isinstance(m, dict)]
    return []


def reward(prompts, completions, *, reward_model: str | None = None, domain=None,
           reward_device: str | None = None, batch_size: int = 64, **columns) -> list[float | None]:
    """TRL reward: the calibrated reward-model probability in [0, 1] that each answer
    is a good one; None for rows whose `domain` is not "chat". `reward_model` (the
    folder of a trained reward model) is required."""
    _resolve(reward_model)  # no reward model is an error even for a batch without chat rows
    completions = list(completions)
    prompts = list(prompts) if prompts is not None else [None] * len(completions)
    if len(prompts) != len(completions):
        raise ValueError(f"rewards.chat.reward: {len(prompts)} prompts but {len(completions)} completions")
    domains = list(domain) if domain is not None else [None] * len(completions)
    if len(domains) != len(completions):
        raise ValueError(f"rewards.chat.reward: {len(completions)} completions but {len(domains)} domains")
    mine = [i for i, d in enumerate(domains) if d is None or d == DOMAIN]
    out: list[float | None] = [None] * len(completions)
    if not mine:
        return out
    model, tok, mid, scale = load_reward_model(reward_model, reward_device)
    texts = [completion_text(completions[i])[:MAX_COMPLETION_CHARS] for i in mine]
    raw = score_batch(model, tok, [_prompt_messages(prompts[i]) for i in mine], texts, batch_size=batch_size)
    for i, s in zip(mine, raw):
        out[i] = _sigmoid((s - mid) / scale)
    return out
