"""The layer rule's own checks: the domain lookups that import-linter cannot see (importlib
by name) stay within the rule, and the README's test command runs lint-imports."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[3]
ORDER = ["bench", "pipeline", "evals", "experts", "mopd", "teachers", "rewards", "core"]


def _layers() -> list[str]:
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in cfg["contracts"] if c["type"] == "layers"]
    return contract["layers"]


def _layer_of(module: str) -> int:
    for i, name in enumerate(ORDER):
        if module == name or module.startswith(name + "."):
            return i
    return -1


def test_imports_by_name_point_down():
    """`importlib.import_module(f"pkg.{x}")` is invisible to import-linter: check the
    package named in each such f-string against the layer of the module calling it."""
    bad = []
    for pkg in ORDER:
        root = REPO / pkg.replace(".", "/")
        for path in root.rglob("*.py") if root.is_dir() else []:
            mod = ".".join(path.relative_to(REPO).with_suffix("").parts)
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module"
                        and node.args and isinstance(node.args[0], ast.JoinedStr)):
                    head = node.args[0].values[0]
                    target = head.value.rstrip(".") if isinstance(head, ast.Constant) else ""
                    if target and _layer_of(target) < _layer_of(mod):
                        bad.append(f"{mod} imports {target}.* by name")
    assert not bad, bad


def test_lint_imports_keeps_the_layers_contract():
    """The README's test command checks the layer rule too (CI also runs lint-imports first)."""
    import shutil
    import subprocess

    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "import-linter is not installed (pip install -e '.[dev]')"
    p = subprocess.run([exe, "--no-cache"], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
