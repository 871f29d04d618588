"""``fsd sim`` — run a policy against a workload in the simulator; ``fsd sim compare`` — several.

    fsd sim --workload sim/workloads/step.yaml --policy pid --json out.json --plot out.png
    fsd sim --trace ../shared/traces/azure_llm_2023_conv.csv --time-scale 1 --sample 0.1 --duration 600
    fsd sim compare --policies static:0,static:1.0,pid,bandit,feedforward --workload sim/workloads/step.yaml
    fsd sim compare --trace recording.csv --config fsd.yaml --policies pid,slo   # replay a recording
    fsd sim decisions --history status.json --policy '{"policy": "slo", "budget_margin": 0.2}'
    fsd sim model --profile sim/profiles/smollm2-135m-chat-t0.7.json --out policies/models/smollm2-135m-chat-t0.7.json

With ``--config`` (the service's fsd YAML) and a recorded ``--trace`` (``fsd trace fetch``), the replay
takes the SLO, the live policy and the fleet from the config, replays the recorded arrivals, token counts
and tiers exactly, and lists the live policy first as the baseline, with the SLO verdict per tier
(attainment at least the tier's percentile, mean distortion within its budget). See docs/rollout.md.

``fsd sim decisions`` replays a recorded control history (a saved ``GET /v1/fsd/status?history=300``, or a
``benchmarks/load.py --ticks`` file) through a policy, open loop: tick by tick, what it would have decided on
the windows the live controller saw (``--policy``; default the spec that ran, which must decide exactly as it
did live). The policy's operating model is the one the history recorded where that policy took over;
``--profile`` (with ``--div``) replaces it with a profile's.
See docs/rollout.md.

``fsd sim model`` writes the operating model a profile gives the model-predictive policy (``--div``: the
profile's default): the JSON a policy spec's ``"model"`` names, e.g. to run a policy planned on another
calibration beside the shipped one (``benchmarks/load.py --policy``).

Defaults: the shipped calibrated profile (sim/profiles/smollm2-135m.json), SLOSpec.default(), the shipped
steady workload, 2 replicas of max batch 8. Same seed ⇒ identical results.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DEFAULT_COMPARE = "static:0,static:0.5,static:1.0,slo,pid,bandit,feedforward"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "sim",
        help="simulate a policy on a workload (or 'fsd sim compare' for several)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("action", nargs="?", choices=("run", "compare", "decisions", "model"), default="run",
                   help="'run' (default) one policy, 'compare' several on the same workload and seed, "
                        "'decisions': replay a recorded control history through a policy (--history), or 'model': "
                        "write the operating model --profile gives the model-predictive policy (--out)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", help="workload YAML (default: sim/workloads/steady.yaml)")
    src.add_argument("--trace", help="Azure-format trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="with --trace: simulated time = trace time x this (< 1 = more load)")
    p.add_argument("--sample", type=float, default=1.0, help="with --trace: keep this fraction of requests")
    p.add_argument("--max-context", type=int, default=2048, help="with --trace: clip prompt+output tokens")
    p.add_argument("--duration", type=float, help="stop arrivals after S simulated seconds")
    p.add_argument("--config", help="the service's fsd YAML config: replay --trace with its SLO, fleet and live "
                                     "policy (the baseline; see docs/rollout.md)")
    p.add_argument("--policy", default=None,
                   help="(default slo; with --config the live policy) policy name (slo = the shipped SLO policy, static:T, pid, bandit, feedforward), JSON, or a YAML/JSON file")
    p.add_argument("--policies", default=DEFAULT_COMPARE, help="compare: comma-separated names or files")
    p.add_argument("--slo", help="SLO spec YAML/JSON (default: SLOSpec.default())")
    p.add_argument("--profile", help="profile JSON (default: the shipped calibrated SmolLM2 profile, sim/profiles/smollm2-135m.json)")
    p.add_argument("--cluster", help="SimConfig YAML/JSON (replicas, max_batch, routing, autoscaler, ...)")
    p.add_argument("--replicas", type=int, help="initial replicas (overrides --cluster)")
    p.add_argument("--max-batch", type=int, help="max batch size (overrides --cluster)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", help="write the summary (+ time series) JSON here")
    p.add_argument("--plot", help="write a PNG here (run: time series; compare: attainment vs distortion)")
    p.add_argument("--records", help="run: write per-request columns (.npz) here")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no table")
    p.add_argument("--history", help="decisions: a saved /v1/fsd/status answer (with history) or a "
                                     "benchmarks/load.py --ticks file (.json or .json.gz)")
    p.add_argument("--run", action="append", help="decisions, with a --ticks file: NAME:ROUND of the run(s) to "
                                                  "replay (repeatable; default every run)")
    p.add_argument("--div", help="decisions: the divergence of the profile the controller used; model: the "
                                 "model's divergence (default: the profile's default)")
    p.add_argument("--out", help="model: where to write the operating model JSON")
    p.set_defaults(func=handle)


def build_inputs(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """(workload, slo, profile, sim config) from the CLI flags."""
    from sim.inputs import DEFAULT_WORKLOAD, load_mapping, load_slo, trace_workload
    from sim.profile import Profile
    from sim.simulator import SimConfig
    from sim.workload import Workload

    profile = Profile.load(args.profile) if args.profile else Profile.default()
    slo = load_slo(args.slo)
    if args.trace:
        workload = trace_workload(args.trace, time_scale=args.time_scale, sample_fraction=args.sample,
                                  max_context=args.max_context, duration_s=args.duration)
    else:
        workload = Workload.load(args.workload or DEFAULT_WORKLOAD)
        if args.duration is not None:
            workload = Workload.from_dict({**workload.model_dump(), "duration_s": args.duration},
                                          source="--duration")
    cluster: dict[str, Any] = load_mapping(Path(args.cluster), "cluster") if args.cluster else {}
    cluster["seed"] = args.seed
    if args.replicas is not None:
        cluster["replicas"] = args.replicas
    if args.max_batch is not None:
        cluster["max_batch"] = args.max_batch
    config = SimConfig.from_dict(cluster, source=args.cluster or "sim flags")
    return workload, slo, profile, config


def _progress_wanted(args: argparse.Namespace) -> bool:
    return not args.quiet and sys.stderr.isatty()


def handle(args: argparse.Namespace) -> int:
    from sim.compare import markdown_table, summary_row
    from sim.inputs import build_policy, unreachable_tpot_targets
    from sim.report import plot, plot_compare, result_json, write_json, write_records
    from sim.simulator import Simulator

    if args.action == "decisions":
        return handle_decisions(args)
    if args.action == "model":
        return handle_model(args)
    if args.out:
        raise ValueError("--out is for 'fsd sim model' (run and compare write --json)")
    if args.history:
        raise ValueError("--history is for 'fsd sim decisions'")
    if args.config:
        return handle_replay(args)
    args.policy = args.policy or "slo"
    workload, slo, profile, config = build_inputs(args)
    if not args.quiet:
        for warning in unreachable_tpot_targets(slo, profile, config.div or profile.default_div,
                                                config.k or profile.default_k):
            print(f"warning: {warning}", file=sys.stderr)
    if args.action == "run":
        policy = build_policy(args.policy, slo, profile, config.k, config.policy_replica_bounds())
        result = Simulator(config, profile, slo, workload, policy).run(progress=_progress_wanted(args))
        if args.json_out:
            write_json(result, args.json_out)
        if args.plot:
            plot(result, args.plot, title=f"{result.meta['workload']} — policy {args.policy}")
        if args.records:
            write_records(result, args.records)
        print(json.dumps(result_json(result, include_timeseries=False), indent=2))
        return 0

    specs = [s.strip() for s in args.policies.split(",") if s.strip()]
    if not specs:
        raise ValueError("--policies: give at least one policy")
    rows: list[dict[str, Any]] = []
    runs: dict[str, Any] = {}
    meta: dict[str, Any] = {}
    for spec in specs:
        policy = build_policy(spec, slo, profile, config.k, config.policy_replica_bounds())
        result = Simulator(config, profile, slo, workload, policy).run(progress=_progress_wanted(args))
        rows.append(summary_row(spec, result.summary))
        runs[spec] = result_json(result, include_timeseries=False)
        meta = result.meta
    table = markdown_table(rows)
    if not args.quiet:
        print(table)
        for note in meta.get("notes", []):
            print(f"note: {note}")
        if meta.get("attribution"):
            print(f"data: {meta['attribution']}")
    if args.json_out:
        out = {"workload": meta.get("workload"), "seed": args.seed, "rows": rows, "runs": runs}
        if meta.get("attribution"):
            out["attribution"] = meta["attribution"]
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(out, indent=2, default=str) + "\n")
    if args.plot:
        title = f"{meta.get('workload')} (seed {args.seed})"
        if meta.get("attribution"):
            title += f"\n{meta['attribution']}"
        plot_compare(rows, args.plot, title=title)
    return 0


def handle_replay(args: argparse.Namespace) -> int:
    """``--config``: replay a recorded trace with the service's SLO, fleet and live policy (the baseline)."""
    from controller.config import load_config
    from controller.rollout import LIVE, sim_inputs, sim_policy
    from sim.compare import markdown_table, summary_row, tier_table
    from sim.inputs import build_policy, load_mapping, load_slo
    from sim.profile import Profile
    from sim.replay import replay, requests_from_trace
    from sim.report import result_json
    from sim.simulator import SimConfig
    from sim.trace import read_azure_trace

    if not args.trace:
        raise ValueError("--config replays a recorded trace: give --trace PATH (from `fsd trace fetch`)")
    if args.time_scale != 1.0 or args.sample != 1.0 or args.duration is not None:
        raise ValueError("--config replays the recording exactly: drop --time-scale, --sample and --duration")
    inputs = sim_inputs(load_config(args.config), seed=args.seed, replicas=args.replicas)
    slo = load_slo(args.slo) if args.slo else inputs.slo
    profile = Profile.load(args.profile) if args.profile else Profile.default()
    cluster = inputs.config.model_dump()
    if args.cluster:
        cluster.update(load_mapping(Path(args.cluster), "cluster"))
    if args.max_batch is not None:
        cluster["max_batch"] = args.max_batch
    config = SimConfig.from_dict(cluster, source=args.cluster or "fsd config")
    requests = requests_from_trace(read_azure_trace(args.trace), slo)
    if args.action == "compare":
        specs = [s.strip() for s in args.policies.split(",") if s.strip()]
    else:
        specs = [args.policy] if args.policy else []
    if LIVE in specs:
        raise ValueError(f"--policies: {LIVE!r} names the config's live policy, the baseline; drop it")
    policies = {LIVE: sim_policy(inputs.live_policy, slo, profile, config.k, config.policy_replica_bounds())}
    policies.update({spec: build_policy(spec, slo, profile, config.k, config.policy_replica_bounds())
                     for spec in specs})
    result = replay(requests, slo, profile, config, policies, baseline=LIVE)
    rows = []
    for run in result.runs:
        row = summary_row(run.name, run.result.summary)
        row["baseline"] = run.baseline
        row["meets_slo"] = run.meets_slo
        row["tiers"] = {name: v.as_dict() for name, v in run.verdicts.items()}
        rows.append(row)
    notes = [*inputs.notes, *requests.notes]
    if not args.quiet:
        print(markdown_table(rows))
        print()
        print(tier_table(rows))
        for note in notes:
            print(f"note: {note}")
        print(f"baseline: {LIVE} = {inputs.live_policy}; profile: {profile.provenance.pair}; "
              f"cluster: {config.replicas} replicas x batch {config.max_batch}, k={config.k}")
    if args.json_out:
        out = {"workload": "recorded trace", "trace": args.trace, "config": args.config, "baseline": LIVE,
               "live_policy": inputs.live_policy, "seed": args.seed, "notes": notes, "rows": rows,
               "runs": {run.name: result_json(run.result, include_timeseries=False) for run in result.runs}}
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(out, indent=2, default=str) + "\n")
    if args.plot:
        from sim.report import plot_compare

        plot_compare(rows, args.plot, title=f"recorded trace {Path(args.trace).name} (seed {args.seed})")
    return 0


