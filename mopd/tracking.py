"""The MLflow store and experiment every entry point (loop, experts, base, toy,
pipeline) logs to, resolved one way everywhere."""
from __future__ import annotations

import os
from pathlib import Path


def resolve_uri(configured: str | None, out: str | Path) -> str:
    """$MLFLOW_TRACKING_URI (a team's server), else the recipe's, else sqlite under `out`."""
    return os.environ.get("MLFLOW_TRACKING_URI") or configured or f"sqlite:///{Path(out).resolve()}/mlflow.db"


def experiment_id(name: str, uri: str) -> str:
    """Point MLflow at `uri` and return the id of experiment `name`, creating it if needed.
    A local sqlite store keeps its artifacts beside it (not in ./mlruns of the cwd); a
    tracking server decides for itself."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    art = None
    if uri.startswith("sqlite:///"):
        art = (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").as_uri()
    return mlflow.create_experiment(name, artifact_location=art)
