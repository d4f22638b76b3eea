"""The teachers a team has registered: `mopd teachers list`.

An expert run registers its checkpoint in the MLflow model registry as
`<domain>-expert` (or `<domain>-<effort>-expert`) with the alias `teacher`; the MOPD
recipes then point at `models:/<name>@teacher`. This lists those entries, where each
comes from, and whether it fits a student (tokenizer, chat template, vocabulary). An
expert trained with `model.keep_adapter` is registered as its LoRA adapter with the
version tags `base` (the base model reference) and `adapter`; its entry shows the base.
"""
from __future__ import annotations

import getpass
import json
import os
from dataclasses import dataclass
from pathlib import Path

TEACHER_ALIAS = "teacher"
STUDENT_ALIAS = "student"


@dataclass
class TeacherEntry:
    name: str                      # registered model name
    domain: str
    effort: str | None
    version: str | None            # the version the `teacher` alias points at
    uri: str                       # models:/<name>@teacher
    source: str                    # where the version's files come from (run artifacts)
    run_id: str | None
    fit: str                       # "ok", "MISMATCH: ...", "ERROR: ...", or "-" (no student given)
    base: str | None = None        # a LoRA expert: the base its adapter (the version's files) is on
    kind: str = "teacher"          # or "student" (a `<name>-student` registered by mopd distill)
    tags: dict | None = None       # the version's tags (a student's lineage)


def teacher_name(domain: str, effort: str | None = None) -> str:
    """The registered name of a domain's teacher: `math-expert`, `math-low-expert`."""
    return f"{domain}-{effort}-expert" if effort else f"{domain}-expert"


def parse_name(name: str) -> tuple[str, str | None]:
    """`math-low-expert` -> ("math", "low"); `code-expert` -> ("code", None);
    `toy-student` -> ("toy", None)."""
    stem = name[: -len("-expert")] if name.endswith("-expert") else name.removesuffix("-student")
    if name.endswith("-expert") and "-" in stem:
        domain, effort = stem.rsplit("-", 1)
        return domain, effort
    return stem, None


def _client(uri: str):
    import mlflow

    return mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)


def list_teachers(student: str | None = None, alias: str = TEACHER_ALIAS,
                  tracking_uri: str | None = None) -> list[TeacherEntry]:
    """The `<domain>-expert` teachers (at `alias`) and `<name>-student` students (at
    @student) registered in the store at `tracking_uri` (else $MLFLOW_TRACKING_URI; one is
    required), each checked against the `student` checkpoint's tokenizer when given."""
    from core.tracking import given_store
    from teachers.resolve import TeacherError, check_fit, resolve_ref, resolve_teacher

    uri = given_store(tracking_uri, "mopd teachers list")
    client = _client(uri)
    tok = None
    if student:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(resolve_ref(student, tracking_uri=uri, what="--student checkpoint")))
    entries = []
    for rm in client.search_registered_models(max_results=1000):
        kind = "teacher" if rm.name.endswith("-expert") else "student" if rm.name.endswith("-student") else None
        if kind is None:
            continue
        at = alias if kind == "teacher" else STUDENT_ALIAS
        domain, effort = parse_name(rm.name)
        ref = f"models:/{rm.name}@{at}"
        try:
            mv = client.get_model_version_by_alias(rm.name, at)
        except Exception:
            entries.append(TeacherEntry(rm.name, domain, effort, None, ref, "-", None, f"ERROR: no @{at} alias",
                                        kind=kind))
            continue
        fit = "-"
        if tok is not None:
            try:
                # a LoRA expert: its base is what the student must fit (the adapter is checked on it)
                f = check_fit(tok, resolve_teacher(ref, tracking_uri=uri))
                fit = "ok" if f.ok else "MISMATCH: " + "; ".join(f.problems)
            except TeacherError as e:
                fit = f"ERROR: {e}"
        # the folder or run it came from (`mopd teachers register`, an expert's run), else MLflow's source
        source = (mv.tags or {}).get("source") or mv.source
        entries.append(TeacherEntry(rm.name, domain, effort, str(mv.version), ref, source, mv.run_id, fit,
                                    (mv.tags or {}).get("base"), kind=kind, tags=dict(mv.tags or {})))
    return sorted(entries, key=lambda e: (e.kind != "teacher", e.domain, e.effort or ""))


