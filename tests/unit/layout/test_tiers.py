"""The test tiers (pyproject.toml, .ci/run): `pytest -q` is the fast tier; .ci/run runs it,
then a second pytest call for the rest. Every test that is not `slow` runs in exactly one
of the two, whatever markers it carries: checked on the marker expressions themselves, so
no test loses its place in CI when the tiers change."""
from __future__ import annotations

import itertools
import re
import shlex
import tomllib
from pathlib import Path

from _pytest.mark.expression import Expression

REPO = Path(__file__).resolve().parents[3]


def _ini() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]


def _marker_expr(args: list[str]) -> str | None:
    """The last -m's expression in a pytest argument list (a later -m replaces an earlier one)."""
    expr = None
    for a, b in zip(args, args[1:] + [""]):
        if a == "-m":
            expr = b
    return expr


def _ci_pytest_calls() -> list[list[str]]:
    calls = []
    for line in (REPO / ".ci" / "run").read_text().splitlines():
        line = line.split(" #", 1)[0].strip()
        if re.search(r"-m pytest\b", line):
            calls.append(shlex.split(line.split("-m pytest", 1)[1]))
    return calls


def test_every_test_outside_slow_runs_in_exactly_one_ci_tier():
    ini = _ini()
    default = _marker_expr(shlex.split(ini["addopts"]))
    calls = _ci_pytest_calls()
    assert len(calls) == 2 and calls[0] == ["-q"], f".ci/run: the fast tier (`pytest -q`), then the rest: {calls}"
    tiers = [Expression.compile(default), Expression.compile(_marker_expr(calls[1]) or default)]
    names = sorted({m.split(":")[0].strip() for m in ini["markers"]})
    assert {"slow", "server", "ci", "vllm"} <= set(names)
    for n in range(len(names) + 1):
        for marks in itertools.combinations(names, n):
            hits = [t.evaluate(lambda name, **kw: name in marks) for t in tiers]
            if "slow" in marks:
                assert not hits[0], f"the fast tier runs a slow test (markers {marks})"
            else:
                assert sum(hits) == 1, f"a test with markers {marks} runs in {sum(hits)} CI tiers, not 1"


def test_the_fast_tier_leaves_out_real_servers_and_the_second_tier_and_prints_durations():
    ini = _ini()
    fast = Expression.compile(_marker_expr(shlex.split(ini["addopts"])))
    for m in ("server", "ci", "slow"):
        assert not fast.evaluate(lambda name, **kw: name == m), m
    assert fast.evaluate(lambda name, **kw: name == "vllm")     # in-process engines stay in the fast tier
    assert "--durations=15" in shlex.split(ini["addopts"])
