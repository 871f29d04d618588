"""One simulated replica: a FIFO queue and a continuously batched FSD decode loop.

Speed is the point of this module. Instead of one event per iteration, a replica draws a *segment*
of iterations at once (compiled, sim.segment_kernel; numpy where it leaves a case) — accepted counts for
every (iteration, sequence), the batch size of every iteration as sequences finish, and the iteration end
times — and schedules a single event at the segment's end. A segment ends at the first iteration boundary
where something could change: a queued request can join (room in the batch), every sequence is done, or the
segment's horizon. An arrival or a new threshold *truncates* the segment at the first boundary at or after its time;
draws past the cut are discarded (the RNG is the simulator's, so runs stay deterministic).
A drawn segment writes its consequences at once — first-token and completion times into the request
table, per-iteration sums into the control windows' bins (:class:`sim.entities.WindowBins`) — and a
truncation takes back what it voids. Per-request token and distortion totals are folded in when the
segment ends. So neither a control tick nor routing has to step a replica: its load at time t is one
binary search.

Iteration model (per replica, batch of B sequences, draft length k):
- A prefill iteration when requests join: it takes ``prefill_ms(Σ prompt tokens of the joiners)``
  and emits nothing; running sequences stall. As in the engine (``FSDEngine.step``: admit, then one
  draft/verify iteration over every row), the prefill and the decode iteration after it are one
  step: a joiner's first tokens come at the end of that decode iteration (TTFT), and nothing (an
  arrival, a new threshold) cuts between the two.
- A decode iteration takes ``iteration_ms(B, k)`` when every row drafts the same k (at k = 0 the
  profile's plain step per batch when it measured one: ``DecodeSettings.plain_ms_by_rows``), else the mixed
  model (:meth:`sim.profile.LatencyModel.mixed_coeffs`: ``k_max`` draft steps over the drafting rows,
  verify as wide as each row's k) over the rows still running (a plain step once no running row
  drafts); each sequence emits accepted + 1
  tokens, accepted drawn from the profile's per-position acceptance at its tier's current (T, k) (one
  uniform per sequence: accepted = #{i : u < S_i}, S_i = P(at least i accepted), S padded with zeros
  past the tier's k; k = 0 emits exactly one token); a sequence's last iteration is clipped at its
  output length. A segment keeps the k of the rows it was drawn with: a new k truncates it.
- The draft's backlog, when the profile measures the draft's prefill apart
  (:attr:`sim.profile.LatencyModel.models_draft_prefill`), as the engine keeps it: a request joining at
  k = 0 skips the draft's prefill (its prompt is the draft's backlog), a row at k = 0 adds its tokens to
  the backlog while no row drafts (or its backlog is already more than the engine feeds in passing), and
  the first decode iteration in which a row with a backlog drafts also runs the draft over every fed
  row's backlog, padded to the longest (:meth:`~sim.profile.LatencyModel.draft_catch_up_ms`).
- A serving machine's departure from the model, when the profile states one
  (:attr:`~sim.profile.LatencyModel.varies_steps`): each decode iteration's time × the shape of its kind (plain
  or speculative) at its rows, every iteration's (prefills too) × the replica's own speed (drawn once) × its slow
  drift (an Ornstein-Uhlenbeck process in the log, advanced at each segment's start and held through the
  segment) × its own jitter; each factor log-normal with mean 1. The window sums carry the times as drawn: a
  policy measures the machine, not the model.
"""

from __future__ import annotations

import enum
import math
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from sim.entities import RequestTable, WindowBins
from sim.profile import LatencyModel, shifted_acceptance
from sim.segment_kernel import draw_segment

_B = WindowBins.BASE
_BATCH_CACHE_SIZE = 50_000  # entries of DecodeSettings.batch_cache (each a few hundred bytes)
#: A k = 0 row whose draft backlog is at most this many tokens is fed in passing when other rows draft
#: (decoder.engine's _MAX_PASSIVE_UNSEEN): its backlog stays put.
_MAX_PASSIVE_LAG = 2
#: False runs every segment through the numpy path (the kernel's reference: tests compare the two).
_KERNEL_ENABLED = True
_EMPTY = np.zeros(0)
_NO_ROWS = np.zeros((0, 0))
_NO_SPEED = np.zeros((2, 0))  # Replica._speeds' shape, no iterations: the machine runs as modelled


class ReplicaState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"  # finishes its work, takes no new requests
    STOPPED = "stopped"


