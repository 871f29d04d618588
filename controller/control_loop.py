"""``FSDController``: the control loop (fast loop over T; Serve's autoscaler is the slow loop).

Every ``control.interval_s`` seconds:

1. gather ``stats(drain=True)`` from every replica with ``DeploymentHandle.broadcast`` (replicas that
   fail to answer in ``stats_timeout_s`` are skipped this tick);
2. aggregate one :class:`policies.telemetry.Telemetry` window (:mod:`controller.telemetry_agg`);
3. ask the active policy for a :class:`policies.decision.Decision` (a policy that raises leaves T where
   it was — the failure is logged and counted); ask the shadow policy too, and only record its answer;
4. clamp the decision into the SLO's tier bounds and push it, with a version number and the SLO, to
   every replica — every tick, changed or not: the push is idempotent, keeps the replicas' fail-safe
   clock fresh, and brings replicas added by autoscaling or restarts to the current T within one tick.

The policy sees time only through ``Telemetry.time_s`` (seconds since this controller started, on its
monotonic clock). SLO and policy changes from the admin API are validated (the new policy is built
against the new SLO) before anything is swapped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import Mapping
from typing import Any

from controller.config import FSDConfig, parse_config
from controller.metrics import MetricsState
from controller.telemetry_agg import TelemetryAggregator, Window
from policies.base import Policy
from policies.decision import Decision
from policies.registry import DEFAULT_POLICY_SPEC
from policies.slo import SLOSpec
from policies.tiers import clamp_thresholds, safe_thresholds

logger = logging.getLogger("ray.serve")



def build_policy(spec: Mapping[str, Any] | str | None, slo: SLOSpec) -> tuple[Policy, dict[str, Any]]:
    """(policy, normalised spec). ValueError naming the bad field."""
    from policies.registry import make_policy

    normalised: dict[str, Any] | str = dict(spec) if isinstance(spec, Mapping) else (spec or DEFAULT_POLICY_SPEC)
    policy = make_policy(normalised, slo)
    return policy, (normalised if isinstance(normalised, dict) else {"policy": normalised})


def describe_policy(policy: Policy | None, spec: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if policy is None:
        return None
    from policies.registry import describe

    out: dict[str, Any] = _jsonable(describe(policy))
    out["spec"] = dict(spec) if spec is not None else None
    return out


def _jsonable(value: Any) -> Any:
    """JSON-safe copy: dataclasses and mappings to dicts, NaN/inf to None."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _actor_name() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_actor_name()
    except Exception:
        return None


def _decision_dict(decision: Decision | None) -> dict[str, Any] | None:
    if decision is None:
        return None
    return {"thresholds": dict(decision.thresholds), "draft_length": decision.draft_length,
            "replicas": decision.replicas, "reason": decision.reason}


