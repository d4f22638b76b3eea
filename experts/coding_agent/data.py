"""Data of the `coding_agent` domain: fix the bugs in a small workspace with file tools and
a test runner; hidden tests decide (environment and reward: rewards/coding_agent.py).

Procedural tasks, small enough for a 2-layer model: each function comes from a TEMPLATE
(2-6 lines) with one known bug, the buggy text a single small `replace` undoes:

    last          return xs[len(xs) - 1]        off_by_one         len(xs) - 2
    total         sum(range(1, n + 1))          off_by_one         range(1, n)
    count_above   if x > t:                     wrong_comparison   x >= t
    clamp         if x < lo:                    wrong_comparison   x > lo
    gap           return sub(x, y)              swapped_arguments  sub(y, x)
    safe_div      if b == 0: return 0           dropped_edge_case  the `if` removed
    biggest       return best                   wrong_return       return x
    first_even    return -1                     wrong_return       return 0

Difficulty (data.difficulty) sets (bugs, files): 1 -> (1, 1), 2 -> (1, 2), 3 -> (2, 2),
4 -> (2, 3), 5 -> (3, 3); a task has max(bugs, files) functions from distinct templates,
dealt round-robin over m.py, util.py, lib.py, the bugs in `bugs` of them. test_m.py holds
one visible test per function (two asserts, the first failing value drawn so that the
bug shows); the hidden test has six asserts per function (three that the bug fails),
through rewards/coding_agent.py's ENTRY_DISPATCH: candidate("m", "last", [4, 7, 1]).

The oracle's episode: run_tests(), read_file each file with a bug, one replace per bug,
run_tests(), submit(). Its run_tests outputs are computed from the templates' Python
twins of the code (not by running it), in the runner's exact format; the tests replay a
sample through the real sandbox and compare.

HumanEval (DATASETS["humaneval"]): the 164 problems with an injected bug
(experts/coding_agent/humaneval.py); the reference episode is read_file, the fix,
submit; `mopd rewards check --domain coding_agent --dataset humaneval`.

Rows: prompt [{"role": "user", ...}], completion (the oracle's episode after it, through
`harness`), domain, task (JSON), harness. A task is `train` or `test` by a stable hash of
its files; rows are deterministic for (split, n, seed, difficulty).
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import datasets

from experts.agent_expert import AgentExpert
from experts.coding_agent.edits import fix_edit
from core.agent.harness import HarnessConfig, ToolCall, as_harness_config, load_harnesses
from rewards.coding_agent import ENTRY_DISPATCH, HARNESSES, CodingBackend, CodingEnv, harness_config, make_env

DOMAIN = "coding_agent"
EFFORTS: tuple[str, ...] = ()
MULTI_TURN = True            # completions are whole episodes (experts/check.py scores them as message lists)
TEST_FRACTION = 0.1
DIFFICULTIES = {1: (1, 1), 2: (1, 2), 3: (2, 2), 4: (2, 3), 5: (3, 3)}   # difficulty -> (bugs, files)
FILES = ("m.py", "util.py", "lib.py")
TEST_FILE = "test_m.py"
FINAL_TEXT = "done"


# ------------------------------------------------------------------------ templates

@dataclass(frozen=True)
class Template:
    key: str
    names: tuple[str, ...]         # the function's name is drawn from these
    src: str                       # {f}: the name; {g}: a helper's name (gap)
    helper_names: tuple[str, ...]
    good: str                      # the text the bug replaces (occurs once in src)
    bug: str
    kind: str
    spec: str                      # one line for the task text
    ref: Callable                  # the correct function (Python twin of src)
    buggy: Callable                # the buggy one
    draw: Callable[[random.Random], tuple]


def _ints(rng, lo, hi, k):
    return rng.sample(range(lo, hi + 1), k)


def _count_args(rng):
    xs = [rng.randint(0, 9) for _ in range(rng.randint(3, 5))]
    return xs, rng.choice(xs) if rng.random() < 0.6 else rng.randint(0, 9)


def _clamp_args(rng):
    lo = rng.randint(0, 5)
    hi = lo + rng.randint(3, 8)
    return rng.randint(lo - 3, hi + 3), lo, hi


def _biggest_args(rng):
    xs = _ints(rng, 0, 30, rng.randint(3, 5))
    return (xs,)


def _first_even_args(rng):
    k = rng.randint(2, 4)
    if rng.random() < 0.5:
        return ([rng.choice((1, 3, 5, 7, 9, 11, 13)) for _ in range(k)],)
    return ([rng.randint(0, 20) for _ in range(k)],)


def _first_even(xs, missing):
    for x in xs:
        if x % 2 == 0:
            return x
    return missing


TEMPLATES: tuple[Template, ...] = (
    Template("last", ("last", "tail", "final"), "def {f}(xs):\n    return xs[len(xs) - 1]\n", (),
             "len(xs) - 1", "len(xs) - 2", "off_by_one", "{f}(xs) returns the last item of xs.",
             lambda xs: xs[len(xs) - 1], lambda xs: xs[len(xs) - 2],
             lambda rng: (_ints(rng, 0, 20, rng.randint(2, 5)),)),
    Template("total", ("total", "sum_to", "upto"), "def {f}(n):\n    return sum(range(1, n + 1))\n", (),
             "range(1, n + 1)", "range(1, n)", "off_by_one", "{f}(n) returns 1 + 2 + ... + n.",
             lambda n: sum(range(1, n + 1)), lambda n: sum(range(1, n)), lambda rng: (rng.randint(1, 9),)),
    Template("count_above", ("count_above", "n_over", "above"),
             "def {f}(xs, t):\n    n = 0\n    for x in xs:\n        if x > t:\n            n += 1\n    return n\n", (),
             "x > t", "x >= t", "wrong_comparison", "{f}(xs, t) counts the items of xs greater than t.",
             lambda xs, t: sum(x > t for x in xs), lambda xs, t: sum(x >= t for x in xs), _count_args),
    Template("clamp", ("clamp", "bound", "limit"),
             "def {f}(x, lo, hi):\n    if x < lo:\n        return lo\n"
             "    if x > hi:\n        return hi\n    return x\n",
             (), "x < lo", "x > lo", "wrong_comparison", "{f}(x, lo, hi) keeps x between lo and hi.",
             lambda x, lo, hi: lo if x < lo else hi if x > hi else x,
             lambda x, lo, hi: lo if x > lo else hi if x > hi else x, _clamp_args),
    Template("gap", ("gap", "diff", "minus"),
             "def {g}(a, b):\n    return a - b\n\n\ndef {f}(x, y):\n    return {g}(x, y)\n", ("sub", "take", "less"),
             "{g}(x, y)", "{g}(y, x)", "swapped_arguments", "{f}(x, y) returns x minus y.",
             lambda x, y: x - y, lambda x, y: y - x, lambda rng: tuple(_ints(rng, 0, 20, 2))),
    Template("safe_div", ("safe_div", "ratio", "share"),
             "def {f}(a, b):\n    if b == 0:\n        return 0\n    return a // b\n", (),
             "    if b == 0:\n        return 0\n", "", "dropped_edge_case",
             "{f}(a, b) returns a // b, or 0 when b is 0.",
             lambda a, b: 0 if b == 0 else a // b, lambda a, b: a // b,
             lambda rng: (rng.randint(0, 20), rng.choice((0, 0, 1, 2, 3, 4, 5)))),
    Template("biggest", ("biggest", "top", "peak"),
             "def {f}(xs):\n    best = xs[0]\n    for x in xs:\n"
             "        if x > best:\n            best = x\n    return best\n",
             (), "return best", "return x", "wrong_return", "{f}(xs) returns the largest item of xs.",
             lambda xs: max(xs), lambda xs: xs[-1], _biggest_args),
    Template("first_even", ("first_even", "even", "pick_even"),
             "def {f}(xs):\n    for x in xs:\n        if x % 2 == 0:\n            return x\n    return -1\n", (),
             "return -1", "return 0", "wrong_return", "{f}(xs) returns the first even item of xs, or -1.",
             lambda xs: _first_even(xs, -1), lambda xs: _first_even(xs, 0), _first_even_args),
)
BY_KEY = {t.key: t for t in TEMPLATES}


def _outcome(fn, args):
    """('ok', value) or ('raise', "Type: message"), as the test runner would report it."""
    try:
        return "ok", fn(*args)
    except Exception as e:   # our own Python twins of the templates, never model code
        return "raise", f"{type(e).__name__}: {str(e)[:200]}" if str(e) else type(e).__name__


def _call_text(name: str, args: tuple) -> str:
    return f"{name}({', '.join(repr(a) for a in args)})"


def _draw_cases(rng: random.Random, t: Template, k_exposing: int, k_any: int) -> list[tuple]:
    """Argument tuples: k_exposing on which the bug differs from the reference, then k_any
    drawn freely (distinct where the draw allows)."""
    exposing, free, seen = [], [], set()
    for _ in range(2000):
        if len(exposing) >= k_exposing and len(free) >= k_any:
            break
        args = t.draw(rng)
        key = repr(args)
        if key in seen:
            continue
        differs = _outcome(t.ref, args) != _outcome(t.buggy, args)
        if differs and len(exposing) < k_exposing:
            exposing.append(args)
            seen.add(key)
        elif len(free) < k_any:
            free.append(args)
            seen.add(key)
    if len(exposing) < k_exposing:
        raise RuntimeError(f"coding_agent: could not draw inputs that expose the {t.key} bug")
    return exposing + free


@dataclass
class _Func:
    template: Template
    name: str
    helper: str
    file: str
    has_bug: bool
    visible: list[tuple]
    hidden: list[tuple]

    @property
    def module(self) -> str:
        return self.file[:-3]

    def source(self) -> str:
        t = self.template
        src = t.src.format(f=self.name, g=self.helper)
        if self.has_bug:
            good = t.good.format(g=self.helper)
            src = src.replace(good, t.bug.format(g=self.helper), 1)
        return src


def _check_knobs(difficulty, n_bugs, n_files) -> tuple[int, int]:
    if n_bugs is None and n_files is None:
        if difficulty not in DIFFICULTIES:
            raise ValueError(f"coding_agent: difficulty must be one of {sorted(DIFFICULTIES)} "
                             f"((bugs, files): {DIFFICULTIES}), got {difficulty!r}")
        return DIFFICULTIES[difficulty]
    b, f = DIFFICULTIES.get(difficulty, (1, 1))
    b, f = n_bugs or b, n_files or f
    if not (1 <= b <= len(TEMPLATES) and 1 <= f <= len(FILES)):
        raise ValueError(f"coding_agent: bugs in 1..{len(TEMPLATES)} and files in 1..{len(FILES)}, got {b}, {f}")
    return b, f


def _report(funcs: list[_Func], fixed: bool) -> str:
    """What TEST_RUNNER (rewards/workspace.py) prints for test_m.py."""
    lines, passed, failed = [], 0, 0
    for fn in funcs:
        impl = fn.template.ref if (fixed or not fn.has_bug) else fn.template.buggy
        verdict = None
        for args in fn.visible:
            line = f"assert {_call_text(fn.name, args)} == {fn.template.ref(*args)!r}"
            kind, value = _outcome(impl, args)
            if kind == "raise":
                verdict = f"{line} -> {value}"
                break
            if value != fn.template.ref(*args):
                verdict = line
                break
        if verdict is None:
            passed += 1
        else:
            failed += 1
            lines.append(f"FAIL test_{fn.name}: {verdict}")
    lines.append(", ".join(([f"{failed} failed"] if failed else []) + [f"{passed} passed"]))
    return "\n".join(lines)


def make_task(rng: random.Random, difficulty: int = 1, n_bugs: int | None = None,
              n_files: int | None = None) -> dict:
    """One procedural task (rewards/coding_agent.py's format) with its oracle."""
    b, f = _check_knobs(difficulty, n_bugs, n_files)
    n = max(b, f)
    templates = rng.sample(TEMPLATES, n)
    buggy = set(rng.sample(range(n), b))
    funcs = []
    for i, t in enumerate(templates):
        cases = _draw_cases(rng, t, 3, 3)
        vis = [cases[0], cases[3]]
        rng.shuffle(vis)
        funcs.append(_Func(t, rng.choice(t.names), rng.choice(t.helper_names) if t.helper_names else "",
                           FILES[i % f], i in buggy, vis, cases))
    files: dict[str, str] = {}
    for fn in funcs:
        files[fn.file] = (files[fn.file] + "\n\n" if fn.file in files else "") + fn.source()
    imports = "\n".join(f"from {fn.module} import {fn.name}" for fn in funcs)
    tests = "\n\n".join(f"def test_{fn.name}():\n" + "".join(
        f"    assert {_call_text(fn.name, a)} == {fn.template.ref(*a)!r}\n" for a in fn.visible) for fn in funcs)
    files[TEST_FILE] = f"{imports}\n\n\n{tests}"
    hidden = "def check(candidate):\n" + "".join(
        f"    assert candidate({fn.module!r}, {fn.name!r}, {', '.join(repr(a) for a in args)}) == "
        f"{fn.template.ref(*args)!r}\n" for fn in funcs for args in fn.hidden)
    edits = []
    for fn in funcs:
        if fn.has_bug:
            text = files[fn.file]
            bug = fn.template.bug.format(g=fn.helper)
            good = fn.template.good.format(g=fn.helper)
            start = text.index(fn.source()) + fn.source().index(bug) if bug else \
                text.index(fn.source()) + len(fn.source().split("\n", 1)[0]) + 1
            old, new = fix_edit(text, start, bug, good)
            edits.append({"path": fn.file, "old": old, "new": new})
    order = [fn.file for fn in funcs]
    edits.sort(key=lambda e: order.index(e["path"]))
    specs = " ".join(fn.template.spec.format(f=fn.name) for fn in funcs)
    where = ", ".join(dict.fromkeys(fn.file for fn in sorted(funcs, key=lambda x: FILES.index(x.file))))
    user = (f"Files: {where}, {TEST_FILE}. {specs} Tests fail: fix the "
            f"{'bug' if b == 1 else f'{b} bugs'}, then submit.")
    digest = hashlib.sha256(json.dumps([files, user], sort_keys=True).encode()).hexdigest()
    return {"id": f"fix-b{b}f{f}-{digest[:12]}", "family": f"fix-b{b}f{f}", "bug_kinds":
            [fn.template.kind for fn in funcs if fn.has_bug], "user": user, "files": files,
            "visible_tests": [TEST_FILE],
            "hidden": {"test": hidden, "entry_point": ENTRY_DISPATCH, "helper": ""},
            "oracle": {"edits": edits, "reports": {"before": _report(funcs, False), "after": _report(funcs, True)}}}


def _split_of(task_id: str) -> str:
    return "test" if int(task_id.rsplit("-", 1)[1][:8], 16) % 1000 < TEST_FRACTION * 1000 else "train"


def make_tasks(split: str, n: int, seed: int = 0, difficulty: int = 1, n_bugs: int | None = None,
               n_files: int | None = None, stream: str = "tasks") -> list[dict]:
    """n distinct tasks of `split`."""
    if split not in ("train", "test"):
        raise ValueError(f"coding_agent: unknown split {split!r}; expected 'train' or 'test'")
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"coding_agent: n must be an int >= 0, got {n!r}")
    _check_knobs(difficulty, n_bugs, n_files)
    rng = random.Random(f"mopd/{DOMAIN}/{stream}/{split}/{seed}/{difficulty}/{n_bugs}/{n_files}")
    out, seen = [], set()
    for _ in range(n):
        fallback = None
        for _attempt in range(500):
            t = make_task(rng, difficulty, n_bugs, n_files)
            if _split_of(t["id"]) != split:
                continue
            fallback = t
            if t["id"] not in seen:
                break
        if fallback is None:
            raise RuntimeError(f"coding_agent: could not draw a {split} task")
        seen.add(fallback["id"])
        out.append(fallback)
    return out


