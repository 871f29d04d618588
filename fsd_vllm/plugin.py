"""The ``vllm.general_plugins`` entry point that turns vLLM's rejection sampler into FSD's.

vLLM loads every ``vllm.general_plugins`` entry point (``fsd_vllm/pyproject.toml``) in each of its processes
before the model runner is built; :func:`register` then patches three private places of vLLM
``PINNED_VLLM_VERSION`` (and refuses any other release: private functions change without notice):

1. ``vllm.v1.sample.rejection_sampler.rejection_sample`` → :func:`fsd_rejection_sample`, which runs
   :func:`fsd_vllm.acceptance.fsd_rejection_sample_flat` (the FSD rules) and records per-request counters.
   When no request in the batch has ``T > 0`` and the rule is ``reducible`` it hands over to vLLM's own
   kernels (that *is* standard speculative sampling) and only counts.
2. ``InputBatch.add_request`` / ``InputBatch._make_sampling_metadata`` (``vllm/v1/worker/gpu_input_batch.py``,
   also used by the CPU runner): the per-request FSD arguments in ``SamplingParams.extra_args``
   (:func:`fsd_extra_args`) are attached to the batch's ``SamplingMetadata`` in batch order, because the
   rejection sampler otherwise never sees request ids nor ``extra_args``. T is therefore fixed per request
   at admission.
3. CPU only: ``rejection_sampler.expand_batch_to_tokens`` → a dtype-preserving ``repeat_interleave``.
   vLLM 0.32.0's CPU shim for ``expand_kernel`` writes an int64 temporary and never copies it back
   (vLLM issue #55005, fix PR #55006), so per-token temperature/top-k/top-p are uninitialised memory and
   sampled speculative decoding is garbage on CPU. Greedy is unaffected.

Engine-wide settings come from the environment of the vLLM processes: ``FSD_VLLM_DIV`` (default ``kl``) and
``FSD_VLLM_RULE`` (default ``reducible``); ``FSD_VLLM_DISABLE=1`` leaves vLLM untouched.
Counters live in the worker process (:data:`COUNTERS`); read them in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) or through ``LLM.collective_rpc(read_counters)``.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fsd_vllm.acceptance import (
    DIVERGENCES,
    PLACEHOLDER_TOKEN_ID,
    RULES,
    FlatVerifyStats,
    draw_randomness,
    fsd_rejection_sample_flat,
)

logger = logging.getLogger(__name__)

PINNED_VLLM_VERSION = "0.32.0"
EXTRA_ARGS_THRESHOLD = "fsd_threshold"  # SamplingParams.extra_args key: float T >= 0
EXTRA_ARGS_TIER = "fsd_tier"  # SamplingParams.extra_args key: the request's SLO tier name
DEFAULT_TIER = "default"


# ---------------------------------------------------------------------------------------------------------
# request arguments (the boundary: validated here, trusted in the worker)


def fsd_extra_args(threshold: float, tier: str = DEFAULT_TIER) -> dict[str, Any]:
    """``SamplingParams.extra_args`` (``vllm_xargs`` over vLLM's OpenAI API) for one FSD request."""
    value = float(threshold)
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"fsd threshold must be finite and >= 0, got {threshold!r}")
    if not isinstance(tier, str) or not tier:
        raise ValueError(f"fsd tier must be a non-empty string, got {tier!r}")
    return {EXTRA_ARGS_THRESHOLD: value, EXTRA_ARGS_TIER: tier}


