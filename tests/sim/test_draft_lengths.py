"""Per-tier draft length k in the simulator: k = 0 is plain decoding, mixed-k batches, and per-window
token accounting (conservation)."""

from __future__ import annotations

import numpy as np
import pytest

from policies.decision import Decision
from policies.slo import SLOSpec, TierSLO
from policies.static import StaticPolicy
from policies.telemetry import Telemetry
from sim.profile import Profile
from sim.workload import Requests
from tests.sim.conftest import handmade_profile, make_workload, run_sim

TWO_TIERS = SLOSpec(
    tiers={
        "lossless": TierSLO(fixed_threshold=0.0, max_threshold=0.0),
        "standard": TierSLO(tpot_ms=1e9, max_mean_distortion=1.0, max_threshold=1.0),
    },
    default_tier="standard",
)


class Recorder:
    """Wraps a policy and keeps every telemetry window it was shown."""

    def __init__(self, inner: StaticPolicy) -> None:
        self.inner = inner
        self.windows: list[Telemetry] = []

    def decide(self, telemetry: Telemetry) -> Decision:
        self.windows.append(telemetry)
        return self.inner.decide(telemetry)

    def reset(self) -> None:
        self.windows = []


def test_profile_models_k0_as_plain_decoding() -> None:
    p = handmade_profile()
    assert p.available_draft_lengths("kl") == [0, *p.draft_lengths("kl")]
    assert p.expected_tokens_per_iter("kl", 1.0, 0) == 1.0
    assert p.mean_distortion("kl", 1.0, 0) == 0.0
    lat = p.latency
    assert float(lat.iteration_ms(3, 0)) == pytest.approx(lat.verify_a_ms + 3 * lat.verify_b_ms)
    assert p.plain_decoding_source.startswith("derived")
    measured = Profile.model_validate(
        {**p.model_dump(), "latency": {**lat.model_dump(), "plain_step_a_ms": 20.0, "plain_step_b_ms": 1.0}}
    )
    assert float(measured.latency.iteration_ms(3, 0)) == pytest.approx(23.0)
    assert measured.plain_decoding_source == "measured"


def test_mixed_step_model_reduces_to_the_uniform_one() -> None:
    lat = handmade_profile().latency
    for k in (0, 2, 4):
        fixed, per_row = lat.mixed_coeffs(np.full(5, k))
        a, b = lat.iteration_coeffs(k)
        assert fixed + per_row.sum() == pytest.approx(a + 5 * b), f"k={k}"
    # One row drafting 4, one plain: 4 draft steps over one row, verify widths 5 and 1.
    fixed, per_row = lat.mixed_coeffs(np.array([4, 0]))
    expected = (4 * (lat.draft_a_ms + lat.draft_b_ms) + lat.verify_a_ms + 2 * lat.verify_b_ms
                + 4 * lat.verify_c_ms)
    assert fixed + per_row.sum() == pytest.approx(expected)
    # The same step from its sums (rows 2, verify tokens 4, k_max 4, one drafting row).
    assert float(lat.speculative_step_ms(np.array([2]), np.array([4]), np.array([4]), np.array([1]))[0]) == (
        pytest.approx(expected))


def test_k0_tier_emits_one_token_per_step_at_the_plain_step_time_without_distortion() -> None:
    profile = handmade_profile()
    w = make_workload(duration_s=600.0, arrivals={"kind": "poisson", "rate": 0.02},
                      prompt_tokens={"kind": "fixed", "value": 50}, output_tokens={"kind": "fixed", "value": 40},
                      tier_mix={"standard": 1.0})
    res = run_sim(w, StaticPolicy(TWO_TIERS, 1.0, draft_lengths=0), slo=TWO_TIERS, profile=profile,
                  replicas=1, seed=2)
    rec = res.records
    alone = rec["start_s"] == rec["arrival_s"]
    assert alone.sum() >= 5
    tpot_ms = ((rec["completion_s"] - rec["first_token_s"]) / 39 * 1000)[alone]
    # Requests alone on the replica: one token per plain step at batch 1, even at T = 1.
    assert np.allclose(tpot_ms, float(profile.latency.iteration_ms(1, 0)), rtol=1e-9)
    assert res.summary["mean_distortion"] == 0.0


