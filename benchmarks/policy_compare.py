"""Honest policy evaluation in the simulator: the shipped SLO policy against a static (T, k) grid on
held-out cases, several seeds, with confidence intervals and a pass/fail criterion per case.

Tuning vs evaluation. The shipped policy's parameters were chosen on the shipped scenarios only
(sim/workloads/*.yaml: steady, step, bursty, diurnal, ramp, azure_conv = the first 30 min of the Azure
conversation trace, with the hand-made 2-thread profile) — ``--tuning`` reruns those. The default
mode evaluates on cases none of that saw:

* slices of the Azure LLM inference trace 2023 (``../shared/traces``, CC-BY 4.0, Patel et al.,
  "Splitwise", ISCA 2024), conversation part, 8-minute slices from 40 and 50 min on (set A) or 45
  and 35 min on (set B; the shipped scenario replays the first 30 min), 30 min (set C), thinned by
  ``sample_fraction`` to fit the fleet and clipped to a 2048-token context; set D is the code part
  (slices at 20 and 40 min, thinned to the same mean arrival rate), used by nothing before it ran. Its
  ~1500-token prompts make TTFT mostly a matter of prefill, which no (T, k) changes;
* the calibrated profile (sim/profiles/smollm2-135m.json, one torch thread: about 6x slower steps than
  the hand-made one), with the default SLO's latency targets scaled by ``CALIBRATED_SLO_SCALE`` so
  that they are reachable; and the hand-made 2-thread profile with SLOSpec.default();
* two fleet sizes (2 and 4 replicas, load scaled with the fleet), a held-out tier mix
  (lossless 0.2 / standard 0.5 / economy 0.3).

Static baselines: every point of a (T, k) grid — T at a fraction u ∈ {0, 0.5, 1} of each tier's range,
k ∈ {2, 4}, plus plain decoding (k = 0) — the same (u, k) for every tier (the diagonal of the per-tier
product, scaled down to 7 runs per case and seed to fit ~10 min on a busy 2-core machine).

Criterion per case, on the means over seeds (see docs/sim.md):

* some static point meets the SLO (every tier: attainment >= its percentile target, distortion within
  budget) ⇒ the policy must meet it too, at mean distortion <= the least-distortion such point's
  (+ ``DISTORTION_TOL``);
* none does ⇒ the policy's attainment (all requests) must be >= the best static point's within budget
  minus 1 point, and the policy within every budget.

    .venv/bin/python benchmarks/policy_compare.py                 # held-out set A, 5 seeds (~10 min, 2 cores)
    .venv/bin/python benchmarks/policy_compare.py --set B --seed-offset 5   # held-out set B, seeds 5-9
    .venv/bin/python benchmarks/policy_compare.py --set C --seed-offset 10  # held-out set C, seeds 10-14
    .venv/bin/python benchmarks/policy_compare.py --set D --seed-offset 15  # held-out set D (code), 15-19
    .venv/bin/python benchmarks/policy_compare.py --set E --seed-offset 30  # held-out set E (code, matched), 30-34
    .venv/bin/python benchmarks/policy_compare.py --set F --seed-offset 35  # set A's slices, matched, 35-39
    .venv/bin/python benchmarks/policy_compare.py --set G --seed-offset 50  # conv at 52 / 33 min, matched, 50-54
    .venv/bin/python benchmarks/policy_compare.py --seeds 2 --duration 150   # smoke
    .venv/bin/python benchmarks/policy_compare.py --tuning        # the shipped scenarios it was tuned on

Writes JSON (stdout + --out) and a markdown table (--md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.named_specs import parse_named_specs  # noqa: E402
from benchmarks.stats import ci95  # noqa: E402
from policies.slo import SLOSpec, TierSLO  # noqa: E402
from sim.inputs import build_policy  # noqa: E402
from sim.profile import DEFAULT_PROFILE_PATH, HANDMADE_2THREADS_PROFILE_PATH, Profile  # noqa: E402
from sim.simulator import SimConfig, Simulator  # noqa: E402
from sim.workload import Workload  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
if not TRACES.exists():  # a worktree sits one level deeper than the main checkout
    TRACES = Path("/work/shared/traces")
ATTRIBUTION = 'Azure LLM inference trace 2023 (CC-BY 4.0; Patel et al., "Splitwise", ISCA 2024)'
CALIBRATED_SLO_SCALE = 4.0
HELDOUT_MIX = {"lossless": 0.2, "standard": 0.5, "economy": 0.3}
U_GRID = (0.0, 0.5, 1.0)
K_GRID = (2, 4)
DISTORTION_TOL = 0.002
ADAPTIVE = {
    "slo (mpc)": "slo",
    "pid-live (old default)": '{"policy": "pid", "metric": "tpot_live", "setpoint": -0.25}',
    # The shipped policy before its quality guard became a safety net at the budget (sets A-C ran this).
    "mpc, default guard": '{"policy": "mpc"}',
}


def scaled_slo(scale: float, tpot_scale: float | None = None) -> SLOSpec:
    """SLOSpec.default() with every latency target × ``scale`` (TPOT × ``tpot_scale`` when given; budgets
    and T ranges unchanged)."""
    base = SLOSpec.default()
    tiers = {}
    for name, tier in base.tiers.items():
        data = tier.model_dump()
        for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
            if data[key] is not None:
                data[key] *= tpot_scale if key == "tpot_ms" and tpot_scale is not None else scale
        tiers[name] = TierSLO.model_validate(data)
    return SLOSpec(tiers=tiers, default_tier=base.default_tier)


@dataclass(frozen=True)
class Case:
    name: str
    profile: str  # path
    slo_scale: float
    replicas: int
    workload: dict[str, Any] = field(hash=False)
    tpot_scale: float | None = None  # None: TPOT targets × slo_scale like the others

    def slo(self) -> SLOSpec:
        if self.slo_scale == 1.0 and self.tpot_scale in (None, 1.0):
            return SLOSpec.default()
        return scaled_slo(self.slo_scale, self.tpot_scale)


def trace_workload(name: str, trace: str, start_s: float, duration_s: float, sample: float) -> dict[str, Any]:
    return {
        "name": name, "duration_s": duration_s,
        "arrivals": {"kind": "trace", "path": str(TRACES / trace), "start_s": start_s, "sample_fraction": sample},
        "prompt_tokens": {"kind": "trace"}, "output_tokens": {"kind": "trace"}, "max_context": 2048,
        "tier_mix": HELDOUT_MIX,
    }


#: Held-out sets: (calibrated-profile slice start, hand-made slice start) in trace minutes. Set A was
#: evaluated first (docs/figures.md run 1, seeds 0-4); set B (other slices, seeds 5-9) after the change run 1
#: prompted (run 2); set C (slices at 30 min, seeds 10-14) after the bug fix run 2 led to (run 3).
#: Set D (seeds 15-19) is the *code* part of the trace, which nothing had used before: evaluated after
#: the shipped policy's quality guard became a safety net at the budget (session 7).
#: Set E (seeds 30-34, session 11) is the code part at minutes it had not been sliced at, with the
#: calibrated cases *matched* to the hand-made ones by a rule fixed before it ran (see matched_scales):
#: under the recalibrated profile (prefill 261 ms + 6 ms per token) sets A-D's fixed scale left those
#: cases prefill-bound, where no (T, k) matters.
#: Set E turned out prefill-bound in every case (the code part's ~1500-token prompts overload the
#: hand-made replicas too: best static points at 0.05-0.14 attainment), so set F (seeds 35-39) is set A's
#: conversation slices with the calibrated cases matched by the same rule; its slices were seen before
#: (run 1), its seeds and calibrated sizing were not.
#: Set G (seeds 50-54, session 17) is the conversation part at minutes no set started at (52 calibrated, 33
#: hand-made; the trace's last 8 minutes and a slice between sets C's and B's), matched like E and F: the
#: evaluation of session 17's changes, which were traced on set F.
HELDOUT_SETS = {"A": ("conv", 40, 50), "B": ("conv", 45, 35), "C": ("conv", 30, 30), "D": ("code", 20, 40),
                "E": ("code", 5, 50), "F": ("conv", 40, 50), "G": ("conv", 52, 33)}
MATCHED_SETS = {"E", "F", "G"}
#: Requests kept per 2 replicas (calibrated, hand-made): the code trace has 8,818 requests in its hour
#: against the conversation trace's 19,365, so its fractions are scaled up to the same mean arrival rate.
_SAMPLE = {"conv": (0.035, 0.055), "code": (0.035 * 19365 / 8818, 0.055 * 19365 / 8818)}


def matched_scales(calibrated: Profile, handmade: Profile, prompt_tokens: float, output_tokens: float
                   ) -> tuple[float, float, float]:
    """(load, TTFT, TPOT) factors that make a calibrated-profile case the hand-made one's analogue: the
    load × the ratio of the two profiles' plain-decoding service time of the trace's median request
    (prefill + output × a batch-1 plain step), TTFT (and E2E) targets × the ratio of their prefill of
    the median prompt, TPOT targets × the ratio of their batch-1 plain step. A rule on the profiles
    and the trace alone, fixed before any case it sizes was run."""
    def phases(p: Profile) -> tuple[float, float]:
        a, b = p.latency.plain_coeffs()
        return p.latency.prefill_ms(int(prompt_tokens)), a + b

    cal_prefill, cal_step = phases(calibrated)
    hand_prefill, hand_step = phases(handmade)
    load = (hand_prefill + output_tokens * hand_step) / (cal_prefill + output_tokens * cal_step)
    return load, cal_prefill / hand_prefill, cal_step / hand_step


def trace_medians(csv: str) -> tuple[float, float]:
    """Median prompt and output tokens of a trace file."""
    import csv as csv_module

    with open(TRACES / csv) as f:
        rows = list(csv_module.DictReader(f))
    return (float(np.median([int(r["ContextTokens"]) for r in rows])),
            float(np.median([int(r["GeneratedTokens"]) for r in rows])))


def heldout_cases(duration_s: float, which: str = "A") -> list[Case]:
    cal, hand = str(DEFAULT_PROFILE_PATH), str(HANDMADE_2THREADS_PROFILE_PATH)
    trace, cal_min, hand_min = HELDOUT_SETS[which]
    cal_sample, hand_sample = _SAMPLE[trace]
    csv = f"azure_llm_2023_{trace}.csv"
    cal_scale, tpot_scale = CALIBRATED_SLO_SCALE, None
    if which in MATCHED_SETS:
        load, cal_scale, tpot_scale = matched_scales(Profile.load(cal), Profile.load(hand), *trace_medians(csv))
        cal_sample = hand_sample * load
    out = []
    for replicas in (2, 4):
        f = replicas / 2  # load scales with the fleet
        out += [
            Case(f"{trace}@{cal_min}min calibrated {replicas}r", cal, cal_scale, replicas,
                 trace_workload(trace, csv, 60.0 * cal_min, duration_s, cal_sample * f), tpot_scale),
            Case(f"{trace}@{hand_min}min hand-made {replicas}r", hand, 1.0, replicas,
                 trace_workload(trace, csv, 60.0 * hand_min, duration_s, hand_sample * f)),
        ]
    return out


def tuning_cases(duration_s: float) -> list[Case]:
    out = []
    for name in ("steady", "step", "bursty", "diurnal", "ramp"):
        data = Workload.load(ROOT / "sim" / "workloads" / f"{name}.yaml").model_dump()
        data["duration_s"] = min(duration_s, data["duration_s"] or duration_s)
        out.append(Case(f"{name} (shipped)", str(HANDMADE_2THREADS_PROFILE_PATH), 1.0, 2, data))
    return out


def static_specs(slo: SLOSpec) -> dict[str, str]:
    out = {"static k=0": json.dumps({"policy": "static", "thresholds": 0.0, "draft_lengths": 0})}
    for k in K_GRID:
        for u in U_GRID:
            thresholds = {name: tier.min_threshold + u * (tier.max_threshold - tier.min_threshold)
                          for name, tier in slo.tiers.items() if tier.fixed_threshold is None}
            out[f"static u={u:g} k={k}"] = json.dumps(
                {"policy": "static", "thresholds": thresholds, "draft_lengths": k})
    return out


def run_one(case: Case, seed: int, label: str, spec: str) -> dict[str, Any]:
    profile = Profile.load(case.profile)
    slo = case.slo()
    workload = Workload.from_dict(case.workload, source=case.name)
    t0 = time.perf_counter()
    res = Simulator(SimConfig(seed=seed, replicas=case.replicas, max_batch=8), profile, slo, workload,
                    build_policy(spec, slo, profile)).run()
    s = res.summary
    return {
        "case": case.name, "seed": seed, "policy": label,
        "attainment": s["slo_attainment"], "mean_distortion": s["mean_distortion"],
        "cost_per_1k_tokens_rs": s["cost_per_1k_tokens"]["replica_seconds"],
        "meets_slo": all(t["meets_objective"] for t in s["tiers"].values()),
        "within_budget": all(t["within_budget"] for t in s["tiers"].values()),
        "tiers": {n: {"attainment": t["slo_attainment"], "distortion": t["mean_distortion"],
                      "tpot_p95_ms": t["tpot_ms"]["p95"], "ttft_p95_ms": t["ttft_ms"]["p95"]}
                  for n, t in s["tiers"].items()},
        "requests": s["requests"], "wall_s": round(time.perf_counter() - t0, 2),
    }


def aggregate(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per policy over seeds: mean ± CI of attainment and distortion; 'meets' on the means per tier."""
    by_policy: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_policy.setdefault(r["policy"], []).append(r)
    out = {}
    for label, runs in by_policy.items():
        att, att_ci = ci95([r["attainment"] for r in runs])
        dist, dist_ci = ci95([r["mean_distortion"] for r in runs])
        out[label] = {"attainment": att, "attainment_ci": att_ci, "mean_distortion": dist,
                      "distortion_ci": dist_ci, "seeds": len(runs),
                      "tiers": {n: {k: float(np.mean([r["tiers"][n][k] for r in runs]))
                                    for k in ("attainment", "distortion")} for n in runs[0]["tiers"]}}
    return out


