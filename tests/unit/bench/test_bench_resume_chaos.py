"""`python -m bench.resume_chaos` stays alive: one uninterrupted run and one interrupted
and resumed run of 4 steps; the bench's own checks (bit-identical weights, no step redone
after SIGTERM/SIGINT, MLflow statuses) must all hold. The 20-interruption measurement is
the benchmark's business (docs/results/2026-12-01-resume-chaos.md)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.ci
def test_resume_chaos_runs_and_every_resume_is_bit_identical(tmp_path):
    p = subprocess.run([sys.executable, "-m", "bench.resume_chaos", "--out", str(tmp_path), "--n", "1",
                        "--steps", "4", "--seed", "3"], capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    res = json.loads((tmp_path / "resume_chaos.json").read_text())
    assert res["interrupted"] == 1 and res["with_problems"] == 0, res
    assert res["bit_identical"] == res["n"], res
