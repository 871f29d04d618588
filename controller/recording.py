"""Traffic recording: the service writes its own traffic as a trace the simulator replays.

One row per request the ingress admits (or refuses for overload), in the Azure trace format
:mod:`sim.trace` reads — ``TIMESTAMP,ContextTokens,GeneratedTokens`` — plus ``Tier``, ``MaxTokens`` and
``Status`` (see :data:`sim.trace.TRACE_STATUSES`). TIMESTAMP is the arrival at the ingress in Unix
seconds; the row is written when the request ends. **No prompt or output text is ever recorded**: only
token counts, the tier, the requested ``max_tokens`` and how the request ended.

What each status records:

- ``stop`` / ``length``: finished; GeneratedTokens is exact (the replica's ``usage``).
- ``error``: the engine failed the request; GeneratedTokens is the count emitted before the failure
  (a lower bound: engine steps that produced text).
- ``cut``: started, then the request timed out, lost its replica or its client; same lower bound.
- ``rejected``: refused for overload or for want of a replica (503), or not started before the deadline
  (504) — before a replica tokenized it, so ContextTokens and GeneratedTokens are unknown and written
  as 0. Another server failure before the start (5xx) is an ``error`` row with 0 tokens.

Requests refused as invalid (4xx) are not recorded: every policy would refuse them alike.

The file rotates at ``recording.max_bytes`` (``path`` → ``path.1`` → … → ``path.N``, N =
``recording.backups``, the oldest deleted), so the recording never exceeds (N + 1) × max_bytes. The
recorder lives in the ingress process (the shipped app runs one ingress replica); it also keeps the
last ``shadow_window_s`` of rows in memory for the shadow estimate (:mod:`controller.rollout`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.config import FSDConfig, RecordingConfig
from sim.trace import OPTIONAL_TRACE_COLUMNS, TRACE_COLUMNS

logger = logging.getLogger("ray.serve")

RECORDING_HEADER = ",".join((*TRACE_COLUMNS, *OPTIONAL_TRACE_COLUMNS))


@dataclass(frozen=True, slots=True)
class TrafficRecord:
    """One recorded request (counts only)."""

    arrival_unix_s: float
    prompt_tokens: int
    generated_tokens: int
    tier: str
    max_tokens: int
    status: str  # one of sim.trace.TRACE_STATUSES

    def csv_line(self) -> str:
        # Tier names are SLO keys; quote nothing, but never let a comma or newline break the row.
        tier = self.tier.replace(",", "_").replace("\n", "_")
        return (f"{self.arrival_unix_s:.6f},{self.prompt_tokens},{self.generated_tokens},{tier},"
                f"{self.max_tokens},{self.status}\n")


class TrafficRecorder:
    """Appends :class:`TrafficRecord` rows to a size-bounded rotating CSV (see the module docstring)."""

    def __init__(self, path: str | Path, max_bytes: int, backups: int, window_s: float = 60.0) -> None:
        if max_bytes < len(RECORDING_HEADER) + 64:
            raise ValueError(f"recording.max_bytes {max_bytes} is too small for even one row")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.window_s = window_s
        self._recent: deque[TrafficRecord] = deque()
        self._lock = threading.Lock()  # rows come from the ingress's event loop; fetches may come from a thread
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and not self._has_our_header(self.path):
            self._rotate()  # never append to a file of another shape
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._fh = self.path.open("a", encoding="utf-8", newline="")
        if new:
            self._fh.write(RECORDING_HEADER + "\n")
            self._fh.flush()
        self._size = self.path.stat().st_size
        self.rows_written = 0

    @classmethod
    def from_config(cls, cfg: RecordingConfig) -> TrafficRecorder | None:
        """The recorder ``cfg`` asks for, or None when recording is off."""
        if not cfg.enabled:
            return None
        return cls(cfg.path, cfg.max_bytes, cfg.backups, cfg.shadow_window_s)

    @staticmethod
    def _has_our_header(path: Path) -> bool:
        with path.open(encoding="utf-8", errors="replace") as fh:
            first = fh.readline().strip()
        return first == RECORDING_HEADER or first == ""

    def _rotate(self) -> None:
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
            return
        self._backup(self.backups).unlink(missing_ok=True)
        for i in range(self.backups - 1, 0, -1):
            if self._backup(i).exists():
                self._backup(i).rename(self._backup(i + 1))
        if self.path.exists():
            self.path.rename(self._backup(1))

    def _backup(self, i: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{i}")

    def record(self, rec: TrafficRecord) -> None:
        line = rec.csv_line()
        with self._lock:
            if self._size + len(line) > self.max_bytes:
                self._fh.close()
                self._rotate()
                self._fh = self.path.open("w", encoding="utf-8", newline="")
                self._fh.write(RECORDING_HEADER + "\n")
                self._size = len(RECORDING_HEADER) + 1
            self._fh.write(line)
            self._fh.flush()  # a crash loses at most the row being written
            self._size += len(line)
            self.rows_written += 1
            self._recent.append(rec)
            horizon = rec.arrival_unix_s - 2 * self.window_s  # rows end out of arrival order; keep slack
            while self._recent and self._recent[0].arrival_unix_s < horizon:
                self._recent.popleft()

    def recent(self, window_s: float, now_unix_s: float | None = None) -> list[TrafficRecord]:
        """Rows that arrived in the last ``window_s`` seconds, by arrival."""
        now = time.time() if now_unix_s is None else now_unix_s
        with self._lock:
            rows = [r for r in self._recent if r.arrival_unix_s >= now - window_s]
        return sorted(rows, key=lambda r: r.arrival_unix_s)

    def files(self) -> list[Path]:
        """The recording's files, oldest first."""
        out = [self._backup(i) for i in range(self.backups, 0, -1) if self._backup(i).exists()]
        return [*out, self.path] if self.path.exists() else out

    def read_all(self) -> str:
        """The whole recording (every file, oldest first) as one CSV with one header."""
        with self._lock:
            self._fh.flush()
            parts = [RECORDING_HEADER + "\n"]
            for f in self.files():
                lines = f.read_text(encoding="utf-8").splitlines(keepends=True)
                parts.extend(lines[1:] if lines and lines[0].strip() == RECORDING_HEADER else lines)
        return "".join(parts)

    def close(self) -> None:
        with self._lock:
            self._fh.close()


