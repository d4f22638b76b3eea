"""experts/agent_expert.py on the agent domain: the agent expert's own SFT (oracle episodes, loss on the
assistant's tokens) and multi-turn GRPO, two steps each on a tiny model from the domain's
recipes; GRPO's group advantages; the registry finds the domain's trainer."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from experts import registry
from experts.agent.data import TRAINER as T
from experts.run import ExpertConfig, build_dataset, load_model, train
from core.agent.grpo import group_advantages
from core.agent.transcript import encode_transcript
from core.config import load_config
from core.tiny import build_tiny_model

REPO = Path(__file__).resolve().parents[3]
SMALL = ["train.max_steps=2", "data.n_train=8", "train.batch_size=2", "rl.num_generations=2", "agent.max_turns=2",
         "agent.max_new_tokens=8", "train.logging_steps=1"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("agent_expert") / "base", seed=0, max_position_embeddings=1536)


def _cfg(stage, model_dir, *extra):
    return load_config(ExpertConfig, REPO / "recipes" / "experts" / "agent" / f"{stage}.yaml",
                       [f"model.path={model_dir}", f"model.base={model_dir}", *SMALL, *extra])


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _changed(before, model):
    return [k for k, v in model.named_parameters() if not torch.equal(before[k], v.detach())]


# ----------------------------------------------------------------------------- group advantages
def test_group_advantages():
    assert group_advantages([1.0, 1.0, 0.0, 0.0], 2, "group") == [0.0, 0.0, 0.0, 0.0]   # equal rewards: no signal
    a = group_advantages([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], 3, "group")
    for g in (a[:3], a[3:]):
        assert sum(g) == pytest.approx(0.0, abs=1e-6)
        assert (sum(x * x for x in g) / 3) ** 0.5 == pytest.approx(1.0, abs=1e-3)   # unit std per group
    assert a[0] > 0 > a[1] and a[3] < 0 < a[4]
    raw = group_advantages([3.0, 1.0, 0.5, 0.5], 2, "none")   # scale "none": mean-centred only
    assert raw == pytest.approx([1.0, -1.0, 0.0, 0.0])


# ----------------------------------------------------------------------------- registry
def test_registry_finds_the_domain_trainer():
    assert registry.domain_trainer("agent") is T
    assert registry.domain_trainer("math") is None
    assert registry.is_agent_domain("agent") and not registry.is_agent_domain("math")


# ----------------------------------------------------------------------------- SFT
def test_sft_transcripts_are_oracle_episodes_with_assistant_loss(model_dir):
    cfg = _cfg("sft", model_dir, "data.difficulty=2", "agent.perturb=0.5")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ds = build_dataset(cfg, registry.load_domain("agent"), "train", cfg.data.n_train)
    rows = T.sft_transcripts(cfg, tok, ds)
    assert len(rows) >= len(ds)
    eos = tok.convert_ids_to_tokens(tok.eos_token_id)
    systems = set()
    for p, c, m in rows:
        assert len(c) == len(m) and 0 < sum(m) and len(p) + len(c) <= cfg.train.max_length
        text = tok.decode(p, skip_special_tokens=False)
        assert text.startswith("<|im_start|>system\n")
        systems.add(text.split("<|im_end|>")[0])
        written = tok.decode([t for t, k in zip(c, m) if k], skip_special_tokens=False)
        assert written.endswith(eos)
    assert len(systems) > 1   # harnesses drawn from the mix, not one
    # a row too long for train.max_length is left out, and none left is an error
    with pytest.raises(ValueError, match="max_length"):
        T.sft_transcripts(_cfg("sft", model_dir, "data.difficulty=2", "train.max_length=64"), tok, ds)


def test_train_sft_two_steps_change_the_weights(model_dir, tmp_path):
    cfg = _cfg("sft", model_dir, "data.difficulty=2")
    domain = registry.load_domain("agent")
    model, tok = load_model(cfg)
    before = _params(model)
    ds = build_dataset(cfg, domain, "train", cfg.data.n_train)
    out = train(cfg, domain, model, tok, ds, tmp_path)   # experts/run.py dispatches to the domain's TRAINER
    assert _changed(before, model)
    assert (out / "config.json").exists() and out == tmp_path / "model"
    assert not (tmp_path / "trainer").exists()   # TRL's SFTTrainer never ran


def _rl_setup(model_dir, *extra):
    cfg = _cfg("rl", model_dir, "data.difficulty=1", *extra)
    domain = registry.load_domain("agent")
    model, tok = load_model(cfg)
    return cfg, domain, model, tok, build_dataset(cfg, domain, "train", cfg.data.n_train)


def _grade(monkeypatch, reward):
    """core.agent.grpo.play_groups (the RL loop's episodes), its ended episodes graded
    reward(i) (a random model never succeeds); records each call's (kwargs, episodes)."""
    import core.agent.grpo as grpo

    real, played = grpo.play_groups, []

    def graded(rollout, tokenizer, groups, **kw):
        done, rest, n = real(rollout, tokenizer, groups, **kw)
        eps = [r.ep for g in done for r in g.runs]
        for i, e in enumerate(eps):
            e.reward = reward(i)
        played.append((kw, eps))
        return done, rest, n

    monkeypatch.setattr(grpo, "play_groups", graded)
    return played


def test_train_rl_two_steps_change_the_weights(model_dir, tmp_path, monkeypatch):
    cfg, domain, model, tok, ds = _rl_setup(model_dir)
    played = _grade(monkeypatch, lambda i: float(i % 2))
    before = _params(model)
    out = train(cfg, domain, model, tok, ds, tmp_path)
    assert len(played) == 2 and out == tmp_path / "model"
    kw, eps = played[0]
    assert len(eps) == cfg.train.batch_size * cfg.rl.num_generations
    assert kw["max_turns"] == 2 and kw["max_new_tokens"] == 8 and kw["max_context_tokens"] == 1536
    assert kw["min_finished"] == 1.0 and kw["max_tokens"] == 0   # partial rollouts are off by default
    assert all(1 <= e.turns <= 2 and e.segments for e in eps)
    tasks = [json.loads(t) for t in ds["task"]]
    assert all(any(t["user"] in tok.decode(e.segments[0].prompt_ids) for t in tasks) for e in eps)
    assert _changed(before, model)


def test_train_rl_with_equal_rewards_makes_no_update(model_dir, tmp_path, monkeypatch):
    cfg, domain, model, tok, ds = _rl_setup(model_dir, "train.max_steps=1")
    _grade(monkeypatch, lambda i: 1.0)
    before = _params(model)
    T.train_rl(cfg, domain, model, tok, ds, tmp_path)
    assert not _changed(before, model)


def test_policy_step_gradient_comes_from_assistant_tokens_only(model_dir):
    """policy_step (core/agent/grpo.py): an observation token's sampler log-prob (masked)
    does not move the loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.agent.grpo import policy_step
    from core.rollout import Sample

    cfg = _cfg("rl", model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    msgs = [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "add(a=2, b=3)"},
            {"role": "tool", "content": "5"}, {"role": "assistant", "content": "5"}]
    p, c, m = encode_transcript(tok, msgs)

    def step(obs_lp):
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        lp = [-1.0 if k else obs_lp for k in m]
        seg = Sample(prompt_ids=p, completion_ids=c, sampler_logprobs=lp, finished=True, loss_mask=m)
        return policy_step(model, opt, tok, [(seg, 1.0)], epsilon=cfg.rl.epsilon, grad_clip=cfg.train.grad_clip)

    a, b = step(0.0), step(-50.0)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-7) and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
    assert a["segments"] == 1.0 and a["grad_norm"] > 0


def test_bfcl_tasks_get_an_env_with_bfcls_tools(model_dir, tmp_path, monkeypatch):
    """data.dataset=bfcl_multi_turn: tasks of toolset "bfcl" need make_env(toolset="bfcl")
    (the procedural env refuses them at reset), in the SFT transcripts and the RL episodes."""
    import datasets
    from transformers import AutoTokenizer

    from experts.agent.data import bfcl_tasks
    tasks = bfcl_tasks()[:2]
    ds = datasets.Dataset.from_dict({"task": [json.dumps(t) for t in tasks]})
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rows = T.sft_transcripts(_cfg("sft", model_dir, "train.max_length=100000"), tok, ds)
    assert len(rows) >= 2 and all(sum(m) > 0 for _, _, m in rows)
    seen = []
    import core.agent.grpo as grpo

    def capture(tokenizer, tasks, envs, seeds, group, **kw):
        ep_tasks = [t for t in tasks for _ in range(group)]
        seen.extend((e.backend.toolset, t.get("toolset")) for e, t in zip(envs, ep_tasks))
        return []   # no episode is played

    monkeypatch.setattr(grpo, "start_groups", capture)
    cfg, domain, model, tok, _ = _rl_setup(model_dir, "train.max_steps=1")
    T.train_rl(cfg, domain, model, tok, ds, tmp_path)
    assert seen and all(a == b == "bfcl" for a, b in seen)
