"""`python -m bench.lora_teachers` stays alive on its HF path (peft multi-adapter vs merged
models vs one teacher, tiny sizes): the LoRA scores equal the merged ones, the adapters
do change the scores, and every mode reports a peak memory and step times. The vLLM
numbers are the benchmark's business (docs/results/2026-12-02-lora-teachers.md)."""
from __future__ import annotations

import json

import pytest


@pytest.mark.ci
def test_lora_teachers_bench_hf_runs_and_scores_match(tmp_path):
    # in this process: a fresh interpreter per mode (the bench's default, for isolated peak
    # memory) costs three torch imports, too slow for a unit test
    from bench.lora_teachers import main

    assert main(["--out", str(tmp_path), "--backend", "hf", "--adapters", "2", "--rows", "4", "--repeats", "1",
                 "--hidden", "128", "--layers", "1", "--in-process"]) == 0
    res = json.loads((tmp_path / "lora_teachers.json").read_text())
    assert res["max_abs_logprob_diff_lora_vs_merged"] < 1e-4, res
    assert res["max_abs_logprob_diff_lora_vs_one"] > 1e-3, res
    assert res["scored_tokens"] > 0
    for m in ("lora", "merged", "one"):
        assert res["peak_rss_mib"][m] >= res["rss_after_imports_mib"][m] > 0
        assert len(res["step_ms_all"][m]) == 1 and res["step_ms_median"][m] > 0
        assert len(res["interleaved_step_ms_all"][m]) == 1
