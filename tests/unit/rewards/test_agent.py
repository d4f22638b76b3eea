"""rewards/agent.py: the BFCL-simulator backend (dispatch by name with checked arguments,
recoverable errors, never eval), the env through harnesses, the multi-turn check (state,
results, answer) and the TRL-style reward that replays an episode, also through bfcl's
own multi_turn_checker."""
from __future__ import annotations

import copy
import decimal
import json

import mpmath
import pytest

pytest.importorskip("bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker")

from core.agent.env import ToolError  # noqa: E402
from core.agent.harness import ToolCall, load_harnesses  # noqa: E402
from rewards import agent  # noqa: E402
from rewards.agent import (BFCLBackend, answer_matches, execute, harness_config, make_env, new_instances,  # noqa: E402
                           replay, reward, score_episode, shown_result)

FILES = {"a.txt": "b.txt", "b.txt": "plum", "c.txt": "lime", "answer.txt": ""}
TASK = {
    "id": "files-test", "family": "files", "toolset": "procedural", "horizon": 3,
    "initial_config": {"GorillaFileSystem": {"root": {"w": {"type": "directory", "contents": {
        n: {"type": "file", "content": c} for n, c in FILES.items()}}}}},
    "involved_classes": ["GorillaFileSystem"], "tools": ["ls", "cat", "echo"],
    "user": "Follow the files from a.txt and write the last text to answer.txt.",
    "ground_truth": [{"name": "cat", "args": {"file_name": "a.txt"}}, {"name": "cat", "args": {"file_name": "b.txt"}},
                     {"name": "echo", "args": {"content": "plum", "file_name": "answer.txt"}}],
}
MATH = {
    "id": "math-test", "family": "math", "toolset": "procedural", "horizon": 2, "initial_config": {},
    "involved_classes": ["MathAPI"], "tools": ["add", "subtract", "multiply"],
    "user": "Start with 7, then +5 *3. Give the result.",
    "ground_truth": [{"name": "add", "args": {"a": 7, "b": 5}}, {"name": "multiply", "args": {"a": 12, "b": 3}}],
    "answer": "36",
}
MSG = {
    "id": "messages-test", "family": "messages", "toolset": "procedural", "horizon": 2,
    "initial_config": {"MessageAPI": {"user_map": {"Ana": "U42", "Ben": "U17"}, "user_count": 2, "inbox": [],
                                      "message_count": 0, "current_user": "U00", "random_seed": 7}},
    "involved_classes": ["MessageAPI"], "tools": ["get_user_id", "send_message"],
    "user": "Look up Ana. Send 'hi' to the last id.",
    "ground_truth": [{"name": "get_user_id", "args": {"user": "Ana"}},
                     {"name": "send_message", "args": {"receiver_id": "U42", "message": "hi"}}],
}


def _py(*calls: str) -> list[dict]:
    """A transcript in the python_terse harness: each call its own assistant message, then
    the final answer (observations are not needed: the reward replays)."""
    return [{"role": "assistant", "content": c} for c in calls]


def _score(task, messages, harness="python_terse", checker="env"):
    return reward(["x"], [messages], task=[json.dumps(task)], harness=[harness], checker=checker)[0]


# ----------------------------------------------------------------------------- backend

def test_backend_runs_calls_and_reports_errors():
    b = BFCLBackend()
    assert set(b.tools()) == set(agent.PROCEDURAL_TOOLS)
    assert b.task_tools(TASK) == ["ls", "cat", "echo"]
    assert b.reset(TASK) == TASK["user"]
    assert b.call(ToolCall("cat", {"file_name": "a.txt"})) == "b.txt"       # a one-key result shows its value
    assert b.call(ToolCall("ls", {})) == json.dumps(list(FILES), separators=(",", ":"))
    with pytest.raises(ToolError, match="No such file"):
        b.call(ToolCall("cat", {"file_name": "zz.txt"}))                      # bfcl's {"error": ...}
    with pytest.raises(ToolError, match="not available"):
        b.call(ToolCall("add", {"a": 1, "b": 2}))                             # another family's tool
    with pytest.raises(ToolError, match="not available"):
        b.call(ToolCall("_load_scenario", {"scenario": {}}))                  # private methods never run
    with pytest.raises(ToolError, match="no argument"):
        b.call(ToolCall("cat", {"file_name": "a.txt", "mode": "x"}))
    with pytest.raises(ToolError, match="missing"):
        b.call(ToolCall("cat", {}))
    assert b.call(ToolCall("echo", {"content": "plum", "file_name": "answer.txt"})) == "ok"
    assert b.turn_calls == 8 and len(b.results) == 8   # failed calls count, as bfcl's executor records them


