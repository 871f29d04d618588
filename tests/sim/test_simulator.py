"""End-to-end properties of the simulator (real simulator, real policies, fixed seeds)."""

import math

import numpy as np
import pytest

from policies.slo import SLOSpec, TierSLO
from policies.static import StaticPolicy
from sim.autoscaler import AutoscalerConfig
from sim.profile import Profile
from sim.simulator import SimConfig

from .conftest import exponential_profile, handmade_profile, make_workload, run_sim, single_tier_slo


def test_conservation_every_arrival_completes_or_is_rejected() -> None:
    # Overloaded on purpose with a short queue, so both outcomes occur.
    w = make_workload(duration_s=200.0, arrivals={"kind": "poisson", "rate": 3.0},
                      output_tokens={"kind": "lognormal", "median": 60, "sigma": 0.8, "max": 400})
    res = run_sim(w, replicas=2, max_batch=4, max_queue=3, seed=3)
    s, rec = res.summary, res.records
    assert s["rejected"] > 0 and s["completed"] > 0
    assert s["completed"] + s["rejected"] == s["requests"] and s["unfinished"] == 0
    done = ~np.isnan(rec["completion_s"])
    assert np.array_equal(done, ~rec["rejected"])
    # Causality for every completed request: a <= s <= f <= c, and all its tokens were emitted.
    a, st, f, c = (rec[k][done] for k in ("arrival_s", "start_s", "first_token_s", "completion_s"))
    assert np.all(a <= st) and np.all(st < f) and np.all(f <= c)
    assert s["output_tokens"] == int(rec["output_tokens"][done].sum())
    assert np.all(rec["replica"][rec["rejected"]] == -1)


def test_littles_law_on_a_steady_poisson_run() -> None:
    """Time-average in-flight count sampled by the control ticks (the telemetry path) equals λ·W
    from the request records, within 5 %."""
    w = make_workload(duration_s=3000.0, arrivals={"kind": "poisson", "rate": 0.8},
                      output_tokens={"kind": "lognormal", "median": 80, "sigma": 0.5, "max": 400})
    res = run_sim(w, replicas=3, max_batch=8, seed=5, control_interval_s=1.0)
    rec, ts = res.records, res.timeseries
    t = np.asarray(ts["time_s"])
    steady = (t > 200) & (t <= 2800)
    L = float(np.mean(np.asarray(ts["in_flight"])[steady]))
    arr = rec["arrival_s"]
    inside = (arr > 200) & (arr <= 2800)
    lam = inside.sum() / 2600.0
    W = float(np.mean(rec["completion_s"][inside] - arr[inside]))
    assert pytest.approx(lam * W, rel=0.05) == L, f"L={L:.3f}, λW={lam * W:.3f}"


def test_mm1_mean_queue_wait_matches_theory() -> None:
    """Batch 1, exponential service (mean 100 ms: μ = 10/s), Poisson λ = 5/s: Wq = ρ/(μ−λ) = 0.1 s.
    One output token = one decode iteration (the free prefill emits nothing)."""
    lam, mu = 5.0, 10.0
    slo = single_tier_slo()
    w = make_workload(duration_s=4000.0, arrivals={"kind": "poisson", "rate": lam},
                      prompt_tokens={"kind": "fixed", "value": 10}, output_tokens={"kind": "fixed", "value": 1})
    res = run_sim(w, StaticPolicy(slo, 0.0), slo=slo, profile=exponential_profile(1000.0 / mu),
                  replicas=1, max_batch=1, max_queue=10**6, seed=11, control_interval_s=20.0)
    rec = res.records
    assert res.summary["completed"] == res.summary["requests"] > 15000
    wait = rec["start_s"] - rec["arrival_s"]
    expected = (lam / mu) / (mu - lam)
    assert float(wait.mean()) == pytest.approx(expected, rel=0.05)
    sojourn = rec["completion_s"] - rec["arrival_s"]
    assert float(sojourn.mean()) == pytest.approx(1.0 / (mu - lam), rel=0.05)


