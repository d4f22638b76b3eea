"""The harness: everything between a model and an environment's tools, as data.

A `HarnessConfig` (YAML) says which tools the model is offered and under which names, the
call syntax it writes (json, xml or python), the system prompt, how the context is kept,
skills put in the prompt, and whether it has a note-taking memory. `Harness` turns one into
a system prompt, parses the model's text into canonical `ToolCall`s (and renders calls back
into text, for oracle transcripts), formats observations and applies the context policy.

The three call syntaxes (shown for the tool `cat(file_name: string)`):

    json     ```json
             {"name": "cat", "arguments": {"file_name": "a.txt"}}
             ```                                   one fenced block per call
    xml      <call name="cat"><arg name="file_name">a.txt</arg></call>
    python   cat(file_name='a.txt')   or   cat('a.txt')   one call per line, or [f(), g()]
    tags     <tool_call>{"name": "cat", "arguments": {"file_name": "a.txt"}}</tool_call>
             (Hermes/Qwen style; one element per call)

A text with no call is the model's final answer. Model output is parsed, never evaluated:
python calls go through `ast.parse`, and only each argument node through
`ast.literal_eval`. A malformed call raises `CallSyntaxError`, whose message is written for
the model to read (it becomes the error observation), e.g.
"unknown tool 'foo'; tools: cat, echo".
"""
from __future__ import annotations

import ast
import copy
import functools
import html
import json
import keyword
import random
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal

from core.config import ConfigError, _build, load_config, option

_REPO = Path(__file__).resolve().parents[2]
MAX_TEXT_CHARS = 20_000   # longer model output is not parsed (ast on megabytes is slow)
MAX_CALLS = 16            # calls per assistant message
MEMORY_TOOLS = ("write_note", "read_notes")

DEFAULT_SYSTEM_PROMPT = "You can use these tools:\n{tools}\n{syntax}{skills}{memory}"

# JSON-schema types, plus the spellings BFCL's function docs use ("dict", "float", "tuple").
_TYPE_ALIASES = {"dict": "object", "float": "number", "tuple": "array", "int": "integer",
                 "bool": "boolean", "str": "string", "list": "array"}
