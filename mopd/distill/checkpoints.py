"""Checkpoints of the loop: HF-format model, accelerate state (optimizer, scheduler,
RNG) and the data position, written so that a kill at any moment loses nothing.

A checkpoint is written into `.tmp_step_N`, every file fsynced, then a MANIFEST (each
file's size and sha256) last, and only then renamed to `step_N`. `latest_checkpoint`
returns the newest checkpoint whose files match its manifest: a damaged one (a file
truncated or changed by a full disk, a copy, a crash of the file system) is reported by
path and the previous good one is used. Pruning never removes the newest good one.

Each checkpoint also stores the training-relevant settings (`training_settings`) and
their hash, so a resume can tell whether it would continue the same run.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

MANIFEST = "MANIFEST.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; names its path."""


def _steps(out: Path) -> list[Path]:
    return sorted((p for p in (out / "checkpoints").glob("step_*") if p.name.split("_")[1].isdigit()),
                  key=lambda p: int(p.name.split("_")[1]))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def write_manifest(root: Path) -> None:
    """Size and sha256 of every file under `root`, fsynced, written last."""
    files = _files(root)
    for f in files:
        _fsync(f)
    entries = {str(f.relative_to(root)): {"size": f.stat().st_size, "sha256": _sha256(f)} for f in files}
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"files": entries}, indent=1))
    _fsync(tmp)
    os.replace(tmp, root / MANIFEST)
    for d in {f.parent for f in files} | {root}:
        _fsync(d)


# checksums verified in this process, keyed by every file's (path, size, mtime): a
# checkpoint is hashed once per process unless a file of it changes
_verified: dict[tuple, str | None] = {}
_reported: set[str] = set()


def _fingerprint(ckpt: Path) -> tuple:
    return (str(ckpt.resolve()),) + tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns)
                                          for f in sorted(ckpt.rglob("*")) if f.is_file())


def check_checkpoint(ckpt: Path) -> str | None:
    """None if every file of `ckpt` matches its manifest, else what is wrong (naming the
    file). Checkpoints written before manifests existed are accepted on their DONE marker."""
    man = ckpt / MANIFEST
    if not man.exists():
        if (ckpt / "DONE").exists():
            return None
        return f"{ckpt} is incomplete (no {MANIFEST}: killed while it was written?)"
    key = _fingerprint(ckpt)
    if key in _verified:
        return _verified[key]
    problem = None
    try:
        entries = json.loads(man.read_text())["files"]
    except (ValueError, KeyError) as e:
        problem = f"{man} is unreadable: {e}"
        entries = {}
    for rel, e in entries.items():
        f = ckpt / rel
        if not f.is_file():
            problem = f"{f} is missing"
        elif f.stat().st_size != e["size"]:
            problem = f"{f} has {f.stat().st_size} bytes, its manifest says {e['size']} (truncated?)"
        elif _sha256(f) != e["sha256"]:
            problem = f"{f} does not match its checksum in {man}"
        if problem:
            break
    _verified[key] = problem
    return problem


def good_checkpoints(out: Path, report: bool = True) -> list[Path]:
    """The checkpoints under `out` that pass `check_checkpoint`, oldest first; damaged
    ones are reported on stderr by path."""
    good = []
    for c in _steps(out):
        problem = check_checkpoint(c)
        if problem is None:
            good.append(c)
        elif report and str(c) not in _reported:
            _reported.add(str(c))
            print(f"[mopd] skipping damaged checkpoint {c}: {problem}", file=sys.stderr)
    return good


def latest_checkpoint(out: Path) -> Path | None:
    """The newest checkpoint under `out` whose files match their manifest."""
    good = good_checkpoints(Path(out))
    return good[-1] if good else None


def read_state(ckpt: Path) -> dict:
    """The checkpoint's trainer_state (step, data position, MLflow run id, history,
    training settings and their hash), without loading anything else."""
    try:
        return json.loads((ckpt / "trainer_state.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: cannot read trainer_state.json: {e}") from None


# --- the settings a checkpoint belongs to

# Keys that never change what the run computes: where and how it is tracked, how
# often it is saved, and how it was started. `train.max_steps` changes nothing done so
# far either: with a constant schedule it only says where to stop, so extending a run
# (`train.max_steps=2000 train.resume=true`) is a plain resume; with a warm-up-only or
# decaying schedule the lr of the remaining steps depends on it, so there it counts.
# ... and the memory settings, which change how an update is computed, not what it is
_IGNORED = ("mlflow.", "train.resume", "train.accept_config_change", "train.save_every", "train.keep_checkpoints",
            "train.micro_batches", "loss.logits_chunk", "model.gradient_checkpointing")


def training_settings(flat: dict) -> dict:
    """The flattened config minus the keys that do not affect training (see `_IGNORED`)."""
    keep = {k: v for k, v in flat.items() if not k.startswith(_IGNORED)}
    if flat.get("train.lr_schedule") == "constant":
        keep.pop("train.max_steps", None)
    return json.loads(json.dumps(keep, sort_keys=True, default=str))


def settings_hash(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def settings_diff(old: dict, new: dict) -> dict[str, tuple]:
    """key -> (checkpoint's value, now), for every key that differs."""
    missing = "<unset>"
    return {k: (old.get(k, missing), new.get(k, missing)) for k in sorted(set(old) | set(new))
            if old.get(k, missing) != new.get(k, missing)}


def save_checkpoint(accelerator, model, tokenizer, out: Path, step: int, extra: dict, keep: int):
    """HF-format model + accelerate state (optimizer, scheduler, RNG) + data position,
    written to a temporary folder with a manifest and renamed, so a kill mid-save loses
    nothing; then all but the newest `keep` good checkpoints are removed."""
    final = out / "checkpoints" / f"step_{step}"
    tmp = out / "checkpoints" / f".tmp_step_{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp / "state"), safe_serialization=True)
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(str(tmp / "model"), state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(str(tmp / "model"))
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **extra}, indent=1))
        (tmp / "DONE").write_text("ok")
        write_manifest(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync(final.parent)
        _verified[_fingerprint(final)] = None  # just written and hashed
        if keep > 0:
            good = good_checkpoints(out, report=False)
            keep_set = set(good[-keep:]) | {final}
            for old in _steps(out):
                if old not in keep_set:
                    shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def load_checkpoint(accelerator, ckpt: Path) -> dict:
    """Restore the accelerate state from `ckpt` (verified against its manifest); returns
    its trainer_state (step, data position, MLflow run id, history)."""
    problem = check_checkpoint(ckpt)
    if problem:
        raise CheckpointError(f"checkpoint {ckpt} is damaged: {problem}")
    try:
        accelerator.load_state(str(ckpt / "state"))
    except Exception as e:  # torch / safetensors raise many types; the path is what matters
        raise CheckpointError(f"cannot load checkpoint {ckpt / 'state'}: {type(e).__name__}: {e}") from e
    return read_state(ckpt)
