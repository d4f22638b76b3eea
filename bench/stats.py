"""The confidence intervals the benches report, in one place (they were three private
copies: bench.frontend_loop_gain, bench.capacity_gap, bench.harness_generalization).

- `bootstrap_mean_ci`: the mean of per-row scores and its percentile bootstrap CI. A 1-D
  array is rows; a seeds x rows matrix is bootstrapped on two levels (seeds with
  replacement, then rows, the same row draw for every seed, since the seeds score the
  same rows), so seed-to-seed spread is in the interval and not only row noise.
- `paired_gap_ci`: the same on the per-(seed, row) differences of two arms scored on the
  same seeds and rows: the pairing removes the rows' shared difficulty from the spread.
- `bootstrap_ci`: the (low, high) of `bootstrap_mean_ci` on a list of paired differences.
- `t_interval`: the Student-t interval of a mean over a handful of values (seeds), for
  benches with one number per seed, where a bootstrap of three values is too coarse.
"""
from __future__ import annotations

import math
import statistics

import numpy as np

# two-sided 95% Student-t quantiles by degrees of freedom (df > 9: the normal's 1.96)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def bootstrap_mean_ci(scores, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high) of `scores`: rows (1-D) or seeds x rows (2-D, two-level bootstrap)."""
    x = np.asarray(scores, dtype=float)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2 or x.size == 0:
        raise ValueError(f"bootstrap_mean_ci: expected non-empty rows or a seeds x rows matrix, got shape {x.shape}")
    rng = np.random.default_rng(seed)
    S, N = x.shape
    s = rng.integers(0, S, (n_boot, S)) if S > 1 else np.zeros((n_boot, 1), dtype=int)
    n = rng.integers(0, N, (n_boot, N))
    means = np.take_along_axis(x[s], n[:, None, :], axis=2).mean(axis=(1, 2))
    a = (1 - level) / 2
    return float(x.mean()), float(np.quantile(means, a)), float(np.quantile(means, 1 - a))


def paired_gap_ci(a, b, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float, float]:
    """(mean a - b, low, high) for two arms scored on the same seeds and rows."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired_gap_ci: arms are not paired (shapes {a.shape} and {b.shape})")
    return bootstrap_mean_ci(a - b, n_boot=n_boot, seed=seed, level=level)


def bootstrap_ci(diffs, n_boot: int = 10_000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """(low, high) of the mean of paired differences; (0, 0) for none (nothing was measured)."""
    if len(diffs) == 0:
        return (0.0, 0.0)
    _, lo, hi = bootstrap_mean_ci(diffs, n_boot=n_boot, seed=seed, level=level)
    return lo, hi


def t_interval(xs) -> tuple[float, float, float]:
    """(mean, low, high): the mean of a few values and its 95% t interval (one value: no width)."""
    xs = [float(v) for v in xs]
    if not xs:
        raise ValueError("t_interval: no values")
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, m, m
    h = T975.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))
    return m, m - h, m + h
