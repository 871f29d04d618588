"""Per-request acceptance spread (κ of ``sim.profile.RequestAcceptance``) fitted from a live service's own
requests: the real legs of ``benchmarks/fidelity.py`` reports. No model is loaded and nothing is timed.
Prints JSON: κ pooled over every report's requests, and per scenario for reference.

    .venv/bin/python benchmarks/serving_spread.py docs/img/fidelity_smollm2_s7_bracketed.json \\
        docs/img/fidelity_smollm2_s8_bracketed.json --profile-out results/profile_served_kappa.json

Why from serving: a calibration measures κ at a fixed T and batch over a few dozen requests (session 27:
32 of 128 usable, κ = 15.9); a live service's requests run at the T the policy moves and beside whatever
else decodes. Each request is compared with the profile's own acceptance rate at *its* operating point —
the tier's T averaged over its decode span (the status samples the report keeps), and the mean number of
requests decoding beside it, itself included (from the records' decode spans) — so what is left beyond
sampling noise is the spread the simulator has to draw (``sim.profile_fit.fit_request_acceptance`` with
``expected=``). Requests whose acceptance saturates are left out, as in that fit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import emit  # noqa: E402
from sim.profile import Profile, RequestAcceptance  # noqa: E402
from sim.profile_fit import fit_request_acceptance  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def decode_spans(records: list[dict[str, Any]]) -> np.ndarray:
    """[n, 2] each answered request's decode span in seconds since the run's start (first token → end)."""
    return np.array([[r["arrival_s"] + r["ttft_ms"] / 1e3, r["arrival_s"] + r["e2e_ms"] / 1e3] for r in records],
                    dtype=float)


def mean_rows(spans: np.ndarray) -> np.ndarray:
    """Each span's time-averaged count of spans overlapping it, itself included (its mean batch)."""
    start, end = spans[:, 0], spans[:, 1]
    overlap = np.clip(np.minimum(end[:, None], end[None, :]) - np.maximum(start[:, None], start[None, :]), 0.0, None)
    length = end - start
    return np.where(length > 0, overlap.sum(axis=1) / np.where(length > 0, length, 1.0), 1.0)


def mean_threshold(spans: np.ndarray, t_samples: list[dict[str, Any]], tier: str) -> np.ndarray:
    """The tier's T averaged over each span, reading the samples as a step function (each value held until
    the next sample; the first one before it)."""
    times = np.array([s["t_s"] for s in t_samples], dtype=float)
    values = np.array([s["thresholds"][tier] for s in t_samples], dtype=float)
    if times.size == 0:
        raise ValueError("the report has no T samples")
    out = np.empty(len(spans))
    for i, (lo, hi) in enumerate(spans):
        if hi <= lo:
            out[i] = values[max(0, int(np.searchsorted(times, lo, side="right")) - 1)]
            continue
        edges = np.concatenate(([lo], times[(times > lo) & (times < hi)], [hi]))
        held = values[np.maximum(np.searchsorted(times, edges[:-1], side="right") - 1, 0)]
        out[i] = float(np.sum(held * np.diff(edges)) / (hi - lo))
    return out


def operating_points(scenario: dict[str, Any], tier: str) -> dict[str, np.ndarray]:
    """Per answered request with drafts: accepted, drafted, its mean T and mean rows (every answered request,
    drafting or not, counts among the rows beside it)."""
    answered = [r for r in scenario["real"]["records"] if r.get("status") == 200 and "ttft_ms" in r]
    if not answered:
        return {key: np.zeros(0) for key in ("accepted", "drafted", "threshold", "rows")}
    spans = decode_spans(answered)
    drafted = np.array([(r.get("fsd") or {}).get("drafted_tokens", 0) for r in answered], dtype=float)
    mask = drafted > 0
    return {
        "accepted": np.array([r["fsd"]["accepted_tokens"] for r, m in zip(answered, mask, strict=True) if m],
                             dtype=float),
        "drafted": drafted[mask],
        "threshold": mean_threshold(spans[mask], scenario["real"]["t_samples"], tier),
        "rows": mean_rows(spans)[mask],
    }


