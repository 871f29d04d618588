"""One completion through the whole stack on the real default pair (SmolLM2-135M fp32 → int8 draft)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.controller.conftest import RayServe, tiny_config, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]


def test_real_pair_chat_completion(ray_serve: RayServe) -> None:
    from ray import serve

    from controller.app import build_app
    from controller.config import parse_config

    cfg = parse_config(tiny_config(model={"pair": "smollm2-135m", "max_batch_size": 2},
                                   serve={"app_name": "fsd-real", "route_prefix": "/real"},
                                   replica={"stale_after_s": 10.0}, control={"interval_s": 1.0}))
    serve.run(build_app(cfg), name="fsd-real", route_prefix="/real")
    try:
        url = f"{ray_serve.base_url}/real"
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16,
                "temperature": 0, "fsd": {"tier": "lossless"}}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["model"] == "smollm2-135m"
        assert "Paris" in data["choices"][0]["message"]["content"]
        # Lossless tier: T = 0, so greedy output is exactly the target's greedy answer.
        assert data["fsd"]["threshold"] == 0.0 and data["fsd"]["drafted_tokens"] > 0
        def replicas_report_the_pair() -> list[Any] | None:
            st = httpx.get(f"{url}/v1/fsd/status", timeout=10).json()
            return st["replicas"] if st["replicas"] and st["replicas"][0]["pair"] == "smollm2-135m" else None

        # The controller reports a replica after its next stats tick.
        replicas = wait_until(replicas_report_the_pair, 120, "the status to report the smollm2-135m replica")
        assert replicas[0]["pair"] == "smollm2-135m"
    finally:
        serve.delete("fsd-real")
