"""One local Ray cluster and one Serve HTTP proxy for the whole controller test session.

The cluster is small on purpose (2 CPUs, ~100 MB object store) and binds loopback on a free port. Start-up
is generous with time (``controller.runtime.init_local_ray``/``start_serve``): a busy machine is slow, not
broken.
Tests that need the FSD app use the ``service`` fixture (tiny random pair, fast control loop); it is
deployed once per module and reused across that module's tests.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RayServe:
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="session")
def ray_serve() -> Iterator[RayServe]:
    import ray
    from ray import serve

    from controller.runtime import init_local_ray, start_serve

    port = free_port()
    # Both retry start-up and raise Serve's proxy deadlines (controller/runtime.py): a busy CI machine must
    # not turn every Ray test into a fixture error.
    init_local_ray(num_cpus=2, include_dashboard=False, object_store_memory=100 * 1024 * 1024, log_to_driver=False)
    start_serve({"host": "127.0.0.1", "port": port})
    try:
        yield RayServe(port)
    finally:
        serve.shutdown()
        ray.shutdown()


ADMIN_TOKEN = "test-admin-token"

T = TypeVar("T")


#: No wait gives up before this: deadlines only matter when a state never comes, and a saturated CI
#: machine may take minutes where a quiet one takes a tick. No test asserts speed through a wait.
MIN_WAIT_S = 180.0


def wait_until(condition: Callable[[], T | None], timeout_s: float, what: str, poll_s: float = 0.2) -> T:
    """Poll ``condition`` until it returns something truthy, at most ``timeout_s``; that value.

    A bounded wait for a state the service reaches on its own ticks (a control tick, a replica report),
    not a sleep for a fixed time: it returns as soon as the state is there, and a state never reached fails
    with ``what`` and the last exception the condition raised. Deadlines are generous (a busy machine is
    slow, not broken): at least :data:`MIN_WAIT_S`.
    """
    timeout_s = max(timeout_s, MIN_WAIT_S)
    deadline = time.monotonic() + timeout_s
    last_exc: Exception | None = None
    pace = threading.Event()  # never set: wait() paces the polls without a bare sleep
    while True:
        try:
            value = condition()
            if value:
                return value
        except Exception as exc:  # not there yet (a request timing out on a busy machine, say)
            last_exc = exc
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last error: {last_exc!r})")
        pace.wait(poll_s)


def replicas_applied(status: Mapping[str, Any], check: Callable[[Mapping[str, Any]], bool]) -> bool:
    """True when ``status`` (``GET /v1/fsd/status``) lists replicas, each has applied the controller's
    current push (same epoch, at least its version) and ``check`` holds on each.

    An empty list never counts, nor does a report built before the push: either let a wait pass while a
    replica still ran the previous policy's k or T (a seeded request then drew a different sequence).
    """
    replicas = status["replicas"]
    return bool(replicas) and all(
        r["epoch"] == status["epoch"] and r["version"] >= status["version"] and check(r) for r in replicas
    )


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """The test service: tiny pair, 0.2 s control interval, 1.5 s fail-safe, small limits."""
    data: dict[str, Any] = {
        "model": {"pair": "tiny", "max_batch_size": 4, "num_draft_tokens": 4},
        "replica": {"max_queued": 24, "stale_after_s": 1.5, "max_new_tokens_limit": 400,
                    "default_max_new_tokens": 16},
        "control": {"interval_s": 0.2},
        "serve": {"num_replicas": 1, "max_ongoing_requests": 32, "max_queued_requests": 64,
                  "replica_num_cpus": 0.5, "app_name": "fsd-test", "route_prefix": "/"},
        "http": {"admin_token": ADMIN_TOKEN, "max_body_bytes": 65536, "request_timeout_s": 60},
    }
    for section, values in overrides.items():
        data.setdefault(section, {}).update(values)
    return data


@contextmanager
def deployed_app(ray_serve: RayServe, config: Mapping[str, Any], name: str, route_prefix: str = "/") -> Iterator[str]:
    """Deploy the FSD app built from ``config`` (a :func:`tiny_config`-style mapping) as ``name``; yield its
    base URL once a replica reports to the controller; delete the app afterwards (the session's Serve stays)."""
    from ray import serve

    from controller.app import build_app
    from controller.config import parse_config

    serve.run(build_app(parse_config(dict(config))), name=name, route_prefix=route_prefix)
    url = ray_serve.base_url + ("" if route_prefix == "/" else route_prefix)
    try:
        wait_until(lambda: httpx.get(f"{url}/v1/fsd/status", timeout=5).json()["replicas"], 60, "replicas reporting")
        yield url
    finally:
        serve.delete(name)
