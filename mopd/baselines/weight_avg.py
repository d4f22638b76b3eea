"""weight_avg: a uniform average of every teacher's parameters (same architecture, same
base), the cheapest way to put several experts into one model; and `export_checkpoint`,
the export both baselines share.

With `quant` enabled the average is exported through the same INT4 fake-quantization
(core.quant) as the student, so every model in the report sits on the same INT4 grid
(the student and the experts were trained with QAT; the baselines are quantized after
training, which is what one would deploy).
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.export import export_model
from core.quant import apply_qat


def export_checkpoint(model, tokenizer, out_dir: str | Path, quant=None) -> Path:
    """Save an HF checkpoint; with `quant` enabled, its fake-quantized (INT4 grid) weights.
    Both baselines export through it, so they sit on the same grid as the student."""
    out_dir = Path(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    if quant is not None and quant.enabled:
        apply_qat(model, quant)
    export_model(model, tokenizer, out_dir)
    return out_dir


def _arch(path: Path) -> dict:
    cfg = json.loads((Path(path) / "config.json").read_text())
    # settings of a run, not of the weights: a TRL-trained expert is saved with use_cache false
    skip = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures_version", "use_cache",
            "output_router_logits"}
    return {k: v for k, v in cfg.items() if k not in skip}


def weight_average(paths: list[str | Path], out_dir: str | Path, *, quant=None) -> dict:
    """Uniform parameter average of HF checkpoints with one architecture -> out_dir."""
    paths = [Path(p) for p in paths]
    if len(paths) < 1:
        raise ValueError("weight_average: no checkpoints given")
    ref = _arch(paths[0])
    for p in paths[1:]:
        a = _arch(p)
        diff = sorted(k for k in set(a) | set(ref) if a.get(k) != ref.get(k))
        if diff:
            raise ValueError(f"weight_average: {p} has another architecture than {paths[0]} "
                             f"(config differs in {diff[:5]})")
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(paths[0]), dtype=torch.float32)
    acc = {k: v.detach().to(torch.float64).clone() for k, v in model.state_dict().items()}
    for p in paths[1:]:
        sd = AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32).state_dict()
        if set(sd) != set(acc) or any(sd[k].shape != acc[k].shape for k in acc):
            raise ValueError(f"weight_average: {p} has other parameter names or shapes than {paths[0]}")
        for k in acc:
            acc[k] += sd[k].to(torch.float64)
    n = len(paths)
    model.load_state_dict({k: (v / n).to(torch.float32) for k, v in acc.items()})
    tok = AutoTokenizer.from_pretrained(str(paths[0]))
    export_checkpoint(model, tok, out_dir, quant)
    return {"checkpoint": str(Path(out_dir).resolve()), "sources": [str(p) for p in paths],
            "seconds": round(time.perf_counter() - t0, 1)}
