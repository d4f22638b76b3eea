"""Run by torchrun (2 CPU processes, gloo) from test_chunked_logits_under_fsdp2: the
student's chunked loss path (`core.models.completion_hidden` + `mopd.distill.step.
chunked_terms`, the output head applied a chunk at a time outside the model's forward) on
a model sharded with FSDP2's `fully_shard` (each decoder layer, optionally the head on its
own, then the root), each rank on its own batch. Rank 0 writes OUT/grads.json: the
largest difference between the sharded model's gradients (gathered whole) and the mean of
an unsharded copy's gradients on both ranks' batches. accelerate runs FSDP only on GPUs,
so this is the check that runs on CPU.

    torchrun --nproc_per_node 2 fsdp2_chunked_grads.py MODEL OUT [head]"""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from core.models import completion_hidden
from mopd.distill.config import LossConfig
from mopd.distill.step import chunked_terms

B, L, P = 2, 14, 6     # rows, sequence length, prompt length


def batch(seed: int) -> dict:
    ids = torch.randint(5, 1000, (B, L), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_start": torch.full((B,), P),
            "mask": torch.ones(B, L - P)}


def loss(model, b: dict) -> torch.Tensor:
    h, head = completion_hidden(model, b)
    ones = torch.ones(B)
    return -chunked_terms(h, head, b["input_ids"][:, P:], b["mask"], [], V=0, loss_cfg=LossConfig(), temp_B=ones,
                          top_p_B=ones, tempered=False, chunk=5)["lp"].sum()


def main() -> None:
    path, out, wrap_head = sys.argv[1], sys.argv[2], "head" in sys.argv[3:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    if wrap_head:
        fully_shard(model.lm_head)
    fully_shard(model)
    loss(model, batch(rank)).backward()
    (loss(ref, batch(0)) / 2 + loss(ref, batch(1)) / 2).backward()   # FSDP averages the ranks' gradients
    gaps = {}
    for (n, p), (n2, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert n == n2 and p.grad is not None, n
        gaps[n] = (p.grad.full_tensor() - q.grad).abs().max().item()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gaps, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
