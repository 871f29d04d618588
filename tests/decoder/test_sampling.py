"""Tests for decoder/sampling.py: sampling transforms (vs HF's warpers), reproducible categorical draws."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from decoder.sampling import draw_uniforms, greedy, sample, sample_from_uniforms, sampling_probs

ALPHA = 1e-3


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """HF transformers' warper chain for one row set (temperature -> top-k -> top-p -> softmax)."""
    scores = logits.clone()
    ids = torch.zeros(scores.shape[0], 1, dtype=torch.long)
    if temperature not in (0.0, 1.0):
        scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return torch.softmax(scores, dim=-1)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (0.7, 0, 0.8), (0.5, 20, 0.9), (0.0, 10, 0.95), (2.0, 0, 0.3)],
)
def test_matches_hf_warper_chain(temperature: float, top_k: int, top_p: float) -> None:
    logits = torch.randn(16, 64, generator=gen(1)) * 3
    ours = sampling_probs(logits, temperature, top_k, top_p)
    expected = hf_probs(logits, temperature, top_k, top_p)  # temperature 0 == temperature 1 by contract
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    assert ours.dtype == torch.float32


@pytest.mark.parametrize(
    ("scale", "top_k", "top_p"), [(0.05, 0, 0.95), (0.3, 0, 0.5), (0.05, 300, 0.9), (4.0, 0, 0.999), (0.05, 2000, 1.0)]
)
def test_large_vocab_nucleus_beyond_first_candidates_matches_hf(scale: float, top_k: int, top_p: float) -> None:
    # Flat distributions over 5000 tokens: the nucleus holds thousands of tokens, so the candidate set must
    # grow past its first size; sharp ones keep it small.
    logits = torch.randn(6, 5000, generator=gen(21)) * scale
    ours = sampling_probs(logits, 1.0, top_k, top_p)
    expected = hf_probs(logits, 1.0, top_k, top_p)
    # HF accumulates ascending and compares with 1 - top_p, we accumulate descending: at most the one token
    # sitting on the nucleus boundary (cumulative mass == top_p up to rounding) may differ.
    assert (((ours > 0) != (expected > 0)).sum(dim=-1) <= 1).all()
    assert float(0.5 * (ours - expected).abs().sum(dim=-1).max()) < 1e-4
    if scale < 0.1 and top_p < 1:
        assert int((ours[0] > 0).sum()) > 64, "the case should need more than the first candidates"


def test_mixed_rows_topk_only_topp_only_and_unfiltered() -> None:
    logits = torch.randn(3, 2, 3000, generator=gen(22)) * 0.2
    ks, ps = torch.tensor([100, 0, 0]), torch.tensor([1.0, 0.7, 1.0])
    batched = sampling_probs(logits, 1.0, ks, ps)
    for row in range(3):
        expected = hf_probs(logits[row], 1.0, int(ks[row]), float(ps[row]))
        torch.testing.assert_close(batched[row], expected, rtol=1e-5, atol=1e-7)
    assert torch.equal(batched[2], torch.softmax(logits[2], -1)), "an unfiltered row is the plain softmax"


def test_per_row_parameters_broadcast_over_block_positions() -> None:
    b, positions, v = 4, 3, 50
    logits = torch.randn(b, positions, v, generator=gen(2)) * 2
    temps = torch.tensor([0.0, 0.7, 1.0, 1.5])
    ks = torch.tensor([0, 3, 10, 0])
    ps = torch.tensor([1.0, 0.9, 0.5, 0.2])
    batched = sampling_probs(logits, temps, ks, ps)
    assert batched.shape == (b, positions, v)
    for row in range(b):
        single = sampling_probs(logits[row], float(temps[row]), int(ks[row]), float(ps[row]))
        torch.testing.assert_close(batched[row], single, rtol=0, atol=0)


def test_top_k_keeps_ties_and_exactly_k_otherwise() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    probs = sampling_probs(logits, 1.0, top_k=2)
    assert (probs[0] > 0).tolist() == [True, False, True, True, False]  # 2nd-largest value is tied
    assert (probs[1] > 0).tolist() == [True, True, False, False, False]
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))


def test_tiny_top_p_keeps_the_argmax_and_never_nans() -> None:
    logits = torch.randn(8, 100, generator=gen(3))
    probs = sampling_probs(logits, 0.8, top_p=1e-9)
    assert not torch.isnan(probs).any()
    torch.testing.assert_close(probs, torch.nn.functional.one_hot(logits.argmax(-1), 100).float())


