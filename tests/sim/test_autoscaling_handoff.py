"""The autoscaling hand-off in the simulator: a burst arrives, the shipped policy asks for replicas
(``Decision.replicas``), T absorbs the burst within budget while they start, and falls back once they
serve. The simulator's autoscaler honours the decision with the scenario's start-up delay and bills
the replica-seconds."""

from __future__ import annotations

from functools import cache

import numpy as np

from policies.registry import make_policy
from policies.slo import SLOSpec
from sim.autoscaler import AutoscalerConfig
from sim.simulator import SimResult
from tests.sim.conftest import handmade_profile, make_workload, run_sim

BURST_AT_S = 150.0
STARTUP_S = 60.0
# The burst's backlog drains by ~300 s; then the margin the policy started with relaxes as the tier meets (over
# minutes: margin_gain_down), and T with it: at the initial margin of 1.7 (session 43) T is back under 0.1 by
# ~550 s, at 1.3 by ~350 s.
DURATION_S = 700.0


@cache  # two tests read the same deterministic runs
def _burst_run(autoscale: bool, low: float = 0.05, high: float = 1.0) -> SimResult:
    profile = handmade_profile()
    slo = SLOSpec.default()
    workload = make_workload(
        duration_s=DURATION_S,
        arrivals={"kind": "step", "steps": [{"at_s": 0, "rate": low}, {"at_s": BURST_AT_S, "rate": high}]},
        prompt_tokens={"kind": "fixed", "value": 200}, output_tokens={"kind": "fixed", "value": 150},
        tier_mix={"standard": 1},
    )
    policy = make_policy("slo", slo, operating_model=profile.to_operating_model(), replica_bounds=(1, 6))
    fleet: dict[str, object] = {"replicas": 1}
    if autoscale:
        fleet["autoscaler"] = AutoscalerConfig(min_replicas=1, max_replicas=6, upscale_delay_s=2,
                                               downscale_delay_s=120, startup_s=STARTUP_S)
        fleet["honour_policy_replicas"] = True
    return run_sim(workload, policy, slo=slo, profile=profile, seed=1, **fleet)


def test_burst_raises_t_while_replicas_start_and_t_falls_back_once_they_serve() -> None:
    res = _burst_run(autoscale=True)
    ts = {k: np.asarray(v) for k, v in res.timeseries.items()}
    t, threshold = ts["time_s"], ts["T_standard"]
    serving, target, wanted = ts["replicas"], ts["replicas_target"], ts["replicas_wanted"]

    before = (t > 60) & (t <= BURST_AT_S)
    assert np.nanmax(wanted[before]) <= 2, wanted[before]
    # The burst: the policy asks for more replicas, the autoscaler starts them at once (delay 2 s)...
    first_ask = t[np.argmax((t > BURST_AT_S) & (target > target[before][-1]))]
    assert BURST_AT_S < first_ask < BURST_AT_S + 30, first_ask
    # ...and they serve only after their start-up time: the fleet is short meanwhile.
    peak = int(target.max())
    assert peak >= 3, peak
    full = t[np.argmax(serving >= peak)]
    # (A tick's record precedes its autoscaling: replicas started at tick w show in the record of w + 1.)
    assert full >= first_ask - 1 + STARTUP_S, (first_ask, full)
    short = (t > first_ask) & (t < full)
    # Once they serve, the backlog of the burst drains first, then T falls back (the last 100 s).
    after = t > DURATION_S - 100
    assert full < 300 and short.sum() >= 20 and after.sum() >= 50
    # T absorbs the burst while the replicas start, within the tier's budget...
    assert threshold[short].max() >= 0.5, threshold[short]
    assert threshold[short].mean() > threshold[before].mean() + 0.2, (threshold[short].mean(), threshold[before].mean())
    standard = res.summary["tiers"]["standard"]
    assert standard["mean_distortion"] <= slo_budget("standard"), standard
    # ...and falls back once they serve.
    assert threshold[after].mean() <= 0.1 < 0.5 <= threshold[short].mean(), (threshold[after], threshold[short])
    assert np.all(serving[after] == peak), serving[after]


def test_without_new_replicas_t_stays_up_and_autoscaling_bills_its_replicas() -> None:
    """The control: the same burst on the fixed single replica keeps T up to the end; the autoscaled
    run pays for its extra replicas in replica-seconds (start-up included)."""
    scaled = _burst_run(autoscale=True)
    fixed = _burst_run(autoscale=False)
    def late_t(res: SimResult) -> float:
        t = np.asarray(res.timeseries["time_s"])
        return float(np.asarray(res.timeseries["T_standard"])[(t > 350) & (t <= 450)].mean())

    fixed_t, scaled_t = late_t(fixed), late_t(scaled)
    assert fixed_t > scaled_t + 0.3, (fixed_t, scaled_t)
    assert set(np.asarray(fixed.timeseries["replicas"]).tolist()) == {1.0}
    assert scaled.summary["replica_seconds"] > 2.0 * fixed.summary["replica_seconds"]
    assert scaled.summary["tiers"]["standard"]["slo_attainment"] > fixed.summary["tiers"]["standard"]["slo_attainment"]
    assert scaled.summary["replica_startup_s"] == STARTUP_S


def slo_budget(tier: str) -> float:
    budget = SLOSpec.default().tiers[tier].max_mean_distortion
    assert budget is not None
    return budget
