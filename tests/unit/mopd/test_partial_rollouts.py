"""Partial rollouts (issue #17 part 4): resumable episode playing, the carry-over pool of
the MOPD loop, and the bookkeeping of carried-over episodes: each token keeps the weights
version that sampled it and its sampler log-prob, tokens older than loss.max_staleness
get loss mask 0, and the metrics count carried, aged and masked tokens."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from core.agent.episode import play, run_episodes, start_episodes, turn_seed
from core.agent.harness import MemoryStore, load_harnesses
from core.config import ConfigError, load_config
from mopd.distill import agents as A
from mopd.distill.config import AgentDomainConfig, DistillConfig, PartialRollouts, RolloutConfig
from mopd.distill.data import Prompt
from mopd.distill.metrics import partial_metrics
from core.rollout import HFRollout, Sample


class OneProcess:
    num_processes = 1

    def reduce(self, t, reduction="sum"):
        return t


class Versioned:
    """A rollout standing in for a sampler whose weights change between steps: every token
    it writes has log-prob -(1 + version), so a token's log-prob names the weights that
    sampled it. Records each call's prompts and seeds."""

    def __init__(self, tok, text="ok"):
        self.tok, self.text, self.version, self.calls = tok, text, 0, []

    def generate(self, prompts, *, max_new_tokens, temperature, top_p, seeds):
        self.calls.append(([list(p) for p in prompts], list(seeds)))
        ids = self.tok.encode(self.text, add_special_tokens=False)[:max_new_tokens - 1] + [self.tok.eos_token_id]
        return [Sample(prompt_ids=list(p), completion_ids=list(ids), sampler_logprobs=[-1.0 - self.version] * len(ids),
                       finished=True) for p in prompts]


class TurnsEnv:
    """Done (successful) after `n` student turns; each earlier turn gets a tool result."""

    def __init__(self, n=1, log=None):
        self.n, self.log, self.seen = n, log, 0

    def reset(self, task):
        self.seen = 0
        return f"task {task['id']}"

    def step(self, text):
        self.seen += 1
        if self.seen >= self.n:
            return "", True, {"success": True, "reward": 1.0}
        return f"result {self.seen}", False, {"obs_role": "tool"}

    def close(self):
        if self.log is not None:
            self.log.append(self.n)


RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "mopd" / "agent.yaml"
KW = dict(temperature=1.0, top_p=1.0, max_turns=8, max_context_tokens=400, max_new_tokens=6)


def _student_versions(ep):
    return [v for seg, vs in zip(ep.segments, ep.versions) for m, v in zip(seg.loss_mask, vs) if m]


# ------------------------------------------------------------------ episode.play
def test_play_stops_early_and_a_later_play_continues_with_new_weights(tiny_tokenizer):
    tok = tiny_tokenizer
    closed: list[int] = []
    envs = [TurnsEnv(1, closed), TurnsEnv(3, closed), TurnsEnv(2, closed)]
    roll = Versioned(tok)
    runs = start_episodes(tok, envs, [{"id": i} for i in range(3)], seeds=[5, 6, 7], max_context_tokens=400,
                          max_new_tokens=6)
    first = play(roll, tok, runs, eos_ids={tok.eos_token_id}, version=0, stop_when=lambda e, n, t: e >= 1, **KW)
    assert [r.ep.task_id for r in first.finished] == ["0"] and len(first.unfinished) == 2
    assert closed == [1]   # the ended episode's env is released, the others stay open for the next step
    n = len(tok.encode("ok", add_special_tokens=False)) + 1
    assert first.tokens == 3 * n
    roll.version = 1
    second = play(roll, tok, runs, eos_ids={tok.eos_token_id}, version=1, **KW)
    assert not second.unfinished and sorted(closed) == [1, 2, 3]
    ep0, ep1, ep2 = (r.ep for r in runs)
    assert ep1.turns == 3 and ep1.success and ep2.turns == 2
    # each student token keeps the version that sampled it and that sampler's log-prob
    assert _student_versions(ep0) == [0] * n
    assert _student_versions(ep1) == [0] * n + [1] * 2 * n
    seg = ep1.segments[0]
    for j, (m, v) in enumerate(zip(seg.loss_mask, ep1.versions[0])):
        assert (m == 1) == (v >= 0)
        if m:
            assert seg.sampler_logprobs[j] == -1.0 - v
    # continued turns carry on the episode's own seed sequence and its exact token sequence
    assert roll.calls[1][1] == [turn_seed(6, 1), turn_seed(7, 1)]
    assert roll.calls[1][0][0] == seg.prompt_ids + seg.completion_ids[:seg.turn_ids.index(1)]


