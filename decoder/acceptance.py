"""Acceptance math of Fuzzy Speculative Decoding (FSD) for one verify block.

Notation
--------
``p`` = the target's next-token distribution (``target_probs``), ``q`` = the draft's (``draft_probs``),
both *after* the same sampling transforms (temperature, top-k, top-p; see decoder/sampling.py).
``x_i`` = the token the draft proposed at block position ``i`` (``draft_tokens``), ``k`` = tokens drafted
per block, ``D_i = D(p_i, q_i)`` a divergence, ``T`` the row's fuzzy threshold, ``u_i ~ U[0, 1)``.

Glossary
--------
accepted token
    A drafted token ``x_i`` that is emitted. Positions are tested left to right; the block stops at the
    first rejection, so ``num_accepted`` is the length of the accepted prefix (0..k).
fuzzy-accepted token
    An accepted token that only the fuzzy test ``D_i <= T`` let through: the standard test alone would have
    rejected it (sampled rows: ``u_i >= p_i(x_i) / q_i(x_i)`` under the same ``u_i``; greedy rows:
    ``x_i != argmax p_i``).
recovered (resampled) token
    The token emitted at the first rejected position ``j`` instead of ``x_j``.
bonus token
    When all ``k`` drafts are accepted, one more token is drawn from the target's distribution at position
    ``k`` (``target_probs[:, k]``), which the verify forward computed anyway. Each block therefore emits
    ``num_accepted + 1`` tokens: the accepted drafts plus ``next_token``.

The rules (sampled rows)
------------------------
Standard speculative sampling (Leviathan et al., arXiv 2211.17192): accept ``x_i`` iff
``u_i < p_i(x_i) / q_i(x_i)``; at the first rejection ``j`` emit a token from
``normalize(max(0, p_j - q_j))``; if all are accepted emit the bonus from ``p_k``. Every emitted token is
then distributed exactly as the target's ``p``.

FSD (Holsman, Huang, Dhingra, arXiv 2502.20704) adds a *fuzzy branch*: a position is also accepted when
``D_i <= T``. The branch is active only where ``T > 0`` (``fuzzy_i = (D_i <= T) & (T > 0)``), so a zero
threshold never accepts anything extra, even when ``D_i == 0`` exactly (identical rows, bf16 rounding).

* ``reducible`` (default; the variant the authors proposed to TensorRT-LLM): accept iff standard test
  **or** ``fuzzy_i``. At the first rejection emit from ``normalize(max(0, p_j - q_j))`` (falling back to
  ``p_j`` if that residual is numerically all zero); bonus from ``p_k``. With ``T = 0`` this is *exactly*
  standard speculative sampling.
* ``pure`` (the paper's released code): accept iff ``fuzzy_i``; at the first rejection emit from ``p_j``;
  bonus from ``p_k``. With ``T = 0`` nothing is accepted and every block emits one token from ``p_0`` —
  also exact, just with no speed-up.

Greedy rows (temperature 0; ``greedy=True``): accept iff ``x_i == argmax p_i`` **or** ``fuzzy_i``; the
recovered and bonus tokens are ``argmax p_j``. The two rules coincide here: rejecting an ``x_i`` that
equals ``argmax p_i`` would emit that same token anyway.

What D is measured on
---------------------
``D`` may be measured on other distributions than the ones the test runs on: the engine passes the
temperature-scaled, *untruncated* logits (``target_div_logits`` / ``draft_div_logits``; temperature 1 for
greedy rows) while ``p`` and ``q`` carry top-k / top-p. Measured on the truncated pair, KL(q‖p) is +inf
wherever q keeps a token p's truncation dropped, which silently turned FSD off under top-k / top-p. The
acceptance test, the residual and the distortion stay on the truncated ``p``, ``q`` — so T = 0 is exact.
Without those logits ``D`` is measured on ``p`` and ``q`` themselves.

``D`` is computed lazily, from log-softmax, only where it can matter: at positions with ``T > 0`` where
the standard test rejected (and, for sampled rows, at accepted positions, to know what to charge). With
every row at ``T = 0`` no divergence is computed at all. ``VerifyResult.divergence`` is NaN elsewhere.

Ragged blocks: ``draft_lengths[b] = k_b <= k`` says row b drafted only its first ``k_b`` positions (the
rest is padding); its bonus comes from ``p_{k_b}``. ``k_b = 0`` is plain target decoding.

Where FSD departs from standard speculative sampling, and the distortion accounting
-----------------------------------------------------------------------------------
Conditioned on the prefix, the token emitted at a reached block position ``i`` (an accepted draft or the
recovered token) has a law ``e_i``; the exact charge is ``TV(e_i, p_i)``. Let ``F_i(y) = (D_i(y) <= T) &
(T > 0)``: for every divergence but ``draft_tokens`` it does not depend on the drafted token ``y``.

* ``reducible``: ``e = q·a + (1 − Σ q·a)·r`` with ``a(y) = 1`` where ``F(y)``, else ``min(1, p/q)``, and
  ``r`` the normalised residual. Then ``e − p = extra − (E/R)·max(0, p − q)`` with ``extra = F·max(0,
  q − p)``, ``E = Σ extra`` and ``R = Σ max(0, p − q)``; the two terms have disjoint supports, so
  ``TV(e, p) = E = Σ_y F(y)·max(0, q(y) − p(y))``. With ``F`` constant that is ``TV(p, q)·1[F]``.
* ``pure``: ``e = q·F + (1 − Σ q·F)·p``; ``TV(e, p) = ½ Σ |q·F − (Σ q·F)·p|`` (``TV(p, q)·1[F]`` for a
  constant ``F``).
* greedy rows: the emitted token is a point mass; ``TV = 1[x_i != argmax p_i]`` at a fuzzy-accepted
  position, else 0.

``VerifyResult.distortion`` reports it at every reached drafted position (bonus tokens are exact: 0). For
a constant ``F`` only accepted fuzzy positions are charged; for ``draft_tokens`` the recovered token's
position can be charged too (its law is also a mix). By the chain rule for total variation (a hybrid
argument), the TV between the law of FSD's whole output sequence and the target's is at most
``E[sum over emitted positions of TV(emitted law, p | prefix)]``, the expectation taken over FSD's own
outputs; the realised running sum of ``distortion`` is an unbiased estimate of that bound, and is the
quality signal the controller uses.

Randomness and the reference implementation
-------------------------------------------
:func:`verify_block` draws ``k + 1`` uniforms per row (``k`` acceptance tests, one for the
recovered/bonus draw, via :func:`decoder.sampling.draw_uniforms`; a greedy row draws them too, so the
amount drawn never depends on data; with ``draft_lengths`` and per-row generators row b draws ``k_b + 1``)
and hands them to :func:`_verify_block_from_uniforms`. Callers may pass pre-drawn ``uniforms`` instead (the
engine draws a whole step's numbers per row at once). The slow :func:`_verify_block_reference` replays the
same uniforms with Python loops and computes every emitted law explicitly; tests compare the two.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from decoder.sampling import GeneratorArg, draw_uniforms, sample_from_uniforms

DIVERGENCES = ("kl", "reverse_kl", "js", "tv", "draft_tokens")
RULES = ("reducible", "pure")


def _kl(a: Tensor, b: Tensor) -> Tensor:
    """KL(a‖b) = Σ a log(a/b) over the last dim; 0·log 0 = 0, a > 0 with b = 0 gives +inf (never NaN)."""
    # where() rather than xlogy: the same result, several times faster on CPU. Where a = 0 the term is
    # NaN or 0 and is discarded; where a > 0 and b = 0 it is +inf.
    terms = a * (torch.log(a) - torch.log(b))
    return torch.where(a > 0, terms, 0.0).sum(dim=-1).clamp_min(0.0)


def divergence(
    p: Tensor,  # [..., V] target probs
    q: Tensor,  # [..., V] draft probs
    kind: str,
    draft_token: Tensor | None = None,  # [...] int64, needed for "draft_tokens"
) -> Tensor:  # [...] float32
    """Divergence between target ``p`` and draft ``q`` over the last dim, computed in float32.

    * ``kl``: KL(q‖p) = Σ q log(q/p) (draft‖target, the reference code's "candidate‖target"). Where
      ``q > 0`` and ``p = 0`` it is +inf — mathematically right, and an infinite divergence never passes a
      finite threshold, which is the right decision. Never NaN.
    * ``reverse_kl``: KL(p‖q), +inf where ``p > 0`` and ``q = 0``.
    * ``js``: ½KL(p‖m) + ½KL(q‖m), m = (p+q)/2, natural log, always finite and in [0, ln 2].
    * ``tv``: ½Σ|p − q|, in [0, 1].
    * ``draft_tokens``: |p(x) − q(x)| at the drafted token x.

    Tiny negative values from rounding are clamped to 0.
    """
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
    # draft_tokens
    if draft_token is None:
        raise ValueError("divergence 'draft_tokens' needs draft_token (the drafted token ids)")
    if tuple(draft_token.shape) != tuple(p.shape[:-1]):
        raise ValueError(
            f"draft_token must have shape {tuple(p.shape[:-1])}, got {tuple(draft_token.shape)}"
        )
    index = draft_token.long().unsqueeze(-1)
    return (p.gather(-1, index) - q.gather(-1, index)).abs().squeeze(-1)


def divergence_from_logits(
    target_logits: Tensor,  # [..., V] logits of p (any float dtype; computed in float32)
    draft_logits: Tensor,  # [..., V] logits of q
    kind: str,
    draft_token: Tensor | None = None,  # [...] int64, needed for "draft_tokens"
) -> Tensor:  # [...] float32
    """:func:`divergence` of ``softmax(target_logits)`` and ``softmax(draft_logits)``, via log-softmax (the KL
    terms use log-probabilities directly: accurate for tiny probabilities, and no log of a zero)."""
    if kind not in DIVERGENCES:
        raise ValueError(f"unknown divergence {kind!r}; expected one of {DIVERGENCES}")
    log_p = torch.log_softmax(target_logits.float(), dim=-1)
    log_q = torch.log_softmax(draft_logits.float(), dim=-1)
    if kind in ("kl", "reverse_kl"):
        log_a, log_b = (log_q, log_p) if kind == "kl" else (log_p, log_q)
        a = log_a.exp()
        # a = 0 terms are 0 (also where both log-probs are -inf); a > 0 with b = 0 gives +inf.
        return torch.where(a > 0, a * (log_a - log_b), 0.0).sum(dim=-1).clamp_min(0.0)
    return divergence(log_p.exp(), log_q.exp(), kind, draft_token)


@dataclass
class VerifyResult:
    """Outcome of one verify block for a batch of B rows (ragged: row b emits num_accepted[b] + 1 tokens)."""

    num_accepted: Tensor  # [B] int64 in 0..k_b: length of the accepted draft prefix
    next_token: Tensor  # [B] int64: recovered token at the first rejection, or the bonus token if all k_b accepted
    fuzzy_accepted: Tensor  # [B, k] bool: accepted only because D <= T (standard test alone would reject)
    distortion: Tensor  # [B, k] float32: TV(emitted law, p) at reached drafted positions, else 0
    divergence: Tensor  # [B, k] float32: the D values where computed (see the module docstring), NaN elsewhere

    def emitted_tokens(self, draft_tokens: Tensor) -> list[list[int]]:  # draft_tokens [B, k]
        """Per row: the accepted drafts followed by ``next_token``."""
        counts = self.num_accepted.tolist()
        drafts = draft_tokens.tolist()
        nexts = self.next_token.tolist()
        return [row[:n] + [nxt] for row, n, nxt in zip(drafts, counts, nexts, strict=True)]


def _per_row_threshold(threshold: float | Tensor, batch: int, device: torch.device) -> Tensor:  # -> [B]
    t = torch.as_tensor(threshold, dtype=torch.float32).cpu()  # validated on the host (a caller's host tensor: no sync)
    if t.dim() == 0:
        t = t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(f"threshold must be a float or a [{batch}] tensor, got shape {tuple(t.shape)}")
    bad = ~torch.isfinite(t) | (t < 0)
    if bool(bad.any()):
        shown = threshold if not isinstance(threshold, Tensor) else t[bad].tolist()
        raise ValueError(f"threshold must be finite and >= 0, got {shown!r}")
    return t.to(device)


def _per_row_greedy(greedy: bool | Tensor, batch: int, device: torch.device) -> Tensor:  # -> [B] bool
    g = torch.as_tensor(greedy, dtype=torch.bool)
    if g.dim() == 0:
        g = g.expand(batch)
    if g.shape != (batch,):
        raise ValueError(f"greedy must be a bool or a [{batch}] bool tensor, got shape {tuple(g.shape)}")
    return g.to(device)


def _per_row_lengths(draft_lengths: Tensor | Sequence[int] | None, batch: int, k: int) -> list[int]:
    if draft_lengths is None:
        return [k] * batch
    lengths = [int(n) for n in (draft_lengths.tolist() if isinstance(draft_lengths, Tensor) else draft_lengths)]
    if len(lengths) != batch or any(not 0 <= n <= k for n in lengths):
        raise ValueError(f"draft_lengths must be {batch} integers in [0, {k}], got {lengths!r}")
    return lengths


def _check_inputs(
    target_probs: Tensor, draft_probs: Tensor, draft_tokens: Tensor, div: str, rule: str
) -> tuple[int, int, int]:
    if div not in DIVERGENCES:
        raise ValueError(f"unknown divergence {div!r}; expected one of {DIVERGENCES}")
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; expected one of {RULES}")
    if draft_probs.dim() != 3:
        raise ValueError(f"draft_probs must be [B, k, V], got shape {tuple(draft_probs.shape)}")
    batch, k, vocab = draft_probs.shape
    if k < 1:
        raise ValueError(f"need at least one drafted token per row, got k={k}")
    if tuple(target_probs.shape) != (batch, k + 1, vocab):
        raise ValueError(
            f"target_probs must be [B, k+1, V] = {(batch, k + 1, vocab)} for draft_probs "
            f"{tuple(draft_probs.shape)}, got {tuple(target_probs.shape)}"
        )
    if tuple(draft_tokens.shape) != (batch, k):
        raise ValueError(f"draft_tokens must be [B, k] = {(batch, k)}, got {tuple(draft_tokens.shape)}")
    if draft_tokens.dtype.is_floating_point or draft_tokens.dtype == torch.bool:
        raise ValueError(f"draft_tokens must be integer token ids, got dtype {draft_tokens.dtype}")
    low, high = (int(v) for v in torch.stack(draft_tokens.aminmax()).tolist())  # one host sync
    if low < 0 or high >= vocab:
        raise ValueError(f"draft_tokens must lie in [0, {vocab}), got values in [{low}, {high}]")
    return batch, k, vocab


def draw_block_uniforms(
    draft_lengths: Sequence[int],  # [B] k_b per row
    k: int,  # the block width (max k_b)
    generator: GeneratorArg,
    device: torch.device | str,
) -> Tensor:  # [B, k+1]: [:, :k_b] acceptance tests, [:, k] recovered/bonus draw
    """The uniforms one verify block needs: ``k_b + 1`` per row, drawn from the row's own generator when
    ``generator`` is a sequence (so the amount a row draws depends on its own k only); else ``[B, k+1]``."""
    if generator is None or isinstance(generator, torch.Generator):
        return draw_uniforms((len(draft_lengths), k + 1), generator, device)
    generators = list(generator)
    if len(generators) != len(draft_lengths):
        raise ValueError(f"got {len(generators)} generators for {len(draft_lengths)} rows; need one per row")
    out = torch.zeros(len(draft_lengths), k + 1)
    for b, (n, g) in enumerate(zip(draft_lengths, generators, strict=True)):
        row = torch.rand(n + 1, generator=g, device=g.device if g is not None else "cpu").cpu()
        out[b, :n] = row[:n]
        out[b, k] = row[n]
    return out.to(device)  # one copy for the whole block


def verify_block(
    target_probs: Tensor,  # [B, k+1, V]; position k is the bonus position
    draft_probs: Tensor,  # [B, k, V]
    draft_tokens: Tensor,  # [B, k] int64, x_i drawn from draft_probs[:, i]
    threshold: float | Tensor,  # float or [B] per-row fuzzy threshold T >= 0
    div: str = "kl",
    rule: str = "reducible",
    generator: GeneratorArg = None,  # one generator, one per row (row b draws only from its own), or None
    greedy: bool | Tensor = False,  # bool or [B] bool: rows decoded at temperature 0
    *,
    draft_lengths: Tensor | Sequence[int] | None = None,  # [B] k_b in 0..k (None: k for every row)
    target_div_logits: Tensor | None = None,  # [B, >=k, V] logits D is measured on (None: target_probs)
    draft_div_logits: Tensor | None = None,  # [B, k, V] logits D is measured on (None: draft_probs)
    uniforms: Tensor | None = None,  # [B, k+1] pre-drawn (layout of draw_block_uniforms); replaces generator
) -> VerifyResult:
    """Verify one block of drafted tokens per row by the FSD rule (see the module docstring)."""
    batch, k, _ = _check_inputs(target_probs, draft_probs, draft_tokens, div, rule)
    if (target_div_logits is None) != (draft_div_logits is None):
        raise ValueError("pass both target_div_logits and draft_div_logits, or neither")
    if (
        draft_div_logits is not None
        and target_div_logits is not None
        and (draft_div_logits.shape != draft_probs.shape or target_div_logits.shape[-1] != draft_probs.shape[-1])
    ):
        raise ValueError(
            f"divergence logits must match the probs: draft {tuple(draft_div_logits.shape)} vs "
            f"{tuple(draft_probs.shape)}, target {tuple(target_div_logits.shape)}"
        )
    device = target_probs.device
    thresholds = _per_row_threshold(threshold, batch, torch.device("cpu"))
    any_fuzzy = bool((thresholds > 0).any())  # host decision: with every T = 0 no divergence is computed
    thresholds = thresholds.to(device)
    greedy_rows = _per_row_greedy(greedy, batch, device)
    lengths = _per_row_lengths(draft_lengths, batch, k)
    if uniforms is None:
        uniforms = draw_block_uniforms(lengths, k, generator, device)
    elif tuple(uniforms.shape) != (batch, k + 1):
        raise ValueError(f"uniforms must be [B, k+1] = {(batch, k + 1)}, got {tuple(uniforms.shape)}")
    return _verify_block_from_uniforms(
        target_probs, draft_probs, draft_tokens, thresholds, greedy_rows, div, rule, uniforms.to(device),
        draft_lengths=None if draft_lengths is None else torch.tensor(lengths, device=device),
        target_div_logits=target_div_logits, draft_div_logits=draft_div_logits, any_fuzzy=any_fuzzy,
    )


def _divergence_at(
    where: Tensor,  # [B, k] bool: positions to compute
    out: Tensor,  # [B, k] float32, written in place at `where`
    p: Tensor, q: Tensor,  # [B, k, V] the truncated probs (used without div logits)
    x: Tensor,  # [B, k] drafted tokens
    target_div_logits: Tensor | None, draft_div_logits: Tensor | None,
    div: str,
) -> None:
    rows, cols = where.nonzero(as_tuple=True)  # one host sync
    if rows.numel() == 0:
        return
    if target_div_logits is not None and draft_div_logits is not None:
        values = divergence_from_logits(target_div_logits[rows, cols], draft_div_logits[rows, cols], div, x[rows, cols])
    else:
        values = divergence(p[rows, cols], q[rows, cols], div, x[rows, cols])
    out[rows, cols] = values


def _verify_block_from_uniforms(
    target_probs: Tensor,  # [B, k+1, V]
    draft_probs: Tensor,  # [B, k, V]
    draft_tokens: Tensor,  # [B, k] int64
    thresholds: Tensor,  # [B] float32, validated
    greedy_rows: Tensor,  # [B] bool
    div: str,
    rule: str,
    uniforms: Tensor,  # [B, k+1] in [0, 1): [:, :k_b] acceptance tests, [:, k] recovered/bonus draw
    draft_lengths: Tensor | None = None,  # [B] int64 k_b on the same device (None: all k)
    target_div_logits: Tensor | None = None,  # [B, >=k, V]
    draft_div_logits: Tensor | None = None,  # [B, k, V]
    any_fuzzy: bool = True,  # False: the caller knows every threshold is 0 (skips D and distortion, no sync)
) -> VerifyResult:
    """Vectorised verify: no loop over rows or positions."""
    p_all = target_probs.float()
    q = draft_probs.float()
    batch, k, _ = q.shape
    device = p_all.device
    p = p_all[:, :k]  # [B, k, V]
    x = draft_tokens.long()  # [B, k]
    rows = torch.arange(batch, device=device)
    positions = torch.arange(k, device=device).unsqueeze(0)  # [1, k]
    lengths = draft_lengths if draft_lengths is not None else torch.full((batch,), k, device=device)
    in_block = positions < lengths.unsqueeze(1)  # [B, k]
    t = thresholds.unsqueeze(1)  # [B, 1]
    g = greedy_rows.unsqueeze(1)  # [B, 1]

    p_x = p.gather(-1, x.unsqueeze(-1)).squeeze(-1)  # [B, k]
    q_x = q.gather(-1, x.unsqueeze(-1)).squeeze(-1)  # [B, k]
    target_argmax = p.argmax(dim=-1)  # [B, k]
    # u < p/q without dividing (q_x = 0 with p_x > 0 accepts; p_x = 0 never does).
    standard_ok = torch.where(g, x == target_argmax, uniforms[:, :k] * q_x < p_x) & in_block  # [B, k]

    # D only where the fuzzy branch can change the decision: T > 0 and the standard test rejected (pure:
    # the standard test decides nothing for sampled rows, so every in-block position).
    fuzzy_possible = in_block & (t > 0)  # [B, k]
    decides = standard_ok if rule == "reducible" else (g & standard_ok)
    d = torch.full((batch, k), math.nan, device=device)
    if any_fuzzy:
        _divergence_at(fuzzy_possible & ~decides, d, p, q, x, target_div_logits, draft_div_logits, div)
    fuzzy = (d <= t) & fuzzy_possible  # NaN (not computed) compares False

    # pure: only the fuzzy test, except that greedy rows also accept x == argmax p (rejecting it would emit
    # that very token, so accepting changes nothing but the speed).
    accept = (standard_ok | fuzzy) if rule == "reducible" else (fuzzy | (g & standard_ok))  # [B, k]
    num_accepted = torch.cumprod(accept.long(), dim=1).sum(dim=1)  # [B]
    emitted = positions < num_accepted.unsqueeze(1)  # [B, k] accepted drafts
    reached = (positions <= num_accepted.unsqueeze(1)) & in_block  # [B, k] accepted or recovered position

    # Recovered / bonus token at position j = num_accepted (the bonus when j = k_b).
    p_j = p_all[rows, num_accepted]  # [B, V]
    q_j = q[rows, num_accepted.clamp(max=k - 1)]  # [B, V] (unused for bonus rows)
    use_residual = (num_accepted < lengths) & (rule == "reducible")  # [B]
    residual = (p_j - q_j).clamp_min(0.0)
    has_mass = residual.sum(dim=-1) > 0
    weights = torch.where((use_residual & has_mass).unsqueeze(1), residual, p_j)
    sampled_next = sample_from_uniforms(weights, uniforms[:, k])
    next_token = torch.where(greedy_rows, p_j.argmax(dim=-1), sampled_next)

    fuzzy_accepted = emitted & fuzzy & ~standard_ok
    distortion = torch.zeros(batch, k, device=device)
    # Greedy rows: the emitted point mass differs from argmax p exactly at fuzzy-accepted positions.
    distortion = torch.where(g & fuzzy_accepted, 1.0, distortion)
    sampled_charge = fuzzy_possible & ~g & reached  # [B, k] positions whose law may differ from p
    if not any_fuzzy:
        pass
    elif div == "draft_tokens":
        _draft_token_distortion(sampled_charge, distortion, p, q, t, target_div_logits, draft_div_logits, rule)
    else:
        # F is the same for every drafted token: the law is q where D <= T (always accepted), else p. A
        # standard-accepted position still needs D to know which.
        _divergence_at(sampled_charge & emitted & torch.isnan(d), d, p, q, x, target_div_logits, draft_div_logits, div)
        charged = sampled_charge & emitted & (d <= t)
        rows_c, cols_c = charged.nonzero(as_tuple=True)
        if rows_c.numel():
            distortion[rows_c, cols_c] = divergence(p[rows_c, cols_c], q[rows_c, cols_c], "tv")
    return VerifyResult(
        num_accepted=num_accepted,
        next_token=next_token,
        fuzzy_accepted=fuzzy_accepted,
        distortion=distortion,
        divergence=d,
    )


def _fuzzy_tokens(
    target: Tensor, draft: Tensor, threshold: Tensor, from_logits: bool
) -> Tensor:  # [N, V] bool: tokens y with |P(y) - Q(y)| <= T (draft_tokens)
    if from_logits:
        target, draft = torch.softmax(target.float(), dim=-1), torch.softmax(draft.float(), dim=-1)
    return (target.float() - draft.float()).abs() <= threshold.unsqueeze(-1)


def _emitted_law_tv(
    p: Tensor, q: Tensor, fuzzy_tokens: Tensor, rule: str  # [N, V], [N, V], [N, V] bool
) -> Tensor:  # [N] TV(emitted law, p) of a position whose fuzzy set is `fuzzy_tokens` (module docstring)
    if rule == "reducible":
        return torch.where(fuzzy_tokens, (q - p).clamp_min(0.0), 0.0).sum(dim=-1)
    q_fuzzy = torch.where(fuzzy_tokens, q, 0.0)
    return 0.5 * (q_fuzzy - q_fuzzy.sum(dim=-1, keepdim=True) * p).abs().sum(dim=-1)


def _draft_token_distortion(
    charge: Tensor,  # [B, k] bool positions to charge
    out: Tensor,  # [B, k] written in place
    p: Tensor, q: Tensor,  # [B, k, V]
    t: Tensor,  # [B, 1]
    target_div_logits: Tensor | None, draft_div_logits: Tensor | None,
    rule: str,
) -> None:
    rows, cols = charge.nonzero(as_tuple=True)
    if rows.numel() == 0:
        return
    if target_div_logits is not None and draft_div_logits is not None:
        fuzzy = _fuzzy_tokens(target_div_logits[rows, cols], draft_div_logits[rows, cols], t[rows, 0], True)
    else:
        fuzzy = _fuzzy_tokens(p[rows, cols], q[rows, cols], t[rows, 0], False)
    out[rows, cols] = _emitted_law_tv(p[rows, cols], q[rows, cols], fuzzy, rule)


def _verify_block_reference(
    target_probs: Tensor,  # [B, k+1, V]
    draft_probs: Tensor,  # [B, k, V]
    draft_tokens: Tensor,  # [B, k] int64
    thresholds: Tensor,  # [B] float32
    greedy_rows: Tensor,  # [B] bool
    div: str,
    rule: str,
    uniforms: Tensor,  # [B, k+1]
    draft_lengths: Tensor | None = None,  # [B]
    target_div_logits: Tensor | None = None,  # [B, >=k, V]
    draft_div_logits: Tensor | None = None,  # [B, k, V]
) -> VerifyResult:
    """Slow, obviously-correct verify: Python loops over rows and positions, replaying ``uniforms``; the
    emitted law of every reached position is built explicitly and its TV to p charged."""
    batch, k, vocab = draft_probs.shape
    num_accepted = torch.zeros(batch, dtype=torch.long)
    next_token = torch.zeros(batch, dtype=torch.long)
    fuzzy_accepted = torch.zeros(batch, k, dtype=torch.bool)
    distortion = torch.zeros(batch, k, dtype=torch.float32)
    d_all = torch.zeros(batch, k, dtype=torch.float32)

    def argmax(dist: list[float]) -> int:
        return max(range(len(dist)), key=lambda i: (dist[i], -i))  # first index of the max

    def inverse_cdf(weights: list[float], u: float) -> int:
        total = sum(weights)  # sequential, like the fast path's cumsum
        target, acc, last = u * total, 0.0, 0
        for token, w in enumerate(weights):
            if w > 0:
                last = token
            acc += w
            if target < acc:
                return token
        return last

    def div_sources(b: int, i: int) -> tuple[Tensor, Tensor]:
        if target_div_logits is None or draft_div_logits is None:
            return target_probs[b, i].float(), draft_probs[b, i].float()
        return torch.softmax(target_div_logits[b, i].float(), -1), torch.softmax(draft_div_logits[b, i].float(), -1)

    def d_of(b: int, i: int, token: int) -> float:
        big_p, big_q = div_sources(b, i)
        return float(divergence(big_p, big_q, div, torch.tensor(token)))

    def emitted_law(b: int, i: int, t: float) -> Tensor:  # [V] float64
        p_i, q_i = target_probs[b, i].double(), draft_probs[b, i].double()
        if div == "draft_tokens":
            fuzzy = [t > 0 and d_of(b, i, y) <= t for y in range(vocab)]
        else:
            fuzzy = [t > 0 and d_of(b, i, 0) <= t] * vocab
        if not any(fuzzy):
            return p_i  # exact (reducible: the standard argument; pure: rejected, drawn from p)
        if all(fuzzy):
            return q_i
        accept = torch.tensor(
            [1.0 if f else (min(1.0, float(p_i[y] / q_i[y])) if q_i[y] > 0 else 0.0) for y, f in enumerate(fuzzy)]
            if rule == "reducible" else [float(f) for f in fuzzy],
            dtype=torch.float64,
        )
        accepted = q_i * accept
        rest = 1.0 - float(accepted.sum())
        if rule == "reducible":
            residual = (p_i - q_i).clamp_min(0.0)
            fallback = residual / residual.sum() if float(residual.sum()) > 0 else p_i
        else:
            fallback = p_i
        return accepted + rest * fallback

    for b in range(batch):
        t = float(thresholds[b])
        is_greedy = bool(greedy_rows[b])
        k_b = k if draft_lengths is None else int(draft_lengths[b])
        for i in range(k):  # D for every drafted position (the fast path computes a subset)
            d_all[b, i] = d_of(b, i, int(draft_tokens[b, i]))
        n = 0
        for i in range(k_b):
            p_i = target_probs[b, i].float()
            q_i = draft_probs[b, i].float()
            x = int(draft_tokens[b, i])
            d = float(d_all[b, i])
            fuzzy = t > 0 and d <= t
            if is_greedy:
                standard = x == argmax(p_i.tolist())
            else:
                p_x, q_x = float(p_i[x]), float(q_i[x])
                ratio = p_x / q_x if q_x > 0 else (math.inf if p_x > 0 else 0.0)
                standard = float(uniforms[b, i]) < ratio  # u < min(1, p/q) as u < 1
            if not is_greedy and t > 0:  # the law at a reached position (accepted or recovered)
                distortion[b, i] = 0.5 * float((emitted_law(b, i, t) - p_i.double()).abs().sum())
            accepted = (standard or fuzzy) if (rule == "reducible" or is_greedy) else fuzzy
            if not accepted:
                break
            n += 1
            if fuzzy and not standard:
                fuzzy_accepted[b, i] = True
                if is_greedy:
                    distortion[b, i] = 1.0
        num_accepted[b] = n
        p_j = target_probs[b, n].float()
        if is_greedy:
            next_token[b] = argmax(p_j.tolist())
            continue
        weights = p_j
        if n < k_b and rule == "reducible":
            residual = (p_j - draft_probs[b, n].float()).clamp_min(0.0)
            if float(residual.sum()) > 0:
                weights = residual
        next_token[b] = inverse_cdf(weights.double().tolist(), float(uniforms[b, k]))
    return VerifyResult(
        num_accepted=num_accepted,
        next_token=next_token,
        fuzzy_accepted=fuzzy_accepted,
        distortion=distortion,
        divergence=d_all,
    )
