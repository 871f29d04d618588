"""The control channel without Ray, tick by tick: real ``FSDReplica``s (tiny pair) report straight into a
real ``FSDController`` through the same ``report`` call Serve would route, on a clock the test advances.

Timers never fire here (report and control intervals of 60 s); every report and every tick is an
explicit step, so each assertion names the tick it is about.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from controller.batching import BatchingLoop, TokenEvent
from controller.control_loop import FSDController
from controller.protocol import EndChunk, ReplicaReport, ReportReply, StartChunk
from controller.replica import FSDReplica
from policies.registry import resolve_spec
from tests.controller.conftest import tiny_config

ECONOMY_T = 1.5


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _config(**control: Any) -> dict[str, Any]:
    # The replicas' own fail-safe clock is real time: long enough that it never fires in these tests.
    return tiny_config(control={"interval_s": 60.0, **control},
                       replica={"report_interval_s": 60.0, "stale_after_s": 600.0})


def _sender(controller_ref: list[FSDController]) -> Callable[[list[ReplicaReport]], Awaitable[ReportReply]]:
    """Reports go to whichever controller is current (a restart swaps it)."""

    async def send(batch: list[ReplicaReport]) -> ReportReply:
        return await controller_ref[0].report(batch)

    return send


async def _complete(replica: FSDReplica, n: int, tier: str = "economy", max_tokens: int = 6) -> int:
    done = 0
    for i in range(n):
        chunks = [c async for c in replica.generate({"prompt": f"p{i}", "max_tokens": max_tokens, "tier": tier,
                                                      "ignore_eos": True, "seed": i})]
        end = chunks[-1]
        assert isinstance(end, EndChunk) and end.finish_reason == "length", end
        assert isinstance(chunks[0], StartChunk) and chunks[0].tier == tier
        done += 1
    return done


async def _tick(clock: Clock, controller: FSDController, *replicas: FSDReplica) -> None:
    clock.now += 1.0
    for r in replicas:
        await r.push_report()
    controller.tick()


def test_silent_replica_costs_only_its_own_report_and_is_counted_once_when_back() -> None:
    async def scenario() -> None:
        clock = Clock()
        ctrl = FSDController(_config(policy={"policy": "static", "thresholds": {"economy": ECONOMY_T}}),
                             start_loop=False, clock=clock)
        ref = [ctrl]
        a, b = FSDReplica(_config(), _sender(ref)), FSDReplica(_config(), _sender(ref))
        try:
            finished = await _complete(a, 2) + await _complete(b, 2)
            await _tick(clock, ctrl, a, b)
            assert ctrl.control_stats()["completions_counted"] == finished, "tick 1"
            # b goes silent for five ticks spanning 65 s — past forget_replica_after_s (60 s), so the
            # controller forgets its state — while it keeps finishing requests.
            finished += await _complete(b, 3)
            for i in range(5):
                finished += await _complete(a, 1)
                clock.now += 12.0
                await _tick(clock, ctrl, a)
                window = ctrl._last_window
                assert window is not None and window.reports == 1, f"silent tick {i}: a's report counted"
                assert window.telemetry.completions == 1, f"silent tick {i}"
            assert b._replica_id not in {r["replica_id"] for r in ctrl.status()["replicas"]}, "forgotten"
            # b's report reaches the controller but the reply is lost: b keeps it and re-sends it.
            reply_lost = False

            async def lossy(batch: list[ReplicaReport]) -> ReportReply:
                nonlocal reply_lost
                await ctrl.report(batch)
                reply_lost = True
                raise TimeoutError("reply lost")

            b._sender = lossy
            await b.push_report()
            assert reply_lost and [r.seq for r in b.unacked_reports()] == [2], "b keeps the unacknowledged report"
            b._sender = _sender(ref)
            await _tick(clock, ctrl, a, b)  # b re-sends report 2 with report 3
            assert not b.unacked_reports(), "acknowledged after the re-send"
            stats = ctrl.control_stats()
            assert stats["completions_counted"] == finished, f"exactly once: {stats} vs {finished} finished"
            assert {r["replica_id"] for r in ctrl.status()["replicas"]} == {a._replica_id, b._replica_id}
        finally:
            a.__del__()
            b.__del__()

    asyncio.run(scenario())


def test_restarted_controller_resumes_at_the_replicas_t_and_failsafe_still_wins() -> None:
    async def scenario() -> None:
        clock = Clock()
        old = FSDController(_config(policy={"policy": "static", "thresholds": {"economy": ECONOMY_T}}),
                            start_loop=False, clock=clock)
        ref = [old]
        replica = FSDReplica(_config(), _sender(ref))
        try:
            for _ in range(2):
                await _tick(clock, old, replica)
            await replica.push_report()  # the reply of tick 2 carries tick 2's decision
            assert replica.stats()["thresholds"]["economy"] == ECONOMY_T
            # The controller dies; Serve starts a new one from the config: a PID policy, whose own state
            # would start every tier at the safe T (0). (The model-predictive default has no integrator
            # to rebuild: it decides from its model and the telemetry, whatever T it inherits.)
            new = FSDController(_config(policy={"policy": "pid", "metric": "tpot_live", "setpoint": -0.25}),
                                start_loop=False, clock=clock)
            ref[0] = new
            clock.now += 1.0
            assert new.tick() is None, "no decision before the replicas have reported"
            await replica.push_report()
            assert replica.stats()["thresholds"]["economy"] == ECONOMY_T, "no push before resuming"
            for i in range(3):
                await _tick(clock, new, replica)
                assert new.status()["thresholds"]["economy"] == pytest.approx(ECONOMY_T, abs=0.3), f"tick {i}"
            assert new.status()["resumed"]["from"] == "replicas"
            await replica.push_report()
            assert replica.stats()["epoch"] == new.status()["epoch"]
            assert replica.stats()["thresholds"]["economy"] == pytest.approx(ECONOMY_T, abs=0.3)
            # Telemetry really stale (nobody reported for 10 s): the policy's fail-safe wins.
            clock.now += 10.0
            new.tick()
            decision = new.status()["last_decision"]
            assert decision["reason"].startswith("fail-safe"), decision
            assert new.status()["thresholds"]["economy"] == 0.0
            assert new.control_stats()["failsafe_decisions"] == 1
        finally:
            replica.__del__()

    asyncio.run(scenario())


def test_pushed_k_per_tier_runs_per_row_and_comes_back_in_the_window() -> None:
    """The controller decides lossless k = 0, standard k = 3: in one batch the lossless request decodes
    without drafting while the standard one drafts, and the next window carries what the model-predictive
    policy reads (k and sequence iterations per tier, step time, batch size)."""

    async def run(replica: FSDReplica, tier: str) -> EndChunk:
        chunks = [c async for c in replica.generate({"prompt": "p", "max_tokens": 24, "tier": tier,
                                                      "ignore_eos": True, "seed": 1})]
        assert isinstance(chunks[-1], EndChunk) and chunks[-1].finish_reason == "length", chunks[-1]
        return chunks[-1]

    async def scenario() -> None:
        clock = Clock()
        ks = {"lossless": 0, "standard": 3, "economy": 3}
        controller = FSDController(_config(policy={"policy": "static", "draft_lengths": ks, "guards": False}),
                                   start_loop=False, clock=clock)
        replica = FSDReplica(_config(), _sender([controller]))
        try:
            await _tick(clock, controller, replica)  # the first report; the tick decides
            await replica.push_report()  # the reply carries the decision
            assert replica.stats()["draft_lengths"] == ks
            lossless, standard = await asyncio.gather(run(replica, "lossless"), run(replica, "standard"))
            assert lossless.fsd is not None and standard.fsd is not None
            assert lossless.fsd.drafted_tokens == 0
            assert standard.fsd.drafted_tokens > 0
            await _tick(clock, controller, replica)
            tel = controller.status()["telemetry"]
            assert tel["tiers"]["lossless"]["draft_length"] == 0 and tel["tiers"]["standard"]["draft_length"] == 3
            assert tel["tiers"]["lossless"]["sequence_iterations"] == 24  # one token per step at k = 0
            assert 0 < tel["tiers"]["standard"]["sequence_iterations"] <= 24
            assert tel["mean_iteration_ms"] > 0 and 1.0 <= tel["mean_batch_size"] <= 2.0
        finally:
            replica.__del__()

    asyncio.run(scenario())


def test_a_decisions_batch_cap_reaches_the_replica_and_fail_safe_lifts_it() -> None:
    """A static policy with batch_cap 1: the push carries it, the replica decodes one request at a time
    (a second concurrent request waits, counted as queued), and the replica's own fail-safe (no controller
    update for stale_after_s) drops the cap with the thresholds."""

    async def scenario() -> None:
        clock = Clock()
        controller = FSDController(_config(policy={"policy": "static", "thresholds": 0.0, "batch_cap": 1,
                                                   "guards": False}), start_loop=False, clock=clock)
        config = _config()
        config["replica"]["stale_after_s"] = 5.0
        replica = FSDReplica(config, _sender([controller]))
        try:
            await _tick(clock, controller, replica)
            await replica.push_report()
            assert controller.status()["batch_cap"] == 1 and replica.stats()["batch_cap"] == 1
            done: list[str] = []

            async def run(name: str) -> None:
                chunks = [c async for c in replica.generate({"prompt": name, "max_tokens": 24, "tier": "economy",
                                                              "ignore_eos": True, "seed": 1})]
                assert isinstance(chunks[-1], EndChunk) and chunks[-1].finish_reason == "length", chunks[-1]
                done.append(name)

            tasks = [asyncio.create_task(run(name)) for name in ("a", "b")]
            seen_queued = False
            while len(done) < 2:
                stats = replica.stats()
                assert stats["running"] <= 1, stats
                seen_queued |= stats["queue_depth"] == 1
                await asyncio.sleep(0.005)
            await asyncio.gather(*tasks)
            assert seen_queued, "the second request waited behind the cap"
            await replica.push_report()  # the controller's reply refreshes the replica's fail-safe clock
            assert replica.stats()["batch_cap"] == 1 and not replica.stats()["failsafe"]
            for _ in range(150):  # no update for stale_after_s: the watchdog trips the fail-safe
                if replica.stats()["failsafe"]:
                    break
                await asyncio.sleep(0.1)
            assert replica.stats()["failsafe"] and replica.stats()["batch_cap"] is None
        finally:
            replica.__del__()

    asyncio.run(scenario())


def test_bad_user_config_is_rejected_and_the_replica_keeps_serving() -> None:
    async def scenario() -> None:
        replica = FSDReplica(_config(), _sender([FSDController(_config(), start_loop=False)]))
        try:
            replica.reconfigure({"thresholds": {"economy": 2.0}, "draft_length": 3})
            assert replica.stats()["controlled_thresholds"]["economy"] == 2.0
            assert replica.stats()["draft_lengths"] == {"lossless": 3, "standard": 3, "economy": 3}
            for bad, needle in [({"thresholds": {"economy": 9.0}}, "outside tier 'economy' bounds"),
                                ({"thresholds": {"gold": 1.0}}, "gold"),
                                ({"draft_length": -1}, "draft_length"),
                                ({"speed": "fast"}, "speed")]:
                with pytest.raises(ValueError, match=needle):
                    replica.reconfigure(bad)
                assert replica.stats()["controlled_thresholds"]["economy"] == 2.0, bad
            assert await _complete(replica, 1) == 1, "the engine loop still serves"
            assert replica.stats()["engine_alive"]
        finally:
            replica.__del__()

    asyncio.run(scenario())


# ---- engine health -------------------------------------------------------------------------------


class _Row:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


class _StepFails:
    """A StepEngine whose every step raises (a broken kernel, a poisoned cache)."""

    def __init__(self) -> None:
        self.pending: set[str] = set()

    def add_request(self, request_id: str, prompt_ids: list[int], params: Any, threshold: float = 0.0,
                    draft_length: int | None = None) -> None:
        self.pending.add(request_id)

    def set_threshold(self, request_id: str, threshold: float) -> None: ...
    def set_draft_length(self, k: int, request_id: str | None = None) -> None: ...

    def abort(self, request_id: str) -> None:
        self.pending.discard(request_id)

    def release(self, request_id: str) -> Any:
        self.pending.discard(request_id)
        raise KeyError(request_id)

    def step(self) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access")

    def has_unfinished(self) -> bool:
        return bool(self.pending)


class _StepHangs(_StepFails):
    def __init__(self) -> None:
        super().__init__()
        self.release_step = threading.Event()

    def step(self) -> Any:
        self.release_step.wait(60)
        raise RuntimeError("released")


def _wait_finished(q: queue.SimpleQueue[TokenEvent]) -> TokenEvent:
    while True:
        event = q.get(timeout=30)
        if event.finished:
            return event


def test_failing_steps_make_the_engine_unhealthy_after_the_limit() -> None:
    loop = BatchingLoop(_StepFails(), {"standard": 0.0})
    try:
        for i in range(3):
            assert loop.health_problem(60.0, 3) is None, f"after {i} failed steps"
            q: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
            loop.submit(f"r{i}", [1, 2], None, "standard", None, q.put)
            assert _wait_finished(q).error is not None, "the request gets an explicit error"
        problem = loop.health_problem(60.0, 3)
        assert problem is not None and "3 engine steps in a row failed" in problem and "illegal memory" in problem
        assert loop.counters().per_tier["standard"].failed == 3
    finally:
        loop.stop()


def test_a_hung_step_makes_the_engine_unhealthy() -> None:
    engine = _StepHangs()
    loop = BatchingLoop(engine, {"standard": 0.0})
    try:
        q: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        loop.submit("r", [1], None, "standard", None, q.put)
        deadline = threading.Event()
        problem = None
        for _ in range(600):  # bounded poll: the step is entered within a few ms
            problem = loop.health_problem(0.05, 3)
            if problem is not None:
                break
            deadline.wait(0.05)
        assert problem is not None and "hung" in problem
    finally:
        engine.release_step.set()
        loop.stop()


class _ScriptedVLLMEngine(_StepFails):
    """vLLM's step shape (``fsd_vllm.engine.VLLMStep``: no step-level draft_length, each row at the engine-wide
    k): every request emits one token per step and finishes after three."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.steps: dict[str, int] = {}

    def release(self, request_id: str) -> Any:
        self.pending.discard(request_id)
        return type("Released", (), {"text": ""})()

    def step(self) -> Any:
        from fsd_vllm.engine import VLLMRow, VLLMStep

        rows = []
        for rid in sorted(self.pending):
            n = self.steps[rid] = self.steps.get(rid, 0) + 1
            rows.append(VLLMRow(request_id=rid, new_token_ids=(7,), drafted=self.k, accepted=0, fuzzy_accepted=0,
                                distortion=0.0, threshold=0.0, draft_length=self.k, finished=n >= 3,
                                finish_reason="length" if n >= 3 else None))
        return VLLMStep(rows=tuple(rows))


