"""What the ingress sends a replica, and the chunks a replica streams back.

Chunks are plain dicts (cheap to ship through Ray) with a ``type``:

* ``error`` — first and only chunk of a rejected request: ``status`` (the HTTP status the ingress
  returns), ``message``, ``param`` (the offending field, OpenAI style) and ``code``;
* ``start`` — the request joined the replica: ``prompt_tokens``, ``tier``, ``threshold``;
* ``delta`` — new output text;
* ``end`` — ``finish_reason`` (``stop`` | ``length`` | ``abort`` | ``error``), the last ``text``, and for
  successful requests ``usage`` and ``fsd`` (see :func:`fsd_summary`).
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class RequestError(Exception):
    """A request the service refuses, with the HTTP status and the field to blame."""

    def __init__(self, status: int, message: str, param: str | None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def chunk(self) -> dict[str, Any]:
        return {"type": "error", "status": self.status, "message": self.message, "param": self.param,
                "code": self.code}


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
) -> dict[str, Any]:
    """The ``fsd`` object of a response.

    ``acceptance_rate`` = accepted / drafted draft tokens; ``mean_accepted_length`` = output tokens per
    engine iteration (accepted drafts plus the target's own token, the usual speculative-decoding τ);
    ``distortion`` = summed per-token TV distortion, ``mean_distortion`` = per output token.
    """
    return {
        "tier": tier,
        "threshold": threshold,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "fuzzy_accepted_tokens": fuzzy_accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_length": output_tokens / iterations if iterations else None,
        "distortion": distortion,
        "mean_distortion": distortion / output_tokens if output_tokens else 0.0,
        "replica_id": replica_id,
    }


def finite_or_none(x: float | None) -> float | None:
    """JSON has no NaN: map non-finite numbers to null."""
    if x is None or not math.isfinite(x):
        return None
    return x
