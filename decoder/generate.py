"""HF-style ``generate`` for fuzzy speculative decoding, on top of :class:`decoder.engine.FSDEngine`.

Names follow the reference implementation (``maxholsman/fuzzy-spec-dec``, a transformers
``custom_generate``): ``fsd_threshold``, ``fsd_div_type``, ``num_draft_tokens``,
``track_acceptance_metrics`` and, on the output, ``draft_token_acceptance_rate``,
``total_draft_tokens``, ``total_accepted_tokens``. Additions: ``fsd_rule``, ``mean_distortion``,
``fuzzy_accepted_tokens``, ``tokens_per_iteration``.

Three entry points, one code path (the engine):

- ``generate(target, draft, input_ids, ...)`` — a batch of prompts, HF-shaped output.
- ``target.generate(input_ids, custom_generate=fsd_custom_generate, draft_model=draft, fsd_threshold=...)``
  — transformers 5.x accepts a callable ``custom_generate``. transformers does not forward
  ``assistant_model`` to a callable, so the draft goes in ``draft_model=``.
- ``generate_text(pair, prompt, ...)`` — one prompt string in, text and stats out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from decoder.engine import FSDEngine, RequestOutput, SamplingParams

__all__ = ["FSDGenerateOutput", "GenerateTextResult", "fsd_custom_generate", "generate", "generate_text"]


@dataclass
class FSDGenerateOutput:
    """``sequences`` [B, L + generated] (prompt as given, then the new tokens, right-padded).

    The acceptance fields are filled when ``track_acceptance_metrics`` is on, else None.
    """

    sequences: torch.Tensor
    draft_token_acceptance_rate: float | None = None
    total_draft_tokens: int | None = None
    total_accepted_tokens: int | None = None
    fuzzy_accepted_tokens: int | None = None
    mean_distortion: float | None = None  # distortion per generated token
    tokens_per_iteration: float | None = None
    iterations: int | None = None


@dataclass
class _BarePair:
    target: Any
    draft: Any
    tokenizer: Any
    max_context: int
    eos_token_ids: tuple[int, ...]


def _as_id_tuple(value: int | Sequence[int] | torch.Tensor | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.flatten().tolist()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _prompts(input_ids: torch.Tensor | Sequence[Sequence[int]], attention_mask: torch.Tensor | None) -> list[list[int]]:
    """Per-row prompt ids with left padding removed (by ``attention_mask`` when given)."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
        if attention_mask is None:
            return [row.tolist() for row in input_ids]
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} differs from input_ids {tuple(input_ids.shape)}"
            )
        return [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask, strict=True)]
    prompts = [list(map(int, row)) for row in input_ids]
    if not prompts:
        raise ValueError("input_ids is empty: no prompts")
    return prompts


@torch.inference_mode()
def generate(
    target: Any,
    draft: Any,
    input_ids: torch.Tensor | Sequence[Sequence[int]],
    fsd_threshold: float = 0.0,
    fsd_div_type: str = "kl",
    fsd_rule: str = "reducible",
    num_draft_tokens: int = 4,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    max_new_tokens: int = 128,
    eos_token_id: int | Sequence[int] | None = None,
    stop_strings: str | Sequence[str] | None = None,
    tokenizer: Any = None,
    seed: int | None = None,
    track_acceptance_metrics: bool = False,
    attention_mask: torch.Tensor | None = None,
    pad_token_id: int | None = None,
    max_batch_size: int | None = None,
) -> FSDGenerateOutput:
    """Fuzzy speculative decoding of a batch of prompts; ``fsd_threshold=0`` is exact speculative decoding.

    ``input_ids``: [B, L] (left-padded, with ``attention_mask``) or a list of id lists. ``do_sample=False``
    decodes greedily (top_k / top_p are then ignored). ``num_draft_tokens=0`` is plain target decoding. With ``seed``, row b samples from its own generator seeded ``seed + b``.
    ``eos_token_id`` defaults to the target's generation config; ``stop_strings`` need ``tokenizer``.
    """
    prompts = _prompts(input_ids, attention_mask)
    stops: tuple[str, ...] = (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings or ())
    if stops and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer (pass tokenizer=...)")
    eos = _as_id_tuple(eos_token_id)
    if eos is None:
        eos = _as_id_tuple(getattr(target.generation_config, "eos_token_id", None)) or ()
    config = target.config.get_text_config()
    pair = _BarePair(target, draft, tokenizer, int(config.max_position_embeddings), eos)
    engine = FSDEngine(
        pair,
        num_draft_tokens=num_draft_tokens,
        div=fsd_div_type,
        rule=fsd_rule,
        max_batch_size=max_batch_size or len(prompts),
    )
    for b, prompt in enumerate(prompts):
        params = SamplingParams(
            temperature=float(temperature) if do_sample else 0.0,
            # Greedy decoding ignores top-k / top-p (as HF's generate does with do_sample=False, and as
            # fsd_custom_generate passes them): one behaviour for both entry points.
            top_k=int(top_k or 0) if do_sample else 0,
            top_p=float(top_p if top_p is not None else 1.0) if do_sample else 1.0,
            max_new_tokens=max_new_tokens,
            stop=stops,
            eos_token_ids=eos,
            seed=None if seed is None else seed + b,
        )
        engine.add_request(str(b), prompt, params, threshold=fsd_threshold)
    engine.run_to_completion()
    outputs = [engine.output(str(b)) for b in range(len(prompts))]
    return _assemble(input_ids, prompts, outputs, pad_token_id, eos, track_acceptance_metrics)


