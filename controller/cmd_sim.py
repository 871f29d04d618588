"""``fsd sim`` — run a policy against a workload in the simulator; ``fsd sim compare`` — several.

    fsd sim --workload sim/workloads/step.yaml --policy pid --json out.json --plot out.png
    fsd sim --trace ../shared/traces/azure_llm_2023_conv.csv --time-scale 1 --sample 0.1 --duration 600
    fsd sim compare --policies static:0,static:1.0,pid,bandit,feedforward --workload sim/workloads/step.yaml

Defaults: the shipped calibrated profile (sim/profiles/smollm2-135m.json), SLOSpec.default(), the shipped
steady workload, 2 replicas of max batch 8. Same seed ⇒ identical results.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DEFAULT_WORKLOAD = Path(__file__).resolve().parents[1] / "sim" / "workloads" / "steady.yaml"
DEFAULT_COMPARE = "static:0,static:0.5,static:1.0,slo,pid,bandit,feedforward"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "sim",
        help="simulate a policy on a workload (or 'fsd sim compare' for several)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("action", nargs="?", choices=("run", "compare"), default="run",
                   help="'run' (default) one policy, or 'compare' several on the same workload and seed")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", help="workload YAML (default: sim/workloads/steady.yaml)")
    src.add_argument("--trace", help="Azure-format trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="with --trace: simulated time = trace time x this (< 1 = more load)")
    p.add_argument("--sample", type=float, default=1.0, help="with --trace: keep this fraction of requests")
    p.add_argument("--max-context", type=int, default=2048, help="with --trace: clip prompt+output tokens")
    p.add_argument("--duration", type=float, help="stop arrivals after S simulated seconds")
    p.add_argument("--policy", default="slo",
                   help="policy name (slo = the shipped SLO policy, static:T, pid, bandit, feedforward), JSON, or a YAML/JSON file")
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
    p.set_defaults(func=handle)


def _load_mapping(path: Path, what: str) -> dict[str, Any]:
    import yaml

    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"{what} file {str(path)!r} does not exist") from None
    try:
        data = yaml.safe_load(text)  # YAML is a superset of JSON
    except yaml.YAMLError as exc:
        raise ValueError(f"{what} file {str(path)!r} is not valid YAML/JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} file {str(path)!r} must hold a mapping")
    return data


def load_slo(path: str | None) -> Any:
    from pydantic import ValidationError

    from policies.slo import SLOSpec

    if path is None:
        return SLOSpec.default()
    try:
        return SLOSpec.model_validate(_load_mapping(Path(path), "slo"))
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "(root)"
        raise ValueError(f"slo {path!r}: {loc}: {err['msg']}") from None


def policy_spec(text: str) -> Any:
    """A policy name/JSON string, or the mapping in a YAML/JSON file when ``text`` names one."""
    candidate = Path(text)
    if candidate.suffix in (".yaml", ".yml", ".json") or candidate.is_file():
        return _load_mapping(candidate, "policy")
    return text


def build_policy(text: str, slo: Any, profile: Any, k: int | None = None) -> Any:
    from policies.registry import make_policy

    return make_policy(
        policy_spec(text), slo,
        speed_curve=profile.to_speed_curve(k=k), latency_model=profile.to_latency_model(k=k),
        operating_model=profile.to_operating_model(),
    )


def build_inputs(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """(workload, slo, profile, sim config) from the CLI flags."""
    from sim.profile import Profile
    from sim.simulator import SimConfig
    from sim.workload import Workload

    profile = Profile.load(args.profile) if args.profile else Profile.default()
    slo = load_slo(args.slo)
    if args.trace:
        workload = Workload.from_dict(
            {
                "name": Path(args.trace).stem,
                "duration_s": args.duration,
                "arrivals": {"kind": "trace", "path": args.trace, "time_scale": args.time_scale,
                             "sample_fraction": args.sample},
                "prompt_tokens": {"kind": "trace"},
                "output_tokens": {"kind": "trace"},
                "max_context": args.max_context,
            },
            source="--trace",
        )
    else:
        workload = Workload.load(args.workload or DEFAULT_WORKLOAD)
        if args.duration is not None:
            workload = Workload.from_dict({**workload.model_dump(), "duration_s": args.duration},
                                          source="--duration")
    cluster: dict[str, Any] = _load_mapping(Path(args.cluster), "cluster") if args.cluster else {}
    cluster["seed"] = args.seed
    if args.replicas is not None:
        cluster["replicas"] = args.replicas
    if args.max_batch is not None:
        cluster["max_batch"] = args.max_batch
    config = SimConfig.from_dict(cluster, source=args.cluster or "sim flags")
    return workload, slo, profile, config


def unreachable_tpot_targets(slo: Any, profile: Any, div: str, k: int) -> list[str]:
    """Tiers whose p95 TPOT target is below the profile's best case (one sequence, no queue, the tier's
    highest T): no policy can meet them, which an operator should hear before reading attainment."""
    out = []
    for name, tier in slo.tiers.items():
        if tier.tpot_ms is None:
            continue
        ceiling = tier.fixed_threshold if tier.fixed_threshold is not None else tier.max_threshold
        best = profile.tpot_ms(div, ceiling, k, batch=1)
        if best > tier.tpot_ms:
            out.append(f"tier {name!r}: p95 TPOT target {tier.tpot_ms:g} ms is below this profile's best case "
                       f"({best:.0f} ms per token at batch 1, T = {ceiling:g}); no policy can meet it "
                       f"({profile.provenance.pair}; --profile or --slo to change)")
    return out


def _progress_wanted(args: argparse.Namespace) -> bool:
    return not args.quiet and sys.stderr.isatty()


def handle(args: argparse.Namespace) -> int:
    from sim.report import plot, plot_compare, result_json, write_json, write_records
    from sim.simulator import Simulator

    workload, slo, profile, config = build_inputs(args)
    if not args.quiet:
        for warning in unreachable_tpot_targets(slo, profile, config.div or profile.default_div,
                                                config.k or profile.default_k):
            print(f"warning: {warning}", file=sys.stderr)
    if args.action == "run":
        policy = build_policy(args.policy, slo, profile, config.k)
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
        policy = build_policy(spec, slo, profile, config.k)
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


def summary_row(name: str, s: dict[str, Any]) -> dict[str, Any]:
    return {
        "policy": name,
        "slo_attainment": s["slo_attainment"],
        "goodput_rps": s["goodput_rps"],
        "tpot_p95_ms": s["tpot_ms"]["p95"],
        "ttft_p95_ms": s["ttft_ms"]["p95"],
        "mean_distortion": s["mean_distortion"],
        "replica_seconds": s["replica_seconds"],
        "cost_per_1k_tokens_rs": s["cost_per_1k_tokens"]["replica_seconds"],
        "completed": s["completed"],
        "rejected": s["rejected"],
    }


def markdown_table(rows: list[dict[str, Any]]) -> str:
    cols = ["policy", "slo_attainment", "goodput_rps", "tpot_p95_ms", "ttft_p95_ms", "mean_distortion",
            "replica_seconds", "cost_per_1k_tokens_rs", "completed", "rejected"]

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)