def test_plain_steps_run_at_the_measured_step_per_batch_when_the_profile_has_one() -> None:
    """A profile with plain steps measured per batch (concave): windows of plain decoding at 1 and 3 rows
    step at the table's times, not the line's (which would say 23 and 25 ms)."""
    base = handmade_profile()
    table = [10.0, 16.0, 19.0, 20.0]
    profile = Profile.model_validate({**base.model_dump(), "latency": {
        **base.latency.model_dump(), "plain_step_a_ms": 22.0, "plain_step_b_ms": 1.0, "plain_step_ms_by_batch": table}})
    assert profile.latency.plain_table(6) == pytest.approx([0.0, 10.0, 16.0, 19.0, 20.0, 21.0, 22.0])
    three = Requests(arrival_s=np.array([0.1, 0.1, 0.1, 30.0]), prompt_tokens=np.array([10, 10, 10, 10]),
                     output_tokens=np.array([1000, 1000, 1000, 300]), tier=np.zeros(4, dtype=np.int16),
                     tier_names=("standard",))
    slo = SLOSpec(tiers={"standard": TierSLO(tpot_ms=1e9, max_mean_distortion=1.0, max_threshold=1.0)},
                  default_tier="standard")
    policy = Recorder(StaticPolicy(slo, 0.0, draft_lengths=0))
    run_sim(three, policy, slo=slo, profile=profile, replicas=1, max_batch=8, seed=0, control_interval_s=1.0)
    by_batch = {round(t.mean_batch_size): t.mean_iteration_ms for t in policy.windows
                if t.mean_batch_size in (1.0, 3.0) and t.tiers["standard"].completions == 0
                and t.prefill_ms == 0.0}
    assert by_batch[3] == pytest.approx(19.0) and by_batch[1] == pytest.approx(10.0)
    with pytest.raises(ValueError, match="plain_step_ms_by_batch"):
        Profile.model_validate({**base.model_dump(), "latency": {**base.latency.model_dump(),
                                                                 "plain_step_ms_by_batch": [10.0, 0.0]}})


def _lossless_beside_standard(profile: Profile, lossless_tokens: int, standard_tokens: int) -> Recorder:
    """One lossless request (k = 0) and one standard (k = 4, T = 1) arriving together on one replica: the
    windows the static policy saw."""
    w = Requests(arrival_s=np.array([0.1, 0.1]), prompt_tokens=np.array([10, 10]),
                 output_tokens=np.array([lossless_tokens, standard_tokens]), tier=np.array([0, 1], dtype=np.int16),
                 tier_names=("lossless", "standard"))
    policy = Recorder(StaticPolicy(TWO_TIERS, 1.0, draft_lengths={"lossless": 0, "standard": 4}))
    run_sim(w, policy, slo=TWO_TIERS, profile=profile, replicas=1, max_batch=8, seed=0, control_interval_s=1.0)
    return policy


def test_mixed_batch_steps_at_the_mixed_model_time_and_each_tier_keeps_its_k() -> None:
    profile = handmade_profile()
    # Long outputs: both decode side by side.
    policy = _lossless_beside_standard(profile, 400, 400)
    fixed, per_row = profile.latency.mixed_coeffs(np.array([0, 4]))
    both = [t for t in policy.windows if t.mean_batch_size == pytest.approx(2.0)]
    assert len(both) >= 3
    for t in both:
        assert t.mean_iteration_ms == pytest.approx(fixed + per_row.sum())
        assert t.tiers["lossless"].tokens_per_iteration == pytest.approx(1.0)
        assert t.tiers["standard"].tokens_per_iteration > 1.5
        assert t.tiers["lossless"].draft_length == 0 and t.tiers["standard"].draft_length == 4
        assert t.tiers["lossless"].mean_distortion == 0.0


def test_windows_report_steps_by_kind_and_a_mixed_batch_steps_plain_once_no_row_drafts() -> None:
    """A row drafting k = 4 beside a plain one, then (it done) the plain one alone, inside one drawn segment:
    speculative steps at the mixed model's time with their composition, then plain steps at the plain
    step's time (no draft forwards charged for a row that is gone)."""
    profile = handmade_profile()
    policy = _lossless_beside_standard(profile, 1500, 400)
    fixed, per_row = profile.latency.mixed_coeffs(np.array([0, 4]))
    plain_ms = float(profile.latency.iteration_ms(1, 0))
    mixed_windows = plain_windows = 0
    for t in policy.windows:
        spec, plain = t.speculative_steps, t.plain_steps
        if t.time_s == 0.0:  # the initial window, before any step
            continue
        assert spec is not None and plain is not None
        assert spec.ms + plain.ms == pytest.approx(t.mean_iteration_ms * (spec.steps + plain.steps), nan_ok=True)
        if t.prefill_ms > 0:
            continue
        if spec.steps and not plain.steps:
            mixed_windows += 1
            assert spec.mean_ms == pytest.approx(fixed + per_row.sum())
            assert (spec.rows, spec.draft_forwards, spec.verify_tokens, spec.drafted_row_forwards) == (
                2 * spec.steps, 4 * spec.steps, 4 * spec.steps, 4 * spec.steps)
        elif plain.steps and not spec.steps:
            plain_windows += 1
            assert plain.mean_ms == pytest.approx(plain_ms) and plain.rows == plain.steps
    assert mixed_windows >= 3 and plain_windows >= 3, (mixed_windows, plain_windows)


