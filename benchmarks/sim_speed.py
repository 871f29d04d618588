"""Simulator speed: one hour of traffic at 20 req/s (~72k requests, ~200 output tokens each), with the
tier mix (lossless 0.2 / standard 0.5 / economy 0.3).

Target (issue 11): <= 5 s wall for the hour with the tier mix and the shipped policy. Reported, not
asserted. Prints JSON (stdout, and --out, default results/sim_speed.json): wall and CPU seconds,
requests, simulated decode iterations, events, segment draws, the time spent in the policy (wall and
CPU) and its ticks, and headline metrics.

    .venv/bin/python benchmarks/sim_speed.py --policy slo    # the hour, the shipped SLO policy (mpc)
    .venv/bin/python benchmarks/sim_speed.py                 # the hour, static:1.0
    .venv/bin/python benchmarks/sim_speed.py --duration 300  # smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import emit  # noqa: E402
from policies.slo import SLOSpec  # noqa: E402
from sim.inputs import build_policy  # noqa: E402
from sim.profile import HANDMADE_2THREADS_PROFILE_PATH, Profile  # noqa: E402
from sim.simulator import SimConfig, Simulator  # noqa: E402
from sim.workload import Workload  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=3600.0, help="simulated seconds of arrivals")
    ap.add_argument("--rate", type=float, default=20.0, help="requests per second")
    ap.add_argument("--replicas", type=int, default=70)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--policy", default="static:1.0", help="policy spec (see fsd sim --help)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default=str(HANDMADE_2THREADS_PROFILE_PATH),
                    help="profile JSON (default: the hand-made 2-thread profile, the fastest replicas: most "
                    "iterations per simulated second)")
    ap.add_argument("--out", default="results/sim_speed.json")
    args = ap.parse_args()

    slo = SLOSpec.default()
    profile = Profile.load(args.profile)
    workload = Workload.from_dict(
        {
            "name": f"poisson-{args.rate:g}rps",
            "duration_s": args.duration,
            "arrivals": {"kind": "poisson", "rate": args.rate},
            "prompt_tokens": {"kind": "lognormal", "median": 200, "sigma": 0.5, "max": 1024},
            "output_tokens": {"kind": "lognormal", "median": 190, "sigma": 0.35, "max": 1024},
            "tier_mix": {"lossless": 0.2, "standard": 0.5, "economy": 0.3},
        }
    )
    config = SimConfig(seed=args.seed, replicas=args.replicas, max_batch=args.max_batch)
    policy = build_policy(args.policy, slo, profile)
    policy_s = [0.0]
    policy_cpu_s = [0.0]
    decide = policy.decide

    def timed_decide(telemetry):  # type: ignore[no-untyped-def]
        t0, c0 = time.perf_counter(), time.process_time()
        decision = decide(telemetry)
        policy_s[0] += time.perf_counter() - t0
        policy_cpu_s[0] += time.process_time() - c0
        return decision

    policy.decide = timed_decide  # type: ignore[method-assign]
    wall0, cpu0 = time.perf_counter(), time.process_time()
    sim = Simulator(config, profile, slo, workload, policy)
    result = sim.run()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    s = result.summary
    out = {
        "benchmark": "sim_speed",
        "simulated_s": args.duration,
        "rate_rps": args.rate,
        "replicas": args.replicas,
        "max_batch": args.max_batch,
        "policy": args.policy,
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "policy_wall_s": round(policy_s[0], 3),
        "policy_cpu_s": round(policy_cpu_s[0], 3),
        "policy_ticks": len(result.timeseries.get("time_s", [])),
        "requests": s["requests"],
        "output_tokens": s["output_tokens"],
        "mean_output_tokens": round(s["output_tokens"] / max(1, s["completed"]), 1),
        "decode_iterations": result.iterations,
        "events": result.events,
        "segments_drawn": sum(r.segments_drawn for r in sim.replicas),
        "iterations_per_cpu_s": round(result.iterations / cpu, 1) if cpu > 0 else None,
        "target_wall_s_for_1h": 5.0,
        "tier_mix": {"lossless": 0.2, "standard": 0.5, "economy": 0.3},
        "summary": {k: s[k] for k in ("completed", "rejected", "slo_attainment", "tpot_ms", "mean_distortion")},
    }
    emit(out, args.out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