def test_first_token_comes_after_the_prefill_and_one_decode_iteration() -> None:
    """As in the engine: a joiner's first tokens come out of the decode iteration its prefill is
    stepped with, so an unqueued request's TTFT = prefill(prompt) + iteration(B = 1)."""
    profile = handmade_profile()
    w = make_workload(duration_s=600.0, arrivals={"kind": "poisson", "rate": 0.02},
                      prompt_tokens={"kind": "fixed", "value": 120}, output_tokens={"kind": "fixed", "value": 30})
    res = run_sim(w, StaticPolicy(single_tier_slo(), 0.0), slo=single_tier_slo(), profile=profile, replicas=1,
                  seed=6)
    rec = res.records
    alone = rec["start_s"] == rec["arrival_s"]  # found the replica idle
    assert alone.sum() >= 5
    expected_s = (profile.latency.prefill_ms(120) + float(profile.latency.iteration_ms(1, profile.default_k))) / 1000

    ttft = (rec["first_token_s"] - rec["arrival_s"])[alone]
    assert np.allclose(ttft, expected_s, rtol=1e-9)


def test_a_joins_prefill_follows_the_measured_prefills() -> None:
    """With prefills measured per prompt length the simulator's join costs what was measured (between two
    lengths: the straight line through them), not the fitted line."""
    base = handmade_profile()
    lat = base.latency.model_copy(update={"prefill_ms_by_tokens": [(16, 300.0), (256, 500.0)]})
    profile = base.model_copy(update={"latency": lat})
    w = make_workload(duration_s=600.0, arrivals={"kind": "poisson", "rate": 0.02},
                      prompt_tokens={"kind": "fixed", "value": 120}, output_tokens={"kind": "fixed", "value": 30})
    res = run_sim(w, StaticPolicy(single_tier_slo(), 0.0), slo=single_tier_slo(), profile=profile, replicas=1,
                  seed=6)
    rec = res.records
    alone = rec["start_s"] == rec["arrival_s"]
    assert alone.sum() >= 5
    prefill_ms = 300.0 + (120 - 16) / (256 - 16) * 200.0
    assert abs(prefill_ms - (lat.prefill_fixed_ms + 120 * lat.prefill_ms_per_token)) > 50.0
    expected_s = (prefill_ms + float(lat.iteration_ms(1, profile.default_k))) / 1000
    assert np.allclose((rec["first_token_s"] - rec["arrival_s"])[alone], expected_s, rtol=1e-9)


def test_serving_overhead_is_what_the_client_sees_and_not_what_the_policy_reads() -> None:
    w = make_workload(duration_s=120.0, arrivals={"kind": "poisson", "rate": 0.8})
    base, served = (run_sim(w, seed=3, serving_overhead_ms=ms) for ms in (0.0, 40.0))
    done = ~np.isnan(base.records["completion_s"])
    assert done.sum() > 50
    for col in ("first_token_s", "completion_s"):
        assert np.allclose(served.records[col][done] - base.records[col][done], 0.040, rtol=0, atol=1e-9)
    assert np.array_equal(np.isnan(served.records["completion_s"]), ~done)
    assert np.array_equal(served.records["start_s"], base.records["start_s"])  # the engine's run is the same
    for key, series in base.timeseries.items():  # the policy's view: replica-side, as live
        assert np.array_equal(np.asarray(series), np.asarray(served.timeseries[key]), equal_nan=True), key
    assert served.summary["ttft_ms"]["p50"] == pytest.approx(base.summary["ttft_ms"]["p50"] + 40.0)
    assert served.summary["tpot_ms"]["p50"] == pytest.approx(base.summary["tpot_ms"]["p50"])
    with pytest.raises(ValueError, match="serving_overhead_ms"):
        SimConfig.from_dict({"serving_overhead_ms": -1.0})