def expected_rates(profile: Profile, div: str, k: int, threshold: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The profile's acceptance rate (accepted / drafted) at each request's operating point."""
    return np.array([profile.expected_acceptance_rate(div, float(t), k, batch=float(b))
                     for t, b in zip(threshold, rows, strict=True)])


def fit(reports: list[tuple[str, dict[str, Any]]], profile: Profile) -> dict[str, Any]:
    """κ pooled over the (name, report) pairs' scenarios, and per scenario."""
    pooled: dict[str, list[np.ndarray]] = {"accepted": [], "drafted": [], "expected": []}
    per_scenario = []
    for name, report in reports:
        settings = report["settings"]
        tier, div, k = settings["tier"], settings["div"], int(settings["k"])
        for scenario in report["scenarios"]:
            pts = operating_points(scenario, tier)
            expected = expected_rates(profile, div, k, pts["threshold"], pts["rows"])
            for key, value in (("accepted", pts["accepted"]), ("drafted", pts["drafted"]), ("expected", expected)):
                pooled[key].append(value)
            one = (fit_request_acceptance(pts["accepted"], pts["drafted"], expected=expected)
                   if pts["accepted"].size >= 3 else None)
            per_scenario.append({
                "report": name, "scenario": scenario["name"], "requests": int(pts["accepted"].size),
                "mean_threshold": float(pts["threshold"].mean()) if pts["threshold"].size else None,
                "mean_rows": float(pts["rows"].mean()) if pts["rows"].size else None,
                "measured_rate": float(pts["accepted"].sum() / pts["drafted"].sum()) if pts["drafted"].size else None,
                "profile_rate": float(np.average(expected, weights=pts["drafted"])) if expected.size else None,
                "kappa": None if one is None else one.concentration,
            })
    accepted, drafted, expected = (np.concatenate(pooled[key]) for key in ("accepted", "drafted", "expected"))
    if accepted.size < 3:
        raise ValueError(f"the reports hold {accepted.size} requests with drafts; need at least 3")
    result = fit_request_acceptance(accepted, drafted, expected=expected,
                                    source="benchmarks/serving_spread.py over " + ", ".join(n for n, _ in reports))
    return {"requests": int(accepted.size), "request_acceptance": None if result is None else result.model_dump(),
            "per_scenario": per_scenario}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", type=Path, help="benchmarks/fidelity.py reports (their real legs)")
    ap.add_argument("--profile", type=Path, default=None,
                    help="profile whose acceptance the requests are compared with (default: the first report's)")
    ap.add_argument("--profile-out", type=Path, default=None,
                    help="write --profile with the fitted request_acceptance here")
    ap.add_argument("--out", default=None, help="also write the JSON report here")
    args = ap.parse_args(argv)
    try:
        reports = []
        for path in args.reports:
            try:
                data = json.loads(path.read_text())
                if data.get("benchmark") != "fidelity" or not data.get("scenarios"):
                    raise ValueError("not a fidelity report")
            except (OSError, json.JSONDecodeError, ValueError) as exc:
                raise ValueError(f"{str(path)!r}: {exc}") from None
            reports.append((str(path), data))
        profile_path = args.profile or Path(reports[0][1]["profile"])
        if not profile_path.is_absolute() and not profile_path.exists():
            profile_path = REPO / profile_path  # reports store repo-relative paths
        profile = Profile.load(profile_path)
        result = fit(reports, profile)
    except (ValueError, KeyError) as exc:
        print(f"serving_spread: error: {exc}", file=sys.stderr)
        return 2
    out: dict[str, Any] = {"benchmark": "serving_spread", "profile": str(profile_path), **result,
                           "command": " ".join([sys.executable, *sys.argv])}
    if args.profile_out is not None:
        if result["request_acceptance"] is None:
            print("serving_spread: error: no spread beyond sampling noise; nothing to write", file=sys.stderr)
            emit(out, args.out)
            return 2
        variation = RequestAcceptance.model_validate(result["request_acceptance"])
        args.profile_out.parent.mkdir(parents=True, exist_ok=True)
        profile.model_copy(update={"request_acceptance": variation}).save(args.profile_out)
        out["profile_out"] = str(args.profile_out)
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
