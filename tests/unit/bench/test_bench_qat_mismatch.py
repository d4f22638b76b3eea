"""`python -m bench.qat_mismatch` stays alive: a tiny run (8 prompts, 8 tokens, 5 SFT
steps) writes its JSON with the three settings measured. The targets themselves are the
benchmark's business (docs/quantization.md), not this test's."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.ci
@pytest.mark.vllm
def test_qat_mismatch_runs_and_writes_its_json(tmp_path):
    pytest.importorskip("vllm")
    p = subprocess.run([sys.executable, "-m", "bench.qat_mismatch", "--out", str(tmp_path), "--prompts", "8",
                        "--max-new-tokens", "8", "--sft-steps", "5", "--group-size", "64"],
                       capture_output=True, text=True, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "qat_mismatch.json").read_text())
    for key in ("bf16_floor", "qat_identical", "sampler_only_quant"):
        assert res[key] >= 0.0, key
    assert res["n_sequences"] == 8 and res["n_tokens"] > 0
    # the sampler got exactly the trainer's weights, with and without QAT
    assert all(res["sampler_weights_bit_equal"].values()), res["sampler_weights_bit_equal"]
