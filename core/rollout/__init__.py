"""Rollout backends: the student samples its own completions (on-policy).

`base.py` holds the protocol and the `Sample` every backend returns; one file per
backend: `hf.py` (the trainer's own module), `vllm.py` (a colocated vLLM engine with
in-memory weight sync), `server.py` (a vLLM server in another process or node, the
weights pushed through vLLM's weight-update API; `weight_transfer.py` is its CPU
transport). `make_rollout` picks one by name.
"""
from __future__ import annotations

from typing import Any

from core.rollout.base import Rollout, Sample, eos_ids
from core.rollout.hf import HFCopyRollout, HFRollout, sample_from_logits
from core.rollout.server import SamplerServerError, ServerRollout
from core.rollout.vllm import VLLMRollout, shutdown_vllm_engine, start_vllm_engine
from core.task_cost import completion_tokens, note_tokens

__all__ = ["Rollout", "Sample", "eos_ids", "HFRollout", "HFCopyRollout", "sample_from_logits", "VLLMRollout",
           "ServerRollout", "SamplerServerError", "start_vllm_engine", "shutdown_vllm_engine", "make_rollout", "greedy_texts"]


def make_rollout(kind: str, **kwargs: Any):
    """'vllm' -> VLLMRollout(model_path, ...); 'hf' -> HFRollout(model, tokenizer, ...);
    'hf_copy' -> HFCopyRollout(model_path, tokenizer, ...); 'server' -> ServerRollout(urls, ...)."""
    backends = {"vllm": VLLMRollout, "hf": HFRollout, "hf_copy": HFCopyRollout, "server": ServerRollout}
    if kind not in backends:
        raise ValueError(f"unknown rollout kind {kind!r}; valid: {sorted(backends)}")
    return backends[kind](**kwargs)


def greedy_texts(rollout: Rollout, tokenizer, prompt_ids: list[list[int]], *, max_new_tokens: int) -> list[str]:
    """Greedy completions as text (up to the first EOS, special tokens dropped): the one
    greedy decoding path of the project, whatever the backend."""
    eos = eos_ids(tokenizer)
    samples = rollout.generate(prompt_ids, max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0,
                               seeds=[0] * len(prompt_ids))
    texts, counts = [], []
    for smp in samples:
        ids = smp.completion_ids
        cut = next((k for k, t in enumerate(ids) if t in eos), len(ids))
        texts.append(tokenizer.decode(ids[:cut], skip_special_tokens=True))
        counts.append(completion_tokens(ids, eos))
    note_tokens(counts)   # the eval's cost per task (core.task_cost), when a recorder is open
    return texts
