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
shipped spec's settings, read at that window's composition). With ``--noise`` it reports how the serving machine's
steps depart from the model in the simulator's terms (:func:`step_noise`: each kind's shape by batch, the spread
between runs, per-step jitter, drift; and :func:`prefill_noise`: the joins' prefills against the calibrated
profile's, at the mean prompt of the report each ticks file names), what ``benchmarks/load_sim.py --step-noise``
simulates. With ``--against NOISE`` (such a report) it gives each file's steps off that simulated machine
(:func:`machine_offsets`): whether the live machine a run was on is the one the simulator runs. Prints JSON (and
writes ``--out``)::

    .venv/bin/python benchmarks/step_ratios.py docs/img/load_economy_s4{0,1}_t97_ttft4_s32_ticks.json.gz --fits
    .venv/bin/python benchmarks/step_ratios.py docs/img/load_economy_s*_ticks.json.gz --noise --out results/noise.json
    .venv/bin/python benchmarks/step_ratios.py docs/img/load_economy_s6*_ticks.json.gz --against results/noise.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterator, Mapping
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
from sim.profile import LatencyModel, Profile  # noqa: E402


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


def _shipped_fits(step_slope_prior: float | None = None) -> dict[str, Any]:
    """Per shape, a maker of a fresh fit of a kind of step (``speculative``: True / False) at the shipped spec's step
    decay, slope priors (the plain fit's ``step_slope_prior``, the speculative fits' ``draft_slope_prior``) and batch
    limit; ``step_slope_prior`` given: every line fit at that prior instead."""
    p = MPCParams()

    def prior(speculative: bool) -> float:
        if step_slope_prior is not None:
            return step_slope_prior
        return p.draft_slope_prior if speculative and p.draft_slope_prior is not None else p.step_slope_prior

    return {"line": lambda speculative: StepCorrection(decay=p.step_decay, slope_prior=prior(speculative)),
            "batch": lambda speculative: BatchStepCorrection(p.max_batch, decay=p.step_decay)}


def fit_errors(runs: list[list[Mapping[str, Any]]], model_of: list[OperatingModel],
               min_windows: int = 3, step_slope_prior: float | None = None) -> dict[str, dict[str, list[float]]]:
    """log(predicted / measured) of each fit shape's prediction of every window's ratio before observing it, per
    group (``"plain rows 1-2"``, ``"speculative rows 4+"``, ``"plain after a rise"``, ...). ``runs``: each run's
    telemetry in order; a fit predicts once it has ``min_windows`` windows of its kind (k_max apart); the line fits
    at the shipped spec's priors, or every one at ``step_slope_prior``."""
    makers = _shipped_fits(step_slope_prior)
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
                    fits[name].setdefault(kind, make(kind != "plain")).observe(ms, fixed, per_row, batch)
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
        plain_fit = make(False)
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


def kind_windows(runs: list[list[Mapping[str, Any]]], model_of: list[OperatingModel], kind: str) -> Iterator[
        tuple[int, Mapping[str, Any], float, float, float, float, float]]:
    """Each window's steps of one ``kind`` ("plain" or "speculative"): (run index, telemetry, mean batch, measured
    mean step ms, the model's fixed ms, its per-row ms, steps)."""
    for run, (telemetry_seq, model) in enumerate(zip(runs, model_of, strict=True)):
        for telemetry in telemetry_seq:
            steps = float((telemetry.get(f"{kind}_steps") or {}).get("steps") or 0)
            for k, batch, ms, fixed, per_row in window_steps(telemetry, model):
                if ("plain" if k == "plain" else "speculative") == kind:
                    yield run, telemetry, batch, ms, fixed, per_row, steps


