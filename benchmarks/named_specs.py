"""``NAME=JSON`` command-line items (``--policy``, ``--config``): named policy specs, validated alike."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def parse_named_specs(items: list[str], option: str,
                      reserved: Callable[[str], str | None] = lambda name: None) -> dict[str, dict[str, Any]]:
    """``items`` as {name: spec}; ValueError naming the item for a missing ``=``, an empty name or one with a
    comma, a name given twice or ``reserved`` (which returns why, e.g. "a built-in configuration"), text that
    is not JSON, or JSON that is not an object with a "policy" key."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or not name or "," in name:
            raise ValueError(f"{option} {item!r}: expected NAME=JSON (a name without commas)")
        why = reserved(name)
        if why:
            raise ValueError(f"{option} {item!r}: {name!r} is {why}")
        if name in out:
            raise ValueError(f"{option} {item!r}: {name!r} given twice")
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{option} {item!r}: not JSON ({e})") from None
        if not isinstance(spec, dict) or "policy" not in spec:
            raise ValueError(f"{option} {item!r}: expected a JSON object with a \"policy\" key")
        out[name] = spec
    return out
