"""The baseline: one fixed T per tier, whatever the load."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policies.decision import Decision
from policies.slo import SLOSpec
from policies.telemetry import Telemetry
from policies.tiers import clamp_thresholds, controllable_tiers


class StaticPolicy:
    """Always the same thresholds.

    ``thresholds`` is either one T applied to every controllable tier, or a mapping tier → T (tiers
    left out get their ``min_threshold``). Every T is clamped into its tier's bounds and pinned tiers
    keep their pin, so ``StaticPolicy(slo, 0.0)`` is standard speculative decoding everywhere.
    """

    name = "static"

    def __init__(self, slo: SLOSpec, thresholds: float | Mapping[str, float]) -> None:
        self.slo = slo
        if isinstance(thresholds, Mapping):
            requested = {name: float(t) for name, t in thresholds.items()}
        else:
            requested = {name: float(thresholds) for name in controllable_tiers(slo)}
        for name in controllable_tiers(slo):
            requested.setdefault(name, slo.tiers[name].min_threshold)
        for name, t in requested.items():
            if not t >= 0:  # also rejects NaN
                raise ValueError(f"thresholds[{name!r}] must be >= 0, got {t}")
        self.requested = requested
        try:
            self._thresholds = clamp_thresholds(slo, requested)
        except ValueError as exc:
            raise ValueError(f"thresholds: {exc}") from None
        self.last_decision: Decision | None = None

    def decide(self, telemetry: Telemetry) -> Decision:
        self.last_decision = Decision(thresholds=dict(self._thresholds), reason="static")
        return self.last_decision

    def reset(self) -> None:
        self.last_decision = None

    def params(self) -> dict[str, Any]:
        return {"thresholds": dict(self._thresholds)}

    def __repr__(self) -> str:
        return f"StaticPolicy(thresholds={self._thresholds!r})"