def criterion(agg: dict[str, dict[str, Any]], slo: SLOSpec, policy: str) -> dict[str, Any]:
    """The pass/fail rule of the module docstring, on means over seeds."""
    def meets(a: dict[str, Any]) -> bool:
        return all(t["attainment"] >= slo.tiers[n].attainment_target - 1e-9 and within(n, t)
                   for n, t in a["tiers"].items())

    def within(name: str, t: dict[str, float]) -> bool:
        budget = slo.tiers[name].max_mean_distortion
        return budget is None or t["distortion"] <= budget + 1e-9

    statics = {k: v for k, v in agg.items() if k.startswith("static")}
    pol = agg[policy]
    meeting = {k: v for k, v in statics.items() if meets(v)}
    if meeting:
        ref_name = min(meeting, key=lambda k: (meeting[k]["mean_distortion"], -meeting[k]["attainment"]))
        ref = meeting[ref_name]
        ok = meets(pol) and pol["mean_distortion"] <= ref["mean_distortion"] + DISTORTION_TOL
        rule = "meets at <= distortion of the least-distortion static point that meets"
    else:
        budgeted = {k: v for k, v in statics.items() if all(within(n, t) for n, t in v["tiers"].items())}
        ref_name = max(budgeted, key=lambda k: budgeted[k]["attainment"])
        ref = budgeted[ref_name]
        ok = (pol["attainment"] >= ref["attainment"] - 0.01
              and all(within(n, t) for n, t in pol["tiers"].items()))
        rule = "no static point meets: attainment within 1 point of the best static point within budget"
    return {"held": bool(ok), "rule": rule, "reference": ref_name,
            "reference_attainment": ref["attainment"], "reference_distortion": ref["mean_distortion"],
            "policy_attainment": pol["attainment"], "policy_distortion": pol["mean_distortion"],
            "static_points_meeting": sorted(meeting)}


