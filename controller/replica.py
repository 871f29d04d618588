"""``FSDReplica``: one model pair, one continuous-batching engine, the current T per tier.

The class is plain Python; :mod:`controller.app` turns it into a Ray Serve deployment with the
configured options. Methods called over Serve:

* ``generate(request)`` — an async generator of chunks for one request (see :mod:`controller.protocol`);
  the first chunk is either an ``error`` (with the HTTP status the ingress should return) or ``start``.
* ``stats()`` — a debugging snapshot: cumulative counters, load, T held (never drains anything).
* ``reconfigure(user_config)`` — Serve's ``user_config`` path for a local T / k override (validated
  first: a bad one raises ValueError and changes nothing).
* ``check_health()`` — raises when the engine thread is gone, a step hangs past ``replica.step_hang_s``
  or ``replica.max_consecutive_step_failures`` steps in a row raised, so Serve replaces the replica.

Control channel (never through a request slot): an asyncio task on the replica's own event loop pushes
a :class:`controller.protocol.ReplicaReport` to the controller deployment every report interval with
``.remote()``, skipping a tick while the previous push is unanswered (Serve's own ``MetricsPusher``
pattern). The controller's reply acknowledges the reports it counted and carries the current
:class:`controller.protocol.ThresholdPush`; unacknowledged reports are re-sent with the next push.

Fail-safe: when no decision arrived for ``replica.stale_after_s`` seconds (measured on this replica's
monotonic clock), every tier drops to its safe T (its pin, else ``TierSLO.safe_threshold``, default 0 =
lossless) until the next one. The switch is logged and reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controller import protocol
from controller.batching import BatchingLoop, ReplicaCounters, StepEngine, TokenEvent
from controller.config import FSDConfig, parse_config
from fsd_common.validation import format_validation_error
from policies.slo import SLOSpec
from policies.tiers import apply_decision, request_threshold, safe_thresholds

logger = logging.getLogger("ray.serve")

#: At most this many unacknowledged reports wait for the controller (≈ 16 min at 1 s); older ones are
#: dropped and counted (``dropped_reports``) rather than growing without bound.
MAX_UNACKED_REPORTS = 1000

#: A request is aborted in the engine this long after the ingress's own deadline (``http.request_timeout_s``
#: from arrival) has answered 504: the ingress speaks first; the margin covers clock skew between nodes.
DEADLINE_GRACE_S = 2.0

#: The explicit error in-flight requests get when the service stops.
SHUTDOWN_MESSAGE = "the service is shutting down; request cancelled"

#: Sends one batch of reports and returns the controller's reply (the Serve transport by default).
ReportSender = Callable[[list[protocol.ReplicaReport]], Awaitable[protocol.ReportReply]]


class UserConfig(BaseModel):
    """Serve ``user_config`` of the replica deployment: a local override until the controller's next push."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    thresholds: dict[str, float] = Field(default_factory=dict)
    draft_length: int | None = Field(None, ge=0, le=16)
    draft_lengths: dict[str, int] = Field(default_factory=dict)


def _serve_sender(timeout_s: float) -> ReportSender:
    """Reports go to the controller deployment of this replica's application via a handle call: it takes
    one of the *controller's* slots (sized for control traffic), never a slot of this replica."""
    from ray import serve

    app_name = serve.get_replica_context().app_name
    handle = serve.get_deployment_handle(protocol.CONTROLLER_DEPLOYMENT, app_name)

    async def send(batch: list[protocol.ReplicaReport]) -> protocol.ReportReply:
        response = handle.report.remote(batch)
        try:
            reply: protocol.ReportReply = await asyncio.wait_for(response, timeout_s)
        except BaseException:
            with contextlib.suppress(Exception):
                response.cancel()  # type: ignore[no-untyped-call]  # Ray's ObjectRef.cancel is unannotated
            raise
        return reply

    return send


def load_model_pair(cfg: FSDConfig) -> Any:
    """The configured pair, from the registry (decoder/pairs.py); ``seed`` seeds a random test pair."""
    from decoder.pairs import load_pair

    return load_pair(cfg.model.pair, dtype=cfg.model.dtype, draft_dtype=cfg.model.draft_dtype, seed=cfg.model.seed,
                     linear_layout=cfg.model.linear_layout)


