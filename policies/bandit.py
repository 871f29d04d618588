"""Non-stationary UCB over a grid of thresholds (optionally × draft length), optionally per load level.

* :func:`ucb_index` — the index formula, pure.
* :class:`SlidingWindowUCB` — the algorithm with ``select()`` / ``update(reward)`` and an injected
  ``numpy.random.Generator`` (ties are broken at random). Statistics cover either the last ``window``
  pulls (SW-UCB) or all pulls discounted by ``discount`` per pull (D-UCB), both from Garivier &
  Moulines, "On upper-confidence bound policies for switching bandit problems" (ALT 2011). Forgetting
  is what lets it follow shifting load: an arm not pulled for a window has its count decay to zero and
  is explored again.
* :class:`BanditPolicy` — the :class:`policies.base.Policy`: each ``decide`` credits the reward of the
  window just observed to the arm played during it, then selects the next arm.

Reward of a window for the controlled tier (higher is better)::

    attainment − distortion_weight · d / budget − distortion_penalty · max(0, d − budget) / budget

``attainment`` is the share of the tier's requests that met every target (rejections count as misses);
``d`` the tier's mean distortion. The small ``distortion_weight`` term breaks ties toward lower T among
arms that all meet the SLO; the large penalty makes over-budget arms lose. Without a budget, ``d``
enters unnormalised.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from policies.decision import Decision
from policies.signals import (
    LOAD_SIGNALS,
    LoadSignal,
    attainment,
    load_level,
    normalised_slack,
    tier_distortion,
)
from policies.slo import LatencyMetric, SLOSpec
from policies.telemetry import Telemetry
from policies.tiers import (
    controllable_tiers,
    fraction_from_threshold,
    resolve_tiers,
    safe_thresholds,
    threshold_from_fraction,
)


def ucb_index(mean: float, count: float, total: float, c: float) -> float:
    """UCB index ``mean + c · sqrt(ln(total) / count)``; ``+inf`` for an arm with no (weighted) pulls.

    ``count`` and ``total`` may be fractional (discounted counts); ``total`` below 1 gives no bonus.
    """
    if count <= 0:
        return math.inf
    return mean + c * math.sqrt(math.log(max(total, 1.0)) / count)


class SlidingWindowUCB:
    """UCB over ``n_arms`` with forgetting: a sliding ``window`` of pulls or a per-pull ``discount``.

    Exactly one of ``window`` / ``discount`` is set. ``select()`` returns the arm with the highest
    :func:`ucb_index` (random among ties, via ``rng``) and remembers it; ``update(reward)`` credits it.
    """

    def __init__(
        self,
        n_arms: int,
        c: float,
        rng: np.random.Generator,
        window: int | None = 100,
        discount: float | None = None,
    ) -> None:
        if n_arms < 1:
            raise ValueError(f"n_arms must be >= 1, got {n_arms}")
        if not (math.isfinite(c) and c >= 0):
            raise ValueError(f"c must be finite and >= 0, got {c}")
        if (window is None) == (discount is None):
            raise ValueError("set exactly one of window (sliding window) or discount (discounted UCB)")
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if discount is not None and not (0 < discount <= 1):
            raise ValueError(f"discount must be in (0, 1], got {discount}")
        self.n_arms, self.c, self.rng = n_arms, c, rng
        self.window, self.discount = window, discount
        self.reset()

    def reset(self) -> None:
        self._history: deque[tuple[int, float]] = deque(maxlen=self.window)
        self._counts = np.zeros(self.n_arms)
        self._sums = np.zeros(self.n_arms)
        self.last_arm: int | None = None
        self.pulls = np.zeros(self.n_arms, dtype=np.int64)  # lifetime, for inspection

    def stats(self) -> tuple[np.ndarray, np.ndarray]:
        """(weighted counts, weighted reward sums) per arm under the current forgetting."""
        if self.window is not None:
            counts = np.zeros(self.n_arms)
            sums = np.zeros(self.n_arms)
            for arm, reward in self._history:
                counts[arm] += 1
                sums[arm] += reward
            return counts, sums
        return self._counts.copy(), self._sums.copy()

    def indices(self) -> np.ndarray:
        counts, sums = self.stats()
        total = float(counts.sum())
        return np.array(
            [
                ucb_index(sums[a] / counts[a] if counts[a] > 0 else 0.0, float(counts[a]), total, self.c)
                for a in range(self.n_arms)
            ]
        )

    def select(self) -> int:
        idx = self.indices()
        best = np.flatnonzero(idx == idx.max())
        arm = int(best[0] if best.size == 1 else self.rng.choice(best))
        self.last_arm = arm
        return arm

    def update(self, reward: float) -> None:
        """Credit ``reward`` to the arm returned by the last :meth:`select`."""
        if self.last_arm is None:
            raise ValueError("update() before any select()")
        if not math.isfinite(reward):
            raise ValueError(f"reward must be finite, got {reward}")
        arm = self.last_arm
        self.pulls[arm] += 1
        if self.window is not None:
            self._history.append((arm, reward))
        else:
            assert self.discount is not None
            self._counts *= self.discount
            self._sums *= self.discount
            self._counts[arm] += 1.0
            self._sums[arm] += reward

    def __repr__(self) -> str:
        return (
            f"SlidingWindowUCB(n_arms={self.n_arms!r}, c={self.c!r}, window={self.window!r}, "
            f"discount={self.discount!r})"
        )


Arm = tuple[float, int | None]


def _parse_arm(arm: float | tuple[float, int]) -> Arm:
    """``T`` or ``(T, k)`` → ``(T, k or None)``."""
    if isinstance(arm, int | float):
        return float(arm), None
    if len(arm) != 2:
        raise ValueError(f"an arm is T or (T, k), got {arm!r}")
    return float(arm[0]), int(arm[1])


class BanditPolicy:
    """Learns which T (and k) earns the most reward at the current load, and follows it as load shifts.

    * ``arms`` — T values for the controlled tier, or ``(T, k)`` pairs (k = draft length, passed on as
      ``Decision.draft_length``); None ⇒ 6 evenly spaced T over the tier's range. Arms outside the
      tier's bounds raise ValueError.
    * ``tier`` — the tier the arms are for (None ⇒ the SLO's default tier). Every other unpinned tier
      gets the same *fraction* of its own range; pinned tiers keep their pin.
    * ``window`` / ``discount`` — forgetting (see :class:`SlidingWindowUCB`); ``discount`` set ⇒
      discounted UCB and ``window`` is ignored.
    * ``c`` — exploration weight. Rewards live in about [−1, 1].
    * ``distortion_weight``, ``distortion_penalty`` — see the module docstring.
    * ``context`` / ``context_bins`` — optional contextual variant: ascending bin edges on a load signal
      (``arrival_rate`` req/s, ``in_flight_per_replica`` or ``queue_depth_per_replica``); each bin keeps
      its own statistics. None ⇒ one bin.
    * ``seed`` — seeds the policy's own ``numpy.random.Generator``.

    A window with no completion for the tier yields no reward: the arm keeps playing, nothing is credited.
    """

    name = "bandit"

    def __init__(
        self,
        slo: SLOSpec,
        arms: Sequence[float | tuple[float, int]] | None = None,
        tier: str | None = None,
        window: int | None = 100,
        discount: float | None = None,
        c: float = 0.2,
        distortion_weight: float = 0.1,
        distortion_penalty: float = 2.0,
        context: LoadSignal = "arrival_rate",
        context_bins: Sequence[float] | None = None,
        seed: int = 0,
    ) -> None:
        self.slo = slo
        self.tier = resolve_tiers(slo, tier if tier is not None else slo.default_tier)[0]
        tier_slo = slo.tiers[self.tier]
        if arms is None:
            arms = [
                round(float(t), 6) for t in np.linspace(tier_slo.min_threshold, tier_slo.max_threshold, 6)
            ]
        self.arms: list[Arm] = []
        for i, arm in enumerate(arms):
            t, k = _parse_arm(arm)
            if not (tier_slo.min_threshold <= t <= tier_slo.max_threshold):
                raise ValueError(
                    f"arms[{i}]: T={t} outside tier {self.tier!r} bounds "
                    f"[{tier_slo.min_threshold}, {tier_slo.max_threshold}]"
                )
            if k is not None and k < 1:
                raise ValueError(f"arms[{i}]: draft length k must be >= 1, got {k}")
            self.arms.append((t, k))
        if not self.arms:
            raise ValueError("arms: at least one arm is required")
        if context not in LOAD_SIGNALS:
            raise ValueError(f"context must be one of {LOAD_SIGNALS}, got {context!r}")
        bins = [float(b) for b in context_bins] if context_bins is not None else []
        if any(not math.isfinite(b) for b in bins) or any(
            b2 <= b1 for b1, b2 in zip(bins, bins[1:], strict=False)
        ):
            raise ValueError(f"context_bins must be finite and strictly ascending, got {bins}")
        for name, value in (
            ("distortion_weight", distortion_weight),
            ("distortion_penalty", distortion_penalty),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if discount is not None:
            window = None
        self.window, self.discount, self.c = window, discount, c
        self.distortion_weight, self.distortion_penalty = distortion_weight, distortion_penalty
        self.context: LoadSignal = context
        self.context_bins = bins
        self.seed = seed
        # Validate the algorithm parameters once, up front.
        SlidingWindowUCB(len(self.arms), c, np.random.default_rng(0), window=window, discount=discount)
        self.reset()

    def reset(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.learners = [
            SlidingWindowUCB(len(self.arms), self.c, self.rng, window=self.window, discount=self.discount)
            for _ in range(len(self.context_bins) + 1)
        ]
        self._playing: tuple[int, int] | None = None  # (context bin, arm) in play since the last decide
        self.last_decision: Decision | None = None
        self.last_reward: float = math.nan

    def context_bin(self, telemetry: Telemetry) -> int:
        if not self.context_bins:
            return 0
        return int(np.searchsorted(self.context_bins, load_level(telemetry, self.context), side="right"))

    def reward(self, telemetry: Telemetry) -> float:
        """Reward of one window for the controlled tier (NaN when the window has no evidence)."""
        tier = self.slo.tiers[self.tier]
        met = attainment(telemetry, self.tier)
        if math.isnan(met) and self.tier not in telemetry.tiers:
            # Telemetry not split by tier: all-or-nothing on the aggregate percentiles, less rejections.
            metrics: tuple[LatencyMetric, ...] = ("ttft", "tpot", "e2e")
            slacks = [
                normalised_slack(telemetry, self.tier, tier, m) for m in metrics if tier.latency_target(m)
            ]
            if telemetry.completions > 0 and slacks and not any(math.isnan(s) for s in slacks):
                ok = 1.0 if all(s <= 0 for s in slacks) else 0.0
                met = ok * telemetry.completions / (telemetry.completions + telemetry.rejections)
        if math.isnan(met):
            return math.nan
        distortion = tier_distortion(telemetry, self.tier)
        if math.isnan(distortion):
            distortion = 0.0
        budget = tier.max_mean_distortion
        if budget is None or budget <= 0:
            return met - self.distortion_weight * distortion
        return (
            met
            - self.distortion_weight * distortion / budget
            - self.distortion_penalty * max(0.0, distortion - budget) / budget
        )

    def _decision(self, arm_index: int, reason: str) -> Decision:
        t, k = self.arms[arm_index]
        controlled = self.slo.tiers[self.tier]
        fraction = fraction_from_threshold(controlled, t)
        thresholds = safe_thresholds(self.slo)
        for name in controllable_tiers(self.slo):
            thresholds[name] = threshold_from_fraction(self.slo.tiers[name], fraction)
        thresholds[self.tier] = controlled.clamp(t)
        return Decision(thresholds=thresholds, draft_length=k, reason=reason)

    def decide(self, telemetry: Telemetry) -> Decision:
        reward = self.reward(telemetry) if self._playing is not None else math.nan
        self.last_reward = reward
        if self._playing is not None and not math.isfinite(reward):  # no (or unusable) evidence
            bin_index, arm = self._playing
            decision = self._decision(arm, f"bandit: no evidence for tier {self.tier!r}, keep arm {arm}")
            self.last_decision = decision
            return decision
        if self._playing is not None:
            bin_index, arm = self._playing
            self.learners[bin_index].last_arm = arm
            self.learners[bin_index].update(reward)
        bin_index = self.context_bin(telemetry)
        arm = self.learners[bin_index].select()
        self._playing = (bin_index, arm)
        credit = "" if not math.isfinite(reward) else f"reward {reward:+.3f}; "
        decision = self._decision(arm, f"bandit: {credit}context bin {bin_index}, arm {arm} {self.arms[arm]}")
        self.last_decision = decision
        return decision

    def params(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "arms": [list(a) if a[1] is not None else a[0] for a in self.arms],
            "window": self.window,
            "discount": self.discount,
            "c": self.c,
            "distortion_weight": self.distortion_weight,
            "distortion_penalty": self.distortion_penalty,
            "context": self.context,
            "context_bins": list(self.context_bins),
            "seed": self.seed,
        }

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"BanditPolicy({inner})"
