"""Per-request variation in acceptance (``Profile.request_acceptance``): each request's acceptance is the
profile's shifted by its own log-odds draw. Statistical checks with fixed seeds, at batch 1 and fixed
step time, where a request's decode iterations can be read off its timestamps."""

from __future__ import annotations

import math

import numpy as np
import pytest

from policies.static import StaticPolicy
from sim.profile import Profile, RequestAcceptance, shifted_acceptance
from sim.simulator import SimConfig, Simulator

from .conftest import handmade_profile, make_workload, single_tier_slo

THRESHOLD = 0.5
K = 4  # the hand-made profile's default k


def _with_variation(concentration: float | None) -> Profile:
    profile = handmade_profile()
    if concentration is None:
        return profile
    return profile.model_copy(update={"request_acceptance": RequestAcceptance(concentration=concentration)})


def _run(concentration: float | None, seed: int = 4) -> tuple[Simulator, np.ndarray, np.ndarray]:
    """~500 requests of 400 tokens at batch 1: per completed request, measured tokens per decode
    iteration after its first one, and the request's odds multiplier (1 without variation)."""
    profile = _with_variation(concentration)
    slo = single_tier_slo(max_threshold=4.0)
    workload = make_workload(duration_s=700.0, arrivals={"kind": "poisson", "rate": 0.7},
                             output_tokens={"kind": "fixed", "value": 400})
    sim = Simulator(SimConfig(replicas=12, max_batch=1, seed=seed), profile, slo, workload,
                    StaticPolicy(slo, THRESHOLD))
    result = sim.run()
    rec = result.records
    done = np.flatnonzero(~np.isnan(rec["completion_s"]))
    step_s = float(profile.latency.iteration_ms(1, K)) / 1000.0
    # Batch 1, fixed step: the iterations after the first = (completion − first token) / step.
    iterations = np.round((rec["completion_s"][done] - rec["first_token_s"][done]) / step_s)
    # Tokens after the first iteration: all but the first iteration's 1..k+1 (its mean, ~3; the
    # same small bias for every request, which the comparisons below cancel).
    tokens_per_iter = (rec["output_tokens"][done] - 3.0) / iterations
    odds = sim.table.acceptance_odds
    return sim, tokens_per_iter, (odds[done] if odds is not None else np.ones(done.size))


def _expected_tokens(profile: Profile, odds: np.ndarray) -> np.ndarray:
    """Per request: 1 + Σ_i Π_{j<=i} α_r,j with α_r the profile's acceptance shifted by its odds
    (and the centring that keeps the step-pooled mean)."""
    alpha = profile.position_accept("kl", THRESHOLD, K)
    centring = profile.request_odds_centring("kl", THRESHOLD, K)
    accept = shifted_acceptance(alpha[None, :], odds[:, None] * centring)
    return np.asarray(1.0 + np.cumprod(accept, axis=1).sum(axis=1), dtype=float)


def test_shifted_acceptance_is_the_profile_at_odds_one_and_keeps_the_bounds() -> None:
    alpha = np.array([0.0, 0.2, 0.5, 0.9, 1.0])
    assert np.allclose(shifted_acceptance(alpha, 1.0), alpha)
    easy, hard = shifted_acceptance(alpha, 3.0), shifted_acceptance(alpha, 1 / 3)
    assert easy[0] == hard[0] == 0.0 and easy[-1] == hard[-1] == 1.0
    assert np.all(easy[1:-1] > alpha[1:-1]) and np.all(hard[1:-1] < alpha[1:-1])
    assert easy[2] == pytest.approx(0.75)  # odds 1 → 3


def test_request_draws_are_beta_around_one_half() -> None:
    """At α = 0.5 a request's acceptance is a ~ Beta(κ/2, κ/2): mean 0.5, sd 1/(2·sqrt(κ+1))."""
    kappa = 6.0
    odds = RequestAcceptance(concentration=kappa).draw_odds_scales(np.random.default_rng(0), 20_000)
    a = shifted_acceptance(np.array(0.5), odds)
    sd = 1.0 / (2.0 * math.sqrt(kappa + 1.0))
    assert abs(float(a.mean()) - 0.5) < 3 * sd / math.sqrt(a.size)
    assert float(a.std()) == pytest.approx(sd, rel=0.03)
    with pytest.raises(ValueError, match="concentration"):
        RequestAcceptance(concentration=0.0)


