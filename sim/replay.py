"""Replay a recorded trace against candidate policies: "would policy B have met our SLO on this traffic?"

A recorded trace (:mod:`sim.trace` with the optional ``Tier``/``MaxTokens``/``Status`` columns, written by
the service's traffic recorder) becomes :class:`sim.workload.Requests` with the recorded arrivals, token
counts and tiers exactly — no sampling, clipping or time scaling — so every candidate sees the same
traffic. Each candidate runs in its own :class:`sim.simulator.Simulator` (same seed, same cluster) and
gets a per-tier verdict against the SLO: attainment at least the tier's percentile, mean distortion
within the tier's budget.

Rows the recording could not measure are filled in and reported in the notes: a ``rejected`` row (refused
before a replica tokenized it; likewise an ``error`` row with 0 prompt tokens) gets the median prompt and
output length of its tier's finished rows;
a ``cut`` or ``error`` row keeps the tokens it produced before it ended (a lower bound), at least one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from policies.base import Policy
from policies.slo import SLOSpec
from sim.profile import Profile
from sim.simulator import SimConfig, SimResult, Simulator
from sim.trace import Trace
from sim.workload import Requests, trace_tier_index


def requests_from_trace(trace: Trace, slo: SLOSpec) -> Requests:
    """The trace's requests as simulator columns: arrivals and token counts as recorded."""
    tier_names = list(slo.tiers)
    n = len(trace)
    tiers = trace.tier if trace.tier is not None else (None,) * n
    index = trace_tier_index(tiers, tier_names, slo.default_tier)
    prompt = trace.prompt_tokens.copy()
    output = trace.output_tokens.copy()
    notes = [f"recorded trace {trace.source}: {n} requests over {float(trace.arrival_s[-1]):.1f} s, replayed as "
             f"recorded (arrivals, token counts, tiers)"]
    if trace.status is not None:
        status = np.asarray(trace.status)
        # Never reached a replica: refused for overload, or failed before the start (0 prompt tokens).
        rejected = (status == "rejected") | ((status == "error") & (trace.prompt_tokens == 0))
        finished = (status == "stop") | (status == "length")
        if rejected.any():
            for i in range(len(tier_names)):
                sel = rejected & (index == i)
                if not sel.any():
                    continue
                known = finished & (index == i)
                if not known.any():
                    known = finished
                prompt[sel] = int(np.median(trace.prompt_tokens[known])) if known.any() else 1
                output[sel] = int(np.median(trace.output_tokens[known])) if known.any() else 1
            notes.append(f"{int(rejected.sum())} requests rejected live (before a replica; lengths unknown) given "
                         f"their tier's median recorded lengths")
        short = int((((status == "cut") | (status == "error")) & ~rejected).sum())
        if short:
            notes.append(f"{short} requests cut or failed live replay the tokens they produced (a lower bound)")
    zero = int((output < 1).sum())
    if zero:
        notes.append(f"{zero} requests with 0 generated tokens given 1 output token")
        output = np.maximum(output, 1)
    prompt = np.maximum(prompt, 1)
    return Requests(trace.arrival_s.copy(), prompt, output, index, tuple(tier_names), notes, None)


@dataclass(frozen=True, slots=True)
class TierVerdict:
    """One tier of one replay against its SLO (targets None when the tier sets none)."""

    tier: str
    arrivals: int
    attainment: float
    attainment_target: float  # the tier's percentile / 100
    mean_distortion: float
    distortion_budget: float | None

    @property
    def attainment_ok(self) -> bool:
        return self.attainment >= self.attainment_target

    @property
    def distortion_ok(self) -> bool:
        return self.distortion_budget is None or self.mean_distortion <= self.distortion_budget

    @property
    def meets(self) -> bool:
        return self.attainment_ok and self.distortion_ok

    def as_dict(self) -> dict[str, Any]:
        return {"arrivals": self.arrivals, "slo_attainment": self.attainment,
                "attainment_target": self.attainment_target, "mean_distortion": self.mean_distortion,
                "distortion_budget": self.distortion_budget, "attainment_ok": self.attainment_ok,
                "distortion_ok": self.distortion_ok, "meets_slo": self.meets}


def tier_verdicts(summary: Mapping[str, Any], slo: SLOSpec) -> dict[str, TierVerdict]:
    """Per tier with traffic in ``summary`` (a :class:`SimResult` summary): the SLO criterion."""
    out = {}
    for name, stats in summary.get("tiers", {}).items():
        tier = slo.tiers[name]
        attainment = stats["slo_attainment"]
        out[name] = TierVerdict(
            tier=name,
            arrivals=int(stats["arrivals"]),
            attainment=float(attainment) if attainment is not None else math.nan,
            attainment_target=tier.percentile / 100.0,
            mean_distortion=float(stats["mean_distortion"]),
            distortion_budget=tier.max_mean_distortion,
        )
    return out


@dataclass
class ReplayRun:
    """One candidate on the replayed trace."""

    name: str
    result: SimResult
    verdicts: dict[str, TierVerdict]
    baseline: bool = False

    @property
    def meets_slo(self) -> bool:
        return all(v.meets for v in self.verdicts.values())


@dataclass
class Replay:
    """Every candidate on the same requests, cluster and seed; the first run is the baseline."""

    runs: list[ReplayRun] = field(default_factory=list)

    @property
    def baseline(self) -> ReplayRun:
        return self.runs[0]


def replay(requests: Requests, slo: SLOSpec, profile: Profile, config: SimConfig,
           policies: Mapping[str, Policy], baseline: str | None = None) -> Replay:
    """Run every policy on ``requests``; ``baseline`` (default: the first) is listed first."""
    if not policies:
        raise ValueError("replay: give at least one policy")
    names = list(policies)
    if baseline is not None:
        if baseline not in policies:
            raise ValueError(f"replay: baseline {baseline!r} is not one of the policies {names}")
        names.remove(baseline)
        names.insert(0, baseline)
    out = Replay()
    for i, name in enumerate(names):
        result = Simulator(config, profile, slo, requests, policies[name]).run()
        result.meta["workload"] = "recorded trace"
        out.runs.append(ReplayRun(name, result, tier_verdicts(result.summary, slo), baseline=i == 0))
    return out
