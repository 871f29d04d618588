"""The FSD engine: continuous-batching speculative decoding with a per-iteration step API.

One iteration (:meth:`FSDEngine.step`) over the running rows:

1. **Admit** waiting requests up to ``max_batch_size``: prefill each prompt (all but its last token)
   alone on both models, then merge its KV into the batch caches (:mod:`decoder.kv_cache`).
2. **Draft** ``k`` tokens per row with ``k`` batched single-position draft forwards. The first one also
   feeds what the draft has not seen yet (the last emitted token, plus the last draft token when the
   previous block was fully accepted), so it is 1 or 2 positions wide, left-padded per row.
3. **Verify** with one target forward over ``k + 1`` positions per row: the token the target has not
   seen (the last emitted one) and the ``k`` drafts. :func:`decoder.acceptance.verify_block` decides,
   per row at that row's own threshold T, how many drafts are accepted and the next token.
4. **Roll back** both caches: rejected slots become holes in the attention mask (nothing is
   re-encoded); slots no row keeps are cropped; holes are compacted away when they pile up.
5. Emit tokens, apply eos / stop strings / ``max_new_tokens``; finished rows leave the batch.

Invariants per running row: the target cache holds every token of the sequence except the last one
(``pending``); the draft cache holds every token except ``draft_unseen`` (1 or 2 tokens).

Sampling: each request has its own ``torch.Generator`` (seeded from ``SamplingParams.seed``, else from
the engine's generator at admission), and every draw for a row comes from that generator alone, so a
seeded request produces the same tokens whatever else shares its batch.
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
from decoder.sampling import sample, sampling_probs

__all__ = ["DIVERGENCES", "RULES", "FSDEngine", "RequestOutput", "RowStats", "SamplingParams", "StepStats"]

FINISH_REASONS = ("stop", "length", "abort")

# Compact a cache when its holes exceed this fraction of its slots (and at least _MIN_HOLES).
_COMPACT_HOLE_FRACTION = 0.25
_MIN_HOLES = 64


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


@dataclass
class StepStats:
    """One engine iteration."""

    rows: list[RowStats]
    batch_size: int  # rows drafted/verified this iteration
    draft_length: int  # k used this iteration
    draft_time_s: float
    verify_time_s: float
    prefill_time_s: float
    prefill_tokens: int


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
    output_ids: list[int] = field(default_factory=list)
    stop_text: str | None = None  # the output text cut before the stop string that ended it
    pending: int = -1  # the last token: in the sequence, not yet in the target cache
    draft_unseen: list[int] = field(default_factory=list)  # in the sequence, not yet in the draft cache
    finished: bool = False
    finish_reason: str | None = None
    drafted: int = 0
    accepted: int = 0
    fuzzy_accepted: int = 0
    distortion: float = 0.0
    iterations: int = 0


def _check_threshold(threshold: float) -> float:
    try:
        value = float(threshold)
    except (TypeError, ValueError):
        raise ValueError(f"threshold must be a finite number >= 0, got {threshold!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"threshold must be a finite number >= 0, got {threshold!r}")
    return value


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
        self.num_draft_tokens = 1
        self.set_draft_length(num_draft_tokens)
        self.device = next(self.target.parameters()).device
        self._seed_generator = torch.Generator().manual_seed(seed)
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._requests: dict[str, _Request] = {}
        self._aborted_unreported: list[_Request] = []
        self._target_cache = self._new_cache(self.target, 0)
        self._draft_cache = self._new_cache(self.draft, 0)

    # ------------------------------------------------------------------ API
    def add_request(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams | None = None, threshold: float = 0.0
    ) -> None:
        """Queue a request; it joins the batch at the next :meth:`step` with room.

        The prompt plus ``max_new_tokens`` must fit the pair's context (``max_context``), so a request
        never runs out of positions half-way.
        """
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
        )
        self._requests[request_id] = request
        self._waiting.append(request)

    def set_threshold(self, request_id: str, threshold: float) -> None:
        """Change one request's threshold T; it applies from the next iteration."""
        self._get(request_id).threshold = _check_threshold(threshold)

    def set_draft_length(self, k: int) -> None:
        """Change k for all rows; it applies from the next iteration."""
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_draft_tokens (k) must be an integer >= 1, got {k!r}")
        self.num_draft_tokens = k

    def abort(self, request_id: str) -> None:
        """Stop a waiting or running request now; the next StepStats reports it with reason "abort"."""
        request = self._get(request_id)
        if request.finished:
            return
        request.finished, request.finish_reason = True, "abort"
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
        k = self.num_draft_tokens
        if not self._running:
            return StepStats(rows, 0, k, 0.0, 0.0, prefill_time, prefill_tokens)
        running = list(self._running)
        # k is the same for every row and never depends on the batch's make-up (a seeded request's
        # random draws must not), except that no row may be scored past the model's context.
        room = min(self.pair.max_context - len(r.prompt_ids) - len(r.output_ids) for r in running)
        k = max(1, min(k, room))

        t0 = time.perf_counter()
        draft_probs, draft_tokens = self._draft(running, k)
        t1 = time.perf_counter()
        target_probs = self._verify_forward(running, draft_tokens)
        result = verify_block(
            target_probs,
            draft_probs,
            draft_tokens,
            threshold=torch.tensor([r.threshold for r in running], dtype=torch.float32),
            div=self.div,
            rule=self.rule,
            generator=[r.generator for r in running],
            greedy=torch.tensor([r.params.greedy for r in running]),
        )
        self._rollback(result.num_accepted, k)
        t2 = time.perf_counter()

        rows.extend(self._emit(running, draft_tokens, result, k))
        finished = [i for i, r in enumerate(running) if r.finished]
        if finished:
            self._drop_rows(finished)
        return StepStats(rows, len(running), k, t1 - t0, t2 - t1, prefill_time, prefill_tokens)

    # -------------------------------------------------------------- helpers
    def _get(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise ValueError(f"unknown request_id {request_id!r}") from None

    def _new_cache(self, model: Any, batch_size: int) -> BatchKVCache:
        return BatchKVCache(_num_layers(model), batch_size, device=self.device)

    def _forward(
        self, model: Any, cache: BatchKVCache, input_ids: torch.Tensor, valid: torch.Tensor, logits_to_keep: int = 0
    ) -> torch.Tensor:
        """Run ``model`` over new tokens [B, q] (``valid`` marks real ones); returns logits [B, q, V]
        (only the last ``logits_to_keep`` positions when non-zero: the LM head is costly on long inputs)."""
        position_ids, mask = cache.prepare(valid)
        out = model(
            input_ids=input_ids.to(self.device),
            attention_mask=mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        cache.commit()
        return out.logits

    def _admit(self) -> tuple[float, int]:
        """Prefill every request that fits, together, and merge them into the batch caches."""
        joining: list[_Request] = []
        while self._waiting and len(self._running) + len(joining) < self.max_batch_size:
            joining.append(self._waiting.popleft())
        if not joining:
            return 0.0, 0
        start = time.perf_counter()
        # Prefill all but the last prompt token (see the invariants), left-padded to a common width.
        width = max(len(r.prompt_ids) - 1 for r in joining)
        feed = torch.zeros(len(joining), width, dtype=torch.long)
        valid = torch.zeros(len(joining), width, dtype=torch.bool)
        for b, r in enumerate(joining):
            prefix = r.prompt_ids[:-1]
            if prefix:
                feed[b, width - len(prefix) :] = torch.tensor(prefix)
                valid[b, width - len(prefix) :] = True
        for model, batch_cache in ((self.target, self._target_cache), (self.draft, self._draft_cache)):
            joining_cache = self._new_cache(model, len(joining))
            if width:
                self._forward(model, joining_cache, feed, valid, logits_to_keep=1)
            batch_cache.append_rows(joining_cache)
        for r in joining:
            r.pending = r.prompt_ids[-1]
            r.draft_unseen = [r.prompt_ids[-1]]
            self._running.append(r)
        return time.perf_counter() - start, sum(len(r.prompt_ids) for r in joining)

    def _sampling_tensors(self, running: list[_Request]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        temperature = torch.tensor([r.params.temperature for r in running], dtype=torch.float32)
        top_k = torch.tensor([r.params.top_k for r in running], dtype=torch.long)
        top_p = torch.tensor([r.params.top_p for r in running], dtype=torch.float32)
        return temperature, top_k, top_p

    def _draft(self, running: list[_Request], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k batched draft forwards; returns draft_probs [B, k, V] and draft_tokens [B, k]."""
        temperature, top_k, top_p = self._sampling_tensors(running)
        greedy_rows = temperature == 0
        all_greedy = bool(greedy_rows.all())
        generators = [r.generator for r in running]
        # The first forward feeds the tokens the draft has not seen, left-padded to a common width.
        width = max(len(r.draft_unseen) for r in running)
        feed = torch.zeros(len(running), width, dtype=torch.long)
        valid = torch.zeros(len(running), width, dtype=torch.bool)
        for b, r in enumerate(running):
            feed[b, width - len(r.draft_unseen) :] = torch.tensor(r.draft_unseen)
            valid[b, width - len(r.draft_unseen) :] = True
        probs_steps, token_steps = [], []
        for i in range(k):
            logits = self._forward(self.draft, self._draft_cache, feed, valid, logits_to_keep=1)[:, -1].float()
            probs = sampling_probs(logits, temperature, top_k, top_p)
            tokens = greedy_token(probs)
            if not all_greedy:
                tokens = torch.where(greedy_rows, tokens, sample(probs, generators))
            probs_steps.append(probs)
            token_steps.append(tokens)
            if i + 1 < k:
                feed = tokens[:, None]
                valid = torch.ones_like(feed, dtype=torch.bool)
        self._draft_first_width = width
        return torch.stack(probs_steps, 1), torch.stack(token_steps, 1)

    def _verify_forward(self, running: list[_Request], draft_tokens: torch.Tensor) -> torch.Tensor:
        """One target forward over [pending, d_1..d_k]; returns target_probs [B, k+1, V]."""
        pending = torch.tensor([[r.pending] for r in running], dtype=torch.long)
        feed = torch.cat([pending, draft_tokens], dim=1)
        logits = self._forward(self.target, self._target_cache, feed, torch.ones_like(feed, dtype=torch.bool))
        temperature, top_k, top_p = self._sampling_tensors(running)
        return sampling_probs(logits.float(), temperature, top_k, top_p)

    def _rollback(self, num_accepted: torch.Tensor, k: int) -> None:
        """Keep the accepted prefix of the slots written this iteration; the rest become holes."""
        # Target slots: [pending, d_1..d_k] -> keep pending and the accepted drafts.
        self._target_cache.reject_tail(k + 1, num_accepted + 1)
        # Draft slots: [pad.., unseen.., d_1..d_{k-1}] -> keep the unseen tokens and accepted drafts.
        width = self._draft_first_width
        self._draft_cache.reject_tail(width + k - 1, width + torch.clamp(num_accepted, max=k - 1))
        for cache in (self._target_cache, self._draft_cache):
            if cache.num_holes > max(_MIN_HOLES, _COMPACT_HOLE_FRACTION * cache.batch_size * cache.length):
                cache.compact()

    def _emit(self, running: list[_Request], draft_tokens: torch.Tensor, result: Any, k: int) -> list[RowStats]:
        num_accepted = result.num_accepted.tolist()
        next_tokens = result.next_token.tolist()
        fuzzy = result.fuzzy_accepted.tolist()
        distortion = result.distortion.tolist()
        drafts = draft_tokens.tolist()
        rows = []
        for b, r in enumerate(running):
            n = num_accepted[b]
            block = drafts[b][:n] + [next_tokens[b]]
            remaining = r.params.max_new_tokens - len(r.output_ids)
            new_tokens = self._append(r, block)
            emitted = len(new_tokens)
            drafted = min(k, remaining)
            accepted = min(n, emitted)
            fuzzy_count = int(sum(fuzzy[b][:accepted]))
            # Distortion of each emitted position: drafts at 0..n-1, the next token at n (not fuzzy: 0).
            charged = distortion[b][: min(emitted, k)]
            row_distortion = float(sum(charged))
            r.drafted += drafted
            r.accepted += accepted
            r.fuzzy_accepted += fuzzy_count
            r.distortion += row_distortion
            r.iterations += 1
            # Cache invariants for the next iteration.
            r.pending = block[-1]
            r.draft_unseen = [drafts[b][k - 1], block[-1]] if n == k else [block[-1]]
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

        Only the tokens up to the one that completes the stop string are kept. Earlier blocks were
        checked already, so only matches ending in this block's text can be new.
        """
        decode = self.pair.tokenizer.decode
        full_text = decode(r.output_ids, skip_special_tokens=True)
        if not any(s in full_text for s in r.params.stop):
            return
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

    def _text(self, r: _Request) -> str:
        if r.stop_text is not None:
            return r.stop_text
        if self.pair.tokenizer is None:  # decoder.generate without a tokenizer: ids only
            return ""
        return str(self.pair.tokenizer.decode(r.output_ids, skip_special_tokens=True))

    def _drop_rows(self, indices: list[int]) -> None:
        drop = set(indices)
        keep = [i for i in range(len(self._running)) if i not in drop]
        index = torch.tensor(keep, dtype=torch.long)
        self._target_cache.select_rows(index)
        self._draft_cache.select_rows(index)
        self._running = [self._running[i] for i in keep]

    @staticmethod
    def _abort_stats(r: _Request) -> RowStats:
        return RowStats(r.request_id, [], 0, 0, 0, 0.0, r.threshold, True, "abort")