def test_requests_run_at_their_own_acceptance() -> None:
    """With variation, each request's measured tokens per iteration follow its own expectation: the
    spread across requests is much wider than without variation, and what is left after subtracting
    each request's expectation is the same sampling noise as without variation."""
    sim_off, measured_off, _ = _run(None)
    sim_on, measured_on, odds = _run(4.0)
    profile = sim_on.profile
    expected_on = _expected_tokens(profile, odds)
    expected_off = profile.expected_tokens_per_iter("kl", THRESHOLD, K)
    assert measured_off.size > 400 and measured_on.size > 400

    noise_off = measured_off - expected_off
    noise_on = measured_on - expected_on
    # Without variation the spread is sampling noise alone; with it, requests differ for real.
    assert measured_on.std() > 2.0 * measured_off.std()
    assert np.corrcoef(measured_on, expected_on)[0, 1] > 0.9
    # The residual is the same noise (its sd within 20 %) and carries the same small bias (3 s.e.).
    assert noise_on.std() == pytest.approx(noise_off.std(), rel=0.2)
    se = math.hypot(noise_on.std() / math.sqrt(noise_on.size), noise_off.std() / math.sqrt(noise_off.size))
    assert abs(float(noise_on.mean() - noise_off.mean())) < 3 * se


def test_step_pooled_acceptance_stays_the_profiles() -> None:
    """The centring keeps what calibration measures — tokens per step pooled over steps — at the
    profile's, in the windows' telemetry (as the no-variation test in test_simulator.py) and in the
    requests' own tokens and steps; the per-request average rises (easy requests take fewer steps)."""
    profile = _with_variation(3.0)
    slo = single_tier_slo(max_threshold=4.0)
    workload = make_workload(duration_s=600.0, arrivals={"kind": "poisson", "rate": 0.3},
                             output_tokens={"kind": "fixed", "value": 600})
    for threshold in (0.0, 1.0):
        sim = Simulator(SimConfig(replicas=2, seed=2), profile, slo, workload, StaticPolicy(slo, threshold))
        res = sim.run()
        acc = np.asarray(res.timeseries["acceptance_rate"])
        expected = profile.expected_acceptance_rate("kl", threshold, K)
        # Clipping at a sequence's last iteration biases this down by < 2 % at 600 tokens.
        assert float(acc[~np.isnan(acc)].mean()) == pytest.approx(expected, rel=0.03), threshold

    _, measured_off, _ = _run(None)
    sim_on, measured_on, odds = _run(4.0)
    steps_off, steps_on = 397.0 / measured_off, 397.0 / measured_on  # equal lengths: pooled = harmonic
    pooled_off, pooled_on = 397.0 / steps_off.mean(), 397.0 / steps_on.mean()
    se = pooled_on * steps_on.std() / steps_on.mean() / math.sqrt(steps_on.size)
    assert abs(pooled_on - pooled_off) < 3 * math.hypot(se, pooled_off * steps_off.std() / steps_off.mean()
                                                         / math.sqrt(steps_off.size))
    # The per-request average is not what is kept: it sits ~5 % above the pooled mean at κ = 4.
    assert measured_on.mean() > 1.03 * pooled_on


def test_variation_off_leaves_runs_unchanged_and_on_is_seeded() -> None:
    """No variation ⇒ no per-request draws (the table has none); the same seed ⇒ the same draws and
    the same run; another seed ⇒ other draws."""
    sim_off, _, _ = _run(None, seed=1)
    assert sim_off.table.acceptance_odds is None
    a, measured_a, odds_a = _run(4.0, seed=1)
    _, measured_b, odds_b = _run(4.0, seed=1)
    _, _, odds_c = _run(4.0, seed=2)
    assert np.array_equal(odds_a, odds_b) and np.array_equal(measured_a, measured_b)
    assert not np.array_equal(odds_a[:50], odds_c[:50])


@pytest.mark.parametrize("kappa", [2.0, 8.0])
def test_fit_recovers_the_concentration(kappa: float) -> None:
    """Method of moments on per-request counts drawn from the model (600 requests, 40–120 drafts each,
    pooled rate 0.7): κ back within 25 %; requests that differ by sampling noise alone fit no variation."""
    from sim.profile_fit import fit_request_acceptance

    rng = np.random.default_rng(11)
    n = 600
    drafted = rng.integers(40, 121, size=n)
    odds = RequestAcceptance(concentration=kappa).draw_odds_scales(rng, n)
    accepted = rng.binomial(drafted, shifted_acceptance(np.array(0.7), odds))
    fitted = fit_request_acceptance(accepted, drafted)
    assert fitted is not None and fitted.concentration == pytest.approx(kappa, rel=0.25)

    plain = rng.binomial(drafted, 0.7)
    fitted_plain = fit_request_acceptance(plain, drafted)
    assert fitted_plain is None or fitted_plain.concentration > 50.0
    with pytest.raises(ValueError, match="accepted <= drafted"):
        fit_request_acceptance([5, 3, 9], [4, 4, 4])