def markdown(results: list[dict[str, Any]], command: str, policies: list[str] | None = None) -> str:
    lines = [f"Command: `{command}`", ""]
    policies = policies if policies is not None else list(ADAPTIVE)
    held = {p: sum(1 for r in results if r["criterion"][p]["held"]) for p in policies}
    lines.append("Cases held: " + ", ".join(f"**{p}** {held[p]} / {len(results)}" for p in policies))
    lines.append("")
    lines.append("| case | requests | static points meeting the SLO | reference static point (att, dist) | "
                 + " | ".join(f"{p}: att ± CI, dist ± CI, held" for p in policies) + " |")
    lines.append("|---|---|---|---|" + "---|" * len(policies))
    for r in results:
        agg = r["aggregate"]
        c0 = r["criterion"][policies[0]]
        ref = f"{c0['reference']} ({c0['reference_attainment']:.3f}, {c0['reference_distortion']:.4f})"
        cells = []
        for p in policies:
            a = agg[p]
            cells.append(f"{a['attainment']:.3f} ± {a['attainment_ci']:.3f}, {a['mean_distortion']:.4f} ± "
                         f"{a['distortion_ci']:.4f}, {'**yes**' if r['criterion'][p]['held'] else 'no'}")
        lines.append(f"| {r['case']} | {r['requests']:.0f} | {len(c0['static_points_meeting'])} | {ref} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--duration", type=float, default=480.0, help="simulated seconds of arrivals per case")
    ap.add_argument("--tuning", action="store_true", help="the shipped scenarios the policy was tuned on")
    ap.add_argument("--set", dest="heldout_set", choices=sorted(HELDOUT_SETS), default="A",
                    help="held-out set (A: conv slices at 40/50 min; B: 45/35 min; C: 30/30 min; D: code trace, "
                    "20/40 min; E: code trace, 5/50 min, and F: A's slices, calibrated cases matched to the "
                    "hand-made ones; G: conv at 52/33 min, matched)")
    ap.add_argument("--seed-offset", type=int, default=0, help="first seed (set B was run with 5)")
    ap.add_argument("--cases", default="", help="comma-separated substrings: keep matching cases only")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--out", default="results/policy_compare.json")
    ap.add_argument("--md", default="results/policy_compare.md")
    ap.add_argument("--policy", dest="policies", action="append", default=[], metavar="NAME=JSON",
                    help="another adaptive policy judged beside the shipped ones (repeatable), e.g. "
                         "'slo_cap={\"policy\": \"slo\", \"batch_cap\": true}'")
    args = ap.parse_args()
    if args.seeds < 1:
        raise SystemExit("--seeds must be >= 1")
    try:
        extra = parse_named_specs(args.policies, "--policy", lambda name: "a shipped policy's name"
                                  if name in ADAPTIVE else None)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    adaptive = ADAPTIVE | {name: json.dumps(spec) for name, spec in extra.items()}

    cases = tuning_cases(args.duration) if args.tuning else heldout_cases(args.duration, args.heldout_set)
    if args.cases:
        keys = [c for c in args.cases.split(",") if c]
        cases = [c for c in cases if any(k in c.name for k in keys)]
    jobs = []
    for case in cases:
        specs = static_specs(case.slo()) | adaptive
        for seed in range(args.seed_offset, args.seed_offset + args.seeds):
            for label, spec in specs.items():
                jobs.append((case, seed, label, spec))
    t0 = time.perf_counter()
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            rows = list(pool.map(run_one, *zip(*jobs, strict=True), chunksize=4))
    else:
        rows = [run_one(*j) for j in jobs]
    results = []
    for case in cases:
        case_rows = [r for r in rows if r["case"] == case.name]
        agg = aggregate(case_rows)
        results.append({
            "case": case.name, "profile": Path(case.profile).name, "replicas": case.replicas,
            "slo_scale": case.slo_scale, "tpot_scale": case.tpot_scale, "workload": case.workload,
            "requests": float(np.mean([r["requests"] for r in case_rows])),
            "aggregate": agg, "criterion": {p: criterion(agg, case.slo(), p) for p in adaptive},
        })
    command = "benchmarks/policy_compare.py " + " ".join(sys.argv[1:])
    table = markdown(results, command.strip(), list(adaptive))
    doc = {"benchmark": "policy_compare", "mode": "tuning" if args.tuning else f"held-out set {args.heldout_set}",
           "seeds": list(range(args.seed_offset, args.seed_offset + args.seeds)),
           "duration_s": args.duration, "attribution": ATTRIBUTION, "results": results, "runs": rows,
           "wall_s": round(time.perf_counter() - t0, 1), "command": command}
    for path, text in ((args.out, json.dumps(doc, indent=1, default=str) + "\n"), (args.md, table + "\n")):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
    print(table)
    print(f"\n{len(rows)} runs in {doc['wall_s']} s; data: {ATTRIBUTION}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
