"""Builders for simulator tests: defaults plus overrides (no fixtures hiding behaviour)."""

from __future__ import annotations

from typing import Any

from policies.slo import SLOSpec, TierSLO
from policies.static import StaticPolicy
from sim.profile import HANDMADE_2THREADS_PROFILE_PATH, Profile
from sim.simulator import SimConfig, SimResult, Simulator
from sim.workload import Workload


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
