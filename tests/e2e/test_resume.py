"""Resume you can trust, and MLflow records that tell the truth (issue #20, parts 4-5), on
tiny random models with HF sampling: SIGTERM / SIGINT checkpoint the last finished step
and resume bit-identically without redoing a step; a damaged latest checkpoint is named
and the previous good one used; a resume with changed settings is refused unless
accepted (then the new lr really applies); a resume whose MLflow run is gone starts a
linked new run; failed runs end FAILED, interrupted ones KILLED.

The runs are in-process (the loop's signal handlers turn SIGTERM / SIGINT into a
checkpoint and a SystemExit(143 / 130)); bench/resume_chaos.py does the same with
SIGKILL too, in subprocesses, many times in a row."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from conftest import tiny_mopd_run

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    su = tiny_mopd_run(tmp_path_factory.mktemp("mopd_resume"), recipe="""
rollout: {backend: hf, max_new_tokens: 6}
train: {max_steps: 6, prompts_per_step: 4, lr: 1.0e-3, save_every: 2}
mlflow: {experiment: test, log_model: false}""")
    root, cfg = su["root"], su["cfg"]
    full = root / "full"
    _go(cfg, full)
    return {"cfg": cfg, "full": full}


def _go(cfg: Path, out: Path, *overrides: str, callbacks=None) -> dict:
    from core.config import load_config
    from mopd.distill import DistillConfig, run

    os.environ.pop("MLFLOW_TRACKING_URI", None)   # each run's own store under its --out
    return run(load_config(DistillConfig, str(cfg), list(overrides)), out, progress=False, callbacks=callbacks)


def _signal_at(step: int, sig: int):
    def cb(s, m):
        if s == step:
            os.kill(os.getpid(), sig)
    return cb


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "model.safetensors"))


def _same_weights(a: Path, b: Path):
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def _runs(out: Path, uri: str | None = None):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri or f"sqlite:///{out}/mlflow.db")
    exp = client.get_experiment_by_name("test")
    return client, client.search_runs([exp.experiment_id])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_saves_a_checkpoint_and_resume_redoes_no_step(setup, tmp_path, sig):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        _go(setup["cfg"], out, callbacks=[_signal_at(3, sig)])
    assert e.value.code == 128 + sig
    # the step that was running when the signal came is saved (save_every=2 would keep step 2 only)
    assert (out / "checkpoints" / "step_3" / "MANIFEST.json").exists()
    client, runs = _runs(out)
    assert [r.info.status for r in runs] == ["KILLED"]
    _go(setup["cfg"], out, "train.resume=true")
    _same_weights(setup["full"], out)
    client, runs = _runs(out)
    assert [r.info.status for r in runs] == ["FINISHED"]
    # each step logged once: none was redone after the resume
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")]
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]


def test_damaged_latest_checkpoint_falls_back_and_a_lost_mlflow_run_is_linked(setup, tmp_path, capfd):
    out = tmp_path / "run"
    with pytest.raises(SystemExit):
        _go(setup["cfg"], out, callbacks=[_signal_at(5, signal.SIGTERM)])
    assert {p.name for p in (out / "checkpoints").iterdir()} == {"step_4", "step_5"}
    _, runs = _runs(out)
    old_id = runs[0].info.run_id
    bad = out / "checkpoints" / "step_5" / "state" / "optimizer.bin"
    bad.write_bytes(bad.read_bytes()[:100])          # truncated
    capfd.readouterr()
    other = f"sqlite:///{tmp_path}/moved/mlflow.db"   # a store without the original run
    (tmp_path / "moved").mkdir()
    _go(setup["cfg"], out, "train.resume=true", f"mlflow.tracking_uri={other}")
    err = capfd.readouterr().err
    assert str(bad) in err and "step_4" in err
    _same_weights(setup["full"], out)
    client, runs = _runs(out, other)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.tags["mopd.resumed_from_run_id"] == old_id
    # the damaged checkpoint is gone, the good ones kept (never the last good one pruned)
    assert (out / "checkpoints" / "step_6").exists()


def test_resume_with_changed_settings_is_refused_unless_accepted(setup, tmp_path):
    from core.config import ConfigError

    out = tmp_path / "run"
    with pytest.raises(SystemExit):
        _go(setup["cfg"], out, "train.max_steps=4", callbacks=[_signal_at(2, signal.SIGTERM)])
    before = (out / "config.yaml").read_text()
    # max_steps with a constant schedule only says where to stop: not a change; lr is
    with pytest.raises(ConfigError) as e:
        _go(setup["cfg"], out, "train.resume=true", "train.max_steps=4", "train.lr=3e-3")
    assert "train.lr" in str(e.value) and "train.max_steps" not in str(e.value)
    assert "accept_config_change" in str(e.value)
    assert (out / "config.yaml").read_text() == before, "a refused resume must not rewrite config.yaml"
    r = _go(setup["cfg"], out, "train.resume=true", "train.max_steps=5", "train.lr=3e-3",
            "train.accept_config_change=true")
    lrs = {h["step"]: h["lr"] for h in r["history"]}
    assert lrs[1] == lrs[2] == pytest.approx(1e-3) and lrs[3] == lrs[5] == pytest.approx(3e-3)
    import yaml
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["lr"] == pytest.approx(3e-3)
    _, runs = _runs(out)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    change = json.loads(runs[0].data.tags["mopd.config_change.step_2"])
    assert change == {"train.lr": [0.001, 0.003]}


@pytest.mark.parametrize("error", [
    ValueError("a reward returned garbage"),                  # what `mopd: error:` reports
    OSError(28, "No space left on device"),                    # disk full
    torch.OutOfMemoryError("CUDA out of memory"),              # OOM raised by torch
    RuntimeError("any traceback"),
], ids=["mopd-error", "disk-full", "oom", "traceback"])
def test_failed_run_ends_failed(setup, tmp_path, error):
    def boom(step, m):
        if step == 2:
            raise error

    out = tmp_path / "run"
    with pytest.raises(type(error)):
        _go(setup["cfg"], out, callbacks=[boom])
    _, runs = _runs(out)
    assert [r.info.status for r in runs] == ["FAILED"]


def test_resume_after_a_failure_logs_each_step_once(setup, tmp_path, capfd):
    """A run that fails at step 3 has logged step 3 past its last checkpoint (step 2);
    the resume redoes step 3 but does not log it again: every metric of the MLflow run
    has exactly one point per step, and the resume is recorded on the run."""
    def boom(step, m):
        if step == 3:
            raise RuntimeError("a lost node")

    out = tmp_path / "run"
    with pytest.raises(RuntimeError):
        _go(setup["cfg"], out, callbacks=[boom])
    client, runs = _runs(out)
    run_id = runs[0].info.run_id
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == [1, 2, 3]
    capfd.readouterr()
    res = _go(setup["cfg"], out, "train.resume=true")
    assert res["mlflow_run_id"] == run_id and [h["step"] for h in res["history"]] == [1, 2, 3, 4, 5, 6]
    assert "it already holds step 3 from the run that stopped" in capfd.readouterr().err
    client, runs = _runs(out)
    keys = runs[0].data.metrics
    assert "loss" in keys and len(keys) > 5
    for k in keys:
        steps = [m.step for m in client.get_metric_history(run_id, k)]
        assert len(steps) == len(set(steps)), (k, sorted(steps))
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == [1, 2, 3, 4, 5, 6]
    note = runs[0].data.tags["mopd.resume.1"]
    assert note.startswith("from step 2 at 20") and "step 3 had been logged before the stop" in note
