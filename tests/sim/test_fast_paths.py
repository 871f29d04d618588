"""The simulator's speed paths compute exactly what the plain formulations do (bit for bit): runs stay
reproducible across speed work, and a policy sees the same telemetry."""

from __future__ import annotations

import numpy as np

from sim.entities import WindowBins
from sim.metrics import fast_summary
from sim.replica import survival_grid


def test_window_bins_fold_matches_add_at_bit_for_bit() -> None:
    rng = np.random.default_rng(7)
    bins = WindowBins(1.0, 60.0, 3)
    ref = np.zeros_like(bins.sums)
    for step in range(2000):
        n = int(rng.integers(1, 50))
        # Segments span one window or several (non-decreasing bins), as replicas add them.
        at = np.sort(rng.integers(0, 60, size=n)) if step % 3 else np.full(n, int(rng.integers(0, 60)))
        rows = rng.random((n, bins.n_features)) * float(rng.choice([1e-3, 1.0, 55.123, 1e3]))
        if rng.random() < 0.4:
            bins.subtract(at, rows)
            np.subtract.at(ref, at, rows)
        else:
            bins.add(at, rows)
            np.add.at(ref, at, rows)
        if rng.random() < 0.05:  # a tick reads a window mid-way
            w = int(rng.integers(0, 60))
            assert bins.window(w).tobytes() == ref[w].tobytes()
    got = np.array([bins.window(w) for w in range(ref.shape[0])])
    assert got.tobytes() == ref.tobytes()


def test_survival_grid_counts_match_direct_comparison() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        rows, k = int(rng.integers(1, 9)), int(rng.integers(1, 7))
        accept = rng.random((rows, k))
        accept[rng.random((rows, k)) < 0.2] = 0.0  # padded positions past a tier's k
        accept[rng.random((rows, k)) < 0.1] = 1.0
        survival = np.cumprod(accept, axis=1)
        grid, tokens = survival_grid(survival)
        u = rng.random((40, rows))
        u[0, 0] = survival[0, 0]  # a draw exactly on a breakpoint
        g = grid.searchsorted(u, side="right")
        got = tokens[np.arange(rows), g]
        want = 1 + (u[:, :, None] < survival).sum(axis=2)
        np.testing.assert_array_equal(got, want)


def _numpy_summary(samples: np.ndarray) -> tuple[int, float, float, float, float]:
    """The interpolation fast_summary did in numpy before it moved to Python floats."""
    s = np.sort(samples)
    pos = np.array([50.0, 90.0, 95.0, 99.0]) / 100.0 * (s.size - 1)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, s.size - 1)
    v = s[lo] + (s[hi] - s[lo]) * (pos - lo)
    return int(s.size), float(v[0]), float(v[1]), float(v[2]), float(v[3])


def test_fast_summary_matches_the_numpy_interpolation() -> None:
    rng = np.random.default_rng(11)
    for n in [*range(1, 40), 100, 257, 1000]:
        samples = rng.lognormal(4.0, 1.0, n)
        got = fast_summary(samples)
        assert (got.count, got.p50_ms, got.p90_ms, got.p95_ms, got.p99_ms) == _numpy_summary(samples)
