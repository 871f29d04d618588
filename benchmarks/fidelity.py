"""Simulator fidelity: the same seeded workload on the real Ray Serve deployment and in the simulator.

For each scenario (``steady``: Poisson at ``--rate``; ``step``: Poisson at ``--step-rates`` low → high →
low) the seeded request list (arrival times, prompt and output lengths, from ``sim.workload``) is

(a) replayed open-loop against the real service (``controller.runtime.Service``: Ray Serve on loopback,
    the FSD replica, the controller running ``--policy``), streaming chat completions of the
    calibration prompts (``--prompts filler`` for raw completions of filler text), timing each
    request at the client: TTFT = first content chunk − send, TPOT = (last − first chunk) / (tokens − 1),
    E2E = end of stream − send; T per tier sampled from ``/v1/fsd/status`` every control interval;
(b) simulated with the calibrated profile, the same policy spec, SLO, control interval, batch size and
    k, and exactly the requests the real run saw: the same send times, the prompt and output token
    counts the service reported (``usage``), so early eos stops are replayed, not guessed.

It compares output-token throughput and p50/p95 of TTFT, TPOT and E2E (relative error of the sim
against the real run) and the T trajectories, and decomposes the error with the replica's own
counters (read through a Serve handle before and after each scenario): the real mean decode step
time at the real mean batch size against the profile's latency model, real tokens per row-iteration
against the profile's acceptance at the T the requests ran with, and the HTTP round trip (idle
``/healthz`` probe). JSON on stdout and ``--out``; overlay plot ``--png``.

Smoke (tiny random pair and a profile calibrated for it; ~2-3 min)::

    fsd calibrate --pair tiny --quick --out results/tiny_profile.json
    .venv/bin/python benchmarks/fidelity.py --pair tiny --profile results/tiny_profile.json \\
        --duration-s 20 --rate 2 --step-rates 1,4 --output-tokens 64,128 --interval 0.5 \\
        --out results/fidelity_tiny.json

Real figures (default pair with its shipped profile; ~6 min on a quiet machine)::

    .venv/bin/python benchmarks/fidelity.py --duration-s 120 --rate 0.6 --step-rates 0.3,1.2

After a simulator or profile change, re-run only the simulator leg on a stored report's real requests
(seconds; the real leg is the stored one)::

    .venv/bin/python benchmarks/fidelity.py --resim results/fidelity.json --out results/fidelity_resim.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import sys
import time
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sse_client import timed_stream  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MEASURED_PROFILE = REPO / "sim" / "profiles" / "smollm2-135m.json"

# Prompt filler: common one-token English words (for BPE vocabularies with a leading-space token per
# word, n words ≈ n tokens; the service reports the exact count, which is what the simulator gets).
_WORDS_TEXT = (
    "the of and to in is was for on that with as by at from his her an they which you one had not but "
    "what all were when we there can more if no out so said up its about into than them only other new "
    "some could time these two may then do first any my now such like our over man me even most made "
    "after also did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men work long get "
    "here between both life being under never day same another know while last might us great old year"
)
_WORDS = tuple(_WORDS_TEXT.split())

METRICS = ("ttft_ms", "tpot_ms", "e2e_ms")


# ---------------------------------------------------------------------------------------------------
# Workload
# ---------------------------------------------------------------------------------------------------


def scenario_workload(name: str, args: argparse.Namespace) -> Any:
    """The seeded ``sim.workload.Workload`` of a scenario."""
    from sim.workload import Workload

    if name == "steady":
        arrivals: dict[str, Any] = {"kind": "poisson", "rate": args.rate}
    elif name == "step":
        low, high = args.step_rates
        third = args.duration_s / 3
        arrivals = {"kind": "step", "steps": [{"at_s": 0.0, "rate": low}, {"at_s": third, "rate": high},
                                              {"at_s": 2 * third, "rate": low}]}
    else:
        raise ValueError(f"unknown scenario {name!r}; expected steady or step")
    return Workload.from_dict({
        "name": name,
        "duration_s": args.duration_s,
        "arrivals": arrivals,
        "prompt_tokens": {"kind": "uniform", "low": args.prompt_tokens[0], "high": args.prompt_tokens[1]},
        "output_tokens": {"kind": "uniform", "low": args.output_tokens[0], "high": args.output_tokens[1]},
        "max_context": args.max_context,
    })


def prompt_text(n_tokens: int, i: int) -> str:
    """About ``n_tokens`` tokens of filler text, different per request."""
    return " ".join(_WORDS[(i * 7 + j * 13) % len(_WORDS)] for j in range(max(1, n_tokens)))


# ---------------------------------------------------------------------------------------------------
# (a) the real service
# ---------------------------------------------------------------------------------------------------


async def _one_request(client: Any, t0: float, at: float, i: int, prompt_tokens: int, max_tokens: int,
                       args: argparse.Namespace, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
    common = {"max_tokens": max_tokens, "temperature": args.temperature, "seed": args.seed * 100_003 + i,
              "stream": True, "fsd": {"tier": args.tier}, **(extra or {})}
    if args.prompts == "calibration":
        # The text the profile's acceptance was measured on: acceptance depends on the text (filler
        # words are far more predictable than answers to instructions).
        from decoder.calibration import CALIBRATION_PROMPTS

        path = "/v1/chat/completions"
        prompts = CALIBRATION_PROMPTS[: args.prompt_count or len(CALIBRATION_PROMPTS)]
        body = {"messages": [{"role": "user", "content": prompts[i % len(prompts)]}], **common}
    else:
        path = "/v1/completions"
        body = {"prompt": prompt_text(prompt_tokens, i), **common}
    rec: dict[str, Any] = {"i": i, "scheduled_s": at, "arrival_s": time.monotonic() - t0, "status": None,
                           "max_tokens": max_tokens, "prompt_tokens_asked": prompt_tokens}
    return await timed_stream(client, path, body, rec)


async def _replay(url: str, requests: Any, policy: dict[str, Any], args: argparse.Namespace,
                  token: str) -> dict[str, Any]:
    import httpx

    auth = {"authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(args.request_timeout),
                                 limits=httpx.Limits(max_connections=1024)) as client:
        (await client.put("/v1/fsd/policy", json=policy, headers=auth)).raise_for_status()
        for _ in range(int(60 / args.interval)):  # the previous scenario's queue drains first
            tel = (await client.get("/v1/fsd/status", params={"history": 0})).json().get("telemetry") or {}
            if not tel.get("in_flight"):
                break
            await asyncio.sleep(args.interval)
        await asyncio.sleep(2 * args.interval)
        t0 = time.monotonic()
        samples: list[dict[str, Any]] = []
        done = asyncio.Event()

        async def sample_thresholds() -> None:
            while not done.is_set():
                try:
                    st = (await client.get("/v1/fsd/status", params={"history": 0})).json()
                    samples.append({"t_s": time.monotonic() - t0, "thresholds": st["thresholds"]})
                except Exception:  # a missed sample is a gap in the plot, not a failure
                    pass
                await asyncio.sleep(args.interval)

        sampler = asyncio.create_task(sample_thresholds())
        records = await asyncio.gather(*(
            _one_request(client, t0, float(requests.arrival_s[i]), i, int(requests.prompt_tokens[i]),
                         int(requests.output_tokens[i]), args)
            for i in range(len(requests))
        ))
        done.set()
        await sampler
    return {"records": list(records), "t_samples": samples}


def _replica_counters(app_name: str) -> dict[str, Any] | None:
    """Cumulative counters of the (single) replica, without draining its records."""
    try:
        from ray import serve

        from controller.app import REPLICA_DEPLOYMENT

        handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=app_name)
        return dict(handle.stats.remote(drain=False).result(timeout_s=30)["counters"])
    except Exception as exc:  # the decomposition is optional; the comparison still stands
        print(f"fidelity: replica counters unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def _http_round_trip_ms(url: str, n: int = 20) -> float:
    import httpx

    times = []
    with httpx.Client(base_url=url, timeout=10.0) as client:
        for _ in range(n):
            t = time.monotonic()
            client.get("/healthz")
            times.append((time.monotonic() - t) * 1e3)
    return float(np.median(times))


def measure_serving_overhead(url: str, app_name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The request path the simulator does not model, measured apart before the legs (it is fixed before it
    is compared with anything): ``--probes`` sequential one-token requests (``ignore_eos``) into the idle
    service, on the legs' own path and prompt lengths, each the client's time from send to the end of the
    stream less the engine's busy time for it (the replica's counters around it). What is left is HTTP, Serve's
    routing, the engine thread's admission and streaming the token back. (The end of the stream, not the first
    text: a single token may decode to no text yet.) Returns the median (ms) and every probe."""
    import httpx

    if args.probes <= 0:
        return {"ms": 0.0, "source": "--probes 0: not measured", "probes": []}
    lo, hi = args.prompt_tokens
    probes: list[dict[str, Any]] = []

    async def probe(j: int, prompt_tokens: int) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(args.request_timeout)) as client:
            return await _one_request(client, time.monotonic(), 0.0, 1_000_000 + j, prompt_tokens, 1, args,
                                      {"ignore_eos": True})

    for j in range(args.probes):
        prompt_tokens = lo + (hi - lo) * j // max(1, args.probes - 1)
        before = _replica_counters(app_name)
        rec = asyncio.run(probe(j, prompt_tokens))
        after = _replica_counters(app_name)
        if before is None or after is None or rec.get("status") != 200 or rec.get("e2e_ms") is None:
            continue
        engine_ms = (after["busy_time_s"] - before["busy_time_s"]) * 1e3
        probes.append({"prompt_tokens": rec.get("prompt_tokens", prompt_tokens), "client_ms": rec["e2e_ms"],
                       "engine_busy_ms": engine_ms, "overhead_ms": rec["e2e_ms"] - engine_ms})
    if not probes:
        raise RuntimeError("no serving-overhead probe was answered with counters; pass --serving-overhead-ms")
    overheads = [p["overhead_ms"] for p in probes]
    return {"ms": float(np.median(overheads)), "p10_ms": float(np.percentile(overheads, 10)),
            "p90_ms": float(np.percentile(overheads, 90)),
            "source": f"median of {len(probes)} idle one-token probes (client time less the engine's busy time)",
            "probes": probes}


