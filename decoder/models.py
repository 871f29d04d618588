"""Draft/target model pairs: what the FSD engine runs on.

A :class:`ModelPair` bundles a target model, a draft model that shares the target's tokenizer (so the
two next-token distributions live over the same vocabulary), the tokenizer itself and the facts the
engine needs (context length, end-of-sequence ids).

This module builds pairs from models (HF directories, hub ids, ``*.gguf`` files: ``load_custom_pair``;
random weights: :func:`tiny_pair`). Named pairs — which exist, where their weights come from, how each is
loaded — are the registry's: ``decoder/pairs.py`` (``load_pair(name)``); fetching their weights is
``decoder/model_fetch.py``. Neither is imported here.

Dequantizing a GGUF takes tens of seconds, so shipped pairs are converted once to safetensors under
the cache directory (``$FSD_CACHE_DIR``, default ``~/.cache/fsd-runtime``) and loaded from there.

:func:`tiny_pair` builds a tiny random Llama pair with a real in-memory byte-level tokenizer for fast,
deterministic unit tests.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Token strings treated as end-of-sequence when the vocabulary has them (ChatML-style chat models
# end an assistant turn with <|im_end|>; base models end documents with <|endoftext|>).
_CHAT_EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")

DTypeLike = str | torch.dtype | None

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}
INT8_DYNAMIC = "int8"
#: Dynamic int8 with one activation scale per row (token) instead of per tensor: batch-invariant.
INT8_PER_ROW = "int8-row"
_FLOAT_WORDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}  # describe_dtype's words


# --------------------------------------------------------------------------------------------------
# ModelPair
# --------------------------------------------------------------------------------------------------


@dataclass
class ModelPair:
    """A target model, its draft model and their shared tokenizer.

    Both models are in eval mode with ``requires_grad`` off; running them under
    ``torch.inference_mode`` is the caller's business. The draft may be int8 dynamically quantized
    (its ``nn.Linear`` layers replaced by ``torch.ao.nn.quantized.dynamic.Linear``), in which case it
    runs in fp32 activations whatever the target's dtype.
    """

    target: PreTrainedModel
    draft: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    max_context: int  # positions the target supports (config.max_position_embeddings)
    eos_token_ids: tuple[int, ...]
    description: str = ""
    # The draft is a quantized (or otherwise lightly altered) copy of the target's own weights, so its keys
    # and values are the target's up to that alteration: the engine may run it on the target's KV cache
    # (FSDEngine's share_kv) instead of keeping a cache of its own.
    draft_is_target_copy: bool = False

    def encode_prompt(self, prompt: str | Sequence[Mapping[str, Any]], chat: bool = True) -> list[int]:
        """Token ids for ``prompt``.

        A list of ``{"role": ..., "content": ...}`` messages always goes through the tokenizer's chat
        template (with the generation prompt appended). A plain string goes through it too when
        ``chat`` is true and the tokenizer has a template (as a single user turn); otherwise it is
        tokenized as raw text.
        """
        return encode_prompt(self.tokenizer, prompt, chat=chat)


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str | Sequence[Mapping[str, Any]], chat: bool = True
) -> list[int]:
    """See :meth:`ModelPair.encode_prompt`."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("empty prompt: expected non-empty text or a non-empty list of messages")
        if chat and getattr(tokenizer, "chat_template", None):
            return _apply_chat_template(tokenizer, [{"role": "user", "content": prompt}])
        ids = list(tokenizer.encode(prompt, add_special_tokens=True))
    elif isinstance(prompt, Sequence):
        # Typed as object: the messages come from callers (JSON) and are checked one by one below.
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


def _apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]) -> list[int]:
    encoded = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    # transformers has returned list[int], a BatchEncoding and a tensor across versions.
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    if isinstance(encoded, torch.Tensor):
        encoded = encoded.tolist()
    ids = list(encoded)
    if ids and isinstance(ids[0], list):  # batched shape for a single conversation
        ids = ids[0]
    return [int(i) for i in ids]


# --------------------------------------------------------------------------------------------------
# Tokenizer compatibility
# --------------------------------------------------------------------------------------------------