def test_simulator_exceptions_and_huge_values_are_failed_calls():
    inst = new_instances({"involved_classes": ["MathAPI"], "initial_config": {}})
    offered = {n: "MathAPI" for n in ("add", "power", "logarithm", "mean")}
    _r, text, err = execute(inst, offered, "add", {"a": "x", "b": 1})
    assert err == "Both inputs must be numbers" and json.loads(text) == {"error": err}
    for args, name in (({"base": 10, "exponent": 10**9}, "power"), ({"value": 1, "base": 2, "precision": 10**9},
                                                                      "logarithm"), ({"numbers": [1] * 5000}, "mean")):
        _r, text, err = execute(inst, offered, name, args)
        assert err and "too" in err and text.startswith("Error during execution")
    dps, prec = mpmath.mp.dps, decimal.getcontext().prec
    _r, _t, err = execute(inst, offered, "logarithm", {"value": 10, "base": 2, "precision": 60})
    assert err is None and (mpmath.mp.dps, decimal.getcontext().prec) == (dps, prec)   # process precision kept
    _r, _t, err = execute(inst, offered, "add", {"a": object(), "b": 1})
    assert err == "add: arguments must be plain JSON values"


def test_shown_results_and_answers():
    assert shown_result({"result": 39}, bare=True) == "39"
    assert shown_result(None, bare=True) == "ok"
    assert shown_result({"a": 1, "b": "x"}, bare=True) == '{"a":1,"b":"x"}'
    assert shown_result({"file_content": "plum"}) == '{"file_content":"plum"}'
    assert shown_result(None) == "null"
    for text, ans, ok in (("36", "36", True), ("The result is 36.", "36", True), ("36.0", "36", True),
                          ("36 or 37", "36", False), ("", "36", False), ("-4", "-4", True), ("4", "-4", False),
                          ("Done: Plum", "plum", True), ("3 6", "36", False)):
        assert answer_matches(text, ans) is ok, (text, ans)


def test_toolsets_and_task_checks():
    with pytest.raises(ValueError, match="toolset"):
        make_env(harness_config()).reset({**TASK, "toolset": "bfcl"})   # the env's toolset is procedural
    with pytest.raises(ValueError, match="toolset"):
        agent.toolset_specs("nope")
    with pytest.raises(ValueError, match="belongs to none"):
        make_env(harness_config()).reset({**TASK, "tools": ["cat", "add"]})
    with pytest.raises(ValueError, match="turns"):
        make_env(harness_config()).reset({**TASK, "user": ["a", "b"]})
    with pytest.raises(ValueError, match="unknown simulator class"):
        make_env(harness_config()).reset({**TASK, "involved_classes": ["os"]})
    mix = load_harnesses(agent.HARNESSES)
    for h in mix.harnesses + mix.held_out_combo + mix.held_out:   # every harness fits both toolsets
        make_env(h)
        make_env(h, toolset="bfcl")
    assert len(agent.toolset_specs("bfcl")) == 128   # the 8 classes of the multi-turn categories


# ----------------------------------------------------------------------------- env + reward

def test_env_episode_with_a_failed_call_and_recovery():
    env = make_env(harness_config("json_plain"))
    assert env.reset(TASK) == TASK["user"]
    assert set(env.harness.tools) == {"ls", "cat", "echo"}   # only the task's tools are shown
    obs, done, info = env.step('```json\n{"name": "cat", "arguments": {"file_name": "b.txt"\n```')
    assert obs.startswith("error:") and not done and info["failed_calls"] == 1       # malformed: harness error
    obs, done, info = env.step('```json\n{"name": "cat", "arguments": {"file_name": "q.txt"}}\n```')
    assert obs == "error: cat: 'q.txt': No such file or directory" and info["failed_calls"] == 1
    for f in ("a.txt", "b.txt"):
        obs, done, info = env.step(env.harness.render([ToolCall("cat", {"file_name": f})]))
    assert obs == "plum" and not done
    env.step(env.harness.render([ToolCall("echo", {"content": "plum", "file_name": "answer.txt"})]))
    obs, done, info = env.step("done")
    assert done and info["success"] and info["reward"] == 1.0 and info["failure"] is None
    assert env.failed_calls == 2


