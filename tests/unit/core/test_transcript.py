"""core.agent.transcript: the token layout of an agent transcript, shared by the episode
runner (sampling) and the agent SFT / seq-KD (training). The key check: the rows
encode_segments writes for a finished transcript are token for token the segments
run_episodes samples when the model writes those very turns (SFT layout == sampling layout)."""
from __future__ import annotations

import json
import random

import pytest

from core.agent.episode import run_episodes
from core.agent.transcript import (assistant_ids, encode_segments, encode_transcript, end_of_turn_id,
                                   observation_ids, prompt_ids)
from core.rollout import Sample
from core.tiny import load_tokenizer

# The template of Qwen2.5 for tool results: consecutive tool messages are one user turn
# wrapped in <tool_response> tags. Observation framing must come from the template.
QWEN_TOOL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def qwen_tok():
    t = load_tokenizer()   # a fresh object: the observation frame is cached per tokenizer
    t.chat_template = QWEN_TOOL_TEMPLATE
    return t


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def render(tok, messages, gen=False):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)


def runs(ids, mask):
    """Maximal runs of equal mask values: [(mask value, ids)]."""
    out: list[tuple[int, list[int]]] = []
    for t, m in zip(ids, mask):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return out


TRANSCRIPT = [
    {"role": "system", "content": "You have tools: cat(file_name)."},
    {"role": "user", "content": "Follow ab.txt."},
    {"role": "assistant", "content": "cat(file_name='ab.txt')"},
    {"role": "tool", "content": "cd.txt"},
    {"role": "assistant", "content": "cat(file_name='cd.txt')"},
    {"role": "tool", "content": "error: no such file"},
    {"role": "assistant", "content": "The answer is plum."},
    {"role": "user", "content": "Now write it down."},
    {"role": "assistant", "content": "done"},
]


# ----------------------------------------------------------------------------- encode_transcript
@pytest.mark.parametrize("which", ["chatml", "qwen_tool"])
def test_encode_transcript_is_the_chat_template(tok, qwen_tok, which):
    t = tok if which == "chatml" else qwen_tok
    p, c, m = encode_transcript(t, TRANSCRIPT)
    assert len(c) == len(m)
    assert p == prompt_ids(t, TRANSCRIPT[:2])
    assert decode(t, p) == render(t, TRANSCRIPT[:2], gen=True)
    full = render(t, TRANSCRIPT)
    assert full.endswith("\n")
    # the template's trailing newline after the last EOS is no token of the transcript
    assert decode(t, p + c) == full[:-1]
    assert c[-1] == end_of_turn_id(t)


@pytest.mark.parametrize("which", ["chatml", "qwen_tool"])
def test_loss_mask_is_one_exactly_on_assistant_tokens_and_their_eos(tok, qwen_tok, which):
    t = tok if which == "chatml" else qwen_tok
    _, c, m = encode_transcript(t, TRANSCRIPT)
    eos = t.convert_ids_to_tokens(end_of_turn_id(t))
    parts = runs(c, m)
    assert [v for v, _ in parts] == [1, 0, 1, 0, 1, 0, 1]
    written = [decode(t, ids) for v, ids in parts if v == 1]
    assert written == [x["content"] + eos for x in TRANSCRIPT if x["role"] == "assistant"]
    assert all(ids == assistant_ids(t, x["content"]) for (v, ids), x in
               zip([q for q in parts if q[0] == 1], [x for x in TRANSCRIPT if x["role"] == "assistant"]))
    observed = [ids for v, ids in parts if v == 0]
    obs_msgs = [x for x in TRANSCRIPT[2:] if x["role"] != "assistant"]
    assert observed == [observation_ids(t, x["role"], x["content"]) for x in obs_msgs]
    if which == "chatml":
        assert decode(t, observed[0]) == "\n<|im_start|>tool\ncd.txt<|im_end|>\n<|im_start|>assistant\n"
        assert decode(t, observed[2]) == "\n<|im_start|>user\nNow write it down.<|im_end|>\n<|im_start|>assistant\n"
    else:
        assert decode(t, observed[0]) == ("\n<|im_start|>user\n<tool_response>\ncd.txt\n</tool_response>"
                                          "<|im_end|>\n<|im_start|>assistant\n")