def check_tokenizers_match(target_tok: PreTrainedTokenizerBase, draft_tok: PreTrainedTokenizerBase) -> None:
    """Raise ``ValueError`` unless the two tokenizers map tokens to the same ids.

    Speculative decoding compares the two models' distributions id by id, so the vocabularies must be
    the same. Checks the full size (base vocabulary plus added tokens), every special token and an
    evenly spaced sample of the vocabulary.
    """
    target_size, draft_size = len(target_tok), len(draft_tok)
    if target_size != draft_size:
        raise ValueError(
            f"tokenizers differ: target vocab size {target_size}, draft vocab size {draft_size}"
        )
    stride = max(1, target_size // 512)
    sample_ids = list(range(0, target_size, stride)) + [target_size - 1]
    target_tokens = target_tok.convert_ids_to_tokens(sample_ids)
    draft_tokens = draft_tok.convert_ids_to_tokens(sample_ids)
    for token_id, t_tok, d_tok in zip(sample_ids, target_tokens, draft_tokens, strict=True):
        if t_tok != d_tok:
            raise ValueError(
                f"tokenizers differ (target vocab size {target_size}, draft vocab size {draft_size}): "
                f"id {token_id} is {t_tok!r} for the target but {d_tok!r} for the draft"
            )
    for token in target_tok.all_special_tokens:
        t_id = target_tok.convert_tokens_to_ids(token)
        d_id = draft_tok.convert_tokens_to_ids(token)
        if t_id != d_id:
            raise ValueError(
                f"tokenizers differ (target vocab size {target_size}, draft vocab size {draft_size}): "
                f"special token {token!r} is id {t_id} for the target but {d_id} for the draft"
            )


def _check_model_vocab_sizes(target: PreTrainedModel, draft: PreTrainedModel, tokenizer_size: int) -> None:
    target_vocab = int(target.config.vocab_size)
    draft_vocab = int(draft.config.vocab_size)
    # The engine compares logits position by position, so both output layers must be equally wide.
    if target_vocab != draft_vocab:
        raise ValueError(
            f"model vocab sizes differ: target vocab size {target_vocab}, draft vocab size {draft_vocab}"
        )
    if target_vocab < tokenizer_size:
        raise ValueError(
            f"model vocab size {target_vocab} is smaller than the tokenizer's {tokenizer_size} tokens"
        )


def eos_token_ids_for(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel | None = None) -> tuple[int, ...]:
    """End-of-sequence ids: the generation config's, the tokenizer's, and the ChatML end tokens."""
    ids: list[int] = []

    def add(value: Any) -> None:
        if value is None:
            return
        if isinstance(value, int):
            if value not in ids:
                ids.append(value)
            return
        for v in value:
            add(v)

    if model is not None and getattr(model, "generation_config", None) is not None:
        add(model.generation_config.eos_token_id)
    if model is not None:
        add(getattr(model.config, "eos_token_id", None))
    add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    for token in _CHAT_EOS_TOKENS:
        if token in vocab:
            add(vocab[token])
    if not ids:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} defines no end-of-sequence token")
    return tuple(ids)


# --------------------------------------------------------------------------------------------------
# Dtypes and the int8 draft
# --------------------------------------------------------------------------------------------------


def resolve_dtype(dtype: DTypeLike, default: torch.dtype) -> torch.dtype:
    """``torch.dtype`` for a name like ``"bf16"`` (``None`` ⇒ ``default``)."""
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported model dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[key]


def _is_int8(dtype: DTypeLike) -> bool:
    return isinstance(dtype, str) and dtype.lower() in (INT8_DYNAMIC, "qint8", "int8-dynamic", INT8_PER_ROW)


def _is_int8_per_row(dtype: DTypeLike) -> bool:
    return isinstance(dtype, str) and dtype.lower() == INT8_PER_ROW


def quantize_int8_dynamic(model: PreTrainedModel) -> PreTrainedModel:
    """Quantize ``model``'s ``nn.Linear`` weights to int8 in place (dynamic activation quantization).

    Converts the model to fp32 first: the dynamic quantized kernels take fp32 activations. On CPU
    this is the fastest draft by far (see MEASURED.md: 2-4x faster per forward than bf16).
    """
    model = model.float()  # type: ignore[no-untyped-call]  # transformers' PreTrainedModel.float is unannotated
    with warnings.catch_warnings():
        # torch.ao.quantization is deprecated in favour of torchao, which is not a dependency here.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        # torch's quantize_dynamic is unannotated.
        torch.ao.quantization.quantize_dynamic(  # type: ignore[no-untyped-call]
            model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True
        )
    return model


