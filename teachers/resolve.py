"""Resolve teacher references and check that a teacher fits the student.

A reference is either a local HF checkpoint directory or an MLflow model URI
(`models:/<name>@<alias>`, `models:/<name>/<version>`, `runs:/<id>/<path>`), looked up in
the run's own store (its `mlflow.tracking_uri`, else $MLFLOW_TRACKING_URI, else the
sqlite store under --out; never ./mlflow.db of the working directory). A version whose
artifacts are on a local disk is used where it lies; one on a server is downloaded once
into the teacher cache ($MOPD_CACHE_DIR/teachers, default ~/.cache/mopd/teachers), one
folder per store, model and version, and reused from there. A teacher must share the student's tokenizer
(same vocabulary, same special tokens) and chat template, or its log-probs would score
different tokens than the student sampled. A LoRA teacher (a peft adapter folder on a
base) is checked against its base from the files alone (`check_adapter`), before any
model or engine starts; `teachers.lora` serves it.
"""
from __future__ import annotations

import hashlib
import json
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


def _is_model_dir(path: Path) -> bool:
    """An HF checkpoint or a peft adapter folder (a LoRA expert registers the adapter)."""
    return (path / "config.json").exists() or (path / "adapter_config.json").exists()


def _hf_dir(path: Path) -> Path:
    # A registered model may point at the run's artifact root with the HF files below it.
    if not _is_model_dir(path) and _is_model_dir(path / "model"):
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
        mv = _version(client, ref, name, alias, rest, uri)
        if mv is not None:
            key = f"models:/{name}/{mv.version}"
            location = client.get_model_version_download_uri(name, mv.version)
    elif ref.startswith("runs:/"):
        location = ref
    if location and location.startswith("runs:/"):   # a version logged from a run's artifacts
        location = _run_artifacts(client, location, uri)
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
    if not _is_model_dir(dest) and len(only) == 1 and only[0].is_dir():
        return _hf_dir(only[0])
    return _hf_dir(dest)


def _version(client, ref: str, name: str, alias: str, version: str, uri: str):
    """The model version `ref` names (None for a stage or "latest": left to MLflow); a name,
    alias or version the registry lacks is an error listing what it has."""
    from mlflow.exceptions import MlflowException

    try:
        if alias:
            return client.get_model_version_by_alias(name, alias)
        return client.get_model_version(name, version) if version.isdigit() else None
    except MlflowException as e:
        if "RESOURCE_DOES_NOT_EXIST" not in str(e.error_code) and "INVALID_PARAMETER_VALUE" not in str(e.error_code):
            raise
    try:
        client.get_registered_model(name)
        what = f"no alias @{alias} of {name!r}" if alias else f"no version {version} of {name!r}"
    except MlflowException:
        what = f"no model named {name!r}"
    raise TeacherError(f"cannot resolve {ref!r}: the registry at {uri} has {what}; {registry_contents(client)}") \
        from None


def registry_contents(client) -> str:
    """"registered: math-expert (@teacher -> v2; versions 1, 2), ..." for an error message."""
    try:
        models = client.search_registered_models(max_results=200)
    except Exception as e:  # noqa: BLE001 - the listing only helps the message
        return f"(its models could not be listed: {e})"
    if not models:
        return "nothing is registered there"
    parts = []
    for rm in sorted(models, key=lambda m: m.name):
        aliases = ", ".join(f"@{a} -> v{v}" for a, v in sorted((rm.aliases or {}).items())) or "no aliases"
        versions = sorted(int(v.version) for v in client.search_model_versions(f"name='{rm.name}'"))
        parts.append(f"{rm.name} ({aliases}; versions {', '.join(map(str, versions)) or 'none'})")
    return "registered: " + "; ".join(parts)


def _run_artifacts(client, runs_uri: str, uri: str) -> str:
    """Where the files behind runs:/<run>/<path> are: the run's own artifacts (a model
    logged as plain files), else the model of that name logged with an MLflow flavor
    (MLflow 3 keeps those under the experiment's models/, not the run's artifacts)."""
    from mlflow.store.artifact.runs_artifact_repo import RunsArtifactRepository

    plain = RunsArtifactRepository.get_underlying_uri(runs_uri, tracking_uri=uri)
    if _local_dir(plain) is not None:
        return plain
    found = logged_model(client, *RunsArtifactRepository.parse_runs_uri(runs_uri))
    return found.artifact_location if found else plain


