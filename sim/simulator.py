"""The discrete-event simulator: workload → routed replicas → control ticks → a :class:`SimResult`.

The loop is tiny: a heap keyed by (time, event order, sequence number); each event's handler returns
its follow-up events. The RNG and id counters belong to the simulator instance, so two simulators
with the same inputs and seed produce identical results. Nothing here writes files; see
:mod:`sim.report` for that.
"""

from __future__ import annotations

import heapq
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fsd_common.validation import format_validation_error
from policies.base import Policy
from policies.decision import Decision
from policies.slo import SLOSpec
from policies.telemetry import StepTotals, Telemetry
from policies.tiers import apply_decision
from sim.autoscaler import Autoscaler, AutoscalerConfig, replica_startup_s
from sim.entities import EventCounters, RequestTable, WindowBins
from sim.events import ApplyDecision, Arrival, ControlTick, Event, ReplicaReady, ReplicaReport, SegmentEnd
from sim.metrics import fast_summary, latencies_ms, slo_met, summarize, tier_windows, window_summaries
from sim.profile import Profile
from sim.replica import DecodeSettings, Replica, ReplicaState, survival_grid
from sim.workload import Requests, Workload

Routing = Literal["power_of_two", "least_loaded", "round_robin"]
# Spawn key of the per-request acceptance draws' RNG stream (any constant; see Simulator.__init__).
_REQUEST_ACCEPTANCE_STREAM = 0xACCE


