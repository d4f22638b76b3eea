"""ToolEnv over a fake backend: calls, errors the model sees, broken backends, user turns, memory."""
from __future__ import annotations

import pytest

from core.agent.env import Environment, ToolBackend, ToolEnv, ToolError
from core.agent.harness import MemoryStore, ToolCall, ToolSpec, load_harnesses
from core.config import ConfigError

S = {"type": "string"}


class FakeFiles:
    """A file system of one folder: cat a file, echo into one; `crash` breaks the backend.
    The task succeeds when answer.txt holds task["answer"]."""

    def tools(self):
        return {
            "cat": ToolSpec("cat", "Display a file.", {"type": "object", "properties": {"file_name": S},
                                                      "required": ["file_name"]}),
            "echo": ToolSpec("echo", "Write a file.", {"type": "object", "properties": {"content": S, "file_name": S},
                                                      "required": ["content", "file_name"]}),
            "crash": ToolSpec("crash", "Break.", {"type": "object", "properties": {}, "required": []}),
        }

    def reset(self, task):
        self.task = task
        self.files = dict(task["files"])
        self.users = list(task.get("more_users", []))
        self.finished_with = None
        return task["user"]

    def call(self, call: ToolCall) -> str:
        if call.name == "cat":
            if call.args["file_name"] not in self.files:
                raise ToolError(f"no such file: {call.args['file_name']}")
            return self.files[call.args["file_name"]]
        if call.name == "echo":
            self.files[call.args["file_name"]] = call.args["content"]
            return "ok"
        raise RuntimeError("simulator bug")

    def end_turn(self, final_text):
        return self.users.pop(0) if self.users else None

    def finish(self, final_text):
        self.finished_with = final_text
        ok = self.files.get("answer.txt") == self.task["answer"]
        return {"success": ok, "reward": float(ok), "answer_file": self.files.get("answer.txt")}


TASK = {"id": "t0", "family": "files", "user": "Put what a.txt says into answer.txt.",
        "files": {"a.txt": "42"}, "answer": "42"}
MIX = load_harnesses({"harnesses": [
    {"name": "py", "syntax": "python"},
    {"name": "notes", "syntax": "json", "memory": True},
    {"name": "renamed", "syntax": "xml", "rename": {"cat": "show"}, "arg_rename": {"cat.file_name": "path"}},
]})


def env(name="py", backend=None, memory=None) -> ToolEnv:
    return ToolEnv(backend or FakeFiles(), MIX.by_name(name), memory=memory)


def test_protocols():
    e = env()
    assert isinstance(e, Environment) and isinstance(e.backend, ToolBackend)


def test_an_episode_that_succeeds():
    e = env()
    assert e.reset(TASK) == TASK["user"]
    assert [m["role"] for m in e.messages] == ["system", "user"]
    assert "cat(file_name: string)" in e.messages[0]["content"]

    obs, done, info = e.step("cat('a.txt')")
    assert (obs, done) == ("42", False)
    assert info == {"calls": 1, "failed_calls": 0, "env_error": None, "obs_role": "tool"}
    obs, done, info = e.step("echo(content='42', file_name='answer.txt')\ncat(file_name='answer.txt')")
    assert (obs, done, info["calls"]) == ("ok\n42", False, 2)
    obs, done, info = e.step("The answer is written.")
    assert done and info["success"] is True and info["reward"] == 1.0 and info["answer_file"] == "42"
    assert info["env_error"] is None and info["calls"] == 0
    assert (e.calls, e.failed_calls) == (3, 0)
    assert e.backend.finished_with == "The answer is written."
    assert [m["role"] for m in e.messages] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]
    with pytest.raises(RuntimeError, match="reset"):
        e.step("more")


def test_a_wrong_final_answer_fails():
    e = env()
    e.reset(TASK)
    _, done, info = e.step("I am done.")
    assert done and info["success"] is False and info["reward"] == 0.0


def test_failed_call_is_an_error_observation_and_the_episode_goes_on():
    e = env()
    e.reset(TASK)
    obs, done, info = e.step("cat('b.txt')")
    assert (obs, done) == ("error: no such file: b.txt", False)
    assert info["failed_calls"] == 1 and info["calls"] == 1 and info["env_error"] is None
    assert e.messages[-1] == {"role": "tool", "content": obs}
    obs, done, info = e.step("cat('a.txt')")   # recovers
    assert obs == "42" and info["failed_calls"] == 0
    assert (e.calls, e.failed_calls) == (2, 1)


