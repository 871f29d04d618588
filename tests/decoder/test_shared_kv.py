"""The draft on the target's KV cache (FSDEngine's share_kv): exact at T = 0, no draft prefill, no catch-up.
(Sampling at T = 0 with it: tests/decoder/test_engine.py's chi-square test, share_kv=True.)"""

from __future__ import annotations

import dataclasses

import pytest

from decoder.engine import FSDEngine
from decoder.models import ModelPair, tiny_pair
from tests.decoder.test_engine import (  # noqa: F401  (one_thread: the module's autouse fixture)
    PROMPTS,
    greedy_params,
    one_thread,
    sampled,
    target_greedy,
)


@pytest.fixture(scope="module")
def pair() -> ModelPair:
    return tiny_pair(seed=0)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_t0_reproduces_target_greedy(pair: ModelPair, k: int) -> None:
    for prompt in PROMPTS[:4]:
        engine = FSDEngine(pair, num_draft_tokens=k, share_kv=True)
        engine.add_request("r", prompt, greedy_params(24), threshold=0.0)
        engine.run_to_completion()
        assert engine.output("r").token_ids == target_greedy(pair.target, prompt, 24), (k, prompt)


def test_a_draft_identical_to_the_target_is_always_accepted() -> None:
    # The draft reads the target's keys and values at the right positions, beside rows of other lengths and
    # rows that joined mid-flight: were a position or a mask wrong, the identical draft would be rejected.
    same = tiny_pair(seed=0, draft_noise=0.0)
    prompts = {"a": PROMPTS[0], "b": PROMPTS[5], "c": PROMPTS[2], "d": PROMPTS[1]}
    engine = FSDEngine(same, num_draft_tokens=4, share_kv=True)
    engine.add_request("a", prompts["a"], greedy_params(30))
    engine.add_request("b", prompts["b"], greedy_params(30))
    engine.step()
    engine.add_request("c", prompts["c"], greedy_params(30))
    engine.add_request("d", prompts["d"], greedy_params(30), draft_length=2)
    engine.run_to_completion()
    for rid, prompt in prompts.items():
        out = engine.output(rid)
        assert out.accepted == out.drafted > 0, (rid, out.accepted, out.drafted)
        assert out.token_ids == target_greedy(same.target, prompt, 30)


def test_switching_k_is_exact_and_costs_no_catch_up(pair: ModelPair) -> None:
    # Row "x" switches k 3 -> 0 -> 0 -> 2 -> 5 beside rows joining at k = 0 and drafting later: greedy at T = 0
    # it stays plain target decoding, alone and with neighbours, and no step reports a draft catch-up.
    schedule = {1: 0, 3: 2, 4: 5}

    def drive(with_neighbours: bool) -> tuple[list[int], list[int], list[int]]:
        engine = FSDEngine(pair, num_draft_tokens=3, share_kv=True)
        engine.add_request("x", PROMPTS[5], greedy_params(40), threshold=0.0)
        engine.add_request("s", PROMPTS[0], sampled(3, 30), threshold=0.4, draft_length=2)
        engine.add_request("z", PROMPTS[2], greedy_params(30), threshold=0.0, draft_length=0)
        if with_neighbours:
            engine.add_request("n1", PROMPTS[1], sampled(4, 35), threshold=0.2)
            engine.add_request("n2", PROMPTS[2], greedy_params(30), threshold=0.0, draft_length=0)
        step = 0
        while engine.has_unfinished():
            if step in schedule and not engine.output("x").finished:
                engine.set_draft_length(schedule[step], "x")
            if step == 2:
                engine.set_draft_length(3, "z")
            stats = engine.step()
            assert stats.catch_up_time_s == 0.0
            step += 1
        return engine.output("x").token_ids, engine.output("s").token_ids, engine.output("z").token_ids

    alone = drive(False)
    assert alone[0] == target_greedy(pair.target, PROMPTS[5], 40)
    assert alone[2] == target_greedy(pair.target, PROMPTS[2], 30)
    assert drive(True) == alone


def test_no_draft_cache_and_no_draft_prefill(pair: ModelPair) -> None:
    engine = FSDEngine(pair, num_draft_tokens=4, share_kv=True)
    for i in range(3):
        engine.add_request(str(i), PROMPTS[i] * 4, greedy_params(12))
    engine.run_to_completion()
    assert engine._draft_cache.length == 0 and engine._draft_cache.batch_size == 0
    separate = FSDEngine(pair, num_draft_tokens=4, share_kv=False)
    separate.add_request("0", PROMPTS[0] * 4, greedy_params(12))
    separate.step()
    assert separate._draft_cache.length > 0  # the separate draft prefilled the prompt


def test_pair_default_and_bad_values(pair: ModelPair) -> None:
    assert FSDEngine(pair).share_kv is False  # the tiny pair does not declare its draft a copy
    copy = dataclasses.replace(pair, draft_is_target_copy=True)
    assert FSDEngine(copy).share_kv is True
    other = tiny_pair(seed=0, num_layers=3)
    mixed = dataclasses.replace(pair, draft=other.draft, draft_is_target_copy=True)
    assert FSDEngine(mixed).share_kv is False  # declared a copy, but the layouts differ: not shared by default
    with pytest.raises(ValueError, match="num_hidden_layers=2.*num_hidden_layers=3"):
        FSDEngine(mixed, share_kv=True)
    with pytest.raises(ValueError, match="'yes'"):
        FSDEngine(pair, share_kv="yes")  # type: ignore[arg-type]
