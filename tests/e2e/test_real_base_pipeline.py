"""The pipeline on a real family's checkpoint (issue #33's must-show): the tiny recipe with
`base.path` set to a random-init Qwen3 stand-in (core/standins.py) runs, with the smoke
budget, to its report, and every expert, the student and the baselines are
Qwen3ForCausalLM with the stand-in's tokenizer; each expert stage's config.yaml starts
from the stand-in (applied, not replaced). And recipes/real/qwen3/ end to end on the same
stand-in. Minutes: `pytest -m slow`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SMOKE = ["domains=[math]", "train.max_steps=2", "eval.n=8", "mopd.n_prompts=64", "extra_seeds=[]",
         "baselines.cascade_rl.enabled=false"]   # full.yaml's every stage kind, one seed

pytestmark = pytest.mark.slow


def arch(path: Path) -> list[str]:
    return json.loads((path / "config.json").read_text())["architectures"]


def test_tiny_pipeline_on_a_qwen3_base_runs_to_its_report(tmp_path, standins):
    pytest.importorskip("vllm")
    base = Path(standins["qwen3"]).resolve()
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "pipeline", "--config", "recipes/pipeline/full.yaml",
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


def test_the_qwen3_recipes_run_end_to_end_on_a_qwen3_stand_in(tmp_path, standins):
    """recipes/real/qwen3/ as shipped (bf16, experts on the sample files, vLLM teachers),
    with overrides only for the stand-in's size: its base, INT4 groups of 32 (hidden 64),
    its 1,024 positions, and a smoke budget. One domain, ~70 s here."""
    pytest.importorskip("vllm")
    base = Path(standins["qwen3"]).resolve()
    out = tmp_path / "run"
    small = "train.batch_size=2, train.grad_accum=1, eval.max_new_tokens=16, data.n_test=4, quant.group_size=32"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    p = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "pipeline", "--config", "recipes/real/qwen3/pipeline.yaml",
         "--out", str(out), f"base.path={base}", "domains=[instruction_following]", "train.max_steps=2",
         "eval.n=4", "eval.batch_size=4", "mopd.n_prompts=3",
         f"experts.sft=[{small}, train.max_length=512]",
         f"experts.rl=[{small}, rl.num_generations=2, rl.max_completion_length=16]",
         "mopd.overrides=[rollout.max_model_len=1024, data.max_prompt_tokens=512, rollout.max_new_tokens=16, "
         "train.prompts_per_step=2, rollout.kv_cache_gb=0.5]"],
        capture_output=True, text=True, cwd=REPO, env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    assert set(json.loads((out / "report.json").read_text())["scores"]) >= {"base", "teacher", "student"}
    for path in (out / "experts" / "instruction_following" / "sft" / "model",
                 out / "experts" / "instruction_following" / "rl" / "model", out / "mopd" / "final"):
        c = json.loads((path / "config.json").read_text())
        assert (c["architectures"], c.get("dtype") or c.get("torch_dtype")) == (["Qwen3ForCausalLM"], "bfloat16")
    mopd = yaml.safe_load((out / "mopd" / "config.yaml").read_text())
    assert mopd["model"]["dtype"] == "bfloat16"
    assert mopd["teachers"]["instruction_following"]["backend"] == "vllm"
    # the MOPD prompts are the RL expert's file's rows (data.files.train), not the generator's
    prompts = (REPO / "recipes" / "real" / "qwen3" / "data" / "instruction_following.jsonl").read_text().splitlines()
    import datasets
    got = datasets.load_from_disk(str(out / "data" / "instruction_following"))["prompt"]
    assert got == [json.loads(r)["prompt"] for r in prompts[:3]]
