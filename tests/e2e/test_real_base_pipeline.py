"""The pipeline on a real family's checkpoint (issue #33's must-show): the tiny recipe with
`base.path` set to a random-init Qwen3 stand-in (mopd/standins.py) runs, with the smoke
budget, to its report, and every expert, the student and the baselines are
Qwen3ForCausalLM with the stand-in's tokenizer; each expert stage's config.yaml starts
from the stand-in (applied, not replaced). Takes minutes: `pytest -m slow`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SMOKE = ["domains=[math]", "train.max_steps=2", "eval.n=8", "mopd.n_prompts=64"]

pytestmark = pytest.mark.slow


def arch(path: Path) -> list[str]:
    return json.loads((path / "config.json").read_text())["architectures"]


def test_tiny_pipeline_on_a_qwen3_base_runs_to_its_report(tmp_path, standins):
    pytest.importorskip("vllm")
    base = Path(standins["qwen3"]).resolve()
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "pipeline", "--config", "recipes/pipeline/tiny.yaml",
                        "--out", str(out), f"base.path={base}", *SMOKE], capture_output=True, text=True, cwd=REPO,
                       env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert set(report["scores"]) >= {"base", "student", "seq_kd", "weight_avg", "mix_rl", "warmup_mopd"}
    assert not (out / "base" / "model").exists()          # nothing trained: the checkpoint is the base
    models = {f"expert {k}/{st}": out / "experts" / k / st / "model" for k in ("math-low", "math-high")
              for st in ("sft", "rl")}
    models.update(student=out / "mopd" / "final", seq_kd=out / "baselines" / "seq_kd" / "model",
                  weight_avg=out / "baselines" / "weight_avg" / "model", mix_rl=out / "baselines" / "mix_rl" / "model")
    for name, path in models.items():
        assert arch(path) == ["Qwen3ForCausalLM"], name
        assert (path / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes(), name
    for k in ("math-low", "math-high"):
        cfg = yaml.safe_load((out / "experts" / k / "sft" / "config.yaml").read_text())
        assert cfg["model"]["path"] == cfg["model"]["base"] == str(base)
    assert yaml.safe_load((out / "mopd" / "config.yaml").read_text())["model"]["path"] == str(base)