def test_playing_in_pieces_equals_playing_to_the_end(student_hf, tiny_tokenizer):
    """Stopping after every round and continuing (same weights) gives exactly the episodes
    of one uninterrupted run: carrying over changes nothing but the weights."""
    tok = tiny_tokenizer
    roll = HFRollout(student_hf, tok)
    tasks = [{"id": i} for i in range(3)]
    whole = run_episodes(roll, tok, [TurnsEnv(n) for n in (1, 3, 2)], tasks, seeds=[1, 2, 3],
                         eos_ids={tok.eos_token_id}, **KW)
    runs = start_episodes(tok, [TurnsEnv(n) for n in (1, 3, 2)], tasks, seeds=[1, 2, 3], max_context_tokens=400,
                          max_new_tokens=6)
    pieces = 0
    while any(not r.done for r in runs):
        play(roll, tok, runs, eos_ids={tok.eos_token_id}, stop_when=lambda e, n, t: True, **KW)
        pieces += 1
    assert pieces == 3
    for a, b in zip(whole, (r.ep for r in runs)):
        assert [s.completion_ids for s in a.segments] == [s.completion_ids for s in b.segments]
        assert [s.sampler_logprobs for s in a.segments] == [s.sampler_logprobs for s in b.segments]
        assert [s.loss_mask for s in a.segments] == [s.loss_mask for s in b.segments]
        assert a.turns == b.turns and a.success == b.success


# ------------------------------------------------------------------ the carry-over pool
def _agents(partial, factory=None):
    mix = load_harnesses({"harnesses": [{"name": "h"}]})
    cfg = AgentDomainConfig(harnesses="x", max_turns=8, max_context_tokens=400, max_new_tokens=6, partial=partial)
    return {"agent": A.AgentDomain("agent", cfg, factory or (lambda harness_cfg, memory: None), mix, MemoryStore())}


def _factory():
    """Environments whose length is the task's `n` (read at reset)."""
    class Env(TurnsEnv):
        def reset(self, task):
            self.n = task["n"]
            return super().reset(task)
    return lambda harness_cfg, memory: Env()


def _rows(ns, start=0):
    return [Prompt(start + i, "agent", "agent", [], [1, 2], {"task": json.dumps({"id": f"t{start + i}", "n": n})})
            for i, n in enumerate(ns)]