def test_fit_about_expected_rates_removes_the_operating_points() -> None:
    """Requests at different operating points (model rates 0.2–0.9, as on a live service where the policy
    moves T): compared with each one's expected rate the fit finds the drawn κ within 25 %; pooled as one
    group it reads the spread of the operating points as per-request spread (κ a quarter smaller or more)."""
    from sim.profile_fit import fit_request_acceptance

    rng = np.random.default_rng(29)
    n, kappa = 600, 6.0
    drafted = rng.integers(40, 121, size=n)
    base = rng.uniform(0.2, 0.9, size=n)
    odds = RequestAcceptance(concentration=kappa).draw_odds_scales(rng, n)
    accepted = rng.binomial(drafted, shifted_acceptance(base, odds))
    fitted = fit_request_acceptance(accepted, drafted, expected=base)
    assert fitted is not None and fitted.concentration == pytest.approx(kappa, rel=0.25)
    assert "expected rates over 600 requests of 600" in fitted.source
    pooled = fit_request_acceptance(accepted, drafted)
    assert pooled is not None and pooled.concentration < 0.75 * fitted.concentration
    # A common level error (the model 0.5 logit off for every request) is the offset, not spread.
    shifted_base = shifted_acceptance(base, np.exp(0.5))
    off = fit_request_acceptance(accepted, drafted, expected=shifted_base)
    assert off is not None and off.concentration == pytest.approx(fitted.concentration, rel=0.15)


def test_fit_about_expected_rates_leaves_out_saturated_requests_and_refuses_bad_input() -> None:
    from sim.profile_fit import fit_request_acceptance

    drafted = np.full(6, 50)
    accepted = np.array([25, 30, 20, 49, 50, 50])
    expected = np.array([0.5, 0.5, 0.5, 0.99, 0.995, 1.0])  # a model may saturate at exactly 1
    fitted = fit_request_acceptance(accepted, drafted, expected=expected)
    assert fitted is None or "over 3 requests of 6" in fitted.source
    with pytest.raises(ValueError, match="groups or expected"):
        fit_request_acceptance(accepted, drafted, groups=[0, 0, 0, 1, 1, 1], expected=expected)
    with pytest.raises(ValueError, match=r"\[0, 1\], got 1.2"):
        fit_request_acceptance(accepted, drafted, expected=[0.5, 0.5, 0.5, 0.9, 0.9, 1.2])
    with pytest.raises(ValueError, match=r"\[0, 1\], got nan"):
        fit_request_acceptance(accepted, drafted, expected=[0.5, 0.5, 0.5, 0.9, 0.9, float("nan")])
    with pytest.raises(ValueError, match="shape"):
        fit_request_acceptance(accepted, drafted, expected=[0.5, 0.5])


def test_tokens_at_a_request_quantile_keep_the_pooled_mean_and_match_the_simulated_requests() -> None:
    """What the operating model carries (``Profile.tokens_per_iter_at_request_quantile``, ``to_operating_model``):
    over the quantiles' mid-points the requests' tokens per step pool (harmonically) to the profile's own; the
    simulated requests' 5 % and 50 % quantiles of tokens per step are the model's at 0.05 and 0.5."""
    profile = _with_variation(4.0)
    nodes = (np.arange(400) + 0.5) / 400
    tokens = np.array([profile.tokens_per_iter_at_request_quantile("kl", THRESHOLD, K, q) for q in nodes])
    assert (np.diff(tokens) >= 0).all()
    pooled = 1.0 / float(np.mean(1.0 / tokens))
    assert pooled == pytest.approx(profile.expected_tokens_per_iter("kl", THRESHOLD, K), rel=2e-3)
    _, measured, _ = _run(4.0)
    for q in (0.05, 0.5):
        model = profile.tokens_per_iter_at_request_quantile("kl", THRESHOLD, K, q)
        assert float(np.quantile(measured, q)) == pytest.approx(model, rel=0.05), q
    # Without variation (or at k = 0) every request is the mean one.
    plain = _with_variation(None)
    assert plain.tokens_per_iter_at_request_quantile("kl", THRESHOLD, K, 0.05) == plain.expected_tokens_per_iter(
        "kl", THRESHOLD, K)
    model = profile.to_operating_model()
    assert model.request_quantiles and all(p.tokens_per_step_by_quantile for p in model.points)
    assert not plain.to_operating_model().request_quantiles
