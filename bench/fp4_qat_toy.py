"""The toy's numbers for docs/results/2026-12-05-fp4-qat.md: per quant format (int4,
nvfp4, mxfp4; bf16 = no QAT), from MOPD runs of recipes/mopd/toy.yaml already made under
ROOT (see the results page for the commands):

- the sampler/trainer mismatch (history.json's mismatch/*) at step 0 of ROOT/d_<fmt>;
- the fixed point: ROOT/d_<fmt>/final loaded as the next stage's student (QAT on, same
  format) against final/ itself, max |logit difference|;
- QAT against post-training quantization: held-out greedy scores (core.evaluate, the toy
  eval's settings) of ROOT/q_<fmt>/final (trained with QAT) and of ROOT/q_bf16/final
  quantized afterwards with the same format (PTQ).

    PYTHONPATH=$PWD python bench/fp4_qat_toy.py runs     # writes runs/fp4_qat_toy.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import datasets
import torch

from core.evaluate import evaluate
from core.models import build_student
from core.quant import QuantConfig, quantized_state_dict
from core.tiny import load_tokenizer
from core.toy_tasks import DOMAINS, REWARDS, TOY_DEFAULTS

FORMATS = {"int4": {}, "nvfp4": {"format": "nvfp4", "group_size": 16}, "mxfp4": {"format": "mxfp4", "group_size": 32}}


def mismatch(root: Path) -> dict:
    out = {}
    for name in ("bf16", *FORMATS):
        f = root / f"d_{name}" / "history.json"
        if f.exists():
            h0 = json.loads(f.read_text())[0]
            out[name] = {k: v for k, v in h0.items() if k.startswith("mismatch/")}
    return out


@torch.no_grad()
def fixed_point(root: Path) -> dict:
    tok = load_tokenizer(root / "toy" / "base")
    ids = [torch.tensor([tok(t)["input_ids"]]) for t in ("reverse: a b c d e", "rotate: 1 2 3 4 5 6", "hi there")]
    out = {}
    for name, q in FORMATS.items():
        final = root / f"d_{name}" / "final"
        if final.exists():
            plain, nxt = build_student(str(final)), build_student(str(final), quant=QuantConfig(enabled=True, **q))
            out[name] = max((plain(x).logits - nxt(x).logits).abs().max().item() for x in ids)
    return out


def scores(root: Path) -> dict:
    ev = TOY_DEFAULTS["eval"]
    tests = {d: datasets.load_from_disk(str(root / "toy" / "data" / d / "test")) for d in DOMAINS}

    def score(model) -> dict:
        return {d: float(evaluate(model, tests[d], REWARDS[d], max_new_tokens=ev["max_new_tokens"],
                                  batch_size=ev["batch_size"], tokenizer=tok)) for d in DOMAINS}

    tok = load_tokenizer(root / "toy" / "base")
    out = {"bf16": score(str(root / "q_bf16" / "final"))}
    for name, q in FORMATS.items():
        row = {}
        if (root / f"q_{name}" / "final").exists():
            row["qat"] = score(str(root / f"q_{name}" / "final"))
        ptq = build_student(str(root / "q_bf16" / "final"), quant=QuantConfig(enabled=True, **q))
        plain = build_student(str(root / "q_bf16" / "final"))
        plain.load_state_dict(quantized_state_dict(ptq))
        row["ptq"] = score(plain.eval())
        out[name] = row
    return out


def main(root: str = "runs") -> dict:
    root = Path(root)
    res = {"mismatch_step0": mismatch(root), "fixed_point_max_abs_dlogit": fixed_point(root)}
    if (root / "q_bf16" / "final").exists():
        res["scores"] = scores(root)
    (root / "fp4_qat_toy.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main(*sys.argv[1:])
