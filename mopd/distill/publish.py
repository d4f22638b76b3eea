"""The finished run's model in MLflow: logged with the transformers flavor (so
`mlflow.transformers.load_model("runs:/<id>/model")` opens it), then registered as a new
version of `<name>-student` whose tags say what made it: each teacher's registered
version (or folder), the data mix and the recipe's hash. The model is on disk already: a
store that refuses either step is reported, never raised."""
from __future__ import annotations

import sys
from pathlib import Path

from core.tracking import log_hf_model, resolve_uri
from mopd.distill.checkpoints import settings_hash
from mopd.distill.config import DistillConfig
from teachers.registry import data_mix_tag, register_student


def publish(cfg: DistillConfig, out: Path, final_dir: Path, run_id: str, inputs) -> str | None:
    """Log `final_dir` to the active run and register it; returns the registered
    models:/<name>-student/<version>, or None (not asked for, or the store refused)."""
    if not cfg.mlflow.log_model:
        return None
    model_uri = log_hf_model(final_dir)
    if model_uri is None or not cfg.mlflow.register:
        return None
    name = cfg.mlflow.registered_name or cfg.mlflow.run_name or out.name
    tags = {**inputs.lineage, "data_mix": data_mix_tag(cfg.data.datasets, cfg.data.mix),
            "recipe_hash": settings_hash(inputs.settings), "domains": ",".join(inputs.domains),
            "source": f"runs:/{run_id}/model"}
    try:
        ref = register_student(name, run_id, model_uri, tags, tracking_uri=resolve_uri(cfg.mlflow.tracking_uri, out))
    except Exception as e:  # noqa: BLE001 - any store error: the run's outcome matters more than its record
        print(f"[mopd] could not register the student as {name}-student ({type(e).__name__}: {str(e)[:300]})",
              file=sys.stderr)
        return None
    print(f"[mopd] registered the student as {ref} (alias @student), with its teachers' versions", file=sys.stderr)
    return ref
