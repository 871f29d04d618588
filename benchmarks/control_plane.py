"""Does the controller keep seeing and steering every replica while the data plane is full?

Starts the service (default: the shipped config, the default pair), keeps ``--streams`` long streaming
completions (``ignore_eos``, ``--max-tokens``, tier ``--tier``) running for ``--duration`` seconds — a new
one starts whenever one ends — and polls ``/v1/fsd/status`` every ``--poll`` seconds. Prints JSON:

* ``max_telemetry_age_s``: the largest per-replica telemetry age any poll saw (and the controller's own
  running maximum over every tick), in seconds and in control intervals;
* ``push_latency_ms``: decision → applied on the replica (wall clock of the same host), p50/p99/max;
* ``failsafe_decisions``: control ticks whose decision was the fail-safe (target 0);
* ``polls_without_every_replica``: polls where a replica was missing from status (target 0).

    python benchmarks/control_plane.py [--config cfg.yaml] [--pair NAME] [--duration 60] [--streams 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


async def _streams(url: str, n: int, body: dict[str, Any], headers: dict[str, str], until: float,
                   outcomes: dict[str, int], errors: dict[str, str]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def worker() -> None:
            while time.monotonic() < until:
                try:
                    async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                        text = (await r.aread()).decode(errors="replace")
                    key = "ok" if r.status_code == 200 and '"error"' not in text else f"status_{r.status_code}"
                    if key != "ok":  # keep one message per kind: e.g. an SSE 504 after http.request_timeout_s
                        marker = text.find('"error"')
                        errors.setdefault(key, text[max(0, marker - 10): marker + 200])
                except httpx.HTTPError as exc:
                    key = type(exc).__name__
                outcomes[key] = outcomes.get(key, 0) + 1

        await asyncio.gather(*(worker() for _ in range(n)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="service YAML (default: the shipped default service)")
    p.add_argument("--pair", help="override model.pair (e.g. 'tiny' for a quick check)")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--tier", default="economy")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--poll", type=float, default=1.0)
    args = p.parse_args(argv)

    import torch

    from controller.config import config_with_overrides
    from controller.runtime import Service

    cfg = config_with_overrides(args.config, port=args.port, pair=args.pair)
    service = Service(cfg, quiet=True)
    t_start = time.monotonic()
    url = service.start()
    startup_s = time.monotonic() - t_start
    body = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": args.max_tokens,
            "ignore_eos": True, "stream": True}
    outcomes: dict[str, int] = {}
    errors: dict[str, str] = {}
    until = time.monotonic() + args.duration
    load = threading.Thread(target=lambda: asyncio.run(
        _streams(url, args.streams, body, {"x-slo-tier": args.tier}, until, outcomes, errors)))
    polls: list[dict[str, Any]] = []
    try:
        load.start()
        while time.monotonic() < until:
            t0 = time.monotonic()
            try:
                st = httpx.get(f"{url}/v1/fsd/status", params={"history": 0}, timeout=30).json()
                ages = [r["telemetry_age_s"] for r in st["replicas"]]
                polls.append({"ok": True, "replicas": len(ages), "max_age_s": max(ages) if ages else None,
                              "in_flight": sum(r["in_flight"] for r in st["replicas"]),
                              "status_ms": (time.monotonic() - t0) * 1e3})
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                polls.append({"ok": False, "error": repr(exc)})
            time.sleep(max(0.0, args.poll - (time.monotonic() - t0)))
        load.join()
        final = httpx.get(f"{url}/v1/fsd/status", params={"history": 0}, timeout=30).json()
    finally:
        service.stop()
    expected_replicas = cfg.serve.num_replicas or 1
    ages = [q["max_age_s"] for q in polls if q.get("max_age_s") is not None]
    control = final["control"]
    interval = cfg.control.interval_s
    out = {
        "command": " ".join([sys.executable, *sys.argv]),
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "pair": cfg.model.pair,
        "streams": args.streams, "max_tokens": args.max_tokens, "tier": args.tier, "duration_s": args.duration,
        "max_ongoing_requests": cfg.serve.max_ongoing_requests, "control_interval_s": interval,
        "startup_s": round(startup_s, 1),
        "polls": len(polls),
        "polls_failed": sum(1 for q in polls if not q["ok"]),
        "polls_without_every_replica": sum(1 for q in polls if q["ok"] and q["replicas"] < expected_replicas),
        "max_in_flight_seen": max((q.get("in_flight", 0) for q in polls), default=0),
        "max_telemetry_age_s": max(ages) if ages else None,
        "max_telemetry_age_intervals": (max(ages) / interval) if ages else None,
        "controller_max_replica_age_s": control["max_replica_telemetry_age_s"],
        "push_latency_ms": control["push_latency_ms"],
        "failsafe_decisions": control["failsafe_decisions"],
        "ticks": control["ticks"],
        "completions_counted": control["completions_counted"],
        "client_outcomes": outcomes,
        "client_error_samples": errors,
        "last_decision": final["last_decision"],
        "status_p99_ms": sorted(q["status_ms"] for q in polls if q["ok"])[int(0.99 * (len(ages) - 1))] if ages else None,
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
