"""Wrappers: FailSafe, QualityGuard (closed loop against a distortion plant), TierClamp, RateLimit,
Hysteresis, and the standard composition order."""

from __future__ import annotations

import math

import numpy as np
import pytest

from policies.decision import Decision
from policies.guards import FailSafe, Hysteresis, QualityGuard, RateLimit, TierClamp, guarded
from policies.pid import PIDPolicy
from policies.slo import TierSLO
from policies.static import StaticPolicy
from policies.telemetry import Telemetry
from tests.policies.builders import make_slo, make_telemetry, make_tier_window
from tests.policies.plants import DistortionPlant


class Scripted:
    """An inner policy that returns whatever the test queued (the wrappers are what is under test)."""

    def __init__(self, *decisions: Decision) -> None:
        self.queue = list(decisions)
        self.calls = 0
        self.resets = 0

    def decide(self, telemetry: Telemetry) -> Decision:
        self.calls += 1
        return self.queue.pop(0) if len(self.queue) > 1 else self.queue[0]

    def reset(self) -> None:
        self.resets += 1


# --- FailSafe ------------------------------------------------------------------------------------


def test_stale_telemetry_sends_every_tier_to_its_safe_threshold() -> None:
    slo = make_slo(economy={"safe_threshold": 0.5})
    inner = Scripted(Decision({"standard": 0.8, "economy": 3.0, "lossless": 0.0}))
    policy = FailSafe(inner, slo, stale_after_s=5.0)
    assert policy.decide(make_telemetry(time_s=1.0, age_s=1.0)).thresholds["standard"] == 0.8
    decision = policy.decide(make_telemetry(time_s=2.0, age_s=6.0))
    assert decision.thresholds == {"lossless": 0.0, "standard": 0.0, "economy": 0.5}
    assert "stale" in decision.reason and "age 6" in decision.reason
    assert inner.calls == 1  # stale data never reaches the inner policy
    # Fresh telemetry again: the inner policy is back in charge.
    assert policy.decide(make_telemetry(time_s=3.0, age_s=0.5)).thresholds["standard"] == 0.8


def test_nan_age_counts_as_stale() -> None:
    policy = FailSafe(Scripted(Decision({"standard": 0.8})), make_slo(), stale_after_s=5.0)
    assert policy.decide(make_telemetry(age_s=math.nan)).thresholds["standard"] == 0.0


def test_time_going_backwards_is_lost_control_and_resets_the_inner_policy() -> None:
    inner = Scripted(Decision({"standard": 0.8}))
    policy = FailSafe(inner, make_slo())
    policy.decide(make_telemetry(time_s=100.0))
    decision = policy.decide(make_telemetry(time_s=3.0))
    assert decision.thresholds["standard"] == 0.0
    assert "went backwards" in decision.reason
    assert inner.resets == 1
    # The new timeline is then accepted.
    assert policy.decide(make_telemetry(time_s=4.0)).thresholds["standard"] == 0.8


def test_a_gap_longer_than_max_gap_is_lost_control() -> None:
    policy = FailSafe(Scripted(Decision({"standard": 0.8})), make_slo(), max_gap_s=3.0)
    policy.decide(make_telemetry(time_s=1.0))
    decision = policy.decide(make_telemetry(time_s=10.0))
    assert decision.thresholds["standard"] == 0.0 and "gap" in decision.reason


def test_fail_safe_keeps_a_pinned_tier_at_its_pin() -> None:
    tiers = dict(make_slo().tiers)
    tiers["pinned"] = TierSLO(fixed_threshold=0.5, max_threshold=1.0)
    slo = make_slo(tiers=tiers)
    decision = FailSafe(Scripted(Decision({})), slo).decide(make_telemetry(age_s=60.0))
    assert decision.thresholds["pinned"] == 0.5 and decision.thresholds["standard"] == 0.0


def test_fail_safe_in_front_of_a_real_policy_holds_it_during_staleness() -> None:
    slo = make_slo()
    pid = PIDPolicy(slo, tiers="standard")
    policy = FailSafe(pid, slo, stale_after_s=2.0)
    for i in range(10):
        policy.decide(make_telemetry(time_s=float(i + 1), tpot_ms=120.0))
    assert pid.last_decision is not None and pid.last_decision.thresholds["standard"] > 0.5
    for i in range(10, 15):
        assert policy.decide(make_telemetry(time_s=float(i + 1), age_s=3.0)).thresholds["standard"] == 0.0, (
            f"tick {i}"
        )