def test_same_seed_identical_different_seed_differs() -> None:
    w = make_workload(duration_s=200.0, arrivals={"kind": "poisson", "rate": 0.8})
    a = run_sim(w, seed=7)
    b = run_sim(w, seed=7)
    c = run_sim(w, seed=8)
    assert a.summary == b.summary
    assert a.timeseries == b.timeseries
    assert np.array_equal(a.records["completion_s"], b.records["completion_s"], equal_nan=True)
    assert a.summary != c.summary


def test_acceptance_telemetry_matches_the_profile() -> None:
    """Long outputs (little end-of-sequence clipping): the measured accepted drafts per sequence
    per iteration match the profile's expectation at the T in force."""
    profile = handmade_profile()
    slo = single_tier_slo(max_threshold=4.0)
    w = make_workload(duration_s=600.0, arrivals={"kind": "poisson", "rate": 0.3},
                      output_tokens={"kind": "fixed", "value": 600})
    for threshold in (0.0, 1.0):
        res = run_sim(w, StaticPolicy(slo, threshold), slo=slo, replicas=2, seed=2)
        acc = np.asarray(res.timeseries["acceptance_rate"])
        acc = acc[~np.isnan(acc)]
        expected = profile.expected_acceptance_rate("kl", threshold, 4)
        # Clipping at a sequence's last iteration biases this down by < 2 % at 600 tokens.
        assert float(acc.mean()) == pytest.approx(expected, rel=0.03), threshold
        if threshold == 0.0:
            assert res.summary["mean_distortion"] == 0.0


def test_higher_threshold_is_faster_and_distorts_more() -> None:
    slo = single_tier_slo(max_threshold=4.0, tpot_ms=60.0)
    w = make_workload(duration_s=400.0, arrivals={"kind": "poisson", "rate": 0.5},
                      output_tokens={"kind": "fixed", "value": 150})
    lo = run_sim(w, StaticPolicy(slo, 0.0), slo=slo, replicas=2, seed=4).summary
    hi = run_sim(w, StaticPolicy(slo, 2.0), slo=slo, replicas=2, seed=4).summary
    assert hi["tpot_ms"]["p50"] < lo["tpot_ms"]["p50"]
    assert hi["slo_attainment"] > lo["slo_attainment"]
    assert hi["mean_distortion"] > lo["mean_distortion"] == 0.0


def _with_distortion_events(profile: Profile, share: float) -> Profile:
    """The profile with every grid point's distortion carried by ``share``·(tokens) events (p ≥ mean)."""
    data = profile.model_dump()
    for point in data["acceptance"]:
        point["distorted_per_token"] = min(1.0, point["mean_distortion"] / share) if point["mean_distortion"] else 0.0
    return Profile.model_validate(data)


def test_distortion_events_keep_the_mean_and_add_window_noise() -> None:
    """With event fractions in the profile, distortion per token is drawn (p, size) per token: the
    run's mean distortion matches the profile's mean (binomial s.e. bound), and per-window distortion
    varies, where charging the mean gives every window the same value."""
    slo = single_tier_slo(max_threshold=4.0)
    w = make_workload(duration_s=600.0, arrivals={"kind": "poisson", "rate": 0.3},
                      output_tokens={"kind": "fixed", "value": 200})
    base = handmade_profile()
    evented = _with_distortion_events(base, share=0.25)  # each event carries TV 0.25
    p, size = evented.distortion_events("kl", 1.0, 4)
    mean = base.mean_distortion("kl", 1.0, 4)
    assert p * size == pytest.approx(mean) and size == pytest.approx(0.25)
    runs = {name: run_sim(w, StaticPolicy(slo, 1.0), slo=slo, profile=prof, replicas=2, seed=9)
            for name, prof in (("mean", base), ("events", evented))}
    tokens = runs["events"].summary["output_tokens"]
    got = runs["events"].summary["mean_distortion"]
    se = size * math.sqrt(p * (1 - p) / tokens)
    assert abs(got - mean) < 4 * se, (got, mean, se)
    assert runs["mean"].summary["mean_distortion"] == pytest.approx(mean, rel=1e-9)
    window = {name: np.asarray(r.timeseries["mean_distortion"], dtype=float) for name, r in runs.items()}
    window = {name: x[~np.isnan(x) & (x > 0)] for name, x in window.items()}
    assert np.std(window["mean"]) < 1e-9 < 0.01 < np.std(window["events"])