@dataclass(frozen=True)
class RequestFSDArgs:
    threshold: float = 0.0
    tier: str = DEFAULT_TIER

    @classmethod
    def from_extra_args(cls, extra_args: Mapping[str, Any] | None) -> RequestFSDArgs:
        """Defensive: the worker must never crash on a bad value; it falls back to T = 0 (lossless)."""
        if not extra_args:
            return cls()
        tier = extra_args.get(EXTRA_ARGS_TIER, DEFAULT_TIER)
        try:
            threshold = float(extra_args.get(EXTRA_ARGS_THRESHOLD, 0.0))
        except (TypeError, ValueError):
            threshold = 0.0
        if not 0.0 <= threshold < float("inf"):
            logger.warning("fsd: ignoring invalid threshold %r (using 0)", extra_args.get(EXTRA_ARGS_THRESHOLD))
            threshold = 0.0
        return cls(threshold=threshold, tier=str(tier) if tier else DEFAULT_TIER)


# ---------------------------------------------------------------------------------------------------------
# counters


@dataclass
class TokenCounts:
    """Cumulative acceptance counters (the native engine's StepStats fields, summed)."""

    steps: int = 0  # verify steps with at least one drafted token
    drafted: int = 0
    accepted: int = 0
    fuzzy_accepted: int = 0
    emitted: int = 0  # accepted + one recovered/bonus token per step
    distortion: float = 0.0  # summed per-position TV to the target

    def add(self, drafted: int, accepted: int, fuzzy: int, distortion: float) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.fuzzy_accepted += fuzzy
        self.emitted += accepted + 1
        self.distortion += distortion


@dataclass
class FSDCounters:
    """Per-request and per-tier counters of the process's rejection sampler (thread-safe)."""

    per_request: dict[str, TokenCounts] = field(default_factory=dict)
    per_tier: dict[str, TokenCounts] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, req_ids: list[str] | None, tiers: list[str], stats: FlatVerifyStats) -> None:
        drafted = stats.num_drafted.tolist()
        accepted = stats.num_accepted.tolist()
        fuzzy = stats.num_fuzzy_accepted.tolist()
        distortion = stats.distortion.tolist()
        with self._lock:
            for row, n in enumerate(drafted):
                if n == 0:
                    continue  # not a speculative step for this request
                args = (n, accepted[row], fuzzy[row], distortion[row])
                self.per_tier.setdefault(tiers[row], TokenCounts()).add(*args)
                if req_ids is not None:
                    self.per_request.setdefault(req_ids[row], TokenCounts()).add(*args)

    def snapshot(self) -> dict[str, dict[str, TokenCounts]]:
        with self._lock:
            copy = {
                "per_request": {k: TokenCounts(**vars(v)) for k, v in self.per_request.items()},
                "per_tier": {k: TokenCounts(**vars(v)) for k, v in self.per_tier.items()},
            }
        return copy

    def request_counts(self, req_id: str) -> tuple[int, int, int, float]:
        """(drafted, accepted, fuzzy_accepted, distortion) of one request so far (zeros if none yet)."""
        with self._lock:
            c = self.per_request.get(req_id)
            return (0, 0, 0, 0.0) if c is None else (c.drafted, c.accepted, c.fuzzy_accepted, c.distortion)

    def pop_request(self, req_id: str) -> TokenCounts | None:
        """Forget one finished request (a long-running server would otherwise keep every request's counts)."""
        with self._lock:
            return self.per_request.pop(req_id, None)

    def reset(self) -> None:
        with self._lock:
            self.per_request.clear()
            self.per_tier.clear()


COUNTERS = FSDCounters()


def read_counters(_worker: Any = None) -> dict[str, dict[str, dict[str, float]]]:
    """Plain-dict snapshot of :data:`COUNTERS`; usable as ``LLM.collective_rpc(read_counters)``."""
    snap = COUNTERS.snapshot()
    return {scope: {key: vars(c) for key, c in table.items()} for scope, table in snap.items()}


# ---------------------------------------------------------------------------------------------------------
# the patched functions


