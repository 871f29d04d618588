"""``fsd_vllm.engine`` pieces that run without vLLM (in the project's venv).

The vLLM replica encodes prompts with ``fsd_vllm.engine.encode_prompt`` (decoder/ cannot be imported in the
vLLM environment), so both engines must turn the same request into the same token ids and refuse the same
bad prompts with the same message.
"""

from __future__ import annotations

from typing import Any

import pytest

from decoder.models import encode_prompt as native_encode_prompt
from decoder.models import tiny_tokenizer
from fsd_vllm.engine import VLLMEngineOptions, encode_prompt
from fsd_vllm.offline import default_target_dir

PROMPTS: list[tuple[Any, bool]] = [
    ("Write a haiku about autumn.", True),
    ("Write a haiku about autumn.", False),
    ([{"role": "user", "content": "Hi"}], True),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}], False),
]
BAD_PROMPTS: list[Any] = ["", [], [{"role": "user"}], [{"content": "x"}], [1], 3]


def _tokenizers() -> list[Any]:
    tokenizers = [tiny_tokenizer()]
    if (default_target_dir() / "tokenizer.json").exists():  # the real chat template, when converted
        from transformers import AutoTokenizer

        tokenizers.append(AutoTokenizer.from_pretrained(str(default_target_dir())))
    return tokenizers


@pytest.mark.parametrize("tokenizer", _tokenizers(), ids=lambda t: type(t).__name__)
def test_prompt_encoding_matches_the_native_engine(tokenizer: Any) -> None:
    for prompt, chat in PROMPTS:
        assert encode_prompt(tokenizer, prompt, chat=chat) == native_encode_prompt(tokenizer, prompt, chat=chat)
    for bad in BAD_PROMPTS:
        with pytest.raises(ValueError) as native:
            native_encode_prompt(tokenizer, bad)
        with pytest.raises(ValueError) as ours:
            encode_prompt(tokenizer, bad)
        assert str(ours.value) == str(native.value)


def test_engine_options_ask_vllm_for_full_draft_probabilities() -> None:
    options = VLLMEngineOptions(target_dir="/t", draft_dir="/d", num_speculative_tokens=3, max_num_seqs=8,
                                max_model_len=1024, memory_fraction=0.1, enforce_eager=True, seed=0)
    kwargs = options.engine_kwargs()
    assert kwargs["speculative_config"] == {"method": "draft_model", "model": "/d", "num_speculative_tokens": 3,
                                            "draft_sample_method": "probabilistic"}
    assert kwargs["distributed_executor_backend"] == "uni"  # one process: the plugin's counters are read there
    no_draft = VLLMEngineOptions(**{**vars(options), "draft_dir": None}).engine_kwargs()
    assert no_draft["speculative_config"] is None
