"""The live control loop's lag in the simulator (``SimConfig.report_age_s``): a tick reads the telemetry of the
replicas' last report, ``age`` before it, and its decision lands with their next report, ``interval − age`` after
it; nothing is lost or counted twice between windows."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from policies.decision import Decision
from policies.slo import SLOSpec
from policies.static import StaticPolicy
from policies.telemetry import Telemetry
from sim.events import ApplyDecision, ControlTick, ReplicaReport
from sim.simulator import SimConfig, Simulator
from tests.sim.conftest import Recorder, handmade_profile, make_workload, run_sim
from tests.sim.test_draft_lengths import Flipper


def test_a_tick_reads_the_window_that_closed_at_the_last_report() -> None:
    """Every tick w (at w s) sees the arrivals and completions of ((w − 1) − age, w − age] and the requests in
    flight at w − age, its own time, the age, a one-second window; what comes after the report waits for the next
    tick."""
    slo = SLOSpec.default()
    age = 0.4
    w = make_workload(duration_s=60.0, arrivals={"kind": "poisson", "rate": 2.0})
    policy = Recorder(StaticPolicy(slo, 0.5))
    res = run_sim(w, policy, slo=slo, replicas=1, seed=5, report_age_s=age)
    arrivals = np.sort(res.records["arrival_s"])
    completions = res.records["completion_s"]
    assert not np.isnan(completions).any() and res.summary["rejected"] == 0
    windows = policy.entries[1:]  # the first is the empty pre-traffic window
    assert len(windows) >= 60
    for w_index, entry in enumerate(windows, start=1):
        t = entry["telemetry"]
        assert t["time_s"] == pytest.approx(w_index) and t["age_s"] == age
        assert t["window_s"] == pytest.approx(1.0 if w_index > 1 else 1.0 - age)
        closed = w_index - age
        expected = int(((arrivals > closed - 1.0) & (arrivals <= closed)).sum())
        assert t["arrivals"] == expected, (w_index, t["arrivals"], expected)
        done = int(((completions > closed - 1.0) & (completions <= closed)).sum())
        assert t["completions"] == done, (w_index, t["completions"], done)
        assert t["in_flight"] == int((arrivals <= closed).sum() - (completions <= closed).sum())


def test_a_decision_lands_with_the_next_report_after_it_is_sealed() -> None:
    """The tick at 1 s decides (k 2 → 6) on the report of 0.6 s; nothing changes until the next report, 1.6 s,
    which is sealed first (it reports k = 2, for the tick at 2 s) and then applies the decision, as a replica
    applies the reply to the report it sent. Without the lag the decision lands push_delay_s after the tick."""
    slo = SLOSpec.default()
    w = make_workload(duration_s=10.0, arrivals={"kind": "poisson", "rate": 1.0})
    policy = StaticPolicy(slo, 0.5, draft_lengths=6)
    lagged = Simulator(SimConfig(seed=1, replicas=1, k=2, report_age_s=0.4), handmade_profile(), slo, w, policy)
    assert lagged.on_replica_report(0.6) == []
    events = lagged.on_control_tick(1.0)
    assert not any(isinstance(e, ApplyDecision) for e in events)
    assert [e.time_s for e in events if isinstance(e, ReplicaReport)] == [pytest.approx(1.6)]
    assert [e.time_s for e in events if isinstance(e, ControlTick)] == [2.0]
    assert set(lagged.draft_lengths.values()) == {2}
    lagged.on_replica_report(1.6)
    assert lagged._reported is not None
    sealed = lagged._reported[0]
    assert (sealed.time_s, sealed.age_s, sealed.draft_length) == (2.0, 0.4, 2)
    assert set(lagged.draft_lengths.values()) == {6}
    instant = Simulator(SimConfig(seed=1, replicas=1, k=2), handmade_profile(), slo, w, policy)
    events = instant.on_control_tick(1.0)
    assert [e.time_s for e in events if isinstance(e, ApplyDecision)] == [pytest.approx(1.05)]
    assert not any(isinstance(e, ReplicaReport) for e in events)


@pytest.mark.parametrize("age", [0.0, 0.25, 0.9])
def test_with_the_lag_window_accounting_is_conserved(age: float) -> None:
    """Σ over windows of tokens, arrivals and completions = the run's, per tier too, with a decision that truncates
    segments at every landing."""
    slo = SLOSpec.default()
    w = make_workload(duration_s=150.0, arrivals={"kind": "poisson", "rate": 3.0},
                      output_tokens={"kind": "lognormal", "median": 60, "sigma": 0.5, "max": 300},
                      tier_mix={"lossless": 0.2, "standard": 0.5, "economy": 0.3})
    policy = Flipper()
    res = run_sim(w, policy, slo=slo, replicas=2, seed=4, drain_timeout_s=1000.0, report_age_s=age)
    done = ~np.isnan(res.records["completion_s"])
    windows: list[Telemetry] = policy.windows[1:]
    assert res.summary["completed"] == res.summary["requests"] - res.summary["rejected"]
    assert sum(t.output_tokens for t in windows) == res.records["output_tokens"][done].sum()
    assert sum(t.arrivals for t in windows) == res.summary["requests"]
    assert sum(t.completions for t in windows) == res.summary["completed"]
    for i, name in enumerate(slo.tiers):
        tier_done = done & (res.records["tier"] == i)
        assert sum(t.tiers[name].output_tokens for t in windows) == res.records["output_tokens"][tier_done].sum()


def test_the_lag_delays_the_response_to_a_burst() -> None:
    """A policy that drafts once a window shows a queue: with the lag it reads the queue later and its decision
    lands later, so the first speculative step of the run comes later (fixed seed)."""
    slo = SLOSpec.default()

    class OnQueue:
        def decide(self, telemetry: Telemetry) -> Decision:
            k = 4 if telemetry.queue_depth > 0 or telemetry.in_flight > 2 else 0
            return Decision(thresholds={n: 0.0 for n in slo.tiers}, draft_lengths={n: k for n in slo.tiers})

        def reset(self) -> None:
            pass

    w = make_workload(duration_s=60.0, arrivals={"kind": "step", "steps": [{"at_s": 0, "rate": 0.05},
                                                                          {"at_s": 20.0, "rate": 6.0}]})

    def first_drafting_tick(age: float | None) -> float:
        res = run_sim(w, OnQueue(), slo=slo, replicas=1, seed=2, k=0, report_age_s=age)
        ts = res.timeseries
        return min(t for t, k in zip(ts["time_s"], ts[f"k_{slo.default_tier}"], strict=True) if k > 0)

    assert first_drafting_tick(0.8) > first_drafting_tick(None)


def test_a_report_age_outside_the_interval_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="report_age_s 1.0 must be below control_interval_s 1.0"):
        SimConfig(report_age_s=1.0)
    with pytest.raises(ValueError, match="report_age_s"):
        SimConfig.from_dict({"report_age_s": -0.1})


def test_report_age_options_for_the_twin_and_the_replay(tmp_path: Path) -> None:
    """``--report-age``: 'uniform' is the seed's own phase in [0, interval), the same for every configuration of the
    seed; a number is itself; 'ticks' reads each run's median age from the report's ticks file, which also gives the
    spec each configuration ran, written out (so a default changed since does not change the replay)."""
    from benchmarks.load_replay import recorded_runs
    from benchmarks.load_sim import report_age_s
    from policies.registry import resolve_spec

    phases = [report_age_s("uniform", seed) for seed in range(200, 260)]
    assert all(0.0 <= p < 1.0 for p in phases) and len(set(phases)) == 60
    assert report_age_s("uniform", 7) == report_age_s("uniform", 7)
    assert 0.3 < float(np.mean(phases)) < 0.7
    assert report_age_s("off", 3) is None and report_age_s("0.25", 3) == 0.25
    assert report_age_s("ticks", 3, measured=0.61) == 0.61
    for bad in ("soon", "1.5", "-0.2"):
        with pytest.raises(ValueError, match=bad):
            report_age_s(bad, 0)
    written = {**resolve_spec({"policy": "slo"}), "initial_margin": 1.1}  # as a controller with another default
    event = {"time_s": 0.0, "event": {"kind": "policy", "policy": {"policy": "slo"}, "resolved_policy": written}}
    history = [event] + [{"time_s": 1.0, "telemetry": {"age_s": a}} for a in (0.90, 0.91, 0.92)]
    runs = [{"name": "slo", "round": 0, "history": history},
            {"name": "plain", "round": 1, "history": [{"time_s": 1.0, "telemetry": {"age_s": 0.3}}]}]
    with gzip.open(tmp_path / "load_x_ticks.json.gz", "wt") as f:
        json.dump({"runs": runs}, f)
    ages, specs = recorded_runs(str(tmp_path / "load_x.json"))
    assert ages == {("slo", 0): pytest.approx(0.91), ("plain", 1): 0.3}
    assert specs == {"slo": written}
    assert recorded_runs(str(tmp_path / "no_such_report.json")) == ({}, {})


def test_a_written_out_spec_builds_as_given_not_as_a_path() -> None:
    """A replay builds what ran from its written-out spec: JSON longer than a file name may be is read as JSON
    (it raised ENAMETOOLONG, looked up as a path), with every parameter as written."""
    from policies.registry import describe, resolve_spec
    from sim.inputs import build_policy, policy_spec

    written = {**resolve_spec({"policy": "slo"}), "initial_margin": 1.1}
    text = json.dumps(written)
    assert len(text) > 300 and policy_spec(text) == text
    policy = build_policy(text, SLOSpec.default(), handmade_profile())
    inner = describe(policy)
    while inner.get("inner") is not None:  # the guards wrap it
        inner = inner["inner"]
    assert inner["params"]["initial_margin"] == 1.1
