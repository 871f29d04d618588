"""The baseline: one fixed T (and optionally k) per tier, whatever the load."""

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
    ``draft_lengths`` is one k for every tier, a mapping tier → k (tiers left out keep theirs), or None
    (k is left to the data plane's default). ``batch_cap``: the most requests a replica decodes at once
    (:class:`~policies.decision.Decision`), None for none.
    """

    name = "static"

    def __init__(
        self,
        slo: SLOSpec,
        thresholds: float | Mapping[str, float],
        draft_lengths: int | Mapping[str, int] | None = None,
        batch_cap: int | None = None,
    ) -> None:
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
        if draft_lengths is None:
            ks: dict[str, int] = {}
        elif isinstance(draft_lengths, Mapping):
            ks = {name: int(k) for name, k in draft_lengths.items()}
        else:
            ks = {name: int(draft_lengths) for name in slo.tiers}
        unknown = sorted(set(ks) - set(slo.tiers))
        if unknown:
            raise ValueError(f"draft_lengths: unknown tier(s) {unknown}; known tiers: {sorted(slo.tiers)}")
        for name, k in ks.items():
            if k < 0:
                raise ValueError(f"draft_lengths[{name!r}] must be >= 0, got {k}")
        self._draft_lengths = ks
        if batch_cap is not None and (isinstance(batch_cap, bool) or not isinstance(batch_cap, int) or batch_cap < 1):
            raise ValueError(f"batch_cap must be an integer >= 1, got {batch_cap!r}")
        self.batch_cap = batch_cap
        self.last_decision: Decision | None = None

    def decide(self, telemetry: Telemetry) -> Decision:
        self.last_decision = Decision(
            thresholds=dict(self._thresholds), draft_lengths=dict(self._draft_lengths), batch_cap=self.batch_cap,
            reason="static",
        )
        return self.last_decision

    def reset(self) -> None:
        self.last_decision = None

    def params(self) -> dict[str, Any]:
        return {"thresholds": dict(self._thresholds), "draft_lengths": dict(self._draft_lengths),
                "batch_cap": self.batch_cap}

    def __repr__(self) -> str:
        return (f"StaticPolicy(thresholds={self._thresholds!r}, draft_lengths={self._draft_lengths!r}, "
                f"batch_cap={self.batch_cap!r})")
