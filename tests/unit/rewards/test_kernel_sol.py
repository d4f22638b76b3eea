"""rewards/kernel.py against the speed of light (issue 45): the score rises from the floor at
the reference to 1.0 at the task's speed of light, with no cap at the expert; a time below
the speed of light is a named cheat scoring 0; the peaks are measured once per machine and
cached; a kernel row without its `sol` sizes is an error before any model loads.

All with synthetic harness results (deterministic, no wall-clock assertion) except the
ci-tier test that runs the calibration itself."""
from __future__ import annotations

import json
import logging
import math
import random
import sys
import types

import pytest

import rewards.kernel as K
from experts.kernel import data
from rewards.kernel import FLOOR, SOL_CHEAT, SOL_MARGIN, Peaks, judge, score_kernels

PEAKS = Peaks(bytes_per_s=4e10, flops_per_s=1e11, key="test", source="given")
T_REF = 1000.0                 # us per reference call (synthetic)
SOL = {"bytes": 40_000, "flops": 10_000}   # bandwidth-bound: 1 us at 4e10 B/s
R_EXPERT = 20.0


def _result(r: float) -> dict:
    """A harness result of a correct kernel with speed-up r over the reference."""
    return {"reason": "ok", "detail": "", "r": r, "r_expert": R_EXPERT, "t_ref_us": T_REF,
            "t_exp_us": T_REF / R_EXPERT, "t_cand_us": T_REF / r}


def _assert_ordering():
    ref, exp, fast, faster = (judge(_result(r), SOL, PEAKS) for r in (1.0, R_EXPERT, 3 * R_EXPERT, 10 * R_EXPERT))
    assert ref["score"] == pytest.approx(FLOOR)
    assert FLOOR < exp["score"] < fast["score"] < faster["score"] < 1.0, (exp, fast, faster)


def test_reference_expert_faster_candidate_order_below_one():
    _assert_ordering()
    exp = judge(_result(R_EXPERT), SOL, PEAKS)
    # the speed of light: 1 us, r_sol = 1000; the expert at 2 % of it, reported, not a cap
    assert exp["sol_us"] == pytest.approx(1.0) and exp["r_sol"] == pytest.approx(1000.0)
    assert exp["frac_sol_expert"] == pytest.approx(R_EXPERT / 1000.0) == exp["frac_sol"]
    # the curve: log-linear between the dead bands, 1.0 within the noise band of the speed of light
    lo = math.log1p(K.NOISE_BAND)
    u = (math.log(R_EXPERT) - lo) / (math.log(1000.0) - 2 * lo)
    assert exp["score"] == pytest.approx(FLOOR + (1 - FLOOR) * u)
    assert judge(_result(1000.0 / 1.4), SOL, PEAKS)["score"] == 1.0
    assert judge(_result(1000.0), SOL, PEAKS)["score"] == 1.0
    assert judge(_result(0.25), SOL, PEAKS)["score"] < FLOOR   # correct but slower than the reference


def test_the_test_fails_if_the_cap_at_the_expert_comes_back(monkeypatch):
    """Mutation check: with the old curve (1.0 at the expert's speed and above) the
    ordering test above fails."""
    orig = K.score_of_speed
    monkeypatch.setattr(K, "score_of_speed", lambda r, r_sol, **kw: orig(min(r, R_EXPERT), R_EXPERT, **kw))
    with pytest.raises(AssertionError):
        _assert_ordering()


def test_below_the_speed_of_light_is_a_named_cheat_scoring_zero():
    near = judge(_result(1000.0 * SOL_MARGIN * 0.95), SOL, PEAKS)     # within the margin: the physical limit
    assert near["reason"] == "ok" and near["score"] == 1.0
    fake = judge(_result(1000.0 * SOL_MARGIN * 1.5), SOL, PEAKS)      # a lookup table: 3x faster than possible
    assert (fake["reason"], fake["score"]) == (SOL_CHEAT, 0.0) and SOL_CHEAT in K.CHEATS
    assert "speed of light" in fake["detail"]
    # the harness's own cheats score 0 too, named; a wrong kernel stays 0
    assert judge({"reason": "cached_output", "detail": "timed"}, SOL, PEAKS)["score"] == K.CHEAT_SCORE == 0.0
    assert judge({"reason": "mismatch", "detail": ""}, SOL, PEAKS)["score"] == 0.0


