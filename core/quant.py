"""INT4 weight-only quantization (W4A16, group-wise symmetric) for QAT, sampling and export.

One function pair owns the arithmetic, and training, the sampler weight push and the
checkpoint export all go through it:

    codes, scales = quantize(w, group_size, convention)   # int8 codes, bf16 [out, in // g]
    w_hat = dequantize(codes, scales, group_size, dtype)
    w_hat = fake_quantize(w, group_size, convention)      # the two above, in w.dtype
    fake_quantize(w_hat, group_size, convention) == w_hat   # a fixed point (`_keep_grid`)

Per group of `group_size` consecutive input columns of one output row::

    amax  = max |w|                                  (exact, in w's dtype)
    scale = bf16(float32(amax) / divisor)            one rounding, as calculate_qparams
    scale = bf16 eps (2**-7) where scale == 0        all-zero groups: codes 0, no NaN
    code  = round_half_even(clamp(w / scale, q_min, q_max))   division in the promoted
                                                     dtype of (w, bf16): fp32 masters
                                                     divide in fp32, bf16 weights in bf16
    w_hat = bf16(code * scale)                       then cast to the weight's dtype

Conventions (`divisor`, `q_min`, `q_max`):

- ``"llm-compressor"``: (7.5, -8, 7). This is compressed-tensors' own symmetric int4
  (``calculate_qparams``: ``amax / (bit_range / 2)`` with bit_range = 15;
  ``calculate_range``: [-8, 7]). ``-amax`` codes to -8; ``+amax`` lands on 7.5 and is
  clamped to 7.
- ``"kimi"``: (7, -7, 7), the Kimi-K2-Thinking QAT grid. compressed-tensors has no
  native option for it (its int4 range is always [-8, 7] and its scale always
  ``amax / 7.5``), so it is emulated through the scale alone: ``scale = amax / 7``, then
  compressed-tensors' ``quantize``/``dequantize`` are used unchanged. With that scale
  (bf16 rounding error <= 2**-9) ``|w / scale| < 7.05 < 7.5``, so the [-8, 7] clamp
  never produces -8 and the codes stay in [-7, 7]. The checkpoint format is the same ``pack-quantized`` one,
  so vLLM needs nothing special. We still clamp to [-7, 7] ourselves; the two differ
  only when a whole group is so small that its scale is a bf16 subnormal
  (amax < ~1e-37), and the exporter (core/export.py) re-checks the codes and raises if
  that ever happens.

Fixed point: a group whose values already sit exactly on an INT4 grid of the convention
(a fake-quantized weight, e.g. a QAT checkpoint loaded again) keeps that grid, so
``fake_quantize(fake_quantize(w)) == fake_quantize(w)`` (`_keep_grid` says why; issue 36).
Every other group is quantized as below.

Bit-exactness: `quantize` does the same torch ops, in the same dtypes, as
compressed-tensors 0.17 ``calculate_qparams`` (scale_dtype=bf16),
``forward._quantize`` / ``forward_helpers._process_group`` and ``_dequantize``, and the
``PackedQuantizationCompressor`` compress/decompress. tests/unit/core/test_quant.py checks
that with ``torch.equal`` against those functions, tests/unit/core/test_export.py against a
written checkpoint.

QAT: `apply_qat(model, QuantConfig(enabled=True))` swaps every targeted ``nn.Linear``
for a `FakeQuantLinear` (same Parameter objects, same state-dict names) whose forward is
``x @ fake_quantize(W).T + b`` with a straight-through gradient. peft LoRA layers are
patched instead (their class becomes a subclass of peft's ``lora.Linear``) so that the
*merged* weight is quantized: ``x @ fake_quantize(W + scaling * B @ A).T + b``. Apply
LoRA first, then QAT. ``lm_head`` is ignored by default and embeddings are never
``nn.Linear``. `quantized_state_dict(model)` returns exactly the weights the trainer's
forward uses, under HF names, for the vLLM sampler; `mopd export` (core/export.py) writes
a compressed-tensors ``pack-quantized`` checkpoint that vLLM loads on GPU (Marlin /
Machete W4A16 kernels dequantize with the same bf16 ``code * scale``).
"""
from __future__ import annotations

import contextlib
import re
import sys
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from core.quant_config import CONVENTIONS, FP4_BLOCK, QuantConfig