def _assemble(
    input_ids: torch.Tensor | Sequence[Sequence[int]],
    prompts: list[list[int]],
    outputs: list[RequestOutput],
    pad_token_id: int | None,
    eos: tuple[int, ...],
    track: bool,
) -> FSDGenerateOutput:
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    if isinstance(input_ids, torch.Tensor):
        base = input_ids if input_ids.dim() == 2 else input_ids[None]
    else:  # ragged lists: left-pad, as a tokenizer would
        width = max(len(p) for p in prompts)
        base = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], dtype=torch.long)
    generated = max(len(o.token_ids) for o in outputs)
    new = torch.full((len(outputs), generated), pad, dtype=torch.long)
    for b, o in enumerate(outputs):
        new[b, : len(o.token_ids)] = torch.tensor(o.token_ids, dtype=torch.long)
    result = FSDGenerateOutput(sequences=torch.cat([base.cpu().long(), new], dim=1))
    if track:
        drafted = sum(o.drafted for o in outputs)
        accepted = sum(o.accepted for o in outputs)
        tokens = sum(len(o.token_ids) for o in outputs)
        iterations = sum(o.iterations for o in outputs)
        result.total_draft_tokens = drafted
        result.total_accepted_tokens = accepted
        result.draft_token_acceptance_rate = accepted / drafted if drafted else 0.0
        result.fuzzy_accepted_tokens = sum(o.fuzzy_accepted for o in outputs)
        result.mean_distortion = sum(o.distortion for o in outputs) / tokens if tokens else 0.0
        result.tokens_per_iteration = tokens / iterations if iterations else 0.0
        result.iterations = iterations
    return result


def fsd_custom_generate(
    model: Any,
    input_ids: torch.Tensor,
    logits_processor: Any = None,
    stopping_criteria: Any = None,
    generation_config: Any = None,
    draft_model: Any = None,
    fsd_threshold: float = 0.0,
    fsd_div_type: str = "kl",
    fsd_rule: str = "reducible",
    num_draft_tokens: int = 4,
    track_acceptance_metrics: bool = False,
    fsd_seed: int | None = None,
    **model_kwargs: Any,
) -> FSDGenerateOutput:
    """A transformers ``custom_generate`` callable: ``target.generate(ids, custom_generate=fsd_custom_generate,
    draft_model=draft, fsd_threshold=0.5, max_new_tokens=64, do_sample=True, temperature=0.7)``.

    Sampling settings (do_sample, temperature, top_k, top_p, max_new_tokens, eos_token_id) come from the
    generation config transformers prepared; logits processors and stopping criteria beyond those are
    not applied (their effect on p and q would have to enter the acceptance test).
    """
    if draft_model is None:
        raise ValueError("fsd_custom_generate needs draft_model=<the draft model>")
    config = generation_config or model.generation_config
    max_new = config.max_new_tokens
    if max_new is None:
        max_new = int(config.max_length) - int(input_ids.shape[1])
    return generate(
        model,
        draft_model,
        input_ids,
        fsd_threshold=fsd_threshold,
        fsd_div_type=fsd_div_type,
        fsd_rule=fsd_rule,
        num_draft_tokens=num_draft_tokens,
        do_sample=bool(config.do_sample),
        temperature=float(config.temperature if config.temperature is not None else 1.0),
        top_k=int(config.top_k or 0) if config.do_sample else 0,
        top_p=float(config.top_p if config.top_p is not None else 1.0) if config.do_sample else 1.0,
        max_new_tokens=int(max_new),
        eos_token_id=config.eos_token_id,
        seed=fsd_seed,
        track_acceptance_metrics=track_acceptance_metrics,
        attention_mask=model_kwargs.get("attention_mask"),
        pad_token_id=config.pad_token_id,
    )


@dataclass
class GenerateTextResult:
    text: str
    output: RequestOutput
    prefill_time_s: float
    decode_time_s: float

    @property
    def tokens_per_second(self) -> float:
        total = self.prefill_time_s + self.decode_time_s
        return len(self.output.token_ids) / total if total > 0 else 0.0


def generate_text(
    pair: Any,
    prompt: str,
    *,
    threshold: float = 0.0,
    div: str = "kl",
    rule: str = "reducible",
    num_draft_tokens: int = 4,
    params: SamplingParams | None = None,
    chat: bool = True,
) -> GenerateTextResult:
    """One prompt through a :class:`decoder.models.ModelPair` (chat template applied when ``chat``)."""
    import time

    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"empty prompt {prompt!r}")
    engine = FSDEngine(pair, num_draft_tokens=num_draft_tokens, div=div, rule=rule, max_batch_size=1)
    engine.add_request("0", pair.encode_prompt(prompt, chat=chat), params or SamplingParams(), threshold)
    prefill = decode = 0.0
    start = time.perf_counter()
    while engine.has_unfinished():
        stats = engine.step()
        prefill += stats.prefill_time_s
    decode = time.perf_counter() - start - prefill
    out = engine.output("0")
    return GenerateTextResult(out.text, out, prefill, decode)