class Flipper:
    """Every tick a new (T, k) for the standard and economy tiers (cycling): every decision truncates
    the drawn segments holding them, so window sums are taken back and redrawn all the time."""

    def __init__(self) -> None:
        self.windows: list[Telemetry] = []

    def decide(self, telemetry: Telemetry) -> Decision:
        self.windows.append(telemetry)
        i = len(self.windows)
        return Decision(thresholds={"standard": (0.0, 0.5, 1.0)[i % 3], "economy": (4.0, 1.0)[i % 2]},
                        draft_lengths={"standard": (4, 2, 6, 0)[i % 4], "economy": (6, 4)[i % 2]})

    def reset(self) -> None:
        self.windows = []


@pytest.mark.parametrize("variation", [None, 3.0], ids=["profile acceptance", "per-request acceptance"])
@pytest.mark.parametrize("flipping", [False, True], ids=["static", "T and k change every tick"])
def test_window_token_accounting_is_conserved(variation: float | None, flipping: bool) -> None:
    """Σ over windows of the tokens the telemetry reports = tokens the requests received, per tier and
    overall; in every window tokens = sequence-steps + accepted drafts, and tier sums add up — also
    when every tick's decision truncates segments, and with per-request acceptance."""
    from sim.profile import RequestAcceptance

    slo = SLOSpec.default()
    w = make_workload(duration_s=200.0, arrivals={"kind": "poisson", "rate": 3.0},
                      output_tokens={"kind": "lognormal", "median": 60, "sigma": 0.5, "max": 300},
                      tier_mix={"lossless": 0.2, "standard": 0.5, "economy": 0.3})
    policy: Recorder | Flipper = Flipper() if flipping else Recorder(StaticPolicy(
        slo, {"standard": 0.5, "economy": 2.0}, draft_lengths={"lossless": 0, "standard": 4, "economy": 6}))
    profile = handmade_profile()
    if variation is not None:
        profile = profile.model_copy(update={"request_acceptance": RequestAcceptance(concentration=variation)})
    res = run_sim(w, policy, slo=slo, profile=profile, replicas=2, seed=4, drain_timeout_s=1000.0)
    emitted = res.records["output_tokens"][~np.isnan(res.records["completion_s"])].sum()
    assert res.summary["completed"] == res.summary["requests"] - res.summary["rejected"]
    windows = policy.windows[1:]  # the first is the empty pre-traffic window
    assert sum(t.output_tokens for t in windows) == emitted == res.summary["output_tokens"]
    for i, name in enumerate(slo.tiers):
        tier_emitted = res.records["output_tokens"][(res.records["tier"] == i)
                                                    & ~np.isnan(res.records["completion_s"])].sum()
        assert sum(t.tiers[name].output_tokens for t in windows) == tier_emitted, name
    for j, t in enumerate(windows):
        assert sum(tw.output_tokens for tw in t.tiers.values()) == t.output_tokens, f"window {j}"
        if t.mean_batch_size == t.mean_batch_size:  # steps in the window
            seq_iters = sum(tw.sequence_iterations for tw in t.tiers.values())
            accepted = t.mean_accepted_per_iter * seq_iters
            assert t.output_tokens == pytest.approx(seq_iters + accepted, abs=1e-6), f"window {j}"


# ---------------------------------------------------------------------------------------------------
# The draft's backlog: a join at k = 0 skips the draft's prefill, a row that starts drafting catches up
# ---------------------------------------------------------------------------------------------------


def _with_draft_prefill(fixed_ms: float, per_token_ms: float) -> Profile:
    data = handmade_profile().model_dump()
    data["latency"] = {**data["latency"], "draft_prefill_fixed_ms": fixed_ms, "draft_prefill_ms_per_token": per_token_ms}
    return Profile.model_validate(data)


class SwitchK:
    """Static T; every tier at k = ``before`` until ``at_s``, then at ``after``."""

    def __init__(self, slo: SLOSpec, at_s: float, before: int, after: int) -> None:
        self.inner, self.at_s, self.before, self.after = StaticPolicy(slo, 1.0), at_s, before, after

    def decide(self, telemetry: Telemetry) -> Decision:
        d = self.inner.decide(telemetry)
        k = self.before if telemetry.time_s < self.at_s else self.after
        return Decision(thresholds=d.thresholds, draft_lengths={n: k for n in d.thresholds}, reason="test")

    def reset(self) -> None:
        self.inner.reset()


