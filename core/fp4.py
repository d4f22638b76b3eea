"""FP4 weight-only quantization (NVFP4A16, MXFP4A16) for QAT, sampling and export.

The INT4 path (core/quant.py) hands a weight whose ``quant.format`` is ``nvfp4`` or
``mxfp4`` to this module; the one function pair is

    codes, scales, global_scale = quantize(w, fmt)        # E2M1 values (fp32), see below
    w_hat = dequantize(codes, scales, global_scale, fmt, dtype)
    w_hat = fake_quantize(w, fmt)                         # the two above, in w.dtype

and the trainer's forward (`core.quant.FakeQuantLinear`), the sampler's weight push
(`core.quant.quantized_state_dict`) and `mopd export --quant nvfp4|mxfp4` all call it.

Formats, per output row, over consecutive input columns:

- ``nvfp4``: blocks of 16. ``global_scale = 448 * 6 / A`` (fp32, one per tensor, A the
  tensor's max |w|); ``scale = fp8_e4m3(global_scale * block_amax / 6)`` (0 -> 0.125);
  ``code = E2M1(w / (scale / global_scale))``; ``w_hat = bf16(code * (scale / global_scale))``.
- ``mxfp4``: blocks of 32. ``scale = 2 ** (e - 2)`` with ``e`` the exponent of the
  block's max |w| rounded to a power of two (up from a mantissa of 1.75), stored as E8M0
  (``e - 2 + 127``); ``code = E2M1(w / scale)``; ``w_hat = code * scale`` (exact).

E2M1 (``round_e2m1``): clamp to [-6, 6], then the nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6,
ties to the even mantissa (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
3.5 -> 4, 5 -> 4), keeping the sign (so -0.1 codes to -0).

Bit-exactness: the scales are the ops of compressed-tensors 0.17 ``generate_gparam`` and
``calculate_qparams`` on the observed min/max in the weight's dtype (MXFP4 with its
``generate_mx_scales`` / ``round_to_power_2``), the codes those of ``forward.quantize``
(``FP4_E2M1_DATA.cast_to_fp4``, re-written here without its ``torch.compile``), and
``dequantize`` is what ``NVFP4PackedCompressor`` / ``MXFP4PackedCompressor.decompress``
return (bf16). tests/unit/core/test_fp4.py checks all three with ``torch.equal``.

Two choices make a QAT checkpoint a fixed point (re-quantizing its weights gives the same
codes, scales and values, so the next stage's student starts where this one ended):

- the dequantized weight is rounded to bf16 (as the compressors decompress it), so what
  the trainer uses is exactly what the sampler (bf16) and the checkpoint hold;
- NVFP4's tensor max A is taken in bf16 (a no-op for bf16 weights). With an fp32 A the
  largest weight comes back as ``bf16(6 * 448 / global_scale) != A`` and the re-quantized
  tensor would get another global scale. With A in bf16 it comes back as A itself.

One global scale per fused group: vLLM runs q/k/v (and gate/up) as one layer and uses one
NVFP4 global scale for it (``weight_global_scale.max()``), so those projections share
theirs, the max over the group, in the trainer, the sampler and the checkpoint alike
(`fused_groups`), as llm-compressor does when it quantizes for vLLM.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from core.quant_config import FP4_BLOCK

__all__ = ["FP4_BLOCK", "quantize", "dequantize", "fake_quantize", "round_e2m1",
           "group_amax", "fused_groups", "check_shape", "E2M1_MAX", "FP8_MAX"]

E2M1_MAX = 6.0
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
FP8_ZERO_SCALE = 0.125  # what calculate_qparams puts for a zero FP8 scale
# Projections vLLM fuses into one layer (the same list core.export checks).
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _block(fmt: str) -> int:
    try:
        return FP4_BLOCK[fmt]
    except KeyError:
        raise ValueError(f"unknown FP4 format {fmt!r}; expected one of {sorted(FP4_BLOCK)}") from None


def check_shape(shape: Iterable[int], fmt: str, group_size: int | None = None,
                what: str = "weight") -> None:
    """The weight is a matrix whose input dim is a multiple of the format's block."""
    block = _block(fmt)
    if group_size is not None and group_size != block:
        raise ValueError(f"{fmt} has one scale per {block} weights, not group_size={group_size}; "
                         f"set quant.group_size: {block}")
    shape = tuple(shape)
    if len(shape) < 2:
        raise ValueError(f"{what} of shape {shape}: {fmt} needs an [out, in] matrix")
    if shape[-1] % block:
        raise ValueError(f"{what} of shape {shape}: input dim {shape[-1]} is not a multiple of "
                         f"the {fmt} block ({block})")


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Clamp to [-6, 6] and round to the E2M1 grid, ties to even (compressed-tensors'
    ``cast_to_fp4``: the same comparisons, without torch.compile)."""
    x = torch.clamp(x, -E2M1_MAX, E2M1_MAX)
    a = x.abs()
    q = torch.zeros_like(a)
    for lo, lo_in, hi, hi_in, v in ((0.25, False, 0.75, False, 0.5), (0.75, True, 1.25, True, 1.0),
                                    (1.25, False, 1.75, False, 1.5), (1.75, True, 2.5, True, 2.0),
                                    (2.5, False, 3.5, False, 3.0), (3.5, True, 5.0, True, 4.0)):
        inside = ((a >= lo) if lo_in else (a > lo)) & ((a <= hi) if hi_in else (a < hi))
        q = torch.where(inside, torch.tensor(v, dtype=q.dtype), q)
    q = torch.where(a > 5.0, torch.tensor(E2M1_MAX, dtype=q.dtype), q)
    return q * torch.sign(x)


def group_amax(weights: Iterable[torch.Tensor]) -> torch.Tensor:
    """NVFP4's tensor max A over one or more weights (a fused group), rounded to bf16 and
    held in fp32: the input of the global scale."""
    amax = torch.stack([w.detach().abs().amax().to(torch.float32) for w in weights]).amax()
    return amax.to(torch.bfloat16).to(torch.float32)


def _global_scale(amax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors ``generate_gparam`` (FP8 max * FP4 max / A, fp32, shape [1])."""
    amax = torch.clamp(amax.to(torch.float32), min=torch.finfo(torch.float32).tiny)
    gs = FP8_MAX * E2M1_MAX / amax
    return torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32).reshape([1])


