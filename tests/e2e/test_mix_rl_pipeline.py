"""The Mix-RL baseline through the pipeline's own stages on two domains (math, tool_use):
the data stage, the `baseline/mix_rl` stage (real GRPO on a tiny model, two steps), its
eval stage and the report, which must carry the Mix-RL row, the budgets table and the
score-vs-budget plot. The experts and the MOPD stage are stood in for (a tiny model as
every teacher, a two-step MOPD history), so the whole run takes seconds, not the
pipeline's minutes; the plan is the real one (recipes/pipeline/tiny.yaml)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.config import load_config
from pipeline.config import PipelineConfig
from pipeline.plan import build_plan
from core.tiny import build_tiny_model
from pipeline.runner import Stage, StageRunner

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes/pipeline/tiny.yaml"
OVERRIDES = ["domains=[math,tool_use]", "train.max_steps=2", "mopd.n_prompts=16", "eval.n=4",
             "eval.max_new_tokens={math: 8, tool_use: 8}",
             "baselines.seq_kd.enabled=false", "baselines.weight_avg.enabled=false",
             "baselines.warmup_mopd.enabled=false", "baselines.mix_rl.enabled=true",   # off in tiny.yaml
             "baselines.mix_rl.n_samples=32", "baselines.mix_rl.batch_size=4", "baselines.mix_rl.num_generations=4",
             "baselines.mix_rl.max_completion_length=12"]


def _stand_ins(plan, teacher: Path) -> list[Stage]:
    """The plan's stages, the base, experts, MOPD and the other models' evals replaced by
    stages that hand on a tiny model or fixed numbers (the plan's names, deps and hashes kept)."""
    root = plan.root

    def base(ctx):
        return {"checkpoint": str(build_tiny_model(root / "base" / "model", seed=0))}

    def expert(ctx):
        return {"checkpoint": str(teacher)}

    def mopd(ctx):
        hist = [{"step": i + 1, "tokens": 700.0, "reverse_kl/math": 0.5, "reverse_kl/tool_use": 0.4} for i in range(2)]
        (root / "mopd").mkdir(parents=True, exist_ok=True)
        (root / "mopd" / "history.json").write_text(json.dumps(hist))
        return {"final": str(teacher), "steps": 2, "tokens": 1400, "history": str(root / "mopd" / "history.json")}

    def fixed(score):
        return lambda ctx: {"model": "stand-in", "scores": {c.name: score for c in plan.columns}}

    out = []
    for s in plan.stages:
        fn = s.fn
        if s.name == "base":
            fn = base
        elif s.name.startswith("expert/"):
            fn = expert
        elif s.name == "mopd":
            fn = mopd
        elif s.name.startswith("eval/") and s.name != "eval/mix_rl":
            fn = fixed(0.5 if s.name.startswith("eval/teacher") else 0.2)
        out.append(Stage(s.name, s.settings, fn, deps=s.deps, out=s.out, always=s.always))
    return out


@pytest.mark.timeout(240)
def test_mix_rl_stage_trains_and_the_report_carries_it_with_budgets(tmp_path):
    cfg = load_config(PipelineConfig, TINY, OVERRIDES)
    plan = build_plan(cfg, tmp_path / "run")
    names = [s.name for s in plan.stages]
    assert "baseline/mix_rl" in names and "eval/mix_rl" in names and "baseline/cascade_rl" not in names
    teacher = build_tiny_model(tmp_path / "teacher", seed=1)
    outputs = StageRunner(plan.root).run(_stand_ins(plan, teacher))

    s = outputs["baseline/mix_rl"]
    # 32 samples at 4 prompts x 4 completions a step: 2 GRPO steps, every sample counted
    assert s["steps"] == 2 and s["samples"] == 32 and s["budget_samples"] == 32
    assert 0 < s["tokens"] <= 32 * 12
    assert s["phases"][0]["prompts_per_domain"].keys() <= {"math", "tool_use"}
    b = s["budget"]
    assert b["student_tokens"] == s["tokens"] and b["teacher_tokens_generated"] == 0
    assert b["teacher_tokens_scored"] == 0
    n = b["params"]["student"]
    assert b["flops"] == pytest.approx(8 * n * s["tokens"])       # 2N sampling + 6N update per token
    assert Path(s["checkpoint"], "config.json").is_file()
    # the stage's summary (its marker's outputs, what a rerun hands the report) holds the budget
    marker = json.loads((plan.root / "stages" / "baseline__mix_rl.json").read_text())
    assert marker["outputs"]["budget"]["flops"] == b["flops"]

    report = json.loads((plan.root / "report.json").read_text())
    assert set(report["scores"]["mix_rl"]) == {"math/low", "math/high", "tool_use"}
    assert all(v is not None for v in report["scores"]["mix_rl"].values())
    assert set(report["budgets"]) == {"student", "mix_rl"}
    st = report["budgets"]["student"]
    assert st["student_tokens"] == 1400 and st["teacher_tokens_scored"] == 1400
    assert st["student_samples"] == 128       # one sampled batch of 128 prompts for 2 steps of 4 minibatches
    assert report["budgets"]["mix_rl"]["seconds"] > 0
    md = (plan.root / "report.md").read_text()
    assert "Mix-RL (joint GRPO)" in md and "## Budgets" in md and "](budgets.png)" in md
    assert (plan.root / "budgets.png").stat().st_size > 1000