# ------------------------------------------------------------------------ oracle episodes

class _OracleBackend(CodingBackend):
    """The real backend (workspace, file tools) with the oracle's precomputed test reports
    and no verdict: rendering an episode runs no code."""

    def reset(self, task: dict) -> str:
        user = super().reset(task)
        reports = (task.get("oracle") or {}).get("reports") or {}
        self._reports = [reports.get("before"), reports.get("after")]
        return user

    def call(self, call: ToolCall) -> str:
        if call.name == "run_tests" and not self.submitted:
            report = self._reports.pop(0) if self._reports else None
            if report is None:
                raise RuntimeError("coding_agent: the oracle has no test report for this run")
            return report
        return super().call(call)

    def finish(self, final_text: str) -> dict:
        self.close()
        return {"success": True, "reward": 1.0, "failure": None}


def oracle_calls(task: dict) -> list[ToolCall]:
    """The oracle's calls: procedural tasks run the tests, read each file with a bug, fix,
    run the tests again and submit; HumanEval tasks (no precomputed reports) read, fix, submit."""
    edits = task["oracle"]["edits"]
    with_tests = bool(task["oracle"].get("reports"))
    calls = [ToolCall("run_tests", {})] if with_tests else []
    for path in dict.fromkeys(e["path"] for e in edits):
        calls.append(ToolCall("read_file", {"path": path}))
        calls += [ToolCall("replace", dict(e)) for e in edits if e["path"] == path]
    if with_tests:
        calls.append(ToolCall("run_tests", {}))
    return calls + [ToolCall("submit", {})]


