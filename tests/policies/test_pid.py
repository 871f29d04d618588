"""PID core and PIDPolicy: terms, clamps, anti-windup, derivative on measurement, rate limit, deadband,
NaN windows, and a closed loop against a toy TPOT plant under a step in load."""

from __future__ import annotations

import math

import numpy as np
import pytest

from policies.pid import PID, PIDPolicy
from policies.telemetry import LatencySummary
from tests.policies.builders import make_slo, make_telemetry, make_tier_window
from tests.policies.plants import TPOTPlant

# --- the core ------------------------------------------------------------------------------------


def test_proportional_term_alone() -> None:
    pid = PID(kp=0.5, ki=0.0)
    assert pid(0.4, 1.0) == pytest.approx(0.2)
    assert pid.components == pytest.approx((0.2, 0.0, 0.0))
    # Negative error cannot take the output below the lower limit.
    assert pid(-0.4, 1.0) == 0.0


def test_integral_term_accumulates_error_times_dt() -> None:
    pid = PID(kp=0.0, ki=0.5)
    expected = [0.1, 0.2, 0.3, 0.4]
    for i, want in enumerate(expected):
        assert pid(0.2, 1.0) == pytest.approx(want), f"tick {i}"
    assert pid.components[1] == pytest.approx(0.4)
    # dt scales the integral step.
    assert pid(0.2, 0.5) == pytest.approx(0.45)


def test_derivative_acts_on_measurement_so_a_setpoint_change_does_not_kick() -> None:
    pid = PID(kp=0.0, ki=0.0, kd=1.0, initial_output=0.5)
    assert pid(0.1, 1.0) == pytest.approx(0.5)  # first sample: no derivative yet
    assert pid(0.3, 1.0) == pytest.approx(0.7)  # d(measurement)/dt = 0.2
    assert pid.components[2] == pytest.approx(0.2)
    pid.setpoint = -0.5  # error jumps by 0.5; the measurement does not move
    assert pid(0.3, 1.0) == pytest.approx(0.5)
    assert pid.components[2] == 0.0


def test_output_and_integral_stay_within_limits() -> None:
    pid = PID(kp=2.0, ki=2.0, output_limits=(0.0, 1.0))
    for i in range(50):
        assert 0.0 <= pid(5.0, 1.0) <= 1.0, f"tick {i}"
        assert 0.0 <= pid.components[1] <= 1.0, f"tick {i}"
    for i in range(50):
        assert pid(-5.0, 1.0) == 0.0, f"tick {i}"
        assert pid.components[1] >= 0.0, f"tick {i}"


def test_anti_windup_output_leaves_the_limit_as_soon_as_the_error_flips() -> None:
    pid = PID(kp=0.2, ki=0.5, output_limits=(0.0, 1.0))
    for i in range(200):  # long saturation: a naive integral would reach 100
        assert pid(1.0, 1.0) <= 1.0, f"tick {i}"
    assert pid.output == 1.0
    assert pid.components[1] <= 1.0
    # First tick with a (small) negative error already moves off the limit, and it keeps falling.
    first = pid(-0.1, 1.0)
    assert first < 1.0
    assert pid(-0.1, 1.0) < first


def test_conditional_integration_freezes_the_integral_while_held_at_the_limit() -> None:
    pid = PID(kp=0.95, ki=0.1, output_limits=(0.0, 1.0))
    for i in range(20):  # 0.95 + 0.1 > 1 → held at the limit from the first tick → integral never moves
        assert pid(1.0, 1.0) == 1.0, f"tick {i}"
        assert pid.components[1] == 0.0, f"tick {i}"
    assert pid(-0.1, 1.0) == 0.0  # the error flips: P takes the output off the limit at once


