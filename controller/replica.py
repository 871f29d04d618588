"""``FSDReplica``: one model pair, one continuous-batching engine, the current T per tier.

The class is plain Python; :mod:`controller.app` turns it into a Ray Serve deployment with the
configured options. Methods called over Serve:

* ``generate(request)`` — an async generator of chunks for one request (see :mod:`controller.protocol`);
  the first chunk is either an ``error`` (with the HTTP status the ingress should return) or ``start``.
* ``stats(drain=True)`` — exact counters and the finished-request records since the previous drain.
* ``set_thresholds(thresholds, version, slo=None, draft_length=None)`` — the controller's push (idempotent;
  stale versions are ignored).
* ``reconfigure(user_config)`` — Serve's ``user_config`` path for the same live T / k updates.
* ``check_health()`` — raises when the engine thread is gone, so Serve replaces the replica.

Fail-safe: when no controller update arrived for ``replica.stale_after_s`` seconds (measured on this
replica's monotonic clock), every tier drops to its safe T (its pin, else ``TierSLO.safe_threshold``,
default 0 = lossless) until the next update. The switch is logged and reported by ``stats()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from controller import protocol
from controller.batching import BatchingLoop, TokenEvent
from controller.config import FSDConfig, parse_config
from policies.slo import SLOSpec
from policies.tiers import clamp_thresholds, safe_thresholds

logger = logging.getLogger("ray.serve")


def load_model_pair(cfg: FSDConfig) -> Any:
    """The configured pair, from the registry (decoder/pairs.py); ``seed`` seeds a random test pair."""
    from decoder.pairs import load_pair

    return load_pair(cfg.model.pair, dtype=cfg.model.dtype, draft_dtype=cfg.model.draft_dtype, seed=cfg.model.seed)


def _actor_name() -> str | None:
    """This process's Ray actor name (tests and operators use it to find or kill a replica)."""
    try:
        import ray

        return ray.get_runtime_context().get_actor_name()
    except Exception:
        return None


