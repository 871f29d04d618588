"""Metric names and labels as Prometheus and Ray Serve users expect them (no Ray: rendered from state)."""

from __future__ import annotations

import re
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from controller.metrics import MetricsState
from controller.telemetry_agg import TelemetryAggregator
from policies.slo import SLOSpec
from tests.controller.test_units import _record, _report


def _families() -> dict[str, Any]:
    agg = TelemetryAggregator(SLOSpec.default())
    state = MetricsState()
    for report in (
        _report("rep-a", 1, {"completions": 2, "output_tokens": 16}, [_record("standard", 50.0)], queue_depth=3,
                in_flight=5, failsafe=True, running=2, last_update_age_s=2.5),
        _report("rep-b", 1, {"completions": 1, "output_tokens": 4}, [_record("economy", 90.0)], queue_depth=0,
                in_flight=1, running=1, thresholds={"standard": 0.4, "economy": 1.0, "lossless": 0.0}),
    ):  # one batch per replica incarnation
        agg.receive([report], now_s=0.5)
    window = agg.window(now_s=1.0, window_s=1.0, age_s=0.0, thresholds={"standard": 0.2})
    state.update(window, {"standard": 0.2, "economy": 0.5, "lossless": 0.0})
    return {f.name: f for f in text_string_to_metric_families(state.render().decode())}


def test_no_per_second_gauges_and_units_spelled_out() -> None:
    families = _families()
    for name, family in families.items():
        assert not re.search(r"_per_s$|_rate$|_s$|_ms$", name), f"{name}: units in full, rates left to rate()"
        if family.type == "gauge":
            assert "goodput" not in name and "throughput" not in name, name
    # The rates they replace are counters that rate() turns into the same figures.
    for counter in ("fsd_output_tokens", "fsd_arrivals", "fsd_slo_met"):
        assert families[counter].type == "counter", counter


def test_ratios_are_ratios() -> None:
    families = _families()
    for name in ("fsd_acceptance_ratio", "fsd_tier_slo_attainment_ratio"):
        for sample in families[name].samples:
            assert sample.value != sample.value or 0.0 <= sample.value <= 1.0, (name, sample)
    attainment = {s.labels["tier"]: s.value for s in families["fsd_tier_slo_attainment_ratio"].samples}
    assert attainment["standard"] == 1.0 and attainment["economy"] == 1.0  # 50 ms ≤ 60, 90 ms ≤ 120


def test_per_replica_values_carry_a_replica_label() -> None:
    families = _families()
    in_flight = {s.labels["replica"]: s.value for s in families["fsd_replica_in_flight"].samples}
    assert in_flight == {"rep-a": 5.0, "rep-b": 1.0}
    queue = {s.labels["replica"]: s.value for s in families["fsd_replica_queue_depth"].samples}
    assert queue == {"rep-a": 3.0, "rep-b": 0.0}
    failsafe = {s.labels["replica"]: s.value for s in families["fsd_replica_failsafe"].samples}
    assert failsafe == {"rep-a": 1.0, "rep-b": 0.0}
    age = {s.labels["replica"]: s.value for s in families["fsd_replica_control_update_age_seconds"].samples}
    assert age == {"rep-a": 2.5}, "a replica that reports no age gets no sample, not a made-up one"
    thresholds = {(s.labels["replica"], s.labels["tier"]): s.value for s in families["fsd_replica_threshold"].samples}
    assert thresholds[("rep-b", "economy")] == 1.0 and thresholds[("rep-a", "standard")] == 0.2
    # The service-wide gauges stay unlabelled sums over replicas.
    assert families["fsd_in_flight"].samples[0].value == 6.0
