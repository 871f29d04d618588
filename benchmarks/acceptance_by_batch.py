"""Acceptance against the engine batch: does a row's draft depend on the other rows in its batch?

torch's int8 *dynamically* quantized draft (``--draft-dtype int8``, the default pair's draft until
session 10) computes one activation scale per quantized linear over its whole input tensor, i.e. over
every row of the batch, so a row's draft distribution moves with its neighbours while the fp32 target
does not; the per-row draft (``int8-row``, the default now) should not. This script measures both
halves (JSON to stdout and ``--out``):

* ``logits``: the next-token distributions of one prompt alone and batched with another prompt of the
  same length (no padding), for the target and for the draft (max |Δ logit| and total variation);
* ``acceptance``: the calibration sweep (``decoder.calibration.measure_acceptance``: the calibration
  prompts and seeds, temperature 1, kl, k = 4) at each ``--batches`` engine batch size and each
  ``--thresholds`` T: tokens per row-iteration and the acceptance rate.

With ``--batch-profile-out PATH`` it fits an odds multiplier per measured (batch size, T), relative to
the batch that profile's acceptance was calibrated at (``sim.profile_fit.fit_batch_acceptance``;
``batch_fit`` in the JSON) and writes the profile already at PATH (a fresh calibration; the shipped
profile where PATH does not exist yet) with that ``batch_acceptance`` section — and, where the run recorded
accepted / drafted per request, the per-request spread κ fitted within each (batch, T)
(``sim.profile_fit.fit_request_acceptance``) as its ``request_acceptance``. ``--refit JSON`` does the fit from an
earlier run's measurements, without the models.

With ``--profile-batch B --profile-out PATH`` it also writes the shipped profile with its acceptance
(kl, k = 4, the profile's whole T grid) re-measured at engine batch B and its latency unchanged: the
profile to re-simulate a service that ran at mean batch ~B (``benchmarks/fidelity.py --resim ... --profile``).

    .venv/bin/python benchmarks/acceptance_by_batch.py --batches 1,2,8 --thresholds 0,1   # ~6 min
    .venv/bin/python benchmarks/acceptance_by_batch.py --batches 2 --thresholds 0 \\
        --profile-batch 2 --profile-out results/profile_acceptance_b2.json                 # ~5 min
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import emit  # noqa: E402


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def _ints(text: str) -> tuple[int, ...]:
    values = tuple(int(x) for x in text.split(","))
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be integers >= 1, got {text!r}")
    return values


_SECTIONS = ("batch_acceptance", "request_acceptance")


def _sections(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [x for x in names if x not in _SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"sections are {', '.join(_SECTIONS)}; got {text!r}")
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="smollm2-135m")
    ap.add_argument("--batches", type=_ints, default=(1, 2, 8))
    ap.add_argument("--thresholds", type=_floats, default=(0.0, 1.0))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a serving replica's default: 1)")
    ap.add_argument("--draft-dtype", default=None,
                    help="draft dtype override: int8 (per-tensor activations), int8-row (per-row: batch-invariant) or a float dtype")
    ap.add_argument("--prompts", type=int, default=None,
                    help="calibration prompts per (batch, T) (default: the shipped calibration's; at most 16)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="tokens per request (default: the shipped calibration's, 40); answer positions matter")
    ap.add_argument("--profile-batch", type=int, default=None)
    ap.add_argument("--profile-out", default=None)
    ap.add_argument("--batch-profile-out", default=None,
                    help="write the profile at this path (the shipped one where none is there yet) with batch_acceptance "
                    "fitted to these measurements")
    ap.add_argument("--sections", type=_sections, default=_SECTIONS,
                    help="which fitted sections --batch-profile-out writes (comma-separated; default both): "
                    "request_acceptance alone for a batch-invariant draft, whose batch multipliers are ~1 "
                    "and would add only their noise (they are still fitted and reported where the reference batch "
                    "was measured)")
    ap.add_argument("--refit", default=None, help="an earlier run's JSON: fit from its measurements (no models)")
    ap.add_argument("--out", default="results/acceptance_by_batch.json")
    args = ap.parse_args()
    if (args.profile_batch is None) != (args.profile_out is None):
        raise SystemExit("--profile-batch and --profile-out go together")
    if args.refit is not None and args.profile_batch is not None:
        raise SystemExit("--refit measures nothing: it cannot go with --profile-batch")
    command = " ".join([sys.executable, *sys.argv])
    if args.refit is not None:
        try:
            out = json.loads(Path(args.refit).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SystemExit(f"--refit {args.refit!r}: {exc}") from None
        out["measured_by"] = out.get("command")
        out["command"] = command
    else:
        out = _measure(args, command)
    status = 0
    if args.batch_profile_out is not None:
        try:
            out["batch_fit"] = _write_batch_profile(out["acceptance"], args.batch_profile_out, command, args.sections)
        except ValueError as exc:  # the measurement is still written (--refit can fit it later)
            out["batch_fit"] = {"error": str(exc)}
            print(f"acceptance_by_batch: error: {exc}", file=sys.stderr)
            status = 2

    emit(out, args.out)
    return status


def _write_batch_profile(acceptance: list[dict[str, Any]], path: str, command: str,
                         sections: tuple[str, ...] = _SECTIONS) -> dict[str, Any]:
    from sim.profile import DEFAULT_PROFILE_PATH, Profile
    from sim.profile_fit import BatchAcceptanceSample, fit_batch_acceptance, fit_request_acceptance

    # Fit into the profile already at ``path`` (a fresh `fsd calibrate` output): basing on the shipped
    # one would overwrite that calibration's latency and acceptance with another machine's.
    base = Profile.load(path if Path(path).is_file() else DEFAULT_PROFILE_PATH)
    reference = int((base.calibration or {}).get("settings", {}).get("acceptance_batch_size", 8))
    samples = [BatchAcceptanceSample(batch=int(a["batch"]), threshold=float(a["threshold"]),
                                     tokens_per_row_iteration=float(a["tokens_per_row_iteration"]),
                                     row_iterations=int(a["row_iterations"])) for a in acceptance]
    update: dict[str, Any] = {}
    out: dict[str, Any] = {"reference_batch": reference, "thresholds": None, "odds_scale": None}
    if "batch_acceptance" in sections or any(s.batch == reference for s in samples):
        # Multipliers are relative to the reference batch: without it only κ can be fitted (ValueError naming the
        # batch when the batch section is asked for).
        fitted = fit_batch_acceptance(base, samples, reference, source=command)
        update["batch_acceptance"] = fitted
        out.update(thresholds=fitted.thresholds, odds_scale=fitted.odds_scale)
    # Per-request spread (κ), each (batch, T) about its own mean, where the run recorded requests.
    counted = [a for a in acceptance if a.get("request_accepted") is not None]
    if counted:
        accepted = [x for a in counted for x in a["request_accepted"]]
        drafted = [x for a in counted for x in a["request_drafted"]]
        groups = [f"{a['batch']}/{a['threshold']}" for a in counted for _ in a["request_accepted"]]
        variation = fit_request_acceptance(accepted, drafted, groups=groups,
                                           source=f"{len(accepted)} requests in {len(counted)} (batch, T) groups: {command}")
        out["request_concentration"] = None if variation is None else variation.concentration
        if variation is not None:
            update["request_acceptance"] = variation
    base.model_copy(update={key: value for key, value in update.items() if key in sections}).save(path)
    return {**out, "profile_out": path, "sections_written": [key for key in update if key in sections]}


def _measure(args: argparse.Namespace, command: str) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from decoder.calibration import CalibrationRecord, CalibrationSettings, Measurement, measure_acceptance
    from decoder.pairs import load_pair
    from sim.profile import DEFAULT_PROFILE_PATH, Profile
    from sim.profile_fit import fit_profile

    torch.set_num_threads(args.threads)
    pair = load_pair(args.pair, draft_dtype=args.draft_dtype)
    from decoder.models import describe_dtype

    out: dict[str, Any] = {"benchmark": "acceptance_by_batch", "pair": pair.name, "draft": describe_dtype(pair.draft),
                           "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                           "torch_threads": torch.get_num_threads(), "command": command}

    # One prompt alone vs beside another of the same length (no padding: only the neighbour differs).
    tok = pair.tokenizer
    a = tok("The quick brown fox jumps over the lazy dog and then", return_tensors="pt").input_ids
    b = tok("def fibonacci(n): return n if n < 2 else fibonacci(n-1) +", return_tensors="pt").input_ids
    n = min(a.shape[1], b.shape[1])
    a, b = a[:, :n], b[:, :n]
    out["logits"] = {}
    for name in ("target", "draft"):
        model = getattr(pair, name)
        with torch.no_grad():
            alone = model(input_ids=a).logits[0, -1].float()
            beside = model(input_ids=torch.cat([a, b])).logits[0, -1].float()
        tv = 0.5 * (alone.softmax(-1) - beside.softmax(-1)).abs().sum()
        out["logits"][name] = {"max_abs_logit_diff": float((alone - beside).abs().max()), "tv": float(tv)}

    shipped = Profile.load(DEFAULT_PROFILE_PATH)
    base = CalibrationRecord.model_validate({k: v for k, v in (shipped.calibration or {}).items() if k != "fit"})
    common = {**base.settings.model_dump(), "divs": ("kl",), "acceptance_ks": (4,), "default_div": "kl",
              "default_k": 4}
    if args.prompts is not None:
        common["prompts"] = args.prompts
    if args.max_new_tokens is not None:
        common["max_new_tokens"] = args.max_new_tokens
    out["acceptance"] = []
    for batch in args.batches:
        settings = CalibrationSettings.from_dict({**common, "thresholds": {"kl": args.thresholds},
                                                  "acceptance_batch_size": batch})
        t0 = time.perf_counter()
        for s in measure_acceptance(pair, settings):
            out["acceptance"].append({
                "batch": batch, "threshold": s.threshold, "row_iterations": s.row_iterations,
                "tokens_per_row_iteration": s.emitted_tokens / s.row_iterations,
                "acceptance_rate": s.accepted / s.drafted if s.drafted else None,
                "request_accepted": s.request_accepted, "request_drafted": s.request_drafted})
        print(f"acceptance_by_batch: batch {batch} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    if args.profile_batch is not None:
        settings = CalibrationSettings.from_dict({**common, "thresholds": {"kl": base.settings.thresholds["kl"]},
                                                  "acceptance_batch_size": args.profile_batch})
        record = base.model_copy(update={"settings": settings, "acceptance": measure_acceptance(pair, settings)})
        prov = shipped.provenance
        measurement = Measurement(
            record=record, pair=prov.pair, dtype=prov.dtype, machine=prov.machine, torch_version=prov.torch_version,
            transformers_version=prov.transformers_version, date=prov.date,
            setup_notes=(f"The shipped profile ({DEFAULT_PROFILE_PATH.name}) with its acceptance re-measured at "
                         f"engine batch {args.profile_batch} (kl, k = 4, its T grid, {settings.prompts} prompts x "
                         f"{settings.max_new_tokens} tokens); latency as shipped."),
            run_notes="Written by benchmarks/acceptance_by_batch.py.")
        fit_profile(measurement, command=out["command"]).save(args.profile_out)
        out["profile_out"] = args.profile_out
    return out


if __name__ == "__main__":
    sys.exit(main())
