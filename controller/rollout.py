"""Rollout: the live service's config as simulator inputs, and the shadow estimate.

- :func:`sim_inputs` maps an :class:`FSDConfig` (SLO, live policy, fleet) to what the simulator needs,
  so ``fsd sim compare --trace rec.csv --config fsd.yaml`` replays a recording on the cluster that
  served it, with the live policy as the baseline.
- :class:`ShadowEstimator` (in the ingress, beside the traffic recorder) answers, per tier, "what would
  the shadow policy have done on the last ``recording.shadow_window_s`` of traffic": it replays that
  window's recorded arrivals through the simulator with the shadow policy and with the live one. It runs
  in a worker thread when ``/v1/fsd/status`` is read, at most every ``recording.shadow_every_s``
  (cached in between): the control loop never waits for it.
- A promotion leaves an entry in the ``/v1/fsd/status`` history (``controller.control_loop.policy_event_record``).

The simulator starts each replay cold (empty queues, a fresh policy) and times it with the sim profile
(``recording.profile``, default the shipped one calibrated on the default pair): an estimate, not a
measurement — the live policy's row beside it shows how far the two differ on the same window.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from controller.config import FSDConfig, steered_replica_bounds
from controller.recording import TrafficRecord, TrafficRecorder
from policies.base import Policy
from policies.registry import DEFAULT_POLICY_SPEC
from policies.slo import SLOSpec
from sim.autoscaler import AutoscalerConfig
from sim.profile import Profile
from sim.replay import Replay, replay, requests_from_trace
from sim.simulator import SimConfig
from sim.trace import Trace

logger = logging.getLogger("ray.serve")

LIVE = "live"
SHADOW = "shadow"


@dataclass(frozen=True)
class SimInputs:
    """What the simulator needs to replay traffic as the live service would serve it."""

    slo: SLOSpec
    live_policy: dict[str, Any] | str
    config: SimConfig
    notes: tuple[str, ...] = ()
    #: Serve's (min, max) replicas when the live policy's Decision.replicas drives its autoscaler (the
    #: simulator then honours the policy's count, as the live hook does); None otherwise.
    replica_bounds: tuple[int, int] | None = None


def live_policy_spec(cfg: FSDConfig) -> dict[str, Any] | str:
    return cfg.control.policy if cfg.control.policy is not None else DEFAULT_POLICY_SPEC


_AUTOSCALER_KEYS = ("min_replicas", "max_replicas", "target_ongoing_requests", "upscale_delay_s", "downscale_delay_s")
#: Serve's autoscaling_config keys the simulator mirrors otherwise (the hand-off's policy: honour_policy_replicas).
_MIRRORED_KEYS = ("initial_replicas", "policy")


def sim_inputs(cfg: FSDConfig, *, seed: int = 0, replicas: int | None = None) -> SimInputs:
    """The config's SLO, live policy and fleet (replicas or autoscaling, batch size, queue bound, k,
    divergence, control interval) as simulator inputs. ``replicas`` overrides the fleet's count."""
    notes: list[str] = []
    cluster: dict[str, Any] = {
        "seed": seed,
        "max_batch": cfg.model.max_batch_size,
        # The replica bounds waiting + running; the simulator's queue counts the waiting only.
        "max_queue": max(0, cfg.replica.max_queued - cfg.model.max_batch_size),
        "control_interval_s": cfg.control.interval_s,
        "k": cfg.model.num_draft_tokens,
        "div": cfg.model.div,
    }
    auto = cfg.serve.autoscaling_config
    if auto is not None and replicas is None:
        known = {k: auto[k] for k in _AUTOSCALER_KEYS if k in auto}
        ignored = sorted(set(auto) - set(_AUTOSCALER_KEYS) - set(_MIRRORED_KEYS))
        if ignored:
            notes.append(f"serve.autoscaling_config keys the simulator does not model: {ignored}")
        scaler = AutoscalerConfig.model_validate(known)
        cluster["autoscaler"] = scaler
        cluster["replicas"] = int(auto.get("initial_replicas") or scaler.min_replicas)
        bounds = steered_replica_bounds(cfg)
        cluster["honour_policy_replicas"] = bounds is not None
    else:
        cluster["replicas"] = replicas or cfg.serve.num_replicas or 1
        bounds = None
    return SimInputs(cfg.slo, live_policy_spec(cfg), SimConfig.from_dict(cluster, source="fsd config"),
                     tuple(notes), bounds)


def sim_policy(spec: Mapping[str, Any] | str, slo: SLOSpec, profile: Profile, k: int | None,
               replica_bounds: tuple[int, int] | None = None) -> Policy:
    """``spec`` built for the simulator (with the profile's speed curve and latency model; with
    ``replica_bounds``, asking for replicas within them as the live policy does behind the hook)."""
    from policies.registry import make_policy

    return make_policy(dict(spec) if isinstance(spec, Mapping) else spec, slo,
                       speed_curve=profile.to_speed_curve(k=k), latency_model=profile.to_latency_model(k=k),
                       replica_bounds=replica_bounds)


