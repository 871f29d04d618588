"""Request deadline: a request that cannot finish within ``http.request_timeout_s`` gets a 504 (or an SSE
error event when already streaming), and its replica slot is freed (the cancellation reaches the engine)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.controller.conftest import RayServe, tiny_config, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]  # deploying on a busy machine takes minutes

APP = "fsd-timeout"


def test_deadline_gives_504_and_frees_the_slot(ray_serve: RayServe) -> None:
    from ray import serve

    from controller.app import build_app
    from controller.config import parse_config

    # k = 1 and the longest output the tiny context allows: ~300 iterations, well past the 0.3 s deadline
    # even on a quiet machine (with k = 4 and 400 tokens a warm replica could finish in time).
    cfg = parse_config(tiny_config(serve={"app_name": APP, "route_prefix": "/slow"},
                                   model={"pair": "tiny", "max_batch_size": 4, "num_draft_tokens": 1},
                                   replica={"max_new_tokens_limit": 480},
                                   http={"request_timeout_s": 0.3}))
    serve.run(build_app(cfg), name=APP, route_prefix="/slow")
    url = f"{ray_serve.base_url}/slow"
    body = {"prompt": "long", "max_tokens": 480, "ignore_eos": True, "fsd": {"tier": "lossless"}}
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 504, r.text
            message = r.json()["error"]["message"]
            assert "timed out" in message or "did not start" in message
            # A request that "timed out" was running in the engine, so the engine must count its abort; one
            # that "did not start" (a busy machine: the deadline passed before the replica answered) may
            # never have reached it.
            reached_engine = int("timed out" in message)
            s = c.post("/v1/completions", json={**body, "stream": True})
            if s.status_code == 504:  # the deadline passed before the replica even answered (busy machine)
                assert "did not start" in s.json()["error"]["message"]
            else:  # headers went out before the deadline: the stream ends with an error event
                assert s.status_code == 200, s.text
                events = [b[len("data: "):] for b in s.text.split("\n\n") if b.strip()]
                assert events[-1] == "[DONE]"
                error = json.loads(events[-2])["error"]
                assert error["code"] == 504 and "timed out" in error["message"]
                reached_engine += 1

            handle = serve.get_deployment_handle("FSDReplica", APP)

            def stats_once_idle() -> list[Any] | None:
                stats = handle.broadcast("stats", drain=False).results(timeout_s=60)
                return stats if all(st["in_flight"] == 0 for st in stats) else None

            # The abort reaches the engine on its next step; until then the slot still counts as in flight.
            stats = wait_until(stats_once_idle, 120, "timed-out requests to be aborted in the engine (in_flight 0)")
            assert sum(st["counters"]["aborted"] for st in stats) >= reached_engine
            assert sum(st["counters"]["completions"] for st in stats) == 0
    finally:
        serve.delete(APP)