@dataclass
class DecodeSettings:
    """What a replica reads from the simulator when it draws a segment (shared, mutated by control)."""

    k_by_tier: np.ndarray  # [n_tiers] draft length per tier (0 = plain decoding)
    k_pad: int  # width of the survival tables: max k over tiers (>= 1)
    survival_by_tier: np.ndarray  # [n_tiers, k_pad] P(at least i+1 drafts accepted), 0 past the tier's k
    distortion_by_tier: np.ndarray  # [n_tiers] mean TV per emitted decode token
    survival_asc_by_tier: np.ndarray  # [n_tiers, k_pad] survival reversed (ascending, for searchsorted)
    accept_by_tier: np.ndarray  # [n_tiers, k_pad] per-position conditional acceptance, 0 past the tier's k
    # Per-request variation (Profile.request_acceptance): odds multiplier per tier that keeps the
    # tier's step-pooled tokens per step at the profile's (RequestAcceptance.centring).
    odds_centring_by_tier: np.ndarray  # [n_tiers]
    # Acceptance against the engine batch (Profile.batch_acceptance): odds multiplier per batch size
    # and tier ([max_batch + 1, n_tiers], index = rows in the batch; it depends on the tier's T);
    # None: acceptance does not depend on the batch. A segment draws at the batch it starts with
    # (rows finishing inside it do not raise the others' acceptance until the next draw).
    batch_odds: np.ndarray | None
    tier_weights: np.ndarray  # [n_tiers, F] per-tier row of the window-feature product
    coeffs_by_tier: list[tuple[float, float]]  # step ms = fixed + per_seq · B with every row at the tier's k
    # Plain steps (every row at k = 0) by rows in the batch, [max_batch + 1] (LatencyModel.plain_table);
    # None: coeffs_by_tier's line.
    plain_ms_by_rows: np.ndarray | None = None
    # Distortion as events (None: every token carries its tier's mean): a token carries
    # event_size_by_tier[τ] with probability event_p_by_tier[τ], so short windows see the real noise.
    event_p_by_tier: np.ndarray | None = None  # [n_tiers]
    event_size_by_tier: np.ndarray | None = None  # [n_tiers]
    # survival_by_tier's breakpoints and per-tier token counts at them (survival_grid(survival_by_tier)).
    survival_grid: np.ndarray | None = None  # [G]
    grid_tokens_by_tier: np.ndarray | None = None  # [n_tiers, G + 1] int
    # What the tables above were built from ((T, k) per tier): with the batch composition it keys
    # batch_cache, so an entry outlives a decision and serves again when the policy returns there.
    state_key: tuple[tuple[float, int], ...] = ()
    # Per state_key, per batch composition (the tiers of its rows, in order): the rows' slices of the
    # tables above. Derived data only (speed).
    batch_cache: dict[tuple[tuple[float, int], ...], dict[tuple[int, ...], _BatchTables]] = field(
        default_factory=dict)
    # batch_cache[state_key] for the state_key object it was looked up for (a decision sets a new one):
    # the per-segment lookup then hashes the composition only.
    _state_tables: dict[tuple[int, ...], _BatchTables] = field(default_factory=dict, init=False, repr=False)
    _state_tables_key: tuple[tuple[float, int], ...] | None = field(default=None, init=False, repr=False)
    _cached_tables: int = field(default=0, init=False, repr=False)
    # Per (tier of row 0, one tier) for the state_key object it was built for: step_table's tables.
    _step_tables: dict[tuple[int, bool], _StepTable] = field(default_factory=dict, init=False, repr=False)
    _step_tables_key: tuple[tuple[float, int], ...] | None = field(default=None, init=False, repr=False)

    def step_table(self, tier: int, one_tier: bool, max_batch: int) -> _StepTable:
        """The step ms and the step's window-feature columns by rows in it, for a batch whose rows all
        draft ``tier``'s k (row 0 of ``tier``; ``one_tier``: every row of it). Cached per state."""
        if self._step_tables_key is not self.state_key:
            self._step_tables = {}
            self._step_tables_key = self.state_key
        key = (tier, one_tier)
        found = self._step_tables.get(key)
        if found is None:
            found = self._step_tables[key] = _StepTable.build(self, tier, one_tier, max_batch)
        return found

    def batch_tables(self, tier_list: list[int]) -> _BatchTables:
        if self._state_tables_key is not self.state_key:
            self._state_tables = self.batch_cache.setdefault(self.state_key, {})
            self._state_tables_key = self.state_key
        key = tuple(tier_list)
        found = self._state_tables.get(key)
        if found is None:
            if self._cached_tables >= _BATCH_CACHE_SIZE:
                self.batch_cache.clear()
                self._cached_tables = 0
                self._state_tables = self.batch_cache.setdefault(self.state_key, {})
            found = _BatchTables.build(self, np.array(tier_list, dtype=np.int64))
            self._state_tables[key] = found
            self._cached_tables += 1
        return found


