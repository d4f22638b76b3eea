"""Agent episodes (core.agent.episode): token-exact continuation of the sampled sequence,
masks and turn ids, cuts at max_turns / max_context_tokens, environment failures that end
one episode only, malformed tool calls as error observations, context policies that start
a new segment."""
from __future__ import annotations

import pytest

from core.agent.env import ToolEnv, ToolError
from core.agent.episode import Episode, run_episodes, turn_seed
from core.agent.harness import ContextPolicy, HarnessConfig, ToolCall, ToolSpec
from core.agent.transcript import observation_ids, prompt_ids
from core.rollout import HFRollout, Sample

SEEDS = [11, 12, 13, 14]


def render(tok, messages, gen):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


class Recording:
    """A rollout that records every generate call (prompts in, samples out)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def generate(self, prompts, **kw):
        out = self.inner.generate(prompts, **kw)
        self.calls.append(([list(p) for p in prompts], kw, out))
        return out


class Scripted:
    """A rollout that writes given texts: turn k of every episode gets texts[k] (+ EOS
    unless the text is in `no_eos`), with made-up log-probs."""

    def __init__(self, tok, texts, no_eos=()):
        self.tok, self.texts, self.no_eos, self.turn = tok, texts, set(no_eos), 0

    def generate(self, prompts, *, max_new_tokens, temperature, top_p, seeds):
        text = self.texts[min(self.turn, len(self.texts) - 1)]
        self.turn += 1
        ids = self.tok.encode(text, add_special_tokens=False)[:max_new_tokens]
        fin = text not in self.no_eos and len(ids) < max_new_tokens
        ids = ids + [self.tok.eos_token_id] if fin else ids
        return [Sample(prompt_ids=list(p), completion_ids=list(ids), sampler_logprobs=[-1.0] * len(ids), finished=fin)
                for p in prompts]


class CountingEnv:
    """Answers `n_obs` turns (alternately a tool result and a next user message), then is
    done and successful; optionally raises at reset or at a given step."""

    def __init__(self, n_obs=3, raise_at=None, raise_on_reset=False):
        self.n_obs, self.raise_at, self.raise_on_reset = n_obs, raise_at, raise_on_reset
        self.seen: list[str] = []

    def reset(self, task):
        if self.raise_on_reset:
            raise RuntimeError("reset broke")
        self.seen = []
        return f"task {task['id']}: start"

    def step(self, text):
        self.seen.append(text)
        n = len(self.seen)
        if n == self.raise_at:
            raise RuntimeError("simulator crashed")
        if n > self.n_obs:
            return "", True, {"success": True, "reward": 1.0, "calls": 0, "failed_calls": 0}
        return f"result {n}", False, {"obs_role": "tool" if n % 2 else "user", "calls": 1, "failed_calls": 0}


@pytest.fixture
def rollout(student_hf, tiny_tokenizer):
    return Recording(HFRollout(student_hf, tiny_tokenizer))


def _run(rollout, tok, envs, *, max_turns=4, max_context_tokens=400, max_new_tokens=10, seeds=None, ids=None):
    return run_episodes(rollout, tok, envs, [{"id": f"t{i}"} for i in (ids or range(len(envs)))],
                        seeds=seeds or SEEDS[:len(envs)], temperature=1.0, top_p=1.0, max_turns=max_turns,
                        max_context_tokens=max_context_tokens, max_new_tokens=max_new_tokens,
                        eos_ids={tok.eos_token_id})


def _check_layout(ep: Episode, tok):
    for seg in ep.segments:
        n = len(seg.completion_ids)
        assert len(seg.sampler_logprobs) == len(seg.loss_mask) == len(seg.turn_ids) == n
        assert all((m == 1) == (t >= 0) for m, t in zip(seg.loss_mask, seg.turn_ids))
    assert sum(sum(s.loss_mask) for s in ep.segments) == ep.student_tokens


def test_continuation_is_token_exact(rollout, tiny_tokenizer):
    tok = tiny_tokenizer
    envs = [CountingEnv(n_obs=3) for _ in range(3)]
    eps = _run(rollout, tok, envs)
    assert len(rollout.calls) == 4   # one generate per turn over all live episodes
    for e, ep in enumerate(eps):
        assert len(ep.segments) == 1 and ep.success and ep.reward == 1.0 and ep.cut is None and ep.turns == 4
        _check_layout(ep, tok)
        seg = ep.segments[0]
        ids = seg.prompt_ids + seg.completion_ids
        # the whole sequence spells the chat template of the transcript (its final newline aside)
        assert decode(tok, ids) + "\n" == render(tok, ep.messages, gen=False)
        assert [m["role"] for m in ep.messages] == ["user", "assistant", "tool", "assistant", "user", "assistant",
                                                    "tool", "assistant"]
        for turn, (prompts, kw, out) in enumerate(rollout.calls):
            # turn k was sampled from exactly the sequence so far, which renders the transcript so far
            assert kw["seeds"][e] == turn_seed(SEEDS[e], turn)
            start = len(seg.prompt_ids) + seg.turn_ids.index(turn)
            assert prompts[e] == ids[:start]
            assert decode(tok, prompts[e]) == render(tok, ep.messages[:1 + 2 * turn], gen=True)
            # and its sampled ids and log-probs are kept verbatim, loss on them only
            k = [j for j, t in enumerate(seg.turn_ids) if t == turn]
            assert [seg.completion_ids[j] for j in k] == out[e].completion_ids[:len(k)]
            assert [seg.sampler_logprobs[j] for j in k] == out[e].sampler_logprobs[:len(k)]
        # observations: the template's tokens between turns, masked
        obs = [j for j, t in enumerate(seg.turn_ids) if t < 0]
        assert obs and all(seg.loss_mask[j] == 0 for j in obs)
        assert envs[e].seen == [m["content"] for m in ep.messages if m["role"] == "assistant"]


def test_turn_cut_by_max_new_tokens_gets_a_masked_end_of_turn(tiny_tokenizer):
    tok = tiny_tokenizer
    ep, = _run(Scripted(tok, ["a long answer that never ends"], no_eos={"a long answer that never ends"}), tok,
               [CountingEnv(n_obs=1)], max_new_tokens=4)
    seg = ep.segments[0]
    assert ep.turns == 2 and ep.student_tokens == 8
    first = seg.completion_ids[:5]
    assert first[-1] == tok.eos_token_id and seg.loss_mask[:5] == [1, 1, 1, 1, 0]
    assert decode(tok, seg.prompt_ids + seg.completion_ids) + "\n" == render(tok, ep.messages, gen=False)


def test_cut_at_max_context_tokens_never_outgrows_it(rollout, tiny_tokenizer):
    tok = tiny_tokenizer
    envs = [CountingEnv(n_obs=50) for _ in range(4)]
    eps = _run(rollout, tok, envs, max_turns=50, max_context_tokens=80, max_new_tokens=10)
    for ep in eps:
        assert ep.cut == "max_context_tokens" and not ep.success and ep.reward == 0.0
        for seg in ep.segments:
            assert len(seg.prompt_ids) + len(seg.completion_ids) <= 80
        _check_layout(ep, tok)
    for prompts, kw, _ in rollout.calls:
        assert all(len(p) + kw["max_new_tokens"] <= 80 for p in prompts)
    # a prompt that leaves no room: cut before any turn
    ep, = _run(rollout, tok, [CountingEnv()], max_context_tokens=12, max_new_tokens=10)
    assert ep.cut == "max_context_tokens" and ep.turns == 0 and ep.segments[0].completion_ids == []


def test_cut_at_max_turns(rollout, tiny_tokenizer):
    tok = tiny_tokenizer
    ep, = _run(rollout, tok, [CountingEnv(n_obs=10)], max_turns=2)
    assert ep.cut == "max_turns" and ep.turns == 2 and not ep.success
    seg = ep.segments[0]
    # the last observation is in the transcript, not in the tokens (nothing was sampled after it)
    assert decode(tok, seg.prompt_ids + seg.completion_ids) + "\n" == render(tok, ep.messages[:-1], gen=False)


def test_env_raising_fails_that_episode_and_the_others_finish(rollout, tiny_tokenizer, capsys):
    tok = tiny_tokenizer
    envs = [CountingEnv(), CountingEnv(raise_at=2), CountingEnv(raise_on_reset=True), CountingEnv()]
    eps = _run(rollout, tok, envs)
    assert [e.success for e in eps] == [True, False, False, True]
    assert "simulator crashed" in eps[1].env_error and eps[1].turns == 2
    assert "reset broke" in eps[2].env_error and eps[2].segments == [] and eps[2].turns == 0
    assert eps[0].env_error is None and eps[3].turns == 4
    err = capsys.readouterr().err
    assert "'t1'" in err and "simulator crashed" in err and "'t2'" in err


class ClosingEnv(CountingEnv):
    """Records when it is closed: after how many steps, and how often."""

    def __init__(self, log, name, fail_close=False, **kw):
        super().__init__(**kw)
        self.log, self.name, self.fail_close = log, name, fail_close

    def close(self):
        self.log.append((self.name, len(self.seen)))
        if self.fail_close:
            raise OSError("workspace busy")


def test_each_env_is_closed_once_when_its_episode_ends(tiny_tokenizer, capsys):
    """A workspace is released when its episode ends (done, env error, cut or failed reset),
    not when the slowest episode of the batch does; a failing close is logged, not raised."""
    tok = tiny_tokenizer
    log = []
    envs = [ClosingEnv(log, "short", n_obs=1), ClosingEnv(log, "long", n_obs=10),
            ClosingEnv(log, "crash", raise_at=2, fail_close=True), ClosingEnv(log, "nostart", raise_on_reset=True)]
    eps = _run(Scripted(tok, ["x"]), tok, envs, max_turns=4)
    assert sorted(log) == [("crash", 2), ("long", 4), ("nostart", 0), ("short", 2)]
    # the short episode's env was closed before the long one had taken its third turn
    assert log.index(("short", 2)) < log.index(("long", 4))
    assert eps[0].success and eps[1].cut == "max_turns" and "simulator crashed" in eps[2].env_error
    assert "closing its environment failed" in capsys.readouterr().err


def test_seeded_and_batch_independent(student_hf, tiny_tokenizer):
    tok = tiny_tokenizer
    a = _run(HFRollout(student_hf, tok), tok, [CountingEnv() for _ in range(3)])
    b = _run(HFRollout(student_hf, tok), tok, [CountingEnv() for _ in range(3)])
    alone = _run(HFRollout(student_hf, tok), tok, [CountingEnv()], seeds=[SEEDS[1]], ids=[1])
    assert [e.segments[0].completion_ids for e in a] == [e.segments[0].completion_ids for e in b]
    assert alone[0].segments[0].completion_ids == a[1].segments[0].completion_ids
    assert a[0].segments[0].completion_ids != a[1].segments[0].completion_ids


# ---- through ToolEnv: system prompt, tool calls, malformed calls, context policy ----------------
class AddBackend:
    """add(a, b); the task is done when the assistant answers (no call) with the sum's value."""

    def tools(self):
        return {"add": ToolSpec("add", "Add two integers.", {
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"]})}

    def reset(self, task):
        self.last = None
        return "add 2 and 3, then say the result"

    def call(self, call: ToolCall):
        if call.args["a"] < 0:
            raise ToolError("a must be >= 0")
        self.last = call.args["a"] + call.args["b"]
        return str(self.last)

    def end_turn(self, text):
        return None

    def finish(self, text):
        ok = self.last is not None and str(self.last) in text
        return {"success": ok, "reward": float(ok)}


def _tool_env(**harness):
    return ToolEnv(AddBackend(), HarnessConfig(name="h", syntax="json", **harness))


CALL = '```json\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n```'
BAD = '```json\n{"name": "add", "arguments": {"a": 2}}\n```'


def test_malformed_call_is_an_error_observation_and_the_episode_recovers(tiny_tokenizer):
    tok = tiny_tokenizer
    env = _tool_env()
    ep, = _run(Scripted(tok, [BAD, CALL, "5"]), tok, [env], max_context_tokens=1000, max_new_tokens=64)
    assert ep.messages[0]["role"] == "system" and ep.messages[0]["content"] == env.harness.system_prompt()
    assert ep.messages[3]["role"] == "tool" and ep.messages[3]["content"].startswith("error:")
    assert ep.messages[5] == {"role": "tool", "content": "5"}
    assert ep.turns == 3 and ep.calls == 2 and ep.failed_calls == 1 and ep.first_failed_turn == 0
    assert ep.success and ep.recovered and ep.harness == "h"
    seg = ep.segments[0]
    assert decode(tok, seg.prompt_ids + seg.completion_ids) + "\n" == render(tok, ep.messages, gen=False)
    assert seg.prompt_ids == prompt_ids(tok, ep.messages[:2])
    # each observation is exactly the template's tokens for it
    obs = [j for j, t in enumerate(seg.turn_ids) if t < 0]
    first_obs = [seg.completion_ids[j] for j in obs if j < seg.turn_ids.index(1)]
    assert first_obs == observation_ids(tok, "tool", ep.messages[3]["content"])


def test_backend_crash_inside_tool_env_fails_the_episode(tiny_tokenizer):
    tok = tiny_tokenizer
    env = _tool_env()
    env.backend.call = lambda call: 1 / 0
    ep, = _run(Scripted(tok, [CALL]), tok, [env], max_context_tokens=1000, max_new_tokens=64)
    assert not ep.success and "ZeroDivisionError" in ep.env_error and ep.turns == 1


def test_last_k_context_starts_new_segments(tiny_tokenizer):
    tok = tiny_tokenizer
    env = _tool_env(context=ContextPolicy(kind="last_k", k=1))
    ep, = _run(Scripted(tok, [CALL, CALL, CALL, "5"]), tok, [env], max_context_tokens=1000, max_new_tokens=64)
    assert ep.success and ep.turns == 4
    assert len(ep.segments) == 3   # turns 0-1 share a sequence; then each turn drops the oldest one
    for seg in ep.segments:
        first = seg.turn_ids[0]
        view = env.harness.apply_context(ep.messages[:2 + 2 * first])
        assert decode(tok, seg.prompt_ids) == render(tok, view, gen=True)
    assert sum(len([t for t in s.turn_ids if t >= 0]) for s in ep.segments) == ep.student_tokens
