"""Prometheus exposition of the controller's aggregated state.

The controller is the one place that sees every replica's exact counters and every finished request,
so ``/metrics`` is rendered from its state: cumulative totals (sums of window deltas, so they survive
replica restarts), latency histograms fed with each request's exact TTFT/TPOT/E2E, and the current
gauges (T per tier, queue depth, last window's acceptance, distortion, SLO attainment). A private
``CollectorRegistry`` with one custom collector renders exactly the current values on each scrape —
nothing is sampled or cached in between.

Naming follows Prometheus' conventions (and what Ray Serve's own ``ray_serve_*`` metrics sit beside):
units in the name (``_seconds``), counters end ``_total``, ratios in [0, 1] end ``_ratio``, no gauges of
per-second rates (``rate(fsd_output_tokens_total[1m])`` is the throughput, ``rate(fsd_slo_met_total[1m])``
the goodput), and per-replica values carry a ``replica`` label whose value is Serve's replica id — the
same ``replica`` label ``ray_serve_replica_processing_queries`` and friends carry, so they join.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from policies.signals import attainment

#: Histogram upper bounds in seconds (TPOT lives in the 5–500 ms range, E2E in seconds).
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0,
    20.0, 30.0, 60.0,
)
_METRICS = ("ttft", "tpot", "e2e")


class _Histogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        self.total += seconds

    def buckets(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, count in zip((*LATENCY_BUCKETS_S, math.inf), self.counts, strict=True):
            running += count
            out.append(("+Inf" if math.isinf(bound) else repr(bound), float(running)))
        return out


class MetricsState:
    """Everything ``/metrics`` shows; updated once per control tick by the controller."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.tier_totals: dict[str, dict[str, float]] = {}
        self.slo_met_total: dict[str, int] = {}
        self.histograms: dict[tuple[str, str], _Histogram] = {}
        self.thresholds: dict[str, float] = {}
        self.gauges: dict[str, float] = {}
        self.tier_gauges: dict[str, dict[str, float]] = {}
        self.replica_gauges: dict[str, dict[str, float]] = {}  # replica id → gauge name → value
        self.replica_thresholds: dict[str, dict[str, float]] = {}  # replica id → tier → T it applies
        self.ticks = 0
        self.policy_errors = 0

    def update(self, window: Any, thresholds: Mapping[str, float]) -> None:
        """Fold one :class:`controller.telemetry_agg.Window` in."""
        tel = window.telemetry
        self.ticks += 1
        for k, v in window.deltas.items():
            self.totals[k] = self.totals.get(k, 0.0) + v
        for tier, values in window.tier_deltas.items():
            acc = self.tier_totals.setdefault(tier, {})
            for k, v in values.items():
                acc[k] = acc.get(k, 0.0) + v
        for tier, met in window.slo_met.items():
            self.slo_met_total[tier] = self.slo_met_total.get(tier, 0) + met
        for record in window.records:
            for metric in _METRICS:
                value = record.get(f"{metric}_ms")
                if value is not None:
                    self.histograms.setdefault((metric, str(record["tier"])), _Histogram()).observe(value / 1e3)
        self.thresholds = dict(thresholds)
        self.gauges = {
            "queue_depth": tel.queue_depth,
            "in_flight": tel.in_flight,
            "replicas": tel.replicas,
            "draft_length": tel.draft_length,
            "acceptance_ratio": tel.acceptance_rate,
            "tokens_per_iteration": tel.mean_accepted_per_iter,
            "mean_distortion": tel.mean_distortion,
            "telemetry_age_seconds": tel.age_s,
            "failsafe_replicas": sum(1 for r in window.replicas if r.get("failsafe")),
        }
        self.tier_gauges = {}
        for name, tw in tel.tiers.items():
            self.tier_gauges[name] = {
                # The policies' definition: refused and aborted requests of the tier are misses too.
                "slo_attainment_ratio": attainment(tel, name),
                "mean_distortion": tw.mean_distortion,
            }
        self.replica_gauges, self.replica_thresholds = {}, {}
        for report in window.replicas:
            rid = str(report.get("replica_id"))
            self.replica_gauges[rid] = {
                key: float(report[key]) for key in ("queue_depth", "in_flight", "running", "draft_length")
                if isinstance(report.get(key), int | float)
            }
            self.replica_gauges[rid]["failsafe"] = 1.0 if report.get("failsafe") else 0.0
            age = report.get("last_update_age_s")
            if isinstance(age, int | float):
                self.replica_gauges[rid]["control_update_age_seconds"] = float(age)
            self.replica_thresholds[rid] = {str(t): float(v) for t, v in (report.get("thresholds") or {}).items()}

    def render(self) -> bytes:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        return generate_latest(registry)


