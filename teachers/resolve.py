"""Resolve teacher references and check that a teacher fits the student.

A reference is either a local HF checkpoint directory or an MLflow model URI
(`models:/<name>@<alias>`, `models:/<name>/<version>`, `runs:/<id>/<path>`), looked up in
the run's own store (its `mlflow.tracking_uri`, else $MLFLOW_TRACKING_URI, else the
sqlite store under --out; never ./mlflow.db of the working directory). A version whose
artifacts are on a local disk is used where it lies; one on a server is downloaded once
into the teacher cache ($MOPD_CACHE_DIR/teachers, default ~/.cache/mopd/teachers), one
folder per store, model and version, and reused from there. A teacher must share the student's tokenizer
(same vocabulary, same special tokens) and chat template, or its log-probs would score
different tokens than the student sampled.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import urllib.parse
from dataclasses import dataclass
from pathlib import Path


class TeacherError(ValueError):
    """A teacher that cannot be used; says which domain and which reference."""


MLFLOW_SCHEMES = ("models:/", "runs:/", "mlflow-artifacts:/")


def default_cache_dir() -> Path:
    """Where teachers from a tracking server are downloaded once: $MOPD_CACHE_DIR/teachers,
    default ~/.cache/mopd/teachers."""
    return Path(os.environ.get("MOPD_CACHE_DIR") or Path.home() / ".cache" / "mopd") / "teachers"


def _local_dir(uri: str) -> Path | None:
    """The folder behind a file:// (or plain path) artifact location, if it is one."""
    if uri.startswith("file://"):
        path = Path(urllib.parse.unquote(urllib.parse.urlparse(uri).path))
    elif "://" in uri or uri.startswith(MLFLOW_SCHEMES):
        return None
    else:
        path = Path(uri)
    return path if path.is_dir() else None


def _hf_dir(path: Path) -> Path:
    # A registered model may point at the run's artifact root with the HF files below it.
    if not (path / "config.json").exists() and (path / "model" / "config.json").exists():
        return path / "model"
    return path


def _resolve_mlflow(ref: str, uri: str, cache_dir: Path) -> Path:
    import mlflow

    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
        raise TeacherError(f"cannot resolve {ref!r}: there is no MLflow store at {uri} (set mlflow.tracking_uri "
                           f"to the store the teacher is registered in)")
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    # the concrete thing the reference names now: an alias moves, a version does not
    location, key = None, ref
    if ref.startswith("models:/"):
        name, _, rest = ref[len("models:/"):].partition("/")
        name, _, alias = name.partition("@")
        if alias:
            mv = client.get_model_version_by_alias(name, alias)
        elif rest.isdigit():
            mv = client.get_model_version(name, rest)
        else:
            mv = None   # a stage or "latest": left to MLflow
        if mv is not None:
            key = f"models:/{name}/{mv.version}"
            location = client.get_model_version_download_uri(name, mv.version)
    elif ref.startswith("runs:/"):
        location = ref
    if location and location.startswith("runs:/"):   # a version logged from a run's artifacts
        from mlflow.store.artifact.runs_artifact_repo import RunsArtifactRepository

        location = RunsArtifactRepository.get_underlying_uri(location, tracking_uri=uri)
    local = _local_dir(location) if location else None
    if local is not None:   # a local store: use the files where they are, no copy
        return _hf_dir(local)
    digest = hashlib.sha256(f"{uri}\n{key}".encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", key.split(":/", 1)[1])[:80]
    dest = cache_dir / f"{name}-{digest}"
    if (dest / ".complete").exists():
        return _hf_dir(dest)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".tmp-{dest.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        mlflow.artifacts.download_artifacts(artifact_uri=location or ref, dst_path=str(tmp),
                                            tracking_uri=uri, registry_uri=uri)
        # download_artifacts puts the artifact folder's contents, or a folder named after it, in tmp
        (tmp / ".complete").write_text(ref + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    only = [p for p in dest.iterdir() if p.name != ".complete"]
    if not (dest / "config.json").exists() and len(only) == 1 and only[0].is_dir():
        return _hf_dir(only[0])
    return _hf_dir(dest)


def resolve_ref(ref: str, tracking_uri: str | None = None, cache_dir: str | Path | None = None) -> Path:
    """The local HF folder of a teacher reference. MLflow references are looked up in
    `tracking_uri` (else $MLFLOW_TRACKING_URI; one of them is required: the working
    directory's ./mlflow.db is never used or created) and, when their files are not on
    a local disk, downloaded once into `cache_dir` (default `default_cache_dir()`)."""
    if ref.startswith(MLFLOW_SCHEMES):
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            raise TeacherError(f"cannot resolve {ref!r}: no MLflow store given (set mlflow.tracking_uri, or "
                               f"$MLFLOW_TRACKING_URI)")
        try:
            return _resolve_mlflow(ref, uri, Path(cache_dir) if cache_dir else default_cache_dir())
        except TeacherError:
            raise
        except Exception as e:  # MLflow raises several types; the reference is what matters
            raise TeacherError(f"cannot resolve {ref!r} in the MLflow registry at {uri}: {e}") from None
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
