"""core/task_cost.py: completion tokens per task (the tokenizer's ids up to and including
the first EOS; no prompt, no padding), the nearest-rank p90, the recorder the one greedy
decoding path (core.rollout.greedy_texts) reports to, and an agent episode's turns and
tool calls counted from a scripted episode (core.agent.episode.run_episodes ->
evals.agent.harness_scores)."""
from __future__ import annotations

import pytest

from core.agent.episode import run_episodes
from core.rollout import Sample, greedy_texts
from core.task_cost import completion_tokens, cost_metrics, p90, record_tokens, summary
from core.tiny import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_completion_tokens_stop_at_the_first_eos():
    assert completion_tokens([5, 6, 2, 7, 8], {2}) == 3        # the EOS is generated; what follows is not counted
    assert completion_tokens([2], {2}) == 1
    assert completion_tokens([5, 6, 7], {2}) == 3              # cut by the budget: every token
    assert completion_tokens([], {2}) == 0
    assert completion_tokens([5, 3, 9, 2], {2, 3}) == 2         # any of the EOS ids


def test_p90_is_nearest_rank():
    assert p90(list(range(1, 11))) == 9                          # 9 of 10 tasks at or below 9
    assert p90(list(range(100, 0, -1))) == 90                    # order does not matter
    assert p90(list(range(1, 12))) == 10                         # ceil(0.9 * 11) = 10th smallest
    assert p90([1] * 9 + [100]) == 1                             # 90% took 1: the outlier is the top 10%
    assert p90([7]) == 7 and p90([]) is None
    assert summary([4, 8, 12]) == {"mean": 8.0, "p90": 12} and summary([]) is None


class Fixed:
    """A rollout that returns given completion ids per prompt (what a backend sampled)."""

    def __init__(self, completions):
        self.completions = completions

    def generate(self, prompts, *, max_new_tokens, temperature, top_p, seeds):
        return [Sample(prompt_ids=list(p), completion_ids=list(c), sampler_logprobs=[0.0] * len(c),
                       finished=False) for p, c in zip(prompts, self.completions)]


def test_greedy_texts_reports_token_ids_not_characters_to_the_open_recorder(tok):
    eos = tok.eos_token_id
    long_word = tok.encode("1234567890 + 1234567890 = 2469135780", add_special_tokens=False)
    comps = [long_word + [eos, 5, 6, 7], [9] * 4, [eos]]
    prompts = [[4] * 30, [4], [4] * 7]                 # different lengths: a backend pads them; never counted
    with record_tokens() as counts:
        texts = greedy_texts(Fixed(comps), tok, prompts, max_new_tokens=64)
        with record_tokens() as inner:                 # an inner recorder takes its own counts only
            greedy_texts(Fixed([[9, eos]]), tok, [[4]], max_new_tokens=8)
    assert counts == [len(long_word) + 1, 4, 1] and inner == [2]
    assert len(texts[0]) != counts[0]                  # characters are not tokens
    greedy_texts(Fixed(comps), tok, prompts, max_new_tokens=64)   # no recorder open: nothing to report to
    assert counts == [len(long_word) + 1, 4, 1]


class Scripted:
    """Every turn writes the same text plus EOS."""

    def __init__(self, tok, text):
        self.ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]

    def generate(self, prompts, *, max_new_tokens, temperature, top_p, seeds):
        return [Sample(prompt_ids=list(p), completion_ids=list(self.ids), sampler_logprobs=[-1.0] * len(self.ids),
                       finished=True) for p in prompts]


class CallsThenDone:
    """Makes `n` tool calls (one per turn), then the next turn ends the episode."""

    def __init__(self, n):
        self.n, self.steps = n, 0

    def reset(self, task):
        self.steps = 0
        return "go"

    def step(self, text):
        self.steps += 1
        if self.steps > self.n:
            return "", True, {"success": self.n % 2 == 0, "calls": 0, "failed_calls": 0}
        return "ok", False, {"calls": 1, "failed_calls": 0, "obs_role": "tool"}


def test_agent_turns_and_tool_calls_of_scripted_episodes(tok):
    from evals.agent import harness_scores

    turn = Scripted(tok, "call add 1 2")
    per_turn = len(turn.ids)

    def run(tasks, harness_cfgs):
        envs = [CallsThenDone(t["calls"]) for t in tasks]
        return run_episodes(turn, tok, envs, tasks, seeds=[0] * len(tasks), temperature=0.0, top_p=1.0,
                            max_turns=20, max_context_tokens=4096, max_new_tokens=32, eos_ids={tok.eos_token_id})

    tasks = [{"id": str(i), "calls": i} for i in range(10)]     # episode i: i calls, i + 1 turns
    res = harness_scores(run, tasks, "recipes/harnesses/agent.yaml", seed=0, held_out=False, domain="agent",
                         dataset="procedural")
    c = res["cost"]
    assert c == res["train_harness"]["cost"] and c["n"] == 10
    assert c["turns"] == {"mean": 5.5, "p90": 9} and c["tool_calls"] == {"mean": 4.5, "p90": 8}
    # the student's tokens only (each turn's text and its EOS), not the observations between turns
    assert c["tokens"] == {"mean": 5.5 * per_turn, "p90": 9 * per_turn}
    assert cost_metrics({"agent": c}) == {"tokens_mean/agent": 5.5 * per_turn, "tokens_p90/agent": 9 * per_turn,
                                          "turns_mean/agent": 5.5, "turns_p90/agent": 9,
                                          "tool_calls_mean/agent": 4.5, "tool_calls_p90/agent": 8}
