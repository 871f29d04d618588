"""Model pairs: the tiny test pair, tokenizer checks, pair loading and the real default pair."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from decoder.models import (
    ModelPair,
    RowScaledInt8Linear,
    cache_dir,
    check_tokenizers_match,
    describe_dtype,
    is_int8_dynamic,
    quantize_int8_dynamic,
    quantize_int8_per_row,
    resolve_dtype,
    tiny_pair,
    tiny_tokenizer,
)
from decoder.pairs import DEFAULT_PAIR, PAIRS, SHIPPED_PAIRS, get_pair_spec, load_pair, pair_status, register


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.state_dict())


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _sd_acceptance(pair: ModelPair, seed: int) -> float:
    """Mean 1 − TV(p, q) at temperature 1 over random contexts: standard SD's acceptance rate."""
    generator = torch.Generator().manual_seed(seed)
    contexts = torch.randint(0, 256, (8, 24), generator=generator)
    with torch.inference_mode():
        p = pair.target(contexts).logits.softmax(-1)
        q = pair.draft(contexts).logits.softmax(-1)
    return float(1 - 0.5 * (p - q).abs().sum(-1).mean())


# ------------------------------------------------------------------------------------------------
# tiny_pair
# ------------------------------------------------------------------------------------------------


def test_tiny_pair_same_seed_gives_identical_weights() -> None:
    a, b = tiny_pair(seed=3), tiny_pair(seed=3)
    assert _same_weights(a.target, b.target)
    assert _same_weights(a.draft, b.draft)


def test_tiny_pair_different_seeds_differ() -> None:
    a, b = tiny_pair(seed=0), tiny_pair(seed=1)
    assert not _same_weights(a.target, b.target)
    assert not _same_weights(a.draft, b.draft)


def test_tiny_pair_leaves_global_rng_untouched() -> None:
    before = torch.random.get_rng_state()
    tiny_pair(seed=5)
    assert torch.equal(before, torch.random.get_rng_state())


def test_tiny_pair_shapes_and_metadata() -> None:
    pair = tiny_pair()
    assert pair.target.config.vocab_size >= len(pair.tokenizer)
    assert pair.draft.config.vocab_size == pair.target.config.vocab_size
    assert pair.max_context == pair.target.config.max_position_embeddings == 512
    im_end = pair.tokenizer.convert_tokens_to_ids("<|im_end|>")
    endoftext = pair.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert set(pair.eos_token_ids) == {im_end, endoftext}
    assert pair.target.dtype == pair.draft.dtype == torch.float32
    for model in (pair.target, pair.draft):
        assert not model.training
        assert not any(p.requires_grad for p in model.parameters())


def test_tiny_pair_draft_is_close_but_not_equal() -> None:
    for seed in range(3):
        pair = tiny_pair(seed=seed)
        assert not _same_weights(pair.target, pair.draft)
        acceptance = _sd_acceptance(pair, seed=100 + seed)
        assert 0.3 < acceptance < 0.85, f"seed {seed}: acceptance {acceptance:.3f}"


def test_tiny_pair_zero_noise_draft_equals_target() -> None:
    pair = tiny_pair(seed=2, draft_noise=0.0)
    assert _same_weights(pair.target, pair.draft)
    assert _sd_acceptance(pair, seed=0) == pytest.approx(1.0, abs=1e-5)


def test_tiny_pair_draft_noise_controls_acceptance() -> None:
    close = _sd_acceptance(tiny_pair(seed=0, draft_noise=0.05), seed=7)
    far = _sd_acceptance(tiny_pair(seed=0, draft_noise=0.4), seed=7)
    assert close > far


def test_tiny_pair_rejects_vocab_smaller_than_tokenizer() -> None:
    with pytest.raises(ValueError, match="vocab_size 100"):
        tiny_pair(vocab_size=100)


# ------------------------------------------------------------------------------------------------
# Tokenizer and prompts
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["hello", "héllo wörld 日本語 🙂", "  leading spaces\nand\ttabs  "])
def test_tiny_tokenizer_round_trips_text(text: str) -> None:
    pair = tiny_pair()
    ids = pair.encode_prompt(text, chat=False)
    assert ids == list(text.encode("utf-8"))  # one id per byte
    assert pair.tokenizer.decode(ids) == text