def test_rate_limit_bounds_the_output_change_per_second() -> None:
    pid = PID(kp=10.0, ki=0.0, max_rate=0.1)
    for i in range(5):
        assert pid(1.0, 1.0) == pytest.approx(0.1 * (i + 1)), f"tick {i}"
    assert pid(1.0, 2.0) == pytest.approx(0.7)  # 0.1/s over 2 s
    assert pid(-1.0, 0.5) == pytest.approx(0.65)  # and down


def test_deadband_holds_output_and_integral() -> None:
    pid = PID(kp=0.5, ki=0.5, deadband=0.05)
    out = pid(0.2, 1.0)
    integral = pid.components[1]
    for i, error in enumerate([0.04, -0.05, 0.0, 0.03]):
        assert pid(error, 1.0) == out, f"tick {i}"
        assert pid.components[1] == integral, f"tick {i}"
    assert pid(0.06, 1.0) != out


def test_nan_measurement_holds_and_the_next_derivative_spans_the_gap() -> None:
    pid = PID(kp=0.0, ki=0.5, kd=1.0, output_limits=(-5.0, 5.0))
    pid(0.2, 1.0)
    out = pid.output
    integral = pid.components[1]
    for i in range(3):
        assert pid(math.nan, 1.0) == out, f"tick {i}"
        assert pid.components[1] == integral, f"tick {i}"
    pid(0.6, 1.0)
    assert pid.components[2] == pytest.approx((0.6 - 0.2) / 4.0)  # 4 s since the last real sample
    assert pid.components[1] == pytest.approx(integral + 0.5 * 0.6 * 1.0)  # only this window integrates


def test_reset_restores_initial_state_and_repr_shows_every_parameter() -> None:
    pid = PID(kp=0.1, ki=0.2, kd=0.3, setpoint=-0.1, max_rate=0.4, deadband=0.01, initial_output=0.25)
    pid(1.0, 1.0)
    pid.reset()
    assert pid.output == 0.25 and pid.components == (0.0, 0.25, 0.0)
    text = repr(pid)
    for name in (
        "kp=0.1",
        "ki=0.2",
        "kd=0.3",
        "setpoint=-0.1",
        "output_limits=(0.0, 1.0)",
        "max_rate=0.4",
        "deadband=0.01",
        "initial_output=0.25",
    ):
        assert name in text


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kp": -1.0}, "kp"),
        ({"ki": math.nan}, "ki"),
        ({"output_limits": (1.0, 0.0)}, "output_limits"),
        ({"max_rate": 0.0}, "max_rate"),
        ({"deadband": -0.1}, "deadband"),
    ],
)
def test_bad_parameters_raise_naming_the_field(kwargs: dict[str, object], field: str) -> None:
    params: dict[str, object] = {"kp": 0.1, "ki": 0.1, **kwargs}
    with pytest.raises(ValueError, match=field):
        PID(**params)  # type: ignore[arg-type]


def test_bad_dt_raises() -> None:
    with pytest.raises(ValueError, match="dt"):
        PID(kp=0.1, ki=0.1)(0.1, 0.0)


# --- the policy ----------------------------------------------------------------------------------


def test_policy_measures_slack_at_the_tier_percentile_and_sets_every_tier() -> None:
    slo = make_slo(standard={"percentile": 99.0})
    policy = PIDPolicy(slo, tiers="standard", kp=0.5, ki=0.0, deadband=0.0, max_rate=None)
    # p99 = 90 ms against the 60 ms target → slack +0.5 → u = 0.25; p50 is under target (ignored).
    window = make_tier_window(tpot=LatencySummary(20, 40.0, 50.0, 60.0, 90.0))
    decision = policy.decide(make_telemetry(tiers={"standard": window}))
    assert policy.last_slack["standard"] == pytest.approx(0.5)
    assert decision.thresholds["standard"] == pytest.approx(0.25)
    assert decision.thresholds["lossless"] == 0.0
    assert decision.thresholds["economy"] == 0.0  # not controlled here → its safe threshold


