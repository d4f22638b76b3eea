"""teachers/vllm_lora_ops.py: the grouped LoRA matmuls give vLLM's own CPU results (its
per-token gather and einsum) for every op the CPU punica wrapper calls, index -1 (no
adapter) included, and the plugin swaps them into the wrapper."""
from __future__ import annotations

import pytest
import torch

from teachers import vllm_lora_ops as G

vops = pytest.importorskip("vllm.lora.ops.torch_ops")


def _case(seed=0, B=37, L=4, i=24, o=16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, i, generator=g)
    w = torch.randn(L, 1, o, i, generator=g)
    idx = torch.randint(-1, L, (B,), generator=g)
    return x, w, idx


@pytest.mark.parametrize("add", [True, False])
def test_each_op_equals_vllms(add):
    x, w, idx = _case()
    for name in ("bgmv_shrink",):
        a, b = torch.zeros(x.shape[0], 16), torch.zeros(x.shape[0], 16)
        getattr(vops, name)(x, w, a, idx, 0.5)
        getattr(G, name)(x, w, b, idx, 0.5)
        torch.testing.assert_close(a, b)
    a, b = torch.ones(x.shape[0], 20), torch.ones(x.shape[0], 20)
    vops.bgmv_expand(x, w, a, idx, add)
    G.bgmv_expand(x, w, b, idx, add)
    torch.testing.assert_close(a, b)
    a, b = torch.ones(x.shape[0], 40), torch.ones(x.shape[0], 40)
    vops.bgmv_expand_slice(x, w, a, idx, 8, 16, add)
    G.bgmv_expand_slice(x, w, b, idx, 8, 16, add)
    torch.testing.assert_close(a, b)
    # the prefill forms: one index per sequence, repeated over its tokens
    seq = torch.tensor([10, 20, 7])
    lidx = torch.tensor([2, -1, 0])
    start = torch.tensor([0, 10, 30])
    a, b = torch.zeros(37, 16), torch.zeros(37, 16)
    vops.sgmv_shrink(x, w, a, start, seq, lidx, 3, 20, 37, 2.0)
    G.sgmv_shrink(x, w, b, start, seq, lidx, 3, 20, 37, 2.0)
    torch.testing.assert_close(a, b)
    a, b = torch.ones(37, 16), torch.ones(37, 16)
    vops.sgmv_expand(x, w, a, start, seq, lidx, 3, 20, 37, add)
    G.sgmv_expand(x, w, b, start, seq, lidx, 3, 20, 37, add)
    torch.testing.assert_close(a, b)
    a, b = torch.ones(37, 40), torch.ones(37, 40)
    vops.sgmv_expand_slice(x, w, a, start, seq, lidx, 3, 20, 37, 4, 16, add)
    G.sgmv_expand_slice(x, w, b, start, seq, lidx, 3, 20, 37, 4, 16, add)
    torch.testing.assert_close(a, b)


def test_the_plugin_swaps_them_into_the_cpu_wrapper(monkeypatch):
    pc = pytest.importorskip("vllm.lora.punica_wrapper.punica_cpu")
    for n in G._NAMES:
        monkeypatch.setattr(pc, n, getattr(vops, n))
    monkeypatch.setenv("MOPD_VLLM_CPU_LORA_OPS", "0")
    G.register()
    assert pc.bgmv_shrink is vops.bgmv_shrink
    monkeypatch.delenv("MOPD_VLLM_CPU_LORA_OPS")
    G.register()
    assert all(getattr(pc, n) is getattr(G, n) for n in G._NAMES)