# --- QualityGuard --------------------------------------------------------------------------------

WARM_UP = 20


@pytest.mark.parametrize(("slope", "seed"), [(0.16, 0), (0.3, 1), (0.6, 2), (0.3, 3)])
def test_quality_guard_keeps_windowed_distortion_within_budget(slope: float, seed: int) -> None:
    """Inner policy always asks for T = 1; distortion = slope · T (one window late, 10 % noise).

    After a 20-window warm-up every 10-window mean of the distortion is within the 0.15 budget, and the
    guard does not over-throttle: the mean T stays ≥ 60 % of the T that exactly spends the budget.
    """
    slo = make_slo()
    budget = slo.tiers["standard"].max_mean_distortion
    assert budget == 0.15
    policy = QualityGuard(TierClamp(StaticPolicy(slo, 1.0), slo), slo)
    plant = DistortionPlant(seed, slope=slope)
    threshold = 1.0
    distortions, thresholds = [], []
    for i in range(300):
        d = plant.distortion(threshold)
        window = make_tier_window(threshold=threshold, mean_distortion=d)
        threshold = policy.decide(make_telemetry(time_s=float(i + 1), tiers={"standard": window})).thresholds[
            "standard"
        ]
        distortions.append(d)
        thresholds.append(threshold)
    after = np.array(distortions[WARM_UP:])
    rolling = np.convolve(after, np.ones(10) / 10, mode="valid")
    for i, value in enumerate(rolling):
        assert value <= budget, f"windows {WARM_UP + i}..{WARM_UP + i + 9}: mean distortion {value:.3f}"
    assert np.mean(thresholds[WARM_UP:]) >= 0.6 * min(1.0, budget / slope)


@pytest.mark.parametrize(("slope", "seed"), [(0.16, 0), (0.3, 1), (0.6, 2), (0.3, 3)])
def test_the_shipped_policys_quality_guard_is_a_safety_net_at_the_budget(slope: float, seed: int) -> None:
    """The shipped SLO policy's guard (DEFAULT_POLICY_SPEC: ~10-window average, backs off above the budget
    itself) against the same plant: the run's mean distortion stays within budget and every 30-window mean
    within 6 % of it, and it spends more of the budget (higher mean T) than the default guard."""
    from policies.registry import DEFAULT_POLICY_SPEC

    slo = make_slo()
    budget = slo.tiers["standard"].max_mean_distortion
    assert budget is not None
    shipped = DEFAULT_POLICY_SPEC["guards"]["quality"]
    runs = {}
    for name, params in (("default", {}), ("shipped", shipped)):
        policy = QualityGuard(TierClamp(StaticPolicy(slo, 1.0), slo), slo, **params)
        plant = DistortionPlant(seed, slope=slope)
        threshold, distortions, thresholds = 1.0, [], []
        for i in range(300):
            d = plant.distortion(threshold)
            window = make_tier_window(threshold=threshold, mean_distortion=d)
            threshold = policy.decide(make_telemetry(time_s=float(i + 1), tiers={"standard": window})).thresholds[
                "standard"]
            distortions.append(d)
            thresholds.append(threshold)
        runs[name] = (np.array(distortions[WARM_UP:]), np.mean(thresholds[WARM_UP:]))
    after, mean_t = runs["shipped"]
    assert after.mean() <= budget
    assert np.convolve(after, np.ones(30) / 30, mode="valid").max() <= 1.06 * budget
    assert mean_t > runs["default"][1]


def test_quality_guard_leaves_tiers_without_budget_and_holds_estimate_without_tokens() -> None:
    slo = make_slo()  # lossless has no budget (and is pinned); economy has 0.35
    policy = QualityGuard(Scripted(Decision({"standard": 1.0, "economy": 4.0, "lossless": 0.0})), slo)
    assert set(policy.budgets) == {"standard", "economy"}
    policy.decide(make_telemetry(tiers={"standard": make_tier_window(threshold=1.0, mean_distortion=0.5)}))
    estimate = policy.estimate["standard"]
    assert estimate == 0.5
    empty = make_tier_window(threshold=1.0, completions=0, output_tokens=0, mean_distortion=0.0)
    policy.decide(make_telemetry(time_s=2.0, tiers={"standard": empty}))
    assert policy.estimate["standard"] == estimate


