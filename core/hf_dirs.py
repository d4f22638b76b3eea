"""Checks of a Hugging Face checkpoint folder that read its files only (no model or
tokenizer built), so a wrong path fails before any model loads, naming the folder and
the fix."""
from __future__ import annotations

import functools
import json
from pathlib import Path


# Any one of these makes a folder's tokenizer loadable (fast JSON, sentencepiece, BPE, WordPiece, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "tokenizer.tiktoken")


def hf_dir_problem(path, *, tokenizer: bool = True, vllm: bool = False, backend_key: str = "") -> str | None:
    """What keeps the folder `path` from being used as a causal-LM checkpoint, with the
    fix, or None: no config.json, no tokenizer files (`tokenizer`), an architecture vLLM
    cannot serve (`vllm`; `backend_key` is the setting that picks the backend, named in
    the fix). Reads files only; no model or tokenizer is built."""
    p = Path(path)
    if not (p / "config.json").is_file():
        return (f"{p} has no config.json, so it is not a Hugging Face checkpoint folder: point it at the "
                f"folder that holds config.json and the weights (what save_pretrained writes)")
    if tokenizer and not any((p / f).is_file() for f in TOKENIZER_FILES):
        return (f"{p} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): copy in the tokenizer of the "
                f"model it was trained from (AutoTokenizer.from_pretrained(<that model>).save_pretrained('{p}'))")
    return vllm_problem(p, backend_key) if vllm else None


class UnservableCheckpoint(ValueError):
    """A checkpoint whose architecture vLLM has no model for (`check_vllm_servable`)."""


# the fix when the caller does not know which setting chose vLLM
ANY_VLLM_BACKEND = "rollout.backend=hf for the sampler, teachers.<key>.backend=hf for a teacher, --backend hf " \
                   "for mopd eval"


def vllm_problem(path, backend_key: str = "") -> str | None:
    """The folder's architecture (config.json `architectures`) is one vLLM cannot serve:
    what and the fix (the hf backend: `backend_key`=hf, or `backend_key` itself when it
    says how), or None. A config with
    auto_map (remote code) is left to vLLM itself. Imports vLLM (only here)."""
    p = Path(path)
    try:
        cfg = json.loads((p / "config.json").read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"{p / 'config.json'} is not readable JSON ({e})"
    archs = cfg.get("architectures") or []
    if not cfg.get("auto_map") and archs and not any(vllm_can_serve(a) for a in archs):
        import vllm

        fix = backend_key if "=" in backend_key else f"{backend_key or 'backend'}=hf"
        return (f"{p} is a {' / '.join(archs)}, which vLLM {vllm.__version__} cannot serve: use the hf "
                f"backend for it ({fix}), or a checkpoint of an architecture vLLM supports")
    return None


def check_vllm_servable(path, backend_key: str = ANY_VLLM_BACKEND) -> None:
    """Before a vLLM engine or server loads the checkpoint folder `path`: an
    UnservableCheckpoint naming the folder, its architecture and the fix when vLLM cannot
    serve it (`vllm_problem`). Anything else (a model name, a folder without config.json)
    is left to vLLM and the other checks."""
    p = Path(path)
    if (p / "config.json").is_file():
        problem = vllm_problem(p, backend_key)
        if problem:
            raise UnservableCheckpoint(problem)


def vllm_can_serve(arch: str) -> bool:
    """vLLM has a model class for `arch`, or can run transformers' own through its
    Transformers backend (what vLLM's registry falls back to for model_impl=auto)."""
    if arch in _vllm_text_generation_archs():   # the common case, without importing vLLM (seconds)
        return True
    import transformers
    from vllm.model_executor.models import ModelRegistry

    if arch in ModelRegistry.get_supported_archs():
        return True
    cls = getattr(transformers, arch, None)
    try:
        return cls is not None and bool(cls.is_backend_compatible() or cls._can_set_attn_implementation())
    except Exception:   # a class without these hooks: not one vLLM's fallback accepts
        return False


@functools.cache
def _vllm_text_generation_archs() -> frozenset[str]:
    """The architectures of the installed vLLM's text-generation table, read from its
    registry's source file (a dry run stays seconds long: importing vLLM takes ~10-25 s
    here). Empty when the file is not where this vLLM keeps it: the caller asks vLLM."""
    import importlib.util
    import re

    try:
        spec = importlib.util.find_spec("vllm")   # finds the package without importing it
        text = (Path(spec.origin).parent / "model_executor" / "models" / "registry.py").read_text(encoding="utf-8")
    except (AttributeError, TypeError, ValueError, OSError):
        return frozenset()
    start = text.find("_TEXT_GENERATION_MODELS = {")
    end = text.find("\n}", start)
    if start < 0 or end < 0:
        return frozenset()
    return frozenset(re.findall(r'^\s+"(\w+)":', text[start:end], flags=re.M))
