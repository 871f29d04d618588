"""What a policy measures in a telemetry window: normalised SLO slack, attainment, distortion, load.

Every function here is pure (telemetry in, number out) and returns NaN when the window holds no
evidence, so that callers can *hold* instead of reacting to an empty window.

Normalised slack of a latency signal: ``e = (observed − target) / target``, observed at the tier's
percentile. ``e > 0`` means the SLO is violated (a policy should raise T to go faster); ``e = −0.2``
means 20 % headroom.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

from policies.slo import TierSLO
from policies.telemetry import LatencySummary, Telemetry, TierWindow

#: Signals a latency-tracking policy can follow. ``tpot``/``ttft``/``e2e`` are percentiles over the
#: requests that *finished* in the window: exact, but sparse at low traffic and lagged by a request's
#: lifetime. ``tpot_live`` is the mean time per output token of the sequences decoding *now*,
#: ``1000 · (in_flight − queue_depth) / output_tokens_per_s`` (aggregate, every window, no lag; a mean,
#: so pair it with a negative setpoint against a p95 target). ``queue_delay`` is the Little's-law wait
#: in queue (queue depth / completion rate). Both compare with the tier's TPOT / TTFT target.
ControlMetric = Literal["tpot", "ttft", "e2e", "queue_delay", "tpot_live"]
CONTROL_METRICS: tuple[str, ...] = get_args(ControlMetric)

LoadSignal = Literal["arrival_rate", "in_flight_per_replica", "queue_depth_per_replica"]
LOAD_SIGNALS: tuple[str, ...] = get_args(LoadSignal)


def metric_target_ms(tier: TierSLO, metric: ControlMetric) -> float | None:
    """The target in ms a signal is compared with (queue delay is held to the TTFT target)."""
    if metric == "queue_delay":
        return tier.ttft_ms
    if metric == "tpot_live":
        return tier.tpot_ms
    return tier.latency_target(metric)


def _tier_window(telemetry: Telemetry, tier_name: str) -> TierWindow | None:
    return telemetry.tiers.get(tier_name)


def observed_latency_ms(
    telemetry: Telemetry, tier_name: str, tier: TierSLO, metric: ControlMetric, min_samples: int = 1
) -> float:
    """The observed value of ``metric`` for a tier at the tier's percentile.

    Uses the tier's own window when the telemetry splits by tier, else the aggregate window. NaN (no
    evidence) when the window has fewer than ``min_samples`` latencies: the p95 of two requests is
    their max, too noisy to act on.
    """
    if metric == "queue_delay":
        return queue_delay_ms(telemetry)
    if metric == "tpot_live":
        return live_tpot_ms(telemetry)
    window = _tier_window(telemetry, tier_name)
    summary: LatencySummary = window.latency(metric) if window is not None else telemetry.latency(metric)
    if summary.count < max(1, min_samples):
        return math.nan
    return summary.at(tier.percentile)


def live_tpot_ms(telemetry: Telemetry) -> float:
    """Mean ms per output token of the sequences decoding in this window (NaN when none decoded)."""
    decoding = telemetry.in_flight - telemetry.queue_depth
    if decoding <= 0 or telemetry.output_tokens_per_s <= 0:
        return math.nan
    return 1000.0 * decoding / telemetry.output_tokens_per_s


def queue_delay_ms(telemetry: Telemetry) -> float:
    """Little's-law wait in queue, ``1000 · queue_depth / completion rate`` in ms.

    An empty queue waits 0 ms; a non-empty queue with no completion in the window is a stall, reported
    as ``+inf`` (callers clip it).
    """
    if telemetry.queue_depth <= 0:
        return 0.0
    if telemetry.completions <= 0:
        return math.inf
    return 1000.0 * telemetry.queue_depth / (telemetry.completions / telemetry.window_s)


def normalised_slack(
    telemetry: Telemetry,
    tier_name: str,
    tier: TierSLO,
    metric: ControlMetric,
    clip: float = math.inf,
    min_samples: int = 1,
) -> float:
    """``(observed − target) / target`` clipped to ``[−1, clip]``; NaN without evidence or target."""
    target = metric_target_ms(tier, metric)
    if target is None:
        return math.nan
    observed = observed_latency_ms(telemetry, tier_name, tier, metric, min_samples)
    if math.isnan(observed):
        return math.nan
    return min(max((observed - target) / target, -1.0), clip)


def attainment(telemetry: Telemetry, tier_name: str) -> float:
    """Share of the tier's finished-or-rejected requests in this window that met every target.

    Rejected and aborted requests count as misses: the tier's own (``TierWindow.rejections`` and
    ``aborted``), and rejections reported only in aggregate are attributed to the tier in proportion to
    its completions. NaN when nothing of the tier finished or was refused.
    """
    window = _tier_window(telemetry, tier_name)
    if window is None or window.completions + window.misses_unanswered <= 0:
        return math.nan
    attributed = sum(t.rejections for t in telemetry.tiers.values())
    unattributed = max(0, telemetry.rejections - attributed)
    rejected = unattributed * window.completions / max(1, telemetry.completions)
    return window.slo_met / (window.completions + window.misses_unanswered + rejected)


def tier_distortion(telemetry: Telemetry, tier_name: str) -> float:
    """Mean per-token distortion the tier saw (aggregate when not split by tier); NaN without tokens."""
    window = _tier_window(telemetry, tier_name)
    if window is not None:
        return window.mean_distortion if window.output_tokens > 0 or window.completions > 0 else math.nan
    if telemetry.output_tokens <= 0 and telemetry.completions <= 0:
        return math.nan
    return telemetry.mean_distortion


def load_level(telemetry: Telemetry, signal: LoadSignal) -> float:
    """A scalar load level for contextual policies."""
    replicas = max(1, telemetry.replicas)
    if signal == "arrival_rate":
        return telemetry.arrival_rate
    if signal == "in_flight_per_replica":
        return telemetry.in_flight / replicas
    return telemetry.queue_depth / replicas
