"""``fsd calibrate``: measure a model pair with the real engine and write the simulator's profile.

Examples::

    fsd calibrate --pair smollm2-135m --out sim/profiles/smollm2-135m.json        # full (~5-10 min, 2 cores)
    fsd calibrate --pair smollm2-135m --out /tmp/quick.json --quick               # smoke (< 1 min)
    fsd calibrate --pair smollm2-135m --out p.json --divs kl --ks 4 --thresholds kl=0,0.5,1,2

The headline numbers (acceptance and tokens per iteration per T, iteration time per batch size) are
printed as JSON on stdout; the progress bar goes to stderr. See docs/calibration.md,
decoder/calibration.py (what is measured) and sim/profile_fit.py (how it is fitted).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch-heavy; imported in the handlers
    from decoder.calibration import CalibrationSettings
    from decoder.models import ModelPair
    from sim.profile import Profile


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "calibrate",
        help="measure acceptance, distortion and latency of a model pair and write a simulator profile",
        description="Sweep div x T x k x batch size through the engine's step API and write the Profile JSON "
        "the simulator reads (sim/profile.py).",
    )
    parser.add_argument("--pair", default="smollm2-135m", help="pair name (see `fsd models list`) or 'tiny'")
    parser.add_argument("--out", required=True, type=Path, help="where to write the profile JSON")
    parser.add_argument("--quick", action="store_true", help="smoke run: kl only, k=4, coarse grid (< 1 min)")
    parser.add_argument("--divs", help="comma-separated divergences (default kl,js,draft_tokens)")
    parser.add_argument(
        "--thresholds",
        action="append",
        metavar="[DIV=]T1,T2,...",
        help="T grid, for one div (DIV=...) or for all; repeatable; T=0 is always added",
    )
    parser.add_argument("--ks", help="comma-separated draft lengths (default 2,4,6)")
    parser.add_argument(
        "--acceptance-ks", help="draft lengths of the acceptance sweep only (default: --ks); timing sweeps --ks"
    )
    parser.add_argument("--batch-sizes", help="comma-separated batch sizes for timing (default 1,2,4,8)")
    parser.add_argument(
        "--prompts", type=int,
        help="prompts per acceptance grid point (default 6 of the built-in 16; all of a given set)")
    prompt_source = parser.add_mutually_exclusive_group()
    prompt_source.add_argument(
        "--prompt-set", choices=("builtin", "serving"),
        help="the acceptance sweep's prompts: 'builtin' (16 long-answer chat and code prompts, the default) or "
        "'serving' (the short chat prompts `fsd demo` and benchmarks/load.py send)")
    prompt_source.add_argument(
        "--prompts-file", type=Path, metavar="PATH",
        help="the acceptance sweep's prompts, one per line (blank lines skipped): calibrate on prompts like the "
        "traffic served, as acceptance depends on what is asked")
    parser.add_argument("--samples-per-prompt", type=int,
                        help="acceptance requests per prompt and grid point, each its own seed (default 1)")
    parser.add_argument("--max-new-tokens", type=int, help="tokens per acceptance request (default 40)")
    parser.add_argument("--timing-iterations", type=int, help="timed steps per (k, batch size) (default 6)")
    parser.add_argument(
        "--temperature", type=float, help="sampling temperature (default 1.0, the serving API's default)"
    )
    parser.add_argument("--rule", choices=("reducible", "pure"), help="acceptance rule (default reducible)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1, a serving replica's default)"
    )
    parser.add_argument("--dtype", help="target dtype override (fp32, bf16, ...)")
    parser.add_argument("--draft-dtype", help="draft dtype override (a float dtype, int8 or int8-row)")
    parser.add_argument(
        "--linear-layout", choices=("auto", "off", "transposed"),
        help="the target's small-batch weight layout (default: the pair's, auto: timed at load; a serving "
        "replica's model.linear_layout should match)",
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        help="'cpu' scales step times by the process CPU share: an idle-machine estimate on a loaded machine "
        "(default wall)",
    )
    parser.add_argument(
        "--acceptance-from",
        type=Path,
        metavar="PROFILE",
        help="reuse the acceptance data of an earlier calibrated profile of this pair; measure latency only",
    )
    parser.add_argument(
        "--latency-from",
        type=Path,
        metavar="PROFILE",
        help="reuse the latency data of an earlier calibrated profile of this pair; measure acceptance only (e.g. "
        "on the served traffic's prompts and temperature)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None


def _float_list(text: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated numbers, got {text!r}") from None


def prompt_texts(args: argparse.Namespace) -> tuple[str, ...] | None:
    """The acceptance sweep's prompts the flags name (None: the built-in set); ValueError naming the flag."""
    if args.prompt_set == "serving":
        from sim.prompts import PROMPTS

        return PROMPTS
    path: Path | None = args.prompts_file
    if path is None:
        return None
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--prompts-file: cannot read {str(path)!r}: {exc}") from None
    texts = tuple(line.strip() for line in lines if line.strip())
    if not texts:
        raise ValueError(f"--prompts-file: {str(path)!r} holds no prompt (one per line)")
    return texts