_EXAMPLE_VALUES = {"string": "x", "integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}


class CallSyntaxError(ValueError):
    """A malformed tool call; the message is shown to the model as an error observation."""


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict   # {"type": "object", "properties": {arg: {"type": .., "description": ..}}, "required": [..]}

    @property
    def properties(self) -> dict[str, dict]:
        return dict(self.parameters.get("properties") or {})

    @property
    def required(self) -> list[str]:
        return list(self.parameters.get("required") or [])


@dataclass
class ToolCall:
    name: str    # canonical (environment) names
    args: dict


# ----------------------------------------------------------------------------- configs
@dataclass
class ContextPolicy:
    kind: Literal["all", "last_k", "truncate_obs"] = option(
        "all: the whole transcript; last_k: system + first user message + the last k assistant turns "
        "(with their observations); truncate_obs: each tool result cut to max_obs_chars", "all")
    k: int = option("assistant turns kept by last_k", 4)
    max_obs_chars: int = option("longest tool result kept by truncate_obs (characters)", 400)

    def validate(self):
        if self.k < 1:
            raise ValueError(f"context.k must be >= 1, got {self.k}")
        if self.max_obs_chars < 1:
            raise ValueError(f"context.max_obs_chars must be >= 1, got {self.max_obs_chars}")


@dataclass
class HarnessConfig:
    name: str = option("the harness's name (metrics, logs, the `harness` column of agent rows)")
    syntax: Literal["json", "xml", "python", "tags"] = option(
        "how the model writes tool calls: json (fenced blocks), xml (<call>/<arg> elements), python "
        "(f(a=1) lines), tags (<tool_call>JSON</tool_call>)", "json")
    tools: list[str] = option("canonical tool names offered to the model; empty: all the environment's tools",
                              factory=list)
    rename: dict[str, str] = option("canonical tool name -> the name the model sees and writes", factory=dict)
    arg_rename: dict[str, str] = option("'tool.arg' (canonical names) -> the argument name the model sees",
                                        factory=dict)
    system_prompt: str = option("template of the system prompt; placeholders {tools} (required), "
                                "{syntax} (required), {skills}, {memory}", DEFAULT_SYSTEM_PROMPT)
    context: ContextPolicy = option("what of the transcript the model sees each turn", factory=ContextPolicy)
    max_description_chars: int = option("tool descriptions in the prompt: the first sentence, cut to this many "
                                        "characters; 0: names and arguments only (the shortest prompt)", 80)
    skills: list[str] = option("how-to snippets listed in the system prompt (needs {skills} in it)", factory=list)
    memory: bool = option("offer write_note(text) / read_notes(): notes kept across the episodes of a task "
                          "family", False)

    def validate(self):
        if not self.name:
            raise ValueError("harness name must not be empty")
        if self.max_description_chars < 0:
            raise ValueError(f"harness {self.name!r}: max_description_chars must be >= 0")
        fields = set()
        for _, field, _, _ in string.Formatter().parse(self.system_prompt):
            if field is not None:
                fields.add(field)
        unknown = fields - {"tools", "syntax", "skills", "memory"}
        if unknown:
            raise ValueError(f"harness {self.name!r}: system_prompt has unknown placeholder "
                             f"{{{sorted(unknown)[0]}}} (known: {{tools}} {{syntax}} {{skills}} {{memory}}; "
                             f"write {{{{ }}}} for a literal brace)")
        for needed in ("tools", "syntax"):
            if needed not in fields:
                raise ValueError(f"harness {self.name!r}: system_prompt must contain {{{needed}}}")
        if self.skills and "skills" not in fields:
            raise ValueError(f"harness {self.name!r}: skills are set but system_prompt has no {{skills}}")
        for key in self.arg_rename:
            if key.count(".") != 1 or not all(key.split(".")):
                raise ValueError(f"harness {self.name!r}: arg_rename key {key!r} must be 'tool.arg'")


def harness_modules(cfg: HarnessConfig) -> dict[str, Any]:
    """The module values a harness combines, one hashable value per module: a combination of
    values seen in training is not a new harness to the model, a new combination may be."""
    ctx = cfg.context
    return {"syntax": cfg.syntax,
            "naming": (tuple(cfg.tools), tuple(sorted(cfg.rename.items())), tuple(sorted(cfg.arg_rename.items()))),
            "prompt": (cfg.system_prompt, cfg.max_description_chars),
            "context": (ctx.kind, ctx.k if ctx.kind == "last_k" else None,
                        ctx.max_obs_chars if ctx.kind == "truncate_obs" else None),
            "skills": tuple(cfg.skills),
            "memory": cfg.memory}


def unseen_pairs(cfg: HarnessConfig, train: Iterable[HarnessConfig]) -> list[tuple[str, str]]:
    """The pairs of modules (e.g. ("syntax", "prompt")) whose two values in `cfg` never occur
    together in a harness of `train`."""
    seen = [harness_modules(t) for t in train]
    mods = harness_modules(cfg)
    keys = list(mods)
    return [(a, b) for i, a in enumerate(keys) for b in keys[i + 1:]
            if not any(t[a] == mods[a] and t[b] == mods[b] for t in seen)]


def check_combo(cfg: HarnessConfig, train: list[HarnessConfig]) -> None:
    """Raise ValueError unless `cfg` is a held-out combination of `train`: each of its module
    values appears in some train harness, its whole combination in none, and at least one
    pair of its values never appears together (else it differs from training only in how
    seen pairs are put together, which no one means by a new combination)."""
    mods = harness_modules(cfg)
    seen = [harness_modules(t) for t in train]
    for k, v in mods.items():
        if not any(t[k] == v for t in seen):
            raise ValueError(f"held_out_combo {cfg.name!r}: its {k} appears in no train harness, so it is not a "
                             f"combination of seen modules; give it a {k} a train harness has (or move it to held_out)")
    same = [t.name for t, m in zip(train, seen) if m == mods]
    if same:
        raise ValueError(f"held_out_combo {cfg.name!r}: train harness {same[0]!r} has the same modules; "
                         "training would draw this combination")
    if not unseen_pairs(cfg, train):
        raise ValueError(f"held_out_combo {cfg.name!r}: every pair of its module values occurs together in some "
                         "train harness; change one module so that some pair (e.g. syntax x prompt) is new")


@dataclass
class HarnessMix:
    harnesses: list[HarnessConfig] = option("the combinations training may draw, one sampled per episode; "
                                            "nothing else is ever trained on")
    weights: list[float] = option("sampling weight of each harness; empty: uniform", factory=list)
    held_out: list[HarnessConfig] = option("held_out_novel: harnesses only evaluated on, with names or a syntax "
                                           "training never saw", factory=list)
    held_out_combo: list[HarnessConfig] = option(
        "harnesses only evaluated on whose every module value (syntax, prompt, context, skills, naming, memory) "
        "appears in training but never in this combination (checked at load)", factory=list)
    modules: dict[str, Any] = option("named module values the harnesses refer to with YAML anchors "
                                     "(&name / *name); not read otherwise", factory=dict)

    def validate(self):
        if not self.harnesses:
            raise ValueError("harnesses: at least one harness is needed")
        if self.weights:
            if len(self.weights) != len(self.harnesses):
                raise ValueError(f"weights: {len(self.weights)} weights for {len(self.harnesses)} harnesses")
            if any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
                raise ValueError(f"weights: must be >= 0 with a positive sum, got {self.weights}")
        seen: set[str] = set()
        for h in self.harnesses + self.held_out + self.held_out_combo:
            if h.name in seen:
                raise ValueError(f"harness name {h.name!r} is used twice (names key metrics and rows)")
            seen.add(h.name)
        for h in self.held_out_combo:
            check_combo(h, self.harnesses)

    def sample(self, rng: random.Random) -> HarnessConfig:
        """One train harness, drawn with `weights` (an episode's harness)."""
        return rng.choices(self.harnesses, weights=self.weights or None, k=1)[0]

    def by_name(self, name: str) -> HarnessConfig:
        every = self.harnesses + self.held_out_combo + self.held_out
        for h in every:
            if h.name == name:
                return h
        raise KeyError(f"no harness named {name!r}; known: {', '.join(h.name for h in every)}")


def load_harnesses(path_or_dict: str | Path | dict) -> HarnessMix:
    """A harness mix from a YAML file ({harnesses: [...], weights: [...], held_out: [...]}) or
    the same as a dict; errors name the file (or <dict>) and the key."""
    if isinstance(path_or_dict, dict):
        try:
            return _build(HarnessMix, path_or_dict, "")
        except ConfigError as e:
            msg = str(e)
            raise ConfigError(f"<harness dict>: {msg[2:] if msg.startswith(': ') else msg.lstrip('.')}") from None
    p = Path(path_or_dict)
    # recipes name the project's presets relative to the repository (recipes/harnesses/...),
    # whatever directory a run is started from
    if not p.is_absolute() and not p.exists() and (_REPO / p).exists():
        p = _REPO / p
    return load_config(HarnessMix, p)


@functools.lru_cache(maxsize=8)
def cached_mix(path: str) -> HarnessMix:
    """load_harnesses(path), read once per process: a reward looks up every row's harness."""
    return load_harnesses(path)


def harness_config(name: str | None, harnesses: str | Path) -> HarnessConfig:
    """The harness called `name` in the mix file `harnesses` (train or held-out), or its
    first train harness when `name` is empty. Each agent domain's rewards module wraps this
    with its own default mix."""
    mix = cached_mix(str(harnesses))
    return mix.harnesses[0] if not name else mix.by_name(name)


def as_harness_config(harness, harnesses: str | Path) -> HarnessConfig:
    """`harness` as a HarnessConfig: one as given, a name in the mix file `harnesses` (None:
    its first train harness), or a plain dict entry (an oracle's or a test's own harness)."""
    if isinstance(harness, HarnessConfig):
        return harness
    if harness is None or isinstance(harness, str):
        return harness_config(harness, harnesses)
    return load_harnesses({"harnesses": [harness]}).harnesses[0]


# ----------------------------------------------------------------------------- memory
class MemoryStore:
    """Notes per task family, kept across episodes (one store shared by a run's envs).
    Bounded: the newest `max_notes` notes of at most `max_chars` characters each."""

    def __init__(self, max_notes: int = 8, max_chars: int = 200):
        self.max_notes = max_notes
        self.max_chars = max_chars
        self.notes: dict[str, list[str]] = {}

    def read(self, family: str) -> list[str]:
        return list(self.notes.get(family, []))

    def write(self, family: str, text: str) -> None:
        notes = self.notes.setdefault(family, [])
        notes.append(text[: self.max_chars])
        del notes[: max(0, len(notes) - self.max_notes)]


_MEMORY_SPECS = {
    "write_note": ToolSpec("write_note", "Save a short note for later tasks of this kind.",
                           {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}),
    "read_notes": ToolSpec("read_notes", "Read your notes from earlier tasks.",
                           {"type": "object", "properties": {}, "required": []}),
}


# ----------------------------------------------------------------------------- helpers
def _norm_type(schema: dict) -> str | None:
    t = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(t, list):   # ["string", "null"]: the first non-null type
        t = next((x for x in t if x != "null"), None)
    if not isinstance(t, str) or t == "any":
        return None
    return _TYPE_ALIASES.get(t, t)


def _type_ok(value: Any, t: str | None) -> bool:
    if t is None:
        return True
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":   # an int is a number (as JSON schema and BFCL's checker have it)
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t == "string":
        return isinstance(value, str)
    if t == "boolean":
        return isinstance(value, bool)
    if t == "array":
        return isinstance(value, list)
    if t == "object":
        return isinstance(value, dict)
    return True   # a type we do not know: the backend validates


def _json_name(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null" if value is None else type(value).__name__


def _first_sentence(description: str, limit: int) -> str:
    if limit <= 0:
        return ""
    text = " ".join(description.split())
    # BFCL's docs open with the API's blurb and put the tool's own text after this marker.
    if "Tool description:" in text:
        text = text.split("Tool description:", 1)[1].strip()
    m = re.match(r"(.+?[.!?])(\s|$)", text)
    text = m.group(1) if m else text
    if len(text) <= limit:
        return text
    cut = text[: limit - 3]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut).rstrip(" ,;:") + "..."


def _literal(node: ast.AST, where: str) -> Any:
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise CallSyntaxError(f"{where} must be a literal value (a string, number, true/false, list or dict), "
                              f"not {ast.unparse(node)[:40]!r}") from None
    return _jsonable(value, where)


def _jsonable(value: Any, where: str) -> Any:
    """Python literals as JSON values: tuples become lists, None is null; sets, bytes and complex are refused."""
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, list):
        return [_jsonable(v, where) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise CallSyntaxError(f"{where}: dict keys must be strings")
        return {k: _jsonable(v, where) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CallSyntaxError(f"{where}: {type(value).__name__} values are not allowed")


_DECODER = json.JSONDecoder()
_XML_CALL = re.compile(r"<call\s+name\s*=\s*([\"'])(.*?)\1\s*>(.*?)</call\s*>", re.S)
_XML_ARG = re.compile(r"<arg\s+name\s*=\s*([\"'])(.*?)\1\s*>(.*?)</arg\s*>", re.S)
_PY_CALL_START = re.compile(r"^\s*\[?\s*[A-Za-z_][\w.]*\(", re.M)
_PY_FENCE = re.compile(r"\A```(?:python|py)?[ \t]*\n(.*?)\n?```\Z", re.S)


# ----------------------------------------------------------------------------- harness
class Harness:
    """One harness config bound to an environment's tools: prompt, parsing, rendering, context."""

    def __init__(self, cfg: HarnessConfig, env_tools: dict[str, ToolSpec], memory: MemoryStore | None = None):
        self.cfg = cfg
        self.name = cfg.name
        self.memory = memory
        where = f"harness {cfg.name!r}"
        for t in cfg.tools:
            if t not in env_tools:
                raise ConfigError(f"{where}: tools: unknown tool {t!r} (the environment has: "
                                  f"{', '.join(sorted(env_tools))})")
        offered = {t: env_tools[t] for t in (cfg.tools or env_tools)}
        if cfg.memory:
            for t, spec in _MEMORY_SPECS.items():
                if t in offered:
                    raise ConfigError(f"{where}: memory: the environment already has a tool named {t!r}")
                offered[t] = spec
        self.tools: dict[str, ToolSpec] = offered   # canonical name -> spec, in the order shown
        for t in cfg.rename:
            if t not in offered:
                raise ConfigError(f"{where}: rename: {t!r} is not an offered tool "
                                  f"(offered: {', '.join(offered)})")
        for key in cfg.arg_rename:
            tool, _, arg = key.partition(".")
            if tool not in offered:
                raise ConfigError(f"{where}: arg_rename: {key!r}: {tool!r} is not an offered tool")
            if arg not in offered[tool].properties:
                raise ConfigError(f"{where}: arg_rename: {key!r}: {tool!r} has no argument {arg!r} "
                                  f"(arguments: {', '.join(offered[tool].properties) or 'none'})")
        self._shown: dict[str, str] = {t: cfg.rename.get(t, t) for t in offered}
        self._canonical: dict[str, str] = {}
        for t, s in self._shown.items():
            self._check_name(s, f"{where}: tool {t!r}")
            if s in self._canonical:
                raise ConfigError(f"{where}: tools {self._canonical[s]!r} and {t!r} are both shown as {s!r}")
            self._canonical[s] = t
        # per tool: shown arg name -> canonical, and canonical -> shown
        self._arg_shown: dict[str, dict[str, str]] = {}
        self._arg_canonical: dict[str, dict[str, str]] = {}
        for t, spec in offered.items():
            shown = {a: cfg.arg_rename.get(f"{t}.{a}", a) for a in spec.properties}
            back: dict[str, str] = {}
            for a, s in shown.items():
                self._check_name(s, f"{where}: argument {t}.{a}")
                if s in back:
                    raise ConfigError(f"{where}: arguments {t}.{back[s]} and {t}.{a} are both shown as {s!r}")
                back[s] = a
            self._arg_shown[t], self._arg_canonical[t] = shown, back

    def _check_name(self, shown: str, where: str):
        ok = re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", shown) is not None
        if not ok or (self.cfg.syntax == "python" and keyword.iskeyword(shown)):
            raise ConfigError(f"{where}: shown name {shown!r} must be an identifier (letters, digits, _)")

    def restricted(self, names: Iterable[str] | None) -> "Harness":
        """This harness offering only those of its tools in `names` (plus its memory tools), so
        that a task touching a few of the environment's tools gets a short prompt; None: self."""
        if names is None:
            return self
        keep = set(names) | (set(MEMORY_TOOLS) if self.cfg.memory else set())
        builtins = set(MEMORY_TOOLS) if self.cfg.memory else set()
        if not any(t in keep for t in self.tools if t not in builtins):
            raise ValueError(f"harness {self.name!r}: none of the task's tools {sorted(set(names))} is offered "
                             f"(offered: {', '.join(self.tools)})")
        h = copy.copy(self)
        h.tools = {t: spec for t, spec in self.tools.items() if t in keep}
        h._shown = {t: s for t, s in self._shown.items() if t in keep}
        h._canonical = {s: t for t, s in h._shown.items()}
        return h

    # --------------------------------------------------------------- names
    def shown_name(self, tool: str) -> str:
        return self._shown[tool]

    def shown_arg(self, tool: str, arg: str) -> str:
        return self._arg_shown[tool].get(arg, arg)

    def _tool_list(self) -> str:
        return ", ".join(self._canonical)

    # --------------------------------------------------------------- prompt
    def tool_line(self, tool: str) -> str:
        spec = self.tools[tool]
        req = set(spec.required)
        args = []
        for a, schema in spec.properties.items():
            t = _norm_type(schema) or "any"
            args.append(f"{self.shown_arg(tool, a)}{'' if a in req else '?'}: {t}")
        line = f"{self.shown_name(tool)}({', '.join(args)})"
        desc = _first_sentence(spec.description, self.cfg.max_description_chars)
        return f"{line} - {desc}" if desc else line

    def example_call(self) -> ToolCall:
        """A call of the first offered tool with placeholder values (the syntax help's example)."""
        tool = next(iter(self.tools))
        spec = self.tools[tool]
        req = spec.required or list(spec.properties)[:1]
        args = {a: _EXAMPLE_VALUES.get(_norm_type(spec.properties.get(a, {})) or "string", "x") for a in req
                if a in spec.properties}
        return ToolCall(tool, args)

    def syntax_help(self) -> str:
        example = self.render([self.example_call()])
        if self.cfg.syntax == "json":
            head = "To call a tool, write a block:\n" + example + "\nOne block per call."
        elif self.cfg.syntax in ("xml", "tags"):
            head = "To call a tool, write: " + example
        else:
            head = "To call a tool, write one call per line: " + example
        return head + "\nWhen done, answer in plain text."

    def system_prompt(self) -> str:
        skills = ("\nTips:\n" + "\n".join(f"- {s}" for s in self.cfg.skills)) if self.cfg.skills else ""
        memory = ""
        if self.cfg.memory:
            memory = f"\nNotes persist across tasks; call {self.shown_name('read_notes')}() first."
        return self.cfg.system_prompt.format(tools="\n".join(self.tool_line(t) for t in self.tools),
                                             syntax=self.syntax_help(), skills=skills, memory=memory)

    # --------------------------------------------------------------- parsing
    def parse(self, text: str) -> list[ToolCall]:
        """The calls in `text` (canonical names), [] when it has none (a final answer)."""
        if len(text) > MAX_TEXT_CHARS:
            raise CallSyntaxError(f"the message is too long ({len(text)} characters; at most {MAX_TEXT_CHARS})")
        raw = {"json": self._parse_json, "xml": self._parse_xml, "python": self._parse_python,
               "tags": self._parse_tags}[self.cfg.syntax](text)
        if len(raw) > MAX_CALLS:
            raise CallSyntaxError(f"too many calls in one message ({len(raw)}; at most {MAX_CALLS})")
        return [self._resolve(name, args, positional) for name, args, positional in raw]

    def _resolve(self, shown: str, args: dict, positional: list) -> ToolCall:
        """Shown names -> canonical, positional args by schema order, then the schema checks."""
        if shown not in self._canonical:
            raise CallSyntaxError(f"unknown tool {shown!r}; tools: {self._tool_list()}")
        tool = self._canonical[shown]
        spec = self.tools[tool]
        arg_back = self._arg_canonical[tool]
        order = list(spec.properties)
        valid = ", ".join(self.shown_arg(tool, a) for a in order) or "none"
        if len(positional) > len(order):
            raise CallSyntaxError(f"{shown} takes {len(order)} argument{'s' * (len(order) != 1)} "
                                  f"({valid}), got {len(positional)} positional")
        out: dict[str, Any] = dict(zip(order, positional))
        for s, v in args.items():
            if s not in arg_back:
                raise CallSyntaxError(f"{shown} has no argument {s!r}; arguments: {valid}")
            a = arg_back[s]
            if a in out:
                raise CallSyntaxError(f"{shown} got argument {s!r} twice")
            out[a] = v
        for a in spec.required:
            if a not in out:
                raise CallSyntaxError(f"{shown} is missing the argument {self.shown_arg(tool, a)!r}")
        for a, v in out.items():
            schema = spec.properties.get(a, {})
            t = _norm_type(schema)
            if not _type_ok(v, t):
                raise CallSyntaxError(f"argument {self.shown_arg(tool, a)!r} of {shown} must be {t}, "
                                      f"got {_json_name(v)} {json.dumps(v)[:40]}")
            enum = schema.get("enum") if isinstance(schema, dict) else None
            if enum and v not in enum:
                raise CallSyntaxError(f"argument {self.shown_arg(tool, a)!r} of {shown} must be one of "
                                      f"{', '.join(json.dumps(e) for e in enum)}")
        return ToolCall(tool, out)

    def _parse_json(self, text: str) -> list[tuple[str, dict, list]]:
        return self._json_calls(self._json_blocks(text, "```json", "```"))

    def _parse_tags(self, text: str) -> list[tuple[str, dict, list]]:
        return self._json_calls(self._json_blocks(text, "<tool_call>", "</tool_call>"))

    @staticmethod
    def _json_blocks(text: str, open_: str, close: str) -> list[Any]:
        """The JSON value after each `open_`, which must be followed by `close`. The value is
        decoded first, so a string holding the closing marker (``` or a tag) is no problem."""
        values, i = [], 0
        while (start := text.find(open_, i)) != -1:
            j = start + len(open_)
            while j < len(text) and text[j] in " \t\r\n":
                j += 1
            try:
                value, end = _DECODER.raw_decode(text, j)
            except ValueError as e:
                raise CallSyntaxError(f"the {open_} block is not valid JSON ({e.msg}, at character {e.pos - j})") from None
            k = end
            while k < len(text) and text[k] in " \t\r\n":
                k += 1
            if not text.startswith(close, k):
                raise CallSyntaxError(f"a {open_} block holds one JSON value and is closed with {close}")
            values.append(value)
            i = k + len(close)
        return values

    @staticmethod
    def _json_calls(values: list[Any]) -> list[tuple[str, dict, list]]:
        calls = []
        for value in values:
            for item in value if isinstance(value, list) else [value]:
                if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                    raise CallSyntaxError('a call is {"name": "<tool>", "arguments": {...}}')
                extra = set(item) - {"name", "arguments"}
                if extra:
                    raise CallSyntaxError(f"unexpected key {sorted(extra)[0]!r} in a call; "
                                          'write {"name": "<tool>", "arguments": {...}}')
                args = item.get("arguments", {})
                if not isinstance(args, dict):
                    raise CallSyntaxError(f'"arguments" of {item["name"]} must be an object')
                calls.append((item["name"], args, []))
        return calls

    def _parse_xml(self, text: str) -> list[tuple[str, dict, list]]:
        if "<call" not in text:
            return []
        found = list(_XML_CALL.finditer(text))
        if len(found) != len(re.findall(r"<call\b", text)):
            raise CallSyntaxError('a call is <call name="<tool>"><arg name="<arg>">value</arg></call>')
        calls = []
        for m in found:
            shown = html.unescape(m.group(2))
            body = m.group(3)
            if shown not in self._canonical:
                raise CallSyntaxError(f"unknown tool {shown!r}; tools: {self._tool_list()}")
            tool = self._canonical[shown]
            rest = _XML_ARG.sub("", body)
            if rest.strip():
                raise CallSyntaxError(f"inside <call name=\"{shown}\"> only "
                                      f"<arg name=\"...\">value</arg> elements are allowed")
            args: dict[str, Any] = {}
            for am in _XML_ARG.finditer(body):
                s = html.unescape(am.group(2))
                if s in args:
                    raise CallSyntaxError(f"{shown} got argument {s!r} twice")
                a = self._arg_canonical[tool].get(s)
                t = _norm_type(self.tools[tool].properties.get(a, {})) if a else "string"
                args[s] = self._xml_value(html.unescape(am.group(3)), t, f"argument {s!r} of {shown}")
            calls.append((shown, args, []))
        return calls

    @staticmethod
    def _xml_value(raw: str, t: str | None, where: str) -> Any:
        if t == "string":
            return raw
        try:
            value = json.loads(raw.strip())
        except ValueError:
            low = raw.strip().lower()
            if t == "boolean" and low in ("true", "false"):
                return low == "true"
            if t is None:
                return raw
            raise CallSyntaxError(f"{where} must be {t} (written as JSON), got {raw.strip()[:40]!r}") from None
        return value

    def _parse_python(self, text: str) -> list[tuple[str, dict, list]]:
        body = text.strip()
        fence = _PY_FENCE.match(body)
        if fence:
            body = fence.group(1).strip()
        if not _PY_CALL_START.search(body):
            return []
        example = self.render([self.example_call()])
        try:
            tree = ast.parse(body, mode="exec")
        except SyntaxError as e:
            raise CallSyntaxError(f"could not parse the call ({e.msg}, line {e.lineno}); write e.g. {example}") from None
        except (ValueError, MemoryError, RecursionError):
            raise CallSyntaxError(f"could not parse the call; write e.g. {example}") from None
        nodes: list[ast.AST] = []
        for stmt in tree.body:
            if not isinstance(stmt, ast.Expr):
                raise CallSyntaxError(f"write only tool calls, one per line, e.g. {example}")
            v = stmt.value
            nodes.extend(v.elts if isinstance(v, (ast.List, ast.Tuple)) else [v])
        calls = []
        for node in nodes:
            if not isinstance(node, ast.Call):
                raise CallSyntaxError(f"write only tool calls, one per line, e.g. {example}")
            if not isinstance(node.func, ast.Name):
                raise CallSyntaxError(f"{ast.unparse(node.func)[:40]!r} is not a tool; tools: {self._tool_list()}")
            shown = node.func.id
            if shown not in self._canonical:
                raise CallSyntaxError(f"unknown tool {shown!r}; tools: {self._tool_list()}")
            positional = []
            for i, arg in enumerate(node.args):
                if isinstance(arg, ast.Starred):
                    raise CallSyntaxError(f"{shown}: *args are not allowed; name each argument")
                positional.append(_literal(arg, f"argument {i + 1} of {shown}"))
            args = {}
            for kw in node.keywords:
                if kw.arg is None:
                    raise CallSyntaxError(f"{shown}: **kwargs are not allowed; name each argument")
                args[kw.arg] = _literal(kw.value, f"argument {kw.arg!r} of {shown}")
            calls.append((shown, args, positional))
        return calls

    # --------------------------------------------------------------- rendering
    def render(self, calls: list[ToolCall]) -> str:
        """The text the model should write for `calls` (shown names); parse(render(c)) == c."""
        parts = []
        for c in calls:
            name = self.shown_name(c.name)
            args = {self.shown_arg(c.name, a): v for a, v in c.args.items()}
            if self.cfg.syntax == "json":
                parts.append("```json\n" + json.dumps({"name": name, "arguments": args}) + "\n```")
            elif self.cfg.syntax == "tags":
                parts.append("<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>")
            elif self.cfg.syntax == "xml":
                inner = "".join(f'<arg name="{a}">{html.escape(v if isinstance(v, str) else json.dumps(v), quote=False)}</arg>'
                                for a, v in args.items())
                parts.append(f'<call name="{name}">{inner}</call>')
            else:
                parts.append(f"{name}({', '.join(f'{a}={v!r}' for a, v in args.items())})")
        return "\n".join(parts)

    # --------------------------------------------------------------- observations and context
    def format_observation(self, results: list[str]) -> str:
        """One tool message for a turn's results (truncate_obs cuts each result)."""
        if self.cfg.context.kind == "truncate_obs":
            n = self.cfg.context.max_obs_chars
            results = [r if len(r) <= n else r[:n] + "...(cut)" for r in results]
        return "\n".join(results)

    def apply_context(self, messages: list[dict]) -> list[dict]:
        """What the model sees: last_k keeps the system and first user message, every later user
        message (they are instructions), and the last k assistant turns with their observations."""
        if self.cfg.context.kind != "last_k":
            return list(messages)
        first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
        if first_user is None:
            return list(messages)
        head, rest = list(messages[: first_user + 1]), messages[first_user + 1:]
        turns: list[list[dict]] = []
        for m in rest:
            if m.get("role") == "assistant" or not turns:
                turns.append([])
            turns[-1].append(m)
        k = self.cfg.context.k
        dropped = [m for t in turns[:-k] for m in t if m.get("role") == "user"] if len(turns) > k else []
        return head + dropped + [m for t in turns[-k:] for m in t]

    # --------------------------------------------------------------- memory tools
    def builtin(self, call: ToolCall, family: str = "default") -> str | None:
        """The result of a memory tool, or None when `call` is not one (it goes to the backend)."""
        if not self.cfg.memory or call.name not in MEMORY_TOOLS:
            return None
        if self.memory is None:   # memory on but no store given: notes last one episode
            self.memory = MemoryStore()
        if call.name == "write_note":
            self.memory.write(family, str(call.args["text"]))
            return "saved"
        notes = self.memory.read(family)
        return "\n".join(f"{i + 1}. {n}" for i, n in enumerate(notes)) if notes else "no notes yet"


def harness_of(cfg: HarnessConfig | dict, env_tools: dict[str, ToolSpec], memory: MemoryStore | None = None) -> Harness:
    """A Harness from a config or a plain dict (one harness entry of a mix file)."""
    if isinstance(cfg, dict):
        cfg = load_harnesses({"harnesses": [cfg]}).harnesses[0]
    return Harness(cfg, env_tools, memory)


__all__ = ["CallSyntaxError", "ContextPolicy", "DEFAULT_SYSTEM_PROMPT", "Harness", "HarnessConfig", "HarnessMix",
           "MemoryStore", "ToolCall", "ToolSpec", "check_combo", "harness_modules", "harness_of", "load_harnesses",
           "unseen_pairs"]
