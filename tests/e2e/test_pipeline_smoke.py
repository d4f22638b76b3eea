"""The pipeline end to end on one domain with a few steps per stage (the smoke run the
presets document, on `recipes/pipeline/full.yaml`: every stage kind), then the commands that read its output:
`mopd teachers validate`, `mopd eval`, `bench.pipeline_time`, and a no-op rerun."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ci

REPO = Path(__file__).resolve().parents[2]
# full.yaml's smoke run (every stage kind: Mix-RL and warm-up -> MOPD are off in tiny.yaml),
# one seed and no cascade here (the seed copies are the last test's), the README's smoke flags
PRESET = "recipes/pipeline/full.yaml"
SMOKE = ["domains=[math]", "train.max_steps=2", "eval.n=8", "mopd.n_prompts=64", "extra_seeds=[]",
         "baselines.cascade_rl.enabled=false"]


def _mopd(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True,
                       cwd=REPO, env=env)
    assert p.returncode == 0, f"mopd {' '.join(args)} failed:\n{p.stderr[-4000:]}"
    return p


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Path:
    pytest.importorskip("vllm")
    out = tmp_path_factory.mktemp("pipeline") / "smoke"
    _mopd("pipeline", "--config", PRESET, "--out", str(out), *SMOKE)
    return out


def test_smoke_pipeline_writes_the_report(smoke):
    report = json.loads((smoke / "report.json").read_text())
    assert set(report["scores"]) >= {"base", "student", "seq_kd", "weight_avg", "mix_rl", "warmup_mopd"}
    assert set(report["budgets"]) == {"student", "seq_kd", "weight_avg", "mix_rl", "warmup_mopd"}
    for model, row in report["scores"].items():
        for col, v in row.items():
            assert v is None or 0.0 <= v <= 1.0, (model, col, v)
    for f in ("report.md", "eval.json", "retention.png", "kl_curves.png"):
        assert (smoke / f).is_file(), f
    hist = json.loads((smoke / "mopd" / "history.json").read_text())
    assert len(hist) == 2 and all(h["tokens"] > 0 for h in hist)
    # the stage runs are nested under the pipeline's parent run, handed down explicitly
    import mlflow
    mlflow.set_tracking_uri(f"sqlite:///{smoke}/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["mopd-pipeline"], output_format="list")
    parents = [r for r in runs if r.data.tags.get("stage") == "pipeline"]
    assert len(parents) == 1
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
    assert len(children) == len(runs) - 1 == 21   # every stage, the experts' subprocess runs included
    assert {r.info.run_name for r in children} >= {"base", "mopd", "math-low-expert-rl", "math-high-expert-sft",
                                                    "warmup", "warmup_mopd"}


def test_commands_that_read_a_pipeline_run(smoke, tmp_path):
    _mopd("teachers", "validate", "--config", str(smoke / "mopd" / "config.yaml"))
    _mopd("eval", "--models", f"base={smoke}/base/model", "--domains", "math", "--n", "4",
          "--out", str(tmp_path / "eval"))
    scores = json.loads((tmp_path / "eval" / "eval.json").read_text())["scores"]["base"]
    assert set(scores) == {"math/low", "math/high"}
    p = subprocess.run([sys.executable, "-m", "bench.pipeline_time", str(smoke)], capture_output=True,
                       text=True, cwd=REPO)
    assert p.returncode == 0 and "sum of stages" in p.stdout, p.stderr[-2000:]


def test_rerun_with_nothing_changed_reuses_every_stage(smoke):
    from core.config import load_config
    from pipeline.config import PipelineConfig
    from pipeline.run import run_pipeline

    cfg = load_config(PipelineConfig, REPO / PRESET, SMOKE)
    plan = {row["stage"]: row["action"] for row in run_pipeline(cfg, smoke, dry_run=True)["plan"]}
    assert len(plan) == 21
    # every stage but the report (always rewritten: it reads every other stage) is reused
    assert {s: a for s, a in plan.items() if a != "cached"} == {"report": "run"}


def test_extra_seeds_rerun_adds_only_the_seeded_stages(smoke):
    """Last in this file: it adds stages to the smoke folder."""
    from core.config import load_config
    from pipeline.config import PipelineConfig
    from pipeline.run import run_pipeline

    more = [*SMOKE, "extra_seeds=[1]"]
    cfg = load_config(PipelineConfig, REPO / PRESET, more)
    plan = {row["stage"]: row["action"] for row in run_pipeline(cfg, smoke, dry_run=True)["plan"]}
    assert {s for s, a in plan.items() if a != "cached"} == {
        "report", "mopd/seed1", "baseline/seq_kd/seed1", "baseline/mix_rl/seed1",
        "eval/student/seed1", "eval/seq_kd/seed1", "eval/mix_rl/seed1"}
    _mopd("pipeline", "--config", PRESET, "--out", str(smoke), *more)
    report = json.loads((smoke / "report.json").read_text())
    seeds = report["seeds"]
    assert set(seeds) >= {"student", "seq_kd", "mix_rl"}
    assert seeds["student"]["models"] == ["student", "student/seed1"] and len(seeds["student"]["means"]) == 2
    assert set(seeds["paired"]) == {"seq_kd", "mix_rl"}
    import yaml
    assert yaml.safe_load((smoke / "seeds" / "seed1" / "mopd" / "config.yaml").read_text())["train"]["seed"] == 1
    assert (smoke / "seeds" / "seed1" / "mopd" / "history.json").is_file()
    assert "## Training seeds" in (smoke / "report.md").read_text()
