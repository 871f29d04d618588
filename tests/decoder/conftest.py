"""Fixtures shared by the decoder tests: the real default pair, loaded once per test session."""

from __future__ import annotations

import shutil

import pytest

from decoder.models import ModelPair
from decoder.pairs import load_pair


@pytest.fixture(scope="session")
def smollm2_loads(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelPair, ModelPair]:
    """(pair converted from the GGUF, pair loaded back from the safetensors cache), private cache dir.

    One GGUF conversion and one cache load (~50 s on 2 cores) for every test that needs the real pair. The
    cache (~0.5 GB) is deleted once both are loaded: pytest keeps its last three sessions' temporary
    directories, and on a small CI disk those copies add up."""
    cache = tmp_path_factory.mktemp("fsd-cache")
    with pytest.MonkeyPatch.context() as patch:  # the private cache only while loading
        patch.setenv("FSD_CACHE_DIR", str(cache))
        from_gguf = load_pair("smollm2-135m")
        from_cache = load_pair("smollm2-135m")
    shutil.rmtree(cache)
    return from_gguf, from_cache
