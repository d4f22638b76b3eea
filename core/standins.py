"""Tiny random-init stand-ins of real model families, built from their transformers
config classes, each with a tokenizer in its family's format.

The project's own tiny Qwen2 (core/tiny.py) shares one tokenizer with every model, so it
cannot show what breaks on a real checkpoint: Qwen3's q/k norms and think tags, Llama 3's
header tokens and missing pad token, an MoE's router. These stand-ins keep the family's
architecture class, special tokens, chat template and generation_config, and shrink
everything else (2 layers, hidden 64-128, head_dim 64 because vLLM's CPU attention
rejects 16).

Families (`FAMILIES`):
  qwen3          Qwen3ForCausalLM; ChatML with <think></think>, EOS <|im_end|>, pad <|endoftext|>
  qwen3-teacher  the same tokenizer, ~5x the parameters of `qwen3` (the capacity-gap pair)
  llama3         LlamaForCausalLM; <|begin_of_text|>, header tokens, <|eot_id|>, no pad token
  qwen3-moe      Qwen3MoeForCausalLM (4 experts, 2 active); the qwen3 tokenizer
  qwen2.5-vl     Qwen2_5_VLForConditionalGeneration (vision-language: a 1-block vision
                 tower, 2 text layers); Qwen2.5-VL's tokens (<|vision_start|> <|image_pad|>
                 <|vision_end|> ...) and a chat template whose image items render as them,
                 saved with Qwen2.5-VL's image processor (preprocessor_config.json: patch 14,
                 merge 2, max_pixels VL_MAX_PIXELS); core.vision.load_processor reads it
  qwen2.5-vl-teacher  the same tokenizer and processor, ~5x the text parameters

Every tokenizer is the project's byte-level BPE (core/assets/tokenizer) without its own
special tokens, re-indexed from 0, with the family's special tokens appended after the
BPE vocabulary, as the real families lay them out. So qwen3, qwen3-teacher and qwen3-moe
have identical tokenizers and llama3's differs from the first id on. Deterministic.

    python -m core.standins --out DIR [--family qwen3 --family llama3 ...]

writes DIR/<family>/ for each family (all by default).
"""
from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch

from core.tiny import TOKENIZER_DIR

HEAD_DIM = 64

# Qwen3's template, shortened: ChatML turns, the reasoning of earlier assistant turns
# dropped, tool results as <tool_response> user turns, and the empty think block that
# `enable_thinking=False` adds to the generation prompt.
QWEN3_CHAT_TEMPLATE = """\
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'system' or message.role == 'user' %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- if not loop.last and '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# Meta-Llama-3-8B-Instruct's template, verbatim.
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Qwen2.5-VL-Instruct's template, shortened as QWEN3_CHAT_TEMPLATE is: a message's content is
# a string or a list of items, an image item renders as the vision tokens (the processor
# then repeats <|image_pad|> once per merged patch of that image).
QWEN25VL_CHAT_TEMPLATE = """\
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' }}
    {%- if message.content is string %}
        {{- message.content }}
    {%- else %}
        {%- for item in message.content %}
            {%- if item.type == 'image' or 'image' in item %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif item.type == 'text' %}
                {{- item.text }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# (content, special) in the order the real tokenizers number them after the BPE vocabulary.
QWEN3_TOKENS = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
                ("<tool_call>", False), ("</tool_call>", False), ("<tool_response>", False),
                ("</tool_response>", False), ("<think>", False), ("</think>", False)]
QWEN25VL_TOKENS = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
                   ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
                   ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
                   ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
                   ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False)]
