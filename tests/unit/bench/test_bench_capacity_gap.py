"""bench.capacity_gap's statistics on synthetic curves: the curves are read at the right
budgets and the win conditions at the right points (the bootstrap itself: test_bench_stats.py)."""
from __future__ import annotations

import numpy as np
import pytest

from bench.capacity_gap import interpolate_rows, summarize, tokens_to_reach


def test_interpolate_and_reach():
    rows = [[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]]
    assert list(interpolate_rows([0, 10, 20], rows, 5)) == [0.5, 0.0]
    assert list(interpolate_rows([0, 10, 20], rows, 20)) == [1.0, 1.0]
    assert list(interpolate_rows([0, 10, 20], rows, 0)) == [0.0, 0.0]
    assert interpolate_rows([0, 10, 20], rows, 21) is None
    assert tokens_to_reach([0, 10, 20], [0.0, 0.5, 1.0], 0.75) == pytest.approx(15.0)
    assert tokens_to_reach([0, 10, 20], [0.0, 0.5, 0.6], 0.75) is None


def _curve(xs_tok, xs_upd, p, n=200, seed=0):
    rng = np.random.default_rng(seed)
    u = rng.random(n)
    return {"points": [{"tokens": t, "updates": k, "scores": (u < q).astype(float).tolist()}
                       for t, k, q in zip(xs_tok, xs_upd, p)], "seconds": 1.0}


def test_summarize_finds_a_planted_win_and_no_win():
    toks, upd = [0, 100, 200, 300], [0, 2, 4, 6]
    runs = []
    for s in range(3):
        runs.append({"mopd": _curve(toks, upd, [0.1, 0.5, 0.7, 0.8], seed=s),
                     "seqkd_tok": _curve([0, 90, 190, 290], [0, 5, 10, 15], [0.1, 0.2, 0.3, 0.4], seed=s),
                     "seqkd_upd": _curve([0, 50, 100, 150], upd, [0.1, 0.15, 0.2, 0.25], seed=s)})
    out = summarize(runs, n_boot=300)
    assert [round(p["tokens"]) for p in out["arms"]["mopd"]] == toks
    assert out["gaps"]["equal_updates"][-1]["gap"] == pytest.approx(0.55, abs=0.02)
    # equal tokens: seq-KD's last checkpoint (290) stands in for MOPD's 300
    assert out["gaps"]["equal_tokens"][-1]["gap"] == pytest.approx(0.4, abs=0.02)
    c = out["conditions"]
    assert c["a_final_gap_ge_0.05_ci_above_0_both_budgets"] and c["b_mopd_reaches_with_half_tokens"]
    # the arms swapped: no win either way
    swapped = [{"mopd": r["seqkd_upd"], "seqkd_tok": r["mopd"], "seqkd_upd": r["mopd"]} for r in runs]
    c = summarize(swapped, n_boot=300)["conditions"]
    assert not c["a_final_gap_ge_0.05_ci_above_0_both_budgets"] and not c["b_mopd_reaches_with_half_tokens"]
    # a seq-KD that never moves from the base is no target to reach
    flat = [{**r, "seqkd_tok": _curve([0, 90, 190, 290], [0, 5, 10, 15], [0.1] * 4, seed=s)} for s, r in enumerate(runs)]
    c = summarize(flat, n_boot=300)["conditions"]
    assert not c["b_seqkd_improves_on_base"] and not c["b_mopd_reaches_with_half_tokens"]


def test_prepare_says_what_is_missing_before_building_anything(tmp_path):
    from bench.capacity_gap import main
    out = tmp_path / "cg"
    with pytest.raises(SystemExit, match="no student for task math: pass --student"):
        main(["prepare", "--task", "math", "--out", str(out)])
    with pytest.raises(SystemExit, match="no teacher for task math: pass --teacher"):
        main(["prepare", "--task", "math", "--out", str(out), "--student", str(tmp_path)])
    with pytest.raises(SystemExit, match="--student .* is not a model folder"):
        main(["prepare", "--task", "math", "--out", str(out), "--student", str(tmp_path / "nope"),
              "--teacher", str(tmp_path)])
    assert not out.exists()


@pytest.mark.ci
def test_math_arms_through_the_cli(tmp_path):
    """prepare -> arms (all three, 2 MOPD updates) -> report on random-init models: every
    arm is scored at the base and each checkpoint on the same rows, seqkd_tok gets MOPD's
    student tokens and seqkd_upd its updates."""
    import json

    from bench.capacity_gap import main
    from core.tiny import build_tiny_model
    student = build_tiny_model(tmp_path / "s", seed=0, hidden_size=64, num_layers=2, num_heads=1)
    teacher = build_tiny_model(tmp_path / "t", seed=1, hidden_size=128, num_layers=2, num_heads=2)
    out = tmp_path / "cg"
    assert main(["prepare", "--task", "math", "--out", str(out), "--student", str(student),
                 "--teacher", str(teacher)]) == 0
    prep = json.loads((out / "prep.json").read_text())
    assert prep["task"] == "math" and prep["params"]["ratio_non_embedding"] == pytest.approx(4.0, abs=0.05)
    assert main(["arms", "--out", str(out), "--seed", "0", "--steps", "2"]) == 0
    curves = json.loads((out / "seed0" / "curves.json").read_text())
    m, tok, upd = curves["mopd"]["points"], curves["seqkd_tok"]["points"], curves["seqkd_upd"]["points"]
    assert [p["updates"] for p in m] == [0, 1, 2] and [p["updates"] for p in upd] == [0, 1, 2]
    assert all(len(p["scores"]) == 400 for p in m + tok + upd)
    # seq-KD takes whole batches of teacher answers: within one batch (32 x 12 tokens) of MOPD's tokens
    assert curves["seqkd_tok"]["match"] == "tokens" and abs(tok[-1]["tokens"] - m[-1]["tokens"]) <= 32 * 12
    assert main(["report", "--out", str(out)]) == 0
    res = json.loads((out / "result.json").read_text())
    assert set(res["gaps"]) == {"equal_updates", "equal_tokens"} and (out / "score_vs_tokens.png").exists()
