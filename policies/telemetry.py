"""One control window of measurements, as a policy sees it.

The controller (live) and the simulator (offline) both aggregate their counters into a
:class:`Telemetry`; the time arrives inside it, so a policy never reads a clock.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from policies.slo import SUPPORTED_PERCENTILES, LatencyMetric


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """Percentiles of one latency metric over a window, in ms (NaN when ``count`` is 0)."""

    count: int = 0
    p50_ms: float = math.nan
    p90_ms: float = math.nan
    p95_ms: float = math.nan
    p99_ms: float = math.nan

    @classmethod
    def from_samples(cls, samples_ms: Sequence[float] | np.ndarray) -> LatencySummary:
        arr = np.asarray(samples_ms, dtype=float)
        if arr.size == 0:
            return cls()
        p50, p90, p95, p99 = np.percentile(arr, SUPPORTED_PERCENTILES)
        return cls(int(arr.size), float(p50), float(p90), float(p95), float(p99))

    def at(self, percentile: float) -> float:
        """The value at ``percentile`` (one of :data:`policies.slo.SUPPORTED_PERCENTILES`)."""
        table = {50.0: self.p50_ms, 90.0: self.p90_ms, 95.0: self.p95_ms, 99.0: self.p99_ms}
        if percentile not in table:
            raise ValueError(f"percentile must be one of {SUPPORTED_PERCENTILES}, got {percentile}")
        return table[percentile]


@dataclass(frozen=True, slots=True)
class TierWindow:
    """Per-tier slice of a window: what the tier's requests saw and the T they ran at."""

    threshold: float
    completions: int = 0
    slo_met: int = 0
    ttft: LatencySummary = field(default_factory=LatencySummary)
    tpot: LatencySummary = field(default_factory=LatencySummary)
    e2e: LatencySummary = field(default_factory=LatencySummary)
    mean_distortion: float = 0.0
    output_tokens: int = 0
    draft_length: int | None = None  # k the tier ran at (None: not reported)
    sequence_iterations: int = 0  # decode steps the tier's sequences took part in (one per row per step)
    #: Requests of this tier that arrived, and that ended without an answer: refused (503) and
    #: aborted / timed out / failed (504, client gone, engine error). Both count as SLO misses.
    arrivals: int = 0
    rejections: int = 0
    aborted: int = 0

    @property
    def tokens_per_iteration(self) -> float:
        """Measured output tokens per sequence per decode step (NaN without steps): 1 + accepted drafts."""
        if self.sequence_iterations <= 0:
            return math.nan
        return self.output_tokens / self.sequence_iterations

    @property
    def misses_unanswered(self) -> int:
        """Requests of the tier that got no answer (rejected or aborted): misses for attainment."""
        return self.rejections + self.aborted

    def latency(self, metric: LatencyMetric) -> LatencySummary:
        return {"ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e}[metric]


@dataclass(frozen=True, slots=True)
class StepTotals:
    """Sums over one kind of decode step in a window: what a step-time model needs to predict their total.

    A window's mean step mixes kinds (plain steps on one replica, speculative ones on another) and
    compositions (the rows drafting, their k), and a long step can end windows after the change that
    started it; so a source that can says which steps were which, and what each held. For a step of
    ``B`` rows, ``k_max`` draft forwards over the ``n_d`` rows with k > 0 and a verify as wide as each
    row's ``k_r``: ``rows`` = Σ B, ``draft_forwards`` = Σ k_max, ``verify_tokens`` = Σ Σ_r k_r,
    ``drafted_row_forwards`` = Σ k_max · n_d. ``ms`` is decode time (prefills and draft catch-ups left out).
    """

    steps: int = 0
    ms: float = 0.0
    rows: int = 0
    draft_forwards: int = 0
    verify_tokens: int = 0
    drafted_row_forwards: int = 0

    @property
    def mean_ms(self) -> float:
        return self.ms / self.steps if self.steps > 0 else math.nan

    @property
    def mean_rows(self) -> float:
        return self.rows / self.steps if self.steps > 0 else math.nan


@dataclass(frozen=True, slots=True)
class Telemetry:
    """Aggregated over all replicas for the window ``(time_s - window_s, time_s]``.

    ``age_s`` is how old the newest replica report was when the window was closed: a fail-safe
    wrapper treats large ages as lost control.
    """

    time_s: float
    window_s: float
    arrivals: int = 0  # requests that arrived in the window: the offered load, refused ones included
    completions: int = 0
    rejections: int = 0
    queue_depth: int = 0
    queue_depth_per_replica: tuple[int, ...] = ()
    in_flight: int = 0
    ttft: LatencySummary = field(default_factory=LatencySummary)
    tpot: LatencySummary = field(default_factory=LatencySummary)
    e2e: LatencySummary = field(default_factory=LatencySummary)
    acceptance_rate: float = math.nan
    mean_accepted_per_iter: float = math.nan
    mean_distortion: float = 0.0
    output_tokens: int = 0
    output_tokens_per_s: float = 0.0
    replicas: int = 1
    draft_length: int = 4  # k of the default tier (per tier: TierWindow.draft_length)
    mean_iteration_ms: float = math.nan  # measured mean decode-step time over the window's steps
    mean_batch_size: float = math.nan  # mean sequences per decode step
    #: Prefill wall time over the window, summed over replicas (ms): the joiners' prompts, during which
    #: the running batch stalls. NaN: not measured (a source that cannot separate it from decode steps).
    prefill_ms: float = math.nan
    #: The window's decode steps by kind (k = 0 for every row; some row drafting). None: the source reports
    #: only the mean above (then a step model corrects itself from windows that ran one kind throughout).
    plain_steps: StepTotals | None = None
    speculative_steps: StepTotals | None = None
    age_s: float = 0.0
    tiers: Mapping[str, TierWindow] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if not math.isfinite(self.time_s):
            raise ValueError(f"time_s must be finite, got {self.time_s}")

    def latency(self, metric: LatencyMetric) -> LatencySummary:
        return {"ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e}[metric]

    @property
    def arrival_rate(self) -> float:
        return self.arrivals / self.window_s


# ---------------------------------------------------------------- JSON form
# The controller keeps each window in its status history as JSON (NaN as null, tuples as lists); a recorded
# history then replays through a policy offline (sim.decision_replay). Python's JSON floats round-trip
# exactly, so a window read back equals the one the policy saw (an infinite value would come back NaN;
# no field holds one).


_W = TypeVar("_W", TierWindow, Telemetry)


def to_json(value: Any) -> Any:
    """JSON-safe copy of a window or any of its parts (of any dataclass, for the controller's status): dataclasses
    and mappings to dicts, tuples to lists, NaN and infinities to None."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _fields(data: object, cls: type, what: str) -> dict[str, Any]:
    """``data``'s fields for ``cls``: unknown names refused, null back to NaN where the field is a float."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{what}: expected an object, got {type(data).__name__}")
    known = {f.name: f.type for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{what}: unknown field(s) {unknown}; known: {list(known)}")
    return {k: math.nan if v is None and known[k] == "float" else v for k, v in data.items()}


def latency_from_json(data: object, what: str = "latency") -> LatencySummary:
    return LatencySummary(**_fields(data, LatencySummary, what))


def step_totals_from_json(data: object, what: str = "steps") -> StepTotals | None:
    if data is None:
        return None
    return StepTotals(**_fields(data, StepTotals, what))


def tier_window_from_json(data: object, what: str = "tier") -> TierWindow:
    d = _fields(data, TierWindow, what)
    for metric in ("ttft", "tpot", "e2e"):
        if metric in d:
            d[metric] = latency_from_json(d[metric], f"{what}.{metric}")
    return _build(TierWindow, d, what)


def telemetry_from_json(data: object) -> Telemetry:
    """The window :func:`to_json` wrote (a controller's status history entry's ``telemetry``). ValueError
    naming the field that does not fit."""
    d = _fields(data, Telemetry, "telemetry")
    for metric in ("ttft", "tpot", "e2e"):
        if metric in d:
            d[metric] = latency_from_json(d[metric], f"telemetry.{metric}")
    for name in ("plain_steps", "speculative_steps"):
        if name in d:
            d[name] = step_totals_from_json(d[name], f"telemetry.{name}")
    if "queue_depth_per_replica" in d:
        d["queue_depth_per_replica"] = tuple(d["queue_depth_per_replica"])
    tiers = d.get("tiers", {})
    if not isinstance(tiers, Mapping):
        raise ValueError(f"telemetry.tiers: expected an object, got {type(tiers).__name__}")
    d["tiers"] = {str(name): tier_window_from_json(w, f"telemetry.tiers.{name}") for name, w in tiers.items()}
    return _build(Telemetry, d, "telemetry")


def _build(cls: type[_W], fields: dict[str, Any], what: str) -> _W:
    try:
        return cls(**fields)
    except TypeError as exc:  # a required field missing
        raise ValueError(f"{what}: {exc}") from None
