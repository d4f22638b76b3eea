"""What the real-family stand-ins showed about the core: the sampler's weights carry the
checkpoint's names (transformers 5 fuses an MoE's experts in memory; vLLM loads the
saved, per-expert layout), and HF sampling works on an MoE whose config asks for router
logits (as TRL saves it)."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.models import sampler_weights
from core.quant import QuantConfig, apply_qat
from core.rollout import HFRollout


@pytest.mark.parametrize("family", ["qwen3", "llama3", "qwen3-moe"])
def test_sampler_weights_have_the_checkpoint_layout(standins, family):
    model = AutoModelForCausalLM.from_pretrained(str(standins[family]), dtype=torch.float32)
    apply_qat(model, QuantConfig(enabled=True, group_size=32))
    got = dict(sampler_weights(model))
    with safe_open(str(standins[family] / "model.safetensors"), framework="pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert {k: tuple(v.shape) for k, v in got.items()} == saved


def test_hf_sampling_on_moe_with_router_logits_on(standins):
    path = standins["qwen3-moe"]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.config.output_router_logits = True          # what TRL's trainers leave in the config
    tok = AutoTokenizer.from_pretrained(str(path))
    prompts = [tok(t)["input_ids"] for t in ("hello there", "a longer prompt than the other one")]
    out = HFRollout(model, tok).generate(prompts, max_new_tokens=4, temperature=1.0, seeds=[0, 1])
    assert all(1 <= len(s.completion_ids) <= 4 and all(lp <= 0 for lp in s.sampler_logprobs) for s in out)


def test_export_of_an_moe_lists_router_and_experts_as_unquantized(standins, tmp_path):
    """transformers 5's MoE router and fused experts are not nn.Linear (QAT leaves them
    alone): the INT4 export keeps them bf16 and names them, by checkpoint module name, in
    the config's ignore list, which vLLM reads to build them unquantized."""
    import json

    from core.export import export

    export(standins["qwen3-moe"], tmp_path / "int4", group_size=32, progress=False)
    ignore = json.loads((tmp_path / "int4" / "config.json").read_text())["quantization_config"]["ignore"]
    assert {"lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.experts.3.down_proj"} <= set(ignore)
    with safe_open(str(tmp_path / "int4" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.experts.0.gate_proj.weight").dtype == torch.bfloat16
    assert "model.layers.0.self_attn.q_proj.weight_packed" in keys        # the attention is INT4
