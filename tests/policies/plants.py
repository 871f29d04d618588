"""Toy plants the policy tests close the loop around (the real simulator is tested in tests/sim).

Each is a few lines on purpose: what a policy must do against it is obvious by inspection.
"""

from __future__ import annotations

import math

import numpy as np


class TPOTPlant:
    """Windowed p95 TPOT = ``base_ms · load / (1 + gain · T_eff)``, times lognormal noise.

    ``T_eff`` follows the pushed T with first-order lag ``lag`` per window (requests in flight finish
    at the old T), so a change of T shows up over a few windows, as in a real cluster.
    """

    def __init__(
        self, seed: int, base_ms: float = 40.0, gain: float = 0.6, lag: float = 0.5, noise: float = 0.03
    ):
        self.rng = np.random.default_rng(seed)
        self.base_ms, self.gain, self.lag, self.noise = base_ms, gain, lag, noise
        self.t_eff = 0.0

    def p95_ms(self, threshold: float, load: float) -> float:
        self.t_eff += self.lag * (threshold - self.t_eff)
        noise = math.exp(self.noise * self.rng.standard_normal())
        return self.base_ms * load / (1.0 + self.gain * self.t_eff) * noise

    def threshold_for(self, p95_ms: float, load: float) -> float:
        """The steady-state T at which the noiseless p95 equals ``p95_ms``."""
        return (self.base_ms * load / p95_ms - 1.0) / self.gain


class DistortionPlant:
    """Windowed mean distortion = ``slope · T`` of the T pushed one window earlier, times lognormal noise."""

    def __init__(self, seed: int, slope: float = 0.3, noise: float = 0.1):
        self.rng = np.random.default_rng(seed)
        self.slope, self.noise = slope, noise
        self._previous_threshold = 0.0

    def distortion(self, threshold: float) -> float:
        out = self.slope * self._previous_threshold * math.exp(self.noise * self.rng.standard_normal())
        self._previous_threshold = threshold
        return out