def wrong_call(task: dict, call: ToolCall, rng: random.Random) -> ToolCall:
    """A plausible mistake in place of the oracle's `call`, one the environment refuses:
    a replace whose old text has one character changed (so it occurs nowhere in the file),
    or a read of a file that does not exist. A student's most common failure is the first."""
    if call.name == "replace":
        text = task["files"][call.args["path"]]
        old = call.args["old"]
        for _ in range(100):
            i = rng.randrange(len(old))
            c = rng.choice([ch for ch in "abcdefghijklmnopqrstuvwxyz0123456789 +-<>=()[]:" if ch != old[i]])
            bad = old[:i] + c + old[i + 1:]
            if bad not in text:
                return ToolCall("replace", {**call.args, "old": bad})
    missing = next(f"{stem}.py" for stem in ("main", "utils", "core", "helpers", "app")
                   if f"{stem}.py" not in task["files"])
    return ToolCall("read_file", {"path": missing})


def render_episode(task: dict, calls: list[ToolCall], harness_cfg=None, harnesses=None,
                   backend: CodingBackend | None = None, wrong: dict[int, ToolCall] | None = None) -> list[dict]:
    """[user, assistant, tool, ...] of `calls` (one per assistant message) played through an
    env with `harness_cfg`; stops when the episode ends. `wrong`: {i: a call that must
    fail}, played (with its error observation) before calls[i]."""
    cfg = as_harness_config(harness_cfg, harnesses or HARNESSES)
    env = CodingEnv(backend or _OracleBackend(), cfg)
    wrong = wrong or {}
    try:
        messages = [{"role": "user", "content": env.reset(task)}]
        for i, c in enumerate(calls):
            for call, must_fail in ((wrong[i], True), (c, False)) if i in wrong else ((c, False),):
                text = env.harness.render([call])
                obs, done, info = env.step(text)
                messages.append({"role": "assistant", "content": text})
                if info.get("env_error"):
                    raise RuntimeError(f"coding_agent: the oracle episode of {task['id']} broke: {info['env_error']}")
                if must_fail and not info["failed_calls"]:
                    raise RuntimeError(f"coding_agent: the injected wrong call of {task['id']} did not fail")
                if done:
                    return messages
                messages.append({"role": info["obs_role"], "content": obs})
        return messages
    finally:
        env.close()


