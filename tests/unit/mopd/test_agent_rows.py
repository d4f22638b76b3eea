"""The loop's agent plumbing without a model: episodes become one row per segment, the
harness of each episode is a seeded draw, and the per-turn / per-episode metrics."""
from __future__ import annotations

import json
from pathlib import Path
import random

import pytest
import torch

from core.agent.episode import Episode
from core.rollout.base import Sample
from core.agent.harness import MemoryStore, load_harnesses
from mopd.distill import agents as A
from mopd.distill.config import AgentDomainConfig, RolloutConfig
from mopd.distill.data import Prompt
from mopd.distill.metrics import episode_metrics, turn_kl_metrics
from core.rollout import Sample


class OneProcess:
    num_processes = 1

    def reduce(self, t, reduction="sum"):
        return t


def _seg(prompt, comp, mask):
    return Sample(prompt_ids=prompt, completion_ids=comp, sampler_logprobs=[0.0] * len(comp), finished=True,
                  loss_mask=mask, turn_ids=[0 if m else -1 for m in mask])


def test_segment_rows():
    rows = [Prompt(i, d, d, [], [100 + i], {"task": "{}"} if d == "agent" else {}) for i, d in
            enumerate(["alpha", "agent", "agent", "alpha"])]
    singles = [Sample([100], [1, 2], [0.0, 0.0], True), None, None, Sample([103], [3], [0.0], True)]
    two = Episode("t1", "h", segments=[_seg([7, 8], [1, 2], [1, 1]), _seg([9], [3, 4, 5], [1, 0, 1])])
    failed = Episode("t2", "h", env_error="boom")
    r, s, o, smp, ep_of = A.segment_rows(rows, [10, 11, 12, 13], [False] * 4, singles, [1, 2], [two, failed])
    assert [x.domain for x in r] == ["alpha", "agent", "agent", "agent", "alpha"]
    assert [x.ids for x in r] == [[100], [7, 8], [9], [102], [103]]   # segment prompts; a failed one keeps its own
    assert s == [10, 11, 11, 12, 13] and ep_of == [None, 0, 0, 1, None] and o == [False] * 5
    assert smp[1] is two.segments[0] and smp[2] is two.segments[1]
    assert smp[3].completion_ids == [] and smp[3].loss_mask == []
    assert smp[0] is singles[0] and smp[4] is singles[3]
    assert rows[1].ids == [101]   # the input rows are not changed


def test_each_episode_draws_its_harness_from_its_seed(monkeypatch):
    mix = load_harnesses({"harnesses": [{"name": "a"}, {"name": "b", "syntax": "xml"}], "weights": [1.0, 3.0]})
    built = []

    def factory(harness_cfg, memory):
        built.append((harness_cfg.name, memory))
        return object()

    played = {}

    def fake_run(rollout, tok, envs, tasks, *, seeds, **kw):
        played.update(kw)
        return [Episode(t["id"], "") for t in tasks]

    monkeypatch.setattr(A, "run_episodes", fake_run)
    mem = MemoryStore()
    agents = {"agent": A.AgentDomain("agent", AgentDomainConfig(harnesses="x", max_turns=5), factory, mix, mem)}
    rows = [Prompt(i, "agent", "agent", [], [1], {"task": json.dumps({"id": f"t{i}"})}) for i in range(40)]
    seeds = list(range(1000, 1040))
    rd = {"agent": RolloutConfig(temperature=0.7, top_p=0.9)}
    eps = A.play(agents, None, None, {0}, rows, seeds, list(range(40)), rd)
    assert [e.task_id for e in eps] == [f"t{i}" for i in range(40)]
    names = [n for n, _ in built]
    assert names == [mix.sample(random.Random(s)).name for s in seeds]   # reruns and ranks agree
    assert 20 < names.count("b") < 40 and all(m is mem for _, m in built)
    assert played["temperature"] == 0.7 and played["top_p"] == 0.9 and played["max_turns"] == 5


def test_a_factory_failing_mid_run_fails_only_that_episode(tiny_tokenizer, capsys):
    from core.agent.episode import run_episodes

    env = A._BrokenEnv(RuntimeError("no simulator"), "h")
    ep, = run_episodes(None, tiny_tokenizer, [env], [{"id": "x"}], seeds=[0], temperature=1.0, top_p=1.0,
                       max_turns=2, max_context_tokens=100, max_new_tokens=4, eos_ids={0})
    assert "no simulator" in ep.env_error and not ep.segments
    assert "'x'" in capsys.readouterr().err


def test_turn_kl_metrics_over_student_tokens_only():
    class Res:
        mask_BT = torch.tensor([[1., 1., 0., 1., 1., 1.], [1., 1., 1., 0., 0., 0.]])
        kl_log_BT = torch.tensor([[1., 3., 0., 5., 7., 9.], [2., 2., 2., 0., 0., 0.]])
    turns = [[0, 0, -1, 1, 4, 6], None]
    m = turn_kl_metrics(OneProcess(), Res, turn_ids=turns, row_domains=["agent", "alpha"], agent_domains=["agent"])
    assert m == {"reverse_kl/agent/turn_0": 2.0, "reverse_kl/agent/turn_1": 5.0, "reverse_kl/agent/turn_4plus": 8.0}


def test_episode_metrics():
    seg = Sample(prompt_ids=[1, 2, 3], completion_ids=[4, 5], sampler_logprobs=[0.0, 0.0], finished=True)
    eps = [("agent", Episode("a", "h", turns=2, student_tokens=10, success=True, reward=1.0, failed_calls=1,
                             segments=[seg, seg])),
           ("agent", Episode("b", "h", turns=4, student_tokens=30, env_error="x", cut=None)),
           ("agent", Episode("c", "h", turns=3, student_tokens=20, cut="max_turns")),
           ("other", Episode("d", "h", turns=9))]
    m = episode_metrics(OneProcess(), eps, ["agent", "empty"])
    assert m == pytest.approx({"agent/turns/agent": 3.0, "agent/tokens_per_episode/agent": 20.0,
                               "agent/env_errors/agent": 1 / 3, "agent/failed_calls/agent": 1 / 3,
                               "agent/success/agent": 1 / 3, "agent/cut/agent": 1 / 3, "agent/reward/agent": 1 / 3,
                               "agent/transcript_tokens/agent": 10.0})


def test_agent_episodes_are_never_teacher_corrected():
    """The top-level correct_below is for single-turn rows (the pipeline recipe sets one
    for every domain); asking for it on an agent domain itself is a config error."""
    import pytest

    from core.config import ConfigError, load_config
    from mopd.distill import DistillConfig

    recipe = Path(__file__).resolve().parents[3] / "recipes" / "mopd" / "agent.yaml"
    cfg = load_config(DistillConfig, recipe, ["rollout.correct_below=0.05"])
    assert cfg.rollout.correct_below == 0.05 and "agent" in cfg.agents
    with pytest.raises(ConfigError, match="by_domain.agent.correct_below"):
        load_config(DistillConfig, recipe, ["rollout.by_domain={agent: {correct_below: 0.05}}"])
