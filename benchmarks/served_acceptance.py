"""The acceptance and distortion a live service's requests got, by operating point, against profiles' predictions.

Reads ``benchmarks/load.py`` reports (per-request records carry the engine's drafted and accepted drafts and
distortion; the report keeps the controller's T and k samples) and keeps every answered request that drafted and
lived at one (T, k) of ``--tier`` throughout: the sample in force when its decode began and every sample before it
ended agree. Per (T, k): requests, drafts, the share accepted and the distortion per output token, beside each
``--profile``'s prediction (``Profile.expected_acceptance_rate`` and ``mean_distortion`` at that point; a point off
a profile's grid is interpolated as the simulator does). Per profile: the drafted-weighted mean absolute error of the
accepted share (over every point and over 0 < T < 2, where the grid's points differ most), the token-weighted one of
distortion, and at how many points each is within 0.02 / 0.01. No model is loaded and nothing is timed.

What it is for: telling whether a profile describes the traffic a service actually served — acceptance depends on the
sampling temperature and on what is asked, so a profile calibrated on other prompts or at another temperature
mispredicts it (docs/figures.md, session 41). Prints JSON (and writes ``--out``)::

    .venv/bin/python benchmarks/served_acceptance.py docs/img/load_economy_s*_t97_ttft4_s*.json --tier economy \\
        --profile shipped=sim/profiles/smollm2-135m.json --profile chat=sim/profiles/smollm2-135m-chat-t0.7.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import emit  # noqa: E402
from benchmarks.serving_spread import decode_spans  # noqa: E402
from sim.profile import DEFAULT_PROFILE_PATH, Profile  # noqa: E402

#: Accepted share within this of the service's, distortion within that: "within" in the report's counts.
ACCEPTANCE_TOLERANCE = 0.02
DISTORTION_TOLERANCE = 0.01


def point_of(span: Sequence[float], times: np.ndarray, points: Sequence[tuple[float, int]]) -> tuple[float, int] | None:
    """The (T, k) in force over the whole ``span`` [start, end] (samples read as a step function: each holds until the
    next; the first one also before it), or None where it changed inside."""
    start, end = span
    first = max(0, int(np.searchsorted(times, start, side="right")) - 1)
    last = max(first + 1, int(np.searchsorted(times, end, side="left")))
    held = set(points[first:last])
    return held.pop() if len(held) == 1 else None


def served_points(reports: Sequence[Mapping[str, Any]], tier: str) -> dict[tuple[float, int], dict[str, float]]:
    """Per (T, k): requests, drafted and accepted drafts, output tokens and their distortion sum, over every run
    of every report."""
    totals: dict[tuple[float, int], dict[str, float]] = defaultdict(
        lambda: {"requests": 0, "drafted": 0, "accepted": 0, "tokens": 0, "distortion": 0.0})
    for report in reports:
        for run in report["runs"]:
            samples = run.get("t_samples") or []
            if not samples:
                continue
            times = np.array([s["t_s"] for s in samples], dtype=float)
            points = [(float(s["thresholds"][tier]), int(s["draft_lengths"][tier])) for s in samples]
            answered = [r for r in run["records"] if r.get("status") == 200 and "ttft_ms" in r
                        and (r.get("fsd") or {}).get("tier", tier) == tier]
            if not answered:
                continue
            for record, span in zip(answered, decode_spans(answered), strict=True):
                fsd = record.get("fsd") or {}
                drafted = int(fsd.get("drafted_tokens") or 0)
                point = point_of(span, times, points)
                if drafted <= 0 or point is None or point[1] == 0:
                    continue
                total = totals[point]
                total["requests"] += 1
                total["drafted"] += drafted
                total["accepted"] += int(fsd.get("accepted_tokens") or 0)
                tokens = int(record.get("output_tokens") or 0)
                total["tokens"] += tokens
                total["distortion"] += float(fsd.get("mean_distortion") or 0.0) * tokens
    return dict(totals)


def compare(served: Mapping[tuple[float, int], Mapping[str, float]], profiles: Mapping[str, Profile],
            div: str) -> dict[str, Any]:
    """The per-point table and each profile's errors against the served figures."""
    rows = []
    errors = {name: {"acceptance_abs": 0.0, "weight": 0.0, "middle_abs": 0.0, "middle_weight": 0.0,
                     "distortion_abs": 0.0, "tokens": 0.0, "acceptance_within": 0, "distortion_within": 0}
              for name in profiles}
    for (t, k), total in sorted(served.items()):
        share = total["accepted"] / total["drafted"]
        distortion = total["distortion"] / total["tokens"] if total["tokens"] else 0.0
        row: dict[str, Any] = {"T": t, "k": k, "requests": int(total["requests"]), "drafted": int(total["drafted"]),
                               "accepted_share": round(share, 4), "distortion_per_token": round(distortion, 4),
                               "profiles": {}}
        for name, profile in profiles.items():
            if k not in profile.draft_lengths(div):
                continue
            predicted = profile.expected_acceptance_rate(div, t, k)
            predicted_distortion = profile.mean_distortion(div, t, k)
            row["profiles"][name] = {"accepted_share": round(predicted, 4),
                                     "distortion_per_token": round(predicted_distortion, 4)}
            e = errors[name]
            e["acceptance_abs"] += total["drafted"] * abs(predicted - share)
            e["weight"] += total["drafted"]
            if 0.0 < t < 2.0:
                e["middle_abs"] += total["drafted"] * abs(predicted - share)
                e["middle_weight"] += total["drafted"]
            e["distortion_abs"] += total["tokens"] * abs(predicted_distortion - distortion)
            e["tokens"] += total["tokens"]
            e["acceptance_within"] += abs(predicted - share) <= ACCEPTANCE_TOLERANCE
            e["distortion_within"] += abs(predicted_distortion - distortion) <= DISTORTION_TOLERANCE
        rows.append(row)
    summary = {
        name: {
            "points": len([r for r in rows if name in r["profiles"]]),
            "accepted_share_mean_abs_error": round(e["acceptance_abs"] / e["weight"], 4) if e["weight"] else None,
            "accepted_share_mean_abs_error_0_lt_T_lt_2": (
                round(e["middle_abs"] / e["middle_weight"], 4) if e["middle_weight"] else None),
            "distortion_mean_abs_error": round(e["distortion_abs"] / e["tokens"], 4) if e["tokens"] else None,
            f"points_accepted_share_within_{ACCEPTANCE_TOLERANCE:g}": int(e["acceptance_within"]),
            f"points_distortion_within_{DISTORTION_TOLERANCE:g}": int(e["distortion_within"]),
        }
        for name, e in errors.items()
    }
    return {"points": rows, "errors": summary}


