"""What a policy returns: T and draft length k per tier, and optionally a batch cap and a replica count."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Decision:
    """``thresholds`` maps tier → T and ``draft_lengths`` tier → k (k >= 0; k = 0 is plain target
    decoding: one target token per step, no draft cost, no distortion). Tiers left out keep their
    current T / k.

    ``batch_cap`` caps the requests each replica decodes at once (its running batch; the rest wait in its
    queue), below the replica's configured ``max_batch_size`` (a larger cap is that size); None: no cap.
    Why a policy caps: a request's TPOT is set by the batch it decodes in, and waiting in the queue costs
    only TTFT; where the TTFT target has room, a cap meets a TPOT target at no distortion. It is not
    sticky, unlike T and k: a decision without one lifts any cap in force.

    ``replicas`` is a suggestion the owner may apply or ignore; ``reason`` is a short human-readable
    explanation logged beside the decision.
    """

    thresholds: Mapping[str, float] = field(default_factory=dict)
    draft_lengths: Mapping[str, int] = field(default_factory=dict)
    replicas: int | None = None
    reason: str = ""
    # Keyword-only: added after the others, so Decision(thresholds, draft_lengths, replicas, reason) keeps its meaning.
    batch_cap: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        for tier, t in self.thresholds.items():
            if not (math.isfinite(t) and t >= 0):
                raise ValueError(f"threshold for tier {tier!r} must be finite and >= 0, got {t}")
        for tier, k in self.draft_lengths.items():
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise ValueError(f"draft length for tier {tier!r} must be an int >= 0, got {k!r}")
        if self.batch_cap is not None and (isinstance(self.batch_cap, bool) or not isinstance(self.batch_cap, int)
                                           or self.batch_cap < 1):
            raise ValueError(f"batch_cap must be an int >= 1 or None, got {self.batch_cap!r}")
        if self.replicas is not None and self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")

    @property
    def draft_length(self) -> int | None:
        """Transitional, for a data plane with one k per replica: the largest k > 0 asked for (None
        when no tier asks for one). Per-row k (``draft_lengths``) supersedes it."""
        ks = [k for k in self.draft_lengths.values() if k > 0]
        return max(ks) if ks else None


def decision_draft_lengths(decision: Decision) -> dict[str, int] | None:
    """k per tier the decision asks for: ``Decision.draft_lengths`` where the policies have it, else the
    single ``draft_length`` for every tier (``"*"``), else None (keep k)."""
    per_tier = getattr(decision, "draft_lengths", None)
    if per_tier:
        return {str(name): int(k) for name, k in per_tier.items()}
    return None if decision.draft_length is None else {"*": int(decision.draft_length)}


def decision_to_json(decision: Decision | None) -> dict[str, Any] | None:
    """The decision as the controller's status and history show it (what a replay compares against)."""
    if decision is None:
        return None
    return {"thresholds": dict(decision.thresholds), "draft_length": decision.draft_length,
            "draft_lengths": decision_draft_lengths(decision), "batch_cap": getattr(decision, "batch_cap", None),
            "replicas": decision.replicas, "reason": decision.reason}