def _actor_name() -> str | None:
    """This process's Ray actor name (tests and operators use it to find or kill a replica)."""
    try:
        import ray

        if not ray.is_initialized():  # outside Ray (tests): asking would start a cluster
            return None
        return ray.get_runtime_context().get_actor_name()
    except Exception:
        return None


def _node_id() -> str | None:
    try:
        import ray

        if not ray.is_initialized():
            return None
        return ray.get_runtime_context().get_node_id()
    except Exception:
        return None


class _Detokenizer:
    """Incremental text for a growing list of token ids.

    Holds back a trailing replacement character for a few tokens (a multi-byte character split across
    tokens) and, when the request has stop strings, the last ``max(len(stop)) - 1`` characters (they may
    turn out to be the start of a stop string the engine will cut).
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._sent = ""
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._unsettled = 0

    @property
    def sent(self) -> str:
        return self._sent

    def push(self, token_ids: tuple[int, ...]) -> str:
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        text = str(self._tokenizer.decode(self._ids, skip_special_tokens=True))
        if text.endswith("\ufffd") and self._unsettled < 4:
            self._unsettled += 1
            return ""
        self._unsettled = 0
        ready = len(text) - self._holdback
        if ready <= len(self._sent) or not text.startswith(self._sent):
            return ""
        delta = text[len(self._sent) : ready]
        self._sent += delta
        return delta

    def finish(self, final_text: str | None) -> str:
        text = final_text if final_text is not None else self._tokenizer.decode(self._ids, skip_special_tokens=True)
        if not text.startswith(self._sent):  # cannot happen with the hold-back; never resend text
            return ""
        delta = text[len(self._sent) :]
        self._sent = text
        return delta


class FSDReplica:
    """See the module docstring."""

    def __init__(self, config: Mapping[str, Any], report_sender: ReportSender | None = None) -> None:
        """``report_sender``: how reports reach the controller (None ⇒ the controller deployment of
        this Serve application; tests pass a direct call to drive both sides tick by tick)."""
        self._cfg = parse_config(dict(config))
        if self._cfg.model.torch_threads is not None:
            import torch

            torch.set_num_threads(self._cfg.model.torch_threads)
        t0 = time.monotonic()
        self._pair, self._engine = self._load_engine()
        self._replica_id = self._own_replica_id()
        self._slo: SLOSpec = self._cfg.slo
        self._draft_length = self._cfg.model.num_draft_tokens  # the engine default k (configured)
        self._draft_lengths = dict.fromkeys(self._slo.tiers, self._draft_length)  # k per tier, as pushed
        self._batch_cap: int | None = None  # Decision.batch_cap as pushed (None: none, and in fail-safe)
        # T the controller asked for; until its first push, the configured initial T (default: safe T).
        self._controlled = apply_decision(self._slo, {}, self._cfg.replica.initial_thresholds)
        self._version = -1
        self._epoch: str | None = None
        self._started = time.monotonic()
        self._last_update: float | None = None
        self._failsafe = False
        self._failsafe_events = 0
        self._loop = BatchingLoop(self._engine, self._effective(), name=f"fsd-engine-{self._replica_id}",
                                  draft_lengths=self._draft_lengths)
        # Reports: numbered per incarnation (this process), deltas against the last report built.
        self._incarnation = uuid.uuid4().hex
        self._seq = 0
        self._reported = ReplicaCounters()
        self._unacked: list[protocol.ReplicaReport] = []
        self._dropped_reports = 0
        self._push_latencies_ms: list[float] = []
        self._report_interval = self._cfg.replica.report_interval_s or self._cfg.control.interval_s
        self._sender = report_sender
        self._push_task: asyncio.Task[None] | None = None
        self._report_problem: str | None = None
        self._stopping = False
        loop = asyncio.get_running_loop()
        self._watchdog = loop.create_task(self._watch_staleness())
        self._reporter = loop.create_task(self._report_loop())
        logger.info(
            "FSD replica %s ready: pair %s (%s) loaded in %.1fs; k=%d div=%s rule=%s batch<=%d",
            self._replica_id, self._pair.name, self._pair.description, time.monotonic() - t0,
            self._draft_length, self._cfg.model.div, self._cfg.model.rule, self._cfg.model.max_batch_size,
        )

    def _load_engine(self) -> tuple[Any, StepEngine]:
        """The model pair and the engine the batching loop drives. The pair gives what the request path
        needs: ``name``, ``description``, ``tokenizer`` (``decode``), ``encode_prompt(prompt, chat)``,
        ``max_context``. Another engine (``controller.vllm_replica``) overrides this and
        :meth:`_sampling_params`; everything else — control channel, fail-safe, reports — is shared."""
        from decoder.engine import FSDEngine

        pair = load_model_pair(self._cfg)
        engine = FSDEngine(
            pair,
            num_draft_tokens=self._cfg.model.num_draft_tokens,
            div=self._cfg.model.div,
            rule=self._cfg.model.rule,
            max_batch_size=self._cfg.model.max_batch_size,
            seed=self._cfg.model.seed,
            share_kv=self._cfg.model.share_kv,
        )
        return pair, engine

    @staticmethod
    def _own_replica_id() -> str:
        try:
            from ray import serve

            return str(serve.get_replica_context().replica_id.unique_id)
        except Exception:  # outside Serve (or local testing mode)
            return f"local-{os.getpid()}-{uuid.uuid4().hex[:6]}"

    # ---- thresholds and fail-safe ----------------------------------------------------------------

    def _effective(self) -> dict[str, float]:
        return safe_thresholds(self._slo) if self._failsafe else dict(self._controlled)

    def _stale_for(self, now: float) -> float:
        reference = self._last_update if self._last_update is not None else self._started
        return now - reference

    async def _watch_staleness(self) -> None:
        stale_after = self._cfg.replica.stale_after_s
        period = min(0.2, stale_after / 5)
        while True:
            await asyncio.sleep(period)
            if not self._failsafe and self._stale_for(time.monotonic()) > stale_after:
                self._failsafe = True
                self._failsafe_events += 1
                logger.warning(
                    "FSD replica %s: no controller update for %.1fs (stale_after_s=%.1f); fail-safe: "
                    "every tier drops to its safe T %s",
                    self._replica_id, self._stale_for(time.monotonic()), stale_after, safe_thresholds(self._slo),
                )
                self._loop.set_tier_thresholds(self._effective())
                self._set_batch_cap(None)  # the configured batch, as before any controller

    def apply_push(self, push: protocol.ThresholdPush) -> bool:
        """Apply the controller's decision; True when it was applied. Idempotent: the same version again
        only refreshes the fail-safe clock; an older version from the same controller ``epoch`` is
        ignored (a delayed reply must not undo a newer one). A new epoch (a restarted controller) is
        accepted."""
        now = time.monotonic()
        if push.epoch == self._epoch and push.version < self._version:
            return False
        fresh = push.epoch != self._epoch or push.version != self._version
        self._epoch = push.epoch
        self._last_update = now
        self._slo = push.slo
        self._controlled = apply_decision(self._slo, {}, push.thresholds)
        if self._failsafe:
            logger.warning("FSD replica %s: controller is back; leaving fail-safe", self._replica_id)
        self._failsafe = False
        self._version = push.version
        self._set_draft_lengths(push.draft_lengths)
        self._loop.set_tier_thresholds(self._effective())
        self._set_batch_cap(push.batch_cap)
        if push.stopping and not self._stopping:
            self._stopping = True
            logger.warning("FSD replica %s: the service is stopping; failing in-flight requests", self._replica_id)
            self._loop.cancel_all(SHUTDOWN_MESSAGE)
        if fresh:
            self._push_latencies_ms.append(max(0.0, (time.time() - push.decided_unix) * 1e3))
            del self._push_latencies_ms[:-1000]
        return True

    def _set_batch_cap(self, cap: int | None) -> None:
        """Cap the requests the engine holds at once (the batching loop holds the rest back as queued)."""
        if cap != self._batch_cap:
            self._loop.set_batch_cap(cap)  # validates first: a bad cap changes nothing
            self._batch_cap = cap

    def _set_draft_lengths(self, draft_lengths: Mapping[str, int]) -> None:
        """Apply k per tier, per row: the engine thread admits each request with its tier's k and moves
        the tier's running rows to a changed k at the next step (k = 0: plain target decoding)."""
        changed = {name: int(k) for name, k in draft_lengths.items()
                   if name in self._slo.tiers and self._draft_lengths.get(name) != int(k)}
        if changed:
            self._loop.set_tier_draft_lengths(changed)  # validates first: a bad k changes nothing
            self._draft_lengths.update(changed)

    def reconfigure(self, user_config: Mapping[str, Any]) -> None:
        """Serve ``user_config``: ``{"thresholds": {tier: T}, "draft_length": k, "draft_lengths": {tier: k}}``
        (all optional), a local override until the controller's next decision. Validated before anything
        changes: a bad one raises ValueError naming the field, and the replica keeps serving as it was."""
        try:
            parsed = UserConfig.model_validate(dict(user_config or {}))
        except ValidationError as exc:
            raise ValueError(f"invalid user_config: {format_validation_error(exc)}") from None
        for name, t in parsed.thresholds.items():
            try:
                request_threshold(self._slo, name, {}, t)  # the tier exists and T lies in its bounds
            except ValueError as exc:
                raise ValueError(f"invalid user_config: thresholds.{name}: {exc}") from None
        unknown = sorted(set(parsed.draft_lengths) - set(self._slo.tiers))
        if unknown:
            raise ValueError(f"invalid user_config: draft_lengths: unknown tier(s) {unknown}")
        self._controlled = apply_decision(self._slo, self._controlled, parsed.thresholds)
        lengths = dict(parsed.draft_lengths)
        if parsed.draft_length is not None:
            lengths = {**dict.fromkeys(self._slo.tiers, parsed.draft_length), **lengths}
        self._set_draft_lengths(lengths)
        self._loop.set_tier_thresholds(self._effective())

    # ---- reports to the controller (the control channel) -----------------------------------------

    def _state(self) -> protocol.ReplicaState:
        now = time.monotonic()
        in_flight, running = self._loop.load()
        return protocol.ReplicaState(
            replica_id=self._replica_id,
            actor_name=_actor_name(),
            node_id=_node_id(),
            pid=os.getpid(),
            pair=self._pair.name,
            uptime_s=now - self._started,
            queue_depth=max(in_flight - running, 0),
            in_flight=in_flight,
            running=running,
            engine_alive=self._loop.alive,
            engine_problem=self._engine_problem(),
            thresholds=self._effective(),
            controlled_thresholds=dict(self._controlled),
            draft_lengths=dict(self._draft_lengths),
            epoch=self._epoch,
            version=self._version,
            failsafe=self._failsafe,
            failsafe_events=self._failsafe_events,
            last_update_age_s=None if self._last_update is None else now - self._last_update,
            stopping=self._stopping,
            batch_cap=self._batch_cap,
        )

    def build_report(self) -> protocol.ReplicaReport:
        """Seal everything since the previous report into the next numbered report and queue it with the
        unacknowledged ones."""
        state = self._state()  # first: nothing below may fail once records are drained
        counters, records = self._loop.counters_and_records()
        self._seq += 1
        report = protocol.ReplicaReport(
            incarnation=self._incarnation,
            seq=self._seq,
            sent_unix=time.time(),
            counters=counters.minus(self._reported),
            records=records,
            state=state,
            push_latencies_ms=tuple(self._push_latencies_ms),
        )
        self._reported = counters
        self._push_latencies_ms = []
        self._unacked.append(report)
        if len(self._unacked) > MAX_UNACKED_REPORTS:
            self._unacked.pop(0)
            self._dropped_reports += 1
        return report

    def unacked_reports(self) -> list[protocol.ReplicaReport]:
        return list(self._unacked)

    def handle_reply(self, reply: protocol.ReportReply) -> None:
        """Drop what the controller counted; apply its decision."""
        self._unacked = [r for r in self._unacked if r.seq > reply.acked_seq]
        if reply.push is not None:
            self.apply_push(reply.push)

    async def push_report(self) -> None:
        """Build a report and send it with every unacknowledged one; on failure they wait for the next."""
        try:
            self.build_report()
            sender = self._sender
            if sender is None:
                sender = self._sender = _serve_sender(self._cfg.replica.report_timeout_s)
            reply = await sender(list(self._unacked))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # controller down / restarting / slow: keep the reports, retry next tick
            problem = f"{type(exc).__name__}: {exc}"
            if self._report_problem is None:
                logger.warning("FSD replica %s: report to the controller failed (%s); %d report(s) kept "
                               "for re-sending", self._replica_id, problem, len(self._unacked))
            self._report_problem = problem
            return
        if self._report_problem is not None:
            logger.info("FSD replica %s: controller answers again", self._replica_id)
            self._report_problem = None
        self.handle_reply(reply)

    async def _report_loop(self) -> None:
        """Serve's MetricsPusher pattern: a timer on this replica's own event loop; a push still in
        flight makes the timer skip (its report is folded into the next), so a slow controller never
        piles calls up and never blocks a request."""
        while True:
            await asyncio.sleep(self._report_interval)
            if self._push_task is not None and not self._push_task.done():
                continue
            self._push_task = asyncio.get_running_loop().create_task(self.push_report())

    # ---- requests --------------------------------------------------------------------------------

    def _resolve_threshold(self, tier_name: str | None, threshold: float | None) -> tuple[str, float | None]:
        """(tier, the request's own validated T or None). 422 naming the field when either is bad."""
        name = tier_name if tier_name is not None else self._slo.default_tier
        if name not in self._slo.tiers:
            raise protocol.RequestError(
                422, f"unknown tier {name!r}; known tiers: {sorted(self._slo.tiers)}", "fsd.tier"
            )
        if threshold is None:
            return name, None
        try:
            return name, request_threshold(self._slo, name, {}, threshold)
        except ValueError as exc:
            raise protocol.RequestError(422, str(exc), "fsd.threshold") from None

    def _max_tokens(self, req: protocol.GenerationRequest) -> int:
        limit = self._cfg.replica.max_new_tokens_limit
        max_tokens = req.max_tokens if req.max_tokens is not None else self._cfg.replica.default_max_new_tokens
        if max_tokens > limit:
            raise protocol.RequestError(422, f"max_tokens {max_tokens} exceeds the limit {limit}", "max_tokens")
        return max_tokens

    def _sampling_params(self, req: protocol.GenerationRequest, tier: str) -> Any:
        """The engine's per-request parameters (``max_new_tokens`` and ``stop`` are read back); 422 when
        the engine refuses them. ``tier``: the request's resolved tier."""
        from decoder.engine import SamplingParams

        max_tokens = self._max_tokens(req)
        params = SamplingParams(
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            max_new_tokens=max_tokens,
            stop=tuple(req.stop),
            eos_token_ids=() if req.ignore_eos else None,
            seed=req.seed,
        )
        try:
            params.validate()
        except ValueError as exc:
            raise protocol.RequestError(422, str(exc), None) from None
        return params

    async def generate(self, request: Mapping[str, Any]) -> AsyncIterator[protocol.Chunk]:
        """Chunks for one request: ``error`` | ``start``, then ``delta``s, then ``end``."""
        try:
            req = protocol.GenerationRequest.model_validate(request)
            tier, pinned_threshold = self._resolve_threshold(req.tier, req.threshold)
            params = self._sampling_params(req, tier)
            try:
                prompt_ids = self._pair.encode_prompt(req.prompt, chat=req.chat)
            except ValueError as exc:
                raise protocol.RequestError(422, str(exc), "prompt") from None
            if len(prompt_ids) + params.max_new_tokens > self._pair.max_context:
                raise protocol.RequestError(
                    400,
                    f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_new_tokens} exceeds the "
                    f"model's context of {self._pair.max_context} tokens",
                    "prompt",
                    code="context_length_exceeded",
                )
            if not self._loop.alive:
                raise protocol.RequestError(503, f"engine is not running: {self._loop.error}", None)
            if self._stopping:
                raise protocol.RequestError(503, SHUTDOWN_MESSAGE, None)
            if self._loop.in_flight >= self._cfg.replica.max_queued:
                self._loop.count_rejection(tier)
                raise protocol.RequestError(
                    503, f"replica queue is full ({self._cfg.replica.max_queued} requests)", None,
                    code="overloaded",
                )
        except protocol.RequestError as exc:
            yield exc.chunk()
            return

        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def sink(event: TokenEvent) -> None:
            with contextlib.suppress(RuntimeError):  # event loop closed: the replica is going away
                loop.call_soon_threadsafe(events.put_nowait, event)

        request_id = req.request_id or uuid.uuid4().hex
        detok = _Detokenizer(self._pair.tokenizer, params.stop)
        drafted = accepted = fuzzy = iterations = completion_tokens = 0
        distortion = 0.0
        threshold = request_threshold(self._slo, tier, self._effective(), pinned_threshold)
        arrival_s = None
        if req.arrival_unix is not None:  # the ingress's stamp, on this process's monotonic clock
            arrival_s = time.monotonic() - max(0.0, time.time() - req.arrival_unix)
        # The ingress answers 504 at arrival + request_timeout_s; past that (plus a grace for clock skew
        # between nodes) nobody reads this request, even if the cancellation raced its start.
        deadline_s = (arrival_s if arrival_s is not None else time.monotonic()) + (
            self._cfg.http.request_timeout_s + DEADLINE_GRACE_S)
        self._loop.submit(request_id, prompt_ids, params, tier, pinned_threshold, sink, arrival_s, deadline_s)
        finished = False
        try:
            yield protocol.StartChunk(request_id=request_id, prompt_tokens=len(prompt_ids), tier=tier,
                                      threshold=threshold, replica_id=self._replica_id)
            while True:
                event = await events.get()
                if event.finished:
                    finished = True
                    tail = detok.finish(event.text)
                    if event.error is not None:
                        yield protocol.EndChunk(finish_reason="error", text=tail, error=event.error)
                        return
                    usage = protocol.Usage(prompt_tokens=len(prompt_ids), completion_tokens=completion_tokens,
                                           total_tokens=len(prompt_ids) + completion_tokens)
                    fsd = protocol.fsd_summary(
                        tier, threshold, drafted, accepted, fuzzy, distortion, completion_tokens, iterations,
                        self._replica_id, replica_ttft_ms=event.ttft_ms, replica_e2e_ms=event.e2e_ms)
                    yield protocol.EndChunk(finish_reason=event.finish_reason or "stop", text=tail,
                                            usage=usage, fsd=fsd)
                    return
                iterations += 1
                drafted += event.drafted
                accepted += event.accepted
                fuzzy += event.fuzzy_accepted
                distortion += event.distortion
                threshold = event.threshold
                completion_tokens += len(event.new_token_ids)
                text = detok.push(event.new_token_ids)
                if text:
                    yield protocol.DeltaChunk(text=text)
        finally:
            if not finished:  # cancelled (client gone, timeout) or the consumer stopped: free the slot
                self._loop.abort(request_id)

    # ---- observability ---------------------------------------------------------------------------

    def stats(self, drain: bool = False) -> dict[str, Any]:
        """A debugging snapshot (cumulative counters, load, T held). Reports, not this, feed the
        controller: nothing is drained here (``drain`` is accepted for old callers and ignored)."""
        snap = self._loop.snapshot(drain_records=False)
        snap.update(dataclasses.asdict(self._state()))
        snap.update(
            incarnation=self._incarnation,
            report_seq=self._seq,
            unacked_reports=len(self._unacked),
            dropped_reports=self._dropped_reports,
            draft_length=self._draft_lengths.get(self._slo.default_tier, self._draft_length),
            max_batch_size=self._cfg.model.max_batch_size,
            max_queued=self._cfg.replica.max_queued,
            max_context=self._pair.max_context,
        )
        return snap

    def _engine_problem(self) -> str | None:
        return self._loop.health_problem(self._cfg.replica.step_hang_s,
                                         self._cfg.replica.max_consecutive_step_failures)

    def check_health(self) -> None:
        """Serve calls this every ``health_check_period_s``; raising makes Serve replace the replica."""
        problem = self._engine_problem()
        if problem is not None:
            raise RuntimeError(f"FSD replica {self._replica_id} unhealthy: {problem}")
        if self._reporter.done():
            raise RuntimeError(f"FSD replica {self._replica_id}: report loop stopped: {self._reporter!r}")

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._watchdog.cancel()
            self._reporter.cancel()
            self._loop.stop(timeout_s=1.0)
