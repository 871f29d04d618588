"""Trace replay: the Azure LLM inference trace format (``TIMESTAMP,ContextTokens,GeneratedTokens``).

Optional columns, read when present (the service's own traffic recorder, :mod:`controller.recording`,
writes them; Azure traces have none): ``Tier`` (the request's SLO tier; empty = the default tier),
``MaxTokens`` (the requested ``max_tokens``; empty or 0 = unknown) and ``Status`` (how the request ended:
``stop``, ``length``, ``error``, ``cut`` or ``rejected``; see :data:`TRACE_STATUSES`).

The real traces in ``../shared/traces/`` are the Azure LLM inference trace 2023 (CC-BY 4.0; Patel et
al., "Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024). Keep
:data:`AZURE_ATTRIBUTION` next to every figure derived from them.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

AZURE_ATTRIBUTION = (
    "Azure LLM inference trace 2023 (CC-BY 4.0): Patel et al., 'Splitwise: Efficient generative LLM "
    "inference using phase splitting', ISCA 2024"
)
TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
#: Optional columns (recorded traffic): tier, requested max tokens, how the request ended.
OPTIONAL_TRACE_COLUMNS = ("Tier", "MaxTokens", "Status")
#: ``Status`` values: finished by a stop condition or by ``max_tokens``; failed in generation; cut
#: (started, then timed out, lost its replica or its client: GeneratedTokens is a lower bound); rejected
#: for overload before any token (ContextTokens and GeneratedTokens unknown, written as 0).
TRACE_STATUSES = ("stop", "length", "error", "cut", "rejected")


@dataclass(frozen=True, slots=True)
class Trace:
    """A trace as columns: arrival offsets (s, from the first request) and token counts."""

    arrival_s: np.ndarray  # [n] float64, non-decreasing, starts at 0
    prompt_tokens: np.ndarray  # [n] int64
    output_tokens: np.ndarray  # [n] int64
    source: str
    tier: tuple[str | None, ...] | None = None  # [n] column Tier (None = default tier), when present
    max_tokens: np.ndarray | None = None  # [n] int64 column MaxTokens (0 = unknown), when present
    status: tuple[str, ...] | None = None  # [n] column Status (TRACE_STATUSES), when present

    def __len__(self) -> int:
        return int(self.arrival_s.size)


def _parse_timestamp(text: str) -> float:
    """Seconds since the epoch for an Azure timestamp ('2023-11-16 18:15:46.6805900') or a number."""
    try:
        return float(text)
    except ValueError:
        pass
    # Azure writes 7 fractional digits; datetime accepts at most 6.
    head, _, frac = text.strip().partition(".")
    try:
        base = datetime.fromisoformat(head)
    except ValueError:
        raise ValueError(f"TIMESTAMP {text!r} is neither a number nor 'YYYY-MM-DD HH:MM:SS[.f]'") from None
    return base.timestamp() + (float("0." + frac) if frac else 0.0)


def read_azure_trace(path: str | Path) -> Trace:
    """Read a trace CSV; ValueError names the file, line and column of anything malformed."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace file {str(path)!r} does not exist")
    times: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    tiers: list[str | None] = []
    max_tokens: list[int] = []
    statuses: list[str] = []
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(
                f"trace {str(path)!r}: missing column(s) {missing}; expected header {','.join(TRACE_COLUMNS)}"
            )
        fieldnames = set(reader.fieldnames or [])
        for line_no, row in enumerate(reader, start=2):
            try:
                t = _parse_timestamp(row["TIMESTAMP"])
            except ValueError as exc:
                raise ValueError(f"trace {str(path)!r} line {line_no}: {exc}") from None
            for col, sink in (("ContextTokens", prompts), ("GeneratedTokens", outputs)):
                try:
                    n = int(row[col])
                except (TypeError, ValueError):
                    raise ValueError(
                        f"trace {str(path)!r} line {line_no}: {col} {row[col]!r} is not an integer"
                    ) from None
                if n < 0:
                    raise ValueError(f"trace {str(path)!r} line {line_no}: {col} {n} is negative")
                sink.append(n)
            times.append(t)
            try:
                _read_optional(row, fieldnames, tiers, max_tokens, statuses)
            except ValueError as exc:
                raise ValueError(f"trace {str(path)!r} line {line_no}: {exc}") from None
    if not times:
        raise ValueError(f"trace {str(path)!r} has no rows")
    arr = np.asarray(times, dtype=np.float64)
    order = np.argsort(arr, kind="stable")
    arr = arr[order]
    idx = order.tolist()
    return Trace(
        arrival_s=arr - arr[0],
        prompt_tokens=np.asarray(prompts, dtype=np.int64)[order],
        output_tokens=np.asarray(outputs, dtype=np.int64)[order],
        source=str(path),
        tier=tuple(tiers[i] for i in idx) if "Tier" in fieldnames else None,
        max_tokens=np.asarray(max_tokens, dtype=np.int64)[order] if "MaxTokens" in fieldnames else None,
        status=tuple(statuses[i] for i in idx) if "Status" in fieldnames else None,
    )


def _read_optional(row: dict[str, str], fieldnames: set[str], tiers: list[str | None], max_tokens: list[int],
                   statuses: list[str]) -> None:
    """Append the optional columns of one row (only those in the header); ValueError names the column."""
    if "Tier" in fieldnames:
        tier = (row["Tier"] or "").strip()
        tiers.append(tier or None)
    if "MaxTokens" in fieldnames:
        text = (row["MaxTokens"] or "").strip()
        try:
            n = int(text) if text else 0
        except ValueError:
            raise ValueError(f"MaxTokens {text!r} is not an integer") from None
        if n < 0:
            raise ValueError(f"MaxTokens {n} is negative")
        max_tokens.append(n)
    if "Status" in fieldnames:
        status = (row["Status"] or "").strip()
        if status not in TRACE_STATUSES:
            raise ValueError(f"Status {status!r} is not one of {list(TRACE_STATUSES)}")
        statuses.append(status)


def write_azure_trace(path: str | Path, arrival_s: np.ndarray, prompt_tokens: np.ndarray,
                      output_tokens: np.ndarray, *, tier: list[str | None] | tuple[str | None, ...] | None = None,
                      max_tokens: np.ndarray | None = None,
                      status: list[str] | tuple[str, ...] | None = None) -> None:
    """Write columns in the Azure format with numeric (seconds) timestamps, plus the optional columns
    given; for tests and tools."""
    optional = [(name, col) for name, col in zip(OPTIONAL_TRACE_COLUMNS, (tier, max_tokens, status), strict=True)
                if col is not None]
    with Path(path).open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow([*TRACE_COLUMNS, *(name for name, _ in optional)])
        for i, (t, p, o) in enumerate(zip(arrival_s, prompt_tokens, output_tokens, strict=True)):
            extra = ["" if col[i] is None else str(col[i]) for _, col in optional]
            w.writerow([f"{float(t):.6f}", int(p), int(o), *extra])
