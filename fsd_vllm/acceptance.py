"""FSD acceptance in vLLM's flat rejection-sampler layout (pure torch: no vLLM, no transformers import).

vLLM's V1 rejection sampler (``vllm/v1/sample/rejection_sampler.py``, ``rejection_sample``) sees the drafts
of a whole batch as *flat* tensors: request ``b`` owns the rows ``cu_num_draft_tokens[b] - n_b ..
cu_num_draft_tokens[b] - 1`` of ``draft_token_ids`` / ``draft_probs`` / ``target_probs`` (``n_b =
num_draft_tokens[b]``, possibly 0), and the output is a padded ``[B, max_spec_len + 1]`` int32 tensor
holding the accepted drafts, then one recovered-or-bonus token, then ``PLACEHOLDER_TOKEN_ID`` (-1).
:func:`fsd_rejection_sample_flat` computes that output by the FSD rules of ``decoder/acceptance.py``
(same glossary, same rules, same distortion accounting; read its module docstring):

* accepted token: a drafted ``x_i`` that is emitted (the accepted prefix stops at the first rejection);
* fuzzy-accepted token: accepted only because ``D_i <= T`` (the standard test alone would reject);
* recovered token: emitted at the first rejection ``j`` — sampled from ``normalize(max(0, p_j - q_j))``
  (``reducible``; ``p_j`` if that residual is all zero) or from ``p_j`` (``pure``); ``argmax p_j`` on
  greedy rows;
* bonus token: vLLM's own ``bonus_token_ids`` (drawn by its sampler from ``p_k``), emitted when all
  ``n_b`` drafts are accepted.

Rules: ``reducible`` accepts iff ``u_i < p_i(x_i)/q_i(x_i)`` (greedy rows: ``x_i == argmax p_i``) or
``fuzzy_i = (D_i <= T) & (T > 0)``; ``pure`` accepts iff ``fuzzy_i`` (greedy rows also on argmax match).
At ``T = 0`` ``reducible`` is exactly vLLM's standard rejection sampling (arXiv 2211.17192).

Where this departs from vLLM's triton kernels: the recovered token uses the same exponential race as vLLM
(``argmax(weights / E)``, ``E ~ Exp(1)``, one noise row per request) but falls back to ``p_j`` when the
residual is empty, and n-gram drafts (``draft_probs is None``) are treated as the point mass ``q = δ_x``
(which is what vLLM's ``IS_NGRAM`` branch does: accept iff ``u < p(x)``, recover from ``p`` with ``x``
removed), so every divergence is defined for them too.

``divergence`` is a copy of ``decoder.acceptance.divergence`` (tests/vllm/test_acceptance_flat.py checks
they agree): importing ``decoder`` pulls in transformers, whose version in the vLLM environment differs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

DIVERGENCES = ("kl", "reverse_kl", "js", "tv", "draft_tokens")
RULES = ("reducible", "pure")
PLACEHOLDER_TOKEN_ID = -1  # vLLM's padding id in the rejection sampler output


def _kl(a: Tensor, b: Tensor) -> Tensor:
    """KL(a‖b) over the last dim; 0·log 0 = 0, a > 0 with b = 0 gives +inf (never NaN)."""
    terms = a * (torch.log(a) - torch.log(b))
    return torch.where(a > 0, terms, 0.0).sum(dim=-1).clamp_min(0.0)


def divergence(
    p: Tensor,  # [..., V] target probs
    q: Tensor,  # [..., V] draft probs
    kind: str,
    draft_token: Tensor | None = None,  # [...] int64, needed for "draft_tokens"
) -> Tensor:  # [...] float32
    """D(p, q) as in decoder/acceptance.py: ``kl`` = KL(q‖p) (draft‖target), ``reverse_kl`` = KL(p‖q),
    ``js`` (nats, ≤ ln 2), ``tv`` = ½Σ|p − q|, ``draft_tokens`` = |p(x) − q(x)| at the drafted token."""
    if kind not in DIVERGENCES:
        raise ValueError(f"unknown divergence {kind!r}; expected one of {DIVERGENCES}")
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    p = p.float()
    q = q.float()
    if kind == "kl":
        return _kl(q, p)
    if kind == "reverse_kl":
        return _kl(p, q)
    if kind == "js":
        m = 0.5 * (p + q)
        return (0.5 * _kl(p, m) + 0.5 * _kl(q, m)).clamp(max=math.log(2.0))
    if kind == "tv":
        return 0.5 * (p - q).abs().sum(dim=-1)
    if draft_token is None:
        raise ValueError("divergence 'draft_tokens' needs draft_token (the drafted token ids)")
    if tuple(draft_token.shape) != tuple(p.shape[:-1]):
        raise ValueError(f"draft_token must have shape {tuple(p.shape[:-1])}, got {tuple(draft_token.shape)}")
    index = draft_token.long().unsqueeze(-1)
    return (p.gather(-1, index) - q.gather(-1, index)).abs().squeeze(-1)


@dataclass
class FlatVerifyStats:
    """Per-request counters of one verify step (B requests, vLLM batch order)."""

    num_drafted: Tensor  # [B] int64: n_b
    num_accepted: Tensor  # [B] int64 in 0..n_b: accepted draft prefix length
    num_fuzzy_accepted: Tensor  # [B] int64: accepted tokens that only the fuzzy test let through
    distortion: Tensor  # [B] float32: summed per-position TV to the target at emitted fuzzy positions


@dataclass
class FlatRandomness:
    """The random numbers one verify step consumes, drawn up front so tests can replay them."""

    uniforms: Tensor  # [num_tokens] float64 in [0, 1): one acceptance test per drafted token
    recovery_noise: Tensor  # [B, V] Exp(1): one exponential-race noise row per request


def draw_randomness(
    num_draft_tokens: Sequence[int],
    vocab_size: int,
    generators: Mapping[int, torch.Generator],  # request index -> its own generator (seeded requests)
    device: torch.device,
) -> FlatRandomness:
    """Like vLLM's ``generate_uniform_probs`` + the noise of ``sample_recovered_tokens``: unseeded
    requests draw from the global generator, a seeded request only from its own, and a request without
    drafts draws nothing from its generator (so its seeded stream does not depend on speculation)."""
    num_tokens = int(sum(num_draft_tokens))
    uniforms = torch.rand((num_tokens,), dtype=torch.float64, device=device)  # float64 as vLLM: never exactly 0
    noise = torch.empty((len(num_draft_tokens), vocab_size), dtype=torch.float32, device=device)
    noise.exponential_()
    start = 0
    for index, n in enumerate(num_draft_tokens):
        generator = generators.get(index)
        if n > 0 and generator is not None:
            uniforms[start : start + n].uniform_(generator=generator)
            noise[index].exponential_(generator=generator)
        start += n
    return FlatRandomness(uniforms=uniforms, recovery_noise=noise)


def _check_flat(
    draft_token_ids: Tensor,
    num_draft_tokens: Sequence[int],
    max_spec_len: int,
    cu_num_draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    bonus_token_ids: Tensor,
    div: str,
    rule: str,
) -> None:
    if div not in DIVERGENCES:
        raise ValueError(f"unknown divergence {div!r}; expected one of {DIVERGENCES}")
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; expected one of {RULES}")
    batch = len(num_draft_tokens)
    num_tokens = int(sum(num_draft_tokens))
    if any(n < 0 or n > max_spec_len for n in num_draft_tokens):
        raise ValueError(f"num_draft_tokens must lie in [0, {max_spec_len}], got {list(num_draft_tokens)}")
    if tuple(draft_token_ids.shape) != (num_tokens,):
        raise ValueError(f"draft_token_ids must be [{num_tokens}], got {tuple(draft_token_ids.shape)}")
    if target_probs.dim() != 2 or target_probs.shape[0] != num_tokens:
        raise ValueError(f"target_probs must be [{num_tokens}, V], got {tuple(target_probs.shape)}")
    if draft_probs is not None and draft_probs.shape != target_probs.shape:
        raise ValueError(
            f"draft_probs must match target_probs {tuple(target_probs.shape)}, got {tuple(draft_probs.shape)}"
        )
    if tuple(cu_num_draft_tokens.shape) != (batch,):
        raise ValueError(f"cu_num_draft_tokens must be [{batch}], got {tuple(cu_num_draft_tokens.shape)}")
    if bonus_token_ids.numel() != batch:
        raise ValueError(f"bonus_token_ids must hold {batch} tokens, got shape {tuple(bonus_token_ids.shape)}")


def fsd_rejection_sample_flat(
    draft_token_ids: Tensor,  # [num_tokens] int
    num_draft_tokens: Sequence[int],  # [B] n_b
    max_spec_len: int,
    cu_num_draft_tokens: Tensor,  # [B] int, inclusive cumulative sum of num_draft_tokens
    draft_probs: Tensor | None,  # [num_tokens, V]; None for n-gram drafts (q = δ_x)
    target_probs: Tensor,  # [num_tokens, V] probabilities (greedy rows: any temperature-1 probs)
    bonus_token_ids: Tensor,  # [B, 1] int
    is_greedy: Tensor,  # [B] bool
    thresholds: Tensor,  # [B] float32 T >= 0 per request
    randomness: FlatRandomness,
    div: str = "kl",
    rule: str = "reducible",
) -> tuple[Tensor, FlatVerifyStats]:  # [B, max_spec_len + 1] int32 output ids, counters
    """FSD verify of one vLLM step; vectorised over requests and positions (no Python loop over data)."""
    _check_flat(
        draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_probs,
        bonus_token_ids, div, rule,
    )
    device = target_probs.device
    batch = len(num_draft_tokens)
    num_tokens = draft_token_ids.shape[0]
    k = max_spec_len
    counts = torch.tensor(list(num_draft_tokens), dtype=torch.long, device=device)  # [B]
    bonus = bonus_token_ids.reshape(batch).long()  # [B]
    output = torch.full((batch, k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=device)
    if num_tokens == 0:
        output[:, 0] = bonus.to(torch.int32)
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        return output, FlatVerifyStats(zeros, zeros.clone(), zeros.clone(), zeros.float())

    p = target_probs.float()  # [N, V]
    x = draft_token_ids.long()  # [N]
    q = draft_probs.float() if draft_probs is not None else torch.zeros_like(p).scatter_(1, x[:, None], 1.0)
    token_row = torch.repeat_interleave(torch.arange(batch, device=device), counts)  # [N] owning request
    t = thresholds.to(device=device, dtype=torch.float32)[token_row]  # [N]
    greedy = is_greedy.to(device=device, dtype=torch.bool)[token_row]  # [N]

    d = divergence(p, q, div, x)  # [N]
    fuzzy = (d <= t) & (t > 0)  # [N]
    p_x = p.gather(1, x[:, None]).squeeze(1)  # [N]
    q_x = q.gather(1, x[:, None]).squeeze(1)  # [N]
    target_argmax = p.argmax(dim=-1)  # [N]
    # u < p/q without dividing (q_x = 0 with p_x > 0 accepts; p_x = 0 never does).
    standard = torch.where(greedy, x == target_argmax, randomness.uniforms * q_x < p_x)  # [N]
    accept = (standard | fuzzy) if rule == "reducible" else (fuzzy | (greedy & standard))  # [N]

    # Recovered token at every drafted position (only the first rejected one is used).
    if rule == "reducible":
        residual = (p - q).clamp_min(0.0)
        weights = torch.where((residual.sum(dim=-1) > 0)[:, None], residual, p)  # [N, V]
    else:
        weights = p
    sampled = (weights / randomness.recovery_noise[token_row]).argmax(dim=-1)  # [N] exponential race
    recovered = torch.where(greedy, target_argmax, sampled)  # [N]

    # Flat -> padded [B, k]: request b, position i is flat row start_b + i when i < n_b.
    positions = torch.arange(k, device=device)
    valid = positions[None, :] < counts[:, None]  # [B, k]
    starts = cu_num_draft_tokens.to(device=device, dtype=torch.long) - counts  # [B]
    flat = (starts[:, None] + positions[None, :]).clamp(0, num_tokens - 1)  # [B, k]
    accept_padded = accept[flat] & valid
    num_accepted = torch.cumprod(accept_padded.long(), dim=1).sum(dim=1)  # [B]
    emitted = positions[None, :] < num_accepted[:, None]  # [B, k]

    rejected_at = num_accepted.clamp(max=k - 1)[:, None]  # [B, 1]
    next_token = torch.where(num_accepted < counts, recovered[flat].gather(1, rejected_at).squeeze(1), bonus)
    output[:, :k] = torch.where(emitted, x[flat], PLACEHOLDER_TOKEN_ID).to(torch.int32)
    output.scatter_(1, num_accepted[:, None], next_token[:, None].to(torch.int32))

    charged = emitted & fuzzy[flat]  # [B, k]
    fuzzy_accepted = charged & ~standard[flat]
    if div == "draft_tokens" and bool((t > 0).any()):
        # D depends on the drafted token: the emitted law at every reached position (accepted or the
        # recovered one) mixes p and q over the fuzzy set F; charge its exact TV to p, as the native
        # engine does (decoder/acceptance.py, _emitted_law_tv). Greedy rows: a point mass, 1[x != argmax].
        fuzzy_set = ((p - q).abs() <= t[:, None]) & (t > 0)[:, None]  # [N, V]
        if rule == "reducible":
            law_tv = torch.where(fuzzy_set, (q - p).clamp_min(0.0), 0.0).sum(dim=-1)  # [N]
        else:
            q_fuzzy = torch.where(fuzzy_set, q, 0.0)
            law_tv = 0.5 * (q_fuzzy - q_fuzzy.sum(dim=-1, keepdim=True) * p).abs().sum(dim=-1)  # [N]
        reached = positions[None, :] < torch.minimum(num_accepted + 1, counts)[:, None]  # [B, k]
        sampled_charge = reached & ~greedy[flat] & (t > 0)[flat]
        greedy_charge = charged & greedy[flat]
        per_position = torch.where(greedy, (x != target_argmax).float(), law_tv)  # [N]
        distortion = torch.where(sampled_charge | greedy_charge, per_position[flat], 0.0).sum(dim=1)
    elif bool(charged.any()):
        tv = d if div == "tv" else divergence(p, q, "tv")  # [N]
        per_position = torch.where(greedy, (x != target_argmax).float(), tv)  # [N]
        distortion = torch.where(charged, per_position[flat], 0.0).sum(dim=1)
    else:
        distortion = torch.zeros(batch, dtype=torch.float32, device=device)
    stats = FlatVerifyStats(
        num_drafted=counts,
        num_accepted=num_accepted,
        num_fuzzy_accepted=fuzzy_accepted.long().sum(dim=1),
        distortion=distortion,
    )
    return output, stats