class RequestRecording:
    """Follows one request from the ingress: call :meth:`observe` with each replica chunk, then
    :meth:`close` (or :meth:`refused` when it never started). Writes exactly one row, or none for a
    request refused as invalid."""

    def __init__(self, recorder: TrafficRecorder, tier: str, max_tokens: int,
                 arrival_unix_s: float | None = None) -> None:
        self._recorder = recorder
        self.arrival_unix_s = time.time() if arrival_unix_s is None else arrival_unix_s
        self.tier = tier
        self.max_tokens = max_tokens
        self.prompt_tokens = 0
        self.generated = 0  # exact once the end chunk arrives; until then engine steps that produced text
        self.status = "cut"
        self._written = False

    @classmethod
    def for_payload(cls, recorder: TrafficRecorder, payload: Mapping[str, Any], cfg: FSDConfig) -> RequestRecording:
        """A recording for the ingress's replica payload (tier and max_tokens as the replica resolves them)."""
        max_tokens = payload.get("max_tokens")
        if max_tokens is None:
            max_tokens = cfg.replica.default_max_new_tokens
        return cls(recorder, payload.get("tier") or cfg.slo.default_tier, int(max_tokens))

    def observe(self, chunk: Mapping[str, Any]) -> None:
        kind = chunk.get("type")
        if kind == "start":
            self.prompt_tokens = int(chunk.get("prompt_tokens", 0))
            self.tier = str(chunk.get("tier") or self.tier)
        elif kind == "delta":
            self.generated += 1
        elif kind == "end":
            if chunk.get("finish_reason") == "error":
                self.status = "error"
                return
            usage = chunk.get("usage") or {}
            self.generated = int(usage.get("completion_tokens", self.generated))
            self.prompt_tokens = int(usage.get("prompt_tokens", self.prompt_tokens))
            self.status = "length" if chunk.get("finish_reason") == "length" else "stop"

    def refused(self, http_status: int) -> None:
        """The request never started: overload or no replica (503) and the start deadline (504) are
        recorded as ``rejected``, another server failure (5xx) as ``error``; an invalid request (4xx)
        is not recorded."""
        if http_status in (503, 504):
            self.status = "rejected"
        elif http_status >= 500:
            self.status = "error"
        else:
            self._written = True
            return
        self.close()

    def close(self) -> None:
        if self._written:
            return
        self._written = True
        try:
            self._recorder.record(TrafficRecord(self.arrival_unix_s, self.prompt_tokens, self.generated,
                                                self.tier, self.max_tokens, self.status))
        except OSError:  # a full disk must not fail the request; the gap shows in the row count
            logger.exception("traffic recording failed")
