"""Model-predictive SLO control of (T, k) per tier: the shipped default policy (``"slo"``).

Each control window the policy predicts, for every joint candidate of (T, k) per tier, each tier's
TPOT and TTFT at the load it measures, and picks the candidate the objective in :mod:`policies.slo`
prefers. The model is plain data (:class:`OperatingModel`, built from a simulator/calibration profile
by ``sim.profile.Profile.to_operating_model``), corrected online; the safety margin between a mean
prediction and a percentile target is learned from measured attainment (the outer loop), not set by
hand.

**Prediction** for a candidate (one (T_τ, k_τ) per tier τ):

* tokens per sequence per step ``n_τ = 1 + E[accepted]`` at (T_τ, k_τ) from the model (1 at k = 0),
  read at the planned batch B when the model has tokens per batch size (a draft whose acceptance
  depends on its neighbours in the batch, as torch's per-tensor int8 dynamic draft does; the batch
  and n then solve Little's law together, by two fixed-point passes), times an online correction
  ``a_τ`` = EWMA of measured / modelled (at the window's mean batch) accepted drafts per step;
* one step over the running batch (tier shares ``s_τ`` of the running rows, measured):
  ``step = c · (fixed(k_max) + B · Σ s_τ · per_row(k_τ, k_max))`` — the draft model runs k_max steps
  over the drafting rows, verify is as wide as each row's k (the simulator's mixed-batch model) —
  with ``c`` = measured / modelled step time (fixed and per-row parts apart), one fit for plain steps
  (every active tier at k = 0) and one per k_max for speculative steps, each learned from the steps
  that ran it (a k_max never run borrows the nearest one's);
* the batch ``B`` at the candidate's speed from Little's law on the measured arrival rate λ per
  replica and mean output length L: ``B = λ·L·TPOT(B)`` solved in closed form (step time is linear in
  B), planned at its upper quantile ``B̄ + z·sqrt(B̄)`` (a request lives through the batch's Poisson
  fluctuations); at least the running batch measured now; no solution below ``max_batch`` ⇒ the
  candidate is overloaded (queue grows; TTFT unbounded). Where the model has the draft's catch-up, at least
  the recent peak rows plus Little's batch (the look-ahead), and a candidate *meets* only if it meets with
  that Little batch at the Poisson upper bound of the recent arrivals (``rate_z``; ranked at λ);
* ``TPOT_τ = step / n_τ / (1 − λ·prefill)`` (joiners' prefills stall the batch), ``prefill`` the
  measured prefill wall time per admitted request (``Telemetry.prefill_ms`` over admissions, decayed
  sums; joiners admitted together share a prefill), scaled by the model's prefill at the candidate's
  draft lengths over that at the ones in force (a join at k = 0 skips the draft's prefill, when the
  model measures it apart); a candidate that makes a tier running at k = 0 draft adds the draft's
  catch-up over the running rows' backlog (prompt, backed out of the measured prefill, plus half the
  mean output), spread over a request's output tokens;
  ``TTFT_τ = wait + step + prefill_τ`` where ``wait`` drains the queue ahead
  at the candidate's request rate and ``prefill_τ`` is learned (EWMA of measured p50 TTFT minus the
  predicted wait and step, from requests that never saw a queue, starting from the model's prefill of
  ``prompt_tokens``; also the stall's prefill until one is measured);
* distortion ``d_τ`` from the model at (T_τ, k_τ) times an online correction (measured / modelled).

**Outer loop on attainment**: predictions are means; a tier's targets are met when ``m_τ · TPOT_τ <=
tpot target`` and ``m_τ · TTFT_τ <= ttft target``. The margin ``m_τ`` rises when a window's measured
attainment falls below the tier's target (``percentile / 100``) and decays slowly while it is above:
``m ← m · exp(g · (target − attainment))`` with ``g = margin_gain_up`` or ``margin_gain_down``.

**Evidence beats prediction**: a tier whose measured attainment (EWMA over pooled completions) is
``short_enter`` below its target counts as not meeting, whatever the prediction says, so it is served
at the fastest point within budget (the objective's "most attainment within budget": its budget
itself, the ``budget_margin`` cushion spent) until it is back within ``short_exit`` of its target.

**Choice** (the objective, with tier coupling): among candidates where every tier with traffic and a
latency target is predicted to meet it and every tier is within budget (``budget_margin`` below it):
least distortion of the tightest-budget tier first, then the next (so the loosest budget spends
first), then the best-effort tiers' TPOT (tiers without a latency target still want speed), then
least cost (step ms per output token). Where none is feasible: within budget, the most traffic share
predicted to meet its targets, then the smallest share-weighted violation, then the best-effort TPOT,
then the least cost (which lets the loose tiers spend budget on capacity), then least distortion. Tiers without traffic get their least-distortion T and the k of the busiest
tier (they must not widen the batch's draft). A choice that meets and gives a tier less distortion than its
point in force waits ``relax_delay_s`` (every decision over it wanting less) where a choice at least as
distorting meets too: a request's TPOT is its mean over its life, so a dip for a window is paid by every
request decoding through it.

**Replicas (the hand-off to the autoscaler)**: with ``max_replicas`` set the policy also emits
``Decision.replicas``: the fewest replicas in ``[min_replicas, max_replicas]`` at which the tiers'
least-distortion candidates (every tier at its least modelled distortion, any k) are predicted to meet
every latency target at the measured total arrival rate spread over them (steady state: no queue,
the same model, corrections and margins as the (T, k) choice). The objective orders distortion
before cost, so capacity is what buys distortion back. A count below the one emitted last must fit
``scale_down_slack`` more load (hysteresis). The (T, k) choice plans at the replicas *serving* now
(``Telemetry.replicas``; the rate per replica is the fleet's remembered rate over them): while new
replicas start the fleet is short, so T and k absorb the burst within budget; once they serve the load
per replica falls and T falls back. The owner applies the count with its own delays and bounds (the
simulator's autoscaler; live, Ray Serve's autoscaler through ``controller.autoscaling``).

The policy never reads a clock; time and every measurement come in the :class:`Telemetry`.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, NamedTuple

import numpy as np

from policies.decision import Decision
from policies.operating_model import DEFAULT_MODEL_PATH, OperatingModel, speculative_step_line
from policies.ranking import anchored_z, lexmin, normal_cdf, row_sums, weighted_column_sums
from policies.slo import SLOSpec, TierSLO, tiers_by_budget
from policies.step_correction import BatchStepCorrection, StepCorrection, corrected_step_line
from policies.telemetry import StepTotals, Telemetry


def _batch_bracket(batch: np.ndarray, n_b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For (fractional) batch sizes, clipped to [1, n_b]: the 0-based indices of the integer sizes
    either side and the weight of the upper one (linear interpolation between them)."""
    b = np.clip(batch, 1.0, float(n_b)) - 1.0
    lo = np.floor(b).astype(np.int64)
    return lo, np.minimum(lo + 1, n_b - 1), b - lo


def _ewma(old: float, new: float, alpha: float) -> float:
    if not math.isfinite(new):
        return old
    return new if not math.isfinite(old) else alpha * new + (1.0 - alpha) * old


#: Steps in a joiner's TTFT besides its wait for a slot: the rest of the step running when it arrives (half
#: a step on average: steps are admission points) and the decode step its prefill is fused with.
_TTFT_STEPS = 1.5
#: How step-time fits correct the model: "line" (StepCorrection, fixed and per-row parts) or "batch"
#: (BatchStepCorrection, a ratio per batch size).
_STEP_FITS = frozenset({"line", "batch"})
_ONE_ROW = np.ones(1)  # where a line's factors are read: the same at every batch
_Z95 = 1.6448536269514722  # the standard normal's 95th percentile


@dataclass(frozen=True, slots=True)
class _Candidates:
    """Per tier: candidate (T, k) with modelled tokens per step and distortion."""

    thresholds: np.ndarray  # [n]
    ks: np.ndarray  # [n] int
    tokens: np.ndarray  # [n]
    distortion: np.ndarray  # [n]
    tokens_by_batch: np.ndarray | None  # [n, batch sizes] (None: no batch dependence)
    hard_share: np.ndarray | None = None  # [n] a hard request's accepted drafts per step / the mean's (None: not modelled)


@dataclass(frozen=True, slots=True)
class _Universe:
    """Joint candidates (one (T, k) per tier; inactive tiers: k 0, T 0, 1 token, no distortion) and the
    parts of their evaluation that do not change between windows. Arrays are [candidates, tiers]
    unless noted."""

    ks: np.ndarray  # int
    thresholds: np.ndarray
    tokens_minus_1: np.ndarray  # modelled accepted drafts per step
    tokens_minus_1_by_batch: np.ndarray | None  # [batch sizes, candidates, tiers] (None: no batch dependence)
    ks_plus_1: np.ndarray  # the most tokens a step can emit (float)
    base_distortion: np.ndarray  # modelled, before the online correction
    per_row: np.ndarray  # step ms per row of each tier (mixed-batch model at the candidate's k_max)
    fixed: np.ndarray  # [candidates] step ms independent of the batch
    k_max: np.ndarray  # [candidates] int: the draft steps of the candidate's step (0: a plain step)
    plain: np.ndarray  # [candidates] bool: every active tier at k = 0 (a plain step)
    hard_share: np.ndarray | None  # [candidates, tiers] see _Candidates.hard_share (None: not modelled)
    # Derived from the fields above once instead of every tick (speed only):
    k_max_keys: np.ndarray  # np.unique(k_max)
    k_max_at: np.ndarray  # [candidates] np.searchsorted(k_max_keys, k_max)
    drafts: np.ndarray  # (ks > 0) as floats (0.0 / 1.0: the same products with the shares as the bools)
    # Per active tier (in act_idx order), the (k, T) of its candidates in the product's order: a joint
    # candidate's index is the mixed-radix number of its per-tier positions (itertools.product order).
    tier_points: tuple[tuple[tuple[int, float], ...], ...]


class _Prediction(NamedTuple):
    """What :meth:`ModelPredictivePolicy.decide` predicts for every joint candidate at one planned load."""

    batch: np.ndarray  # [candidates] rows planned per replica
    step: np.ndarray  # [candidates] step ms
    tokens: np.ndarray  # [candidates, tiers] tokens per row-step
    mean_tokens: np.ndarray  # [candidates] by tier share
    tpot: np.ndarray  # [candidates, tiers] ms
    tpot_ranked: np.ndarray  # tpot with the switch margin
    wait: np.ndarray  # [candidates] queue wait ms
    cost: np.ndarray  # [candidates] ms of replica time per output token (switch margin included)
    ratios: dict[int, list[tuple[str, np.ndarray]]]  # per active tier: (metric, prediction × margin / target)
    meets: np.ndarray  # [candidates, tiers] bool
    cap: np.ndarray  # [candidates] the batch cap planned (0: none)


