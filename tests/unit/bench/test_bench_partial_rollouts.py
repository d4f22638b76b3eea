"""bench/partial_rollouts.py at toy size (HF sampler, one seed, three steps): both arms
run through the real MOPD loop, the JSON and the table have their fields, the partial arm
carries episodes over; the long-tail environment's tasks and reward. No timing asserts
(the measured run is docs/results/2026-12-02-partial-rollouts-bench.md)."""
from __future__ import annotations

import json

import pytest

from bench import partial_rollouts as B

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_long_tail_tasks_and_the_phrase_reward():
    ts = B.tasks(16, 0, 8, 10)
    assert [t["turns"] for t in ts].count(10) == 2 and [t["turns"] for t in ts].count(1) == 14
    assert B.phrase_score(" ".join(B.PHRASE)) == 1.0
    assert B.phrase_score(" ".join(B.PHRASE[:4]) + " x") == 0.5
    assert B.phrase_score("beta alpha") == 0.0   # words out of place score nothing
    be = B.LongTailBackend()
    be.reset({"id": "t", "turns": 2})
    assert be.end_turn(" ".join(B.PHRASE)) is not None and be.end_turn("nothing") is None
    assert be.finish("") == {"success": False, "reward": 0.5}


def test_bad_settings_are_named_before_any_model_loads(tmp_path, capsys):
    for argv, msg in ((["--steps", "2"], "--steps must be >= 3"), (["--min-finished", "0"], "--min-finished"),
                      (["--n-eval", "0"], "--n-eval must be >= 1")):
        with pytest.raises(SystemExit):
            B.main(["--out", str(tmp_path / "o"), *argv])
        assert msg in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.ci
def test_both_arms_run_and_report(tmp_path):
    out = tmp_path / "bench"
    assert B.main(["--out", str(out), "--backend", "hf", "--seeds", "0", "--steps", "3", "--prompts-per-step", "4",
                   "--long-every", "2", "--long-turns", "3", "--max-new-tokens", "6", "--teacher-sft", "2",
                   "--student-sft", "1", "--n-eval", "2"]) == 0
    res = json.loads((out / "partial_rollouts.json").read_text())
    assert [(r["seed"], r["arm"]) for r in res["runs"]] == [(0, "wait"), (0, "partial")]
    for r in res["runs"]:
        assert r["steps"] == 3 and len(r["step_s"]) == 2   # step 1 is not timed
        for k in ("step_s_mean", "step_s_median", "sample_s_mean", "score", "score_greedy", "final_reverse_kl"):
            assert isinstance(r[k], float), k
        assert 0.0 <= r["score"] <= 1.0 and 0.0 <= r["score_greedy"] <= 1.0
    wait, part = res["runs"]
    assert wait["carried_over_mean"] is None and wait["token_age_mean"] is None   # partial off: no such metrics
    # min_finished 0.5 with half the tasks three turns long: episodes were carried over
    assert part["carried_over_max"] > 0 and part["token_age_mean"] is not None
    assert sum(v for v in part["token_age"].values()) == pytest.approx(1.0)
    s = res["summary"]
    assert s["step_time_ratio_mean"] == pytest.approx(part["step_s_mean"] / wait["step_s_mean"])
    assert s["score_diff_per_seed"] == [pytest.approx(part["score"] - wait["score"])]
    assert res["settings"]["min_finished"] == 0.5 and "start_score" in res and "teacher_score" in res
    table = (out / "partial_rollouts.md").read_text()
    assert "| 0 | wait |" in table and "| 0 | partial |" in table and "Step time partial / wait" in table