def settings_from_args(args: argparse.Namespace) -> Any:
    """The CalibrationSettings the flags describe (ValueError naming a bad flag)."""
    from decoder.calibration import CalibrationSettings

    overrides: dict[str, Any] = {"seed": args.seed}
    if args.divs:
        overrides["divs"] = tuple(d.strip() for d in args.divs.split(",") if d.strip())
    if args.ks:
        overrides["ks"] = _int_list(args.ks, "--ks")
    if args.acceptance_ks:
        overrides["acceptance_ks"] = _int_list(args.acceptance_ks, "--acceptance-ks")
    if args.batch_sizes:
        overrides["batch_sizes"] = _int_list(args.batch_sizes, "--batch-sizes")
    for name in ("prompts", "samples_per_prompt", "max_new_tokens", "timing_iterations", "temperature", "rule", "clock"):
        value = getattr(args, name)
        if value is not None:
            overrides[name] = value
    texts = prompt_texts(args)
    if texts is not None:
        overrides["prompt_texts"] = texts
        overrides.setdefault("prompts", len(texts))
    base = CalibrationSettings.quick() if args.quick else CalibrationSettings()
    grids = dict(base.thresholds)
    divs = overrides.get("divs", base.divs)
    for spec in args.thresholds or []:
        div, sep, values = spec.partition("=")
        if sep:
            grids[div.strip()] = _float_list(values, "--thresholds")
        else:
            for d in divs:
                grids[d] = _float_list(spec, "--thresholds")
    overrides["thresholds"] = grids
    data = base.model_dump()
    data.update(overrides)
    return CalibrationSettings.from_dict(data)


def calibrate(pair: ModelPair, settings: CalibrationSettings, *, command: str = "", progress: bool = False,
              log: Callable[[str], None] | None = None, acceptance_from: Profile | None = None,
              latency_from: Profile | None = None) -> Profile:
    """Measure ``pair`` (decoder/calibration.py) and fit its Profile (sim/profile_fit.py).

    ``acceptance_from``: an earlier calibrated ``Profile`` of the same pair whose acceptance data is reused,
    with its separately measured acceptance sections (per-request spread, batch multipliers): only the
    latency is measured again. ``latency_from``: one whose latency data is reused (its fitted latency model kept
    as it is, with the machine's measured departures from it): only the acceptance is measured again; its
    per-request spread comes along where ``acceptance_from`` gives none (a calibration measures no spread, and
    a profile without one simulates every request alike: keeping the served requests' is the nearer guess).
    """
    from decoder.calibration import EarlierCalibration, measure
    from sim.profile_fit import fit_profile

    def earlier(profile: Profile | None) -> EarlierCalibration | None:
        if profile is None:
            return None
        return EarlierCalibration(source=profile.provenance.source, pair=profile.provenance.pair,
                                  date=profile.provenance.date, calibration=profile.calibration)

    measurement = measure(pair, settings, progress=progress, log=log, acceptance_from=earlier(acceptance_from),
                          latency_from=earlier(latency_from))
    profile = fit_profile(measurement, command=command)
    if latency_from is not None:
        # The source's latency as fitted (a refit by today's code could move it), with what was fitted to it since.
        profile = profile.model_copy(update={"latency": latency_from.latency})
    if acceptance_from is not None:
        profile = profile.model_copy(update={"request_acceptance": acceptance_from.request_acceptance,
                                             "batch_acceptance": acceptance_from.batch_acceptance})
    spread = latency_from.request_acceptance if latency_from is not None else None
    if profile.request_acceptance is None and spread is not None:
        spread = spread.model_copy(update={"source": f"kept from the --latency-from profile: {spread.source}"})
        profile = profile.model_copy(update={"request_acceptance": spread})
    return profile


def run(args: argparse.Namespace) -> int:
    import json

    settings = settings_from_args(args)
    out: Path = args.out
    if not out.parent.exists():
        raise ValueError(f"--out: directory {str(out.parent)!r} does not exist")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")

    import torch

    from sim.profile import Profile
    from sim.profile_fit import headline

    source = Profile.load(args.acceptance_from) if args.acceptance_from is not None else None
    latency_source = Profile.load(args.latency_from) if args.latency_from is not None else None

    torch.set_num_threads(args.threads)
    def log(msg: str) -> None:
        if not args.no_progress:
            print(f"fsd calibrate: {msg}", file=sys.stderr)

    log(f"loading pair {args.pair} ...")
    from decoder.pairs import load_pair

    pair = load_pair(args.pair, dtype=args.dtype, draft_dtype=args.draft_dtype, linear_layout=args.linear_layout)
    log(f"pair: {pair.description}")
    if sys.argv[1:2] == ["calibrate"]:
        command = shlex.join(["fsd", *sys.argv[1:]])
    else:  # called in-process (tests, scripts): say so, with the parsed flags
        flags = {k: str(v) for k, v in vars(args).items() if k not in ("func", "command")}
        command = f"fsd calibrate (in-process) {flags}"
    profile = calibrate(
        pair, settings, command=command, progress=not args.no_progress, log=log, acceptance_from=source,
        latency_from=latency_source,
    )
    profile.save(out)
    log(f"wrote {out}")
    print(json.dumps(headline(profile), indent=2))
    return 0
