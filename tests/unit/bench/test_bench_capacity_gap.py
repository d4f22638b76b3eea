"""bench.capacity_gap's statistics on synthetic curves: the bootstrap CIs cover what they
should, the paired gap pairs by seed and row, and the win conditions read the right points."""
from __future__ import annotations

import numpy as np
import pytest

from bench.capacity_gap import (bootstrap_mean_ci, interpolate_rows, paired_gap_ci, summarize,
                                tokens_to_reach)


def test_bootstrap_ci_brackets_the_mean_and_narrows_with_rows():
    rng = np.random.default_rng(0)
    small = (rng.random((3, 50)) < 0.6).astype(float)
    big = (rng.random((3, 2000)) < 0.6).astype(float)
    m, lo, hi = bootstrap_mean_ci(small, n_boot=500)
    M, LO, HI = bootstrap_mean_ci(big, n_boot=500)
    assert lo <= m <= hi and LO <= M <= HI
    assert HI - LO < hi - lo
    assert LO < 0.6 < HI
    with pytest.raises(ValueError, match="seeds x rows"):
        bootstrap_mean_ci([1.0, 0.0])


def test_paired_gap_uses_the_pairing():
    # b = a with 10% of the rows flipped from 1 to 0: the paired gap is exact and its CI
    # tight, although each arm's own spread (rows are 0/1) is wide
    rng = np.random.default_rng(1)
    a = (rng.random((3, 400)) < 0.5).astype(float)
    a[:, :40] = 1.0
    b = a.copy()
    b[:, :40] = 0.0
    gap, lo, hi = paired_gap_ci(a, b, n_boot=500)
    assert gap == pytest.approx(0.1)
    assert lo > 0.05 and hi < 0.15
    with pytest.raises(ValueError, match="not paired"):
        paired_gap_ci(a, b[:, :10])


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
