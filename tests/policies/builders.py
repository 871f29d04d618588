"""Builders with sensible defaults plus overrides: ``make_telemetry(queue_depth=40)``."""

from __future__ import annotations

from typing import Any

from policies.slo import SLOSpec, TierSLO
from policies.telemetry import LatencySummary, Telemetry, TierWindow


def flat_latency(ms: float, count: int = 20) -> LatencySummary:
    """A summary whose every percentile is ``ms`` (so the policy's percentile choice does not matter)."""
    if count <= 0:
        return LatencySummary()
    return LatencySummary(count=count, p50_ms=ms, p90_ms=ms, p95_ms=ms, p99_ms=ms)


def make_slo(**overrides: Any) -> SLOSpec:
    """The shipped default SLO (lossless / standard / economy), with ``tiers`` etc. overridable.

    ``standard=dict(...)`` / ``economy=dict(...)`` override fields of that tier only.
    """
    base = SLOSpec.default()
    tiers = dict(base.tiers)
    for name in list(overrides):
        if name in tiers and isinstance(overrides[name], dict):
            tiers[name] = tiers[name].model_copy(update=overrides.pop(name))
            tiers[name] = TierSLO.model_validate(tiers[name].model_dump())
    fields: dict[str, Any] = {"tiers": tiers, "default_tier": base.default_tier}
    fields.update(overrides)
    return SLOSpec.model_validate(fields)


def make_tier_window(threshold: float = 0.0, **overrides: Any) -> TierWindow:
    """A tier window with 20 completions all meeting the SLO at 50 ms TPOT, overridable.

    Shortcuts: ``tpot_ms=`` / ``ttft_ms=`` / ``e2e_ms=`` set a flat summary over ``completions``.
    """
    completions = overrides.get("completions", 20)
    fields: dict[str, Any] = {
        "threshold": threshold,
        "completions": completions,
        "slo_met": completions,
        "tpot": flat_latency(50.0, completions),
        "ttft": flat_latency(200.0, completions),
        "e2e": flat_latency(5000.0, completions),
        "mean_distortion": 0.0,
        "output_tokens": 200 * completions,
    }
    for metric in ("tpot", "ttft", "e2e"):
        if f"{metric}_ms" in overrides:
            fields[metric] = flat_latency(overrides.pop(f"{metric}_ms"), completions)
    fields.update(overrides)
    return TierWindow(**fields)


def make_telemetry(**overrides: Any) -> Telemetry:
    """One 1-second window at t = 1 s: 20 arrivals and completions, 50 ms TPOT, one replica.

    Shortcuts: ``tpot_ms=`` / ``ttft_ms=`` / ``e2e_ms=`` set a flat aggregate summary over
    ``completions``; ``tiers=`` takes TierWindows (see :func:`make_tier_window`).
    """
    completions = overrides.get("completions", 20)
    fields: dict[str, Any] = {
        "time_s": 1.0,
        "window_s": 1.0,
        "arrivals": 20,
        "completions": completions,
        "in_flight": 8,
        "tpot": flat_latency(50.0, completions),
        "ttft": flat_latency(200.0, completions),
        "e2e": flat_latency(5000.0, completions),
        "output_tokens": 200 * completions,
        "output_tokens_per_s": 200.0 * completions,
        "replicas": 1,
    }
    for metric in ("tpot", "ttft", "e2e"):
        if f"{metric}_ms" in overrides:
            fields[metric] = flat_latency(overrides.pop(f"{metric}_ms"), completions)
    fields.update(overrides)
    return Telemetry(**fields)
