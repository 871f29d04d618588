"""Request-level metrics, window telemetry and the run summary.

Notation, for request r with n_r output tokens:
    a_r  arrival time            s_r  admission into a batch (prefill starts)
    f_r  first token emitted     c_r  completion (last token emitted)
    TTFT_r = f_r − a_r           queue wait W_q,r = s_r − a_r
    TPOT_r = (c_r − f_r) / (n_r − 1)   (defined for n_r > 1; a one-token request meets any TPOT target)
    E2E_r  = c_r − a_r
    D_r    = Σ per-token TV distortion of r's emitted tokens (prefill and target-sampled tokens add 0)

A request *meets its SLO* when it completed and every latency target its tier sets holds for it
(TTFT and TPOT and E2E where set: DistServe's attainment). Rejected or unfinished requests are misses.
A tier *meets its objective* (policies.slo) when its attainment is at least ``percentile / 100`` and
its mean distortion is within its budget. Over a run of duration τ (first to last arrival window):
    slo_attainment = #met / #arrivals (per tier and overall)    goodput_rps = #met / τ
    mean_distortion = Σ_r D_r / Σ_r n_r (per emitted token)
    cost_per_1k_tokens = replica_seconds / (Σ output tokens / 1000)
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from policies.slo import SLOSpec, TierOutcome, meets_objective, within_budget
from policies.telemetry import LatencySummary, TierWindow
from sim.entities import RequestTable

_QUANTILES = [50.0 / 100.0, 90.0 / 100.0, 95.0 / 100.0, 99.0 / 100.0]


def fast_summary(samples_ms: np.ndarray) -> LatencySummary:
    """Same numbers as ``LatencySummary.from_samples`` (numpy's 'linear' percentiles), ~20x cheaper:
    one sort and an interpolation, which matters at one summary per tier per metric per tick. The
    interpolation is in Python floats (a few dozen samples: cheaper than numpy calls), the same IEEE
    operations numpy's elementwise ones are."""
    if samples_ms.size == 0:
        return LatencySummary()
    return _sorted_summary(np.sort(samples_ms).tolist())


def _sorted_summary(s: list[float]) -> LatencySummary:
    """:func:`fast_summary` of samples already sorted (non-empty)."""
    n = len(s)
    last = n - 1
    v = []
    for q in _QUANTILES:
        pos = q * last
        lo = math.floor(pos)
        hi = min(lo + 1, last)
        v.append(s[lo] + (s[hi] - s[lo]) * (pos - lo))
    return LatencySummary(int(n), v[0], v[1], v[2], v[3])


def latencies_ms(table: RequestTable, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TTFT, TPOT (NaN where n_r = 1) and E2E in ms for completed requests ``ids``."""
    a = table.arrival_s[ids]
    f = table.first_token_s[ids]
    c = table.completion_s[ids]
    n = table.output_tokens[ids]
    ttft = (f - a) * 1000.0
    tpot = (c - f) * 1000.0 / np.maximum(n - 1, 1)  # divisor >= 1: no division warnings
    tpot[n <= 1] = np.nan
    e2e = (c - a) * 1000.0
    return ttft, tpot, e2e


Latencies = tuple[np.ndarray, np.ndarray, np.ndarray]


def slo_met(table: RequestTable, ids: np.ndarray, slo: SLOSpec, latencies: Latencies | None = None) -> np.ndarray:
    """Per completed request in ``ids``: did it meet every latency target of its tier?

    ``latencies``: ``latencies_ms(table, ids)`` when the caller has it already.
    """
    ttft, tpot, e2e = latencies if latencies is not None else latencies_ms(table, ids)
    tiers = table.tier[ids]
    met = np.ones(ids.size, dtype=bool)
    for i, name in enumerate(table.tier_names):
        spec = slo.tiers[name]
        sel = tiers == i
        if not sel.any():
            continue
        ok = np.ones(int(sel.sum()), dtype=bool)
        if spec.ttft_ms is not None:
            ok &= ttft[sel] <= spec.ttft_ms
        if spec.tpot_ms is not None:
            t = tpot[sel]
            ok &= np.isnan(t) | (t <= spec.tpot_ms)
        if spec.e2e_ms is not None:
            ok &= e2e[sel] <= spec.e2e_ms
        met[sel] = ok
    return met


def _tier_window(threshold: float, tokens: float, distortion: float, k: int | None, seq_iters: int,
                 completions: int = 0, slo_met: int = 0,
                 summaries: tuple[LatencySummary, LatencySummary, LatencySummary] | None = None) -> TierWindow:
    """One tier's slice of a window: its counters, and its completions' (TTFT, TPOT, E2E) summaries when it has
    completions (``summaries``)."""
    mean_distortion = float(distortion / tokens) if tokens > 0 else 0.0
    if summaries is None:
        return TierWindow(threshold=threshold, mean_distortion=mean_distortion, output_tokens=int(tokens),
                          draft_length=k, sequence_iterations=seq_iters)
    ttft, tpot, e2e = summaries
    return TierWindow(threshold=threshold, completions=completions, slo_met=slo_met, ttft=ttft, tpot=tpot, e2e=e2e,
                      mean_distortion=mean_distortion, output_tokens=int(round(tokens)), draft_length=k,
                      sequence_iterations=seq_iters)


def window_summaries(
    table: RequestTable,
    done: list[int],
    slo: SLOSpec,
    thresholds: dict[str, float],
    tier_tokens: np.ndarray,
    tier_distortion: np.ndarray,
    tier_seq_iters: np.ndarray,
    draft_lengths: dict[str, int],
) -> tuple[tuple[LatencySummary, LatencySummary, LatencySummary], dict[str, TierWindow], int] | None:
    """What a control tick needs of its window's completions ``done`` (ids in ascending order): the
    overall (TTFT, TPOT, E2E) summaries, :func:`tier_windows`' per-tier windows and the number that met
    their SLO, in Python floats per request (a window holds a few dozen: cheaper than ~40 numpy calls,
    and the same IEEE operations as :func:`latencies_ms`, :func:`slo_met` and :func:`fast_summary`).
    None when a latency is NaN (sorting NaN is numpy's business: use the array functions)."""
    arrival, first, completion = table.arrival_list, table.first_token_s, table.completion_s
    output, tier_of = table.output_list, table.tier_list
    specs = [slo.tiers[name] for name in table.tier_names]
    n_t = len(specs)
    ttft_by: list[list[float]] = [[] for _ in range(n_t)]
    tpot_by: list[list[float]] = [[] for _ in range(n_t)]
    e2e_by: list[list[float]] = [[] for _ in range(n_t)]
    met_by = [0] * n_t
    nan = math.nan
    for rid in done:
        a, f, c, n = arrival[rid], float(first[rid]), float(completion[rid]), output[rid]
        ttft = (f - a) * 1000.0
        tpot = (c - f) * 1000.0 / max(n - 1, 1) if n > 1 else nan
        e2e = (c - a) * 1000.0
        if ttft != ttft or e2e != e2e:
            return None
        i = tier_of[rid]
        spec = specs[i]
        ok = ((spec.ttft_ms is None or ttft <= spec.ttft_ms)
              and (spec.tpot_ms is None or tpot != tpot or tpot <= spec.tpot_ms)
              and (spec.e2e_ms is None or e2e <= spec.e2e_ms))
        met_by[i] += ok
        ttft_by[i].append(ttft)
        e2e_by[i].append(e2e)
        if tpot == tpot:
            tpot_by[i].append(tpot)

    def summary(samples: list[float]) -> LatencySummary:
        return _sorted_summary(sorted(samples)) if samples else LatencySummary()

    total = len(done)
    overall = (summary([x for t in ttft_by for x in t]), summary([x for t in tpot_by for x in t]),
               summary([x for t in e2e_by for x in t]))
    out: dict[str, TierWindow] = {}
    for i, name in enumerate(table.tier_names):
        tokens = float(tier_tokens[i])
        seq_iters = int(round(float(tier_seq_iters[i])))
        k = draft_lengths.get(name)
        n_sel = len(ttft_by[i])
        if not n_sel:
            out[name] = _tier_window(thresholds[name], tokens, tier_distortion[i], k, seq_iters)
            continue
        if n_sel == total:
            summaries = overall  # the tier has every completion of the window
        else:
            summaries = summary(ttft_by[i]), summary(tpot_by[i]), summary(e2e_by[i])
        out[name] = _tier_window(thresholds[name], tokens, tier_distortion[i], k, seq_iters, n_sel, met_by[i],
                                 summaries)
    return overall, out, sum(met_by)


def tier_windows(
    table: RequestTable,
    completed_ids: np.ndarray,
    slo: SLOSpec,
    thresholds: dict[str, float],
    tier_tokens: np.ndarray,
    tier_distortion: np.ndarray,
    latencies: Latencies | None = None,
    overall: tuple[LatencySummary, LatencySummary, LatencySummary] | None = None,
    tier_seq_iters: np.ndarray | None = None,
    draft_lengths: dict[str, int] | None = None,
) -> tuple[dict[str, TierWindow], np.ndarray]:
    """Per-tier window slices for the completions of one window, and the per-request met mask.

    ``latencies``: ``latencies_ms(table, completed_ids)`` when the caller has it already;
    ``overall``: the (TTFT, TPOT, E2E) summaries of all of them, reused for a tier that has them all.
    """
    if latencies is None:
        latencies = latencies_ms(table, completed_ids)
    met = slo_met(table, completed_ids, slo, latencies)
    ttft, tpot, e2e = latencies
    tiers = table.tier[completed_ids]
    out: dict[str, TierWindow] = {}
    for i, name in enumerate(table.tier_names):
        tokens = float(tier_tokens[i])
        seq_iters = int(round(float(tier_seq_iters[i]))) if tier_seq_iters is not None else 0
        k = draft_lengths.get(name) if draft_lengths is not None else None
        if not completed_ids.size or not (sel := tiers == i).any():
            out[name] = _tier_window(thresholds[name], tokens, tier_distortion[i], k, seq_iters)
            continue
        n_sel = int(sel.sum())
        if overall is not None and n_sel == completed_ids.size:
            summaries = overall  # the tier has every completion of the window
        else:
            tpot_sel = tpot[sel]
            summaries = fast_summary(ttft[sel]), fast_summary(tpot_sel[~np.isnan(tpot_sel)]), fast_summary(e2e[sel])
        out[name] = _tier_window(thresholds[name], tokens, tier_distortion[i], k, seq_iters, n_sel,
                                 int(met[sel].sum()), summaries)
    return out, met


def _pct(x: np.ndarray) -> dict[str, float | None]:
    x = x[~np.isnan(x)]
    if x.size == 0:
        return {"p50": None, "p95": None, "p99": None, "mean": None}
    p50, p95, p99 = np.percentile(x, [50, 95, 99])
    return {"p50": round(float(p50), 3), "p95": round(float(p95), 3), "p99": round(float(p99), 3),
            "mean": round(float(x.mean()), 3)}


def summarize(
    table: RequestTable,
    slo: SLOSpec,
    duration_s: float,
    replica_seconds: float,
    replica_usd_per_hour: float | None,
) -> dict[str, Any]:
    """The run summary (see the module docstring for definitions)."""
    done = np.nonzero(table.completed)[0]
    n = table.n
    ttft, tpot, e2e = latencies = latencies_ms(table, done)
    met = slo_met(table, done, slo, latencies)
    wait = (table.start_s[done] - table.arrival_s[done]) * 1000.0
    out_tokens = int(table.emitted.sum())
    rejected = int(table.rejected.sum())
    unfinished = n - int(done.size) - rejected
    total_distortion = float(table.distortion_sum.sum())
    per_tier: dict[str, Any] = {}
    tiers_done = table.tier[done]
    for i, name in enumerate(table.tier_names):
        arrivals_i = int((table.tier == i).sum())
        if arrivals_i == 0:
            continue
        sel = tiers_done == i
        tok = int(table.emitted[table.tier == i].sum())
        attained = float(met[sel].sum()) / arrivals_i
        distortion = float(table.distortion_sum[table.tier == i].sum()) / tok if tok else 0.0
        spec = slo.tiers[name]
        outcome = TierOutcome(attainment=attained, mean_distortion=distortion)
        per_tier[name] = {
            "arrivals": arrivals_i,
            "completed": int(sel.sum()),
            "slo_attainment": round(attained, 5),
            "attainment_target": spec.attainment_target,
            "within_budget": within_budget(spec, outcome),
            "meets_objective": meets_objective(spec, outcome),
            "tpot_ms": _pct(tpot[sel]),
            "ttft_ms": _pct(ttft[sel]),
            "mean_distortion": round(distortion, 5),
        }
    cost_per_1k = replica_seconds / (out_tokens / 1000.0) if out_tokens else math.nan
    summary: dict[str, Any] = {
        "requests": n,
        "completed": int(done.size),
        "rejected": rejected,
        "unfinished": unfinished,
        "slo_attainment": round(float(met.sum()) / n, 5) if n else math.nan,
        "goodput_rps": round(float(met.sum()) / duration_s, 5) if duration_s > 0 else math.nan,
        "throughput_rps": round(done.size / duration_s, 5) if duration_s > 0 else math.nan,
        "output_tokens": out_tokens,
        "ttft_ms": _pct(ttft),
        "tpot_ms": _pct(tpot),
        "e2e_ms": _pct(e2e),
        "queue_wait_ms": _pct(wait),
        "mean_distortion": round(total_distortion / out_tokens, 6) if out_tokens else 0.0,
        "replica_seconds": round(replica_seconds, 3),
        "cost_per_1k_tokens": {
            "replica_seconds": round(cost_per_1k, 5) if math.isfinite(cost_per_1k) else None,
            "usd": round(cost_per_1k * replica_usd_per_hour / 3600.0, 8)
            if replica_usd_per_hour is not None and math.isfinite(cost_per_1k)
            else None,
        },
        "tiers": per_tier,
    }
    return summary

