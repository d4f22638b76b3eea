"""bench.horizon covers every multi-turn domain: each has an entry (data module, eval
module, horizons) and a MOPD recipe, recipes/mopd/<domain>.yaml, whose episodes are
played in the domain's own environment with the expert team's harness mix and tokens
per turn. A new agent domain without them fails here, not hours into a bench run."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from bench import horizon
from experts.registry import all_domains, is_agent_domain
from core.config import load_config
from mopd.distill import DistillConfig

REPO = Path(__file__).resolve().parents[3]
AGENT_DOMAINS = [d for d in all_domains() if is_agent_domain(d)]


def test_every_agent_domain_is_in_the_bench():
    assert {"agent", "coding_agent", "search_agent"} <= set(AGENT_DOMAINS)
    assert set(horizon.DOMAINS) == set(AGENT_DOMAINS)


@pytest.mark.parametrize("domain", AGENT_DOMAINS)
def test_domain_recipe_plays_the_domains_episodes(domain):
    from experts.run import ExpertConfig

    data_mod, eval_mod, horizons = horizon.DOMAINS[domain]
    assert callable(importlib.import_module(data_mod).make_dataset)
    assert callable(importlib.import_module(eval_mod).run_tasks)
    assert horizons == sorted(horizons) and horizons[0] >= 1
    cfg = load_config(DistillConfig, REPO / "recipes" / "mopd" / f"{domain}.yaml")
    assert set(cfg.agents) == {domain} and set(cfg.teachers) == {domain}
    a = cfg.agents[domain]
    assert a.env == f"rewards.{domain}:make_env"
    expert = load_config(ExpertConfig, REPO / "recipes" / "experts" / domain / "rl.yaml").agent
    assert (a.harnesses, a.max_new_tokens) == (expert.harnesses, expert.max_new_tokens)
    assert cfg.rollout.max_model_len >= a.max_context_tokens


def test_a_recipe_without_the_domain_is_refused(tmp_path, capsys):
    from core.tiny import build_tiny_model

    base = build_tiny_model(tmp_path / "base", seed=0)
    with pytest.raises(SystemExit):
        horizon.main(["--domain", "search_agent", "--recipe", "recipes/mopd/agent.yaml", "--base", str(base),
                      "--teacher", str(base), "--out", str(tmp_path / "out")])
    assert "has no agents.search_agent section" in capsys.readouterr().err
