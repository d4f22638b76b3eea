"""Environment and reward of the `agent` domain: multi-turn tool use over BFCL's stateful
API simulators (bfcl_eval's `eval_checker/multi_turn_eval/func_source_code`: a file
system, a math API, a messaging app, ...).

`BFCLBackend` is the domain's `ToolBackend` (core/agent/env.py); `make_env(harness_cfg)`
puts a harness in front of it (`ToolEnv`), which is what MOPD episodes, the evals and the
expert's RL drive. A task is a dict (a row's `task` column, as JSON):

    id                str
    family            str   ("files", "math", "messages", "bfcl"; memory notes are kept per family)
    toolset           "procedural" (short tool docs, what the tiny experts train on) or
                      "bfcl" (BFCL's own function docs); the env's toolset must match
    horizon           int   (number of dependent calls, procedural tasks)
    initial_config    {class name: scenario}   as in BFCL
    involved_classes  [class name, ...]         as in BFCL
    tools             [tool name, ...]          offered to the model (the harness shows only these)
    user              str, or [str, ...] one user message per turn (BFCL tasks have several)
    ground_truth      [call, ...] for one turn or [[call, ...], ...] per turn; a call is
                      {"name": ..., "args": {...}} (keyword arguments only)
    answer            optional str: the final assistant message must end with it

How a call runs: the harness has parsed the model's text into a `ToolCall` (never
`eval`); the backend checks the tool is one the task offers, finds the involved
simulator instance that defines it as a public method, checks the argument names against
the method's signature and that the values are plain JSON values of safe size (numbers
up to 1e15, MathAPI's precision up to 100 and exponent up to 1000, strings up to 10k
characters, lists up to 1000 items: a huge exponent or precision would hang the run), and
calls it with a deep copy of them (MathAPI's process-wide mpmath/decimal precision is put
back afterwards). A result `{"error": ...}` (BFCL's convention for a failed call) and an
exception inside the simulator both raise `ToolError`: the model sees "error: ..." and
may try again. Results are shown as compact JSON; in the procedural toolset a one-key
result shows just its value ("plum", 39) and an empty one "ok", to keep transcripts short.

How an episode is checked, the way bfcl's `multi_turn_checker` does it: when the model
ends a user turn (answers without a call), the turn's ground-truth calls run on a second
set of instances (the oracle's, loaded from the same initial config); then (1) the turn
must have had a call when the ground truth has one, (2) every public attribute of every
instance must equal the oracle's (bfcl's `state_checker`), and (3) the oracle's results
of this turn must all be among the results of the model's calls so far, as a multiset,
in any order (bfcl's `response_checker`; the model may make extra calls). At the end,
a task with an `answer` also needs the last assistant message's last word or number to
equal it. Success is all of that; the reward is 1.0 or 0.0.

`reward(prompts, completions, task, harness=None, ...)` (TRL's signature) replays the
assistant messages of each completion (the episode's messages after the first user
message) through a fresh env with the row's harness, and returns the episode's verdict.
With `checker="bfcl"` the replayed calls are instead checked by bfcl's own
`multi_turn_checker` (which `eval`s call strings: here strings this module writes from
the parsed calls, tool names from the task's docs and values as Python literals), under
a fresh model name per call, since bfcl caches simulator instances in module globals
keyed by model name and task id; the cache entries are removed afterwards.
"""
from __future__ import annotations

import copy
import decimal
import functools
import importlib
import importlib.util
import inspect
import json
import re
import uuid
from pathlib import Path

import mpmath

from core.agent.env import ToolEnv, ToolError, reward_columns
import core.agent.harness as agent_harness
from core.agent.harness import HarnessConfig, MemoryStore, ToolCall, ToolSpec

DOMAIN = "agent"
REPO = Path(__file__).resolve().parents[1]
HARNESSES = REPO / "recipes" / "harnesses" / "agent.yaml"
MAX_CALLS_PER_EPISODE = 256   # a replay stops there (a transcript cannot have more in max_turns)

