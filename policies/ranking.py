"""Numerics of the model-predictive policy's ranking of its joint candidates (thousands a control tick).

Where a helper stands in for a plain numpy expression (a row sum, ``np.lexsort(keys)[0]``), it gives that
expression's result bit for bit, only cheaper on the policy's shapes (a few columns, a few thousand rows), so
the policy's choices and the simulator runs built on them do not move. The normal CDF is the logistic
approximation, a ranking device (within 0.01), not a probability to report.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def sum_left_to_right(columns: Sequence[np.ndarray]) -> np.ndarray:
    """Elementwise ``columns[0] + columns[1] + …``, added left to right as numpy's row sum adds fewer than 8
    terms (so bit for bit ``np.stack(columns, axis=1).sum(axis=1)`` for them), without its per-row loop."""
    total = np.array(columns[0], dtype=float)  # a copy: callers may work on the sum in place
    for column in columns[1:]:
        total = total + column
    return total


def row_sums(a: np.ndarray) -> np.ndarray:
    """``a.sum(axis=1)`` for a 2-D ``a``, bit for bit, faster on few columns (~6x on [2356, 3])."""
    if a.shape[1] == 0 or a.shape[1] >= 8:
        return np.asarray(a.sum(axis=1), dtype=float)
    return sum_left_to_right([a[:, i] for i in range(a.shape[1])])


def weighted_column_sums(columns: Sequence[np.ndarray], weights: np.ndarray) -> np.ndarray:
    """``row_sums(np.stack(columns, axis=1) * weights)``, bit for bit, without building the matrix."""
    if len(columns) >= 8:
        return row_sums(np.stack(columns, axis=1) * weights)
    return sum_left_to_right([column * weight for column, weight in zip(columns, weights, strict=True)])


LOGISTIC = 1.702  # Φ(x) ≈ 1 / (1 + exp(−1.702 x)), within 0.01


def normal_cdf(x: np.ndarray) -> np.ndarray:
    """Φ(x), the logistic approximation: ranks candidates, thousands per tick."""
    return np.asarray(1.0 / (1.0 + np.exp(-LOGISTIC * np.clip(x, -30.0, 30.0))), dtype=float)


def phi(x: float) -> float:
    """:func:`normal_cdf` of one value, without numpy's per-call cost."""
    return 1.0 / (1.0 + math.exp(-LOGISTIC * min(max(x, -30.0), 30.0)))


def anchored_z(ratios_now: Sequence[float], spreads: Sequence[float], measured: float) -> float:
    """The ``z`` at which ``Π Φ(z − ln r / σ)`` over a tier's latency ratios in force equals its measured
    attainment (clipped to [0.02, 0.98]): bisection, the product rising in ``z``."""
    target = min(max(measured, 0.02), 0.98)
    logs = [math.log(max(r, 1e-9)) / s for r, s in zip(ratios_now, spreads, strict=True)]
    lo, hi = -40.0, 40.0
    # Scalar (numpy calls here cost the control tick ~0.7 ms a tier, session 17), and phi inlined: 30
    # steps × one or two factors, three times a tick. The same operations as
    # ``math.prod(phi(mid - x) for x in logs)`` (prod starts from the int 1, and 1 · p is p).
    exp, c = math.exp, -LOGISTIC
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        prod = 1.0
        for x in logs:
            v = mid - x
            v = -30.0 if v < -30.0 else 30.0 if v > 30.0 else v  # min(max(v, −30), 30); NaN stays NaN
            prod = prod * (1.0 / (1.0 + exp(c * v)))
        if prod < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def lexmin(keys: Sequence[np.ndarray]) -> int:
    """``np.lexsort(keys)[0]`` (the last key primary; ties to the lowest index) by narrowing the
    candidates key by key instead of sorting them all (lexsort of 5 keys over ~2,400 rows: ~3 ms)."""
    idx: np.ndarray | None = None
    for key in reversed(keys):
        values = key if idx is None else key[idx]
        low = values.min()
        if math.isnan(low):  # lexsort sorts NaN last; keep its exact semantics for that rare case
            return int(np.lexsort(keys)[0])
        hits = np.flatnonzero(values == low)
        idx = hits if idx is None else idx[hits]
        if idx.size == 1:
            break
    assert idx is not None and idx.size > 0
    return int(idx[0])
