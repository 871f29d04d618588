"""Non-stationary UCB over a grid of thresholds (optionally × draft length), optionally per load level.

* :func:`ucb_index` — the index formula, pure.
* :class:`SlidingWindowUCB` — the algorithm with ``select()`` / ``update(reward)`` and an injected
  ``numpy.random.Generator`` (ties are broken at random). Statistics cover either the last ``window``
  pulls (SW-UCB) or all pulls discounted by ``discount`` per pull (D-UCB), both from Garivier &
  Moulines, "On upper-confidence bound policies for switching bandit problems" (ALT 2011). Forgetting
  is what lets it follow shifting load: an arm not pulled for a window has its count decay to zero and
  is explored again.
* :class:`BanditPolicy` — the :class:`policies.base.Policy`. The reward of a window is *lagged*: the
  requests finishing in it arrived up to an E2E latency earlier (10–20 s on the default pair), maybe
  under another arm. So a window is credited to the arm in play only when every request finishing in
  it arrived after that arm was pushed — ``window start − p99 E2E of the tier's finishing requests
  >= the arm's push time`` — i.e. the requests ran under that arm; windows that mix arms are not
  credited. An arm stays in play until it has earned ``min_credited`` windows, then the next is
  selected (keeping the same arm keeps its push time).

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

    * ``arms`` — T values for the controlled tier, or ``(T, k)`` pairs (k >= 0 = draft length, 0 = plain
      decoding, passed on in ``Decision.draft_lengths`` for every unpinned tier); None ⇒ 6 evenly spaced
      T over the tier's range. Arms outside the tier's bounds raise ValueError.
    * ``tier`` — the tier the arms are for (None ⇒ the SLO's default tier). Every other unpinned tier
      gets the same *fraction* of its own range; pinned tiers keep their pin.
    * ``min_credited`` — credited windows an arm earns before the next selection (see the module
      docstring: only windows whose finishing requests all ran under the arm are credited).
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
        min_credited: int = 3,
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
            if k is not None and k < 0:
                raise ValueError(f"arms[{i}]: draft length k must be >= 0, got {k}")
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
        if min_credited < 1:
            raise ValueError(f"min_credited must be >= 1, got {min_credited}")
        self.min_credited = min_credited
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
        self._playing: tuple[int, int] | None = None  # (context bin, arm) in play
        self._pushed_s = math.nan  # when the arm in play was pushed (telemetry time of its decision)
        self._credited = 0  # windows credited to the arm in play
        self.last_decision: Decision | None = None
        self.last_reward: float = math.nan
        self.credit_log: list[tuple[float, int, float]] = []  # (window time, arm credited, reward)

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
        draft_lengths = {} if k is None else {name: k for name in controllable_tiers(self.slo)}
        return Decision(thresholds=thresholds, draft_lengths=draft_lengths, reason=reason)

    def ran_under_arm_in_play(self, telemetry: Telemetry) -> bool:
        """Did every request finishing in this window arrive after the arm in play was pushed?

        The oldest finishing request arrived about one p99 E2E before the window opened, at the
        latest; no E2E evidence (nothing finished) ⇒ False.
        """
        window = telemetry.tiers.get(self.tier)
        e2e = window.e2e if window is not None else telemetry.e2e
        if e2e.count <= 0 or math.isnan(e2e.p99_ms) or math.isnan(self._pushed_s):
            return False
        oldest_arrival_s = telemetry.time_s - telemetry.window_s - e2e.p99_ms / 1000.0
        return oldest_arrival_s >= self._pushed_s

    def decide(self, telemetry: Telemetry) -> Decision:
        reward = math.nan
        note = ""
        if self._playing is not None:
            bin_index, arm = self._playing
            reward = self.reward(telemetry)
            if math.isfinite(reward) and self.ran_under_arm_in_play(telemetry):
                self.learners[bin_index].last_arm = arm
                self.learners[bin_index].update(reward)
                self._credited += 1
                self.credit_log.append((telemetry.time_s, arm, reward))
                note = f"reward {reward:+.3f} credited to arm {arm}; "
            elif math.isfinite(reward):
                note = "window's requests ran partly under an earlier arm, not credited; "
                reward = math.nan
            else:
                note = f"no evidence for tier {self.tier!r}; "
        self.last_reward = reward
        if self._playing is not None and self._credited < self.min_credited:
            bin_index, arm = self._playing
            decision = self._decision(
                arm, f"bandit: {note}keep arm {arm} ({self._credited}/{self.min_credited} credited)"
            )
            self.last_decision = decision
            return decision
        bin_index = self.context_bin(telemetry)
        arm = self.learners[bin_index].select()
        if self._playing != (bin_index, arm):
            self._pushed_s = telemetry.time_s
        self._playing = (bin_index, arm)
        self._credited = 0
        decision = self._decision(arm, f"bandit: {note}context bin {bin_index}, arm {arm} {self.arms[arm]}")
        self.last_decision = decision
        return decision

    def params(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "min_credited": self.min_credited,
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