def test_lossless_tier_stays_at_zero_distortion() -> None:
    slo = SLOSpec.default()
    w = make_workload(duration_s=300.0, tier_mix={"lossless": 1, "economy": 1})
    res = run_sim(w, StaticPolicy(slo, 3.0), slo=slo, seed=1)
    tiers = res.summary["tiers"]
    assert tiers["lossless"]["mean_distortion"] == 0.0
    assert tiers["economy"]["mean_distortion"] > 0.0
    assert all(v == 0.0 for v in res.timeseries["T_lossless"])
    assert all(v == 3.0 for v in res.timeseries["T_economy"])


def test_autoscaler_adds_replicas_under_load_and_costs_them() -> None:
    w = make_workload(duration_s=600.0, arrivals={"kind": "step", "steps": [{"at_s": 0, "rate": 0.1},
                                                                             {"at_s": 200, "rate": 1.5}]})
    auto = AutoscalerConfig(min_replicas=1, max_replicas=6, target_ongoing_requests=4,
                            upscale_delay_s=5, downscale_delay_s=60, startup_s=10)
    res = run_sim(w, replicas=1, autoscaler=auto, seed=2)
    reps = np.asarray(res.timeseries["replicas"])
    t = np.asarray(res.timeseries["time_s"])
    assert reps[t < 200].max() == 1
    assert reps.max() > 1
    first_up = t[np.argmax(reps > 1)]
    assert first_up >= 200 + 5  # not before the upscale delay has passed
    assert res.summary["replica_seconds"] > res.summary["simulated_until_s"]  # more than one replica's worth
    fixed = run_sim(w, replicas=1, seed=2)
    assert res.summary["slo_attainment"] > fixed.summary["slo_attainment"]


