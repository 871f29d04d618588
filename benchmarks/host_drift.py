"""Was a live verdict decided by the host? The runs of live step loads read against a simulated machine.

A live step load (``benchmarks/load.py``) runs each configuration for a few rounds of two minutes, in the order
ABCD DCBA ABCD: that balances a linear drift of the host's speed, not a slowdown of a minute or two, and the host of
this project moves by 20-30 % at that scale (session 44: seed 78's default round 1 ran plain steps 28 % slower than
the machine and reached 0.20 attainment, its other rounds 0.92 and 0.64). This reads every run of each report against
a simulated machine (a ``benchmarks/step_ratios.py --noise`` report): the offset of its plain steps from the machine
(log measured / the machine's, its windows alone, :func:`benchmarks.step_ratios.machine_offsets`; plain steps run the
target alone, so the offset is the host's, not the draft's catch-up that drafting adds) beside its attainment. A run's
first two windows are left out (they can still hold the run before it) and a kind needs five windows for an offset
(:func:`benchmarks.step_ratios.run_offsets`); T = 4, k = 6 runs have no plain steps, so "the static runs" are in
practice plain decoding's.

Per report: each run's offset and attainment, each configuration's mean offset and the criterion's verdict, the
adaptive configuration ``--policy``'s mean offset minus the static configurations' (positive: its runs met a slower
host), and the correlation of offset and attainment over the report's runs. Pooled over the reports: that difference
where the policy held and where it did not (mean, 95 % t-interval), and the mean correlation. Reads the reports and
their ticks files (``<stem>_ticks.json.gz``); prints JSON (and writes ``--out``)::

    .venv/bin/python benchmarks/host_drift.py docs/img/load_economy_s{75,76,77,78,79}_t97_ttft4_s4?.json \\
        --against docs/img/step_noise_s43.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.load_replay import ticks_file  # noqa: E402
from benchmarks.report import emit  # noqa: E402
from benchmarks.stats import ci95  # noqa: E402
from benchmarks.step_ratios import round_attainment, run_offsets  # noqa: E402
from policies.operating_model import DEFAULT_MODEL_PATH, OperatingModel  # noqa: E402
from sim.decision_replay import last_policy_span, load_histories  # noqa: E402


def run_rows(report: dict[str, Any], histories: dict[str, list[Any]], machine: dict[str, Any],
             default_model: OperatingModel) -> list[dict[str, Any]]:
    """One row per run (``NAME:ROUND`` in both the report and its ticks): its start, attainment as
    ``benchmarks/load.py`` scores it and its offsets (plain, speculative) from ``machine``, in the order it ran."""
    rows = []
    for run in report.get("runs", []):
        label = f"{run['name']}:{run['round']}"
        history = histories.get(label)
        if history is None:
            continue
        span = last_policy_span(history)
        offsets = run_offsets([entry.get("telemetry") or {} for entry in span.ticks],
                              span.operating_model or default_model, machine)
        starts = [float(entry["time_s"]) for entry in history if entry.get("time_s") is not None]
        rows.append({"run": label, "name": run["name"], "start_s": min(starts) if starts else None,
                     "slo_attainment": round_attainment(report, run),
                     "plain_offset": offsets["plain"].get("offset"),
                     "speculative_offset": offsets["speculative"].get("offset")})
    return sorted(rows, key=lambda r: r["start_s"] if r["start_s"] is not None else 0.0)


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


def report_drift(report: dict[str, Any], rows: list[dict[str, Any]], policy: str) -> dict[str, Any]:
    """Per configuration its runs' mean offsets and verdict; ``policy``'s plain offset minus the static runs'; the
    correlation of plain offset and attainment over the runs that have both."""
    statics = {c["name"] for c in report.get("configs", []) if (c.get("spec") or {}).get("policy") == "static"}
    held = ((report.get("criterion") or {}).get("held") or {})
    configs: dict[str, Any] = {}
    for name in dict.fromkeys(r["name"] for r in rows):
        mine = [r for r in rows if r["name"] == name]
        configs[name] = {
            "static": name in statics, "held": held.get(name),
            "plain_offset": _mean([r["plain_offset"] for r in mine if r["plain_offset"] is not None]),
            "speculative_offset": _mean([r["speculative_offset"] for r in mine if r["speculative_offset"] is not None]),
        }
    static_offsets = [r["plain_offset"] for r in rows if r["name"] in statics and r["plain_offset"] is not None]
    policy_offsets = [r["plain_offset"] for r in rows if r["name"] == policy and r["plain_offset"] is not None]
    pairs = [(r["plain_offset"], r["slo_attainment"]) for r in rows
             if r["plain_offset"] is not None and r["slo_attainment"] is not None]
    corr = None
    if len(pairs) >= 3:
        x, y = np.array(pairs, dtype=float).T
        if x.std() > 0 and y.std() > 0:
            corr = round(float(np.corrcoef(x, y)[0, 1]), 3)
    difference = None
    if static_offsets and policy_offsets:
        difference = round(statistics.fmean(policy_offsets) - statistics.fmean(static_offsets), 4)
    return {"configs": configs, "policy": policy, "policy_held": held.get(policy),
            "policy_minus_static_plain_offset": difference, "corr_plain_offset_attainment": corr}


def pooled(per_report: list[dict[str, Any]]) -> dict[str, Any]:
    """The policy's offset difference where it held and where it did not, and the mean within-report correlation."""
    out: dict[str, Any] = {}
    for label, want in (("held", True), ("not_held", False)):
        diffs = [r["policy_minus_static_plain_offset"] for r in per_report
                 if r["policy_held"] is want and r["policy_minus_static_plain_offset"] is not None]
        mean, half = ci95(diffs) if diffs else (None, None)
        out[label] = {"reports": len(diffs), "mean_policy_minus_static_plain_offset": mean, "ci95": half,
                      "slower_than_static": sum(1 for d in diffs if d > 0)}
    # How much a slower host costs a configuration: attainment on plain offset across its own rounds (both taken
    # about their mean per report and configuration, so neither the arrivals nor the configuration enter), one
    # slope pooled over every report.
    x: list[float] = []
    y: list[float] = []
    groups = 0
    for r in per_report:
        by_config: dict[str, list[tuple[float, float]]] = {}
        for run in r["runs"]:
            if run["plain_offset"] is not None and run["slo_attainment"] is not None:
                by_config.setdefault(run["name"], []).append((run["plain_offset"], run["slo_attainment"]))
        for pairs in by_config.values():
            if len(pairs) >= 2:
                arr = np.array(pairs, dtype=float)
                arr -= arr.mean(axis=0)
                x += arr[:, 0].tolist()
                y += arr[:, 1].tolist()
                groups += 1
    xa, ya = np.array(x), np.array(y)
    dof = xa.size - groups - 1  # a mean per report and configuration, and the slope
    if dof >= 1 and float(xa @ xa) > 0:
        slope = float(xa @ ya / (xa @ xa))
        resid = ya - slope * xa
        se = math.sqrt(float(resid @ resid) / dof / float(xa @ xa))
        # Runs of one report share the host's drift, so the interval is if anything narrow.
        out["within_config_slope"] = {"runs": int(xa.size), "groups": groups,
                                      "attainment_per_log_offset": round(slope, 4), "ci95": round(1.96 * se, 4)}
    else:
        out["within_config_slope"] = {"runs": int(xa.size), "groups": groups}
    corrs = [r["corr_plain_offset_attainment"] for r in per_report if r["corr_plain_offset_attainment"] is not None]
    out["mean_corr_plain_offset_attainment"] = _mean(corrs)
    out["reports_with_negative_corr"] = sum(1 for c in corrs if c < 0)
    out["reports_with_corr"] = len(corrs)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", help="benchmarks/load.py reports, each with its ticks file beside it")
    ap.add_argument("--against", required=True, metavar="NOISE",
                    help="a benchmarks/step_ratios.py --noise report: the machine the offsets are taken from")
    ap.add_argument("--policy", default="slo", help="the adaptive configuration whose runs are compared (default slo)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        machine = json.loads(Path(args.against).read_text())["noise"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"host_drift: --against {args.against}: {exc}") from None
    default_model = OperatingModel.load(DEFAULT_MODEL_PATH)
    per_report = []
    for path in args.reports:
        try:
            report = json.loads(Path(path).read_text())
            histories = load_histories(ticks_file(path))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"host_drift: {path}: {exc}") from None
        rows = run_rows(report, histories, machine, default_model)
        if not rows:
            raise SystemExit(f"host_drift: {path}: no run of the report is in {ticks_file(path)}")
        per_report.append({"report": path, "seed": report.get("seed"), **report_drift(report, rows, args.policy),
                           "runs": rows})
    emit({"benchmark": "host_drift", "command": " ".join([sys.executable, *sys.argv]), "against": args.against,
          "reports": per_report, "pooled": pooled(per_report)}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