class ModelPredictivePolicy:
    """See the module docstring. Parameters:

    * ``model`` — the :class:`OperatingModel` (None ⇒ the shipped default pair's, ``DEFAULT_MODEL_PATH``).
    * ``max_batch`` — sequences per replica batch (the data plane's limit; for the Little's-law batch).
    * ``prompt_tokens`` — typical prompt length for the initial prefill estimate (corrected online).
    * ``initial_margin``, ``margin_gain_up``, ``margin_gain_down``, ``margin_limits`` — the outer loop.
    * ``budget_margin`` — plan to at most ``(1 − budget_margin) · budget`` (the QualityGuard is the hard
      stop); a tier measured short plans to its budget itself.
    * ``alpha`` — EWMA weight of the newest window in the model corrections and tier shares.
    * ``rate_decay`` — per-window decay of the sums behind the arrival rate and mean output length.
    * ``step_decay`` — per-window decay of the step-time fits (:class:`StepCorrection`).
    * ``step_slope_prior`` — the spread of the fits' prior on how their correction changes with the batch
      (:class:`StepCorrection`'s ``slope_prior``): smaller trusts one ratio for every batch until windows far
      apart in batch show otherwise. 0.05 (session 37): the plain fit's slope learned on a light phase's one- and
      two-row windows is noise that priced plain decoding too slow at a cluster's three or four rows.
    * ``draft_slope_prior`` — the same for the fits of speculative steps alone (None: ``step_slope_prior``);
      1.5, the prior every fit had before session 37.
    * ``draft_prior`` — what speculative steps are predicted at before any has been measured: ``"model"`` (the
      profile's step) or ``"plain"`` (the plain steps' measured correction: the machine runs both models, and its
      state moves both). Session 36: on the first speculative window of 34 live runs (seeds 37–54,
      ``benchmarks/step_ratios.py --first-speculative``) the model's step missed by 0.137 (mean |log|, 12 % optimistic
      on average), the plain fit by 0.073. Out of sample (live seed 55) the plain fit's light-phase slope (per row
      2.8–3.0) priced speculative steps far too high and it lost: off.
    * ``switch_margin`` — a candidate of the other kind of step than the one in force (plain ↔
      speculative) is ranked as if its steps took this much longer: a switch must pay by more than the
      fits' noise (each kind is corrected from its own few windows), or k flips back and forth.
    * ``probe_after`` — windows without evidence on a kind of step after which, while a tier is
      measured short, that kind is predicted optimistically (:meth:`_probing`).
    * ``probe_hold_ticks`` — a probe that switched the kind of step holds it (where nothing is predicted to meet)
      until a window of that kind is measured, for at most this many ticks (0: off, the default). Its first window
      is read two ticks on: the decision takes effect at the next report, and the window that report seals ran the
      kind before; 3 covers that and a window with no step of it. Without it 29 of the 42 probes that switched the
      kind in the live step loads of seeds 37-82 were undone at the next tick, having measured nothing. Off by
      default: at 3 it moved nothing measurable (session 44: replays of live seeds 67-80 at their lag, 4 reports up
      and 8 down, mean -0.001 attainment; three sets of 60 seeds of the twin with the lag, -0.004 to -0.001, held 54
      against 55; the held-out and tuning sets unchanged to the digit). Holding a wrong probe costs its slower steps.
    * ``min_samples`` — completions pooled (over windows) before their attainment moves the margin.
    * ``batch_z`` — plan for the batch's upper quantile ``B̄ + z·sqrt(B̄)`` (Poisson occupancy).
    * ``short_enter`` / ``short_exit`` — a tier whose measured attainment (EWMA over pooled samples)
      falls ``short_enter`` below its target is planned as short — the fastest point within budget,
      whatever the prediction says — until it is back within ``short_exit`` of it.
    * ``t_grid`` — extra T values considered per k besides the model's own points.
    * ``min_replicas`` / ``max_replicas`` — bounds of the replica count it asks for (``max_replicas``
      None: it asks for none, ``Decision.replicas`` stays None); ``scale_down_slack`` — a lower count
      must fit this much more load than the measured rate before it is asked for.
    * ``look_ahead_windows`` — where the model has the draft's catch-up, every candidate is planned for at least
      the most rows a replica held over this many windows plus its Little batch (0: the rows running now).
    * ``rate_z`` — with the look-ahead, a candidate meets only if it meets at the rate the last
      ``look_ahead_windows`` windows' arrivals allow at this many standard deviations (the Poisson upper
      bound); where none does, the most attainment at the measured rate (0: off).
    * ``best_effort_relax_s`` — where no candidate is predicted to meet ("best effort"), a tier also moves to a point of
      less modelled distortion than the one in force only once every best-effort decision over this many seconds
      wanted it (0: at once; the default since session 45, 20 s). In a burst the rows dip between clusters of
      arrivals; relaxed to plain decoding in a dip, the tier takes the next cluster at plain steps, whose time grows
      with the batch where a speculative step's hardly does, and the backlog it builds is then served at more rows
      (session 45, docs/figures.md: in the simulator twin of the live step load the policy without it ran plain
      decoding in 56-68 % of the high phase's windows after its first quarter; with it, +0.025 ± 0.019 attainment
      over 180 seeds, +0.018 ± 0.024 over the 120 it was not chosen on; held-out sets level).
    * ``higher_t_ties`` — where no candidate is predicted to meet, candidates the model cannot tell apart (every key
      of the ranking equal as it rounds them, distortion included) go to the higher T instead of the lower (off: the
      lower). A profile measured from a few hundred drafts reads every position accepted at several thresholds (the
      shipped smollm2 profile: T = 2, 4 and 8 at k = 6), and acceptance only rises with T: where speed is what is
      ranked, the higher T of a tie accepts at least as much (live, T = 4, k = 6 steps carried 3 % more tokens than
      T = 2's at 1 % more distortion; session 45). Where a candidate meets, distortion is what is ranked, and a tie
      still goes to the lower T.
    * ``batch_cap`` — also cap the batch (``Decision.batch_cap``): every candidate is planned with a cap at
      the most rows where it meets every TPOT target, where its load is below ``cap_utilisation`` of what
      those rows serve; a planned batch above the cap is judged at the cap, its queue drained at the capped
      rows' rate (TTFT). The cap is emitted only where every target is predicted met.
    * ``rate_prior_s`` — the arrival rate is read over at least this many seconds from the start (0: from
      the first window on). Keep it below the rate's memory (``window_s / (1 − rate_decay)``, 33 s at 1 s
      windows): the decayed time sum never grows past that, and above it the rate would read low throughout.
    * ``queue_joins`` — plan every candidate for at least the rows running plus the requests queued where the
      batch has room (they join at the next step), not the rows running alone (the default since session 31: on
      seed 37's recorded windows it leaves plain decoding at the burst's first cluster in every round, and it held
      live seed 39 where the rows-running policy did not; the held-out sets 15 / 16).
    * ``rate_rise_decay`` — a second, shorter memory of the arrival rate (per-window decay; 0: off): the rate is
      the larger of the two, so it rises within a few windows of a burst's onset and falls over ``rate_decay``'s
      (session 31: on seed 37's recorded windows, 0.85 leaves plain decoding at the burst's first cluster 6 s
      sooner; it also reads a light phase's clusters, so it drafts more where plain decoding meets).
    * ``relax_delay_s`` — a tier moves to a point of less modelled distortion than the one in force (a lower T,
      a shorter k, plain decoding) to save distortion (every target predicted met) only once every decision over this
      many seconds wanted it, and where the point in force, or another as distorting, is predicted to meet too (0: at
      once; the default since session 34, 4 s, is about the life of a 48-token request on the default pair). A
      request's TPOT is its mean over its life: a point relaxed for a window or two while the rows dip is paid by
      every request decoding through it (session 34: 29 of the 50 misses of the shipped policy's live step-load
      runs, seeds 37–48, lived through such a drop). More distortion is taken at once (cf. Ray Serve's
      ``upscale_delay_s`` / ``downscale_delay_s``).
    * ``stall_windows`` — the joiners' prefill stall is planned at no less than the share of the replicas' time the
      last this many windows spent prefilling (0: off; the stall is then λ × the measured prefill per admission
      alone). The requests in flight pay the stall of the admissions around them; at a burst's onset the decayed
      rate still reads the light phase (session 35: on live seed 52 the joiners' prefills took 17–32 % of each
      window after the switch, planned at a few per cent). A measured share, causal, no forecast.
    * ``hard_requests`` — a TPOT target is met where the request at the tier's attainment quantile of per-request
      acceptance meets it (the operating model's ``tokens_per_step_by_quantile``, from the profile's measured
      spread κ), not where the mean request does: every request's TPOT is its own mean, and at a low T the hardest
      5 % draft at 60 % of the mean's tokens (T = 0, k = 6 on the default pair: 2.9 against 4.5), so a point the
      mean request meets at can miss the tier's p95. Off by default: on the simulated live machine it gained 1.4 to
      2.0 points of attainment over three sets of 60 seeds, but that machine's per-request spread is the very κ it
      reads; live it lost both seeds it ran on (67, 68: −0.038 and −0.069 against the mean request), and the live
      requests' spread is narrower than κ's at T = 0 and wider at T ≥ 1 (session 40). No effect where the model has
      no spread (the hand-made profile).
    """

    name = "mpc"

    def __init__(
        self,
        slo: SLOSpec,
        model: OperatingModel | None = None,
        max_batch: int = 8,
        prompt_tokens: float = 200.0,
        initial_margin: float = 1.7,
        margin_gain_up: float = 0.6,
        margin_gain_down: float = 0.1,
        margin_limits: tuple[float, float] = (1.0, 4.0),
        budget_margin: float = 0.1,
        alpha: float = 0.3,
        rate_decay: float = 0.97,
        step_decay: float = 0.9,
        step_slope_prior: float = 0.05,
        draft_slope_prior: float | None = 1.5,
        draft_prior: str = "model",
        switch_margin: float = 0.1,
        probe_after: int = 30,
        probe_hold_ticks: int = 0,
        min_samples: int = 5,
        batch_z: float = 1.65,
        short_enter: float = 0.05,
        short_exit: float = 0.02,
        t_grid: Sequence[float] = (),
        min_replicas: int = 1,
        max_replicas: int | None = None,
        scale_down_slack: float = 0.15,
        spread_prior: float = 0.3,
        look_ahead_windows: int = 10,
        rate_z: float = 2.0,
        best_effort_relax_s: float = 20.0,
        higher_t_ties: bool = False,
        batch_cap: bool = False,
        cap_utilisation: float = 0.85,
        rate_prior_s: float = 0.0,
        rate_rise_decay: float = 0.0,
        queue_joins: bool = True,
        step_fit: str = "line",
        relax_delay_s: float = 4.0,
        stall_windows: int = 0,
        hard_requests: bool = False,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        low, high = margin_limits
        if not (1.0 <= low <= initial_margin <= high and math.isfinite(high)):
            raise ValueError(f"margin_limits {margin_limits} must hold initial_margin {initial_margin}, low >= 1")
        for label, value in (("margin_gain_up", margin_gain_up), ("margin_gain_down", margin_gain_down),
                             ("prompt_tokens", prompt_tokens)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{label} must be finite and >= 0, got {value}")
        if not (0 <= budget_margin < 1):
            raise ValueError(f"budget_margin must be in [0, 1), got {budget_margin}")
        if not (0 < alpha <= 1):
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not (0 <= rate_decay < 1):
            raise ValueError(f"rate_decay must be in [0, 1), got {rate_decay}")
        self.rate_decay = rate_decay
        if not (0 <= step_decay < 1):
            raise ValueError(f"step_decay must be in [0, 1), got {step_decay}")
        self.step_decay = step_decay
        if not (math.isfinite(step_slope_prior) and step_slope_prior > 0):
            raise ValueError(f"step_slope_prior must be finite and > 0, got {step_slope_prior}")
        self.step_slope_prior = step_slope_prior
        if draft_slope_prior is not None and not (math.isfinite(draft_slope_prior) and draft_slope_prior > 0):
            raise ValueError(f"draft_slope_prior must be finite and > 0 or None, got {draft_slope_prior}")
        self.draft_slope_prior = draft_slope_prior
        if draft_prior not in ("model", "plain"):
            raise ValueError(f"draft_prior must be 'model' or 'plain', got {draft_prior!r}")
        self.draft_prior = draft_prior
        if step_fit not in _STEP_FITS:
            raise ValueError(f"step_fit must be one of {sorted(_STEP_FITS)}, got {step_fit!r}")
        self.step_fit = step_fit
        if not (math.isfinite(switch_margin) and switch_margin >= 0):
            raise ValueError(f"switch_margin must be finite and >= 0, got {switch_margin}")
        self.switch_margin = switch_margin
        if probe_after < 1:
            raise ValueError(f"probe_after must be >= 1, got {probe_after}")
        self.probe_after = probe_after
        if probe_hold_ticks < 0:
            raise ValueError(f"probe_hold_ticks must be >= 0, got {probe_hold_ticks}")
        self.probe_hold_ticks = probe_hold_ticks
        if not (math.isfinite(batch_z) and batch_z >= 0):
            raise ValueError(f"batch_z must be finite and >= 0, got {batch_z}")
        self.batch_z = batch_z
        if not (0 <= short_exit <= short_enter <= 1):
            raise ValueError(f"need 0 <= short_exit <= short_enter <= 1, got {short_exit}, {short_enter}")
        self.short_enter, self.short_exit = short_enter, short_exit
        if min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples}")
        if not (math.isfinite(spread_prior) and spread_prior > 0):
            raise ValueError(f"spread_prior must be finite and > 0, got {spread_prior}")
        self.spread_prior = spread_prior
        if look_ahead_windows < 0:
            raise ValueError(f"look_ahead_windows must be >= 0, got {look_ahead_windows}")
        self.look_ahead_windows = look_ahead_windows
        if not (math.isfinite(rate_z) and rate_z >= 0):
            raise ValueError(f"rate_z must be finite and >= 0, got {rate_z}")
        self.rate_z = rate_z
        if not (math.isfinite(best_effort_relax_s) and best_effort_relax_s >= 0):
            raise ValueError(f"best_effort_relax_s must be finite and >= 0, got {best_effort_relax_s}")
        self.best_effort_relax_s = best_effort_relax_s
        self.higher_t_ties = higher_t_ties
        if not (0 < cap_utilisation < 1):
            raise ValueError(f"cap_utilisation must be in (0, 1), got {cap_utilisation}")
        self.batch_cap, self.cap_utilisation = bool(batch_cap), cap_utilisation
        if not (math.isfinite(rate_prior_s) and rate_prior_s >= 0):
            raise ValueError(f"rate_prior_s must be finite and >= 0, got {rate_prior_s}")
        self.rate_prior_s = rate_prior_s
        if not (0 <= rate_rise_decay < 1):
            raise ValueError(f"rate_rise_decay must be in [0, 1), got {rate_rise_decay}")
        self.rate_rise_decay = rate_rise_decay
        self.queue_joins = queue_joins
        if not (math.isfinite(relax_delay_s) and relax_delay_s >= 0):
            raise ValueError(f"relax_delay_s must be finite and >= 0, got {relax_delay_s}")
        self.relax_delay_s = relax_delay_s
        if isinstance(stall_windows, bool) or not isinstance(stall_windows, int) or stall_windows < 0:
            raise ValueError(f"stall_windows must be an int >= 0, got {stall_windows!r}")
        self.stall_windows = stall_windows
        if min_replicas < 1:
            raise ValueError(f"min_replicas must be >= 1, got {min_replicas}")
        if max_replicas is not None and max_replicas < min_replicas:
            raise ValueError(f"max_replicas {max_replicas} must be >= min_replicas {min_replicas}")
        if not (math.isfinite(scale_down_slack) and scale_down_slack >= 0):
            raise ValueError(f"scale_down_slack must be finite and >= 0, got {scale_down_slack}")
        self.min_replicas, self.max_replicas, self.scale_down_slack = min_replicas, max_replicas, scale_down_slack
        self.min_observed_s = 10.0  # seconds of windows before the arrival rate sizes the fleet
        self.slo = slo
        self.model = model if model is not None else OperatingModel.load(DEFAULT_MODEL_PATH)
        self.max_batch, self.prompt_tokens = max_batch, prompt_tokens
        self.initial_margin, self.margin_limits = initial_margin, (low, high)
        self.margin_gain_up, self.margin_gain_down = margin_gain_up, margin_gain_down
        self.budget_margin, self.alpha, self.min_samples = budget_margin, alpha, min_samples
        self.t_grid = tuple(float(t) for t in t_grid)
        self.tier_names = list(slo.tiers)
        # The normal quantile of each tier's attainment target: a prediction at the target (margin
        # included) is the target share of requests meeting it (see decide's best-effort objective).
        self._attainment_z = {name: NormalDist().inv_cdf(min(max(slo.tiers[name].attainment_target, 0.5), 0.999))
                              for name in self.tier_names}
        self._curves = {k: self.model.curve(k) for k in self.model.draft_lengths}  # per tick in _observe
        self._batch_curves = {k: self.model.batch_curve(k) for k in self.model.draft_lengths}
        self.hard_requests = hard_requests
        self._candidates = {name: self._tier_candidates(slo.tiers[name]) for name in self.tier_names}
        # Each tier's modelled distortion by (k, T) point: the point in force's, for relax_delay_s.
        self._point_distortion = {
            name: {(int(k), float(t)): float(d) for k, t, d in zip(c.ks, c.thresholds, c.distortion, strict=True)}
            for name, c in self._candidates.items()}
        # Evaluate only the within-budget product (see decide); False evaluates every joint candidate
        # (the reference the tests compare the pruning against).
        self._prune_by_budget = True
        self._universe_cache: dict[tuple[tuple[int, ...], tuple[tuple[int, ...], ...] | None], _Universe] = {}
        # Tightest budget first: its distortion is minimised first, so the loosest spends first.
        self._distortion_order = [self.tier_names.index(n) for n in reversed(tiers_by_budget(slo))]
        self.reset()

    # ------------------------------------------------------------------ model

    def _tier_candidates(self, tier: TierSLO) -> _Candidates:
        ts: list[float] = []
        ks: list[int] = []
        tokens: list[float] = []
        distortion: list[float] = []
        by_batch: list[np.ndarray] = []
        n_b = self.model.batch_sizes
        lo, hi = (tier.fixed_threshold, tier.fixed_threshold) if tier.fixed_threshold is not None else (
            tier.min_threshold, tier.max_threshold)
        # With hard_requests, each k's tokens per step of the request at the tier's attainment quantile; none where
        # the model has no per-request spread (the mean request decides).
        quantile = min(max(1.0 - tier.attainment_target, 1e-3), 0.5)
        curves = {k: self.model.hard_curve(k, quantile) for k in self.model.draft_lengths} if self.hard_requests else {}
        hard_curves = {k: c for k, c in curves.items() if c is not None}
        hard: list[float] | None = [] if curves and len(hard_curves) == len(curves) else None
        for k in self.model.draft_lengths:
            grid_t, grid_n, grid_d = self.model.curve(k)
            if k == 0:
                values = [lo]
            else:
                inside = [float(t) for t in grid_t if lo <= t <= hi] + [t for t in self.t_grid if lo <= t <= hi]
                values = sorted({lo, hi, *inside})
            for t in values:
                ts.append(t)
                ks.append(k)
                tokens.append(float(np.interp(t, grid_t, grid_n)))
                distortion.append(float(np.interp(t, grid_t, grid_d)))
                if hard is not None:
                    # As a share of the mean request's accepted drafts: the online acceptance correction scales both.
                    mean_accepted = tokens[-1] - 1.0
                    hard_tokens = float(np.interp(t, grid_t, hard_curves[k]))
                    hard.append((hard_tokens - 1.0) / mean_accepted if mean_accepted > 0 else 1.0)
                if n_b:
                    curve = self._batch_curves[k]
                    assert curve is not None  # a model with batch sizes has a batch curve at every k
                    by_batch.append(np.array([np.interp(t, grid_t, curve[:, b]) for b in range(n_b)]))
        return _Candidates(np.array(ts), np.array(ks, dtype=np.int64), np.array(tokens), np.array(distortion),
                           np.array(by_batch) if n_b else None, None if hard is None else np.array(hard))

    def _universe(self, act_idx: tuple[int, ...], kept: tuple[tuple[int, ...], ...] | None) -> _Universe:
        """The joint candidates over the active tiers ``act_idx`` — every choice of one candidate per
        tier, in ``itertools.product`` order — restricted to the tier candidates ``kept`` (indices per
        active tier; None: all), with what does not depend on the telemetry precomputed. Cached."""
        key = (act_idx, kept)
        cached = self._universe_cache.get(key)
        if cached is not None:
            return cached
        n_t = len(self.tier_names)
        cands = [self._candidates[self.tier_names[i]] for i in act_idx]
        per_tier = kept if kept is not None else tuple(tuple(range(c.ks.size)) for c in cands)
        index = np.array(list(itertools.product(*per_tier)), dtype=np.int64).reshape(-1, len(act_idx))
        n = index.shape[0]
        ks = np.zeros((n, n_t), dtype=np.int64)
        thresholds = np.zeros((n, n_t))
        tokens = np.ones((n, n_t))
        distortion = np.zeros((n, n_t))
        n_b = self.model.batch_sizes
        by_batch = np.ones((n_b, n, n_t)) if n_b else None
        hard = np.ones((n, n_t)) if any(c.hard_share is not None for c in cands) else None
        for col, (i, c) in enumerate(zip(act_idx, cands, strict=True)):
            sel = index[:, col]
            if hard is not None and c.hard_share is not None:
                hard[:, i] = c.hard_share[sel]
            ks[:, i] = c.ks[sel]
            thresholds[:, i] = c.thresholds[sel]
            tokens[:, i] = c.tokens[sel]
            distortion[:, i] = c.distortion[sel]
            if by_batch is not None and c.tokens_by_batch is not None:
                by_batch[:, :, i] = c.tokens_by_batch[sel].T
        # The step model's parts that depend on the candidates' k alone (see _step_ms; the tiers with
        # a positive share are exactly the active ones).
        cost = self.model.cost
        active = np.zeros(n_t, dtype=bool)
        active[list(act_idx)] = True
        k_max = np.where(active, ks, 0).max(axis=1)
        per_row = (cost.verify_per_seq_ms + cost.verify_per_token_ms * ks
                   + (ks > 0) * (k_max[:, None] * cost.draft_per_seq_ms))
        plain = k_max == 0
        fixed = np.asarray(np.where(plain, cost.plain_fixed_ms, k_max * cost.draft_fixed_ms + cost.verify_fixed_ms),
                           dtype=float)
        k_max_keys = np.unique(k_max)
        tier_points = tuple(tuple((int(c.ks[j]), float(c.thresholds[j])) for j in chosen)
                            for c, chosen in zip(cands, per_tier, strict=True))
        universe = _Universe(ks=ks, thresholds=thresholds, tokens_minus_1=tokens - 1.0,
                             tokens_minus_1_by_batch=None if by_batch is None else by_batch - 1.0, ks_plus_1=ks + 1.0,
                             base_distortion=distortion, per_row=per_row, fixed=fixed, k_max=k_max, plain=plain,
                             hard_share=hard,
                             k_max_keys=k_max_keys, k_max_at=np.searchsorted(k_max_keys, k_max),
                             drafts=(ks > 0).astype(float), tier_points=tier_points)
        if len(self._universe_cache) >= 256:  # distinct budget subsets are few; bound it anyway
            self._universe_cache.clear()
        self._universe_cache[key] = universe
        return universe

    def reset(self) -> None:
        n = len(self.tier_names)
        self.margin = {name: self.initial_margin for name in self.tier_names}
        self.tokens_correction = np.ones(n)
        self.distortion_correction = np.ones(n)
        # Measured / modelled step time, apart for plain steps (the target alone) and speculative ones
        # (int8 draft steps and a wider verify): the machine's state moves them differently (the
        # default pair's real step load B, sessions 11 → 12: plain steps 1.76× slower, T = 4, k = 4
        # steps 1.46×), and one correction learned at k = 0 alone would mis-rank every k > 0 candidate.
        # Each corrects the fixed and per-row parts apart (session 13: plain steps at the model's time
        # at one row, 1.6× at seven), so what a light phase teaches carries to a full batch.
        # Speculative steps are fitted per k_max: a machine's extra time per step (a replica contended by
        # its load generator and Ray) is a larger share of a k = 2 step than of a k = 6 one, and one fit
        # over both read the difference as a per-row slope (session 18, contended step load in the
        # simulator: k = 2 and 4 windows at one row after k = 6 ones at three took the per-row factor to
        # its 0.25 bound, and the policy entered the burst at T = 0.75 predicted to meet).
        self.plain_step = self._new_step_fit()
        self.draft_steps: dict[int, StepCorrection | BatchStepCorrection] = {}
        self._draft_last: dict[int, int] = {}  # k_max: the tick its fit last took a window
        self._no_evidence = self._new_step_fit()  # the model's step (never observes)
        self._ticks = 0
        # Rows running per replica in the last look_ahead_windows windows (the look-ahead's recent peak).
        self._rows_seen: deque[float] = deque(maxlen=max(self.look_ahead_windows, 1))
        # (arrivals, seconds) of the same windows: the rate bound the look-ahead's feasibility test plans for.
        self._arrivals_seen: deque[tuple[float, float]] = deque(maxlen=max(self.look_ahead_windows, 1))
        self._plain_last = -math.inf  # the tick the plain-step fit last took a window
        cost = self.model.cost
        # The prefill of a join at k > 0 (target and draft) until TTFT teaches it.
        self.prefill_ms = {
            name: cost.prefill_fixed_ms + cost.draft_prefill_fixed_ms
            + (cost.prefill_ms_per_token + cost.draft_prefill_ms_per_token) * self.prompt_tokens
            for name in self.tier_names
        }
        self.shares = np.full(n, math.nan)
        self.arrival_rate = math.nan  # per serving replica, req/s (the fleet's rate over the replicas now)
        self.total_arrival_rate = math.nan  # whole fleet, req/s
        self.mean_output_tokens = math.nan
        self._arrivals_sum = self._time_sum = self._tokens_sum = self._completions_sum = 0.0
        self._arrivals_rise_sum = self._time_rise_sum = 0.0
        # Measured prefill wall time and the admissions it served, as decayed sums (Telemetry.prefill_ms).
        self._prefill_sum = self._prefill_requests = 0.0
        # (prefill ms, replica-ms) of the last stall_windows windows that measured their prefill time.
        self._stall_seen: deque[tuple[float, float]] = deque(maxlen=max(self.stall_windows, 1))
        self._queue_seen_s = -math.inf  # the last window that closed with a queue
        self.replicas_wanted: int | None = None  # the count asked for last (Decision.replicas)
        self._pending_attainment: dict[str, tuple[int, int]] = {name: (0, 0) for name in self.tier_names}
        # Evidence for the acceptance and distortion corrections not yet used, per tier: [measured sum,
        # modelled sum, weight] (row-iterations / output tokens), pooled over steady windows until it
        # holds enough (a slow replica runs a few row-iterations and a few dozen tokens a second).
        self._pending_tokens = np.zeros((n, 3))
        self._pending_distortion = np.zeros((n, 3))
        self.measured_attainment = {name: math.nan for name in self.tier_names}
        # Log-spread of the requests' TPOT and TTFT about their median, per tier (ln(p95 / p50) / 1.645,
        # measured): how far from its target a prediction may sit and still have requests meet it.
        self.spread = {name: {"tpot": self.spread_prior, "ttft": self.spread_prior} for name in self.tier_names}
        self.short = {name: False for name in self.tier_names}
        self.current: dict[str, tuple[float, int]] = {}
        # Per tier: the time of the first decision in the current run of decisions that wanted less distortion
        # than the point in force (relax_delay_s).
        self._relax_since: dict[str, float] = {}
        # The same for best-effort decisions (best_effort_relax_s).
        self._best_effort_relax_since: dict[str, float] = {}
        # A probe that switched the kind of step: (the kind it switched to, plain or not; the tick it did so).
        self._probe_switch: tuple[bool, int] | None = None
        self._best_effort: dict[str, bool] = {}
        # The (T, k) per tier of the last two windows: a window is steady when both ran its (T, k).
        self._last_configs: list[dict[str, tuple[float, int | None]]] = []
        self.last_decision: Decision | None = None
        self.last_prediction: dict[str, dict[str, float]] = {}
        self._last_time_s: float | None = None

    def _new_step_fit(self, speculative: bool = False) -> StepCorrection | BatchStepCorrection:
        if self.step_fit == "batch":
            return BatchStepCorrection(self.max_batch, decay=self.step_decay)
        prior = self.draft_slope_prior if speculative and self.draft_slope_prior is not None else self.step_slope_prior
        return StepCorrection(decay=self.step_decay, slope_prior=prior)

    def _tokens_at(self, by_batch: np.ndarray, batch: np.ndarray, ks_plus_1: np.ndarray) -> np.ndarray:
        """Corrected tokens per step [candidates, tiers] at each candidate's (fractional) batch, linear
        between integer batch sizes, held beyond the model's last."""
        lo, hi, w = _batch_bracket(batch, by_batch.shape[0])
        w = w[:, None]
        rows = np.arange(batch.size)
        accepted = (1.0 - w) * by_batch[lo, rows] + w * by_batch[hi, rows]
        return np.asarray(np.minimum(1.0 + accepted * self.tokens_correction, ks_plus_1), dtype=float)

    def _step_ms(self, ks: np.ndarray, shares: np.ndarray, batch: float | np.ndarray,
                 near: float | np.ndarray | None = None) -> np.ndarray:
        """Modelled step ms for candidate rows ``ks`` [N, n_tiers] with tier shares [n_tiers]; a plain
        candidate's step is the line of its plain-step segment at ``near`` rows (None: at ``batch``)."""
        c = self.model.cost
        active = shares > 0
        k_max = np.where(active, ks, 0).max(axis=1)
        per_row = c.verify_per_seq_ms + c.verify_per_token_ms * ks + (ks > 0) * (k_max[:, None] * c.draft_per_seq_ms)
        mixed_fixed = k_max * c.draft_fixed_ms + c.verify_fixed_ms
        per_seq = (per_row * shares).sum(axis=1)
        plain = k_max == 0
        plain_fixed, plain_per_row = c.plain_line(np.broadcast_to(batch if near is None else near, plain.shape))
        fixed = np.where(plain, plain_fixed, mixed_fixed)
        per_seq = np.where(plain, plain_per_row, per_seq)
        return np.asarray(fixed + per_seq * batch, dtype=float)

    # ------------------------------------------------------------------ online estimates

    def _last_seen(self, plain: bool) -> float:
        """The tick a fit of that kind of step last took a window (-inf: never)."""
        return self._plain_last if plain else max(self._draft_last.values(), default=-math.inf)

    def _draft_fit(self, k_max: int) -> StepCorrection | BatchStepCorrection:
        """The fit for speculative steps of ``k_max`` draft steps: its own once it has a window, else the
        nearest k_max's that has (the most recent of two as near), else the model's step."""
        fit = self.draft_steps.get(k_max)
        if fit is not None:
            return fit
        if not self.draft_steps:
            return self.plain_step if self.draft_prior == "plain" else self._no_evidence
        nearest = min(self.draft_steps, key=lambda k: (abs(k - k_max), -self._draft_last[k]))
        return self.draft_steps[nearest]

    def _observe_draft(self, k_max: int, measured_ms: float, fixed_ms: float, per_row_ms: float,
                       batch: float) -> None:
        fit = self.draft_steps.get(k_max)
        if fit is None:
            fit = self.draft_steps[k_max] = self._new_step_fit(speculative=True)
        fit.observe(measured_ms, fixed_ms, per_row_ms, batch)
        self._draft_last[k_max] = self._ticks

    def _observe_steps(self, plain: StepTotals | None, speculative: StepTotals | None) -> None:
        """Correct the step model from steps reported by kind, each against the model of what it held:
        exact whatever the mix across replicas, and a step that outlasts windows is still its own kind.
        Speculative steps teach the fit of their mean k_max (a window that mixes two, after a change,
        teaches the one nearest its mean)."""
        c = self.model.cost
        if plain is not None and plain.steps > 0 and plain.rows > 0:
            batch = plain.mean_rows
            plain_fixed, plain_per_row = c.plain_line(np.array([batch]))
            self.plain_step.observe(plain.mean_ms, float(plain_fixed[0]), float(plain_per_row[0]), batch)
            self._plain_last = self._ticks
        if speculative is not None and speculative.steps > 0 and speculative.rows > 0:
            fixed, per_row = speculative_step_line(c, speculative)
            k_max = max(1, round(speculative.draft_forwards / speculative.steps))
            self._observe_draft(k_max, speculative.mean_ms, fixed, per_row, speculative.mean_rows)

    def _rate_bound(self, replicas: int) -> float:
        """The arrival rate per replica at the Poisson upper bound (``rate_z`` standard deviations) of the
        arrivals over the last ``look_ahead_windows`` windows, never below the measured rate. Wilson's form
        of the bound: at zero arrivals it still allows z² over the span, so a light phase plans for the
        burst that a few quiet seconds cannot rule out."""
        lam = self.arrival_rate if math.isfinite(self.arrival_rate) else 0.0
        arrivals = sum(a for a, _ in self._arrivals_seen)
        span_s = sum(w for _, w in self._arrivals_seen)
        if span_s <= 0:
            return lam
        z = self.rate_z
        bound = (arrivals + z * z / 2 + z * math.sqrt(arrivals + z * z / 4)) / span_s / replicas
        return max(lam, bound)

    def _observe(self, telemetry: Telemetry) -> None:
        a = self.alpha
        replicas = max(1, telemetry.replicas)
        # Rates as ratios of exponentially decayed sums (memory ~1/(1 − decay) windows): a per-window
        # ratio at a few requests per window is mostly noise. The fleet's total rate is what is
        # remembered; the rate per replica divides it by the replicas serving *now*, so capacity that
        # arrives lowers the load per replica at once (and T falls back), not over the memory.
        d = self.rate_decay
        self._arrivals_sum = d * self._arrivals_sum + telemetry.arrivals
        self._time_sum = d * self._time_sum + telemetry.window_s
        self._arrivals_seen.append((float(telemetry.arrivals), float(telemetry.window_s)))
        # With rate_prior_s, over the first that many seconds the rate is read over that span (the arrivals so
        # far, none before): one early arrival in a first one-second window is not a rate of one per second.
        self.total_arrival_rate = self._arrivals_sum / max(self._time_sum, self.rate_prior_s)
        if self.rate_rise_decay > 0:
            # Rise fast, fall slowly (as Serve's autoscaler upscales sooner than it downscales): a short memory
            # reads a burst within a few windows, the long one holds the rate after it.
            r = self.rate_rise_decay
            self._arrivals_rise_sum = r * self._arrivals_rise_sum + telemetry.arrivals
            self._time_rise_sum = r * self._time_rise_sum + telemetry.window_s
            self.total_arrival_rate = max(self.total_arrival_rate, self._arrivals_rise_sum / max(
                self._time_rise_sum, self.rate_prior_s))
        self.arrival_rate = self.total_arrival_rate / replicas
        if math.isfinite(telemetry.prefill_ms):
            self._stall_seen.append((telemetry.prefill_ms, 1000.0 * telemetry.window_s * replicas))
            self._prefill_sum = d * self._prefill_sum + telemetry.prefill_ms
            self._prefill_requests = d * self._prefill_requests + max(telemetry.arrivals - telemetry.rejections, 0)
        if telemetry.queue_depth > 0:
            self._queue_seen_s = telemetry.time_s
        self._tokens_sum = d * self._tokens_sum + telemetry.output_tokens
        self._completions_sum = d * self._completions_sum + telemetry.completions
        if self._completions_sum >= 1.0:
            self.mean_output_tokens = self._tokens_sum / self._completions_sum
        weights = np.array([
            float(w.sequence_iterations) if (w := telemetry.tiers.get(n)) is not None else 0.0
            for n in self.tier_names
        ])
        if weights.sum() <= 0:
            weights = np.array([
                float(w.completions) if (w := telemetry.tiers.get(n)) is not None else 0.0 for n in self.tier_names
            ])
        if weights.sum() > 0:
            new = weights / weights.sum()
            self.shares = new if np.isnan(self.shares).any() else a * new + (1 - a) * self.shares

        # Corrections against what the model says about the (T, k) in force during the window.
        configs = {n: (w.threshold, w.draft_length) for n, w in telemetry.tiers.items()}
        # Two windows back, not one: a step started before a change ends after it, and a speculative
        # step (a catch-up above all) can outlast a window, so the first window after the one that
        # reports the new (T, k) may still hold an old step (in the simulator, a 1.2 s step at T = 4,
        # k = 6 taught the plain-step correction 1.6 where the profile is the truth).
        steady = {n: len(self._last_configs) == 2 and all(prev.get(n) == c for prev in self._last_configs)
                  for n, c in configs.items()}
        self._last_configs = [*self._last_configs[-1:], configs]
        ks_now = np.array([[
            w.draft_length if (w := telemetry.tiers.get(n)) is not None and w.draft_length is not None
            else self.current.get(n, (0.0, 0))[1]
            for n in self.tier_names
        ]])
        if telemetry.plain_steps is not None or telemetry.speculative_steps is not None:
            self._observe_steps(telemetry.plain_steps, telemetry.speculative_steps)
        elif (self.current and steady and all(steady.values()) and math.isfinite(telemetry.mean_iteration_ms)
                and math.isfinite(telemetry.mean_batch_size)):
            shares = self.shares if not np.isnan(self.shares).any() else np.full(len(self.tier_names), 1.0)
            near = telemetry.mean_batch_size  # the plain step's segment the window ran in
            fixed_ms = float(self._step_ms(ks_now, shares, 0.0, near)[0])
            per_row_ms = float(self._step_ms(ks_now, shares, 1.0, near)[0]) - fixed_ms
            k_max = int(np.where(shares > 0, ks_now[0], 0).max())
            if k_max == 0:
                self.plain_step.observe(telemetry.mean_iteration_ms, fixed_ms, per_row_ms, telemetry.mean_batch_size)
                self._plain_last = self._ticks
            else:
                self._observe_draft(k_max, telemetry.mean_iteration_ms, fixed_ms, per_row_ms,
                                    telemetry.mean_batch_size)
        for i, name in enumerate(self.tier_names):
            window = telemetry.tiers.get(name)
            if window is None:
                continue
            self._update_margin(name, window.slo_met, window.completions)
            for metric, summary in (("tpot", window.tpot), ("ttft", window.ttft)):
                if summary.count >= self.min_samples and summary.p50_ms > 0 and summary.p95_ms > 0:
                    spread = min(max(math.log(summary.p95_ms / summary.p50_ms) / _Z95, 0.05), 1.5)
                    self.spread[name][metric] = _ewma(self.spread[name][metric], spread, a)
            if name not in self.current:
                continue
            # Compare with the model at the (T, k) the tier actually ran at (the guards, the quality
            # cap above all, may have lowered the T this policy asked for), and only over windows
            # that ran one (T, k) throughout: a step spans a good part of a window, so a window right
            # after a change mixes both and would bias the correction toward the old point.
            t = window.threshold
            k = window.draft_length if window.draft_length is not None else self.current[name][1]
            if k not in self._curves or not steady.get(name, False):
                continue
            if k > 0 and window.sequence_iterations > 0:
                grid_t, grid_n, grid_d = self._curves[k]
                curve = self._batch_curves[k]
                if curve is not None and math.isfinite(telemetry.mean_batch_size):
                    # The model at the batch the window ran (linear between integer batch sizes).
                    lo, hi, upper = _batch_bracket(np.array([telemetry.mean_batch_size]), curve.shape[1])
                    grid_n = (1.0 - upper[0]) * curve[:, lo[0]] + upper[0] * curve[:, hi[0]]
                modelled_accepted = float(np.interp(t, grid_t, grid_n)) - 1.0
                if modelled_accepted > 0.05:  # correct accepted drafts per step, measured / modelled
                    pooled = self._pooled_ratio(self._pending_tokens[i], window.tokens_per_iteration - 1.0,
                                                modelled_accepted, window.sequence_iterations, 20)
                    if pooled is not None:
                        pooled = min(max(pooled, 0.3), 3.0)
                        self.tokens_correction[i] = _ewma(float(self.tokens_correction[i]), pooled, a)
                modelled_d = float(np.interp(t, grid_t, grid_d))
                if modelled_d > 1e-3 and window.output_tokens > 0:
                    pooled = self._pooled_ratio(self._pending_distortion[i], window.mean_distortion, modelled_d,
                                                window.output_tokens, 200)
                    if pooled is not None:
                        pooled = min(max(pooled, 0.25), 4.0)
                        self.distortion_correction[i] = _ewma(float(self.distortion_correction[i]), pooled, a)
            prediction = self.last_prediction.get(name)
            # Only requests that never saw a queue teach the prefill: under a backlog (a burst while
            # replicas start) the residual is mostly queueing the wait model missed, and a prefill learned
            # from it would inflate every prediction (and the replica count) long after the queue is
            # gone. A window's completions arrived up to its longest E2E before it opened; every window
            # closed since then must have had no queue.
            arrived_s = telemetry.time_s - telemetry.window_s - window.e2e.p99_ms / 1000.0
            if (prediction is not None and window.ttft.count > 0 and math.isfinite(window.ttft.p50_ms)
                    and math.isfinite(arrived_s) and arrived_s > self._queue_seen_s
                    and math.isfinite(prediction["wait_ms"])):
                residual = window.ttft.p50_ms - prediction["wait_ms"] - _TTFT_STEPS * prediction["step_ms"]
                self.prefill_ms[name] = _ewma(self.prefill_ms[name], max(residual, 0.0), a)

    @staticmethod
    def _pooled_ratio(pending: np.ndarray, measured: float, modelled: float, weight: float,
                      enough: float) -> float | None:
        """measured / modelled over this window and the pending ones once they weigh ``enough`` (then the
        pending evidence is spent), else None and the window waits in ``pending`` ([measured sum,
        modelled sum, weight], updated in place). A window that is enough alone gives its own ratio."""
        if pending[2] == 0.0 and weight >= enough:
            return measured / modelled
        pending += (measured * weight, modelled * weight, weight)
        if pending[2] < enough:
            return None
        ratio = float(pending[0] / pending[1])
        pending[:] = 0.0
        return ratio

    def _step_correction(self, k_max: np.ndarray, probe: bool | None = None, k_now: int = 0,
                         unique: tuple[np.ndarray, np.ndarray] | None = None,
                         batch: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """[candidates] the corrections of the fixed and of the per-row step time of each candidate's step,
        by its ``k_max`` (0: plain; see :meth:`_draft_fit`) and, with ``step_fit`` "batch", at its ``batch``
        (rows; required then). ``probe`` (the kind in force, plain or not; see :meth:`_probing`) with
        ``k_now`` (the k_max in force): the other kind is taken at the lower of its own factors and those
        of the step in force. ``unique``: ``(np.unique(k_max), np.searchsorted(that, k_max))`` when known
        (a universe's)."""
        keys = np.unique(k_max) if unique is None else unique[0]  # sorted
        now = None if probe is None else self.plain_step if probe else self._draft_fit(max(k_now, 1))
        at = np.searchsorted(keys, k_max) if unique is None else unique[1]
        by_rows = self.step_fit == "batch"  # else one pair of factors per k_max, whatever the batch
        if by_rows:
            if batch is None:
                raise ValueError("step_fit 'batch' corrects a step at a batch: pass batch")
            rows = np.broadcast_to(batch, k_max.shape)
        size = k_max.shape if by_rows else keys.size
        fixed, per_row = np.empty(size), np.empty(size)
        for j, k in enumerate(keys.tolist()):
            where = at == j if by_rows else slice(j, j + 1)
            at_rows = rows[where] if by_rows else _ONE_ROW
            fit = self.plain_step if k == 0 else self._draft_fit(k)
            fit_fixed, fit_per_row = fit.factors(at_rows)
            if now is not None and (k == 0) != probe:  # the kind not in force, while probing
                now_fixed, now_per_row = now.factors(at_rows)
                fit_fixed, fit_per_row = np.minimum(fit_fixed, now_fixed), np.minimum(fit_per_row, now_per_row)
            fixed[where], per_row[where] = fit_fixed, fit_per_row
        return (fixed, per_row) if by_rows else (fixed[at], per_row[at])

    def _probing(self, active: np.ndarray, in_flight: int) -> bool | None:
        """Optimism where evidence is missing and the SLO is being missed: while a tier with traffic is
        measured short and the kind of step not in force has taught its fit nothing for ``probe_after``
        windows (or never), that kind is predicted at the lower of its own and the kind in force's step
        correction. Returns the kind in force (True: plain) when probing, else None.

        Why: each kind is corrected only from windows that ran it, so the kind never run keeps the model's
        step, and the machine moves both kinds — by different amounts, either way. On the default pair's
        real step load B (session 14) the machine ran plain steps at 0.64x the model; speculative ones,
        never run, stayed at 1.0x, so the policy decoded plainly through a burst it missed at 0.23
        attainment where T = 4, k = 4 reached 0.58. Taking the measured kind's factors instead was
        rejected in session 13 (that day plain steps ran 1.7x and T = 4, k = 4 1.2x: plain's factors would
        have kept plain through the burst). A measured shortfall is the evidence that the choice is wrong;
        a probe then measures the other kind, and its own windows take over. While probing, the switch is
        ranked without ``switch_margin`` and the draft's catch-up (a switch to k > 0) is charged to the rows
        running now over them and the requests of the next ``probe_after`` windows, not to every request
        (session 14: with 48-token requests the catch-up over four rows' backlog, charged to every token of
        theirs, added 73 ms per token and kept plain decoding ahead of the probe). No probe while nothing
        runs (``in_flight`` 0): it would measure nothing, and the kind it switched to, in force then, is
        not the one probed, so the next window switched back (session 18, the contended step load's idle
        tail: the kind flipped every window). No probe of plain steps while more than one request is in
        flight: it is the costly experiment there, as every row's backlog becomes the draft's to catch up
        on the way back, which holds plain decoding once it is in (session 19, the contended step load at
        130 ms in the simulator: a probe at seven rows ran plain decoding through 7 s of a burst that
        T = 4, k = 6 served within target)."""
        if not self.current or in_flight <= 0:
            return None
        if not any(self.short[name] for i, name in enumerate(self.tier_names) if active[i]):
            return None
        plain_now = self._plain_in_force(active)
        if self._ticks - self._last_seen(not plain_now) < self.probe_after:
            return None
        if not plain_now and in_flight > 1:  # a probe of plain steps at a busy batch (docstring)
            return None
        return plain_now

    def _stall(self, lam: float, act_idx: Sequence[int], ks: np.ndarray, shares: np.ndarray,
               draft_share: np.ndarray | None = None) -> np.ndarray:
        """[candidates] share of a replica's time its running rows stall for joiners' prefills at ``lam``
        requests/s (admit, then step: every admission's prefill holds the whole batch), capped at 0.9.
        The measured prefill ran at the draft lengths in force; a candidate whose tiers join at another k
        scales it by the model's prefill there (a join at k = 0 skips the draft's prefill). ``draft_share``:
        ``_draft_share(ks, shares)`` when known."""
        measured = self._stall_prefill_ms(act_idx)
        target_ms, draft_ms = self._prefill_split()
        now = self._draft_share(self._ks_now()[None, :], shares)[0]
        if draft_share is None:
            draft_share = self._draft_share(ks, shares)
        scale = (target_ms + draft_ms * draft_share) / (target_ms + draft_ms * now)
        stall = lam * measured * scale / 1000.0
        if self.stall_windows > 0:
            replica_ms = sum(ms for _, ms in self._stall_seen)
            if replica_ms > 0:
                stall = np.maximum(stall, sum(prefill for prefill, _ in self._stall_seen) / replica_ms * scale)
        return np.asarray(np.minimum(stall, 0.9), dtype=float)

    @staticmethod
    def _draft_share(ks: np.ndarray, shares: np.ndarray) -> np.ndarray:
        """[candidates] traffic share of the tiers that draft (k > 0) in each candidate row of ``ks``."""
        return np.asarray(row_sums((ks > 0) * shares), dtype=float)

    def _plain_in_force(self, active: np.ndarray) -> bool:
        """Whether the kind of step in force over the ``active`` tiers is plain decoding (every one at k = 0)."""
        return bool((np.where(active, self._ks_now(), 0) == 0).all())

    def _switches_kind(self, plain: np.ndarray, active: np.ndarray) -> np.ndarray:
        """[candidates] 1.0 where a candidate's kind of step (``plain``: every active tier at k = 0)
        differs from the kind in force over the ``active`` tiers, else 0.0 (0.0 before any decision)."""
        if not self.current:
            return np.zeros(plain.size)
        return np.asarray(plain != self._plain_in_force(active), dtype=float)

    def _current_index(self, act_idx: Sequence[int],
                       tier_points: tuple[tuple[tuple[int, float], ...], ...]) -> int | None:
        """The joint candidate that is the (T, k) in force over the active tiers (None: not a candidate),
        found per tier in the universe's ``tier_points`` (see :class:`_Universe`) without a pass over the
        joint candidates: the first joint match in product order is every tier's first match."""
        if not self.current or not act_idx:
            return None
        index = 0
        for i, points in zip(act_idx, tier_points, strict=True):
            t_in_force, k_in_force = self.current.get(self.tier_names[i], (math.nan, -1))
            at = next((j for j, (k, t) in enumerate(points) if k == k_in_force and abs(t - t_in_force) < 1e-9), None)
            if at is None:
                return None
            index = index * len(points) + at
        return index

    def _ks_now(self) -> np.ndarray:
        """[tiers] the draft lengths in force: the last decision's (0 before any)."""
        return np.array([self.current.get(n, (0.0, 0))[1] for n in self.tier_names], dtype=np.int64)

    def _prompt_tokens(self) -> float:
        """Prompt tokens of a typical admission: backed out of the measured prefill per admission through
        the model's prefill at the draft lengths in force (joiners that share a prefill read shorter);
        the ``prompt_tokens`` parameter until a prefill is measured."""
        c = self.model.cost
        if self._prefill_requests < 1.0:
            return self.prompt_tokens
        share = float(self._draft_share(self._ks_now()[None, :], self._shares_or_default())[0])
        per_token = c.prefill_ms_per_token + share * c.draft_prefill_ms_per_token
        fixed = c.prefill_fixed_ms + share * c.draft_prefill_fixed_ms
        if per_token <= 0:
            return self.prompt_tokens
        return max((self._prefill_sum / self._prefill_requests - fixed) / per_token, 1.0)

    def _prefill_split(self) -> tuple[float, float]:
        """(target, draft) model prefill ms of a typical admission (draft 0 when the model has no
        separate draft prefill; then the target's holds both)."""
        c = self.model.cost
        prompt = self._prompt_tokens()
        target = c.prefill_fixed_ms + c.prefill_ms_per_token * prompt
        draft = c.draft_prefill_fixed_ms + c.draft_prefill_ms_per_token * prompt
        return max(target, 1e-9), draft

    def _catch_up_tpot(self, ks: np.ndarray, shares: np.ndarray, running: float, length: float,
                       draft_share: np.ndarray | None = None) -> np.ndarray:
        """[candidates] TPOT ms a candidate adds by making a tier that runs at k = 0 draft: the draft then
        runs once over the running rows' backlog (their prompts and tokens so far, padded to one
        width), a stall every running request pays once over its ~``length`` tokens."""
        c = self.model.cost
        if c.draft_prefill_ms_per_token <= 0 and c.draft_prefill_fixed_ms <= 0:
            return np.zeros(ks.shape[0])
        starts = ((ks > 0) & (self._ks_now()[None, :] == 0) & (shares > 0)[None, :]).any(axis=1)
        fed = running * (self._draft_share(ks, shares) if draft_share is None else draft_share)
        backlog = self._prompt_tokens() + length / 2.0
        catch_up_ms = c.draft_prefill_fixed_ms + c.draft_prefill_ms_per_token * fed * backlog
        return np.asarray(np.where(starts, catch_up_ms / max(length, 1.0), 0.0), dtype=float)

    def _shares_or_default(self) -> np.ndarray:
        """The measured tier shares; before any traffic, the default tier alone."""
        if np.isnan(self.shares).any():
            shares = np.zeros(len(self.tier_names))
            shares[self.tier_names.index(self.slo.default_tier)] = 1.0
            return shares
        return self.shares

    def _stall_prefill_ms(self, act_idx: Sequence[int]) -> float:
        """Prefill ms per admitted request, for the stall term: measured (prefill wall time over the
        requests admitted, decayed sums) once a request's worth is in, else the active tiers' mean
        prefill as learned from TTFT (which also holds the wait for the step in flight)."""
        if self._prefill_requests >= 1.0:
            return self._prefill_sum / self._prefill_requests
        return float(np.mean([self.prefill_ms[self.tier_names[i]] for i in act_idx]))

    def _planning_budget(self, i: int, budget: float) -> float:
        """The distortion tier ``i`` may plan to: ``budget_margin`` below its budget, the budget itself
        while it is measured short (the objective then asks for the most attainment within budget)."""
        return budget if self.short[self.tier_names[i]] else (1.0 - self.budget_margin) * budget

    def _update_margin(self, name: str, slo_met: int, completions: int) -> None:
        """The outer loop: pool completions until ``min_samples``, then move the tier's margin."""
        tier = self.slo.tiers[name]
        if not tier.has_latency_target:
            return
        met, done = self._pending_attainment[name]
        met, done = met + slo_met, done + completions
        if done >= self.min_samples:
            attained = met / done
            old = self.measured_attainment[name]
            self.measured_attainment[name] = attained if math.isnan(old) else 0.3 * attained + 0.7 * old
            # Evidence beats prediction: a tier measured well short of its target is planned as short
            # (fastest within budget: the most attainment), until it recovers (hysteresis).
            if self.measured_attainment[name] < tier.attainment_target - self.short_enter:
                self.short[name] = True
            elif self.measured_attainment[name] > tier.attainment_target - self.short_exit:
                self.short[name] = False
            gap = tier.attainment_target - attained
            gain = self.margin_gain_up if gap > 0 else self.margin_gain_down
            if gap > 0 and self._best_effort.get(name, False):
                gain = 0.0  # anti-windup: already at the fastest point within budget
            low, high = self.margin_limits
            self.margin[name] = min(max(self.margin[name] * math.exp(gain * gap), low), high)
            met, done = 0, 0
        self._pending_attainment[name] = (met, done)

    # ------------------------------------------------------------------ decision

    def decide(self, telemetry: Telemetry) -> Decision:
        if self._last_time_s is not None and telemetry.time_s <= self._last_time_s and self.last_decision:
            return self.last_decision
        self._last_time_s = telemetry.time_s
        self._ticks += 1
        self._observe(telemetry)
        n_t = len(self.tier_names)
        shares = self._shares_or_default().copy()
        active = shares >= 0.02
        shares = np.where(active, shares, 0.0)
        shares /= shares.sum()
        act_idx = [i for i in range(n_t) if active[i]]

        # Joint candidates over the active tiers. Only candidates where every tier is within its
        # budget can be chosen (when any exists), and "within" is a per-tier test, so the joint pool is
        # the product of each tier's within-budget candidates: evaluate that product alone (cached per
        # choice of subsets; it keeps the full product's order, so lexsort ties break the same way).
        act = tuple(act_idx)
        kept: list[tuple[int, ...]] = []
        for i in act_idx:
            c = self._candidates[self.tier_names[i]]
            budget = self.slo.tiers[self.tier_names[i]].max_mean_distortion
            if budget is None:
                kept.append(tuple(range(c.ks.size)))
            else:
                ok = c.distortion * self.distortion_correction[i] <= self._planning_budget(i, budget) + 1e-12
                kept.append(tuple(np.flatnonzero(ok).tolist()))
        pruned = self._prune_by_budget and all(kept)  # else some tier has nothing within budget
        u = self._universe(act, tuple(kept) if pruned else None)
        ks, thresholds, n = u.ks, u.thresholds, u.ks.shape[0]
        tokens = np.minimum(1.0 + u.tokens_minus_1 * self.tokens_correction, u.ks_plus_1)

        replicas = max(1, telemetry.replicas)
        running_now = max(1.0, (telemetry.in_flight - telemetry.queue_depth) / replicas)
        self._rows_seen.append(running_now)
        # With queue_joins (the default) the batch a candidate is planned for is never below the rows running now
        # plus the requests queued where the batch has room: a replica admits its queue at its next step, so those
        # rows decode beside the others before the next window (session 31: at a burst's onset the rate still reads
        # the light phase, and the batch with the queue in it is where plain decoding stops meeting).
        queue = telemetry.queue_depth / replicas
        admitted_next = max(running_now, min(running_now + queue, float(self.max_batch))) if self.queue_joins \
            else running_now
        # Where leaving plain decoding costs the draft's catch-up over the running rows (it grows with the
        # batch), a switch made late in a burst costs most: plan every candidate for the batch the burst
        # brings, not the one the rate estimate (decayed over ~30 windows) still reads at its onset — the most
        # rows held over the last look_ahead_windows windows (a burst's arrivals come in clusters) plus the
        # arrivals of one request's life (Little's batch). Session 22: in the simulator twin of session 20's
        # real step load this switches at two rows instead of three to five.
        looks_ahead = self.look_ahead_windows > 0 and (
            self.model.cost.draft_prefill_ms_per_token > 0 or self.model.cost.draft_prefill_fixed_ms > 0)
        rows_peak = max(self._rows_seen)
        length = self.mean_output_tokens if math.isfinite(self.mean_output_tokens) else 200.0
        lam = self.arrival_rate if math.isfinite(self.arrival_rate) else 0.0
        # Step time is linear in B: step = f + p·B (per candidate); tokens per row-step averaged by share.
        per_seq = np.where(u.plain, self.model.cost.plain_per_seq_ms, row_sums(u.per_row * shares))
        probe = self._probing(active, telemetry.in_flight)
        k_now = int(np.where(active, self._ks_now(), 0).max())
        unique = (u.k_max_keys, u.k_max_at)
        # Fits by batch (step_fit "batch") are read at each pass's planned batch, lines once.
        by_rows = self.step_fit == "batch"
        line_corrections = None if by_rows else self._step_correction(u.k_max, probe=probe, k_now=k_now,
                                                                      unique=unique)
        plain_table = bool(self.model.cost.plain_ms_by_batch)

        def corrected_line(near: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            """(f, p) per candidate, a plain one's from its plain-step segment at ``near`` rows."""
            fixed, per_row = u.fixed, per_seq
            if plain_table:
                plain_fixed, plain_per_row = self.model.cost.plain_line(near)
                fixed, per_row = np.where(u.plain, plain_fixed, fixed), np.where(u.plain, plain_per_row, per_row)
            fixed_correction, per_row_correction = line_corrections or self._step_correction(
                u.k_max, probe=probe, k_now=k_now, unique=unique, batch=near)
            return corrected_step_line(fixed, per_row, fixed_correction, per_row_correction)

        # What does not depend on the planned batch, once for both of predict's loads:
        # joiners' prefills stall the running batch (admit, then step): a replica spends a share λ·prefill of its
        # time prefilling, which stretches every running sequence's TPOT.
        draft_share = np.asarray(row_sums(u.drafts * shares), dtype=float)  # = _draft_share(ks, shares)
        stall = self._stall(lam, act_idx, ks, shares, draft_share)
        # A tier that starts drafting makes the draft catch up on its rows' backlog: one long step.
        catch_up_now = self._catch_up_tpot(ks, shares, running_now, length, draft_share)
        if probe is not None:
            # A probe is judged over the windows it buys evidence for: the catch-up stalls the rows running now,
            # not the requests that arrive over the next probe_after windows.
            catch_up_now = catch_up_now * (
                running_now / (running_now + lam * self.probe_after * max(telemetry.window_s, 0.0)))
        # Ranked (not predicted): a switch of kind must pay by more than switch_margin.
        # No margin while probing speculative steps: the margin guards against two noisy fits, and one of them
        # is stale. A probe of plain steps keeps it: leaving them again costs the draft's catch-up over the
        # backlog the probe builds, which nothing here charges (session 17, a contended replica's step load:
        # probes of plain steps mid-burst at near-ties, each paid back with a full batch's catch-up).
        switch = 1.0 + (0.0 if probe is True else self.switch_margin) * self._switches_kind(u.plain, active)
        by_batch = u.tokens_minus_1_by_batch
        tokens_model = tokens

        def predict(lam_floor: float) -> _Prediction:
            """Every candidate's latencies, its look-ahead floor planned at ``lam_floor`` req/s per replica."""
            tokens = tokens_model
            f, p = corrected_line(np.full(n, running_now))
            if by_batch is not None:  # acceptance depends on the batch: start from the batch running now
                tokens = self._tokens_at(by_batch, np.full(n, running_now), u.ks_plus_1)
            # Little: B = λ·L·TPOT = λ·L·(f + p·B) / (1000·n̄)  ⇒  B = x·f / (1 − x·p), x = λL / (1000 n̄).
            # With batch-dependent tokens n̄(B), or a plain step piecewise in B, fixed-point passes: each
            # re-reads n̄ and the plain segment at the batch the last one planned.
            for _ in range(1 if by_batch is None and not (plain_table or by_rows) else 3 if plain_table or by_rows
                           else 2):
                mean_tokens = row_sums(tokens * shares)
                x = lam * length / (1000.0 * mean_tokens)
                denom = 1.0 - x * p
                with np.errstate(divide="ignore", invalid="ignore"):
                    # At least 0: a plain step's segment of the measured table can have a negative intercept,
                    # and its line read below the segment's rows gave a negative batch (NaN predictions: the
                    # candidate could never meet). The next pass reads the segment at the batch clamped here.
                    little = np.where(denom > 0, np.maximum(x * f / denom, 0.0), np.inf)
                overloaded = little > self.max_batch
                # A request lives through many steps while the batch fluctuates around its Little's-law
                # mean (Poisson occupancy): plan for its upper quantile, mean + z·sqrt(mean), never below now.
                planned = little + self.batch_z * np.sqrt(np.where(np.isfinite(little), little, 0.0))
                ahead = little
                if lam_floor != lam:
                    x_floor = lam_floor * length / (1000.0 * mean_tokens)
                    denom_floor = 1.0 - x_floor * p
                    with np.errstate(divide="ignore", invalid="ignore"):
                        ahead = np.where(denom_floor > 0, x_floor * f / denom_floor, np.inf)
                floor = rows_peak + np.where(np.isfinite(ahead), ahead, float(self.max_batch)) if looks_ahead \
                    else admitted_next
                batch = np.clip(np.maximum(planned, floor), 1.0, float(self.max_batch))
                if by_batch is not None:
                    tokens = self._tokens_at(by_batch, batch, u.ks_plus_1)
                if plain_table or by_rows:
                    f, p = corrected_line(batch)
            if by_batch is not None:
                mean_tokens = row_sums(tokens * shares)
            step = f + p * batch
            # A switch holds for a while: the rows running now pay the catch-up, those that arrive over a request's
            # life (about the candidate's planned batch) do not, so it is their share of the charge.
            catch_up = catch_up_now if probe is not None else catch_up_now * (running_now / (running_now + batch))
            tpot = (step / (1.0 - stall))[:, None] / tokens + catch_up[:, None]
            rate = batch * mean_tokens * 1000.0 / step / length  # requests per second per replica
            wait = np.where(overloaded, np.inf, 1000.0 * queue / rate)
            cap = np.zeros(n, dtype=np.int64)  # 0: no cap
            if self.batch_cap:
                capped = self._capped(corrected_line, tokens_model, by_batch, u.ks_plus_1, shares, stall, catch_up,
                                      switch, batch, lam, length, queue)
                if capped is not None:
                    # A cap is held wherever it is stable, also where the planned batch is below it: a cluster of
                    # arrivals fills the batch within a control window, faster than a cap set in reaction.
                    use, cap_rows, step_c, tokens_c, mean_tokens_c, tpot_c, wait_c = capped
                    binding = use & (cap_rows < batch)
                    batch = np.where(binding, cap_rows, batch)
                    step = np.where(binding, step_c, step)
                    tokens = np.where(binding[:, None], tokens_c, tokens)
                    mean_tokens = np.where(binding, mean_tokens_c, mean_tokens)
                    tpot = np.where(binding[:, None], tpot_c, tpot)
                    wait = np.where(use, np.maximum(wait, wait_c), wait)
                    cap = np.where(use & (cap_rows < self.max_batch), cap_rows, 0).astype(np.int64)
            cost = step / (batch * mean_tokens) * switch  # ms of replica time per output token, switch ranked in
            tpot_ranked = tpot * switch[:, None]
            # The TPOT a target is judged on: the mean request's, or with hard_requests the request's at the tier's
            # attainment quantile of acceptance (each request's TPOT is its own mean; at low T the hard ones draft at
            # a fraction of the mean's tokens).
            tpot_meets = tpot_ranked if u.hard_share is None else (
                (step / (1.0 - stall))[:, None] / (1.0 + (tokens - 1.0) * u.hard_share) + catch_up[:, None]
            ) * switch[:, None]

            meets = np.ones((n, n_t), dtype=bool)
            # Latency ratios (prediction × margin / target) per tier; their excess over 1 is the violation.
            ratios: dict[int, list[tuple[str, np.ndarray]]] = {i: [] for i in act_idx}
            wait_and_step = wait + _TTFT_STEPS * step
            for i in act_idx:
                name = self.tier_names[i]
                tier = self.slo.tiers[name]
                m = self.margin[name]
                if tier.tpot_ms is not None:
                    ratio = m * tpot_ranked[:, i] / tier.tpot_ms
                    meets[:, i] &= (ratio if u.hard_share is None else m * tpot_meets[:, i] / tier.tpot_ms) <= 1.0
                    ratios[i].append(("tpot", ratio))
                if tier.ttft_ms is not None:
                    ttft = m * wait_and_step + self.prefill_ms[name]
                    ratio = np.minimum(ttft / tier.ttft_ms, 10.0)
                    meets[:, i] &= ratio <= 1.0
                    ratios[i].append(("ttft", ratio))
                if self.short[name]:
                    meets[:, i] = False
            return _Prediction(batch, step, tokens, mean_tokens, tpot, tpot_ranked, wait, cost, ratios, meets, cap)

        # Plan for the rate the recent windows allow, not only the one measured: at a step's onset the decayed
        # estimate still reads the light phase. A candidate meets only if it meets at the Poisson upper bound of
        # the last look_ahead_windows windows' arrivals (a chance constraint); where none does, the most
        # attainment is ranked at the measured rate — ranked at the bound, a full batch where plain steps are
        # the cheapest would send the policy to k = 0 on a guess (session 23).
        lam_bound = self._rate_bound(replicas) if looks_ahead and self.rate_z > 0 else lam
        predicted = predict(lam_bound)
        if lam_bound > lam:
            predicted = predict(lam)._replace(meets=predicted.meets)
        batch, step, tokens, mean_tokens, tpot, tpot_ranked, wait, cost, ratios, meets, cap = predicted
        if pruned:
            within = np.ones(n, dtype=bool)
        else:  # every joint candidate, tested against every budget (also the reference for the pruning)
            distortion = u.base_distortion * self.distortion_correction
            within = np.ones(n, dtype=bool)
            for i in act_idx:
                budget = self.slo.tiers[self.tier_names[i]].max_mean_distortion
                if budget is not None:
                    within &= distortion[:, i] <= self._planning_budget(i, budget) + 1e-12
            if not within.any():  # the correction says nothing fits: fall back to least distortion
                within = distortion.sum(axis=1) <= distortion.sum(axis=1).min() + 1e-12
        # Best-effort tiers (no latency target) still want speed: their share-weighted TPOT comes
        # before cost, so a lossless tier is not parked at k = 0 inside a batch that drafts anyway.
        best_effort_tiers = [i for i in act_idx if not self.slo.tiers[self.tier_names[i]].has_latency_target]

        def select(allowed: np.ndarray | None) -> tuple[int, str, np.ndarray]:
            """The objective's choice among the candidates within budget (and ``allowed``, where given): the
            joint candidate's index, the mode ("meets" / "best effort") and its corrected distortion per tier."""
            eligible = within if allowed is None else within & allowed
            all_meet = eligible.copy()
            for i in range(n_t):  # meets.all(axis=1) & within, without numpy's slow short-axis reduction
                all_meet &= meets[:, i]
            if all_meet.any():
                pool = np.flatnonzero(all_meet)
                mode = "meets"
            else:
                pool = np.flatnonzero(eligible)
                mode = "best effort"
            # a[take] holds a[pool]'s values; a view, not a copy, when the pool is every candidate (the
            # budget-pruned universe's best effort: every tick of an overloaded hour).
            take: np.ndarray | slice = slice(None) if pool.size == n else pool
            best_effort_tpot = np.round(
                row_sums(tpot_ranked[take][:, best_effort_tiers] * shares[best_effort_tiers]), 1)
            distortion_pool = u.base_distortion[take] * self.distortion_correction
            distortion_keys = [np.round(distortion_pool[:, i], 4) for i in self._distortion_order]
            if mode == "meets":
                keys = [cost[take], best_effort_tpot, *reversed(distortion_keys)]
            else:
                # Per tier as contiguous columns (numpy works a strided column of [pool, tiers] slower).
                violation = [np.zeros(pool.size) for _ in range(n_t)]
                attained = [np.ones(pool.size) for _ in range(n_t)]
                now = self._current_index(act_idx, u.tier_points)
                if now is not None and not eligible[now]:
                    now = None  # out of budget: not a candidate (as in a budget-pruned universe)
                for i, tier_ratios in ratios.items():
                    name = self.tier_names[i]
                    spreads = [self.spread[name][metric] for metric, _ in tier_ratios]
                    z = self._attainment_z[name]
                    measured = self.measured_attainment[name]
                    if now is not None and math.isfinite(measured):
                        z = anchored_z([float(r[now]) for _, r in tier_ratios], spreads, measured)
                    for (_, ratio), spread in zip(tier_ratios, spreads, strict=True):
                        ratio_pool = ratio[take]
                        violation[i] += np.maximum(ratio_pool - 1.0, 0.0)
                        attained[i] *= normal_cdf(z - np.log(ratio_pool) / spread)
                # The objective where no candidate meets: the most attainment. Each tier's share of requests
                # meeting its targets, predicted from how far each candidate moves its latencies against its
                # targets (in the spread of its requests' latencies): from what is measured at the point in
                # force, or (none measured yet) a tier predicted at its target (margin included) at its target
                # share. Not "tiers that meet" (0 or 1 each): with that a tier predicted to miss counted
                # nothing whatever its step, and a loose tier drafting (to meet) at a full batch tripled the
                # step of a tight tier that still met half its requests at k = 0 (set F, session 17).
                predicted_attainment = weighted_column_sums(attained, shares)
                weighted_violation = weighted_column_sums(violation, shares)
                # Most attainment, then the smallest violation, then the fastest (the cost order lets the
                # loose tiers spend their budget on capacity), then least distortion.
                keys = [*reversed(distortion_keys), np.round(cost[take], 2), best_effort_tpot,
                        np.round(weighted_violation, 2), -np.round(predicted_attainment, 3)]
                if self.higher_t_ties:  # the last key: it only orders what every other key ties
                    keys.insert(0, -row_sums(thresholds[take][:, list(act_idx)]))
            chosen = lexmin(keys)
            return int(pool[chosen]), mode, distortion_pool[chosen]

        best, mode, best_distortion = select(None)
        holding = ""
        # A relax waits: relax_delay_s where every target is predicted met (the relax saves distortion),
        # best_effort_relax_s where none is ("best effort", a probe while short: it is made for speed, and a burst's
        # rows dip between its clusters, so a point relaxed in a dip takes the next cluster at the slower point).
        # Each mode keeps its own run of decisions wanting to relax; the other mode's ends.
        waits = {"meets": ("relax_delay_s", self.relax_delay_s, self._relax_since),
                 "best effort": ("best_effort_relax_s", self.best_effort_relax_s, self._best_effort_relax_since)}
        for other, (_, _, since) in waits.items():
            if other != mode:
                since.clear()
        label, delay, relax_since = waits[mode]
        held = self._hold(act_idx, u.base_distortion, best, telemetry.time_s, delay, relax_since)
        if held is not None:
            allowed, names, notes = held
            choice = select(allowed) if (within & allowed).any() else None
            if choice is not None and choice[1] == mode:
                best, mode, best_distortion = choice
                holding = f"; held ({label}): " + ", ".join(notes)
            else:  # nothing as distorting is within budget (and, in "meets", predicted to meet): relax now
                for name in names:
                    relax_since.pop(name, None)
        if self.probe_hold_ticks:  # an option (off by default): nothing of it on the tick otherwise
            best, mode, best_distortion, note = self._hold_probe(probe, active, u.plain, within, best, mode,
                                                                 best_distortion, select)
            holding += note
        self._best_effort = {
            name: bool(active[i] and not meets[best, i]) for i, name in enumerate(self.tier_names)
        }
        busiest = int(np.argmax(shares))
        chosen_t: dict[str, float] = {}
        chosen_k: dict[str, int] = {}
        self.last_prediction = {}
        for i, name in enumerate(self.tier_names):
            tier = self.slo.tiers[name]
            if active[i]:
                chosen_t[name] = float(thresholds[best, i])
                chosen_k[name] = int(ks[best, i])
                self.last_prediction[name] = {
                    "tpot_ms": float(tpot[best, i]), "wait_ms": float(wait[best]), "step_ms": float(step[best]),
                    "margin": self.margin[name], "distortion": float(best_distortion[i]),
                }
            else:
                chosen_t[name] = tier.clamp(tier.min_threshold)
                chosen_k[name] = int(ks[best, busiest])
        self.current = {name: (chosen_t[name], chosen_k[name]) for name in self.tier_names}
        parts = [
            f"{name}: T={chosen_t[name]:.3g} k={chosen_k[name]} (m={self.margin[name]:.2f})"
            for name in self.tier_names if active[self.tier_names.index(name)]
        ]
        # The least-distortion candidates of every tier are within budget whenever any is, so a pruned
        # universe still holds them.
        wanted = self._plan_replicas(ks, tokens, u.base_distortion * self.distortion_correction, shares, act_idx,
                                     replicas)
        scaling = "" if wanted is None else f", {replicas} replicas serving, {wanted} wanted"
        probing = "" if probe is None else f", probing {'speculative' if probe else 'plain'} steps"
        reason = (f"mpc {mode}: batch {float(batch[best]):.2g}, step {float(step[best]):.0f} ms, "
                  f"queue {queue:.2g}/replica{scaling}{probing}, step correction "
                  f"{'by rows' if by_rows else '(fixed, per row)'} plain {self.plain_step.summary()} / speculative "
                  + (" ".join(f"k{k} {fit.summary()}" for k, fit in sorted(self.draft_steps.items()))
                     or self._no_evidence.summary()) + "; " + "; ".join(parts))
        # A cap only where every target is predicted met: where none can be, throughput buys the most
        # attainment (held-out overloaded cases lost 2-4 points of it to a cap).
        batch_cap = (int(cap[best]) or None) if mode == "meets" else None
        if batch_cap is not None:
            reason += f"; batch capped at {batch_cap}"
        reason += holding
        self.last_decision = Decision(thresholds=chosen_t, draft_lengths=chosen_k, batch_cap=batch_cap,
                                      replicas=wanted, reason=reason)
        return self.last_decision

    def _hold_probe(self, probe: bool | None, active: np.ndarray, plain: np.ndarray, within: np.ndarray, best: int,
                    mode: str, distortion: np.ndarray, select: Any) -> tuple[int, str, np.ndarray, str]:
        """With ``probe_hold_ticks``: the choice (``best``, ``mode``, its ``distortion``), kept to the kind a probe
        switched to while no window of that kind is measured (``select(allowed)`` re-chooses among ``within``), and a
        note for the reason; records a probe that switches the kind now.

        Why: a probe's decision takes effect at the next report, so the next tick's window still ran the kind before;
        without evidence the prediction is the one the probe overrode, and it switched back at once, the draft's
        catch-up paid for nothing (29 of the 42 probes that switched in the live step loads of seeds 37-82, session
        44)."""
        note = ""
        plain_now = self._plain_in_force(active)
        if self._probe_switch is not None:
            probed_plain, at = self._probe_switch
            if self._last_seen(probed_plain) > at or self._ticks - at > self.probe_hold_ticks or plain_now != probed_plain:
                self._probe_switch = None
            elif mode != "meets" and bool(plain[best]) != probed_plain:
                same_kind = plain == probed_plain
                if (within & same_kind).any():
                    best, mode, distortion = select(same_kind)
                    note = "; held: the probe's kind until a window measures it"
        if probe is not None and self.current and bool(plain[best]) != plain_now:
            self._probe_switch = (bool(plain[best]), self._ticks)
        return best, mode, distortion, note

    def _hold(self, act_idx: Sequence[int], distortion: np.ndarray, best: int, time_s: float, delay: float,
              relax_since: dict[str, float]) -> tuple[np.ndarray, list[str], list[str]] | None:
        """With a ``delay`` (s): the candidates that keep every tier the choice ``best`` relaxes too soon at no less
        modelled distortion (``distortion``: [candidates, tiers]) than its point in force, those tiers' names and a
        note on each; None where no tier is held. Starts, continues or ends each tier's run of decisions wanting to
        relax, kept in ``relax_since`` (the time of each run's first decision)."""
        if delay <= 0 or not self.current:
            return None
        allowed: np.ndarray | None = None
        names: list[str] = []
        notes: list[str] = []
        for i in act_idx:
            name = self.tier_names[i]
            t_now, k_now = self.current.get(name, (math.nan, 0))
            in_force = self._point_distortion[name].get((k_now, t_now))
            if in_force is None or in_force <= 0 or distortion[best, i] >= in_force - 1e-9:
                relax_since.pop(name, None)  # nothing to relax from, or not relaxing: the run ends
                continue
            since = relax_since.setdefault(name, time_s)
            if time_s - since >= delay - 1e-9:
                relax_since.pop(name)  # relaxed now: a new point in force, a new run
                continue
            keep = distortion[:, i] >= in_force - 1e-9
            allowed = keep if allowed is None else allowed & keep
            names.append(name)
            notes.append(f"{name} at T={t_now:.3g} k={k_now} for {delay - (time_s - since):.2g} s")
        return None if allowed is None else (allowed, names, notes)

    def _capped(self, corrected_line: Any, tokens_model: np.ndarray, by_batch: np.ndarray | None,
                ks_plus_1: np.ndarray, shares: np.ndarray, stall: np.ndarray, catch_up: np.ndarray,
                switch: np.ndarray, batch: np.ndarray, lam: float, length: float,
                queue: float) -> tuple[np.ndarray, ...] | None:
        """Every candidate at a batch cap (``batch_cap``): the most rows at which it meets every TPOT target
        (margins and the switch margin in), where its load fits ``cap_utilisation`` of what those rows serve.
        Returns (use, rows, step, tokens, mean tokens, TPOT, wait ms) per candidate, or None
        where no tier has a TPOT target.

        Why: a request's TPOT is set by the rows it decodes beside, and a wait in the queue costs only TTFT.
        A burst that fills the batch past what the TPOT target allows is then served at no distortion
        where the TTFT target has room for its queue. The wait is the queue held now drained at the capped
        rows' request rate, as without a cap (a steady-state M/M/c wait on top read the replays' bursts as
        TTFT misses that the capped static point did not have)."""
        targets = [(i, float(tier.tpot_ms), self.margin[name]) for i, name in enumerate(self.tier_names)
                   if shares[i] > 0 and (tier := self.slo.tiers[name]).tpot_ms is not None]
        if not targets:
            return None
        n = batch.shape[0]

        def at(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            f, p = corrected_line(rows)
            tokens = self._tokens_at(by_batch, rows, ks_plus_1) if by_batch is not None else tokens_model
            step = f + p * rows
            tpot = (step / (1.0 - stall))[:, None] / tokens + catch_up[:, None]
            return step, tokens, row_sums(tokens * shares), tpot

        rows_ok = np.zeros(n)
        for r in range(1, self.max_batch + 1):
            _, _, _, tpot = at(np.full(n, float(r)))
            ok = np.ones(n, dtype=bool)
            for i, target, m in targets:
                ok &= m * tpot[:, i] * switch <= target
            rows_ok = np.where(ok, float(r), rows_ok)
        step, tokens, mean_tokens, tpot = at(np.maximum(rows_ok, 1.0))
        service_s = length * step / (1000.0 * mean_tokens)  # one request's decode at the capped rows
        offered = lam * service_s  # rows the load keeps busy on average
        use = (rows_ok >= 1) & (offered < self.cap_utilisation * rows_ok)
        rate = rows_ok / service_s  # requests per second the capped rows serve
        wait_s = np.where(use, queue / np.where(use, rate, 1.0), np.inf)
        return use, rows_ok, step, tokens, mean_tokens, tpot, 1000.0 * wait_s

    # ------------------------------------------------------------------ replicas

    def _steady_meets(self, ks: np.ndarray, tokens: np.ndarray, shares: np.ndarray, act_idx: Sequence[int],
                      lam: float) -> np.ndarray:
        """[n] bool: candidates ``ks``/``tokens`` [n, tiers] predicted to meet every active tier's
        targets in steady state at ``lam`` requests/s per replica: no queue, the batch from Little's
        law, the same step model, corrections, prefill and margins as :meth:`decide` (which also
        sees the queue and the measured shortfall). ``tokens`` are :meth:`decide`'s, at the batch it
        planned for the load now (a batch-dependent model is not re-read at each count)."""
        length = self.mean_output_tokens if math.isfinite(self.mean_output_tokens) else 200.0
        k_max = np.where(shares > 0, ks, 0).max(axis=1)
        mean_tokens = (tokens * shares).sum(axis=1)
        x = lam * length / (1000.0 * mean_tokens)
        near = np.ones(ks.shape[0])  # the plain step's segment: at one row, then at the batch planned
        for _ in range(2 if self.model.cost.plain_ms_by_batch or self.step_fit == "batch" else 1):
            fixed_correction, per_row_correction = self._step_correction(k_max, batch=near)
            fixed = self._step_ms(ks, shares, 0.0, near)
            f, p = corrected_step_line(fixed, self._step_ms(ks, shares, 1.0, near) - fixed, fixed_correction,
                                       per_row_correction)
            denom = 1.0 - x * p
            with np.errstate(divide="ignore", invalid="ignore"):
                little = np.where(denom > 0, np.maximum(x * f / denom, 0.0), np.inf)  # >= 0: see decide
            planned = little + self.batch_z * np.sqrt(np.where(np.isfinite(little), little, 0.0))
            near = np.clip(planned, 1.0, float(self.max_batch))
        ok = little <= self.max_batch
        step = f + p * near
        stall = self._stall(lam, act_idx, ks, shares)
        for i in act_idx:
            name = self.tier_names[i]
            tier = self.slo.tiers[name]
            m = self.margin[name]
            if tier.tpot_ms is not None:
                ok &= m * step / tokens[:, i] / (1.0 - stall) <= tier.tpot_ms
            if tier.ttft_ms is not None:
                ok &= m * _TTFT_STEPS * step + self.prefill_ms[name] <= tier.ttft_ms
        return np.asarray(ok, dtype=bool)

    def _plan_replicas(self, ks: np.ndarray, tokens: np.ndarray, distortion: np.ndarray, shares: np.ndarray,
                       act_idx: Sequence[int], serving: int) -> int | None:
        """The replica count to ask for (module docstring), or None without ``max_replicas``."""
        high_bound = self.max_replicas
        if high_bound is None:
            return None
        if self._time_sum < self.min_observed_s or not math.isfinite(self.total_arrival_rate):
            # Too little seen for a rate (one early arrival reads as a flood): hold the fleet.
            self.replicas_wanted = min(max(serving, self.min_replicas), high_bound)
            return self.replicas_wanted
        # Every active tier at its least modelled distortion (T at its floor; any k).
        least = distortion[:, act_idx].min(axis=0)
        base = np.flatnonzero(np.all(distortion[:, act_idx] <= least + 1e-12, axis=1))
        ks_b, tokens_b = ks[base], tokens[base]

        def fewest(rate: float) -> int:
            def fits(replicas: int) -> bool:
                return bool(self._steady_meets(ks_b, tokens_b, shares, act_idx, rate / replicas).any())

            # Feasibility only grows with the count (less load on each): bisect [min, max].
            low, high = self.min_replicas, high_bound
            if fits(low):
                return low
            if not fits(high):
                return high  # not even the most replicas meet it: ask for all of them
            while high - low > 1:
                mid = (low + high) // 2
                low, high = (low, mid) if fits(mid) else (mid, high)
            return high

        wanted = fewest(self.total_arrival_rate)
        if self.replicas_wanted is not None and wanted < self.replicas_wanted:
            # Hysteresis: come down only to a count that fits some more load than measured.
            wanted = min(self.replicas_wanted, fewest(self.total_arrival_rate * (1.0 + self.scale_down_slack)))
        self.replicas_wanted = wanted
        return wanted

    def params(self) -> dict[str, Any]:
        return {
            "model": self.model.source,
            "max_batch": self.max_batch,
            "prompt_tokens": self.prompt_tokens,
            "initial_margin": self.initial_margin,
            "margin_gain_up": self.margin_gain_up,
            "margin_gain_down": self.margin_gain_down,
            "margin_limits": list(self.margin_limits),
            "budget_margin": self.budget_margin,
            "alpha": self.alpha,
            "rate_decay": self.rate_decay,
            "step_decay": self.step_decay,
            "step_slope_prior": self.step_slope_prior,
            "draft_slope_prior": self.draft_slope_prior,
            "draft_prior": self.draft_prior,
            "switch_margin": self.switch_margin,
            "probe_after": self.probe_after,
            "probe_hold_ticks": self.probe_hold_ticks,
            "min_samples": self.min_samples,
            "batch_z": self.batch_z,
            "short_enter": self.short_enter,
            "short_exit": self.short_exit,
            "t_grid": list(self.t_grid),
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "scale_down_slack": self.scale_down_slack,
            "look_ahead_windows": self.look_ahead_windows,
            "rate_z": self.rate_z,
            "best_effort_relax_s": self.best_effort_relax_s,
            "higher_t_ties": self.higher_t_ties,
            "batch_cap": self.batch_cap,
            "cap_utilisation": self.cap_utilisation,
            "rate_prior_s": self.rate_prior_s,
            "rate_rise_decay": self.rate_rise_decay,
            "queue_joins": self.queue_joins,
            "step_fit": self.step_fit,
            "relax_delay_s": self.relax_delay_s,
            "stall_windows": self.stall_windows,
            "hard_requests": self.hard_requests,
        }

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"ModelPredictivePolicy({inner})"