def test_push_delay_and_ticks_are_regular() -> None:
    res = run_sim(make_workload(duration_s=60.0), control_interval_s=2.0, push_delay_s=0.5, seed=1)
    t = np.asarray(res.timeseries["time_s"])
    assert np.allclose(np.diff(t), 2.0)
    assert t[0] == 2.0


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"replicas": 0}, "replicas"),
        ({"max_batch": 0}, "max_batch"),
        ({"routing": "random"}, "routing"),
        ({"control_interval_s": 0}, "control_interval_s"),
        ({"autoscaler": {"min_replicas": 3, "max_replicas": 2}}, "max_replicas"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_bad_sim_config_names_the_field(config, field) -> None:
    with pytest.raises(ValueError, match=field):
        SimConfig.from_dict(config)


def test_unknown_div_or_k_in_config_names_it() -> None:
    with pytest.raises(ValueError, match="div 'js'"):
        run_sim(div="js")
    with pytest.raises(ValueError, match="k=3"):
        run_sim(k=3)


def test_routing_modes_all_serve_everything() -> None:
    w = make_workload(duration_s=200.0, arrivals={"kind": "poisson", "rate": 1.0})
    for routing in ("power_of_two", "least_loaded", "round_robin"):
        s = run_sim(w, replicas=3, routing=routing, seed=1).summary
        assert s["completed"] == s["requests"], routing


def test_drain_timeout_leaves_unfinished_requests_as_misses() -> None:
    w = make_workload(duration_s=100.0, arrivals={"kind": "poisson", "rate": 2.0},
                      output_tokens={"kind": "fixed", "value": 400})
    s = run_sim(w, replicas=1, max_queue=1000, drain_timeout_s=10.0, seed=1).summary
    assert s["unfinished"] > 0
    assert s["completed"] + s["rejected"] + s["unfinished"] == s["requests"]
    assert s["slo_attainment"] <= s["completed"] / s["requests"]
    assert math.isfinite(s["replica_seconds"])


def test_tpot_slo_per_request_definition() -> None:
    slo = SLOSpec(tiers={"standard": TierSLO(tpot_ms=1e9, ttft_ms=1e9, e2e_ms=1e9)})
    s = run_sim(make_workload(duration_s=100.0), StaticPolicy(slo, 0.0), slo=slo, seed=1).summary
    assert s["slo_attainment"] == 1.0
    tight = SLOSpec(tiers={"standard": TierSLO(tpot_ms=1.0)})
    s = run_sim(make_workload(duration_s=100.0), StaticPolicy(tight, 0.0), slo=tight, seed=1).summary
    assert s["slo_attainment"] == 0.0


def test_stale_telemetry_trips_the_fail_safe_to_lossless() -> None:
    from policies.registry import make_policy

    slo = SLOSpec.default()
    w = make_workload(duration_s=120.0, arrivals={"kind": "poisson", "rate": 1.0})
    fresh = run_sim(w, make_policy("static:1.0", slo), slo=slo, seed=1)
    stale = run_sim(w, make_policy("static:1.0", slo), slo=slo, seed=1, telemetry_age_s=30.0)
    assert set(fresh.timeseries["T_standard"]) == {1.0}
    assert set(stale.timeseries["T_standard"]) == {0.0}
    assert stale.summary["mean_distortion"] == 0.0 < fresh.summary["mean_distortion"]


class _WantsReplicas:
    """A minimal Policy: fixed T, asks for a replica count (Decision.replicas)."""

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas

    def decide(self, telemetry):
        from policies.decision import Decision

        return Decision(thresholds={"standard": 0.5}, replicas=self.replicas)

    def reset(self) -> None:
        pass


def test_policy_replica_requests_are_honoured_only_when_enabled() -> None:
    auto = AutoscalerConfig(min_replicas=1, max_replicas=5, upscale_delay_s=0, downscale_delay_s=0, startup_s=3)
    w = make_workload(duration_s=60.0, arrivals={"kind": "poisson", "rate": 0.2})
    honoured = run_sim(w, _WantsReplicas(4), replicas=1, autoscaler=auto, honour_policy_replicas=True, seed=1)
    ignored = run_sim(w, _WantsReplicas(4), replicas=1, autoscaler=auto, seed=1)
    assert max(honoured.timeseries["replicas"]) == 4
    assert max(ignored.timeseries["replicas"]) == 1
    assert honoured.summary["replica_seconds"] > 3 * ignored.summary["replica_seconds"]


class _WantsDraftLength:
    """A minimal Policy: fixed T = 0.5 on the standard tier, asks for draft length k."""

    def __init__(self, k: int) -> None:
        self.k = k

    def decide(self, telemetry):
        from policies.decision import Decision

        return Decision(thresholds={"standard": 0.5}, draft_lengths={"standard": self.k})

    def reset(self) -> None:
        pass


def test_decision_draft_length_applies_when_the_profile_has_it() -> None:
    profile = handmade_profile()
    w = make_workload(duration_s=300.0, arrivals={"kind": "poisson", "rate": 0.3},
                      output_tokens={"kind": "fixed", "value": 600})
    res = run_sim(w, _WantsDraftLength(2), replicas=2, seed=1)
    assert res.meta["draft_lengths"]["standard"] == 2
    acc = np.asarray(res.timeseries["acceptance_rate"])
    expected = profile.expected_acceptance_rate("kl", 0.5, 2)
    assert float(np.nanmean(acc)) == pytest.approx(expected, rel=0.03)
    ignored = run_sim(w, _WantsDraftLength(5), replicas=2, seed=1)
    assert ignored.meta["draft_lengths"]["standard"] == 4
    assert any("draft lengths [5]" in n for n in ignored.meta["notes"])


def test_autoscaler_scales_down_after_the_delay_and_drains_without_losing_work() -> None:
    w = make_workload(duration_s=500.0, arrivals={"kind": "step", "steps": [{"at_s": 0, "rate": 2.0},
                                                                             {"at_s": 150, "rate": 0.05}]})
    auto = AutoscalerConfig(min_replicas=1, max_replicas=6, target_ongoing_requests=2,
                            upscale_delay_s=2, downscale_delay_s=60, startup_s=5)
    res = run_sim(w, replicas=4, autoscaler=auto, seed=3)
    t = np.asarray(res.timeseries["time_s"])
    reps = np.asarray(res.timeseries["replicas"])
    assert reps[(t > 20) & (t < 150)].max() >= 4
    assert reps[t > 400].max() < reps[(t > 20) & (t < 150)].max()
    # The load falls at 150 s; nothing may go before the 60 s downscale delay has passed.
    first_down = t[np.argmax((t > 150) & (reps < reps[t < 150][-1]))]
    assert first_down >= 150 + 60
    s = res.summary
    assert s["completed"] + s["rejected"] == s["requests"] and s["unfinished"] == 0


def test_telemetry_prefill_time_is_every_admission_prefill_once() -> None:
    """Telemetry.prefill_ms over the ticks sums the prefill iterations exactly: one per admission,
    joiners admitted together (same replica, same start) sharing one prefill of their summed prompts."""
    profile = handmade_profile()
    seen: list[float] = []

    class Recording(StaticPolicy):
        def decide(self, telemetry):  # type: ignore[no-untyped-def]
            seen.append(telemetry.prefill_ms)
            return super().decide(telemetry)

    slo = SLOSpec.default()
    w = make_workload(duration_s=120.0, arrivals={"kind": "poisson", "rate": 3.0},
                      prompt_tokens={"kind": "uniform", "low": 20, "high": 400})
    res = run_sim(w, Recording(slo, 0.5), slo=slo, profile=profile, replicas=2, max_batch=4, seed=3,
                  drain_timeout_s=600.0)
    rec = res.records
    assert res.summary["completed"] == res.summary["requests"]
    groups: dict[tuple[int, float], int] = {}
    for replica, start, prompt in zip(rec["replica"], rec["start_s"], rec["prompt_tokens"], strict=True):
        groups[(int(replica), float(start))] = groups.get((int(replica), float(start)), 0) + int(prompt)
    assert len(groups) < len(rec["start_s"])  # some joiners shared a prefill
    expected = sum(profile.latency.prefill_ms(tokens) for tokens in groups.values())
    assert sum(seen) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(("k", "threshold"), [(0, 0.0), (4, 0.0), (4, 1.0)])
def test_run_totals_count_decode_tokens_and_row_iterations_as_the_engine_does(k: int, threshold: float) -> None:
    """``meta`` carries the run's decode tokens and sequence-iterations: every emitted token once (the sum of
    the completed requests' lengths), one token per row-iteration at k = 0, more than one when drafts are
    accepted; and the same totals as the policy's per-window telemetry added up (conservation across windows)."""
    slo = SLOSpec.default()
    taps: list[tuple[int, int]] = []

    class Tap(StaticPolicy):
        def decide(self, telemetry):  # type: ignore[no-untyped-def]
            rows = sum(s.rows for s in (telemetry.plain_steps, telemetry.speculative_steps) if s is not None)
            taps.append((telemetry.output_tokens, rows))
            return super().decide(telemetry)

    w = make_workload(duration_s=120.0, arrivals={"kind": "poisson", "rate": 1.5},
                      output_tokens={"kind": "lognormal", "median": 40, "sigma": 0.6, "max": 200})
    res = run_sim(w, Tap(slo, threshold, draft_lengths=k), slo, replicas=2, max_batch=4, seed=9)
    tokens, rows = res.meta["decode_tokens"], res.meta["row_iterations"]
    done = ~np.isnan(res.records["completion_s"])
    assert res.summary["unfinished"] == 0 and tokens == res.records["output_tokens"][done].sum()
    if k == 0:
        assert rows == tokens
    else:
        assert tokens / rows > 1.5
    assert sum(t for t, _ in taps) == tokens and sum(r for _, r in taps) == rows


def _peak_rows(rec: dict[str, np.ndarray], until_s: float = math.inf) -> int:
    """The most requests decoding at once on one replica, from the request records: admitted (start_s) and
    not yet completed, counted at each admission before ``until_s``."""
    done = ~np.isnan(rec["completion_s"])
    peak = 0
    for replica in np.unique(rec["replica"][done]):
        on = done & (rec["replica"] == replica)
        start, end = rec["start_s"][on], rec["completion_s"][on]
        for s in start[start < until_s]:
            peak = max(peak, int(((start <= s) & (end > s)).sum()))
    return peak


class _CapUntil:
    """A static T with a batch cap until ``until_s``, none after."""

    name = "cap-until"

    def __init__(self, cap: int, until_s: float) -> None:
        self.cap, self.until_s = cap, until_s

    def decide(self, telemetry):  # type: ignore[no-untyped-def]
        from policies.decision import Decision

        return Decision(thresholds={"standard": 0.0}, draft_lengths={"standard": 0},
                        batch_cap=self.cap if telemetry.time_s < self.until_s else None)


def test_a_batch_cap_bounds_the_rows_and_trades_tpot_for_queueing() -> None:
    slo = single_tier_slo()
    w = make_workload(duration_s=300.0, arrivals={"kind": "poisson", "rate": 0.8})
    free = run_sim(w, StaticPolicy(slo, 0.0, 0), slo=slo, replicas=1, max_batch=8, seed=4)
    capped = run_sim(w, StaticPolicy(slo, 0.0, 0, batch_cap=3), slo=slo, replicas=1, max_batch=8, seed=4)
    assert _peak_rows(free.records) > 3 and _peak_rows(capped.records) <= 3
    assert capped.summary["completed"] == free.summary["completed"] == free.summary["requests"]
    # Fewer rows per step: faster per token; the wait moves into the queue (TTFT).
    assert capped.summary["tpot_ms"]["p95"] < free.summary["tpot_ms"]["p95"]
    assert capped.summary["ttft_ms"]["p95"] > free.summary["ttft_ms"]["p95"]
    # A cap at max_batch is no cap: the same run, request for request.
    at_max = run_sim(w, StaticPolicy(slo, 0.0, 0, batch_cap=8), slo=slo, replicas=1, max_batch=8, seed=4)
    assert np.array_equal(at_max.records["completion_s"], free.records["completion_s"])


def test_a_lifted_batch_cap_admits_the_queue_at_the_next_step() -> None:
    """Cap 1 for the first 60 s of a load that queues behind it, then none: the queued requests start
    within a step of the decision's arrival, not when the running request completes."""
    slo = single_tier_slo()
    w = make_workload(duration_s=120.0, arrivals={"kind": "poisson", "rate": 1.0},
                      output_tokens={"kind": "fixed", "value": 200})
    res = run_sim(w, _CapUntil(1, 60.0), slo=slo, replicas=1, max_batch=8, seed=2, control_interval_s=1.0,
                  push_delay_s=0.0)
    rec = res.records
    assert _peak_rows(rec, until_s=60.0) == 1
    queued_at_lift = (rec["arrival_s"] < 60.0) & (rec["start_s"] > 60.0)
    assert queued_at_lift.sum() >= 3
    # The queued requests fill the batch at one step boundary just after the lift (steps are ~0.1 s here):
    # 7 join the one running, not one by one as it completes.
    joined = rec["start_s"][queued_at_lift]
    assert int((joined < 60.0 + 1.0).sum()) == min(int(queued_at_lift.sum()), 7)
