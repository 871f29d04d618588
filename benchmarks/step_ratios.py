"""Measured / modelled decode steps by batch, from live step loads' recorded windows (``benchmarks/load.py --ticks``).

The model-predictive policy corrects its step model online with a line in the per-row share of the step
(``policies.step_correction``): the line's slope, learned where a light phase runs one or two rows, is what it
extrapolates to a burst's five or six. This script reads the same windows the policy read (each tick's
``plain_steps`` / ``speculative_steps`` totals, against the run's recorded operating model, the sums as
``policies.mpc.speculative_step_line`` forms them) and tabulates the ratio per kind of step, k_max (speculative) and rounded mean batch,
over every run of each file; so whether a line is the right shape is read off the data, not the fit.
Prints JSON (and writes ``--out``)::

    .venv/bin/python benchmarks/step_ratios.py docs/img/load_economy_s4{0,1}_t97_ttft4_s32_ticks.json.gz
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import emit  # noqa: E402
from policies.mpc import DEFAULT_MODEL_PATH, OperatingModel, speculative_step_line  # noqa: E402
from policies.telemetry import StepTotals  # noqa: E402
from sim.decision_replay import last_policy_span, load_histories  # noqa: E402


def window_ratios(telemetry: Mapping[str, Any], model: OperatingModel) -> list[tuple[str, float, float]]:
    """(kind, mean batch, measured / modelled mean step) for each kind of step the window reports; kind is
    ``"plain"`` or ``"k<k_max>"``."""
    c = model.cost
    out: list[tuple[str, float, float]] = []
    plain = telemetry.get("plain_steps")
    if plain and plain.get("steps") and plain.get("rows"):
        batch = plain["rows"] / plain["steps"]
        fixed, per_row = c.plain_line(batch)
        out.append(("plain", batch, plain["ms"] / plain["steps"] / float(fixed + per_row * batch)))
    spec = telemetry.get("speculative_steps")
    if spec and spec.get("steps") and spec.get("rows"):
        totals = StepTotals(**spec)
        spec_fixed, spec_per_row = speculative_step_line(c, totals)
        k_max = max(1, round(totals.draft_forwards / totals.steps))
        out.append((f"k{k_max}", totals.mean_rows, totals.mean_ms / (spec_fixed + spec_per_row * totals.mean_rows)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ticks", nargs="+", help="benchmarks/load.py --ticks files")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    default_model = OperatingModel.load(DEFAULT_MODEL_PATH)
    out: dict[str, Any] = {"benchmark": "step_ratios", "command": " ".join([sys.executable, *sys.argv]),
                           "files": {}}
    for path in args.ticks:
        try:
            histories = load_histories(path)
        except ValueError as exc:
            raise SystemExit(f"step_ratios: {exc}") from None
        cells: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for history in histories.values():
            span = last_policy_span(history)
            model = span.operating_model or default_model
            for entry in span.ticks:
                for kind, batch, ratio in window_ratios(entry.get("telemetry") or {}, model):
                    cells[kind][max(1, round(batch))].append(ratio)
        out["files"][path] = {
            kind: {str(b): {"windows": len(v), "mean": round(statistics.fmean(v), 3),
                            "min": round(min(v), 3), "max": round(max(v), 3)}
                   for b, v in sorted(by_batch.items())}
            for kind, by_batch in sorted(cells.items())
        }
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