# The classes of BFCL's multi-turn categories (not the memory / web-search ones).
BFCL_CLASSES = ("GorillaFileSystem", "MathAPI", "MessageAPI", "TwitterAPI", "TicketAPI", "TradingBot",
                "TravelAPI", "VehicleControlAPI")
_SIM = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
CLASS_MODULES = {"GorillaFileSystem": f"{_SIM}.gorilla_file_system", "MathAPI": f"{_SIM}.math_api",
                 "MessageAPI": f"{_SIM}.message_api", "TwitterAPI": f"{_SIM}.posting_api",
                 "TicketAPI": f"{_SIM}.ticket_api", "TradingBot": f"{_SIM}.trading_bot",
                 "TravelAPI": f"{_SIM}.travel_booking", "VehicleControlAPI": f"{_SIM}.vehicle_control"}
FUNC_DOCS = {"GorillaFileSystem": "gorilla_file_system.json", "MathAPI": "math_api.json",
             "MessageAPI": "message_api.json", "TwitterAPI": "posting_api.json", "TicketAPI": "ticket_api.json",
             "TradingBot": "trading_bot.json", "TravelAPI": "travel_booking.json",
             "VehicleControlAPI": "vehicle_control.json"}
STATELESS = ("MathAPI",)   # bfcl loads no scenario into these

# ------------------------------------------------------------------------ tool docs

# BFCL doc types -> JSON-schema types (the harness checks argument values against these).
_TYPES = {"string": "string", "integer": "integer", "float": "number", "number": "number",
          "boolean": "boolean", "array": "array", "dict": "object", "object": "object", "tuple": "array"}


def _json_schema(p: dict) -> dict:
    out: dict = {}
    t = p.get("type")
    if t in _TYPES:
        out["type"] = _TYPES[t]
    if p.get("description"):
        out["description"] = " ".join(str(p["description"]).split())
    if isinstance(p.get("items"), dict):
        out["items"] = _json_schema(p["items"])
    if isinstance(p.get("properties"), dict):
        out["properties"] = {k: _json_schema(v) for k, v in p["properties"].items()}
    if "enum" in p:
        out["enum"] = list(p["enum"])
    if "default" in p:
        out["default"] = p["default"]
    return out


def bfcl_data_dir() -> Path:
    """The data folder of the installed `bfcl-eval` package."""
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("agent: the BFCL simulators need the `bfcl-eval` package "
                           "(pip install --no-deps bfcl-eval)")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


@functools.lru_cache(maxsize=None)
def bfcl_tool_specs(class_name: str) -> dict[str, ToolSpec]:
    """BFCL's function docs of one class (data/multi_turn_func_doc/*.json) as ToolSpecs."""
    if class_name not in FUNC_DOCS:
        raise ValueError(f"agent: unknown class {class_name!r}; known: {', '.join(BFCL_CLASSES)}")
    path = bfcl_data_dir() / "multi_turn_func_doc" / FUNC_DOCS[class_name]
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        d = json.loads(line)
        params = d.get("parameters") or {}
        props = {k: _json_schema(v) for k, v in (params.get("properties") or {}).items()}
        schema = {"type": "object", "properties": props, "required": list(params.get("required") or [])}
        out[d["name"]] = ToolSpec(d["name"], " ".join(str(d.get("description", "")).split()), schema)
    return out


def _spec(name: str, description: str, args: dict[str, str], optional: tuple[str, ...] = ()) -> ToolSpec:
    props = {a: {"type": t} for a, t in args.items()}
    return ToolSpec(name, description, {"type": "object", "properties": props,
                                        "required": [a for a in args if a not in optional]})


