"""Environment and reward of the `coding_agent` domain: fix the bug in a small workspace
with file tools and a test runner; hidden tests decide.

`CodingBackend` is the domain's ToolBackend (core/agent/env.py); `make_env(harness_cfg)`
puts a harness in front of it (`CodingEnv`, a ToolEnv whose `submit` call ends the
episode), which MOPD episodes, the evals and the expert's RL drive. Each episode gets its
own workspace (rewards/workspace.py): made at reset, removed when the episode ends, at
close(), at the next reset, and at process exit.

Tools (canonical names; a harness may rename them):

    list_files()                        the workspace's files
    read_file(path, start?, end?)       a file, or lines start..end (1-based); long files are cut
    replace(path, old, new)             replace the one occurrence of `old` ("ok", or an error)
    write_file(path, content)           create or overwrite a file
    run_tests()                         run the visible tests in a sandbox: failures, then a count
    submit()                            end the episode; the hidden tests decide

A plain answer without a call also ends the episode and is judged the same way.

A task is a dict (a row's `task` column, as JSON):

    id             str
    family         str ("humaneval", or a procedural family)
    user           the task text
    files          {path: text}   the workspace at the start (the buggy code and the visible tests)
    visible_tests  [path, ...]    the test files run_tests runs
    hidden         {"test": source defining check(candidate), "entry_point": name,
                    "helper": source the checker runs first (HumanEval's prompt) or ""}
    oracle         optional {"edits": [{"path", "old", "new"}], "reports": {"before", "after"}}
                   (experts/coding_agent/data.py's reference episodes; the reward ignores it)

The verdict: the workspace's modules (top-level .py files, the visible tests replaced by
fresh copies of the task's originals) run in a fresh sandbox, then `check(candidate)`
from the hidden test, through rewards/code.py's harness: the candidate runs in a locked-
down child process, the test code and a per-run token in its parent, and only a passing
check writes the token. `entry_point` is the function under test; the procedural tasks,
whose tests cover functions in several modules, use ENTRY_DISPATCH: the test calls
candidate(module, function, *args). Editing, emptying or deleting the visible tests
changes nothing the verdict sees. Reward 1.0 when check() passed, else 0.0; with
`partial_credit` (the reward's kwarg, e.g. `rl.reward_kwargs: {partial_credit: "true"}`,
and make_env's) the share of the hidden assertions that passed (`counted_check`: each
`assert` of check() counted in the trusted parent, the counts written to the result
channel under a per-run secret the candidate never sees), still on the fresh copies of
the visible tests, so editing them gains nothing here either.

An episode fails (reward 0, the env's `env_error` set, every other episode unaffected)
when one of its runs is killed or crashes, or its tools go over the workspace quota
(rewards/workspace.py: SandboxKilled, QuotaExceeded).

`reward(prompts, completions, task, harness=None, ...)` (TRL's signature) replays the
assistant messages of each completion through a fresh env with the row's harness (every
run_tests really runs) and returns the episode's reward.
"""
from __future__ import annotations

import ast
import json
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from core.agent.env import ToolEnv, ToolError, reward_columns
import core.agent.harness as agent_harness
from core.agent.harness import HarnessConfig, MemoryStore, ToolCall, ToolSpec
from rewards.code import run_tests as run_hidden_tests
from rewards.sandbox import Limits, check_isolation, run_python
from rewards.workspace import Workspace, WorkspaceError, WorkspaceLimits

DOMAIN = "coding_agent"
REPO = Path(__file__).resolve().parents[1]
HARNESSES = REPO / "recipes" / "harnesses" / "coding_agent.yaml"
MAX_WORKERS = 2           # episodes replayed at once by `reward` (each runs a sandbox or two)
ENTRY_DISPATCH = "_mopd_entry"
HIDDEN_LIMITS = Limits(wall_s=10.0, cpu_s=10, memory_mb=1024, total_memory_mb=2048)