__all__ = [
    "CONVENTIONS",
    "QuantConfig",
    "quantize",
    "dequantize",
    "fake_quantize",
    "fake_quantize_ste",
    "FakeQuantLinear",
    "apply_qat",
    "strip_qat",
    "effective_weight",
    "quantized_state_dict",
    "matches",
    "ZERO_SCALE",
]

SCALE_DTYPE = torch.bfloat16
# What compressed-tensors' calculate_qparams puts in place of a zero scale (scale_dtype eps).
ZERO_SCALE = torch.finfo(SCALE_DTYPE).eps


# --------------------------------------------------------------------------- core maths


def _convention(convention: str) -> tuple[float, float, float]:
    try:
        return CONVENTIONS[convention]
    except KeyError:
        raise ValueError(f"unknown INT4 convention {convention!r}; "
                         f"expected one of {sorted(CONVENTIONS)}") from None


def _check_shape(shape: Iterable[int], group_size: int, what: str = "weight") -> None:
    shape = tuple(shape)
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if len(shape) < 2:
        raise ValueError(f"{what} of shape {shape}: INT4 group quantization needs a "
                         "[out, in] matrix")
    if shape[-1] % group_size != 0:
        raise ValueError(f"{what} of shape {shape}: input dim {shape[-1]} is not a multiple "
                         f"of group_size={group_size}")