def test_policy_runs_one_pid_per_tier_scaled_into_each_tier_range() -> None:
    slo = make_slo()  # standard: tpot 60 ms, T ≤ 1; economy: tpot 120 ms, T ≤ 4
    policy = PIDPolicy(slo, kp=0.5, ki=0.0, deadband=0.0, max_rate=None)
    assert policy.tiers == ["standard", "economy"]
    tiers = {
        "standard": make_tier_window(tpot_ms=90.0),  # slack +0.5 → u 0.25 → T 0.25
        "economy": make_tier_window(tpot_ms=60.0),  # slack −0.5 → u 0 → T 0
        "lossless": make_tier_window(tpot_ms=500.0),
    }
    decision = policy.decide(make_telemetry(tiers=tiers))
    assert decision.thresholds == {"lossless": 0.0, "standard": pytest.approx(0.25), "economy": 0.0}
    tiers["economy"] = make_tier_window(tpot_ms=180.0)  # slack +0.5 → u 0.25 → T 1.0 (range 4)
    decision = policy.decide(make_telemetry(time_s=2.0, tiers=tiers))
    assert decision.thresholds["economy"] == pytest.approx(1.0)


def test_policy_falls_back_to_aggregate_latency_without_tier_windows() -> None:
    policy = PIDPolicy(make_slo(), tiers="standard", kp=0.5, ki=0.0, deadband=0.0, max_rate=None)
    decision = policy.decide(make_telemetry(tpot_ms=90.0))
    assert decision.thresholds["standard"] == pytest.approx(0.25)


def test_policy_holds_through_windows_without_completions() -> None:
    policy = PIDPolicy(make_slo(), tiers="standard", kp=0.2, ki=0.5, deadband=0.0, max_rate=None)
    t = 0.0
    for i in range(3):
        t = policy.decide(make_telemetry(time_s=float(i + 1), tpot_ms=90.0)).thresholds["standard"]
    assert t > 0
    for i in range(3, 10):
        decision = policy.decide(make_telemetry(time_s=float(i + 1), completions=0))
        assert decision.thresholds["standard"] == t, f"tick {i}"
        assert "no tpot evidence" in decision.reason


def test_policy_holds_when_time_does_not_advance() -> None:
    policy = PIDPolicy(make_slo(), tiers="standard", kp=0.2, ki=0.5, deadband=0.0, max_rate=None)
    first = policy.decide(make_telemetry(time_s=5.0, tpot_ms=90.0)).thresholds["standard"]
    again = policy.decide(make_telemetry(time_s=5.0, tpot_ms=200.0))
    assert again.thresholds["standard"] == first
    assert "time did not advance" in again.reason


def test_policy_queue_delay_metric_uses_littles_law_against_ttft_target() -> None:
    slo = make_slo(standard={"ttft_ms": 500.0})
    policy = PIDPolicy(
        slo, tiers="standard", metric="queue_delay", kp=0.5, ki=0.0, deadband=0.0, max_rate=None
    )
    # 15 queued, 20 completions/s → 750 ms wait vs 500 ms → slack +0.5 → T = 0.25
    decision = policy.decide(make_telemetry(queue_depth=15))
    assert decision.thresholds["standard"] == pytest.approx(0.25)


def test_policy_rejects_tiers_without_a_target_or_pinned() -> None:
    with pytest.raises(ValueError, match="tiers: tier 'standard' has no target for metric 'e2e'"):
        PIDPolicy(make_slo(), tiers="standard", metric="e2e")
    with pytest.raises(ValueError, match="lossless"):
        PIDPolicy(make_slo(), tiers="lossless")
    with pytest.raises(ValueError, match="unknown tier 'gold'"):
        PIDPolicy(make_slo(), tiers="gold")
    with pytest.raises(ValueError, match="metric"):
        PIDPolicy(make_slo(), metric="latency")  # type: ignore[arg-type]