def test_an_expert_below_the_speed_of_light_is_a_broken_task_not_a_score():
    bad = dict(_result(10.0), r_expert=1000.0 * SOL_MARGIN * 2)
    with pytest.raises(RuntimeError, match="spec.sol is too large or the peaks are stale"):
        judge(bad, SOL, PEAKS)


def _row(family: str) -> dict:
    return data._row(data.draw_task(random.Random(0), 1, families=(data.FAMILY[family],)))


def test_score_kernels_scores_and_names_through_the_reward_path(monkeypatch, caplog):
    """The reward's own path (columns, sol check, judge, log) with the sandbox's results
    replaced by synthetic ones."""
    row = _row("softmax")
    sol_us = PEAKS.sol_us(json.loads(row["spec"])["sol"])
    t_ref = 2000 * sol_us
    results = [{"reason": "ok", "detail": "", "r": r, "r_expert": 20.0, "t_ref_us": t_ref, "t_exp_us": t_ref / 20,
                "t_cand_us": t_ref / r} for r in (1.0, 20.0, 60.0, 2000 * SOL_MARGIN * 2)]
    monkeypatch.setattr(K, "run_jobs", lambda jobs, **kw: [dict(r) for r in results[:len(jobs)]])
    monkeypatch.setattr(K, "check_isolation", lambda isolation: isolation or "none")
    comps = ["```python\ndef kernel(x):\n    return x\n```"] * 4
    with caplog.at_level(logging.WARNING, logger="rewards.kernel"):
        got = score_kernels(None, comps, **{c: [row[c]] * 4 for c in ("reference", "expert", "spec", "domain")},
                            peaks="4e10,1e11")
    s = [g["score"] for g in got]
    assert s[0] == pytest.approx(FLOOR) and FLOOR < s[1] < s[2] < 1.0 and s[3] == 0.0, got
    assert got[3]["reason"] == SOL_CHEAT and any(SOL_CHEAT in m for m in caplog.messages)
    assert got[1]["frac_sol_expert"] == pytest.approx(20 / 2000)


def _fake_harness(monkeypatch, results):
    monkeypatch.setattr(K, "run_jobs", lambda jobs, **kw: [dict(r) for r in results[:len(jobs)]])
    monkeypatch.setattr(K, "check_isolation", lambda isolation: isolation or "none")


def test_every_cheat_scores_zero_and_is_named_through_reward(monkeypatch, caplog):
    """Issue 45: "a candidate that returns cached outputs scores zero and is named", and so
    does every other cheat the harness names (they scored -1 before): through `reward`,
    the function users call, with the harness's verdicts given."""
    row = _row("softmax")
    results = [{"reason": kind, "detail": f"synthetic {kind}"} for kind in K.CHEATS if kind != SOL_CHEAT]
    sol_us = PEAKS.sol_us(json.loads(row["spec"])["sol"])
    results.append({"reason": "ok", "detail": "", "r": 8000.0, "r_expert": 20.0, "t_ref_us": 2000 * sol_us,
                    "t_exp_us": 100 * sol_us, "t_cand_us": sol_us / 4})      # a lookup table: 4x past the limit
    _fake_harness(monkeypatch, results)
    n = len(results)
    comps = ["```python\ndef kernel(x):\n    return x\n```"] * n
    with caplog.at_level(logging.WARNING, logger="rewards.kernel"):
        scores = K.reward(None, comps, **{c: [row[c]] * n for c in ("reference", "expert", "spec", "domain")},
                          peaks="4e10,1e11")
    assert scores == [0.0] * n, scores
    for i, kind in enumerate(K.CHEATS):
        assert any(m.startswith(f"rewards.kernel: row {i} cheats: {kind} ") for m in caplog.messages), kind
    assert "cached_output" in K.CHEATS and data.cheat_completion(row, "cached_output")


