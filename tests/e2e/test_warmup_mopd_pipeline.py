"""The warm-up-then-MOPD variant through the pipeline's own stages on math: the data
stage, `baseline/warmup` (real seq-KD for a quarter of plain MOPD's tokens),
`baseline/warmup_mopd` (real MOPD, HF sampling, from the warm-up's checkpoint for the
rest), its eval and the report. The base and the experts are tiny random models, plain
MOPD a summary of four 96-token steps (what its real run on these models logs: 8
prompts x 12 tokens, the random student never stopping early) and the other evals fixed
numbers, so the run takes well under a minute; the plan is the real one
(recipes/pipeline/tiny.yaml)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.config import load_config
from core.tiny import build_tiny_model
from pipeline.config import PipelineConfig
from pipeline.plan import build_plan
from pipeline.runner import Stage, StageRunner

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes/pipeline/tiny.yaml"
OVERRIDES = ["domains=[math]", "train.max_steps=4", "mopd.n_prompts=32", "eval.n=4",
             "eval.max_new_tokens={math: 8}",
             "mopd.overrides=[rollout.backend=hf,train.prompts_per_step=8,train.minibatches=1,"
             "rollout.max_new_tokens=12,train.warmup_steps=0,train.save_every=0]",
             "baselines.seq_kd.enabled=false", "baselines.weight_avg.enabled=false",
             "baselines.mix_rl.enabled=false", "baselines.seq_kd.batch_size=4", "baselines.seq_kd.gen_batch_size=8",
             "baselines.warmup_mopd.enabled=true", "baselines.warmup_mopd.share=0.25"]   # off in tiny.yaml


def _stand_ins(plan) -> list[Stage]:
    root = plan.root

    def base(ctx):
        return {"checkpoint": str(build_tiny_model(root / "base" / "model", seed=0))}

    def expert(ctx):   # where the MOPD config looks for it
        return {"checkpoint": str(build_tiny_model(ctx.out / "model", seed=1))}

    def mopd(ctx):     # plain MOPD's summary: 8 prompts x 12 tokens a step (a random model never stops early)
        hist = [{"step": i + 1, "tokens": 96.0, "reverse_kl/math": 0.5} for i in range(4)]
        ctx.out.mkdir(parents=True, exist_ok=True)
        (ctx.out / "history.json").write_text(json.dumps(hist))
        return {"final": ctx.inputs["base"]["checkpoint"], "steps": 4, "tokens": 384,
                "history": str(ctx.out / "history.json")}

    def fixed(ctx):
        return {"model": "stand-in", "scores": {c.name: 0.3 for c in plan.columns}}

    out = []
    for s in plan.stages:
        fn = s.fn
        if s.name == "base":
            fn = base
        elif s.name.startswith("expert/"):
            fn = expert
        elif s.name == "mopd":
            fn = mopd
        elif s.name.startswith("eval/") and s.name != "eval/warmup_mopd":
            fn = fixed
        out.append(Stage(s.name, s.settings, fn, deps=s.deps, out=s.out, always=s.always, resumable=s.resumable))
    return out


@pytest.mark.timeout(300)
def test_warmup_then_mopd_matches_plain_mopds_tokens_and_is_reported(tmp_path):
    cfg = load_config(PipelineConfig, TINY, OVERRIDES)
    plan = build_plan(cfg, tmp_path / "run")
    names = [s.name for s in plan.stages]
    assert names.index("mopd") < names.index("baseline/warmup") < names.index("baseline/warmup_mopd")
    assert "eval/warmup_mopd" in names and "eval/warmup" not in names
    outputs = StageRunner(plan.root).run(_stand_ins(plan))

    plain, warm, part = outputs["mopd"], outputs["baseline/warmup"], outputs["baseline/warmup_mopd"]
    T = plain["tokens"]
    assert plain["steps"] == 4 and T == 384
    # the warm-up: seq-KD for a quarter of plain MOPD's tokens, whole batches of 4 rows
    assert warm["budget_tokens"] == round(0.25 * T) and warm["rows"] % 4 == 0
    # the MOPD part starts from the warm-up's checkpoint
    cfg_used = (plan.root / "baselines" / "warmup_mopd" / "config.yaml").read_text()
    assert f"path: {warm['checkpoint']}" in cfg_used
    assert part["warmup_checkpoint"] == warm["checkpoint"]
    m = part["budget_match"]
    plain_per = [h["tokens"] for h in json.loads(Path(plain["history"]).read_text())]
    # the plan: the plain run's steps left after the warm-up's tokens land within half a step
    assert abs(m["warmup_tokens"] + m["mopd_tokens_planned"] - T) <= max(plain_per) / 2
    # the part stops at the first step whose tokens reach T - T_w, or at the plain run's 4 steps
    part_per = [h["tokens"] for h in json.loads(Path(part["history"]).read_text())]
    assert m["mopd_steps"] == part["steps"] == len(part_per) and 1 <= part["steps"] <= 4
    if part["steps"] < 4:
        assert 0 <= m["total_tokens"] - T < part_per[-1]
    assert m["total_tokens"] == warm["tokens"] + part["tokens"] and m["target_tokens"] == T
    assert m["relative_error"] == pytest.approx((m["total_tokens"] - T) / T, abs=1e-4)
    b = part["budget"]
    assert b["student_tokens"] == m["total_tokens"]
    assert b["teacher_tokens_generated"] == warm["tokens"] and b["teacher_tokens_scored"] == part["tokens"]
    assert b["flops"] == pytest.approx(warm["budget"]["flops"] + 10 * b["params"]["student"] * part["tokens"],
                                       rel=1e-9)   # tiny teacher = student shape: 2N + 2N + 6N per MOPD token

    report = json.loads((plan.root / "report.json").read_text())
    assert all(v is not None for v in report["scores"]["warmup_mopd"].values())
    rb = report["budgets"]["warmup_mopd"]
    secs = report["stage_seconds"]
    assert rb["seconds"] == pytest.approx(secs["baseline/warmup"] + secs["baseline/warmup_mopd"], abs=0.2)
    assert rb["match"]["total_tokens"] == m["total_tokens"]
    md = (plan.root / "report.md").read_text()
    assert "| seq-KD warm-up, then MOPD |" in md and "against plain MOPD's" in md
    assert (plan.root / "budgets.png").stat().st_size > 1000
