"""Calibration: the estimators (decoder/calibration.py) and fits (sim/profile_fit.py) on their own, then a
whole calibration of the tiny pair (measure + fit, as ``fsd calibrate`` runs them)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from decoder.calibration import (
    AcceptanceSample,
    CalibrationRecord,
    CalibrationSettings,
    LatencySample,
    position_counts,
)
from fsd_cli.calibrate import calibrate
from sim.profile import Profile
from sim.profile_fit import fit_acceptance, fit_latency, isotonic_increasing

# ---------------------------------------------------------------------------------------------------
# Per-position acceptance estimator
# ---------------------------------------------------------------------------------------------------


def test_position_counts_by_hand() -> None:
    # k = 3; A = 0 twice, A = 1 once, A = 3 four times.
    trials, accepts = position_counts([2, 1, 0, 4])
    assert trials == [7, 5, 4]
    assert accepts == [5, 4, 4]
    # One censored row known to have A >= 2: tried and accepted at positions 0 and 1 only.
    trials, accepts = position_counts([2, 1, 0, 4], [0, 0, 1, 0])
    assert trials == [8, 6, 4]
    assert accepts == [6, 5, 4]


def test_uncensored_estimates_reproduce_the_measured_tokens_per_iteration() -> None:
    rng = np.random.default_rng(0)
    accepted = rng.integers(0, 5, size=500)  # k = 4, any distribution
    histogram = np.bincount(accepted, minlength=5).tolist()
    trials, accepts = position_counts(histogram)
    p = np.array(accepts) / np.array(trials)
    assert 1 + np.cumprod(p).sum() == pytest.approx(1 + accepted.mean(), rel=1e-12)


def test_censored_estimator_is_unbiased_where_dropping_censored_rows_is_not() -> None:
    """Simulate blocks with known per-position acceptance, cut some at an independent position (as
    eos / max_new_tokens do), and check the product-limit estimate against the truth."""
    rng = np.random.default_rng(1)
    k, n = 4, 40_000
    truth = np.array([0.7, 0.6, 0.5, 0.4])
    leading = np.cumprod(rng.random((n, k)) < truth, axis=1).sum(axis=1)  # A: leading successes
    cut = rng.integers(1, 12, size=n)  # the request ends after `cut` more emittable tokens
    emitted = np.minimum(leading + 1, cut)
    reported = np.minimum(leading, emitted)
    exact = (emitted == reported + 1) | (reported == k)
    hist = np.bincount(reported[exact], minlength=k + 1)
    cens = np.bincount(reported[~exact], minlength=k + 1)
    trials, accepts = position_counts(hist.tolist(), cens.tolist())
    est = np.array(accepts) / np.array(trials)
    se = np.sqrt(truth * (1 - truth) / np.array(trials))
    assert np.all(np.abs(est - truth) < 4 * se), (est, truth)
    # Dropping the censored rows instead biases the estimates (long accepted runs hit the end most).
    naive_trials, naive_accepts = position_counts(hist.tolist())
    naive = np.array(naive_accepts) / np.array(naive_trials)
    assert naive[1] < truth[1] - 4 * se[1] and naive[2] < truth[2] - 4 * se[2], naive


# ---------------------------------------------------------------------------------------------------
# Isotonic fit
# ---------------------------------------------------------------------------------------------------


def test_isotonic_pools_violators_by_weight_and_keeps_monotone_input() -> None:
    assert isotonic_increasing([0.5, 0.3], [1, 3]) == pytest.approx([0.35, 0.35])
    assert isotonic_increasing([0.1, 0.2, 0.9], [5, 1, 2]) == pytest.approx([0.1, 0.2, 0.9])
    # A zero-weight point takes its left neighbour's fitted value.
    assert isotonic_increasing([0.2, 0.0, 0.6], [1, 0, 1]) == pytest.approx([0.2, 0.2, 0.6])
    with pytest.raises(ValueError, match="positive weight"):
        isotonic_increasing([0.2], [0])


def _sample(t: float, hist: list[int], tokens: int = 100, distortion: float = 0.0) -> AcceptanceSample:
    trials, accepts = position_counts(hist)
    return AcceptanceSample(
        div="kl", k=len(hist) - 1, threshold=t, row_iterations=sum(hist), censored_row_iterations=0,
        accepted_histogram=hist, censored_histogram=[0] * len(hist), position_trials=trials,
        position_accepts=accepts, emitted_tokens=tokens, distortion_sum=distortion,
        drafted=0, accepted=0, fuzzy_accepted=0,
    )


def test_fit_acceptance_is_monotone_in_threshold_and_zero_distortion_at_zero() -> None:
    samples = [
        _sample(0.0, [50, 30, 20], distortion=1e-9),
        _sample(0.5, [55, 25, 20], distortion=4.0),  # noisy dip in acceptance
        _sample(1.0, [20, 30, 50], distortion=3.0),  # noisy dip in distortion
    ]
    points = fit_acceptance(samples)
    accept = np.array([p.position_accept for p in points])
    assert np.all(np.diff(accept, axis=0) >= 0)
    assert np.all((accept >= 0) & (accept <= 1))
    dist = [p.mean_distortion for p in points]
    assert dist[0] == 0.0
    assert dist[1] == dist[2] == pytest.approx(0.035)


# ---------------------------------------------------------------------------------------------------
# Latency fit
# ---------------------------------------------------------------------------------------------------


def _latency_points(da: float, db: float, va: float, vb: float, vc: float, pf: float, pt: float) -> list[LatencySample]:
    pts = []
    for k in (2, 4, 6):
        for b in (1, 2, 4, 8):
            pts.append(LatencySample(phase="decode", k=k, batch=b, tokens=150, n=5,
                                     draft_ms=k * (da + db * b), verify_ms=0.8 * (va + vb * b + vc * k * b),
                                     overhead_ms=0.2 * (va + vb * b + vc * k * b)))
    for req, tok in ((1, 16), (1, 256), (4, 512), (2, 100)):
        pts.append(LatencySample(phase="prefill", k=0, batch=req, tokens=tok, n=1, prefill_ms=pf + pt * tok))
    return pts


def test_latency_fit_reproduces_its_points() -> None:
    coefs = (9.0, 1.5, 40.0, 6.0, 2.5, 3.0, 1.6)
    fit = fit_latency(_latency_points(*coefs))
    m = fit.model
    got = (m.draft_a_ms, m.draft_b_ms, m.verify_a_ms, m.verify_b_ms, m.verify_c_ms, m.prefill_fixed_ms,
           m.prefill_ms_per_token)
    assert got == pytest.approx(coefs, rel=1e-6)
    q = fit.quality
    assert max(q.draft_max_rel_error, q.verify_max_rel_error, q.iteration_max_rel_error,
               q.prefill_max_rel_error) < 1e-6
    # The simulator's iteration time at a measured point is draft + verify + overhead there.
    assert float(m.iteration_ms(4, 4)) == pytest.approx(4 * (9 + 1.5 * 4) + 40 + 6 * 4 + 2.5 * 16)


def test_latency_fit_measures_plain_decoding_where_k_0_was_timed() -> None:
    points = _latency_points(9.0, 1.5, 40.0, 6.0, 2.5, 3.0, 1.6)
    assert fit_latency(points).model.plain_step_a_ms is None  # k = 0 not timed: derived by the profile
    plain_a, plain_b = 30.0, 4.0
    plain = [LatencySample(phase="decode", k=0, batch=b, tokens=100.0, n=3, verify_ms=0.9 * (plain_a + plain_b * b),
                           overhead_ms=0.1 * (plain_a + plain_b * b)) for b in (1, 2, 4, 8)]
    fit = fit_latency(points + plain)
    m = fit.model
    assert (m.plain_step_a_ms, m.plain_step_b_ms) == pytest.approx((plain_a, plain_b), rel=1e-6)
    assert fit.quality.plain_max_rel_error is not None and fit.quality.plain_max_rel_error < 1e-6
    # k = 0 points stay out of the speculative fit: it is the same as without them.
    assert (m.verify_a_ms, m.verify_b_ms, m.verify_c_ms) == pytest.approx((40.0, 6.0, 2.5), rel=1e-6)
    assert float(m.iteration_ms(4, 0)) == pytest.approx(plain_a + plain_b * 4)
    assert m.plain_step_ms_by_batch == pytest.approx([plain_a + plain_b * b for b in range(1, 9)])


def test_latency_fit_keeps_concave_plain_steps_as_measured() -> None:
    """Plain steps measured at 1, 2, 3, 4, 8 rows (the default pair's shape, session 16): the profile keeps
    them per batch (lines between measured sizes), so the step at 3 rows is the measured one, not the line's."""
    measured = {1: 51.6, 2: 73.3, 3: 91.0, 4: 99.0, 8: 113.4}
    plain = [LatencySample(phase="decode", k=0, batch=b, tokens=100.0, n=3, verify_ms=ms, overhead_ms=0.0)
             for b, ms in measured.items()]
    m = fit_latency(_latency_points(9.0, 1.5, 40.0, 6.0, 2.5, 3.0, 1.6) + plain).model
    assert m.plain_step_ms_by_batch == pytest.approx([51.6, 73.3, 91.0, 99.0, 102.6, 106.2, 109.8, 113.4])
    assert [float(m.iteration_ms(b, 0)) for b in measured] == pytest.approx(list(measured.values()))
    line = m.plain_step_a_ms + 3 * m.plain_step_b_ms
    assert abs(line - 91.0) > 5.0  # the least-squares line is off there: what the table is for


def test_latency_fit_separates_the_drafts_prefill_when_joins_at_k_0_were_timed() -> None:
    points = _latency_points(9.0, 1.5, 40.0, 6.0, 2.5, 3.0, 1.6)  # every join at k = 0 (older calibrations)
    lone = fit_latency(points).model
    assert not lone.models_draft_prefill and lone.prefill_ms(100) == pytest.approx(3.0 + 160.0)
    # Joins at k > 0 also run the draft's prefill: 20 ms + 0.9 ms per token more.
    drafting = [LatencySample(phase="prefill", k=k, batch=req, tokens=tok, n=1, prefill_ms=23.0 + 2.5 * tok)
                for k, req, tok in ((2, 1, 16), (4, 1, 256), (2, 4, 512), (6, 2, 100))]
    fit = fit_latency(points + drafting)
    m = fit.model
    got = (m.prefill_fixed_ms, m.prefill_ms_per_token, m.draft_prefill_fixed_ms, m.draft_prefill_ms_per_token)
    assert got == pytest.approx((3.0, 1.6, 20.0, 0.9), rel=1e-6)
    assert fit.quality.prefill_max_rel_error < 1e-6
    assert m.prefill_ms(100, drafting_tokens=0) == pytest.approx(163.0)  # a join at k = 0
    assert m.prefill_ms(100) == pytest.approx(273.0)  # every joiner drafts
    assert m.draft_catch_up_ms(3 * 50) == pytest.approx(20.0 + 0.9 * 150)
    assert m.draft_catch_up_ms(0) == 0.0


def test_latency_fit_keeps_short_prompts_prefills_as_measured() -> None:
    """A prefill with a fixed cost the line cannot carry (the default pair, session 27: 121-125 ms at 16 tokens,
    ~160 at 64, ~1.7 ms a token beyond): the profile keeps the measured prefills per length (median over
    repeats), reads a join between them off the straight line through its neighbours and beyond the last
    one grows at the fitted slope."""
    decode = [p for p in _latency_points(9.0, 1.5, 40.0, 6.0, 2.5, 3.0, 1.6) if p.phase == "decode"]
    measured = {16: (121.0, 125.0, 160.0), 64: (157.0, 166.0, 162.0), 256: (470.0, 480.0, 478.0),
                512: (880.0, 1000.0, 1005.0)}
    prefill = [LatencySample(phase="prefill", k=0, batch=1, tokens=float(n), n=1, prefill_ms=ms)
               for n, repeats in measured.items() for ms in repeats]
    m = fit_latency(decode + prefill).model
    assert m.prefill_ms_by_tokens is not None
    assert [n for n, _ in m.prefill_ms_by_tokens] == [16, 64, 256, 512]
    assert [ms for _, ms in m.prefill_ms_by_tokens] == pytest.approx([125.0, 162.0, 478.0, 1000.0])
    assert m.prefill_ms(16) == pytest.approx(125.0)
    assert m.prefill_ms(40) == pytest.approx((125.0 + 162.0) / 2)
    assert m.prefill_ms(8) == pytest.approx(125.0)  # below the shortest measured prompt: its prefill
    assert m.prefill_ms(600) == pytest.approx(1000.0 + 88 * m.prefill_ms_per_token)
    line_at_16 = m.prefill_fixed_ms + 16 * m.prefill_ms_per_token
    assert 125.0 - line_at_16 > 20.0  # the least-squares line misses the short prompt: what the points are for
    # One measured length only: no table, the line.
    one = [p for p in prefill if p.tokens == 256] + [prefill[0].model_copy(update={"tokens": 256.0})]
    assert fit_latency(decode + one).model.prefill_ms_by_tokens is None


def test_latency_fit_stays_non_negative() -> None:
    # Timings that fall with batch size would need a negative slope; the profile forbids it.
    pts = _latency_points(9.0, 0.0, 40.0, 0.0, 0.0, 3.0, 1.0)
    pts = [p.model_copy(update={"verify_ms": p.verify_ms - 2.0 * p.batch}) if p.phase == "decode" else p
           for p in pts]
    m = fit_latency(pts).model
    assert min(m.draft_a_ms, m.draft_b_ms, m.verify_a_ms, m.verify_b_ms, m.verify_c_ms) >= 0


def test_latency_fit_needs_both_phases() -> None:
    pts = _latency_points(9.0, 1.0, 40.0, 1.0, 1.0, 3.0, 1.0)
    with pytest.raises(ValueError, match="prefill"):
        fit_latency([p for p in pts if p.phase == "decode"])


# ---------------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"divs": ("kl", "hellinger")}, "hellinger"),
        ({"ks": (0, 4)}, "ks"),
        ({"thresholds": {"kl": (0.0, -1.0)}}, "thresholds"),
        ({"divs": ("js",), "thresholds": {"kl": (0.0, 1.0)}}, "js"),
        ({"prompts": 0}, "prompts"),
        ({"prompts": 17}, "prompts 17 exceeds the prompt set's 16"),
        ({"prompt_texts": ()}, "prompt_texts"),
        ({"prompt_texts": ("a", " ")}, "prompt 1 is empty"),
        ({"default_k": 5}, "default_k"),
    ],
)
def test_bad_settings_name_the_field(data: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        CalibrationSettings.from_dict(data)


def test_threshold_zero_is_always_in_the_grid() -> None:
    s = CalibrationSettings.from_dict({"divs": ("kl",), "thresholds": {"kl": (1.0, 0.5)}})
    assert s.thresholds["kl"] == (0.0, 0.5, 1.0)


# ---------------------------------------------------------------------------------------------------
# A whole calibration of the tiny pair (fast: tiny random models)
# ---------------------------------------------------------------------------------------------------

TINY_SETTINGS = {
    "divs": ("kl", "js"),
    "thresholds": {"kl": (0.0, 0.25, 1.0, 4.0), "js": (0.0, 0.1, 0.7)},
    "ks": (2, 4),
    "batch_sizes": (1, 3),
    "prompts": 6,
    "max_new_tokens": 32,
    "timing_iterations": 2,
    "timing_prompt_tokens": 32,
    "prefill_lengths": (16, 64),
    "prefill_repeats": 1,
}


@pytest.fixture(scope="module")
def tiny_profile() -> Profile:
    from decoder.models import tiny_pair

    return calibrate(tiny_pair(), CalibrationSettings.from_dict(TINY_SETTINGS), command="test")


def test_tiny_profile_validates_and_round_trips(tiny_profile: Profile, tmp_path) -> None:
    assert tiny_profile.provenance.source == "calibrated"
    assert tiny_profile.provenance.torch_version and tiny_profile.provenance.date
    assert "CPUs" in tiny_profile.provenance.machine
    path = tmp_path / "tiny.json"
    tiny_profile.save(path)
    loaded = Profile.load(path)
    assert loaded.model_dump() == tiny_profile.model_dump()
    record = CalibrationRecord.model_validate(loaded.calibration)
    assert record.settings == CalibrationSettings.from_dict(TINY_SETTINGS)
    assert json.loads(path.read_text())["schema_version"] == 1


def test_tiny_profile_measures_plain_decoding(tiny_profile: Profile) -> None:
    lat = tiny_profile.latency
    assert tiny_profile.plain_decoding_source == "measured"
    assert lat.plain_step_a_ms is not None and lat.plain_step_b_ms is not None
    assert float(lat.iteration_ms(1, 0)) > 0
    model = tiny_profile.to_operating_model()
    assert 0 in model.draft_lengths and "k = 0 measured" in model.source


def test_tiny_profile_covers_the_grid(tiny_profile: Profile) -> None:
    assert tiny_profile.divs() == ["js", "kl"]
    assert tiny_profile.draft_lengths("kl") == [2, 4]
    assert list(tiny_profile.thresholds("kl", 4)) == [0.0, 0.25, 1.0, 4.0]
    assert (tiny_profile.default_div, tiny_profile.default_k) == ("kl", 4)


def test_tiny_acceptance_is_a_probability_and_monotone_in_threshold(tiny_profile: Profile) -> None:
    for div in tiny_profile.divs():
        for k in tiny_profile.draft_lengths(div):
            grid = np.array([tiny_profile.position_accept(div, float(t), k)
                             for t in tiny_profile.thresholds(div, k)])
            assert np.all((grid >= 0) & (grid <= 1)), (div, k)
            assert np.all(np.diff(grid, axis=0) >= 0), (div, k)
            dist = [tiny_profile.mean_distortion(div, float(t), k) for t in tiny_profile.thresholds(div, k)]
            assert dist[0] == 0.0 and np.all(np.diff(dist) >= 0)


def test_tiny_raw_acceptance_rises_with_threshold_beyond_noise(tiny_profile: Profile) -> None:
    """The raw first-position estimates (before the isotonic fit): no decrease in T larger than 3
    standard errors, and the largest T accepts significantly more than T = 0."""
    record = CalibrationRecord.model_validate(tiny_profile.calibration)
    for div in ("kl", "js"):
        samples = sorted((s for s in record.acceptance if s.div == div and s.k == 4), key=lambda s: s.threshold)
        n = np.array([s.position_trials[0] for s in samples], dtype=float)
        p = np.array([s.position_accepts[0] for s in samples]) / n
        assert n.min() >= 30, n
        for i in range(len(p)):
            for j in range(i + 1, len(p)):
                se = math.sqrt(p[i] * (1 - p[i]) / n[i] + p[j] * (1 - p[j]) / n[j]) or 1e-9
                assert (p[i] - p[j]) / se < 3, (div, samples[i].threshold, samples[j].threshold, p)
        se = math.sqrt(p[0] * (1 - p[0]) / n[0] + p[-1] * (1 - p[-1]) / n[-1])
        assert p[-1] - p[0] > 3 * se, (div, p)


def test_tiny_raw_data_is_consistent(tiny_profile: Profile) -> None:
    record = CalibrationRecord.model_validate(tiny_profile.calibration)
    # The record says how the engine ran the draft, so its latency can be refitted (benchmarks/refit_latency.py).
    from decoder.engine import default_share_kv
    from decoder.models import tiny_pair

    assert record.draft_shares_kv is default_share_kv(tiny_pair())
    for s in record.acceptance:
        assert sum(s.accepted_histogram) == s.row_iterations
        assert s.fuzzy_accepted <= s.accepted <= s.drafted
        # Per request (one per prompt): the pooled counts split without loss.
        assert s.request_accepted is not None and s.request_drafted is not None
        assert len(s.request_accepted) == len(s.request_drafted) == record.settings.prompts * record.settings.samples_per_prompt
        assert sum(s.request_accepted) == s.accepted and sum(s.request_drafted) == s.drafted
        # Every distortion event carries TV in (0, 1]: events bound the sum from both sides.
        assert s.distorted_tokens is not None and s.distorted_tokens <= s.emitted_tokens
        assert s.distortion_sum <= s.distorted_tokens + 1e-6 and (s.distorted_tokens > 0) == (s.distortion_sum > 0)
        if s.threshold == 0:
            assert s.fuzzy_accepted == 0 and s.distortion_sum == 0.0 and s.distorted_tokens == 0
    for div in tiny_profile.divs():  # the fit gives the simulator distortion as events
        for k in tiny_profile.draft_lengths(div):
            for t in tiny_profile.thresholds(div, k):
                p, size = tiny_profile.distortion_events(div, float(t), k)
                assert 0.0 <= size <= 1.0 and p * size == pytest.approx(tiny_profile.mean_distortion(div, float(t), k))
    decode = [s for s in record.latency if s.phase == "decode"]
    assert {(s.k, s.batch) for s in decode} == {(0, 1), (0, 3), (2, 1), (2, 3), (4, 1), (4, 3)}
    assert all(s.draft_ms > 0 and s.verify_ms > 0 and s.n >= 1 for s in decode if s.k >= 1)
    assert all(s.verify_ms > 0 and s.n >= 1 for s in decode if s.k == 0)  # k = 0: the target forward alone
    prefill = [s for s in record.latency if s.phase == "prefill"]
    assert {s.tokens for s in prefill if s.batch == 1} >= {16.0, 64.0}
    # Joins were timed at k = 0 (the target's prefill alone) and at k > 0 (target and draft).
    assert {s.k for s in prefill} == {0, 2, 4}


def test_acceptance_can_be_reused_and_only_latency_remeasured(tiny_profile: Profile) -> None:
    from decoder.models import tiny_pair

    settings = CalibrationSettings.quick(batch_sizes=(1, 2), timing_iterations=1, clock="cpu",
                                         timing_prompt_tokens=16, prefill_lengths=(16,))
    # Its separately measured acceptance sections come along too (else a latency-only recalibration
    # silently drops the per-request spread).
    from sim.profile import RequestAcceptance

    spread = RequestAcceptance(concentration=12.0, source="test")
    again = calibrate(tiny_pair(), settings, acceptance_from=tiny_profile.model_copy(update={"request_acceptance": spread}))
    assert again.acceptance == tiny_profile.acceptance and again.request_acceptance == spread
    record = CalibrationRecord.model_validate(again.calibration)
    assert record.settings.clock == "cpu" and record.settings.divs == ("kl", "js")
    assert {(s.k, s.batch) for s in record.latency if s.phase == "decode"} == {(0, 1), (0, 2), (4, 1), (4, 2)}
    assert all(0 < s.cpu_fraction <= 1 for s in record.latency)
    with pytest.raises(ValueError, match="temperature"):
        calibrate(tiny_pair(), settings.model_copy(update={"temperature": 0.7}), acceptance_from=tiny_profile)
    with pytest.raises(ValueError, match="pair"):
        calibrate(tiny_pair(seed=1), settings, acceptance_from=tiny_profile)


def test_latency_can_be_reused_and_acceptance_measured_on_other_prompts(tiny_profile: Profile) -> None:
    from decoder.models import tiny_pair

    settings = CalibrationSettings.quick(temperature=0.7, prompt_texts=("Say hi.", "Count to three."), prompts=2,
                                         samples_per_prompt=2)
    from sim.profile import RequestAcceptance

    spread = RequestAcceptance(concentration=7.0, source="served requests")
    again = calibrate(tiny_pair(), settings, latency_from=tiny_profile.model_copy(update={"request_acceptance": spread}))
    # The per-request spread comes along (a calibration measures none), saying where it came from.
    assert again.request_acceptance is not None and again.request_acceptance.concentration == 7.0
    assert "--latency-from" in again.request_acceptance.source
    # The machine model is the source's, as fitted; the raw timings travel with it and the settings describe them.
    assert again.latency == tiny_profile.latency
    record = CalibrationRecord.model_validate(again.calibration)
    source = CalibrationRecord.model_validate(tiny_profile.calibration)
    assert record.latency == source.latency
    assert record.settings.batch_sizes == source.settings.batch_sizes == (1, 3)
    assert record.settings.ks == source.settings.ks and record.settings.swept_acceptance_ks == (4,)
    # The acceptance is this run's: its temperature, prompts and grid.
    assert record.settings.temperature == 0.7 and record.settings.prompt_texts == ("Say hi.", "Count to three.")
    assert {(a.div, a.k) for a in again.acceptance} == {("kl", 4)}
    assert {len(s.request_drafted) for s in record.acceptance} == {4}
    with pytest.raises(ValueError, match="--latency-from"):
        calibrate(tiny_pair(seed=1), settings, latency_from=tiny_profile)

    # Both reused: nothing measured, one profile's acceptance beside the other's latency.
    spliced = calibrate(tiny_pair(), settings, acceptance_from=again.model_copy(update={"request_acceptance": None}),
                        latency_from=tiny_profile.model_copy(update={"request_acceptance": spread}))
    assert spliced.acceptance == again.acceptance and spliced.latency == tiny_profile.latency
    assert spliced.request_acceptance is not None and spliced.request_acceptance.concentration == 7.0
