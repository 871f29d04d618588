"""The continuous-batching loop: one dedicated thread drives ``FSDEngine.step()``.

Why a thread: ``step()`` is tens of milliseconds of synchronous torch work. Run on the replica's event
loop it would stall ``stats()``, health checks and threshold pushes for the whole decode; run in a
thread, the event loop stays free and the engine is touched by exactly one thread (no locking inside
the engine). The thread talks to the rest of the replica through:

* a command queue (add / abort / set tier thresholds / set k per tier / set the batch cap / stop), drained
  between iterations — so requests join and leave the running batch between steps. The batch cap
  (``Decision.batch_cap``) is kept here, not in the engine, so it works the same for every engine: a
  request beyond it waits in this loop's queue (it counts as queued) and is handed to the engine when
  the rows it holds fall below the cap; a lowered cap preempts nobody. k is per row: a request is
  admitted with its tier's k and a change of a tier's k reaches that tier's running rows at the next
  step (``FSDEngine.set_draft_length(k, request_id)``), so one tier can decode plainly (k = 0) while
  another drafts in the same batch;
* per-request sinks (a thread-safe callback, in practice ``loop.call_soon_threadsafe`` into an asyncio
  queue) that receive a :class:`TokenEvent` per step the request took part in;
* :class:`ReplicaCounters`, updated under a lock and read by ``stats()``.

Request timing uses the monotonic clock: arrival is the ingress's stamp (converted by the replica;
the replica's own acceptance time when there is none), first-token and finish times when the step that
produced them returns. Per finished request one
:class:`RequestRecord` is kept until the controller scrapes it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

logger = logging.getLogger(__name__)

#: At most this many finished-request records wait for a scrape; older ones are dropped (and counted).
MAX_PENDING_RECORDS = 20_000


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """What one engine step did for one request (or the request's end)."""

    new_token_ids: tuple[int, ...]
    drafted: int = 0
    accepted: int = 0
    fuzzy_accepted: int = 0
    distortion: float = 0.0
    threshold: float = 0.0
    draft_length: int = 0  # the k the row ran at this step (0: plain target decoding)
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None  # set when the engine failed this request
    text: str | None = None  # the final output text (stop strings cut), on the finishing event only
    #: On the finishing event: ms from the request's arrival (the ingress's stamp, else its submission) to
    #: the engine step that emitted its first token (None: it emitted none) and to its end.
    ttft_ms: float | None = None
    e2e_ms: float | None = None


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One finished request, as the controller aggregates it (times in ms)."""

    tier: str
    ttft_ms: float
    tpot_ms: float | None  # None for single-token outputs
    e2e_ms: float
    output_tokens: int
    distortion: float  # summed per-token TV distortion of the request
    threshold: float  # T at the request's last step
    finish_reason: str


@dataclass
class _Job:
    request_id: str
    prompt_ids: list[int]
    params: Any  # decoder.engine.SamplingParams
    tier: str
    pinned: bool  # the request chose its own ``threshold`` (else it follows its tier's T)
    sink: Callable[[TokenEvent], None]
    arrival_s: float
    threshold: float = 0.0  # the T this request runs at: one name from the HTTP body to verify_block
    draft_length: int | None = None  # the k this request runs at (None: the engine default)
    added: bool = False
    deadline_s: float | None = None  # monotonic; past it nobody waits for the answer: aborted
    first_token_s: float | None = None
    output_tokens: int = 0
    distortion: float = 0.0


@dataclass
class TierCounters:
    """Per-tier counters. ``rejections`` (503 here), ``aborted`` (client gone, 504) and ``failed``
    (engine error) are requests that ended without an answer: SLO misses."""

    arrivals: int = 0
    completions: int = 0
    output_tokens: int = 0
    distortion: float = 0.0
    rejections: int = 0
    aborted: int = 0
    failed: int = 0
    row_iterations: int = 0  # (sequence of this tier, decode step) pairs: its tokens-per-step denominator

    def minus(self, before: TierCounters) -> TierCounters:
        return TierCounters(**{f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self)})

    def add(self, other: TierCounters) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class ReplicaCounters:
    """Cumulative since the replica started inside the replica; a report carries the difference of two
    snapshots (:meth:`minus`), so a receiver only ever adds."""

    iterations: int = 0
    row_iterations: int = 0  # (sequence, iteration) pairs: the denominator of tokens per iteration
    drafted: int = 0
    accepted: int = 0
    fuzzy_accepted: int = 0
    distortion: float = 0.0
    output_tokens: int = 0
    prefill_tokens: int = 0
    arrivals: int = 0
    completions: int = 0
    aborted: int = 0
    failed: int = 0
    rejections: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    prefill_time_s: float = 0.0
    catch_up_time_s: float = 0.0  # the draft's catch-up inside decode steps (StepStats.catch_up_time_s)
    busy_time_s: float = 0.0
    # The speculative steps (some row drafts) apart, as policies.telemetry.StepTotals sums them; plain
    # steps are the rest. Their time is decode time: prefill and catch-up left out.
    speculative_steps: int = 0
    speculative_step_s: float = 0.0
    speculative_rows: int = 0
    speculative_draft_forwards: int = 0  # Σ k_max
    speculative_verify_tokens: int = 0  # Σ over rows of k_r
    speculative_drafted_row_forwards: int = 0  # Σ k_max · rows with k > 0
    dropped_records: int = 0
    per_tier: dict[str, TierCounters] = field(default_factory=dict)

    def tier(self, name: str) -> TierCounters:
        return self.per_tier.setdefault(name, TierCounters())

    def copy(self) -> ReplicaCounters:
        out = ReplicaCounters(**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "per_tier"})
        out.per_tier = {name: TierCounters(**asdict(t)) for name, t in self.per_tier.items()}
        return out

    def minus(self, before: ReplicaCounters) -> ReplicaCounters:
        """``self - before`` field by field (tiers ``before`` lacks count from zero)."""
        out = ReplicaCounters(**{
            f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self) if f.name != "per_tier"
        })
        out.per_tier = {name: t.minus(before.per_tier.get(name, TierCounters())) for name, t in self.per_tier.items()}
        return out

    def add(self, other: ReplicaCounters) -> None:
        for f in fields(self):
            if f.name != "per_tier":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        for name, t in other.per_tier.items():
            self.tier(name).add(t)

    def scalars(self) -> dict[str, float]:
        """The scalar counters by name (for metrics)."""
        return {f.name: float(getattr(self, f.name)) for f in fields(self) if f.name != "per_tier"}


class StepEngine(Protocol):
    """The part of ``decoder.engine.FSDEngine`` the loop drives."""

    def add_request(self, request_id: str, prompt_ids: list[int], params: Any, threshold: float = 0.0,
                    draft_length: int | None = None) -> None: ...
    def set_threshold(self, request_id: str, threshold: float) -> None: ...
    def set_draft_length(self, k: int, request_id: str | None = None) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def release(self, request_id: str) -> Any: ...
    def step(self) -> Any: ...
    def has_unfinished(self) -> bool: ...


class BatchingLoop:
    """Owns the engine thread. Thread-safe public methods; the engine is only touched by the thread."""

    def __init__(self, engine: StepEngine, thresholds: Mapping[str, float], name: str = "fsd-engine",
                 draft_lengths: Mapping[str, int] | None = None) -> None:
        """``thresholds`` / ``draft_lengths``: T and k per tier (a tier without a k runs the engine
        default)."""
        self._engine = engine
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._jobs: dict[str, _Job] = {}  # engine-thread only
        self._tier_thresholds: dict[str, float] = dict(thresholds)  # engine-thread view
        self._tier_draft_lengths: dict[str, int] = _check_draft_lengths(draft_lengths or {})  # engine-thread view
        self._batch_cap: int | None = None  # engine-thread view; None: the engine's own max_batch_size
        self._held: deque[_Job] = deque()  # engine-thread only: submitted, waiting for a row under the cap
        self._lock = threading.Lock()
        self._counters = ReplicaCounters()
        self._records: deque[RequestRecord] = deque()
        self._in_flight = 0  # guarded by _lock: submitted and not yet finished
        self._running = 0
        self._stopped = threading.Event()
        self._error: str | None = None
        # Health (read by check_health from another thread; plain attribute reads are atomic).
        self._step_started: float | None = None  # monotonic start of the step in progress
        self._consecutive_failures = 0
        self._last_failure: str | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- called from any thread ------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: Any,
        tier: str,
        threshold: float | None,
        sink: Callable[[TokenEvent], None],
        arrival_s: float | None = None,
        deadline_s: float | None = None,
    ) -> None:
        """Queue a request. ``threshold``: the request's own T (validated by the caller), None ⇒ it
        follows its tier's T. ``arrival_s``: when it arrived (monotonic; default now). ``deadline_s``
        (monotonic): the engine aborts the request there, started or not — its caller has given up, and a
        cancellation that raced the request's start must not leave it running."""
        job = _Job(request_id, prompt_ids, params, tier, threshold is not None, sink,
                   time.monotonic() if arrival_s is None else arrival_s,
                   threshold=threshold if threshold is not None else 0.0, deadline_s=deadline_s)
        with self._lock:
            self._in_flight += 1
            self._counters.arrivals += 1
            self._counters.tier(tier).arrivals += 1
        self._commands.put(("add", job))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def set_tier_thresholds(self, thresholds: Mapping[str, float]) -> None:
        self._commands.put(("thresholds", dict(thresholds)))

    def set_draft_length(self, k: int) -> None:
        """The engine default k (rows of a tier with its own k keep theirs)."""
        self._commands.put(("draft_length", _check_draft_lengths({"*": k})["*"]))

    def set_tier_draft_lengths(self, draft_lengths: Mapping[str, int]) -> None:
        """k per tier (>= 0; 0 = plain target decoding): new requests of a tier are admitted with it and
        the tier's running rows switch at the next step. ValueError naming a bad k (nothing changes)."""
        self._commands.put(("draft_lengths", _check_draft_lengths(draft_lengths)))

    def set_batch_cap(self, cap: int | None) -> None:
        """The most requests the engine holds at once (None: no cap beyond its own max_batch_size).
        ValueError naming a bad cap (nothing changes)."""
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, numbers.Integral) or cap < 1):
            raise ValueError(f"batch_cap must be an integer >= 1 or None, got {cap!r}")
        self._commands.put(("batch_cap", None if cap is None else int(cap)))

    def cancel_all(self, message: str) -> None:
        """Fail every request in flight with ``message`` (an explicit error, not a cut stream)."""
        self._commands.put(("cancel_all", message))

    def count_rejection(self, tier: str | None = None) -> None:
        with self._lock:
            self._counters.rejections += 1
            if tier is not None:
                self._counters.tier(tier).rejections += 1

    def health_problem(self, hang_after_s: float, max_consecutive_failures: int) -> str | None:
        """Why this engine cannot serve (None when it can): thread gone, a step running longer than
        ``hang_after_s``, or ``max_consecutive_failures`` steps in a row that raised."""
        if not self.alive:
            return f"engine thread is not running: {self._error}"
        started = self._step_started
        if started is not None and time.monotonic() - started > hang_after_s:
            return f"engine step running for {time.monotonic() - started:.1f}s (> {hang_after_s}s): hung"
        if self._consecutive_failures >= max_consecutive_failures:
            return (f"{self._consecutive_failures} engine steps in a row failed "
                    f"(limit {max_consecutive_failures}); last: {self._last_failure}")
        return None

    def counters(self) -> ReplicaCounters:
        """A copy of the cumulative counters."""
        with self._lock:
            return self._counters.copy()

    def counters_and_records(self) -> tuple[ReplicaCounters, tuple[RequestRecord, ...]]:
        """Cumulative counters and the records drained since the previous call, taken atomically (a
        request finishing in between would otherwise be in one and not the other)."""
        with self._lock:
            out = tuple(self._records)
            self._records.clear()
            return self._counters.copy(), out

    def drain_records(self) -> tuple[RequestRecord, ...]:
        """The finished-request records since the previous drain (each handed out exactly once)."""
        with self._lock:
            out = tuple(self._records)
            self._records.clear()
        return out

    def load(self) -> tuple[int, int]:
        """(in flight, running)."""
        with self._lock:
            return self._in_flight, self._running

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    @property
    def error(self) -> str | None:
        return self._error

    def snapshot(self, drain_records: bool) -> dict[str, Any]:
        """Counters (cumulative), queue state and — if ``drain_records`` — the finished-request records
        since the previous drain."""
        with self._lock:
            counters = asdict(self._counters)  # a debugging view; reports use counters()/drain_records()
            records = [asdict(r) for r in self._records] if drain_records else []
            if drain_records:
                self._records.clear()
            in_flight = self._in_flight
            running = self._running
        return {
            "counters": counters,
            "records": records,
            "in_flight": in_flight,
            "running": running,
            "queue_depth": max(in_flight - running, 0),
        }

    def stop(self, timeout_s: float = 5.0) -> None:
        self._commands.put(("stop", None))
        self._thread.join(timeout=timeout_s)

    # ---- engine thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                idle = not self._engine.has_unfinished()
                self._drain_commands(block=idle)
                if self._stopped.is_set():
                    break
                self._expire(time.monotonic())
                self._admit_held()
                if self._engine.has_unfinished():
                    try:
                        self._step_once()
                        self._consecutive_failures = 0
                    except Exception as exc:  # one bad step fails its batch, not the replica
                        self._step_started = None
                        self._consecutive_failures += 1
                        self._last_failure = f"{type(exc).__name__}: {exc}"
                        logger.exception("engine step failed (%d in a row); failing the running batch",
                                         self._consecutive_failures)
                        self._fail_running(f"engine step failed: {type(exc).__name__}: {exc}")
        except BaseException as exc:  # the thread must never die silently
            self._error = f"{type(exc).__name__}: {exc}"
            logger.exception("engine thread crashed")
            self._fail_all(self._error)
        finally:
            self._stopped.set()
            self._fail_all("replica is shutting down")

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _expire(self, now: float) -> None:
        for job in [j for j in self._jobs.values() if j.deadline_s is not None and now > j.deadline_s]:
            logger.info("request %s passed its deadline: aborted", job.request_id)
            self._finish(job, "abort", aborted=True)

    def _apply(self, cmd: tuple[str, Any]) -> None:
        kind, arg = cmd
        if kind == "add":
            self._jobs[arg.request_id] = arg
            if self._batch_cap is None and not self._held:
                self._add(arg)
            else:
                self._held.append(arg)  # admitted by _admit_held, in arrival order
        elif kind == "batch_cap":
            self._batch_cap = arg
        elif kind == "abort":
            job = self._jobs.get(arg)
            if job is not None:
                self._finish(job, "abort", aborted=True)
        elif kind == "thresholds":
            self._tier_thresholds.update(arg)
            for job in self._jobs.values():
                if not job.pinned and job.tier in arg:
                    job.threshold = float(arg[job.tier])
                    if job.added:
                        self._engine.set_threshold(job.request_id, job.threshold)
        elif kind == "draft_length":
            self._engine.set_draft_length(arg)
        elif kind == "draft_lengths":
            self._tier_draft_lengths.update(arg)
            for job in self._jobs.values():
                k = arg.get(job.tier)
                if k is not None and k != job.draft_length:
                    job.draft_length = k
                    if job.added:
                        self._engine.set_draft_length(k, job.request_id)
        elif kind == "cancel_all":
            for job in list(self._jobs.values()):
                self._finish(job, "error", error=arg)
        elif kind == "stop":
            self._stopped.set()

    def _admit_held(self) -> None:
        """Hand held requests to the engine while it holds fewer than the cap (all of them without one)."""
        if not self._held:
            return
        added = sum(1 for j in self._jobs.values() if j.added)
        while self._held and (self._batch_cap is None or added < self._batch_cap):
            job = self._held.popleft()
            if self._jobs.get(job.request_id) is job and not job.added:  # else aborted or expired while held
                self._add(job)
                added += job.added
        with self._lock:
            self._running = added

    def _add(self, job: _Job) -> None:
        if not job.pinned:
            job.threshold = self._tier_thresholds.get(job.tier, 0.0)
        job.draft_length = self._tier_draft_lengths.get(job.tier)
        try:
            self._engine.add_request(job.request_id, job.prompt_ids, job.params, threshold=job.threshold,
                                     draft_length=job.draft_length)
        except ValueError as exc:  # the engine's own validation: report, never crash the loop
            self._finish(job, "error", error=str(exc))
            return
        job.added = True

    def _step_once(self) -> None:
        t0 = time.monotonic()
        self._step_started = t0
        stats = self._engine.step()
        now = time.monotonic()
        self._step_started = None
        finished: list[tuple[_Job, str]] = []
        with self._lock:
            c = self._counters
            c.iterations += 1
            c.busy_time_s += now - t0
            c.draft_time_s += float(getattr(stats, "draft_time_s", 0.0))
            c.verify_time_s += float(getattr(stats, "verify_time_s", 0.0))
            c.prefill_time_s += float(getattr(stats, "prefill_time_s", 0.0))
            c.catch_up_time_s += float(getattr(stats, "catch_up_time_s", 0.0))
            c.prefill_tokens += int(getattr(stats, "prefill_tokens", 0))
            # The step's kind from its rows: both engines' rows carry their k (vLLM's step object has no
            # draft_length, and its k is engine-wide).
            k_max = max((int(getattr(row, "draft_length", 0)) for row in stats.rows), default=0)
            if k_max > 0:
                # The rows row_iterations counts (a row with no token and no draft took no part in it).
                ks = [int(getattr(row, "draft_length", 0)) for row in stats.rows if row.new_token_ids or row.drafted]
                c.speculative_steps += 1
                c.speculative_step_s += (now - t0 - float(getattr(stats, "prefill_time_s", 0.0))
                                         - float(getattr(stats, "catch_up_time_s", 0.0)))
                c.speculative_rows += len(ks)
                c.speculative_draft_forwards += k_max
                c.speculative_verify_tokens += sum(ks)
                c.speculative_drafted_row_forwards += k_max * sum(1 for k in ks if k > 0)
            for row in stats.rows:
                job = self._jobs.get(row.request_id)
                if job is None:  # aborted between submit and this step
                    continue
                n_new = len(row.new_token_ids)
                distortion = float(row.distortion) if math.isfinite(row.distortion) else 0.0
                tier = c.tier(job.tier)
                if n_new or row.drafted:
                    c.row_iterations += 1
                    tier.row_iterations += 1
                c.drafted += int(row.drafted)
                c.accepted += int(row.accepted)
                c.fuzzy_accepted += int(row.fuzzy_accepted)
                c.distortion += distortion
                c.output_tokens += n_new
                tier.output_tokens += n_new
                tier.distortion += distortion
                if n_new and job.first_token_s is None:
                    job.first_token_s = now
                job.output_tokens += n_new
                job.distortion += distortion
                job.threshold = float(row.threshold)
                job.sink(
                    TokenEvent(
                        new_token_ids=tuple(int(t) for t in row.new_token_ids),
                        drafted=int(row.drafted),
                        accepted=int(row.accepted),
                        fuzzy_accepted=int(row.fuzzy_accepted),
                        distortion=distortion,
                        threshold=float(row.threshold),
                        draft_length=int(getattr(row, "draft_length", 0)),
                    )
                )
                if row.finished:
                    finished.append((job, row.finish_reason or "stop"))
            self._running = sum(1 for j in self._jobs.values() if j.added)
        for job, reason in finished:
            self._finish(job, reason, at=now)

    def _finish(
        self,
        job: _Job,
        reason: str,
        *,
        at: float | None = None,
        aborted: bool = False,
        error: str | None = None,
    ) -> None:
        if self._jobs.pop(job.request_id, None) is None:
            return
        if not job.added and self._held:
            # A held request aborted or expired leaves the held queue now, not when it reaches the front.
            with contextlib.suppress(ValueError):
                self._held.remove(job)
        now = time.monotonic() if at is None else at
        text: str | None = None
        if job.added:
            # The engine keeps finished requests until released; its text has stop strings cut exactly.
            try:
                if aborted or error is not None:
                    self._engine.abort(job.request_id)
                text = self._engine.release(job.request_id).text
            except Exception:  # already gone (e.g. a failed step dropped it): nothing to free
                logger.debug("release of %s failed", job.request_id, exc_info=True)
        with self._lock:
            self._in_flight -= 1
            self._running = sum(1 for j in self._jobs.values() if j.added)
            c = self._counters
            if error is not None:
                c.failed += 1
                c.tier(job.tier).failed += 1
            elif aborted:
                c.aborted += 1
                c.tier(job.tier).aborted += 1
            else:
                c.completions += 1
                c.tier(job.tier).completions += 1
                first = job.first_token_s if job.first_token_s is not None else now
                tpot = (now - first) / (job.output_tokens - 1) * 1e3 if job.output_tokens > 1 else None
                self._records.append(
                    RequestRecord(
                        tier=job.tier,
                        ttft_ms=(first - job.arrival_s) * 1e3,
                        tpot_ms=tpot,
                        e2e_ms=(now - job.arrival_s) * 1e3,
                        output_tokens=job.output_tokens,
                        distortion=job.distortion,
                        threshold=job.threshold,
                        finish_reason=reason,
                    )
                )
                if len(self._records) > MAX_PENDING_RECORDS:
                    self._records.popleft()
                    c.dropped_records += 1
        job.sink(TokenEvent(
            new_token_ids=(), finished=True, finish_reason=reason, error=error, text=text,
            ttft_ms=None if job.first_token_s is None else (job.first_token_s - job.arrival_s) * 1e3,
            e2e_ms=(now - job.arrival_s) * 1e3,
        ))

    def _fail_running(self, message: str) -> None:
        """Fail the requests in the engine (the failed step's batch); those held back by the cap never ran
        in it and stay queued."""
        for job in [j for j in self._jobs.values() if j.added]:
            self._finish(job, "error", error=message)

    def _fail_all(self, message: str) -> None:
        for job in list(self._jobs.values()):
            self._finish(job, "error", error=message)
        # Requests still in the command queue were never added: fail them too so nobody waits forever.
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._jobs[arg.request_id] = arg
                self._finish(arg, "error", error=message)


def _check_draft_lengths(draft_lengths: Mapping[str, int]) -> dict[str, int]:
    """k per tier as ints >= 0; ValueError naming the first bad one (checked on the caller's thread, so a
    bad value never reaches the engine thread)."""
    out: dict[str, int] = {}
    for name, k in draft_lengths.items():
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise ValueError(f"draft length for tier {name!r} must be an integer >= 0, got {k!r}")
        out[str(name)] = int(k)
    return out
