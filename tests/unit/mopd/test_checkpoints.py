"""Checkpoints verified on load: a manifest (sizes, sha256) written last; a damaged latest
checkpoint is named and the previous good one used; the settings a checkpoint belongs to."""
from __future__ import annotations

from pathlib import Path

import pytest

from mopd.distill.checkpoints import (CheckpointError, check_checkpoint, latest_checkpoint, load_checkpoint,
                                      settings_diff, settings_hash, training_settings, write_manifest)


def _fake_ckpt(out: Path, step: int) -> Path:
    c = out / "checkpoints" / f"step_{step}"
    (c / "state").mkdir(parents=True)
    (c / "model").mkdir()
    (c / "model" / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    (c / "state" / "optimizer.bin").write_bytes(b"x" * 5000)
    (c / "trainer_state.json").write_text(f'{{"step": {step}}}')
    (c / "DONE").write_text("ok")
    write_manifest(c)
    return c


@pytest.mark.parametrize("damage", ["truncate_model", "truncate_optimizer", "flip_bytes", "missing_file",
                                    "no_manifest"])
def test_damaged_latest_checkpoint_is_named_and_the_previous_good_one_used(tmp_path, capsys, damage):
    _fake_ckpt(tmp_path, 2)
    last = _fake_ckpt(tmp_path, 4)
    f = last / ("state/optimizer.bin" if damage == "truncate_optimizer" else "model/model.safetensors")
    if damage.startswith("truncate"):
        f.write_bytes(f.read_bytes()[:1000])
    elif damage == "flip_bytes":
        f.write_bytes(b"\0" * f.stat().st_size)
    elif damage == "missing_file":
        f.unlink()
    else:   # killed between the files and the manifest (and the DONE marker)
        (last / "MANIFEST.json").unlink()
        (last / "DONE").unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_2"
    err = capsys.readouterr().err
    assert str(last) in err and "damaged" in err
    if damage != "no_manifest":
        assert str(f) in err
    assert check_checkpoint(last) is not None


def test_good_checkpoints_verify(tmp_path):
    c = _fake_ckpt(tmp_path, 3)
    assert check_checkpoint(c) is None
    assert latest_checkpoint(tmp_path) == c


def test_loading_a_damaged_checkpoint_names_it(tmp_path):
    c = _fake_ckpt(tmp_path, 3)
    (c / "state" / "optimizer.bin").write_bytes(b"short")
    with pytest.raises(CheckpointError, match=str(c)):
        load_checkpoint(None, c)


def test_training_settings_ignore_tracking_and_saving_and_max_steps_only_when_constant():
    flat = {"train.lr": 1e-3, "train.max_steps": 10, "train.lr_schedule": "constant", "train.resume": True,
            "train.accept_config_change": False, "train.save_every": 2, "train.keep_checkpoints": 2,
            "mlflow.tracking_uri": "sqlite:///a.db", "mlflow.run_name": "x"}
    s = training_settings(flat)
    assert s == {"train.lr": 1e-3, "train.lr_schedule": "constant"}
    cos = training_settings({**flat, "train.lr_schedule": "cosine"})
    assert cos["train.max_steps"] == 10      # the decay depends on it
    moved = training_settings({**flat, "mlflow.tracking_uri": "http://server", "train.max_steps": 99,
                               "train.save_every": 5})
    assert settings_hash(moved) == settings_hash(s)
    changed = training_settings({**flat, "train.lr": 3e-3})
    assert settings_hash(changed) != settings_hash(s)
    assert settings_diff(s, changed) == {"train.lr": (1e-3, 3e-3)}