def logged_model(client, run_id: str, name: str = "model"):
    """The model called `name` logged with an MLflow flavor by run `run_id` (the newest),
    or None (a run from before models were logged that way keeps plain artifacts)."""
    try:
        exp = client.get_run(run_id).info.experiment_id
        found = [m for m in client.search_logged_models(experiment_ids=[exp], filter_string=f"name = '{name}'")
                 if m.source_run_id == run_id]
    except Exception:  # noqa: BLE001 - a store without logged models
        return None
    return max(found, key=lambda m: m.creation_timestamp) if found else None


def resolve_ref(ref: str, tracking_uri: str | None = None, cache_dir: str | Path | None = None,
                adapter: bool = False, what: str = "teacher checkpoint") -> Path:
    """The local HF folder of a teacher reference. MLflow references are looked up in
    `tracking_uri` (else $MLFLOW_TRACKING_URI; one of them is required: the working
    directory's ./mlflow.db is never used or created) and, when their files are not on
    a local disk, downloaded once into `cache_dir` (default `default_cache_dir()`).
    `adapter`: a local folder may also be a peft LoRA adapter (adapter_config.json).
    `what` names the role in errors ("teacher checkpoint", "--models student: checkpoint"):
    a student or an evaluated model is not a teacher."""
    if ref.startswith(MLFLOW_SCHEMES):
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            raise TeacherError(f"cannot resolve {ref!r}: no MLflow store given (set mlflow.tracking_uri, or "
                               f"$MLFLOW_TRACKING_URI)")
        from core.tracking import StoreMissing, check_store

        try:   # a server that does not answer: said in seconds (StoreUnreachable), not after MLflow's retries
            check_store(uri, create=False)
        except StoreMissing as e:
            raise TeacherError(f"cannot resolve {ref!r}: {e}") from None
        try:
            return _resolve_mlflow(ref, uri, Path(cache_dir) if cache_dir else default_cache_dir())
        except TeacherError:
            raise
        except Exception as e:  # MLflow raises several types; the reference is what matters
            raise TeacherError(f"cannot resolve {ref!r} in the MLflow registry at {uri}: {e}") from None
    path = Path(ref).expanduser()
    if not path.exists():
        raise TeacherError(f"{what} {ref!r} does not exist")
    if adapter and (path / "adapter_config.json").exists():
        return path
    if not (path / "config.json").exists():
        lacks = "config.json or adapter_config.json (neither an HF model nor a peft adapter directory)" \
            if adapter else "config.json (not an HF model directory)"
        raise TeacherError(f"{what} {ref!r} has no {lacks}: point it at the folder that holds config.json and "
                           f"the weights (what save_pretrained writes)")
    return path


class TeacherPath(type(Path())):
    """A teacher's local base folder; `.adapter` is its LoRA adapter folder, or None."""
    adapter: Path | None = None


def registered_tags(ref: str, tracking_uri: str | None) -> dict[str, str]:
    """The model-version tags behind a models:/<name>@alias or models:/<name>/<version>
    reference ({} for any other reference). A LoRA expert's version carries `base` (the
    base model reference) and `adapter` ("true")."""
    if not ref.startswith("models:/"):
        return {}
    import mlflow

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    name, _, rest = ref[len("models:/"):].partition("/")
    name, _, alias = name.partition("@")
    try:
        mv = client.get_model_version_by_alias(name, alias) if alias else \
            client.get_model_version(name, rest) if rest.isdigit() else None
    except Exception as e:  # the reference resolved already; a failure here is the store's
        raise TeacherError(f"cannot read the registry tags of {ref!r}: {e}") from None
    return dict(mv.tags) if mv is not None else {}


# config.json fields that fix the shapes a LoRA adapter was trained against
_SHAPE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size")


def is_adapter_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / "adapter_config.json").exists() and not (p / "config.json").exists()


