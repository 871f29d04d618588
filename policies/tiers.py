"""Tier helpers every policy shares: which tiers a policy may move, and the tier's T range.

Policies reason on a *fraction of the tier's range*, ``u ∈ [0, 1]`` with
``T = min_threshold + u · (max_threshold − min_threshold)``, so that one set of gains and rate limits
means the same thing for a tier capped at T = 1 and one capped at T = 4.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from policies.slo import SLOSpec, TierSLO


def controllable_tiers(slo: SLOSpec) -> list[str]:
    """Names of the tiers whose T a policy may move: not pinned and with a non-empty range."""
    return [
        name
        for name, tier in slo.tiers.items()
        if tier.fixed_threshold is None and tier.max_threshold > tier.min_threshold
    ]


def tier_range(tier: TierSLO) -> float:
    """Width of the tier's T range (0 for a pinned tier)."""
    if tier.fixed_threshold is not None:
        return 0.0
    return tier.max_threshold - tier.min_threshold


def threshold_from_fraction(tier: TierSLO, fraction: float) -> float:
    """T at ``fraction`` of the tier's range, clamped into the tier's bounds."""
    return tier.clamp(tier.min_threshold + fraction * tier_range(tier))


def fraction_from_threshold(tier: TierSLO, threshold: float) -> float:
    """Where ``threshold`` sits in the tier's range, in [0, 1] (0 for a pinned tier)."""
    width = tier_range(tier)
    if width <= 0:
        return 0.0
    return min(max((threshold - tier.min_threshold) / width, 0.0), 1.0)


def pinned_thresholds(slo: SLOSpec) -> dict[str, float]:
    """The fixed T of every pinned tier (and of zero-width tiers, whose T has only one value)."""
    out: dict[str, float] = {}
    for name, tier in slo.tiers.items():
        if tier.fixed_threshold is not None:
            out[name] = tier.fixed_threshold
        elif tier.max_threshold <= tier.min_threshold:
            out[name] = tier.min_threshold
    return out


def safe_thresholds(slo: SLOSpec) -> dict[str, float]:
    """The T every tier falls back to when control is lost: its pinned value, else ``safe_threshold``.

    A pinned tier keeps its pin (the operator chose it explicitly); every other tier gets
    ``safe_threshold`` clamped into its bounds (0 = lossless by default).
    """
    return {name: tier.clamp(tier.safe_threshold) for name, tier in slo.tiers.items()}


def clamp_thresholds(slo: SLOSpec, thresholds: Mapping[str, float]) -> dict[str, float]:
    """``thresholds`` clamped per tier, with every pinned tier set to its pin.

    Unknown tier names raise ValueError naming them, so a typo in a config never silently drops a tier.
    """
    unknown = sorted(set(thresholds) - set(slo.tiers))
    if unknown:
        raise ValueError(f"unknown tier(s) {unknown}; known tiers: {sorted(slo.tiers)}")
    out = {name: slo.tiers[name].clamp(t) for name, t in thresholds.items()}
    out.update(pinned_thresholds(slo))
    return out


def resolve_tiers(slo: SLOSpec, tiers: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """Validate the tiers a policy is asked to control (None ⇒ every controllable tier)."""
    if tiers is None:
        return controllable_tiers(slo)
    names = [tiers] if isinstance(tiers, str) else list(tiers)
    if not names:
        raise ValueError("tiers: at least one tier is required")
    for name in names:
        tier = slo.tier(name)  # ValueError naming unknown tiers
        if tier.fixed_threshold is not None:
            raise ValueError(
                f"tier {name!r} is pinned (fixed_threshold={tier.fixed_threshold}); "
                "a policy cannot control it"
            )
    return names


def apply_decision(slo: SLOSpec, current: Mapping[str, float], proposed: Mapping[str, float]) -> dict[str, float]:
    """The one place a decision becomes the T per tier that runs: ``current`` (every tier; missing
    tiers start at their safe T) updated with ``proposed``, clamped into each tier's bounds, pins
    enforced. The live controller and the simulator both call this; nothing else clamps a decision.
    Unknown tier names in ``proposed`` raise ValueError naming them."""
    out = safe_thresholds(slo)
    out.update({name: t for name, t in current.items() if name in slo.tiers})
    out.update(proposed)
    return clamp_thresholds(slo, out)


def request_threshold(
    slo: SLOSpec, tier_name: str, tier_thresholds: Mapping[str, float], override: float | None
) -> float:
    """T one request runs at: its own ``override`` (which must lie within the tier's bounds — a request
    may pick its T, not leave the tier's range), else the tier's current T. ValueError naming the
    offending value for an unknown tier or an override that is not finite or out of bounds."""
    tier = slo.tier(tier_name)  # ValueError naming an unknown tier
    if override is None:
        return tier.clamp(float(tier_thresholds.get(tier_name, tier.safe_threshold)))
    threshold = float(override)
    if not math.isfinite(threshold):
        raise ValueError(f"threshold must be finite, got {threshold}")
    low, high = (
        (tier.fixed_threshold, tier.fixed_threshold)
        if tier.fixed_threshold is not None
        else (tier.min_threshold, tier.max_threshold)
    )
    if not low <= threshold <= high:
        raise ValueError(f"threshold {threshold} outside tier {tier_name!r} bounds [{low}, {high}]")
    return threshold


def seed_policy(policy: object, slo: SLOSpec, thresholds: Mapping[str, float]) -> list[str]:
    """Start a fresh policy's state at the T the replicas run (bumpless restart); the tiers seeded.

    Walks the wrapper chain (``.inner``). A PID-style policy exposes ``controllers`` (tier → PID):
    each PID's output and integral restart at the fraction of the tier's range the tier runs at.
    Wrappers need nothing: with no memory of their own they read the running T from the telemetry.
    Policies without such state (static, feed-forward, bandits) are left as they are.
    """
    seeded: list[str] = []
    node: Any = policy
    while node is not None:
        controllers = getattr(node, "controllers", None)
        if isinstance(controllers, Mapping):
            for name, pid in controllers.items():
                if name in thresholds and name in slo.tiers and hasattr(pid, "initial_output"):
                    pid.initial_output = fraction_from_threshold(slo.tiers[name], float(thresholds[name]))
                    pid.reset()
                    seeded.append(str(name))
        node = getattr(node, "inner", None)
    return seeded
