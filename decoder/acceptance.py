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
equals ``argmax p_i`` would emit that same token anyway. ``D`` is computed on the probs as given (the
engine passes temperature-1 probs for greedy rows).

Where FSD departs from standard speculative sampling, and the distortion accounting
-----------------------------------------------------------------------------------
Conditioned on the prefix, the token emitted at a block position is distributed as:

* ``q_i`` where the fuzzy branch is active (such a position is always accepted, and the accepted token was
  drawn from ``q_i``);
* exactly ``p_i`` everywhere else (the standard accept/residual argument for ``reducible``; a direct draw
  from ``p`` for ``pure``, whose non-fuzzy positions are always rejected).

So the exact total-variation distance between what is emitted at position ``i`` and the target is
``TV(p_i, q_i) * 1[fuzzy_i]`` for sampled rows, and ``1[x_i != argmax p_i] * 1[fuzzy_i]`` for greedy rows
(the TV between the emitted point mass and the target's greedy choice). ``VerifyResult.distortion``
reports it for every emitted accepted position (recovered and bonus tokens are exact: 0). By the chain
rule for total variation (a hybrid argument), the TV between the law of FSD's whole output sequence and
the target's is at most ``E[sum over emitted positions of TV(emitted law, p | prefix)]``, the expectation
taken over FSD's own outputs; the realised running sum of ``distortion`` is an unbiased estimate of that
bound, and is the quality signal the controller uses.

Randomness and the reference implementation
-------------------------------------------
:func:`verify_block` draws ``k + 1`` uniforms per row (``k`` acceptance tests, one for the
recovered/bonus draw, via :func:`decoder.sampling.draw_uniforms`; a greedy row draws them too, so the
amount drawn never depends on data) and hands them to :func:`_verify_block_from_uniforms`. The slow
:func:`_verify_block_reference` replays the same uniforms with Python loops; tests compare the two.
"""

from __future__ import annotations

import math
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


@dataclass
class VerifyResult:
    """Outcome of one verify block for a batch of B rows (ragged: row b emits num_accepted[b] + 1 tokens)."""

    num_accepted: Tensor  # [B] int64 in 0..k: length of the accepted draft prefix
    next_token: Tensor  # [B] int64: recovered token at the first rejection, or the bonus token if all k accepted
    fuzzy_accepted: Tensor  # [B, k] bool: accepted only because D <= T (standard test alone would reject)
    distortion: Tensor  # [B, k] float32: per-position TV to the target at emitted accepted positions, else 0
    divergence: Tensor  # [B, k] float32: the D values

    def emitted_tokens(self, draft_tokens: Tensor) -> list[list[int]]:  # draft_tokens [B, k]
        """Per row: the accepted drafts followed by ``next_token``."""
        counts = self.num_accepted.tolist()
        drafts = draft_tokens.tolist()
        nexts = self.next_token.tolist()
        return [row[:n] + [nxt] for row, n, nxt in zip(drafts, counts, nexts, strict=True)]


def _per_row_threshold(threshold: float | Tensor, batch: int, device: torch.device) -> Tensor:  # -> [B]
    t = torch.as_tensor(threshold, dtype=torch.float32)
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


def verify_block(
    target_probs: Tensor,  # [B, k+1, V]; position k is the bonus position
    draft_probs: Tensor,  # [B, k, V]
    draft_tokens: Tensor,  # [B, k] int64, x_i drawn from draft_probs[:, i]
    threshold: float | Tensor,  # float or [B] per-row fuzzy threshold T >= 0
    div: str = "kl",
    rule: str = "reducible",
    generator: GeneratorArg = None,  # one generator, one per row (row b draws only from its own), or None
    greedy: bool | Tensor = False,  # bool or [B] bool: rows decoded at temperature 0
) -> VerifyResult:
    """Verify one block of k drafted tokens per row by the FSD rule (see the module docstring)."""
    batch, k, _ = _check_inputs(target_probs, draft_probs, draft_tokens, div, rule)
    device = target_probs.device
    thresholds = _per_row_threshold(threshold, batch, device)
    greedy_rows = _per_row_greedy(greedy, batch, device)
    uniforms = draw_uniforms((batch, k + 1), generator, device)  # [B, k+1]
    return _verify_block_from_uniforms(
        target_probs, draft_probs, draft_tokens, thresholds, greedy_rows, div, rule, uniforms
    )


def _verify_block_from_uniforms(
    target_probs: Tensor,  # [B, k+1, V]
    draft_probs: Tensor,  # [B, k, V]
    draft_tokens: Tensor,  # [B, k] int64
    thresholds: Tensor,  # [B] float32, validated
    greedy_rows: Tensor,  # [B] bool
    div: str,
    rule: str,
    uniforms: Tensor,  # [B, k+1] in [0, 1): [:, :k] acceptance tests, [:, k] recovered/bonus draw
) -> VerifyResult:
    """Vectorised verify: no loop over rows or positions."""
    p_all = target_probs.float()
    q = draft_probs.float()
    batch, k, _ = q.shape
    p = p_all[:, :k]  # [B, k, V]
    x = draft_tokens.long()  # [B, k]
    rows = torch.arange(batch, device=p.device)

    d = divergence(p, q, div, x)  # [B, k]
    t = thresholds.unsqueeze(1)  # [B, 1]
    fuzzy = (d <= t) & (t > 0)  # [B, k]

    p_x = p.gather(-1, x.unsqueeze(-1)).squeeze(-1)  # [B, k]
    q_x = q.gather(-1, x.unsqueeze(-1)).squeeze(-1)  # [B, k]
    target_argmax = p.argmax(dim=-1)  # [B, k]
    g = greedy_rows.unsqueeze(1)  # [B, 1]
    # u < p/q without dividing (q_x = 0 with p_x > 0 accepts; p_x = 0 never does).
    standard_ok = torch.where(g, x == target_argmax, uniforms[:, :k] * q_x < p_x)  # [B, k]

    # pure: only the fuzzy test, except that greedy rows also accept x == argmax p (rejecting it would emit
    # that very token, so accepting changes nothing but the speed).
    accept = (standard_ok | fuzzy) if rule == "reducible" else (fuzzy | (g & standard_ok))  # [B, k]

    num_accepted = torch.cumprod(accept.long(), dim=1).sum(dim=1)  # [B]
    emitted = torch.arange(k, device=p.device).unsqueeze(0) < num_accepted.unsqueeze(1)  # [B, k]

    # Recovered / bonus token at position j = num_accepted.
    p_j = p_all[rows, num_accepted]  # [B, V]
    q_j = q[rows, num_accepted.clamp(max=k - 1)]  # [B, V] (unused for bonus rows)
    use_residual = (num_accepted < k) & (rule == "reducible")  # [B]
    residual = (p_j - q_j).clamp_min(0.0)
    has_mass = residual.sum(dim=-1) > 0
    weights = torch.where((use_residual & has_mass).unsqueeze(1), residual, p_j)
    sampled_next = sample_from_uniforms(weights, uniforms[:, k])
    next_token = torch.where(greedy_rows, p_j.argmax(dim=-1), sampled_next)

    fuzzy_accepted = emitted & fuzzy & ~standard_ok
    charged = emitted & fuzzy  # [B, k]
    if div != "tv" and not bool(charged.any()):
        distortion = torch.zeros_like(d)  # skip a pass over [B, k, V] in the common T = 0 case
    else:
        tv = d if div == "tv" else divergence(p, q, "tv")
        per_position = torch.where(g, (x != target_argmax).float(), tv)
        distortion = torch.where(charged, per_position, torch.zeros_like(per_position))
    return VerifyResult(
        num_accepted=num_accepted,
        next_token=next_token,
        fuzzy_accepted=fuzzy_accepted,
        distortion=distortion,
        divergence=d,
    )


def _verify_block_reference(
    target_probs: Tensor,  # [B, k+1, V]
    draft_probs: Tensor,  # [B, k, V]
    draft_tokens: Tensor,  # [B, k] int64
    thresholds: Tensor,  # [B] float32
    greedy_rows: Tensor,  # [B] bool
    div: str,
    rule: str,
    uniforms: Tensor,  # [B, k+1]
) -> VerifyResult:
    """Slow, obviously-correct verify: Python loops over rows and positions, replaying ``uniforms``."""
    batch, k, _ = draft_probs.shape
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

    for b in range(batch):
        t = float(thresholds[b])
        is_greedy = bool(greedy_rows[b])
        for i in range(k):  # D is reported for every drafted position, accepted or not
            d_all[b, i] = float(divergence(target_probs[b, i], draft_probs[b, i], div, draft_tokens[b, i]))
        n = 0
        for i in range(k):
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
            accepted = (standard or fuzzy) if (rule == "reducible" or is_greedy) else fuzzy
            if not accepted:
                break
            n += 1
            if fuzzy and not standard:
                fuzzy_accepted[b, i] = True
            if fuzzy:
                distortion[b, i] = float(x != argmax(p_i.tolist())) if is_greedy else float(
                    divergence(p_i, q_i, "tv")
                )
        num_accepted[b] = n
        p_j = target_probs[b, n].float()
        if is_greedy:
            next_token[b] = argmax(p_j.tolist())
            continue
        weights = p_j
        if n < k and rule == "reducible":
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
