"""`mopd toy` end to end (minutes): tiny base, two SFT teachers, MOPD with vLLM sampling,
held-out evals. Asserts what the toy is for: MOPD cuts each domain's reverse KL at least
in half, the teachers really know their task, and the student gets most of the way
to each teacher."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.vllm
def test_toy_pipeline(tmp_path):
    out = tmp_path / "toy"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "toy", "--out", str(out)],
                       capture_output=True, text=True, env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr[-5000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["rollout_backend"] == "vllm" and s["steps"] >= 10
    assert set(s["domains"]) == {"reverse", "rotate"}
    for d, m in s["domains"].items():
        assert m["reverse_kl_last"] <= 0.5 * m["reverse_kl_first"], (d, m)
        assert m["teacher_score"] >= m["base_score"] + 0.3, (d, m)
        assert m["student_score"] >= 0.8 * m["teacher_score"], (d, m)
    import mlflow
    mlflow.set_tracking_uri(s["mlflow"]["tracking_uri"])
    run = mlflow.get_run(s["mlflow"]["mopd_run_id"])
    assert run.data.tags.get("mlflow.parentRunId") == s["mlflow"]["parent_run_id"]
    assert "reverse_kl/rotate" in run.data.metrics


def test_toy_stages_and_mopd_config(tmp_path, monkeypatch):
    """The toy is a small pipeline on the stage runner: its MOPD config points at the
    folders its stages write, and a killed or repeated run reuses data, base and teachers."""
    from pipeline.config import ToyConfig
    from pipeline.toy import mopd_config, stages

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "toy"
    cfg = mopd_config(ToyConfig(overrides=["train.max_steps=7"]), out)
    assert cfg.model.path == str(out / "base") and cfg.train.max_steps == 7
    assert [d.path for d in cfg.data.datasets] == [str(out / "data" / d / "train") for d in ("reverse", "rotate")]
    assert {k: t.path for k, t in cfg.teachers.items()} == {d: str(out / "teachers" / d) for d in ("reverse", "rotate")}
    assert cfg.rollout.backend == "vllm" and cfg.mlflow.tracking_uri == f"sqlite:///{out}/mlflow.db"
    assert mopd_config(ToyConfig(rollout_backend="hf"), out).rollout.backend == "hf"
    assert mopd_config(ToyConfig(overrides=["rollout.backend=hf"]), out).rollout.backend == "hf"
    st = {s.name: s for s in stages(ToyConfig(), out, cfg)}
    assert list(st) == ["data", "base", "teacher/reverse", "teacher/rotate", "mopd", "eval"]
    assert st["mopd"].always and st["eval"].always and not st["base"].always
    assert st["teacher/rotate"].deps == ["base"] and st["mopd"].out == out / "student"