@pytest.mark.parametrize("k", [0, 3])
def test_steps_are_counted_by_kind_from_their_rows_for_the_vllm_step_shape(k: int) -> None:
    """The step-kind counters (policies.telemetry.StepTotals) read the kind off the rows: a vLLM step drafting at
    k = 3 counts as speculative (it has no step-level draft_length), at k = 0 as plain."""
    loop = BatchingLoop(_ScriptedVLLMEngine(k), {"standard": 0.0})
    try:
        q: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        loop.submit("r", [1, 2], None, "standard", None, q.put)
        assert _wait_finished(q).error is None
        c = loop.counters()
    finally:
        loop.stop()
    assert c.iterations == 3
    assert c.speculative_steps == (3 if k else 0)
    assert (c.speculative_rows, c.speculative_draft_forwards, c.speculative_verify_tokens) == ((3, 9, 9) if k else (0, 0, 0))


def test_the_status_history_replays_through_the_policy_that_ran_tick_for_tick() -> None:
    """A policy PUT mid-run leaves an event in the status history; fed the recorded windows (strict JSON, read
    back), a fresh object of the same spec decides at every tick what the live one decided, reason included
    (sim.decision_replay); another spec, on the same windows, does not."""
    from sim.decision_replay import build_policy, last_policy_span, replay

    async def scenario() -> list[dict[str, Any]]:
        clock = Clock()
        controller = FSDController(_config(policy={"policy": "static", "thresholds": {"economy": ECONOMY_T}}),
                                   start_loop=False, clock=clock)
        replica = FSDReplica(_config(), _sender([controller]))
        try:
            await _tick(clock, controller, replica)
            await controller.set_policy({"policy": "slo"})
            for i in range(6):
                await asyncio.gather(_complete(replica, 1 + i % 2, "economy"), _complete(replica, 1, "standard"))
                await _tick(clock, controller, replica)
            return controller.status(history=10_000)["history"]
        finally:
            replica.__del__()

    history = json.loads(json.dumps(asyncio.run(scenario()), allow_nan=False))
    span = last_policy_span(history)
    assert span.event is not None and span.event["event"]["kind"] == "policy" and len(span.ticks) == 6
    assert span.event["event"]["policy"] == {"policy": "slo"}  # as PUT, and written out in full beside it
    assert span.slo is not None and span.spec == resolve_spec({"policy": "slo"})
    ticks = replay(span, build_policy(span.spec, span.slo, span.operating_model, span.replica_bounds), span.slo)
    assert [t.same for t in ticks] == [True] * 6
    assert all(t.recorded is not None and t.replayed is not None and t.replayed["reason"] == t.recorded["reason"]
               for t in ticks)
    assert {t.recorded["reason"].split(":")[0] for t in ticks if t.recorded} <= {"mpc meets", "mpc best effort"}
    plain = build_policy({"policy": "static", "thresholds": 0.0, "draft_lengths": 0, "guards": False}, span.slo)
    assert not all(t.same for t in replay(span, plain, span.slo))
