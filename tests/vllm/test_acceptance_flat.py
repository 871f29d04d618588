"""fsd_vllm/acceptance.py: FSD in vLLM's flat rejection-sampler layout, checked against the native engine's
acceptance (decoder/acceptance.py) on the same uniforms and, statistically, against closed forms."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.special import rel_entr
from scipy.stats import chisquare

from decoder import acceptance as native
from decoder.sampling import sample
from fsd_vllm.acceptance import (
    DIVERGENCES,
    PLACEHOLDER_TOKEN_ID,
    RULES,
    FlatRandomness,
    divergence,
    draw_randomness,
    fsd_rejection_sample_flat,
)

ALPHA = 1e-3  # goodness-of-fit significance (fixed seeds: deterministic outcomes)
POWER_ALPHA = 1e-6  # a wrong distribution must be rejected far more strongly than that
DRAWS = 60_000

P0 = torch.tensor([0.35, 0.25, 0.15, 0.10, 0.10, 0.05])
Q0 = torch.tensor([0.15, 0.20, 0.25, 0.15, 0.15, 0.10])
P_BONUS = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.25, 0.25])
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
        [0.10, 0.20, 0.30, 0.20, 0.10, 0.10],  # far from p
        [0.25, 0.15, 0.20, 0.20, 0.10, 0.10],  # close to p: fuzzy at T = 0.05 (kl)
        [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],  # far
    ]
)


# ---------------------------------------------------------------------------------------------------------
# builders


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_dists(shape: tuple[int, ...], seed: int, zero_frac: float = 0.0) -> torch.Tensor:
    g = gen(seed)
    logits = torch.randn(shape, generator=g) * 2.0
    if zero_frac > 0:
        mask = torch.rand(shape, generator=g) < zero_frac
        mask[..., 0] = False
        logits = logits.masked_fill(mask, -torch.inf)
    return torch.softmax(logits, dim=-1)


def cu(num_draft_tokens: list[int]) -> torch.Tensor:
    return torch.tensor(num_draft_tokens, dtype=torch.long).cumsum(0)


def verify_uniform_blocks(
    target: torch.Tensor,  # [B, k+1, V] (position k: bonus law)
    draft: torch.Tensor,  # [B, k, V]
    threshold: float | torch.Tensor,
    rule: str,
    seed: int,
    div: str = "kl",
    greedy: bool = False,
    ngram: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, object]:
    """B requests with k drafts each, drafted from `draft`, bonus drawn from target[:, k] (as vLLM's sampler
    does outside the rejection sampler). Returns (drafts [B, k], output [B, k+1], stats)."""
    b, k, v = draft.shape
    g = gen(seed)
    drafts = sample(draft, g)  # [B, k]
    bonus = (target[:, k].argmax(-1) if greedy else sample(target[:, k], g)).unsqueeze(1)  # [B, 1]
    num = [k] * b
    thresholds = torch.as_tensor(threshold, dtype=torch.float32).expand(b)
    randomness = FlatRandomness(uniforms=torch.rand(b * k, generator=g), recovery_noise=torch.empty(b, v).exponential_(generator=g))
    output, stats = fsd_rejection_sample_flat(
        drafts.reshape(-1), num, k, cu(num), None if ngram else draft.reshape(b * k, v).contiguous(),
        target[:, :k].reshape(b * k, v).contiguous(), bonus, torch.full((b,), greedy), thresholds,
        randomness, div=div, rule=rule,
    )
    return drafts, output, stats


def emitted_at(output: torch.Tensor, position: int) -> torch.Tensor:
    """Tokens emitted at block `position` by the requests that reach it."""
    column = output[:, position]
    return column[column != PLACEHOLDER_TOKEN_ID].long()


def counts(tokens: torch.Tensor, vocab: int) -> np.ndarray:
    return torch.bincount(tokens.flatten(), minlength=vocab).numpy().astype(np.float64)


def gof_pvalue(tokens: torch.Tensor, dist: torch.Tensor) -> float:
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
    pvalue = gof_pvalue(tokens, dist)
    assert pvalue < POWER_ALPHA, f"{what}: the test failed to tell distributions apart (p={pvalue:.2e})"


def kl_q_p(p: torch.Tensor, q: torch.Tensor) -> float:
    return float(rel_entr(q.double().numpy(), p.double().numpy()).sum())


def repeat_rows(dist: torch.Tensor, n: int) -> torch.Tensor:
    return dist.unsqueeze(0).expand(n, *dist.shape).contiguous()


# ---------------------------------------------------------------------------------------------------------
# the divergence copy agrees with decoder/acceptance.py


@pytest.mark.parametrize("div", DIVERGENCES)
@pytest.mark.parametrize("zero_frac", [0.0, 0.3])
def test_divergence_copy_equals_native(div: str, zero_frac: float) -> None:
    p = random_dists((64, 17), seed=1, zero_frac=zero_frac)
    q = random_dists((64, 17), seed=2, zero_frac=zero_frac)
    x = sample(q, gen(3))
    ours = divergence(p, q, div, x)
    theirs = native.divergence(p, q, div, x)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert DIVERGENCES == native.DIVERGENCES and RULES == native.RULES


# ---------------------------------------------------------------------------------------------------------
# same decisions as the native engine on the same uniforms (ragged batch)


@pytest.mark.parametrize("div", DIVERGENCES)
@pytest.mark.parametrize("rule", RULES)
def test_ragged_batch_matches_native_acceptance_on_the_same_uniforms(div: str, rule: str) -> None:
    max_k, v = 4, 11
    num = [4, 0, 1, 3, 4, 2, 0, 4, 3, 1, 4, 4] * 4
    b = len(num)
    seed = 200 + 2 * DIVERGENCES.index(div) + RULES.index(rule)
    g = gen(seed)
    p_rows = random_dists((b, max_k, v), seed=seed, zero_frac=0.2)
    q_rows = torch.softmax(torch.log(p_rows + 1e-3) + 0.5 * torch.randn(b, max_k, v, generator=g), dim=-1)
    q_rows[::3] = random_dists((len(range(0, b, 3)), max_k, v), seed=seed + 1)  # some far drafts
    drafts = sample(q_rows, g)  # [B, max_k]
    d_scale = float(native.divergence(p_rows, q_rows, div, drafts).clamp(max=5).median())
    thresholds = torch.rand(b, generator=g) * 2 * d_scale
    thresholds[::5] = 0.0
    greedy = torch.rand(b, generator=g) < 0.3
    bonus = torch.randint(0, v, (b, 1), generator=g)
    flat = [(r, i) for r in range(b) for i in range(num[r])]
    rows = torch.tensor([r for r, _ in flat])
    cols = torch.tensor([i for _, i in flat])
    randomness = draw_randomness(num, v, {}, torch.device("cpu"))
    output, stats = fsd_rejection_sample_flat(
        drafts[rows, cols], num, max_k, cu(num), q_rows[rows, cols].contiguous(),
        p_rows[rows, cols].contiguous(), bonus, greedy, thresholds, randomness, div=div, rule=rule,
    )
    assert output.shape == (b, max_k + 1) and output.dtype == torch.int32
    start = 0
    for r, n in enumerate(num):
        if n == 0:
            assert output[r].tolist() == [int(bonus[r])] + [PLACEHOLDER_TOKEN_ID] * max_k, f"request {r}"
            assert int(stats.num_accepted[r]) == 0 and int(stats.num_drafted[r]) == 0
            continue
        uniforms = torch.zeros(1, n + 1)
        uniforms[0, :n] = randomness.uniforms[start : start + n]
        target = torch.cat([p_rows[r, :n], p_rows[r, :1]]).unsqueeze(0)  # bonus law unused here
        ref = native._verify_block_from_uniforms(
            target, q_rows[r, :n].unsqueeze(0), drafts[r, :n].unsqueeze(0), thresholds[r : r + 1],
            greedy[r : r + 1], div, rule, uniforms,
        )
        accepted = int(ref.num_accepted[0])
        assert int(stats.num_accepted[r]) == accepted, f"request {r}"
        assert int(stats.num_drafted[r]) == n
        assert int(stats.num_fuzzy_accepted[r]) == int(ref.fuzzy_accepted.sum()), f"request {r}"
        torch.testing.assert_close(stats.distortion[r], ref.distortion.sum(), rtol=1e-6, atol=1e-6)
        row = output[r].tolist()
        assert row[:accepted] == drafts[r, :accepted].tolist(), f"request {r}: accepted prefix"
        assert row[accepted + 1 :] == [PLACEHOLDER_TOKEN_ID] * (max_k - accepted), f"request {r}: padding"
        if accepted == n:
            assert row[accepted] == int(bonus[r]), f"request {r}: bonus"
        elif bool(greedy[r]):
            assert row[accepted] == int(p_rows[r, accepted].argmax()), f"request {r}: greedy recovered"
        start += n
    assert 0 < int(stats.num_accepted.sum()) < sum(num)  # a non-degenerate mix


# ---------------------------------------------------------------------------------------------------------
# exactness and the fuzzy branch, statistically


@pytest.mark.parametrize("rule", RULES)
def test_zero_threshold_emits_exactly_the_target_distribution(rule: str) -> None:
    target = torch.stack([P0, P_BONUS]).unsqueeze(0).expand(DRAWS, 2, 6)
    draft = Q0.view(1, 1, 6).expand(DRAWS, 1, 6).contiguous()
    _, output, stats = verify_uniform_blocks(target, draft, 0.0, rule, seed=11)
    assert_follows(emitted_at(output, 0), P0, f"{rule}, T=0")
    assert_not_follows(emitted_at(output, 0), Q0, f"{rule}, T=0 vs draft")
    assert int(stats.num_fuzzy_accepted.sum()) == 0 and float(stats.distortion.sum()) == 0.0
    rate = stats.num_accepted.double().mean().item()
    expected_rate = float(torch.minimum(P0, Q0).sum()) if rule == "reducible" else 0.0
    assert rate == pytest.approx(expected_rate, abs=0.01)


@pytest.mark.parametrize("rule", RULES)
def test_fuzzy_position_emits_the_draft_distribution_and_charges_tv(rule: str) -> None:
    target = torch.stack([P0, P_BONUS]).unsqueeze(0).expand(DRAWS, 2, 6)
    draft = Q0.view(1, 1, 6).expand(DRAWS, 1, 6).contiguous()
    _, output, stats = verify_uniform_blocks(target, draft, kl_q_p(P0, Q0) + 0.05, rule, seed=12)
    first = emitted_at(output, 0)
    assert_follows(first, Q0, f"{rule}, D <= T")
    assert_not_follows(first, P0, f"{rule}, D <= T vs target")
    assert (stats.num_accepted == 1).all()
    tv = 0.5 * float((P0 - Q0).abs().sum())
    torch.testing.assert_close(stats.distortion, torch.full((DRAWS,), tv), rtol=1e-6, atol=1e-6)
    assert_follows(emitted_at(output, 1), P_BONUS, f"{rule}, bonus")
    if rule == "reducible":
        reject_rate = 1 - float(torch.minimum(P0, Q0).sum())
        assert stats.num_fuzzy_accepted.double().mean().item() == pytest.approx(reject_rate, abs=0.01)


def block_closed_form(rule: str, fuzzy: list[bool]) -> tuple[np.ndarray, list[torch.Tensor]]:
    """Accepted-length law and per-position emitted law for context-free p_i, q_i."""
    k = Q_BLOCK.shape[0]
    accept = [
        1.0 if fuzzy[i] else (float(torch.minimum(P_BLOCK[i], Q_BLOCK[i]).sum()) if rule == "reducible" else 0.0)
        for i in range(k)
    ]
    length = np.zeros(k + 1)
    reach = 1.0
    for n in range(k):
        length[n] = reach * (1 - accept[n])
        reach *= accept[n]
    length[k] = reach
    per_position = [Q_BLOCK[i] if fuzzy[i] else P_BLOCK[i] for i in range(k)] + [P_BLOCK[k]]
    return length, per_position


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("fuzzy_on", [False, True])
def test_block_lengths_and_emitted_tokens_match_closed_form(rule: str, fuzzy_on: bool) -> None:
    k = Q_BLOCK.shape[0]
    d = [kl_q_p(P_BLOCK[i], Q_BLOCK[i]) for i in range(k)]
    assert d[1] < 0.05 < min(d[0], d[2])
    threshold = 0.05 if fuzzy_on else 0.0
    fuzzy = [fuzzy_on and di <= threshold for di in d]
    _, output, stats = verify_uniform_blocks(
        repeat_rows(P_BLOCK, DRAWS), repeat_rows(Q_BLOCK, DRAWS), threshold, rule,
        seed=21 + int(fuzzy_on) + 2 * RULES.index(rule),
    )
    length_law, per_position = block_closed_form(rule, fuzzy)
    observed_len = counts(stats.num_accepted, k + 1)
    support = length_law > 0
    assert observed_len[~support].sum() == 0, f"impossible lengths observed: {observed_len}"
    if support.sum() > 1:
        pvalue = chisquare(observed_len[support], length_law[support] * DRAWS).pvalue
        assert pvalue > ALPHA, f"accepted-length law differs from closed form (p={pvalue:.2e}): {observed_len}"
    for position in range(k + 1):
        tokens = emitted_at(output, position)
        if tokens.numel() >= 1000:
            assert_follows(tokens, per_position[position], f"{rule} token at position {position}")
    tv1 = 0.5 * float((P_BLOCK[1] - Q_BLOCK[1]).abs().sum())
    expected = torch.where(stats.num_accepted > 1, tv1, 0.0) if fuzzy[1] else torch.zeros(DRAWS)
    torch.testing.assert_close(stats.distortion, expected, rtol=1e-6, atol=1e-6)


def test_ngram_drafts_are_a_point_mass_and_stay_exact_at_zero_threshold() -> None:
    # vLLM gives no draft_probs for n-gram drafts: q = δ_x. Accept iff u < p(x); the emitted law is still p.
    target = torch.stack([P0, P_BONUS]).unsqueeze(0).expand(DRAWS, 2, 6)
    draft = Q0.view(1, 1, 6).expand(DRAWS, 1, 6).contiguous()  # only used to pick the drafted tokens
    drafts, output, stats = verify_uniform_blocks(target, draft, 0.0, "reducible", seed=31, ngram=True)
    assert_follows(emitted_at(output, 0), P0, "n-gram, T=0")
    # with a point-mass draft, tv = 1 - p(x) <= T accepts every draft whose target prob is >= 1 - T
    _, output, stats = verify_uniform_blocks(target, draft, 0.70, "reducible", seed=32, div="tv", ngram=True)
    assert (stats.num_accepted == 1).sum() > 0.35 * DRAWS * 0.5  # at least the drafts of token 0 (p = .35)


def test_greedy_zero_threshold_accepts_exactly_the_argmax_prefix_and_fuzzy_charges_mismatches() -> None:
    p = torch.tensor([[[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.1, 0.2, 0.7]]])
    q = torch.tensor([[[0.55, 0.35, 0.10], [0.45, 0.45, 0.10]]])  # KL(q‖p) small at both positions
    drafts = torch.tensor([0, 1])  # position 0 matches argmax, position 1 does not
    bonus = torch.tensor([[2]])

    def run(threshold: float) -> tuple[list[int], object]:
        randomness = draw_randomness([2], 3, {}, torch.device("cpu"))
        output, stats = fsd_rejection_sample_flat(
            drafts, [2], 2, cu([2]), q[0].contiguous(), p[0, :2].contiguous(), bonus,
            torch.tensor([True]), torch.tensor([threshold]), randomness,
        )
        return output[0].tolist(), stats

    row, stats = run(0.0)
    assert row == [0, 0, PLACEHOLDER_TOKEN_ID]  # the mismatch is replaced by argmax p_1
    assert float(stats.distortion[0]) == 0.0
    row, stats = run(0.1)
    assert row == [0, 1, 2]  # fuzzy-accepted mismatch, then the bonus
    assert int(stats.num_fuzzy_accepted[0]) == 1 and float(stats.distortion[0]) == 1.0


# ---------------------------------------------------------------------------------------------------------
# randomness and bad input


def test_a_seeded_request_does_not_depend_on_its_batch() -> None:
    alone = draw_randomness([3], 7, {0: gen(5)}, torch.device("cpu"))
    batched = draw_randomness([2, 0, 3], 7, {2: gen(5)}, torch.device("cpu"))
    assert torch.equal(alone.uniforms, batched.uniforms[2:])
    assert torch.equal(alone.recovery_noise[0], batched.recovery_noise[2])


def test_bad_rule_divergence_or_shapes_are_value_errors_naming_them() -> None:
    p = random_dists((2, 5), seed=7)
    args = (torch.tensor([1, 2]), [1, 1], 1, cu([1, 1]), p, p, torch.tensor([[0], [1]]))
    rest = (torch.tensor([False, False]), torch.zeros(2), draw_randomness([1, 1], 5, {}, torch.device("cpu")))
    with pytest.raises(ValueError, match="'bogus'"):
        fsd_rejection_sample_flat(*args, *rest, div="bogus")
    with pytest.raises(ValueError, match="'lossy'"):
        fsd_rejection_sample_flat(*args, *rest, rule="lossy")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        fsd_rejection_sample_flat(torch.tensor([1, 2]), [2, 0], 1, cu([2, 0]), p, p, args[6], *rest)
    with pytest.raises(ValueError, match="draft_probs"):
        fsd_rejection_sample_flat(*args[:4], p[:, :3], *args[5:], *rest)
