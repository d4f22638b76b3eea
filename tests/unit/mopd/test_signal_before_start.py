"""A SIGTERM / SIGINT before the first training step (models loading, the MLflow run just
opened) has no step to finish and nothing to save: `mopd distill` and `mopd expert` say
they stop before training started, exit at once with 128 + the signal, and end the MLflow
run KILLED. Through the real entry points, the signal sent from inside the model load."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import mlflow
import pytest

from conftest import tiny_mopd_run

REPO = Path(__file__).resolve().parents[3]


def _only_run(out: Path):
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{out}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1
    return runs[0]


def _signal_after(fn, signum):
    def wrapped(*a, **kw):
        res = fn(*a, **kw)
        os.kill(os.getpid(), signum)   # delivered at the next bytecode, before the first step
        return res
    return wrapped


def test_distill_stops_at_once_before_the_first_step(tmp_path, monkeypatch, capsys):
    from mopd.distill import loop, trainer
    from mopd.distill.config import DistillConfig
    from core.config import load_config

    signum = signal.SIGTERM
    # a process-wide handler another test installed (rewards.workspace's cleanup) must come back too
    before = signal.getsignal(signal.SIGTERM)
    s = tiny_mopd_run(tmp_path / "setup", rows=8, recipe="""
rollout: {backend: hf, max_new_tokens: 4}
train: {max_steps: 2, prompts_per_step: 4, save_every: 1}""")
    steps = []
    monkeypatch.setattr(trainer, "build_models", _signal_after(trainer.build_models, signum))
    monkeypatch.setattr(trainer.MOPDTrainer, "train_sync", lambda self: steps.append(1))
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        loop.run(load_config(DistillConfig, s["cfg"]), out, progress=False)
    assert e.value.code == 128 + signum
    err = capsys.readouterr().err
    assert f"[mopd] {signal.Signals(signum).name} before training started: stopping now" in err
    assert "finishing this step" not in err and not steps
    assert _only_run(out).info.status == "KILLED"
    assert not (out / "checkpoints").exists() and not (out / "final").exists()
    assert signal.getsignal(signal.SIGTERM) is before   # handlers restored


def test_expert_stops_at_once_before_training(tmp_path, tiny_student_dir, monkeypatch, capsys):
    import pipeline.expert as ex

    trained = []
    monkeypatch.setattr(ex, "log_config", _signal_after(ex.log_config, signal.SIGINT))   # Ctrl-C
    monkeypatch.setattr(ex, "train", lambda *a, **kw: trained.append(1))
    out = tmp_path / "sft"
    with pytest.raises(SystemExit) as e:
        ex.main(["--config", str(REPO / "recipes/experts/math/sft-low.yaml"), "--out", str(out),
                 f"model.path={tiny_student_dir}", "train.max_steps=2", "data.n_train=8", "data.n_test=4"])
    assert e.value.code == 130 and not trained
    assert "[expert] SIGINT before training started: stopping now" in capsys.readouterr().err
    assert _only_run(out).info.status == "KILLED"
    assert not (out / "model").exists() and not (out / "summary.json").exists()
