"""Sampling transforms and reproducible categorical draws.

The same transforms (temperature, top-k, top-p) are applied to the target's and the draft's logits before
acceptance (decoder/acceptance.py), so that speculative sampling is exact with respect to the distribution
a plain sampler would draw from.

Randomness. Every random draw in the decoder goes through :func:`draw_uniforms`, which takes either one
``torch.Generator`` for the whole call, a sequence with one generator per row (dim 0), or ``None`` (the
global default generator). With a sequence, row ``b``'s numbers come from its own generator only, so a
request's output is reproducible whatever else is in its batch. Categorical draws use the inverse CDF of
one uniform per sample (:func:`sample_from_uniforms`), which lets a test replay the exact same decision
from the same uniforms.

Greedy (temperature 0) rows: :func:`sampling_probs` returns their temperature-1 distribution (after top-k
and top-p); the greedy choice itself is ``argmax`` and is made by the caller (``verify_block(...,
greedy=...)`` or :func:`greedy`). Divergences for greedy rows are therefore computed on temperature-1 probs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

GeneratorArg = torch.Generator | Sequence[torch.Generator | None] | None


def _per_row(value: Tensor | float | int, ref: Tensor, name: str, dtype: torch.dtype) -> Tensor:
    """A scalar or a [B] per-row parameter, still on its own device (CPU for Python numbers), shape-checked
    against ``ref`` [B, ..., V]. Validation and the "is any row filtered" decisions are made on this copy,
    so a CPU parameter never forces an accelerator sync."""
    t = torch.as_tensor(value, dtype=dtype)
    if t.dim() > 1:
        raise ValueError(f"{name} must be a scalar or a 1-D per-row tensor, got shape {tuple(t.shape)}")
    if t.dim() == 1 and (ref.dim() < 2 or t.shape[0] != ref.shape[0]):
        raise ValueError(
            f"{name} has {t.shape[0]} rows but logits have shape {tuple(ref.shape)} (leading dim is the batch)"
        )
    return t


def _broadcastable(t: Tensor, ref: Tensor) -> Tensor:
    """[] or [B] -> [1, ..., 1] or [B, 1, ..., 1] on ``ref``'s device."""
    shape = [t.shape[0] if t.dim() else 1] + [1] * (ref.dim() - 1)
    return t.reshape(shape).to(ref.device)


def _check(ok: Tensor, name: str, value: Tensor | float | int, rule: str) -> None:
    if not bool(ok.all()):
        shown = value.tolist() if isinstance(value, Tensor) else value
        raise ValueError(f"{name} must be {rule}, got {shown!r}")


def sampling_probs(
    logits: Tensor,  # [..., V] (e.g. [B, k+1, V]); any float dtype, computed in float32
    temperature: Tensor | float,  # scalar or [B]; 0 = greedy row (returns the temperature-1 softmax)
    top_k: Tensor | int = 0,  # scalar or [B]; 0 disables
    top_p: Tensor | float = 1.0,  # scalar or [B]; 1 disables
) -> Tensor:  # [..., V] float32 probabilities, never NaN
    """Probabilities after temperature, top-k then top-p (the order HF's logits warpers use).

    Top-k keeps every token whose logit is >= the k-th largest (ties are kept, as in HF). Top-p keeps the
    smallest prefix of the sorted distribution whose mass reaches ``top_p``, always keeping the most
    probable token, so even a tiny ``top_p`` gives a valid one-hot distribution. Rows whose logits are all
    -inf (a caller bug) come back uniform rather than NaN.
    """
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have a non-empty last (vocab) dim, got shape {tuple(logits.shape)}")
    scores = logits.float()
    vocab = scores.shape[-1]
    temp = _per_row(temperature, scores, "temperature", torch.float32)
    _check(torch.isfinite(temp) & (temp >= 0), "temperature", temperature, "finite and >= 0")
    k = _per_row(top_k, scores, "top_k", torch.long)
    _check(k >= 0, "top_k", top_k, ">= 0")
    p_keep = _per_row(top_p, scores, "top_p", torch.float32)
    _check((p_keep > 0) & (p_keep <= 1), "top_p", top_p, "in (0, 1]")
    topk_rows = (k > 0) & (k < vocab)
    topk_needed = int(k[topk_rows].max()) if bool(topk_rows.any()) else 0  # the largest active top-k
    topp_any = bool((p_keep < 1).any())

    if bool((temp != 1).any()):
        scores = scores / _broadcastable(torch.where(temp == 0, torch.ones_like(temp), temp), scores)
    # A row of all -inf would softmax to NaN; make it uniform instead (checked on the row max: one cheap pass).
    all_masked = torch.isneginf(scores.amax(dim=-1, keepdim=True))
    if bool(all_masked.any()):
        scores = scores.masked_fill(all_masked, 0.0)
    if topk_needed == 0 and not topp_any:
        return torch.softmax(scores, dim=-1)
    # Filters only mask scores to -inf and the result is one softmax, so a row without filtering is
    # bit-identical to the plain softmax whatever else is in the batch.
    filtered = _filter_scores(
        scores, _broadcastable(k, scores), topk_needed, _broadcastable(p_keep, scores), topp_any
    )
    return torch.softmax(filtered, dim=-1)


