"""Replica reports → one :class:`policies.telemetry.Telemetry` window. Pure Python, no Ray.

Replicas push :class:`controller.protocol.ReplicaReport` batches whenever their own timer fires
(:meth:`TelemetryAggregator.receive`); the controller closes a window every tick
(:meth:`TelemetryAggregator.window`). Exactly-once counting:

* a report carries *deltas* (counters since the previous report of the same replica incarnation) and
  the requests finished since then, never lifetime counters — so a replica that was silent (stopped,
  partitioned, forgotten) and comes back adds only what it has not reported yet;
* reports are numbered per incarnation (``seq`` 1, 2, …) and the replica re-sends every report until
  the controller's reply acknowledges its number; :meth:`receive` counts a number once and returns the
  highest counted, so a re-sent (or duplicated) report is never counted twice and an unanswered one is
  never lost.

A slow or dead replica costs only its own contribution: a window aggregates whatever arrived since the
previous one, and nobody waits for anyone. State that is not additive (queue depth, T held, fail-safe)
comes from each replica's newest report; a replica silent for ``forget_after_s`` leaves that view.

Latency summaries and SLO attainment come from the records (exact per-request values, not histogram
approximations); ``slo_met`` counts requests that met *every* latency target of their tier. Requests
that got no answer (refused, aborted, timed out, failed) are per-tier counters, misses for attainment.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from controller.batching import ReplicaCounters, RequestRecord, TierCounters
from controller.protocol import ReplicaReport, ReplicaState
from policies.slo import LatencyMetric, SLOSpec, TierSLO
from policies.telemetry import LatencySummary, StepTotals, Telemetry, TierWindow

#: Incarnations whose acknowledged sequence number is remembered (oldest forgotten first).
MAX_REMEMBERED_INCARNATIONS = 4096


def request_met_slo(record: RequestRecord | Mapping[str, Any], tier: TierSLO) -> bool:
    """Did one finished request meet every latency target its tier sets? (no target ⇒ met)"""
    metrics: tuple[LatencyMetric, ...] = ("ttft", "tpot", "e2e")
    for metric in metrics:
        target = tier.latency_target(metric)
        key = f"{metric}_ms"
        value = record.get(key) if isinstance(record, Mapping) else getattr(record, key)
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
    reports: int = 0  # reports folded into this window
    push_latencies_ms: list[float] = field(default_factory=list)


@dataclass
class _Seen:
    received_s: float
    state: ReplicaState
    seq: int


class TelemetryAggregator:
    """Receives report batches and turns them into windows (see the module docstring)."""

    def __init__(self, slo: SLOSpec, forget_after_s: float = 60.0) -> None:
        self.slo = slo
        self._forget_after_s = forget_after_s
        self._acked: OrderedDict[str, int] = OrderedDict()  # incarnation → highest seq counted
        self._pending: list[ReplicaReport] = []  # counted, not yet folded into a window
        self._replicas: dict[str, _Seen] = {}  # replica id → newest report's state
        self._last_report_s: float | None = None

    def acked(self, incarnation: str) -> int:
        return self._acked.get(incarnation, 0)

    def receive(self, batch: Sequence[ReplicaReport], now_s: float) -> int:
        """Count every report of ``batch`` not counted before; the highest ``seq`` counted for the
        batch's incarnation (what the reply acknowledges). A batch holds one incarnation's reports."""
        if not batch:
            return 0
        incarnation = batch[0].incarnation
        if any(r.incarnation != incarnation for r in batch):
            raise ValueError("a report batch must come from one replica incarnation")
        last = self._acked.get(incarnation, 0)
        for report in sorted(batch, key=lambda r: r.seq):
            if report.seq <= last:
                continue  # a re-send of a report already counted (its acknowledgement was lost)
            self._pending.append(report)
            last = report.seq
        self._acked[incarnation] = last
        self._acked.move_to_end(incarnation)
        while len(self._acked) > MAX_REMEMBERED_INCARNATIONS:
            self._acked.popitem(last=False)
        newest = max(batch, key=lambda r: r.seq)
        seen = self._replicas.get(newest.state.replica_id)
        if seen is None or seen.state.pid != newest.state.pid or newest.seq >= seen.seq:
            self._replicas[newest.state.replica_id] = _Seen(now_s, newest.state, newest.seq)
        else:
            seen.received_s = now_s
        self._last_report_s = now_s
        return last

    def live_states(self, now_s: float) -> list[tuple[float, ReplicaState]]:
        """(age of the newest report, state) of every replica heard from within ``forget_after_s``."""
        for rid, seen in list(self._replicas.items()):
            if now_s - seen.received_s > self._forget_after_s:
                del self._replicas[rid]
        return [(now_s - seen.received_s, seen.state) for seen in self._replicas.values()]

    def age_s(self, now_s: float, since_s: float) -> float:
        """Age of the newest report received (since ``since_s`` when none has arrived yet)."""
        return now_s - (self._last_report_s if self._last_report_s is not None else since_s)

    def window(
        self,
        *,
        now_s: float,
        window_s: float,
        age_s: float,
        thresholds: Mapping[str, float],
        ingress_rejections: Mapping[str, int] | None = None,
        ingress_aborted: Mapping[str, int] | None = None,
        draft_lengths: Mapping[str, int] | None = None,
    ) -> Window:
        """Fold every report received since the previous window into one window. ``thresholds`` is
        the T per tier the controller last decided (the replica-held T is used for a tier where every
        live replica agrees on another value, e.g. all of them in fail-safe). ``ingress_*``: requests
        per tier the ingress answered 503 / 504 before any replica saw them. ``draft_lengths``: the k per
        tier the controller last decided (the replica-held k is used where every live replica agrees).

        The fields the model-predictive policy corrects itself with come from the replicas' exact
        counters: per tier ``sequence_iterations`` (decode steps its rows took part in) and
        ``draft_length``; ``mean_iteration_ms`` = decode-step wall time (step time less prefill and draft catch-up) per
        step and ``mean_batch_size`` = rows per step, over the window's steps (NaN without steps); ``plain_steps`` and
        ``speculative_steps`` the same steps by kind, with what a step model needs of each."""
        reports, self._pending = self._pending, []
        totals = ReplicaCounters()
        records: list[RequestRecord] = []
        push_latencies: list[float] = []
        for report in reports:
            totals.add(report.counters)
            records.extend(report.records)
            push_latencies.extend(report.push_latencies_ms)
        # Requests the ingress refused never reached a replica's arrival counter; the telemetry's
        # arrivals are the offered load (as in the simulator), so they count there too.
        refused: dict[str, int] = {}
        for name, n in (ingress_rejections or {}).items():
            if name in self.slo.tiers:
                totals.rejections += n
                totals.tier(name).rejections += n
                refused[name] = refused.get(name, 0) + n
        for name, n in (ingress_aborted or {}).items():
            if name in self.slo.tiers:
                totals.aborted += n
                totals.tier(name).aborted += n

        live = self.live_states(now_s)
        states = [state for _, state in live]
        reported_t = self._agreed_thresholds(states)
        reported_k = self._agreed_draft_lengths(states)
        decided_k = dict(draft_lengths or {})
        tiers_out: dict[str, TierWindow] = {}
        slo_met_by_tier: dict[str, int] = {}
        for name, tier in self.slo.tiers.items():
            tier_records = [r for r in records if r.tier == name]
            met = sum(1 for r in tier_records if request_met_slo(r, tier))
            slo_met_by_tier[name] = met
            counts = totals.per_tier.get(name, TierCounters())
            tokens = int(counts.output_tokens)
            tiers_out[name] = TierWindow(
                threshold=reported_t.get(name, float(thresholds.get(name, tier.clamp(tier.safe_threshold)))),
                completions=len(tier_records),
                slo_met=met,
                ttft=_summary(tier_records, "ttft_ms"),
                tpot=_summary(tier_records, "tpot_ms"),
                e2e=_summary(tier_records, "e2e_ms"),
                mean_distortion=counts.distortion / tokens if tokens > 0 else 0.0,
                output_tokens=tokens,
                draft_length=reported_k.get(name, decided_k.get(name)),
                sequence_iterations=int(counts.row_iterations),
                arrivals=int(counts.arrivals) + refused.get(name, 0),
                rejections=int(counts.rejections),
                aborted=int(counts.aborted + counts.failed),
            )
        tokens = int(totals.output_tokens)
        queue_depths = tuple(s.queue_depth for s in states)
        k_values = [k for s in states for k in s.draft_lengths.values()]
        default_k = tiers_out[self.slo.default_tier].draft_length if self.slo.default_tier in tiers_out else None
        if default_k is None:
            default_k = max(k_values) if k_values else 4
        # Decode steps less the joins' prefills and the draft's catch-ups: one-offs the policy models apart.
        decode_s = totals.busy_time_s - totals.prefill_time_s - totals.catch_up_time_s
        telemetry = Telemetry(
            time_s=now_s,
            window_s=window_s,
            arrivals=int(totals.arrivals) + sum(refused.values()),
            completions=int(totals.completions),
            rejections=int(totals.rejections),
            queue_depth=sum(queue_depths),
            queue_depth_per_replica=queue_depths,
            in_flight=sum(s.in_flight for s in states),
            ttft=_summary(records, "ttft_ms"),
            tpot=_summary(records, "tpot_ms"),
            e2e=_summary(records, "e2e_ms"),
            acceptance_rate=totals.accepted / totals.drafted if totals.drafted > 0 else math.nan,
            mean_accepted_per_iter=tokens / totals.row_iterations if totals.row_iterations > 0 else math.nan,
            mean_distortion=totals.distortion / tokens if tokens > 0 else 0.0,
            output_tokens=tokens,
            output_tokens_per_s=tokens / window_s,
            replicas=len(states),
            draft_length=default_k,
            mean_iteration_ms=decode_s / totals.iterations * 1e3 if totals.iterations > 0 else math.nan,
            mean_batch_size=totals.row_iterations / totals.iterations if totals.iterations > 0 else math.nan,
            prefill_ms=totals.prefill_time_s * 1e3,
            plain_steps=StepTotals(steps=totals.iterations - totals.speculative_steps,
                                   ms=(decode_s - totals.speculative_step_s) * 1e3,
                                   rows=totals.row_iterations - totals.speculative_rows),
            speculative_steps=StepTotals(steps=totals.speculative_steps, ms=totals.speculative_step_s * 1e3,
                                         rows=totals.speculative_rows,
                                         draft_forwards=totals.speculative_draft_forwards,
                                         verify_tokens=totals.speculative_verify_tokens,
                                         drafted_row_forwards=totals.speculative_drafted_row_forwards),
            age_s=age_s,
            tiers=tiers_out,
        )
        replicas = [{**asdict(state), "telemetry_age_s": age} for age, state in live]
        return Window(
            telemetry=telemetry,
            records=[asdict(r) for r in records],
            deltas=totals.scalars(),
            tier_deltas={name: {k: float(v) for k, v in asdict(t).items()} for name, t in totals.per_tier.items()},
            slo_met=slo_met_by_tier,
            replicas=replicas,
            reports=len(reports),
            push_latencies_ms=push_latencies,
        )

    @staticmethod
    def _agreed_draft_lengths(states: Sequence[ReplicaState]) -> dict[str, int]:
        """k per tier on which every live replica agrees (none when they disagree or none report)."""
        if not states:
            return {}
        names = set.intersection(*(set(s.draft_lengths) for s in states))
        out: dict[str, int] = {}
        for name in names:
            values = {int(s.draft_lengths[name]) for s in states}
            if len(values) == 1:
                out[name] = values.pop()
        return out

    @staticmethod
    def _agreed_thresholds(states: Sequence[ReplicaState]) -> dict[str, float]:
        """T per tier on which every live replica agrees (none when they disagree or none report)."""
        out: dict[str, float] = {}
        if not states:
            return out
        names = set.intersection(*(set(s.thresholds) for s in states))
        for name in names:
            values = {float(s.thresholds[name]) for s in states}
            if len(values) == 1:
                out[name] = values.pop()
        return out


def _summary(records: Sequence[RequestRecord], key: str) -> LatencySummary:
    values = [getattr(r, key) for r in records]
    return LatencySummary.from_samples([float(v) for v in values if v is not None])
