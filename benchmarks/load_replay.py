"""A real step load replayed in the simulator: would the simulator have told us what the service did?

Reads a ``benchmarks/load.py`` report and, for every configuration it ran (the policy spec it stored) and
every round, replays that round's requests in the simulator exactly as the service saw them: the recorded
arrival times (from the round's start), prompt tokens and output tokens (early eos stops included), one
replica of max batch 8, the report's SLO and control interval. A request the service refused or failed
before tokenizing it is replayed with its round's median lengths (the report counted it a miss). The
replica's profile is ``--profile`` (default: the calibrated one of the default pair), optionally moved to
the host of the real run by ``--plain-step-scale`` and the overhead knobs of ``benchmarks/load_sim.py``;
the policies' models stay on ``--profile``, as live.

Per configuration the report gives the real attainment and distortion (the report's pooled figures) beside
the simulator's (mean over rounds and ``--seeds``; the seeds move only the acceptance draws, the requests
are the recorded ones), and issue 11's criterion on each side. Deterministic; seconds. Prints JSON (and
writes ``--out``)::

    .venv/bin/python benchmarks/load_replay.py docs/img/load_economy_s16_t97_s20.json
    .venv/bin/python benchmarks/load_replay.py docs/img/load_economy_s16_t97_s20.json --plain-step-scale 1.1
    .venv/bin/python benchmarks/load_replay.py docs/img/load_economy_s16_t97_s20.json --plain-step-scale 1.1 \
        --schedules '{"trigger:2:10": {"policy": "trigger", "rows": 2, "hold_s": 10, "high": [4, 6]}}'

With several reports each is replayed as alone, and ``pooled`` gives per configuration how far the simulator was
from the real figures over them (simulated − real attainment and distortion, and in how many reports the
criterion's verdict agreed). ``--step-noise`` (``benchmarks/load_sim.py``) puts the replica on the machine that
``benchmarks/step_ratios.py --noise`` measured from live windows::

    .venv/bin/python benchmarks/load_replay.py docs/img/load_economy_s*_t97_ttft4_s3?.json \
        --step-noise docs/img/step_noise_s37.json --out results/load_replay_noise.json

``--schedules`` replays ``benchmarks/load_sim.py``'s schedules (hindsight, trigger) on the rounds of ``slo``:
bounds beside the configurations that ran, left out of the criterion. ``--config NAME=JSON`` (repeatable)
replays a policy spec that did not run on the same rounds, as a candidate of the criterion (a static spec is
a static point); ``--ttft-ms`` adds a TTFT target to the report's tier (the simulator's attainment counts it;
the real figures stay as the report measured them)::

    .venv/bin/python benchmarks/load_replay.py docs/img/load_economy_s33_t97_s26.json --ttft-ms 4000 \
        --config 'cap3={"policy": "static", "thresholds": 0.0, "draft_lengths": 0, "batch_cap": 3, "guards": false}' \
        --config 'slo_cap={"policy": "slo", "batch_cap": true, "rate_prior_s": 10}'
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.load import criterion  # noqa: E402
from benchmarks.load_sim import (  # noqa: E402
    add_replica_arguments,
    replica_fields,
    replica_profiles,
    report_age_s,
    schedule_kind,
    schedule_policy,
    seeds_arg,
)
from benchmarks.named_specs import parse_named_specs  # noqa: E402
from benchmarks.report import emit  # noqa: E402
from policies.base import Policy  # noqa: E402
from policies.slo import SLOSpec  # noqa: E402
from sim.decision_replay import last_policy_span, load_histories  # noqa: E402
from sim.inputs import build_policy  # noqa: E402
from sim.profile import Profile  # noqa: E402
from sim.simulator import SimConfig, Simulator  # noqa: E402
from sim.workload import Requests  # noqa: E402


def round_requests(records: list[dict[str, Any]], slo: SLOSpec, tier: str) -> Requests:
    """One round's recorded requests as simulator columns, every request in ``tier``: arrivals as recorded
    (seconds from the round's start), token counts as the service reported them; a request without them
    (refused or failed before a replica tokenized it) gets the round's median lengths."""
    if not records:
        raise ValueError("a round with no requests cannot be replayed")
    if tier not in slo.tiers:
        raise ValueError(f"tier {tier!r} is not in the report's SLO; known: {sorted(slo.tiers)}")
    known = [r for r in records if r.get("prompt_tokens") and r.get("output_tokens")]
    prompt_median = int(np.median([r["prompt_tokens"] for r in known])) if known else 1
    output_median = int(np.median([r["output_tokens"] for r in known])) if known else 1
    order = sorted(records, key=lambda r: float(r["arrival_s"]))
    arrival = np.array([float(r["arrival_s"]) for r in order])
    if not (np.isfinite(arrival).all() and (arrival >= 0).all()):
        raise ValueError(f"recorded arrival times must be finite and >= 0, got {arrival.min()} … {arrival.max()}")
    prompt = np.array([int(r.get("prompt_tokens") or prompt_median) for r in order], dtype=np.int64)
    output = np.array([max(1, int(r.get("output_tokens") or output_median)) for r in order], dtype=np.int64)
    tier_index = np.full(arrival.size, list(slo.tiers).index(tier), dtype=np.int64)
    notes = [f"{arrival.size} recorded requests; {arrival.size - len(known)} without token counts given the round's "
             "median lengths"]
    return Requests(arrival, np.maximum(prompt, 1), output, tier_index, tuple(slo.tiers), notes, None)


def replay_report(report: dict[str, Any], profile: Profile, policy_profile: Profile,
                  seeds: list[int], slo_policy: dict[str, Any] | str | None = None,
                  schedules: dict[str, dict[str, Any]] | None = None,
                  extra: dict[str, dict[str, Any]] | None = None, report_age: str = "off",
                  ages: dict[tuple[str, int], float] | None = None,
                  ran_specs: Mapping[str, Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Per configuration of ``report``: its real figures and the simulator's on the same requests
    (``slo_policy``: the spec to simulate for the configuration ``slo`` instead of the one that ran).
    ``schedules`` (name → ``benchmarks/load_sim.py`` schedule spec, e.g. ``{"policy": "trigger", "rows": 2,
    "hold_s": 40, "high": [4, 6]}``) are replayed on the rounds of ``slo`` (else of the report's first
    configuration), with no real figures. ``report_age`` is ``--report-age``; with 'ticks', ``ages`` gives each run's
    (name, round) median telemetry age, and a spec that did not run takes the age of the run it replays.
    ``ran_specs``: the specs written out as they ran (:func:`recorded_runs`), replayed instead of the report's as given."""
    if isinstance(slo_policy, str):  # a registry name, as load.py's --configs take it
        slo_policy = {"policy": slo_policy}
    if slo_policy is not None and not isinstance(slo_policy, dict):
        raise ValueError(f"slo_policy must be a policy name or a JSON object, got {slo_policy!r}")
    runs = report.get("runs") or []
    if not runs:
        raise ValueError("the report has no runs (records per round); re-run benchmarks/load.py to get them")
    slo = SLOSpec.model_validate(report["slo"])
    tier = report["tier"]
    interval_s = float(report.get("interval_s") or 1.0)
    real = {c["name"]: c for c in report.get("configs", [])}
    names = list(dict.fromkeys(run["name"] for run in runs))
    jobs: list[tuple[str, Any, list[dict[str, Any]]]] = []
    source: dict[str, str] = {}
    for name in names:
        spec: Any
        if name == "slo" and slo_policy is not None:
            spec, source[name] = slo_policy, "--slo-policy"
        elif name in (ran_specs or {}):
            spec, source[name] = (ran_specs or {})[name], "ran (written out in the ticks)"
        else:  # no ticks file: the spec as given, under today's defaults
            spec, source[name] = (real[name]["spec"] if name in real else None), "as given (today's defaults)"
        if spec is not None:  # None: "live", whatever policy the controller ran; nothing to replay
            jobs.append((name, spec, [r for r in runs if r["name"] == name]))
    host = "slo" if "slo" in names else names[0]
    for name, spec in (schedules or {}).items():
        if name in names or name in real or not schedule_kind(spec):
            raise ValueError(f"schedule {name!r}: needs a new name and a hindsight or trigger spec, got {spec!r}")
        jobs.append((name, spec, [r for r in runs if r["name"] == host]))
    for name, spec in (extra or {}).items():
        if name in names or name in real or name in (schedules or {}) or not isinstance(spec, dict) \
                or schedule_kind(spec):
            raise ValueError(f"config {name!r}: needs a new name and a policy spec (JSON object), got {spec!r}")
        jobs.append((name, spec, [r for r in runs if r["name"] == host]))
    out = []
    for name, spec, name_runs in jobs:
        per_round = []
        for run in name_runs:
            requests = round_requests(run["records"], slo, tier)
            age = (ages or {}).get((run["name"], int(run["round"])))
            if report_age == "ticks" and (age is None or not 0.0 <= age < interval_s):
                raise ValueError(f"--report-age ticks: {run['name']} round {run['round']}'s telemetry age {age} is not "
                                 f"in [0, the control interval {interval_s})")
            for seed in seeds:
                config = SimConfig(seed=seed, replicas=1, max_batch=8, k=4, control_interval_s=interval_s,
                                   report_age_s=report_age_s(report_age, seed, interval_s, age))
                if schedule_kind(spec):
                    policy: Policy = schedule_policy(spec, slo, tier, float(report.get("phase_s") or 40.0))
                else:
                    policy = build_policy(spec if isinstance(spec, str) else json.dumps(spec), slo, policy_profile)
                summary = Simulator(config, profile, slo, requests, policy).run().summary["tiers"][tier]
                per_round.append((int(run["round"]), float(summary["slo_attainment"]),
                                  float(summary.get("mean_distortion") or 0.0)))
        rounds = sorted({r for r, _, _ in per_round})
        by_round = [float(np.mean([a for r, a, _ in per_round if r == rnd])) for rnd in rounds]
        measured = real.get(name)  # None for a schedule: its name is new
        out.append({
            "name": name, "spec": spec, "spec_source": source.get(name, "--schedules / --config"),
            "real": {"slo_attainment": measured.get("slo_attainment") if measured else None,
                     "mean_distortion_per_token": measured.get("mean_distortion_per_token") if measured else None},
            "sim": {"slo_attainment": float(np.mean([a for _, a, _ in per_round])),
                    "mean_distortion_per_token": float(np.mean([d for _, _, d in per_round])),
                    "attainment_by_round": [round(a, 4) for a in by_round]},
        })
    return out


def side(configs: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """The configurations in ``benchmarks.load.criterion``'s shape, with ``key``'s ("real" or "sim") figures
    (the schedules left out: they are bounds, not candidates; on the real side, what did not run)."""
    return [{"name": c["name"], "spec": c["spec"], **c[key]} for c in configs
            if not schedule_kind(c["spec"]) and (key != "real" or c["real"]["slo_attainment"] is not None)]


def replay_options(args: argparse.Namespace) -> dict[str, Any]:
    """main's options every report is replayed under, read once: the profiles, the slo policy, schedules, extras."""
    profile, policy_profile = replica_profiles(args)
    try:
        slo_policy = json.loads(args.slo_policy) if args.slo_policy else None
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--slo-policy is not JSON: {exc}") from None
    try:
        schedules = json.loads(args.schedules) if args.schedules else None
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--schedules is not JSON: {exc}") from None
    if schedules is not None and not isinstance(schedules, dict):
        raise SystemExit(f"--schedules must be a JSON object name -> spec, got {schedules!r}")
    try:
        extra = parse_named_specs(args.configs, "--config")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if args.report_age != "ticks":
        try:
            report_age_s(args.report_age, 0)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    if args.ttft_ms is not None and not (args.ttft_ms > 0 and np.isfinite(args.ttft_ms)):
        raise SystemExit(f"--ttft-ms must be a positive number, got {args.ttft_ms}")
    return {"profile": profile, "policy_profile": policy_profile, "slo_policy": slo_policy, "schedules": schedules,
            "extra": extra}


def ticks_file(path: str) -> Path:
    """The ticks file ``benchmarks/load.py --ticks`` wrote beside the report ``path``: ``<stem>_ticks.json.gz``."""
    return Path(path).with_name(Path(path).stem + "_ticks.json.gz")


def recorded_runs(path: str) -> tuple[dict[tuple[str, int], float], dict[str, Mapping[str, Any]]]:
    """From the report's ticks file (empty where there is none): each run's median telemetry age (s), by (name,
    round), and the spec each configuration ran, written out (``resolved_policy``), by name. Live a run's report
    phase drifts by a few ms a minute, so its median is the run's age; the written-out spec rebuilds what ran
    after a default changed (a report's ``spec`` is as given: ``{"policy": "slo"}``)."""
    ticks = ticks_file(path)
    if not ticks.exists():
        return {}, {}
    try:
        histories = load_histories(ticks)
    except ValueError as exc:
        raise SystemExit(f"cannot read {ticks}: {exc}") from None
    ages: dict[tuple[str, int], float] = {}
    specs: dict[str, Mapping[str, Any]] = {}
    for label, history in histories.items():
        name, _, rnd = label.rpartition(":")
        values = [h["telemetry"]["age_s"] for h in history
                  if h.get("telemetry") and h["telemetry"].get("age_s") is not None]
        if values:
            ages[(name, int(rnd))] = float(np.median(values))
        spec = last_policy_span(history).spec
        if spec is not None:
            specs.setdefault(name, spec)
    return ages, specs


def replay_one(path: str, args: argparse.Namespace, options: dict[str, Any]) -> dict[str, Any]:
    """One report replayed under ``args`` (main's options, read by :func:`replay_options`): its configurations,
    real beside simulated."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"cannot read the report {path}: {exc}") from None
    if args.ttft_ms is not None:
        try:
            report["slo"]["tiers"][report["tier"]]["ttft_ms"] = args.ttft_ms
        except (KeyError, TypeError) as exc:
            raise SystemExit(f"cannot read the report's tier SLO: {exc}") from None
    try:
        ages, specs = recorded_runs(path)
        if args.report_age == "ticks" and not ages:
            raise ValueError(f"--report-age ticks: no telemetry ages in {ticks_file(path)}")
        configs = replay_report(report, options["profile"], options["policy_profile"], args.seeds,
                                options["slo_policy"], options["schedules"], options["extra"], args.report_age, ages,
                                specs)
    except (KeyError, ValueError) as exc:
        raise SystemExit(f"cannot replay {path}: {exc}") from None
    tier = SLOSpec.model_validate(report["slo"]).tiers[report["tier"]].model_dump()
    return {"benchmark": "load_replay", "report": path, **replica_fields(args), "tier": report["tier"],
            "seeds": args.seeds, "command": " ".join([sys.executable, *sys.argv]), "configs": configs,
            "criterion": {"real": criterion(side(configs, "real"), tier), "sim": criterion(side(configs, "sim"), tier)}}


def pooled_errors(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration name over the replayed reports: simulated − real attainment and distortion (mean, mean
    absolute, each report's), and in how many reports the criterion's verdict was the same on both sides (a
    policy: held or not; a static point: meets the SLO or not)."""
    pooled: dict[str, Any] = {}
    names = sorted({c["name"] for out in outs for c in out["configs"] if c["real"]["slo_attainment"] is not None})
    for name in names:
        att, dist, same, verdicts = [], [], 0, 0
        for out in outs:
            config = next((c for c in out["configs"] if c["name"] == name), None)
            if (config is None or config["real"]["slo_attainment"] is None
                    or config["real"]["mean_distortion_per_token"] is None):
                continue
            att.append(config["sim"]["slo_attainment"] - config["real"]["slo_attainment"])
            dist.append(config["sim"]["mean_distortion_per_token"] - config["real"]["mean_distortion_per_token"])
            judged = {key: out["criterion"][key] for key in ("real", "sim")}
            if judged["real"] and judged["sim"]:  # None: no policy ran, nothing judged
                verdict = {key: (c.get("held") or {}).get(name, name in (c.get("static_points_meeting") or []))
                           for key, c in judged.items()}
                verdicts += 1
                same += verdict["real"] == verdict["sim"]
        pooled[name] = {
            "reports": len(att),
            "attainment_error": {"mean": round(float(np.mean(att)), 4), "mean_abs": round(float(np.mean(np.abs(att))), 4),
                                 "each": [round(e, 4) for e in att]},
            "distortion_error": {"mean": round(float(np.mean(dist)), 4),
                                 "mean_abs": round(float(np.mean(np.abs(dist))), 4), "each": [round(e, 4) for e in dist]},
            "verdict_agrees": f"{same} of {verdicts}",
        }
    return pooled


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", metavar="report",
                    help="benchmarks/load.py reports (JSON with per-round records); with several, each is replayed and "
                         "the report adds how far the simulator was from each configuration's real figures, pooled")
    add_replica_arguments(ap, ticks=True)
    ap.add_argument("--slo-policy", default=None,
                    help="JSON policy spec to simulate for the 'slo' configuration (default: the one the report ran)")
    ap.add_argument("--schedules", default=None,
                    help='JSON name -> benchmarks/load_sim.py schedule spec replayed on the slo rounds, e.g. '
                         '\'{"trigger:2:40": {"policy": "trigger", "rows": 2, "hold_s": 40, "high": [4, 6]}}\'')
    ap.add_argument("--config", dest="configs", action="append", default=[], metavar="NAME=JSON",
                    help="a policy spec that did not run, replayed on the same rounds as a candidate (repeatable)")
    ap.add_argument("--ttft-ms", type=float, default=None,
                    help="add this TTFT target to the report's tier (the simulator's attainment counts it)")
    ap.add_argument("--seeds", type=seeds_arg, default=seeds_arg("0-2"), help="simulator seeds per round, e.g. 0-2")
    ap.add_argument("--out", default="results/load_replay.json")
    args = ap.parse_args()
    options = replay_options(args)
    outs = [replay_one(path, args, options) for path in args.reports]
    out = outs[0] if len(outs) == 1 else {
        "benchmark": "load_replay", "reports": outs, "command": " ".join([sys.executable, *sys.argv]),
        "pooled": pooled_errors(outs)}
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
