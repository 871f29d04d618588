"""vLLM's ``LLMEngine`` driven one step at a time: the engine of ``engine: vllm`` replicas.

:class:`VLLMStepEngine` has the methods the controller's batching loop drives
(``controller.batching.StepEngine``: ``add_request``, ``step``, ``abort``, ``release``, ``has_unfinished``,
``set_threshold``, ``set_draft_length``), so the vLLM replica (``controller.vllm_replica``) reuses the
native replica's thread, control channel, fail-safe and reports unchanged. :class:`VLLMPair` is the part of
the native ``ModelPair`` the request path reads (tokenizer, prompt encoding, context length).

What differs from the native engine:

* **T is fixed per request at admission.** It travels in ``SamplingParams.extra_args``
  (:func:`fsd_vllm.plugin.fsd_extra_args`) and the plugin reads it when the request joins vLLM's batch; a
  controller decision reaches the requests admitted after it (``set_threshold`` on a running request is
  a no-op and the request's rows keep reporting the T it runs at).
* **k is engine-wide** (vLLM's ``num_speculative_tokens``); ``set_draft_length`` is a no-op.
* Per-request counters (drafted, accepted, fuzzy-accepted, distortion) come from the plugin's
  :data:`fsd_vllm.plugin.COUNTERS`, read in this process: the engine core must run in-process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), which the constructor enforces.

Only the vLLM environment (``make vllm-env``) runs the engine; this module imports vLLM lazily, so the
project's venv can import it (its prompt encoding is tested there against the native one).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VLLMEngineOptions:
    """What the vLLM engine is built from (``controller.vllm_replica`` fills it from the fsd config)."""

    target_dir: str
    draft_dir: str | None  # None: no speculative decoding (target alone)
    num_speculative_tokens: int
    max_num_seqs: int
    max_model_len: int
    memory_fraction: float
    enforce_eager: bool
    seed: int

    def engine_kwargs(self) -> dict[str, Any]:
        """``vllm.EngineArgs`` keyword arguments."""
        speculative = None
        if self.draft_dir is not None and self.num_speculative_tokens > 0:
            speculative = {
                "method": "draft_model",
                "model": self.draft_dir,
                "num_speculative_tokens": self.num_speculative_tokens,
                # FSD needs the draft's full distribution at the rejection sampler (vLLM's default gives none).
                "draft_sample_method": "probabilistic",
            }
        return {
            "model": self.target_dir,
            "dtype": "float32",
            "enforce_eager": self.enforce_eager,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "speculative_config": speculative,
            "seed": self.seed,
            "gpu_memory_utilization": self.memory_fraction,
            # One process: the plugin's counters are read here (and Ray placement is Serve's business).
            "distributed_executor_backend": "uni",
            "disable_log_stats": False,  # vLLM's own spec-decode counters (get_metrics)
        }


@dataclass(frozen=True)
class VLLMRequestParams:
    """One request's sampling parameters (the replica builds them; ``max_new_tokens`` and ``stop`` are the
    names the replica's request path reads back, as on the native ``SamplingParams``)."""

    tier: str
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None


@dataclass(frozen=True)
class VLLMRow:
    """What one step did for one request (the fields the batching loop reads off a native step row)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    drafted: int
    accepted: int
    fuzzy_accepted: int
    distortion: float
    threshold: float
    draft_length: int
    finished: bool
    finish_reason: str | None


@dataclass(frozen=True)
class VLLMStep:
    rows: tuple[VLLMRow, ...]
    prefill_tokens: int = 0


@dataclass(frozen=True)
class ReleasedRequest:
    text: str  # the final output text (vLLM cut the stop strings)


@dataclass
class _Live:
    internal_id: str  # vLLM's id (the external one plus a random suffix): the plugin's counters use it
    threshold: float
    prompt_tokens: int
    emitted: int = 0
    seen: tuple[int, int, int, float] = (0, 0, 0, 0.0)  # plugin counters already reported
    started: bool = False
    finished: bool = False
    text: str = ""


@dataclass(frozen=True)
class SpecDecodeTotals:
    """vLLM's own speculative-decoding counters (its Prometheus metrics), summed over the engine."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


_SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}


class VLLMStepEngine:
    """See the module docstring. Not thread-safe: one thread (the batching loop's) drives it."""

    def __init__(self, options: VLLMEngineOptions) -> None:
        # In-process engine core: the plugin's counters live in this process only then.
        if os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            raise ValueError(
                "VLLM_ENABLE_V1_MULTIPROCESSING must be 0 for FSD replicas on vLLM (the plugin's per-request "
                f"counters are read in-process), got {os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']!r}"
            )
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        from fsd_vllm.plugin import register

        register()  # vLLM loads it too (entry point); idempotent, and fails here on a wrong vLLM release
        self.options = options
        self._engine = LLMEngine.from_engine_args(EngineArgs(**options.engine_kwargs()))
        self.max_model_len = int(self._engine.model_config.max_model_len)
        self.draft_length = options.num_speculative_tokens if options.draft_dir is not None else 0
        self._live: dict[str, _Live] = {}

    # ---- the batching loop's StepEngine --------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: VLLMRequestParams,
                    threshold: float = 0.0, draft_length: int | None = None) -> None:
        """Admit a request at ``threshold`` (fixed for its life). ValueError for what vLLM refuses."""
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already running")
        sampling = _sampling_params(params, threshold)
        internal = self._engine.add_request(request_id, {"prompt_token_ids": list(prompt_ids)}, sampling)
        self._live[request_id] = _Live(internal_id=str(internal), threshold=float(threshold),
                                       prompt_tokens=len(prompt_ids))

    @staticmethod
    def check_params(params: VLLMRequestParams) -> None:
        """ValueError naming what vLLM refuses in ``params`` (checked before the request is queued)."""
        _sampling_params(params, 0.0)

    def set_threshold(self, request_id: str, threshold: float) -> None:
        """No-op: vLLM fixes a request's T at admission (module docstring)."""

    def set_draft_length(self, k: int, request_id: str | None = None) -> None:
        """No-op: k is vLLM's engine-wide ``num_speculative_tokens``."""

    def abort(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is None or live.finished:
            return
        self._engine.abort_request([live.internal_id], internal=True)
        live.finished = True

    def release(self, request_id: str) -> ReleasedRequest:
        """Forget a finished (or aborted) request; its final text."""
        from fsd_vllm.plugin import COUNTERS

        live = self._live.pop(request_id)
        if not live.finished:
            self._engine.abort_request([live.internal_id], internal=True)
        COUNTERS.pop_request(live.internal_id)
        return ReleasedRequest(text=live.text)

    def has_unfinished(self) -> bool:
        return bool(self._engine.has_unfinished_requests())

    def step(self) -> VLLMStep:
        from fsd_vllm.plugin import COUNTERS

        outputs = self._engine.step()
        rows: list[VLLMRow] = []
        prefill = 0
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None or live.finished:  # aborted meanwhile
                continue
            if not live.started:
                live.started = True
                prefill += live.prompt_tokens
            completion = out.outputs[0]
            token_ids = tuple(int(t) for t in completion.token_ids[live.emitted:])
            live.emitted += len(token_ids)
            counts = COUNTERS.request_counts(live.internal_id)
            drafted, accepted, fuzzy, distortion = (
                counts[0] - live.seen[0], counts[1] - live.seen[1], counts[2] - live.seen[2],
                counts[3] - live.seen[3],
            )
            live.seen = counts
            if out.finished:
                live.finished = True
                live.text = str(completion.text)
            rows.append(VLLMRow(
                request_id=out.request_id, new_token_ids=token_ids, drafted=drafted, accepted=accepted,
                fuzzy_accepted=fuzzy, distortion=distortion, threshold=live.threshold,
                draft_length=self.draft_length, finished=bool(out.finished),
                finish_reason=_finish_reason(completion.finish_reason) if out.finished else None,
            ))
        return VLLMStep(rows=tuple(rows), prefill_tokens=prefill)

    # ---- observability ---------------------------------------------------------------------------------

    def spec_decode_totals(self) -> SpecDecodeTotals:
        """vLLM's own speculative-decoding counters since the engine started."""
        totals = dict.fromkeys(_SPEC_METRICS.values(), 0)
        for metric in self._engine.get_metrics():
            key = _SPEC_METRICS.get(getattr(metric, "name", ""))
            if key is not None:
                totals[key] += int(getattr(metric, "value", 0))
        return SpecDecodeTotals(**totals)

    def get_tokenizer(self) -> Any:
        return self._engine.get_tokenizer()


def _sampling_params(params: VLLMRequestParams, threshold: float) -> Any:
    """vLLM's ``SamplingParams`` for one request at ``threshold`` (vLLM validates them: ValueError)."""
    from vllm import SamplingParams

    from fsd_vllm.plugin import fsd_extra_args

    return SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_new_tokens,
        stop=list(params.stop) or None,
        ignore_eos=params.ignore_eos,
        seed=params.seed,
        extra_args=fsd_extra_args(threshold, params.tier),
    )


