"""The shipped SLO policy ("slo" = model-predictive control of (T, k)) closed around the simulator."""

from __future__ import annotations

import numpy as np

from policies.mpc import DEFAULT_MODEL_PATH, OperatingModel
from policies.slo import SLOSpec
from sim.inputs import build_policy
from sim.profile import Profile
from sim.workload import Workload
from tests.sim.conftest import handmade_profile, run_sim

MIXED = {
    "name": "mixed", "duration_s": 400.0, "arrivals": {"kind": "poisson", "rate": 0.6},
    "prompt_tokens": {"kind": "lognormal", "median": 200, "sigma": 0.6, "max": 2048},
    "output_tokens": {"kind": "lognormal", "median": 180, "sigma": 0.5, "max": 1024},
    "tier_mix": {"lossless": 0.2, "standard": 0.6, "economy": 0.2},
}


def test_shipped_policy_meets_the_slo_at_less_distortion_than_the_static_points_that_do() -> None:
    """3 replicas, tier mix: static T = 0 misses the standard tier's p95 TPOT, static T = 1 meets it.
    The shipped policy must meet every tier's attainment target within budget, at no more distortion
    than the least-distortion static point (over T at k = 4) that meets it."""
    profile = handmade_profile()
    slo = SLOSpec.default()
    w = Workload.from_dict(MIXED)
    statics = {}
    for t in (0.0, 0.5, 0.75, 1.0):
        res = run_sim(w, build_policy(f"static:{t}", slo, profile), slo=slo, profile=profile, replicas=3, seed=1)
        statics[t] = res.summary["tiers"]
    meeting = [t for t, tiers in statics.items() if all(v["meets_objective"] for v in tiers.values())]
    assert meeting and 0.0 not in meeting, {t: v["standard"]["slo_attainment"] for t, v in statics.items()}
    cheapest = min(statics[t]["standard"]["mean_distortion"] for t in meeting)

    res = run_sim(w, build_policy("slo", slo, profile), slo=slo, profile=profile, replicas=3, seed=1)
    tiers = res.summary["tiers"]
    for name, v in tiers.items():
        assert v["meets_objective"], (name, v["slo_attainment"], v["mean_distortion"])
    assert tiers["standard"]["mean_distortion"] <= cheapest, (tiers["standard"]["mean_distortion"], cheapest)
    # It steers k too: some windows run another draft length than the profile's default 4.
    ks = np.asarray(res.timeseries["k_standard"])
    assert (ks != 4).any()


def test_shipped_operating_model_is_the_calibrated_profile_converted() -> None:
    shipped = OperatingModel.load(DEFAULT_MODEL_PATH)
    fresh = Profile.default().to_operating_model(source=shipped.source)
    assert fresh == shipped, "regenerate policies/models/smollm2-135m.json from sim/profiles/smollm2-135m.json"
