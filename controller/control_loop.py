"""``FSDController``: the control loop (fast loop over T; Serve's autoscaler is the slow loop).

The controller never calls a replica. Replicas push their reports (``report``, on their own timers,
see :mod:`controller.replica`); the reply acknowledges what was counted and carries the current
decision as a :class:`controller.protocol.ThresholdPush`. So reading stats and pushing T never take a
request slot nor wait for an engine step, and a slow or dead replica costs only its own report.

Every ``control.interval_s`` seconds (``tick``, which awaits nothing):

1. fold the reports received since the previous tick into one :class:`policies.telemetry.Telemetry`
   window (:mod:`controller.telemetry_agg`; exactly-once by sequence number);
2. ask the active policy for a :class:`policies.decision.Decision` (a policy that raises leaves T where
   it was — the failure is logged and counted); ask the shadow policy too, and only record its answer;
3. :func:`policies.tiers.apply_decision` turns it into the T per tier (the one place that clamps), and
   a change bumps the version replicas receive with their next reply.

Bumpless restart: a (re)started controller decides nothing until the first reports arrive, then
resumes from the T the replicas hold (the safe T of replicas already in fail-safe) and seeds the
policy's state with it; only then does it answer reports with a decision (a fresh replica reports its
configured initial T; with no replica there is nothing to steer). The policy's ``FailSafe`` still sees
the telemetry age and wins when the telemetry is really stale.

The policy sees time only through ``Telemetry.time_s`` (seconds since this controller started, on its
monotonic clock). SLO and policy changes from the admin API are validated (the new policy is built
against the new SLO) before anything is swapped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from controller.autoscaling import ReplicaCountPublisher, kv_available
from controller.config import FSDConfig, parse_config, steered_replica_bounds
from controller.metrics import MetricsState
from controller.protocol import ReplicaReport, ReplicaState, ReportReply, ThresholdPush
from controller.telemetry_agg import TelemetryAggregator, Window
from policies.base import Policy
from policies.decision import Decision, decision_draft_lengths, decision_to_json
from policies.operating_model import OperatingModel
from policies.registry import DEFAULT_POLICY_SPEC, resolve_spec
from policies.slo import SLOSpec
from policies.telemetry import to_json
from policies.tiers import apply_decision, seed_policy

logger = logging.getLogger("ray.serve")



def build_policy(spec: Mapping[str, Any] | str | None, slo: SLOSpec,
                 operating_model: OperatingModel | None = None,
                 replica_bounds: tuple[int, int] | None = None) -> tuple[Policy, dict[str, Any]]:
    """(policy, normalised spec). ``operating_model``: the served pair's, for the model-predictive policy
    (None: its default); ``replica_bounds``: Serve's min/max when the policy's replica count drives its
    autoscaler (None: it asks for none). ValueError naming the bad field."""
    from policies.registry import make_policy

    normalised: dict[str, Any] | str = dict(spec) if isinstance(spec, Mapping) else (spec or DEFAULT_POLICY_SPEC)
    policy = make_policy(normalised, slo, operating_model=operating_model, replica_bounds=replica_bounds)
    return policy, (normalised if isinstance(normalised, dict) else {"policy": normalised})


def served_operating_model(pair: str, div: str, profile_path: str | None = None,
                           draft_dtype: str | None = None,
                           share_kv: bool | None = None) -> tuple[OperatingModel | None, str]:
    """The model-predictive policy's model of the served pair: from ``profile_path`` when given (a
    profile calibrated on the serving machine; ValueError naming it when it cannot be read), else from
    its calibrated profile ``sim/profiles/<pair>.json`` when there is one (the configured divergence
    where the profile has it), else None (the policy's default, the default pair's model). Also a line
    saying which, for status; with a ``draft_dtype`` override the profile was not calibrated with, the
    line (and the log) says so: its acceptance is another draft's. With ``share_kv`` False (the draft on its own
    KV cache) the pair's ``sim/profiles/<pair>-separate-kv.json`` where there is one: that engine prefills the
    draft apart and catches it up, which the shared-cache profile does not model."""
    from policies.operating_model import DEFAULT_MODEL_PATH
    from sim.profile import PROFILES_DIR, Profile

    def checked(profile: Profile, line: str) -> str:
        if draft_dtype is None:
            return line
        from decoder.models import describe_dtype_name

        served = describe_dtype_name(draft_dtype)
        if profile.provenance.dtype.endswith(f"draft {served}"):
            return line
        warning = (f"; WARNING: calibrated with {profile.provenance.dtype or 'an unstated draft'}, serving draft "
                   f"{served}: set control.profile to a profile calibrated with it (fsd calibrate --draft-dtype "
                   f"{draft_dtype})")
        logger.warning("operating model: %s%s", line, warning)
        return line + warning

    if profile_path is not None:
        try:
            profile = Profile.load(profile_path)
        except ValueError as exc:
            raise ValueError(f"control.profile: {exc}") from None
        use_div = div if div in profile.divs() else profile.default_div
        return (profile.to_operating_model(div=use_div),
                checked(profile, f"control.profile {profile_path} ({profile.provenance.pair}; div {use_div}; k = 0 "
                                 f"{profile.plain_decoding_source})"))
    path = PROFILES_DIR / f"{pair}.json"
    if share_kv is False and (PROFILES_DIR / f"{pair}-separate-kv.json").is_file():
        path = PROFILES_DIR / f"{pair}-separate-kv.json"
    if Path(pair).name != pair or not path.is_file():
        return None, (f"default model policies/models/{DEFAULT_MODEL_PATH.name} (the default pair's): no "
                      f"calibrated profile sim/profiles/{pair}.json for the served pair {pair!r}")
    profile = Profile.load(path)
    use_div = div if div in profile.divs() else profile.default_div
    return (profile.to_operating_model(div=use_div),
            checked(profile, f"calibrated profile sim/profiles/{path.name} of the served pair (div {use_div}; k = 0 "
                             f"{profile.plain_decoding_source})"))


def describe_policy(policy: Policy | None, spec: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if policy is None:
        return None
    from policies.registry import describe

    out: dict[str, Any] = to_json(describe(policy))
    out["spec"] = dict(spec) if spec is not None else None
    return out


def _actor_name() -> str | None:
    try:
        import ray

        if not ray.is_initialized():  # outside Ray (tests): asking would start a cluster
            return None
        return ray.get_runtime_context().get_actor_name()
    except Exception:
        return None


def _app_name() -> str | None:
    """The Serve application this controller runs in (None outside Serve: nothing to publish to)."""
    try:
        from ray import serve

        return str(serve.get_replica_context().app_name)
    except Exception:
        return None


def policy_event_record(kind: str, time_s: float, thresholds: Mapping[str, float], draft_lengths: Mapping[str, int],
                        version: int, policy: Mapping[str, Any], previous: Mapping[str, Any],
                        telemetry: Any, slo: Mapping[str, Any],
                        replica_bounds: tuple[int, int] | None = None,
                        operating_model: OperatingModel | None = None) -> dict[str, Any]:
    """The ``/v1/fsd/status`` history entry where a fresh policy object takes over (tick entries' keys, plus
    ``event`` and what the policy was built with: the SLO, the replica bounds, the operating model, None for
    the policy's default): ``kind`` ``"resume"`` (the controller's first policy, seeded at the replicas' T),
    ``"policy"`` (PUT /v1/fsd/policy), ``"promote"`` (the shadow promoted) or ``"slo"`` (the policy rebuilt
    against a new SLO); ``resolved_policy``: the spec with every parameter written out
    (:func:`policies.registry.resolve_spec`)."""
    return {
        "time_s": time_s,
        "thresholds": dict(thresholds),
        "draft_lengths": dict(draft_lengths),
        "version": version,
        "decision": None,
        "shadow_decision": None,
        "telemetry": telemetry,
        "slo": dict(slo),
        "replica_bounds": list(replica_bounds) if replica_bounds is not None else None,
        "operating_model": operating_model.to_dict() if operating_model is not None else None,
        # The spec as given and written out in full: the full one rebuilds the same policy after a default
        # changes, so the history replays exactly (sim.decision_replay).
        "event": {"kind": kind, "policy": dict(policy), "resolved_policy": resolve_spec(policy),
                  "previous_policy": dict(previous)},
    }


def held_thresholds(states: Sequence[ReplicaState]) -> ReplicaState | None:
    """The replica whose T a restarted controller resumes from: among replicas a controller has steered
    (``epoch`` set), the one holding the newest decision of the most common epoch; else any replica."""
    steered = [s for s in states if s.epoch is not None]
    if not steered:
        return states[0] if states else None
    epochs = [s.epoch for s in steered]
    common = max(set(epochs), key=epochs.count)
    return max((s for s in steered if s.epoch == common), key=lambda s: s.version)


def _percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else None


class FSDController:
    """See the module docstring. ``replicas`` (the replica deployment's handle, bound by the app) is
    kept for the autoscaling hook; the control loop itself never calls a replica."""

    def __init__(self, config: Mapping[str, Any], replicas: Any = None, start_loop: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``start_loop=False``: no timer; the owner calls :meth:`tick` (tests drive it tick by tick,
        with their own ``clock``)."""
        self._clock = clock
        self._cfg: FSDConfig = parse_config(dict(config))
        self._replicas = replicas
        self._slo = self._cfg.slo
        self._operating_model, self._operating_model_source = served_operating_model(
            self._cfg.model.pair, self._cfg.model.div, self._cfg.control.profile, self._cfg.model.draft_dtype,
            self._cfg.model.share_kv)
        # Serve's replica bounds when the policy's Decision.replicas drives its autoscaler (else None).
        self._replica_bounds = steered_replica_bounds(self._cfg)
        self._policy, self._policy_spec = self._build(self._cfg.control.policy, self._slo)
        self._shadow: Policy | None = None
        self._shadow_spec: dict[str, Any] | None = None
        if self._cfg.control.shadow_policy is not None:
            self._shadow, self._shadow_spec = self._build(self._cfg.control.shadow_policy, self._slo)
        self._thresholds = apply_decision(self._slo, {}, self._cfg.replica.initial_thresholds)
        self._draft_lengths: dict[str, int] = dict.fromkeys(self._slo.tiers, self._cfg.model.num_draft_tokens)
        self._batch_cap: int | None = None  # the active decision's batch cap (None: none)
        self._version = 0
        self._decided_unix = time.time()
        # A restarted controller counts versions from 0 again; the epoch tells replicas it is a new one.
        self._epoch = uuid.uuid4().hex
        self._resumed: dict[str, Any] | None = None  # where the T came from, once known
        self._interval = self._cfg.control.interval_s
        self._aggregator = TelemetryAggregator(self._slo, forget_after_s=self._cfg.control.forget_replica_after_s)
        self._metrics = MetricsState()
        self._history: deque[dict[str, Any]] = deque(maxlen=self._cfg.control.history)
        self._t0 = clock()
        self._last_tick = 0.0
        self._last_window: Window | None = None
        self._last_decision: Decision | None = None
        self._last_shadow: Decision | None = None
        self._ingress_rejections: dict[str, int] = {}
        self._ingress_aborted: dict[str, int] = {}
        self._lock = asyncio.Lock()  # an admin change never interleaves with itself
        self._paused = False
        self._stopping = False
        self._problems: dict[str, str] = {}
        # Cumulative, for status and the benchmark.
        self._ticks = 0
        self._failsafe_decisions = 0
        self._reports_counted = 0
        self._completions_counted = 0
        self._push_latencies_ms: deque[float] = deque(maxlen=10_000)
        self._max_telemetry_age_s = 0.0
        self._replica_publisher: ReplicaCountPublisher | None = None
        app_name = _app_name()
        if self._replica_bounds is not None and app_name is not None and kv_available():
            self._replica_publisher = ReplicaCountPublisher(app_name, self._interval)
        self._task: asyncio.Task[None] | None = None
        if start_loop:
            self._task = asyncio.get_running_loop().create_task(self._run())
        logger.info("FSD controller up: interval %.2fs, policy %s (operating model: %s), shadow %s, epoch %s",
                    self._interval, self._policy_spec, self._operating_model_source, self._shadow_spec, self._epoch)

    def _build(self, spec: Mapping[str, Any] | str | None, slo: SLOSpec) -> tuple[Policy, dict[str, Any]]:
        return build_policy(spec, slo, self._operating_model, self._replica_bounds)

    def _publish_replicas(self, decision: Decision | None) -> None:
        """Hand the active decision's replica count to Serve's autoscaler (controller.autoscaling): a
        write in a worker thread, never awaited; None hands scaling back to Serve's default policy."""
        if self._replica_publisher is not None:
            self._replica_publisher.publish(decision.replicas if decision is not None else None,
                                            self._epoch, self._version)

    def _now(self) -> float:
        """Seconds since this controller started (its monotonic clock; the policy's time axis)."""
        return self._clock() - self._t0

    # ---- the control channel ---------------------------------------------------------------------

    async def report(self, batch: list[ReplicaReport]) -> ReportReply:
        """A replica's report batch (its unacknowledged reports). Counts each report once, answers with
        the highest sequence number counted and the current decision (None until resumed)."""
        acked = self._aggregator.receive(batch, self._now())
        return ReportReply(acked_seq=acked, push=self._current_push())

    def _current_push(self) -> ThresholdPush | None:
        if (self._resumed is None or self._paused) and not self._stopping:
            return None
        return ThresholdPush(epoch=self._epoch, version=self._version, thresholds=dict(self._thresholds),
                             draft_lengths=dict(self._draft_lengths), slo=self._slo,
                             decided_unix=self._decided_unix, stopping=self._stopping, batch_cap=self._batch_cap)

    def begin_shutdown(self) -> bool:
        """The service is stopping: every reply from now on tells replicas to fail what they run with an
        explicit error and to refuse new requests (so streams end with an error event, not a cut
        connection, before Serve tears the proxies down)."""
        if not self._stopping:
            logger.warning("FSD controller: service stopping; replicas will cancel in-flight requests")
        self._stopping = True
        return True

    # ---- the loop --------------------------------------------------------------------------------

    async def _run(self) -> None:
        next_tick = time.monotonic() + self._interval
        while True:
            await asyncio.sleep(max(0.0, next_tick - time.monotonic()))
            next_tick += self._interval
            if time.monotonic() > next_tick:  # overran: skip missed ticks, don't burst
                next_tick = time.monotonic() + self._interval
            if self._paused:
                continue
            try:
                self.tick()
            except Exception:
                logger.exception("control tick failed; thresholds unchanged")

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

    def _try_resume(self, now: float) -> bool:
        """Adopt the T the replicas hold (bumpless restart); True once resumed."""
        if self._resumed is not None:
            return True
        states = [state for _, state in self._aggregator.live_states(now)]
        source = held_thresholds(states)
        if source is None:
            # Nobody to steer yet (replicas still loading, or none): deciding on empty telemetry would
            # only record fail-safe decisions. A fresh replica reports its configured initial T.
            return False
        held = {n: t for n, t in source.thresholds.items() if n in self._slo.tiers}
        self._thresholds = apply_decision(self._slo, self._thresholds, held)
        self._draft_lengths.update({n: k for n, k in source.draft_lengths.items() if n in self._slo.tiers})
        self._resumed = {"from": "replicas", "replica_id": source.replica_id, "epoch": source.epoch,
                         "version": source.version, "failsafe": source.failsafe,
                         "thresholds": dict(self._thresholds)}
        seeded = seed_policy(self._policy, self._slo, self._thresholds)
        self._record_policy_event("resume", self._policy_spec, self._policy_spec)
        # The first window after resuming spans one interval, not the controller's whole start-up: a
        # policy's rate limits then allow one interval's move from the resumed T.
        self._last_tick = max(self._last_tick, now - self._interval)
        self._resumed["seeded_tiers"] = seeded
        self._decided_unix = time.time()
        logger.info("FSD controller resumed: %s", self._resumed)
        return True

    def tick(self) -> Window | None:
        """One control step (see the module docstring); the window, or None while waiting to resume."""
        now = self._now()
        if not self._try_resume(now):
            return None
        window_s = max(now - self._last_tick, 1e-3)
        self._last_tick = now
        age = self._aggregator.age_s(now, since_s=0.0)
        rejections, self._ingress_rejections = self._ingress_rejections, {}
        aborted, self._ingress_aborted = self._ingress_aborted, {}
        window = self._aggregator.window(now_s=now, window_s=window_s, age_s=age, thresholds=self._thresholds,
                                         ingress_rejections=rejections, ingress_aborted=aborted,
                                         draft_lengths=self._draft_lengths)
        self._ticks += 1
        self._reports_counted += window.reports
        self._completions_counted += window.telemetry.completions
        self._push_latencies_ms.extend(window.push_latencies_ms)
        live_ages = [r["telemetry_age_s"] for r in window.replicas]
        if live_ages:
            self._max_telemetry_age_s = max(self._max_telemetry_age_s, max(live_ages))
        decision: Decision | None = None
        try:
            decision = self._policy.decide(window.telemetry)
        except Exception:
            self._metrics.policy_errors += 1
            logger.exception("policy %s raised; thresholds held", self._policy_spec)
        if decision is not None:
            if decision.reason.startswith("fail-safe"):
                self._failsafe_decisions += 1
            self._apply(decision)
        self._publish_replicas(decision)
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
            "draft_lengths": dict(self._draft_lengths),
            "batch_cap": self._batch_cap,
            "version": self._version,
            "decision": decision_to_json(decision),
            "shadow_decision": decision_to_json(shadow),
            "telemetry": to_json(window.telemetry),
        })
        return window

    def _apply(self, decision: Decision) -> None:
        new = apply_decision(self._slo, self._thresholds, decision.thresholds)
        lengths = dict(self._draft_lengths)
        asked = decision_draft_lengths(decision)
        if asked is not None:
            default = asked.pop("*", None)
            if default is not None:
                lengths = dict.fromkeys(self._slo.tiers, default)
            lengths.update({n: k for n, k in asked.items() if n in self._slo.tiers and k >= 0})
        cap = getattr(decision, "batch_cap", None)
        if new != self._thresholds or lengths != self._draft_lengths or cap != self._batch_cap:
            self._version += 1
            self._decided_unix = time.time()
        self._thresholds, self._draft_lengths, self._batch_cap = new, lengths, cap

    # ---- admin -----------------------------------------------------------------------------------

    async def set_slo(self, slo: Mapping[str, Any]) -> dict[str, Any]:
        """Validate a new SLOSpec (and the policies rebuilt against it), then swap; replicas receive it
        with their next reply."""
        from pydantic import ValidationError

        from fsd_common.validation import format_validation_error

        try:
            new_slo = SLOSpec.model_validate(dict(slo))
        except ValidationError as exc:
            raise ValueError(f"invalid slo: {format_validation_error(exc)}") from None
        policy, spec = self._build(self._policy_spec, new_slo)
        shadow = self._build(self._shadow_spec, new_slo)[0] if self._shadow_spec is not None else None
        async with self._lock:
            self._slo = new_slo
            self._aggregator.slo = new_slo
            self._policy, self._policy_spec, self._shadow = policy, spec, shadow
            self._thresholds = apply_decision(
                new_slo, {k: v for k, v in self._thresholds.items() if k in new_slo.tiers}, {}
            )
            default_k = self._cfg.model.num_draft_tokens
            self._draft_lengths = {n: self._draft_lengths.get(n, default_k) for n in new_slo.tiers}
            seed_policy(self._policy, new_slo, self._thresholds)
            self._version += 1
            self._decided_unix = time.time()
            self._record_policy_event("slo", spec, spec)
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
        policy, normalised = self._build(spec, self._slo)
        async with self._lock:
            if shadow:
                self._shadow, self._shadow_spec = policy, normalised
            else:
                seed_policy(policy, self._slo, self._thresholds)
                previous, self._policy, self._policy_spec = self._policy_spec, policy, normalised
                self._record_policy_event("policy", normalised, previous)
        logger.info("%s policy replaced: %s", "shadow" if shadow else "active", normalised)
        return self.status(history=0)

    async def promote_shadow(self) -> dict[str, Any]:
        """Make the shadow policy active (rebuilt from its spec against the current SLO, validated like any
        policy change); the shadow slot empties; the change is recorded in the status history."""
        if self._shadow_spec is None:
            raise ValueError("promote: no shadow policy is set (PUT /v1/fsd/policy?shadow=true first)")
        policy, spec = self._build(self._shadow_spec, self._slo)
        async with self._lock:
            seed_policy(policy, self._slo, self._thresholds)
            previous, self._policy, self._policy_spec = self._policy_spec, policy, spec
            self._shadow, self._shadow_spec, self._last_shadow = None, None, None
            self._record_policy_event("promote", spec, previous)
        logger.info("shadow policy promoted to active: %s (was %s)", spec, previous)
        return self.status(history=1)

    def _record_policy_event(self, kind: str, spec: Mapping[str, Any], previous: Mapping[str, Any]) -> None:
        """A history entry where a fresh policy object takes over (``kind``: a new policy, a promotion, or the
        policy rebuilt against a new SLO): the ticks after it are what that object decided, from the T and k
        it was seeded at, so a recorded history replays through the same spec (sim.decision_replay)."""
        telemetry = to_json(self._last_window.telemetry) if self._last_window is not None else None
        self._history.append(policy_event_record(kind, self._now(), self._thresholds, self._draft_lengths,
                                                 self._version, spec, previous, telemetry,
                                                 self._slo.model_dump(mode="json"), self._replica_bounds,
                                                 self._operating_model))

    def record_rejections(self, count: int = 1, tier: str | None = None) -> None:
        """Requests the ingress refused (503) before any replica saw them: SLO misses of ``tier``."""
        name = tier if tier is not None else self._slo.default_tier
        self._ingress_rejections[name] = self._ingress_rejections.get(name, 0) + max(0, int(count))

    def record_aborted(self, count: int = 1, tier: str | None = None) -> None:
        """Requests the ingress gave up on (504) before any replica answered: SLO misses of ``tier``."""
        name = tier if tier is not None else self._slo.default_tier
        self._ingress_aborted[name] = self._ingress_aborted.get(name, 0) + max(0, int(count))

    def pause(self, paused: bool = True) -> bool:
        """Stop/restart deciding and answering with decisions (tests exercise the replicas' fail-safe)."""
        self._paused = paused
        return self._paused

    # ---- observability ---------------------------------------------------------------------------

    def control_stats(self) -> dict[str, Any]:
        """Health of the control channel itself (status and the control-plane benchmark read it)."""
        latencies = list(self._push_latencies_ms)
        return {
            "ticks": self._ticks,
            "reports_counted": self._reports_counted,
            "completions_counted": self._completions_counted,
            "failsafe_decisions": self._failsafe_decisions,
            "max_replica_telemetry_age_s": self._max_telemetry_age_s,
            "push_latency_ms": {"count": len(latencies), "p50": _percentile(latencies, 50),
                                "p99": _percentile(latencies, 99),
                                "max": max(latencies) if latencies else None},
        }

    def status(self, history: int = 50) -> dict[str, Any]:
        window = self._last_window
        now = self._now()
        return {
            "thresholds": dict(self._thresholds),
            "draft_lengths": dict(self._draft_lengths),
            "batch_cap": self._batch_cap,
            "version": self._version,
            "epoch": self._epoch,
            "resumed": to_json(self._resumed),
            "actor_name": _actor_name(),
            "pid": os.getpid(),
            "interval_s": self._interval,
            "paused": self._paused,
            "time_s": now,
            "telemetry_age_s": self._aggregator.age_s(now, since_s=0.0),
            "control": to_json(self.control_stats()),
            "slo": self._slo.model_dump(mode="json"),
            "policy": describe_policy(self._policy, self._policy_spec),
            "operating_model": self._operating_model_source,
            "autoscaling": {
                "replica_bounds": list(self._replica_bounds) if self._replica_bounds is not None else None,
                "publisher": self._replica_publisher.stats() if self._replica_publisher is not None else None,
            },
            "shadow_policy": describe_policy(self._shadow, self._shadow_spec),
            "last_decision": decision_to_json(self._last_decision),
            "last_shadow_decision": decision_to_json(self._last_shadow),
            "telemetry": to_json(window.telemetry) if window is not None else None,
            "replicas": [to_json({**dataclasses.asdict(state), "telemetry_age_s": age})
                         for age, state in self._aggregator.live_states(now)],
            "history": list(self._history)[-history:] if history > 0 else [],
        }

    def metrics_text(self) -> bytes:
        return self._metrics.render()

    def check_health(self) -> None:
        if self._task is not None and self._task.done():
            raise RuntimeError(f"control loop stopped: {self._task.exception()!r}")
