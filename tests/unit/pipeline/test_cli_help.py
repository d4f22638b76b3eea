"""The documented `--help-config` commands (README) keep answering, without a config,
an --out, or any model (in-process: `pipeline.cli.main`, from an empty folder)."""
from __future__ import annotations

import pytest
from conftest import mopd_in_process


@pytest.mark.parametrize("command, key", [("distill", "train.lr"), ("pipeline", "mopd.n_prompts")])
def test_help_config_lists_every_key(command, key, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = mopd_in_process([command, "--help-config"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert key in p.stdout
    assert not any(tmp_path.iterdir()), "a help command wrote something"