# Candidate count tried first for top-p; a full sort of a 50k-150k vocabulary per row is far slower than a
# small top-k on CPU, and most nuclei are small. If some row's nucleus is larger, one full sort follows
# (at most two selections per call, never a chain of growing ones).
_FIRST_CANDIDATES = 64


def _filter_scores(
    scores: Tensor,  # [..., V] float32, temperature applied
    k: Tensor,  # [B or 1, 1, ..., 1] int64: top-k per row, 0 or >= V = off
    topk_needed: int,  # the largest active top-k (0: top-k off in every row)
    p_keep: Tensor,  # [B or 1, 1, ..., 1] float32: top-p per row, 1 = off
    topp_any: bool,  # whether any row has top-p < 1
) -> Tensor:  # [..., V] scores with filtered-out tokens at -inf
    vocab = scores.shape[-1]
    neg_inf = torch.tensor(-torch.inf, device=scores.device)
    topk_on = (k > 0) & (k < vocab)
    topp_on = p_keep < 1
    any_topk = topk_needed > 0
    candidates = min(vocab, max(topk_needed, _FIRST_CANDIDATES if topp_any else 1))
    while True:
        # The `candidates` highest scores per row, sorted descending (topk's output is sorted).
        values, indices = torch.topk(scores, candidates, dim=-1)
        kth_index = (k.clamp(min=1, max=candidates) - 1).long().expand(*scores.shape[:-1], 1)
        kth_value = values.gather(-1, kth_index)  # ties with the k-th value are kept, as in HF
        if not topp_any:
            return torch.where(~topk_on | (scores >= kth_value), scores, neg_inf)
        masked = torch.where(~topk_on | (scores >= kth_value), scores, neg_inf) if any_topk else scores
        log_norm = torch.logsumexp(masked, dim=-1, keepdim=True)
        values = torch.where(~topk_on | (values >= kth_value), values, neg_inf)
        sorted_probs = torch.exp(values - log_norm)  # the candidates' share of the top-k-filtered softmax
        covered = (sorted_probs.sum(dim=-1, keepdim=True) >= p_keep) | ~topp_on
        if candidates == vocab or bool(covered.all()):
            break
        candidates = vocab
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # exclusive cumsum, descending order
    keep_sorted = mass_before < p_keep
    keep_sorted[..., 0] = True  # the most probable token is always kept (implied by top_p > 0; made explicit)
    # Tokens outside the candidates lie beyond the nucleus (the candidates already hold >= top_p mass).
    kept = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, indices, keep_sorted)
    return torch.where(topp_on & ~kept, neg_inf, masked)


def draw_uniforms(
    shape: Sequence[int],  # (B, ...) — dim 0 is the row a per-row generator belongs to
    generator: GeneratorArg,
    device: torch.device | str,
) -> Tensor:  # `shape`, float32 in [0, 1), on `device`
    """Uniform [0, 1) numbers; with a generator sequence, row b is drawn from ``generator[b]`` alone.

    Numbers are drawn on the generator's own device (a CPU generator stays on CPU) and moved once.
    """
    shape = tuple(int(s) for s in shape)
    if generator is None or isinstance(generator, torch.Generator):
        gen_device = generator.device if generator is not None else device
        return torch.rand(shape, generator=generator, device=gen_device).to(device)
    generators = list(generator)
    if len(shape) == 0 or len(generators) != shape[0]:
        raise ValueError(f"got {len(generators)} generators for {shape[0] if shape else 0} rows; need one per row")
    rows = [
        torch.rand(shape[1:], generator=g, device=g.device if g is not None else device).to(device)
        for g in generators
    ]
    return torch.stack(rows) if rows else torch.empty(shape, device=device)


def sample_from_uniforms(
    weights: Tensor,  # [..., V] non-negative, need not be normalised; every row must have positive mass
    uniforms: Tensor,  # weights.shape[:-1], in [0, 1)
) -> Tensor:  # weights.shape[:-1] int64
    """Inverse-CDF categorical draw: token i is chosen with probability weights[i] / sum(weights).

    The CDF is accumulated in float64 so tokens with tiny mass are not swallowed by rounding over a large
    vocabulary. Zero-weight tokens are never returned.
    """
    cdf = torch.cumsum(weights.double(), dim=-1)
    total = cdf[..., -1:]
    target = uniforms.double().unsqueeze(-1) * total
    index = torch.searchsorted(cdf, target, right=True)
    # r * total can round up to total; the first index reaching the total is the last token with mass.
    last_with_mass = torch.searchsorted(cdf, total.contiguous(), right=False)
    return torch.minimum(index, last_with_mass).squeeze(-1)


def sample(
    probs: Tensor,  # [..., V] (need not be normalised)
    generator: GeneratorArg = None,  # one generator, one per row of dim 0, or None
) -> Tensor:  # probs.shape[:-1] int64
    """Draw one token per distribution over the last dim (any leading shape)."""
    uniforms = draw_uniforms(probs.shape[:-1], generator, probs.device)
    return sample_from_uniforms(probs, uniforms)


def greedy(probs: Tensor) -> Tensor:  # [..., V] -> [...] int64
    """The greedy token (first index of the maximum, as torch.argmax)."""
    return torch.argmax(probs, dim=-1)