def handle_model(args: argparse.Namespace) -> int:
    """``fsd sim model``: the operating model of ``--profile`` (at ``--div``) written to ``--out``."""
    from sim.profile import Profile

    if not args.profile or not args.out:
        raise ValueError("model: give --profile (a profile JSON) and --out (where to write its operating model)")
    out = Path(args.out)
    if not out.parent.exists():
        raise ValueError(f"--out: directory {str(out.parent)!r} does not exist")
    profile = Profile.load(args.profile)
    model = profile.to_operating_model(div=args.div)
    model.save(out)
    print(json.dumps({"profile": args.profile, "out": str(out), "source": model.source,
                      "points": len(model.points), "draft_lengths": list(model.draft_lengths)}, indent=2))
    return 0


def handle_decisions(args: argparse.Namespace) -> int:
    """``fsd sim decisions``: a recorded control history through a policy, open loop (sim.decision_replay)."""
    from sim.decision_replay import (
        build_policy,
        last_policy_span,
        load_histories,
        profile_model,
        replay,
        summary,
    )
    from sim.inputs import load_slo, policy_spec
    from sim.profile import Profile

    if not args.history:
        raise ValueError("decisions: give --history FILE (a saved /v1/fsd/status answer or a load.py --ticks file)")
    if args.div and not args.profile:
        raise ValueError("--div picks the divergence of --profile's model; give --profile too")
    histories = load_histories(args.history)
    labels = args.run or list(histories)
    unknown = [label for label in labels if label not in histories]
    if unknown:
        raise ValueError(f"--run: no run {unknown} in {args.history}; runs: {list(histories)}")
    model = profile_model(Profile.load(args.profile), args.div) if args.profile else None
    out: dict[str, Any] = {"history": args.history, "policy": args.policy or "the recorded spec",
                           "profile": args.profile or "the recorded operating model", "runs": {}}
    per_tick: dict[str, Any] = {}
    for label in labels:
        span = last_policy_span(histories[label])
        spec = policy_spec(args.policy) if args.policy else span.spec
        if spec is None:
            raise ValueError(f"{label}: the history does not reach back to where its policy took over; give --policy")
        slo = load_slo(args.slo) if args.slo else (span.slo or load_slo(None))
        used = model or span.operating_model
        policy = build_policy(spec, slo, used, span.replica_bounds)
        ticks = replay(span, policy, slo)
        out["runs"][label] = {"recorded_spec": span.spec, "from_policy_start": span.event is not None,
                              "operating_model": used.source if used is not None else "the policy's default",
                              **summary(ticks)}
        per_tick[label] = [{"time_s": t.time_s, "same": t.same, "recorded": t.recorded, "replayed": t.replayed}
                           for t in ticks]
    print(json.dumps(out, indent=2, default=str))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps({**out, "ticks": per_tick}, indent=2, default=str) + "\n")
    return 0
