"""The FSD engine: continuous-batching speculative decoding with a per-iteration step API.

One iteration (:meth:`FSDEngine.step`) over the running rows:

1. **Admit** waiting requests up to ``max_batch_size``: prefill the joining prompts together on both models
   (the draft all but the last token; the target too, except into an idle engine, where it sees the whole
   prompt and keeps its last logits for the first token), then merge their KV into the batch caches
   (:mod:`decoder.kv_cache`).
2. **Draft** ``k_b`` tokens for each row b (its own draft length, 0 included) with ``max k_b`` batched
   single-position draft forwards; a row that has drafted its k_b feeds padding. The first forward also
   feeds what the draft has not seen yet (the last emitted token, plus the last draft token when the
   previous block was fully accepted; more after steps without any draft forward), left-padded per row.
   When every row has k_b = 0 no draft forward runs at all.
3. **Verify** with one target forward over ``k_b + 1`` positions per row (right-padded to ``max k_b + 1``):
   the token the target has not seen (the last emitted one) and the row's drafts. A row that joined an idle
   engine has its whole prompt in the target cache: in its first iteration it feeds only its drafts and
   verifies the first one against the logits kept from the prefill, so a step of such rows at k = 0 runs
   no forward at all (plain decoding at batch 1 pays one forward per token, prefill included, like the
   target alone).
   :func:`decoder.acceptance.verify_block` decides, per row at that row's own threshold T, how many drafts
   are accepted and the next token. A row with k_b = 0 is plain target decoding.
4. **Roll back** both caches: rejected slots become holes in the attention mask (nothing is
   re-encoded); slots no row keeps are cropped; holes are compacted away when they pile up.
5. Emit tokens, apply eos / stop strings / ``max_new_tokens``; finished rows leave the batch.

Invariants per running row: the target cache holds every token of the sequence except the last one
(``pending``) — except before the first iteration of a row that joined an idle engine, when it holds the
whole prompt and ``prefill_logits`` are the target's logits after it; the draft cache holds every token except ``draft_unseen``.

Shared KV (``share_kv``; by default where the pair's draft is a copy of the target's weights, e.g. the default
pair's int8 draft of its fp32 target): the draft keeps no cache. Its forwards run on the target's cache, as in
QSpec (Zhao et al., 2024), writing ``pending`` and its drafts after the sequence; those k slots are cropped
before the verify forward, which writes the target's own. The draft then never prefills and never catches up
on tokens emitted at k = 0, so switching a row between k = 0 and k > 0 costs nothing; its proposals are the
draft's next-token distributions given the target's keys and values, and verification keeps T = 0 exact for
any proposal distribution. Rows that join an idle engine prefeed their whole prompt only when none drafts.

Sampling: each request has its own ``torch.Generator`` (seeded from ``SamplingParams.seed``, else from
the engine's generator at admission), and every draw for a row comes from that generator alone: ``2 k_b
+ 1`` uniforms per step (k_b draft draws, k_b acceptance tests, one recovered/bonus draw), drawn at once.
k_b is the row's own draft length capped by the row's own context room, never by the batch, so a seeded
request produces the same tokens whatever else shares its batch.

Divergences are measured on the temperature-scaled, untruncated logits (temperature 1 for greedy rows);
the acceptance test, residual and distortion use the top-k / top-p-truncated probabilities (see
:mod:`decoder.acceptance`). No divergence is computed in a step where every drafting row has T = 0.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from decoder.acceptance import DIVERGENCES, RULES, verify_block
from decoder.kv_cache import BatchKVCache
from decoder.sampling import greedy as greedy_token
from decoder.sampling import sample_from_uniforms, sampling_probs

__all__ = [
    "DIVERGENCES",
    "RULES",
    "FSDEngine",
    "RequestOutput",
    "RowStats",
    "SamplingParams",
    "StepStats",
    "default_share_kv",
]

FINISH_REASONS = ("stop", "length", "abort")

# Compact a cache when its holes exceed this fraction of its slots (and at least _MIN_HOLES).
_COMPACT_HOLE_FRACTION = 0.25
_MIN_HOLES = 64
# Output tokens kept in the decoded window of the incremental stop-string check, beyond the longest stop
# string (slack for tokenizers whose decoding of a token depends on its neighbours).
_STOP_WINDOW_TOKENS = 8
# A row at k = 0 rides along in other rows' first draft forward while its draft backlog is this short.
_MAX_PASSIVE_UNSEEN = 2


class PairLike(Protocol):
    """What the engine needs from a model pair (``decoder.models.ModelPair`` satisfies it)."""

    target: Any
    draft: Any
    tokenizer: Any
    max_context: int
    eos_token_ids: tuple[int, ...]


@dataclass
class SamplingParams:
    """Per-request decoding parameters. :meth:`validate` raises ValueError naming a bad value."""

    temperature: float = 1.0  # 0 => greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()  # output is truncated before the first stop string
    eos_token_ids: tuple[int, ...] | None = None  # None => the pair's eos ids; () => ignore eos
    seed: int | None = None  # per-request generator => reproducible

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        if not isinstance(self.temperature, int | float) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be an integer > 0, got {self.max_new_tokens!r}")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a sequence of non-empty strings, got {self.stop!r}")
        if self.eos_token_ids is not None and any(not isinstance(t, int) or t < 0 for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be non-negative integers, got {self.eos_token_ids!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")


@dataclass
class RowStats:
    """One request in one iteration."""

    request_id: str
    new_token_ids: list[int]
    drafted: int  # draft tokens proposed that could still be emitted (<= k)
    accepted: int  # of those, accepted (exactly or fuzzily)
    fuzzy_accepted: int  # accepted only because D <= T
    distortion: float  # sum over emitted positions of TV(p, q) * 1[D <= T]
    threshold: float
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    distorted: int = 0  # emitted positions whose distortion is > 0 (the events the sum is made of)
    draft_length: int = 0  # the k this row used this iteration (0: plain target decoding)


@dataclass
class StepStats:
    """One engine iteration."""

    rows: list[RowStats]
    batch_size: int  # rows drafted/verified this iteration
    draft_length: int  # the largest k of any row this iteration (RowStats.draft_length has each row's)
    draft_time_s: float
    verify_time_s: float
    prefill_time_s: float
    prefill_tokens: int
    #: Of draft_time_s, what the draft's catch-up cost: its first forward fed a backlog (rows that ran
    #: at k = 0 and now draft), less one ordinary draft forward. A one-off, like a prefill: step-time
    #: models and their online corrections leave it out (the SLO policy charges it apart).
    catch_up_time_s: float = 0.0


@dataclass
class RequestOutput:
    """Everything known about a request (running or finished)."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    threshold: float
    drafted: int
    accepted: int
    fuzzy_accepted: int
    distortion: float
    iterations: int

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_distortion(self) -> float:
        """Distortion per generated token (what a quality budget constrains)."""
        return self.distortion / len(self.token_ids) if self.token_ids else 0.0

    @property
    def tokens_per_iteration(self) -> float:
        return len(self.token_ids) / self.iterations if self.iterations else 0.0


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    threshold: float
    eos: frozenset[int]
    generator: torch.Generator
    draft_length: int | None = None  # None: the engine default (num_draft_tokens)
    output_ids: list[int] = field(default_factory=list)
    stop_scan_from: int = 0  # output tokens before this index cannot start a new stop-string match
    stop_text: str | None = None  # the output text cut before the stop string that ended it
    pending: int = -1  # the last token: in the sequence, not yet in the target cache (see prefill_logits)
    # Before the first iteration: the target's logits [V] after the whole prompt, which the target cache
    # then holds, pending included. None afterwards.
    prefill_logits: torch.Tensor | None = None
    draft_unseen: list[int] = field(default_factory=list)  # in the sequence, not yet in the draft cache
    finished: bool = False
    finish_reason: str | None = None
    drafted: int = 0
    accepted: int = 0
    fuzzy_accepted: int = 0
    distortion: float = 0.0
    iterations: int = 0


