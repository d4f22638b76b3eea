"""The two pipeline presets (issue 37): tiny.yaml, the README's main job, covers every
single-turn domain and one agent domain with every stage the README names (base, experts
SFT then RL, MOPD, seq-KD, weight average, evals, report); full.yaml plans every stage
the pipeline has (Mix-RL, warm-up -> MOPD, cascade RL, the extra seeds). Plans only:
nothing is trained."""
from __future__ import annotations

from pathlib import Path

import pytest

from core.config import ConfigError, load_config
from experts.registry import all_domains, is_agent_domain
from pipeline.config import PipelineConfig
from pipeline.plan import build_plan

REPO = Path(__file__).resolve().parents[3]
PRESETS = REPO / "recipes" / "pipeline"


def _stages(preset: str, tmp_path, *overrides) -> set[str]:
    cfg = load_config(PipelineConfig, PRESETS / preset, list(overrides))
    return {s.name for s in build_plan(cfg, tmp_path / "run").stages}


def test_tiny_covers_every_single_turn_domain_and_one_agent_domain(tmp_path):
    cfg = load_config(PipelineConfig, PRESETS / "tiny.yaml")
    known = all_domains(REPO / "recipes" / "experts")
    single = {d for d in known if not is_agent_domain(d)}
    assert single <= set(cfg.domains), f"tiny.yaml leaves out {sorted(single - set(cfg.domains))}"
    agents = [d for d in cfg.domains if is_agent_domain(d)]
    assert len(agents) == 1, agents
    assert not cfg.baselines.mix_rl.enabled and not cfg.baselines.warmup_mopd.enabled   # full.yaml's
    st = _stages("tiny.yaml", tmp_path)
    for d in [*single, *agents]:
        keys = ["math/low", "math/high"] if d == "math" else [d]
        for k in keys:
            assert {f"expert/{k}/sft", f"expert/{k}/rl", f"eval/teacher/{k}"} <= st, k
    assert {"base", "chat_rm", "mopd", "baseline/seq_kd", "baseline/weight_avg", "eval/base", "eval/student",
            "eval/seq_kd", "eval/weight_avg", "report"} <= st
    assert not any("mix_rl" in s or "warmup" in s or "cascade" in s or "seed" in s for s in st)


def test_full_plans_every_stage(tmp_path):
    st = _stages("full.yaml", tmp_path)
    assert {"data", "base", "chat_rm", "expert/kernel/rl", "expert/frontend/rl", "mopd", "baseline/seq_kd",
            "baseline/weight_avg", "baseline/mix_rl", "baseline/cascade_rl", "baseline/warmup",
            "baseline/warmup_mopd", "report"} <= st
    for seed in (1, 2):
        assert {f"mopd/seed{seed}", f"baseline/seq_kd/seed{seed}", f"baseline/mix_rl/seed{seed}"} <= st
    assert not any("agent" in s for s in st)    # domains: [] keeps to the single-turn ones


def test_tiny_sizes_domains_a_smoke_run_leaves_out_but_refuses_a_typo(tmp_path):
    # the README's smoke run: one domain, while tiny.yaml sizes kernel, frontend, coding_agent
    assert "expert/math/low/rl" in _stages("tiny.yaml", tmp_path, "domains=[math]", "train.max_steps=2")
    with pytest.raises(ConfigError, match="experts.domains.kernal: not a domain"):
        _stages("tiny.yaml", tmp_path, "domains=[math]", "experts.domains={kernal: {rl: [train.max_steps=2]}}")