def test_policy_reset_returns_to_the_safe_threshold() -> None:
    policy = PIDPolicy(make_slo(), tiers="standard")
    for i in range(10):
        policy.decide(make_telemetry(time_s=float(i + 1), tpot_ms=120.0))
    policy.reset()
    assert policy.decide(make_telemetry(time_s=1.0, tpot_ms=60.0)).thresholds["standard"] == 0.0
    assert "kp=0.3" in repr(policy) and "metric='tpot'" in repr(policy)


# --- closed loop ---------------------------------------------------------------------------------

STEP_TICK = 20
SETTLE_TICKS = 20
SETPOINT = -0.08  # aim 8 % under the 60 ms target, so noise rarely crosses it


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_closed_loop_step_in_load_recovers_within_bounded_ticks_and_does_not_oscillate(seed: int) -> None:
    """p95 TPOT = 40 ms · load / (1 + 0.6 T), lagged, 3 % noise. Load 1.0 → 1.8 at tick 20.

    Before the step the SLO holds at T = 0 and the policy must stay lossless. After it (72 ms at T = 0)
    the policy must bring the 5-window mean p95 under 60 ms within 20 ticks and then keep it there,
    with T inside ±0.15 of the steady-state T for the aimed 55.2 ms (the noise alone moves T ±0.1).
    """
    slo = make_slo()
    target = slo.tiers["standard"].tpot_ms
    assert target == 60.0
    policy = PIDPolicy(slo, tiers="standard", setpoint=SETPOINT)  # default gains
    plant = TPOTPlant(seed)
    threshold = 0.0
    p95s: list[float] = []
    thresholds: list[float] = []
    for i in range(120):
        load = 1.0 if i < STEP_TICK else 1.8
        p95 = plant.p95_ms(threshold, load)
        threshold = policy.decide(make_telemetry(time_s=float(i + 1), tpot_ms=p95)).thresholds["standard"]
        p95s.append(p95)
        thresholds.append(threshold)
        if i < STEP_TICK:
            assert threshold == 0.0, f"tick {i}: no violation yet, T must stay lossless"
    steady_t = plant.threshold_for(target * (1 + SETPOINT), 1.8)
    settled = STEP_TICK + SETTLE_TICKS
    for i in range(settled, len(p95s)):
        assert np.mean(p95s[i - 4 : i + 1]) <= target, f"tick {i}: 5-window mean p95 over the SLO"
        assert abs(thresholds[i] - steady_t) <= 0.15, f"tick {i}: T {thresholds[i]:.3f} vs {steady_t:.3f}"


def test_policy_treats_windows_with_too_few_samples_as_no_evidence() -> None:
    policy = PIDPolicy(
        make_slo(), tiers="standard", kp=0.5, ki=0.0, deadband=0.0, max_rate=None, min_samples=5
    )
    decision = policy.decide(make_telemetry(completions=2, tpot_ms=200.0))
    assert decision.thresholds["standard"] == 0.0 and "no tpot evidence" in decision.reason
    decision = policy.decide(make_telemetry(time_s=2.0, completions=5, tpot_ms=90.0))
    assert decision.thresholds["standard"] == pytest.approx(0.25)


def test_tpot_live_metric_reads_the_decoding_sequences_every_window() -> None:
    policy = PIDPolicy(
        make_slo(), tiers="standard", metric="tpot_live", kp=0.5, ki=0.0, deadband=0.0, max_rate=None
    )
    # 12 in flight, 2 queued → 10 decoding at 111.1 tokens/s → 90 ms per token vs 60 → slack +0.5.
    decision = policy.decide(
        make_telemetry(in_flight=12, queue_depth=2, output_tokens_per_s=1000 / 9, completions=0)
    )
    assert policy.last_slack["standard"] == pytest.approx(0.5)
    assert decision.thresholds["standard"] == pytest.approx(0.25)
    # Nothing decoding: no evidence, hold.
    held = policy.decide(make_telemetry(time_s=2.0, in_flight=3, queue_depth=3, output_tokens_per_s=0.0))
    assert held.thresholds["standard"] == pytest.approx(0.25) and "no tpot_live evidence" in held.reason
