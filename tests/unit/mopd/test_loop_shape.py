"""The loop's package stays readable (issue 34): no function in mopd/distill/ over 60
lines, and the trainer's steps are named methods."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[3] / "mopd" / "distill"
MAX_LINES = 60
# functions allowed over the limit for now (none)
PENDING: set[str] = set()


def _functions():
    for path in sorted(PKG.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{path.name}:{node.name}", node.end_lineno - node.lineno + 1


def test_no_function_in_the_loop_package_is_over_60_lines():
    long = {name: n for name, n in _functions() if n > MAX_LINES and name not in PENDING}
    assert not long, f"functions over {MAX_LINES} lines in mopd/distill: {long}"


def test_the_trainer_names_its_steps():
    from mopd.distill.trainer import MOPDTrainer

    for step in ("sample", "score", "update", "log", "save", "sync", "stop", "train_sync", "train_async"):
        assert callable(getattr(MOPDTrainer, step, None)), step
