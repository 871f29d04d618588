"""FSDEngine on tiny random fp32 Llama pairs: exactness, batching, sampling, stopping, bad input."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from scipy.stats import chisquare

from decoder.engine import FSDEngine, SamplingParams
from decoder.models import ModelPair, tiny_pair
from decoder.sampling import sampling_probs

PROMPTS = [
    [5, 6, 7, 8, 9],
    [100],
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42],
    [200, 201],
    [72, 101, 108, 108, 111, 44, 32],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # Tiny models gain nothing from intra-op threads, and on a shared, busy CPU OpenMP's spinning
    # threads make every small matmul ~50x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pair() -> ModelPair:
    return tiny_pair(seed=0)


def greedy_params(max_new_tokens: int = 20, **overrides: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, eos_token_ids=(), **overrides)  # type: ignore[arg-type]


@torch.inference_mode()
def target_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Reference: plain greedy decoding with the target alone, re-encoding the whole sequence each token."""
    ids = torch.tensor([prompt])
    out: list[int] = []
    for _ in range(n):
        token = int(model(input_ids=ids).logits[0, -1].argmax())
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def run(
    pair: ModelPair,
    requests: list[tuple[list[int], SamplingParams, float]],
    k: int = 4,
    max_batch_size: int = 8,
    draft_lengths: list[int | None] | None = None,
    **engine_kwargs: object,
) -> dict[str, list[int]]:
    engine = FSDEngine(pair, num_draft_tokens=k, max_batch_size=max_batch_size, **engine_kwargs)  # type: ignore[arg-type]
    for i, (prompt, params, threshold) in enumerate(requests):
        engine.add_request(str(i), prompt, params, threshold, draft_length=draft_lengths[i] if draft_lengths else None)
    engine.run_to_completion()
    return {str(i): engine.output(str(i)).token_ids for i in range(len(requests))}


# ------------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_greedy_t0_reproduces_target_greedy(pair: ModelPair, k: int) -> None:
    for prompt in PROMPTS[:4]:
        engine = FSDEngine(pair, num_draft_tokens=k)
        engine.add_request("r", prompt, greedy_params(24), threshold=0.0)
        engine.run_to_completion()
        out = engine.output("r")
        assert out.token_ids == target_greedy(pair.target, prompt, 24), f"k={k} prompt={prompt}"
        assert out.finish_reason == "length"
        assert out.fuzzy_accepted == 0 and out.distortion == 0.0


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5, 6, 9])
def test_max_new_tokens_is_exact_at_block_boundaries(pair: ModelPair, max_new_tokens: int) -> None:
    # k=4 emits up to 5 tokens per iteration: these lengths end inside, at and after a block.
    reference = target_greedy(pair.target, PROMPTS[0], max_new_tokens)
    engine = FSDEngine(pair, num_draft_tokens=4)
    engine.add_request("r", PROMPTS[0], greedy_params(max_new_tokens), threshold=1e9)
    engine.add_request("exact", PROMPTS[0], greedy_params(max_new_tokens), threshold=0.0)
    engine.run_to_completion()
    assert len(engine.output("r").token_ids) == max_new_tokens
    assert engine.output("r").finish_reason == "length"
    assert engine.output("exact").token_ids == reference


