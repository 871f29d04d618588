"""The hand-off of ``Decision.replicas`` to Ray Serve's autoscaler (controller/autoscaling.py): the
custom-policy function Serve calls, the control loop's publisher, the app wiring; and on a live
cluster, a decision for 2 replicas makes Serve run 2."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from controller.autoscaling import (
    POLICY_FUNCTION,
    PublishedReplicas,
    ReplicaCountPublisher,
    fsd_autoscaling_policy,
    kv_key,
)
from controller.config import parse_config, steered_replica_bounds


def make_context(policy_state: dict[str, Any] | None = None, *, running: int = 1, ongoing: float = 0.0,
                 low: int = 1, high: int = 4, now: float = 1000.0) -> Any:
    """A real Serve AutoscalingContext (the hook's input), defaults plus overrides."""
    from ray.serve._private.common import DeploymentID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    config = AutoscalingConfig(min_replicas=low, max_replicas=high, target_ongoing_requests=2)
    return AutoscalingContext(
        deployment_id=DeploymentID(name="FSDReplica", app_name="fsd-unit"), deployment_name="FSDReplica",
        app_name="fsd-unit", current_num_replicas=running, target_num_replicas=running, running_replicas=[],
        total_num_requests=ongoing, total_queued_requests=0.0, aggregated_metrics={}, raw_metrics={},
        capacity_adjusted_min_replicas=low, capacity_adjusted_max_replicas=high,
        policy_state=dict(policy_state or {}), last_scale_up_time=None, last_scale_down_time=None,
        current_time=now, config=config,
    )


def cached(record: PublishedReplicas | None, read_at: float = 999.5) -> dict[str, Any]:
    """policy_state as the hook leaves it after reading ``record`` at ``read_at`` (no store read follows
    within READ_EVERY_S)."""
    return {"fsd_read_unix": read_at, "fsd_record": record.to_json().decode() if record is not None else None}


def test_record_round_trips_and_malformed_records_are_refused() -> None:
    record = PublishedReplicas(3, 1.0, 11.0, "epoch", 7)
    assert PublishedReplicas.from_json(record.to_json()) == record
    assert PublishedReplicas.from_json(PublishedReplicas(None, 1.0, 2.0).to_json()).replicas is None
    for raw in (b"not json", b"{}", b'{"replicas": -1, "published_unix": 0, "valid_until_unix": 1}',
                b'{"replicas": true, "published_unix": 0, "valid_until_unix": 1}',
                b'{"replicas": 2, "published_unix": "NaN", "valid_until_unix": 1}'):
        with pytest.raises(ValueError, match="replica"):
            PublishedReplicas.from_json(raw)
    assert kv_key("fsd") == "app/fsd"


def test_hook_returns_the_published_count_clamped_to_serves_bounds() -> None:
    for asked, expected in ((2, 2), (9, 4), (0, 1)):
        desired, state = fsd_autoscaling_policy(make_context(cached(PublishedReplicas(asked, 990.0, 1010.0))))
        assert desired == expected, asked
        assert state["fsd_source"] == "fsd-controller"


def test_hook_falls_back_to_serves_default_policy_without_a_usable_count() -> None:
    # 6 ongoing requests over 1 replica at target 2: Serve's default policy wants 3.
    from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

    default, _ = replica_queue_length_autoscaling_policy(make_context(ongoing=6.0))
    assert default == pytest.approx(3.0)
    for record in (None,  # nothing published (no controller, or no read possible)
                   PublishedReplicas(None, 990.0, 1010.0),  # the policy asks for no count (or fail-safe)
                   PublishedReplicas(2, 900.0, 950.0)):  # stale: the controller stopped publishing
        desired, state = fsd_autoscaling_policy(make_context(cached(record), ongoing=6.0))
        assert desired == pytest.approx(default), record
        assert state["fsd_source"] == "serve-default"


def test_hook_reads_the_store_at_most_every_second() -> None:
    # A cached read younger than READ_EVERY_S is reused; an older one is read again. Outside a Ray
    # cluster the store is unreachable: the fresh read finds nothing and Serve's default decides.
    young = cached(PublishedReplicas(3, 990.0, 1010.0), read_at=999.5)
    assert fsd_autoscaling_policy(make_context(young))[0] == 3
    old = cached(PublishedReplicas(3, 990.0, 1010.0), read_at=990.0)
    desired, state = fsd_autoscaling_policy(make_context(old))
    assert state["fsd_read_unix"] == 1000.0 and state["fsd_record"] is None
    assert state["fsd_source"] == "serve-default" and desired == 0  # no load: Serve's bounds lift it to min


def test_publisher_never_blocks_the_loop_and_skips_while_a_write_is_in_flight() -> None:
    store: dict[str, bytes] = {}
    gate = threading.Event()
    written = threading.Event()

    def slow_put(key: str, value: bytes) -> None:
        gate.wait(60)
        store[key] = value
        written.set()

    clock = iter(float(t) for t in range(100, 200))
    publisher = ReplicaCountPublisher("fsd", interval_s=0.5, put=slow_put, clock=lambda: next(clock))
    assert publisher.publish(2, "e", 1) is True  # returns at once: the write waits on the gate
    assert publisher.publish(3, "e", 2) is False  # in flight: skipped, the next tick carries it
    gate.set()
    assert written.wait(60)
    record = PublishedReplicas.from_json(store["app/fsd"])
    assert (record.replicas, record.version, record.valid_until_unix - record.published_unix) == (2, 1, 10.0)
    deadline = time.monotonic() + 60
    while publisher.published < 1 or publisher._in_flight.is_set():  # the worker's finally runs after the put
        assert time.monotonic() < deadline
        threading.Event().wait(0.01)
    assert publisher.publish(3, "e", 2) is True
    assert publisher.stats()["skipped"] == 1


def test_app_installs_the_hook_only_when_the_policy_steers_replicas() -> None:
    from controller.app import replica_options

    auto = {"min_replicas": 1, "max_replicas": 3}
    steered = parse_config({"serve": {"autoscaling_config": auto}})
    assert steered_replica_bounds(steered) == (1, 3)
    assert replica_options(steered)["autoscaling_config"]["policy"] == {"policy_function": POLICY_FUNCTION}
    off = parse_config({"serve": {"autoscaling_config": auto}, "control": {"steer_replicas": False}})
    assert steered_replica_bounds(off) is None and "policy" not in replica_options(off)["autoscaling_config"]
    own = {**auto, "policy": {"policy_function": "ray.serve.autoscaling_policy:default_autoscaling_policy"}}
    theirs = parse_config({"serve": {"autoscaling_config": own}})
    assert steered_replica_bounds(theirs) is None  # the operator's own policy wins; ours asks for nothing
    assert replica_options(theirs)["autoscaling_config"]["policy"] == own["policy"]
    fixed = parse_config({"serve": {"num_replicas": 2}})
    assert steered_replica_bounds(fixed) is None and "autoscaling_config" not in replica_options(fixed)


APP = "fsd-hook"


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_a_decision_for_two_replicas_makes_serve_run_two(ray_serve: Any) -> None:
    """The shipped policy asks for 2 replicas (its floor, min_replicas 2, within Serve's 1..2) with no
    traffic at all: Serve's default policy would keep 1, so a second replica running proves the hook."""
    from ray import serve

    from controller.app import REPLICA_DEPLOYMENT, build_app
    from tests.controller.conftest import tiny_config, wait_until

    cfg = parse_config(tiny_config(
        serve={"app_name": APP, "route_prefix": "/hook", "num_replicas": None,
               "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 0,
                                      "downscale_delay_s": 600}},
        control={"policy": {"policy": "slo", "min_replicas": 2}},
    ))
    serve.run(build_app(cfg), name=APP, route_prefix="/hook")
    try:
        import httpx

        url = f"{ray_serve.base_url}/hook"

        def controller_asks_two() -> dict[str, Any] | None:
            st = httpx.get(f"{url}/v1/fsd/status", params={"history": 0}, timeout=10).json()
            last = (st["autoscaling"]["publisher"] or {}).get("last") or {}
            return st if last.get("replicas") == 2 else None

        st = wait_until(controller_asks_two, 120, "the controller to publish the policy's 2 replicas")
        assert st["autoscaling"]["replica_bounds"] == [1, 2]
        assert st["last_decision"]["replicas"] == 2

        def serve_runs_two() -> int | None:
            deployment = serve.status().applications[APP].deployments[REPLICA_DEPLOYMENT]
            running = int(deployment.replica_states.get("RUNNING", 0))
            return running if running == 2 else None

        assert wait_until(serve_runs_two, 180, "Serve to run the 2 replicas the policy asked for") == 2
        # Both report to the controller, and both run its current decision.
        def both_report() -> list[dict[str, Any]] | None:
            reps: list[dict[str, Any]] = httpx.get(f"{url}/v1/fsd/status", params={"history": 0},
                                                   timeout=10).json()["replicas"]
            return reps if len(reps) == 2 else None

        reps = wait_until(both_report, 120, "both replicas to report")
        assert len({r["replica_id"] for r in reps}) == 2
    finally:
        serve.delete(APP)
