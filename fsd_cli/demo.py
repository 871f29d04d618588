"""``fsd demo [--pair NAME] [--requests N] [--duration S] [--port P]`` — the README's main command.

Starts the service locally (default pair, default SLO, default SLO policy), then drives it over HTTP
in three phases — light load, a bounded burst of concurrent requests that pushes TPOT over the
standard tier's SLO, light load again — while printing, every control tick, the T per tier the
controller chose and why. Ends with a summary and a clean shutdown (also on Ctrl-C).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import socket
import time
from typing import Any

from sim.prompts import PROMPTS

TIERS = ("standard", "economy")
GRACE_S = 30.0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("demo", help="start the service, drive a short burst, show T reacting, shut down",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", default="smollm2-135m", help="model pair ('tiny' = random test pair, fast)")
    p.add_argument("--requests", type=int, default=24, help="requests in the burst (bounded)")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent requests during the burst")
    p.add_argument("--duration", type=float, default=90.0, help="seconds of load after start-up (bounded)")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens per request")
    p.add_argument("--interval", type=float, default=None, help="control interval (default 2s; 0.5s for tiny)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: a free one)")
    p.set_defaults(func=handle)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _one(client: Any, url: str, i: int, max_tokens: int, results: list[dict[str, Any]]) -> None:
    tier = TIERS[i % len(TIERS)]
    body = {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "max_tokens": max_tokens,
            "temperature": 0.7, "seed": i}
    t0 = time.monotonic()
    try:
        r = await client.post(f"{url}/v1/chat/completions", json=body, headers={"x-slo-tier": tier})
        ok = r.status_code == 200
        data = r.json() if ok else {}
        results.append({"tier": tier, "status": r.status_code, "e2e_s": time.monotonic() - t0,
                        "tokens": data.get("usage", {}).get("completion_tokens", 0), "fsd": data.get("fsd")})
    except Exception as exc:  # a failed request is reported, never hidden
        results.append({"tier": tier, "status": f"{type(exc).__name__}", "e2e_s": time.monotonic() - t0,
                        "tokens": 0, "fsd": None})


def _fmt(x: Any, spec: str = ".0f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


async def _drive(url: str, args: argparse.Namespace, interval: float) -> dict[str, Any]:
    import httpx

    results: list[dict[str, Any]] = []
    trajectory: list[dict[str, Any]] = []
    phase = "light"
    stop_at = time.monotonic() + args.duration
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:

        async def light(until: float, start_index: int) -> int:
            i = start_index
            while time.monotonic() < min(until, stop_at):
                await _one(client, url, i, args.max_tokens, results)
                i += 1
            return i

        async def burst(start_index: int, until: float) -> None:
            sem = asyncio.Semaphore(args.concurrency)

            async def guarded(i: int) -> None:
                async with sem:
                    if time.monotonic() < until:  # no new burst request after the burst window
                        await _one(client, url, i, args.max_tokens, results)

            await asyncio.gather(*(guarded(start_index + j) for j in range(args.requests)))

        async def load() -> None:
            nonlocal phase
            # Quarter light, half burst (new requests stop at 3/4), then light again so T can come back.
            quarter = args.duration / 4
            i = await light(time.monotonic() + quarter, 0)
            phase = "burst"
            await burst(i, stop_at - quarter)
            phase = "light"
            await light(stop_at, i + args.requests)
            phase = "done"

        async def watch() -> None:
            print(f"{'t(s)':>6} {'phase':<6} {'inflight':>8} {'p95 TPOT ms':>11} "
                  + " ".join(f"{'T ' + t:>12}" for t in TIERS) + "  reason", flush=True)
            t0 = time.monotonic()
            while phase != "done":
                await asyncio.sleep(interval)
                try:
                    st = (await client.get(f"{url}/v1/fsd/status", params={"history": 0})).json()
                except Exception:
                    continue
                tel = st.get("telemetry") or {}
                thresholds = st.get("thresholds", {})
                reason = (st.get("last_decision") or {}).get("reason", "")
                row = {"t": time.monotonic() - t0, "phase": phase, "thresholds": thresholds,
                       "p95_tpot_ms": (tel.get("tpot") or {}).get("p95_ms"), "in_flight": tel.get("in_flight")}
                trajectory.append(row)
                print(f"{row['t']:6.1f} {phase:<6} {_fmt(row['in_flight'], 'd'):>8} "
                      f"{_fmt(row['p95_tpot_ms']):>11} "
                      + " ".join(f"{thresholds.get(t, 0.0):12.3f}" for t in TIERS) + f"  {reason[:70]}", flush=True)

        watcher = asyncio.create_task(watch())
        try:
            # Hard bound: requests still running GRACE_S after the load window are cancelled (the client
            # disconnects, the replicas abort them), so the demo ends on time even on a saturated machine.
            await asyncio.wait_for(load(), args.duration + GRACE_S)
        except TimeoutError:
            print(f"fsd demo: load window over; cancelling requests still running after {GRACE_S:.0f}s grace",
                  flush=True)
        finally:
            phase = "done"
            await watcher
    return {"results": results, "trajectory": trajectory}


def handle(args: argparse.Namespace) -> int:
    from controller.config import parse_config
    from controller.runtime import Service

    if args.requests < 1 or args.requests > 1000:
        raise ValueError(f"--requests must be in [1, 1000], got {args.requests}")
    if not 5 <= args.duration <= 1800:
        raise ValueError(f"--duration must be in [5, 1800] seconds, got {args.duration}")
    from decoder.pairs import find_pair_spec

    spec = find_pair_spec(args.pair)
    fast = spec is not None and spec.test_pair
    interval = args.interval if args.interval is not None else (0.5 if fast else 2.0)
    slo = None
    if fast:  # a random test pair is fast: give it SLOs a burst on 2 cores can break
        slo = {"tiers": {"lossless": {"fixed_threshold": 0.0, "max_threshold": 0.0},
                         "standard": {"tpot_ms": 8.0, "max_mean_distortion": 0.5, "max_threshold": 1.0},
                         "economy": {"tpot_ms": 15.0, "max_mean_distortion": 0.8, "max_threshold": 4.0}},
               "default_tier": "standard"}
    data: dict[str, Any] = {
        "model": {"pair": args.pair},
        "control": {"interval_s": interval},
        "serve": {"replica_num_cpus": 1.0},
        "http": {"port": args.port or _free_port()},
        "replica": {"stale_after_s": max(10.0, 5 * interval)},
    }
    if slo is not None:
        data["slo"] = slo
    cfg = parse_config(data)
    service = Service(cfg, quiet=True)
    print(f"fsd demo: starting Ray Serve with pair {args.pair!r} (model load can take ~30 s)…", flush=True)
    try:
        url = service.start()
        print(f"fsd demo: serving on {url}; SLO tpot p95: "
              + ", ".join(f"{t}={cfg.slo.tiers[t].tpot_ms} ms" for t in TIERS), flush=True)
        out = asyncio.run(_drive(url, args, interval))
        _summary(out, cfg)
    except KeyboardInterrupt:
        print("\nfsd demo: interrupted", flush=True)
        return 130
    finally:
        print("fsd demo: shutting down…", flush=True)
        service.stop()
        print("fsd demo: done", flush=True)
    return 0


def _summary(out: dict[str, Any], cfg: Any) -> None:
    results = out["results"]
    ok = [r for r in results if r["status"] == 200]
    failed: dict[str, int] = {}
    for r in results:
        if r["status"] != 200:
            failed[str(r["status"])] = failed.get(str(r["status"]), 0) + 1
    print(f"\nrequests: {len(results)} finished, {len(ok)} ok, {len(results) - len(ok)} failed"
          + (f" {failed}" if failed else ""))
    for tier in TIERS:
        tier_ok = [r for r in ok if r["tier"] == tier]
        ts = [row["thresholds"].get(tier, 0.0) for row in out["trajectory"]]
        acc = [r["fsd"]["acceptance_rate"] for r in tier_ok if r["fsd"] and r["fsd"]["acceptance_rate"] is not None]
        dist = [r["fsd"]["mean_distortion"] for r in tier_ok if r["fsd"]]
        print(f"  {tier:<9} {len(tier_ok):3d} ok; T ranged {_fmt(min(ts, default=None), '.3f')}–"
              f"{_fmt(max(ts, default=None), '.3f')} (final {_fmt(ts[-1] if ts else None, '.3f')}); "
              f"acceptance {_fmt(sum(acc) / len(acc) if acc else None, '.2f')}; "
              f"mean distortion/token {_fmt(sum(dist) / len(dist) if dist else None, '.3f')} "
              f"(budget {cfg.slo.tiers[tier].max_mean_distortion})")