def named_paths(items: Sequence[str]) -> dict[str, str]:
    """``--profile NAME=PATH`` items as {name: path}; ValueError naming a malformed or repeated item."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"--profile {item!r}: expected NAME=PATH")
        if name in out:
            raise ValueError(f"--profile {item!r}: {name!r} given twice")
        out[name] = path
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", help="benchmarks/load.py reports (per-round records and T samples)")
    ap.add_argument("--tier", default="economy", help="the tier whose requests and (T, k) are read")
    ap.add_argument("--profile", dest="profiles", action="append", default=[], metavar="NAME=PATH",
                    help="a profile to compare (repeatable; default: shipped=the default pair's)")
    ap.add_argument("--div", default=None, help="the divergence the service ran (default: each profile's default)")
    ap.add_argument("--out", default="results/served_acceptance.json")
    args = ap.parse_args(argv)
    try:
        named = named_paths(args.profiles) if args.profiles else {"shipped": str(DEFAULT_PROFILE_PATH)}
    except ValueError as exc:
        ap.error(str(exc))
    profiles = {name: Profile.load(path) for name, path in named.items()}
    divs = {args.div or p.default_div for p in profiles.values()}
    if len(divs) != 1:
        ap.error(f"--div: the profiles' default divergences differ ({sorted(divs)}); name one")
    reports = [json.loads(Path(path).read_text()) for path in args.reports]
    out = {"benchmark": "served_acceptance", "reports": list(args.reports), "tier": args.tier, "div": divs.pop(),
           "command": " ".join([sys.executable, *sys.argv]), "profiles": named}
    out.update(compare(served_points(reports, args.tier), profiles, out["div"]))
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
