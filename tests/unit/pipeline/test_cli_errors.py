"""Errors that name the fix (issue 38): a mistyped override is blamed on the command line
with the nearest valid key, a model is named by its role, config errors come before the
heavy imports, and the Slurm script refuses a missing accelerate config itself. (The
parent-run case: tests/unit/mopd/test_tracking.py; every missing path at once:
tests/unit/mopd/test_validation.py.)"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import ConfigError, load_config
from mopd.distill.config import DistillConfig
from pipeline.cli import main as cli_main

REPO = Path(__file__).resolve().parents[3]
TOY = REPO / "recipes/mopd/toy.yaml"


@pytest.mark.parametrize("override, nearest, where", [
    ("train.max_step=3", "'max_steps'", "train: unknown key 'max_step'"),
    ("trian.max_steps=3", "'train'", "unknown key 'trian'"),
    ("rollout.by_domain={a: {temprature: 1}}", "'temperature'", "rollout.by_domain.a: unknown key 'temprature'"),
])
def test_a_mistyped_override_is_blamed_on_the_command_line_with_the_nearest_key(override, nearest, where):
    """It was '<recipe>: train: unknown key ...' with no hint: the file was blamed for
    the command line's typo."""
    with pytest.raises(ConfigError) as e:
        load_config(DistillConfig, TOY, [override])
    msg = str(e.value)
    assert msg.startswith(f"command-line override {override!r} (on top of {TOY}): {where}"), msg
    assert f"did you mean {nearest}?" in msg


def test_a_mistyped_key_in_the_file_is_still_the_files_with_the_nearest_key(tmp_path):
    cfg = tmp_path / "r.yaml"
    cfg.write_text(TOY.read_text() + "\ntrian: {}\n")
    with pytest.raises(ConfigError) as e:
        load_config(DistillConfig, cfg, ["train.max_steps=3"])
    assert str(e.value).startswith(f"{cfg}: unknown key 'trian' (did you mean 'train'?"), str(e.value)


def test_a_wrong_override_value_is_blamed_on_the_command_line():
    with pytest.raises(ConfigError, match=r"^command-line override 'train.lr=abc' .*train.lr: expected float"):
        load_config(DistillConfig, TOY, ["train.lr=abc"])


def test_eval_names_a_missing_model_by_its_role(tmp_path, capsys):
    """`mopd eval --models student=/nonexistent` said "teacher checkpoint"."""
    rc = cli_main(["eval", "--models", f"student={tmp_path / 'nonexistent'}", "--domains", "math",
                   "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"--models student: checkpoint '{tmp_path / 'nonexistent'}' does not exist" in err, err
    assert "teacher checkpoint" not in err


HEAVY = ("torch", "transformers", "vllm", "accelerate", "mlflow", "datasets", "trl")


@pytest.mark.parametrize("argv", [
    ["distill", "--config", str(TOY), "--out", "{tmp}/d", "train.max_step=3"],
    ["pipeline", "--config", str(REPO / "recipes/pipeline/tiny.yaml"), "--out", "{tmp}/p", "domainz=[math]"],
    ["toy", "--out", "{tmp}/t", "train.max_step=3"],
])
@pytest.mark.subprocess
def test_config_errors_come_before_the_heavy_imports(tmp_path, argv):
    """A config error took ~6 s, the time torch and the loop take to import: the config
    is now loaded first, from modules that import none of them. Checked by what the
    process imported (not by seconds): a fresh interpreter, as `mopd` runs."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code = ("import sys; from pipeline.cli import main; rc = main(sys.argv[1:]); "
            f"print('HEAVY', [m for m in {HEAVY!r} if m in sys.modules]); sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=REPO, env=env)
    assert p.returncode == 2, p.stderr
    assert "did you mean" in p.stderr, p.stderr
    assert "HEAVY []" in p.stdout, p.stdout
    assert not any((tmp_path / d).exists() for d in "dpt")     # nothing written


@pytest.mark.subprocess
def test_the_slurm_script_refuses_a_missing_accelerate_config(tmp_path):
    """A missing accelerate config ended in accelerate's own traceback on every trainer
    node; the script now refuses it before any node starts, naming the variable."""
    env = {**os.environ, "RECIPE": str(TOY), "OUT": str(tmp_path), "ACCELERATE_CONFIG": "recipes/accelerate/nope.yaml"}
    p = subprocess.run(["bash", "recipes/slurm/mopd_multinode.sbatch"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "ACCELERATE_CONFIG=recipes/accelerate/nope.yaml: no such file" in p.stderr, p.stderr
    assert "recipes/accelerate/cpu.yaml" in p.stderr