def noise_windows(runs: list[list[Mapping[str, Any]]], model_of: list[OperatingModel], kind: str, min_steps: int,
                  batch_tolerance: float) -> tuple[list[tuple[int, Mapping[str, Any], int, float, float]], int]:
    """The windows the machine's noise is read from (see :func:`step_noise`), for one ``kind`` ("plain" or
    "speculative"): (run index, telemetry, whole batch, log(measured / modelled), steps) for each window of
    ``min_steps`` steps or more of that kind whose mean batch is within ``batch_tolerance`` of a whole number, and
    how many windows were left out for a mixed batch."""
    read: list[tuple[int, Mapping[str, Any], int, float, float]] = []
    mixed_batches = 0
    for run, telemetry, batch, ms, fixed, per_row, steps in kind_windows(runs, model_of, kind):
        if steps < min_steps:
            continue
        if abs(batch - round(batch)) > batch_tolerance:
            mixed_batches += 1
            continue
        read.append((run, telemetry, max(1, round(batch)), math.log(ms / (fixed + per_row * batch)), steps))
    return read, mixed_batches


def scale_sums(runs: list[list[Mapping[str, Any]]], model_of: list[OperatingModel], kind: str,
               batch_tolerance: float, min_steps: int = 4) -> dict[int, tuple[float, float, int, float]]:
    """Per whole batch, (measured ms, modelled ms, windows, steps) summed over the windows' steps of ``kind``
    ("plain" or "speculative"): a plain window of ``min_steps`` steps or more whose mean batch is within
    ``batch_tolerance`` of a whole number (the plain table's curvature), every speculative window at its rounded
    batch (the model is a line in rows: a window's mean batch reads its steps' mean exactly), however few steps.

    Why the speculative windows are not filtered: a speculative step at k = 6 takes 0.3 s at one row and 0.4-0.6 s at
    five to eight, so a one-second window holds one to three, and keeping those with four keeps the fast steps. Live
    (seeds 67-73) that read the speculative steps at 0.97-1.01x the model at one to four rows and left five to eight
    rows with a handful of windows, where the sums over every window read 1.03-1.09x and 1.13-1.19x. Why the plain
    ones are: a request joining an idle replica is counted as a plain step of ~1 ms (its prefill's iteration), and
    the windows holding one are the one-step windows that read 0.02x; the simulator counts no such step."""
    sums: dict[int, tuple[float, float, int, float]] = {}
    for _, _, batch, ms, fixed, per_row, steps in kind_windows(runs, model_of, kind):
        if kind == "plain" and (steps < min_steps or abs(batch - round(batch)) > batch_tolerance):
            continue
        whole = max(1, round(batch))
        measured, modelled, n_windows, n_steps = sums.get(whole, (0.0, 0.0, 0, 0.0))
        sums[whole] = (measured + ms * steps, modelled + (fixed + per_row * batch) * steps, n_windows + 1,
                       n_steps + steps)
    return sums


