"""Partial rollouts in the agent experts' RL stage (core/agent/grpo.py, issue #17 part 4):
GRPO groups carry over whole (a group is scored only once every member ended), every
token keeps its weights version and sampler log-prob, the update weights tokens by the
truncated importance ratio and drops those older than max_staleness; and 3 steps of the
shared RL loop (`rl_loop`, what experts/agent_expert.py runs for every agent domain)
with partial rollouts on, on a tiny model."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import core.agent.grpo as grpo
from core.agent.grpo import drop_groups, play_groups, policy_step, start_groups, train_groups
from core.agent.partial import AgentRLPartial, mask_stale, need_finished
from core.config import ConfigError, load_config
from core.rollout import Sample

pytestmark = pytest.mark.usefixtures("one_torch_thread")
KW = dict(temperature=1.0, top_p=1.0, max_turns=8, max_context_tokens=400, max_new_tokens=6)


def _kw(tok) -> dict:
    return {**KW, "eos_ids": {tok.eos_token_id}}


class Versioned:
    """A sampler whose every token has log-prob -(1 + version): a token's log-prob names
    the weights that sampled it."""

    def __init__(self, tok):
        self.tok, self.version = tok, 0

    def generate(self, prompts, *, max_new_tokens, temperature, top_p, seeds):
        ids = self.tok.encode("ok", add_special_tokens=False)[:max_new_tokens - 1] + [self.tok.eos_token_id]
        return [Sample(prompt_ids=list(p), completion_ids=list(ids), sampler_logprobs=[-1.0 - self.version] * len(ids),
                       finished=True) for p in prompts]


class TurnsEnv:
    """Done after the task's `turns` student turns, reward `reward`; closes are logged."""

    def __init__(self, closed=None):
        self.closed_log, self.seen = closed, 0

    def reset(self, task):
        self.task, self.seen = task, 0
        return f"task {task['id']}"

    def step(self, text):
        self.seen += 1
        if self.seen >= self.task["turns"]:
            return "", True, {"success": True, "reward": float(self.task.get("reward", 1.0))}
        return f"result {self.seen}", False, {"obs_role": "tool"}

    def close(self):
        if self.closed_log is not None:
            self.closed_log.append(self.task["id"])


def _groups(tok, tasks, G=2, step=1, closed=None):
    envs = [TurnsEnv(closed) for _ in range(len(tasks) * G)]
    return start_groups(tok, tasks, envs, list(range(len(envs))), G, max_context_tokens=400, max_new_tokens=6,
                        step=step)


def _student(ep):
    """(version, sampler log-prob) of each student token of an episode."""
    return [(v, lp) for seg, vs in zip(ep.segments, ep.versions)
            for m, v, lp in zip(seg.loss_mask, vs, seg.sampler_logprobs) if m]


# ------------------------------------------------------------------ groups carry over whole
def test_a_group_carries_over_until_every_member_ended(tiny_tokenizer):
    tok = tiny_tokenizer
    roll = Versioned(tok)
    closed: list = []
    # group "a": both members end after 1 turn; group "b": 1 turn for the task, so both
    # end at once too; group "c": 3 turns. Members of a group share the task.
    tasks = [{"id": "a", "turns": 1}, {"id": "b", "turns": 1}, {"id": "c", "turns": 3}, {"id": "d", "turns": 3}]
    groups = _groups(tok, tasks, closed=closed)
    # mix lengths inside group "d": its second member's task says 1 turn
    groups[3].runs[1].env.task = {"id": "d", "turns": 1}
    done, rest, n_tok = play_groups(roll, tok, groups, version=0, min_finished=0.5, **_kw(tok))
    assert [g.task["id"] for g in done] == ["a", "b"] and [g.task["id"] for g in rest] == ["c", "d"]
    assert n_tok > 0
    # "d" is carried whole although one member ended: its advantages need both rewards
    assert rest[1].runs[1].done and not rest[1].runs[0].done and not rest[1].done
    # ended episodes released their environments, the carried ones keep them
    assert sorted(closed) == ["a", "a", "b", "b", "d"]
    # the next step: new weights, the carried groups first, then two new ones
    roll.version = 1
    new = _groups(tok, [{"id": "e", "turns": 1}, {"id": "f", "turns": 1}], step=2, closed=closed)
    done2, rest2, _ = play_groups(roll, tok, rest + new, version=1, **_kw(tok))   # min_finished 1: to the end
    assert [g.task["id"] for g in done2] == ["c", "d", "e", "f"] and rest2 == []
    c = done2[0].runs[0].ep
    # each token kept the version that sampled it and that version's log-prob
    versions = sorted({v for v, _ in _student(c)})
    assert versions == [0, 1]
    assert all(lp == -1.0 - v for v, lp in _student(c))
    assert c.turns == 3


