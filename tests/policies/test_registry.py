"""make_policy / describe: every name builds and decides, bad configs raise ValueError naming the field."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

from policies.base import Policy
from policies.feedforward import LinearLatencyModel, SpeedCurve
from policies.guards import FailSafe
from policies.pid import PIDPolicy
from policies.registry import POLICY_NAMES, describe, make_policy
from tests.policies.builders import make_slo, make_telemetry, make_tier_window

CURVE = [
    {"threshold": 0.0, "tokens_per_iteration": 3.0, "mean_distortion": 0.0},
    {"threshold": 1.0, "tokens_per_iteration": 4.3, "mean_distortion": 0.12},
    {"threshold": 4.0, "tokens_per_iteration": 4.8, "mean_distortion": 0.3},
]
LATENCY = {"draft_ms_per_token": 11.0, "verify_ms": 63.0, "verify_ms_per_seq": 5.0}

SPECS: dict[str, dict[str, Any]] = {
    "static": {"policy": "static", "thresholds": 0.5},
    "pid": {"policy": "pid", "kp": 0.5, "ki": 0.1},
    "bandit": {"policy": "bandit", "arms": [0.0, 0.5, 1.0], "seed": 3},
    "feedforward": {"policy": "feedforward", "curve": CURVE, "latency": LATENCY},
    "mpc": {"policy": "mpc", "max_batch": 4},
}


def test_names_listed_are_the_ones_built() -> None:
    assert set(POLICY_NAMES) == set(SPECS)


@pytest.mark.parametrize("name", list(SPECS))
def test_every_policy_builds_from_a_spec_and_decides(name: str) -> None:
    slo = make_slo()
    policy = make_policy(SPECS[name], slo)
    assert isinstance(policy, Policy) and isinstance(policy, FailSafe)  # guards on by default
    decision = policy.decide(make_telemetry(tpot_ms=70.0))
    assert set(decision.thresholds) == set(slo.tiers)
    for tier, t in decision.thresholds.items():
        assert t == slo.tiers[tier].clamp(t), tier
    info = describe(policy)
    assert info["name"] == "failsafe" and info["last_decision"]["thresholds"] == dict(decision.thresholds)
    json.dumps(info)  # status endpoints serve it as is
    node = info
    while "inner" in node:
        node = node["inner"]
    assert node["name"] == name


@pytest.mark.parametrize("name", ["static", "pid", "bandit"])
def test_a_bare_name_builds_with_defaults(name: str) -> None:
    assert isinstance(make_policy(name, make_slo()), Policy)


def test_static_shorthand_and_json_string() -> None:
    decision = make_policy("static:0.25", make_slo()).decide(make_telemetry())
    assert decision.thresholds["standard"] == 0.25 and decision.thresholds["economy"] == 0.25
    policy = make_policy('{"policy": "pid", "kp": 0.4, "guards": false}', make_slo())
    assert isinstance(policy, PIDPolicy) and policy.kp == 0.4


def test_bandit_arms_with_draft_length_from_json_lists() -> None:
    policy = make_policy({"policy": "bandit", "arms": [[0.5, 3], [1.0, 5]], "guards": False}, make_slo())
    decision = policy.decide(make_telemetry())
    assert (decision.thresholds["standard"], decision.draft_lengths["standard"]) in {(0.5, 3), (1.0, 5)}


def test_feedforward_takes_curve_and_latency_from_the_caller() -> None:
    curve = SpeedCurve.from_points(CURVE)
    policy = make_policy(
        "feedforward", make_slo(), speed_curve=curve, latency_model=LinearLatencyModel(**LATENCY)
    )
    assert isinstance(policy.decide(make_telemetry()).thresholds["standard"], float)
    with pytest.raises(ValueError, match=r"^feedforward\.curve: a speed curve is required"):
        make_policy("feedforward", make_slo())


def test_guards_block_configures_the_wrappers() -> None:
    policy = make_policy(
        {"policy": "static", "thresholds": 0.5, "guards": {"quality": False, "stale_after_s": 2}}, make_slo()
    )
    info = describe(policy)
    assert info["name"] == "failsafe" and info["params"]["stale_after_s"] == 2.0
    assert info["inner"]["name"] == "clamp"  # no quality guard
    bare = make_policy({"policy": "static", "thresholds": 0.5, "guards": False}, make_slo())
    assert describe(bare) == {
        "name": "static",
        "params": {"thresholds": {"standard": 0.5, "economy": 0.5, "lossless": 0.0}, "draft_lengths": {},
                   "batch_cap": None},
        "last_decision": None,
    }


def test_static_batch_cap_reaches_the_decision_through_the_guards() -> None:
    policy = make_policy({"policy": "static", "thresholds": 0.0, "draft_lengths": 0, "batch_cap": 3}, make_slo())
    decision = policy.decide(make_telemetry())
    assert decision.batch_cap == 3 and decision.draft_lengths["economy"] == 0
    assert describe(policy)["inner"]["inner"]["last_decision"]["batch_cap"] == 3
    with pytest.raises(ValueError, match="batch_cap"):
        make_policy({"policy": "static", "batch_cap": 0}, make_slo())


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"policy": "pid", "kp": "fast"}, r"^pid\.kp: Input should be a valid number"),
        ({"policy": "pid", "kp": -1}, r"^pid\.kp: Input should be greater than or equal to 0"),
        ({"policy": "pid", "kq": 0.5}, r"^pid\.kq: Extra inputs are not permitted"),
        (
            {"policy": "pid", "metric": "latency"},
            r"^pid\.metric: Input should be 'tpot', 'ttft', 'e2e', 'queue_delay' or 'tpot_live'",
        ),
        ({"policy": "pid", "tiers": ["gold"]}, r"^pid: unknown tier 'gold'"),
        ({"policy": "pid", "metric": "e2e"}, r"^pid\.metric: no unpinned tier has a target for 'e2e'"),
        ({"policy": "bandit", "window": 0}, r"^bandit\.window: Input should be greater than or equal to 1"),
        ({"policy": "slo", "step_fit": "bins"}, r"^mpc\.step_fit: Input should be 'line' or 'batch'"),
        ({"policy": "slo", "relax_delay_s": -1}, r"^mpc\.relax_delay_s: Input should be greater than or equal to 0"),
        ({"policy": "slo", "best_effort_relax_s": -1},
         r"^mpc\.best_effort_relax_s: Input should be greater than or equal to 0"),
        ({"policy": "bandit", "arms": [0.0, 2.0]}, r"^bandit\.arms\[1\]: T=2.0 outside tier 'standard'"),
        ({"policy": "bandit", "context": "moon_phase"}, r"^bandit\.context: Input should be"),
        (
            {"policy": "static", "thresholds": {"gold": 0.5}},
            r"^static\.thresholds: unknown tier\(s\) \['gold'\]",
        ),
        (
            {"policy": "static", "thresholds": 0.5, "guards": {"stale_after_s": -1}},
            r"^guards\.stale_after_s: Input should be greater than 0",
        ),
        (
            {"policy": "static", "guards": {"qualty": True}},
            r"^guards\.qualty: Extra inputs are not permitted",
        ),
        (
            {"policy": "feedforward", "curve": [{"threshold": 0.0}], "latency": LATENCY},
            r"^feedforward\.curve\.0\.tokens_per_iteration: Field required",
        ),
        ("static:fast", r"^static\.thresholds: not a number"),
        ('{"policy": "pid",', r"^policy spec: invalid JSON"),
    ],
)
def test_bad_config_raises_value_error_naming_the_field(spec: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_policy(spec, make_slo())


@pytest.mark.parametrize("spec", ["magic", {"policy": "magic"}, {"kp": 0.5}])
def test_unknown_policy_name_lists_the_known_ones(spec: Any) -> None:
    with pytest.raises(ValueError, match=r"known policies: \['slo', 'static', 'pid', 'bandit', 'feedforward', 'mpc'\]"):
        make_policy(spec, make_slo())


@pytest.mark.parametrize("name", list(SPECS))
def test_odd_telemetry_never_crashes_a_guarded_policy(name: str) -> None:
    """Seeded fuzz: empty windows, NaN/inf latencies and distortion, time jumping back, stale reports."""
    rng = np.random.default_rng(11)
    slo = make_slo()
    policy = make_policy(SPECS[name], slo)
    odd = [0.0, 1.0, 59.0, 61.0, 1e9, math.inf, math.nan]
    t = 0.0
    for i in range(300):
        t += float(rng.choice([1.0, 1.0, 1.0, 0.0, -5.0, 30.0]))
        completions = int(rng.choice([0, 1, 2, 20]))
        latency = float(rng.choice(odd))
        tier = make_tier_window(
            threshold=float(rng.uniform(0, 1)),
            completions=completions,
            slo_met=int(rng.integers(0, completions + 1)),
            tpot_ms=latency,
            mean_distortion=float(rng.choice([0.0, 0.1, 0.5, math.inf])),
        )
        telemetry = make_telemetry(
            time_s=t,
            completions=completions,
            tpot_ms=latency,
            in_flight=int(rng.integers(0, 50)),
            queue_depth=int(rng.integers(0, 10)),
            output_tokens_per_s=float(rng.choice([0.0, 50.0, 1e6])),
            rejections=int(rng.integers(0, 5)),
            age_s=float(rng.choice([0.0, 0.0, 10.0, math.nan])),
            tiers={"standard": tier} if rng.random() < 0.7 else {},
        )
        decision = policy.decide(telemetry)
        for tier_name, threshold in decision.thresholds.items():
            bounds = slo.tiers[tier_name]
            assert bounds.min_threshold <= threshold <= bounds.max_threshold, (
                f"tick {i}: {tier_name}={threshold}"
            )


def test_slo_alias_is_the_shipped_default_policy() -> None:
    from policies.registry import DEFAULT_POLICY_SPEC, describe, make_policy
    from policies.slo import SLOSpec

    by_alias = describe(make_policy("slo", SLOSpec.default()))
    by_spec = describe(make_policy(dict(DEFAULT_POLICY_SPEC), SLOSpec.default()))
    assert by_alias == by_spec
    assert "mpc" in str(by_alias)


def test_slo_alias_as_mapping_takes_overrides() -> None:
    from policies.registry import describe, make_policy
    from policies.slo import SLOSpec

    d = describe(make_policy({"policy": "slo", "max_batch": 16, "guards": False}, SLOSpec.default()))
    assert d["name"] == "mpc" and d["params"]["max_batch"] == 16, d
    assert d["last_decision"] is None


def _innermost(policy: Any) -> Any:
    while getattr(policy, "inner", None) is not None:
        policy = policy.inner
    return policy


def test_slo_policy_asks_for_replicas_within_the_owners_bounds_unless_its_spec_sets_them() -> None:
    slo = make_slo()
    assert _innermost(make_policy("slo", slo)).max_replicas is None  # no owner bounds: no replica count
    owned = _innermost(make_policy("slo", slo, replica_bounds=(2, 5)))
    assert (owned.min_replicas, owned.max_replicas) == (2, 5)
    spec = _innermost(make_policy({"policy": "slo", "max_replicas": 3}, slo, replica_bounds=(1, 5)))
    assert (spec.min_replicas, spec.max_replicas) == (1, 3)
    decision = make_policy("slo", slo, replica_bounds=(2, 5)).decide(make_telemetry(replicas=2))
    assert decision.replicas == 2  # held until a rate is known
    with pytest.raises(ValueError, match=r"mpc\.max_replicas"):
        make_policy({"policy": "slo", "max_replicas": 0}, slo)
    with pytest.raises(ValueError, match="max_replicas 1 must be >= min_replicas 2"):
        make_policy({"policy": "slo", "max_replicas": 1}, slo, replica_bounds=(2, 5))


def test_quality_guard_parameters_come_from_the_spec_and_bad_ones_name_the_field() -> None:
    from policies.guards import QualityGuard
    from policies.registry import DEFAULT_POLICY_SPEC

    policy = make_policy({"policy": "static", "thresholds": 0.5, "guards": {"quality": {"alpha": 0.2, "margin": 0}}},
                         make_slo())
    guard = policy
    while not isinstance(guard, QualityGuard):
        guard = guard.inner
    assert (guard.alpha, guard.margin, guard.backoff) == (0.2, 0.0, 0.7)
    shipped = make_policy("slo", make_slo())
    while not isinstance(shipped, QualityGuard):
        shipped = shipped.inner
    assert shipped.params() == {**shipped.params(), **DEFAULT_POLICY_SPEC["guards"]["quality"]}
    with pytest.raises(ValueError, match="guards.quality.alpha"):
        make_policy({"policy": "static", "thresholds": 0.5, "guards": {"quality": {"alpha": 2}}}, make_slo())
    with pytest.raises(ValueError, match="guards.quality"):
        make_policy({"policy": "static", "thresholds": 0.5, "guards": {"quality": {"gain": 1}}}, make_slo())


def test_slo_alias_guards_override_key_by_key() -> None:
    from policies.guards import FailSafe, QualityGuard

    policy = make_policy({"policy": "slo", "guards": {"stale_after_s": 2}}, make_slo())
    assert isinstance(policy, FailSafe) and policy.stale_after_s == 2
    guard = policy.inner
    assert isinstance(guard, QualityGuard) and (guard.alpha, guard.margin) == (0.1, 0.0)  # the shipped guard
    bare = make_policy({"policy": "slo", "guards": {"quality": False}}, make_slo())
    assert not isinstance(bare.inner, QualityGuard)


@pytest.mark.parametrize("spec", ["slo", "static:0.5", {"policy": "slo", "queue_joins": False, "guards": False},
                                  {"policy": "pid", "guards": {"quality": False, "max_rate": 0.5}}, *SPECS.values()])
def test_a_resolved_spec_writes_every_parameter_and_builds_the_same_policy(spec: Any) -> None:
    """resolve_spec: the alias expanded, every parameter and guard written out; it builds a policy described
    exactly as the spec's (wrappers, parameters), resolves to itself, and carries no default left to change."""
    from policies.registry import _REGISTRY, GuardParams, QualityParams, resolve_spec

    slo = make_slo()
    resolved = resolve_spec(spec)
    assert describe(make_policy(resolved, slo)) == describe(make_policy(spec, slo))
    assert resolve_spec(resolved) == resolved
    json.dumps(resolved)  # recorded in the status history as is
    name = resolved["policy"]
    assert set(resolved) == {"policy", "guards", *_REGISTRY[name][0].model_fields}
    guards = resolved["guards"]
    if guards is not False:
        assert set(guards) == set(GuardParams.model_fields)
        assert guards["quality"] is False or set(guards["quality"]) == set(QualityParams.model_fields)


def test_resolve_spec_refuses_a_bad_spec_by_name() -> None:
    from policies.registry import resolve_spec

    with pytest.raises(ValueError, match=r"^pid\.kp"):
        resolve_spec({"policy": "pid", "kp": "fast"})
    with pytest.raises(ValueError, match="known policies"):
        resolve_spec("magic")


def test_the_quality_guards_defaults_are_its_parameters_defaults() -> None:
    """``quality: true`` resolves to QualityParams() written out: the same guard only if the defaults agree."""
    import inspect

    from policies.guards import QualityGuard
    from policies.registry import QualityParams

    signature = inspect.signature(QualityGuard.__init__).parameters
    assert {k: f.default for k, f in QualityParams.model_fields.items()} == {
        k: signature[k].default for k in QualityParams.model_fields}
