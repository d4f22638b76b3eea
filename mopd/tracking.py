"""The MLflow store and experiment every entry point (loop, experts, base, pipeline)
logs to, resolved one way everywhere, and the one place runs are started.

A stage run of the pipeline is nested under the pipeline's parent run: the parent's id
is handed down explicitly (a config field `mlflow.parent_run_id` or an argument),
never through an environment variable."""
from __future__ import annotations

import os
from pathlib import Path

import mlflow


def resolve_uri(configured: str | None, out: str | Path) -> str:
    """$MLFLOW_TRACKING_URI (a team's server), else the recipe's, else sqlite under `out`."""
    return os.environ.get("MLFLOW_TRACKING_URI") or configured or f"sqlite:///{Path(out).resolve()}/mlflow.db"


def experiment_id(name: str, uri: str) -> str:
    """Point MLflow at `uri` and return the id of experiment `name`, creating it if needed.
    A local sqlite store keeps its artifacts beside it (not in ./mlruns of the cwd); a
    tracking server decides for itself."""
    mlflow.set_tracking_uri(uri)
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    art = None
    if uri.startswith("sqlite:///"):
        art = (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").as_uri()
    return mlflow.create_experiment(name, artifact_location=art)


def start_run(*, experiment: str, uri: str, run_name: str | None = None, tags: dict | None = None,
              parent_run_id: str | None = None, run_id: str | None = None):
    """Start (or, with `run_id`, resume) an MLflow run in `experiment` of the store at
    `uri`, nested under `parent_run_id` when one is given. Usable as a context manager."""
    exp_id = experiment_id(experiment, uri)
    if run_id:
        return mlflow.start_run(run_id=run_id)
    return mlflow.start_run(experiment_id=exp_id, run_name=run_name, tags=tags or {},
                            nested=bool(parent_run_id), parent_run_id=parent_run_id or None)
