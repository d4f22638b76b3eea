"""Checks of the loop's inputs that need no model loaded: the student folder, each model's
context (its config.json, read without the weights) against the prompt and completion
lengths, the checkpoint folder, the MLflow store. `check_inputs` runs them before any
model is built; the pipeline and the toy run the config-only ones at plan time."""
from __future__ import annotations

import json
import os
from pathlib import Path

from core.config import ConfigError
from mopd.distill.config import DistillConfig
from core.hf_dirs import hf_dir_problem
from teachers.resolve import MLFLOW_SCHEMES


def check_paths(cfg: DistillConfig) -> None:
    """Every local path the recipe names that does not exist (the student, each dataset,
    each teacher and adapter), all in one ConfigError, so that a user fixes them in one go
    rather than one run per path; then the student's folder itself (check_model_dir).
    MLflow URIs are looked up later, in the run's store."""
    missing = missing_paths(cfg)
    if missing:
        raise ConfigError(f"{len(missing)} path(s) the recipe names do not exist:\n"
                          + "\n".join(f"  {m}" for m in missing))
    check_model_dir(cfg.model.path, vllm=cfg.rollout.backend == "vllm")


def missing_paths(cfg: DistillConfig) -> list[str]:
    """One line per local path the recipe names that does not exist (MLflow URIs aside)."""
    missing = []

    def want(key: str, path: str, what: str):
        if path and not path.startswith(MLFLOW_SCHEMES) and not Path(path).expanduser().exists():
            missing.append(f"{key}: {path!r} does not exist ({what})")
    want("model.path", cfg.model.path, "the student's starting checkpoint, an HF folder")
    for i, spec in enumerate(cfg.data.datasets):
        want(f"data.datasets[{i}].path", spec.path, "a dataset")
    for key, spec in sorted(cfg.teachers.items()):
        want(f"teachers.{key}.path", spec.path, "a teacher checkpoint")
        want(f"teachers.{key}.adapter", spec.adapter, "a teacher's LoRA adapter")
    return missing


def check_quant_shapes(cfg: DistillConfig) -> None:
    """With QAT on, every Linear it would quantize has an input dim that quant.group_size
    (an FP4 format's block) divides: checked on the student's config.json, built on the
    meta device (no weights), with apply_qat's own check, before any model loads."""
    if not cfg.quant.enabled or not (Path(cfg.model.path) / "config.json").exists():
        return
    import torch
    from transformers import AutoConfig

    from core.quant import apply_qat
    from core.vision import model_class

    with torch.device("meta"):
        config = AutoConfig.from_pretrained(cfg.model.path)
        model = model_class(config).from_config(config)
    try:
        apply_qat(model, cfg.quant)
    except ValueError as e:
        raise ConfigError(f"quant ({cfg.quant.format}) on model.path {cfg.model.path!r}: {e}") from None


def check_model_dir(path: str, key: str = "model.path", *, vllm: bool = False) -> Path:
    """An HF checkpoint folder with config.json and a tokenizer, whose architecture vLLM
    can serve when `vllm` (the sampler is vLLM), or a ConfigError naming `key`, the
    folder and the fix."""
    p = Path(path)
    if path.startswith(MLFLOW_SCHEMES):   # the loop loads model.path as a folder; teachers are resolved
        raise ConfigError(f"{key}: {path!r} is an MLflow reference; the student's starting checkpoint must be a "
                          f"local HF folder (mlflow artifacts download -u {path} -d DIR, then model.path=DIR)")
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


def _config_json(path: str | Path) -> dict:
    f = Path(path) / "config.json"
    try:
        c = json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{f}: not a readable JSON config ({e})") from None
    return {**(c.get("text_config") or {}), **c}


def check_tokenizer(tokenizer, path: str | Path, key: str = "model.path") -> None:
    """The special tokens the loop needs, and a vocabulary the loss can use, checked from
    the files before any model loads (a missing one used to fail in the first update,
    after every model had loaded, sampled and been scored):

    - an EOS id (the tokenizer's, or the checkpoint's generation_config / config): samples
      end on it. A pad token is not needed: batches pad with any id and take their masks
      from lengths (Llama 3's tokenizer has none).
    - the student's vocab_size at least len(tokenizer): a token the tokenizer produces must
      have a row in the student's output layer. A larger vocab_size (a padded vocabulary) is
      fine: the divergences are taken over the first len(tokenizer) ids."""
    cfg = _config_json(path)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        gen = Path(path) / "generation_config.json"
        try:
            eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id") if gen.is_file() else None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{gen}: not a readable JSON config ({e})") from None
        eos = eos if eos is not None else cfg.get("eos_token_id")
    if eos is None or eos == []:
        raise ConfigError(f"{key}: {str(path)!r} has no EOS token (not in its tokenizer, generation_config.json or "
                          f"config.json): samples could never end. Set eos_token in its tokenizer_config.json")
    n_tok, vocab = len(tokenizer), cfg.get("vocab_size")
    if isinstance(vocab, int) and vocab < n_tok:
        raise ConfigError(f"{key}: {str(path)!r} has vocab_size {vocab}, below its tokenizer's {n_tok} tokens: "
                          f"the tokens {vocab}..{n_tok - 1} have no row in the model's output layer")