def adapter_config(path: str | Path) -> dict:
    f = Path(path) / "adapter_config.json"
    if not f.exists():
        raise TeacherError(f"LoRA adapter {str(path)!r} has no adapter_config.json (not a peft adapter folder)")
    cfg = json.loads(f.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise TeacherError(f"adapter {str(path)!r} is a {cfg.get('peft_type')} adapter; only LoRA is supported")
    return cfg


def _safetensors_shapes(folder: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from the safetensors headers of a folder (no tensor is read)."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                shapes[k] = list(st.get_slice(k).get_shape())
    return shapes


def _base_key(lora_key: str) -> tuple[str, str]:
    """'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' ->
    ('model.layers.0.self_attn.q_proj.weight', 'A')."""
    k = lora_key.removeprefix("base_model.model.")
    for ab in ("A", "B"):
        tag = f".lora_{ab}."
        if tag in k:
            return k.split(tag)[0] + ".weight", ab
    return "", ""


def check_adapter(base: str | Path, adapter: str | Path) -> dict:
    """Check that the LoRA adapter folder `adapter` was trained on a model shaped like
    `base`: the base config it names (when that folder exists here) has the same shape
    fields, and every lora_A [r, in] / lora_B [out, r] matches the base weight [out, in]
    it adapts. Returns the adapter's config; a TeacherError saying what differs."""
    base, adapter = Path(base), Path(adapter)
    cfg = adapter_config(adapter)
    base_cfg = json.loads((base / "config.json").read_text())
    named = cfg.get("base_model_name_or_path") or ""
    if named and (Path(named) / "config.json").exists():
        other = json.loads((Path(named) / "config.json").read_text())
        diff = [f"{k}: {other.get(k)} vs {base_cfg.get(k)}" for k in _SHAPE_KEYS if other.get(k) != base_cfg.get(k)]
        if diff:
            raise TeacherError(f"adapter {str(adapter)!r} was trained on {named}, whose config differs from the "
                               f"base {str(base)!r}: " + "; ".join(diff))
    a_shapes, b_shapes = _safetensors_shapes(adapter), _safetensors_shapes(base)
    if not a_shapes:
        raise TeacherError(f"adapter {str(adapter)!r} has no .safetensors weights")
    if not b_shapes:
        raise TeacherError(f"base {str(base)!r} has no .safetensors weights to check the adapter against")
    bad = []
    for k, shape in a_shapes.items():
        wk, ab = _base_key(k)
        if not wk:
            continue
        w = b_shapes.get(wk)
        if w is None:
            bad.append(f"{wk} (adapted by {k}) is not in the base")
        elif (ab == "A" and shape[1] != w[1]) or (ab == "B" and shape[0] != w[0]):
            bad.append(f"{k} {shape} does not fit {wk} {w}")
    if bad:
        raise TeacherError(f"adapter {str(adapter)!r} does not fit the base {str(base)!r}: " + "; ".join(bad[:4])
                           + (f" (+{len(bad) - 4} more)" if len(bad) > 4 else ""))
    return cfg


def resolve_teacher(path: str, adapter: str = "", tracking_uri: str | None = None,
                    cache_dir: str | Path | None = None) -> TeacherPath:
    """A teacher's base folder, with `.adapter` set when it is a LoRA teacher: `adapter`
    given (a folder or models:/ URI on the base `path`), or `path` resolving to an adapter
    folder (a registered LoRA expert), whose base is its registry tag `base`, else the
    adapter's own base_model_name_or_path. The adapter is checked against the base."""
    if adapter:
        base = resolve_ref(path, tracking_uri=tracking_uri, cache_dir=cache_dir, adapter=True)
        if is_adapter_dir(base):
            raise TeacherError(f"path {path!r} is a LoRA adapter folder; with `adapter` set, path must be the "
                               f"full base model")
        ad = resolve_ref(adapter, tracking_uri=tracking_uri, cache_dir=cache_dir, adapter=True)
        if not is_adapter_dir(ad):
            raise TeacherError(f"adapter {adapter!r} is not a peft LoRA adapter folder (no adapter_config.json)")
    else:
        first = resolve_ref(path, tracking_uri=tracking_uri, cache_dir=cache_dir, adapter=True)
        if not is_adapter_dir(first):
            return TeacherPath(first)
        ad = first
        base_ref = registered_tags(path, tracking_uri).get("base") or \
            adapter_config(ad).get("base_model_name_or_path") or ""
        if not base_ref:
            raise TeacherError(f"{path!r} is a LoRA adapter with no recorded base: set the teacher's path to "
                               f"the base and adapter to {path!r}")
        try:
            base = resolve_ref(base_ref, tracking_uri=tracking_uri, cache_dir=cache_dir)
        except TeacherError as e:
            raise TeacherError(f"{path!r} is a LoRA adapter on the base {base_ref!r}, which cannot be used: {e}") \
                from None
    check_adapter(base, ad)
    out = TeacherPath(base)
    out.adapter = ad
    return out


@dataclass
class Fit:
    ok: bool
    problems: list[str]


def check_fit(student_tokenizer, teacher_path: str | Path) -> Fit:
    """Compare the teacher's tokenizer with the student's: the token of every id, the
    special tokens, the chat template. Configs are not compared: a teacher may differ in
    size, architecture and padded vocabulary rows, as long as its embedding covers the
    tokenizer. Each problem names the first id or template line that differs."""
    # transformers here: `mopd` imports this module at start-up for TeacherError
    from transformers import AutoTokenizer

    from core.hf_dirs import hf_dir_problem

    missing = hf_dir_problem(teacher_path)
    if missing:
        return Fit(False, [missing])
    try:
        t_tok = AutoTokenizer.from_pretrained(str(teacher_path))
    except Exception as e:
        return Fit(False, [f"cannot load its tokenizer from {teacher_path}: {e}"])
    problems = tokenizer_problems(student_tokenizer, t_tok)
    try:
        cfg = json.loads((Path(teacher_path) / "config.json").read_text(encoding="utf-8"))
        rows = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
        if isinstance(rows, int) and rows < len(student_tokenizer):
            problems.append(f"its embedding has {rows} rows (config.json vocab_size), fewer than the "
                            f"{len(student_tokenizer)} tokens of the tokenizer")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        problems.append(f"cannot read its config.json: {e}")
    return Fit(not problems, problems)


def tokenizer_problems(student_tokenizer, teacher_tokenizer) -> list[str]:
    """What differs between two loaded tokenizers (vocabulary ids, special tokens, chat
    template), each naming the first id or template line; [] when they fit."""
    return [p for p in (_vocab_difference(student_tokenizer, teacher_tokenizer),
                        _special_difference(student_tokenizer, teacher_tokenizer),
                        _template_difference(student_tokenizer.chat_template, teacher_tokenizer.chat_template)) if p]


def _vocab_difference(s_tok, t_tok) -> str | None:
    """The first token id whose string differs, or that only one tokenizer has."""
    s_vocab, t_vocab = s_tok.get_vocab(), t_tok.get_vocab()
    if s_vocab == t_vocab:
        return None
    s_by_id = {i: t for t, i in s_vocab.items()}
    t_by_id = {i: t for t, i in t_vocab.items()}
    first = min(i for i in s_by_id.keys() | t_by_id.keys() if s_by_id.get(i) != t_by_id.get(i))
    sv, tv = s_by_id.get(first), t_by_id.get(first)
    return (f"tokenizer vocabulary differs ({len(t_vocab)} tokens vs the student's {len(s_vocab)}): first at "
            f"token id {first}, {'absent' if sv is None else repr(sv)} in the student's tokenizer and "
            f"{'absent' if tv is None else repr(tv)} in the teacher's")


def _special_difference(s_tok, t_tok) -> str | None:
    """The first special-token role (eos, pad, bos, unk) or extra special token that differs."""
    for name in ("eos_token", "pad_token", "bos_token", "unk_token"):
        s, t = getattr(s_tok, name, None), getattr(t_tok, name, None)
        if s != t:
            return f"{name} differs: {t!r} in the teacher's tokenizer, {s!r} in the student's"
    s_all, t_all = set(s_tok.all_special_tokens), set(t_tok.all_special_tokens)
    if s_all != t_all:
        only = sorted(s_all - t_all)[:1] or sorted(t_all - s_all)[:1]
        side = "the student's" if only[0] in s_all else "the teacher's"
        return f"special tokens differ: {only[0]!r} is special only in {side} tokenizer"
    return None


def _template_difference(s_tpl, t_tpl) -> str | None:
    """The first line of the chat template that differs (named templates compared by name)."""
    def named(tpl):
        if isinstance(tpl, dict):
            return tpl
        if isinstance(tpl, list):   # [{"name": ..., "template": ...}], as some tokenizer_config.json store them
            return {d.get("name"): d.get("template") for d in tpl}
        return {"default": tpl or ""}
    s_n, t_n = named(s_tpl), named(t_tpl)
    for name in sorted(s_n.keys() | t_n.keys(), key=str):
        s, t = s_n.get(name) or "", t_n.get(name) or ""
        if s == t:
            continue
        label = "chat template" if name == "default" else f"chat template {name!r}"
        s_lines, t_lines = s.splitlines(), t.splitlines()
        for n in range(max(len(s_lines), len(t_lines))):
            sl = s_lines[n] if n < len(s_lines) else None
            tl = t_lines[n] if n < len(t_lines) else None
            if sl != tl:
                col = next((c for c, (a, b) in enumerate(zip(sl or "", tl or "")) if a != b),
                           min(len(sl or ""), len(tl or "")))
                return (f"{label} differs from the student's at line {n + 1}, column {col + 1}: teacher "
                        f"{_around(tl, col)}, student {_around(sl, col)}")
        return f"{label} differs from the student's (in line endings)"
    return None


def _around(line: str | None, col: int, width: int = 60) -> str:
    """`line` near column `col`, short enough for an error message."""
    if line is None:
        return "(no such line)"
    start = max(0, col - width // 3)
    return ("..." if start else "") + repr(line[start:start + width]) + ("..." if start + width < len(line) else "")
