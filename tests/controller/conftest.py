"""One local Ray cluster and one Serve HTTP proxy for the whole controller test session.

The cluster is small on purpose (2 CPUs, ~100 MB object store) and binds loopback on a free port.
Tests that need the FSD app use the ``service`` fixture (tiny random pair, fast control loop); it is
deployed once per module and reused across that module's tests.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

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


def _start_cluster(attempts: int = 3) -> None:
    """Start a fresh local cluster and check it runs a task.

    On a saturated machine a raylet can die at start-up (it waits a bounded time for its metrics
    agent); that is the environment, not the code under test, so start-up is retried.
    """
    import ray

    @ray.remote(num_cpus=0)
    def ping() -> int:
        return 1

    for attempt in range(1, attempts + 1):
        # address="local": always a fresh cluster, never one a stray `ray start` left behind.
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=100 * 1024 * 1024,
                 log_to_driver=False)
        try:
            if ray.get(ping.remote(), timeout=120) == 1:
                return
        except Exception:
            if attempt == attempts:
                raise
        ray.shutdown()


@pytest.fixture(scope="session")
def ray_serve() -> Iterator[RayServe]:
    import ray
    from ray import serve

    port = free_port()
    _start_cluster()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield RayServe(port)
    finally:
        serve.shutdown()
        ray.shutdown()


ADMIN_TOKEN = "test-admin-token"


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