def _check_draft_length(k: object) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"draft length (k) must be an integer >= 0, got {k!r}")
    return k


def _check_threshold(threshold: float) -> float:
    try:
        value = float(threshold)
    except (TypeError, ValueError):
        raise ValueError(f"threshold must be a finite number >= 0, got {threshold!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"threshold must be a finite number >= 0, got {threshold!r}")
    return value


_SHARED_KV_FIELDS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim",
                     "rope_theta", "rope_parameters", "rope_scaling", "max_position_embeddings")


def _float_dtype(model: Any) -> torch.dtype:
    """The dtype the model computes in: its first floating parameter's (an int8 dynamic draft keeps fp32 ones)."""
    dtype: torch.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    return dtype


def _kv_mismatch(pair: PairLike) -> str | None:
    """Why the draft cannot run on the target's KV cache (None: it can)."""
    target, draft = pair.target.config.get_text_config(), pair.draft.config.get_text_config()
    for name in _SHARED_KV_FIELDS:
        mine, theirs = getattr(target, name, None), getattr(draft, name, None)
        if mine != theirs:
            return f"target {name}={mine!r}, draft {name}={theirs!r}"
    target_dtype, draft_dtype = _float_dtype(pair.target), _float_dtype(pair.draft)
    if target_dtype != draft_dtype:
        return f"target computes in {target_dtype}, draft in {draft_dtype}"
    return None