@dataclass(slots=True)
class _BatchTables:
    """The per-tier tables of :class:`DecodeSettings` taken at a batch's rows ([B] or [B, ·])."""

    weights: np.ndarray  # [B, F] rows of tier_weights
    onehot: np.ndarray  # [B, n_tiers]
    row_k: np.ndarray  # [B] int
    row_k_float: np.ndarray  # [B]
    uniform_k: bool  # every row at one k
    survival: np.ndarray  # [B, k_pad] at this batch size
    survival_asc0: np.ndarray  # [k_pad] row 0's survival ascending (the one-tier search)
    accept: np.ndarray  # [B, k_pad] at the reference batch (per-request draws shift it by odds_centring)
    odds_centring: np.ndarray  # [B] per-request centring times the batch's odds multiplier
    distortion_list: list[float]  # [B] mean distortion per token (plain floats: Replica._fold's scalar updates)
    event_p: np.ndarray | None  # [B]
    event_size: np.ndarray | None  # [B]
    row_drafts: np.ndarray  # [B] 1.0 where the row drafts (k > 0)
    # Every row's survival values, sorted and unique (the breakpoints of all rows' counts), and per row
    # the tokens at each breakpoint interval, flattened [B · (G + 1)]: a uniform u with
    # g = #{breakpoints <= u} emits grid_tokens[row_offset + g] = 1 + #{i : u < survival[row, i]}.
    grid: np.ndarray  # [G]
    grid_tokens: np.ndarray  # [B · (G + 1)] int
    grid_offsets: np.ndarray  # [B] int, row · (G + 1)

    @classmethod
    def build(cls, s: DecodeSettings, tiers: np.ndarray) -> _BatchTables:
        n_t = s.tier_weights.shape[0]
        row_k = s.k_by_tier.take(tiers)
        accept = s.accept_by_tier.take(tiers, axis=0)
        odds_centring = s.odds_centring_by_tier.take(tiers)
        if s.batch_odds is None:
            survival = s.survival_by_tier.take(tiers, axis=0)
            survival_asc0 = s.survival_asc_by_tier[int(tiers[0])]
            if s.survival_grid is not None and s.grid_tokens_by_tier is not None:
                # The tiers' breakpoints serve every batch of them (extra breakpoints change no count).
                grid, grid_tokens = s.survival_grid, s.grid_tokens_by_tier.take(tiers, axis=0)
            else:
                grid, grid_tokens = survival_grid(survival)
        else:
            scale = s.batch_odds[min(int(tiers.size), s.batch_odds.shape[0] - 1)].take(tiers)
            survival = np.multiply.accumulate(shifted_acceptance(accept, scale[:, None]), axis=1)
            survival_asc0 = np.ascontiguousarray(survival[0, ::-1])
            odds_centring = odds_centring * scale
            grid, grid_tokens = survival_grid(survival)
        b, g = survival.shape[0], grid.size
        return cls(
            weights=s.tier_weights.take(tiers, axis=0),
            onehot=s.tier_weights[:, _B : _B + n_t].take(tiers, axis=0),
            row_k=row_k,
            row_k_float=row_k.astype(float),
            row_drafts=(row_k > 0).astype(float),
            uniform_k=int(row_k.min()) == int(row_k.max()),
            survival=survival,
            survival_asc0=survival_asc0,
            accept=accept,
            odds_centring=odds_centring,
            distortion_list=s.distortion_by_tier.take(tiers).tolist(),
            event_p=None if s.event_p_by_tier is None else s.event_p_by_tier.take(tiers),
            event_size=None if s.event_size_by_tier is None else s.event_size_by_tier.take(tiers),
            grid=grid,
            grid_tokens=grid_tokens.ravel(),
            grid_offsets=np.arange(b, dtype=np.int64) * (g + 1),
        )


@dataclass(slots=True)
class _StepTable:
    """A uniform-k step by the rows in it (index 0 .. max_batch): its ms, and the window-feature columns
    that do not come from the tokens' product (rows, drafted tokens, steps, ms, the speculative steps'
    share, and with one tier its sequence-iterations; zeros elsewhere). Replica.start_segment reads
    them at each iteration's rows: the values the per-segment column writes computed, with the same
    operations."""

    ms: np.ndarray  # [max_batch + 1]
    features: np.ndarray  # [max_batch + 1, F]

    @classmethod
    def build(cls, s: DecodeSettings, tier: int, one_tier: bool, max_batch: int) -> _StepTable:
        rows = np.arange(max_batch + 1, dtype=np.int64)
        k = int(s.k_by_tier[tier])
        n_t = s.tier_weights.shape[0]
        uniform_k = 0
        if s.plain_ms_by_rows is not None and k == 0:
            ms = np.array(s.plain_ms_by_rows[: max_batch + 1], dtype=float)
            drafted: np.ndarray = np.zeros(rows.size)
        else:
            fixed_ms, per_seq_ms = s.coeffs_by_tier[tier]
            ms = rows * per_seq_ms
            ms += fixed_ms
            drafted = rows * k
            uniform_k = k
        features = np.zeros((rows.size, s.tier_weights.shape[1]))
        features[:, WindowBins.SEQ_ITERS] = rows
        features[:, WindowBins.ACCEPTED] = -rows  # + the tokens (tier_weights) = tokens − rows, exactly
        features[:, WindowBins.DRAFTED] = drafted
        features[:, WindowBins.ITERS] = 1.0
        features[:, WindowBins.ITER_MS] = ms
        if uniform_k:
            features[:, WindowBins.SPEC_ITERS] = 1.0
            features[:, WindowBins.SPEC_MS] = features[:, WindowBins.ITER_MS]
            features[:, WindowBins.SPEC_ROWS] = rows
            features[:, WindowBins.SPEC_DRAFT_FORWARDS] = float(uniform_k)
            features[:, WindowBins.SPEC_DRAFTED_ROW_FORWARDS] = rows * float(uniform_k)
        if one_tier:
            features[:, _B + 2 * n_t + tier] = rows
        return cls(ms=ms, features=features)


_NO_STEP_TABLE = _StepTable(ms=np.zeros(0), features=np.zeros((0, 0)))  # a mixed batch reads none


