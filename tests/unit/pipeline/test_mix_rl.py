"""Mix-RL and the budgets: the FLOPs estimate from model shapes, the sample budget as GRPO
steps, the prompt phases (joint and cascade), the reward routing by domain, the settings
taken from the RL expert recipes, and the stages' place in the plan."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mopd.baselines.budget import (budget, checkpoint_params, matmul_params, mopd_budget, no_training_budget,
                                   rl_budget, seq_kd_budget)
from mopd.baselines.mix_rl import RoutedReward, plan_phases, rl_prompts, rl_steps
from core.config import ConfigError, load_config
from pipeline.config import PipelineConfig
from pipeline.plan import build_plan

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "recipes/pipeline/full.yaml"   # Mix-RL is on in the full preset (off in tiny.yaml)


# ----------------------------------------------------------------------------- FLOPs
def _qwen(tie: bool):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=1, num_key_value_heads=1, tie_word_embeddings=tie)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("tie", [False, True])
def test_matmul_params_leave_the_embedding_lookup_out(tie):
    m = _qwen(tie)
    # per layer: q, k, v (with biases), o; gate, up, down; two norms; then the final norm and the head
    layer = (64 * 64 + 64) * 3 + 64 * 64 + 3 * 64 * 128 + 2 * 64
    assert matmul_params(m) == 2 * layer + 64 + 100 * 64
    every = sum(p.numel() for p in m.parameters())
    assert matmul_params(m) == (every if tie else every - 100 * 64)


def test_checkpoint_params_read_the_shapes_only(tmp_path):
    from core.tiny import build_tiny_model

    path = build_tiny_model(tmp_path / "m", seed=0)
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert checkpoint_params(path) == matmul_params(m) > 0
    with pytest.raises(ValueError, match="no config.json"):
        checkpoint_params(tmp_path)


def test_budget_formula_per_method():
    N, T = 1_000, 500
    m = mopd_budget(n_student=N, n_teacher=3 * N, tokens=T, on_policy_tokens=400, samples=10)
    # the student samples 400 of its tokens (the rest are references), a teacher scores all 500
    assert m["flops_terms"] == {"student_sampling": 2 * N * 400, "teacher_generation": 0.0,
                                "teacher_scoring": 2 * 3 * N * T, "reference_forward": 0.0,
                                "student_update": 6 * N * T}
    assert m["flops"] == sum(m["flops_terms"].values())
    assert (m["teacher_tokens_scored"], m["teacher_tokens_generated"], m["student_samples"]) == (T, 0, 10)
    s = seq_kd_budget(n_student=N, n_teacher=3 * N, tokens=T, rows=7)
    assert s["flops"] == 2 * 3 * N * T + 6 * N * T and s["teacher_tokens_generated"] == T
    assert s["teacher_tokens_scored"] == 0
    r = rl_budget(n_student=N, tokens=T, samples=16)
    assert r["flops"] == 8 * N * T and r["teacher_tokens_generated"] == r["teacher_tokens_scored"] == 0
    assert rl_budget(n_student=N, tokens=T, samples=16, beta=0.04)["flops"] == 10 * N * T   # + the reference
    assert no_training_budget(N)["flops"] == 0
    with pytest.raises(ValueError, match="n_teacher"):
        budget(n_student=N, student_tokens=T, teacher_scored=T)
    with pytest.raises(ValueError, match="student_tokens"):
        budget(n_student=N, student_tokens=-1)


# ----------------------------------------------------------------------------- phases and rewards
@dataclass
class P:
    index: int
    domain: str
    messages: list = field(default_factory=list)
    columns: dict = field(default_factory=dict)


def _stream():
    i = 0
    while True:   # a, a, b, a, a, b, ...
        d = "b" if i % 3 == 2 else "a"
        yield P(i, d, [{"role": "user", "content": str(i)}], {"domain": d})
        i += 1


def test_rl_steps_round_to_the_nearest_whole_step():
    assert rl_steps(128, 8, 8) == 2 and rl_steps(100, 8, 8) == 2 and rl_steps(90, 8, 8) == 1
    assert rl_steps(1, 8, 8) == 1
    with pytest.raises(ValueError):
        rl_steps(0, 8, 8)


def test_plan_phases_joint_and_cascade():
    [(name, ps)] = plan_phases(_stream(), ["a", "b"], 64, batch_size=4, num_generations=4)
    assert name == "mix" and [p.index for p in ps] == list(range(16))    # the stream's order, its mix
    phases = plan_phases(_stream(), ["b", "a"], 64, batch_size=4, num_generations=4, cascade=True)
    assert [n for n, _ in phases] == ["b", "a"]
    assert [len(ps) for _, ps in phases] == [8, 8]       # 32 samples each: 2 steps of 4 prompts x 4
    assert all(p.domain == "b" for p in phases[0][1]) and all(p.domain == "a" for p in phases[1][1])
    with pytest.raises(ValueError, match="of domains"):
        rl_prompts(iter([P(0, "a")] * 5), 3, {"c"})


def test_routed_reward_calls_each_domain_with_its_own_rows_and_columns():
    rows = [P(0, "a", columns={"domain": "a", "answer": "1"}), P(1, "b", columns={"domain": "b", "tests": [1, 2]}),
            P(2, "a", columns={"domain": "a", "answer": "3"})]
    calls = {}

    def ra(prompts, completions, answer, domain, **_):
        calls["a"] = (list(prompts), list(answer), list(domain))
        return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]

    def rb(prompts, completions, tests, **_):
        calls["b"] = (list(prompts), tests)
        return [None]

    logged = []
    r = RoutedReward(rows, {"a": ra, "b": rb})
    out = r(["p0", "p1", "p2", "p0"], ["1", "x", "0", "2"], row=[0, 1, 2, 0],
            completion_ids=[[1, 2], [3], [4, 5, 6], [7]],
            log_metric=lambda k, v: logged.append((k, v)), trainer_state=None)
    assert out == [1.0, None, 0.0, 0.0]
    assert calls["a"] == (["p0", "p2", "p0"], ["1", "3", "1"], ["a", "a", "a"])
    assert calls["b"] == (["p1"], [[1, 2]])          # only its rows, only its columns
    assert (r.samples, r.tokens) == (4, 7)
    assert logged == [("reward/a", pytest.approx(1 / 3))]
    with pytest.raises(ValueError, match="no reward for domains"):
        RoutedReward(rows, {"a": ra})


# ----------------------------------------------------------------------------- the plan
def _plan(tmp_path, *overrides):
    cfg = load_config(PipelineConfig, TINY, ["domains=[math,tool_use]", "train.max_steps=6", "extra_seeds=[]",
                                             "baselines.cascade_rl.enabled=false", *overrides])
    plan = build_plan(cfg, tmp_path / "run")
    return plan, {s.name: s for s in plan.stages}


def test_mix_rl_stage_settings_come_from_the_rl_recipes_and_mopd(tmp_path):
    plan, st = _plan(tmp_path)
    s = st["baseline/mix_rl"]
    assert s.deps == ["data", "base"]                      # no teacher: RL needs none
    rl = s.settings["rl"]
    # the math recipes sample 48 tokens, tool_use 64: one run samples every domain, so the longest
    assert rl["max_completion_length"] == 64
    assert (rl["lr"], rl["batch_size"], rl["num_generations"], rl["beta"]) == (5e-5, 8, 8, 0.0)
    # MOPD: ceil(6 / 4 minibatches) = 2 sampled batches of 128 prompts x 1 sample
    assert s.settings["n_samples"] == 256 and s.settings["start"] == "$OUT/base/model"
    assert s.settings["domains"] == ["math", "tool_use"] and s.settings["skipped_domains"] == []
    assert [d["path"] for d in s.settings["prompts"]["data"]["datasets"]] == [
        "$OUT/data/math-low", "$OUT/data/math-high", "$OUT/data/tool_use"]
    assert "eval/mix_rl" in st and st["eval/mix_rl"].deps == ["baseline/mix_rl"]
    assert "baseline/mix_rl" in st["report"].deps and "base" in st["report"].deps
    assert "baseline/cascade_rl" not in st

    # a setting given wins; a majority of recipes decides a null one
    _, st2 = _plan(tmp_path, "baselines.mix_rl.lr=0.001", "baselines.mix_rl.n_samples=64",
                   "experts.domains={tool_use: {rl: [train.lr=0.01]}}")
    assert st2["baseline/mix_rl"].settings["rl"]["lr"] == 0.001
    assert st2["baseline/mix_rl"].settings["n_samples"] == 64
    _, st3 = _plan(tmp_path, "experts.domains={math: {rl: [rl.num_generations=4]}}")
    assert st3["baseline/mix_rl"].settings["rl"]["num_generations"] == 4     # math/low and math/high: 2 of 3


def test_cascade_rl_stage_and_its_order(tmp_path):
    _, st = _plan(tmp_path, "baselines.cascade_rl.enabled=true", "baselines.mix_rl.enabled=false",
                  "baselines.cascade_rl.order=[tool_use,math]")
    assert "baseline/mix_rl" not in st and st["baseline/cascade_rl"].settings["cascade"] == ["tool_use", "math"]
    assert "eval/cascade_rl" in st
    with pytest.raises(ConfigError, match="cascade_rl.order"):
        _plan(tmp_path, "baselines.cascade_rl.enabled=true", "baselines.cascade_rl.order=[math]")


def test_mix_rl_with_chat_waits_for_the_reward_model_and_scores_with_it(tmp_path):
    recipes = tmp_path / "recipes"
    (recipes / "chat").mkdir(parents=True)
    common = ("domain: chat\nmodel: {path: runs/base/model}\neval: {max_new_tokens: 40}\n"
              "quant: {enabled: true, group_size: 32, convention: llm-compressor}\n")
    (recipes / "chat" / "sft.yaml").write_text(common + "stage: sft\n")
    (recipes / "chat" / "rl.yaml").write_text(common + "stage: rl\nrl: {reward_kwargs: {reward_model: x}}\n")
    cfg = load_config(PipelineConfig, TINY, [f"experts.recipes={recipes}", "train.max_steps=2"])
    st = {s.name: s for s in build_plan(cfg, tmp_path / "run").stages}
    s = st["baseline/mix_rl"]
    assert "chat_rm" in s.deps and s.settings["reward_kwargs"] == {"chat": {"reward_model": "$OUT/chat_rm"}}


def test_mix_rl_leaves_agent_domains_out_and_refuses_a_run_of_agents_only(tmp_path):
    _, st = _plan(tmp_path, "domains=[math,agent]")
    s = st["baseline/mix_rl"]
    assert s.settings["domains"] == ["math"] and s.settings["skipped_domains"] == ["agent"]
    assert all("agent" not in d["path"] for d in s.settings["prompts"]["data"]["datasets"])
    assert "agent" not in s.settings["prompts"]["data"]["mix"]
    with pytest.raises(ConfigError, match="no single-turn domain"):
        _plan(tmp_path, "domains=[agent]")
    _, st = _plan(tmp_path, "domains=[agent]", "baselines.mix_rl.enabled=false")
    assert "baseline/mix_rl" not in st


@pytest.mark.parametrize("override,msg", [
    ("baselines.mix_rl.num_generations=1", "baselines.mix_rl.num_generations must be >= 2"),
    ("baselines.mix_rl.lr=0", "baselines.mix_rl.lr must be > 0"),
    ("baselines.mix_rl.n_samples=-1", "baselines.mix_rl.n_samples must be >= 0"),
])
def test_mix_rl_settings_are_checked_when_loaded(override, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(PipelineConfig, TINY, [override])


def test_cascade_runs_one_grpo_phase_per_domain_from_the_previous_model(tmp_path):
    """Two phases (domain a, then b) of one step each on a tiny model: each phase samples and
    scores its own domain's rows only, and the exported model is no longer the start."""
    import torch
    from transformers import AutoModelForCausalLM

    from mopd.baselines.mix_rl import mix_rl
    from core.tiny import build_tiny_model

    start = build_tiny_model(tmp_path / "start", seed=0)
    seen = []

    def reward(dom):
        def fn(prompts, completions, domain, **_):
            seen.append((dom, set(domain)))
            # TRL hands each group's completions side by side: 0, 1 in every group, so GRPO has a gradient
            return [float(i % 2) for i in range(len(completions))]
        return fn

    phases = plan_phases(_stream(), ["a", "b"], 8, batch_size=2, num_generations=2, cascade=True)
    s = mix_rl(start, phases, {"a": reward("a"), "b": reward("b")}, tmp_path / "out", lr=1e-2, batch_size=2,
               num_generations=2, max_completion_length=4, progress=False, logging_steps=1)
    assert [(p["name"], p["steps"], p["samples"]) for p in s["phases"]] == [("a", 1, 4), ("b", 1, 4)]
    assert seen == [("a", {"a"}), ("b", {"b"})]
    assert s["samples"] == 8 and 0 < s["tokens"] <= 8 * 4
    a = AutoModelForCausalLM.from_pretrained(str(start), dtype=torch.float32).state_dict()
    b = AutoModelForCausalLM.from_pretrained(s["checkpoint"], dtype=torch.float32).state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "out" / "history.json").is_file() and not (tmp_path / "out" / "trainer").exists()
