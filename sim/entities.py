"""Simulation entities: the request table (columnar, one row per request) and the per-window counters.

Requests are rows of numpy columns rather than objects: a one-hour run has ~10⁵ of them and every
aggregate (latency percentiles, attainment) is a vectorised expression over columns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from sim.workload import Requests


@njit(cache=True, nogil=True)
def add_rows(sums: np.ndarray, bins: np.ndarray, rows: np.ndarray, n: int, sign: float) -> None:
    """``sums[bins[j]] += sign · rows[j]`` for j = 0 .. n − 1 in order, one addition per cell (``sign`` ±1: a − f
    and a + (−f) are the same IEEE operation), compiled: a segment adds a few dozen rows, ~10⁵ times an hour."""
    for j in range(n):
        b = bins[j]
        for f in range(rows.shape[1]):
            if sign > 0:
                sums[b, f] += rows[j, f]
            else:
                sums[b, f] -= rows[j, f]


class RequestTable:
    """Columns for every request of a run. Times are absolute simulated seconds; NaN = not yet."""

    def __init__(self, requests: Requests) -> None:
        n = len(requests)
        self.n = n
        self.tier_names = requests.tier_names
        self.arrival_s = requests.arrival_s.astype(np.float64)
        self.prompt_tokens = requests.prompt_tokens.astype(np.int64)
        self.output_tokens = requests.output_tokens.astype(np.int64)
        self.tier = requests.tier.astype(np.int64)
        # Plain-int copies for the replicas' per-admission lookups (cheaper than numpy scalars).
        self.prompt_list: list[int] = self.prompt_tokens.tolist()
        self.output_list: list[int] = self.output_tokens.tolist()
        self.arrival_list: list[float] = self.arrival_s.tolist()
        self.tier_list: list[int] = self.tier.tolist()
        self.single_tier = n == 0 or bool((self.tier == self.tier[0]).all())
        self.replica = np.full(n, -1, dtype=np.int32)
        self.start_s = np.full(n, np.nan)  # admitted into a batch (prefill starts)
        self.first_token_s = np.full(n, np.nan)
        self.completion_s = np.full(n, np.nan)
        self.rejected = np.zeros(n, dtype=bool)
        self.emitted = np.zeros(n, dtype=np.int64)
        self.distortion_sum = np.zeros(n, dtype=np.float64)  # Σ per-token TV over emitted tokens
        # Tokens of the sequence the draft has not seen (joined or ran at k = 0; LatencyModel.models_draft_prefill).
        self.draft_lag = np.zeros(n, dtype=np.int64)
        # Per-request acceptance odds multipliers (Profile.request_acceptance); None: every request at
        # the profile's acceptance.
        self.acceptance_odds: np.ndarray | None = None

    @property
    def completed(self) -> np.ndarray:
        return np.asarray(~np.isnan(self.completion_s), dtype=bool)


class WindowBins:
    """Per-control-window sums, binned by the tick that closes the window.

    Tick ``w`` happens at ``w·interval`` and closes the window ``((w−1)·interval, w·interval]``; an
    iteration ending at time t lands in bin ``ceil(t / interval)``. With ``offset_s`` (the replicas' reports,
    ``SimConfig.report_age_s``) every window closes ``offset_s`` earlier, at the report tick ``w`` reads. Replicas add a whole drawn
    segment when they draw it and subtract the iterations a truncation voids, so a tick reads its bin
    (:meth:`window`) without touching any replica: iterations that end before a tick can no longer be
    voided. Adds and subtracts go into ``sums`` at once, row by row in the order they come, by a compiled
    loop (:func:`add_rows`; the segment kernel calls it too): the float operations of ``np.add.at`` per
    call, at a fraction of the cost (an ``np.add.at`` per segment and per truncation was a tenth of a run;
    sessions 19–35 queued the rows and folded them per tick with numpy calls to the same result).

    Feature columns of ``sums``: output tokens, decode sequence-iterations, accepted drafts,
    distortion, drafted tokens, decode iterations (steps), decode step time (ms), prefill time (ms,
    the joiners' prefill iterations); the speculative steps' share of them (steps, ms, rows, draft
    forwards, drafted-row forwards: :class:`policies.telemetry.StepTotals`; drafted tokens are their
    verify tokens, plain steps the rest); then output tokens
    per tier, distortion per tier, sequence-iterations per tier (``BASE`` + tier offsets, see the
    ``tier_*`` slices).
    """

    TOKENS, SEQ_ITERS, ACCEPTED, DISTORTION, DRAFTED, ITERS, ITER_MS, PREFILL_MS = 0, 1, 2, 3, 4, 5, 6, 7
    SPEC_ITERS, SPEC_MS, SPEC_ROWS, SPEC_DRAFT_FORWARDS, SPEC_DRAFTED_ROW_FORWARDS = 8, 9, 10, 11, 12
    BASE = 13

    def __init__(self, interval_s: float, horizon_s: float, n_tiers: int, offset_s: float = 0.0) -> None:
        """``offset_s``: windows close ``offset_s`` before each tick (at the replicas' reports, which the
        tick then reads: ``SimConfig.report_age_s``)."""
        self.interval_s = interval_s
        self.n_tiers = n_tiers
        self.n_features = self.BASE + 3 * n_tiers
        self.tier_tokens = slice(self.BASE, self.BASE + n_tiers)
        self.tier_distortion = slice(self.BASE + n_tiers, self.BASE + 2 * n_tiers)
        self.tier_seq_iters = slice(self.BASE + 2 * n_tiers, self.BASE + 3 * n_tiers)
        n_bins = int(math.ceil(horizon_s / interval_s)) + 3
        self.sums = np.zeros((n_bins, self.n_features))
        # Window ends w·interval − offset for w < n_bins − 1 (the ticks' times without an offset): bin_of is one
        # binary search in them, and a time past the last lands in the last bin (past the horizon: a bin no tick reads).
        self.tick_s = np.arange(n_bins - 1) * interval_s - offset_s
        self.completed: dict[int, list[int]] = {}

    def bin_of(self, t: np.ndarray) -> np.ndarray:
        """Bins of times ``t``: the number of window ends w·interval − offset strictly before each (= ceil((t +
        offset) / interval))."""
        return self.tick_s.searchsorted(t, side="left")

    def add(self, bins: np.ndarray, features: np.ndarray) -> None:
        """``sums[bins[j]] += features[j]`` in order j = 0, 1, …."""
        add_rows(self.sums, bins, features, bins.size, 1.0)

    def subtract(self, bins: np.ndarray, features: np.ndarray) -> None:
        """``sums[bins[j]] -= features[j]`` in order; see :meth:`add`."""
        add_rows(self.sums, bins, features, bins.size, -1.0)

    def window(self, w: int) -> np.ndarray:
        """Bin ``w``'s sums with everything added and subtracted so far (a view of ``sums[w]``)."""
        row: np.ndarray = self.sums[w]
        return row

    def totals(self) -> np.ndarray:
        """Every bin's sums added up (a copy): the run's totals per feature, e.g. decode tokens per
        sequence-iteration as the engine's counters give them."""
        return np.asarray(self.sums.sum(axis=0))

    def add_completion(self, bin_index: int, request_id: int) -> None:
        self.completed.setdefault(bin_index, []).append(request_id)

    def take_completions(self, bin_index: int) -> np.ndarray:
        return np.asarray(self.completed.pop(bin_index, []), dtype=np.int64)


@dataclass
class EventCounters:
    """Arrivals and rejections since the last tick (counted as they happen)."""

    arrivals: int = 0
    rejections: int = 0
    admitted_total: int = 0  # never reset: in flight = admitted_total − completions so far

    def reset(self) -> None:
        self.arrivals = self.rejections = 0