# ---------------------------------------------------------------------------------------------------
# (b) the simulator
# ---------------------------------------------------------------------------------------------------


class RecordedThresholds:
    """A policy that sets each tier's T to what the service ran at that time (its status samples, each
    value held until the next): the simulator leg with the service's own decisions (``--open-loop``)."""

    def __init__(self, t_samples: list[dict[str, Any]], tier_names: list[str]) -> None:
        if not t_samples:
            raise ValueError("--open-loop needs the real leg's T samples; the report has none")
        self._times = [float(s["t_s"]) for s in t_samples]
        self._thresholds = [{name: float(s["thresholds"][name]) for name in tier_names} for s in t_samples]

    def decide(self, telemetry: Any) -> Any:
        from policies.decision import Decision

        j = max(0, bisect_right(self._times, telemetry.time_s) - 1)
        return Decision(thresholds=self._thresholds[j], reason="the service's T at this time")

    def reset(self) -> None:
        pass


def simulate(real_records: list[dict[str, Any]], profile: Any, slo: Any, policy: dict[str, Any],
             tier_names: list[str], args: argparse.Namespace, seed: int | None = None,
             recorded: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Run the simulator on exactly the requests the real run saw (``seed``: its random draws; default
    ``--seed``); with ``recorded`` (the real leg's T samples) the T it ran at instead of the policy."""
    from policies.registry import make_policy
    from sim.simulator import SimConfig, Simulator
    from sim.workload import Requests

    recs = sorted(real_records, key=lambda r: r["arrival_s"])
    arrival = np.array([r["arrival_s"] for r in recs])
    # Requests the service did not answer keep their asked lengths (they still loaded the queue).
    prompt = np.array([r.get("prompt_tokens", r["prompt_tokens_asked"]) for r in recs], dtype=np.int64)
    output = np.array([max(1, r.get("output_tokens", r["max_tokens"])) for r in recs], dtype=np.int64)
    tier = np.full(len(recs), tier_names.index(args.tier), dtype=np.int16)
    requests = Requests(arrival, prompt, output, tier, tuple(tier_names))
    k = args.k
    cfg = SimConfig(seed=args.seed if seed is None else seed, replicas=args.replicas, max_batch=args.max_batch,
                    max_queue=args.max_queued,
                    routing="least_loaded", control_interval_s=args.interval, push_delay_s=0.005,
                    div=args.div, k=k, drain_timeout_s=args.request_timeout,
                    serving_overhead_ms=args.serving_overhead_ms or 0.0)
    pol = (RecordedThresholds(recorded, tier_names) if recorded is not None else
           make_policy(policy, slo, speed_curve=profile.to_speed_curve(args.div, k),
                       latency_model=profile.to_latency_model(k)))
    result = Simulator(cfg, profile, slo, requests, pol).run()
    t = result.records
    done = ~np.isnan(t["completion_s"]) & ~t["rejected"]
    out = []
    for j in range(len(recs)):
        rec: dict[str, Any] = {"arrival_s": float(t["arrival_s"][j]), "output_tokens": int(t["output_tokens"][j]),
                               "status": 200 if done[j] else ("rejected" if t["rejected"][j] else "unfinished")}
        if done[j]:
            a, f, c, n = t["arrival_s"][j], t["first_token_s"][j], t["completion_s"][j], t["output_tokens"][j]
            rec["ttft_ms"] = float((f - a) * 1e3)
            rec["tpot_ms"] = float((c - f) * 1e3 / (n - 1)) if n > 1 else None
            rec["e2e_ms"] = float((c - a) * 1e3)
        out.append(rec)
    ts = result.timeseries
    samples = [{"t_s": float(x), "thresholds": {name: float(ts[f"T_{name}"][i]) for name in tier_names}}
               for i, x in enumerate(ts.get("time_s", []))]
    rows = result.meta["row_iterations"]
    return {"records": out, "t_samples": samples, "summary": result.summary, "iterations": result.iterations,
            "tokens_per_row_iteration": result.meta["decode_tokens"] / rows if rows else None}


# ---------------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------------


def summarise(records: list[dict[str, Any]], duration_s: float) -> dict[str, Any]:
    """Throughput and p50/p95 of TTFT, TPOT, E2E over the completed requests."""
    ok = [r for r in records if r["status"] == 200 and r.get("e2e_ms") is not None]
    out: dict[str, Any] = {"requests": len(records), "completed": len(ok)}
    for metric in METRICS:
        vals = [r[metric] for r in ok if r.get(metric) is not None]
        out[metric] = {f"p{q}": float(np.percentile(vals, q)) if vals else None for q in (50, 95)}
    tokens = sum(r.get("output_tokens", 0) for r in ok)
    # Throughput over the span from the first arrival to the last completion (both legs alike).
    if ok:
        start = min(r["arrival_s"] for r in ok)
        end = max(r["arrival_s"] + r["e2e_ms"] / 1e3 for r in ok)
        out["output_tokens_per_s"] = tokens / max(end - start, 1e-9)
    else:
        out["output_tokens_per_s"] = None
    out["output_tokens"] = tokens
    out["duration_s"] = duration_s
    return out


def mean_summary(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The figure-by-figure mean of the simulator leg's replications (None where any replication has none)."""
    def mean(values: list[Any]) -> Any:
        if isinstance(values[0], dict):
            return {key: mean([v[key] for v in values]) for key in values[0]}
        if any(v is None for v in values):
            return None
        return float(np.mean(values))

    out: dict[str, Any] = mean(summaries)
    return out


def _rel(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None or real == 0:
        return None
    return (sim - real) / real


def compare(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    """Relative error of the simulator against the real run, (sim − real) / real."""
    err: dict[str, Any] = {"output_tokens_per_s": _rel(sim["output_tokens_per_s"], real["output_tokens_per_s"])}
    for metric in METRICS:
        for q in ("p50", "p95"):
            err[f"{metric}_{q}"] = _rel(sim[metric][q], real[metric][q])
    return err


def threshold_trajectory_error(real: list[dict[str, Any]], sim: list[dict[str, Any]], tier: str,
                               end_s: float) -> dict[str, float | None]:
    """Mean |T_sim − T_real| over time, both as step functions sampled on a 0.1 s grid."""
    if not real or not sim:
        return {"mean_abs_diff": None, "real_mean": None, "sim_mean": None}
    grid = np.arange(0.0, end_s, 0.1)

    def steps(samples: list[dict[str, Any]]) -> np.ndarray:
        t = np.array([s["t_s"] for s in samples])
        v = np.array([s["thresholds"].get(tier, 0.0) for s in samples])
        idx = np.clip(np.searchsorted(t, grid, side="right") - 1, 0, len(v) - 1)
        return v[idx]

    r, s = steps(real), steps(sim)
    return {"mean_abs_diff": float(np.abs(r - s).mean()), "real_mean": float(r.mean()), "sim_mean": float(s.mean())}


def _profile_prefill_ms(lat: Any, records: list[dict[str, Any]], k: int) -> float:
    """The profile's prefill over the answered requests, each admitted alone at draft length ``k`` (an upper
    bound: joiners admitted together share one prefill's fixed cost). ``LatencyModel.prefill_ms`` reads the
    measured prefills by prompt length where the profile has them."""
    return float(sum(lat.prefill_ms(int(r.get("prompt_tokens", 0)), None if k > 0 else 0) for r in records))


def _tokens_over_requests(profile: Any, records: list[dict[str, Any]], div: str, k: int,
                          batch: float) -> float | None:
    """The profile's tokens per row-iteration averaged over the answered requests at each one's own T, weighted
    by its drafted tokens (its share of the row-iterations, about): tokens per step are concave in T, so the
    profile at the mean T of a run whose T moves overstates them (by 2-4 points in runs 9-10)."""
    rows = [(float(r["fsd"]["threshold"]), float(r["fsd"].get("drafted_tokens") or 0)) for r in records]
    weight = sum(w for _, w in rows)
    if weight <= 0:
        return None
    return float(sum(w * profile.expected_tokens_per_iter(div, t, k, batch) for t, w in rows) / weight)


def decomposition(before: dict[str, Any] | None, after: dict[str, Any] | None, profile: Any,
                  real_records: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any] | None:
    """Where the simulator's error comes from, from the replica's counters over the scenario."""
    if before is None or after is None:
        return None
    d = {key: after[key] - before[key] for key in ("iterations", "row_iterations", "busy_time_s", "draft_time_s",
                                                     "verify_time_s", "prefill_time_s", "prefill_tokens",
                                                     "output_tokens", "drafted", "accepted")}
    if d["iterations"] <= 0 or d["row_iterations"] <= 0:
        return None
    lat = profile.latency
    k = args.k
    mean_batch = d["row_iterations"] / d["iterations"]
    decode_ms = (d["busy_time_s"] - d["prefill_time_s"]) * 1e3 / d["iterations"]
    predicted_ms = float(lat.iteration_ms(mean_batch, k))  # the model is linear in B: exact in the mean
    ok = [r for r in real_records if r.get("fsd")]
    mean_t = float(np.mean([r["fsd"]["threshold"] for r in ok])) if ok else 0.0
    real_tokens = d["output_tokens"] / d["row_iterations"]
    predicted_tokens = profile.expected_tokens_per_iter(args.div, mean_t, k, mean_batch)
    over_requests = _tokens_over_requests(profile, ok, args.div, k, mean_batch)
    return {
        "iterations": d["iterations"],
        "mean_batch": mean_batch,
        "decode_step_ms_real": decode_ms,
        "decode_step_ms_profile": predicted_ms,
        "decode_step_rel_error": _rel(predicted_ms, decode_ms),
        "draft_ms_per_step_real": d["draft_time_s"] * 1e3 / d["iterations"],
        "verify_and_overhead_ms_per_step_real": (d["busy_time_s"] - d["prefill_time_s"] - d["draft_time_s"])
        * 1e3 / d["iterations"],
        "mean_threshold": mean_t,
        "tokens_per_row_iteration_real": real_tokens,
        "tokens_per_row_iteration_profile": predicted_tokens,
        "tokens_per_iteration_rel_error": _rel(predicted_tokens, real_tokens),
        "tokens_per_row_iteration_profile_over_requests": over_requests,
        "tokens_per_iteration_over_requests_rel_error": _rel(over_requests, real_tokens),
        "prefill_ms_real_total": d["prefill_time_s"] * 1e3,
        "prefill_ms_profile_total_upper": _profile_prefill_ms(lat, ok, k),
        "acceptance_rate_real": d["accepted"] / d["drafted"] if d["drafted"] else None,
    }


# ---------------------------------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------------------------------


def plot(scenarios: list[dict[str, Any]], tier: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(scenarios)
    fig, axes = plt.subplots(3, n, figsize=(6 * n, 9), squeeze=False)
    for col, sc in enumerate(scenarios):
        ax_t, ax_l, ax_c = axes[0, col], axes[1, col], axes[2, col]
        for leg, style in (("real", "-"), ("sim", "--")):
            data = sc[leg]
            ax_t.step([s["t_s"] for s in data["t_samples"]], [s["thresholds"].get(tier, 0.0) for s in data["t_samples"]],
                      where="post", ls=style, label=leg)
            pts = sorted((r["arrival_s"] + r["e2e_ms"] / 1e3, r["tpot_ms"]) for r in data["records"]
                         if r["status"] == 200 and r.get("tpot_ms") is not None)
            window = max(2.0, sc["duration_s"] / 12)
            xs, ys = [], []
            t = window
            while t <= sc["duration_s"] + window:
                vals = [v for done, v in pts if t - window < done <= t]
                if vals:
                    xs.append(t)
                    ys.append(float(np.percentile(vals, 95)))
                t += window / 4
            ax_l.plot(xs, ys, ls=style, marker=".", label=leg)
            e2e = np.sort([r["e2e_ms"] for r in data["records"] if r["status"] == 200 and r.get("e2e_ms")])
            if e2e.size:
                ax_c.plot(e2e / 1e3, np.arange(1, e2e.size + 1) / e2e.size, ls=style, label=leg)
        err = sc["error"]
        ax_t.set_title(f"{sc['name']}: p95 TPOT err {_pct(err['tpot_ms_p95'])}, p95 E2E err {_pct(err['e2e_ms_p95'])}")
        ax_t.set_ylabel(f"T ({tier})")
        ax_l.set_ylabel("rolling p95 TPOT (ms)")
        ax_l.set_xlabel("time (s)")
        ax_c.set_xlabel("E2E latency (s)")
        ax_c.set_ylabel("CDF")
        for ax in (ax_t, ax_l, ax_c):
            ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.0f}%"


# ---------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------


def _pair_of_ints(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    a, b = int(lo), int(hi or lo)
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH with 1 <= LOW <= HIGH, got {text!r}")
    return a, b


def _pair_of_rates(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition(",")
    a, b = float(lo), float(hi)
    if not (a > 0 and b > 0 and math.isfinite(a) and math.isfinite(b)):
        raise argparse.ArgumentTypeError(f"expected two positive rates LOW,HIGH, got {text!r}")
    return a, b


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", default="smollm2-135m", help="served pair (shipped name or 'tiny')")
    p.add_argument("--profile", default=None, help="profile JSON (default: the measured smollm2-135m profile)")
    p.add_argument("--scenarios", default="steady,step", help="comma-separated: steady, step")
    p.add_argument("--duration-s", type=float, default=120.0, help="arrival window per scenario")
    p.add_argument("--rate", type=float, default=0.6, help="steady Poisson rate (req/s)")
    p.add_argument("--step-rates", type=_pair_of_rates, default=(0.3, 1.2), help="LOW,HIGH: low → high → low")
    p.add_argument(
        "--prompts",
        choices=("calibration", "filler"),
        default="calibration",
        help="'calibration': the calibration prompt set as chat requests (the text the profile's acceptance "
        "was measured on; prompt lengths are the set's); 'filler': raw completions of --prompt-tokens filler words",
    )
    p.add_argument(
        "--prompt-count",
        type=int,
        default=None,
        help="use the first N calibration prompts (default: as many as the profile was calibrated on)",
    )
    p.add_argument("--prompt-tokens", type=_pair_of_ints, default=(32, 160), help="uniform LOW,HIGH (filler)")
    p.add_argument("--output-tokens", type=_pair_of_ints, default=(32, 96), help="uniform LOW,HIGH (max_tokens)")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--policy", default='{"policy": "pid"}', help="JSON policy spec (both legs)")
    p.add_argument("--tier", default="standard")
    p.add_argument("--tpot-ms", type=float, default=None, help="override the tier's p95 TPOT target")
    p.add_argument("--interval", type=float, default=1.0, help="control interval (s)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (the profile's)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--div", default="kl")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-queued", type=int, default=256)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica (the profile's)")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="Ray num_cpus per replica")
    p.add_argument("--max-requests", type=int, default=1000, help="hard bound on requests per scenario")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-acceptance", type=float, default=None, metavar="KAPPA",
                   help="simulator leg: per-request acceptance variation, concentration κ of "
                   "sim.profile.RequestAcceptance (default: the profile's own, usually none); with --resim "
                   "the command line's value is used, not the stored one")
    p.add_argument("--without", default="", metavar="FIELDS",
                   help="simulator leg: comma-separated profile sections to drop (batch_acceptance, "
                   "request_acceptance) — the model without them, for a before/after; with --resim the command "
                   "line's value is used")
    p.add_argument("--latency-from", default=None, metavar="PROFILE[,PROFILE]",
                   help="simulator leg: the latency model of these profiles (the mean of their coefficients), "
                   "acceptance from --profile — e.g. latency-only calibrations (fsd calibrate --acceptance-from) "
                   "taken just before and just after the real leg, so the machine's drift in speed during the "
                   "run does not count as the simulator's error; with --resim the command line's value is used")
    p.add_argument("--serving-overhead-ms", default=None, type=float, metavar="MS",
                   help="simulator leg: the request path outside the engine (HTTP, routing, streaming back), added "
                   "to its TTFT and E2E (sim.simulator.SimConfig.serving_overhead_ms). Default: measured before "
                   "the legs by idle one-token probes (client time less the engine's busy time for it); with "
                   "--resim, the stored measurement (0 where the report has none)")
    p.add_argument("--sim-seeds", type=int, default=None, metavar="N",
                   help="simulator leg: N replications on the same requests (seeds --seed .. --seed + N - 1); the "
                   "error is taken on the mean of their figures (a p95 over ~100 requests moves by several points "
                   "from one simulator seed to the next). Default 1; with --resim, the stored value")
    p.add_argument("--open-loop", action="store_true",
                   help="simulator leg: run at the T the service ran at (its status samples) instead of the policy: "
                   "the engine model alone, without the control loop's own divergence (a diagnostic; the criterion "
                   "is the closed loop). T only: refused for a policy that moves k; with --resim the command "
                   "line's value is used")
    p.add_argument("--probes", type=int, default=12, help="idle probes for the serving overhead (0: none, then 0 ms)")
    p.add_argument("--resim", default=None, metavar="REPORT",
                   help="no service: re-run only the simulator leg on the real requests stored in an earlier "
                   "report (its settings apply; --profile, --out and --png may differ)")
    p.add_argument("--out", default="results/fidelity.json")
    p.add_argument("--png", default=None, help="default: --out with .png")
    return p


@dataclass
class Setup:
    """What both legs share: the profile, SLO, policy spec and the service config."""

    profile: Any
    profile_path: Path
    slo: Any
    policy: dict[str, Any]
    tier_names: list[str]
    config: Any  # controller.config.FSDConfig
    token: str


_DROPPABLE = frozenset({"batch_acceptance", "request_acceptance"})


def setup(args: argparse.Namespace, port: int, app_name: str = "fsd", route_prefix: str = "/") -> Setup:
    """Validate the flags and build the service config (ValueError naming a bad flag)."""
    from controller.config import parse_config
    from policies.slo import SLOSpec
    from sim.profile import Profile

    if args.profile is None and args.pair != "smollm2-135m":
        raise ValueError(f"--profile is required for pair {args.pair!r} (the shipped profile is smollm2-135m's)")
    profile_path = Path(args.profile) if args.profile else MEASURED_PROFILE
    if not profile_path.is_absolute() and not profile_path.exists() and (REPO / profile_path).exists():
        profile_path = REPO / profile_path  # a repo-relative path, as reports store it
    profile = Profile.load(profile_path)  # ValueError naming a missing or bad file
    dropped = [name for name in args.without.split(",") if name]
    for name in dropped:
        if name not in _DROPPABLE:
            raise ValueError(f"--without {name!r}: droppable sections are {sorted(_DROPPABLE)}")
    if dropped:
        profile = profile.model_copy(update=dict.fromkeys(dropped))
    if args.request_acceptance is not None:  # the simulator leg only: per-request acceptance variation
        from sim.profile import RequestAcceptance

        if not (math.isfinite(args.request_acceptance) and args.request_acceptance > 0):
            raise ValueError(f"--request-acceptance must be a finite κ > 0, got {args.request_acceptance}")
        profile = profile.model_copy(update={"request_acceptance": RequestAcceptance(
            concentration=args.request_acceptance, source="benchmarks/fidelity.py --request-acceptance")})
    if args.latency_from:
        profile = profile.model_copy(update={"latency": mean_latency(args.latency_from)})
    if args.open_loop and policy_moves_k(args.policy):
        raise ValueError(f"--open-loop replays T only, and --policy {args.policy} moves k (its k is not recorded)")
    if args.sim_seeds is not None and args.sim_seeds < 1:
        raise ValueError(f"--sim-seeds must be >= 1, got {args.sim_seeds}")
    if args.serving_overhead_ms is not None and not (math.isfinite(args.serving_overhead_ms)
                                                     and args.serving_overhead_ms >= 0):
        raise ValueError(f"--serving-overhead-ms must be finite and >= 0, got {args.serving_overhead_ms}")
    if args.prompt_count is None and profile.calibration is not None:
        from decoder.calibration import CalibrationRecord

        args.prompt_count = CalibrationRecord.model_validate(profile.calibration).settings.prompts
    try:
        policy = json.loads(args.policy)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--policy is not valid JSON: {exc}") from None
    slo_data = SLOSpec.default().model_dump(mode="json")
    if args.tier not in slo_data["tiers"]:
        raise ValueError(f"--tier {args.tier!r} is not an SLO tier; tiers: {sorted(slo_data['tiers'])}")
    if args.tpot_ms is not None:
        slo_data["tiers"][args.tier]["tpot_ms"] = args.tpot_ms
    slo = SLOSpec.model_validate(slo_data)
    token = "fidelity-bench"
    cfg = parse_config({
        "model": {"pair": args.pair, "num_draft_tokens": args.k, "div": args.div, "max_batch_size": args.max_batch,
                  "torch_threads": args.threads},
        "slo": slo_data,
        "control": {"interval_s": args.interval, "policy": policy, "history": 10_000},
        "serve": {"num_replicas": args.replicas, "replica_num_cpus": args.replica_cpus,
                  "max_ongoing_requests": args.max_queued,
                  "max_queued_requests": 4 * args.max_queued, "app_name": app_name, "route_prefix": route_prefix},
        "replica": {"max_queued": args.max_queued, "max_new_tokens_limit": args.output_tokens[1],
                    "default_max_new_tokens": args.output_tokens[1], "stale_after_s": max(10.0, 5 * args.interval)},
        "http": {"port": port, "admin_token": token, "request_timeout_s": args.request_timeout},
    })
    return Setup(profile, profile_path, slo, policy, list(slo.tiers), cfg, token)


def policy_moves_k(spec: str) -> bool:
    """Whether the policy spec may change k (all but PID, feed-forward and a static spec without draft
    lengths); then a replay of the recorded T alone is not the run."""
    try:
        data = json.loads(spec)
    except json.JSONDecodeError:
        return False  # setup() names the bad JSON
    name = data.get("policy") if isinstance(data, dict) else data
    if isinstance(data, dict) and data.get("draft_lengths") is not None:
        return True
    return not (isinstance(name, str) and name.split(":")[0] in ("pid", "feedforward", "static"))


def mean_latency(paths: str) -> Any:
    """The coefficient-wise mean of the latency models of the comma-separated profiles (ValueError
    naming a bad one). Step and prefill times are linear in the coefficients, so the mean model predicts
    the mean of the models' predictions: bracketing a run by calibrations before and after it."""
    from sim.profile import LatencyModel, Profile

    names = [name.strip() for name in paths.split(",") if name.strip()]
    if not names:
        raise ValueError(f"--latency-from: no profile in {paths!r}")
    models = []
    for name in names:
        try:
            models.append(Profile.load(name).latency)
        except ValueError as exc:
            raise ValueError(f"--latency-from: {exc}") from None
    data = [m.model_dump() for m in models]
    out: dict[str, Any] = {"iteration_time_dist": data[0]["iteration_time_dist"]}
    for key in data[0]:
        if key == "iteration_time_dist":
            continue
        if key == "prefill_ms_by_tokens" and all(d[key] for d in data):
            # Measured prefills: each model's at the union of the measured lengths (piecewise linear through
            # them, and with the mean slope beyond: the mean model is the mean of the models here too).
            grid = sorted({float(n) for d in data for n, _ in d[key]})
            out[key] = [(n, float(np.mean([m.target_prefill_ms(n) for m in models]))) for n in grid]
            continue
        values = [d[key] for d in data]
        if any(v is None for v in values):
            if not all(v is None for v in values):
                raise ValueError(f"--latency-from: {key} is measured in some profiles and not in others")
            out[key] = None
        elif isinstance(values[0], list):  # steps per batch: the mean at each batch (the same rows in each)
            if len({len(v) for v in values}) > 1:
                raise ValueError(f"--latency-from: {key} covers different batch sizes: {[len(v) for v in values]}")
            out[key] = [float(x) for x in np.mean(values, axis=0)]
        else:
            out[key] = float(np.mean(values))
    return LatencyModel.model_validate(out)


def run_scenarios(url: str, st: Setup, args: argparse.Namespace) -> dict[str, Any]:
    """Both legs for every scenario against a deployed service at ``url``; the report."""
    workloads = {}
    for name in args.scenarios.split(","):
        wl = scenario_workload(name.strip(), args)
        reqs = wl.generate(np.random.default_rng(args.seed), st.tier_names, args.tier)
        if len(reqs) > args.max_requests:
            raise ValueError(f"scenario {name!r} has {len(reqs)} requests > --max-requests {args.max_requests}")
        workloads[name.strip()] = reqs
    rtt_ms = _http_round_trip_ms(url)
    overhead: dict[str, Any] = {"ms": args.serving_overhead_ms, "source": "--serving-overhead-ms"}
    if args.serving_overhead_ms is None:
        overhead = measure_serving_overhead(url, st.config.serve.app_name, args)
        args.serving_overhead_ms = overhead["ms"]
        print(f"fidelity: serving overhead {overhead['ms']:.1f} ms ({overhead['source']})", file=sys.stderr, flush=True)
    scenarios = []
    for name, reqs in workloads.items():
        print(f"fidelity: {name}: {len(reqs)} requests over {args.duration_s:.0f}s (real)", file=sys.stderr,
              flush=True)
        before = _replica_counters(st.config.serve.app_name)
        real_run = asyncio.run(_replay(url, reqs, st.policy, args, st.token))
        after = _replica_counters(st.config.serve.app_name)
        parts = decomposition(before, after, st.profile, real_run["records"], args)
        scenarios.append(simulate_scenario(name, len(reqs), real_run, parts, st, args))
    return assemble_report(scenarios, st, args, rtt_ms, overhead)


def simulate_scenario(name: str, n_requests: int, real_run: dict[str, Any], parts: dict[str, Any] | None,
                      st: Setup, args: argparse.Namespace) -> dict[str, Any]:
    """The simulator leg on a real run's requests, and the comparison of the two."""
    print(f"fidelity: {name}: simulating", file=sys.stderr, flush=True)
    recorded = real_run["t_samples"] if args.open_loop else None
    replications = [simulate(real_run["records"], st.profile, st.slo, st.policy, st.tier_names, args, args.seed + r,
                             recorded)
                    for r in range(max(1, args.sim_seeds or 1))]
    sim_run = replications[0]  # its records and T samples are stored and plotted
    real_sum = summarise(real_run["records"], args.duration_s)
    sim_sums = [summarise(rep["records"], args.duration_s) for rep in replications]
    sim_sum = sim_sums[0] if len(sim_sums) == 1 else mean_summary(sim_sums)
    end_s = max([args.duration_s] + [s["t_s"] for s in real_run["t_samples"]])
    if parts is not None and real_sum["ttft_ms"]["p50"] is not None and sim_sum["ttft_ms"]["p50"] is not None:
        # The simulator's TTFT is queueing + prefill + one decode iteration, as the engine's, plus the serving
        # overhead measured apart; what is left of the gap is the model's error and the run's drift.
        parts = {**parts, "ttft_gap_ms_p50": real_sum["ttft_ms"]["p50"] - sim_sum["ttft_ms"]["p50"]}
        parts.pop("serving_overhead_ms_est", None)
    sim_tokens = [rep["tokens_per_row_iteration"] for rep in replications if rep["tokens_per_row_iteration"]]
    if parts is not None and sim_tokens and parts.get("tokens_per_row_iteration_real"):
        # The simulator's own tokens per row-iteration, counted as the replica counts them (a request's last
        # step clipped at its length, T as the simulated policy set it): the like-for-like acceptance check.
        # The profile lines above take whole steps at each request's last T, which overstates them.
        sim_mean = float(np.mean(sim_tokens))
        parts = {**parts, "tokens_per_row_iteration_sim": sim_mean,
                 "tokens_per_iteration_sim_rel_error": _rel(sim_mean, parts["tokens_per_row_iteration_real"])}
    return {
        "name": name,
        "duration_s": args.duration_s,
        "requests": n_requests,
        "real": {**real_run, "summary": real_sum},
        "sim": {**sim_run, "summary": sim_sum},
        "error": compare(real_sum, sim_sum),
        "error_by_sim_seed": [compare(real_sum, one) for one in sim_sums] if len(sim_sums) > 1 else None,
        "threshold_trajectory": threshold_trajectory_error(real_run["t_samples"], sim_run["t_samples"],
                                                           args.tier, end_s),
        "decomposition": parts,
    }


def assemble_report(scenarios: list[dict[str, Any]], st: Setup, args: argparse.Namespace,
                    rtt_ms: float | None, overhead: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "benchmark": "fidelity",
        "pair": args.pair,
        "profile": _repo_relative(st.profile_path),
        "profile_provenance": st.profile.provenance.model_dump(),
        "latency": st.profile.latency.model_dump(),  # the simulator leg's (--latency-from may replace the profile's)
        "policy": st.policy,
        "tier": args.tier,
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()
                     if k not in ("out", "png")},
        "http_round_trip_ms_p50": rtt_ms,
        "serving_overhead": overhead,
        "load_average": list(os.getloadavg()),
        "command": " ".join([sys.executable, *sys.argv]),
        "table": [{"scenario": sc["name"], "real": sc["real"]["summary"], "sim": sc["sim"]["summary"],
                   "error": sc["error"], "error_by_sim_seed": sc.get("error_by_sim_seed"),
                   "threshold_trajectory": sc["threshold_trajectory"],
                   "decomposition": sc["decomposition"]} for sc in scenarios],
        "scenarios": scenarios,
    }


def write_report(report: dict[str, Any], args: argparse.Namespace) -> Path:
    """JSON (per-request records and T samples included) to ``--out``, the plot to ``--png``."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    slim = {**report, "scenarios": [
        {k: sc[k] for k in ("name", "duration_s", "requests")}
        | {leg: {"records": sc[leg]["records"], "t_samples": sc[leg]["t_samples"]} for leg in ("real", "sim")}
        for sc in report["scenarios"]
    ]}
    out.write_text(json.dumps(slim, indent=1, default=float))
    png = Path(args.png) if args.png else out.with_suffix(".png")
    plot(report["scenarios"], args.tier, png)
    return png


def resimulate(args: argparse.Namespace) -> dict[str, Any]:
    """The simulator leg again on a stored report's real requests (e.g. after a simulator or profile
    change): the real leg is the stored one, so only the simulator's side of the error moves."""
    path = Path(args.resim)
    try:
        stored = json.loads(path.read_text())
        settings, table = stored["settings"], {row["scenario"]: row for row in stored["table"]}
        runs = [(sc["name"], sc["requests"], sc["real"], table[sc["name"]].get("decomposition"))
                for sc in stored["scenarios"]]
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"--resim {str(path)!r} is not a fidelity report: {exc!r}") from None
    keep = {"profile": args.profile, "out": args.out, "png": args.png, "resim": args.resim,
            "request_acceptance": args.request_acceptance, "without": args.without,
            "latency_from": args.latency_from, "serving_overhead_ms": args.serving_overhead_ms,
            "sim_seeds": args.sim_seeds, "open_loop": args.open_loop}
    known = vars(build_parser().parse_args([]))
    for key, value in settings.items():
        if key in known and key not in keep:
            setattr(args, key, tuple(value) if isinstance(known[key], tuple) else value)
    if args.profile is None and stored.get("profile"):
        args.profile = stored["profile"]
    if args.sim_seeds is None:
        args.sim_seeds = settings.get("sim_seeds") or 1
    overhead = stored.get("serving_overhead") or {"ms": 0.0, "source": "not measured in the stored report"}
    if args.serving_overhead_ms is None:
        args.serving_overhead_ms = overhead["ms"]
    else:
        overhead = {"ms": args.serving_overhead_ms, "source": "--serving-overhead-ms"}
    st = setup(args, port=0)
    scenarios = [simulate_scenario(name, n, real, _against_profile(parts, st.profile, real["records"], args), st, args)
                 for name, n, real, parts in runs]
    report = assemble_report(scenarios, st, args, stored.get("http_round_trip_ms_p50"), overhead)
    report["resimulated_from"] = {"report": str(path), "command": stored.get("command"),
                                  "load_average": stored.get("load_average")}
    return report


def _against_profile(parts: dict[str, Any] | None, profile: Any, real_records: list[dict[str, Any]],
                     args: argparse.Namespace) -> dict[str, Any] | None:
    """A stored decomposition's profile-side figures recomputed for ``profile`` (the real side stays;
    the TTFT gap is recomputed by :func:`simulate_scenario`)."""
    if not parts:
        return parts
    lat = profile.latency
    step = float(lat.iteration_ms(parts["mean_batch"], args.k))
    tokens = profile.expected_tokens_per_iter(args.div, parts["mean_threshold"], args.k, parts["mean_batch"])
    ok = [r for r in real_records if r.get("fsd")]
    prefill = _profile_prefill_ms(lat, ok, args.k)
    over = _tokens_over_requests(profile, ok, args.div, args.k, parts["mean_batch"])
    out = {**parts, "decode_step_ms_profile": step, "decode_step_rel_error": _rel(step, parts["decode_step_ms_real"]),
           "tokens_per_row_iteration_profile": tokens,
           "tokens_per_iteration_rel_error": _rel(tokens, parts["tokens_per_row_iteration_real"]),
           "tokens_per_row_iteration_profile_over_requests": over,
           "tokens_per_iteration_over_requests_rel_error": _rel(over, parts["tokens_per_row_iteration_real"]),
           "prefill_ms_profile_total_upper": prefill}
    out.pop("ttft_gap_ms_p50", None)
    return out


def _repo_relative(path: Path) -> str:
    """``path`` relative to the repository when inside it (reports stay valid in any clone)."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start a local service (loopback), run every scenario, write the report; returns it."""
    if args.resim:
        report = resimulate(args)
        report["png"] = str(write_report(report, args))
        return report
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from controller.runtime import Service

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    st = setup(args, port)
    service = Service(st.config, quiet=True)
    try:
        url = service.start()
        report = run_scenarios(url, st, args)
    finally:
        service.stop()
    report["png"] = str(write_report(report, args))
    return report


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = run(args)
    except ValueError as exc:
        print(f"fidelity: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in report.items() if k != "scenarios"}, indent=1, default=float))
    print(f"fidelity: wrote {args.out} and {report['png']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
