"""Decision validates what it carries: a bad value names itself."""

from __future__ import annotations

import math

import pytest

from policies.decision import Decision


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"thresholds": {"economy": -1.0}}, r"threshold for tier 'economy' must be finite and >= 0, got -1.0"),
        ({"thresholds": {"economy": math.nan}}, r"threshold for tier 'economy'"),
        ({"draft_lengths": {"economy": 1.5}}, r"draft length for tier 'economy' must be an int >= 0, got 1.5"),
        ({"batch_cap": 0}, r"batch_cap must be an int >= 1 or None, got 0"),
        ({"batch_cap": True}, r"batch_cap must be an int >= 1 or None, got True"),
        ({"batch_cap": 2.0}, r"batch_cap must be an int >= 1 or None, got 2.0"),
        ({"replicas": -1}, r"replicas must be >= 0, got -1"),
    ],
)
def test_bad_values_are_refused_by_name(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Decision(**kwargs)


def test_batch_cap_defaults_to_none_and_keeps_its_value() -> None:
    assert Decision().batch_cap is None
    assert Decision(batch_cap=3).batch_cap == 3


def test_batch_cap_is_keyword_only_so_positional_callers_keep_their_meaning() -> None:
    decision = Decision({"economy": 1.0}, {"economy": 4}, 3, "why")
    assert decision.replicas == 3 and decision.reason == "why" and decision.batch_cap is None