def test_observation_ids_follow_the_eos_and_end_with_the_generation_prompt(tok):
    head = TRANSCRIPT[:3]
    ids = prompt_ids(tok, head[:2]) + assistant_ids(tok, head[2]["content"]) + observation_ids(tok, "tool", "x y")
    assert decode(tok, ids) == render(tok, head + [{"role": "tool", "content": "x y"}], gen=True)
    # content is tokenized verbatim, not stripped or normalized
    assert decode(tok, observation_ids(tok, "tool", "  a\n\nb ")).count("  a\n\nb ") == 1


def test_encode_transcript_without_a_system_prompt(tok):
    msgs = TRANSCRIPT[1:5]
    p, c, m = encode_transcript(tok, msgs)
    assert decode(tok, p + c) == render(tok, msgs)[:-1]
    assert sum(m) == len(assistant_ids(tok, msgs[1]["content"])) + len(assistant_ids(tok, msgs[3]["content"]))


@pytest.mark.parametrize("msgs,match", [
    (TRANSCRIPT[:3] + [TRANSCRIPT[2]], "two assistant turns in a row"),
    (TRANSCRIPT[:4], "ends with an assistant turn"),
    (TRANSCRIPT[:3] + [TRANSCRIPT[3], TRANSCRIPT[3], TRANSCRIPT[4]], "must follow an assistant turn"),
])
def test_malformed_transcripts_are_errors(tok, msgs, match):
    with pytest.raises(ValueError, match=match):
        encode_transcript(tok, msgs)


