"""QAT and the vLLM sampler: after `sync_weights(sampler_weights(model))` the engine holds
exactly the trainer's fake-quantized weights (read back out of the engine, fused qkv /
gate_up compared with the concatenated HF parts, bit for bit), so its log-probs match the
QAT trainer's `completion_logprobs` on the same tokens. Plain and LoRA+QAT students.

The session's sampler engine is float32 (conftest.VLLM_TEST_KW); the tiny model's Linear
input dims are 128 and 512, so group sizes 32 and 64 both divide them."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from core.quant import QuantConfig, apply_qat, fake_quantize, quantized_state_dict
from core.models import collate, completion_logprobs, sampler_weights

pytestmark = pytest.mark.vllm

# Same float32 weights in both, different kernels (vLLM's oneDNN GEMMs and paged
# attention vs torch): measured max |delta log p| over all sampled tokens here is 8e-6
# (llm-compressor g64), 1e-6 (kimi g32), 5e-7 (LoRA+QAT), the same order as without QAT
# (tests/unit/core/test_rollout.py). The unquantized trainer against the quantized sampler is
# >= 1e-2 (asserted as a control), so 1e-4 separates "identical weights" from "not".
LOGPROB_TOL = 1e-4
SETTINGS = [("llm-compressor", 64), ("kimi", 32)]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _fuse(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named tensors arranged as vLLM stores them: q|k|v -> qkv_proj, gate|up -> gate_up_proj."""
    out = {}
    for n, t in sd.items():
        if ".self_attn.q_proj." in n:
            out[n.replace("q_proj", "qkv_proj")] = torch.cat(
                [t, sd[n.replace("q_proj", "k_proj")], sd[n.replace("q_proj", "v_proj")]])
        elif ".mlp.gate_proj." in n:
            out[n.replace("gate_proj", "gate_up_proj")] = torch.cat([t, sd[n.replace("gate_proj", "up_proj")]])
        elif not any(k in n for k in (".k_proj.", ".v_proj.", ".up_proj.")):
            out[n] = t.detach()
    return out


def _assert_engine_holds(rollout, expected_hf: dict[str, torch.Tensor]) -> None:
    got, expected = rollout.read_weights(), _fuse(expected_hf)
    assert set(got) == set(expected)
    for n, t in expected.items():
        assert got[n].dtype == t.dtype and got[n].shape == t.shape, n
        assert torch.equal(got[n], t), f"{n}: max |delta| {(got[n] - t).abs().max().item()}"


def _train_through_qat(model, steps: int = 2, lr: float = 0.3, seed: int = 0) -> None:
    """A few SGD steps through the fake-quantized forward: master weights move off the
    checkpoint (and off any grid), as in a real QAT run."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(steps):
        ids = torch.randint(4, 2000, (2, 12), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def _max_gap(model, rollout, prompts, pad_id: int) -> float:
    """max |sampler log p - trainer log p| over every sampled token of `prompts`."""
    samples = rollout.generate(prompts, max_new_tokens=24, seeds=list(range(len(prompts))))
    batch = collate([s.prompt_ids for s in samples], [s.completion_ids for s in samples], pad_id,
                    {"sampler_lp": [s.sampler_logprobs for s in samples]})
    with torch.no_grad():
        trainer_lp = completion_logprobs(model, batch)
    assert batch["mask"].sum() >= len(prompts)
    return ((trainer_lp - batch["sampler_lp"]).abs() * batch["mask"]).max().item()


@pytest.mark.parametrize("convention,group_size", SETTINGS)
def test_qat_sync_is_bit_exact_and_logprobs_match(vllm_rollout, student_hf, tiny_tokenizer, make_prompts,
                                                  convention, group_size):
    model = student_hf
    names = apply_qat(model, QuantConfig(enabled=True, group_size=group_size, convention=convention))
    assert len(names) == 2 * len(LINEARS)
    _train_through_qat(model)
    sd = quantized_state_dict(model)
    q = model.model.layers[0].self_attn.q_proj
    assert torch.equal(sd["model.layers.0.self_attn.q_proj.weight"],
                       fake_quantize(q.weight, group_size, convention))
    assert not torch.equal(sd["model.layers.0.self_attn.q_proj.weight"], q.weight)

    vllm_rollout.sync_weights(sampler_weights(model))
    _assert_engine_holds(vllm_rollout, sd)
    got = vllm_rollout.read_weights()["model.layers.1.mlp.gate_up_proj.weight"]
    groups = got.unflatten(-1, (-1, group_size))
    assert max(len(g.unique()) for g in groups.flatten(0, 1)) <= 16  # an INT4 grid per group

    prompts = make_prompts(8, seed=11)
    gap = _max_gap(model, vllm_rollout, prompts, tiny_tokenizer.pad_token_id)
    print(f"\nQAT {convention} g={group_size}: max |sampler - trainer| log p = {gap:.2e}")
    assert gap < LOGPROB_TOL

    # Control: the same tokens scored by the trainer *without* fake-quant are far off,
    # so the match above is the quantized weights agreeing, not a loose tolerance.
    from core.quant import strip_qat

    strip_qat(model)
    assert _max_gap(model, vllm_rollout, prompts, tiny_tokenizer.pad_token_id) > 100 * LOGPROB_TOL


@pytest.mark.parametrize("convention,group_size", SETTINGS[:1])
def test_lora_qat_student_syncs_merged_then_quantized(vllm_rollout, student_hf, tiny_tokenizer, make_prompts,
                                                     convention, group_size):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(student_hf, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                  target_modules=list(LINEARS)))
    gen = torch.Generator().manual_seed(3)
    for n, p in model.named_parameters():
        if "lora_B" in n:  # B starts at zero: give the adapters a real delta
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    apply_qat(model, QuantConfig(enabled=True, group_size=group_size, convention=convention))
    _train_through_qat(model)  # moves A and B (the base is frozen)

    # The expected sampler weights, written out by hand: W + scaling * B @ A, then quantized.
    expected = {k: v.detach().clone() for k, v in student_hf.state_dict().items()
                if "lora_" not in k}
    expected = {k.replace(".base_layer", ""): v for k, v in expected.items()}
    for name, mod in student_hf.named_modules():  # peft injected its layers in place
        if name.rpartition(".")[2] not in LINEARS:
            continue
        W = mod.base_layer.weight.detach()
        merged = W + mod.scaling["default"] * (mod.lora_B["default"].weight @ mod.lora_A["default"].weight)
        expected[name + ".weight"] = fake_quantize(merged.detach(), group_size, convention)
        # quantizing after merging is not the same as merging after quantizing
        assert not torch.equal(expected[name + ".weight"], fake_quantize(W, group_size, convention))
    sd = quantized_state_dict(model)
    assert set(sd) == set(expected)
    for k in sd:
        assert torch.equal(sd[k], expected[k]), k

    vllm_rollout.sync_weights(sampler_weights(model))
    _assert_engine_holds(vllm_rollout, expected)
    gap = _max_gap(model, vllm_rollout, make_prompts(8, seed=12), tiny_tokenizer.pad_token_id)
    print(f"\nLoRA+QAT {convention} g={group_size}: max |sampler - trainer| log p = {gap:.2e}")
    assert gap < LOGPROB_TOL
    assert isinstance(model.base_model.model.lm_head, nn.Linear)  # lm_head left alone