def test_need_finished_and_the_token_budget(tiny_tokenizer):
    assert need_finished(0.5, 5) == 3 and need_finished(0.01, 4) == 1 and need_finished(1.0, 0) == 0
    tok = tiny_tokenizer
    groups = _groups(tok, [{"id": "x", "turns": 5}, {"id": "y", "turns": 5}])
    done, rest, n_tok = play_groups(Versioned(tok), tok, groups, version=0, min_finished=1.0, max_tokens=1, **_kw(tok))
    assert done == [] and len(rest) == 2 and all(r.turn == 1 for g in rest for r in g.runs)   # one round, then stop
    assert drop_groups(rest) == 4 and rest == []


# ------------------------------------------------------------------ the update
def test_train_groups_masks_stale_tokens_and_counts_ages(tiny_student_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer
    roll = Versioned(tok)
    groups = _groups(tok, [{"id": "c", "turns": 3, "reward": 1.0}], G=2)
    groups[0].runs[1].env.task = {"id": "c", "turns": 3, "reward": 0.0}   # the group's two rewards differ
    rest = groups
    for v in range(3):   # one turn per step: versions 0, 1, 2
        roll.version = v
        done, rest, _ = play_groups(roll, tok, rest, version=v, max_tokens=1, **_kw(tok))
    assert done and done[0].done
    model = AutoModelForCausalLM.from_pretrained(str(tiny_student_dir), dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    # trained with the weights of version 3: ages 3, 2, 1; max_staleness 1 keeps only age 1
    m = train_groups(model, opt, tok, done, scale="none", epsilon=0.2, grad_clip=1.0, version=3, max_staleness=1,
                     is_truncation=2.0)
    assert m["updated"] == 1.0 and m["groups"] == 1.0 and m["reward"] == pytest.approx(0.5)
    assert m["token_age_mean"] == pytest.approx(2.0)
    assert m["token_age/age_1"] == pytest.approx(1 / 3) and m["token_age/age_2"] == pytest.approx(1 / 3)
    assert m["token_age/age_3plus"] == pytest.approx(1 / 3) and m["token_age/age_0"] == 0.0
    assert m["stale_masked_share"] == pytest.approx(2 / 3)
    # the episode itself is not changed: its own loss mask still covers every student token
    assert sum(done[0].runs[0].ep.segments[0].loss_mask) == len(_student(done[0].runs[0].ep))
    # max_staleness 5: nothing masked; without it (partial off) no age metrics at all
    m5 = train_groups(model, opt, tok, done, scale="none", epsilon=0.2, grad_clip=1.0, version=3, max_staleness=5)
    assert m5["stale_masked_share"] == 0.0
    m_off = train_groups(model, opt, tok, done, scale="none", epsilon=0.2, grad_clip=1.0, version=3)
    assert "token_age_mean" not in m_off and m_off["updated"] == 1.0
    # every token too old: nothing to train, no optimizer step
    m0 = train_groups(model, opt, tok, done, scale="none", epsilon=0.2, grad_clip=1.0, version=9, max_staleness=0)
    assert m0["updated"] == 0.0 and m0["stale_masked_share"] == 1.0


def test_mask_stale_is_shared_with_the_mopd_loop():
    from mopd.distill import agents as A

    assert A.mask_stale is mask_stale   # one implementation for both loops
    smp = Sample(prompt_ids=[1], completion_ids=[5, 6, 7], sampler_logprobs=[0.0] * 3, finished=True,
                 loss_mask=[1, 0, 1])
    (out,), stats = mask_stale([smp], [[0, -1, 2]], [""], [2], 1, [""])
    assert out.loss_mask == [0, 0, 1] and smp.loss_mask == [1, 0, 1]
    assert stats[""][:3] == [2.0, 2.0, 1.0]


def _segment(tok, lp_shift: float, model):
    """A segment whose sampler log-probs are the model's own plus `lp_shift`."""
    from core.models import completion_logprobs
    from core.agent.sft import masked_batch

    p = tok.encode("hello there", add_special_tokens=False)
    c = tok.encode(" general kenobi", add_special_tokens=False)
    with torch.no_grad():
        lp = completion_logprobs(model, masked_batch([(p, c, [1] * len(c))], tok.pad_token_id))[0].tolist()
    return Sample(prompt_ids=p, completion_ids=c, sampler_logprobs=[x + lp_shift for x in lp], finished=True,
                  loss_mask=[1] * len(c))


def test_policy_step_truncated_importance_weight(tiny_student_dir, tiny_tokenizer):
    """is_truncation C: a token of the current weights trains as without it; a token whose
    sampler gave it far less probability (old weights) is weighted min(ratio, C) = C."""
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer

    def loss(shift, **kw):
        model = AutoModelForCausalLM.from_pretrained(str(tiny_student_dir), dtype=torch.float32)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        seg = _segment(tok, shift, model)
        return policy_step(model, opt, tok, [(seg, 1.0)], epsilon=0.2, grad_clip=1e9, **kw)

    fresh, fresh_is = loss(0.0), loss(0.0, is_truncation=2.0)
    assert fresh_is["loss"] == pytest.approx(fresh["loss"], rel=1e-5)
    assert fresh_is["grad_norm"] == pytest.approx(fresh["grad_norm"], rel=1e-4)
    assert fresh_is["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    old = loss(-5.0, is_truncation=2.0)   # ratio e^5, truncated at 2
    assert old["is_weight_mean"] == pytest.approx(2.0)
    assert old["loss"] == pytest.approx(2.0 * fresh["loss"], rel=1e-5)
    assert old["grad_norm"] == pytest.approx(2.0 * fresh["grad_norm"], rel=1e-4)
    # without the correction PPO's clip would zero this token's gradient (ratio e^5 > 1 + eps)
    assert loss(-5.0)["grad_norm"] == pytest.approx(0.0, abs=1e-8)


# ------------------------------------------------------------------ config
def test_partial_config_defaults_off_and_is_checked(tmp_path):
    from experts.run import ExpertConfig

    assert AgentRLPartial().enabled is False
    for bad, msg in (({"min_finished": 0.0}, "min_finished"), ({"max_tokens": -1}, "max_tokens"),
                     ({"max_staleness": -1}, "max_staleness"), ({"is_truncation": 0.0}, "is_truncation")):
        with pytest.raises(ValueError, match=msg):
            AgentRLPartial(**bad).validate()
    recipe = "recipes/experts/agent/rl.yaml"
    cfg = load_config(ExpertConfig, recipe, ["agent.partial.enabled=true", "agent.partial.min_finished=0.5"])
    assert cfg.agent.partial.enabled and cfg.agent.partial.min_finished == 0.5
    assert load_config(ExpertConfig, recipe).agent.partial.enabled is False
    with pytest.raises(ConfigError, match="min_finished"):
        load_config(ExpertConfig, recipe, ["agent.partial.min_finished=2"])


# ------------------------------------------------------------------ e2e: 3 steps of the RL loop
def test_rl_loop_three_steps_with_partial_rollouts(tiny_student_dir, tiny_tokenizer, monkeypatch):
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer
    model = AutoModelForCausalLM.from_pretrained(str(tiny_student_dir), dtype=torch.float32)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    logged: list[tuple[int, dict]] = []
    monkeypatch.setattr(grpo, "log_metrics", lambda step, m: logged.append((step, dict(m))))
    closed: list = []
    # one task in three takes two turns
    tasks = [{"id": f"t{i}", "turns": 2 if i % 3 == 0 else 1} for i in range(9)]
    made = []

    def new_env(task, rng):
        env = TurnsEnv(closed)
        orig, k = env.reset, len(made)

        def reset(t):   # the two members of a group score 0 and 1: every group has a signal
            return orig({**t, "reward": float(k % 2)})
        env.reset = reset
        made.append(env)
        return env

    cfg = SimpleNamespace(
        rl=SimpleNamespace(num_generations=2, temperature=1.0, scale_rewards="group", epsilon=0.2),
        agent=SimpleNamespace(max_turns=4, max_context_tokens=400, max_new_tokens=6,
                              partial=AgentRLPartial(enabled=True, min_finished=0.3, max_staleness=1)),
        train=SimpleNamespace(seed=0, lr=1e-3, weight_decay=0.0, max_steps=3, warmup_steps=0, lr_schedule="constant",
                              batch_size=3, grad_clip=1.0, logging_steps=1))
    out = grpo.rl_loop(cfg, model, tok, tasks, new_env, "test")
    assert out is model and [s for s, _ in logged] == [1, 2, 3]
    ms = [m for _, m in logged]
    assert all("carried_over" in m and "carried_over_groups" in m for m in ms)
    assert any(m["carried_over_groups"] > 0 for m in ms)            # long groups carried over
    assert any(m.get("token_age/age_1", 0) > 0 for m in ms)          # and trained one version later
    assert all(math.isfinite(m["loss"]) for m in ms if "loss" in m)
    assert any(not torch.equal(before[k], v) for k, v in model.named_parameters())
    # every environment was released: ended, or dropped in flight at the end
    assert len(closed) == len(made)


def test_the_agent_experts_rl_stage_runs_three_steps_with_partial_rollouts(tmp_path_factory, monkeypatch):
    """The agent domain's TRAINER.train_rl (experts/agent_expert.py) from the domain's rl recipe with agent.partial on."""
    from experts import registry
    from experts.agent.data import TRAINER as T
    from experts.run import ExpertConfig, build_dataset, load_model
    from core.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path_factory.mktemp("agent_rl_partial") / "base", seed=0,
                                 max_position_embeddings=1536)
    cfg = load_config(ExpertConfig, "recipes/experts/agent/rl.yaml", [
        f"model.path={model_dir}", f"model.base={model_dir}", "train.max_steps=3", "data.n_train=8",
        "train.batch_size=2", "rl.num_generations=2", "agent.max_turns=2", "agent.max_new_tokens=8",
        "train.logging_steps=1", "data.difficulty=1", "agent.partial.enabled=true", "agent.partial.min_finished=0.5"])
    model, tok = load_model(cfg)
    ds = build_dataset(cfg, registry.load_domain("agent"), "train", cfg.data.n_train)
    real, calls, logged = grpo.play_groups, [], []

    def graded(rollout, tokenizer, groups, **kw):   # a random model never succeeds: grade every other episode 1
        done, rest, n = real(rollout, tokenizer, groups, **kw)
        for i, r in enumerate(x for g in done for x in g.runs):
            r.ep.reward = float(i % 2)
        calls.append(kw)
        return done, rest, n

    monkeypatch.setattr(grpo, "play_groups", graded)
    monkeypatch.setattr(grpo, "log_metrics", lambda step, m: logged.append((step, dict(m))))
    T.train_rl(cfg, None, model, tok, ds, tmp_path_factory.mktemp("out"))
    assert [kw["min_finished"] for kw in calls] == [0.5] * 3 and [s for s, _ in logged] == [1, 2, 3]
    assert all("carried_over_groups" in m for _, m in logged)
    assert any("token_age_mean" in m and "is_weight_mean" in m for _, m in logged)
