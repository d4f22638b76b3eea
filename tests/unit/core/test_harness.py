"""The harness: prompt, parsing (never eval), rendering, renames, context, memory, presets."""
from __future__ import annotations

import builtins
import random
from pathlib import Path

import pytest

from core.agent.harness import (CallSyntaxError, Harness, HarnessConfig, MemoryStore, ToolCall, ToolSpec,
                                harness_of, load_harnesses)
from core.config import ConfigError

REPO = Path(__file__).resolve().parents[3]
PRESETS = REPO / "recipes" / "harnesses" / "agent.yaml"
SYNTAXES = ["json", "xml", "python", "tags"]


def _spec(name, desc, props, required):
    return ToolSpec(name, desc, {"type": "object", "properties": props, "required": required})


S = {"type": "string"}
TOOLS = {
    "cat": _spec("cat", "Display the contents of a file. No path is allowed.", {"file_name": S}, ["file_name"]),
    "echo": _spec("echo", "Write content to a file.", {"content": S, "file_name": S}, ["content"]),
    "ls": _spec("ls", "List the directory.", {"a": {"type": "boolean"}}, []),
    "add": _spec("add", "Add two numbers.", {"a": {"type": "number"}, "b": {"type": "number"}}, ["a", "b"]),
    "repeat": _spec("repeat", "Repeat a word.", {"word": S, "n": {"type": "integer"},
                                                  "tags": {"type": "array"}, "opts": {"type": "object"},
                                                  "mode": {"type": "string", "enum": ["up", "down"]}},
                    ["word", "n"]),
}
# The nine canonical tools of the agent domain, with BFCL's type spellings ("dict", "float").
BFCL_TOOLS = {
    "cat": ToolSpec("cat", "This tool belongs to the Gorilla file system. It is a simple file system. "
                    "Tool description: Display the contents of a file of any extension from currrent directory.",
                    {"type": "dict", "properties": {"file_name": S}, "required": ["file_name"]}),
    "echo": ToolSpec("echo", "Write content to a file.", {"type": "dict", "properties": {"content": S, "file_name": S},
                                                          "required": ["content"]}),
    "ls": ToolSpec("ls", "List the contents of the current directory.",
                   {"type": "dict", "properties": {"a": {"type": "boolean"}}, "required": []}),
    "cd": ToolSpec("cd", "Change the directory.", {"type": "dict", "properties": {"folder": S}, "required": ["folder"]}),
    **{op: ToolSpec(op, f"{op} two numbers.", {"type": "dict", "properties": {"a": {"type": "float"},
                                                                              "b": {"type": "float"}},
                                               "required": ["a", "b"]}) for op in ("add", "subtract", "multiply")},
    "get_user_id": ToolSpec("get_user_id", "Get user ID from user name.",
                            {"type": "dict", "properties": {"user": S}, "required": ["user"]}),
    "send_message": ToolSpec("send_message", "Send a message to a user.",
                             {"type": "dict", "properties": {"receiver_id": S, "message": S},
                              "required": ["receiver_id", "message"]}),
}


def harness(syntax="json", env=TOOLS, store=None, **kw) -> Harness:
    return harness_of({"name": "h", "syntax": syntax, **kw}, env, store)


# ----------------------------------------------------------------------------- round trips
CALLS = [
    ToolCall("cat", {"file_name": "a.txt"}),
    ToolCall("echo", {"content": "x</arg> & <call name=\"q\"> 'it''s' \"\n\ttwo lines ```", "file_name": "b.txt"}),
    ToolCall("add", {"a": 1, "b": -2.5}),
    ToolCall("repeat", {"word": "3", "n": 2, "tags": ["a", 1, True, None], "opts": {"k": [1.0, "v"]}, "mode": "up"}),
    ToolCall("ls", {}),
    ToolCall("ls", {"a": False}),
]


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_render_parse_round_trip(syntax):
    h = harness(syntax)
    for call in CALLS:
        assert h.parse(h.render([call])) == [call], call
    both = h.parse(h.render(CALLS))
    assert both == CALLS
    # types survive: 1 stays an int, 1.0 a float, "3" a string
    assert type(both[2].args["a"]) is int and type(both[3].args["opts"]["k"][0]) is float
    assert both[3].args["word"] == "3"


