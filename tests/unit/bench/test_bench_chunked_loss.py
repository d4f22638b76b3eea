"""bench/chunked_loss.py at a small size (slow tier: two subprocesses)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def bench(tmp_path: Path, *args: str) -> dict:
    """`python -m bench.chunked_loss ARGS --out F` in a fresh process; F's JSON."""
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, "-m", "bench.chunked_loss", *args, "--out", str(out)], check=True, cwd=REPO,
                   capture_output=True, timeout=900)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_chunked_loss_bench_runs_small(tmp_path):
    """Equal losses and gradients, and less memory with the chunks."""
    r = bench(tmp_path, "--vocab", "32000", "--batch", "2", "--length", "256", "--chunk", "64")
    assert r["max_loss_diff"] <= 1e-5 and r["max_grad_diff"] <= 1e-5
    assert r["chunked"]["peak_mb"] < r["unchunked"]["peak_mb"]


@pytest.mark.slow
def test_recomputed_layers_bench_runs_small(tmp_path):
    """Gradient checkpointing: the same loss and gradients, a lower peak with 4 layers."""
    r = bench(tmp_path, "--vocab", "2048", "--hidden", "128", "--layers", "4", "--batch", "2", "--length", "256",
              "--chunk", "64", "--variants", "chunked", "recomputed")
    assert r["max_loss_diff"] <= 1e-5 and r["max_grad_diff"] <= 1e-5
    assert r["recomputed"]["peak_mb"] < r["chunked"]["peak_mb"]


@pytest.mark.slow
def test_chunked_loss_bench_with_an_hf_teacher(tmp_path):
    """--teacher model: the teacher's side inside the measured step, still equal and lower."""
    r = bench(tmp_path, "--vocab", "32000", "--batch", "2", "--length", "256", "--chunk", "64", "--teacher", "model")
    assert r["teacher"] == "model" and r["max_loss_diff"] <= 1e-5 and r["max_grad_diff"] <= 1e-5
    assert r["chunked"]["peak_mb"] < r["unchunked"]["peak_mb"] / 2
