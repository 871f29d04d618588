"""decoder.generate (HF-style API, custom_generate, generate_text) on tiny pairs; one slow real-pair test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from decoder.engine import SamplingParams
from decoder.generate import fsd_custom_generate, generate, generate_text
from decoder.models import ModelPair, tiny_pair


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: OpenMP threads only spin on a shared CPU
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair() -> ModelPair:
    return tiny_pair(seed=0)


PADDED = torch.tensor([[256, 256, 5, 6, 7], [1, 2, 3, 4, 5], [256, 256, 256, 256, 100]])
MASK = (PADDED != 256).long()


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


def test_greedy_t0_matches_hf_greedy_per_row(pair: ModelPair) -> None:
    out = generate(pair.target, pair.draft, PADDED, attention_mask=MASK, max_new_tokens=12, eos_token_id=[])
    assert out.sequences.shape == (3, 5 + 12)
    assert torch.equal(out.sequences[:, :5], PADDED)
    for b in range(3):
        prompt = PADDED[b][MASK[b].bool()].tolist()
        assert out.sequences[b, 5:].tolist() == hf_greedy(pair.target, prompt, 12), f"row {b}"
    assert out.draft_token_acceptance_rate is None  # tracking off


def test_tracking_fields_and_list_input(pair: ModelPair) -> None:
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5], [100]]
    out = generate(
        pair.target, pair.draft, prompts, fsd_threshold=0.5, max_new_tokens=10, eos_token_id=[],
        track_acceptance_metrics=True, num_draft_tokens=3,
    )
    assert out.sequences.shape == (3, 5 + 10)
    assert out.total_draft_tokens is not None and out.total_accepted_tokens is not None
    assert 0 < out.total_accepted_tokens <= out.total_draft_tokens
    assert out.draft_token_acceptance_rate == out.total_accepted_tokens / out.total_draft_tokens
    assert out.fuzzy_accepted_tokens is not None and out.fuzzy_accepted_tokens > 0
    assert out.mean_distortion is not None and out.mean_distortion > 0
    assert out.tokens_per_iteration is not None and 1.0 <= out.tokens_per_iteration <= 4.0


def test_custom_generate_callable_is_the_same_code_path(pair: ModelPair) -> None:
    kwargs = {"fsd_threshold": 0.3, "num_draft_tokens": 3, "track_acceptance_metrics": True}
    direct = generate(pair.target, pair.draft, PADDED, attention_mask=MASK, max_new_tokens=9, eos_token_id=258, **kwargs)
    via_hf = pair.target.generate(
        PADDED, attention_mask=MASK, custom_generate=fsd_custom_generate, draft_model=pair.draft,
        max_new_tokens=9, do_sample=False, **kwargs,
    )
    assert torch.equal(via_hf.sequences, direct.sequences)
    assert via_hf.total_accepted_tokens == direct.total_accepted_tokens


def test_custom_generate_sampling_settings_come_from_the_generation_config(pair: ModelPair) -> None:
    common = {"max_new_tokens": 8, "num_draft_tokens": 2}
    via_hf = pair.target.generate(
        PADDED, attention_mask=MASK, custom_generate=fsd_custom_generate, draft_model=pair.draft,
        do_sample=True, temperature=0.7, top_k=20, fsd_seed=5, **common,
    )
    direct = generate(
        pair.target, pair.draft, PADDED, attention_mask=MASK, do_sample=True, temperature=0.7, top_k=20,
        seed=5, eos_token_id=258, pad_token_id=256, **common,
    )
    assert torch.equal(via_hf.sequences, direct.sequences)


def test_greedy_ignores_top_k_and_top_p_the_same_way_in_both_entry_points(pair: ModelPair) -> None:
    # Regression (bug 3): generate passed top_k / top_p to greedy rows while fsd_custom_generate zeroed them.
    kwargs = {"fsd_threshold": 0.5, "num_draft_tokens": 3, "track_acceptance_metrics": True, "max_new_tokens": 10}
    plain = generate(pair.target, pair.draft, PADDED, attention_mask=MASK, eos_token_id=258, **kwargs)
    direct = generate(
        pair.target, pair.draft, PADDED, attention_mask=MASK, eos_token_id=258, top_k=3, top_p=0.3, **kwargs
    )
    via_hf = pair.target.generate(
        PADDED, attention_mask=MASK, custom_generate=fsd_custom_generate, draft_model=pair.draft,
        do_sample=False, top_k=3, top_p=0.3, **kwargs,
    )
    assert torch.equal(direct.sequences, plain.sequences) and torch.equal(via_hf.sequences, plain.sequences)
    assert direct.fuzzy_accepted_tokens == via_hf.fuzzy_accepted_tokens == plain.fuzzy_accepted_tokens


def test_k0_generate_equals_hf_greedy(pair: ModelPair) -> None:
    out = generate(pair.target, pair.draft, [[5, 6, 7]], num_draft_tokens=0, max_new_tokens=10, eos_token_id=[])
    assert out.sequences[0, 3:].tolist() == hf_greedy(pair.target, [5, 6, 7], 10)


def test_seeded_generate_is_reproducible(pair: ModelPair) -> None:
    kwargs = {"do_sample": True, "temperature": 0.8, "max_new_tokens": 15, "eos_token_id": [], "fsd_threshold": 0.2}
    a = generate(pair.target, pair.draft, [[5, 6, 7], [9, 9]], seed=11, **kwargs)
    b = generate(pair.target, pair.draft, [[5, 6, 7], [9, 9]], seed=11, **kwargs)
    c = generate(pair.target, pair.draft, [[5, 6, 7], [9, 9]], seed=12, **kwargs)
    assert torch.equal(a.sequences, b.sequences)
    assert not torch.equal(a.sequences, c.sequences)


def test_bad_generate_input(pair: ModelPair) -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        generate(pair.target, pair.draft, [[1, 2]], stop_strings=["x"])
    with pytest.raises(ValueError, match="hellinger"):
        generate(pair.target, pair.draft, [[1, 2]], fsd_div_type="hellinger")
    with pytest.raises(ValueError, match="-1"):
        generate(pair.target, pair.draft, [[1, 2]], fsd_threshold=-1.0)
    with pytest.raises(ValueError, match="empty prompt"):
        generate(pair.target, pair.draft, [[1, 2], []])
    with pytest.raises(ValueError, match="-2"):
        generate(pair.target, pair.draft, [[1, 2]], num_draft_tokens=-2)
    with pytest.raises(ValueError, match="draft_model"):
        pair.target.generate(PADDED, attention_mask=MASK, custom_generate=fsd_custom_generate, max_new_tokens=3)


def test_generate_text_stops_at_stop_string(pair: ModelPair) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=30, eos_token_ids=())
    full = generate_text(pair, "hello", params=params)
    assert full.output.finish_reason == "length" and len(full.output.token_ids) == 30
    stop = next(full.text[i : i + 2] for i in range(5, len(full.text) - 2) if "\ufffd" not in full.text[i : i + 2])
    params = SamplingParams(temperature=0.0, max_new_tokens=30, eos_token_ids=(), stop=(stop,))
    cut = generate_text(pair, "hello", params=params)
    assert cut.text == full.text[: full.text.find(stop)]
    assert cut.output.finish_reason == "stop"
    with pytest.raises(ValueError, match="empty prompt"):
        generate_text(pair, "  ")


def test_cli_generate_prints_text_and_stats(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from fsd_cli.main import main

    argv = ["generate", "--pair", "tiny", "--threshold", "0.5", "-k", "3", "--max-new-tokens", "12", "--seed", "1"]
    assert main([*argv, "--json", "hello"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["tokens"] == 12 or stats["finish_reason"] == "stop"
    assert 0 <= stats["acceptance_rate"] <= 1 and stats["k"] == 3 and stats["threshold"] == 0.5
    assert main([*argv, "hello"]) == 0
    assert "tokens/iteration" in capsys.readouterr().out
    assert main(["generate", "--pair", "tiny", "--div", "hellinger", "hello"]) == 2
    assert "hellinger" in capsys.readouterr().err


@pytest.mark.slow
def test_real_pair_greedy_exact_and_fuzzy_accepts_more(smollm2_loads: tuple[ModelPair, ModelPair]) -> None:
    real, _ = smollm2_loads
    prompts = [
        real.encode_prompt("What is the capital of France?"),
        real.encode_prompt("Write a Python function that reverses a string."),
    ]
    n = 24
    sd = generate(real.target, real.draft, prompts, max_new_tokens=n, eos_token_id=[], track_acceptance_metrics=True)
    for b, prompt in enumerate(prompts):
        reference = hf_greedy(real.target, prompt, n)
        width = max(len(p) for p in prompts)
        assert sd.sequences[b, width:].tolist() == reference, f"prompt {b}"
    fsd = generate(
        real.target, real.draft, prompts, fsd_threshold=1.0, fsd_div_type="kl", max_new_tokens=n, eos_token_id=[],
        track_acceptance_metrics=True,
    )
    assert fsd.draft_token_acceptance_rate is not None and sd.draft_token_acceptance_rate is not None
    assert fsd.draft_token_acceptance_rate > sd.draft_token_acceptance_rate
    assert sd.mean_distortion == 0.0 and fsd.mean_distortion is not None and fsd.mean_distortion > 0
