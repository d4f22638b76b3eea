"""evals/agent.py: greedy held-out episodes through the train harnesses and, reported
beside them, the held-out harness; episode_stats arithmetic; the eval column of the agent
domain carries its recipe's episode settings to evaluate()."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from evals import agent as A
from evals.run import EvalColumn, _eval_kwargs, column_from_config, columns_for, evaluate_model
from experts.run import ExpertConfig
from core.agent.episode import Episode
from core.config import load_config
from core.tiny import build_tiny_model, load_tokenizer

REPO = Path(__file__).resolve().parents[3]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("agent_eval") / "m", seed=0, max_position_embeddings=1536)


def _ep(success=False, failed_calls=0, turns=1, cut=None, env_error=None):
    return Episode("t", "h", turns=turns, failed_calls=failed_calls, success=success, cut=cut, env_error=env_error,
                   reward=float(success))


def test_episode_stats_arithmetic():
    eps = [_ep(success=True, turns=3), _ep(success=True, failed_calls=2, turns=5),
           _ep(failed_calls=1, turns=2, cut="max_turns"), _ep(turns=2, env_error="boom")]
    s = A.episode_stats(eps)
    cost = s.pop("cost")
    assert s == {"success": 0.5, "failed_call_share": 0.5, "recovery_rate": 0.5, "turns": 3.0, "cut": 0.25,
                 "env_errors": 0.25, "n": 4}
    assert cost["turns"] == {"mean": 3.0, "p90": 5} and cost["n"] == 4
    assert A.episode_stats([_ep(success=True)])["recovery_rate"] is None   # no failed call: nothing to recover
    empty = A.episode_stats([])
    assert empty["n"] == 0 and empty["success"] == 0.0 and empty["recovery_rate"] is None


def test_evaluate_on_a_tiny_model(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    res = A.evaluate(model, n=3, difficulty=2, max_turns=2, max_new_tokens=8, tokenizer=load_tokenizer())
    assert {"score", "held_out", "train_harness", "held_out_harness", "n", "domain"} <= set(res)
    assert res["domain"] == "agent" and res["n"] == 3
    assert 0.0 <= res["score"] <= 1.0 and 0.0 <= res["held_out"] <= 1.0
    for stats in (res["train_harness"], res["held_out_harness"]):
        assert stats["n"] == 3 and 1.0 <= stats["turns"] <= 2.0
        for k in ("success", "failed_call_share", "cut", "env_errors"):
            assert 0.0 <= stats[k] <= 1.0, k
    assert res["score"] == res["train_harness"]["success"] and res["held_out"] == res["held_out_harness"]["success"]
    assert res["held_out_novel"] == res["held_out"] and res["held_out_combo"] == res["held_out_combo_harness"]["success"]
    assert res["held_out_combo_harness"]["n"] == 3
    # a random model does not solve horizon-2 tasks in 2 turns (2 calls + the answer take 3)
    assert res["score"] == 0.0
    no_ho = A.evaluate(model, n=3, difficulty=2, max_turns=2, max_new_tokens=8, tokenizer=load_tokenizer(),
                       held_out=False)
    assert no_ho["held_out"] is None and no_ho["train_harness"] == res["train_harness"]   # greedy: the same


def test_evaluate_rejects_what_it_cannot_score(model_dir):
    with pytest.raises(ValueError, match="efforts"):
        A.evaluate(str(model_dir), n=1, effort="high")
    with pytest.raises(ValueError, match="procedural"):
        A.evaluate(str(model_dir), n=1, dataset="bfcl_multi_turn")
    with pytest.raises(ValueError, match="unknown settings"):
        A.evaluate(str(model_dir), n=1, reward_model="x")


def test_agent_column_carries_the_recipe_episode_settings():
    rcfg = load_config(ExpertConfig, REPO / "recipes" / "experts" / "agent" / "rl.yaml",
                       ["agent.max_turns=5", "agent.max_context_tokens=900"])
    col = column_from_config("agent", rcfg, n=7)
    assert col.domain == "agent" and col.n == 7
    assert col.episode == {"harnesses": rcfg.agent.harnesses, "max_turns": 5, "max_context_tokens": 900}
    kw = _eval_kwargs(col)
    assert kw["max_turns"] == 5 and kw["max_context_tokens"] == 900 and kw["harnesses"] == rcfg.agent.harnesses
    assert "effort" not in kw and "dataset" not in kw
    # every keyword is one evaluate() takes
    import inspect

    assert set(kw) <= set(inspect.signature(A.evaluate).parameters)
    # single-turn domains get none of it
    math = columns_for(["math"])
    assert all(c.episode == {} for c in math)
    assert not {"max_turns", "harnesses", "max_context_tokens"} & set(_eval_kwargs(math[0]))


def test_evaluate_model_scores_the_agent_column_and_its_held_out_harness(model_dir):
    col, = columns_for(["agent"], n=2, max_new_tokens={"agent": 8}, recipe_overrides={
        "agent": ["agent.max_turns=2", "data.difficulty=2"]})
    assert isinstance(col, EvalColumn) and col.episode["max_turns"] == 2
    scores, cost = evaluate_model(str(model_dir), [col], progress=False, with_cost=True)
    assert set(scores) == set(cost) == {"agent", "agent/held_out_combo", "agent/held_out_novel"}
    for c in cost.values():   # per episode: the model's tokens, its turns (<= max_turns) and tool calls
        assert c["n"] == 2 and 1 <= c["turns"]["mean"] <= c["turns"]["p90"] <= 2
        assert 1 <= c["tokens"]["mean"] <= c["tokens"]["p90"] <= 2 * 8 and c["tool_calls"]["p90"] >= 0
    assert all(0.0 <= v <= 1.0 for v in scores.values())
    with pytest.raises(ValueError, match="agent domains are scored by episodes"):
        evaluate_model(str(model_dir), [col], backend="vllm", progress=False)