@dataclass(frozen=True)
class FSDEngineConfig:
    div: str = "kl"
    rule: str = "reducible"

    @classmethod
    def from_env(cls) -> FSDEngineConfig:
        div = os.environ.get("FSD_VLLM_DIV", "kl")
        rule = os.environ.get("FSD_VLLM_RULE", "reducible")
        if div not in DIVERGENCES:
            raise ValueError(f"FSD_VLLM_DIV={div!r} is not one of {DIVERGENCES}")
        if rule not in RULES:
            raise ValueError(f"FSD_VLLM_RULE={rule!r} is not one of {RULES}")
        return cls(div=div, rule=rule)


_CONFIG = FSDEngineConfig()
_ORIGINALS: dict[str, Any] = {}
_FSD_ATTR = "_fsd_request_args"  # attribute set on SamplingMetadata: list[RequestFSDArgs] in batch order
_REQ_IDS_ATTR = "_fsd_req_ids"


def _batch_args(sampling_metadata: Any, batch: int) -> tuple[list[RequestFSDArgs], list[str] | None]:
    args = getattr(sampling_metadata, _FSD_ATTR, None)
    req_ids = getattr(sampling_metadata, _REQ_IDS_ATTR, None)
    if args is None or len(args) != batch:
        return [RequestFSDArgs()] * batch, None  # unknown batch (e.g. a warm-up dummy): lossless
    return list(args), list(req_ids) if req_ids is not None else None


def _stats_from_output(output: torch.Tensor, num_draft_tokens: list[int]) -> FlatVerifyStats:
    """Counters of a step decided by vLLM's own kernels (standard SD: nothing fuzzy, no distortion)."""
    emitted = (output != PLACEHOLDER_TOKEN_ID).sum(dim=1).cpu()
    drafted = torch.tensor(num_draft_tokens, dtype=torch.long)
    accepted = torch.minimum((emitted - 1).clamp_min(0), drafted)
    zeros = torch.zeros_like(drafted)
    return FlatVerifyStats(drafted, accepted, zeros, zeros.float())


def fsd_rejection_sample(
    draft_token_ids: torch.Tensor,  # [num_tokens]
    num_draft_tokens: list[int],  # [batch_size]
    max_spec_len: int,
    cu_num_draft_tokens: torch.Tensor,  # [batch_size]
    draft_probs: torch.Tensor | None,  # [num_tokens, vocab_size]
    target_logits: torch.Tensor,  # [num_tokens, vocab_size] after temperature/top-k/top-p
    bonus_token_ids: torch.Tensor,  # [batch_size, 1]
    sampling_metadata: Any,  # vllm.v1.sample.metadata.SamplingMetadata
    synthetic_mode: bool = False,
    synthetic_conditional_rates: torch.Tensor | None = None,
    use_fp64_gumbel: bool = False,
) -> torch.Tensor:  # [batch_size, max_spec_len + 1] int32
    """Drop-in for vLLM 0.32.0's ``rejection_sample`` (same signature) applying the FSD rule."""
    original: Callable[..., torch.Tensor] = _ORIGINALS["rejection_sample"]  # vLLM's, untyped without vllm
    passthrough = (
        draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_logits,
        bonus_token_ids, sampling_metadata,
    )
    if synthetic_mode:  # vLLM's benchmarking mode fakes acceptance; FSD has nothing to add
        return original(*passthrough, synthetic_mode, synthetic_conditional_rates, use_fp64_gumbel)
    batch = len(num_draft_tokens)
    args, req_ids = _batch_args(sampling_metadata, batch)
    tiers = [a.tier for a in args]
    thresholds = torch.tensor([a.threshold for a in args], dtype=torch.float32)
    if _CONFIG.rule == "reducible" and not bool((thresholds > 0).any()):
        output = original(*passthrough, synthetic_mode, synthetic_conditional_rates, use_fp64_gumbel)
        COUNTERS.record(req_ids, tiers, _stats_from_output(output, num_draft_tokens))
        return output

    device = target_logits.device
    target_probs = target_logits.softmax(dim=-1, dtype=torch.float32)
    if sampling_metadata.all_greedy or sampling_metadata.temperature is None:
        is_greedy = torch.ones(batch, dtype=torch.bool, device=device)
    else:
        is_greedy = sampling_metadata.temperature[:batch] == 0
    randomness = draw_randomness(num_draft_tokens, target_probs.shape[-1], sampling_metadata.generators, device)
    output, stats = fsd_rejection_sample_flat(
        draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_probs,
        bonus_token_ids, is_greedy, thresholds.to(device), randomness, div=_CONFIG.div, rule=_CONFIG.rule,
    )
    COUNTERS.record(req_ids, tiers, FlatVerifyStats(*(t.cpu() for t in vars(stats).values())))
    return output