def test_bf16_logits_are_computed_in_float32() -> None:
    logits = (torch.randn(4, 3, 1000, generator=gen(4)) * 10).bfloat16()
    probs = sampling_probs(logits, 0.6, top_k=50, top_p=0.9)
    assert probs.dtype == torch.float32
    assert not torch.isnan(probs).any()
    torch.testing.assert_close(probs.sum(-1), torch.ones(4, 3))
    torch.testing.assert_close(probs, sampling_probs(logits.float(), 0.6, top_k=50, top_p=0.9), rtol=0, atol=0)


def test_masked_vocab_entries_stay_zero_and_all_masked_row_is_uniform() -> None:
    logits = torch.tensor([[1.0, -torch.inf, 0.5, -torch.inf], [-torch.inf] * 4])
    probs = sampling_probs(logits, 0.9, top_p=0.99)
    assert probs[0, 1] == 0 and probs[0, 3] == 0
    torch.testing.assert_close(probs[1], torch.full((4,), 0.25))
    assert not torch.isnan(probs).any()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 1.0, "top_k": -1}, "top_k"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
        ({"temperature": torch.tensor([1.0, -1.0])}, "temperature"),
        ({"temperature": torch.tensor([1.0, 1.0, 1.0])}, "temperature"),
    ],
)
def test_bad_sampling_parameters_are_value_errors_naming_them(kwargs: dict[str, object], name: str) -> None:
    logits = torch.randn(2, 5)
    with pytest.raises(ValueError, match=name):
        sampling_probs(logits, **kwargs)  # type: ignore[arg-type]


def test_sample_follows_the_distribution_and_never_draws_zero_mass() -> None:
    weights = torch.tensor([0.0, 2.0, 0.0, 1.0, 4.0, 3.0, 0.0])  # unnormalised, with zeros inside and at the end
    draws = sample(weights.expand(100_000, 7), gen(5))
    assert draws.shape == (100_000,) and draws.dtype == torch.int64
    observed = torch.bincount(draws, minlength=7).numpy().astype(np.float64)
    support = (weights > 0).numpy()
    assert observed[~support].sum() == 0
    expected = weights.double().numpy()[support] / weights.sum().item() * observed.sum()
    assert chisquare(observed[support], expected).pvalue > ALPHA
    # power: a permuted distribution is rejected
    wrong = np.array([4.0, 3.0, 2.0, 1.0])
    assert chisquare(observed[support], wrong / wrong.sum() * observed.sum()).pvalue < 1e-6


def test_inverse_cdf_edges() -> None:
    weights = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.0, 0.5, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]])
    uniforms = torch.tensor([0.0, 1.0 - 2**-24, 0.999999])
    assert sample_from_uniforms(weights, uniforms).tolist() == [1, 2, 0]
    # u = 1 (outside torch.rand's range, but a caller may pass it) still lands on a token with mass
    assert sample_from_uniforms(weights, torch.ones(3)).tolist() == [2, 2, 0]
    # the boundary between tokens is at the cumulative mass
    w = torch.tensor([0.25, 0.75]).expand(2, 2)
    assert sample_from_uniforms(w, torch.tensor([0.2499, 0.25])).tolist() == [0, 1]


def test_sample_keeps_any_leading_shape() -> None:
    probs = torch.softmax(torch.randn(3, 4, 5, 9, generator=gen(6)), -1)
    assert sample(probs, gen(7)).shape == (3, 4, 5)
    assert greedy(probs).shape == (3, 4, 5)


def test_per_row_generators_make_rows_independent_of_batch_composition() -> None:
    probs = torch.softmax(torch.randn(5, 3, 40, generator=gen(8)), -1)
    seeds = [11, 12, 13, 14, 15]
    batch = sample(probs, [gen(s) for s in seeds])
    for row, seed in enumerate(seeds):
        assert torch.equal(batch[row], sample(probs[row : row + 1], [gen(seed)])[0])
    # reordering the batch reorders the rows and nothing else
    order = [3, 0, 4, 1, 2]
    shuffled = sample(probs[order], [gen(seeds[i]) for i in order])
    assert torch.equal(shuffled, batch[order])


def test_draw_uniforms_per_row_stream_is_the_generators_own() -> None:
    uniforms = draw_uniforms((3, 4), [gen(1), gen(2), None], "cpu")
    assert uniforms.shape == (3, 4)
    assert torch.equal(uniforms[0], torch.rand(4, generator=gen(1)))
    assert torch.equal(uniforms[1], torch.rand(4, generator=gen(2)))
    assert ((uniforms >= 0) & (uniforms < 1)).all()
    assert torch.equal(draw_uniforms((3, 4), gen(9), "cpu"), torch.rand(3, 4, generator=gen(9)))
    with pytest.raises(ValueError, match="generators"):
        draw_uniforms((3, 4), [gen(1)], "cpu")
