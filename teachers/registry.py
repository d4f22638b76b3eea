"""The teachers a team has registered: `mopd teachers list`.

An expert run registers its checkpoint in the MLflow model registry as
`<domain>-expert` (or `<domain>-<effort>-expert`) with the alias `teacher`; the MOPD
recipes then point at `models:/<name>@teacher`. This lists those entries, where each
comes from, and whether it fits a student (tokenizer, chat template, vocabulary). An
expert trained with `model.keep_adapter` is registered as its LoRA adapter with the
version tags `base` (the base model reference) and `adapter`; its entry shows the base.
"""
from __future__ import annotations

from dataclasses import dataclass


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


def parse_name(name: str) -> tuple[str, str | None]:
    """`math-low-expert` -> ("math", "low"); `code-expert` -> ("code", None)."""
    stem = name[: -len("-expert")]
    if "-" in stem:
        domain, effort = stem.rsplit("-", 1)
        return domain, effort
    return stem, None


def list_teachers(student: str | None = None, alias: str = "teacher") -> list[TeacherEntry]:
    import mlflow

    from teachers.resolve import TeacherError, check_fit, resolve_ref, resolve_teacher

    client = mlflow.MlflowClient()
    tok = None
    if student:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(resolve_ref(student, tracking_uri=mlflow.get_tracking_uri(), what="--student checkpoint")))
    entries = []
    for rm in client.search_registered_models():
        if not rm.name.endswith("-expert"):
            continue
        domain, effort = parse_name(rm.name)
        try:
            mv = client.get_model_version_by_alias(rm.name, alias)
        except Exception:
            entries.append(TeacherEntry(rm.name, domain, effort, None, f"models:/{rm.name}@{alias}", "-",
                                        None, f"ERROR: no @{alias} alias"))
            continue
        fit = "-"
        if tok is not None:
            try:
                # a LoRA expert: its base is what the student must fit (the adapter is checked on it)
                f = check_fit(tok, resolve_teacher(f"models:/{rm.name}@{alias}",
                                                   tracking_uri=mlflow.get_tracking_uri()))
                fit = "ok" if f.ok else "MISMATCH: " + "; ".join(f.problems)
            except TeacherError as e:
                fit = f"ERROR: {e}"
        entries.append(TeacherEntry(rm.name, domain, effort, mv.version, f"models:/{rm.name}@{alias}",
                                    mv.source, mv.run_id, fit, (mv.tags or {}).get("base")))
    return sorted(entries, key=lambda e: (e.domain, e.effort or ""))