@pytest.mark.parametrize("checker", ["env", "bfcl"])
def test_reward_replays_the_episode(checker):
    ok = _py("cat(file_name='a.txt')", "cat('b.txt')", "echo(content='plum', file_name='answer.txt')", "done")
    assert _score(TASK, ok, checker=checker) == 1.0
    assert _score(TASK, [{"role": "user", "content": "ignored"}] + ok, checker=checker) == 1.0
    # a failed call on the way does not matter; the right final state does
    assert _score(TASK, _py("cat('zz.txt')") + ok, checker=checker) == 1.0
    assert _score(TASK, ok[1:], checker=checker) == 0.0                          # a result missing (a.txt not read)
    assert _score(TASK, ok[:2] + ok[3:], checker=checker) == 0.0                 # answer.txt never written
    assert _score(TASK, _py("cat('a.txt')", "cat('b.txt')", "echo(content='lime', file_name='answer.txt')",
                            "done"), checker=checker) == 0.0                     # wrong state
    assert _score(TASK, ok[:3], checker=checker) == 0.0                          # never ended: cut
    assert _score(TASK, _py("done"), checker=checker) == 0.0                     # no call at all
    assert _score(TASK, [], checker=checker) == 0.0
    assert _score(TASK, "cat('a.txt')", checker=checker) == 0.0                  # a string completion
    # the harness a row names is the one its transcript is parsed with
    assert _score(TASK, ok, harness="json_plain", checker=checker) == 0.0        # python text is no json call


@pytest.mark.parametrize("checker", ["env", "bfcl"])
def test_reward_math_answer_and_messages_state(checker):
    ok = _py("add(a=7, b=5)", "multiply(a=12, b=3)", "36")
    assert _score(MATH, ok, checker=checker) == 1.0
    assert _score(MATH, ok[:2] + _py("35"), checker=checker) == 0.0              # wrong answer stated
    assert _score(MATH, _py("add(a=7, b=5)", "multiply(a=12, b=2)", "36"), checker=checker) == 0.0
    assert _score(MATH, _py("add(a=7, b=5)", "add(a=7, b=5)", "multiply(a=12, b=3)", "36"), checker=checker) == 1.0
    ok = _py("get_user_id(user='Ana')", "send_message(receiver_id='U42', message='hi')", "done")
    assert _score(MSG, ok, checker=checker) == 1.0
    assert _score(MSG, ok[1:], checker=checker) == 0.0
    assert _score(MSG, _py("get_user_id(user='Ana')", "send_message(receiver_id='U17', message='hi')", "done"),
                  checker=checker) == 0.0
    assert _score(MSG, ok[:1] + _py("send_message(receiver_id='U42', message='hi')") + ok[1:],
                  checker=checker) == 0.0                                       # a second message: other state


def test_model_output_is_never_evaluated(tmp_path):
    marker = tmp_path / "pwned"
    evil = [f"__import__('os').system('touch {marker}')", f"cat(file_name=open('{marker}', 'w').name)",
            "cat(file_name='a.txt'); import os", f"[cat(__import__('os').system('touch {marker}'))]"]
    for text in evil:
        assert _score(TASK, _py(text, "done")) == 0.0
        assert _score(TASK, _py(text, "done"), checker="bfcl") == 0.0
    env = make_env(harness_config("python_terse"))
    env.reset(TASK)
    for text in evil:
        obs, done, info = env.step(text)
        assert obs.startswith("error:") and not done, obs
    assert not marker.exists()


def test_reward_columns_and_other_domains():
    ok = _py("cat(file_name='a.txt')", "cat('b.txt')", "echo(content='plum', file_name='answer.txt')", "done")
    got = reward(["p", "q"], [ok, "x"], task=[json.dumps(TASK), None], harness=["python_terse", None],
                 domain=["agent", "math"])
    assert got == [1.0, None]
    assert reward(["p"], [ok], task=[TASK], harness="python_terse") == [1.0]     # a dict task, one harness name
    with pytest.raises(ValueError, match="task"):
        reward(["p"], [ok])
    with pytest.raises(ValueError, match="bad task"):
        reward(["p"], [ok], task=['{"id": "x"}'])
    with pytest.raises(ValueError, match="values of 'task'"):
        reward(["p", "q"], [ok, ok], task=[json.dumps(TASK)])
    with pytest.raises(ValueError, match="checker"):
        score_episode(TASK, ok, "python_terse", checker="nope")
    assert reward.__name__ == "reward_agent"


def test_replay_is_deterministic_and_bfcl_cache_is_cleaned():
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

    before = set(vars(multi_turn_utils))
    ok = _py("get_user_id(user='Ana')", "send_message(receiver_id='U42', message='hi')", "done")
    infos = [replay(copy.deepcopy(MSG), ok, harness_config("python_terse"))[1] for _ in range(2)]
    assert infos[0].results == infos[1].results          # seeded message ids: the same run twice
    assert "new_id" in infos[0].results[1]
    for _ in range(3):
        assert _score(MSG, ok, checker="bfcl") == 1.0
    assert set(vars(multi_turn_utils)) == before          # no simulator instances left in bfcl's globals
