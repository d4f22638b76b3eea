"""The docs cannot drift from the code: the config reference is generated from the
dataclasses' help text, and every config field has one."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _generator():
    spec = importlib.util.spec_from_file_location("config_reference", REPO / "scripts" / "config_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_config_reference_is_current():
    assert _generator().main(["--check"]) == 0, "run: python scripts/config_reference.py"


@pytest.mark.parametrize("section", range(4))
def test_every_config_field_has_help(section):
    from core.config import config_rows

    _, cls, where = _generator().SECTIONS[section]
    missing = [key for key, _, _, help_ in config_rows(cls) if not help_.strip()]
    assert not missing, f"{where}: fields without metadata['help']: {missing}"


def test_readme_is_a_short_guide_with_the_two_setup_commands_first():
    text = (REPO / "README.md").read_text()
    assert len(text) <= 9_000, f"README.md has {len(text)} characters; details belong in docs/"
    pipeline = "bash scripts/install.sh && .venv/bin/mopd pipeline --config recipes/pipeline/tiny.yaml --out runs/pipeline"
    tests = "bash scripts/install.sh && .venv/bin/python -m pytest -q"
    assert pipeline in text and tests in text
    assert text.index(pipeline) < 2500 and text.index(tests) < 3000


def test_results_live_in_docs_results_and_the_readme_links_them():
    readme = (REPO / "README.md").read_text()
    results = (REPO / "docs" / "results" / "README.md").read_text()
    assert "](docs/results/README.md)" in readme
    assert "| MOPD student |" not in readme and "| MOPD student |" in results   # the headline table moved
