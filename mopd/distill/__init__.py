"""The MOPD loop: config tree (`config`), prompts (`data`), loss maths (`loss`), one
optimizer step (`step`), metrics (`metrics`), checkpoints (`checkpoints`), the checks
before any model loads (`inputs`), a sampled batch (`batch`), the trainer whose methods
are the loop's steps (`trainer.MOPDTrainer`: sample, score, update, log, save, sync,
stop), and `run()` (`loop`), which checks, opens the MLflow run and hands over to it.
`python -m mopd.distill --config ... --out ...`.

`DistillConfig`, `run` and `main` are importable from here; they load on first use, so
that reading a config class does not import the whole loop (accelerate, vLLM, teachers).
"""
from __future__ import annotations

import importlib

_LAZY = {"DistillConfig": "mopd.distill.config", "run": "mopd.distill.loop", "main": "mopd.distill.loop"}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mopd.distill' has no attribute {name!r}")