class RowScaledInt8Linear(torch.nn.Module):
    """A dynamic int8 ``nn.Linear`` that quantizes each row (token) of its input with its own scale.

    torch's dynamic int8 Linear takes one activation scale for the whole input tensor, so in a batch a
    row's output depends on the other rows' magnitudes (a row beside a large one loses precision): a
    draft built that way accepts differently depending on which requests share its batch. Here each
    row is divided by its own max |x| first, and an anchor row holding exactly ±1 fixes the tensor's
    range at [−1, 1], so the quantization grid, and every row's output, is the same whatever else is
    in the batch (bit for bit, for finite rows; a non-finite row comes back NaN without touching the
    others); the row's scale and the bias are applied after the int8 product. The grid is symmetric,
    so a one-sided row uses half of it: per row is more precise than per tensor beside larger rows,
    and up to ~1.7x less precise for a one-sided row alone.
    """

    anchor: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        if linear.in_features < 2:
            raise ValueError(f"RowScaledInt8Linear needs in_features >= 2, got {linear.in_features}")
        plain = torch.nn.Linear(linear.in_features, linear.out_features, bias=False, device="meta")  # no init
        plain.weight = torch.nn.Parameter(linear.weight.detach().float(), requires_grad=False)
        with warnings.catch_warnings():
            # torch.ao.quantization is deprecated in favour of torchao, which is not a dependency here.
            for category in (DeprecationWarning, FutureWarning, UserWarning):
                warnings.simplefilter("ignore", category)
            from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

            # from_float reads the qconfig the module carries (torch's own default for dynamic int8).
            plain.qconfig = torch.ao.quantization.default_dynamic_qconfig  # type: ignore[assignment]
            self.inner = DynamicQuantizedLinear.from_float(plain)  # type: ignore[no-untyped-call]
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.register_buffer("bias", bias)
        anchor = torch.zeros(1, linear.in_features)
        anchor[0, 0], anchor[0, 1] = 1.0, -1.0
        self.register_buffer("anchor", anchor, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Hot path (every draft linear, every step): a handful of ops and no host sync; the wrapper's
        # ops cost about as much as the int8 kernel itself at batch 1.
        flat = x.reshape(-1, self.in_features)
        scale = torch.linalg.vector_norm(flat, math.inf, -1, keepdim=True)  # max |x| per row
        # An all-zero row (0 / 0) and a non-finite one enter the kernel as zeros, so neither reaches
        # its range search (a NaN there raises or corrupts the other rows); multiplying by the row's
        # scale afterwards hands a non-finite row back as NaN and a zero row as zeros.
        scaled = torch.cat((flat / scale, self.anchor)).nan_to_num_(0.0, 0.0, 0.0)
        # The inner module's forward minus its checks: its packed int8 weight, and the reduced-range
        # activation grid torch's dynamic Linear (version >= 4) uses.
        packed = self.inner._packed_params._packed_params
        product: torch.Tensor = torch.ops.quantized.linear_dynamic(scaled, packed, reduce_range=True)
        out: torch.Tensor = product[:-1] * scale
        if self.bias is not None:
            out += self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_int8_per_row(model: PreTrainedModel) -> PreTrainedModel:
    """Replace ``model``'s ``nn.Linear`` layers by :class:`RowScaledInt8Linear` in place (fp32 first):
    int8 weights and per-row dynamic activations, so a row's output does not depend on its batch."""
    model = model.float()  # type: ignore[no-untyped-call]  # transformers' PreTrainedModel.float is unannotated
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, RowScaledInt8Linear(child))
    return model


def is_int8_dynamic(model: torch.nn.Module) -> bool:
    """Whether any of ``model``'s layers is a dynamic int8 quantized Linear (per tensor or per row)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    return any(isinstance(m, DynamicQuantizedLinear | RowScaledInt8Linear) for m in model.modules())


def describe_dtype_name(dtype: DTypeLike) -> str:
    """What :func:`describe_dtype` says of a model loaded with ``dtype`` (a name or a torch dtype);
    ValueError for an unknown name."""
    if _is_int8_per_row(dtype):
        return "int8 per row"
    if _is_int8(dtype):
        return "int8 dynamic"
    resolved = resolve_dtype(dtype, torch.float32)
    return _FLOAT_WORDS[resolved]


def describe_dtype(model: torch.nn.Module) -> str:
    """A model's weights in words: ``fp32`` / ``bf16`` / ``fp16``, ``int8 dynamic`` or ``int8 per row``."""
    if any(isinstance(m, RowScaledInt8Linear) for m in model.modules()):
        return "int8 per row"
    if is_int8_dynamic(model):
        return "int8 dynamic"
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    return _FLOAT_WORDS.get(dtype, str(dtype))


