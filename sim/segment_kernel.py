"""The compiled draw of a segment's common case: no draft backlog, step times from the model (not drawn).

:meth:`sim.replica.Replica.start_segment` spent most of its time in ~40 small numpy calls over arrays of a
few hundred elements (call overhead, not arithmetic). This kernel does the same arithmetic in one pass,
compiled by numba, and returns the arrays the numpy path builds. The numpy path stays the reference: every
other case runs it, and ``tests/sim/test_segment_kernel.py`` checks the two agree over whole runs that redraw
every tier's (T, k) at random.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from sim.entities import WindowBins, add_rows

# WindowBins' columns as module ints (numba freezes globals it can type; not a class's attributes).
_ACCEPTED = WindowBins.ACCEPTED
_DRAFTED = WindowBins.DRAFTED
_ITERS = WindowBins.ITERS
_ITER_MS = WindowBins.ITER_MS
_PREFILL_MS = WindowBins.PREFILL_MS
_SEQ_ITERS = WindowBins.SEQ_ITERS
_SPEC_DRAFTED_ROW_FORWARDS = WindowBins.SPEC_DRAFTED_ROW_FORWARDS
_SPEC_DRAFT_FORWARDS = WindowBins.SPEC_DRAFT_FORWARDS
_SPEC_ITERS = WindowBins.SPEC_ITERS
_SPEC_MS = WindowBins.SPEC_MS
_SPEC_ROWS = WindowBins.SPEC_ROWS
_TOKENS = WindowBins.TOKENS
# The mixed step's coefficients, in the order Replica packs them (LatencyModel.speculative_step_ms, plain_coeffs).
VERIFY_A, DRAFT_A, VERIFY_B, VERIFY_C, DRAFT_B, PLAIN_FIXED, PLAIN_PER_ROW = range(7)


@njit(cache=True, nogil=True)
def draw_segment(  # one flat signature of arrays and scalars: numba compiles one specialisation
    u: np.ndarray,  # [h, b] uniforms (the replica's rng, drawn as the numpy path draws them)
    off: int,  # 1 when row 0 is the joiners' prefill
    remaining: np.ndarray,  # [b] int64 tokens each row still has to emit
    one_tier: bool,  # every row of one tier: count with survival_asc (unless per_row); else with the grid
    per_row: bool,  # each row's own survival (per-request acceptance): count with survival_rows
    survival_rows: np.ndarray,  # [b, k_pad] (per_row)
    survival_asc: np.ndarray,  # [k_pad] row 0's survival ascending (one tier)
    k_plus_1: int,
    grid: np.ndarray,  # [G] the batch's breakpoints (several tiers)
    grid_tokens: np.ndarray,  # [b · (G + 1)] int64
    weights: np.ndarray,  # [b, F] the rows' tier_weights
    uniform: bool,  # every row at one k: the step's ms and columns from the table below
    step_ms: np.ndarray,  # [max_batch + 1] the step's ms by rows in it (uniform)
    step_features: np.ndarray,  # [max_batch + 1, F] (uniform)
    row_k: np.ndarray,  # [b] float, each row's k (mixed)
    mixed: np.ndarray,  # [7] the mixed model's coefficients (mixed; the order above)
    plain_ms: np.ndarray,  # [max_batch + 1] a plain step's ms by rows (mixed; empty: mixed's plain line)
    onehot: np.ndarray,  # [b, n_t] (several tiers: the per-tier sequence-iteration columns)
    seq_iters_col: int,  # first of those columns
    prefill_ms: float,  # iteration 0's ms when off
    stop_below: int,  # the segment ends after the first iteration with fewer rows left than this
    now: float,
    tick_s: np.ndarray,  # the control ticks' times (WindowBins.bin_of's)
    sums: np.ndarray,  # WindowBins.sums: the drawn iterations are added here when add_to_sums
    add_to_sums: bool,  # False where the caller still changes features (distortion events) and adds them itself
    speed: np.ndarray,  # [2, h + off] each iteration's factor on its time as a plain step (row 0) or a speculative one
    # (row 1): the replica's speed × drift × jitter ([2, 0]: none); prefill_ms has it
    row_scale: np.ndarray,  # [2, max_batch + 1] a decode iteration's factor by its kind (plain, speculative) and rows
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, np.ndarray]:
    """``(emitted [L, b] cumulative and clipped, finish_iter [b], active_after [L], features [L, F],
    end_s [L], length, bins [L])`` with L = h + off, as the numpy path computes them; with ``add_to_sums`` the
    first ``length`` iterations' features are added to ``sums`` at their bins (WindowBins.add)."""
    h, b = u.shape
    n_iter = h + off
    n_f = weights.shape[1]
    n_t = onehot.shape[1]
    g_size = grid.shape[0]
    emitted = np.empty((n_iter, b), dtype=np.int64)
    finish_iter = np.zeros(b, dtype=np.int64)
    active_after = np.empty(n_iter, dtype=np.int64)
    features = np.empty((n_iter, n_f))
    end_s = np.empty(n_iter)
    drawn = np.zeros(b, dtype=np.int64)  # tokens drawn so far, unclipped
    alive_before = np.ones(b, dtype=np.bool_)  # every row runs in the first iteration
    tokens = np.empty(b)
    active_before = b
    elapsed_ms = 0.0
    length = n_iter
    stopped = False
    shaped = row_scale.shape[0] > 0
    sped = speed.shape[1] > 0
    scaled = sped or shaped
    for j in range(n_iter):
        decode = j >= off
        active = 0
        for r in range(b):
            prev = drawn[r] if drawn[r] < remaining[r] else remaining[r]
            if decode:
                x = u[j - off, r]
                if per_row:
                    # 1 + #{i : x < S_r,i}: the numpy path's comparison, row by row.
                    count = 1
                    for i in range(survival_rows.shape[1]):
                        if x < survival_rows[r, i]:
                            count += 1
                    drawn[r] += count
                elif one_tier:
                    # k + 1 − #{survival <= x}: the accepted count + 1.
                    drawn[r] += k_plus_1 - np.searchsorted(survival_asc, x, side="right")
                else:
                    drawn[r] += grid_tokens[r * (g_size + 1) + np.searchsorted(grid, x, side="right")]
            now_emitted = drawn[r] if drawn[r] < remaining[r] else remaining[r]
            emitted[j, r] = now_emitted
            tokens[r] = now_emitted - prev
            if drawn[r] < remaining[r]:
                active += 1
                finish_iter[r] += 1
        active_after[j] = active
        for f in range(n_f):
            acc = 0.0
            for r in range(b):
                acc += tokens[r] * weights[r, f]
            features[j, f] = acc + step_features[active_before, f] if uniform else acc
        if uniform:
            ms = float(step_ms[active_before])
            if scaled:  # the table's time, as the machine runs it
                speculative = features[j, _SPEC_ITERS] > 0
                if shaped:
                    ms *= row_scale[1 if speculative else 0, active_before]
                if sped:
                    ms *= speed[1 if speculative else 0, j]
                features[j, _ITER_MS] = ms
                if speculative:
                    features[j, _SPEC_MS] = ms
        else:
            # The mixed model over the rows this iteration holds (k_max: the running rows' largest k).
            k_max, drafting, drafted = 0.0, 0.0, 0.0
            for r in range(b):
                if alive_before[r]:
                    k_max = max(k_max, row_k[r])
                    drafted += row_k[r]
                    if row_k[r] > 0:
                        drafting += 1.0
            if k_max > 0:
                ms = mixed[VERIFY_A] + k_max * mixed[DRAFT_A] + active_before * mixed[VERIFY_B]
                ms += drafted * mixed[VERIFY_C] + k_max * drafting * mixed[DRAFT_B]
            elif plain_ms.shape[0]:
                ms = float(plain_ms[active_before])
            else:
                ms = mixed[PLAIN_FIXED] + mixed[PLAIN_PER_ROW] * active_before
            if shaped:
                ms *= row_scale[1 if k_max > 0 else 0, active_before]
            if sped:
                ms *= speed[1 if k_max > 0 else 0, j]
            spec = 1.0 if k_max > 0 else 0.0
            features[j, _SEQ_ITERS] = active_before
            features[j, _DRAFTED] = drafted
            features[j, _ITERS] = 1.0
            features[j, _ITER_MS] = ms
            features[j, _SPEC_ITERS] = spec
            features[j, _SPEC_MS] = ms * spec
            features[j, _SPEC_ROWS] = active_before * spec
            features[j, _SPEC_DRAFT_FORWARDS] = k_max
            features[j, _SPEC_DRAFTED_ROW_FORWARDS] = k_max * drafting
            # Accepted drafts = decode tokens − sequences (one target token each).
            features[j, _ACCEPTED] = features[j, _TOKENS] - active_before
        if j == 0 and off == 1:
            ms = prefill_ms
        if not one_tier:
            for t in range(n_t):
                rows_in = 0.0
                for r in range(b):
                    if alive_before[r]:
                        rows_in += onehot[r, t]
                features[j, seq_iters_col + t] = rows_in
        for r in range(b):
            alive_before[r] = drawn[r] < remaining[r]
        elapsed_ms += ms
        end_s[j] = elapsed_ms / 1000.0 + now
        if not stopped and active < stop_below:
            length = j + 1
            stopped = True
        active_before = active
    if off == 1:
        for f in range(n_f):
            features[0, f] = 0.0  # the prefill iteration: no tokens, no sequences decoded
        features[0, _PREFILL_MS] = prefill_ms
    bins = np.empty(n_iter, dtype=np.int64)
    for j in range(n_iter):
        bins[j] = np.searchsorted(tick_s, end_s[j], side="left")  # WindowBins.bin_of
    if add_to_sums:
        add_rows(sums, bins, features, length, 1.0)
    return emitted, finish_iter, active_after, features, end_s, length, bins