def _spec(name: str, description: str, args: dict[str, str], optional: tuple[str, ...] = ()) -> ToolSpec:
    props = {a: {"type": t} for a, t in args.items()}
    return ToolSpec(name, description, {"type": "object", "properties": props,
                                        "required": [a for a in args if a not in optional]})


TOOLS: dict[str, ToolSpec] = {
    "list_files": _spec("list_files", "List the files.", {}),
    "read_file": _spec("read_file", "Show a file, or its lines start..end.",
                       {"path": "string", "start": "integer", "end": "integer"}, optional=("start", "end")),
    "replace": _spec("replace", "Replace text that occurs once in a file.",
                     {"path": "string", "old": "string", "new": "string"}),
    "write_file": _spec("write_file", "Write a whole file.", {"path": "string", "content": "string"}),
    "run_tests": _spec("run_tests", "Run the visible tests.", {}),
    "submit": _spec("submit", "Submit the fix; this ends the task.", {}),
}


# ------------------------------------------------------------------------ tasks

def check_task(task: dict) -> dict:
    """The task, checked (ValueError naming the task and the key)."""
    tid = task.get("id", "?") if isinstance(task, dict) else "?"
    if not isinstance(task, dict):
        raise ValueError(f"coding_agent task: expected a dict, got {type(task).__name__}")
    for key in ("files", "visible_tests", "hidden", "user"):
        if key not in task:
            raise ValueError(f"coding_agent task {tid}: missing key {key!r}")
    files = task["files"]
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise ValueError(f"coding_agent task {tid}: files must be {{path: text}}")
    for t in task["visible_tests"]:
        if t not in files:
            raise ValueError(f"coding_agent task {tid}: visible test {t!r} is not among its files")
    hidden = task["hidden"]
    if not isinstance(hidden, dict) or not isinstance(hidden.get("test"), str) or \
            not isinstance(hidden.get("entry_point"), str) or "def check" not in hidden["test"]:
        raise ValueError(f"coding_agent task {tid}: hidden must be {{'test': source defining check(candidate), "
                         f"'entry_point': name, 'helper': source}}")
    if not isinstance(task["user"], str) or not task["user"]:
        raise ValueError(f"coding_agent task {tid}: user must be a non-empty string")
    return task


# A module finder serving the workspace's modules from the program's own text: the
# candidate runs in rewards/code.py's harness as one program, and its modules still
# import each other by name.
_LOADER = r'''
import sys as _mopd_sys, importlib as _mopd_il, importlib.util as _mopd_util

_MOPD_SOURCES = %r


class _MopdWorkspace:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return _mopd_util.spec_from_loader(name, cls) if name in _MOPD_SOURCES else None

    @staticmethod
    def create_module(spec):
        return None

    @staticmethod
    def exec_module(module):
        fname, src = _MOPD_SOURCES[module.__name__]
        module.__file__ = fname
        exec(compile(src, fname, "exec"), module.__dict__)


_mopd_sys.meta_path.insert(0, _MopdWorkspace)


def _mopd_entry(module, name, *args):
    return getattr(_mopd_il.import_module(module), name)(*args)
'''


def candidate_program(files: dict[str, str], entry_point: str, module: str | None) -> str:
    """The program the hidden test runs against: every top-level module of `files`, made
    importable, then the entry point bound (ENTRY_DISPATCH needs no module)."""
    sources = {name[:-3]: (name, text) for name, text in files.items()
               if name.endswith(".py") and "/" not in name and name[:-3].isidentifier()}
    prog = _LOADER % (sources,)
    if entry_point != ENTRY_DISPATCH:
        prog += f"\nfrom {module} import {entry_point}\n"
    return prog


