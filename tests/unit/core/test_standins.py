"""The real-family stand-ins (core/standins.py): each loads as its family's class, with
its family's tokens and template, and the capacity-gap pair shares one tokenizer."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.standins import build_standin, num_parameters

CLASSES = {"qwen3": "Qwen3ForCausalLM", "qwen3-teacher": "Qwen3ForCausalLM", "llama3": "LlamaForCausalLM",
           "qwen3-moe": "Qwen3MoeForCausalLM"}


@pytest.mark.parametrize("family", sorted(CLASSES))
def test_standin_loads_as_its_family(standins, family):
    path = standins[family]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert type(model).__name__ == CLASSES[family]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["head_dim"] == 64 and cfg["num_hidden_layers"] == 2 and 64 <= cfg["hidden_size"] <= 128
    tok = AutoTokenizer.from_pretrained(str(path))
    assert cfg["vocab_size"] >= len(tok)
    ids = tok.apply_chat_template([{"role": "user", "content": "1 + 2"}], add_generation_prompt=True,
                                  return_dict=True)["input_ids"]
    logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg["vocab_size"]) and torch.isfinite(logits).all()


def test_family_tokens_and_templates(standins):
    q = AutoTokenizer.from_pretrained(str(standins["qwen3"]))
    text = q.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True,
                                 enable_thinking=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert q.eos_token == "<|im_end|>" and q.pad_token == "<|endoftext|>" and q.bos_token is None
    assert q.convert_ids_to_tokens(q("<think>x</think>")["input_ids"])[::2] == ["<think>", "</think>"]

    ll = AutoTokenizer.from_pretrained(str(standins["llama3"]))
    text = ll.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ll.pad_token is None and ll.eos_token == "<|eot_id|>"      # as Llama 3 ships
    assert ll("x")["input_ids"][0] == ll.bos_token_id                  # BOS prepended on encode
    gen = json.loads((standins["llama3"] / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [ll.convert_tokens_to_ids("<|end_of_text|>"), ll.eos_token_id]


def test_capacity_gap_pair_shares_one_tokenizer(standins):
    s, t = standins["qwen3"], standins["qwen3-teacher"]
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (s / f).read_bytes() == (t / f).read_bytes(), f
    assert 4 <= num_parameters(t) / num_parameters(s) <= 8
    assert (s / "tokenizer.json").read_bytes() != (standins["llama3"] / "tokenizer.json").read_bytes()


def test_build_is_deterministic(standins, tmp_path):
    again = build_standin("qwen3", tmp_path / "q", seed=0)
    for f in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
        assert (again / f).read_bytes() == (standins["qwen3"] / f).read_bytes(), f
