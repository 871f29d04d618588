"""Candidate policy specs on a live step load's recorded control windows (``benchmarks/load.py --ticks``), open loop.

For every adaptive run in the ticks file (by default those whose recorded spec is not static) and every candidate
spec, ``sim.decision_replay`` feeds the recorded windows through a fresh policy of that spec (the recorded operating
model and SLO) and reports, per run: the first tick where it decides otherwise than the live policy did, the first
tick at or after ``--burst-s`` where it drafts for ``--tier`` (k > 0: it has left plain decoding), and the ticks
before ``--burst-s`` (the light phase) where it drafts at T > 0 (spends distortion; T = 0 drafting is lossless);
from ``--burst-s`` to ``--burst-end-s`` (the high phase), the ticks it drafts at T > 0 and its relaxes while drafting
(a tick that drafts followed by one at a lower T or k, plain decoding included: the requests decoding through it pay).
Times are seconds after the run's first tick. A candidate's ticks after its first difference are read on windows
the live choices produced (open loop): a guide to what it would have chosen, not its outcome. Prints JSON (and
writes ``--out``)::

    .venv/bin/python benchmarks/decision_candidates.py docs/img/load_economy_s37_t97_ttft4_s31_ticks.json.gz \\
        --burst-s 45 --candidate 'rise85={"policy": "slo", "rate_rise_decay": 0.85}'
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.named_specs import parse_named_specs  # noqa: E402
from benchmarks.report import emit  # noqa: E402
from policies.slo import SLOSpec  # noqa: E402
from sim.decision_replay import build_policy, last_policy_span, load_histories, replay  # noqa: E402


def _drafts(decision: Any, tier: str) -> tuple[float, int] | None:
    """(T, k) for ``tier`` where the decision drafts for it (k > 0), else None."""
    if not decision:
        return None
    k = (decision.get("draft_lengths") or {}).get(tier, 0)
    return (decision["thresholds"].get(tier), k) if k else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ticks", help="a benchmarks/load.py --ticks file")
    ap.add_argument("--candidate", action="append", default=[], metavar="NAME=JSON", help="a spec to replay "
                    "(repeatable); the recorded spec of each run is always replayed first, as 'recorded'")
    ap.add_argument("--tier", default="economy")
    ap.add_argument("--burst-s", type=float, required=True, help="seconds after a run's first tick where the high "
                    "phase starts (before it: the light phase)")
    ap.add_argument("--burst-end-s", type=float, default=None, help="seconds after a run's first tick where the high "
                    "phase ends (default: the run's end)")
    ap.add_argument("--run", action="append", help="NAME:ROUND (default: every run whose spec is not static)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        candidates: dict[str, Any] = {"recorded": None, **parse_named_specs(
            args.candidate, "--candidate", lambda name: "the recorded spec's row" if name == "recorded" else None)}
        histories = load_histories(args.ticks)
    except ValueError as exc:
        raise SystemExit(f"decision_candidates: {exc}") from None
    out: dict[str, Any] = {"benchmark": "decision_candidates", "ticks": args.ticks, "tier": args.tier,
                           "burst_s": args.burst_s, "command": " ".join([sys.executable, *sys.argv]), "runs": {}}
    for label, history in histories.items():
        span = last_policy_span(history)
        if span.spec is None or (args.run and label not in args.run) or (
                not args.run and span.spec.get("policy") == "static"):
            continue
        slo = span.slo or SLOSpec.default()  # an event without the SLO: a history from before it was recorded
        rows = {}
        for name, spec in candidates.items():
            ticks = replay(span, build_policy(spec or span.spec, slo, span.operating_model, span.replica_bounds), slo)
            t0 = ticks[0].time_s
            drafting = [(round(t.time_s - t0, 1), d) for t in ticks if (d := _drafts(t.replayed, args.tier))]
            end = math.inf if args.burst_end_s is None else args.burst_end_s
            burst = [_drafts(t.replayed, args.tier) or (0.0, 0) for t in ticks if args.burst_s <= t.time_s - t0 < end]
            rows[name] = {
                "first_difference_s": next((round(t.time_s - t0, 1) for t in ticks if not t.same), None),
                "first_draft_from_burst_s": next((s for s, _ in drafting if s >= args.burst_s), None),
                "light_phase_lossy": [[s, *d] for s, d in drafting if s < args.burst_s and (d[0] or 0) > 0],
                "burst_lossy_ticks": sum(1 for t, k in burst if k and (t or 0) > 0),
                "burst_relaxes": sum(1 for (t0_, k0), (t1, k1) in zip(burst, burst[1:], strict=False)
                                     if k0 and (k1 < k0 or (t1 or 0) < (t0_ or 0))),
            }
        out["runs"][label] = rows
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