def register_version(client, name: str, *, source: str, run_id: str | None, model_id: str | None = None,
                     tags: dict[str, str] | None = None, alias: str | None = TEACHER_ALIAS):
    """A new version of registered model `name` (created if new) from `source` (a logged
    model's models:/m-... URI with its `model_id`, or a run's plain-file runs:/ path), with
    `alias` moved to it (None: left where it is). Returns the ModelVersion."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException as e:   # already there: a new version of the same model
        if "RESOURCE_ALREADY_EXISTS" not in str(e.error_code) and "already exists" not in str(e).lower():
            raise
    mv = client.create_model_version(name, source=source, run_id=run_id, model_id=model_id,
                                     tags={k: str(v)[:5000] for k, v in (tags or {}).items()} or None)
    if alias:
        client.set_registered_model_alias(name, alias, mv.version)
    return mv


def _check_loads(path: Path, what: str) -> None:
    """The checkpoint's config and tokenizer load (no weights are read)."""
    from transformers import AutoConfig, AutoTokenizer

    from core.hf_dirs import hf_dir_problem
    from teachers.resolve import TeacherError, is_adapter_dir

    if is_adapter_dir(path):
        raise TeacherError(f"{what} {path} is a LoRA adapter folder: register the merged checkpoint (a LoRA expert "
                           f"trained by `mopd expert` registers itself with its base)")
    problem = hf_dir_problem(path)
    if problem:
        raise TeacherError(f"{what}: {problem}")
    for load in (AutoConfig, AutoTokenizer):
        try:
            load.from_pretrained(str(path))
        except Exception as e:  # noqa: BLE001 - transformers raises many types; the folder is what matters
            raise TeacherError(f"{what} {path}: its {load.__name__[4:].lower()} does not load: "
                               f"{type(e).__name__}: {str(e)[:300]}") from None


def _check_registry_fit(client, uri: str, path: Path, student: str | None, what: str) -> list[str]:
    """The checkpoint's tokenizer against the `student` checkpoint's, else against every
    registered teacher's (and student's): the registry shares one tokenizer. Returns what
    it was checked against; a mismatch is a TeacherError naming the other model."""
    from transformers import AutoTokenizer

    from teachers.resolve import TeacherError, check_fit, resolve_ref, resolve_teacher

    others = {"--student " + student: resolve_ref(student, tracking_uri=uri, what="--student checkpoint")} \
        if student else {}
    if not student:
        for rm in client.search_registered_models(max_results=1000):
            at = TEACHER_ALIAS if rm.name.endswith("-expert") else STUDENT_ALIAS if rm.name.endswith("-student") \
                else None
            if at and at in (rm.aliases or {}):
                others[f"models:/{rm.name}@{at}"] = None
    checked = []
    for ref, local in others.items():
        try:
            local = local or resolve_teacher(ref, tracking_uri=uri)
        except TeacherError as e:   # a broken entry of someone else's is theirs to fix: said, not fatal
            print(f"[mopd] not checked against {ref}: {e}", flush=True)
            continue
        # the new checkpoint in the teacher's place: its tokenizer and its embedding rows are checked
        fit = check_fit(AutoTokenizer.from_pretrained(str(local)), path)
        if not fit.ok:
            raise TeacherError(f"{what} does not fit {ref} (the registry's models share one tokenizer): "
                               + "; ".join(fit.problems))
        checked.append(ref)
    return checked


@dataclass
class Registered:
    name: str
    version: str
    uri: str          # models:/<name>/<version>
    alias: str | None
    checked_against: list[str]
    run_id: str | None
    model_uri: str | None   # the logged model (models:/m-...), or the run's plain files


