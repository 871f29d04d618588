"""The slow loop: Serve's autoscaler adds a replica under load, and the controller brings it to the
current T within a tick (the push is every tick, idempotent, versioned)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import httpx
import pytest

from tests.controller.conftest import ADMIN_TOKEN, RayServe, tiny_config, wait_until

# slow: the scale-up waits on Serve's autoscaler (seconds on a quiet machine, minutes on a saturated one).
# The timeout covers the deploy, up to 600 s of load and the final bounded wait on a saturated machine.
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(1500)]

APP = "fsd-autoscale"


def test_autoscaled_replica_gets_current_threshold(ray_serve: RayServe) -> None:
    from ray import serve

    from controller.app import build_app
    from controller.config import parse_config

    cfg = parse_config(tiny_config(
        serve={"app_name": APP, "route_prefix": "/auto", "num_replicas": None,
               "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
                                      "upscale_delay_s": 1, "downscale_delay_s": 600,
                                      "metrics_interval_s": 0.5, "look_back_period_s": 2}},
        control={"policy": {"policy": "static", "thresholds": {"standard": 0.4, "economy": 1.0}, "guards": False}},
    ))
    t_deploy = time.monotonic()
    serve.run(build_app(cfg), name=APP, route_prefix="/auto")
    print(f"deployed in {time.monotonic() - t_deploy:.1f}s")
    url = f"{ray_serve.base_url}/auto"
    try:
        def status() -> dict[str, Any]:
            return httpx.get(f"{url}/v1/fsd/status", params={"history": 0}, timeout=10).json()

        async def load(stop_at: float, completed: asyncio.Event) -> list[int]:
            codes: list[int] = []
            async with httpx.AsyncClient(base_url=url, timeout=300) as c:  # queued behind the load
                async def worker() -> None:
                    while time.monotonic() < stop_at:
                        r = await c.post("/v1/completions", json={"prompt": "scale", "max_tokens": 200})
                        codes.append(r.status_code)
                        completed.set()
                        if len(status_replicas) >= 2:
                            return
                await asyncio.gather(*(worker() for _ in range(10)))
            completed.set()
            return codes

        status_replicas: list[Any] = []

        async def watch(stop_at: float, completed: asyncio.Event) -> None:
            # Driven by the load: each finished request (the autoscaler's own signal moves with them) is a
            # tick to look at the status again; no fixed sleep.
            while len(status_replicas) < 2:
                try:
                    await asyncio.wait_for(completed.wait(), timeout=max(stop_at - time.monotonic(), 0.0))
                except TimeoutError:
                    return
                completed.clear()
                with contextlib.suppress(Exception):  # status may time out on a busy machine: poll again
                    status_replicas[:] = (await asyncio.to_thread(status))["replicas"]

        async def scenario() -> list[int]:
            stop_at = time.monotonic() + 600  # bounded; a saturated machine starts a replica slowly
            completed = asyncio.Event()
            codes, _ = await asyncio.gather(load(stop_at, completed), watch(stop_at, completed))
            return codes

        t0 = time.monotonic()
        codes = asyncio.run(scenario())
        print(f"second replica reporting after {time.monotonic() - t0:.1f}s of load")
        # Every request is answered: served, or (a saturated machine passing the service's own 60 s deadline)
        # an explicit 504 — never a hang or a dropped connection.
        assert set(codes) <= {200, 504} and 200 in codes, codes
        assert len(status_replicas) == 2, "the autoscaler should add a second replica under load"
        # Every replica, the new one included, runs the controller's current T and version.
        def replicas_at_current_threshold() -> list[Any] | None:
            st = status()
            reps = st["replicas"]
            current = len(reps) == 2 and all(r["thresholds"]["standard"] == 0.4 and r["version"] == st["version"]
                                             for r in reps)
            return reps if current else None

        # The controller pushes T every tick (0.2 s); a busy machine stretches ticks, hence the deadline.
        reps = wait_until(replicas_at_current_threshold, 120, "both replicas to run the current T and version")
        assert len(reps) == 2 and all(r["thresholds"] == {"lossless": 0.0, "standard": 0.4, "economy": 1.0}
                                      for r in reps), reps
        assert ADMIN_TOKEN  # the app is the same as the main service, only the Serve options differ
    finally:
        serve.delete(APP)
