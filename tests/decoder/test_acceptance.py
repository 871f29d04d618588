"""Tests for decoder/acceptance.py: divergences, FSD verify rules, exactness (statistically), distortion."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from scipy.spatial.distance import jensenshannon
from scipy.special import rel_entr
from scipy.stats import chisquare

from decoder.acceptance import (
    DIVERGENCES,
    RULES,
    VerifyResult,
    _verify_block_from_uniforms,
    _verify_block_reference,
    divergence,
    verify_block,
)
from decoder.sampling import draw_uniforms, sample, sample_from_uniforms

ALPHA = 1e-3  # significance level of the goodness-of-fit tests (seeds are fixed, so results are deterministic)
POWER_ALPHA = 1e-6  # a wrong distribution must be rejected far more strongly than that
DRAWS = 120_000
# A distortion is a float32 sum of probability terms of size up to 1, so its rounding error is a few ulp of 1
# (float32 eps = 1.2e-7), whatever the value; the summation order, and so the last bit, depends on the CPU's
# vector width (the CI machine differed from the double-precision reference by 1.1e-7 where this one matched).
DISTORTION_ATOL = 1e-6


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # On a shared, busy CPU OpenMP's spinning threads make these small tensor ops many times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------------------
# builders


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_dists(shape: tuple[int, ...], seed: int, zero_frac: float = 0.0, sharpness: float = 2.0) -> torch.Tensor:
    """Random distributions over the last dim, with about `zero_frac` exact zeros (never a whole row)."""
    g = gen(seed)
    logits = torch.randn(shape, generator=g) * sharpness
    if zero_frac > 0:
        mask = torch.rand(shape, generator=g) < zero_frac
        mask[..., 0] = False
        logits = logits.masked_fill(mask, -torch.inf)
    return torch.softmax(logits, dim=-1)


def repeat_rows(dist: torch.Tensor, n: int) -> torch.Tensor:  # [k, V] -> [n, k, V]
    return dist.unsqueeze(0).expand(n, *dist.shape).contiguous()


def counts(tokens: torch.Tensor, vocab: int) -> np.ndarray:
    return torch.bincount(tokens.flatten(), minlength=vocab).numpy().astype(np.float64)


def gof_pvalue(tokens: torch.Tensor, dist: torch.Tensor) -> float:
    """Chi-square goodness of fit of `tokens` to `dist`; zero-probability categories must be empty."""
    observed = counts(tokens, dist.numel())
    expected_p = dist.double().numpy()
    support = expected_p > 0
    assert observed[~support].sum() == 0, f"tokens outside the support: {observed[~support]}"
    expected = expected_p[support] / expected_p[support].sum() * observed.sum()
    return float(chisquare(observed[support], expected).pvalue)


def assert_follows(tokens: torch.Tensor, dist: torch.Tensor, what: str) -> None:
    pvalue = gof_pvalue(tokens, dist)
    assert pvalue > ALPHA, f"{what}: emitted tokens do not follow the predicted distribution (p={pvalue:.2e})"


def assert_not_follows(tokens: torch.Tensor, dist: torch.Tensor, what: str) -> None:
    observed = counts(tokens, dist.numel())
    expected_p = dist.double().numpy()
    if observed[expected_p == 0].sum() > 0:
        return  # mass outside the support: certainly not this distribution
    pvalue = gof_pvalue(tokens, dist)
    assert pvalue < POWER_ALPHA, f"{what}: the test failed to tell distributions apart (p={pvalue:.2e})"


def emitted_at(result: VerifyResult, draft_tokens: torch.Tensor, position: int) -> torch.Tensor:
    """Token emitted at block `position` for the rows that reach it (num_accepted >= position)."""
    reached = result.num_accepted >= position
    k = draft_tokens.shape[1]
    if position < k:
        token = torch.where(result.num_accepted > position, draft_tokens[:, position], result.next_token)
    else:
        token = result.next_token
    return token[reached]


# Fixed V = 6 pair: p = target, q = draft, both with full support so KL is finite.
P0 = torch.tensor([0.35, 0.25, 0.15, 0.10, 0.10, 0.05])
Q0 = torch.tensor([0.15, 0.20, 0.25, 0.15, 0.15, 0.10])
P_BONUS = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.25, 0.25])


def kl_q_p(p: torch.Tensor, q: torch.Tensor) -> float:
    return float(rel_entr(q.double().numpy(), p.double().numpy()).sum())


# ---------------------------------------------------------------------------------------------------------
# divergences


@pytest.mark.parametrize("zero_frac", [0.0, 0.3])
def test_kl_and_reverse_kl_equal_scipy_rel_entr(zero_frac: float) -> None:
    p = random_dists((64, 50), seed=1, zero_frac=zero_frac)
    q = random_dists((64, 50), seed=2, zero_frac=zero_frac)
    kl = divergence(p, q, "kl")
    rkl = divergence(p, q, "reverse_kl")
    expected_kl = rel_entr(q.double().numpy(), p.double().numpy()).sum(-1)  # KL(q‖p)
    expected_rkl = rel_entr(p.double().numpy(), q.double().numpy()).sum(-1)  # KL(p‖q)
    assert kl.shape == (64,) and kl.dtype == torch.float32
    np.testing.assert_allclose(kl.numpy(), expected_kl, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(rkl.numpy(), expected_rkl, rtol=1e-4, atol=1e-6)
    if zero_frac:
        assert np.isinf(expected_kl).any(), "the zero pattern should produce some infinite KL"
    assert not torch.isnan(kl).any() and not torch.isnan(rkl).any()


@pytest.mark.parametrize("zero_frac", [0.0, 0.3])
def test_js_equals_scipy_jensenshannon_squared_in_nats(zero_frac: float) -> None:
    p = random_dists((64, 50), seed=3, zero_frac=zero_frac)
    q = random_dists((64, 50), seed=4, zero_frac=zero_frac)
    js = divergence(p, q, "js")
    expected = jensenshannon(p.double().numpy(), q.double().numpy(), axis=-1) ** 2  # base=None: nats
    np.testing.assert_allclose(js.numpy(), expected, rtol=1e-4, atol=1e-6)
    assert float(js.max()) <= math.log(2) and float(js.min()) >= 0


def test_js_of_disjoint_supports_is_ln2() -> None:
    p = torch.tensor([0.5, 0.5, 0.0, 0.0])
    q = torch.tensor([0.0, 0.0, 0.3, 0.7])
    assert divergence(p, q, "js").item() == pytest.approx(math.log(2), abs=1e-6)


def test_tv_and_draft_tokens_by_hand() -> None:
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.3, 0.2, 0.4], [0.25, 0.25, 0.25, 0.25]])
    assert divergence(p, q, "tv").tolist() == pytest.approx([0.4, 0.0], abs=DISTORTION_ATOL)
    x = torch.tensor([0, 3])
    assert divergence(p, q, "draft_tokens", x).tolist() == pytest.approx([0.4, 0.0], abs=DISTORTION_ATOL)
    x = torch.tensor([3, 1])
    assert divergence(p, q, "draft_tokens", x).tolist() == pytest.approx([0.4, 0.0], abs=DISTORTION_ATOL)


def test_kl_is_inf_not_nan_where_draft_has_mass_the_target_lacks() -> None:
    p = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.5, 0.5, 0.0]])
    q = torch.tensor([[0.9, 0.1, 0.0], [0.5, 0.5, 0.0], [0.0, 1.0, 0.0]])
    kl = divergence(p, q, "kl")
    assert math.isinf(kl[0].item()) and kl[0].item() > 0
    assert kl[1].item() == 0.0
    assert kl[2].item() == pytest.approx(math.log(2.0), abs=1e-6)
    # reverse: p has mass where q has none in row 2
    assert math.isinf(divergence(p, q, "reverse_kl")[2].item())
    for kind in DIVERGENCES:
        d = divergence(p, q, kind, torch.tensor([0, 1, 1]))
        assert not torch.isnan(d).any(), kind
        assert (d >= 0).all(), kind


def test_identical_distributions_have_zero_divergence_exactly() -> None:
    p = random_dists((16, 100), seed=5, zero_frac=0.2)
    x = sample(p, gen(0))
    for kind in DIVERGENCES:
        assert (divergence(p, p.clone(), kind, x) == 0).all(), kind


def test_bf16_inputs_are_upcast_and_never_nan() -> None:
    # truncated (top-k/top-p style zeros) and coarsely rounded: rows no longer sum to exactly 1
    p = random_dists((8, 3, 200), seed=6, zero_frac=0.3, sharpness=6.0).bfloat16()
    q = random_dists((8, 3, 200), seed=7, zero_frac=0.3, sharpness=6.0).bfloat16()
    x = sample(q.float(), gen(1))
    assert (p == 0).any()
    for kind in DIVERGENCES:
        d = divergence(p, q, kind, x)
        assert d.dtype == torch.float32 and d.shape == (8, 3), kind
        assert not torch.isnan(d).any(), kind
        torch.testing.assert_close(d, divergence(p.float(), q.float(), kind, x), rtol=0, atol=0)


def test_divergence_rejects_unknown_kind_and_missing_token() -> None:
    p = torch.full((2, 4), 0.25)
    with pytest.raises(ValueError, match="'hellinger'"):
        divergence(p, p, "hellinger")
    with pytest.raises(ValueError, match="draft_token"):
        divergence(p, p, "draft_tokens")
    with pytest.raises(ValueError, match="shape"):
        divergence(p, p[:1], "kl")


# ---------------------------------------------------------------------------------------------------------
# exactness of one position (k = 1), statistically


def run_single_position(
    p0: torch.Tensor, q0: torch.Tensor, threshold: float, rule: str, div: str = "kl", seed: int = 0
) -> tuple[VerifyResult, torch.Tensor]:
    """DRAWS identical rows of a k = 1 block; returns the result and the first emitted token per row."""
    target = torch.stack([p0, P_BONUS]).unsqueeze(0).expand(DRAWS, 2, p0.numel())
    draft = q0.view(1, 1, -1).expand(DRAWS, 1, q0.numel())
    g = gen(seed)
    drafts = sample(draft, g)  # [DRAWS, 1]
    result = verify_block(target, draft, drafts, threshold, div=div, rule=rule, generator=g)
    return result, emitted_at(result, drafts, 0)


@pytest.mark.parametrize("rule", RULES)
def test_zero_threshold_emits_exactly_target_distribution(rule: str) -> None:
    result, first = run_single_position(P0, Q0, 0.0, rule, seed=11)
    assert_follows(first, P0, f"{rule}, T=0")
    assert not result.fuzzy_accepted.any()
    assert (result.distortion == 0).all()
    if rule == "pure":
        assert (result.num_accepted == 0).all(), "pure at T=0 accepts nothing"
    else:
        # standard SD acceptance rate is sum(min(p, q))
        rate = result.num_accepted.double().mean().item()
        assert rate == pytest.approx(float(torch.minimum(P0, Q0).sum()), abs=0.005)


@pytest.mark.parametrize("rule", RULES)
def test_fuzzy_position_emits_draft_distribution(rule: str) -> None:
    d = kl_q_p(P0, Q0)
    result, first = run_single_position(P0, Q0, d + 0.05, rule, seed=12)  # D <= T: fuzzy branch active
    assert_follows(first, Q0, f"{rule}, D <= T")
    assert_not_follows(first, P0, f"{rule}, D <= T vs target")  # power: the test can fail
    assert (result.num_accepted == 1).all(), "a fuzzy-active position is always accepted"
    tv = 0.5 * float((P0 - Q0).abs().sum())
    torch.testing.assert_close(result.distortion, torch.full((DRAWS, 1), tv), rtol=1e-6, atol=DISTORTION_ATOL)
    # fuzzy_accepted marks exactly the rows the standard test would have rejected
    if rule == "reducible":
        reject_rate = 1 - float(torch.minimum(P0, Q0).sum())
        assert result.fuzzy_accepted.double().mean().item() == pytest.approx(reject_rate, abs=0.005)


@pytest.mark.parametrize("rule", RULES)
def test_non_fuzzy_position_with_positive_threshold_emits_target_distribution(rule: str) -> None:
    d = kl_q_p(P0, Q0)
    result, first = run_single_position(P0, Q0, d / 2, rule, seed=13)  # D > T
    assert_follows(first, P0, f"{rule}, D > T")
    assert_not_follows(first, Q0, f"{rule}, D > T vs draft")
    assert not result.fuzzy_accepted.any()
    assert (result.distortion == 0).all()


@pytest.mark.parametrize("div", DIVERGENCES)
def test_every_divergence_switches_between_target_and_draft_at_its_own_value(div: str) -> None:
    # draft_tokens: D varies with the drafted token, so cover the largest
    d = float((P0 - Q0).abs().max()) if div == "draft_tokens" else float(divergence(P0, Q0, div))
    _, first = run_single_position(P0, Q0, d * 1.01 + 1e-6, "reducible", div=div, seed=14)
    assert_follows(first, Q0, f"{div}, D <= T")


def test_draft_tokens_divergence_gives_token_dependent_mix() -> None:
    # D(x) = |p(x) - q(x)| = [.2, .05, .1, .05, .05, .05]; with T = 0.07 tokens 1, 3, 4, 5 are fuzzy-accepted.
    # Emitted law: a fuzzy token x is emitted with prob q(x) (always accepted when drafted); for the rest
    # the standard test runs, and the residual is sampled when it rejects. Closed form:
    t = 0.07
    fuzzy_tokens = (P0 - Q0).abs() <= t
    accept_std = torch.minimum(P0, Q0)  # P(draft x and standard-accept)
    accepted_mass = torch.where(fuzzy_tokens, Q0, accept_std)
    reject_prob = 1 - float(accepted_mass.sum())
    residual = (P0 - Q0).clamp_min(0)
    expected = accepted_mass + reject_prob * residual / residual.sum()
    _, first = run_single_position(P0, Q0, t, "reducible", div="draft_tokens", seed=15)
    assert_follows(first, expected, "draft_tokens mix")
    assert_not_follows(first, P0, "draft_tokens mix vs target")


def test_zero_threshold_with_zero_divergence_ties_stays_exact() -> None:
    # Regression: D == 0 (identical rows) must not trigger the fuzzy branch at T = 0 — for `pure` that would
    # accept every draft; with the guard it accepts none and emits from p.
    result, first = run_single_position(P0, P0.clone(), 0.0, "pure", seed=16)
    assert float(divergence(P0, P0.clone(), "kl")) == 0.0
    assert torch.isnan(result.divergence).all(), "no divergence is computed where every row has T = 0"
    assert (result.num_accepted == 0).all()
    assert_follows(first, P0, "pure, T=0, D=0")
    result, first = run_single_position(P0, P0.clone(), 0.0, "reducible", seed=17)
    assert (result.num_accepted == 1).all() and not result.fuzzy_accepted.any()


def test_rejection_with_empty_residual_falls_back_to_target() -> None:
    # An unnormalised draft row (q(x) = 0.9 > p(x) = 0.5 and q >= p everywhere) leaves max(0, p - q) all
    # zero at a rejection; the recovered token must then come from p, never NaN or a zero-mass token.
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
    q = torch.tensor([[[0.9, 0.5, 0.0]]])
    x = torch.tensor([[0]])
    uniforms = torch.tensor([[0.99, 0.5]])  # 0.99 * 0.9 >= 0.5: rejected; then inverse CDF of p at 0.5
    for rule in RULES:
        result = _verify_block_from_uniforms(
            p, q, x, torch.tensor([0.0]), torch.tensor([False]), "kl", rule, uniforms
        )
        assert result.num_accepted.item() == 0
        assert result.next_token.item() == 1, rule


# ---------------------------------------------------------------------------------------------------------
# bug 1 (draft_tokens distortion): the charged distortion is the exact TV of the emitted law, every div × rule

# The two reproductions for draft_tokens (T = 0.1; D(x) = |p(x) - q(x)| makes the law a per-token mix).
DRAFT_TOKEN_CASES = [
    (torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.3, 0.3, 0.4]), {"reducible": 0.0, "pure": 0.21}),
    (torch.tensor([0.7, 0.1, 0.2]), torch.tensor([0.3, 0.2, 0.5]), {"reducible": 0.1, "pure": 0.18}),
]
TV_TOLERANCE = 0.006  # empirical TV over 120k draws and V <= 6: sampling noise ~0.002 (and biased upward)


def empirical_tv(tokens: torch.Tensor, p: torch.Tensor) -> float:
    freq = counts(tokens, p.numel()) / tokens.numel()
    return 0.5 * float(np.abs(freq - p.double().numpy()).sum())


def emitted_law_closed_form(p: torch.Tensor, q: torch.Tensor, fuzzy: torch.Tensor, rule: str) -> torch.Tensor:
    """Law of the token emitted at one position with per-token fuzzy set ``fuzzy`` (written independently)."""
    p, q = p.double(), q.double()
    if rule == "reducible":
        accepted_mass = torch.where(fuzzy, q, torch.minimum(p, q))
        residual = (p - q).clamp_min(0)
        return accepted_mass + (1 - accepted_mass.sum()) * residual / residual.sum()
    accepted_mass = torch.where(fuzzy, q, 0.0)
    return accepted_mass + (1 - accepted_mass.sum()) * p


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("case", [0, 1])
def test_draft_tokens_distortion_is_the_exact_tv_of_the_emitted_law(rule: str, case: int) -> None:
    p0, q0, expected_tv = DRAFT_TOKEN_CASES[case]
    t = 0.1001  # 0.1 plus a margin against float rounding of |p - q| = 0.1
    target = torch.stack([p0, p0]).unsqueeze(0).expand(DRAWS, 2, 3)
    draft = q0.view(1, 1, 3).expand(DRAWS, 1, 3)
    g = gen(300 + case + 2 * RULES.index(rule))
    drafts = sample(draft, g)
    result = verify_block(target, draft, drafts, t, div="draft_tokens", rule=rule, generator=g)
    first = emitted_at(result, drafts, 0)
    law = emitted_law_closed_form(p0, q0, (p0 - q0).abs() <= t, rule)
    assert_follows(first, law, f"draft_tokens {rule} emitted law")
    charged = result.distortion[:, 0]
    assert torch.allclose(charged, charged[0].expand_as(charged)), "position 0 is always reached: one law, one charge"
    assert float(charged[0]) == pytest.approx(expected_tv[rule], abs=1e-6)
    assert float(charged[0]) == pytest.approx(0.5 * float((law - p0.double()).abs().sum()), abs=1e-6)
    assert abs(float(charged[0]) - empirical_tv(first, p0)) < TV_TOLERANCE
    # power: the old charge q(A)·TV(p, q) (A = the fuzzy tokens; 0.060 and 0.080 in the issue) is told apart
    fuzzy_set = (p0 - q0).abs() <= t
    old_charge = float(q0[fuzzy_set].sum()) * 0.5 * float((p0 - q0).abs().sum())
    assert abs(old_charge - empirical_tv(first, p0)) > 2 * TV_TOLERANCE


@pytest.mark.parametrize("div", DIVERGENCES)
@pytest.mark.parametrize("rule", RULES)
def test_charged_distortion_matches_empirical_tv_for_every_divergence_and_rule(div: str, rule: str) -> None:
    # A k = 2 block: position 0 is made fuzzy (draft_tokens: only some tokens), so the emitted first token
    # differs from p_0; the mean charge at position 0 must equal its empirical TV to p_0.
    p_block = torch.stack([P0, P_BONUS, P_BONUS])
    q_block = torch.stack([Q0, P_BONUS])
    # draft_tokens: D(x) = [.2, .05, .1, .05, .05, .05], T = 0.07 makes tokens 1, 3, 4, 5 fuzzy
    t = 0.07 if div == "draft_tokens" else float(divergence(P0, Q0, div)) * 1.01 + 1e-6
    g = gen(400 + DIVERGENCES.index(div) * 2 + RULES.index(rule))
    target = repeat_rows(p_block, DRAWS)
    draft = repeat_rows(q_block, DRAWS)
    drafts = sample(draft, g)
    result = verify_block(target, draft, drafts, t, div=div, rule=rule, generator=g)
    first = emitted_at(result, drafts, 0)
    mean_charge = float(result.distortion[:, 0].double().mean())
    observed = empirical_tv(first, P0)
    assert abs(mean_charge - observed) < TV_TOLERANCE, (div, rule, mean_charge, observed)
    assert mean_charge > 5 * TV_TOLERANCE, "power: the fixture must make the emitted law differ from p"
    # position 1 has q = p: whatever is emitted there is exact, and nothing is charged
    assert float(result.distortion[:, 1].abs().max()) < 1e-6


@pytest.mark.parametrize("rule", RULES)
def test_divergence_is_measured_on_the_div_logits_and_acceptance_on_the_truncated_probs(rule: str) -> None:
    # Bug 3 (kl + top-k turned FSD off): truncated p drops tokens that the truncated q keeps, so KL(q‖p) on
    # them is +inf; measured on the untruncated (div) logits it is small and the fuzzy branch opens. What is
    # emitted is then the truncated q, and the charge is TV(p_trunc, q_trunc).
    full_p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10])
    full_q = torch.tensor([0.28, 0.20, 0.22, 0.10, 0.20])
    p_trunc = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.0]) / 0.90  # top-4
    q_trunc = torch.tensor([0.28, 0.20, 0.22, 0.0, 0.20]) / 0.90  # top-4
    assert math.isinf(float(divergence(p_trunc, q_trunc, "kl")))
    t = float(divergence(full_p, full_q, "kl")) * 1.5
    n = DRAWS // 2
    target = torch.stack([p_trunc, P_BONUS[:5] / P_BONUS[:5].sum()]).unsqueeze(0).expand(n, 2, 5)
    draft = q_trunc.view(1, 1, 5).expand(n, 1, 5)
    target_logits = full_p.log().view(1, 1, 5).expand(n, 1, 5)
    draft_logits = full_q.log().view(1, 1, 5).expand(n, 1, 5)
    g = gen(500 + RULES.index(rule))
    drafts = sample(draft, g)
    without = verify_block(target, draft, drafts, t, rule=rule, generator=gen(1))
    assert not without.fuzzy_accepted.any()
    result = verify_block(
        target, draft, drafts, t, rule=rule, generator=g, target_div_logits=target_logits, draft_div_logits=draft_logits
    )
    assert (result.num_accepted == 1).all() and result.fuzzy_accepted.any()
    first = emitted_at(result, drafts, 0)
    assert_follows(first, q_trunc, f"{rule}: fuzzy on div logits emits the truncated q")
    assert float(result.distortion[0, 0]) == pytest.approx(0.5 * float((p_trunc - q_trunc).abs().sum()), abs=1e-6)
    # T = 0 with div logits stays exact: p_trunc
    exact = verify_block(
        target, draft, drafts, 0.0, rule=rule, generator=gen(2), target_div_logits=target_logits, draft_div_logits=draft_logits
    )
    assert_follows(emitted_at(exact, drafts, 0), p_trunc, f"{rule}: T = 0 with div logits")


def test_ragged_draft_lengths_equal_single_row_blocks_of_their_own_length() -> None:
    b, k, v = 9, 4, 10
    p = random_dists((b, k + 1, v), seed=601)
    q = torch.softmax(torch.log(p[:, :k]) + 0.5 * torch.randn(b, k, v, generator=gen(602)), dim=-1)
    drafts = sample(q, gen(603))
    lengths = [0, 1, 2, 3, 4, 0, 2, 4, 1]
    thresholds = torch.tensor([0.0, 0.1, 0.3, 0.0, 0.2, 0.5, 0.0, 1.0, 0.05])
    greedy_rows = torch.tensor([i % 4 == 0 for i in range(b)])
    for div in ("kl", "draft_tokens"):
        batch = verify_block(
            p, q, drafts, thresholds, div=div, generator=[gen(700 + i) for i in range(b)], greedy=greedy_rows,
            draft_lengths=lengths,
        )
        for row, k_b in enumerate(lengths):
            if k_b == 0:  # plain decoding: one draw from p_0 (argmax for greedy rows)
                u = torch.rand(1, generator=gen(700 + row))
                expected = int(p[row, 0].argmax()) if greedy_rows[row] else int(sample_from_uniforms(p[row, 0], u[0]))
                assert int(batch.num_accepted[row]) == 0 and int(batch.next_token[row]) == expected, (div, row)
                assert float(batch.distortion[row].abs().sum()) == 0.0
                continue
            single = verify_block(
                p[row : row + 1, : k_b + 1], q[row : row + 1, :k_b], drafts[row : row + 1, :k_b], float(thresholds[row]),
                div=div, generator=[gen(700 + row)], greedy=bool(greedy_rows[row]),
            )
            assert int(batch.num_accepted[row]) == int(single.num_accepted[0]), (div, row)
            assert int(batch.next_token[row]) == int(single.next_token[0]), (div, row)
            torch.testing.assert_close(batch.distortion[row, :k_b], single.distortion[0], rtol=0, atol=0)
            assert not batch.fuzzy_accepted[row, k_b:].any() and float(batch.distortion[row, k_b:].abs().sum()) == 0


# ---------------------------------------------------------------------------------------------------------
# a whole k-block: first emitted token, every position's token, and the accepted-length law


P_BLOCK = torch.tensor(
    [
        [0.40, 0.30, 0.10, 0.10, 0.05, 0.05],
        [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
        [0.05, 0.05, 0.10, 0.20, 0.30, 0.30],
        [0.30, 0.00, 0.20, 0.20, 0.20, 0.10],  # bonus
    ]
)
Q_BLOCK = torch.tensor(
    [
        [0.10, 0.20, 0.30, 0.20, 0.10, 0.10],  # far from p: never fuzzy at the T used below
        [0.25, 0.15, 0.20, 0.20, 0.10, 0.10],  # close to p: fuzzy
        [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],  # far
    ]
)
K_BLOCK = 3


def block_closed_form(rule: str, fuzzy: list[bool]) -> tuple[np.ndarray, list[torch.Tensor]]:
    """Accepted-length law and the per-position emitted law for context-free p_i, q_i."""
    accept = []
    for i in range(K_BLOCK):
        if fuzzy[i]:
            accept.append(1.0)
        elif rule == "reducible":
            accept.append(float(torch.minimum(P_BLOCK[i], Q_BLOCK[i]).sum()))
        else:
            accept.append(0.0)
    length = np.zeros(K_BLOCK + 1)
    reach = 1.0
    for n in range(K_BLOCK):
        length[n] = reach * (1 - accept[n])
        reach *= accept[n]
    length[K_BLOCK] = reach
    per_position = [Q_BLOCK[i] if fuzzy[i] else P_BLOCK[i] for i in range(K_BLOCK)] + [P_BLOCK[K_BLOCK]]
    return length, per_position


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fuzzy_on", [False, True])
def test_block_lengths_and_emitted_tokens_match_closed_form(rule: str, fuzzy_on: bool) -> None:
    d = [kl_q_p(P_BLOCK[i], Q_BLOCK[i]) for i in range(K_BLOCK)]
    assert d[1] < 0.05 < min(d[0], d[2])
    threshold = 0.05 if fuzzy_on else 0.0
    fuzzy = [fuzzy_on and di <= threshold for di in d]
    n = DRAWS
    target = repeat_rows(P_BLOCK, n)
    draft = repeat_rows(Q_BLOCK, n)
    g = gen(21 + int(fuzzy_on) + 2 * RULES.index(rule))
    drafts = sample(draft, g)
    result = verify_block(target, draft, drafts, threshold, div="kl", rule=rule, generator=g)

    length_law, per_position = block_closed_form(rule, fuzzy)
    observed_len = counts(result.num_accepted, K_BLOCK + 1)
    support = length_law > 0
    assert observed_len[~support].sum() == 0, f"impossible lengths observed: {observed_len}"
    if support.sum() > 1:
        pvalue = chisquare(observed_len[support], length_law[support] * n).pvalue
        assert pvalue > ALPHA, f"accepted-length law differs from closed form (p={pvalue:.2e}): {observed_len}"

    assert_follows(emitted_at(result, drafts, 0), per_position[0], f"{rule} first token")
    for position in range(1, K_BLOCK + 1):
        tokens = emitted_at(result, drafts, position)
        if tokens.numel() >= 1000:
            assert_follows(tokens, per_position[position], f"{rule} token at position {position}")

    # distortion: TV at the fuzzy position when emitted, zero elsewhere
    tv1 = 0.5 * float((P_BLOCK[1] - Q_BLOCK[1]).abs().sum())
    expected_distortion = torch.zeros(n, K_BLOCK)
    if fuzzy[1]:
        expected_distortion[:, 1] = torch.where(result.num_accepted > 1, tv1, 0.0)
    torch.testing.assert_close(result.distortion, expected_distortion, rtol=1e-6, atol=DISTORTION_ATOL)


def test_block_power_check_first_token_is_not_target_when_fuzzy_at_position_zero() -> None:
    # Position 0 made fuzzy by a large threshold: the first token follows q_0, which a chi-square against p_0
    # must reject — the block-level test can fail.
    n = DRAWS // 2
    target = repeat_rows(P_BLOCK, n)
    draft = repeat_rows(Q_BLOCK, n)
    g = gen(31)
    drafts = sample(draft, g)
    result = verify_block(target, draft, drafts, 10.0, div="kl", rule="reducible", generator=g)
    assert (result.num_accepted == K_BLOCK).all()
    first = emitted_at(result, drafts, 0)
    assert_follows(first, Q_BLOCK[0], "T=10 first token")
    assert_not_follows(first, P_BLOCK[0], "T=10 first token vs target")


# ---------------------------------------------------------------------------------------------------------
# greedy rows


def test_greedy_zero_threshold_accepts_exactly_the_argmax_prefix() -> None:
    b, k, v = 200, 5, 9
    p = random_dists((b, k + 1, v), seed=41)
    q = random_dists((b, k, v), seed=42)
    argmax = p.argmax(-1)
    g = gen(43)
    # drafts agree with argmax p with probability 0.7 per position, otherwise a different token
    other = (argmax[:, :k] + torch.randint(1, v, (b, k), generator=g)) % v
    drafts = torch.where(torch.rand(b, k, generator=g) < 0.7, argmax[:, :k], other)
    result = verify_block(p, q, drafts, 0.0, greedy=True, generator=g)
    for row in range(b):
        expected_n = 0
        while expected_n < k and drafts[row, expected_n] == argmax[row, expected_n]:
            expected_n += 1
        assert result.num_accepted[row].item() == expected_n, f"row {row}"
        assert result.next_token[row].item() == argmax[row, expected_n].item(), f"row {row}"
    assert not result.fuzzy_accepted.any() and (result.distortion == 0).all()
    assert len({int(n) for n in result.num_accepted}) == k + 1, "the random drafts should cover all lengths"


@pytest.mark.parametrize("rule", RULES)
def test_greedy_fuzzy_accepts_mismatches_and_counts_them_as_distortion(rule: str) -> None:
    p = torch.tensor([[[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.1, 0.2, 0.7]]])
    q = torch.tensor([[[0.55, 0.35, 0.10], [0.45, 0.45, 0.10]]])  # KL(q‖p) small at both positions
    drafts = torch.tensor([[0, 1]])  # position 0 matches argmax, position 1 does not
    result = verify_block(p, q, drafts, 0.1, rule=rule, greedy=True)
    assert result.num_accepted.item() == 2
    assert result.next_token.item() == 2  # bonus = argmax p_2
    assert result.fuzzy_accepted.tolist() == [[False, True]]
    assert result.distortion.tolist() == [[0.0, 1.0]]
    assert result.emitted_tokens(drafts) == [[0, 1, 2]]
    # the same drafts with a threshold below D: the mismatch is rejected and replaced by argmax p_1
    result = verify_block(p, q, drafts, 1e-4, rule=rule, greedy=True)
    assert result.emitted_tokens(drafts) == [[0, 0]]
    assert (result.distortion == 0).all()


# ---------------------------------------------------------------------------------------------------------
# fast implementation == slow reference on the same uniforms


@pytest.mark.parametrize("div", DIVERGENCES)
@pytest.mark.parametrize("rule", RULES)
def test_fast_matches_reference_on_random_inputs(div: str, rule: str) -> None:
    b, k, v = 48, 4, 11
    seed = 100 + DIVERGENCES.index(div) * 2 + RULES.index(rule)
    p = random_dists((b, k + 1, v), seed=seed, zero_frac=0.25)
    q = random_dists((b, k, v), seed=seed + 50, zero_frac=0.25)
    # half the rows: draft close to target, so acceptances of every kind occur
    q[: b // 2] = torch.softmax(torch.log(p[: b // 2, :k] + 1e-3) + 0.3 * torch.randn(b // 2, k, v), dim=-1)
    g = gen(seed)
    drafts = sample(q, g)
    uniforms = draw_uniforms((b, k + 1), g, "cpu")
    d_scale = float(divergence(p[:, :k], q, div, drafts).clamp(max=5).median())
    thresholds = torch.rand(b, generator=g) * 2 * d_scale
    thresholds[::5] = 0.0
    greedy_rows = torch.rand(b, generator=g) < 0.3
    fast = _verify_block_from_uniforms(p, q, drafts, thresholds, greedy_rows, div, rule, uniforms)
    ref = _verify_block_reference(p, q, drafts, thresholds, greedy_rows, div, rule, uniforms)
    torch.testing.assert_close(fast.num_accepted, ref.num_accepted, rtol=0, atol=0)
    torch.testing.assert_close(fast.next_token, ref.next_token, rtol=0, atol=0)
    torch.testing.assert_close(fast.fuzzy_accepted, ref.fuzzy_accepted, rtol=0, atol=0)
    torch.testing.assert_close(fast.distortion, ref.distortion, rtol=1e-6, atol=DISTORTION_ATOL)
    computed = ~torch.isnan(fast.divergence)  # the fast path computes D only where it can matter
    assert computed.any()
    torch.testing.assert_close(fast.divergence[computed], ref.divergence[computed], rtol=1e-6, atol=DISTORTION_ATOL)
    # the case mix is not degenerate
    assert 0 < fast.num_accepted.sum() < b * k
    assert (fast.num_accepted == k).any() or rule == "pure"


@pytest.mark.parametrize("rule", RULES)
def test_fast_matches_reference_on_bf16_inputs(rule: str) -> None:
    b, k, v = 32, 3, 40
    p = random_dists((b, k + 1, v), seed=131, zero_frac=0.2).bfloat16()  # rows no longer sum to 1 exactly
    q = torch.softmax(torch.log(p[:, :k].float()) + 0.4 * torch.randn(b, k, v, generator=gen(132)), -1)  # same zeros
    q = q.bfloat16()
    g = gen(133)
    drafts = sample(q.float(), g)
    uniforms = draw_uniforms((b, k + 1), g, "cpu")
    thresholds = torch.tensor([0.0, 0.05, 0.3, 1.0]).repeat(b // 4)
    greedy_rows = torch.arange(b) % 3 == 0
    fast = _verify_block_from_uniforms(p, q, drafts, thresholds, greedy_rows, "kl", rule, uniforms)
    ref = _verify_block_reference(p, q, drafts, thresholds, greedy_rows, "kl", rule, uniforms)
    for field in ("num_accepted", "next_token", "fuzzy_accepted"):
        assert torch.equal(getattr(fast, field), getattr(ref, field)), field
    torch.testing.assert_close(fast.distortion, ref.distortion, rtol=1e-6, atol=DISTORTION_ATOL)
    assert not torch.isnan(ref.divergence).any() and (~torch.isnan(fast.divergence)).any()
    assert fast.fuzzy_accepted.any() and (fast.num_accepted > 0).any()


def test_verify_block_draws_k_plus_one_uniforms_per_row_from_the_generator() -> None:
    b, k, v = 16, 3, 8
    p = random_dists((b, k + 1, v), seed=51)
    q = random_dists((b, k, v), seed=52)
    drafts = sample(q, gen(53))
    public = verify_block(p, q, drafts, 0.3, div="js", generator=gen(54))
    uniforms = draw_uniforms((b, k + 1), gen(54), "cpu")
    internal = _verify_block_from_uniforms(
        p, q, drafts, torch.full((b,), 0.3), torch.zeros(b, dtype=torch.bool), "js", "reducible", uniforms
    )
    assert torch.equal(public.num_accepted, internal.num_accepted)
    assert torch.equal(public.next_token, internal.next_token)


# ---------------------------------------------------------------------------------------------------------
# batches: per-row thresholds, greedy flags and generators


def test_batch_rows_equal_single_row_calls_with_per_row_generators_thresholds_and_greedy() -> None:
    b, k, v = 12, 4, 10
    p = random_dists((b, k + 1, v), seed=61)
    q = torch.softmax(torch.log(p[:, :k]) + 0.5 * torch.randn(b, k, v, generator=gen(62)), dim=-1)
    drafts = sample(q, gen(63))
    thresholds = torch.tensor([0.0, 0.05, 0.2, 1.0, 0.0, 0.3, 0.0, 0.1, 2.0, 0.0, 0.5, 0.02])
    greedy_rows = torch.tensor([i % 3 == 0 for i in range(b)])
    seeds = [1000 + i for i in range(b)]
    for rule in RULES:
        batch = verify_block(
            p, q, drafts, thresholds, div="kl", rule=rule,
            generator=[gen(s) for s in seeds], greedy=greedy_rows,
        )
        for row in range(b):
            single = verify_block(
                p[row : row + 1], q[row : row + 1], drafts[row : row + 1], float(thresholds[row]),
                div="kl", rule=rule, generator=[gen(seeds[row])], greedy=bool(greedy_rows[row]),
            )
            for field in ("num_accepted", "next_token", "fuzzy_accepted", "distortion", "divergence"):
                torch.testing.assert_close(
                    getattr(batch, field)[row], getattr(single, field)[0], rtol=0, atol=0, equal_nan=True,
                    msg=f"{rule} row {row} {field}",
                )
        # rows at T = 0 never fuzzy-accept; greedy rows only record 0/1 distortion
        assert not batch.fuzzy_accepted[thresholds == 0].any()
        greedy_distortion = batch.distortion[greedy_rows]
        assert ((greedy_distortion == 0) | (greedy_distortion == 1)).all()


def test_per_row_threshold_changes_only_that_row() -> None:
    # Identical rows: T = 0 on even rows, T large on odd rows; odd rows accept everything, even rows follow SD.
    n = 20_000
    target = repeat_rows(P_BLOCK, n)
    draft = repeat_rows(Q_BLOCK, n)
    g = gen(71)
    drafts = sample(draft, g)
    thresholds = torch.tensor([0.0, 10.0]).repeat(n // 2)
    result = verify_block(target, draft, drafts, thresholds, rule="reducible", generator=g)
    assert (result.num_accepted[1::2] == K_BLOCK).all()
    assert not result.fuzzy_accepted[0::2].any()
    sd_rate = float(torch.minimum(P_BLOCK[0], Q_BLOCK[0]).sum())
    assert (result.num_accepted[0::2] > 0).double().mean().item() == pytest.approx(sd_rate, abs=0.015)


# ---------------------------------------------------------------------------------------------------------
# bad input


def small_block() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = random_dists((2, 3, 5), seed=81)
    q = random_dists((2, 2, 5), seed=82)
    return p, q, sample(q, gen(83))


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), -float("inf")])
def test_bad_threshold_is_a_value_error_naming_it(bad: float) -> None:
    p, q, x = small_block()
    with pytest.raises(ValueError, match="threshold") as info:
        verify_block(p, q, x, bad)
    assert repr(bad) in str(info.value)
    with pytest.raises(ValueError, match="threshold"):
        verify_block(p, q, x, torch.tensor([0.1, bad]))


def test_unknown_divergence_or_rule_is_a_value_error_naming_it() -> None:
    p, q, x = small_block()
    with pytest.raises(ValueError, match="'wasserstein'"):
        verify_block(p, q, x, 0.1, div="wasserstein")
    with pytest.raises(ValueError, match="'lenient'"):
        verify_block(p, q, x, 0.1, rule="lenient")


def test_shape_mismatches_are_value_errors() -> None:
    p, q, x = small_block()
    with pytest.raises(ValueError, match="target_probs"):
        verify_block(p[:, :2], q, x, 0.1)  # target needs k+1 positions
    with pytest.raises(ValueError, match="draft_tokens"):
        verify_block(p, q, x[:, :1], 0.1)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_block(p, q[0], x, 0.1)
    with pytest.raises(ValueError, match="k=0"):
        verify_block(p[:, :1], q[:, :0], x[:, :0], 0.1)
    with pytest.raises(ValueError, match="threshold"):
        verify_block(p, q, x, torch.tensor([0.1, 0.2, 0.3]))
    with pytest.raises(ValueError, match="greedy"):
        verify_block(p, q, x, 0.1, greedy=torch.tensor([True, False, True]))
    with pytest.raises(ValueError, match="generators"):
        verify_block(p, q, x, 0.1, generator=[gen(0)])
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        verify_block(p, q, torch.tensor([[0, 5], [1, 1]]), 0.1)
    with pytest.raises(ValueError, match="dtype"):
        verify_block(p, q, x.float(), 0.1)
