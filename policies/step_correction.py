"""An online correction of a modelled step time: fixed part and per-row part apart.

A calibrated profile models a decode step as ``fixed + per_row · B``. On the machine that serves, both
parts drift, and not alike: on the default pair (2-core AVX2 machine, session 13) plain steps measured
about the model's time at one row and 1.6x it at seven, because the per-row part had grown ~3x while the
fixed part had not. One ratio learned at the batch that ran then mis-predicts every other batch: learned
at 1-2 rows in a light phase, it had plain decoding meeting the target at a full batch where it missed.

So the correction is a line in the per-row part's share of the modelled step, ``s = P·B / (F + P·B)``:
``measured / modelled = a + (b − a)·s``, i.e. ``measured = a·F + b·P·B``. Windows at different batches
fit both; windows at one batch give ``a = b`` = their ratio (one scalar correction) until the batch moves.

The slope is a ridge estimate (a Gaussian prior on it, centred on 0): its pull is the windows' residual
variance over the prior's, so it takes what a spread of batches shows clearly and little of what noise
shows. Why: at a light load a window holds a handful of steps, its ratio moves ±20 % from one window to the
next (session 13, step load B seed 3: 1.27 → 1.66 at one row within three windows), and a line through
windows at one and two rows extrapolated that noise to a per-row factor at the 4.0 bound — plain decoding
then looked twice as slow at a full batch as it ran, and the policy drafted where plain decoding paid.
"""

from __future__ import annotations

import math

import numpy as np


