"""Measured / modelled decode steps by batch, from live step loads' recorded windows (``benchmarks/load.py --ticks``).

The model-predictive policy corrects its step model online with a line in the per-row share of the step
(``policies.step_correction``): the line's slope, learned where a light phase runs one or two rows, is what it
extrapolates to a burst's five or six. This script reads the same windows the policy read (each tick's
``plain_steps`` / ``speculative_steps`` totals, against the run's recorded operating model, the sums as
``policies.operating_model.speculative_step_line`` forms them) and tabulates the ratio per kind of step, k_max (speculative) and rounded mean batch,
over every run of each file; so whether a line is the right shape is read off the data, not the fit.
With ``--fits`` it also replays each run's windows, in order, through the two shapes of online fit the policy
can use (``step_fit`` "line", :class:`~policies.step_correction.StepCorrection`, and "batch",
:class:`~policies.step_correction.BatchStepCorrection`, at the shipped spec's decay, prior and batch limit) and
reports how well each predicts the next window's ratio before it observes it: log(predicted / measured) by kind
of step and batch (and after the batch rose by 1.5 rows or more since that kind's last window, where a fit must
extrapolate). With ``--first-speculative`` it reports, for each run's first window of speculative steps (the one a
policy plans before it has measured any: ``draft_prior``), log(predicted / measured) of its ratio under the two
priors the policy can take there: the model's step (1) and the plain steps' fit so far (the "line" shape at the
shipped spec's settings, read at that window's composition). Prints JSON (and writes ``--out``)::

    .venv/bin/python benchmarks/step_ratios.py docs/img/load_economy_s4{0,1}_t97_ttft4_s32_ticks.json.gz --fits
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks.report import emit  # noqa: E402
from policies.operating_model import DEFAULT_MODEL_PATH, OperatingModel, speculative_step_line  # noqa: E402
from policies.registry import MPCParams  # noqa: E402
from policies.step_correction import BatchStepCorrection, StepCorrection  # noqa: E402
from policies.telemetry import StepTotals  # noqa: E402
from sim.decision_replay import last_policy_span, load_histories  # noqa: E402


def window_steps(telemetry: Mapping[str, Any], model: OperatingModel) -> list[tuple[str, float, float, float, float]]:
    """(kind, mean batch, measured mean step ms, the model's fixed ms, its per-row ms) for each kind of step the
    window reports; kind is ``"plain"`` or ``"k<k_max>"``."""
    c = model.cost
    out: list[tuple[str, float, float, float, float]] = []
    plain = telemetry.get("plain_steps")
    if plain and plain.get("steps") and plain.get("rows"):
        batch = plain["rows"] / plain["steps"]
        fixed, per_row = c.plain_line(batch)
        out.append(("plain", batch, plain["ms"] / plain["steps"], float(fixed), float(per_row)))
    spec = telemetry.get("speculative_steps")
    if spec and spec.get("steps") and spec.get("rows"):
        totals = StepTotals(**spec)
        spec_fixed, spec_per_row = speculative_step_line(c, totals)
        k_max = max(1, round(totals.draft_forwards / totals.steps))
        out.append((f"k{k_max}", totals.mean_rows, totals.mean_ms, spec_fixed, spec_per_row))
    return out


def window_ratios(telemetry: Mapping[str, Any], model: OperatingModel) -> list[tuple[str, float, float]]:
    """(kind, mean batch, measured / modelled mean step) for each kind of step the window reports."""
    return [(kind, batch, ms / (fixed + per_row * batch))
            for kind, batch, ms, fixed, per_row in window_steps(telemetry, model)]


def _shipped_fits() -> dict[str, Any]:
    """A fresh fit of each shape, at the shipped spec's step decay, slope prior and batch limit."""
    p = MPCParams()
    return {"line": lambda: StepCorrection(decay=p.step_decay, slope_prior=p.step_slope_prior),
            "batch": lambda: BatchStepCorrection(p.max_batch, decay=p.step_decay)}


def fit_errors(runs: list[list[Mapping[str, Any]]], model_of: list[OperatingModel],
               min_windows: int = 3) -> dict[str, dict[str, list[float]]]:
    """log(predicted / measured) of each fit shape's prediction of every window's ratio before observing it, per
    group (``"plain rows 1-2"``, ``"speculative rows 4+"``, ``"plain after a rise"``, ...). ``runs``: each run's
    telemetry in order; a fit predicts once it has ``min_windows`` windows of its kind (k_max apart)."""
    makers = _shipped_fits()
    errors: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in makers}
    for telemetry_seq, model in zip(runs, model_of, strict=True):
        fits: dict[str, dict[str, Any]] = {name: {} for name in makers}
        last_batch: dict[str, float] = {}
        for telemetry in telemetry_seq:
            for kind, batch, ms, fixed, per_row in window_steps(telemetry, model):
                measured = ms / (fixed + per_row * batch)
                part = "plain" if kind == "plain" else "speculative"
                rows = "rows 1-2" if batch < 2.5 else "rows 3" if batch < 3.5 else "rows 4+"
                rose = batch - last_batch.get(kind, batch) >= 1.5
                for name, make in makers.items():
                    fit = fits[name].get(kind)
                    if fit is not None and fit.windows >= min_windows:
                        error = math.log(fit.at(fixed, per_row, batch) / measured)
                        errors[name][f"{part} {rows}"].append(error)
                        if rose:
                            errors[name][f"{part} after a rise"].append(error)
                    fits[name].setdefault(kind, make()).observe(ms, fixed, per_row, batch)
                last_batch[kind] = batch
    return errors


