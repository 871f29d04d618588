"""Load benchmark: static T=0, static T=ceiling and the SLO policy under the same step load.

Starts the service locally (loopback only), then for each configuration replays the same open-loop
arrival sequence (Poisson or gamma inter-arrival times; a step load: low rate, high rate, low rate) of
streaming chat requests, recording per request TTFT (first content chunk), TPOT ((last − first chunk) /
(tokens − 1)), E2E, status and the ``fsd`` summary, and sampling T per tier from ``/v1/fsd/status``.
Configurations switch through the admin API on the same deployment (no reload between them).

Prints a JSON report (and writes it to ``--out``) and a PNG (T and rolling p95 TPOT over time per
configuration). Smoke run (tiny random pair, ~1 minute)::

    .venv/bin/python benchmarks/load.py --pair tiny --phase-s 6 --rates 2,12 --out results/load_smoke.json

Real figures (default pair; minutes)::

    .venv/bin/python benchmarks/load.py --pair smollm2-135m --phase-s 60 --rates 0.5,3

The machine's speed drifts over minutes (on the 2-core CPU machines, the same configuration's p50 TPOT
moved by 1.5x between runs), and configurations run one after another: ``--rounds 2`` runs them in a
palindrome (A B C C B A), so a drift linear in time weighs on each configuration alike; a configuration's
figures and the criterion pool its rounds' requests, and each round's figures are kept in the report.
Another policy spec runs beside the shipped one in the same rounds under a name of its own (``--policy
NAME=JSON``, repeatable; every configuration is validated before the service starts)::

    .venv/bin/python benchmarks/load.py --pair smollm2-135m --phase-s 40 --rates 0.1,0.5 --max-tokens 48 \
        --tier economy --tpot-ms 97 --rounds 3 --configs plain,static:4:6,slo,relaxed \
        --policy 'relaxed={"policy": "slo", "initial_margin": 1.0, "rate_z": 0}'

Drive a service that already runs (``fsd serve``; e.g. to record its traffic, docs/rollout.md) with
``--url`` (admin token: ``--token`` or ``$FSD_ADMIN_TOKEN``) and ``--configs live`` (keep its policy)::

    .venv/bin/python benchmarks/load.py --url http://127.0.0.1:8000 --configs live --tier economy,standard
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.named_specs import parse_named_specs  # noqa: E402
from benchmarks.sse_client import timed_stream  # noqa: E402
from benchmarks.stats import ci95  # noqa: E402
from policies.slo import TierOutcome, TierSLO, meets_objective, within_budget  # noqa: E402
from sim.prompts import PROMPTS  # noqa: E402  (one prompt set for the demo and the load test)


def arrivals(rates: list[float], phase_s: float, process: str, cv: float, rng: np.random.Generator,
             max_requests: int) -> list[float]:
    """Arrival times (s from start) for a step load: one phase of ``phase_s`` per rate, then the first
    rate again (low → high → low for two rates)."""
    schedule = [*rates, rates[0]] if len(rates) > 1 else rates
    out: list[float] = []
    for i, rate in enumerate(schedule):
        start, end = i * phase_s, (i + 1) * phase_s
        t = start
        while True:
            if process == "poisson":
                gap = rng.exponential(1.0 / rate)
            else:  # gamma with the given coefficient of variation: shape 1/cv², mean 1/rate
                shape = 1.0 / (cv * cv)
                gap = rng.gamma(shape, 1.0 / (rate * shape))
            t += gap
            if t >= end:
                break
            out.append(t)
            if len(out) >= max_requests:
                return out
    return out


async def one_request(client: Any, t_start: float, at: float, i: int, args: argparse.Namespace) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, t_start + at - time.monotonic()))
    tier = args.tiers[i % len(args.tiers)]  # --tier a,b: requests cycle through the tiers
    body = {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "max_tokens": args.max_tokens,
            "temperature": args.temperature, "seed": i, "stream": True, "fsd": {"tier": tier}}
    rec: dict[str, Any] = {"i": i, "arrival_s": time.monotonic() - t_start, "status": None}
    return await timed_stream(client, "/v1/chat/completions", body, rec)


async def run_config(url: str, name: str, times: list[float], args: argparse.Namespace, token: str) -> dict[str, Any]:
    import httpx

    auth = {"authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(args.request_timeout),
                                 limits=httpx.Limits(max_connections=512)) as client:
        spec = policy_spec(name, args)
        if spec is None:  # 'live': the service's own policy
            spec = (await client.get("/v1/fsd/status", params={"history": 0})).json()["policy"]["spec"]
        else:
            r = await client.put("/v1/fsd/policy", json=spec, headers=auth)
            r.raise_for_status()
        # Let the policy switch land and the previous configuration's queue drain.
        for _ in range(int(30 / args.interval)):
            st = (await client.get("/v1/fsd/status", params={"history": 0})).json()
            tel = st.get("telemetry") or {}
            if tel.get("in_flight", 0) == 0:
                break
            await asyncio.sleep(args.interval)
        await asyncio.sleep(3 * args.interval)
        t_start = time.monotonic()
        samples: list[dict[str, Any]] = []
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                try:
                    st = (await client.get("/v1/fsd/status", params={"history": 0})).json()
                    samples.append({"t_s": time.monotonic() - t_start, "thresholds": st["thresholds"],
                                    "draft_lengths": st.get("draft_lengths"),
                                    "reason": (st.get("last_decision") or {}).get("reason")})
                except Exception:
                    pass
                await asyncio.sleep(args.interval)

        sampler = asyncio.create_task(sample())
        records = await asyncio.gather(*(one_request(client, t_start, at, i, args) for i, at in enumerate(times)))
        done.set()
        await sampler
        history = None
        if getattr(args, "ticks", None):  # the controller's windows and decisions since this run's policy took over
            st = (await client.get("/v1/fsd/status", params={"history": 10_000})).json()
            history = since_policy_event(st["history"])
    return {"name": name, "spec": spec, "records": list(records), "t_samples": samples, "history": history}


def since_policy_event(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``history`` from its last policy-change entry on (the PUT of this run's configuration), so that
    ``fsd sim decisions`` replays the policy object that ran from where it started; all of it if none."""
    starts = [i for i, entry in enumerate(history) if (entry.get("event") or {}).get("kind") == "policy"]
    return history[starts[-1]:] if starts else history


