"""Service-level objectives, as operators state them, and the objective every policy serves.

Operators never set a raw FSD threshold T. They state, per named tier, latency targets at a percentile,
a quality budget (the largest mean per-token distortion they accept, in the TV units the decoder
reports) and a hard ceiling on T; plus an optional cost target for the whole service. Policies read
this spec; the controller and the simulator validate it at the boundary.

The objective, per tier (:func:`objective_key` orders operating points by it):

1. *attainment* = the fraction of the tier's requests that meet **every** latency target the tier
   states (TTFT and TPOT, and E2E when set — DistServe's definition; rejected or unfinished requests
   miss). The tier asks for attainment >= ``percentile / 100`` (:attr:`TierSLO.attainment_target`);
2. the distortion budget ``max_mean_distortion`` is a hard constraint;
3. among operating points that meet the attainment target within budget: least distortion, then least
   cost (replica-seconds per output token, or $ per 1M tokens — the same order);
4. where none meets it: the most attainment within budget.

Tiers share replicas, so they are coupled; a policy that must spend distortion spends it first in the
tier with the loosest budget (:func:`tiers_by_budget`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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

    @property
    def attainment_target(self) -> float:
        """The share of requests that must meet every latency target: ``percentile / 100``."""
        return self.percentile / 100.0

    @property
    def has_latency_target(self) -> bool:
        """False for a best-effort tier (no TTFT, TPOT or E2E target: every completion counts as met)."""
        return any(t is not None for t in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

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
        """The shipped SLO: lossless, standard and economy tiers sized for the default small pair.

        Every tier states a p95 TTFT and a p95 TPOT target (sized for the hand-made 2-thread SmolLM2
        profile); ``lossless`` is pinned at T = 0 (only its k moves), ``standard`` and ``economy`` have a
        distortion budget and a T ceiling.
        """
        return cls(
            tiers={
                "lossless": TierSLO(fixed_threshold=0.0, max_threshold=0.0, ttft_ms=4000.0, tpot_ms=120.0),
                "standard": TierSLO(
                    ttft_ms=2000.0, tpot_ms=60.0, max_mean_distortion=0.15, max_threshold=1.0
                ),
                "economy": TierSLO(
                    ttft_ms=4000.0, tpot_ms=120.0, max_mean_distortion=0.35, max_threshold=4.0
                ),
            },
            default_tier="standard",
        )


@dataclass(frozen=True, slots=True)
class TierOutcome:
    """What one operating point achieved (or is predicted to achieve) for one tier."""

    attainment: float  # share of the tier's requests that met every latency target, in [0, 1]
    mean_distortion: float  # mean TV distortion per output token
    cost: float = 0.0  # replica-seconds per output token (or any cost in one unit across points)


def meets_objective(tier: TierSLO, outcome: TierOutcome, tolerance: float = 1e-9) -> bool:
    """Attainment target met and distortion within budget (a best-effort tier only needs the budget)."""
    return within_budget(tier, outcome, tolerance) and outcome.attainment >= tier.attainment_target - tolerance


def within_budget(tier: TierSLO, outcome: TierOutcome, tolerance: float = 1e-9) -> bool:
    budget = tier.max_mean_distortion
    return budget is None or outcome.mean_distortion <= budget + tolerance


def objective_key(tier: TierSLO, outcome: TierOutcome, tolerance: float = 1e-9) -> tuple[float, ...]:
    """Sort key, smaller is better, that orders operating points by the objective (module docstring).

    Over-budget points come last (least excess first); then points that meet the attainment target,
    by distortion then cost; then the rest, by attainment (most first), then distortion, then cost.
    """
    budget = tier.max_mean_distortion
    if not within_budget(tier, outcome, tolerance):
        assert budget is not None
        return (2.0, outcome.mean_distortion - budget, -outcome.attainment, outcome.cost)
    if outcome.attainment >= tier.attainment_target - tolerance:
        return (0.0, outcome.mean_distortion, outcome.cost, 0.0)
    return (1.0, -outcome.attainment, outcome.mean_distortion, outcome.cost)


def tiers_by_budget(slo: SLOSpec, names: list[str] | None = None) -> list[str]:
    """Tier names from the loosest distortion budget to the tightest (no budget = loosest; a tier held
    at T = 0 spends nothing, budget 0).

    The loosest budget spends distortion first when tiers compete for shared replicas.
    """
    chosen = list(slo.tiers) if names is None else list(names)

    def looseness(name: str) -> float:
        tier = slo.tiers[name]
        if tier.fixed_threshold == 0.0 or tier.max_threshold == 0.0:
            return 0.0
        return math.inf if tier.max_mean_distortion is None else tier.max_mean_distortion

    return sorted(chosen, key=looseness, reverse=True)
