"""Service-level objectives, as operators state them.

Operators never set a raw FSD threshold T. They state, per named tier, latency targets at a percentile,
a quality budget (the largest mean per-token distortion they accept, in the TV units the decoder
reports) and a hard ceiling on T; plus an optional cost target for the whole service. Policies read
this spec; the controller and the simulator validate it at the boundary.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: Percentiles every latency summary carries (see :class:`policies.telemetry.LatencySummary`).
SUPPORTED_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 95.0, 99.0)

LatencyMetric = Literal["ttft", "tpot", "e2e"]


class TierSLO(BaseModel):
    """Targets for one tier. Every latency target is optional; a tier with none is best-effort."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    percentile: float = Field(95.0, description="percentile the latency targets apply to")
    ttft_ms: float | None = Field(None, gt=0, description="time to first token target, ms")
    tpot_ms: float | None = Field(None, gt=0, description="time per output token target, ms")
    e2e_ms: float | None = Field(None, gt=0, description="end-to-end latency target, ms")
    max_mean_distortion: float | None = Field(
        None, ge=0, description="quality budget: max mean per-token TV distortion"
    )
    max_threshold: float = Field(1.0, ge=0, description="hard ceiling on the FSD threshold T")
    min_threshold: float = Field(0.0, ge=0, description="floor on T (0 = lossless allowed)")
    fixed_threshold: float | None = Field(
        None, ge=0, description="pin T (e.g. 0.0 for a lossless tier); policies never move it"
    )
    safe_threshold: float = Field(0.0, ge=0, description="T a replica falls back to when control is stale")

    @field_validator("percentile")
    @classmethod
    def _known_percentile(cls, v: float) -> float:
        if v not in SUPPORTED_PERCENTILES:
            raise ValueError(f"percentile must be one of {SUPPORTED_PERCENTILES}, got {v}")
        return v

    @field_validator("max_threshold", "min_threshold", "safe_threshold", "fixed_threshold")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError(f"threshold must be finite, got {v}")
        return v

    @model_validator(mode="after")
    def _bounds_consistent(self) -> TierSLO:
        if self.min_threshold > self.max_threshold:
            raise ValueError(
                f"min_threshold {self.min_threshold} exceeds max_threshold {self.max_threshold}"
            )
        if self.fixed_threshold is not None and not (
            self.min_threshold <= self.fixed_threshold <= self.max_threshold
        ):
            raise ValueError(
                f"fixed_threshold {self.fixed_threshold} outside "
                f"[{self.min_threshold}, {self.max_threshold}]"
            )
        if self.safe_threshold > self.max_threshold:
            raise ValueError(
                f"safe_threshold {self.safe_threshold} exceeds max_threshold {self.max_threshold}"
            )
        return self

    def latency_target(self, metric: LatencyMetric) -> float | None:
        """The target in ms for ``metric`` (None when the tier sets none)."""
        return {"ttft": self.ttft_ms, "tpot": self.tpot_ms, "e2e": self.e2e_ms}[metric]

    def clamp(self, threshold: float) -> float:
        """``threshold`` clamped into this tier's bounds (the fixed value, if pinned)."""
        if self.fixed_threshold is not None:
            return self.fixed_threshold
        if math.isnan(threshold):
            return self.safe_threshold
        return min(max(threshold, self.min_threshold), self.max_threshold)


class CostTarget(BaseModel):
    """A cost target for the service; set at most one of the two forms."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replica_seconds_per_1k_tokens: float | None = Field(None, gt=0)
    usd_per_1m_tokens: float | None = Field(None, gt=0)
    replica_usd_per_hour: float | None = Field(None, gt=0, description="price of one replica")

    @model_validator(mode="after")
    def _one_form(self) -> CostTarget:
        if self.usd_per_1m_tokens is not None and self.replica_usd_per_hour is None:
            raise ValueError("usd_per_1m_tokens needs replica_usd_per_hour to convert replica time to $")
        return self

    def replica_seconds_budget_per_1k(self) -> float | None:
        """The target expressed as replica-seconds per 1k output tokens."""
        if self.replica_seconds_per_1k_tokens is not None:
            return self.replica_seconds_per_1k_tokens
        if self.usd_per_1m_tokens is not None and self.replica_usd_per_hour is not None:
            usd_per_1k = self.usd_per_1m_tokens / 1000.0
            return usd_per_1k / self.replica_usd_per_hour * 3600.0
        return None


class SLOSpec(BaseModel):
    """Named tiers with their targets, the default tier, and an optional cost target."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tiers: dict[str, TierSLO]
    default_tier: str = "standard"
    cost: CostTarget | None = None

    @model_validator(mode="after")
    def _default_tier_exists(self) -> SLOSpec:
        if not self.tiers:
            raise ValueError("tiers: at least one tier is required")
        if self.default_tier not in self.tiers:
            raise ValueError(
                f"default_tier {self.default_tier!r} is not one of the tiers {sorted(self.tiers)}"
            )
        return self

    def tier(self, name: str | None) -> TierSLO:
        """The tier called ``name`` (the default tier for None); ValueError names unknown tiers."""
        key = self.default_tier if name is None else name
        try:
            return self.tiers[key]
        except KeyError:
            raise ValueError(f"unknown tier {key!r}; known tiers: {sorted(self.tiers)}") from None

    @classmethod
    def default(cls) -> SLOSpec:
        """The shipped SLO: lossless, standard and economy tiers sized for the default small pair."""
        return cls(
            tiers={
                "lossless": TierSLO(fixed_threshold=0.0, max_threshold=0.0),
                "standard": TierSLO(tpot_ms=60.0, max_mean_distortion=0.15, max_threshold=1.0),
                "economy": TierSLO(tpot_ms=120.0, max_mean_distortion=0.35, max_threshold=4.0),
            },
            default_tier="standard",
        )