#: Configuration names load.py defines itself (besides ``static:T[:k]``); a --policy name must differ.
BUILT_IN_CONFIGS = ("static0", "plain", "static0k4", "ceiling", "slo", "live")


def parse_alternatives(items: list[str]) -> dict[str, dict[str, Any]]:
    """``--policy NAME=JSON`` items as {name: spec}. A name must not shadow a built-in configuration."""
    return parse_named_specs(items, "--policy", lambda name: "a built-in configuration"
                             if name in BUILT_IN_CONFIGS or name.startswith("static:") else None)


def policy_spec(name: str, args: argparse.Namespace) -> dict[str, Any] | None:
    if name == "live":
        return None
    # Every static configuration states its k (the deployment's unless given): a configuration that
    # left k out would inherit the previous one's (plain's k = 0, say), so results would depend on order.
    default_k: dict[str, Any] = {} if args.default_k is None else {"draft_lengths": args.default_k}
    if name == "static0":
        return {"policy": "static", "thresholds": 0.0, "guards": False, **default_k}
    if name == "plain":  # plain target decoding: T = 0, k = 0 (no draft forward) for every tier
        return {"policy": "static", "thresholds": 0.0, "draft_lengths": 0, "guards": False}
    if name == "static0k4":  # standard speculative decoding: T = 0, k = 4 for every tier
        return {"policy": "static", "thresholds": 0.0, "draft_lengths": 4, "guards": False}
    if name == "ceiling":
        return {"policy": "static", "thresholds": {args.tier: args.ceiling}, "guards": False, **default_k}
    if name == "slo":
        policy: dict[str, Any] = json.loads(args.slo_policy)
        return policy
    alternatives: dict[str, dict[str, Any]] = getattr(args, "alternatives", {})
    if name in alternatives:
        return alternatives[name]
    if name.startswith("static:"):  # static:T or static:T:k, T for the benchmarked tier(s), 0 elsewhere
        parts = name.split(":")[1:]
        try:
            t = float(parts[0])
            k = int(parts[1]) if len(parts) > 1 else None
        except (ValueError, IndexError):
            raise ValueError(f"configuration {name!r}: expected static:T or static:T:k") from None
        if len(parts) > 2 or not (math.isfinite(t) and t >= 0) or (k is not None and k < 0):
            raise ValueError(f"configuration {name!r}: expected static:T or static:T:k with T >= 0, k >= 0")
        spec: dict[str, Any] = {"policy": "static", "thresholds": {tier: t for tier in args.tiers}, "guards": False}
        spec.update({"draft_lengths": k} if k is not None else default_k)
        return spec
    raise ValueError(f"unknown configuration {name!r}; expected static0, plain, static0k4, ceiling, static:T[:k], "
                     "slo, live or a name given by --policy")


