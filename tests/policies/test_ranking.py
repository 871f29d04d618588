"""The ranking numerics of the model-predictive policy (policies/ranking.py) against the numpy forms they replace."""

from __future__ import annotations

import math

import numpy as np

from policies.ranking import anchored_z, lexmin, normal_cdf, phi, row_sums, weighted_column_sums


def test_fast_lexmin_and_row_sums_match_numpy_bit_for_bit() -> None:
    """The policy's search picks ``np.lexsort(keys)[0]`` and sums rows as ``a.sum(axis=1)`` does, exactly:
    a different tie-break or rounding would change which (T, k) it chooses."""
    rng = np.random.default_rng(7)
    for trial in range(300):
        n = int(rng.integers(1, 400))
        # Coarse values: many ties on every key, which is where the tie-break order matters.
        keys = [np.round(rng.random(n) * rng.integers(1, 5), 1) for _ in range(int(rng.integers(1, 8)))]
        if trial % 10 == 0:
            keys[-1][rng.integers(0, n)] = np.nan  # NaN sorts last in lexsort
        if trial % 7 == 0:
            keys[0] = -keys[0] * 0.0  # -0.0 ties with 0.0
        assert lexmin(keys) == int(np.lexsort(keys)[0]), f"trial {trial}"
    for cols in range(0, 10):
        a = rng.random((257, cols)) * rng.random(cols) * 1e3
        assert np.array_equal(row_sums(a), a.sum(axis=1)), f"{cols} columns"


def _anchored_z_reference(ratios_now: list[float], spreads: list[float], measured: float) -> float:
    """The bisection as it was written before its factors were inlined (session 20)."""
    target = min(max(measured, 0.02), 0.98)
    logs = [math.log(max(r, 1e-9)) / s for r, s in zip(ratios_now, spreads, strict=True)]
    lo, hi = -40.0, 40.0
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if math.prod(phi(mid - x) for x in logs) < target else (lo, mid)
    return 0.5 * (lo + hi)


def test_anchored_z_matches_the_product_form_bit_for_bit() -> None:
    rng = np.random.default_rng(11)
    for trial in range(3000):
        n = int(rng.integers(0, 4))
        # Ratios from far inside to far past the target (the clip at ±30 binds at both ends).
        ratios = (np.exp(rng.normal(0.0, 3.0, n)) * rng.choice([1e-12, 1.0, 1e12], n)).tolist()
        spreads = rng.uniform(0.05, 1.5, n).tolist()
        measured = float(rng.choice([rng.random(), 0.0, 1.0, 0.5]))
        got, want = anchored_z(ratios, spreads, measured), _anchored_z_reference(ratios, spreads, measured)
        assert got == want or (math.isnan(got) and math.isnan(want)), f"trial {trial}"


def test_weighted_column_sums_match_the_stacked_row_sum_bit_for_bit() -> None:
    """The best-effort ranking weighs each tier's column by its share without stacking them: the same sums."""
    rng = np.random.default_rng(5)
    for cols in range(1, 10):
        columns = [rng.random(311) * 10.0 ** rng.integers(-3, 4) for _ in range(cols)]
        weights = rng.random(cols)
        assert np.array_equal(weighted_column_sums(columns, weights), (np.stack(columns, axis=1) * weights).sum(axis=1))


def test_normal_cdf_is_the_scalar_phi_and_a_close_normal_cdf() -> None:
    """The vector and scalar forms agree (the anchored z is solved with one, candidates ranked with the other),
    and the logistic stays within 0.01 of the normal CDF it approximates."""
    from statistics import NormalDist

    x = np.concatenate([np.linspace(-8.0, 8.0, 801), [-1e6, 1e6]])
    vector = normal_cdf(x)
    assert np.allclose(vector, [phi(float(v)) for v in x], rtol=0.0, atol=1e-15)
    exact = np.array([NormalDist().cdf(float(v)) for v in x])
    assert float(np.max(np.abs(vector - exact))) < 0.01
    assert vector[0] < vector[400] == 0.5 < vector[-1]