def step_noise(runs: list[list[Mapping[str, Any]]], model_of: list[OperatingModel], kind: str = "plain",
               passes: int = 5, max_lag: int = 5, min_steps: int = 4, batch_tolerance: float = 0.1) -> dict[str, Any]:
    """How a live machine's steps depart from the model, in the simulator's terms (``LatencyModel``'s step drift):
    each window's log(measured / modelled) mean step of ``kind`` as a run's offset + a shape by batch + a drift
    + per-step jitter averaged over the window's steps,

        log r_w = o_run + g(B_w) + d(t_w) + e_w,   Var e_w = σ_jitter² / steps_w,  d an Ornstein-Uhlenbeck
        process (stationary σ_drift, correlation time τ).

    o and g by alternating means (``passes``). The drift from the residuals' covariance over lags of 1..``max_lag``
    windows within a run, σ_drift² · exp(−lag · window / τ): the jitter is independent between windows, so those
    covariances are the drift's alone, and their log-linear fit gives τ (slope) and σ_drift² (extrapolated to lag
    0). The jitter from what the drift leaves of the squared residuals, regressed on 1 / steps through the origin.
    A run's offset is its own mean: drift slower than a run reads as offset (``run_offset.sd`` between runs).

    The scales by batch are arithmetic means, as the simulator's factors (each of mean 1) make them: measured over
    modelled time summed over the windows at that batch (:func:`scale_sums`: every speculative window, plain ones of
    ``min_steps`` steps or more; ``windows`` and ``steps`` count them). With fewer than ten windows for the fit, the
    scales alone are returned. The fit above reads windows of ``min_steps`` steps or more: a window of one to three
    steps reads 0.02-1.5x the model on its own (a join's ~1 ms prefill iteration counted as a step, a handful of
    steps' jitter unaveraged), which is not the shape a drift and a jitter describe. So are
    windows whose mean batch is more than ``batch_tolerance`` from a whole number: the model is read at the mean
    batch, and a window that mixes, say, two and four rows would put the table's curvature (the 58 -> 86 ms jump
    between three and four rows) into the shape at three."""
    read, mixed_batches = noise_windows(runs, model_of, kind, min_steps, batch_tolerance)
    rows = [(run, float(telemetry.get("time_s", math.nan)), batch, log_ratio, steps)
            for run, telemetry, batch, log_ratio, steps in read]  # (run, time_s, batch, log ratio, steps)
    windows = [float(telemetry.get("window_s", math.nan)) for _, telemetry, _, _, _ in read]
    # The shape by batch as multipliers of the model's mean step (the runs' offsets folded in; sums, see above).
    scales = {str(v): {"scale": round(measured / modelled, 4), "windows": n_windows, "steps": int(n_steps)}
              for v, (measured, modelled, n_windows, n_steps) in sorted(
                  scale_sums(runs, model_of, kind, batch_tolerance, min_steps).items()) if modelled > 0}
    if len(rows) < 10:
        return {"windows": len(rows), "mixed_batch_windows": mixed_batches, **({"scale_by_batch": scales} if scales
                                                                               else {})}
    run_idx = np.array([r[0] for r in rows])
    t = np.array([r[1] for r in rows])
    b = np.array([r[2] for r in rows])
    y = np.array([r[3] for r in rows])
    steps = np.array([r[4] for r in rows])
    runs_present = np.unique(run_idx)
    batches = np.unique(b)
    offset = np.zeros(run_idx.max() + 1)
    shape = dict.fromkeys(batches.tolist(), 0.0)
    for _ in range(passes):
        g = np.array([shape[v] for v in b.tolist()])
        for r in runs_present:
            offset[r] = float((y - g)[run_idx == r].mean())
        o = offset[run_idx]
        for v in batches.tolist():
            shape[v] = float((y - o)[b == v].mean())
    mean_offset = float(offset[runs_present].mean())
    offset_sd = float(offset[runs_present].std(ddof=1)) if runs_present.size > 1 else 0.0
    residual = y - offset[run_idx] - np.array([shape[v] for v in b.tolist()])
    # The residuals' covariance at lags of 1..max_lag windows, within runs (the jitter adds to lag 0 alone).
    covariance: dict[int, list[float]] = defaultdict(list)
    window = float(np.median(windows))
    for r in runs_present:
        sel = np.flatnonzero(run_idx == r)
        slot = {int(round(tw / window)): i for tw, i in zip(t[sel].tolist(), sel.tolist(), strict=True)}
        for at, i in slot.items():
            for lag in range(1, max_lag + 1):
                j = slot.get(at + lag)
                if j is not None:
                    covariance[lag].append(float(residual[i] * residual[j]))
    mean_cov = {lag: float(np.mean(c)) for lag, c in covariance.items() if len(c) >= 10}
    total_var = float(np.mean(residual**2))
    lags = [lag for lag in range(1, max_lag + 1) if mean_cov.get(lag, 0.0) > 0]
    # The positive lags must start at 1 and run on without a gap: past the first non-positive one, the covariance
    # is noise about 0, not the drift's tail.
    lags = [lag for i, lag in enumerate(lags) if lag == i + 1]
    tau, drift_var = math.nan, 0.0
    if len(lags) >= 2:
        slope, intercept = (float(x) for x in np.polyfit(lags, [math.log(mean_cov[lag]) for lag in lags], 1))
        if slope < 0:
            tau = -window / slope
            drift_var = min(math.exp(intercept), total_var)
        else:  # no decay within max_lag windows: slower than the lags see, its level the lags' mean
            tau = math.inf
            drift_var = min(float(np.mean([mean_cov[lag] for lag in lags])), total_var)
    elif lags:  # lag 1 alone: the drift decays within about a window; taken as e-folding over one
        tau = window
        drift_var = min(mean_cov[1] * math.e, total_var)
    # E[res² − σ_drift²] = σ_jitter² / steps: least squares through the origin.
    inv = 1.0 / steps
    jitter_var = max(float(np.sum((residual**2 - drift_var) * inv) / np.sum(inv * inv)), 0.0)
    lag1 = mean_cov[1] / total_var if 1 in mean_cov and total_var > 0 else math.nan
    return {
        "kind": kind, "windows": len(rows), "mixed_batch_windows": mixed_batches, "runs": int(runs_present.size),
        "run_offset": {"mean": round(mean_offset, 4), "sd": round(offset_sd, 4) if runs_present.size > 1 else None},
        "scale_by_batch": scales,
        "residual_sd": round(math.sqrt(total_var), 4),
        "drift_sigma": round(math.sqrt(drift_var), 4), "jitter_sigma": round(math.sqrt(jitter_var), 4),
        "window_s": round(window, 3), "lag_pairs": {str(lag): len(covariance[lag]) for lag in range(1, max_lag + 1)},
        "lag_covariance": {str(lag): round(c, 5) for lag, c in sorted(mean_cov.items())},
        "lag1_correlation": round(lag1, 3) if math.isfinite(lag1) else None,
        "drift_tau_s": round(tau, 2) if math.isfinite(tau) else None,
    }