_COUNTED = """
import os as _mopd_os


def check(candidate):
    _mopd_n = [0, 0]   # assertions passed, failed
    _mopd_err = 1      # check() raised outside its assertions (setup code, the solution died)
    try:
        _mopd_check_body(candidate, _mopd_n)
        _mopd_err = 0
    finally:
        _mopd_os.write(3, ("%s:%%d:%%d:%%d;" %% (_mopd_n[0], _mopd_n[1], _mopd_err)).encode())
    if _mopd_n[1]:
        raise AssertionError("%%d of %%d hidden assertions failed" %% (_mopd_n[1], sum(_mopd_n)))
"""


class _CountAsserts(ast.NodeTransformer):
    """Each `assert` becomes: try it; count it passed or failed (an exception raised by
    the candidate in it is a failure), and go on to the next."""

    def __init__(self):
        self.n = 0

    def visit_Assert(self, node: ast.Assert):
        self.n += 1
        def bump(k):
            return ast.AugAssign(target=ast.Subscript(value=ast.Name("_mopd_n", ast.Load()), slice=ast.Constant(k),
                                                      ctx=ast.Store()), op=ast.Add(), value=ast.Constant(1))
        return ast.Try(body=[node], handlers=[ast.ExceptHandler(type=ast.Name("Exception", ast.Load()), name=None,
                                                                body=[bump(1)])],
                       orelse=[bump(0)], finalbody=[])


def counted_check(test: str, secret: str) -> tuple[str, int] | None:
    """`test` with its check(candidate) counting its assertions (`_COUNTED`), and the
    number of assert statements in it; None when it has no module-level check() with an
    assert (then only pass / fail exists)."""
    try:
        tree = ast.parse(test)
    except SyntaxError:
        return None
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if fn is None or not fn.args.args:
        return None
    counter = _CountAsserts()
    counter.visit(fn)
    if not counter.n:
        return None
    fn.name = "_mopd_check_body"
    fn.args.args.append(ast.arg("_mopd_n"))
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n" + _COUNTED % secret, counter.n


def judge(task: dict, files: dict[str, str], *, isolation: str | None = None,
          limits: Limits | None = None, partial_credit: bool = False) -> dict:
    """The hidden tests on `files` (the workspace at submit): {"passed", "reason",
    "fraction"}; `fraction` is 1.0 or 0.0, or with `partial_credit` the share of the
    hidden assertions that passed: passed / max(assertions run (+1 when check() raised
    outside one), assert statements in check()), 0.0 when the run left no count (killed,
    timed out)."""
    hidden = task["hidden"]
    fresh = {**files, **{t: task["files"][t] for t in task["visible_tests"]}}   # edited or deleted: no matter
    program = candidate_program(fresh, hidden["entry_point"], hidden.get("module"))
    iso = check_isolation(isolation)
    secret = secrets.token_hex(16)
    counted = counted_check(hidden["test"], secret) if partial_credit else None
    passed, res = run_hidden_tests(program, counted[0] if counted else hidden["test"], hidden["entry_point"],
                                   helper=hidden.get("helper") or "", limits=limits or HIDDEN_LIMITS, isolation=iso)
    fraction = float(passed)
    if counted:
        # the counts come only from the trusted parent, under the secret (the candidate
        # cannot reach the result channel); the harness's token follows them when all passed
        m = re.match(rf"{secret}:(\d+):(\d+):(\d+);".encode(), res.result or b"")
        if m:
            ok, bad, err = (int(x) for x in m.groups())
            fraction = ok / max(ok + bad + err, counted[1])
            passed = bad == 0 and err == 0 and ok >= counted[1]
        else:
            fraction, passed = 0.0, False
    if not passed and res.reason == "setup_failed":
        # a program can fake the bootstrap's failure: the machine is at fault only when a
        # trivial program fails the same way, and then the run stops instead of scoring 0
        probe = run_python("print('ok')", isolation=iso, limits=Limits(wall_s=20))
        if probe.reason == "setup_failed":
            raise RuntimeError(f"coding_agent: the sandbox ({iso}) could not be built: {probe.stderr[-500:]}")
    reason = "passed" if passed else (res.reason if not counted or fraction == 0.0 else "some_failed")
    return {"passed": bool(passed), "reason": reason, "fraction": fraction}


