"""Controller pieces without Ray: config validation, telemetry aggregation, metrics, the batching loop."""

from __future__ import annotations

import math
import queue
import threading
from pathlib import Path
from typing import Any

import pytest

from controller.batching import BatchingLoop, ReplicaCounters, RequestRecord, TokenEvent
from controller.config import FSDConfig, load_config, parse_config
from controller.metrics import MetricsState
from controller.protocol import ReplicaReport, ReplicaState
from controller.telemetry_agg import TelemetryAggregator, request_met_slo
from policies.slo import SLOSpec
from policies.telemetry import StepTotals

EXAMPLE = Path(__file__).resolve().parents[2] / "controller" / "configs" / "example.yaml"

# ---- config ------------------------------------------------------------------------------------


def test_default_config_is_the_documented_service() -> None:
    cfg = FSDConfig()
    assert cfg.model.pair == "smollm2-135m"
    assert cfg.http.host == "127.0.0.1" and cfg.http.port == 8000
    assert cfg.slo == SLOSpec.default()


def test_example_config_loads() -> None:
    cfg = load_config(EXAMPLE)
    assert cfg.control.policy is not None and cfg.control.shadow_policy is not None


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"control": {"interval_s": 0}}, "control.interval_s"),
        ({"model": {"max_batch_size": 0}}, "model.max_batch_size"),
        ({"serve": {"replicas": 2}}, "serve.replicas"),
        ({"http": {"port": 70000}}, "http.port"),
        ({"slo": {"tiers": {"a": {"tpot_ms": -1}}, "default_tier": "a"}}, "slo.tiers.a.tpot_ms"),
        ({"replica": {"initial_thresholds": {"gold": 0.1}}}, "replica.initial_thresholds"),
        ({"replica": {"initial_thresholds": {"standard": 5.0}}}, "replica.initial_thresholds.standard"),
        ({"control": {"policy": {"policy": "pid", "kp": "x"}}}, "control.policy"),
        ({"control": {"shadow_policy": {"policy": "nope"}}}, "control.shadow_policy"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_config_errors_name_the_field(data: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        parse_config(data)


def test_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config(bad)


# ---- telemetry aggregation ---------------------------------------------------------------------


def _state(rid: str, **kw: Any) -> ReplicaState:
    base: dict[str, Any] = dict(
        replica_id=rid, actor_name=None, node_id=None, pid=1, pair="tiny", uptime_s=1.0, queue_depth=0,
        in_flight=0, running=0, engine_alive=True, engine_problem=None,
        thresholds={"standard": 0.2, "economy": 0.5, "lossless": 0.0},
        controlled_thresholds={"standard": 0.2, "economy": 0.5, "lossless": 0.0},
        draft_lengths={"standard": 4, "economy": 4, "lossless": 4}, epoch=None, version=-1, failsafe=False,
        failsafe_events=0, last_update_age_s=None,
    )
    base.update(kw)
    return ReplicaState(**base)


def _report(rid: str, seq: int, counters: dict[str, Any], records: list[RequestRecord] | None = None,
            incarnation: str | None = None, **state: Any) -> ReplicaReport:
    return ReplicaReport(incarnation=incarnation or f"inc-{rid}", seq=seq, sent_unix=0.0,
                         counters=ReplicaCounters(**counters), records=tuple(records or ()),
                         state=_state(rid, **state))


def _record(tier: str, tpot: float, e2e: float = 100.0) -> RequestRecord:
    return RequestRecord(tier=tier, ttft_ms=10.0, tpot_ms=tpot, e2e_ms=e2e, output_tokens=8, distortion=0.0,
                         threshold=0.2, finish_reason="length")


def test_window_adds_deltas_and_counts_each_report_once() -> None:
    agg = TelemetryAggregator(SLOSpec.default())
    t = {"standard": 0.2}
    r1 = _report("a", 1, {"drafted": 40, "accepted": 20, "output_tokens": 30, "row_iterations": 10})
    assert agg.receive([r1], now_s=0.5) == 1
    w1 = agg.window(now_s=1.0, window_s=1.0, age_s=0.0, thresholds=t)
    assert w1.telemetry.acceptance_rate == pytest.approx(0.5)
    assert w1.telemetry.mean_accepted_per_iter == pytest.approx(3.0)
    # Replica "a" re-sends report 1 (its acknowledgement was lost) with report 2: only 2 counts.
    r2 = _report("a", 2, {"drafted": 20, "accepted": 20, "output_tokens": 20, "row_iterations": 5})
    assert agg.receive([r1, r2], now_s=1.5) == 2
    assert agg.receive([_report("b", 1, {"drafted": 10, "output_tokens": 5, "row_iterations": 5})], 1.6) == 1
    w2 = agg.window(now_s=2.0, window_s=1.0, age_s=0.0, thresholds=t)
    assert w2.deltas["drafted"] == 30 and w2.deltas["accepted"] == 20 and w2.reports == 2
    assert w2.telemetry.acceptance_rate == pytest.approx(20 / 30)
    assert w2.telemetry.output_tokens == 25 and w2.telemetry.replicas == 2
    # A window without reports counts nothing; a restarted "a" (new incarnation) starts at seq 1 again.
    assert agg.window(now_s=3.0, window_s=1.0, age_s=0.0, thresholds=t).deltas["drafted"] == 0
    assert agg.receive([_report("a", 1, {"drafted": 8}, incarnation="inc-a-2", pid=2)], now_s=3.5) == 1
    assert agg.window(now_s=4.0, window_s=1.0, age_s=0.0, thresholds=t).deltas["drafted"] == 8
    with pytest.raises(ValueError, match="one replica incarnation"):
        agg.receive([_report("a", 3, {}), _report("b", 3, {})], now_s=5.0)


def test_window_fills_the_fields_the_model_predictive_policy_reads() -> None:
    from controller.batching import TierCounters

    agg = TelemetryAggregator(SLOSpec.default())
    per_tier = {"lossless": TierCounters(output_tokens=30, row_iterations=30),
                "standard": TierCounters(output_tokens=50, row_iterations=20)}
    ks = {"standard": 4, "economy": 4, "lossless": 0}
    agg.receive([_report("a", 1, {"iterations": 25, "row_iterations": 50, "output_tokens": 80, "busy_time_s": 2.5,
                                  "prefill_time_s": 0.5, "catch_up_time_s": 0.25, "per_tier": per_tier,
                                  "speculative_steps": 10, "speculative_step_s": 1.0, "speculative_rows": 20,
                                  "speculative_draft_forwards": 40, "speculative_verify_tokens": 60,
                                  "speculative_drafted_row_forwards": 70},
                          draft_lengths=ks)], now_s=0.5)
    # Replica "b" disagrees on the economy tier's k: the controller's decided k stands for it.
    agg.receive([_report("b", 1, {}, draft_lengths={**ks, "economy": 2})], now_s=0.6)
    w = agg.window(now_s=1.0, window_s=1.0, age_s=0.0, thresholds={}, draft_lengths={**ks, "economy": 3})
    tel = w.telemetry
    # Decode time per step: less the joins' prefills and the draft's catch-ups (one-offs modelled apart).
    assert tel.mean_iteration_ms == pytest.approx((2.5 - 0.5 - 0.25) / 25 * 1e3)
    assert tel.mean_batch_size == pytest.approx(50 / 25)
    assert tel.prefill_ms == pytest.approx(500.0)  # the stall the policy charges running rows for
    # The same steps by kind: plain ones are the rest of the decode time.
    assert tel.speculative_steps == StepTotals(steps=10, ms=1000.0, rows=20, draft_forwards=40, verify_tokens=60,
                                               drafted_row_forwards=70)
    assert tel.plain_steps is not None
    assert (tel.plain_steps.steps, tel.plain_steps.rows) == (15, 30)
    assert tel.plain_steps.ms == pytest.approx((2.5 - 0.5 - 0.25 - 1.0) * 1e3)
    lossless, standard = tel.tiers["lossless"], tel.tiers["standard"]
    assert (lossless.draft_length, lossless.sequence_iterations, lossless.tokens_per_iteration) == (0, 30, 1.0)
    assert (standard.draft_length, standard.sequence_iterations, standard.tokens_per_iteration) == (4, 20, 2.5)
    assert tel.tiers["economy"].draft_length == 3
    assert tel.draft_length == 4  # the default tier's k
    empty = agg.window(now_s=2.0, window_s=1.0, age_s=0.0, thresholds={})
    assert math.isnan(empty.telemetry.mean_iteration_ms) and math.isnan(empty.telemetry.mean_batch_size)


def test_window_slo_met_and_latency_from_records() -> None:
    slo = SLOSpec.default()  # standard: tpot <= 60 ms, economy: tpot <= 120 ms
    agg = TelemetryAggregator(slo)
    records = [_record("standard", 50.0), _record("standard", 70.0), _record("economy", 70.0),
               _record("economy", 130.0), _record("economy", 20.0)]
    agg.receive([_report("a", 1, {"completions": 5}, records)], now_s=0.9)
    w = agg.window(now_s=1.0, window_s=2.0, age_s=0.1, thresholds={"standard": 0.2})
    std, eco = w.telemetry.tiers["standard"], w.telemetry.tiers["economy"]
    assert (std.completions, std.slo_met) == (2, 1)
    assert (eco.completions, eco.slo_met) == (3, 2)
    assert w.telemetry.tpot.count == 5
    assert w.telemetry.tpot.p50_ms == pytest.approx(70.0)
    assert w.telemetry.tiers["lossless"].completions == 0 and math.isnan(w.telemetry.tiers["lossless"].tpot.p95_ms)
    assert w.telemetry.completions == 5 and w.telemetry.window_s == 2.0 and w.telemetry.age_s == 0.1
    assert std.threshold == 0.2  # what the replicas report


def test_unanswered_requests_are_misses_of_their_tier() -> None:
    from policies.signals import attainment

    slo = SLOSpec.default()
    agg = TelemetryAggregator(slo)
    counters = ReplicaCounters(arrivals=3, completions=2, rejections=1, aborted=1)
    counters.tier("economy").arrivals = 3
    counters.tier("economy").completions = 2
    counters.tier("economy").rejections = 1
    counters.tier("economy").aborted = 1
    report = ReplicaReport(incarnation="i", seq=1, sent_unix=0.0, counters=counters,
                           records=(_record("economy", 10.0), _record("economy", 10.0)), state=_state("a"))
    agg.receive([report], now_s=0.5)
    w = agg.window(now_s=1.0, window_s=1.0, age_s=0.0, thresholds={}, ingress_rejections={"economy": 1},
                   ingress_aborted={"economy": 1})
    eco = w.telemetry.tiers["economy"]
    assert (eco.completions, eco.slo_met, eco.rejections, eco.aborted) == (2, 2, 2, 2)
    # Arrivals are the offered load, as in the simulator: the ingress's refusals (503) count; its 504s do
    # not (a request it gave up on may already have reached a replica, which counted it).
    assert (w.telemetry.arrivals, eco.arrivals) == (4, 4)
    assert w.deltas["arrivals"] == 3  # the replicas' own counter (Prometheus: admitted by replicas)
    assert attainment(w.telemetry, "economy") == pytest.approx(2 / 6), "503/504/aborted are misses"
    assert math.isnan(attainment(w.telemetry, "standard"))
    # The Prometheus gauge reads the same definition.
    from prometheus_client.parser import text_string_to_metric_families

    state = MetricsState()
    state.update(w, {})
    fams = {f.name: f for f in text_string_to_metric_families(state.render().decode())}
    gauge = {s.labels["tier"]: s.value for s in fams["fsd_tier_slo_attainment_ratio"].samples}
    assert gauge["economy"] == pytest.approx(2 / 6)


def test_request_met_slo_requires_every_target() -> None:
    tier = SLOSpec.default().tiers["standard"].model_copy(update={"ttft_ms": 5.0})
    assert not request_met_slo(_record("standard", 10.0), tier)  # ttft 10 > 5
    assert request_met_slo({"ttft_ms": 1.0, "tpot_ms": None, "e2e_ms": 9.0}, tier)  # single-token: no TPOT


def test_metrics_render_is_exact_prometheus() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    agg = TelemetryAggregator(SLOSpec.default())
    state = MetricsState()
    records = [_record("standard", 50.0, e2e=120.0), _record("standard", 70.0, e2e=2500.0)]
    agg.receive([_report("a", 1, {"completions": 2, "output_tokens": 16}, records)], now_s=0.5)
    w = agg.window(now_s=1.0, window_s=1.0, age_s=0.0, thresholds={"standard": 0.3})
    state.update(w, {"standard": 0.3, "economy": 0.0, "lossless": 0.0})
    fams = {f.name: f for f in text_string_to_metric_families(state.render().decode())}
    assert {s.labels["tier"]: s.value for s in fams["fsd_threshold"].samples}["standard"] == 0.3
    e2e = {(s.name, s.labels.get("le")): s.value for s in fams["fsd_e2e_seconds"].samples}
    assert e2e[("fsd_e2e_seconds_bucket", "0.15")] == 1.0
    assert e2e[("fsd_e2e_seconds_bucket", "3.0")] == 2.0
    assert e2e[("fsd_e2e_seconds_count", None)] == 2.0
    assert e2e[("fsd_e2e_seconds_sum", None)] == pytest.approx(2.62)
    att = {s.labels["tier"]: s.value for s in fams["fsd_tier_slo_attainment_ratio"].samples}
    assert att["standard"] == pytest.approx(0.5)


# ---- the batching loop over the real engine (tiny pair) ----------------------------------------


@pytest.fixture(scope="module")
def engine() -> Any:
    from decoder.engine import FSDEngine
    from decoder.models import tiny_pair

    return FSDEngine(tiny_pair(seed=0), num_draft_tokens=3, max_batch_size=2)


def _collect(loop: BatchingLoop, rid: str, prompt: list[int], params: Any, tier: str = "standard",
             threshold: float | None = None) -> queue.SimpleQueue[TokenEvent]:
    q: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
    loop.submit(rid, prompt, params, tier, threshold, q.put)
    return q


def _drain(q: queue.SimpleQueue[TokenEvent], timeout_s: float = 60.0) -> list[TokenEvent]:
    events = []
    while True:
        event = q.get(timeout=timeout_s)
        events.append(event)
        if event.finished:
            return events


def test_batching_loop_counts_exactly_and_applies_tier_thresholds(engine: Any) -> None:
    from decoder.engine import SamplingParams

    loop = BatchingLoop(engine, {"standard": 0.7, "economy": 2.0})
    try:
        params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)
        queues = {f"r{i}": _collect(loop, f"r{i}", [257, 104, 105 + i], params, tier)
                  for i, tier in enumerate(["standard", "economy", "standard"])}
        queues["pinned"] = _collect(loop, "pinned", [257, 120], params, "economy", threshold=0.1)
        events = {rid: _drain(q) for rid, q in queues.items()}
        snap = loop.snapshot(drain_records=True)
    finally:
        loop.stop()
    for rid, evs in events.items():
        assert evs[-1].finish_reason == "length" and evs[-1].error is None, rid
        assert sum(len(e.new_token_ids) for e in evs) == 12, rid
        steps = [e for e in evs if not e.finished]
        expected = 0.1 if rid == "pinned" else (2.0 if rid == "r1" else 0.7)
        assert all(e.threshold == expected for e in steps), (rid, [e.threshold for e in steps])
    c = snap["counters"]
    assert c["completions"] == 4 and c["output_tokens"] == 48 and c["arrivals"] == 4
    assert c["drafted"] == sum(e.drafted for evs in events.values() for e in evs)
    assert c["accepted"] == sum(e.accepted for evs in events.values() for e in evs)
    assert len(snap["records"]) == 4 and snap["in_flight"] == 0
    assert all(r["tpot_ms"] is not None and r["e2e_ms"] >= r["ttft_ms"] for r in snap["records"])
    assert c["per_tier"]["economy"]["completions"] == 2
    # The finishing event carries the loop's own stamps, the same ones its record holds.
    ends = sorted((evs[-1].ttft_ms, evs[-1].e2e_ms) for evs in events.values())
    assert all(e is not None and t is not None and 0.0 < t <= e for t, e in ends)
    assert ends == sorted((r["ttft_ms"], r["e2e_ms"]) for r in snap["records"])


def test_batching_loop_abort_and_live_threshold_change(engine: Any) -> None:
    from decoder.engine import SamplingParams

    loop = BatchingLoop(engine, {"standard": 0.0})
    try:
        long = SamplingParams(max_new_tokens=200, temperature=1.0, seed=1, eos_token_ids=())
        q = _collect(loop, "long", [257, 100], long)
        first = q.get(timeout=60)
        assert first.threshold == 0.0
        loop.set_tier_thresholds({"standard": 0.9})
        seen = [q.get(timeout=60) for _ in range(3)]
        assert seen[-1].threshold == 0.9, "a live T change reaches running requests within an iteration or two"
        loop.abort("long")
        events = _drain(q)
        assert events[-1].finish_reason == "abort"
        snap = loop.snapshot(drain_records=True)
        assert snap["counters"]["aborted"] == 1 and snap["in_flight"] == 0 and snap["records"] == []
    finally:
        loop.stop()


def test_batching_loop_reports_engine_rejections_without_dying(engine: Any) -> None:
    from decoder.engine import SamplingParams

    loop = BatchingLoop(engine, {"standard": 0.0})
    try:
        # Prompt + max_new_tokens beyond the tiny pair's 512-token context: the engine refuses it.
        q = _collect(loop, "huge", [257] * 10, SamplingParams(max_new_tokens=600))
        events = _drain(q)
        assert events[-1].error is not None and "context" in events[-1].error
        ok = _drain(_collect(loop, "ok", [257, 99], SamplingParams(max_new_tokens=4)))
        assert ok[-1].finish_reason == "length"
        assert loop.alive and threading.active_count() >= 1
    finally:
        loop.stop()


def test_batching_loop_runs_k_per_tier_per_row(engine: Any) -> None:
    """A lossless row pushed k = 0 decodes with no drafting while a standard row in the same batch keeps
    drafting; a request admitted to a k = 0 tier never drafts; greedy T = 0 tokens do not depend on k."""
    from decoder.engine import SamplingParams

    greedy = SamplingParams(max_new_tokens=40, temperature=0.0, eos_token_ids=())
    loop = BatchingLoop(engine, {"standard": 0.0, "lossless": 0.0}, draft_lengths={"standard": 3, "lossless": 3})
    try:
        with pytest.raises(ValueError, match="lossless"):
            loop.set_tier_draft_lengths({"lossless": -1})
        lossless = _collect(loop, "lossless", [257, 100], greedy, "lossless")
        standard = _collect(loop, "standard", [257, 101], greedy, "standard")
        first = lossless.get(timeout=60)
        assert first.draft_length == 3
        loop.set_tier_draft_lengths({"lossless": 0})
        lossless_events = [first, *_drain(lossless)]
        standard_events = _drain(standard)
        # A request admitted while its tier runs k = 0: plain decoding from its first step.
        admitted = _drain(_collect(loop, "admitted", [257, 100], greedy, "lossless"))
        c = loop.counters()
    finally:
        loop.stop()
    # Steps by kind (policies.telemetry.StepTotals): speculative ones drafted k_max = 3 over their drafting rows
    # (verify 3 wide each); the admitted request alone ran plain steps.
    plain_steps = c.iterations - c.speculative_steps
    assert c.speculative_steps > 0 and plain_steps >= 40
    assert c.speculative_draft_forwards == 3 * c.speculative_steps
    assert c.speculative_verify_tokens == c.speculative_drafted_row_forwards > 0
    assert c.speculative_rows >= c.speculative_steps and c.row_iterations - c.speculative_rows >= plain_steps
    assert 0 < c.speculative_step_s < c.busy_time_s
    steps = [e for e in lossless_events if not e.finished]
    switch = next(i for i, e in enumerate(steps) if e.draft_length == 0)
    assert 0 < switch < len(steps) - 5, "the push reached the running row within a few steps"
    assert all(e.draft_length == 0 and e.drafted == 0 and len(e.new_token_ids) == 1 for e in steps[switch:])
    standard_steps = [e for e in standard_events if not e.finished]
    assert all(e.draft_length == 3 for e in standard_steps)
    assert sum(e.drafted for e in standard_steps[switch:]) > 0, "the other tier kept drafting"
    plain = [e for e in admitted if not e.finished]
    assert all(e.draft_length == 0 and e.drafted == 0 for e in plain)
    tokens = [t for e in steps for t in e.new_token_ids]
    assert tokens == [t for e in plain for t in e.new_token_ids], "greedy T = 0 output does not depend on k"


def test_the_controller_models_the_served_pair_where_a_calibrated_profile_exists() -> None:
    from controller.control_loop import FSDController, served_operating_model
    from sim.profile import PROFILES_DIR, Profile

    model, source = served_operating_model("smollm2-135m", "kl")
    assert model is not None and "calibrated profile sim/profiles/smollm2-135m.json" in source
    expected = Profile.load(PROFILES_DIR / "smollm2-135m.json").to_operating_model(div="kl")
    assert model.points == expected.points and model.cost == expected.cost and 0 in model.draft_lengths
    for pair in ("tiny", "../smollm2-135m"):  # no profile of its own; never a path outside the profiles
        model, source = served_operating_model(pair, "kl")
        assert model is None and source.startswith("default model"), (pair, source)
    controller = FSDController(parse_config({"model": {"pair": "tiny"}}).model_dump(mode="json"), start_loop=False)
    assert controller.status(history=0)["operating_model"].startswith("default model")
    # The shipped profile is the per-row int8 draft's (the pair's default): serving another draft says so.
    _, same = served_operating_model("smollm2-135m", "kl", draft_dtype="int8-row")
    assert "WARNING" not in same
    _, other = served_operating_model("smollm2-135m", "kl", draft_dtype="int8")
    assert "WARNING: calibrated with target fp32 / draft int8 per row, serving draft int8 dynamic" in other
    assert "fsd calibrate --draft-dtype int8" in other
    # The draft on its own cache (model.share_kv: false) has its own profile: the draft's prefill and catch-up.
    model, source = served_operating_model("smollm2-135m", "kl", share_kv=False)
    assert model is not None and "sim/profiles/smollm2-135m-separate-kv.json" in source
    assert model.cost.draft_prefill_ms_per_token > 0
    shared, _ = served_operating_model("smollm2-135m", "kl", share_kv=True)
    assert shared is not None and shared.cost.draft_prefill_ms_per_token == 0


def test_control_profile_gives_the_policy_a_machine_calibrated_model(tmp_path: Any) -> None:
    """``control.profile``: the model-predictive policy's model comes from that profile (e.g. one
    calibrated on the serving machine), whatever the pair; a missing file is a ValueError naming it."""
    from controller.control_loop import FSDController, served_operating_model
    from sim.profile import PROFILES_DIR, Profile

    shipped = Profile.load(PROFILES_DIR / "smollm2-135m.json")
    slower = shipped.model_copy(update={"latency": shipped.latency.model_copy(update={"verify_a_ms": 400.0})})
    path = tmp_path / "this_machine.json"
    slower.save(path)
    model, source = served_operating_model("tiny", "kl", str(path))
    assert model is not None and model.cost.verify_fixed_ms == 400.0 and source.startswith(f"control.profile {path}")
    controller = FSDController(parse_config({"model": {"pair": "tiny"}, "control": {"profile": str(path)}})
                               .model_dump(mode="json"), start_loop=False)
    assert controller.status(history=0)["operating_model"].startswith("control.profile")
    with pytest.raises(ValueError, match="control.profile: profile file .*missing.json' does not exist"):
        served_operating_model("tiny", "kl", str(tmp_path / "missing.json"))


def test_batching_loop_aborts_a_request_past_its_deadline_started_or_not(engine: Any) -> None:
    """The ingress has answered 504 at the deadline; a request still in the engine then (its cancellation
    raced its start) is aborted there instead of decoding for nobody. Before the deadline nothing changes."""
    import time

    from decoder.engine import SamplingParams

    loop = BatchingLoop(engine, {"standard": 0.0})
    try:
        # 480 tokens take > 200 engine steps (seconds even on a fast machine): far past a 0.3 s deadline.
        long = SamplingParams(max_new_tokens=480, temperature=1.0, seed=1, eos_token_ids=())
        q = queue.SimpleQueue[TokenEvent]()
        loop.submit("stale", [257, 100], long, "standard", None, q.put, deadline_s=time.monotonic() - 1.0)
        assert _drain(q)[-1].finish_reason == "abort"
        running: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        loop.submit("late", [257, 101], long, "standard", None, running.put, deadline_s=time.monotonic() + 0.3)
        events = _drain(running)
        # Aborted mid-way (or, on a machine too busy to start it within 0.3 s, before its first token).
        assert events[-1].finish_reason == "abort"
        assert sum(len(e.new_token_ids) for e in events) < 480
        ok = _drain(_collect(loop, "ok", [257, 99], SamplingParams(max_new_tokens=4)))
        assert ok[-1].finish_reason == "length"
        snap = loop.snapshot(drain_records=True)
        assert snap["counters"]["aborted"] == 2 and snap["counters"]["completions"] == 1 and snap["in_flight"] == 0
    finally:
        loop.stop()


def test_batching_loop_batch_cap_holds_requests_back_and_lifting_it_admits_them(engine: Any) -> None:
    """Cap 1 over an engine of two rows: requests decode one at a time (a request's events never
    interleave with another's), the ones held count as queued, a held request can be aborted before it
    ever ran; lifting the cap lets the engine take two again."""
    import time

    from decoder.engine import SamplingParams

    loop = BatchingLoop(engine, {"standard": 0.0})
    order: list[str] = []
    lock = threading.Lock()

    def sink_for(rid: str, q: queue.SimpleQueue[TokenEvent]) -> Any:
        def sink(event: TokenEvent) -> None:
            if event.new_token_ids:
                with lock:
                    order.append(rid)
            q.put(event)
        return sink

    with pytest.raises(ValueError, match="batch_cap must be an integer >= 1 or None, got 0"):
        loop.set_batch_cap(0)
    try:
        loop.set_batch_cap(1)
        params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=2, eos_token_ids=())
        queues = {rid: queue.SimpleQueue[TokenEvent]() for rid in ("a", "b", "held")}
        for rid, q in queues.items():
            loop.submit(rid, [257, 104], params, "standard", None, sink_for(rid, q))
        deadline = time.monotonic() + 30
        while loop.snapshot(drain_records=False)["running"] != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        snap = loop.snapshot(drain_records=False)
        assert snap["running"] == 1 and snap["queue_depth"] == 2
        loop.abort("held")
        events = {rid: _drain(q) for rid, q in queues.items()}
        assert events["held"][-1].finish_reason == "abort" and "held" not in order
        assert events["a"][-1].finish_reason == events["b"][-1].finish_reason == "length"
        first_b = order.index("b")
        assert set(order[:first_b]) == {"a"} and set(order[first_b:]) == {"b"}, "cap 1: one request at a time"
        # Lifted: two requests in the engine at once again (their tokens interleave).
        order.clear()
        loop.set_batch_cap(None)
        queues = {rid: queue.SimpleQueue[TokenEvent]() for rid in ("c", "d")}
        for rid, q in queues.items():
            loop.submit(rid, [257, 105], params, "standard", None, sink_for(rid, q))
        for q in queues.values():
            _drain(q)
        first_d = order.index("d")
        assert "c" in order[first_d:], "without the cap the engine's two rows decode together"
    finally:
        loop.stop()


class _FailsFirstStep:
    """The real engine, whose first step raises (a transient fault)."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.failed = engine, False

    def step(self) -> Any:
        if not self.failed:
            self.failed = True
            raise RuntimeError("transient fault")
        return self.engine.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def test_a_failed_step_fails_the_engines_rows_not_the_requests_held_by_the_cap(engine: Any) -> None:
    from decoder.engine import SamplingParams

    loop = BatchingLoop(_FailsFirstStep(engine), {"standard": 0.0})
    try:
        loop.set_batch_cap(1)
        params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=4, eos_token_ids=())
        first, held = _collect(loop, "first", [257, 104], params), _collect(loop, "held", [257, 105], params)
        failed = _drain(first)[-1]
        assert failed.error is not None and "transient fault" in failed.error
        done = _drain(held)
        assert done[-1].finish_reason == "length" and done[-1].error is None
        assert sum(len(e.new_token_ids) for e in done) == 8
    finally:
        loop.stop()