def _node_id() -> str | None:
    try:
        import ray

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

    def __init__(self, config: Mapping[str, Any]) -> None:
        self._cfg = parse_config(dict(config))
        if self._cfg.model.torch_threads is not None:
            import torch

            torch.set_num_threads(self._cfg.model.torch_threads)
        from decoder.engine import FSDEngine

        t0 = time.monotonic()
        self._pair = load_model_pair(self._cfg)
        self._engine = FSDEngine(
            self._pair,
            num_draft_tokens=self._cfg.model.num_draft_tokens,
            div=self._cfg.model.div,
            rule=self._cfg.model.rule,
            max_batch_size=self._cfg.model.max_batch_size,
            seed=self._cfg.model.seed,
        )
        self._replica_id = self._own_replica_id()
        self._slo: SLOSpec = self._cfg.slo
        self._draft_length = self._cfg.model.num_draft_tokens
        # T the controller asked for; until its first push, the configured initial T (default: safe T).
        self._controlled = safe_thresholds(self._slo)
        self._controlled.update(clamp_thresholds(self._slo, self._cfg.replica.initial_thresholds))
        self._version = -1
        self._epoch: str | None = None
        self._started = time.monotonic()
        self._last_update: float | None = None
        self._failsafe = False
        self._failsafe_events = 0
        self._loop = BatchingLoop(self._engine, self._effective(), name=f"fsd-engine-{self._replica_id}")
        self._watchdog = asyncio.get_running_loop().create_task(self._watch_staleness())
        logger.info(
            "FSD replica %s ready: pair %s (%s) loaded in %.1fs; k=%d div=%s rule=%s batch<=%d",
            self._replica_id, self._pair.name, self._pair.description, time.monotonic() - t0,
            self._draft_length, self._cfg.model.div, self._cfg.model.rule, self._cfg.model.max_batch_size,
        )

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

    def set_thresholds(
        self,
        thresholds: Mapping[str, float],
        version: int,
        slo: Mapping[str, Any] | None = None,
        draft_length: int | None = None,
        epoch: str | None = None,
    ) -> dict[str, Any]:
        """Apply the controller's decision. Idempotent: re-sending the same version only refreshes the
        fail-safe clock; an older version from the same controller ``epoch`` is ignored (a delayed push
        must not undo a newer one). A new epoch (a restarted controller counts from 0 again) is accepted."""
        now = time.monotonic()
        if epoch == self._epoch and version < self._version:
            return {"replica_id": self._replica_id, "applied": False, "version": self._version}
        self._epoch = epoch
        self._last_update = now
        if slo is not None:
            self._slo = SLOSpec.model_validate(slo)
        self._controlled = safe_thresholds(self._slo)
        self._controlled.update(clamp_thresholds(self._slo, {k: float(v) for k, v in thresholds.items()}))
        if self._failsafe:
            logger.warning("FSD replica %s: controller is back; leaving fail-safe", self._replica_id)
        self._failsafe = False
        self._version = version
        if draft_length is not None and draft_length != self._draft_length:
            self._draft_length = int(draft_length)
            self._loop.set_draft_length(self._draft_length)
        self._loop.set_tier_thresholds(self._effective())
        return {"replica_id": self._replica_id, "applied": True, "version": version}

    def reconfigure(self, user_config: Mapping[str, Any]) -> None:
        """Serve ``user_config``: ``{"thresholds": {tier: T}, "draft_length": k}`` (both optional)."""
        thresholds = user_config.get("thresholds") or {}
        draft_length = user_config.get("draft_length")
        self.set_thresholds(thresholds, max(self._version, 0), None, draft_length, self._epoch)

    # ---- requests --------------------------------------------------------------------------------

    def _resolve_threshold(self, tier_name: str | None, threshold: float | None) -> tuple[str, float | None]:
        """(tier, per-request T or None). ValueError naming the field when either is out of bounds."""
        name = tier_name if tier_name is not None else self._slo.default_tier
        if name not in self._slo.tiers:
            raise protocol.RequestError(
                422, f"unknown tier {name!r}; known tiers: {sorted(self._slo.tiers)}", "fsd.tier"
            )
        if threshold is None:
            return name, None
        tier = self._slo.tiers[name]
        if not math.isfinite(threshold):
            raise protocol.RequestError(422, f"threshold must be finite, got {threshold}", "fsd.threshold")
        lo, hi = (
            (tier.fixed_threshold, tier.fixed_threshold)
            if tier.fixed_threshold is not None
            else (tier.min_threshold, tier.max_threshold)
        )
        if not lo <= threshold <= hi:
            raise protocol.RequestError(
                422, f"threshold {threshold} outside tier {name!r} bounds [{lo}, {hi}]", "fsd.threshold"
            )
        return name, float(threshold)

    def _sampling_params(self, req: protocol.GenerationRequest) -> Any:
        from decoder.engine import SamplingParams

        limit = self._cfg.replica.max_new_tokens_limit
        max_tokens = req.max_tokens if req.max_tokens is not None else self._cfg.replica.default_max_new_tokens
        if max_tokens > limit:
            raise protocol.RequestError(422, f"max_tokens {max_tokens} exceeds the limit {limit}", "max_tokens")
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

    async def generate(self, request: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Chunks for one request: ``error`` | ``start``, then ``delta``s, then ``end``."""
        try:
            req = protocol.GenerationRequest.model_validate(request)
            tier, override = self._resolve_threshold(req.tier, req.threshold)
            params = self._sampling_params(req)
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
        threshold = override if override is not None else self._effective().get(tier, 0.0)
        self._loop.submit(request_id, prompt_ids, params, tier, override, sink)
        finished = False
        try:
            yield {"type": "start", "request_id": request_id, "prompt_tokens": len(prompt_ids), "tier": tier,
                   "threshold": threshold, "replica_id": self._replica_id}
            while True:
                event = await events.get()
                if event.finished:
                    finished = True
                    tail = detok.finish(event.text)
                    if event.error is not None:
                        yield {"type": "end", "finish_reason": "error", "error": event.error, "text": tail}
                        return
                    usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                             "total_tokens": len(prompt_ids) + completion_tokens}
                    fsd = protocol.fsd_summary(tier, threshold, drafted, accepted, fuzzy, distortion,
                                               completion_tokens, iterations, self._replica_id)
                    yield {"type": "end", "finish_reason": event.finish_reason, "text": tail,
                           "usage": usage, "fsd": fsd}
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
                    yield {"type": "delta", "text": text}
        finally:
            if not finished:  # cancelled (client gone, timeout) or the consumer stopped: free the slot
                self._loop.abort(request_id)

    # ---- observability ---------------------------------------------------------------------------

    def stats(self, drain: bool = True) -> dict[str, Any]:
        now = time.monotonic()
        snap = self._loop.snapshot(drain_records=drain)
        snap.update(
            replica_id=self._replica_id,
            actor_name=_actor_name(),
            node_id=_node_id(),
            pid=os.getpid(),
            uptime_s=now - self._started,
            thresholds=self._effective(),
            controlled_thresholds=dict(self._controlled),
            version=self._version,
            last_update_age_s=None if self._last_update is None else now - self._last_update,
            failsafe=self._failsafe,
            failsafe_events=self._failsafe_events,
            draft_length=self._draft_length,
            max_batch_size=self._cfg.model.max_batch_size,
            max_queued=self._cfg.replica.max_queued,
            engine_alive=self._loop.alive,
            pair=self._pair.name,
            max_context=self._pair.max_context,
        )
        return snap

    def check_health(self) -> None:
        if not self._loop.alive:
            raise RuntimeError(f"FSD engine thread is not running: {self._loop.error}")

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._watchdog.cancel()
            self._loop.stop(timeout_s=1.0)