@torch.no_grad()
def quantize(weight: torch.Tensor, group_size: int = 128,
             convention: str = "llm-compressor", *,
             keep_grid: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-wise symmetric INT4: `(codes int8 [..., in], scales bf16 [..., in // g])`.

    `keep_grid` (default): a group whose values already sit exactly on an INT4 grid of
    this convention (what `fake_quantize` returns) keeps that grid, so fake_quantize is a
    fixed point on its own output; see `_keep_grid`. ``keep_grid=False`` is
    compressed-tensors' arithmetic alone, for every group."""
    divisor, q_min, q_max = _convention(convention)
    _check_shape(weight.shape, group_size)
    if not weight.is_floating_point():
        raise TypeError(f"weight must be a floating-point tensor, got {weight.dtype}")
    w = weight.detach()
    groups = w.unflatten(-1, (w.shape[-1] // group_size, group_size))
    # calculate_qparams: min/max clipped to include 0, then max(|min|, |max|) == amax|w|.
    amax = groups.abs().amax(dim=-1)
    # `tensor / python float` as in calculate_qparams (CUDA turns it into a multiply by
    # the reciprocal; doing the same op keeps us bit-equal on every device).
    scales = (amax.to(torch.float32) / divisor).to(SCALE_DTYPE)
    scales = torch.where(scales == 0, torch.tensor(ZERO_SCALE, dtype=SCALE_DTYPE,
                                                   device=scales.device), scales)
    # (a DTensor shard, FSDP2's state_dict: no boolean indexing there, so its groups get
    # compressed-tensors' scale alone; its training forward sees gathered plain tensors)
    if keep_grid and not hasattr(groups, "device_mesh"):
        scales = _keep_grid(groups, amax, scales, convention)
    # forward._quantize: x / scale (type promotion decides the dtype), clamp, then round
    # (torch.round is round-half-to-even), then cast.
    scaled = groups / scales.unsqueeze(-1)
    codes = torch.round(torch.clamp(scaled, q_min, q_max)).to(torch.int8)
    return codes.flatten(-2), scales


# |code| of a fake-quantized group's largest |w|: llm-compressor's amax / scale is 7.5
# +- 2**-8 relative, so 7 (positive, clamped) or 8 (negative, rounded to -8); Kimi's is
# 7 +- 2**-8, so always 7.
_GRID_CODES = {"llm-compressor": (7, 8), "kimi": (7,)}


def _keep_grid(groups: torch.Tensor, amax: torch.Tensor, scales: torch.Tensor,
               convention: str) -> torch.Tensor:
    """`scales` with each group that is already exactly on an INT4 grid given that grid's
    scale instead, so that quantize -> dequantize returns such a group unchanged.

    Why: compressed-tensors' scale is amax / 7.5. A fake-quantized group's amax is
    7 * s (or 8 * s), so quantizing it again picks the scale 7/7.5 * s and new codes:
    88% of the entries of a random matrix moved (relative L2 0.066, against 0.094 for
    the quantization itself; Kimi's grid: 8%, bf16 rounding of 7 * s). Every stage that
    trained on from a QAT checkpoint (which stores the fake-quantized weights) started
    from another model than the one that was scored. With this rule a QAT checkpoint
    loads with QAT on to exactly the weights that were evaluated.

    Which groups: those that one of the <= 6 bf16 scales next to amax / c (c in
    `_GRID_CODES`) reproduces exactly with the quantizer's own arithmetic (the search of
    `core.export.recover_grid`). Cheap tests first, so QAT's per-forward cost stays
    small: the group's amax must be a bf16 value (fp32 master weights' practically never
    is), then its first 2 values must fit some candidate (a bf16 master group's almost
    never do), and only those groups are checked whole. Such a group is encoded with
    zero error, so the rule only ever lowers the quantization error; every other group
    gets compressed-tensors' scale bit for bit."""
    _, q_min, q_max = _convention(convention)
    maybe = (amax.to(SCALE_DTYPE).to(amax.dtype) == amax) & (amax > 0)
    if not bool(maybe.any()):
        return scales
    if bool(maybe.all()):  # bf16 weights: no boolean indexing (its nonzero is the cost)
        maybe, _ = _grid_scales(groups[..., :2], amax, convention, q_min, q_max)
    else:
        head_ok, _ = _grid_scales(groups[..., :2][maybe], amax[maybe], convention, q_min, q_max)
        maybe[maybe.clone()] = head_ok
    if not bool(maybe.any()):
        return scales
    ok, grid = _grid_scales(groups[maybe], amax[maybe], convention, q_min, q_max)
    kept = scales.clone()
    kept[maybe] = torch.where(ok, grid, scales[maybe])
    return kept


def _grid_scales(sub: torch.Tensor, amax: torch.Tensor, convention: str, q_min: float,
                 q_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows `sub` [n, k] of groups whose largest |w| is `amax` [n]: (found [n], the
    bf16 scale [n] with ``bf16(round(clamp(w / s)) * s) == w`` on every value)."""
    found = torch.zeros(amax.shape, dtype=torch.bool, device=sub.device)
    kept = torch.ones(amax.shape, dtype=SCALE_DTYPE, device=sub.device)
    for c in _GRID_CODES[convention]:
        base_bits = (amax.to(torch.float32) / c).to(SCALE_DTYPE).view(torch.int16)
        for delta in (0, -1, 1):
            s = (base_bits + delta).view(SCALE_DTYPE)  # positive bf16: bits are monotone
            usable = ~found & torch.isfinite(s) & (s > 0)
            if not bool(usable.any()):
                continue
            s_safe = torch.where(usable, s, torch.ones_like(s)).unsqueeze(-1)
            codes = torch.round(torch.clamp(sub / s_safe, q_min, q_max))
            ok = usable & ((codes.to(SCALE_DTYPE) * s_safe).to(sub.dtype) == sub).all(dim=-1)
            kept = torch.where(ok, s, kept)
            found |= ok
        if bool(found.all()):
            break
    return found, kept


@torch.no_grad()
def dequantize(codes: torch.Tensor, scales: torch.Tensor, group_size: int = 128,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`codes * scale` computed in the scales' dtype (bf16), as compressed-tensors
    ``_dequantize`` does, then cast to `dtype`."""
    _check_shape(codes.shape, group_size, what="codes")
    n_groups = codes.shape[-1] // group_size
    if tuple(scales.shape) != (*codes.shape[:-1], n_groups):
        raise ValueError(f"scales of shape {tuple(scales.shape)} do not fit codes of shape "
                         f"{tuple(codes.shape)} with group_size={group_size} (expected "
                         f"{(*codes.shape[:-1], n_groups)})")
    grouped = codes.unflatten(-1, (n_groups, group_size)).to(scales.dtype)
    return (grouped * scales.unsqueeze(-1)).flatten(-2).to(dtype)


@torch.no_grad()
def fake_quantize(weight: torch.Tensor, group_size: int = 128,
                  convention: str = "llm-compressor", global_amax=None) -> torch.Tensor:
    """dequantize(quantize(weight)) in the weight's dtype (no gradient; see
    `fake_quantize_ste`). `convention` "nvfp4" / "mxfp4" (QuantConfig.grid) hands the weight
    to core.fp4 (`global_amax`: NVFP4's fused-group max |w|, see `_fp4_amax`)."""
    if convention in FP4_BLOCK:
        from core import fp4
        return fp4.fake_quantize(weight, convention, global_amax, group_size)
    codes, scales = quantize(weight, group_size, convention)
    return dequantize(codes, scales, group_size, weight.dtype)


class _FakeQuantSTE(torch.autograd.Function):
    """Forward: fake_quantize. Backward: identity (straight-through estimator).

    A Function rather than ``w + (fq(w) - w).detach()`` because that sum is not always
    bit-equal to fq(w) in floating point, and the sampler must see exactly these values."""

    @staticmethod
    def forward(ctx, weight, group_size, convention, global_amax=None):
        return fake_quantize(weight, group_size, convention, global_amax)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None, None, None


def fake_quantize_ste(weight: torch.Tensor, group_size: int = 128,
                      convention: str = "llm-compressor", global_amax=None) -> torch.Tensor:
    """fake_quantize with a straight-through gradient: d out / d weight = identity."""
    return _FakeQuantSTE.apply(weight, group_size, convention, global_amax)


def _check_grid(convention: str, shape, group_size: int) -> None:
    if convention in FP4_BLOCK:
        from core import fp4
        fp4.check_shape(shape, convention, group_size)
    else:
        _convention(convention)
        _check_shape(shape, group_size)


@torch.no_grad()
def _fp4_amax(module: nn.Module):
    """NVFP4's global-scale input for a QAT module: the max |w| over its fused group
    (q/k/v, gate/up: vLLM runs them as one layer with one global scale), set by `apply_qat`
    as ``fp4_siblings``; None for everything else (the weight's own max is used)."""
    sibs = module.__dict__.get("fp4_siblings")
    if not sibs:
        return None
    from core.fp4 import group_amax
    return group_amax(_lora_merged_weight(m) if _is_lora_linear(m) else m.weight for m in sibs)


# --------------------------------------------------------------------------- QAT modules


class FakeQuantLinear(nn.Module):
    """An ``nn.Linear`` whose forward uses ``fake_quantize(weight)`` (STE gradient).

    It takes over the Linear's own ``weight``/``bias`` Parameter objects, so optimizer
    state, ``state_dict()`` names and ``save_pretrained`` are unchanged: ``q_proj.weight``
    stays ``q_proj.weight`` and holds the full-precision master weight."""

    def __init__(self, linear: nn.Linear, group_size: int = 128,
                 convention: str = "llm-compressor"):
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"FakeQuantLinear wraps an nn.Linear, got {type(linear).__name__}")
        _check_grid(convention, linear.weight.shape, group_size)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.group_size = group_size
        self.convention = convention
        self.weight = linear.weight
        if linear.bias is not None:
            self.bias = linear.bias
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._frozen and not (torch.is_grad_enabled() and self.weight.requires_grad):
            return F.linear(x, self._frozen_weight(), self.bias)
        return F.linear(x, fake_quantize_ste(self.weight, self.group_size, self.convention,
                                             _fp4_amax(self)), self.bias)

    # Sampling from the QAT model with HF generate runs one forward per token with the same
    # weights; quantizing them once instead of every time made a generate 0.78-0.87x as long
    # at the pipeline's sizes (a busy machine; HF's own per-token overhead is the rest).
    # Inside `frozen_weights` the quantized
    # weight is computed once and kept while the weight's storage and version counter stay
    # the same (an optimizer step or copy_ bumps the version; `.data` writes do not, which
    # is why this is scoped to a block where nothing may change the weights).
    _frozen = 0
    _cache: tuple | None = None

    def _frozen_weight(self) -> torch.Tensor:
        w = self.weight
        key = (w.data_ptr(), w._version, w.dtype, w.device, w.shape)
        if self._cache is None or self._cache[0] != key:
            with torch.no_grad():
                self._cache = (key, fake_quantize(w, self.group_size, self.convention,
                                                  _fp4_amax(self)))
        return self._cache[1]

    def quantized_weight(self) -> torch.Tensor:
        return fake_quantize(self.weight, self.group_size, self.convention, _fp4_amax(self))

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear sharing this module's Parameters (the QAT wrapper removed)."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device="meta")
        lin.weight = self.weight
        lin.bias = self.bias
        return lin

    def extra_repr(self) -> str:
        grid = f"{self.convention}" if self.convention in FP4_BLOCK else \
            f"int4 group_size={self.group_size}, convention={self.convention}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {grid}")


@contextlib.contextmanager
def frozen_weights(model: nn.Module):
    """Inside this block the model's fake-quantized Linear layers quantize their weights once
    and reuse the result in every no-grad forward (sampling a completion token by token),
    instead of once per forward. The weights must not change inside the block; a forward
    with gradients still quantizes afresh. The cached copies are dropped on exit. Values
    are bit-identical to the uncached forward."""
    mods = [m for m in model.modules() if isinstance(m, FakeQuantLinear)]
    for m in mods:
        m._frozen += 1
    try:
        yield model
    finally:
        for m in mods:
            m._frozen -= 1
            if not m._frozen:
                m._cache = None


def quantize_once_per_generation(trainer_cls: type) -> type:
    """A subclass of a TRL trainer (GRPOTrainer) whose HF-generate sampling runs inside
    `frozen_weights(self.model)`: the same samples, without re-quantizing every weight at
    every generated token. A TRL without `_generate_single_turn` gets the class unchanged
    (slower sampling, same results)."""
    if not hasattr(trainer_cls, "_generate_single_turn"):
        return trainer_cls

    class QATGeneration(trainer_cls):
        def _generate_single_turn(self, *args, **kwargs):
            with frozen_weights(self.model):
                return super()._generate_single_turn(*args, **kwargs)

    QATGeneration.__name__ = QATGeneration.__qualname__ = trainer_cls.__name__
    return QATGeneration


def _lora_linear_cls():
    """peft's lora.Linear if peft is already imported (no peft model can exist otherwise)."""
    mod = sys.modules.get("peft.tuners.lora.layer")
    return getattr(mod, "Linear", None) if mod is not None else None


def _is_lora_linear(module: nn.Module) -> bool:
    cls = _lora_linear_cls()
    return cls is not None and isinstance(module, cls)


def _lora_merged_weight(module) -> torch.Tensor:
    """W + sum of the active adapters' deltas, with the same numerics as peft's
    ``merge()`` (``W += get_delta_weight(a)``: added in the promoted dtype, stored in W's),
    so the merged and unmerged states give bit-identical weights. Differentiable."""
    w = module.get_base_layer().weight
    if module.disable_adapters or module.merged:
        return w  # disabled: base only; merged: the deltas are already inside W
    for adapter in module.active_adapters:
        if adapter in module.lora_A.keys():
            w = (w + module.get_delta_weight(adapter)).to(w.dtype)
    return w


def _check_vanilla_lora(module, name: str, qat: bool) -> None:
    """Only plain LoRA on an nn.Linear has a merged weight W + scaling * B @ A; with QAT
    on, the forward must also be expressible through that merged weight (no dropout)."""
    base = module.get_base_layer()
    if not isinstance(base, nn.Linear):
        raise ValueError(f"{name}: LoRA base layer is {type(base).__name__}, only nn.Linear "
                         "is supported by INT4 QAT")
    if getattr(module, "lora_variant", None):
        raise ValueError(f"{name}: LoRA variants ({', '.join(module.lora_variant)}: DoRA, "
                         "aLoRA, ...) are not supported by INT4 QAT over the merged weight")
    for adapter in module.lora_A.keys():
        if getattr(module, "lora_bias", {}).get(adapter, False):
            raise ValueError(f"{name}: lora_bias=True is not supported by INT4 QAT")
        drop = module.lora_dropout[adapter]
        if qat and isinstance(drop, nn.Dropout) and drop.p > 0:
            raise ValueError(f"{name}: lora_dropout={drop.p} cannot be expressed as "
                             "x @ fake_quant(W + dW).T; set lora dropout to 0 with QAT")


_QAT_LORA_CLS = None


def _qat_lora_cls():
    """A subclass of peft's lora.Linear whose forward quantizes the merged weight. Patched
    modules keep their peft class ancestry (merge, unmerge, save_pretrained of adapters
    all work) and their names."""
    global _QAT_LORA_CLS
    if _QAT_LORA_CLS is None:
        from peft.tuners.lora.layer import Linear as LoraLinear  # peft only where LoRA is used

        class QATLoraLinear(LoraLinear):
            def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
                self._check_forward_args(x, *args, **kwargs)
                if kwargs.get("adapter_names") is not None:
                    raise NotImplementedError("INT4 QAT does not support mixed-adapter "
                                              "batches (adapter_names=...)")
                if self.disable_adapters and self.merged:
                    self.unmerge()
                w = fake_quantize_ste(_lora_merged_weight(self), self.qat_group_size,
                                      self.qat_convention, _fp4_amax(self))
                return F.linear(x, w, self.get_base_layer().bias)

            def __repr__(self) -> str:
                return (super().__repr__() + f" [int4 QAT group_size={self.qat_group_size}, "
                        f"convention={self.qat_convention}]")

        QATLoraLinear.__module__ = __name__
        QATLoraLinear.__qualname__ = "QATLoraLinear"
        globals()["QATLoraLinear"] = QATLoraLinear  # so pickling finds it
        _QAT_LORA_CLS = QATLoraLinear
    return _QAT_LORA_CLS


def _is_peft_model(model: nn.Module) -> bool:
    return getattr(model, "peft_config", None) is not None and hasattr(model, "base_model")


def _hf_name(name: str, peft_prefix: bool) -> str | None:
    """The HF name of a module or parameter path inside a (peft) model, or None for what
    is no part of the HF model (LoRA A/B, a modules_to_save wrapper's original copy)."""
    parts = name.split(".") if name else []
    if peft_prefix and parts[:2] == ["base_model", "model"]:
        parts = parts[2:]
    out: list[str] = []
    i = 0
    while i < len(parts):
        p = parts[i]
        if p == "base_layer":
            i += 1
            continue
        if p == "original_module" or p.startswith("lora_"):
            return None
        if p == "modules_to_save":
            i += 2  # modules_to_save.<adapter>
            continue
        out.append(p)
        i += 1
    return ".".join(out)


def matches(name: str, patterns: Iterable[str]) -> bool:
    """`name` is one of `patterns` (a module name or its last parts), or matches a "re:" pattern."""
    for pat in patterns:
        if pat.startswith("re:"):
            if re.match(pat[3:], name):
                return True
        elif name == pat or name.endswith("." + pat):
            return True
    return False


def apply_qat(model: nn.Module, cfg: QuantConfig) -> list[str]:
    """Turn on INT4 QAT in place; return the names (as in ``model.named_modules()``) of the
    modules now fake-quantized. Nothing happens (returns []) when ``cfg.enabled`` is False.

    Plain ``nn.Linear`` -> `FakeQuantLinear`; peft ``lora.Linear`` -> forward over
    ``fake_quantize(W + dW)``. Modules matching ``cfg.ignore`` (checked on the HF name,
    peft prefixes removed) are left alone. A targeted Linear whose input dim is not a
    multiple of group_size is an error naming it, raised before anything is changed."""
    cfg.validate()
    if not cfg.enabled:
        return []
    peft_prefix = _is_peft_model(model)
    plan: list[tuple[str, nn.Module, str]] = []
    lora_prefixes: list[str] = []
    for name, mod in model.named_modules():
        if any(name.startswith(p) for p in lora_prefixes):
            continue  # base_layer / lora_A / lora_B of a LoRA layer
        hf = _hf_name(name, peft_prefix)
        is_lora = _is_lora_linear(mod)
        if is_lora:
            lora_prefixes.append(name + ".")
        if hf is None or matches(hf, cfg.ignore):
            continue
        if is_lora:
            if not hasattr(mod, "qat_group_size"):
                plan.append((name, mod, "lora"))
        elif isinstance(mod, nn.Linear):
            plan.append((name, mod, "linear"))
    for name, mod, kind in plan:
        weight = mod.get_base_layer().weight if kind == "lora" else mod.weight
        try:
            _check_grid(cfg.grid, weight.shape, cfg.group_size)
        except ValueError as e:
            fix = "change quant.group_size" if cfg.format == "int4" else \
                "use quant.format: int4 with a quant.group_size that divides it"
            raise ValueError(f"{name}: {e}; add it to quant.ignore or {fix}") from None
        if kind == "lora":
            _check_vanilla_lora(mod, name, qat=True)
    for name, mod, kind in plan:
        if kind == "lora":
            mod.__class__ = _qat_lora_cls()
            mod.qat_group_size = cfg.group_size
            mod.qat_convention = cfg.grid
        else:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, FakeQuantLinear(mod, cfg.group_size, cfg.grid))
    if cfg.format == "nvfp4":
        from core.fp4 import fused_groups
        for name, group in fused_groups([n for n, _, _ in plan]).items():
            if len(group) > 1:  # a plain tuple in __dict__: no submodule registered
                model.get_submodule(name).__dict__["fp4_siblings"] = \
                    tuple(model.get_submodule(g) for g in group)
    return [name for name, _, _ in plan]


def strip_qat(model: nn.Module) -> nn.Module:
    """Undo `apply_qat` in place (FakeQuantLinear -> nn.Linear with the same Parameters,
    patched LoRA layers -> peft's lora.Linear). The weights stay full precision; write
    `quantized_state_dict(model)` taken before stripping if the quantized values are
    what you want to save."""
    for name, mod in list(model.named_modules()):
        if isinstance(mod, FakeQuantLinear):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, mod.to_linear())
        elif hasattr(mod, "qat_group_size") and _is_lora_linear(mod):
            mod.__class__ = _lora_linear_cls()
            del mod.qat_group_size, mod.qat_convention
            mod.__dict__.pop("fp4_siblings", None)
    return model