def prefill_noise(runs: list[list[Mapping[str, Any]]], prompt_tokens: list[float],
                  latency: LatencyModel) -> dict[str, Any]:
    """How a live machine's joins' prefills compare with ``latency``'s target prefill (the simulator's), from windows
    with exactly one arrival, none refused, and a measured prefill: measured / modelled at the run's mean prompt
    (``prompt_tokens``, one per run). The scale is the median: a window that also holds the previous window's
    arrival's prefill reads double, and the mean would count it (the simulator adds its own spread on top)."""
    ratios: list[float] = []
    for telemetry_seq, prompt in zip(runs, prompt_tokens, strict=True):
        modelled = latency.target_prefill_ms(prompt)
        for telemetry in telemetry_seq:
            measured = telemetry.get("prefill_ms")
            if (telemetry.get("arrivals") != 1 or telemetry.get("rejections") or measured is None
                    or not math.isfinite(float(measured)) or float(measured) <= 0):
                continue
            ratios.append(float(measured) / modelled)
    if len(ratios) < 10:
        return {"windows": len(ratios)}
    q10, q50, q90 = np.quantile(ratios, [0.1, 0.5, 0.9])
    return {"windows": len(ratios), "scale": round(float(q50), 4), "mean": round(statistics.fmean(ratios), 4),
            "q10": round(float(q10), 4), "q90": round(float(q90), 4)}


