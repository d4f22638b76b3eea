"""`mopd distill --dry-run` (and `mopd teachers validate`): the recipe's inputs checked
from their files, every problem at once, and what would run; no model is loaded, nothing
is written. The student's and teachers' tokenizers are read (the fit check needs them),
so transformers is imported; torch models, vLLM and MLflow are not (MLflow only to look
up a models:/ reference)."""
from __future__ import annotations

from pathlib import Path

from core.dryrun import DryRun, check_accelerate_config, describe_quant
from mopd.distill.config import DistillConfig
from mopd.distill.preflight import (check_checkpoint_dir, check_context, check_model_dir, check_quant_shapes, check_tokenizer,
                                    missing_paths)
from teachers.resolve import MLFLOW_SCHEMES


def dry_run(cfg: DistillConfig, out: str | Path | None, dry: DryRun, *, accelerate_config: str = "") -> dict:
    """Fill `dry` with what `mopd distill --config ... --out out` would run and every problem
    with its inputs; returns {teacher key: local folder} of the teachers that resolved."""
    for m in missing_paths(cfg):
        dry.problem(m)
    uri = _tracking_uri(cfg, out)
    student = _student(cfg, dry)
    tok = _tokenizer(student, dry) if student is not None else None
    dry.show("model", f"{student or cfg.model.path}  [{cfg.model.dtype}, quant {describe_quant(cfg.quant)}, "
             f"sampler {cfg.rollout.backend}]")
    teachers = _teachers(cfg, tok, dry, uri)
    if student is not None:
        models = {"the student (model.path)": student, **{f"teacher {k}": p for k, p in teachers.items() if p}}
        dry.check(check_context, cfg, None, models)
        dry.check(check_quant_shapes, cfg)   # QAT's block divides every quantized Linear (config.json only)
        from mopd.distill.agents import check_vision

        dry.check(check_vision, cfg, teachers)   # images: the HF sampler, in-process vision-language teachers
    world = check_accelerate_config(accelerate_config, dry)
    t = cfg.train
    if t.prompts_per_step % world:
        dry.problem(f"train.prompts_per_step={t.prompts_per_step} is not divisible by the {world} processes "
                    f"(each rank samples an equal share)")
    dry.show("steps", f"{t.max_steps} (train.max_steps), {t.prompts_per_step} prompts per step, "
             f"{cfg.rollout.max_new_tokens} new tokens, loss.kl {cfg.loss.kl}")
    if cfg.rollout.backend == "server" and not cfg.rollout.server.urls:
        dry.problem("rollout.backend=server needs rollout.server.urls: start the sampler server with "
                    "`mopd teachers serve --config RECIPE --out DIR` and pass the overrides it writes")
    if out is not None:
        _check_out(cfg, Path(out), dry)
    return teachers


def preflight(cfg: DistillConfig, out: str | Path) -> None:
    """The real run's first check (`mopd distill`, `python -m mopd.distill`, under
    `accelerate launch` on every rank): what the dry run would name, all in one ConfigError
    (an unreachable server or store alone: its own error), before anything loads."""
    dry = DryRun("mopd distill")
    dry_run(cfg, out, dry)
    dry.raise_if_any()


def _tracking_uri(cfg: DistillConfig, out) -> str | None:
    """The store the teachers' models:/ references are looked up in: the run's (core.tracking.resolve_uri,
    which imports MLflow: only when the recipe has such a reference); without --out, only
    $MLFLOW_TRACKING_URI or the recipe's."""
    refs = [r for t in cfg.teachers.values() for r in (t.path, t.adapter)]
    if not any(r and r.startswith(MLFLOW_SCHEMES) for r in refs):
        return None
    if out is None:
        import os

        return os.environ.get("MLFLOW_TRACKING_URI") or cfg.mlflow.tracking_uri or None
    from core.tracking import resolve_uri

    return resolve_uri(cfg.mlflow.tracking_uri, out)


def _student(cfg: DistillConfig, dry: DryRun) -> Path | None:
    """The student's folder (the real run's check_model_dir: config.json, a tokenizer, an
    architecture vLLM serves when it samples), or None with its problem recorded."""
    ref = cfg.model.path
    if not ref.startswith(MLFLOW_SCHEMES) and not Path(ref).expanduser().exists():
        return None   # named by missing_paths
    return dry.check(check_model_dir, ref, vllm=cfg.rollout.backend == "vllm")


def _tokenizer(path: Path, dry: DryRun):
    """The student's tokenizer, or None (its problem recorded): the teachers are checked against it."""
    from transformers import AutoTokenizer

    n = len(dry.problems)
    tok = dry.check(_load_tokenizer, AutoTokenizer, path)
    if tok is not None:
        dry.check(check_tokenizer, tok, path)
    return tok if len(dry.problems) == n else None


def _load_tokenizer(auto, path: Path):
    try:
        return auto.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - a broken tokenizer file raises many types
        raise ValueError(f"model.path: cannot load the tokenizer of {path}: {type(e).__name__}: "
                         f"{' '.join(str(e).split())}") from None


def _teachers(cfg: DistillConfig, tok, dry: DryRun, uri: str | None) -> dict:
    """Each teacher resolved and checked against the student's tokenizer (resolve_teacher_key)."""
    from teachers.check import resolve_teacher_key

    found = {}
    for key, spec in sorted(cfg.teachers.items()):
        label = f"{spec.path or spec.model} ({spec.backend}" + (f", adapter {spec.adapter}" if spec.adapter else "")
        local_missing = any(r and not r.startswith(MLFLOW_SCHEMES) and not Path(r).expanduser().exists()
                            for r in (spec.path, spec.adapter))
        if local_missing:   # named by missing_paths
            dry.show(f"teacher {key}", label + ", missing)")
            continue
        n = len(dry.problems)
        path = dry.check(resolve_teacher_key, key, spec, tok, cfg.model.path, tracking_uri=uri)
        if len(dry.problems) == n:
            found[key] = path
            where = f" -> {path}" if path is not None and str(path) != spec.path else ""
            fit = "fits" if tok is not None else "fit not checked: the student's tokenizer did not load"
            dry.show(f"teacher {key}", label + f", {fit}){where}")
        else:
            dry.show(f"teacher {key}", label + ", see the problem below)")
    return found


def _check_out(cfg: DistillConfig, out: Path, dry: DryRun) -> None:
    from mopd.distill.checkpoints import latest_checkpoint

    dry.check(check_checkpoint_dir, out)
    ckpt = dry.check(latest_checkpoint, out) if out.is_dir() else None
    if ckpt is not None and not cfg.train.resume:
        dry.problem(f"{out} already holds checkpoints ({ckpt.name}); pass train.resume=true to continue that run, "
                    f"or choose a new --out")
    dry.show("out", f"{out}" + (f" (resumes from {ckpt.name})" if ckpt is not None and cfg.train.resume else ""))
