"""benchmarks/load.py: the static (T, k) configurations and issue 11's criterion over a run's configs."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from benchmarks.load import (
    criterion,
    paired_rounds,
    parse_alternatives,
    policy_spec,
    pool_rounds,
    round_order,
    since_policy_event,
)


def _args(**kw: Any) -> argparse.Namespace:
    base: dict[str, Any] = {"tier": "economy", "tiers": ["economy"], "ceiling": 4.0, "default_k": 4,
                            "slo_policy": '{"policy": "slo"}'}
    base.update(kw)
    return argparse.Namespace(**base)


def test_static_configs_state_their_k_so_order_does_not_matter() -> None:
    assert policy_spec("static:2", _args()) == {
        "policy": "static", "thresholds": {"economy": 2.0}, "guards": False, "draft_lengths": 4}
    assert policy_spec("static:0.5:2", _args())["draft_lengths"] == 2
    assert policy_spec("static:1:0", _args())["draft_lengths"] == 0
    assert policy_spec("ceiling", _args())["draft_lengths"] == 4
    assert policy_spec("static0", _args())["draft_lengths"] == 4
    # A running service (--url): its k is not known here, so k is left to the service.
    assert "draft_lengths" not in policy_spec("static:2", _args(default_k=None))


@pytest.mark.parametrize("name", ["static:", "static:x", "static:1:2:3", "static:-1", "static:1:-2", "static:nan"])
def test_bad_static_configs_name_the_offending_value(name: str) -> None:
    with pytest.raises(ValueError, match="static:"):
        policy_spec(name, _args())


def test_named_policies_are_configurations_beside_slo() -> None:
    alternatives = parse_alternatives(['relaxed={"policy": "slo", "rate_z": 0}', 'pid = {"policy": "pid"}'])
    assert alternatives == {"relaxed": {"policy": "slo", "rate_z": 0}, "pid": {"policy": "pid"}}
    args = _args(alternatives=alternatives)
    assert policy_spec("relaxed", args) == {"policy": "slo", "rate_z": 0}
    assert policy_spec("slo", args) == {"policy": "slo"}
    with pytest.raises(ValueError, match="unknown configuration 'other'"):
        policy_spec("other", args)
    with pytest.raises(ValueError, match="given twice"):
        parse_alternatives(['a={"policy": "slo"}', 'a={"policy": "pid"}'])


@pytest.mark.parametrize(("item", "message"), [
    ("relaxed", "expected NAME=JSON"),
    ('=[]', "expected NAME=JSON"),
    ('a,b={"policy": "slo"}', "expected NAME=JSON"),
    ('slo={"policy": "pid"}', "'slo' is a built-in configuration"),
    ('static:1={"policy": "pid"}', "'static:1' is a built-in configuration"),
    ("relaxed={policy: slo}", "not JSON"),
    ("relaxed=[1]", 'a JSON object with a "policy" key'),
])
def test_bad_named_policies_name_the_offending_item(item: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_alternatives([item])


def _config(name: str, attainment: float, distortion: float, static: bool = True) -> dict[str, Any]:
    return {"name": name, "spec": {"policy": "static" if static else "slo"}, "slo_attainment": attainment,
            "mean_distortion_per_token": distortion}


TIER = {"tpot_ms": 200.0, "max_mean_distortion": 0.35}


def test_where_static_points_meet_the_slo_the_policy_must_meet_it_at_no_more_distortion() -> None:
    statics = [_config("plain", 0.2, 0.0), _config("static:2", 0.96, 0.20), _config("static:4", 1.0, 0.28)]
    out = criterion([*statics, _config("slo", 0.97, 0.15, static=False)], TIER)
    assert out is not None
    assert out["static_points_meeting"] == ["static:2", "static:4"]
    assert out["reference"]["name"] == "static:2"
    assert out["held"] == {"slo": True}
    assert criterion([*statics, _config("slo", 0.97, 0.25, static=False)], TIER)["held"] == {"slo": False}
    assert criterion([*statics, _config("slo", 0.90, 0.10, static=False)], TIER)["held"] == {"slo": False}


def test_where_none_meets_it_the_policy_must_come_within_a_point_of_the_best_within_budget() -> None:
    # static:4 has the most attainment but is over budget: the reference is static:2.
    statics = [_config("plain", 0.2, 0.0), _config("static:2", 0.60, 0.30), _config("static:4", 0.80, 0.40)]
    out = criterion([*statics, _config("slo", 0.595, 0.2, static=False)], TIER)
    assert out is not None and out["reference"]["name"] == "static:2"
    assert out["held"] == {"slo": True}
    assert criterion([*statics, _config("slo", 0.58, 0.2, static=False)], TIER)["held"] == {"slo": False}
    assert criterion([*statics, _config("slo", 0.70, 0.36, static=False)], TIER)["held"] == {"slo": False}


def test_no_criterion_without_both_kinds_of_configuration() -> None:
    assert criterion([_config("plain", 0.2, 0.0)], TIER) is None
    assert criterion([_config("slo", 0.2, 0.0, static=False)], TIER) is None


def test_rounds_run_as_a_palindrome_so_a_linear_drift_weighs_on_each_configuration_alike() -> None:
    order = round_order(["plain", "ceiling", "slo"], 2)
    assert order == [(0, "plain"), (0, "ceiling"), (0, "slo"), (1, "slo"), (1, "ceiling"), (1, "plain")]
    mean_position = {name: sum(i for i, (_, n) in enumerate(order) if n == name) / 2 for name in ("plain", "slo")}
    assert mean_position["plain"] == mean_position["slo"] == 2.5
    assert round_order(["a", "b"], 1) == [(0, "a"), (0, "b")]
    with pytest.raises(ValueError, match="got 0"):
        round_order(["a"], 0)


def test_pooled_rounds_keep_every_request_of_a_configuration_once() -> None:
    runs = [{"name": n, "round": r, "spec": {}, "records": [{"i": i, "r": r} for i in range(3)],
             "t_samples": [{"t_s": float(r)}]} for r, n in round_order(["plain", "slo"], 2)]
    pooled = pool_rounds(runs)
    assert [p["name"] for p in pooled] == ["plain", "slo"]
    assert sorted((q["r"], q["i"]) for q in pooled[1]["records"]) == [(r, i) for r in (0, 1) for i in range(3)]
    assert [s["t_s"] for s in pooled[0]["t_samples"]] == [0.0, 1.0]
    assert len(runs[0]["records"]) == 3  # the rounds' own runs are left as they were


def test_paired_rounds_compare_each_round_with_the_reference_run_beside_it() -> None:
    """Rounds pair the policy with the reference under the host's speed of the moment: the differences
    0.10, 0.20, 0.00 give a mean of 0.10 and a t-interval of 4.30 · 0.10 / sqrt(3); a round the policy
    did not run is left out, and a configuration with no round beside the reference is not reported."""
    by_round = [
        {"name": "static:4:6", "round": 0, "slo_attainment": 0.4}, {"name": "slo", "round": 0, "slo_attainment": 0.5},
        {"name": "static:4:6", "round": 1, "slo_attainment": 0.7}, {"name": "slo", "round": 1, "slo_attainment": 0.9},
        {"name": "static:4:6", "round": 2, "slo_attainment": 0.6}, {"name": "slo", "round": 2, "slo_attainment": 0.6},
        {"name": "static:4:6", "round": 3, "slo_attainment": 0.5},
    ]
    out = paired_rounds(by_round, "static:4:6", ["slo", "live"])
    assert list(out) == ["slo"]
    assert out["slo"]["per_round"] == pytest.approx([0.1, 0.2, 0.0])
    assert out["slo"]["rounds"] == 3 and out["slo"]["mean"] == pytest.approx(0.1)
    assert out["slo"]["ci95"] == pytest.approx(4.30 * 0.1 / 3**0.5)


def test_a_runs_history_starts_at_the_put_of_its_policy() -> None:
    """--ticks keeps a run's history from its configuration's PUT (the last policy event) on, so the replay starts
    where that policy object did; a promotion or an SLO change is not a PUT; without any, the whole history."""
    tick = {"time_s": 1.0, "telemetry": {}, "decision": None}
    history = [{"event": {"kind": "resume"}}, tick, {"event": {"kind": "policy", "policy": {"policy": "static"}}},
               tick, {"event": {"kind": "policy", "policy": {"policy": "slo"}}}, tick,
               {"event": {"kind": "slo", "policy": {"policy": "slo"}}}, tick]
    assert since_policy_event(history) == history[4:]
    assert since_policy_event([tick, tick]) == [tick, tick]