def machine_offsets(runs: list[list[Mapping[str, Any]]], model_of: list[OperatingModel], noise: Mapping[str, Any],
                    batch_tolerance: float = 0.1) -> dict[str, Any]:
    """How far ``runs``' steps sit from a simulated machine (``noise``: a ``--noise`` report's ``"noise"``), per kind:
    log(measured / the machine's time) summed over the windows :func:`step_noise` takes its scales from
    (:func:`scale_sums`, at a whole batch the machine has a scale for), where the machine's time is the
    model's × its scale at the batch, and that in the machine's spread of a run's offset (``z``). Near 0 where the
    runs are of the machine measured; a run's own offset spreads by ``run_offset.sd`` about it."""
    out: dict[str, Any] = {}
    for kind in ("plain", "speculative"):
        entry = noise.get(kind) or {}
        scales = {int(b): float(v["scale"]) for b, v in (entry.get("scale_by_batch") or {}).items()}
        sums = {b: cell for b, cell in scale_sums(runs, model_of, kind, batch_tolerance).items() if b in scales}
        measured = sum(cell[0] for cell in sums.values())
        machine = sum(scales[b] * cell[1] for b, cell in sums.items())
        if not machine > 0:
            out[kind] = {"windows": 0}
            continue
        offset = math.log(measured / machine)
        sd = float((entry.get("run_offset") or {}).get("sd") or math.nan)
        out[kind] = {"windows": sum(cell[2] for cell in sums.values()), "offset": round(offset, 4),
                     "z": round(offset / sd, 2) if sd > 0 else None}
    return out


#: A run's own offsets leave out its first windows (they can still hold the steps of the run before it: the load
#: generator starts the next configuration at once) and need this many windows of a kind: one window is a step or
#: two, not a host's speed.
RUN_SKIP_WINDOWS = 2
RUN_MIN_WINDOWS = 5


def run_offsets(telemetry: list[Mapping[str, Any]], model: OperatingModel, machine: Mapping[str, Any],
                skip: int = RUN_SKIP_WINDOWS, min_windows: int = RUN_MIN_WINDOWS) -> dict[str, Any]:
    """One run's :func:`machine_offsets` (its windows in order) without its first ``skip`` windows; a kind with fewer
    than ``min_windows`` windows keeps its count and gets no offset."""
    out = machine_offsets([list(telemetry[skip:])], [model], machine)
    for kind, entry in out.items():
        if entry.get("windows", 0) < min_windows:
            out[kind] = {"windows": entry.get("windows", 0)}
    return out


