"""What crosses the Ray boundary: ingress → replica requests and chunks, replica ↔ controller reports.

Control plane (see docs/controller.md): every replica pushes a :class:`ReplicaReport` batch to the
controller on its own timer (``FSDController.report``) and applies the :class:`ThresholdPush` in the
controller's :class:`ReportReply`. Reports carry *deltas* numbered per replica incarnation, and stay
with the replica until the controller acknowledges their sequence number, so a report is never lost and
never counted twice.

Chunks are typed dataclasses (:data:`Chunk`), each with a ``type`` tag:

* :class:`ErrorChunk` — first and only chunk of a rejected request: ``status`` (the HTTP status the
  ingress returns), ``message``, ``param`` (the offending field, OpenAI style) and ``code``;
* :class:`StartChunk` — the request joined the replica: ``prompt_tokens``, ``tier``, ``threshold``;
* :class:`DeltaChunk` — new output text;
* :class:`EndChunk` — ``finish_reason`` (``stop`` | ``length`` | ``abort`` | ``error``), the last ``text``,
  and for successful requests ``usage`` and ``fsd`` (see :func:`fsd_summary`).

:func:`chunk_as_dict` gives the JSON-shaped view the ingress renders.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from controller.batching import ReplicaCounters, RequestRecord
from policies.slo import SLOSpec


class RequestError(Exception):
    """A request the service refuses, with the HTTP status and the field to blame."""

    def __init__(self, status: int, message: str, param: str | None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def chunk(self) -> ErrorChunk:
        return ErrorChunk(status=self.status, message=self.message, param=self.param, code=self.code)


@dataclass(frozen=True, slots=True)
class ErrorChunk:
    status: int
    message: str
    param: str | None
    code: str | None
    type: Literal["error"] = "error"


@dataclass(frozen=True, slots=True)
class StartChunk:
    request_id: str
    prompt_tokens: int
    tier: str
    threshold: float  # the T the request starts at (its own, else its tier's)
    replica_id: str
    type: Literal["start"] = "start"


@dataclass(frozen=True, slots=True)
class DeltaChunk:
    text: str
    type: Literal["delta"] = "delta"


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True, slots=True)
class FSDSummary:
    """The ``fsd`` object of a response (see :func:`fsd_summary`)."""

    tier: str
    threshold: float
    drafted_tokens: int
    accepted_tokens: int
    fuzzy_accepted_tokens: int
    acceptance_rate: float | None
    mean_accepted_length: float | None
    distortion: float
    mean_distortion: float
    replica_id: str
    #: The deployment's own share of the latency, in ms, stamped by the engine loop: from the ingress's
    #: arrival stamp (the request's submission to the engine where there is none) to the engine step that
    #: emitted the first token (None: no token) / the request's end. The client's TTFT and E2E less these
    #: are the network, proxy and streaming path (what the simulator's engine model leaves out).
    replica_ttft_ms: float | None = None
    replica_e2e_ms: float | None = None


@dataclass(frozen=True, slots=True)
class EndChunk:
    finish_reason: str
    text: str
    usage: Usage | None = None  # None when finish_reason is "error"
    fsd: FSDSummary | None = None
    error: str | None = None
    type: Literal["end"] = "end"


Chunk = ErrorChunk | StartChunk | DeltaChunk | EndChunk


def chunk_as_dict(chunk: Chunk | dict[str, Any]) -> dict[str, Any]:
    """The JSON-shaped view of a chunk (what the ingress renders); a dict passes through unchanged."""
    if isinstance(chunk, dict):
        return chunk
    out = asdict(chunk)
    if isinstance(chunk, EndChunk) and chunk.finish_reason == "error":
        del out["usage"], out["fsd"]
    return out


class GenerationRequest(BaseModel):
    """One request, already validated for types by the ingress; the replica checks model-dependent
    limits (context, tier bounds, max_tokens limit)."""

    model_config = ConfigDict(extra="forbid")

    request_id: str | None = None
    prompt: str | list[dict[str, Any]]
    chat: bool = True
    max_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    tier: str | None = None
    threshold: float | None = None
    #: Wall-clock time (``time.time()``) the ingress received the request: latency is measured from
    #: here, so time in the ingress and in Serve's queue counts, as users see it.
    arrival_unix: float | None = Field(None, allow_inf_nan=False)


@dataclass(frozen=True, slots=True)
class ThresholdPush:
    """The controller's decision as replicas apply it. ``version`` grows with every change within one
    controller ``epoch`` (a restarted controller is a new epoch); ``decided_unix`` lets a replica measure
    how long the decision took to reach it."""

    epoch: str
    version: int
    thresholds: dict[str, float]
    draft_lengths: dict[str, int]
    slo: SLOSpec
    decided_unix: float
    #: The service is stopping: fail what is in flight with an explicit error and refuse new requests.
    stopping: bool = False
    #: The most requests a replica decodes at once (``Decision.batch_cap``); None: no cap.
    batch_cap: int | None = None


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """What a replica holds right now (not additive: the newest report wins)."""

    replica_id: str
    actor_name: str | None
    node_id: str | None
    pid: int
    pair: str
    uptime_s: float
    queue_depth: int
    in_flight: int
    running: int
    engine_alive: bool
    engine_problem: str | None  # why check_health would fail (hung or repeatedly failing step), else None
    thresholds: dict[str, float]  # effective T per tier (the safe T while in fail-safe)
    controlled_thresholds: dict[str, float]  # the last T the controller pushed
    draft_lengths: dict[str, int]
    epoch: str | None
    version: int
    failsafe: bool
    failsafe_events: int
    last_update_age_s: float | None
    stopping: bool = False
    batch_cap: int | None = None  # the cap in force (None: none; always None in fail-safe)


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """One report: counter deltas and the requests finished since the previous report of this
    ``incarnation`` (one replica process; ``seq`` counts 1, 2, … within it)."""

    incarnation: str
    seq: int
    sent_unix: float
    counters: ReplicaCounters  # deltas, not lifetime totals
    records: tuple[RequestRecord, ...]
    state: ReplicaState
    #: Decision → applied latencies (ms) of the pushes applied since the previous report.
    push_latencies_ms: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class ReportReply:
    """The controller's answer: the highest ``seq`` of this incarnation it has counted, and the decision
    to apply (None until a restarted controller has resumed from what the replicas hold)."""

    acked_seq: int
    push: ThresholdPush | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)


def fsd_summary(
    tier: str,
    threshold: float,
    drafted: int,
    accepted: int,
    fuzzy_accepted: int,
    distortion: float,
    output_tokens: int,
    iterations: int,
    replica_id: str,
    replica_ttft_ms: float | None = None,
    replica_e2e_ms: float | None = None,
) -> FSDSummary:
    """The ``fsd`` object of a response.

    ``acceptance_rate`` = accepted / drafted draft tokens; ``mean_accepted_length`` = output tokens per
    engine iteration (accepted drafts plus the target's own token, the usual speculative-decoding τ);
    ``distortion`` = summed per-token TV distortion, ``mean_distortion`` = per output token.
    """
    return FSDSummary(
        tier=tier,
        threshold=threshold,
        drafted_tokens=drafted,
        accepted_tokens=accepted,
        fuzzy_accepted_tokens=fuzzy_accepted,
        acceptance_rate=accepted / drafted if drafted else None,
        mean_accepted_length=output_tokens / iterations if iterations else None,
        distortion=distortion,
        mean_distortion=distortion / output_tokens if output_tokens else 0.0,
        replica_id=replica_id,
        replica_ttft_ms=replica_ttft_ms,
        replica_e2e_ms=replica_e2e_ms,
    )


def finite_or_none(x: float | None) -> float | None:
    """JSON has no NaN: map non-finite numbers to null."""
    if x is None or not math.isfinite(x):
        return None
    return x


#: Name of the controller deployment replicas report to (``controller.app`` deploys it under this name).
CONTROLLER_DEPLOYMENT = "FSDController"