def test_a_candidate_faster_than_the_expert_scores_more_through_reward(monkeypatch):
    """The sizes measured in docs/results/2026-12-05-kernel-speed-of-light.md: experts at
    1-5 % of the speed of light, candidates 1.1-3x faster than them. Each candidate scores
    above its expert and below 1.0, the reference the floor; through `reward`."""
    row = _row("softmax")
    sol_us = PEAKS.sol_us(json.loads(row["spec"])["sol"])
    t_ref = 500 * sol_us
    for frac_exp in (0.01, 0.03, 0.05):
        r_exp = frac_exp * 500
        rs = [1.0, r_exp, 1.1 * r_exp, 1.5 * r_exp, 3.0 * r_exp]
        _fake_harness(monkeypatch, [{"reason": "ok", "detail": "", "r": r, "r_expert": r_exp, "t_ref_us": t_ref,
                                     "t_exp_us": t_ref / r_exp, "t_cand_us": t_ref / r} for r in rs])
        s = K.reward(None, ["```python\ndef kernel(x):\n    return x\n```"] * len(rs),
                     **{c: [row[c]] * len(rs) for c in ("reference", "expert", "spec", "domain")}, peaks="4e10,1e11")
        assert s[0] == pytest.approx(FLOOR) and FLOOR < s[1] < s[2] < s[3] < s[4] < 1.0, (frac_exp, s)


