"""The target-only baseline (decoder/baseline.py) against the engine, on the tiny random pair."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from decoder.baseline import target_only_decode
from decoder.engine import FSDEngine, SamplingParams
from decoder.models import ModelPair
from decoder.pairs import load_pair


@pytest.fixture(scope="module")
def pair() -> Iterator[ModelPair]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models only lose time to OpenMP hand-offs on a busy machine
    yield load_pair("tiny", seed=0)
    torch.set_num_threads(threads)


def test_greedy_baseline_equals_lossless_speculative_decoding(pair: ModelPair) -> None:
    # Greedy and T = 0: speculative decoding emits exactly the target's own greedy tokens.
    prompt = pair.encode_prompt("hello there")
    params = SamplingParams(temperature=0.0, max_new_tokens=24, eos_token_ids=())
    base = target_only_decode(pair, prompt, params)
    engine = FSDEngine(pair, num_draft_tokens=3, div="kl", max_batch_size=1)
    engine.add_request("r", prompt, params, threshold=0.0)
    engine.run_to_completion()
    assert base.token_ids == list(engine.output("r").token_ids)
    assert base.finish_reason == "length" and len(base.token_ids) == 24
    assert base.time_s >= base.prefill_s > 0


def test_sampled_baseline_is_reproducible_per_seed(pair: ModelPair) -> None:
    prompt = pair.encode_prompt("abc")
    params = SamplingParams(temperature=1.0, max_new_tokens=16, eos_token_ids=(), seed=7)
    a, b = target_only_decode(pair, prompt, params), target_only_decode(pair, prompt, params)
    other = target_only_decode(pair, prompt, SamplingParams(temperature=1.0, max_new_tokens=16, eos_token_ids=(),
                                                            seed=8))
    assert a.token_ids == b.token_ids and a.token_ids != other.token_ids


def test_stop_string_cuts_the_text(pair: ModelPair) -> None:
    prompt = pair.encode_prompt("abc")
    free = target_only_decode(pair, prompt, SamplingParams(temperature=0.0, max_new_tokens=32, eos_token_ids=()))
    stop = free.text[5:7]
    assert stop, free.text
    cut = target_only_decode(pair, prompt, SamplingParams(temperature=0.0, max_new_tokens=32, eos_token_ids=(),
                                                          stop=(stop,)))
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.find(stop)]