# The stand-in's image budget (pixels): the frontend renderer's screenshot (800x320) fits.
VL_MAX_PIXELS = 800 * 320
VL_MIN_PIXELS = 28 * 28 * 4
LLAMA3_TOKENS = [(t, True) for t in (
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>", "<|reserved_special_token_3|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|reserved_special_token_4|>", "<|eot_id|>")]


def _bpe_without_specials() -> dict:
    """The project tokenizer's JSON with its added (special) tokens removed and the BPE
    vocabulary re-numbered from 0."""
    d = json.loads((TOKENIZER_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    special = {t["content"] for t in d["added_tokens"]}
    kept = sorted((i, t) for t, i in d["model"]["vocab"].items() if t not in special)
    d["model"]["vocab"] = {t: n for n, (_, t) in enumerate(kept)}
    d["added_tokens"] = []
    return d


def _family_tokenizer(kind: str):
    """A PreTrainedTokenizerFast in the format of `kind` ("qwen3" or "llama3")."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    d = _bpe_without_specials()
    n = len(d["model"]["vocab"])
    tokens = list({"qwen3": QWEN3_TOKENS, "qwen2.5-vl": QWEN25VL_TOKENS}.get(kind, LLAMA3_TOKENS))
    if kind == "llama3":
        # Llama 3 reserves special tokens up to its embedding size (128256 = len(tokenizer)).
        k = 5
        while (n + len(tokens)) % 64:
            tokens.append((f"<|reserved_special_token_{k}|>", True))
            k += 1
    d["added_tokens"] = [{"id": n + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": s} for i, (t, s) in enumerate(tokens)]
    tok = Tokenizer.from_str(json.dumps(d))
    if kind in ("qwen3", "qwen2.5-vl"):
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                       bos_token=None, unk_token=None)
        fast.chat_template = QWEN3_CHAT_TEMPLATE if kind == "qwen3" else QWEN25VL_CHAT_TEMPLATE
        fast.model_max_length = 131072
    else:
        # Llama 3 prepends <|begin_of_text|> to every encoding and ships no pad token.
        bos = n
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
            special_tokens=[("<|begin_of_text|>", bos)])
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                       unk_token=None)
        fast.chat_template = LLAMA3_CHAT_TEMPLATE
        fast.model_max_length = 131072
    return fast


def _round64(n: int) -> int:
    return (n + 63) // 64 * 64


def _config(family: str, tok):
    """The family's transformers config, sized small."""
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=_round64(len(tok)), head_dim=HEAD_DIM, num_hidden_layers=2,
                  max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=False,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, torch_dtype="float32")
    if family == "qwen3":
        return Qwen3Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=192,
                           pad_token_id=None, **common)
    if family == "qwen3-teacher":
        return Qwen3Config(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=1536,
                           pad_token_id=None, **common)
    if family == "qwen3-moe":
        return Qwen3MoeConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=192,
                              moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                              mlp_only_layers=[], norm_topk_prob=True, pad_token_id=None, **common)
    if family == "llama3":
        return LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=192,
                           pad_token_id=None, **common)
    if family in ("qwen2.5-vl", "qwen2.5-vl-teacher"):
        return _vl_config(family, tok, common)
    raise ValueError(f"unknown stand-in family {family!r}; one of {sorted(FAMILIES)}")


def _vl_config(family: str, tok, common: dict):
    """Qwen2.5-VL sized small: the real patch (14), merge (2) and temporal patch (2), so the
    processor's image -> token count is the real one; one vision block."""
    from transformers import Qwen2_5_VLConfig

    big = family.endswith("-teacher")
    hidden = 128 if big else 64
    text = {k: v for k, v in common.items() if k not in ("head_dim", "rope_theta", "tie_word_embeddings")}
    # mrope splits head_dim/2 rotary pairs into (temporal, height, width) sections
    text.update(hidden_size=hidden, num_attention_heads=hidden // HEAD_DIM, num_key_value_heads=1,
                intermediate_size=1536 if big else 192, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[0])
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                                                      "<|vision_end|>")}
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                            video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                            vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)


def _vl_image_processor():
    """Qwen2.5-VL's image processor (patch 14, merge 2, the stand-in's pixel budget). The PIL
    one: the torch one and Qwen2_5_VLProcessor itself need torchvision (its video
    processor), which the project does not install; `core.vision.load_processor` pairs this
    with the tokenizer and expands the image pads as Qwen2_5_VLProcessor does."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=VL_MIN_PIXELS, max_pixels=VL_MAX_PIXELS, patch_size=14,
                                    merge_size=2, temporal_patch_size=2)


# family -> tokenizer format
FAMILIES = {"qwen3": "qwen3", "qwen3-teacher": "qwen3", "llama3": "llama3", "qwen3-moe": "qwen3",
            "qwen2.5-vl": "qwen2.5-vl", "qwen2.5-vl-teacher": "qwen2.5-vl"}
VL_FAMILIES = ("qwen2.5-vl", "qwen2.5-vl-teacher")


def build_standin(family: str, out_dir: str | os.PathLike, *, seed: int = 0) -> Path:
    """Write a random-init `family` checkpoint (config.json, model.safetensors,
    generation_config.json, tokenizer files with the chat template) to `out_dir`."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown stand-in family {family!r}; one of {sorted(FAMILIES)}")
    tok = _family_tokenizer(FAMILIES[family])
    cfg = _config(family, tok)
    torch.manual_seed(seed)
    if family in VL_FAMILIES:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if FAMILIES[family] == "llama3":
        # as Llama 3 Instruct ships: generation stops at either end token
        eos = [tok.convert_tokens_to_ids("<|end_of_text|>"), tok.eos_token_id]
        model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=eos)
    else:
        model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    if family in VL_FAMILIES:
        _vl_image_processor().save_pretrained(str(out))   # preprocessor_config.json
    return out


def num_parameters(path: str | os.PathLike) -> int:
    """Parameters stored in a checkpoint's model.safetensors (no model built)."""
    from safetensors import safe_open

    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m core.standins", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="write OUT/<family>/ for each family")
    ap.add_argument("--family", action="append", choices=sorted(FAMILIES),
                    help="a family to build (repeatable; default: all)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for fam in args.family or list(FAMILIES):
        path = build_standin(fam, Path(args.out) / fam, seed=args.seed)
        print(f"{fam}: {path} ({num_parameters(path):,} parameters)")


if __name__ == "__main__":
    main()