# ------------------------------------------------------------------------ the backend

class CodingBackend:
    """The coding_agent domain's ToolBackend (module doc)."""

    def __init__(self, *, isolation: str | None = None, limits: WorkspaceLimits | None = None,
                 hidden_limits: Limits | None = None, base_dir: str | Path | None = None,
                 partial_credit: bool = False):
        self.isolation = check_isolation(isolation)   # before any episode: a bad setting is the run's error
        self.partial_credit = partial_credit
        self.limits = limits or WorkspaceLimits()
        self.hidden_limits = hidden_limits or HIDDEN_LIMITS
        self.base_dir = base_dir
        self.task: dict | None = None
        self.ws: Workspace | None = None
        self.submitted = False
        self.verdict: dict | None = None

    def tools(self) -> dict[str, ToolSpec]:
        return dict(TOOLS)

    def reset(self, task: dict) -> str:
        self.close()
        check_task(task)
        self.task = task
        self.submitted = False
        self.verdict = None
        self.ws = Workspace(task["files"], self.limits, self.isolation, self.base_dir)
        return task["user"]

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()

    def call(self, call: ToolCall) -> str:
        if self.ws is None or self.ws.closed:
            raise RuntimeError("CodingBackend.call without a live workspace (reset first)")
        if self.submitted:
            raise ToolError("already submitted")
        a = call.args
        try:
            if call.name == "list_files":
                return self.ws.list_files()
            if call.name == "read_file":
                return self.ws.read(a["path"], a.get("start"), a.get("end"))
            if call.name == "replace":
                return self.ws.replace(a["path"], a["old"], a["new"])
            if call.name == "write_file":
                return self.ws.write(a["path"], a["content"])
            if call.name == "run_tests":
                return self.ws.run_tests(list(self.task["visible_tests"]))
            if call.name == "submit":
                self.submitted = True
                return "submitted"
        except WorkspaceError as e:
            raise ToolError(str(e)) from None
        except Exception:
            self.close()   # SandboxKilled, QuotaExceeded: the episode ends here, failed
            raise
        raise ToolError(f"unknown tool {call.name!r}")

    def end_turn(self, final_text: str) -> str | None:
        return None   # one user turn: a plain answer ends the episode, judged like submit()

    def finish(self, final_text: str) -> dict:
        try:
            files = {k: v.decode("utf-8", "replace") for k, v in self.ws.snapshot().items()}
            self.verdict = judge(self.task, files, isolation=self.isolation, limits=self.hidden_limits,
                                 partial_credit=self.partial_credit)
        finally:
            self.close()
        ok = self.verdict["passed"]
        return {"success": ok, "reward": self.verdict["fraction"],
                "failure": None if ok else f"hidden tests: {self.verdict['reason']}"}


class CodingEnv(ToolEnv):
    """ToolEnv whose `submit` call ends the episode; the workspace goes when it ends."""

    def _step(self, text: str, info: dict) -> tuple[str, bool]:
        obs, done = super()._step(text, info)
        if not done and self.backend.submitted:
            info.update(self.backend.finish(text))
            return "", True
        return obs, done

    def step(self, assistant_text: str) -> tuple[str, bool, dict]:
        try:
            return super().step(assistant_text)
        finally:
            if self.done:
                self.backend.close()

    def close(self) -> None:
        """End the episode where it stands (cut, abandoned) and remove its workspace."""
        self.backend.close()
        self.done = True


def make_env(harness_cfg: HarnessConfig, memory: MemoryStore | None = None, *, isolation: str | None = None,
             limits: WorkspaceLimits | None = None, hidden_limits: Limits | None = None,
             base_dir: str | Path | None = None, partial_credit: bool | str = False) -> CodingEnv:
    """The coding_agent environment: a harness in front of a CodingBackend."""
    return CodingEnv(CodingBackend(isolation=isolation, limits=limits, hidden_limits=hidden_limits,
                                   base_dir=base_dir, partial_credit=as_bool(partial_credit, "partial_credit")),
                     harness_cfg, memory)


