"""Fuzzy speculative decoding: acceptance math, the batched engine, model pairs and ``generate``.

``decoder.generate(target, draft, input_ids, ...)`` is the public HF-style function (the issue's API).
Its sub-module has the same name, so the function is bound here eagerly — otherwise the name would
resolve to the module once anything imported ``decoder.generate``. That makes ``import decoder``
import torch; nothing torch-free (sim/, policies/) imports this package. Import the module's other
names with ``from decoder.generate import ...``. Everything else is re-exported lazily (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import Any

from decoder.generate import generate as generate

_EXPORTS = {
    "FSDEngine": "decoder.engine",
    "SamplingParams": "decoder.engine",
    "StepStats": "decoder.engine",
    "RowStats": "decoder.engine",
    "RequestOutput": "decoder.engine",
    "generate_text": "decoder.generate",
    "fsd_custom_generate": "decoder.generate",
    "FSDGenerateOutput": "decoder.generate",
    "verify_block": "decoder.acceptance",
    "divergence": "decoder.acceptance",
    "ModelPair": "decoder.models",
    "load_pair": "decoder.pairs",
    "tiny_pair": "decoder.models",
}

__all__ = sorted([*_EXPORTS, "generate"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'decoder' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