@pytest.mark.parametrize("syntax,text", [
    ("json", 'Let me look.\n```json\n{"name": "cat", "arguments": {"file_name": "a.txt"}}\n```'),
    ("json", '```json\n[{"name": "cat", "arguments": {"file_name": "a.txt"}}, {"name": "ls", "arguments": {}}]\n```'),
    ("xml", '<call name="cat">\n  <arg name="file_name">a.txt</arg>\n</call>\n<call name=\'ls\'></call>'),
    ("python", "cat(file_name='a.txt')\nls()"),
    ("python", "[cat('a.txt'), ls()]"),
    ("python", "```python\ncat(\"a.txt\")\nls()\n```"),
    ("tags", '<tool_call>{"name": "cat", "arguments": {"file_name": "a.txt"}}</tool_call>\n'
             '<tool_call>{"name": "ls"}</tool_call>'),
])
def test_parse_written_forms(syntax, text):
    calls = harness(syntax).parse(text)
    assert calls[0] == ToolCall("cat", {"file_name": "a.txt"})
    if len(calls) > 1:
        assert calls[1] == ToolCall("ls", {})


@pytest.mark.parametrize("syntax", SYNTAXES)
@pytest.mark.parametrize("text", ["The answer is 42.", "", "Done (the file is written).", "cat is a tool"])
def test_text_without_a_call_is_a_final_answer(syntax, text):
    assert harness(syntax).parse(text) == []


def test_positional_args_follow_the_schema_order():
    h = harness("python")
    assert h.parse("add(1, 2)") == [ToolCall("add", {"a": 1, "b": 2})]
    assert h.parse("repeat('w', 3, mode='down')") == [ToolCall("repeat", {"word": "w", "n": 3, "mode": "down"})]
    assert h.parse("echo('hi', file_name='f')") == [ToolCall("echo", {"content": "hi", "file_name": "f"})]


def test_xml_values_are_typed_by_the_schema():
    h = harness("xml")
    [c] = h.parse('<call name="repeat"><arg name="word">7</arg><arg name="n"> 3 </arg>'
                  '<arg name="tags">["a", 2]</arg><arg name="opts">{"k": 1}</arg></call>')
    assert c.args == {"word": "7", "n": 3, "tags": ["a", 2], "opts": {"k": 1}}
    [c] = h.parse('<call name="add"><arg name="a">2</arg><arg name="b">0.5</arg></call>')
    assert c.args == {"a": 2, "b": 0.5}
    assert h.parse('<call name="ls"><arg name="a">True</arg></call>')[0].args == {"a": True}


