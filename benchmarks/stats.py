"""Small statistics the benchmarks share."""

from __future__ import annotations

import math

import numpy as np


def ci95(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of a 95 % t-interval (0 for one value)."""
    arr = np.asarray(values, dtype=float)
    if arr.size < 2:
        return float(arr.mean()), 0.0
    t = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 7: 2.45, 8: 2.36, 9: 2.31, 10: 2.26}.get(arr.size, 2.0)
    return float(arr.mean()), float(t * arr.std(ddof=1) / math.sqrt(arr.size))


def sign_test_p(wins: int, losses: int) -> float:
    """Exact two-sided sign-test p-value for ``wins`` against ``losses`` (ties dropped before; 1.0 with none):
    the binomial at one half. McNemar's exact test is this on the discordant pairs."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(wins, losses) + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)