def _finish_reason(reason: str | None) -> str:
    """vLLM's ``stop`` / ``length`` / ``abort`` are the service's names already."""
    return reason if reason in ("stop", "length", "abort") else "stop"


# ---------------------------------------------------------------------------------------------------------
# the model pair as the request path sees it


@dataclass
class VLLMPair:
    """Tokenizer, prompt encoding and context of the pair a vLLM replica serves (the native ``ModelPair``
    fields the replica's request path reads)."""

    name: str
    description: str
    tokenizer: Any  # transformers tokenizer of the target directory
    max_context: int

    @classmethod
    def load(cls, name: str, target_dir: str, draft_dir: str | None, max_context: int) -> VLLMPair:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        draft = f"draft {Path(draft_dir).name}" if draft_dir else "no draft"
        return cls(name=name, description=f"vLLM: target {target_dir}, {draft}", tokenizer=tokenizer,
                   max_context=max_context)

    def encode_prompt(self, prompt: str | Sequence[Mapping[str, Any]], chat: bool = True) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat=chat)


def encode_prompt(tokenizer: Any, prompt: str | Sequence[Mapping[str, Any]], chat: bool = True) -> list[int]:
    """Token ids for ``prompt``, by the rules of ``decoder.models.encode_prompt`` (which this environment
    cannot import: decoder needs the project's newer transformers); a test checks both agree.

    Messages always go through the chat template (generation prompt appended); a plain string does too
    when ``chat`` and the tokenizer has a template, else it is tokenized as raw text.
    """
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("empty prompt: expected non-empty text or a non-empty list of messages")
        if chat and getattr(tokenizer, "chat_template", None):
            return _apply_chat_template(tokenizer, [{"role": "user", "content": prompt}])
        ids = [int(i) for i in tokenizer.encode(prompt, add_special_tokens=True)]
    elif isinstance(prompt, Sequence):
        raw_messages: list[object] = list(prompt)
        if not raw_messages:
            raise ValueError("empty prompt: the message list is empty")
        messages: list[dict[str, Any]] = []
        for i, message in enumerate(raw_messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("content"), str):
                raise ValueError(
                    f"message {i} must be a mapping with a string 'content' and a 'role', got {message!r}"
                )
            if not isinstance(message.get("role"), str):
                raise ValueError(f"message {i} has no string 'role': {message!r}")
            messages.append(dict(message))
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"tokenizer {type(tokenizer).__name__} has no chat template; pass the prompt as plain text"
            )
        ids = _apply_chat_template(tokenizer, messages)
    else:
        raise ValueError(f"prompt must be a string or a list of messages, got {type(prompt).__name__}")
    if not ids:
        raise ValueError(f"prompt {prompt!r} encodes to no tokens")
    return ids


def _apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    # transformers has returned list[int], a BatchEncoding and a tensor across versions.
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    if hasattr(encoded, "tolist"):
        encoded = encoded.tolist()
    ids = list(encoded)
    if ids and isinstance(ids[0], list):  # batched shape for a single conversation
        ids = ids[0]
    return [int(i) for i in ids]
