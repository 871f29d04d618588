"""Runs INSIDE the vLLM environment (.venv-vllm/bin/python tests/vllm/vllm_env_check.py); prints one JSON
object that tests/vllm/test_vllm_env.py judges with scipy in the project's venv (the vLLM env has neither
pytest nor scipy). Not collected by pytest (no test_ prefix)."""

from __future__ import annotations

import inspect
import json
import math
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.v1.sample import rejection_sampler  # noqa: E402
from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402

from fsd_vllm import plugin  # noqa: E402

P0 = [0.35, 0.25, 0.15, 0.10, 0.10, 0.05]
Q0 = [0.15, 0.20, 0.25, 0.15, 0.15, 0.10]
P_BONUS = [0.05, 0.10, 0.15, 0.20, 0.25, 0.25]
DRAWS = 20_000


def metadata(batch: int, greedy: bool) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=None if greedy else torch.ones(batch),
        all_greedy=greedy,
        all_random=not greedy,
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def single_position_batch(threshold: float, tier: str, seed: int) -> tuple[list[int], dict[str, float]]:
    """DRAWS requests, one draft each, through the module-level rejection_sample (the patched one)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # unseeded requests draw from the global generator, as in vLLM
    draft_probs = torch.tensor(Q0).repeat(DRAWS, 1).contiguous()
    drafts = torch.multinomial(draft_probs, 1, generator=g).squeeze(1)
    bonus = torch.multinomial(torch.tensor(P_BONUS).repeat(DRAWS, 1), 1, generator=g).to(torch.int32)
    target_logits = torch.log(torch.tensor(P0)).repeat(DRAWS, 1).contiguous()
    meta = metadata(DRAWS, greedy=False)
    meta._fsd_request_args = [plugin.RequestFSDArgs(threshold, tier)] * DRAWS
    meta._fsd_req_ids = [f"r{i}" for i in range(DRAWS)]
    num = [1] * DRAWS
    out = rejection_sampler.rejection_sample(
        drafts, num, 1, torch.arange(1, DRAWS + 1, dtype=torch.int32), draft_probs, target_logits,
        bonus.contiguous(), meta,
    )
    first = out[:, 0].tolist()
    counts = [first.count(v) for v in range(len(P0))]
    tier_counts = vars(plugin.COUNTERS.snapshot()["per_tier"][tier])
    return counts, tier_counts


def main() -> None:
    report: dict[str, object] = {"vllm_version": vllm.__version__}
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()  # what vLLM's CPU worker does at start-up
    original = rejection_sampler.rejection_sample
    original_expand = rejection_sampler.expand_batch_to_tokens
    # vLLM's own loader, exactly as engine processes call it: finds our entry point.
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    report["patched"] = rejection_sampler.rejection_sample is plugin.fsd_rejection_sample
    report["expand_patched"] = rejection_sampler.expand_batch_to_tokens is plugin.expand_batch_to_tokens_native
    report["original_params"] = [
        (p.name, repr(p.default)) for p in inspect.signature(original).parameters.values()
    ]
    report["patched_params"] = [
        (p.name, repr(p.default)) for p in inspect.signature(plugin.fsd_rejection_sample).parameters.values()
    ]
    report["placeholder_matches"] = int(rejection_sampler.PLACEHOLDER_TOKEN_ID) == plugin.PLACEHOLDER_TOKEN_ID
    report["greedy_temperature"] = float(rejection_sampler.GREEDY_TEMPERATURE)

    # vLLM issue #55005: float temperatures through the CPU expand shim (0 -> 1 is the greedy rewrite).
    temps = torch.tensor([0.7, 0.0, 1.3])
    cu = torch.tensor([2, 3, 5], dtype=torch.int32)
    report["expand_fixed"] = rejection_sampler.expand_batch_to_tokens(temps, cu, 5, 0, 1).tolist()
    try:
        report["expand_original"] = original_expand(temps, cu, 5, 0, 1).tolist()
    except Exception as exc:  # the broken shim may also crash
        report["expand_original"] = f"raised {type(exc).__name__}"

    report["t0_counts"], report["t0_tier"] = single_position_batch(1e-9, "t0", seed=1)  # FSD path, D > T
    report["fuzzy_counts"], report["fuzzy_tier"] = single_position_batch(10.0, "fuzzy", seed=2)
    report["standard_counts"], report["standard_tier"] = single_position_batch(0.0, "standard", seed=3)

    # greedy batch: raw logits, no draft probs (vLLM gives none when all requests are greedy)
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1]]))
    meta = metadata(1, greedy=True)
    meta._fsd_request_args = [plugin.RequestFSDArgs(-math.log(0.4) + 1e-3, "greedy")]  # KL(δ_x‖p) = -log p(x)
    meta._fsd_req_ids = ["g"]
    out = rejection_sampler.rejection_sample(
        torch.tensor([0, 1]), [2], 2, torch.tensor([2], dtype=torch.int32), None, logits,
        torch.tensor([[2]], dtype=torch.int32), meta,
    )
    report["greedy_output"] = out[0].tolist()
    report["greedy_request"] = vars(plugin.COUNTERS.snapshot()["per_request"]["g"])
    print("FSD_VLLM_REPORT " + json.dumps(report))


if __name__ == "__main__":
    main()