def oracle_messages(task: dict | str, harness_cfg=None, harnesses=None, perturb: bool = False,
                    rng: random.Random | None = None) -> list[dict]:
    """The oracle's episode as chat messages through `harness_cfg` (a HarnessConfig, a
    name, a dict entry, or None: the first train harness). `perturb`: one wrong call (a
    replace whose old text is not in the file, or a read of a missing file; `wrong_call`)
    and its error observation come before a random replace or read of the oracle's (`rng`),
    so that a teacher trained on these has seen how to recover from the state a
    student's mistake leads to."""
    task = json.loads(task) if isinstance(task, str) else task
    calls = oracle_calls(task)
    wrong = None
    if perturb:
        rng = rng or random.Random(0)
        at = rng.choice([i for i, c in enumerate(calls) if c.name in ("replace", "read_file")])
        wrong = {at: wrong_call(task, calls[at], rng)}
    return render_episode(task, calls, harness_cfg, harnesses, wrong=wrong)


COLUMNS = ("prompt", "completion", "domain", "task", "harness")


def _row(task: dict, cfg: HarnessConfig) -> dict:
    msgs = oracle_messages(task, cfg)
    return {"prompt": msgs[:1], "completion": msgs[1:], "domain": DOMAIN, "task": json.dumps(task),
            "harness": cfg.name}