def _qat_params(module: nn.Module) -> tuple[int, str] | None:
    if isinstance(module, FakeQuantLinear):
        return module.group_size, module.convention
    if hasattr(module, "qat_group_size"):
        return module.qat_group_size, module.qat_convention
    return None


@torch.no_grad()
def effective_weight(module: nn.Module) -> torch.Tensor:
    """The weight a (QAT or LoRA) linear module's forward multiplies by: fake-quantized
    when QAT is on, LoRA merged in for LoRA layers."""
    w = _lora_merged_weight(module) if _is_lora_linear(module) else module.weight
    q = _qat_params(module)
    return fake_quantize(w, *q, _fp4_amax(module)) if q is not None else w.detach()


@torch.no_grad()
def _hf_tensors(model: nn.Module):
    """(tensors under HF names with LoRA merged, {HF module name: (group_size, convention)}
    for the fake-quantized modules, [HF names of every linear module])."""
    peft_prefix = _is_peft_model(model)
    tensors: dict[str, torch.Tensor] = {}
    for key, t in model.state_dict().items():
        hf = _hf_name(key, peft_prefix)
        if hf is not None:
            tensors[hf] = t
    quantized: dict[str, tuple[int, str]] = {}
    linears: list[str] = []
    for name, mod in model.named_modules():
        hf = _hf_name(name, peft_prefix)
        if hf is None:
            continue
        if _is_lora_linear(mod):
            _check_vanilla_lora(mod, name, qat=False)
            tensors[hf + ".weight"] = _lora_merged_weight(mod).detach()
        if isinstance(mod, (nn.Linear, FakeQuantLinear)) or _is_lora_linear(mod):
            if hf not in linears:
                linears.append(hf)
        q = _qat_params(mod)
        if q is not None:
            quantized[hf] = q
    return tensors, quantized, linears


@torch.no_grad()
def quantized_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` under the original HF names (no peft prefixes, no
    ``base_layer``, no LoRA A/B: LoRA is merged in) with every fake-quantized Linear's
    weight replaced by ``fake_quantize(weight)`` in the weight's dtype. These are exactly
    the weights the trainer's forward uses (the quantized ones are bf16-representable,
    so casting them to bf16 for the sampler is lossless). The model is not modified."""
    tensors, quantized, _ = _hf_tensors(model)
    amax = fp4_group_amax(tensors, quantized)
    for name, (group_size, convention) in quantized.items():
        key = name + ".weight"
        tensors[key] = fake_quantize(tensors[key], group_size, convention, amax.get(name))
    return tensors


def fp4_group_amax(tensors: dict, quantized: dict) -> dict:
    """{module name: NVFP4 global-scale input} for the NVFP4 modules of a fused group, from
    their weights under `tensors` (``name.weight``): what `_fp4_amax` gives the trainer."""
    from core.fp4 import fused_groups, group_amax

    nv = [n for n, (_, c) in quantized.items() if c == "nvfp4"]
    return {n: group_amax(tensors[g + ".weight"] for g in group)
            for n, group in fused_groups(nv).items() if len(group) > 1} if nv else {}
