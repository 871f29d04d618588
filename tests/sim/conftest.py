"""Builders for simulator tests: defaults plus overrides (no fixtures hiding behaviour)."""

from __future__ import annotations

import json
from typing import Any

from policies.decision import decision_to_json
from policies.registry import resolve_spec
from policies.slo import SLOSpec, TierSLO
from policies.static import StaticPolicy
from policies.telemetry import Telemetry, to_json
from sim.decision_replay import build_policy, profile_model
from sim.profile import HANDMADE_2THREADS_PROFILE_PATH, Profile
from sim.simulator import SimConfig, SimResult, Simulator
from sim.workload import Workload

#: A three-tier load (tests/sim/test_mpc_closed_loop.py's MIXED).
MIXED_TIERS: dict[str, Any] = {
    "name": "mixed", "duration_s": 400.0, "arrivals": {"kind": "poisson", "rate": 0.6},
    "prompt_tokens": {"kind": "lognormal", "median": 200, "sigma": 0.6, "max": 2048},
    "output_tokens": {"kind": "lognormal", "median": 180, "sigma": 0.5, "max": 1024},
    "tier_mix": {"lossless": 0.2, "standard": 0.6, "economy": 0.2},
}


def make_workload(**overrides: Any) -> Workload:
    data: dict[str, Any] = {
        "name": "test",
        "duration_s": 300.0,
        "arrivals": {"kind": "poisson", "rate": 0.5},
        "prompt_tokens": {"kind": "fixed", "value": 100},
        "output_tokens": {"kind": "fixed", "value": 50},
    }
    data.update(overrides)
    return Workload.from_dict(data)


def handmade_profile() -> Profile:
    """The hand-made 2-thread profile: fast, fixed timings the scenarios below are sized for."""
    return Profile.load(HANDMADE_2THREADS_PROFILE_PATH)


def single_tier_slo(**tier: Any) -> SLOSpec:
    return SLOSpec(tiers={"standard": TierSLO(**tier)}, default_tier="standard")


def run_sim(
    workload: Workload | None = None,
    policy: Any = None,
    slo: SLOSpec | None = None,
    profile: Profile | None = None,
    **config: Any,
) -> SimResult:
    slo = slo or SLOSpec.default()
    policy = policy if policy is not None else StaticPolicy(slo, 0.5)
    cfg = SimConfig(**config)
    return Simulator(cfg, profile or handmade_profile(), slo, workload or make_workload(), policy).run()


def exponential_profile(service_ms: float) -> Profile:
    """One decode iteration ~ Exp(mean service_ms) at batch 1; prefill free (M/M/1 checks)."""
    data = handmade_profile().model_dump()
    data["latency"] = {
        "draft_a_ms": 0.0, "draft_b_ms": 0.0, "verify_a_ms": 0.0, "verify_b_ms": service_ms,
        "verify_c_ms": 0.0, "prefill_ms_per_token": 0.0, "iteration_time_dist": "exponential",
    }
    return Profile.model_validate(data)


class Recorder:
    """Wraps a policy; keeps each window and decision as the controller's history keeps them."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.entries: list[dict[str, Any]] = []

    def decide(self, telemetry: Telemetry) -> Any:
        decision = self.inner.decide(telemetry)
        self.entries.append({"time_s": telemetry.time_s, "telemetry": to_json(telemetry),
                             "decision": decision_to_json(decision)})
        return decision

    def reset(self) -> None:
        self.inner.reset()


def recorded_history(spec: dict[str, Any], slo: SLOSpec, **workload: Any) -> list[dict[str, Any]]:
    """Two minutes of a three-tier load (fields of ``workload`` override it) on two replicas under ``spec``, as a
    controller's status history records it (strict JSON): a resume event, the policy event (spec as given and
    written out, SLO, operating model), then one entry per tick."""
    profile = handmade_profile()
    recorder = Recorder(build_policy(spec, slo, profile_model(profile)))
    run_sim(Workload.from_dict({**MIXED_TIERS, "duration_s": 120.0, **workload}), recorder, slo=slo, profile=profile,
            replicas=2, seed=3)
    event = {"time_s": 0.0, "thresholds": {}, "decision": None, "telemetry": None, "slo": slo.model_dump(mode="json"),
             "operating_model": profile_model(profile).to_dict(),
             "event": {"kind": "policy", "policy": spec, "resolved_policy": resolve_spec(spec), "previous_policy": spec}}
    return json.loads(json.dumps([{"event": {"kind": "resume"}}, event, *recorder.entries], allow_nan=False))
