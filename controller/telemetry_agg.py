"""Replica reports → one :class:`policies.telemetry.Telemetry` window. Pure Python, no Ray.

Each replica's ``stats()`` carries cumulative counters (monotonic since the replica started) and the
finished-request records drained since the previous scrape. The aggregator keeps the last counters per
replica id and takes deltas, so a window counts exactly what happened in it; a replica seen for the
first time contributes everything since it started (a fresh replica has little history), and a
replica whose counters went backwards (same id, restarted) is treated as new.

Latency summaries and SLO attainment come from the records (exact per-request values, not histogram
approximations); ``slo_met`` counts requests that met *every* latency target of their tier.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from policies.slo import LatencyMetric, SLOSpec, TierSLO
from policies.telemetry import LatencySummary, Telemetry, TierWindow

_COUNTERS = (
    "arrivals", "completions", "rejections", "aborted", "failed", "drafted", "accepted", "fuzzy_accepted",
    "distortion", "output_tokens", "iterations", "row_iterations", "busy_time_s", "prefill_tokens",
)
_TIER_COUNTERS = ("arrivals", "completions", "output_tokens", "distortion")


def request_met_slo(record: Mapping[str, Any], tier: TierSLO) -> bool:
    """Did one finished request meet every latency target its tier sets? (no target ⇒ met)"""
    metrics: tuple[LatencyMetric, ...] = ("ttft", "tpot", "e2e")
    for metric in metrics:
        target = tier.latency_target(metric)
        value = record.get(f"{metric}_ms")
        if target is not None and value is not None and value > target:
            return False
    return True


@dataclass(frozen=True)
class Window:
    """One aggregated window: the policy's view plus what metrics and status need besides."""

    telemetry: Telemetry
    records: list[dict[str, Any]]
    deltas: dict[str, float]
    tier_deltas: dict[str, dict[str, float]]
    slo_met: dict[str, int]
    replicas: list[dict[str, Any]] = field(default_factory=list)