def _one_request_e2e(profile: Profile, policy: SwitchK, prompt: int = 100, output: int = 200) -> tuple[float, float]:
    w = Requests(arrival_s=np.array([0.05]), prompt_tokens=np.array([prompt]), output_tokens=np.array([output]),
                 tier=np.array([1], dtype=np.int16), tier_names=("lossless", "standard"))
    res = run_sim(w, policy, slo=TWO_TIERS, profile=profile, replicas=1, seed=3, control_interval_s=1.0)
    rec = res.records
    return float(rec["first_token_s"][0] - rec["arrival_s"][0]), float(rec["completion_s"][0] - rec["arrival_s"][0])


def test_a_row_that_starts_drafting_pays_the_drafts_catch_up_once() -> None:
    fixed_ms, per_token_ms = 50.0, 1.0
    without, with_ = handmade_profile(), _with_draft_prefill(fixed_ms, per_token_ms)

    def backlog_at_switch(at_s: float) -> float:
        """Plain decoding until ``at_s``, then k = 4: the draft runs once over the prompt (100) and the
        tokens so far; the extra E2E, in tokens of that forward (the run is otherwise the same)."""
        ttft0, e2e0 = _one_request_e2e(without, SwitchK(TWO_TIERS, at_s, 0, 4))
        ttft1, e2e1 = _one_request_e2e(with_, SwitchK(TWO_TIERS, at_s, 0, 4))
        assert ttft1 == pytest.approx(ttft0)  # joined at k = 0: the target's prefill alone
        return (1000.0 * (e2e1 - e2e0) - fixed_ms) / per_token_ms - 100

    plain_step_ms = float(without.latency.iteration_ms(1, 0))
    early, late = backlog_at_switch(3.0), backlog_at_switch(4.0)
    for backlog in (early, late):
        assert backlog == pytest.approx(round(backlog), abs=1e-6) and 0 < backlog < 200
    # A second more at k = 0 is a second more of plain steps (one token each) the draft has not seen.
    assert late - early == pytest.approx(1000.0 / plain_step_ms, abs=1.0)
    # Plain decoding throughout: the draft never runs, nothing to catch up.
    assert _one_request_e2e(with_, SwitchK(TWO_TIERS, 1e9, 0, 4)) == pytest.approx(
        _one_request_e2e(without, SwitchK(TWO_TIERS, 1e9, 0, 4)))
    # Drafting from the start: the draft prefills the prompt with the target, once, at the join.
    ttft2, e2e2 = _one_request_e2e(with_, SwitchK(TWO_TIERS, 0.0, 4, 4))
    ttft3, e2e3 = _one_request_e2e(without, SwitchK(TWO_TIERS, 0.0, 4, 4))
    assert 1000.0 * (ttft2 - ttft3) == pytest.approx(fixed_ms + per_token_ms * 100)
    assert 1000.0 * (e2e2 - e2e3) == pytest.approx(fixed_ms + per_token_ms * 100)


class _RecordingSwitch(SwitchK):
    def __init__(self, slo: SLOSpec, at_s: float, before: int, after: int) -> None:
        super().__init__(slo, at_s, before, after)
        self.windows: list[Telemetry] = []

    def decide(self, telemetry: Telemetry) -> Decision:
        self.windows.append(telemetry)
        return super().decide(telemetry)


def test_the_catch_up_is_not_reported_as_decode_step_time() -> None:
    """A row switching from k = 0 to k = 4 pays the draft's catch-up once (above); the window that holds it
    reports the decode steps alone, as the engine does (StepStats.catch_up_time_s), so a policy's step
    correction does not read the one-off as slower steps."""
    profile = _with_draft_prefill(500.0, 5.0)  # a catch-up far longer than any step
    policy = _RecordingSwitch(TWO_TIERS, 3.0, 0, 4)
    w = Requests(arrival_s=np.array([0.05]), prompt_tokens=np.array([100]), output_tokens=np.array([400]),
                 tier=np.array([1], dtype=np.int16), tier_names=("lossless", "standard"))
    run_sim(w, policy, slo=TWO_TIERS, profile=profile, replicas=1, seed=3, control_interval_s=1.0)
    step_k4 = float(profile.latency.iteration_ms(1, 4))
    # From the window after the one that first reports k = 4 (that one closes before the catch-up step ends).
    after = [t for t in policy.windows if t.time_s >= 5.0 and "standard" in t.tiers
             and t.tiers["standard"].draft_length == 4 and t.mean_batch_size == 1.0]
    assert len(after) >= 3 and after[0].time_s == 5.0
    for t in after:
        assert t.mean_iteration_ms == pytest.approx(step_k4), t.time_s