def test_encode_prompt_applies_chat_template() -> None:
    pair = tiny_pair()
    ids = pair.encode_prompt("hello")
    assert pair.tokenizer.decode(ids) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    im_start = pair.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == im_start  # the special token is one id, not its spelled-out bytes


def test_encode_prompt_messages_use_template_even_without_chat_flag() -> None:
    pair = tiny_pair()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = pair.tokenizer.decode(pair.encode_prompt(messages, chat=False))
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_encode_prompt_plain_text_when_chat_off() -> None:
    pair = tiny_pair()
    assert pair.tokenizer.decode(pair.encode_prompt("hello", chat=False)) == "hello"


@pytest.mark.parametrize("prompt", ["", []])
def test_encode_prompt_rejects_empty(prompt: str | list[dict[str, str]]) -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        tiny_pair().encode_prompt(prompt)


def test_encode_prompt_rejects_malformed_message() -> None:
    with pytest.raises(ValueError, match="message 0"):
        tiny_pair().encode_prompt([{"role": "user"}])


def test_check_tokenizers_match_accepts_identical() -> None:
    check_tokenizers_match(tiny_tokenizer(), tiny_tokenizer())


def test_check_tokenizers_match_names_both_vocab_sizes() -> None:
    target_tok, draft_tok = tiny_tokenizer(), tiny_tokenizer()
    draft_tok.add_special_tokens({"additional_special_tokens": ["<|fim_middle|>"]})
    with pytest.raises(ValueError, match=r"target vocab size 259, draft vocab size 260"):
        check_tokenizers_match(target_tok, draft_tok)


def test_check_tokenizers_match_catches_same_size_different_ids() -> None:
    target_tok, draft_tok = tiny_tokenizer(), tiny_tokenizer()
    target_tok.add_tokens(["<a>"])
    draft_tok.add_tokens(["<b>"])
    with pytest.raises(ValueError, match=r"target vocab size 260, draft vocab size 260.*'<a>'.*'<b>'"):
        check_tokenizers_match(target_tok, draft_tok)


# ------------------------------------------------------------------------------------------------
# load_pair: names, custom dirs, errors
# ------------------------------------------------------------------------------------------------


def test_unknown_pair_name_lists_known_names() -> None:
    with pytest.raises(ValueError, match="unknown model pair 'gpt-5'.*smollm2-135m.*qwen2.5-coder-1.5b"):
        load_pair("gpt-5")


def test_shipped_pairs_include_default() -> None:
    assert DEFAULT_PAIR == "smollm2-135m"
    assert set(SHIPPED_PAIRS) == {"smollm2-135m", "qwen2.5-coder-1.5b"}


def test_tiny_pair_is_registered_like_any_other() -> None:
    assert set(PAIRS) == {"smollm2-135m", "qwen2.5-coder-1.5b", "tiny"}
    spec = get_pair_spec("tiny")
    assert spec.test_pair and spec.torch_threads == 1 and "tiny" not in SHIPPED_PAIRS
    pair = load_pair("tiny", seed=3)
    same = tiny_pair(seed=3)
    assert pair.name == same.name == "tiny-seed3" and _same_weights(pair.target, same.target)
    assert load_pair("tiny", max_context=1024).max_context == 1024
    status = pair_status("tiny")
    assert status.available and status.size_bytes == 0
    with pytest.raises(ValueError, match="unknown model pair 'gpt-5'; known pairs: smollm2-135m, qwen2.5-coder-1.5b, tiny"):
        get_pair_spec("gpt-5")


def test_registry_rejects_a_duplicate_or_comma_name() -> None:
    spec = get_pair_spec("tiny")
    with pytest.raises(ValueError, match="already registered"):
        register(spec)
    with pytest.raises(ValueError, match="no commas"):
        register(dataclasses.replace(spec, name="a,b"))


def test_qwen_not_fetched_names_fetch_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSD_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="run: fsd models fetch qwen2.5-coder-1.5b"):
        load_pair("qwen2.5-coder-1.5b")


