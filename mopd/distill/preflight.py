"""Checks of the loop's inputs that need no model loaded: the student folder, each model's
context (its config.json, read without the weights) against the prompt and completion
lengths, the checkpoint folder, the MLflow store. `check_inputs` runs them before any
model is built; the pipeline and the toy run the config-only ones at plan time."""
from __future__ import annotations

import json
import os
from pathlib import Path

from mopd.config import ConfigError
from mopd.hf_dirs import hf_dir_problem
from mopd.distill.config import DistillConfig


def check_model_dir(path: str, key: str = "model.path", *, vllm: bool = False) -> Path:
    """An HF checkpoint folder with config.json and a tokenizer, whose architecture vLLM
    can serve when `vllm` (the sampler is vLLM), or a ConfigError naming `key`, the
    folder and the fix."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{key}: {path!r} does not exist (the student's starting checkpoint, an HF folder)")
    if not p.is_dir():
        raise ConfigError(f"{key}: {path!r} is a file, not an HF checkpoint folder")
    problem = hf_dir_problem(p, vllm=vllm, backend_key="rollout.backend")
    if problem:
        raise ConfigError(f"{key}: {problem}")
    return p


def max_positions(path: str | Path) -> int | None:
    """The model's max_position_embeddings from its config.json (None when not stated)."""
    f = Path(path) / "config.json"
    try:
        c = json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{f}: not a readable JSON config ({e})") from None
    for sec in (c, c.get("text_config") or {}):
        for k in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            if isinstance(sec.get(k), int):
                return sec[k]
    return None


def check_context(cfg: DistillConfig, domains: list[str] | None, model_paths: dict[str, str | Path]) -> None:
    """Prompt plus completion of every row fits rollout.max_model_len (vLLM) and each
    model's positions (`model_paths`: label -> HF folder, e.g. the student and teachers)."""
    try:
        cfg.check_context(domains)
        for label, path in model_paths.items():
            n = max_positions(path)
            if n is not None:
                cfg.check_context(domains, positions=n, model=label)
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(str(e)) from None


def check_checkpoint_dir(out: Path) -> None:
    """OUT/checkpoints, when it exists, is a folder this process can write (else the run
    fails at its first save, after the models loaded and the first steps trained)."""
    ck = out / "checkpoints"
    if ck.exists() and not ck.is_dir():
        raise ConfigError(f"{ck} is a file: checkpoints are saved in that folder; move it away")
    for p in (ck, out):
        if p.exists():
            if not os.access(p, os.W_OK | os.X_OK):
                raise ConfigError(f"{p} is not writable: checkpoints could not be saved")
            break