def corrected_step_line(fixed_ms: np.ndarray | float, per_row_ms: np.ndarray | float, fixed_factor: np.ndarray | float,
                        per_row_factor: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
    """The modelled step's line ``fixed_ms + per_row_ms · B`` corrected by a fit's two factors: ``(fixed_ms ·
    fixed_factor, per_row_ms · per_row_factor)``, except where ``fixed_ms`` < 0, which takes the per-row factor for
    both parts, and where ``per_row_ms`` < 0 (a falling segment), which takes the fixed factor for both. Why: a
    plain step read from a measured table is the segment through its two neighbouring batches, and a steep one has a
    negative intercept (the default pair: 58 ms at three rows, 86 at four, so -25 ms + 27.7 ms per row). That
    intercept is no fixed cost: scaled by a larger factor than the per-row part it drove the corrected step below
    zero on noisy fits (per-row share s = P·B / (F + P·B) above 1, the line read past s = 1). The share is a
    fraction; at s >= 1 the line's value is its per-row factor, so the whole segment takes it; at s <= 0 (a negative
    per-row part) its fixed factor (and :meth:`StepCorrection.observe` clips s to [0, 1] alike)."""
    fixed = np.asarray(fixed_ms, dtype=float)
    per_row = np.asarray(per_row_ms, dtype=float)
    return (fixed * np.where(fixed < 0, per_row_factor, fixed_factor),
            per_row * np.where(per_row < 0, fixed_factor, per_row_factor))


def _check_decay_and_bounds(decay: float, bounds: tuple[float, float]) -> None:
    if not (0 <= decay < 1):
        raise ValueError(f"decay must be in [0, 1), got {decay}")
    if not (0 < bounds[0] <= 1 <= bounds[1]):
        raise ValueError(f"bounds must satisfy 0 < low <= 1 <= high, got {bounds}")


class StepCorrection:
    """Measured / modelled step time as ``a·fixed + b·per_row·B``, fitted from windows online.

    The fit is a weighted line of the windows' ratio in their per-row share ``s``: the mean ratio at the
    mean share, and a ridge slope ``Sxy / (Sxx + σ²/τ²)``, with ``σ²`` the windows' residual variance
    about the least-squares line (``noise_prior`` counted as ``noise_weight`` windows until enough are in)
    and ``τ`` = ``slope_prior``, the prior's spread of the slope (ratio per unit of share).

    * ``decay`` — per-window decay of the fit's sums (memory ~1 / (1 − decay) windows).
    * ``bounds`` — clip of each window's ratio and of each factor.
    """

    def __init__(self, decay: float = 0.9, slope_prior: float = 1.5, noise_prior: float = 0.1,
                 noise_weight: float = 2.0, bounds: tuple[float, float] = (0.25, 4.0)) -> None:
        _check_decay_and_bounds(decay, bounds)
        for label, value in (("slope_prior", slope_prior), ("noise_prior", noise_prior),
                             ("noise_weight", noise_weight)):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{label} must be finite and > 0, got {value}")
        self.decay, self.bounds = decay, bounds
        self.slope_prior, self.noise_prior, self.noise_weight = slope_prior, noise_prior, noise_weight
        # Decayed sums over windows: weight, s, s², ratio, ratio², s·ratio.
        self._w = self._s = self._ss = self._y = self._yy = self._sy = 0.0
        self.fixed = 1.0  # a: the ratio at s = 0
        self.per_row = 1.0  # b: the ratio at s = 1
        self.slope = 0.0  # b − a
        self.noise = noise_prior  # σ: the windows' residual spread about the line
        self.windows = 0

    def observe(self, measured_ms: float, fixed_ms: float, per_row_ms: float, batch: float) -> None:
        """One window: its measured mean step against the model's ``fixed_ms + per_row_ms · batch``."""
        modelled = fixed_ms + per_row_ms * batch
        if not (modelled > 0 and math.isfinite(measured_ms) and math.isfinite(modelled)):
            return
        lo, hi = self.bounds
        y = min(max(measured_ms / modelled, lo), hi)
        s = min(max(per_row_ms * batch / modelled, 0.0), 1.0)  # a share (see corrected_step_line)
        d = self.decay
        self._w = d * self._w + 1.0
        self._s = d * self._s + s
        self._ss = d * self._ss + s * s
        self._y = d * self._y + y
        self._yy = d * self._yy + y * y
        self._sy = d * self._sy + s * y
        self.windows += 1
        w = self._w
        s_mean, y_mean = self._s / w, self._y / w
        sxx = max(self._ss - w * s_mean * s_mean, 0.0)  # Σ w (s − s̄)²
        sxy = self._sy - w * s_mean * y_mean
        syy = max(self._yy - w * y_mean * y_mean, 0.0)
        rss = max(syy - sxy * sxy / sxx, 0.0) if sxx > 1e-12 else syy  # about the least-squares line
        variance = (rss + self.noise_weight * self.noise_prior**2) / (max(w - 2.0, 0.0) + self.noise_weight)
        self.noise = math.sqrt(variance)
        self.slope = sxy / (sxx + variance / self.slope_prior**2)
        self.fixed = min(max(y_mean - self.slope * s_mean, lo), hi)
        self.per_row = min(max(y_mean + self.slope * (1.0 - s_mean), lo), hi)

    def factors(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The (fixed, per-row) factors at each of ``batch`` (rows): the line's two, whatever the batch."""
        return np.full(np.shape(batch), self.fixed), np.full(np.shape(batch), self.per_row)

    def summary(self) -> str:
        """The two factors, for a decision's reason."""
        return f"{self.fixed:.2f}, {self.per_row:.2f}"

    def at(self, fixed_ms: float, per_row_ms: float, batch: float) -> float:
        """The correction of a whole step of the model's ``fixed_ms + per_row_ms · batch`` (for reports)."""
        modelled = fixed_ms + per_row_ms * batch
        if not modelled > 0:
            return 1.0
        fixed, per_row = corrected_step_line(fixed_ms, per_row_ms, self.fixed, self.per_row)
        return float((fixed + per_row * batch) / modelled)

    def __repr__(self) -> str:
        return (f"StepCorrection(fixed={self.fixed:.3g}, per_row={self.per_row:.3g}, noise={self.noise:.3g}, "
                f"windows={self.windows})")


class BatchStepCorrection:
    """Measured / modelled step time per batch size (rows), fitted from windows online; no line.

    Why: on the default pair's live step loads (sessions 31-32, ``benchmarks/step_ratios.py`` over five
    ticks files) measured / modelled steps rise from one row to two or three (1.1 -> 1.2-1.4) and fall back
    at four to six (1.1-1.3), plain and speculative steps alike. A line in the per-row share fitted where a
    light phase runs (one or two rows) extrapolates the rise: fits read the per-row part at 1.6-2.8x the
    model, and at five rows a speculative step looked slower per token than a plain one where it met.

    So each integer batch ``1..max_batch`` keeps decayed sums of the ratio of the windows that ran there (a
    window at a fractional mean batch splits between its two neighbours), and its ratio is their mean
    shrunk toward the pooled ratio of every window by ``prior_weight`` windows: a batch no window has
    reached reads the level measured elsewhere, not a slope. Linear between integer batches, held beyond.

    * ``decay`` -- per-window decay of every batch's sums (as :class:`StepCorrection`'s).
    * ``bounds`` -- clip of each window's ratio.
    """

    def __init__(self, max_batch: int, decay: float = 0.9, prior_weight: float = 2.0,
                 bounds: tuple[float, float] = (0.25, 4.0)) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        _check_decay_and_bounds(decay, bounds)
        if not (prior_weight > 0 and math.isfinite(prior_weight)):
            raise ValueError(f"prior_weight must be finite and > 0, got {prior_weight}")
        self.max_batch, self.decay, self.prior_weight, self.bounds = max_batch, decay, prior_weight, bounds
        self._w = np.zeros(max_batch)  # decayed weight per batch (index 0: one row)
        self._y = np.zeros(max_batch)  # decayed ratio sums per batch
        self._rows = np.arange(1.0, max_batch + 1.0)
        self.ratios = np.ones(max_batch)  # the correction at 1..max_batch rows
        self.windows = 0

    def observe(self, measured_ms: float, fixed_ms: float, per_row_ms: float, batch: float) -> None:
        """One window: its measured mean step against the model's ``fixed_ms + per_row_ms · batch``."""
        modelled = fixed_ms + per_row_ms * batch
        if not (modelled > 0 and math.isfinite(measured_ms) and math.isfinite(modelled) and math.isfinite(batch)):
            return
        lo_bound, hi_bound = self.bounds
        y = min(max(measured_ms / modelled, lo_bound), hi_bound)
        position = min(max(batch, 1.0), float(self.max_batch)) - 1.0
        lo = min(int(position), self.max_batch - 1)
        upper = position - lo
        self._w *= self.decay
        self._y *= self.decay
        self._w[lo] += 1.0 - upper
        self._y[lo] += (1.0 - upper) * y
        if upper > 0:
            self._w[lo + 1] += upper
            self._y[lo + 1] += upper * y
        self.windows += 1
        pooled = float(self._y.sum() / self._w.sum())
        self.ratios = (self._y + self.prior_weight * pooled) / (self._w + self.prior_weight)

    def factors(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The correction at each of ``batch`` (rows) as (fixed, per-row) factors: both the same ratio."""
        ratio = np.interp(batch, self._rows, self.ratios)
        return ratio, ratio

    def at(self, fixed_ms: float, per_row_ms: float, batch: float) -> float:
        """The correction of a whole step at ``batch`` rows (for reports)."""
        return float(np.interp(batch, self._rows, self.ratios))

    def summary(self) -> str:
        """The ratio at each batch size, for a decision's reason."""
        return "/".join(f"{r:.2f}" for r in self.ratios.tolist())

    def __repr__(self) -> str:
        return f"BatchStepCorrection(ratios={np.round(self.ratios, 3).tolist()}, windows={self.windows})"