class TelemetryAggregator:
    """Turns successive sets of replica reports into windows (see the module docstring)."""

    def __init__(self, slo: SLOSpec, forget_after_s: float = 60.0) -> None:
        self.slo = slo
        self._last: dict[str, tuple[float, dict[str, Any]]] = {}  # replica id → (time seen, counters)
        self._forget_after_s = forget_after_s

    def _delta(self, replica_id: str, counters: Mapping[str, Any], now_s: float) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        prev = self._last.get(replica_id)
        prev_counters: Mapping[str, Any] = prev[1] if prev is not None else {}
        if prev_counters and any(float(counters.get(k, 0)) < float(prev_counters.get(k, 0)) for k in _COUNTERS):
            prev_counters = {}  # restarted under the same id: its counters began again at zero
        self._last[replica_id] = (now_s, dict(counters))
        delta = {k: float(counters.get(k, 0)) - float(prev_counters.get(k, 0)) for k in _COUNTERS}
        tiers: dict[str, dict[str, float]] = {}
        prev_tiers = prev_counters.get("per_tier", {}) if prev_counters else {}
        for name, values in counters.get("per_tier", {}).items():
            before = prev_tiers.get(name, {})
            tiers[name] = {k: float(values.get(k, 0)) - float(before.get(k, 0)) for k in _TIER_COUNTERS}
        return delta, tiers

    def window(
        self,
        reports: Sequence[Mapping[str, Any]],
        *,
        now_s: float,
        window_s: float,
        age_s: float,
        thresholds: Mapping[str, float],
        extra_rejections: int = 0,
    ) -> Window:
        """Aggregate one window. ``thresholds`` is the T per tier the controller last pushed (the
        replica-reported T is used for a tier where every reporting replica agrees on another value,
        e.g. all of them in fail-safe)."""
        totals = dict.fromkeys(_COUNTERS, 0.0)
        tier_totals: dict[str, dict[str, float]] = {}
        records: list[dict[str, Any]] = []
        queue_depths: list[int] = []
        in_flight = 0
        draft_length = 0
        for report in reports:
            delta, tiers = self._delta(str(report["replica_id"]), report["counters"], now_s)
            for k, v in delta.items():
                totals[k] += v
            for name, values in tiers.items():
                acc = tier_totals.setdefault(name, dict.fromkeys(_TIER_COUNTERS, 0.0))
                for k, v in values.items():
                    acc[k] += v
            records.extend(report.get("records", []))
            queue_depths.append(int(report.get("queue_depth", 0)))
            in_flight += int(report.get("in_flight", 0))
            draft_length = max(draft_length, int(report.get("draft_length", 0)))
        for rid, (seen, _) in list(self._last.items()):
            if now_s - seen > self._forget_after_s:
                del self._last[rid]
        totals["rejections"] += extra_rejections

        reported_t = self._reported_thresholds(reports)
        tiers_out: dict[str, TierWindow] = {}
        slo_met_by_tier: dict[str, int] = {}
        for name, tier in self.slo.tiers.items():
            tier_records = [r for r in records if r.get("tier") == name]
            met = sum(1 for r in tier_records if request_met_slo(r, tier))
            slo_met_by_tier[name] = met
            counts = tier_totals.get(name, dict.fromkeys(_TIER_COUNTERS, 0.0))
            tokens = int(counts["output_tokens"])
            tiers_out[name] = TierWindow(
                threshold=reported_t.get(name, float(thresholds.get(name, tier.clamp(tier.safe_threshold)))),
                completions=len(tier_records),
                slo_met=met,
                ttft=_summary(tier_records, "ttft_ms"),
                tpot=_summary(tier_records, "tpot_ms"),
                e2e=_summary(tier_records, "e2e_ms"),
                mean_distortion=counts["distortion"] / tokens if tokens > 0 else 0.0,
                output_tokens=tokens,
            )
        tokens = int(totals["output_tokens"])
        telemetry = Telemetry(
            time_s=now_s,
            window_s=window_s,
            arrivals=int(totals["arrivals"]),
            completions=int(totals["completions"]),
            rejections=int(totals["rejections"]),
            queue_depth=sum(queue_depths),
            queue_depth_per_replica=tuple(queue_depths),
            in_flight=in_flight,
            ttft=_summary(records, "ttft_ms"),
            tpot=_summary(records, "tpot_ms"),
            e2e=_summary(records, "e2e_ms"),
            acceptance_rate=totals["accepted"] / totals["drafted"] if totals["drafted"] > 0 else math.nan,
            mean_accepted_per_iter=tokens / totals["row_iterations"] if totals["row_iterations"] > 0 else math.nan,
            mean_distortion=totals["distortion"] / tokens if tokens > 0 else 0.0,
            output_tokens=tokens,
            output_tokens_per_s=tokens / window_s,
            replicas=len(reports),
            draft_length=draft_length or 4,
            age_s=age_s,
            tiers=tiers_out,
        )
        replicas = [
            {k: report.get(k) for k in ("replica_id", "actor_name", "node_id", "pid", "thresholds", "version", "failsafe", "queue_depth",
                                        "in_flight", "running", "engine_alive", "draft_length",
                                        "last_update_age_s", "uptime_s", "pair")}
            for report in reports
        ]
        return Window(telemetry, records, totals, tier_totals, slo_met_by_tier, replicas)

    @staticmethod
    def _reported_thresholds(reports: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        """T per tier on which every reporting replica agrees (none when they disagree or none report)."""
        out: dict[str, float] = {}
        if not reports:
            return out
        names = set.intersection(*(set(r.get("thresholds", {})) for r in reports))
        for name in names:
            values = {float(r["thresholds"][name]) for r in reports}
            if len(values) == 1:
                out[name] = values.pop()
        return out


def _summary(records: Sequence[Mapping[str, Any]], key: str) -> LatencySummary:
    return LatencySummary.from_samples([float(r[key]) for r in records if r.get(key) is not None])
