"""Refit a profile's latency model from the calibration record it carries, with today's fit: only ``latency``
changes (e.g. profiles calibrated before the fit kept the measured prefills by prompt length, session 28).
No model is loaded and nothing is timed. Prints JSON: which latency fields changed, old and new.

    .venv/bin/python benchmarks/refit_latency.py docs/img/latency_before_s8_profile.json --shared-kv \\
        --profile-out results/latency_before_s8_refit.json

Records written since session 28 say whether the engine ran the draft on the target's KV cache (then the
draft never prefills and is not fitted apart); older ones need ``--shared-kv`` or ``--separate-kv``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import emit  # noqa: E402
from sim.profile import Profile  # noqa: E402
from sim.profile_fit import fit_latency  # noqa: E402


def refit(profile: Profile, shared_kv: bool | None) -> tuple[Profile, dict[str, Any]]:
    """``profile`` with its latency refitted from ``profile.calibration``; the fields that changed (old, new).
    ValueError when the profile has no record, or the KV layout is neither recorded nor given (or contradicts
    the record)."""
    from decoder.calibration import CalibrationRecord

    if not profile.calibration:
        raise ValueError("the profile carries no calibration record to refit (a hand-made profile?)")
    record = CalibrationRecord.model_validate(profile.calibration)
    recorded = record.draft_shares_kv
    if recorded is not None and shared_kv is not None and recorded != shared_kv:
        raise ValueError(f"the record says draft_shares_kv={recorded}; --{'shared' if shared_kv else 'separate'}-kv "
                         "contradicts it")
    shares = recorded if recorded is not None else shared_kv
    if shares is None:
        raise ValueError("the record does not say whether the draft shared the target's KV cache: pass --shared-kv "
                         "or --separate-kv")
    latency = fit_latency(record.latency, draft_prefill_apart=not shares).model
    old, new = profile.latency.model_dump(), latency.model_dump()
    changed = {key: {"old": old[key], "new": new[key]} for key in old if old[key] != new[key]}
    return profile.model_copy(update={"latency": latency}), changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", type=Path, help="a calibrated profile JSON (with its `calibration` record)")
    kv = ap.add_mutually_exclusive_group()
    kv.add_argument("--shared-kv", dest="shared_kv", action="store_const", const=True, default=None,
                    help="the draft ran on the target's KV cache (the default pair since session 26)")
    kv.add_argument("--separate-kv", dest="shared_kv", action="store_const", const=False,
                    help="the draft kept its own cache (its prefill is fitted apart)")
    ap.add_argument("--profile-out", type=Path, required=True, help="where to write the refitted profile")
    ap.add_argument("--out", default=None, help="also write the JSON report here")
    args = ap.parse_args(argv)
    try:
        profile, changed = refit(Profile.load(args.profile), args.shared_kv)
    except ValueError as exc:
        print(f"refit_latency: error: {exc}", file=sys.stderr)
        return 2
    args.profile_out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(args.profile_out)
    emit({"benchmark": "refit_latency", "profile": str(args.profile), "profile_out": str(args.profile_out),
          "changed": changed, "command": " ".join([sys.executable, *sys.argv])}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