def test_quality_guard_backs_off_multiplicatively_then_recovers_additively() -> None:
    slo = make_slo()
    policy = QualityGuard(
        Scripted(Decision({"standard": 1.0})), slo, backoff=0.5, recover_rate=0.1, cooldown_s=0.0
    )
    high = make_tier_window(threshold=1.0, mean_distortion=0.3)
    assert policy.decide(make_telemetry(time_s=1.0, tiers={"standard": high})).thresholds["standard"] == 0.5
    assert "back off" in (policy.last_decision.reason if policy.last_decision else "")
    low = make_tier_window(threshold=0.5, mean_distortion=0.0)
    # EWMA (alpha 0.5): 0.3 → 0.15, still over 0.135 → 0.25; → 0.075 (under) → +0.1 per second.
    expected = [0.25, 0.35, 0.45, 0.55]
    for i, want in enumerate(expected):
        got = policy.decide(make_telemetry(time_s=float(i + 2), tiers={"standard": low})).thresholds[
            "standard"
        ]
        assert got == pytest.approx(want), f"tick {i}"


# --- TierClamp, RateLimit, Hysteresis ------------------------------------------------------------


def test_tier_clamp_bounds_every_tier_pins_fixed_ones_and_drops_unknown() -> None:
    slo = make_slo()
    inner = Scripted(Decision({"standard": 7.0, "economy": 2.5, "lossless": 0.9, "gold": 0.3}, reason="x"))
    decision = TierClamp(inner, slo).decide(make_telemetry())
    assert decision.thresholds == {"standard": 1.0, "economy": 2.5, "lossless": 0.0}
    assert "dropped unknown tiers ['gold']" in decision.reason


def test_rate_limit_moves_each_tier_at_most_max_rate_of_its_range_per_second() -> None:
    slo = make_slo()
    policy = RateLimit(Scripted(Decision({"standard": 1.0, "economy": 4.0})), slo, max_rate=0.25)
    # No T known yet on the first window: the telemetry says both tiers run at 0.
    tiers = {"standard": make_tier_window(threshold=0.0), "economy": make_tier_window(threshold=0.0)}
    expected_standard = [0.25, 0.5, 0.75, 1.0, 1.0]
    for i, want in enumerate(expected_standard):
        decision = policy.decide(make_telemetry(time_s=float(i + 1), tiers=tiers))
        assert decision.thresholds["standard"] == pytest.approx(want), f"tick {i}"
        assert decision.thresholds["economy"] == pytest.approx(4 * want), f"tick {i}"


def test_hysteresis_ignores_small_changes() -> None:
    slo = make_slo()
    inner = Scripted(
        Decision({"standard": 0.5}),
        Decision({"standard": 0.52}),
        Decision({"standard": 0.49}),
        Decision({"standard": 0.6}),
    )
    policy = Hysteresis(inner, slo, min_change=0.05)
    got = [policy.decide(make_telemetry(time_s=float(i + 1))).thresholds["standard"] for i in range(4)]
    assert got == [0.5, 0.5, 0.5, 0.6]


def test_guarded_composes_in_the_documented_order() -> None:
    slo = make_slo()
    policy = guarded(StaticPolicy(slo, 0.5), slo, max_rate=0.5, min_change=0.01)
    chain = []
    node: object = policy
    while node is not None:
        chain.append(type(node).__name__)
        node = getattr(node, "inner", None)
    assert chain == ["FailSafe", "QualityGuard", "Hysteresis", "RateLimit", "TierClamp", "StaticPolicy"]
    assert "FailSafe(QualityGuard(Hysteresis(RateLimit(TierClamp(StaticPolicy(" in repr(policy)


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda slo: FailSafe(StaticPolicy(slo, 0.0), slo, stale_after_s=0.0), "stale_after_s"),
        (lambda slo: RateLimit(StaticPolicy(slo, 0.0), slo, max_rate=-1.0), "max_rate"),
        (lambda slo: QualityGuard(StaticPolicy(slo, 0.0), slo, backoff=1.5), "backoff"),
        (lambda slo: Hysteresis(StaticPolicy(slo, 0.0), slo, min_change=math.inf), "min_change"),
    ],
)
def test_bad_wrapper_parameters_raise_naming_the_field(build, field: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=field):
        build(make_slo())