def test_pool_carries_unfinished_episodes_and_masks_stale_tokens(tiny_tokenizer):
    tok = tiny_tokenizer
    agents = _agents(PartialRollouts(enabled=True, min_finished=0.5), _factory())
    rd = {"agent": RolloutConfig(backend="hf")}
    roll, pool = Versioned(tok), {}
    rows = _rows([1, 1, 4, 3])
    fin, tokens = A.play_partial(agents, roll, tok, {tok.eos_token_id}, rows, [10, 11, 12, 13], [0, 1, 2, 3], rd,
                                 pool, version=0)
    assert [f.live.ep.task_id for f in fin] == ["t0", "t1"] and len(roll.calls) == 1
    assert [f.live.ep.task_id for f in pool["agent"]] == ["t2", "t3"] and tokens > 0
    roll.version = 1
    rows2 = _rows([1, 1], start=4)
    fin, _ = A.play_partial(agents, roll, tok, {tok.eos_token_id}, rows2, [20, 21], [0, 1], rd, pool, version=1)
    # carried episodes are continued first, in one sampler call with the new ones
    assert len(roll.calls[1][0]) == 4 and [f.live.ep.task_id for f in fin] == ["t4", "t5"]
    assert [f.live.ep.turns for f in pool["agent"]] == [2, 2]
    roll.version = 2
    fin, _ = A.play_partial(agents, roll, tok, {tok.eos_token_id}, [], [], [], rd, pool, version=2)
    assert [f.live.ep.task_id for f in fin] == ["t3"] and [f.live.ep.task_id for f in pool["agent"]] == ["t2"]
    ep = fin[0].live.ep
    n = len(tok.encode("ok", add_special_tokens=False)) + 1
    assert _student_versions(ep) == [0] * n + [1] * n + [2] * n
    assert fin[0].row.index == 3 and fin[0].seed == 13   # trained as the row it was drawn for
    # trained at step 2 with max_staleness 1: the turn sampled at version 0 is masked, the rest kept
    seg = ep.segments[0]
    (out,), stats = A.mask_stale([seg], [ep.versions[0]], ["agent"], [2], 1, ["agent"])
    kept = [v for m, v in zip(out.loss_mask, ep.versions[0]) if m]
    assert kept == [1] * n + [2] * n
    assert sum(seg.loss_mask) == 3 * n, "the episode's own mask is not changed"
    assert stats["agent"] == [3 * n, 2 * n + n, n, n, n, n, 0]
    m = partial_metrics(OneProcess(), stats, {"agent": len(pool["agent"])}, ["agent"])
    assert m == pytest.approx({"agent/carried_over/agent": 1.0, "agent/token_age_mean/agent": 1.0,
                               "agent/stale_masked_share/agent": 1 / 3, "agent/token_age/agent/age_0": 1 / 3,
                               "agent/token_age/agent/age_1": 1 / 3, "agent/token_age/agent/age_2": 1 / 3,
                               "agent/token_age/agent/age_3plus": 0.0})
    # an in-flight episode dropped (checkpoint, end of run) is counted and its env released
    log: list = []
    pool["agent"][0].live.env.log = log
    assert A.drop_in_flight(pool) == {"agent": 1} and pool == {} and log == [4]


def test_max_tokens_budget_stops_the_step(tiny_tokenizer):
    tok = tiny_tokenizer
    agents = _agents(PartialRollouts(enabled=True, min_finished=1.0, max_tokens=1), _factory())
    roll, pool = Versioned(tok), {}
    fin, tokens = A.play_partial(agents, roll, tok, {tok.eos_token_id}, _rows([2, 3]), [1, 2], [0, 1],
                                 {"agent": RolloutConfig(backend="hf")}, pool, version=0)
    assert fin == [] and len(pool["agent"]) == 2 and len(roll.calls) == 1 and tokens > 1


def _cfg(minibatches=1, max_staleness=1):
    return SimpleNamespace(rollout=SimpleNamespace(samples_per_prompt=1, max_new_tokens=6),
                           train=SimpleNamespace(seed=0, minibatches=minibatches),
                           loss=SimpleNamespace(max_staleness=max_staleness))