# The procedural tasks' tools (experts/agent/data.py): a few BFCL methods with one-line docs,
# so the system prompt of a tiny model stays short. Names and arguments are BFCL's own.
PROCEDURAL_TOOLS: dict[str, tuple[str, ToolSpec]] = {
    "cat": ("GorillaFileSystem", _spec("cat", "Show a file.", {"file_name": "string"})),
    "echo": ("GorillaFileSystem", _spec("echo", "Write text to a file.", {"content": "string", "file_name": "string"},
                                        optional=("file_name",))),
    "ls": ("GorillaFileSystem", _spec("ls", "List files.", {"a": "boolean"}, optional=("a",))),
    "cd": ("GorillaFileSystem", _spec("cd", "Go to a folder.", {"folder": "string"})),
    "add": ("MathAPI", _spec("add", "a + b.", {"a": "integer", "b": "integer"})),
    "subtract": ("MathAPI", _spec("subtract", "a - b.", {"a": "integer", "b": "integer"})),
    "multiply": ("MathAPI", _spec("multiply", "a * b.", {"a": "integer", "b": "integer"})),
    "get_user_id": ("MessageAPI", _spec("get_user_id", "A user's id.", {"user": "string"})),
    "send_message": ("MessageAPI", _spec("send_message", "Send a message.",
                                         {"receiver_id": "string", "message": "string"})),
}
TOOLSETS = ("procedural", "bfcl")


@functools.lru_cache(maxsize=None)
def toolset_specs(toolset: str) -> dict[str, ToolSpec]:
    """Every tool of a toolset (the env's tools; a task offers a subset): "procedural" is
    PROCEDURAL_TOOLS, "bfcl" every documented method of BFCL_CLASSES."""
    if toolset == "procedural":
        return {n: s for n, (_c, s) in PROCEDURAL_TOOLS.items()}
    if toolset == "bfcl":
        out: dict[str, ToolSpec] = {}
        for c in BFCL_CLASSES:
            for n, s in bfcl_tool_specs(c).items():
                if n in out:
                    raise RuntimeError(f"agent: BFCL tool {n!r} is defined by two classes")
                out[n] = s
        return out
    raise ValueError(f"agent: unknown toolset {toolset!r}; expected one of {TOOLSETS}")


@functools.lru_cache(maxsize=None)
def simulator_class(name: str) -> type:
    if name not in CLASS_MODULES:
        raise ValueError(f"agent: unknown simulator class {name!r}; known: {', '.join(BFCL_CLASSES)}")
    return getattr(importlib.import_module(CLASS_MODULES[name]), name)


@functools.lru_cache(maxsize=None)
def _documented(class_name: str) -> frozenset[str]:
    return frozenset(bfcl_tool_specs(class_name))


def new_instances(task: dict) -> dict:
    """Fresh simulator instances of the task's involved classes, loaded with its initial
    config (deep-copied, as bfcl does)."""
    out = {}
    for c in task["involved_classes"]:
        inst = simulator_class(c)()
        if c not in STATELESS:
            inst._load_scenario(copy.deepcopy((task.get("initial_config") or {}).get(c, {})), long_context=False)
        out[c] = inst
    return out


# ------------------------------------------------------------------------ tasks

def _calls(value, where: str) -> list[dict]:
    if not isinstance(value, list):
        raise ValueError(f"{where}: expected a list of calls, got {type(value).__name__}")
    for i, c in enumerate(value):
        if not (isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("args", {}), dict)):
            raise ValueError(f"{where}[{i}]: a call is {{'name': str, 'args': dict}}, got {c!r}")
    return value


def task_turns(task: dict) -> tuple[list[str], list[list[dict]]]:
    """(user message per turn, ground-truth calls per turn) of a task; ValueError naming
    the task when they do not fit together."""
    tid = task.get("id", "?")
    users = task.get("user")
    users = [users] if isinstance(users, str) else users
    if not isinstance(users, list) or not users or not all(isinstance(u, str) for u in users):
        raise ValueError(f"agent task {tid}: 'user' must be a string or a non-empty list of strings")
    gt = task.get("ground_truth", [])
    if gt and all(isinstance(t, list) for t in gt):
        turns = [_calls(t, f"agent task {tid}: ground_truth[{i}]") for i, t in enumerate(gt)]
    else:
        turns = [_calls(gt, f"agent task {tid}: ground_truth")]
    if len(turns) != len(users):
        raise ValueError(f"agent task {tid}: {len(users)} user turns but {len(turns)} turns of ground truth")
    return users, turns