# ----------------------------------------------------------------------------- rejections
@pytest.mark.parametrize("syntax,text,message", [
    ("json", '```json\n{"name": "foo", "arguments": {}}\n```', "unknown tool 'foo'; tools: cat, echo, ls, add, repeat"),
    ("json", '```json\n{"name": "cat", "arguments": {"file_name": "a"\n```', "not valid JSON"),
    ("json", '```json\n{"name": "cat", "arguments": {"file_name": "a"}}', "is closed with ```"),
    ("json", '```json\n{"name": "cat", "args": {"file_name": "a"}}\n```', "unexpected key 'args'"),
    ("json", '```json\n{"name": "cat", "arguments": ["a"]}\n```', "must be an object"),
    ("json", '```json\n"cat"\n```', '{"name": "<tool>", "arguments": {...}}'),
    ("json", '```json\n{"name": "cat", "arguments": {"file": "a"}}\n```', "cat has no argument 'file'; arguments: file_name"),
    ("json", '```json\n{"name": "cat", "arguments": {}}\n```', "cat is missing the argument 'file_name'"),
    ("json", '```json\n{"name": "cat", "arguments": {"file_name": 3}}\n```', "'file_name' of cat must be string, got integer"),
    ("json", '```json\n{"name": "repeat", "arguments": {"word": "w", "n": 2.0}}\n```', "must be integer, got number"),
    ("json", '```json\n{"name": "repeat", "arguments": {"word": "w", "n": true}}\n```', "must be integer, got boolean"),
    ("json", '```json\n{"name": "add", "arguments": {"a": "1", "b": 2}}\n```', "must be number, got string"),
    ("json", '```json\n{"name": "repeat", "arguments": {"word": "w", "n": 1, "mode": "left"}}\n```',
     'must be one of "up", "down"'),
    ("xml", '<call name="cat"><arg name="file_name">a</arg>', "<call name="),
    ("xml", '<call name="cat">oops<arg name="file_name">a</arg></call>', "only <arg"),
    ("xml", '<call name="repeat"><arg name="word">w</arg><arg name="n">three</arg></call>', "must be integer"),
    ("xml", '<call name="cat"><arg name="file_name">a</arg><arg name="file_name">b</arg></call>', "twice"),
    ("xml", '<call name="cp"></call>', "unknown tool 'cp'"),
    ("tags", '<tool_call>{"name": "cat", "arguments": {"file_name": "a"}}', "is closed with </tool_call>"),
    ("python", "foo(1)", "unknown tool 'foo'; tools: cat, echo, ls, add, repeat"),
    ("python", "__import__('os').system('x')", "is not a tool"),
    ("python", "os.system('ls')", "'os.system' is not a tool"),
    ("python", "cat(*names)", "*args are not allowed"),
    ("python", "cat(**kw)", "**kwargs are not allowed"),
    ("python", "cat(file_name=open('/etc/passwd'))", "must be a literal value"),
    ("python", "cat(file_name=x)", "must be a literal value"),
    ("python", "cat(file_name='a' + 'b')", "must be a literal value"),
    ("python", "cat(file_name={1, 2})", "set values are not allowed"),
    ("python", "cat(file_name=None)", "'file_name' of cat must be string, got null"),
    ("python", "cat(file_name=b'a')", "bytes values are not allowed"),
    ("python", "cat('a.txt'", "could not parse the call"),
    ("python", "x = cat('a')\ncat('b')", "write only tool calls"),
    ("python", "import os\ncat('a')", "write only tool calls"),
    ("python", "[cat('a'), 3]", "write only tool calls"),
    ("python", "cat(1)", "'file_name' of cat must be string, got integer"),
    ("python", "add(1, 2, 3)", "add takes 2 arguments (a, b), got 3 positional"),
    ("python", "add(1, a=2, b=3)", "got argument 'a' twice"),
    ("python", "add(a=1)", "missing the argument 'b'"),
    ("python", "cat(name='a')", "cat has no argument 'name'; arguments: file_name"),
])
def test_malformed_calls_are_rejected_with_a_message(syntax, text, message):
    with pytest.raises(CallSyntaxError) as e:
        harness(syntax).parse(text)
    assert message in str(e.value)