@torch.inference_mode()
def accept_all_reference(pair: ModelPair, prompt: list[int], n: int, k: int) -> list[int]:
    """Greedy FSD with every draft accepted: k draft-greedy tokens, then the target's greedy bonus token."""
    seq = list(prompt)
    while len(seq) - len(prompt) < n:
        for _ in range(k):
            seq.append(int(pair.draft(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        seq.append(int(pair.target(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) : len(prompt) + n]


def test_accept_all_emits_k_plus_one_per_iteration(pair: ModelPair) -> None:
    k, n = 3, 22
    engine = FSDEngine(pair, num_draft_tokens=k)
    engine.add_request("all", PROMPTS[2], greedy_params(n), threshold=1e9)
    steps = engine.run_to_completion()
    out = engine.output("all")
    assert out.token_ids == accept_all_reference(pair, PROMPTS[2], n, k)
    emitted = [len(s.rows[0].new_token_ids) for s in steps]
    assert emitted == [k + 1] * (n // (k + 1)) + [n % (k + 1)]
    assert out.acceptance_rate == 1.0
    assert out.distortion > 0.0  # the draft differs from the target, and every position was fuzzy
    # Greedy distortion is 1[x != argmax p] per fuzzy position: the sum counts its events exactly.
    assert sum(s.rows[0].distorted for s in steps) == round(out.distortion)


def test_fuzzy_threshold_raises_acceptance(pair: ModelPair) -> None:
    rates = {}
    for threshold in (0.0, 0.5, 1e9):
        outs = []
        for prompt in PROMPTS:
            engine = FSDEngine(pair, num_draft_tokens=4)
            engine.add_request("r", prompt, greedy_params(24), threshold=threshold)
            engine.run_to_completion()
            outs.append(engine.output("r"))
        rates[threshold] = sum(o.accepted for o in outs) / sum(o.drafted for o in outs)
        if threshold == 0.0:
            assert all(o.fuzzy_accepted == 0 for o in outs)
        else:
            assert sum(o.fuzzy_accepted for o in outs) > 0
    assert rates[0.0] < rates[0.5] < rates[1e9] == 1.0, rates


# --------------------------------------------------------------------------------------- batching


def test_batch_equals_singles_greedy(pair: ModelPair) -> None:
    thresholds = [0.0, 0.3, 0.0, 2.0, 0.1, 0.0]
    requests = [(p, greedy_params(40), t) for p, t in zip(PROMPTS, thresholds, strict=True)]
    singles = {str(i): run(pair, [r])["0"] for i, r in enumerate(requests)}
    assert run(pair, requests) == singles
    for i, (prompt, _, t) in enumerate(requests):
        if t == 0.0:
            assert singles[str(i)] == target_greedy(pair.target, prompt, 40)


def test_continuous_batching_join_and_leave(pair: ModelPair) -> None:
    # Different lengths leave at different times; max_batch_size=3 makes later requests wait and join
    # a batch in flight; more requests are added between steps.
    lengths = [7, 30, 13, 45, 3, 25]
    requests = [(p, greedy_params(n), 0.0 if i % 2 else 0.4) for i, (p, n) in enumerate(zip(PROMPTS, lengths, strict=True))]
    singles = {str(i): run(pair, [r])["0"] for i, r in enumerate(requests)}

    engine = FSDEngine(pair, num_draft_tokens=3, max_batch_size=3)
    for i, (prompt, params, t) in enumerate(requests[:4]):
        engine.add_request(str(i), prompt, params, t)
    batch_sizes = []
    step = 0
    while engine.has_unfinished():
        stats = engine.step()
        batch_sizes.append(stats.batch_size)
        step += 1
        if step == 3:
            for i in (4, 5):
                prompt, params, t = requests[i]
                engine.add_request(str(i), prompt, params, t)
    assert {str(i): engine.output(str(i)).token_ids for i in range(6)} == singles
    assert max(batch_sizes) == 3 and min(batch_sizes) < 3
    assert engine._target_cache.batch_size == 0
    # An emptied engine takes new work.
    engine.add_request("again", *requests[1])
    engine.run_to_completion()
    assert engine.output("again").token_ids == singles["1"]


def test_holes_are_compacted_without_changing_outputs(pair: ModelPair) -> None:
    requests = [(p, greedy_params(80), 0.0) for p in PROMPTS[:4]]
    engine = FSDEngine(pair, num_draft_tokens=5)
    for i, (prompt, params, t) in enumerate(requests):
        engine.add_request(str(i), prompt, params, t)
    engine.run_to_completion()
    assert engine._target_cache.compactions > 0 and engine._draft_cache.compactions > 0
    for i, (prompt, _, _) in enumerate(requests):
        assert engine.output(str(i)).token_ids == target_greedy(pair.target, prompt, 80), f"row {i}"


# --------------------------------------------------------------------------------------- sampling


def sampled(seed: int | None, n: int = 20) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_k=50, max_new_tokens=n, eos_token_ids=(), seed=seed)


def test_seeded_sampling_is_reproducible_whatever_the_batch(pair: ModelPair) -> None:
    alone = run(pair, [(PROMPTS[0], sampled(123), 0.3)])["0"]
    assert run(pair, [(PROMPTS[0], sampled(123), 0.3)])["0"] == alone
    crowd = [
        (PROMPTS[3], sampled(7), 0.0),
        (PROMPTS[0], sampled(123), 0.3),
        (PROMPTS[2], greedy_params(30), 1.0),
        (PROMPTS[1], sampled(None, 40), 0.1),
    ]
    assert run(pair, crowd)["1"] == alone
    assert run(pair, [(PROMPTS[0], sampled(124), 0.3)])["0"] != alone


def test_seeded_request_ignores_a_neighbour_near_its_context_limit(pair: ModelPair) -> None:
    # Regression (bug 2): k was lowered for every row to the smallest context room in the batch, so a
    # request next to a row near the context limit decoded with k = [4, 4, 4, 2, 1, ...] and its tokens
    # changed from the 8th on. k is now capped by each row's own room.
    seeded = (PROMPTS[0], sampled(123, 30), 0.3)
    alone = run(pair, [seeded])["0"]
    near_limit = ([7] * (pair.max_context - 12), sampled(5, 12), 0.0)
    engine = FSDEngine(pair, num_draft_tokens=4)
    engine.add_request("seeded", *seeded)
    engine.add_request("near", *near_limit)
    steps = engine.run_to_completion()
    assert engine.output("seeded").token_ids == alone
    seeded_k = [r.draft_length for s in steps for r in s.rows if r.request_id == "seeded"]
    near_k = [r.draft_length for s in steps for r in s.rows if r.request_id == "near"]
    assert set(seeded_k) == {4}, seeded_k
    assert min(near_k) < 4, "the fixture must bring the neighbour to its context limit"


# ---------------------------------------------------------------------------------- per-row k


def test_k0_greedy_is_plain_target_decoding_without_draft_forwards(pair: ModelPair) -> None:
    draft_calls = []
    hook = pair.draft.register_forward_hook(lambda *_: draft_calls.append(1))
    try:
        engine = FSDEngine(pair, num_draft_tokens=0)
        engine.add_request("a", PROMPTS[0], greedy_params(20), threshold=0.5)
        engine.add_request("b", PROMPTS[2], greedy_params(12), threshold=0.0)
        steps = engine.run_to_completion()
    finally:
        hook.remove()
    assert draft_calls == [], "no draft forward (not even a prefill) may run when every row has k = 0"
    assert engine.output("a").token_ids == target_greedy(pair.target, PROMPTS[0], 20)
    assert engine.output("b").token_ids == target_greedy(pair.target, PROMPTS[2], 12)
    assert all(s.draft_length == 0 and all(r.draft_length == 0 and r.drafted == 0 for r in s.rows) for s in steps)
    assert engine.output("a").distortion == 0.0


def test_k0_runs_one_target_forward_per_token_prefill_included(pair: ModelPair) -> None:
    # Like the target alone: the prefill's last logits give the first token, so n tokens cost the prefill
    # and n - 1 single-token forwards (the engine once paid one more: the prompt's last token fed again).
    forwards: list[int] = []
    hook = pair.target.register_forward_hook(lambda _m, args, kwargs, _out: forwards.append(kwargs["input_ids"].shape[1]),
                                             with_kwargs=True)
    try:
        engine = FSDEngine(pair, num_draft_tokens=0)
        engine.add_request("a", PROMPTS[0], greedy_params(9))
        steps = engine.run_to_completion()
    finally:
        hook.remove()
    assert forwards == [len(PROMPTS[0])] + [1] * 8
    assert engine.output("a").token_ids == target_greedy(pair.target, PROMPTS[0], 9)
    assert len(steps) == 9 and steps[0].verify_time_s < steps[0].prefill_time_s


def test_rows_joining_idle_or_mid_flight_get_what_they_get_alone(pair: ModelPair) -> None:
    # Rows joining an idle engine feed only their drafts in their first iteration (their prompts are all in
    # the target cache, the first position verified against the prefill's logits), next to a row that does
    # not draft; rows joining mid-flight prefill all but the last token. Each gets what it gets alone.
    requests = [(PROMPTS[i], greedy_params(18), t) for i, t in ((0, 0.0), (1, 0.5), (2, 0.0), (3, 0.0))]
    ks: list[int | None] = [3, 0, 4, 0]
    singles = {str(i): run(pair, [r], draft_lengths=[ks[i]])["0"] for i, r in enumerate(requests)}
    assert singles["2"] == target_greedy(pair.target, PROMPTS[2], 18)
    engine = FSDEngine(pair, num_draft_tokens=4)
    engine.add_request("0", *requests[0], draft_length=ks[0])
    engine.add_request("1", *requests[1], draft_length=ks[1])
    engine.step()
    engine.step()
    engine.add_request("2", *requests[2], draft_length=ks[2])  # joins rows that are mid-flight
    engine.add_request("3", *requests[3], draft_length=ks[3])
    engine.run_to_completion()
    assert {str(i): engine.output(str(i)).token_ids for i in range(4)} == singles


def test_batch_mixing_k0_k2_k4_gives_each_row_what_it_gets_alone(pair: ModelPair) -> None:
    requests = [
        (PROMPTS[0], sampled(11, 25), 0.3),
        (PROMPTS[1], sampled(12, 30), 0.0),
        (PROMPTS[2], greedy_params(28), 0.5),
        (PROMPTS[3], sampled(14, 22), 1.0),
        (PROMPTS[4], greedy_params(26), 0.0),
        (PROMPTS[5], sampled(16, 27), 0.2),
    ]
    ks: list[int | None] = [0, 2, 4, 2, 0, None]  # None: the engine default (4)
    singles = {str(i): run(pair, [r], draft_lengths=[ks[i]])["0"] for i, r in enumerate(requests)}
    engine = FSDEngine(pair, num_draft_tokens=4)
    for i, (prompt, params, t) in enumerate(requests):
        engine.add_request(str(i), prompt, params, t, draft_length=ks[i])
    steps = engine.run_to_completion()
    assert {str(i): engine.output(str(i)).token_ids for i in range(len(requests))} == singles
    assert singles["4"] == target_greedy(pair.target, PROMPTS[4], 26)
    first = {r.request_id: r.draft_length for r in steps[0].rows}
    assert first == {"0": 0, "1": 2, "2": 4, "3": 2, "4": 0, "5": 4} and steps[0].draft_length == 4


def test_per_row_k_changes_between_steps_and_stays_exact(pair: ModelPair) -> None:
    # Row "x" switches k 3 -> 0 -> 0 -> 2 -> 5 (the draft cache catches up on tokens emitted at k = 0);
    # greedy at T = 0 it must stay equal to plain target decoding, alone and next to other rows.
    schedule = {1: 0, 3: 2, 4: 5}

    def drive(with_neighbours: bool) -> tuple[list[int], list[int]]:
        engine = FSDEngine(pair, num_draft_tokens=3)
        engine.add_request("x", PROMPTS[5], greedy_params(40), threshold=0.0)
        engine.add_request("s", PROMPTS[0], sampled(3, 30), threshold=0.4, draft_length=2)
        # joins at k = 0 (no draft prefill), drafts from step 2: the draft catches up on prompt + output
        engine.add_request("z", PROMPTS[2], greedy_params(30), threshold=0.0, draft_length=0)
        if with_neighbours:
            engine.add_request("n1", PROMPTS[1], sampled(4, 35), threshold=0.2)
            engine.add_request("n2", PROMPTS[2], greedy_params(30), threshold=0.0, draft_length=0)
        step = 0
        while engine.has_unfinished():
            if step in schedule and not engine.output("x").finished:
                engine.set_draft_length(schedule[step], "x")
            if step == 2:
                engine.set_draft_length(1)  # the default: moves "n1" only (the others have their own k)
                engine.set_draft_length(3, "z")
            engine.step()
            step += 1
        return engine.output("x").token_ids, engine.output("s").token_ids, engine.output("z").token_ids

    alone_x, alone_s, alone_z = drive(False)
    assert alone_x == target_greedy(pair.target, PROMPTS[5], 40)
    assert alone_z == target_greedy(pair.target, PROMPTS[2], 30)
    assert drive(True) == (alone_x, alone_s, alone_z)


def test_kl_with_top_k_or_top_p_still_fuzzy_accepts(pair: ModelPair) -> None:
    # Regression (bug 3): D was computed on the truncated p and q, so KL(q‖p) = inf wherever q kept a token
    # p's top-k / top-p dropped: 100 % of positions, and no fuzzy acceptance at all.
    for extra in ({"top_k": 50}, {"top_p": 0.9}):
        engine = FSDEngine(pair, num_draft_tokens=4, div="kl")
        for s in range(4):
            params = SamplingParams(temperature=0.5, max_new_tokens=24, eos_token_ids=(), seed=s, **extra)  # type: ignore[arg-type]
            engine.add_request(str(s), PROMPTS[s], params, threshold=0.5)
        engine.run_to_completion()
        outs = [engine.output(str(s)) for s in range(4)]
        assert sum(o.fuzzy_accepted for o in outs) > 0, extra
        assert all(0 <= o.mean_distortion <= 1 for o in outs)


@pytest.fixture(scope="module")
def far_pair() -> ModelPair:
    """A pair whose draft differs a lot from its target, so a wrong sampler is detectable."""
    return tiny_pair(seed=1, draft_noise=1.0)


@pytest.mark.parametrize(("position", "k", "share_kv"), [(0, 3, False), (1, 3, False), (1, 0, False), (1, 3, True)])
def test_t0_sampling_follows_the_target_distribution(far_pair: ModelPair, position: int, k: int, share_kv: bool) -> None:
    """Chi-square: the token at ``position`` under SD (T=0; k = 0: plain decoding) is distributed as target
    sampling, with the draft on its own cache or on the target's (``share_kv``)."""
    pair = far_pair
    prompt, temperature, top_k, n = PROMPTS[4], 0.9, 40, 3000
    with torch.inference_mode():
        first = sampling_probs(pair.target(input_ids=torch.tensor([prompt])).logits[0, -1], temperature, top_k)
        if position == 0:
            expected = first
        else:  # the exact mixture over first tokens: sum_x p(x) p(. | prompt, x)
            contexts = torch.cat([torch.tensor([prompt]).expand(first.shape[0], -1), torch.arange(first.shape[0])[:, None]], 1)
            second = sampling_probs(pair.target(input_ids=contexts).logits[:, -1], temperature, top_k)
            expected = first @ second
    engine = FSDEngine(pair, num_draft_tokens=k, max_batch_size=100, share_kv=share_kv)
    params = [SamplingParams(temperature=temperature, top_k=top_k, max_new_tokens=2, eos_token_ids=(), seed=s) for s in range(n)]
    for s, p in enumerate(params):
        engine.add_request(str(s), prompt, p, threshold=0.0)
    engine.run_to_completion()
    counts = torch.zeros_like(expected)
    for s in range(n):
        counts[engine.output(str(s)).token_ids[position]] += 1
    # Pool tokens with small expected counts so the chi-square approximation holds.
    assert counts[expected == 0].sum() == 0, "a token outside the top-k support was emitted"
    big = expected * n >= 5
    small = ~big & (expected > 0)
    observed, predicted = counts[big].double(), expected[big].double() * n
    if small.any():
        observed = torch.cat([observed, counts[small].sum()[None].double()])
        predicted = torch.cat([predicted, expected[small].sum()[None].double() * n])
    result = chisquare(observed.numpy(), predicted.numpy() * n / predicted.sum().item())
    assert result.pvalue > 1e-3, (result, int(big.sum()))


# ------------------------------------------------------------------------------------- stopping


def test_eos_stops_and_is_kept(pair: ModelPair) -> None:
    reference = target_greedy(pair.target, PROMPTS[0], 30)
    eos = reference[6]
    first = reference.index(eos)
    engine = FSDEngine(pair)
    engine.add_request("r", PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=30, eos_token_ids=(eos,)))
    engine.run_to_completion()
    out = engine.output("r")
    assert out.token_ids == reference[: first + 1]
    assert out.finish_reason == "stop"


def test_pair_eos_is_the_default(pair: ModelPair) -> None:
    engine = FSDEngine(pair)
    engine.add_request("r", PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=5))
    assert engine._requests["r"].eos == frozenset(pair.eos_token_ids)


def test_stop_string_truncates_text(pair: ModelPair) -> None:
    reference = target_greedy(pair.target, PROMPTS[0], 40)
    full_text = pair.tokenizer.decode(reference, skip_special_tokens=True)
    # A stop string from the middle of the text, free of replacement characters.
    start = next(i for i in range(8, len(full_text) - 2) if "\ufffd" not in full_text[i : i + 2])
    stop = full_text[start : start + 2]
    engine = FSDEngine(pair)
    engine.add_request("r", PROMPTS[0], greedy_params(40, stop=(stop, "never-appears")))
    engine.run_to_completion()
    out = engine.output("r")
    assert out.finish_reason == "stop"
    assert out.text == full_text[: full_text.find(stop)]
    assert stop not in out.text
    assert out.token_ids == reference[: len(out.token_ids)]
    assert stop in pair.tokenizer.decode(out.token_ids) and stop not in pair.tokenizer.decode(out.token_ids[:-1])


def test_stop_strings_are_checked_on_a_window_not_the_whole_output(pair: ModelPair, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each block decodes only the last (longest stop string + 8) tokens or so, not the whole output again.
    decoded_lengths: list[int] = []
    decode = pair.tokenizer.decode

    def recording_decode(ids: list[int], **kwargs: object) -> str:
        decoded_lengths.append(len(ids))
        return str(decode(ids, **kwargs))

    monkeypatch.setattr(pair.tokenizer, "decode", recording_decode)
    engine = FSDEngine(pair, num_draft_tokens=4)
    engine.add_request("r", PROMPTS[0], greedy_params(120, stop=("never-appears",)))
    engine.run_to_completion()
    longest_decode = max(decoded_lengths)  # before output(), which decodes the whole text once
    assert len(engine.output("r").token_ids) == 120
    assert longest_decode <= len("never-appears") + 8 + 5, longest_decode


def test_abort_running_and_waiting(pair: ModelPair) -> None:
    engine = FSDEngine(pair, max_batch_size=2)
    engine.add_request("a", PROMPTS[0], greedy_params(30))
    engine.add_request("b", PROMPTS[2], greedy_params(30))
    engine.add_request("c", PROMPTS[3], greedy_params(30))
    engine.step()
    engine.abort("a")
    engine.abort("c")  # still waiting
    stats = engine.step()
    aborted = {r.request_id: r for r in stats.rows if r.finish_reason == "abort"}
    assert set(aborted) == {"a", "c"} and all(r.finished for r in aborted.values())
    engine.run_to_completion()
    assert engine.output("b").token_ids == target_greedy(pair.target, PROMPTS[2], 30)
    assert engine.output("a").finish_reason == "abort" and engine.output("c").token_ids == []
    assert not engine.has_unfinished()
    assert engine.release("a").request_id == "a"
    with pytest.raises(ValueError, match="'a'"):
        engine.output("a")


def test_step_stats_account_for_every_token(pair: ModelPair) -> None:
    engine = FSDEngine(pair, num_draft_tokens=3)
    engine.add_request("x", PROMPTS[1], sampled(1, 25), threshold=0.5)
    engine.add_request("y", PROMPTS[2], greedy_params(17), threshold=0.0)
    steps = engine.run_to_completion()
    assert steps[0].prefill_tokens == len(PROMPTS[1]) + len(PROMPTS[2])
    for rid in ("x", "y"):
        rows = [r for s in steps for r in s.rows if r.request_id == rid]
        out = engine.output(rid)
        assert [t for r in rows for t in r.new_token_ids] == out.token_ids
        assert sum(r.accepted for r in rows) == out.accepted <= out.drafted == sum(r.drafted for r in rows)
        assert math.isclose(sum(r.distortion for r in rows), out.distortion)
        assert rows[-1].finished and not any(r.finished for r in rows[:-1])
        assert all(r.accepted <= len(r.new_token_ids) <= r.accepted + 1 for r in rows)
    assert all(s.draft_time_s > 0 and s.verify_time_s > 0 for s in steps)


def test_set_threshold_and_draft_length_apply_next_iteration(pair: ModelPair) -> None:
    engine = FSDEngine(pair, num_draft_tokens=2)
    engine.add_request("r", PROMPTS[0], greedy_params(40), threshold=0.0)
    engine.step()
    engine.set_threshold("r", 1e9)
    engine.set_draft_length(5)
    stats = engine.step()
    assert stats.draft_length == 5 and stats.rows[0].threshold == 1e9
    assert len(stats.rows[0].new_token_ids) == 6


def test_the_drafts_catch_up_is_reported_apart_only_in_the_step_that_feeds_a_backlog(pair: ModelPair) -> None:
    """A row at k = 0 leaves its prompt and tokens unseen by the draft; the step that makes it draft feeds that
    backlog first (a one-off, StepStats.catch_up_time_s > 0); ordinary steps, drafting all along, report 0."""
    engine = FSDEngine(pair, num_draft_tokens=0)
    engine.add_request("r", PROMPTS[0] * 8, greedy_params(60), draft_length=0)
    plain = [engine.step() for _ in range(6)]
    assert all(s.catch_up_time_s == 0.0 and s.draft_length == 0 for s in plain)
    engine.set_draft_length(4, "r")
    switching = engine.step()
    assert switching.draft_length == 4 and 0.0 < switching.catch_up_time_s <= switching.draft_time_s
    later = [engine.step() for _ in range(3)]
    assert all(s.catch_up_time_s == 0.0 and s.draft_time_s > 0 for s in later)


# -------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"num_draft_tokens": -1}, "-1"),
        ({"div": "hellinger"}, "hellinger"),
        ({"rule": "lenient"}, "lenient"),
        ({"max_batch_size": 0}, "max_batch_size"),
    ],
)
def test_bad_engine_arguments(pair: ModelPair, kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        FSDEngine(pair, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("prompt", "params", "threshold", "needle"),
    [
        ([], SamplingParams(), 0.0, "empty prompt"),
        ([1, 2], SamplingParams(max_new_tokens=0), 0.0, "max_new_tokens"),
        ([1, 2], SamplingParams(max_new_tokens=-3), 0.0, "-3"),
        ([1, 2], SamplingParams(), -0.5, "-0.5"),
        ([1, 2], SamplingParams(), float("nan"), "nan"),
        ([1, 2], SamplingParams(), float("inf"), "inf"),
        ([1, 2], SamplingParams(temperature=-1.0), 0.0, "temperature"),
        ([1, 2], SamplingParams(top_p=0.0), 0.0, "top_p"),
        ([1, 2], SamplingParams(top_k=-2), 0.0, "top_k"),
        ([1, 2], SamplingParams(stop=("",)), 0.0, "stop"),
        ([1, 99999], SamplingParams(), 0.0, "99999"),
        ([1] * 500, SamplingParams(max_new_tokens=13), 0.0, "500 tokens"),
        ([1] * 600, SamplingParams(max_new_tokens=1), 0.0, "600"),
    ],
)
def test_bad_requests(pair: ModelPair, prompt: list[int], params: SamplingParams, threshold: float, needle: str) -> None:
    engine = FSDEngine(pair)
    with pytest.raises(ValueError, match=needle):
        engine.add_request("r", prompt, params, threshold)
    assert not engine.has_unfinished()


def test_bad_calls(pair: ModelPair) -> None:
    engine = FSDEngine(pair)
    engine.add_request("r", [1, 2], greedy_params(3))
    with pytest.raises(ValueError, match="duplicate request_id 'r'"):
        engine.add_request("r", [1, 2], greedy_params(3))
    with pytest.raises(ValueError, match="-1"):
        engine.set_threshold("r", -1.0)
    with pytest.raises(ValueError, match="-1"):
        engine.set_draft_length(-1)
    with pytest.raises(ValueError, match="-2"):
        engine.set_draft_length(-2, "r")
    with pytest.raises(ValueError, match="'nope'"):
        engine.set_draft_length(2, "nope")
    with pytest.raises(ValueError, match="2.5"):
        engine.add_request("s", [1, 2], greedy_params(3), draft_length=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'nope'"):
        engine.abort("nope")
    with pytest.raises(ValueError, match="still running"):
        engine.release("r")
    engine.run_to_completion()
    assert engine.output("r").finish_reason == "length"