def _to(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """``model.to(dtype)``, typed: transformers wraps ``PreTrainedModel.to`` in a decorator that mypy sees as
    an unbound ``functools._Wrapped`` (expecting the model as its first argument) returning Any."""
    moved: PreTrainedModel = model.to(dtype)  # type: ignore[arg-type]
    return moved


def _freeze(model: PreTrainedModel) -> PreTrainedModel:
    model.eval()  # type: ignore[no-untyped-call]  # transformers' PreTrainedModel.eval is unannotated
    for param in model.parameters():
        param.requires_grad_(False)
    return model


# --------------------------------------------------------------------------------------------------
# tiny_pair: random models + real byte-level tokenizer, for unit tests
# --------------------------------------------------------------------------------------------------

TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (what the ByteLevel pre-tokenizer emits)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def tiny_tokenizer() -> PreTrainedTokenizerBase:
    """A real byte-level tokenizer built in memory: ids 0-255 are bytes, then the ChatML specials.

    Any text round-trips through ``encode``/``decode``; a ChatML chat template is attached.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(TINY_SPECIAL_TOKENS))
    # transformers' tokenizer constructors are unannotated.
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def tiny_pair(
    seed: int = 0,
    vocab_size: int = 320,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 512,
    init_std: float = 0.2,
    draft_noise: float = 0.1,
) -> ModelPair:
    """A tiny random fp32 Llama target, a perturbed copy as draft, and a byte-level tokenizer.

    Deterministic in ``seed`` and leaves the global RNG untouched. ``init_std`` (the config's
    ``initializer_range``) is large enough that next-token distributions are peaked rather than
    uniform, and the draft is the target with Gaussian noise of ``draft_noise`` × each weight
    tensor's std added, so the pair agrees only partly: with the defaults, standard speculative
    sampling at temperature 1 accepts ~0.6 of drafted tokens (1 − TV(p, q) averaged over random
    contexts). ``draft_noise=0`` gives a draft identical to the target.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_tokenizer()
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    if draft_noise < 0:
        raise ValueError(f"draft_noise must be >= 0, got {draft_noise}")
    special_ids = tokenizer.convert_tokens_to_ids(list(TINY_SPECIAL_TOKENS))
    assert isinstance(special_ids, list)  # a list of tokens maps to a list of ids
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=None,
        pad_token_id=special_ids[0],
        eos_token_id=special_ids[2],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # model init draws from the global RNG; fork_rng restores it after
        target = _to(LlamaForCausalLM(config), torch.float32)
    draft = copy.deepcopy(target)
    noise_rng = torch.Generator().manual_seed(seed * 1_000_003 + 17)
    with torch.no_grad():
        for param in draft.parameters():
            if param.numel() > 1 and draft_noise > 0:
                scale = draft_noise * float(param.std())
                param.add_(torch.randn(param.shape, generator=noise_rng, dtype=param.dtype) * scale)
    return ModelPair(
        target=_freeze(target),
        draft=_freeze(draft),
        tokenizer=tokenizer,
        name=f"tiny-seed{seed}",
        max_context=max_position_embeddings,
        eos_token_ids=(special_ids[2], special_ids[0]),
        description=f"tiny random Llama ({num_layers}x{hidden_size}, vocab {vocab_size}) fp32 → noise {draft_noise}",
    )


# --------------------------------------------------------------------------------------------------
# Loading models into a pair
# --------------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where converted models live: ``$FSD_CACHE_DIR`` or ``~/.cache/fsd-runtime``."""
    return Path(os.environ.get("FSD_CACHE_DIR") or Path.home() / ".cache" / "fsd-runtime").expanduser()


def _check_draft_dtype(draft_dtype: DTypeLike) -> None:
    if _is_int8(draft_dtype):
        return
    try:
        resolve_dtype(draft_dtype, torch.float32)
    except ValueError:
        raise ValueError(
            f"unknown draft dtype {draft_dtype!r}; use {INT8_DYNAMIC!r} (dynamic int8), {INT8_PER_ROW!r} (dynamic "
            f"int8 with per-row activation scales: batch-invariant) or one of {sorted(_DTYPE_NAMES)}"
        ) from None


def _make_draft(model: PreTrainedModel, draft_dtype: DTypeLike, *, copy_of: bool) -> PreTrainedModel:
    draft = copy.deepcopy(model) if copy_of else model
    if _is_int8_per_row(draft_dtype):
        return quantize_int8_per_row(draft)
    if _is_int8(draft_dtype):
        return quantize_int8_dynamic(draft)
    return _to(draft, resolve_dtype(draft_dtype, model.dtype))


def _assemble(
    name: str,
    target: PreTrainedModel,
    draft: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    description: str,
    draft_is_target_copy: bool = False,
) -> ModelPair:
    _check_model_vocab_sizes(target, draft, len(tokenizer))
    max_context = int(getattr(target.config, "max_position_embeddings", 0) or 0)
    if max_context <= 0:
        raise ValueError(f"target config of {name!r} has no max_position_embeddings")
    return ModelPair(
        target=_freeze(target),
        draft=_freeze(draft),
        tokenizer=tokenizer,
        name=name,
        max_context=max_context,
        eos_token_ids=eos_token_ids_for(tokenizer, target),
        description=description or f"{name}: target {describe_dtype(target)} → draft {describe_dtype(draft)}",
        draft_is_target_copy=draft_is_target_copy,
    )


def _load_hf(source: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A causal LM and its tokenizer from a HF directory/id, or a ``*.gguf`` file (dequantized)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if source.lower().endswith(".gguf"):
        path = Path(source).expanduser()
        if not path.is_file():
            raise ValueError(f"GGUF file {source!r} does not exist")
        from transformers import GgufConfig

        # Dense weights, always: packed GGUF blocks (used when the optional `kernels` package has a
        # matmul kernel) cannot be saved, quantized dynamically or compared against a draft's.
        kwargs: dict[str, Any] = {"gguf_file": path.name}
        model_kwargs: dict[str, Any] = {"quantization_config": GgufConfig(dequantize=True)}
        location = str(path.parent)
    else:
        kwargs = {}
        model_kwargs = {}
        location = source
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, **kwargs, **model_kwargs)
    except OSError as exc:
        raise ValueError(f"cannot load model {source!r} (offline; is it a local model dir?): {exc}") from exc
    if model_kwargs:  # a GGUF: dense now, so drop the quantizer (other quantized checkpoints keep theirs)
        _drop_quantizer(model)
    return model, tokenizer


def _drop_quantizer(model: PreTrainedModel) -> None:
    """Forget GGUF provenance: the weights are already dequantized, and save_pretrained refuses otherwise."""
    # Attributes transformers sets on the instance; mypy sees only nn.Module.__setattr__ (Tensor | Module).
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False  # type: ignore[assignment]


def load_custom_pair(target_src: str, draft_src: str, *, dtype: DTypeLike, draft_dtype: DTypeLike) -> ModelPair:
    """A pair from two HF model directories / hub ids / ``*.gguf`` files (target first)."""
    if not target_src or not draft_src:
        raise ValueError(f"expected 'target,draft', got target {target_src!r} and draft {draft_src!r}")
    started = time.perf_counter()
    target_dtype = resolve_dtype(dtype, torch.float32)
    _check_draft_dtype(draft_dtype)
    draft_float = torch.float32 if _is_int8(draft_dtype) else resolve_dtype(draft_dtype, target_dtype)
    target, tokenizer = _load_hf(target_src, target_dtype)
    draft_model, draft_tok = _load_hf(draft_src, draft_float)
    check_tokenizers_match(tokenizer, draft_tok)
    draft = _make_draft(draft_model, draft_dtype if _is_int8(draft_dtype) else draft_float, copy_of=False)
    name = f"{Path(target_src).name}+{Path(draft_src).name}"
    pair = _assemble(name, target, draft, tokenizer, "")
    logger.info("loaded pair %s in %.1f s", name, time.perf_counter() - started)
    return pair
