"""Checkpoints of the loop: HF-format model, accelerate state (optimizer, scheduler,
RNG) and the data position, written so that a kill at any moment loses nothing."""
from __future__ import annotations

import json
import shutil
from pathlib import Path


def _steps(out: Path) -> list[Path]:
    return sorted((out / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))


def latest_checkpoint(out: Path) -> Path | None:
    ckpts = [c for c in _steps(out) if (c / "DONE").exists()]
    return ckpts[-1] if ckpts else None


def save_checkpoint(accelerator, model, tokenizer, out: Path, step: int, extra: dict, keep: int):
    """HF-format model + accelerate state (optimizer, scheduler, RNG) + data position,
    written to a temporary folder and renamed, so a kill mid-save loses nothing."""
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
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in _steps(out)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def load_checkpoint(accelerator, ckpt: Path) -> dict:
    """Restore the accelerate state from `ckpt`; returns its trainer_state (step, data
    position, MLflow run id, history)."""
    accelerator.load_state(str(ckpt / "state"))
    return json.loads((ckpt / "trainer_state.json").read_text())