def as_bool(value: bool | str, name: str) -> bool:
    """A setting that may arrive as a string (rl.reward_kwargs values are strings)."""
    if isinstance(value, bool):
        return value
    v = str(value).strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off", ""):
        return False
    raise ValueError(f"reward_coding_agent: {name} must be true or false, got {value!r}")


# ------------------------------------------------------------------------ replay and reward

def harness_config(name: str | None = None, harnesses: str | Path | None = None) -> HarnessConfig:
    """The harness called `name` in `harnesses` (default: this domain's mix), or its first train harness."""
    return agent_harness.harness_config(name, harnesses or HARNESSES)


def _messages(completion) -> list[dict]:
    if isinstance(completion, str):
        return [{"role": "assistant", "content": completion}]
    if isinstance(completion, dict):
        return [completion]
    return list(completion or [])


def replay(task: dict, messages: list[dict], harness_cfg: HarnessConfig, **env_kw) -> dict:
    """Run the assistant messages of a transcript through a fresh env: the info of the
    step that ended the episode, or a failure when it never ended. Never raises on model
    output."""
    env = make_env(harness_cfg, **env_kw)
    try:
        env.reset(task)
        for m in messages:
            if not isinstance(m, dict) or m.get("role") != "assistant":
                continue
            content = m.get("content")
            _obs, done, info = env.step(content if isinstance(content, str) else "")
            if done:
                if info.get("env_error"):
                    info.setdefault("failure", f"env error: {info['env_error']}")
                return info
        return {"success": False, "reward": 0.0, "failure": "the episode did not end"}
    finally:
        env.close()


def reward(prompts, completions, task=None, harness=None, domain=None, harnesses: str | None = None,
           isolation: str | None = None, max_workers: int = MAX_WORKERS, partial_credit: bool | str = False,
           **kwargs) -> list[float | None]:
    """TRL-style reward: 1.0 when the episode in each completion (its messages after the
    first user message), replayed through the row's `harness` (default: the first train
    harness of `harnesses`), ends with the hidden tests passing, else 0.0; with
    `partial_credit` the share of the hidden assertions that passed. None for rows of
    another domain."""
    partial_credit = as_bool(partial_credit, "partial_credit")
    completions, tasks, names, mine = reward_columns("reward_coding_agent", DOMAIN, completions, task, harness, domain)
    n = len(completions)
    jobs = []
    for i in range(n):
        if not mine[i]:
            continue
        try:
            t = json.loads(tasks[i]) if isinstance(tasks[i], str) else tasks[i]
            check_task(t)
        except (ValueError, TypeError) as e:
            raise ValueError(f"reward_coding_agent: row {i}: bad task ({e})") from None
        jobs.append((i, t, harness_config(names[i], harnesses)))
    if jobs:
        isolation = check_isolation(isolation)

    def score(job) -> tuple[int, float]:
        i, t, cfg = job
        info = replay(t, _messages(completions[i]), cfg, isolation=isolation, partial_credit=partial_credit)
        return i, float(info.get("reward", 0.0)) if partial_credit else float(bool(info.get("success")))

    out: list[float | None] = [None] * n
    if len(jobs) <= 1 or max_workers <= 1:
        results = [score(j) for j in jobs]
    else:
        with ThreadPoolExecutor(max_workers=min(max_workers, len(jobs))) as pool:
            results = list(pool.map(score, jobs))
    for i, s in results:
        out[i] = s
    return out


reward.__name__ = "reward_coding_agent"


def _preflight(*, isolation: str | None = None, partial_credit: bool | str = False, **_kwargs) -> None:
    """Before any model loads: a bad or missing sandbox isolation, or a partial_credit
    that is no boolean, is an error now."""
    check_isolation(isolation)
    as_bool(partial_credit, "partial_credit")


reward.preflight = _preflight
