"""fsd_vllm.plugin pieces that need no vLLM (run in the project's venv): request arguments, counters, the
#55006 expand fix, the version pin; and fsd_vllm.offline's layer-truncated draft."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fsd_vllm.acceptance import FlatVerifyStats
from fsd_vllm.offline import truncated_draft
from fsd_vllm.plugin import (
    EXTRA_ARGS_THRESHOLD,
    EXTRA_ARGS_TIER,
    PINNED_VLLM_VERSION,
    FSDCounters,
    FSDEngineConfig,
    RequestFSDArgs,
    _stats_from_output,
    check_vllm_version,
    expand_batch_to_tokens_native,
    fsd_extra_args,
)


def test_extra_args_round_trip_and_bad_values_are_value_errors_naming_them() -> None:
    args = fsd_extra_args(0.25, "gold")
    assert args == {EXTRA_ARGS_THRESHOLD: 0.25, EXTRA_ARGS_TIER: "gold"}
    assert RequestFSDArgs.from_extra_args(args) == RequestFSDArgs(0.25, "gold")
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="threshold"):
            fsd_extra_args(bad)
    with pytest.raises(ValueError, match="tier"):
        fsd_extra_args(0.1, "")


@pytest.mark.parametrize("raw", [None, {}, {EXTRA_ARGS_THRESHOLD: "x"}, {EXTRA_ARGS_THRESHOLD: -1.0}])
def test_worker_side_parsing_falls_back_to_lossless_never_raises(raw: dict | None) -> None:
    assert RequestFSDArgs.from_extra_args(raw).threshold == 0.0


def test_engine_config_from_env_rejects_unknown_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FSD_VLLM_DIV", "js")
    monkeypatch.setenv("FSD_VLLM_RULE", "pure")
    assert FSDEngineConfig.from_env() == FSDEngineConfig(div="js", rule="pure")
    monkeypatch.setenv("FSD_VLLM_DIV", "cosine")
    with pytest.raises(ValueError, match="'cosine'"):
        FSDEngineConfig.from_env()


def test_version_pin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FSD_VLLM_ALLOW_UNPINNED", raising=False)
    check_vllm_version(PINNED_VLLM_VERSION)
    with pytest.raises(RuntimeError, match="0.33.0"):
        check_vllm_version("0.33.0")


def test_counters_accumulate_per_request_and_tier_and_skip_rows_without_drafts() -> None:
    counters = FSDCounters()
    stats = FlatVerifyStats(
        num_drafted=torch.tensor([3, 0, 2]),
        num_accepted=torch.tensor([2, 0, 2]),
        num_fuzzy_accepted=torch.tensor([1, 0, 0]),
        distortion=torch.tensor([0.25, 0.0, 0.0]),
    )
    counters.record(["a", "b", "c"], ["gold", "gold", "bronze"], stats)
    counters.record(["a", "b", "c"], ["gold", "gold", "bronze"], stats)
    snap = counters.snapshot()
    assert "b" not in snap["per_request"]
    a = snap["per_request"]["a"]
    assert (a.steps, a.drafted, a.accepted, a.fuzzy_accepted, a.emitted) == (2, 6, 4, 2, 6)
    assert a.distortion == pytest.approx(0.5)
    assert snap["per_tier"]["bronze"].accepted == 4 and snap["per_tier"]["gold"].drafted == 6
    counters.reset()
    assert counters.snapshot() == {"per_request": {}, "per_tier": {}}


def test_one_requests_counts_are_read_and_dropped_by_id() -> None:
    """What the vLLM replica's step adapter reads after each step and drops when a request ends."""
    counters = FSDCounters()
    assert counters.request_counts("a") == (0, 0, 0, 0.0)
    stats = FlatVerifyStats(num_drafted=torch.tensor([3, 2]), num_accepted=torch.tensor([1, 2]),
                            num_fuzzy_accepted=torch.tensor([1, 0]), distortion=torch.tensor([0.5, 0.0]))
    counters.record(["a", "b"], ["gold", "bronze"], stats)
    counters.record(["a", "b"], ["gold", "bronze"], stats)
    assert counters.request_counts("a") == (6, 2, 2, pytest.approx(1.0))
    dropped = counters.pop_request("a")
    assert dropped is not None and dropped.drafted == 6
    assert counters.request_counts("a") == (0, 0, 0, 0.0) and counters.pop_request("a") is None
    assert counters.request_counts("b") == (4, 4, 0, 0.0)
    assert counters.snapshot()["per_tier"]["gold"].drafted == 6  # tiers keep their totals


def test_counters_of_a_standard_step_come_from_vllms_padded_output() -> None:
    output = torch.tensor([[5, 6, 7, -1], [9, -1, -1, -1], [1, 2, 3, 4]], dtype=torch.int32)
    stats = _stats_from_output(output, [3, 3, 3])
    assert stats.num_accepted.tolist() == [2, 0, 3]
    assert stats.num_drafted.tolist() == [3, 3, 3]


def test_regression_vllm_55005_expand_keeps_the_callers_dtype() -> None:
    cu = torch.tensor([2, 3, 3, 5], dtype=torch.int32)
    temps = torch.tensor([0.7, 0.0, 2.0, 1.3])
    out = expand_batch_to_tokens_native(temps, cu, 5, replace_from=0, replace_to=1)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([0.7, 0.7, 1.0, 1.3, 1.3]))
    top_k = torch.tensor([5, 0, 7, 9], dtype=torch.int32)
    assert expand_batch_to_tokens_native(top_k, cu, 5).tolist() == [5, 5, 0, 9, 9]


def test_truncated_draft_keeps_the_first_layers(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    weights = {"model.embed_tokens.weight": torch.ones(4, 2), "model.norm.weight": torch.ones(2)}
    for layer in range(4):
        weights[f"model.layers.{layer}.mlp.weight"] = torch.full((2, 2), float(layer))
    save_file(weights, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    (target / "tokenizer.json").write_text("{}")
    draft = truncated_draft(target, 2)
    kept = load_file(str(draft / "model.safetensors"))
    assert sorted(k for k in kept if k.startswith("model.layers.")) == [
        "model.layers.0.mlp.weight", "model.layers.1.mlp.weight"
    ]
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 2
    assert (draft / "tokenizer.json").exists()
    with pytest.raises(ValueError, match="got 4"):
        truncated_draft(target, 4)
