"""Wrappers every policy can be put in: bounds, rate limit, hysteresis, quality budget, fail-safe.

Each wrapper is itself a :class:`policies.base.Policy` around an ``inner`` one, so they compose; the
same wrapper code applies to every policy. The order :func:`guarded` builds (innermost first)::

    inner → TierClamp → RateLimit → Hysteresis → QualityGuard → FailSafe

Bounds first; smoothing (rate limit, hysteresis) next; then the quality budget, which may cut T at once
whatever the smoothing says (quality wins over latency); the fail-safe outermost, so lost control always
reaches the safe thresholds immediately.

Rates and step sizes are fractions of each tier's T range per second / per step (see
:mod:`policies.tiers`). A wrapper's ``last_decision`` is the decision it returned last.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from policies.base import Policy
from policies.decision import Decision
from policies.signals import tier_distortion
from policies.slo import SLOSpec
from policies.telemetry import Telemetry
from policies.tiers import (
    fraction_from_threshold,
    pinned_thresholds,
    safe_thresholds,
    threshold_from_fraction,
    tier_range,
)


def _check_positive(name: str, value: float, allow_zero: bool = False) -> None:
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ValueError(f"{name} must be finite and {'>=' if allow_zero else '>'} 0, got {value}")


class _Wrapper:
    """Common plumbing: the inner policy, the SLO, and the thresholds last emitted."""

    name = "wrapper"

    def __init__(self, inner: Policy, slo: SLOSpec) -> None:
        self.inner = inner
        self.slo = slo
        self.last_decision: Decision | None = None
        self._current: dict[str, float] = {}

    def reset(self) -> None:
        self.inner.reset()
        self.last_decision = None
        self._current = {}

    def _emit(self, decision: Decision) -> Decision:
        self._current.update(decision.thresholds)
        self.last_decision = decision
        return decision

    def _current_threshold(self, name: str, telemetry: Telemetry) -> float | None:
        """The T the tier runs at: what this wrapper sent last, else what the telemetry reports."""
        if name in self._current:
            return self._current[name]
        window = telemetry.tiers.get(name)
        return window.threshold if window is not None else None

    def params(self) -> dict[str, Any]:
        return {}

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        sep = ", " if inner else ""
        return f"{type(self).__name__}({self.inner!r}{sep}{inner})"


class TierClamp(_Wrapper):
    """Clamps every T into its tier's bounds and sets every pinned tier to its pin (k passes through:
    it does not change what is emitted, only how fast).

    Tiers the inner policy names but the SLO does not know are dropped (and said so in the reason)
    rather than crashing the control loop.
    """

    name = "clamp"

    def decide(self, telemetry: Telemetry) -> Decision:
        inner = self.inner.decide(telemetry)
        unknown = sorted(set(inner.thresholds) - set(self.slo.tiers))
        thresholds = {
            name: self.slo.tiers[name].clamp(t)
            for name, t in inner.thresholds.items()
            if name in self.slo.tiers
        }
        thresholds.update(pinned_thresholds(self.slo))
        unknown_k = sorted(set(inner.draft_lengths) - set(self.slo.tiers))
        draft_lengths = {name: k for name, k in inner.draft_lengths.items() if name in self.slo.tiers}
        dropped = sorted(set(unknown) | set(unknown_k))
        reason = inner.reason + (f" [clamp: dropped unknown tiers {dropped}]" if dropped else "")
        return self._emit(Decision(thresholds, draft_lengths, batch_cap=inner.batch_cap, replicas=inner.replicas,
                                   reason=reason))


class RateLimit(_Wrapper):
    """Bounds how fast each tier's T moves: at most ``max_rate`` of the tier's range per second.

    ``dt`` is the time between consecutive telemetry windows (``window_s`` for the first one).
    """

    name = "rate_limit"

    def __init__(self, inner: Policy, slo: SLOSpec, max_rate: float) -> None:
        _check_positive("max_rate", max_rate)
        super().__init__(inner, slo)
        self.max_rate = max_rate
        self._last_time_s: float | None = None

    def reset(self) -> None:
        super().reset()
        self._last_time_s = None

    def decide(self, telemetry: Telemetry) -> Decision:
        inner = self.inner.decide(telemetry)
        dt = telemetry.window_s if self._last_time_s is None else telemetry.time_s - self._last_time_s
        dt = max(dt, 0.0)
        self._last_time_s = telemetry.time_s
        thresholds: dict[str, float] = {}
        limited: list[str] = []
        for name, target in inner.thresholds.items():
            current = self._current_threshold(name, telemetry)
            tier = self.slo.tiers.get(name)
            if current is None or tier is None:
                thresholds[name] = target
                continue
            step = self.max_rate * dt * tier_range(tier)
            value = min(max(target, current - step), current + step)
            if value != target:
                limited.append(name)
            thresholds[name] = value
        reason = inner.reason + (f" [rate-limited: {', '.join(limited)}]" if limited else "")
        return self._emit(Decision(thresholds, inner.draft_lengths, batch_cap=inner.batch_cap, replicas=inner.replicas,
                                   reason=reason))

    def params(self) -> dict[str, Any]:
        return {"max_rate": self.max_rate}


class Hysteresis(_Wrapper):
    """Ignores changes of T smaller than ``min_change`` of the tier's range (keeps the current T).

    Every push of a new T costs a broadcast to all replicas; this keeps noise from churning it.
    """

    name = "hysteresis"

    def __init__(self, inner: Policy, slo: SLOSpec, min_change: float) -> None:
        _check_positive("min_change", min_change)
        super().__init__(inner, slo)
        self.min_change = min_change

    def decide(self, telemetry: Telemetry) -> Decision:
        inner = self.inner.decide(telemetry)
        thresholds: dict[str, float] = {}
        for name, target in inner.thresholds.items():
            current = self._current_threshold(name, telemetry)
            tier = self.slo.tiers.get(name)
            if (
                current is not None
                and tier is not None
                and abs(target - current) < self.min_change * tier_range(tier)
            ):
                thresholds[name] = current
            else:
                thresholds[name] = target
        return self._emit(Decision(thresholds, inner.draft_lengths, batch_cap=inner.batch_cap, replicas=inner.replicas,
                                   reason=inner.reason))

    def params(self) -> dict[str, Any]:
        return {"min_change": self.min_change}


class QualityGuard(_Wrapper):
    """The distortion budget wins: caps T per tier so the windowed distortion stays within budget.

    For every tier with ``max_mean_distortion`` the guard keeps an exponentially weighted estimate of
    the tier's windowed mean distortion (weight ``alpha`` on the newest window) and a cap on T, as a
    fraction of the tier's range (AIMD, as in TCP congestion control):

    * estimate above ``(1 − margin) · budget`` ⇒ multiplicative back-off: ``cap = backoff · min(cap,
      current)``, at most once per ``cooldown_s`` (None ⇒ two windows) so the lag between a new T and
      the distortion it produces is not punished twice;
    * otherwise the cap recovers additively at ``recover_rate`` of the range per second.

    The emitted T is ``min(inner T, cap)``. Windows without tokens leave the estimate unchanged.
    """

    name = "quality"

    def __init__(
        self,
        inner: Policy,
        slo: SLOSpec,
        backoff: float = 0.7,
        alpha: float = 0.5,
        margin: float = 0.1,
        recover_rate: float = 0.02,
        cooldown_s: float | None = None,
    ) -> None:
        if not (0 < backoff < 1):
            raise ValueError(f"backoff must be in (0, 1), got {backoff}")
        if not (0 < alpha <= 1):
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not (0 <= margin < 1):
            raise ValueError(f"margin must be in [0, 1), got {margin}")
        _check_positive("recover_rate", recover_rate, allow_zero=True)
        if cooldown_s is not None:
            _check_positive("cooldown_s", cooldown_s, allow_zero=True)
        super().__init__(inner, slo)
        self.backoff, self.alpha, self.margin = backoff, alpha, margin
        self.recover_rate, self.cooldown_s = recover_rate, cooldown_s
        self.budgets = {
            name: tier.max_mean_distortion
            for name, tier in slo.tiers.items()
            if tier.max_mean_distortion is not None and tier_range(tier) > 0
        }
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.estimate: dict[str, float] = {name: math.nan for name in self.budgets}
        self.cap: dict[str, float] = {name: 1.0 for name in self.budgets}
        self._last_backoff_s: dict[str, float] = {}
        self._last_time_s: float | None = None

    def decide(self, telemetry: Telemetry) -> Decision:
        dt = telemetry.window_s if self._last_time_s is None else telemetry.time_s - self._last_time_s
        dt = max(dt, 0.0)
        self._last_time_s = telemetry.time_s
        cooldown = self.cooldown_s if self.cooldown_s is not None else 2.0 * telemetry.window_s
        notes: list[str] = []
        for name, budget in self.budgets.items():
            tier = self.slo.tiers[name]
            observed = tier_distortion(telemetry, name)
            if not math.isnan(observed):
                old = self.estimate[name]
                self.estimate[name] = (
                    observed if math.isnan(old) else self.alpha * observed + (1 - self.alpha) * old
                )
            estimate = self.estimate[name]
            if not math.isnan(estimate) and estimate > (1 - self.margin) * budget:
                last = self._last_backoff_s.get(name)
                if last is None or telemetry.time_s - last >= cooldown:
                    current = self._current_threshold(name, telemetry)
                    running = 1.0 if current is None else fraction_from_threshold(tier, current)
                    self.cap[name] = self.backoff * min(self.cap[name], running)
                    self._last_backoff_s[name] = telemetry.time_s
                    notes.append(f"{name}: distortion {estimate:.3g} > budget {budget:.3g}, back off")
            else:
                self.cap[name] = min(1.0, self.cap[name] + self.recover_rate * dt)

        inner = self.inner.decide(telemetry)
        thresholds = dict(inner.thresholds)
        for name in self.budgets:
            cap_t = threshold_from_fraction(self.slo.tiers[name], self.cap[name])
            current = thresholds.get(name, self._current_threshold(name, telemetry))
            if current is not None and current > cap_t:
                thresholds[name] = cap_t
                notes.append(f"{name}: T capped at {cap_t:.3g}")
        reason = inner.reason + (f" [quality: {'; '.join(notes)}]" if notes else "")
        return self._emit(Decision(thresholds, inner.draft_lengths, batch_cap=inner.batch_cap, replicas=inner.replicas,
                                   reason=reason))

    def params(self) -> dict[str, Any]:
        return {
            "backoff": self.backoff,
            "alpha": self.alpha,
            "margin": self.margin,
            "recover_rate": self.recover_rate,
            "cooldown_s": self.cooldown_s,
        }


class FailSafe(_Wrapper):
    """Lost control ⇒ every tier to its safe T (0 = lossless) at once, with the reason; draft lengths
    are left as they are (k changes speed, never what is emitted).

    Control counts as lost when the telemetry is older than ``stale_after_s`` (``age_s``), when its
    time went backwards (the inner policy is then reset: its state belongs to another timeline), or
    when it arrives more than ``max_gap_s`` after the previous window (None ⇒ no gap check). The inner
    policy is not consulted on such a window; the next fresh window goes to it again.
    """

    name = "failsafe"

    def __init__(
        self, inner: Policy, slo: SLOSpec, stale_after_s: float = 5.0, max_gap_s: float | None = None
    ) -> None:
        _check_positive("stale_after_s", stale_after_s)
        if max_gap_s is not None:
            _check_positive("max_gap_s", max_gap_s)
        super().__init__(inner, slo)
        self.stale_after_s = stale_after_s
        self.max_gap_s = max_gap_s
        self._last_time_s: float | None = None

    def reset(self) -> None:
        super().reset()
        self._last_time_s = None

    def _lost_control(self, telemetry: Telemetry) -> str | None:
        if not (telemetry.age_s <= self.stale_after_s):  # NaN age counts as stale
            return f"telemetry is stale (age {telemetry.age_s:.3g}s > {self.stale_after_s:.3g}s)"
        last = self._last_time_s
        if last is not None and telemetry.time_s < last:
            self.inner.reset()
            return f"telemetry time went backwards ({telemetry.time_s:.6g}s after {last:.6g}s)"
        if last is not None and self.max_gap_s is not None and telemetry.time_s - last > self.max_gap_s:
            return f"telemetry gap {telemetry.time_s - last:.3g}s > {self.max_gap_s:.3g}s"
        return None

    def decide(self, telemetry: Telemetry) -> Decision:
        problem = self._lost_control(telemetry)
        self._last_time_s = telemetry.time_s
        if problem is not None:
            return self._emit(Decision(safe_thresholds(self.slo), reason=f"fail-safe: {problem}"))
        return self._emit(self.inner.decide(telemetry))

    def params(self) -> dict[str, Any]:
        return {"stale_after_s": self.stale_after_s, "max_gap_s": self.max_gap_s}


def guarded(
    inner: Policy,
    slo: SLOSpec,
    *,
    quality: bool | Mapping[str, Any] = True,
    stale_after_s: float | None = 5.0,
    max_gap_s: float | None = None,
    max_rate: float | None = None,
    min_change: float | None = None,
) -> Policy:
    """``inner`` wrapped in the standard order: clamp → rate limit → hysteresis → quality → fail-safe.

    ``quality``: True (the guard at its defaults), False (none) or :class:`QualityGuard`'s keyword arguments.
    """
    policy: Policy = TierClamp(inner, slo)
    if max_rate is not None:
        policy = RateLimit(policy, slo, max_rate)
    if min_change is not None:
        policy = Hysteresis(policy, slo, min_change)
    if quality is True:
        policy = QualityGuard(policy, slo)
    elif quality is not False:
        policy = QualityGuard(policy, slo, **quality)
    if stale_after_s is not None:
        policy = FailSafe(policy, slo, stale_after_s=stale_after_s, max_gap_s=max_gap_s)
    return policy