def named_report(ticks_path: str) -> dict[str, Any] | None:
    """The ``benchmarks/load.py`` report a ``--ticks`` file names (None where it names none or it cannot be read)."""
    try:
        p = Path(ticks_path)
        raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
        report: dict[str, Any] = json.loads(Path(json.loads(raw)["report"]).read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return report


def round_attainment(report: Mapping[str, Any], run: Mapping[str, Any]) -> float | None:
    """A run's (one round's) attainment as ``benchmarks/load.py`` scores it: every target its configuration states."""
    from benchmarks.load import summarise

    config: Mapping[str, Any] = next((c for c in report.get("configs", []) if c.get("name") == run["name"]), {})
    score = summarise({**run, "spec": None}, config.get("tpot_target_ms"), 1.0,
                      config.get("ttft_target_ms")).get("slo_attainment")
    return None if score is None else round(float(score), 4)


def run_attainment(ticks_path: str) -> dict[str, float]:
    """Each run's attainment by ``NAME:ROUND`` (:func:`round_attainment`), from the report a ``--ticks`` file names
    (empty where it names none or the report is not there)."""
    report = named_report(ticks_path)
    out: dict[str, float] = {}
    for run in (report or {}).get("runs", []):
        score = round_attainment(report or {}, run)
        if score is not None:
            out[f"{run['name']}:{run['round']}"] = score
    return out


def report_prompt_tokens(ticks_path: str, default: float) -> float:
    """Mean prompt tokens of the requests of the report a ``--ticks`` file names (``default`` where it names none or
    the report is not there)."""
    report = named_report(ticks_path)
    try:
        prompts = [float(r["prompt_tokens"]) for run in (report or {}).get("runs", []) for r in run["records"]
                   if r.get("prompt_tokens")]
    except (KeyError, TypeError, ValueError):
        return default
    return statistics.fmean(prompts) if prompts else default


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
    ap.add_argument("--noise", action="store_true", help="also the steps' departure from the model as the simulator's "
                    "step drift models it: run offset, shape by batch, drift and jitter (plain and speculative steps)")
    ap.add_argument("--prompt-tokens", type=float, default=40.0, help="--noise: a run's prompt length where its "
                    "ticks file names no report to read it from (load.py's default prompts are 35-41 tokens)")
    ap.add_argument("--against", default=None, metavar="NOISE", help="also each file's steps off the simulated machine "
                    "a --noise report describes (its shape by batch): the mean log offset and its z in the machine's "
                    "spread of a run's offset; is the live machine the one the simulator runs?")
    ap.add_argument("--per-run", action="store_true", help="with --against: also each run's offsets (its windows "
                    "alone, the first two left out, five or more of a kind) beside its attainment from the report the ticks file names: was a run's host slower than "
                    "its neighbours'? (runs of one seed are minutes apart; the host's speed moves between them)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.per_run and not args.against:
        raise SystemExit("step_ratios: --per-run needs --against NOISE (the machine the offsets are taken from)")
    machine: Mapping[str, Any] | None = None
    if args.against:
        try:
            machine = json.loads(Path(args.against).read_text())["noise"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"step_ratios: --against {args.against}: {exc}") from None
    default_model = OperatingModel.load(DEFAULT_MODEL_PATH)
    out: dict[str, Any] = {"benchmark": "step_ratios", "command": " ".join([sys.executable, *sys.argv]),
                           "files": {}}
    runs: list[list[Mapping[str, Any]]] = []
    models: list[OperatingModel] = []
    prompts: list[float] = []
    for path in args.ticks:
        try:
            histories = load_histories(path)
        except ValueError as exc:
            raise SystemExit(f"step_ratios: {exc}") from None
        prompt = report_prompt_tokens(path, args.prompt_tokens) if args.noise else args.prompt_tokens
        cells: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        first_run = len(runs)
        per_run: list[dict[str, Any]] = []
        attainment = run_attainment(path) if args.per_run else {}
        for label, history in histories.items():
            span = last_policy_span(history)
            model = span.operating_model or default_model
            runs.append([entry.get("telemetry") or {} for entry in span.ticks])
            models.append(model)
            prompts.append(prompt)
            if args.per_run and machine is not None:
                starts = [float(entry["time_s"]) for entry in history if entry.get("time_s") is not None]
                per_run.append({"run": label, "start_s": round(min(starts), 1) if starts else None,
                                "slo_attainment": attainment.get(label),
                                **run_offsets(runs[-1], models[-1], machine)})
            for entry in span.ticks:
                for kind, batch, ratio in window_ratios(entry.get("telemetry") or {}, model):
                    cells[kind][max(1, round(batch))].append(ratio)
        out["files"][path] = {
            kind: {str(b): {"windows": len(v), "mean": round(statistics.fmean(v), 3),
                            "min": round(min(v), 3), "max": round(max(v), 3)}
                   for b, v in sorted(by_batch.items())}
            for kind, by_batch in sorted(cells.items())
        }
        if machine is not None:
            out.setdefault("against", {"noise": args.against, "files": {}})["files"][path] = machine_offsets(
                runs[first_run:], models[first_run:], machine)
            if args.per_run:
                out["against"]["files"][path]["runs"] = sorted(per_run, key=lambda r: r["start_s"] or 0.0)
    if args.fits:
        out["fit_errors"] = {name: {group: _error_summary(e) for group, e in sorted(groups.items())}
                             for name, groups in fit_errors(runs, models).items()}
    if args.first_speculative:
        out["first_speculative"] = {prior: _error_summary(e) for prior, e in
                                    first_speculative_errors(runs, models).items() if e}
    if args.noise:
        out["noise"] = {kind: step_noise(runs, models, kind) for kind in ("plain", "speculative")}
        # Against the calibrated profile's prefill: the simulator's replica runs it (the policy's model is its own).
        out["noise"]["prefill"] = prefill_noise(runs, prompts, Profile.default().latency)
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
