"""Two configurations of several live step loads (``benchmarks/load.py`` reports), compared seed by seed and pooled.

Each argument is ``REPORT:A:B``: a report and the names its two configurations ran under there (a candidate run under
one name in one session can be the default under another in the next). Per report: each configuration's attainment
and distortion over its rounds, the difference A − B, and whether each held the report's criterion. Pooled over the
reports (the seeds, each with its own arrivals, are the independent units; rounds within a seed share them): the mean
difference with a 95 % t-interval, wins / ties / losses, and the exact two-sided sign-test p over the non-tied seeds.
Prints JSON (and writes ``--out``)::

    .venv/bin/python benchmarks/load_pool.py \\
        docs/img/load_economy_s49_t97_ttft4_s34.json:hold4:slo docs/img/load_economy_s50_t97_ttft4_s34.json:slo:relax0
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import emit  # noqa: E402
from benchmarks.stats import ci95, sign_test_p  # noqa: E402


def _config(report: dict[str, Any], name: str, path: str) -> dict[str, Any]:
    for c in report.get("configs", []):
        if c.get("name") == name:
            found: dict[str, Any] = c
            return found
    names = [c.get("name") for c in report.get("configs", [])]
    raise ValueError(f"{path}: no configuration {name!r} (it ran {names})")


def pool(items: list[tuple[str, dict[str, Any], str, str]], tie: float = 1e-9) -> dict[str, Any]:
    """Per report and pooled; ``items`` are (label, report, name of A, name of B)."""
    seeds: list[dict[str, Any]] = []
    for label, report, a_name, b_name in items:
        a, b = _config(report, a_name, label), _config(report, b_name, label)
        held = (report.get("criterion") or {}).get("held") or {}
        seeds.append({
            "report": label, "seed": report.get("seed"), "a": a_name, "b": b_name,
            "attainment_a": a["slo_attainment"], "attainment_b": b["slo_attainment"],
            "difference": a["slo_attainment"] - b["slo_attainment"],
            "distortion_a": a.get("mean_distortion_per_token"), "distortion_b": b.get("mean_distortion_per_token"),
            "held_a": held.get(a_name), "held_b": held.get(b_name),
        })
    diffs = [s["difference"] for s in seeds]
    wins = sum(1 for d in diffs if d > tie)
    losses = sum(1 for d in diffs if d < -tie)
    mean, half = ci95(diffs) if diffs else (math.nan, math.nan)
    return {
        "seeds": seeds,
        "pooled": {
            "seeds": len(seeds), "mean_difference": mean, "ci95": half, "wins": wins, "ties": len(diffs) - wins - losses,
            "losses": losses, "sign_test_p": sign_test_p(wins, losses),
            "held_a": sum(1 for s in seeds if s["held_a"]), "held_b": sum(1 for s in seeds if s["held_b"]),
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="REPORT:A:B", help="a benchmarks/load.py report and the names of the "
                    "two configurations in it (A is compared against B)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    items: list[tuple[str, dict[str, Any], str, str]] = []
    try:
        for run in args.runs:
            path, sep, names = run.partition(":")
            a_name, sep2, b_name = names.partition(":")
            if not sep or not sep2 or not a_name or not b_name:
                raise ValueError(f"{run!r}: give REPORT:A:B")
            try:
                report = json.loads(Path(path).read_text())
            except (OSError, ValueError) as exc:
                raise ValueError(f"{path}: {exc}") from None
            items.append((path, report, a_name, b_name))
        result = pool(items)
    except ValueError as exc:
        raise SystemExit(f"load_pool: {exc}") from None
    emit({"benchmark": "load_pool", **result}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
