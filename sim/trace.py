"""Trace replay: the Azure LLM inference trace format (``TIMESTAMP,ContextTokens,GeneratedTokens``).

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


@dataclass(frozen=True, slots=True)
class Trace:
    """A trace as columns: arrival offsets (s, from the first request) and token counts."""

    arrival_s: np.ndarray  # [n] float64, non-decreasing, starts at 0
    prompt_tokens: np.ndarray  # [n] int64
    output_tokens: np.ndarray  # [n] int64
    source: str

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
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(
                f"trace {str(path)!r}: missing column(s) {missing}; expected header {','.join(TRACE_COLUMNS)}"
            )
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
    if not times:
        raise ValueError(f"trace {str(path)!r} has no rows")
    arr = np.asarray(times, dtype=np.float64)
    order = np.argsort(arr, kind="stable")
    arr = arr[order]
    return Trace(
        arrival_s=arr - arr[0],
        prompt_tokens=np.asarray(prompts, dtype=np.int64)[order],
        output_tokens=np.asarray(outputs, dtype=np.int64)[order],
        source=str(path),
    )


def write_azure_trace(path: str | Path, arrival_s: np.ndarray, prompt_tokens: np.ndarray,
                      output_tokens: np.ndarray) -> None:
    """Write columns in the Azure format with numeric (seconds) timestamps; for tests and tools."""
    with Path(path).open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(TRACE_COLUMNS)
        for t, p, o in zip(arrival_s, prompt_tokens, output_tokens, strict=True):
            w.writerow([f"{float(t):.6f}", int(p), int(o)])
