"""The rollout protocol: what every sampler backend of the student offers.

A backend returns one `Sample` per prompt with the sampler's raw log-probs
(`log_softmax` of the logits, before temperature / top-p), which the loss needs for the
reverse-KL reward r_t = log p_T(y_t) - log p_S(y_t). It takes the trainer's new weights
with `sync_weights` after every update (a no-op where the sampler is the trainer's own
module), as verl's `BaseRollout` and TRL's `RolloutWorkerProtocol` do.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]       # sampled tokens, including the final EOS if generated
    sampler_logprobs: list[float]   # raw log p_sampler(y_t | prefix), one per completion token
    finished: bool                  # ended with EOS (False if cut by max_new_tokens)
    # Agent transcripts (core.agent.episode): the completion also holds the observations
    # between the student's turns. loss_mask: 1 where the student wrote the token, 0 for
    # observation / template tokens (no loss, no gradient, no IS weight, no metric);
    # turn_ids: the turn each token belongs to, -1 for observation tokens. None: every
    # token is the student's, turn 0 (a single-turn sample).
    loss_mask: list[int] | None = None
    turn_ids: list[int] | None = None
    # The images of prompt + completion (core.vision.Vision), in the order of their pad
    # tokens, for a vision-language model's forwards; None: text only.
    vision: object | None = None


def _check_batch(prompts: list[list[int]], seeds: list[int], max_new_tokens: int) -> None:
    if len(seeds) != len(prompts):
        raise ValueError(f"generate: got {len(prompts)} prompts but {len(seeds)} seeds (need one seed per prompt)")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"generate: prompt {i} is empty (a prompt needs at least one token)")


def eos_ids(*sources: Any) -> set[int]:
    """EOS token ids from a tokenizer and/or generation config (int or list)."""
    ids: set[int] = set()
    for src in sources:
        eos = getattr(src, "eos_token_id", None)
        if eos is None:
            continue
        ids.update([eos] if isinstance(eos, int) else list(eos))
    return ids




class Rollout(Protocol):
    """One sampler backend (hf.py, vllm.py)."""

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seeds: list[int]) -> list[Sample]:
        """One sample per prompt; each row's randomness comes from its own seed."""

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take the trainer's current weights (HF names)."""

    def read_weights(self) -> dict[str, torch.Tensor]:
        """The weights the sampler holds now (for checks)."""

    def close(self) -> None:
        """Release the engine."""
