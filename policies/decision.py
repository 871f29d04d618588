"""What a policy returns: thresholds per tier, and optionally a draft length and a replica count."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Decision:
    """``thresholds`` maps tier name → T. Tiers left out keep their current T.

    ``draft_length`` (k) and ``replicas`` are suggestions the owner may apply or ignore; ``reason``
    is a short human-readable explanation logged beside the decision.
    """

    thresholds: Mapping[str, float] = field(default_factory=dict)
    draft_length: int | None = None
    replicas: int | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        for tier, t in self.thresholds.items():
            if not (math.isfinite(t) and t >= 0):
                raise ValueError(f"threshold for tier {tier!r} must be finite and >= 0, got {t}")
        if self.draft_length is not None and self.draft_length < 1:
            raise ValueError(f"draft_length must be >= 1, got {self.draft_length}")
        if self.replicas is not None and self.replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {self.replicas}")