def test_resolve_dtype_names_bad_value() -> None:
    assert resolve_dtype("bf16", torch.float32) is torch.bfloat16
    assert resolve_dtype(None, torch.float16) is torch.float16
    with pytest.raises(ValueError, match="'fp8'"):
        resolve_dtype("fp8", torch.float32)


def test_bad_draft_dtype_fails_before_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An empty cache: had it tried to load first, the error would be about the missing model instead.
    monkeypatch.setenv("FSD_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="unknown draft dtype 'int4'"):
        load_pair("qwen2.5-coder-1.5b", draft_dtype="int4")
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        load_pair("qwen2.5-coder-1.5b", dtype="fp8")


def test_tiny_pair_applies_dtype_overrides_and_refuses_bad_ones() -> None:
    """The test pair honours dtype / draft_dtype like the real pairs (it used to ignore them, bad ones too)."""
    pair = load_pair("tiny", dtype="bf16", draft_dtype="int8")
    assert pair.target.dtype is torch.bfloat16
    assert "overridden: target bf16, draft int8" in pair.description
    assert load_pair("tiny").target.dtype is torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'float7'"):
        load_pair("tiny", dtype="float7")
    with pytest.raises(ValueError, match="unknown draft dtype 'int3'"):
        load_pair("tiny", draft_dtype="int3")


@pytest.fixture
def tiny_dirs(tmp_path: Path) -> Iterator[tuple[Path, Path, ModelPair]]:
    """The tiny pair saved as two HF model dirs, as a user's custom pair would be."""
    pair = tiny_pair(seed=4)
    target_dir, draft_dir = tmp_path / "target", tmp_path / "draft"
    for model, path in ((pair.target, target_dir), (pair.draft, draft_dir)):
        model.save_pretrained(path)
        pair.tokenizer.save_pretrained(path)
    yield target_dir, draft_dir, pair


def test_load_custom_pair_from_dirs(tiny_dirs: tuple[Path, Path, ModelPair]) -> None:
    target_dir, draft_dir, original = tiny_dirs
    pair = load_pair((str(target_dir), str(draft_dir)))
    assert _same_weights(pair.target, original.target)
    assert _same_weights(pair.draft, original.draft)
    assert pair.max_context == 512
    assert pair.tokenizer.decode(pair.encode_prompt("hi")) == original.tokenizer.decode(
        original.encode_prompt("hi")
    )
    assert set(pair.eos_token_ids) == set(original.eos_token_ids)


def test_load_custom_pair_comma_string_with_int8_draft(tiny_dirs: tuple[Path, Path, ModelPair]) -> None:
    target_dir, draft_dir, _ = tiny_dirs
    pair = load_pair(f"{target_dir},{draft_dir}", dtype="bf16", draft_dtype="int8")
    assert pair.target.dtype == torch.bfloat16
    assert is_int8_dynamic(pair.draft)
    assert not is_int8_dynamic(pair.target)


def test_load_custom_pair_with_a_per_row_int8_draft(tiny_dirs: tuple[Path, Path, ModelPair]) -> None:
    target_dir, draft_dir, original = tiny_dirs
    pair = load_pair(f"{target_dir},{draft_dir}", draft_dtype="int8-row")
    assert describe_dtype(pair.draft) == "int8 per row" and describe_dtype(pair.target) == "fp32"
    assert is_int8_dynamic(pair.draft) and "draft int8 per row" in pair.description
    assert _sd_acceptance(pair, 0) == pytest.approx(_sd_acceptance(original, 0), abs=0.05)


def _rows_alone_and_batched(model: torch.nn.Module, contexts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        batched = model(contexts).logits
        alone = torch.cat([model(contexts[i : i + 1]).logits for i in range(contexts.shape[0])])
    return batched, alone


def test_per_row_int8_draft_is_batch_invariant_where_per_tensor_int8_is_not() -> None:
    """torch's dynamic int8 Linear quantizes activations with one scale per input tensor, so a row's
    logits move with the rest of its batch; the per-row draft gives every row bit-identical logits
    alone and in a batch, at the precision of the per-tensor one (both near the fp32 model's)."""
    import copy

    pair = tiny_pair(seed=2)
    contexts = torch.randint(0, 256, (4, 12), generator=torch.Generator().manual_seed(1))
    per_row = quantize_int8_per_row(copy.deepcopy(pair.target))
    per_tensor = quantize_int8_dynamic(copy.deepcopy(pair.target))
    assert any(isinstance(m, RowScaledInt8Linear) for m in per_row.modules())
    batched, alone = _rows_alone_and_batched(per_row, contexts)
    assert torch.equal(batched, alone)
    batched_t, alone_t = _rows_alone_and_batched(per_tensor, contexts)
    assert not torch.equal(batched_t, alone_t), "per-tensor scales: the batch moves a row (else this test proves nothing)"
    with torch.inference_mode():
        exact = pair.target(contexts).logits
    err_row, err_tensor = (batched - exact).abs().mean(), (batched_t - exact).abs().mean()
    assert err_row <= 1.5 * err_tensor, (float(err_row), float(err_tensor))


def test_per_row_linear_matches_the_float_layer_and_rejects_a_one_wide_input() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    layer = RowScaledInt8Linear(linear)
    x = torch.randn(3, 5, 64) * torch.tensor([0.01, 1.0, 100.0]).view(3, 1, 1)  # rows four decades apart
    with torch.inference_mode():
        out, exact = layer(x), linear(x)
    assert out.shape == exact.shape == (3, 5, 32)
    # Relative to each row's own size: per-row scales keep small rows as precise as large ones.
    rel = ((out - exact).norm(dim=-1) / exact.norm(dim=-1)).max()
    assert rel < 0.05, float(rel)
    # A non-finite row comes back NaN; the other rows are exactly what they are without it.
    broken = x.clone()
    broken[1, 2, 7] = float("nan")
    broken[2, 0, 3] = float("inf")
    broken[0, 4] = 0.0  # an all-zero row (scale 0) gives the bias, no NaN
    with torch.inference_mode():
        out_broken = layer(broken)
    assert torch.isnan(out_broken[1, 2]).all() and torch.isnan(out_broken[2, 0]).all()
    assert torch.equal(out_broken[0, 4], linear.bias.detach())
    keep = torch.ones(3, 5, dtype=torch.bool)
    keep[1, 2] = keep[2, 0] = keep[0, 4] = False
    assert torch.equal(out_broken[keep], out[keep])
    with pytest.raises(ValueError, match="in_features >= 2, got 1"):
        RowScaledInt8Linear(torch.nn.Linear(1, 4))


def test_load_custom_pair_refuses_mismatched_tokenizers(tiny_dirs: tuple[Path, Path, ModelPair]) -> None:
    target_dir, draft_dir, pair = tiny_dirs
    other = tiny_tokenizer()
    other.add_special_tokens({"additional_special_tokens": ["<|fim_middle|>"]})
    other.save_pretrained(draft_dir)
    with pytest.raises(ValueError, match="target vocab size 259, draft vocab size 260"):
        load_pair((str(target_dir), str(draft_dir)))


def test_load_custom_pair_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot load model"):
        load_pair((str(tmp_path / "nope"), str(tmp_path / "nope2")))


# ------------------------------------------------------------------------------------------------
# The real default pair (slow: one GGUF conversion + one cache load, tests/decoder/conftest.py)
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_pair_metadata(smollm2_loads: tuple[ModelPair, ModelPair]) -> None:
    pair, _ = smollm2_loads
    assert pair.name == "smollm2-135m"
    assert pair.max_context == 8192
    assert len(pair.tokenizer) == 49152
    assert pair.tokenizer.convert_tokens_to_ids("<|im_end|>") in pair.eos_token_ids
    assert pair.target.dtype == torch.float32
    assert pair.target.config.tie_word_embeddings


@pytest.mark.slow
def test_smollm2_draft_is_an_int8_per_row_copy(smollm2_loads: tuple[ModelPair, ModelPair]) -> None:
    pair, _ = smollm2_loads
    assert is_int8_dynamic(pair.draft) and describe_dtype(pair.draft) == "int8 per row"
    assert not is_int8_dynamic(pair.target)
    assert "int8 per-row copy" in pair.description
    assert not pair.draft.training


@pytest.mark.slow
def test_smollm2_greedy_next_token_is_sensible(smollm2_loads: tuple[ModelPair, ModelPair]) -> None:
    pair, _ = smollm2_loads
    ids = torch.tensor([pair.encode_prompt("What is the capital of France? Answer in one word.")])
    with torch.inference_mode():
        target_logits = pair.target(ids).logits[0, -1]
        draft_logits = pair.draft(ids).logits[0, -1]
    assert torch.isfinite(target_logits).all() and torch.isfinite(draft_logits).all()
    continuation = ids
    with torch.inference_mode():
        for _ in range(8):
            next_id = pair.target(continuation).logits[0, -1].argmax()
            continuation = torch.cat([continuation, next_id.view(1, 1)], dim=1)
    assert "Paris" in pair.tokenizer.decode(continuation[0, ids.shape[1] :])


@pytest.mark.slow
def test_smollm2_cache_round_trip_gives_identical_logits(smollm2_loads: tuple[ModelPair, ModelPair]) -> None:
    from_gguf, from_cache = smollm2_loads
    ids = torch.tensor([from_gguf.encode_prompt("Write a haiku about the sea.")])
    assert ids.tolist() == [from_cache.encode_prompt("Write a haiku about the sea.")]
    with torch.inference_mode():
        assert torch.equal(from_gguf.target(ids).logits, from_cache.target(ids).logits)
        assert torch.equal(from_gguf.draft(ids).logits, from_cache.draft(ids).logits)
    # Tied embeddings stay tied after the safetensors round trip.
    model = from_cache.target
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert from_cache.tokenizer.chat_template == from_gguf.tokenizer.chat_template


#: The user's cache, read at import: module fixtures above point FSD_CACHE_DIR at private dirs.
_USER_CACHE = cache_dir()


def _qwen_fetched() -> bool:
    return pair_status("qwen2.5-coder-1.5b").available


@pytest.mark.slow
@pytest.mark.skipif(not _qwen_fetched(), reason="run `fsd models fetch qwen2.5-coder-1.5b` first")
def test_qwen_pair_loads_with_matching_tokenizers_and_writes_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSD_CACHE_DIR", str(_USER_CACHE))
    pair = load_pair("qwen2.5-coder-1.5b")
    assert pair.target.dtype == torch.bfloat16
    assert is_int8_dynamic(pair.draft)
    assert pair.max_context == 32768
    assert pair.tokenizer.convert_tokens_to_ids("<|im_end|>") in pair.eos_token_ids
    prompt = pair.encode_prompt("Write a Python function square(x) that returns x squared.")
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        draft_logits = pair.draft(ids).logits[0, -1]
        # Greedy with HF's own KV-cache loop; the model may open with a sentence before the code.
        out = pair.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False)
    assert torch.isfinite(draft_logits).all()
    assert "def square" in pair.tokenizer.decode(out[0, len(prompt) :])


@pytest.mark.slow
def test_smollm2_small_batch_layout_gives_the_same_logits(smollm2_loads: tuple[ModelPair, ModelPair]) -> None:
    from decoder.linear_layout import SmallBatchLinear

    pair, _ = smollm2_loads
    layers = [m for m in pair.target.modules() if isinstance(m, SmallBatchLinear)]
    if not layers:
        pytest.skip(f"the layout did not pay on this machine at load: {pair.description}")
    assert f"{len(layers)} layers transposed" in pair.description
    cut = layers[0].max_rows
    ids = torch.tensor([pair.encode_prompt("Write a haiku about the sea.")[:cut]]).T  # [cut rows, 1 position]
    with torch.inference_mode():
        transposed = pair.target(ids).logits
        for m in layers:
            m.max_rows = 0
        try:
            plain = pair.target(ids).logits
        finally:
            for m in layers:
                m.max_rows = cut
    torch.testing.assert_close(transposed, plain, rtol=1e-4, atol=1e-3)
