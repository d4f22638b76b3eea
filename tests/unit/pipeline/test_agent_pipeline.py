"""The pipeline with the `agent` domain: left out of the default run, included when named;
the base's positions cover the agent episodes only then; the MOPD stage keeps `agents`
(and per-domain rollout settings) for the selected domains only. Plans only, no training."""
from __future__ import annotations

from pathlib import Path

import pytest

from core.config import load_config
from pipeline.config import PipelineConfig
from pipeline.plan import build_plan, select
from pipeline.stages import base, experts, mopd

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "recipes" / "pipeline" / "tiny.yaml"


def _scope(tmp_path, *overrides):
    return select(load_config(PipelineConfig, TINY, list(overrides)), tmp_path / "run")


def _mopd_cfg(scope):
    return mopd.config(scope, experts.common_quant(experts.configs(scope)))


def test_default_run_leaves_agent_out_named_includes_it(tmp_path):
    default = _scope(tmp_path)
    assert "agent" not in default.domains and "math" in default.domains
    assert all(k.domain != "agent" for k in default.keys)
    named = _scope(tmp_path, "domains=[math, agent]")
    assert named.domains == ["math", "agent"] and [k.key for k in named.keys if k.domain == "agent"] == ["agent"]
    only = _scope(tmp_path, "domains=[agent]")
    assert only.domains == ["agent"]


def test_base_positions_fit_agent_episodes_only_when_agent_is_selected(tmp_path):
    plain = base.config(_scope(tmp_path, "domains=[math]"))
    recipe = load_config(base.BaseConfig, REPO / "recipes" / "base" / "tiny.yaml")
    assert plain.model.max_positions == recipe.model.max_positions   # untouched
    with_agent = base.config(_scope(tmp_path, "domains=[math, agent]"))
    assert with_agent.model.max_positions == 1536 > plain.model.max_positions   # the agent recipes' context
    assert "agent" in with_agent.data.domains   # the base pretrains on the agent format too
    # a base recipe that already has more positions keeps them
    big = base.config(_scope(tmp_path, "domains=[agent]", "base.overrides=[model.max_positions=4096]"))
    assert big.model.max_positions == 4096


def test_base_positions_follow_the_pipelines_expert_overrides(tmp_path):
    """An expert run with a longer context (set through the pipeline) needs a base with as
    many positions as the expert recipe would have with that override."""
    s = _scope(tmp_path, "domains=[agent]", "experts.domains={agent: {rl: [agent.max_context_tokens=2048]}}")
    assert experts.config(s, s.keys[0], "rl").agent.max_context_tokens == 2048
    assert base.config(s).model.max_positions == 2048
    s = _scope(tmp_path, "domains=[agent]", "experts.sft=[agent.max_context_tokens=1800]")
    assert base.config(s).model.max_positions == 1800
    # ... and the student's episodes in MOPD (it starts from the base too): the RL recipe's
    # agent section unless the MOPD recipe has its own agents entry
    s = _scope(tmp_path, "domains=[agent]", "experts.domains={agent: {rl: [agent.max_context_tokens=1900]}}")
    m = _mopd_cfg(s)
    assert m.agents["agent"].max_context_tokens == 1900 and m.rollout.max_model_len == 1900
    assert m.agents["agent"].env == "rewards.agent:make_env"
    s = _scope(tmp_path, "domains=[agent]",
               'mopd.overrides=["agents={agent: {harnesses: recipes/harnesses/agent.yaml, max_context_tokens: 2000}}", '
               '"rollout.max_model_len=2048"]')
    assert _mopd_cfg(s).agents["agent"].max_context_tokens == 2000
    assert base.config(s).model.max_positions == 2000


def test_mopd_keeps_agents_for_selected_domains_only(tmp_path):
    plain = _mopd_cfg(_scope(tmp_path, "domains=[math]"))
    assert plain.agents == {} and "agent" not in plain.rollout.by_domain and "agent" not in plain.data.mix
    cfg = _mopd_cfg(_scope(tmp_path, "domains=[math, agent]"))
    assert list(cfg.agents) == ["agent"]
    a = cfg.agents["agent"]
    assert a.env == "rewards.agent:make_env" and a.harnesses.endswith("harnesses/agent.yaml")
    assert a.max_context_tokens <= cfg.rollout.max_model_len
    # the recipe's top-level correct_below is for the single-turn rows: no agent override needed
    assert cfg.rollout.correct_below > 0 and "agent" not in cfg.rollout.by_domain
    assert set(cfg.data.mix) == {"math", "agent"}
    assert sorted(cfg.teachers) == ["agent", "math/high", "math/low"]


def test_plan_with_agent_wires_its_stages(tmp_path):
    plan = build_plan(load_config(PipelineConfig, TINY, ["domains=[math, agent]", "train.max_steps=2"]),
                      tmp_path / "run")
    st = {s.name: s for s in plan.stages}
    assert {"expert/agent/sft", "expert/agent/rl", "eval/teacher/agent"} <= set(st)
    assert st["expert/agent/rl"].deps == ["expert/agent/sft"]
    col = next(c for c in plan.columns if c.name == "agent")
    assert col.episode["max_context_tokens"] == 1536 and col.episode["max_turns"] >= 1
    assert all(c.episode == {} for c in plan.columns if c.name != "agent")
    assert "agents" in st["baseline/seq_kd"].settings   # the teacher plays episodes in seq-KD
    plain = build_plan(load_config(PipelineConfig, TINY, ["domains=[math]", "train.max_steps=2"]), tmp_path / "p")
    sp = {s.name: s for s in plain.stages}
    assert not any("agent" in n for n in sp)
    assert "agents" not in sp["baseline/seq_kd"].settings   # runs without agents hash as before
    assert sp["base"].settings != st["base"].settings


def test_unknown_domain_still_rejected(tmp_path):
    from core.config import ConfigError

    with pytest.raises(ConfigError, match="agnt"):
        _scope(tmp_path, "domains=[agnt]")
