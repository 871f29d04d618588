"""benchmarks/load.py: the static (T, k) configurations and issue 11's criterion over a run's configs."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from benchmarks.load import criterion, policy_spec


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
