"""Per-request TPOT against the batch each request decoded in, from ``benchmarks/load.py`` reports.

A step load's attainment mixes two things: how fast the replica steps at a given batch (the machine,
the hour) and how large the batch grew (the seed's burst). This separates them. For every answered
request of a configuration it takes the request's decoding interval [first token, completion] (arrival
plus TTFT, arrival plus E2E, as the client measured them) and its *mean batch*: the time-average of
the number of the run's requests decoding at once over that interval, itself included — exactly,
as the sum of its overlaps with every request's interval over its own length. Requests are binned by
mean batch rounded to the nearest row; per bin it reports the count, the median and p95 TPOT and the
share meeting the report's TPOT target. Several reports pool (the same configuration's runs, every
round). A request's TPOT also holds the stalls of the prefills that joined its batch, so the bins read
what a request saw, not a bare decode step.

    .venv/bin/python benchmarks/load_batches.py docs/img/load_economy_s2[4-8]_t97_s2*.json --config plain
    .venv/bin/python benchmarks/load_batches.py docs/img/load_economy_s16_t97_s20.json --min-tokens 8

Prints JSON (and writes ``--out`` when given). Deterministic; no model, no Ray.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def decoding_intervals(records: Sequence[dict[str, Any]], min_tokens: int = 2) -> tuple[np.ndarray, np.ndarray,
                                                                                        np.ndarray]:
    """(start_s, end_s, tpot_ms) of the run's answered requests with at least ``min_tokens`` output tokens
    (TPOT needs two): the interval from first token to completion, seconds from the run's start."""
    if min_tokens < 2:
        raise ValueError(f"min_tokens must be >= 2, got {min_tokens} (TPOT needs two tokens)")
    start, end, tpot = [], [], []
    for r in records:
        ttft, e2e, tp = r.get("ttft_ms"), r.get("e2e_ms"), r.get("tpot_ms")
        if r.get("status") not in (None, 200) or ttft is None or e2e is None or tp is None:
            continue
        if int(r.get("output_tokens") or 0) < min_tokens:
            continue
        start.append(float(r["arrival_s"]) + float(ttft) / 1000.0)
        end.append(float(r["arrival_s"]) + float(e2e) / 1000.0)
        tpot.append(float(tp))
    return np.array(start), np.array(end), np.array(tpot)


def mean_batches(start_s: np.ndarray, end_s: np.ndarray) -> np.ndarray:
    """Each interval's time-averaged count of intervals open at once (itself included): Σ_j |i ∩ j| / |i|.
    A zero-length interval counts the intervals open at its instant."""
    if start_s.shape != end_s.shape:
        raise ValueError(f"start_s and end_s differ in shape: {start_s.shape} vs {end_s.shape}")
    if np.any(end_s < start_s):
        raise ValueError("an interval ends before it starts")
    length = end_s - start_s
    overlap = np.minimum(end_s[:, None], end_s[None, :]) - np.maximum(start_s[:, None], start_s[None, :])
    total = np.clip(overlap, 0.0, None).sum(axis=1)
    open_at = ((start_s[None, :] <= start_s[:, None]) & (end_s[None, :] >= start_s[:, None])).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(np.where(length > 0, total / np.where(length > 0, length, 1.0), open_at), dtype=float)


def by_batch(batches: np.ndarray, tpot_ms: np.ndarray, target_ms: float | None) -> list[dict[str, Any]]:
    """Requests binned by mean batch (nearest row): count, median and p95 TPOT, share meeting ``target_ms``."""
    rows = np.maximum(np.rint(batches).astype(int), 1)
    out = []
    for b in sorted(set(rows.tolist())):
        sel = tpot_ms[rows == b]
        entry: dict[str, Any] = {"batch": b, "requests": int(sel.size),
                                 "tpot_p50_ms": round(float(np.median(sel)), 1),
                                 "tpot_p95_ms": round(float(np.percentile(sel, 95)), 1)}
        if target_ms is not None:
            entry["meeting_target"] = round(float(np.mean(sel <= target_ms)), 3)
        out.append(entry)
    return out


def analyse(reports: Iterable[dict[str, Any]], config: str | None = None, min_tokens: int = 2) -> dict[str, Any]:
    """Every configuration (or ``config`` alone) pooled over the reports' runs: its requests by mean batch."""
    pooled: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    targets: set[float] = set()
    for report in reports:
        for c in report.get("configs", []):
            if c.get("tpot_target_ms") is not None:
                targets.add(float(c["tpot_target_ms"]))
        for run in report.get("runs", []):
            if config is not None and run["name"] != config:
                continue
            start, end, tpot = decoding_intervals(run["records"], min_tokens)
            if tpot.size == 0:
                continue
            batches, tpots = pooled.setdefault(run["name"], ([], []))
            batches.append(mean_batches(start, end))
            tpots.append(tpot)
    if config is not None and config not in pooled:
        raise ValueError(f"no run of configuration {config!r} with answered requests in the reports")
    target = next(iter(targets)) if len(targets) == 1 else None
    return {
        "benchmark": "load_batches",
        "tpot_target_ms": target,
        "configs": {name: by_batch(np.concatenate(b), np.concatenate(t), target) for name, (b, t) in pooled.items()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", help="benchmarks/load.py report JSON files")
    ap.add_argument("--config", default=None, help="one configuration's runs only (e.g. plain)")
    ap.add_argument("--min-tokens", type=int, default=2, help="leave out requests with fewer output tokens")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        reports = [json.loads(Path(p).read_text()) for p in args.reports]
        result = analyse(reports, args.config, args.min_tokens)
    except (OSError, json.JSONDecodeError, ValueError, KeyError) as e:
        raise SystemExit(f"load_batches: {e}") from None
    result["reports"] = list(args.reports)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
