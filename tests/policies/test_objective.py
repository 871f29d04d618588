"""The objective in policies.slo: attainment target, hard budget, then least distortion, then least cost."""

from __future__ import annotations

import pytest

from policies.slo import SLOSpec, TierOutcome, TierSLO, meets_objective, objective_key, tiers_by_budget

TIER = TierSLO(percentile=95.0, tpot_ms=60.0, ttft_ms=2000.0, max_mean_distortion=0.15, max_threshold=1.0)


def best(*outcomes: TierOutcome) -> TierOutcome:
    return min(outcomes, key=lambda o: objective_key(TIER, o))


def test_default_slo_states_ttft_and_tpot_targets_on_every_tier() -> None:
    slo = SLOSpec.default()
    for name, tier in slo.tiers.items():
        assert tier.ttft_ms is not None and tier.tpot_ms is not None, name
        assert tier.has_latency_target
    assert slo.tiers["standard"].attainment_target == pytest.approx(0.95)
    assert not TierSLO().has_latency_target


def test_meeting_points_rank_by_distortion_then_cost() -> None:
    low_d = TierOutcome(attainment=0.96, mean_distortion=0.05, cost=3.0)
    high_d = TierOutcome(attainment=0.99, mean_distortion=0.10, cost=1.0)
    cheaper = TierOutcome(attainment=0.955, mean_distortion=0.05, cost=2.0)
    assert best(low_d, high_d) == low_d  # more attainment than needed buys nothing
    assert best(low_d, high_d, cheaper) == cheaper


def test_budget_is_hard_and_short_points_rank_by_attainment() -> None:
    over = TierOutcome(attainment=1.0, mean_distortion=0.2)
    short_a = TierOutcome(attainment=0.90, mean_distortion=0.14)
    short_b = TierOutcome(attainment=0.80, mean_distortion=0.0)
    assert best(over, short_a, short_b) == short_a
    assert not meets_objective(TIER, over) and not meets_objective(TIER, short_a)
    assert meets_objective(TIER, TierOutcome(attainment=0.95, mean_distortion=0.15))
    # A meeting point always beats a short one, whatever their distortions.
    assert best(short_b, TierOutcome(attainment=0.95, mean_distortion=0.14)).attainment == 0.95


def test_loosest_budget_spends_first() -> None:
    assert tiers_by_budget(SLOSpec.default()) == ["economy", "standard", "lossless"]
    assert tiers_by_budget(SLOSpec.default(), ["standard", "economy"]) == ["economy", "standard"]