def round_order(configs: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, configuration) in run order: the list forwards, then backwards, alternately (a palindrome
    for two rounds), so each configuration's mean position in time is the same."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    return [(r, name) for r in range(rounds) for name in (configs if r % 2 == 0 else configs[::-1])]


def pool_rounds(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One run per configuration (first-run order) with every round's records and threshold samples."""
    pooled: dict[str, dict[str, Any]] = {}
    for run in runs:
        into = pooled.setdefault(run["name"], {**run, "records": [], "t_samples": []})
        into["records"] = into["records"] + run["records"]
        into["t_samples"] = into["t_samples"] + run["t_samples"]
    return list(pooled.values())


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarise(run: dict[str, Any], tpot_target: float | None, duration_s: float,
              ttft_target: float | None = None) -> dict[str, Any]:
    recs = run["records"]
    ok = [r for r in recs if r["status"] == 200 and "e2e_ms" in r]
    out: dict[str, Any] = {"name": run["name"], "spec": run["spec"], "requests": len(recs), "ok": len(ok),
                           "rejected_503": sum(1 for r in recs if r["status"] == 503),
                           "errors": sum(1 for r in recs if r["status"] not in (200, 503))}
    for metric in ("ttft_ms", "tpot_ms", "e2e_ms"):
        vals = [r[metric] for r in ok if r.get(metric) is not None]
        out[metric] = {f"p{q}": percentile(vals, q) for q in (50, 95, 99)}
    tokens = sum(r.get("output_tokens", 0) for r in ok)
    distortion = sum(r["fsd"]["distortion"] for r in ok if r.get("fsd"))
    out["output_tokens"] = tokens
    out["mean_distortion_per_token"] = distortion / tokens if tokens else None
    acc = [r["fsd"]["acceptance_rate"] for r in ok if r.get("fsd") and r["fsd"]["acceptance_rate"] is not None]
    out["mean_acceptance_rate"] = float(np.mean(acc)) if acc else None
    if tpot_target is not None:
        # A request meets every target the tier states (TTFT as the client saw it: queueing included).
        met = [r for r in ok if (r.get("tpot_ms") is None or r["tpot_ms"] <= tpot_target)
               and (ttft_target is None or (r.get("ttft_ms") is not None and r["ttft_ms"] <= ttft_target))]
        out["tpot_target_ms"] = tpot_target
        if ttft_target is not None:
            out["ttft_target_ms"] = ttft_target
        out["slo_attainment"] = len(met) / len(recs) if recs else None  # rejections and errors count as misses
        out["goodput_rps"] = len(met) / duration_s
    ts = [s["thresholds"].get(run.get("tier", "standard"), 0.0) for s in run["t_samples"]]
    out["threshold"] = {"min": min(ts, default=None), "max": max(ts, default=None),
                        "mean": float(np.mean(ts)) if ts else None}
    ks = [s["draft_lengths"].get(run.get("tier", "standard")) for s in run["t_samples"] if s.get("draft_lengths")]
    ks = [k for k in ks if k is not None]
    out["draft_length"] = {"min": min(ks, default=None), "max": max(ks, default=None),
                           "mean": float(np.mean(ks)) if ks else None}
    return out


def criterion(configs: list[dict[str, Any]], tier: dict[str, Any]) -> dict[str, Any] | None:
    """Issue 11's criterion for each adaptive configuration against the static ones that ran.

    Where some static point meets the tier's SLO (attainment >= percentile / 100, mean distortion within
    budget) the policy must meet it at no more distortion than the least-distortion such point (+0.002);
    where none does, its attainment must be within 1 point of the best static point within budget, and
    the policy within budget itself.
    """
    slo_tier = TierSLO.model_validate(tier)

    def dist(c: dict[str, Any]) -> float:
        return c["mean_distortion_per_token"] or 0.0

    def outcome(c: dict[str, Any]) -> TierOutcome:
        return TierOutcome(attainment=c.get("slo_attainment") or 0.0, mean_distortion=dist(c))

    def within(c: dict[str, Any]) -> bool:
        return within_budget(slo_tier, outcome(c))

    def meets(c: dict[str, Any]) -> bool:
        return meets_objective(slo_tier, outcome(c))

    statics = [c for c in configs if (c["spec"] or {}).get("policy") == "static"]
    adaptive = [c for c in configs if c not in statics]
    if not statics or not adaptive or any(c.get("slo_attainment") is None for c in configs):
        return None
    meeting = [c for c in statics if meets(c)]
    out: dict[str, Any] = {"attainment_target": slo_tier.attainment_target, "budget": slo_tier.max_mean_distortion,
                           "static_points_meeting": [c["name"] for c in meeting]}
    if meeting:
        ref = min(meeting, key=dist)
        out["reference"] = {"name": ref["name"], "rule": "meets the SLO at least distortion",
                            "attainment": ref["slo_attainment"], "mean_distortion": dist(ref)}
        held = {c["name"]: meets(c) and dist(c) <= dist(ref) + 0.002 for c in adaptive}
    else:
        inside = [c for c in statics if within(c)]
        best_static = max(inside, key=lambda c: c["slo_attainment"]) if inside else None
        out["reference"] = best_static and {
            "name": best_static["name"], "rule": "most attainment within budget",
            "attainment": best_static["slo_attainment"], "mean_distortion": dist(best_static)}
        best = best_static["slo_attainment"] if best_static else 0.0
        held = {c["name"]: within(c) and c["slo_attainment"] >= best - 0.01 for c in adaptive}
    out["held"] = held
    return out


def paired_rounds(by_round: list[dict[str, Any]], reference: str, adaptive: list[str]) -> dict[str, dict[str, Any]]:
    """Each adaptive configuration's attainment minus the reference's, round by round: the mean and a 95 %
    t-interval over the rounds both ran. Why: the host's speed moves within a run (session 18: one static
    point's two rounds at 0.39 and 0.74), so the pooled figures alone cannot say whether a difference of a
    few points is the policy or the hour; rounds run back to back pair the two under similar speed."""
    att = {(c["name"], c["round"]): c.get("slo_attainment") for c in by_round}
    out: dict[str, dict[str, Any]] = {}
    for name in adaptive:
        diffs = [float(a - att[(reference, r)]) for (n, r), a in sorted(att.items(), key=lambda kv: kv[0][1])
                 if n == name and a is not None and att.get((reference, r)) is not None]
        if not diffs:
            continue
        mean, half = ci95(diffs)
        out[name] = {"reference": reference, "rounds": len(diffs), "per_round": diffs, "mean": mean, "ci95": half}
    return out


def rolling_p95(records: list[dict[str, Any]], metric: str, window_s: float, end_s: float) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    pts = sorted((r["arrival_s"] + r["e2e_ms"] / 1e3, r[metric]) for r in records
                 if r["status"] == 200 and r.get(metric) is not None)
    t = window_s
    while t <= end_s + window_s:
        vals = [v for (done, v) in pts if t - window_s < done <= t]
        if vals:
            xs.append(t)
            ys.append(float(np.percentile(vals, 95)))
        t += window_s / 4
    return xs, ys


def plot(runs: list[dict[str, Any]], tier: str, tpot_target: float | None, phase_s: float, rates: list[float],
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = phase_s * (len(rates) + (1 if len(rates) > 1 else 0))
    fig, (ax_t, ax_l) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for run in runs:
        ax_t.step([s["t_s"] for s in run["t_samples"]], [s["thresholds"].get(tier, 0.0) for s in run["t_samples"]],
                  where="post", label=run["name"])
        xs, ys = rolling_p95(run["records"], "tpot_ms", max(2.0, phase_s / 6), end)
        ax_l.plot(xs, ys, marker=".", label=run["name"])
    if tpot_target is not None:
        ax_l.axhline(tpot_target, color="k", ls="--", lw=1, label=f"SLO p95 TPOT {tpot_target:g} ms")
    for i in range(1, len(rates) + (1 if len(rates) > 1 else 0)):
        for ax in (ax_t, ax_l):
            ax.axvline(i * phase_s, color="grey", lw=0.5)
    ax_t.set_ylabel(f"T ({tier})")
    ax_l.set_ylabel("rolling p95 TPOT (ms)")
    ax_l.set_xlabel("time (s); step load " + " → ".join(f"{r:g}" for r in [*rates, rates[0]][: len(rates) + 1])
                    + " req/s")
    ax_t.legend()
    ax_l.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", default="smollm2-135m")
    p.add_argument("--rates", default="0.5,3", help="step load, req/s per phase (low,high → low,high,low)")
    p.add_argument("--phase-s", type=float, default=60.0, help="seconds per phase")
    p.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    p.add_argument("--cv", type=float, default=2.0, help="gamma inter-arrival coefficient of variation")
    p.add_argument("--max-requests", type=int, default=2000, help="hard bound on requests per configuration")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--tier", default="standard", help="tier of every request, or a,b,…: requests cycle through "
                   "them (the report's T and TPOT target are the first one's)")
    p.add_argument("--tpot-ms", type=float, default=None, help="override the tier's p95 TPOT target")
    p.add_argument("--ttft-ms", type=float, default=None,
                   help="the tier's TTFT target (default: none); attainment then counts it too. Needed to judge a "
                        "batch cap (static batch_cap, or the SLO policy's), which trades TPOT for queueing")
    p.add_argument("--ceiling", type=float, default=None, help="T for the 'ceiling' config (default: tier max)")
    p.add_argument("--configs", default="static0,ceiling,slo",
                   help="comma-separated: static0, plain (T = 0, k = 0), static0k4 (T = 0, k = 4), ceiling, "
                        "static:T or static:T:k (a static point for the benchmarked tier), slo, live (keep the "
                        "service's policy)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the configurations this many times, forwards then backwards (a palindrome for 2: "
                        "a linear drift of the machine's speed weighs on each alike); figures pool the rounds")
    p.add_argument("--url", default=None, help="drive this running service instead of starting one")
    p.add_argument("--token", default=None, help="with --url: admin token (default $FSD_ADMIN_TOKEN)")
    p.add_argument("--slo-policy", default='{"policy": "slo"}', help="JSON policy spec for the 'slo' config (default: the shipped SLO policy)")
    p.add_argument("--policy", dest="policies", action="append", default=[], metavar="NAME=JSON",
                   help="another adaptive configuration for --configs: its name and JSON policy spec, e.g. "
                        "'relaxed={\"policy\": \"slo\", \"rate_z\": 0}' (repeatable): compared with the others "
                        "in the same interleaved rounds")
    p.add_argument("--interval", type=float, default=None, help="control interval (default 1s, 0.5s tiny)")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default=None,
                   help="control.profile: the profile whose operating model the SLO policy uses (default: the pair's shipped one)")
    p.add_argument("--out", default="results/load.json")
    p.add_argument("--png", default=None, help="default: --out with .png")
    p.add_argument("--ticks", default=None,
                   help="also write every run's control history (the controller's windows and decisions, from the "
                        "PUT of its policy on) here, gzip-compressed if it ends in .gz: `fsd sim decisions --history` "
                        "replays it through a policy")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    from controller.config import parse_config
    from controller.runtime import Service
    from policies.registry import make_policy
    from policies.slo import SLOSpec

    try:
        order = round_order([c.strip() for c in args.configs.split(",") if c.strip()], args.rounds)
    except ValueError as e:
        raise SystemExit(f"--rounds: {e}") from None
    rates = [float(x) for x in args.rates.split(",")]
    if not rates or any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise SystemExit(f"--rates must be positive numbers, got {args.rates!r}")
    from decoder.pairs import find_pair_spec

    spec = find_pair_spec(args.pair)
    tiny = spec is not None and spec.test_pair  # random weights, millisecond steps: SLOs it can break
    args.interval = args.interval or (0.5 if tiny else 1.0)
    args.tiers = [t.strip() for t in args.tier.split(",") if t.strip()]
    args.tier = args.tiers[0]
    slo: dict[str, Any] = {
        "tiers": {"lossless": {"fixed_threshold": 0.0, "max_threshold": 0.0},
                  "standard": {"tpot_ms": 8.0 if tiny else 60.0, "max_mean_distortion": 0.5 if tiny else 0.15,
                               "max_threshold": 1.0},
                  "economy": {"tpot_ms": 15.0 if tiny else 120.0, "max_mean_distortion": 0.8 if tiny else 0.35,
                              "max_threshold": 4.0}},
        "default_tier": "standard",
    }
    if args.tpot_ms is not None:
        slo["tiers"][args.tier]["tpot_ms"] = args.tpot_ms
    if args.ttft_ms is not None:
        if not (args.ttft_ms > 0 and math.isfinite(args.ttft_ms)):
            raise SystemExit(f"--ttft-ms must be a positive number, got {args.ttft_ms}")
        slo["tiers"][args.tier]["ttft_ms"] = args.ttft_ms
    if args.url:  # a running service: its SLO, its token
        import httpx

        slo = httpx.get(f"{args.url.rstrip('/')}/v1/fsd/status", params={"history": 0}, timeout=30).json()["slo"]
    if any(t not in slo["tiers"] for t in args.tiers):
        raise SystemExit(f"--tier must be among {sorted(slo['tiers'])}")
    args.ceiling = args.ceiling if args.ceiling is not None else slo["tiers"][args.tier]["max_threshold"]
    tpot_target = slo["tiers"][args.tier].get("tpot_ms")
    ttft_target = slo["tiers"][args.tier].get("ttft_ms")
    token = (args.token or os.environ.get("FSD_ADMIN_TOKEN") or "") if args.url else "load-bench"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = parse_config({
        "model": {"pair": args.pair}, "slo": slo, "control": {"interval_s": args.interval, "profile": args.profile,
                                                        "history": 2000},
        "serve": {"num_replicas": args.replicas, "replica_num_cpus": args.replica_cpus,
                  "max_ongoing_requests": 64, "max_queued_requests": 256},
        "replica": {"max_queued": 64, "stale_after_s": max(10.0, 5 * args.interval)},
        "http": {"port": port, "admin_token": token, "request_timeout_s": args.request_timeout},
    })
    # k of the static configurations that do not name one: the started deployment's (a running one's is
    # not known here: those keep the service's).
    args.default_k = None if args.url else cfg.model.num_draft_tokens
    try:
        args.alternatives = parse_alternatives(args.policies)
        for name in dict.fromkeys(n for _, n in order):  # every configuration valid before the service starts
            config_spec = policy_spec(name, args)
            if config_spec is not None:
                make_policy(config_spec, SLOSpec.model_validate(slo))
    except ValueError as e:  # json.JSONDecodeError included
        raise SystemExit(f"load: {e}") from None
    times = arrivals(rates, args.phase_s, args.arrival, args.cv, np.random.default_rng(args.seed), args.max_requests)
    duration = args.phase_s * (len(rates) + (1 if len(rates) > 1 else 0))
    runs = []
    service = Service(cfg, quiet=True)
    try:
        url = args.url.rstrip("/") if args.url else service.start()
        for r, name in order:
            print(f"load: {name} (round {r + 1}/{args.rounds}): {len(times)} requests over {duration:.0f}s",
                  file=sys.stderr, flush=True)
            run = asyncio.run(run_config(url, name, times, args, token))
            run["tier"] = args.tier
            run["round"] = r
            runs.append(run)
    finally:
        service.stop()
    report = {
        "benchmark": "load", "pair": args.pair, "tier": args.tier, "rates_rps": rates, "phase_s": args.phase_s,
        "arrival": args.arrival, "cv": args.cv if args.arrival == "gamma" else None, "seed": args.seed,
        "max_tokens": args.max_tokens, "temperature": args.temperature, "interval_s": args.interval,
        "tiers": args.tiers, "url": args.url,
        "replicas": args.replicas, "slo": slo, "command": " ".join([sys.executable, *sys.argv]),
        "rounds": args.rounds,
        "configs": [summarise(r, tpot_target, duration * args.rounds, ttft_target) for r in pool_rounds(runs)],
        "runs": [{k: r[k] for k in ("name", "round", "records", "t_samples")} for r in runs],
    }
    if args.rounds > 1:
        report["configs_by_round"] = [{"round": r["round"], **summarise(r, tpot_target, duration, ttft_target)}
                                      for r in runs]
    report["criterion"] = criterion(report["configs"], slo["tiers"][args.tier])
    crit = report["criterion"]
    if args.rounds > 1 and crit is not None and crit.get("reference"):
        crit["paired_by_round"] = paired_rounds(report["configs_by_round"], crit["reference"]["name"],
                                                list(crit["held"]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    if args.ticks:
        ticks = Path(args.ticks)
        ticks.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"report": str(out), "command": report["command"],
                           "runs": [{k: r[k] for k in ("name", "round", "history")} for r in runs]}).encode()
        ticks.write_bytes(gzip.compress(text) if ticks.suffix == ".gz" else text)
    png = Path(args.png) if args.png else out.with_suffix(".png")
    plot([{**r, "name": f"{r['name']} #{r['round'] + 1}"} if args.rounds > 1 else r for r in runs],
         args.tier, tpot_target, args.phase_s, rates, png)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    print(f"load: wrote {out} and {png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
