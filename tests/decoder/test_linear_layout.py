"""The small-batch weight layout (decoder/linear_layout.py): same results as F.linear up to float rounding,
nothing else about the model changes, and the cut-over rule picks what the timings say."""

from __future__ import annotations

import pytest
import torch

from decoder.engine import FSDEngine, SamplingParams
from decoder.linear_layout import SmallBatchLinear, choose_cut_over, tune_linear_layout
from decoder.models import ModelPair, tiny_pair
from decoder.pairs import load_pair


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 16), (2, 16), (3, 16), (4, 16), (2, 3, 16), (1, 5, 16)])
def test_small_batch_linear_matches_f_linear(bias: bool, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(16, 24, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(24, 16, generator=gen))
        if bias:
            linear.bias.copy_(torch.randn(24, generator=gen))
    x = torch.randn(*shape, generator=gen)
    layer = SmallBatchLinear(linear, max_rows=3)
    out = layer(x)
    assert out.shape == (*shape[:-1], 24)
    torch.testing.assert_close(out, linear(x), rtol=1e-5, atol=1e-5)


def test_small_batch_linear_takes_the_copy_up_to_max_rows_only() -> None:
    linear = torch.nn.Linear(8, 4, bias=False)
    layer = SmallBatchLinear(linear, max_rows=2)
    # Poison the copy: rows it serves come out wrong, rows F.linear serves do not.
    layer.weight_t.zero_()
    assert layer(torch.ones(2, 8)).abs().sum() == 0
    assert layer(torch.ones(3, 8)).abs().sum() > 0
    layer.max_rows = 0
    assert layer(torch.ones(1, 8)).abs().sum() > 0


def test_transposed_layout_keeps_parameters_state_dict_and_tying() -> None:
    pair = tiny_pair(seed=3)
    model = pair.target
    keys = list(model.state_dict())
    n_params = sum(p.numel() for p in model.parameters())
    ids = torch.tensor([[5, 9, 17, 2]])
    with torch.inference_mode():
        before = [model(ids[:, : i + 1].repeat(rows, 1)).logits for i in range(4) for rows in (1, 2, 3)]
    report = tune_linear_layout(model, "transposed", max_rows=3)
    layers = [m for m in model.modules() if isinstance(m, SmallBatchLinear)]
    assert report.layers == len(layers) > 0 and report.max_rows == 3
    assert report.extra_bytes == sum(m.weight.numel() * 4 for m in layers)
    assert list(model.state_dict()) == keys  # the copies are non-persistent buffers
    assert sum(p.numel() for p in model.parameters()) == n_params
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.inference_mode():
        after = [model(ids[:, : i + 1].repeat(rows, 1)).logits for i in range(4) for rows in (1, 2, 3)]
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # Applying it again finds nothing left to convert.
    assert tune_linear_layout(model, "transposed").layers == 0


def test_layout_off_and_bad_input() -> None:
    pair = tiny_pair(seed=1)
    assert tune_linear_layout(pair.target, "off").layers == 0
    assert not any(isinstance(m, SmallBatchLinear) for m in pair.target.modules())
    with pytest.raises(ValueError, match="'sideways'"):
        tune_linear_layout(pair.target, "sideways")
    with pytest.raises(ValueError, match="max_rows must be >= 1, got 0"):
        tune_linear_layout(pair.target, "auto", max_rows=0)
    with pytest.raises(ValueError, match="'diagonal'"):
        load_pair("tiny", linear_layout="diagonal")


def test_bf16_layers_are_left_alone() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8).to(torch.bfloat16), torch.nn.Linear(8, 8))
    report = tune_linear_layout(model, "transposed")
    assert report.layers == 1
    assert type(model[0]) is torch.nn.Linear and isinstance(model[1], SmallBatchLinear)


def test_auto_on_a_model_leaves_it_working_whatever_it_chose() -> None:
    pair = tiny_pair(seed=2)
    ids = torch.tensor([[4, 8, 15, 16]])
    with torch.inference_mode():
        before = pair.target(ids).logits
    report = tune_linear_layout(pair.target, "auto", repeats=1)
    assert len(report.linear_ms) == len(report.transposed_ms) == 3
    assert report.max_rows == choose_cut_over(report.linear_ms, report.transposed_ms, 0.1)
    layers = [m for m in pair.target.modules() if isinstance(m, SmallBatchLinear)]
    assert len(layers) == report.layers and all(m.max_rows == report.max_rows for m in layers)
    with torch.inference_mode():
        torch.testing.assert_close(pair.target(ids).logits, before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("linear_ms", "transposed_ms", "expected"),
    [
        ([48.0, 76.0, 98.0], [42.0, 58.0, 74.0], 3),  # session 16's SmolLM2 timings: all three rows
        ([48.0, 76.0, 98.0], [47.0, 58.0, 74.0], 3),  # one row alone gains 2 %, together 20 %
        ([48.0, 76.0, 98.0], [40.0, 80.0, 60.0], 1),  # slower at 2 rows (beyond noise): stop at 1
        ([48.0, 76.0, 98.0], [49.0, 76.0, 97.0], 0),  # within noise everywhere: no gain, no copies
        ([10.0, 20.0], [100.0, 2.0], 0),  # bf16-like: far slower at one row
        ([], [], 0),
    ],
)
def test_cut_over_rule(linear_ms: list[float], transposed_ms: list[float], expected: int) -> None:
    assert choose_cut_over(linear_ms, transposed_ms, min_gain=0.1) == expected


def test_cut_over_rejects_mismatched_timings() -> None:
    with pytest.raises(ValueError, match="different lengths: 2 and 1"):
        choose_cut_over([1.0, 2.0], [1.0], 0.1)


def _greedy_tokens(pair: ModelPair, k: int, batch: int) -> list[list[int]]:
    engine = FSDEngine(pair, num_draft_tokens=k, max_batch_size=8)
    for r in range(batch):
        engine.add_request(f"r{r}", [3 + r, 11, 40, 7], SamplingParams(temperature=0.0, max_new_tokens=12,
                                                                       eos_token_ids=()), 0.0)
        engine.step()  # staggered joins: ragged rows, as in a served batch
    engine.run_to_completion()
    return [engine.output(f"r{r}").token_ids for r in range(batch)]


@pytest.mark.parametrize("k", [0, 3])
def test_engine_decodes_the_same_tokens_with_the_layout(k: int) -> None:
    plain = tiny_pair(seed=4)
    transposed = tiny_pair(seed=4)
    tune_linear_layout(transposed.target, "transposed")
    for batch in (1, 2, 3, 5):
        assert _greedy_tokens(transposed, k, batch) == _greedy_tokens(plain, k, batch), f"batch {batch}"