@pytest.mark.parametrize("text,message", [
    ("rm('a.txt')", "error: unknown tool 'rm'; tools: cat, echo, crash"),
    ("cat(__import__('os'))", "error: argument 1 of cat must be a literal value"),
    ("echo('42')", "error: echo is missing the argument 'file_name'"),
])
def test_malformed_call_is_an_error_observation(text, message):
    e = env()
    e.reset(TASK)
    obs, done, info = e.step(text)
    assert obs.startswith(message) and not done
    assert info["failed_calls"] == 1 and info["obs_role"] == "tool"
    assert e.backend.files == TASK["files"]   # nothing ran


def test_renamed_harness_talks_in_shown_names():
    e = env("renamed")
    e.reset(TASK)
    assert "show(path: string)" in e.messages[0]["content"]
    assert e.step('<call name="show"><arg name="path">a.txt</arg></call>')[0] == "42"
    assert e.step('<call name="cat"><arg name="file_name">a.txt</arg></call>')[0].startswith("error: unknown tool 'cat'")


@pytest.mark.parametrize("where", ["call", "end_turn", "finish"])
def test_backend_raising_fails_the_episode_not_the_run(where, monkeypatch):
    backend = FakeFiles()
    e = env(backend=backend)
    e.reset(TASK)
    if where == "call":
        text = "cat('a.txt')\ncrash()"
    else:
        monkeypatch.setattr(backend, where, lambda final: (_ for _ in ()).throw(KeyError("state lost")))
        text = "All done."
    obs, done, info = e.step(text)
    assert done and info["success"] is False and info["reward"] == 0.0
    assert info["env_error"] in ("RuntimeError('simulator bug')", "KeyError('state lost')")
    assert e.messages[-1]["role"] == "assistant"
    # the next episode on the same env runs normally
    e.reset(TASK)
    assert e.step("cat('a.txt')")[0] == "42"


def test_next_user_turn():
    e = env()
    e.reset({**TASK, "more_users": ["Now also copy it to b.txt."]})
    obs, done, info = e.step("Sure.")
    assert (obs, done, info["obs_role"]) == ("Now also copy it to b.txt.", False, "user")
    assert e.messages[-1] == {"role": "user", "content": obs}
    e.step("echo('42', 'answer.txt')")
    _, done, info = e.step("Done.")
    assert done and info["success"]


def test_memory_is_kept_across_episodes_of_a_family():
    store = MemoryStore()
    e = env("notes", memory=store)
    e.reset(TASK)
    call = '```json\n{"name": "write_note", "arguments": {"text": "answers go to answer.txt"}}\n```'
    obs, _, info = e.step(call)
    assert obs == "saved" and info["calls"] == 1
    read = '```json\n{"name": "read_notes", "arguments": {}}\n```'
    # a later episode of the family, in another env sharing the store, reads the note
    e2 = env("notes", memory=store)
    e2.reset({**TASK, "id": "t1"})
    assert e2.step(read)[0] == "1. answers go to answer.txt"
    # another family does not
    e2.reset({**TASK, "family": "math"})
    assert e2.step(read)[0] == "no notes yet"
    # without memory the tools are not offered at all
    e3 = env("py")
    e3.reset(TASK)
    assert e3.step("read_notes()")[0].startswith("error: unknown tool 'read_notes'")


def test_task_tools_narrow_the_prompt():
    class Narrow(FakeFiles):
        def task_tools(self, task):
            return ["cat"]
    e = env(backend=Narrow())
    e.reset(TASK)
    assert "cat(" in e.messages[0]["content"] and "echo(" not in e.messages[0]["content"]
    assert e.step("echo('1', 'answer.txt')")[0] == "error: unknown tool 'echo'; tools: cat"
    assert "echo(" in e.full_harness.system_prompt()


def test_harness_naming_a_missing_tool_is_a_config_error():
    cfg = load_harnesses({"harnesses": [{"name": "bad", "tools": ["cat", "ls"]}]}).harnesses[0]
    with pytest.raises(ConfigError, match="harness 'bad': tools: unknown tool 'ls'"):
        ToolEnv(FakeFiles(), cfg)