def trace_from_records(rows: list[TrafficRecord], source: str = "recording window") -> Trace:
    """Recorder rows (by arrival) as a :class:`Trace`, arrivals relative to the first."""
    if not rows:
        raise ValueError("no recorded requests in the window")
    t = np.array([r.arrival_unix_s for r in rows], dtype=np.float64)
    return Trace(arrival_s=t - t[0], prompt_tokens=np.array([r.prompt_tokens for r in rows], dtype=np.int64),
                 output_tokens=np.array([r.generated_tokens for r in rows], dtype=np.int64), source=source,
                 tier=tuple(r.tier for r in rows), max_tokens=np.array([r.max_tokens for r in rows], dtype=np.int64),
                 status=tuple(r.status for r in rows))


def _tier_row(run_result: Any, verdict: Any) -> dict[str, Any]:
    ts = run_result.timeseries.get(f"T_{verdict.tier}") or []
    out = verdict.as_dict()
    out["sim_mean_threshold"] = float(np.mean(ts)) if ts else None
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}


def shadow_report(result: Replay, status: Mapping[str, Any], window_s: float, requests: int,
                  profile: Profile) -> dict[str, Any]:
    """Per tier: the threshold the shadow policy last chose live, and the simulator's attainment and
    distortion for the shadow and the live policy on the window (with the SLO verdict)."""
    runs = {r.name: r for r in result.runs}
    shadow_last = ((status.get("last_shadow_decision") or {}).get("thresholds")) or {}
    tiers: dict[str, Any] = {}
    for name in runs[SHADOW].verdicts:
        tiers[name] = {
            "shadow_would_set": shadow_last.get(name),
            "live_threshold": (status.get("thresholds") or {}).get(name),
            SHADOW: _tier_row(runs[SHADOW].result, runs[SHADOW].verdicts[name]),
            LIVE: _tier_row(runs[LIVE].result, runs[LIVE].verdicts[name]),
        }
    return {
        "window_s": window_s,
        "requests": requests,
        "profile": profile.provenance.pair,
        "shadow_meets_slo": runs[SHADOW].meets_slo,
        "live_meets_slo": runs[LIVE].meets_slo,
        "tiers": tiers,
    }


class ShadowEstimator:
    """Cached simulator estimate of the shadow policy on the recorded window (module docstring)."""

    def __init__(self, cfg: FSDConfig, recorder: TrafficRecorder | None) -> None:
        self._cfg = cfg
        self._recorder = recorder
        self._profile: Profile | None = None
        self._cache: tuple[float, str, dict[str, Any]] | None = None  # (computed at, inputs key, report)
        self._lock = asyncio.Lock()

    def _profile_loaded(self) -> Profile:
        if self._profile is None:
            path = self._cfg.recording.profile
            self._profile = Profile.load(path) if path else Profile.default()
        return self._profile

    async def estimate(self, status: Mapping[str, Any]) -> dict[str, Any] | None:
        """The estimate for this status (None without a shadow policy); never raises."""
        shadow = status.get("shadow_policy")
        if not shadow:
            return None
        if self._recorder is None:
            return {"error": "no estimate: traffic recording is off (recording.enabled)"}
        live_spec = (status.get("policy") or {}).get("spec") or live_policy_spec(self._cfg)
        key = json.dumps([shadow.get("spec"), live_spec, status.get("slo")], sort_keys=True, default=str)
        async with self._lock:
            now = time.monotonic()
            if self._cache is not None and self._cache[1] == key and now - self._cache[0] < self._cfg.recording.shadow_every_s:
                return self._cache[2]
            try:
                report = await asyncio.to_thread(self._compute, status, shadow.get("spec"), live_spec)
            except Exception as exc:  # an estimate must never break the status route
                logger.warning("shadow estimate failed: %s: %s", type(exc).__name__, exc)
                report = {"error": f"no estimate: {type(exc).__name__}: {exc}"}
            self._cache = (now, key, report)
            return report

    def _compute(self, status: Mapping[str, Any], shadow_spec: Any, live_spec: Any) -> dict[str, Any]:
        assert self._recorder is not None
        window_s = self._cfg.recording.shadow_window_s
        rows = self._recorder.recent(window_s)
        if not rows:
            return {"window_s": window_s, "requests": 0, "error": "no estimate: no recorded requests in the window"}
        slo = SLOSpec.model_validate(status["slo"]) if status.get("slo") else self._cfg.slo
        profile = self._profile_loaded()
        replicas = len(status.get("replicas") or []) or None
        inputs = sim_inputs(self._cfg, replicas=replicas)
        k = inputs.config.k
        policies = {LIVE: sim_policy(live_spec, slo, profile, k), SHADOW: sim_policy(shadow_spec, slo, profile, k)}
        requests = requests_from_trace(trace_from_records(rows), slo)
        result = replay(requests, slo, profile, inputs.config, policies, baseline=LIVE)
        return shadow_report(result, status, window_s, len(rows), profile)