def expand_batch_to_tokens_native(
    x: torch.Tensor,  # [batch_size]
    cu_num_tokens: torch.Tensor,  # [batch_size], inclusive cumulative token counts
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:  # [num_tokens], x's dtype
    """``expand_batch_to_tokens`` at the caller's dtype (the #55006 fix): repeat each request's value over
    its tokens, rewriting ``replace_from`` to ``replace_to`` before the store, as the Triton kernel does."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype, device=x.device), x)
    return torch.repeat_interleave(values, counts, output_size=num_tokens)


def _patch_input_batch(input_batch_cls: type[Any]) -> None:  # vLLM's InputBatch (vllm is optional here)
    """Carry each request's FSD arguments from its SamplingParams to the batch's SamplingMetadata."""
    original_add = input_batch_cls.add_request
    original_make = input_batch_cls._make_sampling_metadata

    @functools.wraps(original_add)
    def add_request(self: Any, request: Any) -> int:
        table = self.__dict__.setdefault(_FSD_ATTR, {})
        params = getattr(request, "sampling_params", None)
        table[request.req_id] = RequestFSDArgs.from_extra_args(getattr(params, "extra_args", None))
        index: int = original_add(self, request)
        return index

    @functools.wraps(original_make)
    def _make_sampling_metadata(self: Any) -> Any:
        metadata = original_make(self)
        table: dict[str, RequestFSDArgs] = self.__dict__.setdefault(_FSD_ATTR, {})
        req_ids = [r for r in self._req_ids[: self.num_reqs]]
        live = set(req_ids)
        for gone in [r for r in table if r not in live]:
            del table[gone]
        setattr(metadata, _FSD_ATTR, [table.get(r, RequestFSDArgs()) if r else RequestFSDArgs() for r in req_ids])
        setattr(metadata, _REQ_IDS_ATTR, req_ids)
        return metadata

    input_batch_cls.add_request = add_request
    input_batch_cls._make_sampling_metadata = _make_sampling_metadata


def check_vllm_version(version: str) -> None:
    if version != PINNED_VLLM_VERSION and os.environ.get("FSD_VLLM_ALLOW_UNPINNED") != "1":
        raise RuntimeError(
            f"fsd_vllm patches private functions of vLLM {PINNED_VLLM_VERSION}, found vLLM {version}; "
            "run `make vllm-env`, or set FSD_VLLM_ALLOW_UNPINNED=1 at your own risk"
        )


def register() -> None:
    """Entry point (idempotent: vLLM may call it several times per process)."""
    global _CONFIG
    if os.environ.get("FSD_VLLM_DISABLE") == "1" or "rejection_sample" in _ORIGINALS:
        return
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.worker import gpu_input_batch

    check_vllm_version(vllm.__version__)
    _CONFIG = FSDEngineConfig.from_env()
    _ORIGINALS["rejection_sample"] = rejection_sampler.rejection_sample
    rejection_sampler.rejection_sample = fsd_rejection_sample
    _patch_input_batch(gpu_input_batch.InputBatch)
    if current_platform.is_cpu():
        _ORIGINALS["expand_batch_to_tokens"] = rejection_sampler.expand_batch_to_tokens
        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens_native
    logger.info("fsd: rejection sampler patched (div=%s, rule=%s)", _CONFIG.div, _CONFIG.rule)
