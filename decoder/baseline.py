"""The target-only baseline: the target model alone, one token per forward over a KV cache.

What speculative decoding is compared against (``benchmarks/decoder_bench.py`` for speed,
``benchmarks/quality.py`` for task quality). Same sampling transforms (``decoder.sampling``), per-request
generator, eos and stop-string handling as the engine: the text is cut before the first stop string, and
tokens up to the one completing it count. ``eos_token_ids=()`` in the params ignores eos (a fixed length).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from decoder.engine import SamplingParams
from decoder.models import ModelPair
from decoder.sampling import greedy, sample, sampling_probs


@dataclass(frozen=True)
class TargetOnlyOutput:
    """One target-only completion."""

    token_ids: list[int]
    text: str  # cut before the first stop string, special tokens skipped
    finish_reason: str  # "stop" (eos or a stop string) or "length"
    time_s: float  # prefill + decode, wall
    prefill_s: float  # the first forward (prompt), wall


def target_only_decode(pair: ModelPair, prompt_ids: list[int], params: SamplingParams) -> TargetOnlyOutput:
    """Decode ``prompt_ids`` with ``pair.target`` alone (see the module docstring)."""
    eos = set(pair.eos_token_ids if params.eos_token_ids is None else params.eos_token_ids)
    generator = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
    temperature = torch.tensor([params.temperature], dtype=torch.float32)

    def decode(ids: list[int]) -> str:
        return str(pair.tokenizer.decode(ids, skip_special_tokens=True))

    out: list[int] = []
    text: str | None = None
    finish: str | None = None
    prefill_s = 0.0
    started = time.perf_counter()
    with torch.inference_mode():
        cache = DynamicCache()
        feed = torch.tensor([prompt_ids], dtype=torch.long)
        while finish is None:
            logits = pair.target(input_ids=feed, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            if not out:
                prefill_s = time.perf_counter() - started
            probs = sampling_probs(logits.float(), temperature, params.top_k, params.top_p)
            token = int(greedy(probs)[0] if params.greedy else sample(probs, [generator])[0])
            out.append(token)
            if token in eos:
                finish = "stop"
            elif len(out) >= params.max_new_tokens:
                finish = "length"
            if params.stop:
                decoded = decode(out)
                hits = [i for i in (decoded.find(s) for s in params.stop) if i >= 0]
                if hits:
                    text, finish = decoded[: min(hits)], "stop"
            feed = torch.tensor([[token]], dtype=torch.long)
    elapsed = time.perf_counter() - started
    if text is None:
        text = decode(out)
    assert finish is not None  # the loop ends only with a reason
    return TargetOnlyOutput(token_ids=out, text=text, finish_reason=finish, time_s=elapsed, prefill_s=prefill_s)