def test_sample_batch_trains_finished_episodes_only(tiny_tokenizer):
    from mopd.distill.batch import sample_batch

    tok = tiny_tokenizer
    n = len(tok.encode("ok", add_special_tokens=False)) + 1
    agents = _agents(PartialRollouts(enabled=True, min_finished=0.25), _factory())
    rd = {"agent": RolloutConfig(backend="hf"), "alpha": RolloutConfig(backend="hf")}
    roll, pool = Versioned(tok), {}
    single = Prompt(9, "alpha", "alpha", [], [3, 4], {})
    mine = _rows([1, 4, 4, 4]) + [single]
    with pytest.raises(ValueError, match="carry-over pool"):
        sample_batch(_cfg(), roll, rd, mine, 0, agents, tok, {tok.eos_token_id})
    b = sample_batch(_cfg(minibatches=2), roll, rd, mine, 0, agents, tok, {tok.eos_token_id}, pool=pool)
    # the single-turn row stays, the one finished episode (t0) comes in; three are carried over
    assert [r.domain for r in b.rows] == ["alpha", "agent"] and b.episode_of == [None, 0]
    assert [(d, e.task_id) for d, e in b.episodes] == [("agent", "t0")]
    assert b.versions[0] is None and b.partial["carried"] == {"agent": 3}
    assert b.rows[1].ids == b.samples[1].prompt_ids
    assert b.partial["stats"]["agent"] == [n, n, 0, 0, n, 0, 0]   # minibatch 1 trains at step 1: age 1
    assert b.n_gen == 5 * n   # the single-turn sample and the four episodes' first turns
    # step 1: the carried episodes (one turn each at version 0) end after three more turns
    # at version 1, before the new ones (five turns) do
    roll.version = 1
    b = sample_batch(_cfg(minibatches=2, max_staleness=1), roll, rd, _rows([5, 5], start=10), 1, agents, tok,
                     {tok.eos_token_id}, pool=pool)
    assert [e.task_id for _, e in b.episodes] == ["t1", "t2", "t3"] and b.episode_of == [0, 1, 2]
    assert [r.index for r in b.rows] == [1, 2, 3] and b.partial["carried"] == {"agent": 2}
    # minibatch 0 (row 0) trains with the weights of step 1, minibatch 1 (rows 1-2) with
    # those of step 2: there the version-0 turn is 2 steps old, over max_staleness=1
    assert [sum(s.loss_mask) for s in b.samples] == [4 * n, 3 * n, 3 * n]
    assert [sum(s.loss_mask) for _, e in b.episodes for s in e.segments] == [4 * n] * 3
    assert b.partial["stats"]["agent"] == [12 * n, 11 * n, 2 * n, 3 * n, 7 * n, 2 * n, 0]


def test_filler_rows_when_nothing_finished(tiny_tokenizer):
    from mopd.distill.batch import sample_batch

    tok = tiny_tokenizer
    agents = _agents(PartialRollouts(enabled=True, min_finished=1.0, max_tokens=1), _factory())
    rd = {"agent": RolloutConfig(backend="hf")}
    pool = {}
    b = sample_batch(_cfg(minibatches=2), Versioned(tok), rd, _rows([3, 3]), 0, agents, tok, {tok.eos_token_id},
                     pool=pool)
    assert len(b.rows) == 2 and all(s.completion_ids == [] for s in b.samples) and b.episodes == []
    assert b.episode_of == [None, None] and b.partial["carried"] == {"agent": 2}
    m = partial_metrics(OneProcess(), b.partial["stats"], b.partial["carried"], ["agent"])
    assert m == {"agent/carried_over/agent": 2.0}


# ------------------------------------------------------------------ config and resume
@pytest.mark.parametrize("override, needle", [
    ("agents.agent.partial.min_finished=0", r"agents\.agent\.partial: partial\.min_finished must be in \(0, 1\]"),
    ("agents.agent.partial.min_finished=1.5", r"partial\.min_finished must be in \(0, 1\]"),
    ("agents.agent.partial.max_tokens=-1", r"agents\.agent\.partial: partial\.max_tokens must be >= 0"),
    ("agents.agent.partial.wait=1", "wait"),
])
def test_partial_config_is_validated(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(DistillConfig, RECIPE, [override])


def test_partial_is_off_by_default():
    cfg = load_config(DistillConfig, RECIPE)
    assert not cfg.agents["agent"].partial.enabled
    assert A.partial_domains({"agent": A.AgentDomain("agent", cfg.agents["agent"], None, None, None)}) == []


def test_resume_of_a_checkpoint_from_before_partial_rollouts(tmp_path):
    """A checkpoint written before `partial` existed resumes when it is off; turning it on
    is a settings change like any other."""
    from core.config import flatten, to_dict
    from mopd.distill.checkpoints import training_settings
    from mopd.distill.inputs import resume_settings

    cfg = load_config(DistillConfig, RECIPE)
    old = {k: v for k, v in training_settings(flatten(to_dict(cfg))).items() if ".partial." not in k}
    ckpt = tmp_path / "step_2"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2, "settings": old}))
    assert resume_settings(cfg, ckpt)[1] == {}
    on = load_config(DistillConfig, RECIPE, ["agents.agent.partial.enabled=true"])
    with pytest.raises(ConfigError, match="agents.agent.partial.enabled"):
        resume_settings(on, ckpt)
