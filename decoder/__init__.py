"""Fuzzy speculative decoding: acceptance math, the batched engine, model pairs and ``generate``.

Names are re-exported lazily (PEP 562), so ``import decoder`` stays cheap and importing one
sub-module never drags in the others.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FSDEngine": "decoder.engine",
    "SamplingParams": "decoder.engine",
    "StepStats": "decoder.engine",
    "RowStats": "decoder.engine",
    "RequestOutput": "decoder.engine",
    "generate": "decoder.generate",
    "generate_text": "decoder.generate",
    "fsd_custom_generate": "decoder.generate",
    "FSDGenerateOutput": "decoder.generate",
    "verify_block": "decoder.acceptance",
    "divergence": "decoder.acceptance",
    "ModelPair": "decoder.models",
    "load_pair": "decoder.models",
    "tiny_pair": "decoder.models",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'decoder' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
