"""Tiny local models: a byte-level BPE tokenizer with a chat template (committed under
core/assets/tokenizer) and small Qwen2 configs with head_dim 64.

No model hub is reachable from where this project is developed and tested, so every
model the tests and the toy pipeline use is built here. head_dim is 64 because vLLM's
CPU attention rejects 16.

Rebuild the tokenizer asset with `python -m core.tiny --rebuild-tokenizer` (deterministic).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

ASSETS = Path(__file__).parent / "assets"
TOKENIZER_DIR = ASSETS / "tokenizer"

# Qwen-style ChatML: the assistant turn ends with <|im_end|>, which is also EOS, so a
# sampled completion terminates exactly where the chat template would close the turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
VOCAB_SIZE = 2048


def _corpus(seed: int = 0) -> list[str]:
    """Text the BPE merges are learned from: English-like prose, numbers, code and JSON,
    so every later domain (math, code, tool calls, instructions) tokenizes compactly."""
    rng = random.Random(seed)
    lines: list[str] = []
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ["json/__init__.py", "textwrap.py", "string.py", "heapq.py", "bisect.py",
                 "fractions.py", "statistics.py", "random.py", "csv.py", "calendar.py"]:
        p = stdlib / name
        if p.exists():
            lines.extend(p.read_text(encoding="utf-8", errors="ignore").splitlines())
    words = ("the of and to in is you that it he was for on are as with his they at be this "
             "have from or one had by word but not what all were we when your can said there "
             "use an each which she do how their if will up other about out many then them these "
             "so some her would make like him into time has look two more write go see number no "
             "way could people my than first water been call who oil its now find long down day "
             "did get come made may part apple river stone cloud green light music paper table "
             "window garden silver yellow orange purple doctor animal summer winter planet ocean "
             "answer question reverse list add sum total result please give only final step "
             "function return value string integer float boolean name argument call tool json "
             "sentence paragraph bullet keyword lowercase uppercase words exactly least most "
             "hello help sorry cannot safe unsafe weather city temperature compute python code "
             "def print if else for while true false none import class self").split()
    for _ in range(4000):
        n = rng.randint(3, 14)
        lines.append(" ".join(rng.choice(words) for _ in range(n)).capitalize() + rng.choice(".?!:"))
    for _ in range(3000):
        a, b = rng.randint(0, 9999), rng.randint(0, 9999)
        lines.append(f"{a} + {b} = {a + b}. {a} * {b} = {a * b}. {a} - {b} = {a - b}")
    for _ in range(500):
        lines.append(json.dumps({"name": rng.choice(words), "arguments": {rng.choice(words): rng.randint(0, 99)}}))
    return lines


def build_tokenizer(out_dir: Path = TOKENIZER_DIR, vocab_size: int = VOCAB_SIZE) -> None:

    tok = Tokenizer(models.BPE())
    # Digits are split one per token so arithmetic is learnable by tiny models.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
        bos_token=None, unk_token=None, additional_special_tokens=["<|im_start|>", "<|endoftext|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1024
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))


def load_tokenizer(path: str | os.PathLike | None = None):

    return AutoTokenizer.from_pretrained(str(path or TOKENIZER_DIR))


def tiny_config(vocab_size: int, hidden_size: int = 128, num_layers: int = 2, num_heads: int = 2,
                num_kv_heads: int | None = None, intermediate_size: int | None = None,
                max_position_embeddings: int = 512, eos_token_id: int | None = None,
                pad_token_id: int | None = None):

    head_dim = 64
    if hidden_size != num_heads * head_dim:
        raise ValueError(f"hidden_size {hidden_size} must equal num_heads {num_heads} x head_dim 64 "
                         "(vLLM's CPU attention needs head_dim 64)")
    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads or num_heads,
        head_dim=head_dim, intermediate_size=intermediate_size or 4 * hidden_size,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
        rope_theta=10000.0, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        bos_token_id=None, torch_dtype="float32", use_sliding_window=False,
    )


def build_tiny_model(out_dir: str | os.PathLike, seed: int = 0, **sizes) -> Path:
    """Random-init tiny Qwen2 + the project tokenizer, saved as an HF checkpoint."""

    tok = load_tokenizer()
    vocab = ((len(tok) + 63) // 64) * 64  # pad for kernels that like multiples of 64
    # a larger vocabulary (rows the tokenizer never emits): benches where the lm_head's cost matters
    vocab = max(vocab, int(sizes.pop("vocab_size", 0) or 0))
    cfg = tiny_config(vocab, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **sizes)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    # generation_config holds the EOS so HF generate and vLLM both stop on <|im_end|>.
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rebuild-tokenizer", action="store_true")
    ap.add_argument("--model", help="write a random-init tiny model here")
    args = ap.parse_args()
    if args.rebuild_tokenizer:
        build_tokenizer()
        print(f"tokenizer written to {TOKENIZER_DIR}")
    if args.model:
        print(build_tiny_model(args.model))
