"""An online correction of a modelled step time: fixed part and per-row part apart.

A calibrated profile models a decode step as ``fixed + per_row · B``. On the machine that serves, both
parts drift, and not alike: on the default pair (2-core AVX2 machine, session 13) plain steps measured
about the model's time at one row and 1.6x it at seven, because the per-row part had grown ~3x while the
fixed part had not. One ratio learned at the batch that ran then mis-predicts every other batch: learned
at 1-2 rows in a light phase, it had plain decoding meeting the target at a full batch where it missed.

So the correction is a line in the per-row part's share of the modelled step, ``s = P·B / (F + P·B)``:
``measured / modelled = a + (b − a)·s``, i.e. ``measured = a·F + b·P·B``. Windows at different batches
fit both (a weighted line, its slope shrunk toward 0), so windows at one batch give ``a = b`` = their
ratio (one scalar correction, as before) until the batch moves.
"""

from __future__ import annotations

import math


class StepCorrection:
    """Measured / modelled step time as ``a·fixed + b·per_row·B``, fitted from windows online.

    The fit is a weighted line of the windows' ratio in their per-row share ``s``: the mean ratio at the
    mean share, and a slope shrunk toward 0 as if ``prior_weight`` more windows sat at the mean ratio
    ``prior_spread`` either side of the mean share (windows at one batch: slope 0, one ratio).

    * ``decay`` — per-window decay of the fit's sums (memory ~1 / (1 − decay) windows).
    * ``bounds`` — clip of each window's ratio and of each factor.
    """

    def __init__(self, decay: float = 0.9, prior_weight: float = 2.0, prior_spread: float = 0.03,
                 bounds: tuple[float, float] = (0.25, 4.0)) -> None:
        if not (0 <= decay < 1):
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        if not (prior_weight > 0 and math.isfinite(prior_weight)):
            raise ValueError(f"prior_weight must be > 0, got {prior_weight}")
        if not (prior_spread > 0 and math.isfinite(prior_spread)):
            raise ValueError(f"prior_spread must be > 0, got {prior_spread}")
        if not (0 < bounds[0] <= 1 <= bounds[1]):
            raise ValueError(f"bounds must satisfy 0 < low <= 1 <= high, got {bounds}")
        self.decay, self.bounds = decay, bounds
        self._shrink = prior_weight * prior_spread**2
        # Decayed sums over windows: weight, s, s², ratio, s·ratio.
        self._w = self._s = self._ss = self._y = self._sy = 0.0
        self.fixed = 1.0  # a: the ratio at s = 0
        self.per_row = 1.0  # b: the ratio at s = 1
        self.windows = 0

    def observe(self, measured_ms: float, fixed_ms: float, per_row_ms: float, batch: float) -> None:
        """One window: its measured mean step against the model's ``fixed_ms + per_row_ms · batch``."""
        modelled = fixed_ms + per_row_ms * batch
        if not (modelled > 0 and math.isfinite(measured_ms) and math.isfinite(modelled)):
            return
        lo, hi = self.bounds
        y = min(max(measured_ms / modelled, lo), hi)
        s = per_row_ms * batch / modelled
        d = self.decay
        self._w = d * self._w + 1.0
        self._s = d * self._s + s
        self._ss = d * self._ss + s * s
        self._y = d * self._y + y
        self._sy = d * self._sy + s * y
        self.windows += 1
        w = self._w
        s_mean, y_mean = self._s / w, self._y / w
        spread = max(self._ss - w * s_mean * s_mean, 0.0)  # Σ w (s − s̄)²
        slope = (self._sy - w * s_mean * y_mean) / (spread + self._shrink)
        self.fixed = min(max(y_mean - slope * s_mean, lo), hi)
        self.per_row = min(max(y_mean + slope * (1.0 - s_mean), lo), hi)

    def at(self, fixed_ms: float, per_row_ms: float, batch: float) -> float:
        """The correction of a whole step of the model's ``fixed_ms + per_row_ms · batch`` (for reports)."""
        modelled = fixed_ms + per_row_ms * batch
        if not modelled > 0:
            return 1.0
        return (self.fixed * fixed_ms + self.per_row * per_row_ms * batch) / modelled

    def __repr__(self) -> str:
        return f"StepCorrection(fixed={self.fixed:.3g}, per_row={self.per_row:.3g}, windows={self.windows})"
