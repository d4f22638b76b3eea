"""FP4 W4A16 (quant.format nvfp4 / mxfp4): bit-exact agreement with compressed-tensors,
a mutation of any rounding step caught, the QAT checkpoint a fixed point, one global
scale per fused group, and the bad-input errors (the export: test_export.py)."""
import pytest
import torch
from compressed_tensors.compressors import MXFP4PackedCompressor, NVFP4PackedCompressor
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.quant_args import FP4_E2M1_DATA
from compressed_tensors.quantization.quant_scheme import MXFP4A16, NVFP4A16
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

from core import fp4
from core.quant import QuantConfig, apply_qat, fake_quantize, quantized_state_dict

FORMATS = ["nvfp4", "mxfp4"]
PRESET = {"nvfp4": NVFP4A16, "mxfp4": MXFP4A16}
COMPRESSOR = {"nvfp4": NVFP4PackedCompressor, "mxfp4": MXFP4PackedCompressor}
TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def fp4_weight(fmt: str, dtype, out: int = 12, inp: int = 128, seed: int = 0) -> torch.Tensor:
    """Random weight with exact E2M1 ties (an nvfp4 row whose block scale is 448 / 4096,
    an mxfp4 row whose scale is 2**-4), an all-zero block, negative zeros, tiny and huge
    blocks, one-signed blocks."""
    b = fp4.FP4_BLOCK[fmt]
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(seed)) * 0.05
    e = 448 / 4096 if fmt == "nvfp4" else 2.0 ** -4
    ties = [6.0] + TIES + [-t for t in TIES]
    w[0, :b] = 0.0
    w[0, b:b + len(ties)] = torch.tensor(ties) * e     # block max 6e: A = 6e is the tensor max
    w[0, b + len(ties):2 * b] = 0.0
    w[1, :b] = -0.0
    w[2, :b] *= 1e-6
    w[3, :b] *= 10.0 if fmt == "mxfp4" else 0.1       # nvfp4: keep 6e the tensor max
    w[4, :b] = w[4, :b].abs()
    w[5, :b] = -w[5, :b].abs()
    if fmt == "nvfp4":
        w = w.clamp(-6 * e, 6 * e)
    return w.to(dtype)


