"""One simulated replica: a FIFO queue and a continuously batched FSD decode loop.

Speed is the point of this module. Instead of one event per iteration, a replica draws a *segment*
of iterations at once with numpy — accepted counts for every (iteration, sequence), the batch size of
every iteration as sequences finish, and the iteration end times — and schedules a single event at
the segment's end. A segment ends at the first iteration boundary where something could change: a
queued request can join (room in the batch), every sequence is done, or the segment's horizon. An
arrival or a new threshold *truncates* the segment at the first boundary at or after its time;
draws past the cut are discarded (the RNG is the simulator's, so runs stay deterministic).
A drawn segment writes its consequences at once — first-token and completion times into the request
table, per-iteration sums into the control windows' bins (:class:`sim.entities.WindowBins`) — and a
truncation takes back what it voids. Per-request token and distortion totals are folded in when the
segment ends. So neither a control tick nor routing has to step a replica: its load at time t is one
binary search.

Iteration model (per replica, batch of B sequences, draft length k):
- A prefill iteration when requests join: it takes ``prefill_ms(Σ prompt tokens of the joiners)``,
  running sequences stall, each joiner emits its first token at its end (TTFT).
- A decode iteration takes ``iteration_ms(B, k)``; each sequence emits accepted + 1 tokens, accepted
  drawn from the profile's per-position acceptance at its tier's current T (one uniform per
  sequence: accepted = #{i : u < S_i}, S_i = P(at least i accepted)); a sequence's last iteration is
  clipped at its output length.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

import numpy as np

from sim.entities import RequestTable, WindowBins
from sim.profile import LatencyModel


class ReplicaState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"  # finishes its work, takes no new requests
    STOPPED = "stopped"


@dataclass
class DecodeSettings:
    """What a replica reads from the simulator when it draws a segment (shared, mutated by control)."""

    k: int
    survival_by_tier: np.ndarray  # [n_tiers, k] P(at least i+1 drafts accepted)
    distortion_by_tier: np.ndarray  # [n_tiers] mean TV per emitted decode token
    neg_survival_by_tier: np.ndarray  # [n_tiers, k] −survival (ascending, for searchsorted)
    tier_weights: np.ndarray  # [n_tiers, F] per-tier row of the window-feature product
    iteration_coeffs: tuple[float, float]  # iteration ms = fixed + per_seq · B at the current k


@dataclass
class _Segment:
    ids: np.ndarray  # [B] request ids in the batch (joiners first)
    remaining: np.ndarray  # [B] tokens each still had to emit when the segment started
    end_s: np.ndarray  # [L] absolute end time of each iteration
    tokens: np.ndarray  # [L, B] emitted tokens (clipped; 0 once a sequence is done)
    finish_iter: np.ndarray  # [B] iteration at whose end the sequence completes; > L-1 if not in segment
    finished_by: np.ndarray  # [L] sequences completed by the end of iteration j
    active_after: np.ndarray  # [L] sequences still running after iteration j
    iter_seqs: np.ndarray  # [L] sequences in each decode iteration (0 for the prefill iteration)
    distortion_per_token: np.ndarray  # [B]
    features: np.ndarray  # [L, F] per-iteration window sums (see WindowBins)
    bins: np.ndarray  # [L] window bin of each iteration
    n_new: int  # the first n_new of ids joined in this segment (iteration 0 is their prefill)
    length: int  # iterations in force (truncation lowers it)


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
        self.max_queue = max_queue
        self.table = table
        self.bins = bins
        self.rng = rng
        self.started_s = started_s
        self.ready_s = ready_s
        self.stopped_s: float | None = None
        self.state = ReplicaState.STARTING if ready_s > started_s else ReplicaState.READY
        self.queue: deque[int] = deque()
        self.running = np.empty(0, dtype=np.int64)  # ids in the batch as of the last segment end
        self.remaining = np.empty(0, dtype=np.int64)  # tokens still to emit, aligned with running
        self.segment: _Segment | None = None
        self.version = 0  # bumps whenever the pending segment-end time changes
        self.iterations = 0  # decode iterations run (for the speed benchmark)
        self.horizon_iters = horizon_iters

    # ---------------------------------------------------------------- state

    def load(self, now: float) -> int:
        """Requests in flight here at ``now`` (running + queued)."""
        seg = self.segment
        if seg is None:
            return int(self.running.size) + len(self.queue)
        j = int(seg.end_s[: seg.length].searchsorted(now, side="right"))
        done = int(seg.finished_by[j - 1]) if j else 0
        return int(seg.ids.size) - done + len(self.queue)

    # ---------------------------------------------------------------- segments

    def start_segment(self, now: float, settings: DecodeSettings) -> float | None:
        """Admit from the queue and draw the next segment; returns its end time (None when idle)."""
        table = self.table
        new: list[int] = []
        room = self.max_batch - int(self.running.size)
        while self.queue and room > 0:
            new.append(self.queue.popleft())
            room -= 1
        if not new and self.running.size == 0:
            self.segment = None
            return None
        n_new = len(new)
        if n_new:
            new_ids = np.asarray(new, dtype=np.int64)
            table.start_s[new_ids] = now
            ids = np.concatenate([new_ids, self.running])
            remaining = np.concatenate([table.output_tokens[new_ids], self.remaining])
        else:
            ids, remaining = self.running, self.remaining
        b = ids.size
        tiers = table.tier[ids]

        # Horizon: enough decode iterations for the shortest sequence if someone waits for a slot,
        # otherwise for the longest one; capped (the segment just continues in a fresh draw).
        decode_remaining = remaining - 1 if n_new == b else remaining.copy()
        if n_new < b:
            decode_remaining[:n_new] -= 1  # joiners get their first token from the prefill
        need = int(decode_remaining.min()) if self.queue else int(decode_remaining.max())
        h = max(1, min(need, self.horizon_iters))

        # accepted = #{i : u < S_i} with S_i = P(at least i+1 accepted), non-increasing in i: an exact
        # draw of the accepted count from one uniform, as a binary search in -S (ascending).
        u = self.rng.random((h, b))
        neg_survival = settings.neg_survival_by_tier
        t0 = int(tiers[0])
        if b == 1 or bool((tiers == t0).all()):
            accepted = neg_survival[t0].searchsorted(-u)
        else:
            accepted = np.empty((h, b), dtype=np.int64)
            for t in np.unique(tiers).tolist():
                cols = tiers == t
                accepted[:, cols] = neg_survival[t].searchsorted(-u[:, cols])
        off = 1 if n_new else 0  # row 0 is the joiners' prefill
        n_iter = h + off
        raw = np.empty((n_iter, b), dtype=np.int64)
        if n_new:
            raw[0] = 0
            raw[0, :n_new] = 1
        np.add(accepted, 1, out=raw[off:])
        cum = raw.cumsum(axis=0)
        capped = np.minimum(cum, remaining)
        tokens = capped.copy()  # [L, B]
        tokens[1:] -= capped[:-1]
        # Index of the iteration in which each sequence completes (n_iter: not within this draw).
        finish_iter = (cum < remaining).sum(axis=0)
        finished_by = np.bincount(finish_iter, minlength=n_iter + 1)[:n_iter].cumsum()
        active_after = b - finished_by  # [L]
        active_before = np.empty(n_iter, dtype=np.int64)
        active_before[0] = b
        active_before[1:] = active_after[:-1]

        fixed_ms, per_seq_ms = settings.iteration_coeffs
        dt_ms = fixed_ms + per_seq_ms * active_before
        if n_new:
            dt_ms[0] = self.latency.prefill_ms(int(table.prompt_tokens[new_ids].sum()))
        if self.latency.iteration_time_dist == "exponential":
            dt_ms = dt_ms * self.rng.exponential(1.0, size=n_iter)
        end_s = now + dt_ms.cumsum() / 1000.0

        # Last iteration that can run: the batch empties, or (someone queued) a slot frees up.
        length = n_iter if active_before[-1] else int(np.argmin(active_before))
        if self.queue:
            room_at = np.flatnonzero(active_after[:length] < self.max_batch)
            if room_at.size:
                length = int(room_at[0]) + 1

        # Per-iteration window sums (feature layout: see WindowBins) in one product: each sequence's
        # row of tier_weights is [1, 0, 0, d_τ, onehot(τ), d_τ·onehot(τ)] for its tier τ.
        features = tokens.astype(np.float64) @ settings.tier_weights[tiers]  # [L, F]
        features[:, 1] = active_before
        # Accepted drafts = decode tokens − sequences (one target token each); a sequence's last
        # iteration is clipped at its output length, which undercounts that iteration's accepts.
        np.subtract(features[:, 0], active_before, out=features[:, 2])
        if n_new:
            features[0, 1:4] = 0.0  # the prefill iteration: first tokens only, target-sampled
            features[0, 4 + self.bins.n_tiers :] = 0.0
        bins = self.bins.bin_of(end_s)
        self.bins.add(bins[:length], features[:length])
        dpt = settings.distortion_by_tier[tiers]

        if n_new:
            table.first_token_s[new_ids] = end_s[0]
        fin = finish_iter < length
        if fin.any():
            done_ids = ids[fin]
            table.completion_s[done_ids] = end_s[finish_iter[fin]]
            add = self.bins.add_completion
            for rid, w in zip(done_ids.tolist(), bins[finish_iter[fin]].tolist(), strict=True):
                add(w, rid)

        self.running, self.remaining = ids, remaining
        self.segment = _Segment(
            ids=ids,
            remaining=remaining,
            end_s=end_s,
            tokens=tokens,
            finish_iter=finish_iter,
            finished_by=finished_by,
            active_after=active_after,
            iter_seqs=features[:, 1],
            distortion_per_token=dpt,
            features=features,
            bins=bins,
            n_new=n_new,
            length=length,
        )
        self.version += 1
        return float(end_s[length - 1])

    def truncate(self, now: float, need_room: bool) -> float | None:
        """Cut the segment at the first boundary >= ``now`` (with a free slot if ``need_room``).

        Returns the new end time when it moved (the caller schedules a fresh event), else None.
        """
        seg = self.segment
        if seg is None:
            return None
        j = int(seg.end_s[: seg.length].searchsorted(now, side="left"))
        if j >= seg.length:
            return None
        if need_room:
            room = np.flatnonzero(seg.active_after[j : seg.length] < self.max_batch)
            if room.size == 0:
                return None
            j += int(room[0])
        if j + 1 == seg.length:
            return None
        self._void_after(seg, j + 1)
        self.version += 1
        return float(seg.end_s[j])

    def _void_after(self, seg: _Segment, new_length: int) -> None:
        """Take back the iterations [new_length, length) of a drawn segment."""
        old = seg.length
        self.bins.add(seg.bins[new_length:old], seg.features[new_length:old], sign=-1.0)
        voided = (seg.finish_iter >= new_length) & (seg.finish_iter < old)
        if voided.any():
            self.table.completion_s[seg.ids[voided]] = np.nan
        if new_length == 0 and seg.n_new:
            self.table.first_token_s[seg.ids[: seg.n_new]] = np.nan
        seg.length = new_length

    def finish_segment(self, settings: DecodeSettings) -> float | None:
        """At the segment's end: fold it into the request table and draw the next one (None = idle)."""
        seg = self.segment
        assert seg is not None
        now = float(seg.end_s[seg.length - 1])
        self._fold(seg)
        if self.running.size == 0 and not self.queue:
            self.version += 1
            return None
        return self.start_segment(now, settings)

    def close(self, now: float) -> None:
        """End of simulation: keep only iterations finished by ``now``; the rest never happened."""
        seg = self.segment
        if seg is None:
            return
        j = int(seg.end_s[: seg.length].searchsorted(now, side="right"))
        if j < seg.length:
            self._void_after(seg, j)
        self._fold(seg)
        self.version += 1

    def _fold(self, seg: _Segment) -> None:
        n = seg.length
        table = self.table
        per_seq = seg.tokens[:n].sum(axis=0)
        decode = per_seq - seg.tokens[0] if (seg.n_new and n) else per_seq
        table.emitted[seg.ids] += per_seq
        table.distortion_sum[seg.ids] += decode * seg.distortion_per_token
        self.iterations += int(np.count_nonzero(seg.iter_seqs[:n]))
        keep = seg.finish_iter >= n
        self.running = seg.ids[keep]
        self.remaining = (seg.remaining - per_seq)[keep]
        self.segment = None
