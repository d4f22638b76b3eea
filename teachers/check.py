"""One teacher of a recipe resolved and checked against the student, from files (and a
server teacher's /tokenize) alone: what `teachers.routing.resolve_teachers` does per key
before a run loads any model, and what `mopd distill --dry-run` calls per key, so every
bad teacher is named at once. Light on purpose: no torch model code is imported."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from core.hf_dirs import hf_dir_problem
from teachers.resolve import TeacherError, check_fit, resolve_teacher


def resolve_teacher_key(key: str, spec: Any, tokenizer, student: str, tracking_uri: str | None = None,
                        cache_dir: str | Path | None = None) -> Path | None:
    """One teacher of `resolve_teachers`: its local folder (None for a server teacher with
    no path), resolved and checked (tokenizer fit, a LoRA adapter on its base, an
    architecture vLLM serves for backend vllm); a TeacherError naming `key` otherwise.
    `tokenizer` None: resolved and checked without the tokenizer fit (the student's did not load).
    `mopd distill --dry-run` calls it per key, so every bad teacher is named at once."""
    if getattr(spec, "backend", "hf") == "server" and tokenizer is not None:
        from teachers.server import from_spec

        t = from_spec(key, spec)
        try:
            t.check_tokenizer(tokenizer)
        finally:
            t.close()
    if getattr(spec, "backend", "hf") == "server" and not spec.path:
        return None
    try:
        server = getattr(spec, "backend", "hf") == "server"
        path = resolve_teacher(spec.path, "" if server else getattr(spec, "adapter", ""),
                               tracking_uri=tracking_uri, cache_dir=cache_dir)
        if server and path.adapter is not None:
            raise TeacherError(f"{spec.path!r} is a LoRA adapter; a server teacher's path must be a full "
                               f"model (the server loads the adapter itself)")
        if getattr(spec, "top_k", 0) and path.adapter is not None:
            raise TeacherError(f"{spec.path!r} is a LoRA adapter, whose vllm scoring returns sampled-token "
                               f"log-probs only, so top_k={spec.top_k} cannot apply: merge the adapter into "
                               f"its base (teachers.lora.merge_adapter) or use backend hf")
    except TeacherError as e:
        raise TeacherError(f"teacher for {key!r}: {e}") from None
    fit = check_fit(tokenizer, path) if tokenizer is not None else None
    if fit is not None and not fit.ok:
        raise TeacherError(f"teacher for {key!r} ({spec.path}) does not fit the student "
                           f"{student}: " + "; ".join(fit.problems))
    missing = hf_dir_problem(path) if fit is None else None   # the folder part of check_fit
    if missing:
        raise TeacherError(f"teacher for {key!r}: {missing}")
    if getattr(spec, "backend", "hf") == "vllm":
        unservable = hf_dir_problem(path, tokenizer=False, vllm=True, backend_key=f"teachers.{key}.backend")
        if unservable:
            raise TeacherError(f"teacher for {key!r} ({spec.path}): {unservable}")
    return path