def ct_reference(w: torch.Tensor, fmt: str):
    """compressed-tensors' own scales (min-max observer in the weight's dtype; NVFP4's
    global scale from the bf16 tensor max), codes, fake-quantized and decompressed weight."""
    args = PRESET[fmt]["weights"]
    b = fp4.FP4_BLOCK[fmt]
    g = w.unflatten(-1, (w.shape[-1] // b, b))
    gs = None
    if fmt == "nvfp4":
        a = w.abs().amax().to(torch.bfloat16).float()
        gs = generate_gparam(-a.reshape(1), a.reshape(1))
    scales, _ = calculate_qparams(g.amin(-1), g.amax(-1), args, global_scale=gs)
    codes = ct_quantize(w, scales.to(w.dtype), None, args, global_scale=gs)
    fq = ct_fake_quantize(w, scales.to(w.dtype), None, args, global_scale=gs)
    scheme = QuantizationScheme(targets=["Linear"], **PRESET[fmt])
    state = {"weight": w, "weight_scale": scales.to(w.dtype)}
    if gs is not None:
        state["weight_global_scale"] = gs
    dec = COMPRESSOR[fmt].decompress(COMPRESSOR[fmt].compress(state, scheme), scheme)["weight"]
    return scales, gs, codes, fq, dec


def agrees_with_ct(w: torch.Tensor, fmt: str) -> bool:
    """Every output of core.fp4 equals compressed-tensors' (torch.equal)."""
    scales, gs, codes, fq, dec = ct_reference(w, fmt)
    mine_codes, mine_scales, mine_gs = fp4.quantize(w, fmt)
    mine_fq = fp4.fake_quantize(w, fmt)
    checks = [torch.equal(mine_scales.float(), scales.float()),
              torch.equal(mine_codes.float(), codes.float()),
              torch.equal(fp4.dequantize(mine_codes, mine_scales, mine_gs, fmt), dec),
              torch.equal(mine_fq, fq.to(torch.bfloat16).to(w.dtype)),
              mine_fq.dtype == w.dtype]
    if fmt == "nvfp4":
        checks.append(torch.equal(mine_gs, gs))
    return all(checks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_matches_compressed_tensors(fmt, dtype):
    w = fp4_weight(fmt, dtype)
    assert agrees_with_ct(w, fmt)
    codes, scales, gs = fp4.quantize(w, fmt)
    assert codes.shape == w.shape and scales.shape == (w.shape[0], w.shape[1] // fp4.FP4_BLOCK[fmt])
    # the tie row lands on the ties, so a changed tie rule shows (test_a_changed_rounding_step_is_caught)
    e = 448 / 4096 if fmt == "nvfp4" else 2.0 ** -4
    b = fp4.FP4_BLOCK[fmt]
    assert torch.equal((w[0, b:b + 15].float() / e), torch.tensor([6.0] + TIES + [-t for t in TIES]))
    assert codes[0, b:b + 15].tolist() == [6, 0, 1, 1, 2, 2, 4, 4, -0, -1, -1, -2, -2, -4, -4]
    if fmt == "nvfp4":
        assert gs.dtype == torch.float32 and gs.shape == (1,) and scales[0, 1].item() == 448.0
    else:
        assert gs is None and torch.all(torch.log2(scales.float()) == torch.log2(scales.float()).round())


def test_e2m1_rounding_is_cast_to_fp4():
    x = torch.cat([torch.linspace(-8, 8, 1601), torch.tensor(TIES) + 0, -torch.tensor(TIES)])
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        assert torch.equal(fp4.round_e2m1(xd), FP4_E2M1_DATA.cast_to_fp4(torch.clamp(xd, -6, 6)))


MUTATIONS = {
    # E2M1 ties away from zero instead of to even
    "e2m1 ties": ("round_e2m1", lambda orig: lambda x: torch.sign(x) * torch.where(
        torch.isin(torch.clamp(x, -6, 6).abs(), torch.tensor(TIES, dtype=x.dtype)),
        orig(torch.clamp(x, -6, 6).abs() * (1 + 2 ** -6)), orig(x).abs())),
    # MXFP4: power of two rounded down (floor) instead of up from a mantissa of 1.75
    "mx power of two": ("_round_to_power_2", lambda orig: lambda x: 2.0 ** torch.floor(
        torch.log2(x.float())).to(x.dtype)),
    # NVFP4: the tensor max not rounded to bf16
    "nvfp4 tensor max": ("group_amax", lambda orig: lambda ws: torch.stack(
        [w.detach().abs().amax().float() for w in ws]).amax()),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_a_changed_rounding_step_is_caught(name, monkeypatch):
    """The bit-exactness check fails when one rounding step is changed."""
    attr, mutate = MUTATIONS[name]
    fmt = "nvfp4" if attr == "group_amax" else "mxfp4" if attr == "_round_to_power_2" else None
    cases = [(f, torch.float32) for f in ([fmt] if fmt else FORMATS)]
    w = {f: fp4_weight(f, d) for f, d in cases}
    if attr == "group_amax":   # an fp32 tensor max off the bf16 grid
        w["nvfp4"][0, 16] = 6 * 448 / 4096 * (1 + 2 ** -12)
    if attr == "_round_to_power_2":
        w["mxfp4"][7, :32] = 0.01 * 1.8  # a block max with mantissa 1.8
    for f, _ in cases:
        assert agrees_with_ct(w[f], f)
    monkeypatch.setattr(fp4, attr, mutate(getattr(fp4, attr)))
    for f, _ in cases:
        assert not agrees_with_ct(w[f], f), f"{name}: {f} still agrees"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_requantizing_is_a_fixed_point(fmt, dtype):
    """Re-quantizing a fake-quantized weight gives the same codes, scales and values (fp32
    masters too: NVFP4's tensor max in bf16 is what makes that so, see the mutation)."""
    for seed in range(3):
        w = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed)).to(dtype) * 0.02
        w[3, 5] = 0.31   # an outlier sets NVFP4's global scale
        q1 = fp4.quantize(w, fmt)
        w1 = fp4.fake_quantize(w, fmt)
        q2 = fp4.quantize(w1, fmt)
        assert all(torch.equal(a, b) for a, b in zip(q1, q2) if a is not None)
        assert torch.equal(fp4.fake_quantize(w1, fmt), w1)


def test_fp32_tensor_max_would_break_the_fixed_point(monkeypatch):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    w[3, 5] = 0.3101   # not a bf16 value
    w1 = fp4.fake_quantize(w, "nvfp4")
    assert torch.equal(fp4.fake_quantize(w1, "nvfp4"), w1)
    monkeypatch.setattr(fp4, "group_amax", MUTATIONS["nvfp4 tensor max"][1](None))
    w1 = fp4.fake_quantize(w, "nvfp4")
    assert not torch.equal(fp4.fake_quantize(w1, "nvfp4"), w1)


@pytest.fixture(scope="module")
def tiny_qwen():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False)
    m = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        m.model.layers[0].self_attn.k_proj.weight[0, 0] = 0.5  # k_proj holds the group max
    return m


@pytest.mark.parametrize("fmt", FORMATS)
def test_qat_model_sampler_weights_and_next_stage_fixed_point(tiny_qwen, fmt):
    """The trainer's forward uses exactly quantized_state_dict's weights (what the sampler
    and the checkpoint get), NVFP4's q/k/v and gate/up share one global scale, and a model
    started from those weights with QAT on moves no logit."""
    import copy
    model = copy.deepcopy(tiny_qwen)
    cfg = QuantConfig(enabled=True, format=fmt, group_size=fp4.FP4_BLOCK[fmt])
    names = apply_qat(model, cfg)
    assert "lm_head" not in names and len(names) == 14
    ids = torch.arange(20).reshape(2, 10)
    sd = quantized_state_dict(model)
    plain = copy.deepcopy(tiny_qwen)
    plain.load_state_dict(sd)
    with torch.no_grad():
        logits = model(ids).logits
        assert torch.equal(logits, plain(ids).logits)
    attn = tiny_qwen.model.layers[0].self_attn
    if fmt == "nvfp4":
        gss = {p: fp4.quantize(attn.get_submodule(p).weight, fmt,
                               fp4.group_amax(attn.get_submodule(x).weight for x in ("q_proj", "k_proj", "v_proj")))[2]
               for p in ("q_proj", "k_proj", "v_proj")}
        assert gss["q_proj"] == gss["k_proj"] == gss["v_proj"]
        own = fp4.fake_quantize(attn.q_proj.weight, fmt)   # without the shared scale: other values
        assert not torch.equal(sd["model.layers.0.self_attn.q_proj.weight"], own)
    nxt = copy.deepcopy(tiny_qwen)
    nxt.load_state_dict(sd)
    apply_qat(nxt, cfg)
    with torch.no_grad():
        assert torch.equal(nxt(ids).logits, logits)
    assert all(torch.equal(v, sd[k]) for k, v in quantized_state_dict(nxt).items())
    # a gradient flows straight through to the master weights
    model.train()
    model(ids).logits.sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_bad_settings_name_the_setting_and_the_fix():
    with pytest.raises(ValueError, match=r"quant.format='fp8'.*int4.*nvfp4.*mxfp4"):
        QuantConfig(format="fp8")
    with pytest.raises(ValueError, match=r"quant.group_size=128: nvfp4 has one scale per 16.*quant.group_size: 16"):
        QuantConfig(enabled=True, format="nvfp4")
    with pytest.raises(ValueError, match=r"quant.group_size=16: mxfp4 .* per 32.*quant.group_size: 32"):
        QuantConfig(enabled=True, format="mxfp4", group_size=16)
    with pytest.raises(ValueError, match=r"quant.convention='kimi' is an int4 grid"):
        QuantConfig(format="mxfp4", group_size=32, convention="kimi")
    with pytest.raises(ValueError, match=r"input dim 40 is not a multiple of the mxfp4 block \(32\)"):
        fake_quantize(torch.zeros(4, 40), 32, "mxfp4")
    from torch import nn
    m = nn.Sequential(nn.Linear(48, 8), nn.Linear(8, 4))
    with pytest.raises(ValueError, match=r"^1: .*input dim 8 is not a multiple of the nvfp4 block \(16\).*quant.ignore"):
        apply_qat(m, QuantConfig(enabled=True, format="nvfp4", group_size=16))
    assert isinstance(m[0], nn.Linear)  # nothing changed


# ------------------------------------------------------------------ export (mopd export --quant nvfp4|mxfp4)


def _qat_final(src, dst, fmt: str):
    """A QAT run's final/ (core.export.export_model: the fake-quantized weights) after a few
    SGD steps, and the trainer's quantized_state_dict."""
    from core.export import export_model
    from core.models import build_student
    from core.tiny import load_tokenizer

    model = build_student(str(src), quant=QuantConfig(enabled=True, format=fmt, group_size=fp4.FP4_BLOCK[fmt]))
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    export_model(model, load_tokenizer(src), dst)
    return dst, quantized_state_dict(model)


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_writes_the_trainer_weights(tiny_student_dir, tmp_path, fmt):
    """`mopd export --quant FMT` of a QAT run's final/ and of master weights: a
    compressed-tensors FMT-pack-quantized checkpoint that decompresses (compressed-tensors'
    compressor) to exactly the trainer's weights in bf16, whose config vLLM maps to its
    FP4 scheme; fused projections share NVFP4's global scale (vLLM uses one per layer)."""
    import json

    from safetensors.torch import load_file
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig)

    from core.export import export, load_compressed_decompressed, main

    final, trainer_sd = _qat_final(tiny_student_dir, tmp_path / "final", fmt)
    assert main(["--quant", fmt, str(final), str(tmp_path / "out")]) == 0
    dec = load_compressed_decompressed(tmp_path / "out")
    targets = [k for k in trainer_sd if k.endswith("proj.weight")]
    assert len(targets) == 14
    for k in targets:
        assert torch.equal(dec[k], trainer_sd[k].to(torch.bfloat16)), k
    # the master weights of the same model export the same checkpoint bytes' values
    s = export(tiny_student_dir, tmp_path / "master", quant=fmt, progress=False)
    assert s.group_size == fp4.FP4_BLOCK[fmt] and len(s.quantized) == 14
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == f"{fmt}-pack-quantized" and qc["ignore"] == ["lm_head"]
    cfg = CompressedTensorsConfig.from_config(qc)
    args = cfg.target_scheme_map["Linear"]["weights"]
    assert cfg.target_scheme_map["Linear"]["input_activations"] is None  # A16
    assert (cfg._is_nvfp4_format(args), cfg._is_mxfp4(args)) == (fmt == "nvfp4", fmt == "mxfp4")
    packed = load_file(str(tmp_path / "out" / "model.safetensors"))
    if fmt == "nvfp4":
        for layer in range(2):
            pre = f"model.layers.{layer}."
            for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                          ("mlp.gate_proj", "mlp.up_proj")):
                gss = [packed[pre + g + ".weight_global_scale"] for g in group]
                assert all(torch.equal(g, gss[0]) for g in gss)
        assert packed["model.layers.0.self_attn.q_proj.weight_scale"].dtype == torch.float8_e4m3fn
    else:
        assert packed["model.layers.0.self_attn.q_proj.weight_scale"].dtype == torch.uint8
        assert not any(k.endswith("global_scale") for k in packed)


