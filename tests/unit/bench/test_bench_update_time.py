"""bench/update_time.py at toy size: both paths run, alternating, and the JSON has their CPU
seconds and the ratio (no timing asserts: measured runs go to docs/results)."""
from __future__ import annotations

import json

import pytest

from bench import update_time


@pytest.mark.ci
def test_update_time_bench_runs_both_paths(tmp_path):
    out = tmp_path / "u.json"
    update_time.main(["--hidden", "64", "--layers", "1", "--vocab", "2048", "--batch", "2", "--length", "4",
                      "--repeats", "2", "--out", str(out)])
    r = json.loads(out.read_text())
    assert [len(r["cpu_s"][k]) for k in ("packed", "padded")] == [2, 2]
    assert r["packed_over_padded"] == pytest.approx(r["median_cpu_s"]["packed"] / r["median_cpu_s"]["padded"])
