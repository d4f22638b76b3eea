"""`python -m bench.server_teachers` stays alive: one round of 3 steps with HF teachers and
with server teachers (the fake vLLM server under `mopd teachers serve`); the two runs
score the same and the servers are gone afterwards. The step-time ratio is the
benchmark's business (docs/results/2026-12-02-server-teachers.md)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.ci
def test_server_teachers_bench_runs_and_scores_match(tmp_path):
    p = subprocess.run([sys.executable, "-m", "bench.server_teachers", "--out", str(tmp_path), "--steps", "3",
                        "--rounds", "1", "--prompts", "4"], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    res = json.loads((tmp_path / "server_teachers.json").read_text())
    assert res["max_abs_reverse_kl_diff"] < 1e-3, res
    assert res["processes_left"] == 0 and res["serve_rc"] == 0
    assert len(res["runs"]["hf"][0]["step_s"]) == 2 and res["step_ratio_server_over_hf"] > 0