def check_task(task: dict) -> dict:
    """The task, checked: known classes, tools its classes document, turns that fit."""
    tid = task.get("id", "?")
    for key in ("involved_classes", "tools", "user"):
        if key not in task:
            raise ValueError(f"agent task {tid}: missing key {key!r}")
    toolset = task.get("toolset", "procedural")
    specs = toolset_specs(toolset)
    for c in task["involved_classes"]:
        simulator_class(c)
    owned = {t for c in task["involved_classes"] for t in _documented(c)}
    for t in task["tools"]:
        if t not in specs:
            raise ValueError(f"agent task {tid}: tool {t!r} is not in the {toolset!r} toolset")
        if t not in owned:
            raise ValueError(f"agent task {tid}: tool {t!r} belongs to none of {task['involved_classes']}")
    task_turns(task)
    return task


# ------------------------------------------------------------------------ the backend

MAX_NUMBER = 10**15        # larger argument values are refused (a huge int exponent or precision hangs)
MAX_STRING = 10_000
MAX_ITEMS = 1_000
SMALL_ARGS = {"precision": 100, "exponent": 1_000}   # MathAPI's: mpmath / decimal precision, power


def _too_big(args: dict) -> str | None:
    """Why the argument values are too large to run safely, or None."""
    def walk(v, key: str) -> str | None:
        if isinstance(v, bool) or v is None:
            return None
        if isinstance(v, (int, float)):
            limit = SMALL_ARGS.get(key, MAX_NUMBER)
            return None if abs(v) <= limit else f"argument {key!r} is too large (at most {limit})"
        if isinstance(v, str):
            return None if len(v) <= MAX_STRING else f"argument {key!r} is too long (at most {MAX_STRING} characters)"
        items = list(v.values()) if isinstance(v, dict) else list(v)
        if len(items) > MAX_ITEMS:
            return f"argument {key!r} has too many items (at most {MAX_ITEMS})"
        return next((m for m in (walk(x, key) for x in items) if m), None)
    return next((m for m in (walk(v, k) for k, v in args.items()) if m), None)


def _plain(value, depth: int = 0) -> bool:
    """A JSON value (what a parser can produce), not too deep."""
    if depth > 20:
        return False
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, list):
        return all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v, depth + 1) for k, v in value.items())
    return False


def bfcl_result_text(result) -> str:
    """A result as bfcl's executor records it (what the response check compares)."""
    if type(result) is str:
        return result
    if type(result) is dict:
        try:
            return json.dumps(result)
        except Exception:
            return str(result)
    return str(result)


def shown_result(result, bare: bool = False) -> str:
    """A result as the model sees it: compact JSON ("null" for None). `bare` (the procedural
    toolset, for short transcripts): a one-key dict shows just its value ({"file_content":
    "plum"} -> plum, {"result": 39} -> 39) and None shows "ok"."""
    if bare:
        if result is None:
            return "ok"
        if isinstance(result, dict) and len(result) == 1:
            result = next(iter(result.values()))
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, separators=(",", ":"), ensure_ascii=False, default=str)
    except Exception:
        return str(result)


