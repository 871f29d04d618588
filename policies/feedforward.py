"""Feed-forward control: predict the smallest T that meets the TPOT target at the measured load, then trim.

The model is plain data, so policies/ never imports the simulator: the simulator (or calibration)
converts its profile into a :class:`SpeedCurve` — tokens emitted per iteration and mean distortion as a
function of T, at the draft length in use — and a latency model, either a :class:`LinearLatencyModel`
(iteration time linear in the batch size) or any callable ``predict_tpot_ms(threshold, batch_size)``.

Each window, per tier with a TPOT target:

1. ``batch = in_flight / replicas`` (at least 1; capped at ``max_batch_size`` when given);
2. ``T_ff`` = the smallest T in the tier's range with ``predicted TPOT(T, batch) <= headroom · target``
   (the top of the range when none does); the prediction is a mean, the target a percentile, hence
   ``headroom`` < 1;
3. with ``respect_budget``, ``T_ff`` is capped at the largest T whose curve distortion is within the
   tier's budget;
4. a PID on the observed slack (the same :class:`policies.pid.PID`) adds a trim, in fractions of the
   tier's range, absorbing what the model gets wrong. The trim's limits are ``[−u_ff, 1 − u_ff]`` (the
   room the feed-forward leaves), so its integral cannot wind up while the sum sits at a bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from policies.decision import Decision
from policies.pid import PID
from policies.signals import normalised_slack
from policies.slo import SLOSpec, TierSLO
from policies.telemetry import Telemetry
from policies.tiers import (
    controllable_tiers,
    fraction_from_threshold,
    resolve_tiers,
    safe_thresholds,
    threshold_from_fraction,
)

#: ``predict_tpot_ms(threshold, batch_size) -> ms``
TPOTPredictor = Callable[[float, float], float]


@dataclass(frozen=True, slots=True)
class SpeedPoint:
    """At threshold T: mean tokens emitted per sequence per iteration, and mean per-token distortion."""

    threshold: float
    tokens_per_iteration: float
    mean_distortion: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.threshold) and self.threshold >= 0):
            raise ValueError(f"threshold must be finite and >= 0, got {self.threshold}")
        if not (math.isfinite(self.tokens_per_iteration) and self.tokens_per_iteration > 0):
            raise ValueError(f"tokens_per_iteration must be finite and > 0, got {self.tokens_per_iteration}")
        if not (math.isfinite(self.mean_distortion) and self.mean_distortion >= 0):
            raise ValueError(f"mean_distortion must be finite and >= 0, got {self.mean_distortion}")


@dataclass(frozen=True, slots=True)
class SpeedCurve:
    """Points sorted by strictly increasing T; linear interpolation between them, flat outside."""

    points: tuple[SpeedPoint, ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("points: a speed curve needs at least one point")
        ts = [p.threshold for p in self.points]
        if any(b <= a for a, b in zip(ts, ts[1:], strict=False)):
            raise ValueError(f"points: thresholds must be strictly increasing, got {ts}")

    @classmethod
    def from_points(
        cls, points: Iterable[SpeedPoint | Mapping[str, float] | tuple[float, ...]]
    ) -> SpeedCurve:
        """From SpeedPoints, dicts with the field names, or ``(T, tokens_per_iteration[, distortion])``."""
        out: list[SpeedPoint] = []
        for p in points:
            if isinstance(p, SpeedPoint):
                out.append(p)
            elif isinstance(p, Mapping):
                out.append(SpeedPoint(**p))
            else:
                out.append(SpeedPoint(*p))
        return cls(tuple(sorted(out, key=lambda p: p.threshold)))

    def tokens_per_iteration(self, threshold: float) -> float:
        xs = [p.threshold for p in self.points]
        return float(np.interp(threshold, xs, [p.tokens_per_iteration for p in self.points]))

    def mean_distortion(self, threshold: float) -> float:
        xs = [p.threshold for p in self.points]
        return float(np.interp(threshold, xs, [p.mean_distortion for p in self.points]))


@dataclass(frozen=True, slots=True)
class LinearLatencyModel:
    """Iteration time linear in the batch size ``b``::

        iteration_ms(b) = k · (draft_ms_per_token + draft_ms_per_token_per_seq · (b − 1))
                          + verify_ms + verify_ms_per_seq · (b − 1)

    and ``TPOT(T, b) = iteration_ms(b) / tokens_per_iteration(T)``.
    """

    draft_ms_per_token: float
    verify_ms: float
    draft_ms_per_token_per_seq: float = 0.0
    verify_ms_per_seq: float = 0.0
    draft_length: int = 4

    def __post_init__(self) -> None:
        for name in ("draft_ms_per_token", "verify_ms", "draft_ms_per_token_per_seq", "verify_ms_per_seq"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if self.verify_ms <= 0:
            raise ValueError(f"verify_ms must be > 0, got {self.verify_ms}")
        if self.draft_length < 1:
            raise ValueError(f"draft_length must be >= 1, got {self.draft_length}")

    def iteration_ms(self, batch_size: float) -> float:
        extra = max(batch_size, 1.0) - 1.0
        draft = self.draft_length * (self.draft_ms_per_token + self.draft_ms_per_token_per_seq * extra)
        return draft + self.verify_ms + self.verify_ms_per_seq * extra


class FeedForwardPolicy:
    """Model-predicted T per tier plus a PID trim on the residual TPOT slack (see the module docstring).

    ``tiers`` None ⇒ every unpinned tier with a TPOT target. ``trim_kp``/``trim_ki``/``trim_deadband``/
    ``trim_setpoint`` parameterise the trim PID (gains on slack, output in fractions of the tier's range, limited to
    ``[−1, 1]``). ``grid_points`` sets how finely the range is searched for ``T_ff``.
    """

    name = "feedforward"

    def __init__(
        self,
        slo: SLOSpec,
        curve: SpeedCurve,
        latency: LinearLatencyModel | TPOTPredictor,
        tiers: str | list[str] | tuple[str, ...] | None = None,
        headroom: float = 0.8,
        respect_budget: bool = True,
        trim_kp: float = 0.2,
        trim_ki: float = 0.2,
        trim_deadband: float = 0.02,
        trim_setpoint: float = 0.0,
        max_batch_size: int | None = None,
        grid_points: int = 101,
    ) -> None:
        if not (0 < headroom <= 1):
            raise ValueError(f"headroom must be in (0, 1], got {headroom}")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if grid_points < 2:
            raise ValueError(f"grid_points must be >= 2, got {grid_points}")
        self.slo, self.curve, self.latency = slo, curve, latency
        if tiers is None:
            names = [n for n in controllable_tiers(slo) if slo.tiers[n].tpot_ms is not None]
            if not names:
                raise ValueError("tiers: no unpinned tier has a TPOT target")
        else:
            names = resolve_tiers(slo, tiers)
            for n in names:
                if slo.tiers[n].tpot_ms is None:
                    raise ValueError(f"tiers: tier {n!r} has no TPOT target")
        self.tiers = names
        self.headroom, self.respect_budget = headroom, respect_budget
        self.trim_kp, self.trim_ki, self.trim_deadband = trim_kp, trim_ki, trim_deadband
        self.trim_setpoint = trim_setpoint
        self.max_batch_size, self.grid_points = max_batch_size, grid_points
        self.trims = {
            n: PID(
                trim_kp,
                trim_ki,
                0.0,
                setpoint=trim_setpoint,
                output_limits=(-1.0, 1.0),
                deadband=trim_deadband,
                initial_output=0.0,
            )
            for n in names
        }
        self._grids = {n: self._grid(slo.tiers[n]) for n in names}
        # The curve is fixed: tabulate it on each tier's grid once (decide runs every control tick).
        self._tokens_on_grid = {n: self._interp(g, "tokens_per_iteration") for n, g in self._grids.items()}
        self._budget_caps = {n: self._budget_cap(n) for n in names}
        self.reset()

    def _interp(self, grid: np.ndarray, column: str) -> np.ndarray:
        xs = [p.threshold for p in self.curve.points]
        ys = [float(getattr(p, column)) for p in self.curve.points]
        return np.asarray(np.interp(grid, xs, ys), dtype=float)

    def _grid(self, tier: TierSLO) -> np.ndarray:
        lo, hi = tier.min_threshold, tier.max_threshold
        from_curve = [p.threshold for p in self.curve.points if lo <= p.threshold <= hi]
        return np.unique(np.concatenate([np.linspace(lo, hi, self.grid_points), from_curve]))

    def reset(self) -> None:
        for pid in self.trims.values():
            pid.reset()
        self._last_time_s: float | None = None
        self.last_decision: Decision | None = None

    def predict_tpot_ms(self, threshold: float, batch_size: float) -> float:
        if isinstance(self.latency, LinearLatencyModel):
            return self.latency.iteration_ms(batch_size) / self.curve.tokens_per_iteration(threshold)
        return float(self.latency(threshold, batch_size))

    def batch_size(self, telemetry: Telemetry) -> float:
        batch = max(1.0, telemetry.in_flight / max(1, telemetry.replicas))
        return min(batch, float(self.max_batch_size)) if self.max_batch_size is not None else batch

    def _budget_cap(self, tier_name: str) -> float:
        grid = self._grids[tier_name]
        budget = self.slo.tiers[tier_name].max_mean_distortion
        if not self.respect_budget or budget is None:
            return float(grid[-1])
        within = grid[self._interp(grid, "mean_distortion") <= budget]
        return float(within[-1]) if within.size else float(grid[0])

    def budget_cap(self, tier_name: str) -> float:
        """The largest T whose curve distortion is within the tier's budget (the top without one)."""
        return self._budget_caps[tier_name]

    def feedforward_threshold(self, tier_name: str, batch_size: float) -> float:
        """The smallest T predicted to meet ``headroom · tpot target``, capped by :meth:`budget_cap`."""
        tier = self.slo.tiers[tier_name]
        assert tier.tpot_ms is not None
        grid = self._grids[tier_name]
        if isinstance(self.latency, LinearLatencyModel):
            predicted = self.latency.iteration_ms(batch_size) / self._tokens_on_grid[tier_name]
        else:
            predicted = np.array([self.latency(float(t), batch_size) for t in grid])
        meets = np.flatnonzero(predicted <= self.headroom * tier.tpot_ms)
        chosen = float(grid[meets[0]]) if meets.size else float(grid[-1])
        return min(chosen, self.budget_cap(tier_name))

    def decide(self, telemetry: Telemetry) -> Decision:
        dt = telemetry.window_s if self._last_time_s is None else telemetry.time_s - self._last_time_s
        thresholds = safe_thresholds(self.slo)
        batch = self.batch_size(telemetry)
        parts: list[str] = []
        advance = dt > 0
        if advance:
            self._last_time_s = telemetry.time_s
        for name, trim in self.trims.items():
            tier = self.slo.tiers[name]
            t_ff = self.feedforward_threshold(name, batch)
            u_ff = fraction_from_threshold(tier, t_ff)
            # The trim may only use the room the feed-forward leaves in [0, 1]; tying its limits (and
            # so its integral) to that room is the anti-windup for the combined output.
            trim.set_output_limits(-u_ff, 1.0 - u_ff)
            if advance:
                trim(normalised_slack(telemetry, name, tier, "tpot", clip=2.0), dt)
            fraction = min(max(u_ff + trim.output, 0.0), 1.0)
            # The trim corrects latency; it may not push past the model's quality cap.
            thresholds[name] = min(threshold_from_fraction(tier, fraction), self.budget_cap(name))
            parts.append(f"{name}: batch {batch:.3g} -> T_ff={t_ff:.3g}, trim {trim.output:+.3f}")
        decision = Decision(thresholds=thresholds, reason="feedforward " + "; ".join(parts))
        self.last_decision = decision
        return decision

    def params(self) -> dict[str, Any]:
        return {
            "tiers": list(self.tiers),
            "curve": [[p.threshold, p.tokens_per_iteration, p.mean_distortion] for p in self.curve.points],
            "latency": repr(self.latency),
            "headroom": self.headroom,
            "respect_budget": self.respect_budget,
            "trim_kp": self.trim_kp,
            "trim_ki": self.trim_ki,
            "trim_deadband": self.trim_deadband,
            "trim_setpoint": self.trim_setpoint,
            "max_batch_size": self.max_batch_size,
            "grid_points": self.grid_points,
        }

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"FeedForwardPolicy({inner})"