def test_template_that_rewrites_history_is_rejected():
    t = load_tokenizer()
    # renders the last message differently from earlier ones: appending changes the prefix
    t.chat_template = ("{% for message in messages %}{% if loop.last %}{{ '<|im_start|>' + message['role'] + "
                       "'\n' + message['content'] + '<|im_end|>\n' }}{% else %}{{ message['content'] + "
                       "'<|im_end|>\n' }}{% endif %}{% endfor %}"
                       "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    with pytest.raises(ValueError, match="only appends"):
        observation_ids(t, "tool", "x")


# ----------------------------------------------------------------------------- SFT layout == sampling layout
class OracleRollout:
    """A 'model' that writes the oracle's turns: episode i's k-th call gets script[i][k]
    (its text's tokens + EOS, as transcript.assistant_ids writes a turn). Episodes are
    live in input order until their script is used up (the oracle's last turn ends them)."""

    def __init__(self, tok, scripts, users):
        self.tok, self.scripts, self.users = tok, scripts, users
        self.next = [0] * len(scripts)
        self.prompts: list[list[list[int]]] = []

    def generate(self, prompts, *, max_new_tokens, temperature, top_p, seeds):
        live = [i for i, s in enumerate(self.scripts) if self.next[i] < len(s)]
        assert len(prompts) == len(live), "an episode ended before (or after) its oracle did"
        self.prompts.append([list(p) for p in prompts])
        out = []
        for i, p in zip(live, prompts):
            assert self.users[i] in decode(self.tok, p)   # the prompt is episode i's
            ids = assistant_ids(self.tok, self.scripts[i][self.next[i]])
            self.next[i] += 1
            out.append(Sample(prompt_ids=list(p), completion_ids=ids, sampler_logprobs=[-0.5] * len(ids),
                              finished=True))
        return out


def _oracle_episodes(tok, harness_name, difficulty, n, perturb):
    from experts.agent.data import make_dataset, oracle_messages
    from rewards.agent import harness_config, make_env

    hc = harness_config(harness_name)
    tasks = [json.loads(t) for t in make_dataset("train", n, seed=3, difficulty=difficulty, harness=harness_name)["task"]]
    oracles = [oracle_messages(t, hc, perturb=perturb and i % 2 == 0, rng=random.Random(i)) for i, t in enumerate(tasks)]
    scripts = [[m["content"] for m in o if m["role"] == "assistant"] for o in oracles]
    rollout = OracleRollout(tok, scripts, [o[0]["content"] for o in oracles])
    envs = [make_env(hc) for _ in tasks]
    eps = run_episodes(rollout, tok, envs, tasks, seeds=list(range(n)), temperature=1.0, top_p=1.0,
                       max_turns=64, max_context_tokens=8192, max_new_tokens=64, eos_ids={end_of_turn_id(tok)})
    return eps, envs, oracles, rollout


@pytest.mark.parametrize("harness,difficulty,perturb,min_segments", [
    ("python_terse", 8, True, 2),        # last_k 4: later turns are re-rendered views, one segment each
    ("python_terse", 2, False, 1),       # too short for last_k to rewrite anything
    ("json_plain", 4, True, 1),
    ("xml_skills_memory", 4, False, 1),  # truncate_obs, memory tools offered
    ("held_out_renamed", 2, True, 1),    # tags syntax, renamed tools
])
def test_encode_segments_equals_what_run_episodes_samples(tok, harness, difficulty, perturb, min_segments):
    eps, envs, oracles, rollout = _oracle_episodes(tok, harness, difficulty, n=3, perturb=perturb)
    assert all(rollout.next[i] == len(s) for i, s in enumerate(rollout.scripts))   # every oracle turn was played
    for ep, env, oracle in zip(eps, envs, oracles):
        assert ep.success and ep.env_error is None and ep.cut is None, (ep.task_id, ep.messages[-3:])
        assert ep.messages[0]["role"] == "system" and ep.messages[1:] == oracle
        rows = encode_segments(tok, ep.messages, env.harness.apply_context)
        assert len(rows) == len(ep.segments) >= min_segments
        for (p, c, m), seg in zip(rows, ep.segments):
            assert p == seg.prompt_ids
            assert c == seg.completion_ids
            assert m == seg.loss_mask
        assert sum(sum(m) for _, _, m in rows) == ep.student_tokens
        # without a context policy it is one row: the whole transcript
        if len(rows) == 1:
            assert rows == [encode_transcript(tok, ep.messages)]
    if min_segments > 1:   # the rewritten views really are not prefixes of the whole transcript
        ep = eps[0]
        assert ep.segments[1].prompt_ids[:len(ep.segments[0].prompt_ids)] == ep.segments[0].prompt_ids
        whole = ep.segments[0].prompt_ids + ep.segments[0].completion_ids
        assert ep.segments[1].prompt_ids != whole[:len(ep.segments[1].prompt_ids)]


def test_encode_segments_without_policy_and_with_identity_policy(tok):
    one = encode_segments(tok, TRANSCRIPT)
    assert one == [encode_transcript(tok, TRANSCRIPT)]
    assert encode_segments(tok, TRANSCRIPT, lambda ms: list(ms)) == one
    # a trailing observation (an episode cut at max_turns) carries no loss and is left out
    cut = TRANSCRIPT[:6]
    assert encode_segments(tok, cut, lambda ms: list(ms)) == [encode_transcript(tok, cut[:5])]


def test_encode_segments_rejects_a_policy_that_stops_rewriting(tok):
    def flaky(ms):   # rewrites the view of the 2nd turn only
        return ms[:2] if len(ms) == 4 else list(ms)

    with pytest.raises(ValueError, match="later stopped rewriting"):
        encode_segments(tok, TRANSCRIPT, flaky)


def test_a_turn_marked_loss_false_is_context_not_a_target(tok):
    # the frontend_loop revise episode's scripted imperfect page: seen by the model, never learnt
    head = [{"role": "system", "content": "s"}, {"role": "user", "content": "make a page"}]
    msgs = head + [{"role": "assistant", "content": "bad page", "loss": False},
                   {"role": "user", "content": "1 of 2 checks fail"},
                   {"role": "assistant", "content": "good page"}]
    _p, ids, mask = encode_transcript(tok, msgs)
    assert decode(tok, [t for t, m in zip(ids, mask) if m]) == decode(tok, assistant_ids(tok, "good page"))
    assert "bad page" in decode(tok, [t for t, m in zip(ids, mask) if not m])
    # under a context policy that rewrites later turns, the marked turn gets no row of its own
    rows = encode_segments(tok, msgs, lambda m: m[:2] + m[-1:] if len(m) > 3 else m)
    assert [decode(tok, [t for t, m in zip(c, k) if m]) for _p, c, k in rows] == [decode(tok, assistant_ids(tok, "good page"))]
