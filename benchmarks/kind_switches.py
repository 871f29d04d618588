"""How often a policy switched the kind of step (plain decoding ↔ drafting) in recorded runs, and how many probes it undid.

Reads ``benchmarks/load.py --ticks`` files (or saved ``/v1/fsd/status`` answers) and, per run of an adaptive policy
(any run but a static point's), counts the decisions that switched the kind of step of
that tier, those of them made while probing (the reason says ``probing``: see docs/policies.md, "Probing"), and the
probes undone at the very next decision (a switch there is made before any window of the probed kind can have been
measured: a decision takes effect at the next report, so it pays the draft's catch-up and learns nothing), and the
decisions made in best effort (nothing predicted to meet). Prints
JSON (and writes ``--out``)::

    .venv/bin/python benchmarks/kind_switches.py docs/img/load_economy_s*_t97_ttft4_s??_ticks.json.gz
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import emit  # noqa: E402
from sim.decision_replay import last_policy_span, load_histories  # noqa: E402


def plain_kinds(history: Sequence[Mapping[str, Any]], tier: str) -> list[tuple[bool, str]]:
    """(plain decoding or not, the reason) of each decision in ``history`` that names a draft length for ``tier``."""
    out = []
    for entry in history:
        decision = entry.get("decision") or {}
        k = (decision.get("draft_lengths") or {}).get(tier)
        if k is not None:
            out.append((int(k) == 0, str(decision.get("reason") or "")))
    return out


def count_switches(kinds: Sequence[tuple[bool, str]]) -> dict[str, int]:
    """Switches of kind, those made while probing, probes undone at the next decision, and the decisions made in best
    effort (nothing predicted to meet: the reason says ``best effort``)."""
    switches = probes = undone = 0
    best_effort = sum(1 for _, reason in kinds if "best effort" in reason)
    for i in range(1, len(kinds)):
        if kinds[i][0] == kinds[i - 1][0]:
            continue
        switches += 1
        if "probing" in kinds[i][1]:
            probes += 1
            if i + 1 < len(kinds) and kinds[i + 1][0] != kinds[i][0]:
                undone += 1
    return {"decisions": len(kinds), "switches": switches, "probe_switches": probes, "probes_undone_next_tick": undone,
            "best_effort_decisions": best_effort}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ticks", nargs="+", help="benchmarks/load.py --ticks files or saved /v1/fsd/status answers")
    ap.add_argument("--tier", default="economy", help="the tier whose draft length is read (default economy)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    files: dict[str, Any] = {}
    counted = ("decisions", "switches", "probe_switches", "probes_undone_next_tick", "best_effort_decisions")
    totals = dict.fromkeys(("runs", *counted), 0)
    for path in args.ticks:
        try:
            histories = load_histories(path)
        except ValueError as exc:
            raise SystemExit(f"kind_switches: {exc}") from None
        runs = {}
        for label, history in histories.items():
            spec = last_policy_span(history).spec
            if isinstance(spec, Mapping) and spec.get("policy") == "static":
                continue  # a static point: nothing to count
            runs[label] = count_switches(plain_kinds(history, args.tier))
            totals["runs"] += 1
            for key in counted:
                totals[key] += runs[label][key]
        files[path] = runs
    emit({"benchmark": "kind_switches", "command": " ".join([sys.executable, *sys.argv]), "tier": args.tier,
          "files": files, "total": totals}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