def test_export_bad_options_are_refused_before_anything_is_written(tiny_student_dir, tmp_path, capsys):
    from core.export import main

    cases = [(["--quant", "fp8"], "--quant 'fp8' is not supported; supported: int4, nvfp4, mxfp4"),
             (["--quant", "nvfp4", "--group-size", "128"], "--group-size 128: nvfp4 has one scale per 16 weights; "
              "leave --group-size out"),
             (["--quant", "mxfp4", "--convention", "kimi"], "--convention 'kimi' is an int4 grid")]
    for args, msg in cases:
        assert main([*args, str(tiny_student_dir), str(tmp_path / "o")]) != 0
        assert msg in capsys.readouterr().err
        assert not (tmp_path / "o").exists()


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_cpu_refuses_packed_fp4_and_serves_its_dequantized_copy(tiny_student_dir, tmp_path, make_prompts,
                                                                    reference_logprobs):
    """vllm-cpu 0.32 has no NVFP4 W4A16 kernel (its only one, Marlin FP4, is CUDA): the
    packed checkpoint is refused with that reason; its compressed-tensors decompression
    (core.export.dequantized_checkpoint) serves the trainer's weights. The packed file on a
    GPU: scripts/gpu_check.sh."""
    from transformers import AutoModelForCausalLM

    from core.export import dequantized_checkpoint, export
    from teachers.scoring import VLLMTeacher

    final, trainer_sd = _qat_final(tiny_student_dir, tmp_path / "final", "nvfp4")
    export(final, tmp_path / "nvfp4", quant="nvfp4", progress=False)
    with pytest.raises(Exception, match="Marlin FP4 not available"):
        VLLMTeacher(str(tmp_path / "nvfp4"), dtype="bfloat16", enforce_eager=True, max_model_len=128,
                    kv_cache_gb=0.25)
    plain = dequantized_checkpoint(tmp_path / "nvfp4", tmp_path / "plain")
    fq16 = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.bfloat16).eval()
    assert all(torch.equal(fq16.state_dict()[k], v.to(torch.bfloat16)) for k, v in trainer_sd.items())
    base16 = AutoModelForCausalLM.from_pretrained(str(tiny_student_dir), dtype=torch.bfloat16).eval()
    prompts, comps = make_prompts(8, seed=5), make_prompts(8, seed=6, min_len=8, max_len=16)
    teacher = VLLMTeacher(str(plain), dtype="bfloat16", enforce_eager=True, max_model_len=128, kv_cache_gb=0.25)
    try:
        got = torch.cat(teacher.score(prompts, comps))
    finally:
        teacher.close()
    d_q, d_base = ((got - torch.cat([reference_logprobs(m, p, c) for p, c in zip(prompts, comps)])).abs().mean().item()
                   for m in (fq16, base16))
    print(f"\nvLLM on the NVFP4 export (dequantized) vs the trainer's weights: {d_q:.2e}; vs the start: {d_base:.2e}")
    assert d_q < 0.2 * d_base