class _Collector:
    def __init__(self, state: MetricsState) -> None:
        self._s = state

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        s = self._s
        t = GaugeMetricFamily("fsd_threshold", "current FSD threshold T per tier", labels=["tier"])
        for tier, value in sorted(s.thresholds.items()):
            t.add_metric([tier], value)
        yield t
        counter_help = {
            "arrivals": "requests admitted by replicas", "completions": "requests finished",
            "rejections": "requests refused for overload", "aborted": "requests aborted (client gone, timeout)",
            "failed": "requests failed by the engine", "drafted": "draft tokens proposed",
            "accepted": "draft tokens accepted (exactly or fuzzily)",
            "fuzzy_accepted": "draft tokens accepted only because D <= T",
            "output_tokens": "output tokens emitted", "iterations": "engine iterations",
            "distortion": "summed per-token TV distortion", "prefill_tokens": "prompt tokens prefilled",
        }
        for key, help_text in counter_help.items():
            c = CounterMetricFamily(f"fsd_{key}", help_text)
            c.add_metric([], s.totals.get(key, 0.0))
            yield c
        for key, help_text in (("completions", "requests finished per tier"),
                               ("output_tokens", "output tokens per tier"),
                               ("distortion", "summed distortion per tier")):
            c = CounterMetricFamily(f"fsd_tier_{key}", help_text, labels=["tier"])
            for tier, values in sorted(s.tier_totals.items()):
                c.add_metric([tier], values.get(key, 0.0))
            yield c
        met = CounterMetricFamily("fsd_slo_met", "finished requests that met every latency target of their tier",
                                  labels=["tier"])
        for tier, value in sorted(s.slo_met_total.items()):
            met.add_metric([tier], float(value))
        yield met
        for key, value in sorted(s.gauges.items()):
            g = GaugeMetricFamily(f"fsd_{key}", f"last control window: {key.replace('_', ' ')}")
            g.add_metric([], float(value))
            yield g
        for key, help_text in (("slo_attainment_ratio", "share (0-1) of the window's requests that met the tier's SLO"),
                               ("mean_distortion", "mean per-token distortion in the last window")):
            g = GaugeMetricFamily(f"fsd_tier_{key}", help_text, labels=["tier"])
            for tier, values in sorted(s.tier_gauges.items()):
                g.add_metric([tier], values[key])
            yield g
        replica_help = {
            "queue_depth": "requests waiting for a batch slot on this replica",
            "in_flight": "requests admitted by this replica (waiting + running)",
            "running": "sequences in this replica's running batch",
            "draft_length": "draft length k this replica runs",
            "failsafe": "1 while this replica runs its safe T because the controller went quiet",
            "control_update_age_seconds": "time since this replica last heard from the controller",
        }
        for key, help_text in replica_help.items():
            g = GaugeMetricFamily(f"fsd_replica_{key}", help_text, labels=["replica"])
            for rid, values in sorted(s.replica_gauges.items()):
                if key in values:
                    g.add_metric([rid], values[key])
            yield g
        rt = GaugeMetricFamily("fsd_replica_threshold", "T this replica applies per tier", labels=["replica", "tier"])
        for rid, tiers in sorted(s.replica_thresholds.items()):
            for tier, value in sorted(tiers.items()):
                rt.add_metric([rid, tier], value)
        yield rt
        for metric in _METRICS:
            h = HistogramMetricFamily(f"fsd_{metric}_seconds", f"{metric.upper()} of finished requests",
                                      labels=["tier"])
            for (name, tier), hist in sorted(s.histograms.items()):
                if name == metric:
                    h.add_metric([tier], hist.buckets(), hist.total)
            yield h
        ticks = CounterMetricFamily("fsd_control_ticks", "control loop ticks")
        ticks.add_metric([], float(s.ticks))
        yield ticks
        errs = CounterMetricFamily("fsd_policy_errors", "policy calls that raised (T held)")
        errs.add_metric([], float(s.policy_errors))
        yield errs