def _block_amax(groups: torch.Tensor) -> torch.Tensor:
    """calculate_qparams' max(|min(min, 0)|, |max(max, 0)|), in the weight's dtype."""
    mn, mx = groups.amin(dim=-1), groups.amax(dim=-1)
    mn = torch.min(mn, torch.zeros_like(mn))
    mx = torch.max(mx, torch.zeros_like(mx))
    return torch.max(torch.abs(mn), torch.abs(mx))


def _round_to_power_2(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors ``round_to_power_2``: keep sign and exponent after adding a
    quarter of the mantissa range (1.75 * 2**e rounds up to 2**(e + 1))."""
    mantissa = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}.get(x.dtype)
    if mantissa is None:
        raise TypeError(f"MXFP4 scales of {x.dtype} weights are not supported (bf16, fp16, fp32)")
    exponent = 8 if x.dtype != torch.float16 else 5
    int_dtype = torch.uint32 if x.dtype == torch.float32 else torch.uint16
    bits = x.view(int_dtype).to(torch.int32)
    add = 1 << (mantissa - 1 - 1)
    mask = ((1 << (exponent + 1)) - 1) << mantissa
    out = torch.bitwise_and(bits + add, mask)
    return out.to(int_dtype).view(x.dtype) if int_dtype is torch.uint16 else out.view(x.dtype)


def _mx_scales(block_amax: torch.Tensor) -> torch.Tensor:
    """``generate_mx_scales`` -> uint8 E8M0 -> ``maybe_convert_from_mx_exp``: 2**(e - 2)
    in the weight's dtype (calculate_qparams' order of ops)."""
    dtype = block_amax.dtype
    e8m0 = 127 + torch.floor(torch.log2(_round_to_power_2(block_amax))) - 2
    e8m0 = torch.round(torch.clamp(e8m0, 0, 255)).to(torch.uint8).to(dtype)
    scales = (2.00 ** ((e8m0.to(torch.int32) - 127).to(torch.float))).to(dtype)
    return torch.where(scales == 0, torch.tensor(1, dtype=dtype), scales)


@torch.no_grad()
def quantize(weight: torch.Tensor, fmt: str, global_amax: torch.Tensor | None = None,
             group_size: int | None = None):
    """`(codes, scales, global_scale)`: codes are E2M1 values (fp32 for nvfp4, the weight's
    dtype for mxfp4) shaped like the weight; scales [..., in // block] (nvfp4: fp32 holding
    FP8 values; mxfp4: powers of two in the weight's dtype); global_scale fp32 [1] for nvfp4,
    None for mxfp4. `global_amax` (nvfp4): the fused group's `group_amax`, default the
    weight's own."""
    check_shape(weight.shape, fmt, group_size)
    if not weight.is_floating_point():
        raise TypeError(f"weight must be a floating-point tensor, got {weight.dtype}")
    block = FP4_BLOCK[fmt]
    w = weight.detach()
    groups = w.unflatten(-1, (w.shape[-1] // block, block))
    amax = _block_amax(groups)
    if fmt == "mxfp4":
        scales = _mx_scales(amax)
        return round_e2m1(groups / scales.unsqueeze(-1)).flatten(-2), scales, None
    gs = _global_scale(group_amax([w]) if global_amax is None else global_amax)
    scales = gs * (amax / (2 * E2M1_MAX / 2))  # calculate_qparams: amax / (bit_range / 2)
    scales = torch.clamp(scales, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(scales.dtype)
    scales = torch.where(scales == 0, torch.tensor(FP8_ZERO_SCALE, dtype=scales.dtype), scales)
    codes = round_e2m1(groups / (scales / gs).unsqueeze(-1))
    return codes.flatten(-2), scales, gs


@torch.no_grad()
def dequantize(codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None,
               fmt: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """What compressed-tensors' FP4 compressors decompress to (codes and scales in bf16,
    ``code * (scale / global_scale)``, bf16), cast to `dtype`."""
    check_shape(codes.shape, fmt, what="codes")
    block = FP4_BLOCK[fmt]
    n = codes.shape[-1] // block
    if tuple(scales.shape) != (*codes.shape[:-1], n):
        raise ValueError(f"scales of shape {tuple(scales.shape)} do not fit codes of shape "
                         f"{tuple(codes.shape)} ({fmt}: expected {(*codes.shape[:-1], n)})")
    x = codes.to(torch.bfloat16).unflatten(-1, (n, block))
    s = scales.to(torch.bfloat16).unsqueeze(-1)
    if global_scale is not None:
        s = s / global_scale
    return (x.to(s.dtype) * s).to(torch.bfloat16).flatten(-2).to(dtype)


@torch.no_grad()
def fake_quantize(weight: torch.Tensor, fmt: str, global_amax: torch.Tensor | None = None,
                  group_size: int | None = None) -> torch.Tensor:
    """dequantize(quantize(weight)) in the weight's dtype."""
    codes, scales, gs = quantize(weight, fmt, global_amax, group_size)
    return dequantize(codes, scales, gs, fmt, weight.dtype)


def fused_groups(names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """{name: the names it shares an NVFP4 global scale with (itself included)} for module
    names ending in a fused projection (q/k/v_proj, gate/up_proj) under one parent; every
    other name maps to (name,)."""
    names = list(names)
    present = set(names)
    out: dict[str, tuple[str, ...]] = {}
    for name in names:
        parent, dot, leaf = name.rpartition(".")
        group = (name,)
        for fused in FUSED:
            if leaf in fused:
                group = tuple(f"{parent}{dot}{g}" for g in fused if f"{parent}{dot}{g}" in present)
        out[name] = group
    return out
