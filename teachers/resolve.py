"""Resolve teacher references and check that a teacher fits the student.

A reference is either a local HF checkpoint directory or an MLflow model URI
(`models:/<name>@<alias>`, `models:/<name>/<version>`, `runs:/<id>/<path>`), downloaded
once into the local MLflow artifact cache. A teacher must share the student's tokenizer
(same vocabulary, same special tokens) and chat template, or its log-probs would score
different tokens than the student sampled.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class TeacherError(ValueError):
    """A teacher that cannot be used; says which domain and which reference."""


def resolve_ref(ref: str) -> Path:
    if ref.startswith(("models:/", "runs:/", "mlflow-artifacts:/")):
        import mlflow

        try:
            local = mlflow.artifacts.download_artifacts(artifact_uri=ref)
        except Exception as e:  # MLflow raises several types; the reference is what matters
            raise TeacherError(f"cannot resolve {ref!r} in the MLflow registry at "
                               f"{mlflow.get_tracking_uri()}: {e}") from None
        path = Path(local)
        # A registered model may point at the run's artifact root with the HF files below it.
        if not (path / "config.json").exists() and (path / "model" / "config.json").exists():
            path = path / "model"
        return path
    path = Path(ref).expanduser()
    if not path.exists():
        raise TeacherError(f"teacher checkpoint {ref!r} does not exist")
    if not (path / "config.json").exists():
        raise TeacherError(f"teacher checkpoint {ref!r} has no config.json (not an HF model directory)")
    return path


@dataclass
class Fit:
    ok: bool
    problems: list[str]


def check_fit(student_tokenizer, teacher_path: str | Path) -> Fit:
    """Compare tokenizer vocabulary, special tokens and chat template with the student's."""
    # transformers here: `mopd` imports this module at start-up for TeacherError
    from transformers import AutoConfig, AutoTokenizer

    problems: list[str] = []
    try:
        t_tok = AutoTokenizer.from_pretrained(str(teacher_path))
    except Exception as e:
        return Fit(False, [f"cannot load its tokenizer: {e}"])
    s_vocab, t_vocab = student_tokenizer.get_vocab(), t_tok.get_vocab()
    if s_vocab != t_vocab:
        diff = len(set(s_vocab.items()) ^ set(t_vocab.items()))
        problems.append(f"tokenizer vocabulary differs ({len(t_vocab)} vs student's {len(s_vocab)} "
                        f"tokens, {diff} entries differ)")
    for name in ("eos_token", "pad_token", "bos_token"):
        if getattr(student_tokenizer, name) != getattr(t_tok, name):
            problems.append(f"{name} differs ({getattr(t_tok, name)!r} vs student's "
                            f"{getattr(student_tokenizer, name)!r})")
    if (student_tokenizer.chat_template or "") != (t_tok.chat_template or ""):
        problems.append("chat template differs from the student's")
    try:
        cfg = AutoConfig.from_pretrained(str(teacher_path))
        if getattr(cfg, "vocab_size", len(t_tok)) < len(student_tokenizer):
            problems.append(f"model vocab_size {cfg.vocab_size} is smaller than the tokenizer "
                            f"({len(student_tokenizer)} tokens)")
    except Exception as e:
        problems.append(f"cannot read its config.json: {e}")
    return Fit(not problems, problems)
