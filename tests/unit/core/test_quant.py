"""INT4 W4A16 core: bit-exact agreement with compressed-tensors, STE, QAT on plain and
LoRA models (the export to a pack-quantized checkpoint: test_export.py)."""
import copy

import pytest
import torch
import torch.nn.functional as F
from compressed_tensors.compressors import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import calculate_qparams
from torch import nn

from core.quant import (FakeQuantLinear, QuantConfig, apply_qat, dequantize, effective_weight, fake_quantize,
                        fake_quantize_ste, quantize, quantized_state_dict, strip_qat)

CONVENTIONS = ["llm-compressor", "kimi"]
GROUPS = [32, 128]
OTHER = {"llm-compressor": "kimi", "kimi": "llm-compressor"}


def ct_args(group_size: int) -> QuantizationArgs:
    return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=group_size, scale_dtype=torch.bfloat16)


def ct_scales_llm_compressor(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """compressed-tensors' own scales (llm-compressor RTN: memoryless min-max observer)."""
    g = w.unflatten(-1, (w.shape[-1] // group_size, group_size))
    scales, _ = calculate_qparams(g.amin(-1), g.amax(-1), ct_args(group_size))
    return scales.to(torch.bfloat16)


def special_weight(out: int, inp: int, group_size: int, dtype, seed: int = 0) -> torch.Tensor:
    """Random weight with an all-zero group, a group holding exact +-amax, tiny and huge
    groups, and negative zeros."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=gen) * 0.05
    w[0, :group_size] = 0.0                              # all-zero group
    w[1, :group_size] = -0.0
    w[1, group_size // 2] = 0.25                         # single nonzero in a group
    w[2, :group_size] = torch.linspace(-1, 1, group_size)  # exactly -amax and +amax
    w[3, :group_size] *= 1e-30                           # tiny but normal scales
    w[4, :group_size] *= 1e4
    w[5, :group_size] = w[5, :group_size].abs()          # one-signed groups
    w[6, :group_size] = -w[6, :group_size].abs()
    return w.to(dtype)


# ------------------------------------------------------------------ bit-exact vs CT


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("convention", CONVENTIONS)
def test_matches_compressed_tensors(convention, group_size, dtype):
    w = special_weight(16, 256, group_size, dtype)
    codes, scales = quantize(w, group_size, convention, keep_grid=False)  # CT's arithmetic alone
    assert codes.dtype == torch.int8 and codes.shape == w.shape
    assert scales.dtype == torch.bfloat16 and scales.shape == (16, 256 // group_size)
    if convention == "llm-compressor":
        assert torch.equal(scales, ct_scales_llm_compressor(w, group_size))
        # CT computes in the weight's dtype when the observer sees bf16 weights: same.
        assert torch.equal(scales, ct_scales_llm_compressor(w.float(), group_size))
        assert int(codes.min()) == -8
    else:
        assert -7 <= int(codes.min()) and int(codes.max()) <= 7
        # the largest |w| of every nonzero group codes to +-7 (Kimi's grid property)
        g = codes.unflatten(-1, (-1, group_size)).abs().amax(-1)
        nonzero = w.unflatten(-1, (-1, group_size)).abs().amax(-1) > 0
        assert torch.all(g[nonzero] == 7)
    args = ct_args(group_size)
    assert torch.equal(codes, ct_quantize(w, scales, None, args, dtype=torch.int8))
    assert torch.equal(dequantize(codes, scales, group_size, torch.bfloat16),
                       ct_dequantize(codes, scales, args=args))
    ct_fq = ct_fake_quantize(w, scales, None, args)
    assert torch.equal(dequantize(codes, scales, group_size, dtype), ct_fq)
    # The default (fixed-point rule) differs only on groups it reproduces exactly: here
    # the group holding a single 0.25, which sits on a grid of scale bf16(0.25 / 7).
    fq = fake_quantize(w, group_size, convention)
    assert fq.dtype == dtype and not torch.isnan(fq).any()
    differ = (fq != ct_fq).unflatten(-1, (-1, group_size)).any(-1)
    exact = (fq == w).unflatten(-1, (-1, group_size)).all(-1)
    assert torch.all(exact[differ])
    if convention == "llm-compressor":
        assert differ[1, 0]
    fq = ct_fq
    # compressed-tensors' pack-quantized compressor, compress then decompress
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    comp = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scales}, scheme)
    dec = PackedQuantizationCompressor.decompress(comp, scheme)["weight"]
    assert dec.dtype == torch.bfloat16
    assert torch.equal(dec, fq.to(torch.bfloat16))
    assert torch.equal(dec.to(dtype), fq)  # the fake-quantized weight is bf16-exact


def test_all_zero_group_and_extremes():
    w = torch.zeros(2, 64)
    w[1, :32] = torch.tensor([7.5, -7.5] + [0.0] * 30)
    for convention in CONVENTIONS:
        codes, scales = quantize(w, 32, convention)
        eps = torch.finfo(torch.bfloat16).eps  # what calculate_qparams puts for a zero scale
        assert scales[0].tolist() == [eps, eps] and scales[1, 1].item() == eps
        assert torch.equal(codes[0], torch.zeros(64, dtype=torch.int8))
        fq = fake_quantize(w, 32, convention)
        assert torch.equal(fq[0], torch.zeros(64)) and not torch.isnan(fq).any()
    codes, scales = quantize(w, 32, "llm-compressor", keep_grid=False)
    assert scales[1, 0].item() == 1.0 and codes[1, :2].tolist() == [7, -8]  # 7.5 clamped; -7.5 even
    assert torch.equal(scales, ct_scales_llm_compressor(w, 32))
    # [7.5, -7.5, 0, ...] sits on the grid of scale bf16(7.5 / 7) (codes 7, -7): the
    # default keeps that grid, so this group is encoded exactly (quantize's fixed point).
    codes, scales = quantize(w, 32, "llm-compressor")
    assert codes[1, :2].tolist() == [7, -7] and torch.equal(fake_quantize(w, 32), w)
    codes, scales = quantize(w, 32, "kimi")
    assert scales[1, 0].item() == (torch.tensor(7.5) / 7).to(torch.bfloat16).item()
    assert codes[1, :2].tolist() == [7, -7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("convention", CONVENTIONS)
def test_round_half_to_even_ties(convention, dtype):
    """w / scale lands exactly on k + 0.5: torch.round (half to even), as CT."""
    divisor = {"llm-compressor": 7.5, "kimi": 7.0}[convention]
    s = 0.375  # bf16-exact scale, and (k + .5) * s is bf16-exact too
    halves = [0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, -0.5, -1.5, -2.5, -3.5, -4.5, -5.5, -6.5]
    expected = [0, 2, 2, 4, 4, 6, 6, 0, -2, -2, -4, -4, -6, -6]
    row = [divisor * s] + [h * s for h in halves]
    row += [0.0] * (32 - len(row))
    w = torch.tensor([row], dtype=dtype)
    codes, scales = quantize(w, 32, convention)
    assert scales.item() == s
    assert codes[0, 1:1 + len(halves)].tolist() == expected
    assert torch.equal(codes, ct_quantize(w, scales, None, ct_args(32), dtype=torch.int8))


def test_scale_rounding_tie_goes_to_even():
    """amax / 7.5 exactly halfway between two bf16 values rounds to the even one."""
    amax = 7.5 * (1 + 2 ** -8)  # fp32-exact; amax / 7.5 = 1 + 2**-8, a bf16 midpoint
    w = torch.zeros(1, 32)
    w[0, 0] = amax
    w[0, 1] = -amax
    codes, scales = quantize(w, 32, "llm-compressor")
    assert scales.item() == 1.0
    assert torch.equal(scales, ct_scales_llm_compressor(w, 32))
    assert codes[0, :2].tolist() == [7, -8]
    w[0, 0], w[0, 1] = 7 * (1 + 2 ** -8), 7 * (1 + 3 * 2 ** -8)  # kimi: ties up to even
    _, scales = quantize(w, 32, "kimi")
    assert scales.item() == 1 + 4 * 2 ** -8


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_wrong_convention_fails(convention):
    w = special_weight(16, 128, 32, torch.float32, seed=3)
    args = ct_args(32)
    # the llm-compressor pipeline entirely inside compressed-tensors
    ct_llm = ct_fake_quantize(w, ct_scales_llm_compressor(w, 32), None, args)
    ours = dequantize(*quantize(w, 32, convention, keep_grid=False), 32, w.dtype)
    if convention == "llm-compressor":
        assert torch.equal(ours, ct_llm)
    else:
        assert not torch.equal(ours, ct_llm)
    codes, scales = quantize(w, 32, OTHER[convention])
    assert not torch.equal(ours, dequantize(codes, scales, 32, w.dtype))


def test_bad_shapes_and_config():
    with pytest.raises(ValueError, match=r"\(4, 100\).*group_size=32"):
        quantize(torch.randn(4, 100), 32)
    with pytest.raises(ValueError, match=r"\(4, 100\).*group_size=128"):
        FakeQuantLinear(nn.Linear(100, 4), 128)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 100), nn.Linear(100, 8))
    with pytest.raises(ValueError, match=r"^2: .*\(8, 100\).*group_size=32"):
        apply_qat(model, QuantConfig(enabled=True, group_size=32))
    assert all(type(m) is nn.Linear for m in model)  # nothing changed before the error
    with pytest.raises(ValueError, match="bits"):
        QuantConfig(bits=8)
    with pytest.raises(ValueError, match="convention"):
        QuantConfig(convention="gptq")
    with pytest.raises(ValueError, match="convention"):
        quantize(torch.randn(4, 64), 32, "gptq")
    with pytest.raises(ValueError, match="scales of shape"):
        dequantize(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 3), 32)


# ------------------------------------------------------------------ STE and QAT modules


def test_ste_gradient_is_identity():
    w = torch.randn(8, 64, requires_grad=True)
    g = torch.randn(8, 64)
    out = fake_quantize_ste(w, 32, "kimi")
    assert torch.equal(out, fake_quantize(w, 32, "kimi"))
    out.backward(g)
    assert torch.equal(w.grad, g)

    lin = nn.Linear(64, 8)
    fq_lin = FakeQuantLinear(lin, 32)
    assert fq_lin.weight is lin.weight and fq_lin.bias is lin.bias
    x = torch.randn(5, 64)
    y = fq_lin(x)
    ref_w = fake_quantize(lin.weight, 32).requires_grad_()
    ref = F.linear(x, ref_w, lin.bias.detach())
    assert torch.equal(y, ref)
    gy = torch.randn_like(y)
    y.backward(gy)
    ref.backward(gy)
    assert torch.equal(lin.weight.grad, ref_w.grad)  # dL/dW = dL/dW_q


def tiny_qwen2(seed: int = 0, tie: bool = False, dtype=torch.float32):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=64, max_position_embeddings=64, tie_word_embeddings=tie)
    return Qwen2ForCausalLM(cfg).to(dtype)


LINEARS = [f"model.layers.{i}.{m}" for i in range(1) for m in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


def test_apply_qat_plain_model():
    model = tiny_qwen2()
    keys = list(model.state_dict())
    assert apply_qat(model, QuantConfig()) == []  # disabled: no-op
    names = apply_qat(model, QuantConfig(enabled=True, group_size=32, convention="kimi"))
    assert names == LINEARS
    assert type(model.lm_head) is nn.Linear and isinstance(model.model.embed_tokens, nn.Embedding)
    assert list(model.state_dict()) == keys  # no wrapper prefixes
    q = model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, 128)
    wq = fake_quantize(q.weight, 32, "kimi")
    assert torch.equal(q(x), F.linear(x, wq, q.bias))
    torch.testing.assert_close(q(x), x @ wq.T + q.bias)
    sd = quantized_state_dict(model)
    assert list(sd) == keys
    assert torch.equal(sd["model.layers.0.self_attn.q_proj.weight"], wq)
    assert torch.equal(sd["lm_head.weight"], model.lm_head.weight)
    model(torch.randint(0, 256, (2, 8))).logits.sum().backward()
    assert q.weight.grad is not None
    strip_qat(model)
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    assert model.model.layers[0].self_attn.q_proj.weight is q.weight


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16])
def test_apply_qat_lora_quantizes_merged_weight(base_dtype):
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear as LoraLinear

    base = tiny_qwen2(seed=1, dtype=base_dtype)
    hf_keys = list(base.state_dict())
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                            target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at zero; make dW non-zero
            nn.init.normal_(p, std=0.05)
    names = apply_qat(model, QuantConfig(enabled=True, group_size=32))
    assert len(names) == len(LINEARS)
    assert [n.removeprefix("base_model.model.") for n in names] == LINEARS
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q, LoraLinear) and type(q.base_layer) is nn.Linear
    assert isinstance(model.base_model.model.model.layers[0].self_attn.k_proj, FakeQuantLinear)
    assert type(model.base_model.model.lm_head) is nn.Linear

    W = q.base_layer.weight
    A, B = q.lora_A["default"].weight, q.lora_B["default"].weight
    dW = q.scaling["default"] * (B @ A)
    wq = fake_quantize((W + dW).to(W.dtype), 32)
    x = torch.randn(3, 128, dtype=base_dtype)
    y = q(x)
    assert torch.equal(y, F.linear(x, wq, q.base_layer.bias))
    torch.testing.assert_close(y, x @ wq.T + q.base_layer.bias)
    assert not torch.equal(wq, fake_quantize(W, 32))  # the LoRA delta matters
    assert torch.equal(effective_weight(q), wq)

    y.sum().backward()  # STE: gradient reaches the adapters through the merged weight
    assert A.grad is not None and B.grad is not None and A.grad.abs().sum() > 0

    sd = quantized_state_dict(model)
    assert list(sd) == hf_keys
    assert torch.equal(sd["model.layers.0.self_attn.q_proj.weight"], wq)
    # deep copies (train.py makes them) keep the patched LoRA class
    clone = copy.deepcopy(model)
    assert all(torch.equal(sd[k], v) for k, v in quantized_state_dict(clone).items())
    # peft's merge gives the same weights bit for bit (quantized_state_dict itself never
    # merges: merge + unmerge does not restore W exactly, bf16 W drifts)
    model.merge_adapter()
    assert torch.equal(q(x), y.detach())
    sd_merged = quantized_state_dict(model)
    assert all(torch.equal(sd[k], sd_merged[k]) for k in sd)


def test_apply_qat_rejects_lora_dropout():
    from peft import LoraConfig, get_peft_model

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 64)

        def forward(self, x):
            return self.proj(x)

    model = get_peft_model(Tiny(), LoraConfig(r=2, lora_dropout=0.1, target_modules=["proj"]))
    with pytest.raises(ValueError, match="proj: lora_dropout=0.1"):
        apply_qat(model, QuantConfig(enabled=True, group_size=32))
    # without QAT the merged weight is still well defined
    sd = quantized_state_dict(model)
    assert list(sd) == ["proj.weight", "proj.bias"]


def test_frozen_weights_quantize_once_and_give_identical_outputs(monkeypatch):
    """frozen_weights: sampling forwards reuse one quantized copy (bit-identical); an
    optimizer step, copy_ or a forward with gradients are never served a stale copy."""
    import core.quant as quant

    model = tiny_qwen2()
    apply_qat(model, QuantConfig(enabled=True, group_size=32))
    ids = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        plain = model(ids).logits
    calls = []
    real = quant.fake_quantize
    monkeypatch.setattr(quant, "fake_quantize", lambda *a, **k: calls.append(1) or real(*a, **k))
    n_linears = len(LINEARS)
    with quant.frozen_weights(model), torch.no_grad():
        assert torch.equal(model(ids).logits, plain)
        assert torch.equal(model(ids).logits, plain)
    assert len(calls) == n_linears  # once per Linear for both forwards
    assert all(m._cache is None for m in model.modules() if isinstance(m, FakeQuantLinear))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with quant.frozen_weights(model):
        with torch.no_grad():
            model(ids)
        out = model(ids).logits  # gradients on: the STE path, quantized afresh
        out.sum().backward()
        opt.step()  # bumps every weight's version: the next no-grad forward re-quantizes
        with torch.no_grad():
            after = model(ids).logits
        with torch.no_grad():
            q = model.model.layers[0].self_attn.q_proj
            q.weight.copy_(torch.zeros_like(q.weight))
            zeroed = model(ids).logits
    assert q.weight.grad is not None
    with torch.no_grad():
        assert not torch.equal(after, plain)
        torch.testing.assert_close(zeroed, model(ids).logits, rtol=0, atol=0)
        q.weight.copy_(torch.ones_like(q.weight))
        assert not torch.equal(zeroed, model(ids).logits)


def test_trl_trainer_generation_runs_frozen():
    from trl import GRPOTrainer

    from core.quant import quantize_once_per_generation

    cls = quantize_once_per_generation(GRPOTrainer)
    assert issubclass(cls, GRPOTrainer) and cls.__name__ == "GRPOTrainer"
    assert "_generate_single_turn" in cls.__dict__
    assert quantize_once_per_generation(object) is object