def execute(instances: dict, offered: dict[str, str], name: str, args: dict) -> tuple[object, str, str | None]:
    """Run one call on `instances`: (result, bfcl's text of it, error message or None).
    `offered` maps the task's tool names to the class that defines them. Never evals:
    the method is looked up by name among the documented public methods."""
    owner = offered.get(name)
    if owner is None or owner not in instances or name.startswith("_"):
        msg = f"tool {name!r} is not available in this task"
        return None, f"Error during execution: {msg}", msg
    if not isinstance(args, dict) or not all(isinstance(k, str) for k in args) or not _plain(args):
        msg = f"{name}: arguments must be plain JSON values"
        return None, f"Error during execution: {msg}", msg
    method = getattr(instances[owner], name, None)
    if not callable(method):
        msg = f"tool {name!r} is not available in this task"
        return None, f"Error during execution: {msg}", msg
    params = inspect.signature(method).parameters
    unknown = [a for a in args if a not in params or params[a].kind not in
               (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    if unknown:
        msg = f"{name} has no argument {unknown[0]!r}"
        return None, f"Error during execution: {msg}", msg
    missing = [a for a, p in params.items() if p.default is inspect.Parameter.empty and a not in args
               and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    if missing:
        msg = f"{name} is missing the argument {missing[0]!r}"
        return None, f"Error during execution: {msg}", msg
    big = _too_big(args)
    if big:
        msg = f"{name}: {big}"
        return None, f"Error during execution: {msg}", msg
    dps, prec = mpmath.mp.dps, decimal.getcontext().prec
    try:
        result = method(**copy.deepcopy(args))
        text = bfcl_result_text(result)
    except Exception as e:   # the simulator choked on the values: a failed call, as in bfcl
        return None, f"Error during execution: {e}", f"{name} failed: {type(e).__name__}: {e}"[:300]
    finally:   # MathAPI sets these process-wide precisions; put them back
        mpmath.mp.dps, decimal.getcontext().prec = dps, prec
    if isinstance(result, dict) and "error" in result:
        return result, text, str(result["error"])
    return result, text, None


_NUM = re.compile(r"-?\d+(?:\.\d+)?")
_WORD = re.compile(r"-?\d+(?:\.\d+)?|[^\W_]+(?:['.][^\W_]+)*", re.UNICODE)


def answer_matches(text: str, answer: str) -> bool:
    """The last word or number of `text` equals `answer` (numbers by value, words ignoring case)."""
    words = _WORD.findall(text or "")
    if not words:
        return False
    last = words[-1]
    if _NUM.fullmatch(last) and _NUM.fullmatch(str(answer).strip()):
        return float(last) == float(str(answer).strip())
    return last.casefold() == str(answer).strip().casefold()


class BFCLBackend:
    """The agent domain's ToolBackend over bfcl_eval's simulators (module doc)."""

    def __init__(self, toolset: str = "procedural"):
        self.toolset = toolset
        self._tools = toolset_specs(toolset)
        self.task: dict | None = None

    def tools(self) -> dict[str, ToolSpec]:
        return dict(self._tools)

    def task_tools(self, task: dict) -> list[str]:
        """The tools the task offers (ToolEnv shows the model only these)."""
        return list(task["tools"])

    def reset(self, task: dict) -> str:
        check_task(task)
        toolset = task.get("toolset", "procedural")
        if toolset != self.toolset:
            raise ValueError(f"agent task {task.get('id')}: its toolset is {toolset!r}, the env's "
                             f"{self.toolset!r} (make_env(..., toolset={toolset!r}))")
        self.task = task
        self.users, self.gt = task_turns(task)
        owner = {t: c for c in task["involved_classes"] for t in _documented(c)}
        self.offered = {t: owner[t] for t in task["tools"]}
        # the oracle runs every documented method of its classes (BFCL ground truth may use a
        # tool the task does not offer, e.g. an excluded function), the model only offered ones
        self.oracle_tools = owner
        self.instances = new_instances(task)
        self.oracle = new_instances(task)
        self.turn = 0
        self.results: list[str] = []        # bfcl's texts of every model call so far
        self.turn_calls = 0
        self.log: list[tuple[int, ToolCall]] = []   # (turn, call) of every call that reached the backend
        self.failure: str | None = None
        return self.users[0]

    def call(self, call: ToolCall) -> str:
        if self.task is None:
            raise RuntimeError("BFCLBackend.call before reset")
        if len(self.log) >= MAX_CALLS_PER_EPISODE:
            raise ToolError(f"too many calls (at most {MAX_CALLS_PER_EPISODE} per episode)")
        self.log.append((self.turn, ToolCall(call.name, copy.deepcopy(call.args))))
        self.turn_calls += 1
        result, text, error = execute(self.instances, self.offered, call.name, call.args)
        self.results.append(text)
        if error is not None:
            raise ToolError(error)
        return shown_result(result, bare=self.toolset == "procedural")

    def _check_turn(self) -> None:
        from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import response_checker, state_checker

        gt = self.gt[self.turn]
        gt_results = [execute(self.oracle, self.oracle_tools, c["name"], c.get("args", {}))[1] for c in gt]
        if self.failure is not None or not gt:
            return   # bfcl checks no turn without ground truth (its calls still ran above)
        if self.turn_calls == 0:
            self.failure = f"turn {self.turn}: no call, the task needed one"
            return
        state = state_checker(self.instances, self.oracle)
        if not state["valid"]:
            diff = sorted(state.get("details", {}).get("differences", {}))
            self.failure = f"turn {self.turn}: {state['error_message']} (attributes {diff})"
            return
        resp = response_checker(self.results, gt_results, self.turn)
        if not resp["valid"]:
            missing = resp.get("details", {}).get("missing_items", [])
            self.failure = f"turn {self.turn}: results missing: {[m[:80] for m in missing][:3]}"

    def end_turn(self, final_text: str) -> str | None:
        self._check_turn()
        self.turn += 1
        self.turn_calls = 0
        return self.users[self.turn] if self.turn < len(self.users) else None

    def finish(self, final_text: str) -> dict:
        answer = self.task.get("answer") if self.task else None
        failure = self.failure
        if failure is None and answer is not None and not answer_matches(final_text, str(answer)):
            failure = f"final answer: expected {answer!r} at the end"
        ok = failure is None
        return {"success": ok, "reward": 1.0 if ok else 0.0, "failure": failure}


def make_env(harness_cfg: HarnessConfig, memory: MemoryStore | None = None, toolset: str = "procedural") -> ToolEnv:
    """The agent environment: a harness in front of a BFCLBackend of `toolset`
    ("procedural": the short tool docs of experts/agent's tasks; "bfcl": BFCL's docs)."""
    return ToolEnv(BFCLBackend(toolset), harness_cfg, memory)


# ------------------------------------------------------------------------ replay and reward

def harness_config(name: str | None = None, harnesses: str | Path | None = None) -> HarnessConfig:
    """The harness called `name` in `harnesses` (default: this domain's mix), or its first train harness."""
    return agent_harness.harness_config(name, harnesses or HARNESSES)


def replay(task: dict, messages: list[dict], harness_cfg: HarnessConfig) -> tuple[dict, BFCLBackend, list]:
    """Run the assistant messages of a transcript through a fresh env: (info of the last
    step, with success/reward when the episode ended; the backend; the calls per turn per
    assistant message, as bfcl's checker takes them). Never raises on model output."""
    env = make_env(harness_cfg, toolset=task.get("toolset", "procedural"))
    backend: BFCLBackend = env.backend
    env.reset(task)
    info: dict = {"success": False, "reward": 0.0, "failure": "the episode did not end"}
    steps: list[list[list[ToolCall]]] = [[] for _ in backend.users]
    done = False
    for m in messages:
        if not isinstance(m, dict) or m.get("role") != "assistant":
            continue
        content = m.get("content")
        n0, turn = len(backend.log), backend.turn
        _obs, done, info = env.step(content if isinstance(content, str) else "")
        made = [c for _t, c in backend.log[n0:]]
        if made and turn < len(steps):
            steps[turn].append(made)
        if done:
            break
    if not done:
        info = {"success": False, "reward": 0.0, "failure": "the episode did not end"}
    elif info.get("env_error"):
        info.setdefault("failure", f"env error: {info['env_error']}")
    return info, backend, steps


def _call_string(c: ToolCall) -> str:
    """bfcl's form of a call: the tool's name (checked against the docs by the caller) and
    each value as a Python literal (repr of a JSON value)."""
    return f"{c.name}({', '.join(f'{k}={v!r}' for k, v in c.args.items())})"


def bfcl_verdict(task: dict, steps: list[list[list[ToolCall]]]) -> dict:
    """bfcl's multi_turn_checker on the replayed calls (strings written here from parsed
    calls), under a fresh model name whose cached instances are removed afterwards."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    users, gt = task_turns(task)
    tid = str(task.get("id", "task"))
    entry = {"id": tid, "initial_config": task.get("initial_config") or {},
             "involved_classes": list(task["involved_classes"])}
    known = {t for c in task["involved_classes"] for t in _documented(c)}

    def call_string(c: ToolCall) -> str:   # a tool no involved class has: a call that fails, never a builtin
        return _call_string(c) if c.name in known else "_mopd_unavailable_tool()"

    decoded = [[[call_string(c) for c in step] for step in turn] for turn in steps]
    gt_strings = [[_call_string(ToolCall(c["name"], c.get("args", {}))) for c in turn] for turn in gt]
    name = f"mopd_agent_{uuid.uuid4().hex}"
    try:
        res = multi_turn_checker(decoded, gt_strings, entry, "multi_turn_base", name)
    except Exception as e:   # bfcl asserts on instance sets; a broken replay is a failure
        res = {"valid": False, "error_message": f"{type(e).__name__}: {e}"}
    finally:
        prefix = re.sub(r"[-./:]", "_", name)
        g = vars(multi_turn_utils)
        for k in [k for k in g if k.startswith(prefix)]:
            del g[k]
    return res


def _messages(completion) -> list[dict]:
    if isinstance(completion, str):
        return [{"role": "assistant", "content": completion}]
    if isinstance(completion, dict):
        return [completion]
    return list(completion or [])


def score_episode(task, completion, harness: str | None = None, harnesses: str | Path | None = None,
                  checker: str = "env") -> float:
    """1.0 when replaying `completion` solves `task` (module doc), else 0.0."""
    task = json.loads(task) if isinstance(task, str) else task
    cfg = harness_config(harness, harnesses)
    info, backend, steps = replay(task, _messages(completion), cfg)
    if checker == "env":
        return float(bool(info.get("success")))
    if checker != "bfcl":
        raise ValueError(f"reward_agent: checker must be 'env' or 'bfcl', got {checker!r}")
    if not info.get("success") and info.get("failure") == "the episode did not end":
        return 0.0   # bfcl: a force-terminated episode fails
    if backend.turn < len(backend.users):
        return 0.0
    ok = bfcl_verdict(task, steps)["valid"]
    answer = task.get("answer")
    if ok and answer is not None:
        last = next((m.get("content") for m in reversed(_messages(completion))
                     if isinstance(m, dict) and m.get("role") == "assistant"), "")
        ok = answer_matches(last if isinstance(last, str) else "", str(answer))
    return float(ok)


def reward(prompts, completions, task=None, harness=None, domain=None, harnesses: str | None = None,
           checker: str = "env", **kwargs) -> list[float | None]:
    """TRL-style reward: 1.0 when the episode in each completion (its messages after the
    first user message) solves the row's `task`, replayed through the row's `harness`
    (default: the first train harness of `harnesses`, recipes/harnesses/agent.yaml);
    None for rows of another domain. `checker`: "env" (this module's check) or "bfcl"
    (bfcl's multi_turn_checker on the replayed calls)."""
    completions, tasks, names, mine = reward_columns("reward_agent", DOMAIN, completions, task, harness, domain)
    n = len(completions)
    out: list[float | None] = []
    for i in range(n):
        if not mine[i]:
            out.append(None)
            continue
        t = tasks[i]
        try:
            t = json.loads(t) if isinstance(t, str) else t
            check_task(t)
        except (ValueError, TypeError) as e:
            raise ValueError(f"reward_agent: row {i}: bad task ({e})") from None
        out.append(score_episode(t, completions[i], names[i], harnesses, checker))
    return out


reward.__name__ = "reward_agent"