def register_teacher(domain: str, *, path: str | None = None, run: str | None = None, effort: str | None = None,
                     tracking_uri: str | None = None, score: float | None = None, keep_alias: bool = False,
                     student: str | None = None, experiment: str = "mopd-teachers") -> Registered:
    """`mopd teachers register`: check that the checkpoint (a folder, or run `run`'s `model`)
    loads and fits the registry's tokenizer, then log a new version of `<domain>-expert`
    (`<domain>-<effort>-expert`) with the alias `teacher` (left where it is with
    `keep_alias`) and the tags source, registered_by and eval_score. A folder is first
    logged as an MLflow transformers model in a run of `experiment`."""
    import mlflow

    from core.tracking import StoreMissing, check_store, log_hf_model, start_run
    from teachers.resolve import TeacherError, logged_model, resolve_ref

    if (path is None) == (run is None):
        raise TeacherError("mopd teachers register: give one of --path DIR or --run RUN_ID")
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:   # registering creates a store, so only the one asked for
        raise StoreMissing("mopd teachers register: no MLflow store given: pass --tracking-uri URI (a shared "
                           "server http://HOST:PORT, or sqlite:///PATH/mlflow.db) or set $MLFLOW_TRACKING_URI")
    check_store(uri, create=True)
    name = teacher_name(domain, effort)
    client = _client(uri)
    what = f"teacher {name}"
    if path is not None:
        local = Path(path).expanduser()
        if not local.is_dir():
            raise TeacherError(f"{what}: --path {path} is not a folder")
        source = str(local.resolve())
    else:
        source = f"runs:/{run}/model"
        local = resolve_ref(source, tracking_uri=uri, what=f"{what}: run {run}'s model")
    _check_loads(local, what)
    checked = _check_registry_fit(client, uri, local, student, what)
    tags = {"source": source, "registered_by": getpass.getuser(), "domain": domain, "effort": effort or "",
            **({"eval_score": f"{score:g}"} if score is not None else {})}
    if path is not None:
        mlflow.set_tracking_uri(uri)
        with start_run(experiment=experiment, uri=uri, run_name=f"register-{name}",
                       tags={"stage": "register", "domain": domain, **tags}) as r:
            model_uri = log_hf_model(local)
        if model_uri is None:
            raise TeacherError(f"{what}: the store at {uri} did not take the checkpoint (see above)")
        run_id = r.info.run_id
    else:
        run_id, found = run, logged_model(client, run)
        model_uri = found.model_uri if found else None
    mv = register_version(client, name, source=model_uri or source, run_id=run_id,
                          model_id=model_uri.split("/")[-1] if model_uri else None, tags=tags,
                          alias=None if keep_alias else TEACHER_ALIAS)
    return Registered(name, str(mv.version), f"models:/{name}/{mv.version}", None if keep_alias else TEACHER_ALIAS,
                      checked, run_id, model_uri)


def lineage(teachers: dict, tracking_uri: str | None) -> dict[str, str]:
    """`teacher.<key>` -> what each teacher reference named when the run started: a
    registered model's concrete version (`models:/math-expert/3`, an alias resolved), a
    folder's absolute path, a server's model name and URLs."""
    from teachers.resolve import TeacherError

    out = {}
    for key, spec in sorted(teachers.items()):
        ref = getattr(spec, "path", "") or ""
        if not ref:
            out[f"teacher.{key}"] = f"server {getattr(spec, 'model', '')} @ {','.join(getattr(spec, 'urls', []))}"
            continue
        if ref.startswith("models:/"):
            name, _, rest = ref[len("models:/"):].partition("/")
            name, _, alias = name.partition("@")
            try:
                v = _client(tracking_uri).get_model_version_by_alias(name, alias).version if alias else rest
            except Exception as e:  # noqa: BLE001 - resolved already; a failure here is the store's
                raise TeacherError(f"teacher {key}: cannot read the version behind {ref}: {e}") from None
            out[f"teacher.{key}"] = f"models:/{name}/{v}"
        elif "://" in ref or ref.startswith(("runs:/", "mlflow-artifacts:/")):
            out[f"teacher.{key}"] = ref
        else:
            out[f"teacher.{key}"] = str(Path(ref).expanduser().resolve())
        if getattr(spec, "adapter", ""):
            out[f"teacher.{key}.adapter"] = spec.adapter
    return out


def register_student(name: str, run_id: str, model_uri: str | None, tags: dict[str, str],
                     tracking_uri: str) -> str:
    """Register the run's logged model (else its plain `model` files) as a new version of
    `<name>-student` with alias `student` and the lineage `tags`; returns models:/<n>/<v>."""
    full = name if name.endswith("-student") else f"{name}-student"
    mv = register_version(_client(tracking_uri), full, source=model_uri or f"runs:/{run_id}/model", run_id=run_id,
                          model_id=model_uri.split("/")[-1] if model_uri else None,
                          tags={"registered_by": getpass.getuser(), **tags}, alias=STUDENT_ALIAS)
    return f"models:/{full}/{mv.version}"


def data_mix_tag(datasets, mix: dict) -> str:
    """The data mix as one tag: the prompt files and the per-domain weights."""
    return json.dumps({"datasets": [getattr(d, "path", str(d)) for d in datasets], "mix": mix}, default=str)
