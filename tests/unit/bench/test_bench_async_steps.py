"""bench/async_steps.py at toy size: both arms run through the real MOPD loop and the
JSON has their times, the overlap, token ages and the ratios. No timing asserts (the
measured run is docs/results/2026-12-02-async-steps.md)."""
from __future__ import annotations

import json

import pytest

from bench import async_steps as B

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bad_settings_are_named_before_any_model_loads(tmp_path, capsys):
    for argv, msg in ((["--steps", "2"], "--steps must be >= 3"), (["--hidden", "100"], "--hidden")):
        with pytest.raises(SystemExit):
            B.main(["--out", str(tmp_path / "o"), *argv])
        assert msg in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.ci
def test_both_arms_run_and_report(tmp_path):
    out = tmp_path / "bench"
    assert B.main(["--out", str(out), "--hidden", "64", "--layers", "1", "--steps", "3", "--prompts-per-step", "2",
                   "--max-new-tokens", "4", "--repeats", "1"]) == 0
    r = json.loads((out / "async_steps.json").read_text())
    assert [x["arm"] for x in r["runs"]] == ["sync", "async"]
    a = r["runs"][1]
    assert len(a["step_s"]) == 2 and a["token_age_mean"] == [1.0, 1.0]
    assert all(x > 0 for x in a["overlap_s"]) and "overlap_s" not in r["runs"][0]
    rat = r["summary"]["ratios"]
    assert rat["gain"] == pytest.approx(1 - rat["step_async_over_sync"])
    assert len(rat["step_async_over_sync_per_repeat"]) == 1
