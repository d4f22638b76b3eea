"""The warm-up-then-MOPD variant's plan (its two stages, their deps and hashes), the steps
its MOPD part gets from the plain run's history, and its combined budget."""
from __future__ import annotations

from pathlib import Path

import pytest

from mopd.baselines.budget import mopd_budget, seq_kd_budget
from core.config import ConfigError, load_config
from pipeline.config import PipelineConfig
from pipeline.plan import build_plan
from pipeline.runner import StageRunner
from pipeline.stages.warmup_mopd import combine, rest_steps

# the warm-up variant is on in the full preset (off in tiny.yaml)
TINY = Path(__file__).resolve().parents[3] / "recipes/pipeline/full.yaml"


def _plan(tmp_path, *more):
    plan = build_plan(load_config(PipelineConfig, TINY, ["domains=[math]", "train.max_steps=3", *more]),
                      tmp_path / "run")
    return plan, {s.name: s for s in plan.stages}


def test_plan_has_the_warmup_then_the_mopd_part_evaluated_and_reported(tmp_path):
    _, st = _plan(tmp_path)
    w, p = st["baseline/warmup"], st["baseline/warmup_mopd"]
    # the warm-up is seq-KD with the baseline's settings and a share of MOPD's tokens
    assert w.settings["share"] == 0.2 and w.settings["lr"] == st["baseline/seq_kd"].settings["lr"]
    assert "share" not in st["baseline/seq_kd"].settings
    assert "mopd" in w.deps and w.out.name == "warmup"
    assert p.deps[:2] == ["baseline/warmup", "mopd"] and set(p.deps) >= {"expert/math/low/rl", "expert/math/high/rl"}
    assert p.resumable and p.out.name == "warmup_mopd"
    assert p.settings["model"]["path"] == "$WARMUP" and p.settings["loss"] == st["mopd"].settings["loss"]
    assert st["eval/warmup_mopd"].deps == ["baseline/warmup_mopd"] and "eval/warmup" not in st
    assert "baseline/warmup_mopd" in st["report"].deps


def test_share_changes_the_variant_only_and_disabling_drops_it(tmp_path):
    plan, _ = _plan(tmp_path)
    h1 = {s: h for s, h, _ in StageRunner(plan.root).plan(plan.stages)}
    plan2, _ = _plan(tmp_path, "baselines.warmup_mopd.share=0.5")
    h2 = {s: h for s, h, _ in StageRunner(plan2.root).plan(plan2.stages)}
    assert {s for s in h1 if h1[s] != h2[s]} == {"baseline/warmup", "baseline/warmup_mopd", "eval/warmup_mopd",
                                                 "report"}
    _, st = _plan(tmp_path, "baselines.warmup_mopd.enabled=false")
    assert not [s for s in st if "warmup" in s]
    # a seq-KD setting reaches the warm-up too (same code, same settings)
    plan3, _ = _plan(tmp_path, "baselines.seq_kd.lr=0.0005")
    h3 = {s: h for s, h, _ in StageRunner(plan3.root).plan(plan3.stages)}
    assert h3["baseline/warmup"] != h1["baseline/warmup"]


@pytest.mark.parametrize("share", ["0", "1", "-0.1", "1.5"])
def test_share_out_of_range_is_refused_when_loaded(share):
    with pytest.raises(ConfigError, match=r"baselines.warmup_mopd.share must be in \(0, 1\)"):
        load_config(PipelineConfig, TINY, [f"baselines.warmup_mopd.share={share}"])


def test_rest_steps_follow_the_plain_runs_cumulative_tokens():
    hist = [{"tokens": t} for t in (100, 80, 60, 60, 50)]     # 350 in all
    # 100 + 80 = 180 lands closest to 170: the part gets the last 3 steps, their 170 tokens
    assert rest_steps(hist, 5, 350, 170) == (3, 170)
    assert rest_steps(hist, 5, 350, 40) == (5, 350)           # closer to 0 than to 100: every step
    assert rest_steps(hist, 5, 350, 50) == (4, 250)           # a tie takes the later step
    assert rest_steps(hist, 5, 350, 1000) == (1, 50)          # at least one step
    # no per-step tokens: spread evenly (70 a step)
    assert rest_steps([{}] * 5, 5, 350, 140) == (3, 210)


def test_combined_budget_sums_both_parts():
    a = seq_kd_budget(n_student=10, n_teacher=20, tokens=30, rows=3)
    b = mopd_budget(n_student=10, n_teacher=20, tokens=70, on_policy_tokens=60, samples=7)
    c = combine(a, b)
    assert c["student_tokens"] == 100 and c["student_samples"] == 10 and c["student_tokens_sampled"] == 60
    assert c["teacher_tokens_generated"] == 30 and c["teacher_tokens_scored"] == 70
    assert c["flops"] == pytest.approx(a["flops"] + b["flops"])
    assert c["flops_terms"]["teacher_generation"] == 2 * 20 * 30
