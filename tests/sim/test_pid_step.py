"""PID (the policies package's) against a load step, run in the real simulator.

Scenario: 32 replicas (max batch 8), standard tier p95 TPOT target 60 ms, T ceiling 2.0; Poisson
arrivals step from 4 to 10.4 req/s at t = 300 s — T = 0 cannot hold 60 ms at the higher load. The
PID aims 20 % below the target (setpoint −0.2 on the normalised slack), control every 2 s.
Claims (stated, checked):
- settling: within 15 ticks (30 s) of the step, the 5-tick rolling median of the window p95 TPOT
  is under 60 ms, and it stays under for >= 95 % of the remaining ticks;
- no oscillation beyond a band: after the step + 60 s, T's 10th-90th percentile lies in [0.3, 1.2];
- the step matters: T = 0 (static) has the rolling p95 above 60 ms for most of the same period.
"""

import numpy as np

from policies.registry import make_policy
from policies.slo import SLOSpec, TierSLO

from .conftest import make_workload, run_sim

STEP_S = 300.0
INTERVAL_S = 2.0
TARGET_MS = 60.0


def _run(spec):
    slo = SLOSpec(tiers={"standard": TierSLO(tpot_ms=TARGET_MS, max_threshold=2.0)})
    w = make_workload(
        duration_s=700.0,
        arrivals={"kind": "step", "steps": [{"at_s": 0, "rate": 4.0}, {"at_s": STEP_S, "rate": 10.4}]},
        prompt_tokens={"kind": "fixed", "value": 100},
        output_tokens={"kind": "lognormal", "median": 100, "sigma": 0.4, "max": 400},
    )
    res = run_sim(w, make_policy(spec, slo), slo=slo, replicas=32, seed=3, control_interval_s=INTERVAL_S)
    ts = res.timeseries
    t = np.asarray(ts["time_s"])
    p95 = np.asarray(ts["tpot_p95_ms"])
    rolling = np.array([np.nanmedian(p95[max(0, i - 4) : i + 1]) if np.isfinite(p95[max(0, i - 4) : i + 1]).any()
                        else np.nan for i in range(p95.size)])
    return t, rolling, np.asarray(ts["T_standard"]), res.summary


def test_pid_settles_under_the_tpot_slo_after_a_load_step_without_oscillating() -> None:
    t, rolling, T, summary = _run({"policy": "pid", "setpoint": -0.2})
    after = np.flatnonzero(t > STEP_S)
    settle_by = STEP_S + 15 * INTERVAL_S
    window = after[t[after] >= settle_by]
    under = rolling[window] <= TARGET_MS
    assert under[0], f"rolling p95 TPOT {rolling[window[0]]:.1f} ms still above target 15 ticks after the step"
    assert under.mean() >= 0.95, f"only {under.mean():.2%} of ticks under target after settling"
    late = t > STEP_S + 60
    lo, hi = np.percentile(T[late], [10, 90])
    assert lo >= 0.3 and hi <= 1.2, f"T band p10={lo:.3f} p90={hi:.3f} outside [0.3, 1.2]"
    assert T[t < STEP_S - 60].max() < lo, "T should rise only when the load does"
    assert summary["slo_attainment"] > 0.97


def test_the_step_defeats_a_lossless_static_policy() -> None:
    t, rolling, _, summary = _run("static:0")
    late = t > STEP_S + 60
    assert np.nanmean(rolling[late] > TARGET_MS) > 0.8
    assert summary["slo_attainment"] < 0.8