def survival_grid(survival: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Breakpoints of survival rows [R, k_pad] and each row's tokens at them: ``(grid [G], tokens
    [R, G + 1])`` with ``tokens[r, g] = 1 + #{i : u < survival[r, i]}`` for every u with
    ``g = #{grid <= u}``. Exact (comparisons only): every survival value is a breakpoint, so u < S ⟺
    S >= the first breakpoint above u."""
    grid = np.unique(survival)
    tokens = np.ones((survival.shape[0], grid.size + 1), dtype=np.int64)
    tokens[:, : grid.size] += (survival[:, :, None] >= grid).sum(axis=1)
    return grid, tokens


@dataclass(slots=True)
class _Segment:
    ids: np.ndarray | None  # [B] request ids in the batch (joiners first); None where nothing needed the array
    id_list: list[int]  # the ids as plain ints
    remaining: list[int]  # [B] tokens each still had to emit when the segment started
    end_s: list[float]  # [L] absolute end time of each iteration (plain floats: bisected per arrival)
    emitted: np.ndarray  # [L, B] tokens emitted by the end of iteration j (cumulative, clipped)
    finish_iter: list[int]  # [B] iteration at whose end the sequence completes; > L-1 if not in segment
    active_after: list[int]  # [L] sequences still running after iteration j
    distortion_list: list[float]  # [B] mean distortion per token of each row (plain floats)
    features: np.ndarray  # [L, F] per-iteration window sums (see WindowBins)
    bins: np.ndarray  # [L] window bin of each iteration
    completions: list[tuple[int, int]]  # (iteration, request id) of the completions inside the draw
    tiers: frozenset[int]  # tiers present in the batch (a threshold change elsewhere leaves it be)
    n_new: int  # the first n_new of ids joined in this segment (iteration 0 is their prefill)
    length: int  # iterations in force (truncation lowers it)
    distortion_rows: np.ndarray | None  # [L, B] drawn distortion per iteration (None: mean per token)
    lag_grows: np.ndarray | None = None  # [B] rows whose emitted tokens add to the draft's backlog


class Replica:
    def __init__(
        self,
        replica_id: int,
        latency: LatencyModel,
        max_batch: int,
        max_queue: int,
        table: RequestTable,
        bins: WindowBins,
        rng: np.random.Generator,
        started_s: float,
        ready_s: float,
        horizon_iters: int = 48,
    ) -> None:
        self.id = replica_id
        self.latency = latency
        self.max_batch = max_batch
        # The rows admitted at most: max_batch, or a policy's lower cap (Decision.batch_cap). A lowered cap
        # preempts nobody: it holds back admissions until the batch is below it, as the live loop does.
        self.batch_limit = max_batch
        self.max_queue = max_queue
        self.table = table
        self.bins = bins
        self.rng = rng
        self.started_s = started_s
        self.ready_s = ready_s
        self.stopped_s: float | None = None
        self.state = ReplicaState.STARTING if ready_s > started_s else ReplicaState.READY
        self.queue: deque[int] = deque()
        self.running: list[int] = []  # ids in the batch as of the last segment end
        self.remaining: list[int] = []  # tokens still to emit, aligned with running
        self.segment: _Segment | None = None
        self.version = 0  # bumps whenever the pending segment-end time changes
        self.iterations = 0  # decode iterations run (for the speed benchmark)
        self.segments_drawn = 0  # segment draws, truncated or not (for the speed benchmark)
        self.horizon_iters = horizon_iters
        # The latency model is frozen: read its switches once, not per segment.
        self._draft_prefill = latency.models_draft_prefill
        self._exponential_times = latency.iteration_time_dist == "exponential"
        # The machine's departure from the model (LatencyModel.varies_steps): the shape by rows, the drift's state.
        self._varies = latency.varies_steps
        shaped = latency.plain_step_scale_by_batch or latency.speculative_step_scale_by_batch
        self._row_scale = latency.step_scale_table(max_batch) if shaped else _NO_ROWS  # [plain, speculative] by rows
        self._drift_sigma, self._drift_tau_s = latency.step_drift_sigma, latency.step_drift_tau_s
        self._jitter_sigma = latency.step_jitter_sigma
        spec_jitter = latency.speculative_step_jitter_sigma
        self._spec_jitter_sigma = latency.step_jitter_sigma if spec_jitter is None else spec_jitter
        offset = latency.step_offset_sigma
        self._speed = math.exp(float(rng.normal(0.0, offset)) - 0.5 * offset * offset) if offset > 0 else 1.0
        self._drift_log = float(rng.normal(0.0, self._drift_sigma)) if self._drift_sigma > 0 else 0.0  # stationary
        self._drift_at = started_s
        plain_fixed, plain_per_row = latency.plain_coeffs()
        self._mixed_coeffs = np.array([  # in segment_kernel's order
            latency.verify_a_ms, latency.draft_a_ms, latency.verify_b_ms, latency.verify_c_ms, latency.draft_b_ms,
            plain_fixed, plain_per_row])

    # ---------------------------------------------------------------- state

    def load(self, now: float) -> int:
        """Requests in flight here at ``now`` (running + queued)."""
        seg = self.segment
        if seg is None:
            return len(self.running) + len(self.queue)
        j = bisect_right(seg.end_s, now)
        if j == 0:
            return len(seg.id_list) + len(self.queue)
        return seg.active_after[min(j, seg.length) - 1] + len(self.queue)

    # ---------------------------------------------------------------- segments

    def start_segment(self, now: float, settings: DecodeSettings) -> float | None:
        """Admit from the queue and draw the next segment; returns its end time (None when idle)."""
        # Hot path (once per arrival and per segment end): few numpy calls, plain ints where small.
        table = self.table
        queue = self.queue
        running = self.running
        n_run = len(running)
        n_new = min(len(queue), self.batch_limit - n_run)
        if n_new <= 0:
            if n_run == 0:
                self.segment = None
                return None
            n_new = 0
            id_list = running
            decode_left = self.remaining
            prefill_tokens = 0
        else:
            new = [queue.popleft() for _ in range(n_new)]
            out_list, prompt_list = table.output_list, table.prompt_list
            decode_left = [out_list[i] for i in new]
            prefill_tokens = sum([prompt_list[i] for i in new])
            if n_run:
                id_list = new + running
                decode_left += self.remaining
            else:
                id_list = new
        # The ids as an array only where a fancy index needs them (per-request acceptance, the draft's
        # backlog); a few scalar writes beat one fancy-indexed write.
        ids = np.array(id_list, dtype=np.int64) if table.acceptance_odds is not None or self._draft_prefill else None
        remaining = np.array(decode_left, dtype=np.int64)
        if n_new:
            start_s = table.start_s
            for rid in new:
                start_s[rid] = now
        b = n_new + n_run
        tier_of = table.tier_list
        tier_list = [tier_of[i] for i in id_list]

        # Horizon: enough decode iterations for the shortest sequence if someone waits for a slot,
        # otherwise for the longest one; capped (the segment just continues in a fresh draw).
        need = min(decode_left) if queue else max(decode_left)
        h = max(1, min(need, self.horizon_iters))

        # accepted = #{i : u < S_i} with S_i = P(at least i+1 accepted), non-increasing in i: an exact
        # draw of the accepted count from one uniform, as k − #{i : S_i <= u}, a binary search in S
        # reversed (ascending). Tokens emitted = accepted + 1.
        u = self.rng.random((h, b))
        k_plus_1 = settings.k_pad + 1
        off = 1 if n_new else 0  # row 0 is the joiners' prefill
        speed = self._speeds(now, h + off) if self._varies else _NO_SPEED
        t0 = tier_list[0]
        one_tier = b == 1 or table.single_tier or min(tier_list) == max(tier_list)
        tier_set = frozenset(tier_list)
        rows = settings.batch_tables(tier_list)
        odds = table.acceptance_odds
        if not self._draft_prefill and not self._exponential_times and _KERNEL_ENABLED:
            # The common case, compiled (sim.segment_kernel): the numpy path's arithmetic in one pass.
            uniform = one_tier or rows.uniform_k
            survival_rows = _NO_ROWS if odds is None else self._request_survival(odds, ids, rows)
            step = settings.step_table(t0, one_tier, self.max_batch) if uniform else _NO_STEP_TABLE
            plain_ms = settings.plain_ms_by_rows
            events = rows.event_p is not None
            prefill_ms = self.latency.prefill_ms(prefill_tokens) if n_new else 0.0
            emitted, finish_iter, active_after, features, end_s, length, bins = draw_segment(
                u, off, remaining, one_tier, odds is not None, survival_rows, rows.survival_asc0, k_plus_1, rows.grid,
                rows.grid_tokens, rows.weights, uniform, step.ms, step.features, rows.row_k_float, self._mixed_coeffs,
                _EMPTY if plain_ms is None else plain_ms, rows.onehot, _B + 2 * self.bins.n_tiers,
                prefill_ms * float(speed[0, 0]) if n_new and speed.size else prefill_ms, self.batch_limit if queue else 1,
                now, self.bins.tick_s, self.bins.sums, not events, speed, self._row_scale)
            distortion_rows: np.ndarray | None = None
            if events:
                tokens = np.diff(emitted, axis=0, prepend=np.zeros((1, b), dtype=np.int64))
                distortion_rows = self._distortion_events(tokens, rows, features)
                self.bins.add(bins[:length], features[:length])
            lag_grows: np.ndarray | None = None
        else:
            emitted, finish_iter, active_after, features, end_s, length, distortion_rows, lag_grows = (
                self._draw_general(now, settings, u, off, ids, remaining, rows, t0, one_tier, n_new,
                                   prefill_tokens, bool(queue), speed))
            bins = self.bins.bin_of(end_s)
            self.bins.add(bins[:length], features[:length])

        end_list: list[float] = end_s.tolist()
        if n_new:
            first_token_s, first_s = table.first_token_s, end_list[1]  # n_iter >= 2: h >= 1 decode iteration follows
            for rid in new:
                first_token_s[rid] = first_s
        # Completions inside the draw (a few per segment: plain Python beats numpy calls here).
        finish_list = finish_iter.tolist()
        completions = [(it, rid) for it, rid in zip(finish_list, id_list, strict=True) if it < length]
        if completions:
            completion_s = table.completion_s
            add = self.bins.add_completion
            for it, rid in completions:
                completion_s[rid] = end_list[it]
                add(int(bins[it]), rid)

        self.running, self.remaining = id_list, decode_left
        self.segment = _Segment(
            ids,
            id_list,
            decode_left,
            end_list,
            emitted,
            finish_list,
            active_after.tolist(),
            rows.distortion_list,
            features,
            bins,
            completions,
            tier_set,
            n_new,
            length,
            distortion_rows,
            lag_grows,
        )
        self.version += 1
        self.segments_drawn += 1
        return end_list[length - 1]

    def _draw_general(
        self, now: float, settings: DecodeSettings, u: np.ndarray, off: int, ids: np.ndarray | None,
        remaining: np.ndarray, rows: _BatchTables, t0: int, one_tier: bool, n_new: int, prefill_tokens: int,
        queued: bool, speed: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, np.ndarray | None,
               np.ndarray | None]:
        """A segment's draw with numpy, every case (sim.segment_kernel compiles the common one):
        ``(emitted, finish_iter, active_after, features, end_s, length, distortion_rows, lag_grows)``."""
        h, b = u.shape
        n_iter = h + off
        k_plus_1 = settings.k_pad + 1
        table = self.table
        odds = table.acceptance_odds
        # Cumulative tokens with a leading row of zeros (row j + 1 = by the end of iteration j): "alive
        # before" and "alive after" iteration j, the batch sizes and the tokens per iteration each come
        # from one call over it instead of a shifted copy.
        cz = np.zeros((n_iter + 1, b), dtype=np.int64)  # zeros: nothing before iteration 0, nor in a prefill
        dec = cz[off + 1 :]
        if odds is None and one_tier:
            np.subtract(k_plus_1, rows.survival_asc0.searchsorted(u, side="right"), out=dec)
        elif odds is None:
            # Rows of several tiers: one search in the batch's breakpoints, then each row's count there.
            g = rows.grid.searchsorted(u, side="right")
            g += rows.grid_offsets
            rows.grid_tokens.take(g, out=dec, mode="clip")  # g is in range: clip only skips a buffer
        else:
            # Each row's own survival S_r (the tier's acceptance shifted by the request's log-odds):
            # tokens = 1 + #{i : u < S_r,i}, the same count as the searches above.
            survival_rows = self._request_survival(odds, ids, rows)
            np.add(1, (u[:, :, None] < survival_rows).sum(axis=2), out=dec)
        np.add.accumulate(cz, axis=0, out=cz)  # tokens drawn by the end of each iteration, unclipped
        alive_all = cz < remaining  # [L + 1, B]: row j still running before iteration j (= after j − 1)
        alive_all[0] = True  # every row runs in the first iteration
        alive = alive_all[1:]  # [L, B] still running after iteration j
        alive_before = alive_all[:-1]  # [L, B] rows in iteration j
        emitted_all = np.minimum(cz, remaining, out=cz)  # clipped at each output length
        emitted = emitted_all[1:]  # [L, B] by the end of iteration j
        finish_iter = np.add.reduce(alive, axis=0)  # iteration in which each completes (n_iter: not in this draw)
        active_all = np.add.reduce(alive_all, axis=1)  # [L + 1]
        active_before = active_all[:-1]  # [L] rows in iteration j (all b in the first)
        active_after = active_all[1:]  # [L]
        tokens = np.empty((n_iter, b))  # [L, B] emitted in iteration j
        np.subtract(emitted_all[1:], emitted_all[:-1], out=tokens)
        # Per-iteration window sums (feature layout: see WindowBins) in one product: each sequence's
        # row of tier_weights is [1, 0, 1, d_τ, 0, 0, 0, 0, onehot(τ), d_τ·onehot(τ), 0] for its tier τ.
        features = tokens @ rows.weights  # [L, F]

        n_t = self.bins.n_tiers
        uniform = one_tier or rows.uniform_k
        k_max: np.ndarray | None = None  # [L] draft forwards per iteration (mixed batches only)
        if uniform:
            # Every row at one k: the step's ms and its columns depend on the rows in it alone; read them
            # from the per-row-count table (the product leaves those columns at 0, and 0 + x is x).
            step = settings.step_table(t0, one_tier, self.max_batch)
            dt_ms = step.ms.take(active_before)
            features += step.features.take(active_before, axis=0)
        else:
            # The mixed model (LatencyModel.mixed_coeffs) over the rows each iteration still holds: once
            # the last drafting row is done the step is a plain one, and k_max is the running rows' largest.
            k_max = np.maximum.reduce(alive_before * rows.row_k_float, axis=1)
            drafting_rows = alive_before @ rows.row_drafts
            drafted = alive_before @ rows.row_k_float
            dt_ms = self.latency.speculative_step_ms(active_before, drafted, k_max, drafting_rows)
            plain_steps = k_max == 0
            if plain_steps.any():
                if settings.plain_ms_by_rows is not None:
                    dt_ms[plain_steps] = settings.plain_ms_by_rows.take(active_before[plain_steps])
                else:
                    plain_fixed, plain_per_row = self.latency.plain_coeffs()
                    dt_ms[plain_steps] = plain_fixed + plain_per_row * active_before[plain_steps]
        lag_grows = None
        catch_up_ms = 0.0
        if self._draft_prefill:
            assert ids is not None
            catch_up_ms, drafting_tokens, lag_grows = self._draft_backlog(ids, n_new, rows.row_k)
            dt_ms[off] += catch_up_ms
            if n_new:
                dt_ms[0] = self.latency.prefill_ms(prefill_tokens, drafting_tokens)
        elif n_new:
            dt_ms[0] = self.latency.prefill_ms(prefill_tokens)
        if self._exponential_times:
            draws = self.rng.exponential(1.0, size=n_iter)
            dt_ms *= draws
            catch_up_ms *= float(draws[off])
        if self._varies:
            # Decode iterations by their kind (plain, speculative); a prefill takes the plain factor and no shape
            # (its time does not grow with the batch).
            speculative = (np.full(h, int(rows.row_k[0]) > 0) if uniform
                           else np.asarray(k_max)[off:] > 0)
            if self._row_scale.size:
                scale = np.where(speculative, self._row_scale[1].take(active_before[off:]),
                                 self._row_scale[0].take(active_before[off:]))
                dt_ms[off:] *= scale
                catch_up_ms *= float(scale[0])
            factor = speed[0].copy()
            factor[off:] = np.where(speculative, speed[1, off:], speed[0, off:])
            dt_ms *= factor
            catch_up_ms *= float(factor[off])
        if not uniform or catch_up_ms or self._exponential_times or self._varies:
            # The steps' times as drawn (the table holds the model's); as the engine reports it, the
            # catch-up is not a decode step's time.
            features[:, WindowBins.ITER_MS] = dt_ms
            if catch_up_ms:
                features[off, WindowBins.ITER_MS] -= catch_up_ms
            if uniform and int(rows.row_k[0]) > 0:
                features[:, WindowBins.SPEC_MS] = features[:, WindowBins.ITER_MS]
        if k_max is not None:  # a mixed batch: its step columns, the speculative steps apart
            features[:, WindowBins.SEQ_ITERS] = active_before
            features[:, WindowBins.DRAFTED] = drafted
            features[:, WindowBins.ITERS] = 1.0
            speculative = k_max > 0
            features[:, WindowBins.SPEC_ITERS] = speculative
            features[:, WindowBins.SPEC_MS] = features[:, WindowBins.ITER_MS] * speculative
            features[:, WindowBins.SPEC_ROWS] = active_before * speculative
            features[:, WindowBins.SPEC_DRAFT_FORWARDS] = k_max
            features[:, WindowBins.SPEC_DRAFTED_ROW_FORWARDS] = k_max * drafting_rows
            # Accepted drafts = decode tokens − sequences (one target token each); a sequence's last
            # iteration is clipped at its output length, which undercounts that iteration's accepts.
            # (The step table adds −rows to the tokens the product put in this column: the same value.)
            np.subtract(features[:, 0], active_before, out=features[:, WindowBins.ACCEPTED])
        end_s = np.add.accumulate(dt_ms)
        end_s /= 1000.0
        end_s += now

        # Last iteration that can run: the batch empties, or (someone queued) a slot frees up.
        stop = active_after < (self.batch_limit if queued else 1)
        j = int(stop.argmax())
        length = j + 1 if stop[j] else n_iter

        if not one_tier:
            features[:, _B + 2 * n_t :] = alive_before @ rows.onehot
        distortion_rows = None
        if rows.event_p is not None:
            distortion_rows = self._distortion_events(tokens.astype(np.int64), rows, features)
        if n_new:
            features[0] = 0.0  # the prefill iteration: no tokens, no sequences decoded
            features[0, WindowBins.PREFILL_MS] = dt_ms[0]
        return emitted, finish_iter, active_after, features, end_s, length, distortion_rows, lag_grows

    def _speeds(self, now: float, n_iter: int) -> np.ndarray:
        """[2, n_iter] each iteration's factor on its modelled time were it a plain step (row 0; a prefill too) or a
        speculative one (row 1): the replica's speed × the drift, advanced to ``now`` (an exact Ornstein-Uhlenbeck
        step over the time since the last segment began) × each iteration's jitter, of its kind's spread (one
        normal draw per iteration, which only one kind uses)."""
        factor = self._speed
        sigma = self._drift_sigma
        if sigma > 0:
            rho = math.exp(-max(now - self._drift_at, 0.0) / self._drift_tau_s)
            self._drift_log = rho * self._drift_log + sigma * math.sqrt(1.0 - rho * rho) * float(self.rng.normal())
            self._drift_at = now
            factor *= math.exp(self._drift_log - 0.5 * sigma * sigma)  # mean 1
        out = np.full((2, n_iter), factor)
        jitter, spec_jitter = self._jitter_sigma, self._spec_jitter_sigma
        if jitter > 0 or spec_jitter > 0:
            z = self.rng.normal(size=n_iter)
            out[0] *= np.exp(jitter * z - 0.5 * jitter * jitter)
            if spec_jitter == jitter:
                out[1] = out[0]
            else:
                out[1] *= np.exp(spec_jitter * z - 0.5 * spec_jitter * spec_jitter)
        return out

    @staticmethod
    def _request_survival(odds: np.ndarray, ids: np.ndarray | None, rows: _BatchTables) -> np.ndarray:
        """[B, k_pad] each row's survival: its tier's acceptance shifted by the request's log-odds."""
        assert ids is not None
        row_odds = odds.take(ids) * rows.odds_centring
        return np.asarray(np.multiply.accumulate(shifted_acceptance(rows.accept, row_odds[:, None]), axis=1))

    def _distortion_events(self, tokens: np.ndarray, rows: _BatchTables, features: np.ndarray) -> np.ndarray:
        """Distortion drawn as events per token (the profile's event model): ``[L, B]``, and the window
        columns of it written into ``features``."""
        assert rows.event_p is not None and rows.event_size is not None
        events = self.rng.binomial(tokens, rows.event_p)
        distortion_rows = events * rows.event_size
        n_t = self.bins.n_tiers
        features[:, WindowBins.DISTORTION] = distortion_rows.sum(axis=1)
        features[:, _B + n_t : _B + 2 * n_t] = distortion_rows @ rows.onehot
        return np.asarray(distortion_rows)

    def _draft_backlog(self, ids: np.ndarray, n_new: int, row_k: np.ndarray) -> tuple[float, int, np.ndarray]:
        """The draft's backlog at a segment's start (the first ``n_new`` of ``ids`` join, rows at draft
        lengths ``row_k``): the catch-up ms of its first decode iteration, the prompt tokens of joiners
        the draft prefills (those at k > 0), and the rows whose tokens add to the backlog in it."""
        lag = self.table.draft_lag
        drafting = row_k > 0
        drafting_tokens = 0
        if n_new:
            new_ids = ids[:n_new]
            prompts = self.table.prompt_tokens[new_ids]
            joins_drafting = drafting[:n_new]
            drafting_tokens = int(prompts[joins_drafting].sum())
            lag[new_ids] = np.where(joins_drafting, 0, prompts)
        backlog = lag[ids]
        catch_up_ms = 0.0
        behind = drafting & (backlog > _MAX_PASSIVE_LAG)
        if behind.any():
            # One padded forward over every fed row (drafting ones, and k = 0 ones close enough to be
            # fed in passing) at the longest backlog's width; after it the drafting rows are current.
            fed = drafting | (backlog <= _MAX_PASSIVE_LAG)
            catch_up_ms = self.latency.draft_catch_up_ms(int(fed.sum()) * int(backlog[behind].max()))
            lag[ids[behind]] = 0
            backlog = lag[ids]
        if drafting.any():
            lag_grows = ~drafting & (backlog > _MAX_PASSIVE_LAG)
        else:  # the draft does not run: every row's tokens add to its backlog
            lag_grows = np.ones(ids.size, dtype=bool)
        return catch_up_ms, drafting_tokens, lag_grows

    def truncate(self, now: float, need_room: bool) -> float | None:
        """Cut the segment at the first boundary >= ``now`` (with a free slot if ``need_room``).

        Returns the new end time when it moved (the caller schedules a fresh event), else None.
        """
        seg = self.segment
        if seg is None:
            return None
        length = seg.length
        j = bisect_left(seg.end_s, now)
        if seg.n_new:
            j = max(j, 1)  # prefill + first decode iteration are one engine step
        if j >= length:
            return None
        after = seg.active_after
        if need_room and after[j] >= self.batch_limit:
            # The first boundary with a free slot, if any before the segment ends.
            j = next((i for i in range(j + 1, length) if after[i] < self.batch_limit), length)
            if j == length:
                return None
        if j + 1 == length:
            return None
        self._void_after(seg, j + 1)
        self.version += 1
        return seg.end_s[j]

    def _void_after(self, seg: _Segment, new_length: int) -> None:
        """Take back the iterations [new_length, length) of a drawn segment."""
        old = seg.length
        self.bins.subtract(seg.bins[new_length:old], seg.features[new_length:old])
        if seg.completions:
            kept = [(it, rid) for it, rid in seg.completions if it < new_length]
            if len(kept) < len(seg.completions):
                completion_s = self.table.completion_s
                for it, rid in seg.completions:  # a few: scalar writes beat a fancy-indexed one
                    if it >= new_length:
                        completion_s[rid] = np.nan
                seg.completions = kept
        if new_length < 2 and seg.n_new:  # the joiners' first decode iteration did not happen
            first_token_s = self.table.first_token_s
            for rid in seg.id_list[: seg.n_new]:
                first_token_s[rid] = np.nan
        seg.length = new_length

    def finish_segment(self, settings: DecodeSettings) -> float | None:
        """At the segment's end: fold it into the request table and draw the next one (None = idle)."""
        seg = self.segment
        assert seg is not None
        now = seg.end_s[seg.length - 1]
        self._fold(seg)
        if not self.running and not self.queue:
            self.version += 1
            return None
        return self.start_segment(now, settings)

    def close(self, now: float) -> None:
        """End of simulation: keep only iterations finished by ``now``; the rest never happened."""
        seg = self.segment
        if seg is None:
            return
        j = bisect_right(seg.end_s, now)
        if j < seg.length:
            self._void_after(seg, j)
        self._fold(seg)
        self.version += 1

    def _fold(self, seg: _Segment) -> None:
        n = seg.length
        table = self.table
        if n:
            per_seq = seg.emitted[n - 1]
            per_seq_list: list[int] = per_seq.tolist()
            # A few rows: scalar updates beat fancy-indexed ones (the same IEEE operations, e · d then +).
            emitted, distortion_sum = table.emitted, table.distortion_sum
            if seg.distortion_rows is None:
                for rid, e, d in zip(seg.id_list, per_seq_list, seg.distortion_list, strict=True):
                    emitted[rid] += e
                    distortion_sum[rid] += e * d
            else:
                for rid, e, d in zip(seg.id_list, per_seq_list, seg.distortion_rows[:n].sum(axis=0).tolist(),
                                     strict=True):
                    emitted[rid] += e
                    distortion_sum[rid] += d
            if seg.lag_grows is not None and seg.lag_grows.any():
                assert seg.ids is not None  # drawn with the draft's backlog: the array was built
                table.draft_lag[seg.ids[seg.lag_grows]] += per_seq[seg.lag_grows]
            self.iterations += n - 1 if seg.n_new else n
            finish = seg.finish_iter
            self.running = [rid for rid, f in zip(seg.id_list, finish, strict=True) if f >= n]
            self.remaining = [left - e for left, e, f in zip(seg.remaining, per_seq_list, finish, strict=True)
                              if f >= n]
        else:
            self.running, self.remaining = seg.id_list, seg.remaining
        self.segment = None