def test_bad_format_settings_fail_at_config_load_and_shapes_before_the_model_loads(tiny_student_dir, tmp_path):
    """What `mopd distill` checks before any weight is read: the recipe's quant section
    (load_config) and, from config.json alone, the block against every quantized Linear
    (check_inputs -> check_quant_shapes)."""
    import json
    import shutil
    from pathlib import Path

    from core.config import ConfigError, load_config
    from mopd.distill.config import DistillConfig
    from mopd.distill.preflight import check_quant_shapes

    toy = Path(__file__).resolve().parents[3] / "recipes/mopd/toy.yaml"
    with pytest.raises(ConfigError, match=r"quant.format='nvfp8'"):
        load_config(DistillConfig, toy, ["quant.enabled=true", "quant.format=nvfp8"])
    with pytest.raises(ConfigError, match=r"quant.group_size=128: mxfp4 has one scale per 32.*quant.group_size: 32"):
        load_config(DistillConfig, toy, ["quant.enabled=true", "quant.format=mxfp4"])
    bad = tmp_path / "bad"
    shutil.copytree(tiny_student_dir, bad)
    (bad / "model.safetensors").write_bytes(b"not weights: the check must not read them")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 136   # down_proj's input: not a multiple of 16
    (bad / "config.json").write_text(json.dumps(cfg))
    c = load_config(DistillConfig, toy, ["quant.enabled=true", "quant.format=nvfp4", "quant.group_size=16",
                                         f"model.path={bad}"])
    with pytest.raises(ConfigError, match=r"quant \(nvfp4\) on model.path .*mlp.down_proj: .*input dim 136 is not a "
                       r"multiple of the nvfp4 block \(16\); add it to quant.ignore or use quant.format: int4"):
        check_quant_shapes(c)
    check_quant_shapes(load_config(DistillConfig, toy, ["quant.enabled=true", "quant.format=nvfp4",
                                                        "quant.group_size=16", f"model.path={tiny_student_dir}"]))