def default_share_kv(pair: PairLike) -> bool:
    """Whether an engine over ``pair`` runs the draft on the target's KV cache unless told otherwise."""
    return _resolve_share_kv(pair, None)


def _resolve_share_kv(pair: PairLike, share_kv: bool | None) -> bool:
    """``share_kv`` as given (True checked against the pair), or the pair's default: shared when its draft is a
    copy of the target (``ModelPair.draft_is_target_copy``) that computes in the target's dtype."""
    if share_kv is None:
        return bool(getattr(pair, "draft_is_target_copy", False)) and _kv_mismatch(pair) is None
    if not isinstance(share_kv, bool):
        raise ValueError(f"share_kv must be True, False or None, got {share_kv!r}")
    if share_kv:
        mismatch = _kv_mismatch(pair)
        if mismatch is not None:
            raise ValueError(f"share_kv=True needs a draft with the target's attention layout and dtype: {mismatch}")
    return share_kv


def _num_layers(model: Any) -> int:
    return int(model.config.get_text_config().num_hidden_layers)


class FSDEngine:
    """Continuous-batching fuzzy speculative decoding over a target/draft pair (see module docstring)."""

    def __init__(
        self,
        pair: PairLike,
        *,
        num_draft_tokens: int = 4,
        div: str = "kl",
        rule: str = "reducible",
        max_batch_size: int = 8,
        seed: int = 0,
        share_kv: bool | None = None,
    ) -> None:
        if div not in DIVERGENCES:
            raise ValueError(f"unknown divergence {div!r}; expected one of {', '.join(DIVERGENCES)}")
        if rule not in RULES:
            raise ValueError(f"unknown rule {rule!r}; expected one of {', '.join(RULES)}")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        self.pair = pair
        self.target = pair.target
        self.draft = pair.draft
        self.div = div
        self.rule = rule
        self.max_batch_size = max_batch_size
        self.num_draft_tokens = _check_draft_length(num_draft_tokens)
        self.share_kv = _resolve_share_kv(pair, share_kv)
        self.device = next(self.target.parameters()).device
        self._seed_generator = torch.Generator().manual_seed(seed)
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._requests: dict[str, _Request] = {}
        self._aborted_unreported: list[_Request] = []
        self._draft_fed: list[bool] = []  # per running row: fed to the draft's first forward this step
        self._catch_up_s = 0.0  # this step's draft catch-up (StepStats.catch_up_time_s)
        self._target_cache = self._new_cache(self.target, 0)
        # With share_kv the draft runs on the target's cache and this one stays empty.
        self._draft_cache = self._new_cache(self.draft, 0)

    # ------------------------------------------------------------------ API
    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        threshold: float = 0.0,
        draft_length: int | None = None,
    ) -> None:
        """Queue a request; it joins the batch at the next :meth:`step` with room.

        The prompt plus ``max_new_tokens`` must fit the pair's context (``max_context``), so a request
        never runs out of positions half-way. ``draft_length``: this request's k (>= 0; 0 = plain target
        decoding); None follows the engine default (:meth:`set_draft_length` without an id).
        """
        if draft_length is not None:
            _check_draft_length(draft_length)
        params = params or SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"duplicate request_id {request_id!r}")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError(f"empty prompt for request {request_id!r}")
        vocab = int(self.target.config.get_text_config().vocab_size)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        params.validate()
        if len(prompt) + params.max_new_tokens > self.pair.max_context:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_new_tokens {params.max_new_tokens} exceeds the context "
                f"of {self.pair.max_context} tokens"
            )
        eos = self.pair.eos_token_ids if params.eos_token_ids is None else params.eos_token_ids
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._seed_generator))
        request = _Request(
            request_id=request_id,
            prompt_ids=prompt,
            params=params,
            threshold=_check_threshold(threshold),
            eos=frozenset(eos),
            generator=torch.Generator(device="cpu").manual_seed(seed),
            draft_length=draft_length,
        )
        self._requests[request_id] = request
        self._waiting.append(request)

    def set_threshold(self, request_id: str, threshold: float) -> None:
        """Change one request's threshold T; it applies from the next iteration."""
        self._get(request_id).threshold = _check_threshold(threshold)

    def set_draft_length(self, k: int, request_id: str | None = None) -> None:
        """Change k (>= 0) from the next iteration: with ``request_id`` that row's own k; without, the engine
        default, which applies to every row that was never given its own k."""
        _check_draft_length(k)
        if request_id is None:
            self.num_draft_tokens = k
        else:
            self._get(request_id).draft_length = k

    def abort(self, request_id: str) -> None:
        """Stop a waiting or running request now; the next StepStats reports it with reason "abort"."""
        request = self._get(request_id)
        if request.finished:
            return
        request.finished, request.finish_reason = True, "abort"
        request.prefill_logits = None  # [V] floats a finished request no longer needs
        if request in self._waiting:
            self._waiting.remove(request)
        else:
            index = self._running.index(request)
            self._drop_rows([index])
        self._aborted_unreported.append(request)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def output(self, request_id: str) -> RequestOutput:
        request = self._get(request_id)
        return RequestOutput(
            request_id=request.request_id,
            prompt_ids=list(request.prompt_ids),
            token_ids=list(request.output_ids),
            text=self._text(request),
            finished=request.finished,
            finish_reason=request.finish_reason,
            threshold=request.threshold,
            drafted=request.drafted,
            accepted=request.accepted,
            fuzzy_accepted=request.fuzzy_accepted,
            distortion=request.distortion,
            iterations=request.iterations,
        )

    def release(self, request_id: str) -> RequestOutput:
        """Return a finished request's output and forget it (a server must release what it reads)."""
        request = self._get(request_id)
        if not request.finished:
            raise ValueError(f"request {request_id!r} is still running; abort it first")
        out = self.output(request_id)
        del self._requests[request_id]
        return out

    def run_to_completion(self) -> list[StepStats]:
        """Step until every request has finished (each step makes progress, so this terminates)."""
        steps = []
        while self.has_unfinished():
            steps.append(self.step())
        return steps

    # ----------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> StepStats:
        """Admit waiting requests, then run one draft/verify iteration over every running row."""
        rows: list[RowStats] = [self._abort_stats(r) for r in self._aborted_unreported]
        self._aborted_unreported = []
        prefill_time, prefill_tokens = self._admit()
        if not self._running:
            return StepStats(rows, 0, self.num_draft_tokens, 0.0, 0.0, prefill_time, prefill_tokens)
        running = list(self._running)
        # Each row's own k, capped only by its own context room (a seeded request's draws never depend
        # on the batch); room >= 1 always (admission checks prompt + max_new_tokens <= max_context).
        lengths = [min(self._row_draft_length(r), self._room(r)) for r in running]
        k = max(lengths)
        # D only matters for drafting rows with T > 0 (decided on the host: no device sync).
        need_div = any(r.threshold > 0 and n > 0 for r, n in zip(running, lengths, strict=True))
        sampling = self._sampling_tensors(running)
        draft_uniforms, verify_uniforms = self._draw_uniforms(running, lengths, k)

        t0 = time.perf_counter()
        self._catch_up_s = 0.0
        draft_probs = draft_tokens = draft_div_logits = None
        if k > 0:
            draft_probs, draft_tokens, draft_div_logits = self._draft(running, lengths, k, sampling, draft_uniforms, need_div)
        t1 = time.perf_counter()
        # Rows that joined an idle engine are the whole batch in their first step (nothing else was running).
        first = running[0].prefill_logits is not None
        target_logits = self._verify_forward(running, lengths, k, draft_tokens, first)
        for r in running:
            r.prefill_logits = None
        target_probs = sampling_probs(target_logits, *sampling)  # [B, k+1, V]
        if draft_probs is None or draft_tokens is None:  # every row plain decoding: no drafts to verify
            sampled = sample_from_uniforms(target_probs[:, 0], verify_uniforms[:, 0])
            greedy_rows = (sampling[0] == 0).to(self.device)
            next_token = torch.where(greedy_rows, greedy_token(target_probs[:, 0]), sampled)
            num_accepted = torch.zeros_like(next_token)
            block = _HostBlock.of(num_accepted, next_token, None, None, None)
        else:
            result = verify_block(
                target_probs,
                draft_probs,
                draft_tokens,
                threshold=torch.tensor([r.threshold for r in running], dtype=torch.float32),
                div=self.div,
                rule=self.rule,
                greedy=sampling[0] == 0,
                draft_lengths=lengths,
                target_div_logits=self._div_logits(target_logits[:, :k], sampling[0]) if need_div else None,
                draft_div_logits=draft_div_logits,
                uniforms=verify_uniforms,
            )
            block = _HostBlock.of(result.num_accepted, result.next_token, result.fuzzy_accepted, result.distortion, draft_tokens)
        self._rollback(block.num_accepted, lengths, k, first)
        t2 = time.perf_counter()

        rows.extend(self._emit(running, block, lengths, ran_draft=k > 0))
        finished = [i for i, r in enumerate(running) if r.finished]
        if finished:
            self._drop_rows(finished)
        return StepStats(rows, len(running), k, t1 - t0, t2 - t1, prefill_time, prefill_tokens, self._catch_up_s)

    # -------------------------------------------------------------- helpers
    def _get(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise ValueError(f"unknown request_id {request_id!r}") from None

    def _row_draft_length(self, r: _Request) -> int:
        return self.num_draft_tokens if r.draft_length is None else r.draft_length

    def _room(self, r: _Request) -> int:
        return self.pair.max_context - len(r.prompt_ids) - len(r.output_ids)

    def _new_cache(self, model: Any, batch_size: int) -> BatchKVCache:
        return BatchKVCache(_num_layers(model), batch_size, device=self.device)

    def _forward(
        self, model: Any, cache: BatchKVCache, input_ids: torch.Tensor, valid: torch.Tensor, logits_to_keep: int = 0
    ) -> torch.Tensor:
        """Run ``model`` over new tokens [B, q] (``valid`` marks real ones); returns logits [B, q, V]
        (only the last ``logits_to_keep`` positions when non-zero: the LM head is costly on long inputs)."""
        position_ids, mask = cache.prepare(valid)
        out = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        cache.commit()
        logits: torch.Tensor = out.logits  # the model's output is untyped (Any)
        return logits

    def _padded(self, sequences: list[list[int]], width: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [B, width] on the model's device (one copy) and their valid mask on the host (the caches
        keep their bookkeeping there)."""
        feed = torch.zeros(len(sequences), width, dtype=torch.long)
        valid = torch.zeros(len(sequences), width, dtype=torch.bool)
        for b, seq in enumerate(sequences):
            if seq:
                cols = slice(width - len(seq), width) if left else slice(0, len(seq))
                feed[b, cols] = torch.tensor(seq)
                valid[b, cols] = True
        return feed.to(self.device), valid

    def _admit(self) -> tuple[float, int]:
        """Prefill every request that fits, together, and merge them into the batch caches."""
        joining: list[_Request] = []
        while self._waiting and len(self._running) + len(joining) < self.max_batch_size:
            joining.append(self._waiting.popleft())
        if not joining:
            return 0.0, 0
        start = time.perf_counter()
        # Prefill all but the last prompt token (see the invariants), left-padded to a common width. A
        # request that joins with k = 0 skips the draft prefill: its whole prompt stays "unseen" by the
        # draft and is fed only if it ever drafts (plain decoding must not pay for a draft).
        drafting = [self._row_draft_length(r) > 0 for r in joining]
        shared = self.share_kv
        # Into an idle engine the target prefills whole prompts and keeps the last logits for the first token
        # (plain decoding then pays one forward per token, like the target alone). Not beside running rows:
        # a k = 0 row in its first iteration would feed nothing and leave a hole in the target cache, and a
        # cache with holes takes the masked attention path at every later step.
        # With a shared cache the draft's first forward of a step feeds the token the target has not seen
        # (``pending``), so a drafting row never prefeeds: the target keeps the prompt's last token for it.
        prefeed = not self._running and not (shared and any(drafting))
        prefill_logits: torch.Tensor | None = None
        models = [(self.target, self._target_cache, [r.prompt_ids if prefeed else r.prompt_ids[:-1] for r in joining])]
        if not shared:
            draft_prefixes = [r.prompt_ids[:-1] if d else [] for r, d in zip(joining, drafting, strict=True)]
            models.append((self.draft, self._draft_cache, draft_prefixes))
        for model, batch_cache, prefixes in models:
            width = max(len(p) for p in prefixes)
            joining_cache = self._new_cache(model, len(joining))
            if width:
                feed, valid = self._padded(prefixes, width, left=True)
                logits = self._forward(model, joining_cache, feed, valid, logits_to_keep=1)
                if model is self.target:  # left-padded: the last column is every row's last prompt token
                    prefill_logits = logits[:, -1].float()
            batch_cache.append_rows(joining_cache)
        for j, (r, d) in enumerate(zip(joining, drafting, strict=True)):
            r.pending = r.prompt_ids[-1]
            r.prefill_logits = prefill_logits[j] if prefeed and prefill_logits is not None else None
            r.draft_unseen = [] if shared else [r.prompt_ids[-1]] if d else list(r.prompt_ids)
            self._running.append(r)
        return time.perf_counter() - start, sum(len(r.prompt_ids) for r in joining)

    def _sampling_tensors(self, running: list[_Request]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-row temperature, top-k, top-p on the host (sampling_probs validates them there, without a
        device sync, and moves them once)."""
        temperature = torch.tensor([r.params.temperature for r in running], dtype=torch.float32)
        top_k = torch.tensor([r.params.top_k for r in running], dtype=torch.long)
        top_p = torch.tensor([r.params.top_p for r in running], dtype=torch.float32)
        return temperature, top_k, top_p

    def _draw_uniforms(
        self, running: list[_Request], lengths: list[int], k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [B, k] draft draws, [B, k+1] verify (draw_block_uniforms layout)
        """All of a step's random numbers: 2 k_b + 1 per row from the row's own generator, one copy to the device."""
        draws = torch.zeros(len(running), 2 * k + 1)
        for b, (r, n) in enumerate(zip(running, lengths, strict=True)):
            row = torch.rand(2 * n + 1, generator=r.generator)
            draws[b, :n] = row[:n]  # draft sampling, step i uses column i
            draws[b, k : k + n] = row[n : 2 * n]  # acceptance tests
            draws[b, 2 * k] = row[2 * n]  # recovered / bonus draw
        draws = draws.to(self.device)
        return draws[:, :k], draws[:, k:]

    def _div_logits(self, logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:  # [B, n, V]
        """The temperature-scaled, untruncated logits divergences are measured on (greedy rows: temperature 1)."""
        scale = torch.where(temperature == 0, torch.ones_like(temperature), temperature).to(logits.device)
        return logits.float() / scale.view(-1, *([1] * (logits.dim() - 1)))

    def _draft(
        self,
        running: list[_Request],
        lengths: list[int],
        k: int,
        sampling: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        uniforms: torch.Tensor,  # [B, k]
        need_div: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """k batched draft forwards; returns draft_probs [B, k, V], draft_tokens [B, k] and, when ``need_div``,
        the div logits [B, k, V]. Row b's positions >= k_b are padding (never fed, never verified)."""
        temperature = sampling[0]
        greedy_rows = (temperature == 0).to(self.device)
        all_greedy = bool((temperature == 0).all())
        # The first forward feeds the tokens the draft has not seen, left-padded to a common width: every
        # drafting row's, and a k_b = 0 row's while they are few (it keeps its draft cache current for
        # free; a long backlog, e.g. a whole prompt, waits until the row drafts itself).
        if self.share_kv:
            # The draft writes its keys and values into the target's cache after the sequence (which holds
            # everything but ``pending``); they are all dropped again before the verify forward.
            cache = self._target_cache
            fed = [n > 0 for n in lengths]
            unseen = [[r.pending] if f else [] for r, f in zip(running, fed, strict=True)]
        else:
            cache = self._draft_cache
            fed = [n > 0 or len(r.draft_unseen) <= _MAX_PASSIVE_UNSEEN for r, n in zip(running, lengths, strict=True)]
            unseen = [r.draft_unseen if f else [] for r, f in zip(running, fed, strict=True)]
        width = max(len(u) for u in unseen)
        feed, valid = self._padded(unseen, width, left=True)
        self._draft_fed = fed
        # Later forwards feed row b's previous draft while it still has drafts to make.
        still_drafting = torch.tensor([[n > i for i in range(1, k)] for n in lengths], dtype=torch.bool)  # host
        probs_steps, token_steps, logit_steps = [], [], []
        forward_s: list[float] = []
        for i in range(k):
            started = time.perf_counter()
            logits = self._forward(self.draft, cache, feed, valid, logits_to_keep=1)[:, -1].float()
            forward_s.append(time.perf_counter() - started)
            probs = sampling_probs(logits, *sampling)
            tokens = greedy_token(probs)
            if not all_greedy:
                tokens = torch.where(greedy_rows, tokens, sample_from_uniforms(probs, uniforms[:, i]))
            probs_steps.append(probs)
            token_steps.append(tokens)
            if need_div:
                logit_steps.append(self._div_logits(logits, temperature))
            if i + 1 < k:
                feed = tokens[:, None]
                valid = still_drafting[:, i : i + 1]
        self._draft_first_width = width
        if self.share_kv:
            cache.reject_tail(k, [0] * len(running))  # every slot the draft wrote: the tail is cropped, no holes
        elif width > _MAX_PASSIVE_UNSEEN:  # a backlog was fed: what the first forward took beyond the others
            ordinary = sum(forward_s[1:]) / (k - 1) if k > 1 else 0.0
            self._catch_up_s = max(forward_s[0] - ordinary, 0.0)
        div_logits = torch.stack(logit_steps, 1) if need_div else None
        return torch.stack(probs_steps, 1), torch.stack(token_steps, 1), div_logits

    def _verify_forward(
        self, running: list[_Request], lengths: list[int], k: int, draft_tokens: torch.Tensor | None, first: bool
    ) -> torch.Tensor:
        """Target logits [B, k+1, V] for [pending, d_1..d_k_b] per row: one forward over those tokens
        (right-padded). In the ``first`` step of rows that joined an idle engine the target has seen their
        whole prompts: position 0 comes from the prefill logits and only the drafts are fed (no forward at
        all at k = 0)."""
        if first:
            prefill = torch.stack([r.prefill_logits for r in running if r.prefill_logits is not None])[:, None]
            if draft_tokens is None:
                return prefill
            valid = torch.tensor([[j < n for j in range(k)] for n in lengths], dtype=torch.bool)
            return torch.cat([prefill, self._forward(self.target, self._target_cache, draft_tokens, valid).float()], 1)
        pending = torch.tensor([[r.pending] for r in running], dtype=torch.long).to(self.device)
        if draft_tokens is None:
            feed = pending
            valid = torch.ones(len(running), 1, dtype=torch.bool)  # host, like every valid mask
        else:
            feed = torch.cat([pending, draft_tokens], dim=1)
            valid = torch.tensor([[j <= n for j in range(k + 1)] for n in lengths], dtype=torch.bool)
        return self._forward(self.target, self._target_cache, feed, valid).float()

    def _rollback(self, num_accepted: list[int], lengths: list[int], k: int, first: bool) -> None:
        """Keep the accepted prefix of the slots written this iteration; the rest become holes."""
        # Target slots: [pending, d_1..d_k] -> keep pending and the accepted drafts; in the first step of
        # rows that joined an idle engine: [d_1..d_k] -> keep the accepted drafts (k = 0: nothing written).
        if first:
            if k > 0:
                self._target_cache.reject_tail(k, num_accepted)
        else:
            self._target_cache.reject_tail(k + 1, [n + 1 for n in num_accepted])
        if k > 0 and not self.share_kv:
            # Draft slots: [pad.., unseen.., d_1..d_{k-1}] -> keep the unseen tokens and the accepted drafts
            # that were fed (d_{k_b} never is).
            width = self._draft_first_width
            keep = [width + min(n, max(k_b - 1, 0)) for n, k_b in zip(num_accepted, lengths, strict=True)]
            self._draft_cache.reject_tail(width + k - 1, keep)
        for cache in (self._target_cache, self._draft_cache):
            if cache.num_holes > max(_MIN_HOLES, _COMPACT_HOLE_FRACTION * cache.batch_size * cache.length):
                cache.compact()

    def _emit(self, running: list[_Request], block: _HostBlock, lengths: list[int], ran_draft: bool) -> list[RowStats]:
        rows = []
        for b, r in enumerate(running):
            n, k_b = block.num_accepted[b], lengths[b]
            drafts = block.draft_tokens[b] if block.draft_tokens is not None else []
            tokens = drafts[:n] + [block.next_token[b]]
            remaining = r.params.max_new_tokens - len(r.output_ids)
            new_tokens = self._append(r, tokens)
            emitted = len(new_tokens)
            drafted = min(k_b, remaining)
            accepted = min(n, emitted)
            fuzzy_count = int(sum(block.fuzzy_accepted[b][:accepted])) if block.fuzzy_accepted is not None else 0
            # Distortion of each emitted drafted position: accepted drafts at 0..n-1 and, for draft_tokens,
            # the recovered token at n < k_b (bonus tokens are exact: 0).
            charged = block.distortion[b][: min(emitted, k_b)] if block.distortion is not None else []
            row_distortion = float(sum(charged))
            r.drafted += drafted
            r.accepted += accepted
            r.fuzzy_accepted += fuzzy_count
            r.distortion += row_distortion
            r.iterations += 1
            # Cache invariants for the next iteration.
            r.pending = tokens[-1]
            if self.share_kv:
                pass  # the draft reads the target's cache: it has no backlog of its own
            elif ran_draft and self._draft_fed[b]:
                r.draft_unseen = ([drafts[k_b - 1]] if k_b > 0 and n == k_b else []) + [tokens[-1]]
            else:  # the draft was not fed this row: it has still not seen what it had not seen before
                r.draft_unseen = r.draft_unseen + [tokens[-1]]
            rows.append(
                RowStats(
                    request_id=r.request_id,
                    new_token_ids=new_tokens,
                    drafted=drafted,
                    accepted=accepted,
                    fuzzy_accepted=fuzzy_count,
                    distortion=row_distortion,
                    threshold=r.threshold,
                    finished=r.finished,
                    finish_reason=r.finish_reason,
                    distorted=sum(1 for x in charged if x > 0),
                    draft_length=k_b,
                )
            )
        return rows

    def _append(self, r: _Request, block: list[int]) -> list[int]:
        """Append ``block`` to the output, stopping at eos, max_new_tokens or a stop string."""
        new_tokens: list[int] = []
        for token in block:
            r.output_ids.append(token)
            new_tokens.append(token)
            if token in r.eos:
                r.finished, r.finish_reason = True, "stop"
                break
            if len(r.output_ids) >= r.params.max_new_tokens:
                r.finished, r.finish_reason = True, "length"
                break
        if r.params.stop:
            self._check_stop_strings(r, new_tokens)
        return new_tokens

    def _check_stop_strings(self, r: _Request, new_tokens: list[int]) -> None:
        """Finish ``r`` if its text now contains a stop string; the text is cut before it.

        Incremental: each block decodes only a window of the output, from ``stop_scan_from`` (kept the
        longest stop string's length plus ``_STOP_WINDOW_TOKENS`` tokens behind the end, so a match
        ending in the new tokens lies inside it). Once a match is seen (once per request) the exact cut
        is found on full decodes: only the tokens up to the one that completes the stop string are kept.
        """
        decode = self.pair.tokenizer.decode
        window_text = decode(r.output_ids[r.stop_scan_from :], skip_special_tokens=True)
        if any(s in window_text for s in r.params.stop):
            first_new = len(r.output_ids) - len(new_tokens)
            for keep in range(first_new + 1, len(r.output_ids) + 1):
                text = decode(r.output_ids[:keep], skip_special_tokens=True)
                hits = [i for i in (text.find(s) for s in r.params.stop) if i >= 0]
                if hits:
                    dropped = len(r.output_ids) - keep
                    del r.output_ids[keep:]
                    del new_tokens[len(new_tokens) - dropped :]
                    r.stop_text = text[: min(hits)]
                    r.finished, r.finish_reason = True, "stop"
                    return
        longest = max(len(s) for s in r.params.stop)
        r.stop_scan_from = max(r.stop_scan_from, len(r.output_ids) - longest - _STOP_WINDOW_TOKENS)

    def _text(self, r: _Request) -> str:
        if r.stop_text is not None:
            return r.stop_text
        if self.pair.tokenizer is None:  # decoder.generate without a tokenizer: ids only
            return ""
        return str(self.pair.tokenizer.decode(r.output_ids, skip_special_tokens=True))

    def _drop_rows(self, indices: list[int]) -> None:
        drop = set(indices)
        keep = [i for i in range(len(self._running)) if i not in drop]
        self._target_cache.select_rows(keep)
        if not self.share_kv:
            self._draft_cache.select_rows(keep)
        self._running = [self._running[i] for i in keep]

    @staticmethod
    def _abort_stats(r: _Request) -> RowStats:
        return RowStats(r.request_id, [], 0, 0, 0, 0.0, r.threshold, True, "abort")


@dataclass
class _HostBlock:
    """A verify block's outcome copied to the host in one transfer per dtype."""

    num_accepted: list[int]
    next_token: list[int]
    fuzzy_accepted: list[list[bool]] | None
    distortion: list[list[float]] | None
    draft_tokens: list[list[int]] | None

    @staticmethod
    def of(
        num_accepted: torch.Tensor,  # [B]
        next_token: torch.Tensor,  # [B]
        fuzzy_accepted: torch.Tensor | None,  # [B, k] bool
        distortion: torch.Tensor | None,  # [B, k]
        draft_tokens: torch.Tensor | None,  # [B, k]
    ) -> _HostBlock:
        batch = num_accepted.shape[0]
        if fuzzy_accepted is None or distortion is None or draft_tokens is None:
            ints = torch.stack([num_accepted, next_token]).cpu()
            return _HostBlock(ints[0].tolist(), ints[1].tolist(), None, None, None)
        k = draft_tokens.shape[1]
        ints = torch.cat(
            [num_accepted.view(batch, 1), next_token.view(batch, 1), fuzzy_accepted.long(), draft_tokens.long()], dim=1
        ).cpu()
        host = ints.tolist()
        return _HostBlock(
            num_accepted=[row[0] for row in host],
            next_token=[row[1] for row in host],
            fuzzy_accepted=[[bool(v) for v in row[2 : 2 + k]] for row in host],
            distortion=distortion.cpu().tolist(),
            draft_tokens=[row[2 + k :] for row in host],
        )
