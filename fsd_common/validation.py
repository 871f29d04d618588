"""The one formatter for pydantic validation errors: each error as ``field.path: message``.

Bad input must name the offending field (a ``ValueError`` in Python, a 4xx over HTTP); every boundary
that validates with pydantic formats its ``ValidationError`` here, so messages read the same everywhere.
"""

from __future__ import annotations

from pydantic import ValidationError


def format_validation_error(exc: ValidationError, *, root: str = "", first_only: bool = False) -> str:
    """``path: message`` per error, joined with ``"; "``.

    ``root`` is prepended to every path (``root="policy"`` ⇒ ``policy.kp: ...``; an error on the whole
    model then reads ``policy: ...``). Pydantic's ``"Value error, "`` prefix is dropped: the validators'
    own messages already say what is wrong. An error with no path (a whole-model check, whose message
    names its fields itself) is its message alone. ``first_only``: only the first error.
    """
    errors = exc.errors()[:1] if first_only else exc.errors()
    parts = []
    for err in errors:
        msg = str(err["msg"]).removeprefix("Value error, ")
        path = ".".join(str(p) for p in (root, *err["loc"]) if p != "")
        parts.append(f"{path}: {msg}" if path else msg)
    return "; ".join(parts)


def first_error_path(exc: ValidationError) -> str | None:
    """The dotted path of the first error's field (None for a whole-model error)."""
    errors = exc.errors()
    if not errors:
        return None
    return ".".join(str(p) for p in errors[0]["loc"]) or None