def test_sol_sizes_per_task():
    t = dict(R=64, C=128)
    sol = lambda fam, params=(), **shape: data.Task(fam, tuple(params), tuple((r, r) for r in data.FAMILY[fam].roles),
                                                    tuple((shape or t).items())).sol()
    n = 64 * 128
    assert sol("softmax") == {"bytes": 2 * 4 * n, "flops": 5 * n}
    assert sol("layer_norm", [("eps", "1e-5")]) == {"bytes": 4 * (2 * n + 2 * 128), "flops": 7 * n}
    assert sol("bias_act", [("act", "silu")]) == {"bytes": 4 * (2 * n + 128), "flops": 4 * n}
    assert sol("residual_rms", [("eps", "1e-5")]) == {"bytes": 4 * (3 * n + 128), "flops": 5 * n}
    assert sol("segment_sum", [("k", "5")], R=64, C=128, K=5) == {"bytes": 4 * n + 8 * 64 + 4 * 5 * 128, "flops": n}
    assert sol("pairwise", [("p", "2")], R=64, M=32, D=16) == {"bytes": 4 * (64 * 16 + 32 * 16 + 64 * 32),
                                                                "flops": 3 * 64 * 32 * 16}
    causal = sol("attention", [("causal", "True")], B=2, N=16, D=8)
    assert causal == {"bytes": 4 * 4 * 2 * 16 * 8, "flops": 2 * (16 * 17 // 2) * (4 * 8 + 3)}
    # roofline: the slower of moving the bytes and doing the FLOPs
    assert PEAKS.sol_us({"bytes": 4e4, "flops": 1e3}) == pytest.approx(1.0)
    assert PEAKS.sol_us({"bytes": 1e3, "flops": 3e5}) == pytest.approx(3.0)
    for r in data.make_dataset("train", 40, difficulty=3):
        assert K.sol_problem(r["spec"]) is None


def test_machine_peaks_are_measured_once_and_cached(tmp_path, monkeypatch):
    calls = []

    def fake_calibrate(isolation, trials=K.CALIBRATION_TRIALS):
        calls.append(isolation)
        return {"bytes_per_s": 3e10 + len(calls), "flops_per_s": 9e10, "bandwidth_from": "copy of 128 KiB"}

    monkeypatch.setattr(K, "calibrate", fake_calibrate)
    monkeypatch.setattr(K, "check_isolation", lambda isolation: isolation or "none")
    monkeypatch.setattr(K, "_PEAKS", {})
    cache = tmp_path / "peaks.json"
    p = K.machine_peaks(cache=cache)
    assert (p.source, p.bytes_per_s, len(calls)) == ("measured", 3e10 + 1, 1)
    table = json.loads(cache.read_text())
    assert table[p.key]["bytes_per_s"] == 3e10 + 1 and "threads=1" in p.key and "cpus=" in p.key
    monkeypatch.setattr(K, "_PEAKS", {})                  # a new process: read from the file
    q = K.machine_peaks(cache=cache)
    assert (q.source, q.bytes_per_s, len(calls)) == (str(cache), 3e10 + 1, 1)
    monkeypatch.setattr(K, "machine_key", lambda isolation: "another machine")
    assert K.machine_peaks(cache=cache).source == "measured" and len(calls) == 2
    assert set(json.loads(cache.read_text())) == {p.key, "another machine"}
    cache.write_text("{not json")                         # unreadable: measured again, rewritten
    monkeypatch.setattr(K, "_PEAKS", {})
    assert K.machine_peaks(cache=cache).source == "measured" and len(calls) == 3
    assert json.loads(cache.read_text())["another machine"]["bytes_per_s"] == 3e10 + 3
    # $MOPD_CACHE_DIR picks the default file
    monkeypatch.setenv("MOPD_CACHE_DIR", str(tmp_path / "c"))
    assert K.peaks_cache() == tmp_path / "c" / "kernel_peaks.json"


def test_peaks_are_recorded_in_the_active_mlflow_run(monkeypatch):
    logged = []
    run = types.SimpleNamespace(info=types.SimpleNamespace(run_id="r1"))
    fake = types.SimpleNamespace(active_run=lambda: run, log_params=logged.append)
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    monkeypatch.setattr(K, "_RECORDED", set())
    K.record_peaks(PEAKS)
    K.record_peaks(PEAKS)                                 # once per run
    assert logged == [{"kernel.peak_bytes_per_s": "4e+10", "kernel.peak_flops_per_s": "1e+11",
                       "kernel.peaks_machine": "test", "kernel.peaks_source": "given"}]


def test_a_kernel_row_without_its_sol_sizes_is_an_error_naming_the_fix(tmp_path):
    from experts.files import load_rows

    row = _row("softmax")
    spec = json.loads(row["spec"])
    del spec["sol"]
    problem = K.sol_problem(spec)
    assert "spec has no 'sol'" in problem and '"sol": {"bytes"' in problem and "Task.sol" in problem
    assert "not both 0" in K.sol_problem({"sol": {"bytes": 0, "flops": 0}})
    assert "spec.sol must be" in K.sol_problem({"sol": {"bytes": "many", "flops": 1}})
    # a team's file: named with its row before any model loads (the pipeline's check_rows, mopd expert)
    f = tmp_path / "train.jsonl"
    good = {c: row[c] for c in ("prompt", "reference", "expert", "spec", "task")}
    f.write_text(json.dumps(good) + "\n" + json.dumps({**good, "spec": json.dumps(spec)}) + "\n")
    with pytest.raises(ValueError, match=r"data.files.train .*row 2: spec has no 'sol'"):
        load_rows({"train": str(f)}, {}, "train", domain="kernel", effort=None, stage="rl",
                  data_module=data, n=None)
    # the reward itself, before any sandbox starts
    with pytest.raises(ValueError, match="row 0: spec has no 'sol'"):
        score_kernels(None, ["```python\ndef kernel(x):\n    return x\n```"], reference=[row["reference"]],
                      expert=[row["expert"]], spec=[json.dumps(spec)], domain=["kernel"])
    with pytest.raises(ValueError, match="peaks='fast' must be 'BYTES_PER_S,FLOPS_PER_S'"):
        K.reward.preflight(peaks="fast")


@pytest.mark.ci   # second tier: runs the calibration in the sandbox (~3-30 s on a busy machine)
def test_calibration_measures_plausible_peaks():
    got = K.calibrate(K.check_isolation(None), trials=2)
    assert 1e8 < got["bytes_per_s"] < 1e13 and 1e8 < got["flops_per_s"] < 1e14, got
    assert got["threads"] == 1