def first_speculative_errors(runs: list[list[Mapping[str, Any]]], model_of: list[OperatingModel],
                             min_plain_windows: int = 3) -> dict[str, list[float]]:
    """log(predicted / measured) of each run's first speculative window under each prior (``"model"``: the
    model's step; ``"plain"``: the plain steps' line fit so far), for runs with ``min_plain_windows`` plain
    windows before it."""
    errors: dict[str, list[float]] = {"model": [], "plain": []}
    make = _shipped_fits()["line"]
    for telemetry_seq, model in zip(runs, model_of, strict=True):
        plain_fit = make()
        done = False
        for telemetry in telemetry_seq:
            for kind, batch, ms, fixed, per_row in window_steps(telemetry, model):
                if kind == "plain":
                    plain_fit.observe(ms, fixed, per_row, batch)
                elif plain_fit.windows >= min_plain_windows:
                    measured = ms / (fixed + per_row * batch)
                    errors["model"].append(math.log(1.0 / measured))
                    errors["plain"].append(math.log(plain_fit.at(fixed, per_row, batch) / measured))
                    done = True
                else:
                    done = True  # drafted before plain steps had taught anything: not a prior's test
            if done:
                break
    return errors


def _error_summary(errors: list[float]) -> dict[str, float]:
    e = np.asarray(errors)
    return {"windows": int(e.size), "bias": round(float(e.mean()), 3), "mean_abs": round(float(np.abs(e).mean()), 3),
            "p90_abs": round(float(np.quantile(np.abs(e), 0.9)), 3), "max_abs": round(float(np.abs(e).max()), 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ticks", nargs="+", help="benchmarks/load.py --ticks files")
    ap.add_argument("--fits", action="store_true", help="also each fit shape's one-window-ahead prediction error, "
                    "over every file's runs")
    ap.add_argument("--first-speculative", action="store_true", help="also each run's first speculative window "
                    "predicted under the model's step and under the plain steps' fit (draft_prior)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    default_model = OperatingModel.load(DEFAULT_MODEL_PATH)
    out: dict[str, Any] = {"benchmark": "step_ratios", "command": " ".join([sys.executable, *sys.argv]),
                           "files": {}}
    runs: list[list[Mapping[str, Any]]] = []
    models: list[OperatingModel] = []
    for path in args.ticks:
        try:
            histories = load_histories(path)
        except ValueError as exc:
            raise SystemExit(f"step_ratios: {exc}") from None
        cells: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for history in histories.values():
            span = last_policy_span(history)
            model = span.operating_model or default_model
            runs.append([entry.get("telemetry") or {} for entry in span.ticks])
            models.append(model)
            for entry in span.ticks:
                for kind, batch, ratio in window_ratios(entry.get("telemetry") or {}, model):
                    cells[kind][max(1, round(batch))].append(ratio)
        out["files"][path] = {
            kind: {str(b): {"windows": len(v), "mean": round(statistics.fmean(v), 3),
                            "min": round(min(v), 3), "max": round(max(v), 3)}
                   for b, v in sorted(by_batch.items())}
            for kind, by_batch in sorted(cells.items())
        }
    if args.fits:
        out["fit_errors"] = {name: {group: _error_summary(e) for group, e in sorted(groups.items())}
                             for name, groups in fit_errors(runs, models).items()}
    if args.first_speculative:
        out["first_speculative"] = {prior: _error_summary(e) for prior, e in
                                    first_speculative_errors(runs, models).items() if e}
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