class SimConfig(BaseModel):
    """Cluster and control-loop settings (pure configuration, no side effects)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 0
    replicas: int = Field(2, ge=1, description="replicas at t = 0 (ready)")
    max_batch: int = Field(8, ge=1, description="max sequences per continuous batch")
    max_queue: int = Field(64, ge=0, description="queued requests per replica before rejecting")
    routing: Routing = "power_of_two"
    control_interval_s: float = Field(1.0, gt=0)
    push_delay_s: float = Field(0.05, ge=0, description="decision → replicas latency (not with report_age_s)")
    telemetry_age_s: float = Field(0.0, ge=0, description="staleness reported to the policy (not with report_age_s)")
    report_age_s: float | None = Field(
        None, ge=0, allow_inf_nan=False,
        description="the live control loop's lag: the replicas report every control interval, this long before "
        "each tick, which reads the telemetry as of that report (window, counters, queues), and the decision "
        "reaches them with the reply to their next report, interval − age after the tick (live a replica's "
        "report phase drifts by a few ms a minute, so it is one age a run): the report is sealed first, then the "
        "decision applied, as a replica applies the reply to the report it sent. None: telemetry of the tick's "
        "instant, the decision push_delay_s after it"
    )
    div: str | None = Field(None, description="divergence (default: the profile's)")
    k: int | None = Field(None, ge=0, description="initial draft length of every tier (default: the profile's)")
    autoscaler: AutoscalerConfig | None = None
    honour_policy_replicas: bool = Field(False, description="use Decision.replicas as the autoscaler's desire")
    drain_timeout_s: float = Field(600.0, ge=0, description="after the last arrival; then unfinished = missed")
    horizon_iters: int = Field(48, ge=1, description="iterations drawn per segment at most (speed only)")
    replica_usd_per_hour: float | None = Field(None, gt=0)
    serving_overhead_ms: float = Field(
        0.0, ge=0, allow_inf_nan=False,
        description="the request's path outside the engine (HTTP, routing, streaming the tokens back), measured "
        "apart: added to every answered request's first token and completion as the client sees them (records "
        "and summary), not to the telemetry the policy reads, which live comes from the replicas' stamps"
    )

    @model_validator(mode="after")
    def _age_within_interval(self) -> SimConfig:
        if self.report_age_s is not None and self.report_age_s >= self.control_interval_s:
            raise ValueError(f"report_age_s {self.report_age_s} must be below control_interval_s "
                             f"{self.control_interval_s}")
        return self

    def policy_replica_bounds(self) -> tuple[int, int] | None:
        """(min, max) replicas a policy may ask for when its ``Decision.replicas`` drives the autoscaler
        (``honour_policy_replicas`` with an autoscaler); None otherwise. Pass it to
        ``make_policy(..., replica_bounds=...)``."""
        if self.autoscaler is None or not self.honour_policy_replicas:
            return None
        return self.autoscaler.min_replicas, self.autoscaler.max_replicas

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "sim config") -> SimConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ValueError(f"{source}: {format_validation_error(exc, first_only=True)}") from None


@dataclass
class SimResult:
    """What ``run()`` returns: summary, per-tick time series, per-request columns, run metadata."""

    summary: dict[str, Any]
    timeseries: dict[str, list[float]]
    records: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)
    iterations: int = 0
    events: int = 0


class Simulator:
    def __init__(
        self,
        config: SimConfig,
        profile: Profile,
        slo: SLOSpec,
        workload: Workload | Requests,
        policy: Policy,
    ) -> None:
        self.config = config
        self.profile = profile
        self.slo = slo
        self.policy = policy
        self.rng = np.random.default_rng(config.seed)
        self.div = config.div or profile.default_div
        initial_k = config.k if config.k is not None else profile.default_k
        profile.thresholds(self.div, initial_k)  # ValueError naming div/k when absent
        self.tier_names = list(slo.tiers)
        self._tier_index = {name: i for i, name in enumerate(self.tier_names)}
        if isinstance(workload, Workload):
            self.workload_name = workload.name
            self.requests = workload.generate(self.rng, self.tier_names, slo.default_tier)
        else:
            self.workload_name = "requests"
            self.requests = workload
        self.table = RequestTable(self.requests)
        if profile.request_acceptance is not None:
            # A stream of its own: switching the variation on leaves arrivals, routing and the
            # iteration draws' streams as they were (common random numbers across settings).
            variation_rng = np.random.default_rng([config.seed, _REQUEST_ACCEPTANCE_STREAM])
            self.table.acceptance_odds = profile.request_acceptance.draw_odds_scales(variation_rng, self.table.n)
        self.counters = EventCounters()
        # Every tier starts at its fail-safe T until the first decision lands (at t = 0).
        self.thresholds = {name: tier.clamp(tier.safe_threshold) for name, tier in slo.tiers.items()}
        # Every tier starts at the initial k; a decision's draft_lengths move it per tier.
        self.draft_lengths = {name: initial_k for name in slo.tiers}
        self.batch_limit = config.max_batch  # rows admitted per replica: max_batch or the policy's batch_cap
        n_t = len(self.tier_names)
        self.settings = DecodeSettings(
            k_by_tier=np.zeros(n_t, dtype=np.int64),
            k_pad=1,
            survival_by_tier=np.zeros((n_t, 1)),
            distortion_by_tier=np.zeros(n_t),
            survival_asc_by_tier=np.zeros((n_t, 1)),
            accept_by_tier=np.zeros((n_t, 1)),
            odds_centring_by_tier=np.ones(n_t),
            batch_odds=None,
            tier_weights=np.zeros((n_t, WindowBins.BASE + 3 * n_t)),
            coeffs_by_tier=[],
            plain_ms_by_rows=profile.latency.plain_table(config.max_batch),
        )
        self._refresh_settings()
        self.autoscaler = Autoscaler(config.autoscaler) if config.autoscaler else None
        #: Scale-up → serving: the scenario's ``autoscaler.startup_s``, else the profile's measured
        #: ``replica_startup_s``, else :data:`DEFAULT_REPLICA_STARTUP_S`.
        self.replica_startup_s = replica_startup_s(config.autoscaler, profile)
        self._policy_replicas: int | None = None
        n = len(self.requests)
        self._route_u: list[list[float]] = self.rng.random((n, 2)).tolist()
        self._rr = 0
        self._routing: Routing = config.routing
        self._heap: list[tuple[float, int, int, Event]] = []
        self._seq = 0
        self.now = 0.0
        self.events = 0
        last_arrival = float(self.requests.arrival_s[-1]) if n else 0.0
        if isinstance(workload, Workload) and workload.duration_s is not None:
            self.arrival_horizon_s = max(workload.duration_s, last_arrival)
        else:
            self.arrival_horizon_s = last_arrival
        self.end_s = self.arrival_horizon_s + config.drain_timeout_s
        self.bins = WindowBins(config.control_interval_s, self.end_s + config.control_interval_s,
                               len(self.tier_names), offset_s=config.report_age_s or 0.0)
        self._tick = 0
        self._routable_cache: list[Replica] | None = None
        self._live_cache: list[Replica] = []
        self._active_cache = 0
        self._completed_total = 0
        self.replicas: list[Replica] = []
        for _ in range(config.replicas):
            self._new_replica(0.0, 0.0)
        self._next_arrival = 0
        self._window_end_s = 0.0  # where the last window closed: the last tick, or report (report_age_s)
        self._reported: tuple[Telemetry, int] | None = None  # the last report's telemetry and SLO-met count
        self._pending: Decision | None = None  # the last tick's decision, applied at the next report
        self._last_report_due = False  # the work is done; one more report reads what ended after the last
        self.timeseries: dict[str, list[float]] = {}
        self.ignored_draft_lengths: set[int] = set()
        self._progress: Any = None

    # ---------------------------------------------------------------- helpers

    def _push(self, event: Event) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (event.time_s, event.ORDER, self._seq, event))

    def _new_replica(self, now: float, startup_s: float) -> Replica:
        r = Replica(
            replica_id=len(self.replicas),
            latency=self.profile.latency,
            max_batch=self.config.max_batch,
            max_queue=self.config.max_queue,
            table=self.table,
            bins=self.bins,
            rng=self.rng,
            started_s=now,
            ready_s=now + startup_s,
            horizon_iters=self.config.horizon_iters,
        )
        r.batch_limit = self.batch_limit
        self.replicas.append(r)
        self._routable_cache = None
        return r

    @property
    def k(self) -> int:
        """The default tier's draft length (single-k readers: telemetry, meta)."""
        return self.draft_lengths[self.slo.default_tier]

    def _refresh_settings(self) -> None:
        s = self.settings
        ks = [self.draft_lengths[n] for n in self.tier_names]
        s.state_key = tuple((self.thresholds[n], k) for n, k in zip(self.tier_names, ks, strict=True))
        s.k_by_tier = np.array(ks, dtype=np.int64)
        s.k_pad = max(1, *ks)
        s.coeffs_by_tier = [self.profile.latency.iteration_coeffs(k) for k in ks]
        accept = np.zeros((len(ks), s.k_pad))
        for i, (n, k) in enumerate(zip(self.tier_names, ks, strict=True)):
            accept[i, :k] = self.profile.position_accept(self.div, self.thresholds[n], k)
        s.accept_by_tier = accept
        s.odds_centring_by_tier = np.array([
            self.profile.request_odds_centring(self.div, self.thresholds[n], k)
            for n, k in zip(self.tier_names, ks, strict=True)
        ])
        s.survival_by_tier = np.cumprod(accept, axis=1)
        s.survival_grid, s.grid_tokens_by_tier = survival_grid(s.survival_by_tier)
        batch = self.profile.batch_acceptance
        if batch is not None:  # [max_batch + 1, n_tiers]; row 0 unused
            sizes = np.arange(1, self.config.max_batch + 1, dtype=float)
            s.batch_odds = np.ones((self.config.max_batch + 1, len(ks)))
            for i, n in enumerate(self.tier_names):
                s.batch_odds[1:, i] = batch.scales(sizes, self.thresholds[n])
        s.distortion_by_tier = np.array(
            [self.profile.mean_distortion(self.div, self.thresholds[n], k) for n, k in zip(self.tier_names, ks, strict=True)]
        )
        s.survival_asc_by_tier = np.ascontiguousarray(s.survival_by_tier[:, ::-1])
        events = [
            self.profile.distortion_events(self.div, self.thresholds[n], k)
            for n, k in zip(self.tier_names, ks, strict=True)
        ]
        present = [e for e in events if e is not None]
        if len(present) == len(events):
            s.event_p_by_tier = np.array([p for p, _ in present])
            s.event_size_by_tier = np.array([size for _, size in present])
        else:
            s.event_p_by_tier = s.event_size_by_tier = None
        n_t = len(self.tier_names)
        base = WindowBins.BASE
        w = np.zeros((n_t, base + 3 * n_t))
        w[:, WindowBins.TOKENS] = 1.0
        # The tokens again: a uniform-k step adds −rows to this column (DecodeSettings.step_table), the
        # general path overwrites it with tokens − rows.
        w[:, WindowBins.ACCEPTED] = 1.0
        w[:, WindowBins.DISTORTION] = s.distortion_by_tier
        w[:, base : base + n_t] = np.eye(n_t)
        w[:, base + n_t : base + 2 * n_t] = np.diag(s.distortion_by_tier)
        s.tier_weights = w

    def _schedule_segment(self, replica: Replica, end_s: float | None) -> list[Event]:
        if end_s is None:
            if replica.state is ReplicaState.DRAINING and replica.load(self.now) == 0:
                replica.state = ReplicaState.STOPPED
                self._routable_cache = None
                replica.stopped_s = self.now
            return []
        return [SegmentEnd(end_s, replica.id, replica.version)]

    def _routable(self) -> list[Replica]:
        if self._routable_cache is None:
            self._refresh_state_caches()
            assert self._routable_cache is not None
        return self._routable_cache

    def _refresh_state_caches(self) -> None:
        """Replica lists by state; every state change sets ``_routable_cache = None`` to redo them."""
        self._routable_cache = [r for r in self.replicas if r.state is ReplicaState.READY]
        self._live_cache = [r for r in self.replicas if r.state is not ReplicaState.STOPPED]
        self._active_cache = sum(
            1 for r in self.replicas if r.state in (ReplicaState.READY, ReplicaState.STARTING)
        )

    def _live(self) -> list[Replica]:
        """Replicas not stopped."""
        if self._routable_cache is None:
            self._refresh_state_caches()
        return self._live_cache

    def _active_count(self) -> int:
        if self._routable_cache is None:
            self._refresh_state_caches()
        return self._active_cache

    # ---------------------------------------------------------------- handlers

    def on_arrival(self, now: float, rid: int) -> list[Event]:
        out: list[Event] = []
        nxt = rid + 1
        if nxt < self.table.n:
            out.append(Arrival(self.table.arrival_list[nxt], nxt))
        self._next_arrival = nxt
        self.counters.arrivals += 1
        cands = self._routable()
        replica = self._route(now, rid, cands) if cands else None
        if replica is None or len(replica.queue) >= replica.max_queue:
            self.table.rejected[rid] = True
            self.counters.rejections += 1
            return out
        self.table.replica[rid] = replica.id
        self.counters.admitted_total += 1
        replica.queue.append(rid)
        if replica.segment is None:
            out += self._schedule_segment(replica, replica.start_segment(now, self.settings))
        elif len(replica.queue) == 1:
            moved = replica.truncate(now, need_room=True)
            if moved is not None:
                out.append(SegmentEnd(moved, replica.id, replica.version))
        return out

    def _route(self, now: float, rid: int, cands: list[Replica]) -> Replica:
        n = len(cands)
        if n == 1:
            return cands[0]
        mode = self._routing
        if mode == "round_robin":
            self._rr = (self._rr + 1) % n
            return cands[self._rr]
        if mode == "power_of_two":
            u1, u2 = self._route_u[rid]  # plain floats
            i = int(u1 * n)
            j = int(u2 * (n - 1))
            if j >= i:
                j += 1
            a, b = cands[i], cands[j]
            return a if a.load(now) <= b.load(now) else b
        best = cands[0]
        best_load = math.inf
        for r in cands:
            load = r.load(now)
            if load < best_load:
                best, best_load = r, load
        return best

    def on_segment_end(self, now: float, replica_id: int, version: int) -> list[Event]:
        replica = self.replicas[replica_id]
        if version != replica.version or replica.segment is None:
            return []  # superseded by a truncation
        return self._schedule_segment(replica, replica.finish_segment(self.settings))

    def on_replica_ready(self, now: float, replica_id: int) -> list[Event]:
        r = self.replicas[replica_id]
        if r.state is ReplicaState.STARTING:
            r.state = ReplicaState.READY
            self._routable_cache = None
        return []

    def on_apply_decision(self, now: float, decision: Decision) -> list[Event]:
        changed_tiers: set[int] = set()
        new = apply_decision(self.slo, self.thresholds, decision.thresholds)
        for name, t in new.items():
            if t != self.thresholds[name]:
                self.thresholds[name] = t
                changed_tiers.add(self._tier_index[name])
        available = self.profile.available_draft_lengths(self.div)
        for name, k in decision.draft_lengths.items():
            if name not in self.draft_lengths:
                continue  # an unknown tier: TierClamp drops it in guarded policies
            if k not in available:
                self.ignored_draft_lengths.add(k)
            elif k != self.draft_lengths[name]:
                self.draft_lengths[name] = k
                changed_tiers.add(self._tier_index[name])
        # None: the policy does not steer replicas (or its fail-safe tripped); the load-based desire
        # applies, as Serve's default policy does behind the live hook.
        self._policy_replicas = decision.replicas
        out: list[Event] = []
        limit = self.config.max_batch if decision.batch_cap is None else min(decision.batch_cap, self.config.max_batch)
        if limit != self.batch_limit:
            raised = limit > self.batch_limit
            self.batch_limit = limit
            for r in self.replicas:
                r.batch_limit = limit
                # A raised cap admits the queue at the next step boundary (a lowered one waits for the
                # batch to shrink below it, which the drawn segment already stops at only if full).
                if raised and r.queue and r.segment is not None:
                    moved = r.truncate(now, need_room=True)
                    if moved is not None:
                        out.append(SegmentEnd(moved, r.id, r.version))
        if not changed_tiers:
            return out
        self._refresh_settings()
        # A drawn segment depends on the (T, k) of the tiers in its batch only.
        for r in self.replicas:
            seg = r.segment
            if seg is not None and not changed_tiers.isdisjoint(seg.tiers):
                moved = r.truncate(now, need_room=False)
                if moved is not None:
                    out.append(SegmentEnd(moved, r.id, r.version))
        return out

    def on_replica_report(self, now: float) -> list[Event]:
        """The replicas report (``report_age_s``): seal the next tick's window as of now, then apply the last
        tick's decision, which rides the reply to this report."""
        age = self.config.report_age_s
        assert age is not None
        self._reported = self._telemetry(now, time_s=(self._tick + 1) * self.config.control_interval_s, age_s=age)
        self._window_end_s = now
        self.counters.reset()
        decision, self._pending = self._pending, None
        return [] if decision is None else self.on_apply_decision(now, decision)

    def on_control_tick(self, now: float) -> list[Event]:
        age = self.config.report_age_s
        interval = self.config.control_interval_s
        if age is None:
            telemetry, met = self._telemetry(now, time_s=now, age_s=self.config.telemetry_age_s)
            self._window_end_s = now
            self.counters.reset()
        else:
            assert self._reported is not None, "a report precedes every tick"
            telemetry, met = self._reported
        # The settings recorded beside the window are those in force at the tick (with the lag, from the report on).
        self._record_tick(telemetry, met)
        decision = self.policy.decide(telemetry)
        out: list[Event] = []
        if age is None:
            out.append(ApplyDecision(now + self.config.push_delay_s, decision))
        else:
            self._pending = decision  # with the reply to the replicas' next report
        out += self._autoscale(now, telemetry)
        work_left = self._next_arrival < self.table.n or any(
            r.segment is not None or r.queue for r in self.replicas
        )
        if not work_left and age is not None and not self._last_report_due:
            # What ended after the last report (up to this tick) is read at the next one.
            work_left = self._last_report_due = True
        # Tick w at exactly w·interval, so it reads bin w (see WindowBins).
        self._tick += 1
        nxt = (self._tick + 1) * interval
        if work_left and nxt <= self.end_s:
            if age is not None:
                out.append(ReplicaReport(nxt - age))
            out.append(ControlTick(nxt))
        if self._progress is not None:
            self._progress.update(now - self._progress.n)
        return out

    def _autoscale(self, now: float, telemetry: Telemetry) -> list[Event]:
        if self.autoscaler is None:
            return []
        current = self._active_count()
        if self.config.honour_policy_replicas and self._policy_replicas is not None:
            desired = self._policy_replicas
        else:
            desired = self.autoscaler.desired_from_load(telemetry.in_flight)
        target = self.autoscaler.target(now, current, desired)
        out: list[Event] = []
        if target > current:
            startup = self.replica_startup_s
            for _ in range(target - current):
                r = self._new_replica(now, startup)
                if r.state is ReplicaState.STARTING:
                    out.append(ReplicaReady(now + startup, r.id))
        elif target < current:
            # Cancel replicas still starting first, then drain the least loaded.
            victims = [r for r in self.replicas if r.state is ReplicaState.STARTING]
            victims += sorted(self._routable(), key=lambda r: (r.load(now), -r.id))
            for r in victims[: current - target]:
                if r.state is ReplicaState.STARTING or r.load(now) == 0:
                    r.state = ReplicaState.STOPPED
                    self._routable_cache = None
                    r.stopped_s = now
                else:
                    r.state = ReplicaState.DRAINING
                    self._routable_cache = None
        return out

    # ---------------------------------------------------------------- telemetry

    def _telemetry(self, now: float, time_s: float, age_s: float) -> tuple[Telemetry, int]:
        """The window that closes now (bin ``tick + 1``), stamped ``time_s`` (the tick that reads it), and how many
        of its completions met their tier's SLO."""
        window_s = max(now - self._window_end_s, 1e-9)
        w = self._tick + 1
        sums = self.bins.window(w)
        tokens = float(sums[WindowBins.TOKENS])
        seq_iters = float(sums[WindowBins.SEQ_ITERS])
        accepted = float(sums[WindowBins.ACCEPTED])
        distortion = float(sums[WindowBins.DISTORTION])
        # Completions registered in this bin, minus any a truncation voided or moved: a few ids, sorted
        # and unique (cheaper than np.unique at this size).
        completion_s, last = self.table.completion_s, self._window_end_s
        done_list = sorted({rid for rid in self.bins.completed.pop(w, ()) if last < completion_s[rid] <= now})
        bins = self.bins
        fast = window_summaries(self.table, done_list, self.slo, self.thresholds, sums[bins.tier_tokens],
                                sums[bins.tier_distortion], sums[bins.tier_seq_iters], self.draft_lengths)
        if fast is not None:
            overall, tiers, n_met = fast
        else:  # a NaN latency: the array functions
            done = np.array(done_list, dtype=np.int64)
            ttft, tpot, e2e = latencies = latencies_ms(self.table, done)
            overall = (fast_summary(ttft), fast_summary(tpot[~np.isnan(tpot)]), fast_summary(e2e))
            tiers, met = tier_windows(self.table, done, self.slo, self.thresholds, sums[bins.tier_tokens],
                                      sums[bins.tier_distortion], latencies, overall,
                                      tier_seq_iters=sums[bins.tier_seq_iters], draft_lengths=self.draft_lengths)
            n_met = int(met.sum())
        iters = float(sums[WindowBins.ITERS])
        drafted = float(sums[WindowBins.DRAFTED])
        spec_iters, spec_ms = float(sums[WindowBins.SPEC_ITERS]), float(sums[WindowBins.SPEC_MS])
        spec_rows = float(sums[WindowBins.SPEC_ROWS])
        queue_per = tuple([len(r.queue) for r in self._live()])
        self._completed_total += len(done_list)
        in_flight = self.counters.admitted_total - self._completed_total
        k = self.k
        tel = Telemetry(
            time_s=time_s,
            window_s=window_s,
            arrivals=self.counters.arrivals,
            completions=len(done_list),
            rejections=self.counters.rejections,
            queue_depth=sum(queue_per),
            queue_depth_per_replica=queue_per,
            in_flight=in_flight,
            ttft=overall[0],
            tpot=overall[1],
            e2e=overall[2],
            acceptance_rate=accepted / drafted if drafted else math.nan,
            mean_accepted_per_iter=accepted / seq_iters if seq_iters else math.nan,
            mean_distortion=distortion / tokens if tokens else 0.0,
            output_tokens=int(round(tokens)),
            output_tokens_per_s=tokens / window_s,
            # Replicas serving now (not those still starting): what the capacity of this window was.
            replicas=max(1, len(self._routable())),
            draft_length=k,
            mean_iteration_ms=float(sums[WindowBins.ITER_MS]) / iters if iters else math.nan,
            mean_batch_size=seq_iters / iters if iters else math.nan,
            prefill_ms=float(sums[WindowBins.PREFILL_MS]),
            plain_steps=StepTotals(steps=int(round(iters - spec_iters)), ms=float(sums[WindowBins.ITER_MS]) - spec_ms,
                                   rows=int(round(seq_iters - spec_rows))),
            speculative_steps=StepTotals(
                steps=int(round(spec_iters)), ms=spec_ms, rows=int(round(spec_rows)),
                draft_forwards=int(round(sums[WindowBins.SPEC_DRAFT_FORWARDS])), verify_tokens=int(round(drafted)),
                drafted_row_forwards=int(round(sums[WindowBins.SPEC_DRAFTED_ROW_FORWARDS]))),
            age_s=age_s,
            tiers=tiers,
        )
        return tel, n_met

    def _record_tick(self, tel: Telemetry, met: int) -> None:
        ts = self.timeseries
        finished = tel.completions + tel.rejections
        row: dict[str, float] = {
            "time_s": tel.time_s,
            "arrival_rate": tel.arrival_rate,
            "completions": tel.completions,
            "rejections": tel.rejections,
            "queue_depth": tel.queue_depth,
            "in_flight": tel.in_flight,
            "replicas": tel.replicas,
            "replicas_target": self._active_count(),  # serving + starting (the autoscaler's count)
            "replicas_wanted": math.nan if self._policy_replicas is None else self._policy_replicas,
            "output_tokens_per_s": tel.output_tokens_per_s,
            "ttft_p95_ms": tel.ttft.p95_ms,
            "tpot_p50_ms": tel.tpot.p50_ms,
            "tpot_p95_ms": tel.tpot.p95_ms,
            "tpot_p99_ms": tel.tpot.p99_ms,
            "e2e_p95_ms": tel.e2e.p95_ms,
            "attainment": met / finished if finished else math.nan,
            "mean_distortion": tel.mean_distortion,
            "acceptance_rate": tel.acceptance_rate,
        }
        for name in self.tier_names:
            row[f"T_{name}"] = self.thresholds[name]
            row[f"k_{name}"] = self.draft_lengths[name]
        for key, value in row.items():
            ts.setdefault(key, []).append(float(value))

    # ---------------------------------------------------------------- run

    def run(self, progress: bool = False) -> SimResult:
        """Simulate to completion (or ``drain_timeout_s`` past the last arrival) and summarise."""
        self._progress = None
        if progress:
            from tqdm import tqdm

            self._progress = tqdm(total=round(self.arrival_horizon_s), unit="sim-s", file=sys.stderr,
                                  leave=False, desc=f"sim {self.workload_name}")
        # The first decision lands before any traffic, from an empty window.
        initial = Telemetry(time_s=0.0, window_s=self.config.control_interval_s,
                            replicas=self.config.replicas, draft_length=self.k, prefill_ms=0.0,
                            age_s=self.config.telemetry_age_s)
        self.on_apply_decision(0.0, self.policy.decide(initial))
        if self.table.n:
            self._push(Arrival(float(self.table.arrival_s[0]), 0))
        if self.config.report_age_s is not None:
            self._push(ReplicaReport(self.config.control_interval_s - self.config.report_age_s))
        self._push(ControlTick(self.config.control_interval_s))
        heap = self._heap
        end_s = self.end_s
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            t, _, _, event = pop(heap)
            if t > end_s:
                # Drain timeout: whatever was still running stops here.
                self.now = end_s
                break
            self.now = t
            self.events += 1
            for follow in event.handle(self):  # as _push, inlined: this loop runs ~10^5 times
                self._seq += 1
                push(heap, (follow.time_s, follow.ORDER, self._seq, follow))
        for r in self.replicas:
            r.close(self.now)
        if self.config.serving_overhead_ms:
            shift = self.config.serving_overhead_ms / 1e3  # NaN (unanswered) stays NaN
            self.table.first_token_s += shift
            self.table.completion_s += shift
        if self._progress is not None:
            self._progress.close()
        return self._result()

    def _result(self) -> SimResult:
        end = self.now
        replica_seconds = sum(
            (r.stopped_s if r.stopped_s is not None else end) - r.started_s for r in self.replicas
        )
        duration = max(self.arrival_horizon_s, 1e-9)
        price = self.config.replica_usd_per_hour
        if price is None and self.slo.cost is not None:
            price = self.slo.cost.replica_usd_per_hour
        summary = summarize(self.table, self.slo, duration, replica_seconds, price)
        summary["duration_s"] = round(duration, 3)
        summary["simulated_until_s"] = round(end, 3)
        summary["peak_replicas"] = int(max(self.timeseries.get("replicas_target", [self.config.replicas])))
        summary["replica_startup_s"] = self.replica_startup_s
        t = self.table
        done = np.flatnonzero(t.completed)
        met = np.zeros(t.n, dtype=bool)
        met[done] = slo_met(t, done, self.slo)
        records: dict[str, np.ndarray] = {
            "arrival_s": t.arrival_s,
            "tier": t.tier,
            "prompt_tokens": t.prompt_tokens,
            "output_tokens": t.output_tokens,
            "replica": t.replica,
            "start_s": t.start_s,
            "first_token_s": t.first_token_s,
            "completion_s": t.completion_s,
            "rejected": t.rejected,
            "distortion_sum": t.distortion_sum,
            "slo_met": met,
        }
        notes = list(self.requests.notes)
        if self.ignored_draft_lengths:
            notes.append(f"policy asked for draft lengths {sorted(self.ignored_draft_lengths)} "
                         f"absent from the profile; ignored")
        meta: dict[str, Any] = {
            "workload": self.workload_name,
            "policy": repr(self.policy),
            "policy_name": _policy_name(self.policy),
            "seed": self.config.seed,
            "config": self.config.model_dump(),
            "div": self.div,
            "draft_length": self.k,
            "draft_lengths": dict(self.draft_lengths),
            "k0_step_time": self.profile.plain_decoding_source,
            "tier_names": self.tier_names,
            "profile_provenance": self.profile.provenance.model_dump(),
            "notes": notes,
        }
        if self.requests.attribution:
            meta["attribution"] = self.requests.attribution
        iterations = sum(r.iterations for r in self.replicas)
        # What the engine's counters give (decode tokens and sequence-iterations, the joiners' prefill
        # iterations not among them): tokens per row-iteration as a service measures it, clipped last steps in.
        totals = self.bins.totals()
        meta["decode_tokens"] = float(totals[WindowBins.TOKENS])
        meta["row_iterations"] = float(totals[WindowBins.SEQ_ITERS])
        return SimResult(summary, self.timeseries, records, meta, iterations=iterations, events=self.events)


def _policy_name(policy: object) -> str:
    """The innermost policy's name (guards wrap it): 'pid', 'static', ..."""
    while getattr(policy, "inner", None) is not None:
        policy = policy.inner  # type: ignore[attr-defined]
    return str(getattr(policy, "name", type(policy).__name__))


def simulate(
    workload: Workload | Requests,
    policy: Policy,
    *,
    profile: Profile | None = None,
    slo: SLOSpec | None = None,
    config: SimConfig | None = None,
    progress: bool = False,
) -> SimResult:
    """Convenience: build a :class:`Simulator` with defaults and run it."""
    sim = Simulator(
        config or SimConfig(),
        profile or Profile.default(),
        slo or SLOSpec.default(),
        workload,
        policy,
    )
    return sim.run(progress=progress)