class FSDController:
    """See the module docstring. ``replicas`` is a DeploymentHandle to the FSDReplica deployment."""

    def __init__(self, config: Mapping[str, Any], replicas: Any) -> None:
        self._cfg: FSDConfig = parse_config(dict(config))
        self._replicas = replicas
        self._slo = self._cfg.slo
        self._policy, self._policy_spec = build_policy(self._cfg.control.policy, self._slo)
        self._shadow: Policy | None = None
        self._shadow_spec: dict[str, Any] | None = None
        if self._cfg.control.shadow_policy is not None:
            self._shadow, self._shadow_spec = build_policy(self._cfg.control.shadow_policy, self._slo)
        self._thresholds = safe_thresholds(self._slo)
        self._thresholds.update(clamp_thresholds(self._slo, self._cfg.replica.initial_thresholds))
        self._draft_length: int | None = None
        self._version = 0
        # A restarted controller counts versions from 0 again; the epoch tells replicas it is a new one.
        self._epoch = uuid.uuid4().hex
        self._interval = self._cfg.control.interval_s
        self._aggregator = TelemetryAggregator(self._slo)
        self._metrics = MetricsState()
        self._history: deque[dict[str, Any]] = deque(maxlen=self._cfg.control.history)
        self._t0 = time.monotonic()
        self._last_tick = self._t0
        self._last_report = self._t0  # when replica stats last arrived
        self._last_window: Window | None = None
        self._last_decision: Decision | None = None
        self._last_shadow: Decision | None = None
        self._pending_rejections = 0
        self._lock = asyncio.Lock()  # a tick and an admin change never interleave
        self._paused = False
        self._problems: dict[str, str] = {}
        self._task = asyncio.get_running_loop().create_task(self._run())
        logger.info("FSD controller up: interval %.2fs, policy %s, shadow %s", self._interval,
                    self._policy_spec, self._shadow_spec)

    # ---- the loop --------------------------------------------------------------------------------

    async def _run(self) -> None:
        next_tick = time.monotonic() + self._interval
        while True:
            await asyncio.sleep(max(0.0, next_tick - time.monotonic()))
            next_tick += self._interval
            if time.monotonic() > next_tick:  # overran (slow gather): skip missed ticks, don't burst
                next_tick = time.monotonic() + self._interval
            if self._paused:
                continue
            try:
                async with self._lock:
                    await self._tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("control tick failed; thresholds unchanged")

    async def _gather(self) -> list[dict[str, Any]]:
        try:
            response = self._replicas.broadcast("stats", drain=True)
            results = await response.results_async(timeout_s=self._cfg.control.stats_timeout_s,
                                                   return_exceptions=True)
        except Exception as exc:  # no replica running (yet), or the whole gather timed out
            self._log_once("gather", f"replica stats gather failed: {type(exc).__name__}: {exc}")
            return []
        self._log_once("gather", None)
        reports = [r for r in results if isinstance(r, dict)]
        failed = len(results) - len(reports)
        if failed:
            logger.warning("%d of %d replicas did not report this tick", failed, len(results))
        return reports

    async def _push(self) -> None:
        try:
            response = self._replicas.broadcast(
                "set_thresholds", dict(self._thresholds), self._version,
                self._slo.model_dump(mode="json"), self._draft_length, self._epoch,
            )
            await response.results_async(timeout_s=self._cfg.control.stats_timeout_s, return_exceptions=True)
        except Exception as exc:
            self._log_once("push", f"threshold push failed: {type(exc).__name__}: {exc}")
            return
        self._log_once("push", None)

    def _log_once(self, key: str, problem: str | None) -> None:
        """Log a problem when it starts and when it clears, not on every tick it persists."""
        before = self._problems.get(key)
        if problem is not None and before is None:
            logger.warning("%s (logged once until it clears)", problem)
        elif problem is None and before is not None:
            logger.info("%s: recovered", key)
        if problem is None:
            self._problems.pop(key, None)
        else:
            self._problems[key] = problem

    async def _tick(self) -> None:
        reports = await self._gather()
        now = time.monotonic()
        if reports:
            self._last_report = now
        window_s = max(now - self._last_tick, 1e-3)
        self._last_tick = now
        rejections, self._pending_rejections = self._pending_rejections, 0
        window = self._aggregator.window(
            reports, now_s=now - self._t0, window_s=window_s, age_s=now - self._last_report,
            thresholds=self._thresholds, extra_rejections=rejections,
        )
        decision: Decision | None = None
        try:
            decision = self._policy.decide(window.telemetry)
        except Exception:
            self._metrics.policy_errors += 1
            logger.exception("policy %s raised; thresholds held", self._policy_spec)
        if decision is not None:
            proposed = dict(self._thresholds)
            proposed.update(decision.thresholds)
            new = clamp_thresholds(self._slo, proposed)
            if new != self._thresholds or decision.draft_length not in (None, self._draft_length):
                self._version += 1
            self._thresholds = new
            if decision.draft_length is not None:
                self._draft_length = decision.draft_length
        shadow: Decision | None = None
        if self._shadow is not None:
            try:
                shadow = self._shadow.decide(window.telemetry)
                logger.info("shadow policy would set T=%s (%s)", dict(shadow.thresholds), shadow.reason)
            except Exception:
                logger.exception("shadow policy %s raised", self._shadow_spec)
        self._last_window, self._last_decision, self._last_shadow = window, decision, shadow
        self._metrics.update(window, self._thresholds)
        self._history.append({
            "time_s": window.telemetry.time_s,
            "thresholds": dict(self._thresholds),
            "version": self._version,
            "decision": _decision_dict(decision),
            "shadow_decision": _decision_dict(shadow),
            "telemetry": _jsonable(window.telemetry),
        })
        await self._push()

    # ---- admin -----------------------------------------------------------------------------------

    async def set_slo(self, slo: Mapping[str, Any]) -> dict[str, Any]:
        """Validate a new SLOSpec (and the policies rebuilt against it), then swap and push at once."""
        from pydantic import ValidationError

        from fsd_common.validation import format_validation_error

        try:
            new_slo = SLOSpec.model_validate(dict(slo))
        except ValidationError as exc:
            raise ValueError(f"invalid slo: {format_validation_error(exc)}") from None
        policy, spec = build_policy(self._policy_spec, new_slo)
        shadow = build_policy(self._shadow_spec, new_slo)[0] if self._shadow_spec is not None else None
        async with self._lock:
            self._slo = new_slo
            self._aggregator.slo = new_slo
            self._policy, self._policy_spec, self._shadow = policy, spec, shadow
            base = safe_thresholds(new_slo)
            base.update(clamp_thresholds(new_slo, {k: v for k, v in self._thresholds.items() if k in new_slo.tiers}))
            self._thresholds = base
            self._version += 1
            await self._push()
        logger.info("SLO replaced (version %d): %s", self._version, new_slo.model_dump(mode="json"))
        return self.status(history=0)

    async def set_policy(self, spec: Mapping[str, Any] | str | None, shadow: bool = False) -> dict[str, Any]:
        """Replace the active policy (or, with ``shadow``, the shadow one; ``spec=None`` clears the shadow)."""
        if shadow and spec is None:
            async with self._lock:
                self._shadow, self._shadow_spec = None, None
            return self.status(history=0)
        if spec is None:
            raise ValueError("policy: a policy spec is required")
        policy, normalised = build_policy(spec, self._slo)
        async with self._lock:
            if shadow:
                self._shadow, self._shadow_spec = policy, normalised
            else:
                self._policy, self._policy_spec = policy, normalised
        logger.info("%s policy replaced: %s", "shadow" if shadow else "active", normalised)
        return self.status(history=0)

    async def promote_shadow(self) -> dict[str, Any]:
        """Make the shadow policy active (rebuilt from its spec against the current SLO, validated like any
        policy change); the shadow slot empties; the change is recorded in the status history."""
        from controller.rollout import promotion_record

        if self._shadow_spec is None:
            raise ValueError("promote: no shadow policy is set (PUT /v1/fsd/policy?shadow=true first)")
        policy, spec = build_policy(self._shadow_spec, self._slo)
        async with self._lock:
            previous, self._policy, self._policy_spec = self._policy_spec, policy, spec
            self._shadow, self._shadow_spec, self._last_shadow = None, None, None
            telemetry = _jsonable(self._last_window.telemetry) if self._last_window is not None else None
            self._history.append(promotion_record(time.monotonic() - self._t0, self._thresholds, self._version,
                                                  spec, previous, telemetry))
        logger.info("shadow policy promoted to active: %s (was %s)", spec, previous)
        return self.status(history=1)

    def record_rejections(self, count: int = 1) -> None:
        """Requests the ingress refused for overload before any replica saw them."""
        self._pending_rejections += max(0, int(count))

    def pause(self, paused: bool = True) -> bool:
        """Stop/restart deciding and pushing (tests use it to exercise the replicas' fail-safe)."""
        self._paused = paused
        return self._paused

    # ---- observability ---------------------------------------------------------------------------

    def status(self, history: int = 50) -> dict[str, Any]:
        window = self._last_window
        return {
            "thresholds": dict(self._thresholds),
            "version": self._version,
            "epoch": self._epoch,
            "actor_name": _actor_name(),
            "draft_length": self._draft_length,
            "interval_s": self._interval,
            "paused": self._paused,
            "time_s": time.monotonic() - self._t0,
            "slo": self._slo.model_dump(mode="json"),
            "policy": describe_policy(self._policy, self._policy_spec),
            "shadow_policy": describe_policy(self._shadow, self._shadow_spec),
            "last_decision": _decision_dict(self._last_decision),
            "last_shadow_decision": _decision_dict(self._last_shadow),
            "telemetry": _jsonable(window.telemetry) if window is not None else None,
            "replicas": window.replicas if window is not None else [],
            "history": list(self._history)[-history:] if history > 0 else [],
        }

    def metrics_text(self) -> bytes:
        return self._metrics.render()

    def check_health(self) -> None:
        if self._task.done():
            raise RuntimeError(f"control loop stopped: {self._task.exception()!r}")