def _dataset(rows: list[dict]) -> datasets.Dataset:
    return datasets.Dataset.from_dict({c: [r[c] for r in rows] for c in COLUMNS})


def make_dataset(split: str, n: int, seed: int = 0, difficulty: int = 1, effort: str | None = None, *,
                 n_bugs: int | None = None, n_files: int | None = None, harness: str | None = None,
                 harnesses: str | Path | None = None) -> datasets.Dataset:
    """Procedural tasks at `difficulty` (DIFFICULTIES: (bugs, files)), or set n_bugs /
    n_files. Columns: prompt, completion (the oracle's episode through `harness`, default
    the first train harness of `harnesses`), domain, task (JSON), harness (its name)."""
    if effort is not None:
        raise ValueError(f"coding_agent has no reasoning efforts; got effort={effort!r}")
    cfg = harness_config(harness, harnesses)
    return _dataset([_row(t, cfg) for t in make_tasks(split, n, seed, difficulty, n_bugs, n_files)])


def load_humaneval(harnesses: str | Path | None = None) -> datasets.Dataset:
    """HumanEval's 164 problems with injected bugs; each reference episode through the next
    harness of the mix (train and held-out in turn, so every call syntax is replayed)."""
    from experts.coding_agent.humaneval import humaneval_tasks

    mix = load_harnesses(str(harnesses or HARNESSES))
    cfgs = mix.harnesses + mix.held_out
    return _dataset([_row(t, cfgs[i % len(cfgs)]) for i, t in enumerate(humaneval_tasks())])


