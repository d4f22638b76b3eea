"""The documented `--help-config` commands (README) keep answering, without a config,
an --out, or any model."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("command, key", [("distill", "train.lr"), ("pipeline", "mopd.n_prompts")])
def test_help_config_lists_every_key(command, key, tmp_path):
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", command, "--help-config"], capture_output=True,
                       text=True, cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr[-2000:]
    assert key in p.stdout
    assert not any(tmp_path.iterdir()), "a help command wrote something"
