"""bench.stats: the one bootstrap (and t interval) the benches share. The intervals cover
what they should, the second bootstrap level carries the seeds' spread, the pairing
removes the rows' shared difficulty, and the t interval matches its closed form."""
from __future__ import annotations

import math

import numpy as np
import pytest

from bench.stats import bootstrap_ci, bootstrap_mean_ci, paired_gap_ci, t_interval


def test_bootstrap_ci_brackets_the_mean_and_narrows_with_rows():
    rng = np.random.default_rng(0)
    small = (rng.random((3, 50)) < 0.6).astype(float)
    big = (rng.random((3, 2000)) < 0.6).astype(float)
    m, lo, hi = bootstrap_mean_ci(small, n_boot=500)
    M, LO, HI = bootstrap_mean_ci(big, n_boot=500)
    assert lo <= m <= hi and LO <= M <= HI
    assert HI - LO < hi - lo
    assert LO < 0.6 < HI
    # rows alone (1-D) are one seed's rows
    assert bootstrap_mean_ci(big[0], n_boot=300) == bootstrap_mean_ci(big[:1], n_boot=300)
    for bad in ([], np.zeros((2, 2, 2))):
        with pytest.raises(ValueError, match="seeds x rows"):
            bootstrap_mean_ci(bad)


def test_the_seed_level_carries_the_seeds_spread():
    # same overall mean and rows; in `spread` the seeds disagree (0.2 / 0.5 / 0.8): a
    # rows-only bootstrap would give both the same width
    rng = np.random.default_rng(2)
    u = rng.random(400)
    agree = np.stack([(u < 0.5).astype(float)] * 3)
    spread = np.stack([(u < p).astype(float) for p in (0.2, 0.5, 0.8)])
    _, lo_a, hi_a = bootstrap_mean_ci(agree, n_boot=1000)
    m, lo_s, hi_s = bootstrap_mean_ci(spread, n_boot=1000)
    assert abs(m - 0.5) < 0.05
    assert hi_s - lo_s > 3 * (hi_a - lo_a)


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


def test_bootstrap_ci_of_differences():
    assert bootstrap_ci([]) == (0.0, 0.0)
    assert bootstrap_ci([0.25] * 30, n_boot=200) == (0.25, 0.25)
    rng = np.random.default_rng(3)
    d = rng.normal(0.3, 1.0, 400)
    lo, hi = bootstrap_ci(d.tolist(), n_boot=4000)
    half = 1.96 * d.std(ddof=1) / math.sqrt(len(d))   # the normal approximation it should agree with
    assert lo == pytest.approx(d.mean() - half, abs=0.02) and hi == pytest.approx(d.mean() + half, abs=0.02)


def test_t_interval_closed_form():
    m, lo, hi = t_interval([1.0, 2.0, 3.0])
    assert m == 2.0 and hi - m == pytest.approx(4.303 / math.sqrt(3)) and m - lo == pytest.approx(hi - m)
    assert t_interval([0.4]) == (0.4, 0.4, 0.4)
    assert t_interval(range(20))[2] - 9.5 == pytest.approx(1.96 * np.std(range(20), ddof=1) / math.sqrt(20))
    with pytest.raises(ValueError, match="no values"):
        t_interval([])