DATASETS: dict[str, Callable[[], datasets.Dataset]] = {"humaneval": load_humaneval}


# ------------------------------------------------------------------------ corrupt / pretrain

CORRUPTIONS = ("no_fix", "edit_tests", "empty_tests")


def corrupted_calls(task: dict, kind: str) -> list[ToolCall]:
    """Episodes that must score 0: submit the bug untouched; make the visible tests pass by
    rewriting them (then run them: they pass); empty the visible test file."""
    test = task["visible_tests"][0]
    if kind == "no_fix":
        return [ToolCall("submit", {})]
    if kind == "edit_tests":
        return [ToolCall("write_file", {"path": test, "content": "def test_ok():\n    assert True\n"}),
                ToolCall("submit", {})]
    if kind == "empty_tests":
        return [ToolCall("write_file", {"path": test, "content": ""}), ToolCall("submit", {})]
    raise ValueError(f"coding_agent: unknown corruption {kind!r}; expected one of {CORRUPTIONS}")


def corrupt(row: dict, reference, rng: random.Random) -> list[dict]:
    """A corrupted episode (CORRUPTIONS, drawn with `rng`) through the row's harness."""
    task = json.loads(row["task"]) if isinstance(row["task"], str) else row["task"]
    kind = rng.choice(CORRUPTIONS)
    return render_episode(task, corrupted_calls(task, kind), row.get("harness"), backend=_OracleBackend())[1:]


def pretrain_rows(n: int, seed: int = 0, harnesses: str | Path | None = None) -> datasets.Dataset:
    """Rows in the domain's format that do not solve it (domain="pretrain"), for the shared
    tiny base: a train harness's system prompt and a task (1 or 2 bugs), answered with the
    oracle's first call only, so the base learns the call syntaxes and the tool names,
    not which text to replace."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"coding_agent: n must be an int >= 0, got {n!r}")
    mix = load_harnesses(str(harnesses or HARNESSES))
    rng = random.Random(f"mopd/{DOMAIN}/pretrain/{seed}")
    prompts, completions = [], []
    from core.agent.harness import Harness
    from rewards.coding_agent import TOOLS

    for _ in range(n):
        task = make_task(rng, rng.choice((1, 2, 3)))
        h = Harness(mix.sample(rng), dict(TOOLS))
        prompts.append([{"role": "system", "content": h.system_prompt()}, {"role": "user", "content": task["user"]}])
        completions.append([{"role": "assistant", "content": h.render([oracle_calls(task)[0]])}])
    return datasets.Dataset.from_dict({"prompt": prompts, "completion": completions, "domain": ["pretrain"] * n})


# ------------------------------------------------------------------------ the expert's training

def _episode_env(harness_cfg: HarnessConfig, task: dict, cfg) -> CodingEnv:
    # rl.reward_kwargs.partial_credit: an episode's reward is the share of hidden assertions passed
    return make_env(harness_cfg, partial_credit=cfg.rl.reward_kwargs.get("partial_credit", False))


# experts/run.py's SFT and RL stages for this domain
TRAINER = AgentExpert(_episode_env, oracle_messages, DOMAIN)
