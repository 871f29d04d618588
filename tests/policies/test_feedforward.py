"""FeedForwardPolicy and its plain-data model (SpeedCurve, LinearLatencyModel), plus StaticPolicy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from policies.feedforward import FeedForwardPolicy, LinearLatencyModel, SpeedCurve, SpeedPoint
from policies.static import StaticPolicy
from tests.policies.builders import make_slo, make_telemetry

# The shipped default figures (SmolLM2 fp32 + int8 self-draft, k=4): 3.0 tokens/iteration at T=0,
# 4.3 at KL ≤ 1, 4.8 accepting everything; 11 ms per draft token, 63 ms per verify, +5 ms per sequence.
CURVE = SpeedCurve.from_points([(0.0, 3.0, 0.0), (1.0, 4.3, 0.12), (4.0, 4.8, 0.3)])
LATENCY = LinearLatencyModel(draft_ms_per_token=11.0, verify_ms=63.0, verify_ms_per_seq=5.0)


def test_speed_curve_interpolates_and_is_flat_outside() -> None:
    assert CURVE.tokens_per_iteration(0.5) == pytest.approx(3.65)
    assert CURVE.tokens_per_iteration(10.0) == 4.8
    assert CURVE.mean_distortion(2.5) == pytest.approx(0.21)
    assert (
        SpeedCurve.from_points([{"threshold": 1.0, "tokens_per_iteration": 2.0}]).mean_distortion(0.0) == 0.0
    )


def test_speed_curve_rejects_bad_points() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        SpeedCurve((SpeedPoint(1.0, 3.0), SpeedPoint(1.0, 4.0)))
    with pytest.raises(ValueError, match="tokens_per_iteration"):
        SpeedPoint(0.0, 0.0)
    with pytest.raises(ValueError, match="at least one point"):
        SpeedCurve(())


def test_linear_latency_model() -> None:
    assert LATENCY.iteration_ms(1) == pytest.approx(4 * 11 + 63)
    assert LATENCY.iteration_ms(9) == pytest.approx(4 * 11 + 63 + 5 * 8)
    assert LATENCY.iteration_ms(0.2) == LATENCY.iteration_ms(1)  # never below one sequence
    with pytest.raises(ValueError, match="verify_ms"):
        LinearLatencyModel(draft_ms_per_token=1.0, verify_ms=0.0)


def test_feedforward_picks_the_smallest_threshold_predicted_to_meet_the_target() -> None:
    policy = FeedForwardPolicy(make_slo(), CURVE, LATENCY, tiers="standard")  # target 0.8 · 60 = 48 ms
    # batch 1: 107 ms / 3.0 tokens = 35.7 ms → T = 0 already meets it.
    assert policy.feedforward_threshold("standard", 1.0) == 0.0
    # batch 20: 202 ms needs 4.21 tokens/iteration → T = (4.21 − 3) / 1.3 = 0.930 (grid step 0.01).
    t = policy.feedforward_threshold("standard", 20.0)
    assert t == pytest.approx(0.93)
    assert policy.predict_tpot_ms(t, 20.0) <= 48.0 < policy.predict_tpot_ms(t - 0.01, 20.0)
    # Beyond what T can deliver: the top of the range.
    assert policy.feedforward_threshold("standard", 40.0) == 1.0
    # Monotone in load.
    ts = [policy.feedforward_threshold("standard", b) for b in range(1, 30)]
    assert all(b >= a for a, b in zip(ts, ts[1:], strict=False))


def test_feedforward_respects_the_budget_on_the_curve() -> None:
    slo = make_slo(standard={"max_mean_distortion": 0.06})  # curve crosses 0.06 at T = 0.5
    policy = FeedForwardPolicy(slo, CURVE, LATENCY, tiers="standard")
    assert policy.feedforward_threshold("standard", 20.0) == pytest.approx(0.5)
    unbounded = FeedForwardPolicy(slo, CURVE, LATENCY, tiers="standard", respect_budget=False)
    assert unbounded.feedforward_threshold("standard", 20.0) == pytest.approx(0.93)


def test_feedforward_uses_in_flight_per_replica_and_accepts_a_callable_model() -> None:
    policy = FeedForwardPolicy(make_slo(), CURVE, LATENCY, trim_kp=0.0, trim_ki=0.0)  # feed-forward alone
    one = policy.decide(make_telemetry(in_flight=40, replicas=2)).thresholds  # batch 20 each
    assert one["standard"] == pytest.approx(0.93) and one["lossless"] == 0.0
    assert one["economy"] == 0.0  # 202 / 3 = 67 ms ≤ 0.8 · 120

    def predict(threshold: float, batch_size: float) -> float:
        # standard (0.8 · 60 = 48 ms) needs T = 1.04, beyond its range → 1.0; economy (96 ms) T = 0.08.
        return 100.0 - 50.0 * threshold

    called = FeedForwardPolicy(make_slo(), CURVE, predict, respect_budget=False, trim_kp=0.0, trim_ki=0.0)
    decision = called.decide(make_telemetry()).thresholds
    assert decision["standard"] == 1.0 and decision["economy"] == pytest.approx(0.08)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_trim_corrects_an_optimistic_model_in_closed_loop(seed: int) -> None:
    """The real p95 is 1.3× the model's mean (lagged T, 3 % noise); batch 4 → 12 at tick 30.

    Feed-forward reacts on the very next decision (T ≥ 0.3 at once, where a rate-limited PID needs
    seconds); the trim then absorbs the model error: from 20 ticks after the step the 5-window mean p95
    stays under the 60 ms target.
    """
    rng = np.random.default_rng(seed)
    policy = FeedForwardPolicy(make_slo(), CURVE, LATENCY, tiers="standard", trim_setpoint=-0.08)
    threshold, t_eff = 0.0, 0.0
    p95s = []
    for i in range(150):
        batch = 4 if i < 30 else 12
        t_eff += 0.5 * (threshold - t_eff)
        p95 = (
            1.3
            * LATENCY.iteration_ms(batch)
            / CURVE.tokens_per_iteration(t_eff)
            * math.exp(0.03 * rng.standard_normal())
        )
        threshold = policy.decide(
            make_telemetry(time_s=float(i + 1), tpot_ms=p95, in_flight=batch)
        ).thresholds["standard"]
        p95s.append(p95)
        if i == 30:
            assert threshold >= 0.3, "feed-forward must jump on the load step"
    for i in range(50, 150):
        assert np.mean(p95s[i - 4 : i + 1]) <= 60.0, f"tick {i}"


def test_feedforward_rejects_tiers_without_tpot_target() -> None:
    with pytest.raises(ValueError, match="tiers: tier 'standard' has no TPOT target"):
        FeedForwardPolicy(
            make_slo(standard={"tpot_ms": None, "e2e_ms": 9000.0}), CURVE, LATENCY, tiers="standard"
        )


# --- StaticPolicy --------------------------------------------------------------------------------


def test_static_policy_clamps_per_tier_and_pins_fixed_tiers() -> None:
    slo = make_slo()
    decision = StaticPolicy(slo, 2.0).decide(make_telemetry())
    assert decision.thresholds == {"standard": 1.0, "economy": 2.0, "lossless": 0.0}
    decision = StaticPolicy(slo, {"economy": 3.0}).decide(make_telemetry())
    assert decision.thresholds == {"standard": 0.0, "economy": 3.0, "lossless": 0.0}
    with pytest.raises(ValueError, match=r"thresholds\['standard'\] must be >= 0"):
        StaticPolicy(slo, {"standard": -1.0})
    with pytest.raises(ValueError, match="unknown tier"):
        StaticPolicy(slo, {"gold": 1.0})
