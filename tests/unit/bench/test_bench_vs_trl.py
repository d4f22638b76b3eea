"""bench/vs_trl.py at toy size with HF sampling: the TRL arm (DistillationTrainer) and the
mopd arms (1 and 3 teachers) run in their own processes and the JSON has step times,
tokens, peak memory and the ratios. No timing asserts (measured runs go to docs/results)."""
from __future__ import annotations

import json

import pytest

from bench import vs_trl as B


def test_bad_settings_are_named_before_any_model_loads(tmp_path, capsys):
    for argv, msg in ((["--steps", "2"], "--steps >= 3"), (["--teachers", "3"], "--teachers must include 1"),
                      (["--vocab", "100"], "--vocab >= 2048")):
        with pytest.raises(SystemExit):
            B.main(["--out", str(tmp_path / "o"), *argv])
        assert msg in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.ci
def test_trl_and_mopd_arms_run_and_report(tmp_path):
    out = tmp_path / "bench"
    assert B.main(["--out", str(out), "--hidden", "64", "--layers", "1", "--vocab", "2048", "--steps", "3",
                   "--prompts", "2", "--tokens", "4", "--repeats", "1", "--teachers", "1", "3",
                   "--sampler", "hf", "--padded-arm"]) == 0
    r = json.loads((out / "vs_trl.json").read_text())
    assert [x["arm"] for x in r["runs"]] == ["trl", "mopd", "mopd_padded", "mopd_3teachers"]
    for x in r["runs"]:
        assert len(x["step_s"]) == 2 and x["peak_mb"] > 100 and all(t > 0 for t in x["tokens"])
    s = r["summary"]
    assert s["ratios"]["tokens_per_s_mopd_over_trl"] == pytest.approx(s["mopd"]["tokens_per_s"] / s["trl"]["tokens_per_s"])
    assert "step_s_mopd_3teachers_over_mopd" in s["ratios"] and "tokens_per_s_mopd_padded_over_trl" in s["ratios"]
    assert s["mopd"]["update_s"] > 0 and s["mopd"]["sample_s"] > 0   # where the step's time goes
    assert "pack_completions: false" in (out / "runs" / "0_mopd_padded" / "run.yaml").read_text()
    # the 3-teacher run really routed its prompts to three teachers
    cfg = (out / "runs" / "0_mopd_3teachers" / "run.yaml").read_text()
    assert all(f"d{i}: {{path:" in cfg for i in range(3))