def test_python_syntax_never_evaluates(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    h = harness("python")
    for attack in [f"__import__('os').system('touch {marker}')",
                   f"cat(file_name=__import__('os').system('touch {marker}'))",
                   f"[cat('a'), __import__('pathlib').Path('{marker}').touch()]",
                   f"cat(file_name=(lambda: __import__('os').system('touch {marker}'))())"]:
        with pytest.raises(CallSyntaxError):
            h.parse(attack)
    assert not marker.exists()

    def refuse(*a, **k):
        raise AssertionError("eval/exec used")
    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    assert h.parse("add(a=1, b=2.5)") == [ToolCall("add", {"a": 1, "b": 2.5})]


def test_limits_on_size():
    h = harness("python")
    with pytest.raises(CallSyntaxError, match="too many calls"):
        h.parse("\n".join(["ls()"] * 17))
    with pytest.raises(CallSyntaxError, match="too long"):
        h.parse("cat('" + "a" * 30_000 + "')")
    with pytest.raises(CallSyntaxError):   # deep nesting: an error, not a crash
        h.parse("cat(" + "[" * 5000 + "]" * 5000 + ")")


# ----------------------------------------------------------------------------- renames
RENAMED = {"rename": {"cat": "show_file", "add": "plus"}, "arg_rename": {"cat.file_name": "path", "add.a": "x"}}


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_renames_map_shown_names_to_canonical(syntax):
    h = harness(syntax, **RENAMED)
    prompt = h.system_prompt()
    assert "show_file(path: string)" in prompt and "plus(x: number, b: number)" in prompt
    assert "cat(" not in prompt and "(file_name" not in prompt
    calls = [ToolCall("cat", {"file_name": "a.txt"}), ToolCall("add", {"a": 1, "b": 2})]
    text = h.render(calls)
    assert "show_file" in text and "path" in text and "cat" not in text
    assert h.parse(text) == calls
    # the canonical names are not what this harness's model is told, so they are unknown
    with pytest.raises(CallSyntaxError, match="unknown tool 'cat'; tools: show_file, echo, ls, plus, repeat"):
        harness(syntax, **RENAMED).parse(harness(syntax).render([calls[0]]))
    with pytest.raises(CallSyntaxError, match="no argument 'file_name'; arguments: path"):
        h.parse(harness(syntax, rename={"cat": "show_file"}).render([calls[0]]))


@pytest.mark.parametrize("cfg,message", [
    ({"tools": ["cat", "rm"]}, "tools: unknown tool 'rm'"),
    ({"rename": {"rm": "remove"}}, "rename: 'rm' is not an offered tool"),
    ({"tools": ["cat"], "rename": {"echo": "write"}}, "rename: 'echo' is not an offered tool"),
    ({"arg_rename": {"cat.path": "p"}}, "cat' has no argument 'path'"),
    ({"arg_rename": {"rm.path": "p"}}, "'rm' is not an offered tool"),
    ({"rename": {"cat": "ls"}}, "both shown as 'ls'"),
    ({"arg_rename": {"add.a": "b"}}, "both shown as 'b'"),
    ({"rename": {"cat": "show-file"}}, "must be an identifier"),
    ({"syntax": "python", "rename": {"cat": "import"}}, "must be an identifier"),
])
def test_harness_that_does_not_fit_the_tools_is_a_config_error(cfg, message):
    with pytest.raises(ConfigError, match="harness 'h'") as e:
        harness(**cfg)
    assert message in str(e.value)


def test_memory_tool_clash_is_a_config_error():
    tools = {**TOOLS, "read_notes": _spec("read_notes", "x", {}, [])}
    with pytest.raises(ConfigError, match="already has a tool named 'read_notes'"):
        harness(env=tools, memory=True)


# ----------------------------------------------------------------------------- config loading
@pytest.mark.parametrize("data,message", [
    ({"harnesses": [{"name": "a", "sytnax": "json"}]}, "harnesses[0]: unknown key 'sytnax'"),
    ({"harnesses": [{"name": "a", "syntax": "yaml"}]}, "harnesses[0].syntax: expected one of"),
    ({"harnesses": [{"name": "a", "context": {"kind": "last_k", "k": 0}}]}, "context.k must be >= 1"),
    ({"harnesses": [{"name": "a", "system_prompt": "Tools: {tools}"}]}, "must contain {syntax}"),
    ({"harnesses": [{"name": "a", "system_prompt": "{tools}{syntax}{tool}"}]}, "unknown placeholder {tool}"),
    ({"harnesses": [{"name": "a", "skills": ["x"], "system_prompt": "{tools}{syntax}"}]}, "no {skills}"),
    ({"harnesses": [{"name": "a", "arg_rename": {"cat": "x"}}]}, "must be 'tool.arg'"),
    ({"harnesses": [{"name": "a"}], "weights": [1, 2]}, "2 weights for 1 harnesses"),
    ({"harnesses": [{"name": "a"}], "held_out": [{"name": "a"}]}, "'a' is used twice"),
    ({"harnesses": []}, "at least one harness"),
    ({"harnesses": [{"syntax": "json"}]}, "missing required key 'name'"),
])
def test_bad_harness_mix_names_the_key(tmp_path, data, message):
    import yaml
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as e:
        load_harnesses(path)
    assert str(path) in str(e.value) and message in str(e.value)
    with pytest.raises(ConfigError, match="<harness dict>"):
        load_harnesses(data)


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_harnesses(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("harnesses: [")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_harnesses(bad)


def test_mix_sampling_follows_weights():
    mix = load_harnesses({"harnesses": [{"name": "a"}, {"name": "b"}, {"name": "c"}], "weights": [1, 0, 3]})
    rng = random.Random(0)
    names = [mix.sample(rng).name for _ in range(2000)]
    assert names.count("b") == 0 and 0.2 < names.count("a") / 2000 < 0.3
    assert [mix.sample(random.Random(5)).name for _ in range(3)] == [mix.sample(random.Random(5)).name] * 3
    assert mix.by_name("c").name == "c"
    with pytest.raises(KeyError, match="known: a, b, c"):
        mix.by_name("d")


# ----------------------------------------------------------------------------- prompt
def test_system_prompt_is_compact():
    h = harness("python", env=BFCL_TOOLS, system_prompt="Tools:\n{tools}\n{syntax}")
    lines = h.system_prompt().splitlines()
    assert lines[0] == "Tools:"
    assert lines[1] == "cat(file_name: string) - Display the contents of a file of any extension from currrent directory."
    assert "echo(content: string, file_name?: string) - Write content to a file." in lines
    assert "add(a: number, b: number) - add two numbers." in lines   # BFCL's "float" shown as number
    example = [ln for ln in lines if "cat(file_name='x')" in ln]
    assert example and h.parse("cat(file_name='x')") == [ToolCall("cat", {"file_name": "x"})]
    assert len(h.system_prompt()) < 1200
    terse = harness("python", env=BFCL_TOOLS, max_description_chars=0).system_prompt()
    assert "cat(file_name: string)\n" in terse and "Display" not in terse
    short = harness("json", env=BFCL_TOOLS, max_description_chars=30).system_prompt()
    assert "cat(file_name: string) - Display the contents of a...\n" in short


@pytest.mark.parametrize("syntax", SYNTAXES)
def test_the_prompt_example_parses(syntax):
    h = harness(syntax, env=BFCL_TOOLS)
    prompt = h.system_prompt()
    example = h.render([h.example_call()])
    assert example in prompt and h.parse(example) == [h.example_call()]


def test_skills_and_memory_in_the_prompt():
    h = harness("xml", skills=["Read before you write."], memory=True, rename={"read_notes": "notes"})
    p = h.system_prompt()
    assert "- Read before you write." in p
    assert "write_note(text: string)" in p and "notes()" in p and "read_notes" not in p
    assert "write_note" not in harness("xml").system_prompt()


# ----------------------------------------------------------------------------- context, observations, memory
def _transcript():
    m = [{"role": "system", "content": "S"}, {"role": "user", "content": "U0"}]
    for i in range(5):
        m += [{"role": "assistant", "content": f"A{i}"}, {"role": "tool", "content": f"T{i}"}]
        if i == 1:
            m.append({"role": "user", "content": "U1"})
    return m


def test_context_policies():
    msgs = _transcript()
    assert harness().apply_context(msgs) == msgs
    kept = harness(context={"kind": "last_k", "k": 2}).apply_context(msgs)
    assert [m["content"] for m in kept] == ["S", "U0", "U1", "A3", "T3", "A4", "T4"]
    kept = harness(context={"kind": "last_k", "k": 4}).apply_context(msgs)
    assert [m["content"] for m in kept] == ["S", "U0", "A1", "T1", "U1", "A2", "T2", "A3", "T3", "A4", "T4"]
    assert harness(context={"kind": "last_k", "k": 9}).apply_context(msgs) == msgs
    cut = harness(context={"kind": "truncate_obs", "max_obs_chars": 5})
    assert cut.format_observation(["0123456789", "abc"]) == "01234...(cut)\nabc"
    assert harness().format_observation(["0123456789", "abc"]) == "0123456789\nabc"


def test_memory_store_is_bounded_and_per_family():
    store = MemoryStore(max_notes=3, max_chars=5)
    for i in range(5):
        store.write("files", f"note{i}-long")
    assert store.read("files") == ["note2", "note3", "note4"]
    assert store.read("math") == []
    h = harness(store=store, memory=True)
    assert h.builtin(ToolCall("write_note", {"text": "hi"}), "math") == "saved"
    assert h.builtin(ToolCall("read_notes", {}), "math") == "1. hi"
    assert h.builtin(ToolCall("read_notes", {}), "other") == "no notes yet"
    assert h.builtin(ToolCall("cat", {"file_name": "a"}), "math") is None
    assert harness().builtin(ToolCall("write_note", {"text": "x"})) is None   # memory off: not a builtin


def test_restricted_offers_a_subset():
    h = harness("python", memory=True)
    small = h.restricted(["cat", "rm"])
    assert list(small.tools) == ["cat", "write_note", "read_notes"]
    assert "add(" not in small.system_prompt() and "add(" in h.system_prompt()
    with pytest.raises(CallSyntaxError, match="unknown tool 'add'; tools: cat, write_note, read_notes"):
        small.parse("add(1, 2)")
    assert h.restricted(None) is h
    with pytest.raises(ValueError, match="none of the task's tools"):
        h.restricted(["rm"])


# ----------------------------------------------------------------------------- presets
def test_presets_load_and_fit_the_agent_tools():
    mix = load_harnesses(PRESETS)
    assert len(mix.harnesses) >= 3 and mix.held_out
    train_syntaxes = {h.syntax for h in mix.harnesses}
    assert len(train_syntaxes) >= 3
    held = mix.held_out[0]
    assert held.syntax not in train_syntaxes and held.rename and held.arg_rename
    assert held.system_prompt not in {h.system_prompt for h in mix.harnesses}
    assert any(h.context.kind == "last_k" for h in mix.harnesses)
    assert any(h.memory and h.skills for h in mix.harnesses)

    from tokenizers import Tokenizer   # the tiny models' tokenizer (transformers takes seconds to import)
    tok = Tokenizer.from_file(str(REPO / "core" / "assets" / "tokenizer" / "tokenizer.json"))
    calls = [ToolCall("cat", {"file_name": "a.txt"}), ToolCall("echo", {"content": "7", "file_name": "answer.txt"}),
             ToolCall("multiply", {"a": 3, "b": 2.5}), ToolCall("send_message", {"receiver_id": "u1", "message": "hi"})]
    for cfg in mix.harnesses + mix.held_out:
        h = Harness(cfg, BFCL_TOOLS)
        assert h.parse(h.render(calls)) == calls, cfg.name
        # the tiny models have 1024-token contexts: the prompt must leave most of it to the episode
        assert len(tok.encode(h.system_prompt()).ids) < 512, cfg.name


def test_harness_config_is_a_strict_dataclass():
    cfg = HarnessConfig(name="x")
    assert cfg.syntax == "json" and cfg.tools == [] and cfg.context.kind == "all" and not cfg.memory
