"""A replica's performance profile: how many tokens an FSD iteration emits, what it costs, and how much
it distorts — the only model of the decoder the simulator has.

Schema (``schema_version: 1``; documented field by field in docs/sim.md):

- ``acceptance``: one entry per (div, k, T) grid point with ``position_accept[i]`` =
  P(draft position i+1 accepted | positions 1..i accepted) for i = 0..k-1, and ``mean_distortion``
  = mean per-emitted-token TV distortion at that point (0 at T = 0 by construction of FSD).
- ``latency``: draft time per iteration ``k·(draft_a_ms + draft_b_ms·B)``, verify time per iteration
  ``verify_a_ms + verify_b_ms·B + verify_c_ms·k·B`` for a batch of B sequences, and prefill cost
  ``prefill_fixed_ms + prefill_ms_per_token`` per prompt token. With ``draft_prefill_*`` measured
  (calibration that times joins at k = 0 apart from joins at k > 0) the prefill terms are the target's
  and the draft's prefill is its own: a request joining at k = 0 skips it, and the draft catches up on
  the tokens it has not seen (prompt and output) when the row first drafts. Without them the prefill
  terms are target and draft together, charged at every join, and no catch-up is modelled.
- k = 0 is plain target decoding: one target token per step, no draft, zero distortion, step time
  ``plain_step_a_ms + plain_step_b_ms·B`` when calibration measured it, else *derived* from the fitted
  target forward, ``verify_a_ms + verify_b_ms·B`` (the verify model at k = 0; the shipped profiles
  predate k = 0 calibration, see :attr:`Profile.plain_decoding_source`). It needs no acceptance rows.
- A batch mixing draft lengths (per-row k): the draft model runs ``k_max`` steps over the rows that
  draft, the verify forward is as wide as each row's own k (see :meth:`LatencyModel.mixed_coeffs`).

Tokens emitted by one iteration for one sequence = accepted drafts A (0..k) + 1 (the target's
recovered token on the first rejection, or the bonus token when all k are accepted), so 1..k+1.
Between measured T grid points, acceptance and distortion are interpolated linearly in T (which keeps
them monotone when the grid is monotone — validated); beyond the largest T they stay at the last point.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fsd_common.validation import format_validation_error

if TYPE_CHECKING:
    from policies.feedforward import LinearLatencyModel, SpeedCurve
    from policies.operating_model import OperatingModel

PROFILES_DIR = Path(__file__).parent / "profiles"
# Calibrated on the engine (``fsd calibrate``): SmolLM2-135M fp32 → int8, one torch thread, 2-core CPU.
DEFAULT_PROFILE_PATH = PROFILES_DIR / "smollm2-135m.json"
# The same pair with the draft on its own KV cache (``model.share_kv: false``; the default until session 26):
# the draft prefills apart and catches up on what rows emitted at k = 0 (calibrated 2026-12-03, AVX2).
SEPARATE_KV_PROFILE_PATH = PROFILES_DIR / "smollm2-135m-separate-kv.json"
# Hand-made from ../shared/MEASURED.md (bare forwards at 2 threads, ~3x faster iterations than the
# calibrated one-thread replica): the "what if each replica had two quiet cores" scenario the shipped
# SLOSpec.default() tiers are sized for; the simulator tests and policy comparison use it.
HANDMADE_2THREADS_PROFILE_PATH = PROFILES_DIR / "handmade_smollm2_2threads.json"


class Provenance(BaseModel):
    """Where a profile's numbers came from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pair: str = Field(..., description="target → draft model pair")
    dtype: str = ""
    machine: str = ""
    torch_version: str = ""
    transformers_version: str = ""
    date: str = ""
    source: Literal["hand-made from MEASURED.md", "calibrated"]
    notes: str = ""
    command: str = Field("", description="command line that produced the profile (calibrated profiles)")


class AcceptancePoint(BaseModel):
    """Acceptance and distortion at one (div, k, T) grid point."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    div: str = Field(..., min_length=1, description="divergence name, e.g. 'kl'")
    k: int = Field(..., ge=1, description="draft length")
    threshold: float = Field(..., ge=0, description="FSD threshold T")
    position_accept: list[float] = Field(
        ..., description="P(position i accepted | positions < i accepted), length k"
    )
    mean_distortion: float = Field(..., ge=0, description="mean TV distortion per emitted token")
    distorted_per_token: float | None = Field(
        None,
        ge=0,
        le=1,
        description="fraction of emitted tokens that carry distortion (D <= T, TV > 0); with it the simulator "
        "draws distortion per token instead of charging every token the mean",
    )

    @field_validator("threshold", "mean_distortion")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"must be finite, got {v}")
        return v

    @field_validator("position_accept")
    @classmethod
    def _probabilities(cls, v: list[float]) -> list[float]:
        for p in v:
            if not (0.0 <= p <= 1.0):
                raise ValueError(f"position_accept values must be probabilities in [0, 1], got {p}")
        return v

    @model_validator(mode="after")
    def _length_is_k(self) -> AcceptancePoint:
        if len(self.position_accept) != self.k:
            raise ValueError(
                f"position_accept has {len(self.position_accept)} entries but k = {self.k}"
            )
        return self


class LatencyModel(BaseModel):
    """Iteration and prefill cost for a batch of B sequences at draft length k (all in ms)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    draft_a_ms: float = Field(..., ge=0, description="per draft step, fixed part")
    draft_b_ms: float = Field(..., ge=0, description="per draft step, per sequence in the batch")
    verify_a_ms: float = Field(..., ge=0, description="verify forward, fixed part")
    verify_b_ms: float = Field(..., ge=0, description="verify forward, per sequence")
    verify_c_ms: float = Field(..., ge=0, description="verify forward, per sequence per drafted token")
    prefill_ms_per_token: float = Field(
        ..., ge=0, description="prefill per prompt token: the target's when draft_prefill_* are measured, else "
        "target and draft together"
    )
    prefill_fixed_ms: float = Field(0.0, ge=0, description="fixed cost of a prefill call")
    draft_prefill_ms_per_token: float = Field(
        0.0, ge=0, description="the draft's forward over tokens it has not seen (its prefill at a join with k > 0, "
        "its catch-up when a row that ran at k = 0 drafts), per token of the padded feed; 0: not measured"
    )
    draft_prefill_fixed_ms: float = Field(0.0, ge=0, description="fixed cost of that draft forward")
    plain_step_a_ms: float | None = Field(
        None, ge=0, description="k = 0 (plain target decoding) step, fixed part; None: verify_a_ms (derived)"
    )
    plain_step_b_ms: float | None = Field(
        None, ge=0, description="k = 0 step, per sequence; None: verify_b_ms (derived)"
    )
    plain_step_ms_by_batch: list[float] | None = Field(
        None, description="k = 0 step measured at 1, 2, … rows (interpolated between measured batch sizes): "
        "the plain step is piecewise linear through them and grows by plain_step_b_ms per row beyond the "
        "last (policies.operating_model.plain_step_line); None: the line plain_step_a_ms + plain_step_b_ms·B"
    )
    prefill_ms_by_tokens: list[tuple[float, float]] | None = Field(
        None, description="(prompt tokens, ms) of the target's prefill as measured, ascending in tokens: a "
        "join's prefill is piecewise linear through them, the first point's below it and grows by "
        "prefill_ms_per_token beyond the last (the line misses short prompts: a fixed cost the fitted "
        "intercept does not carry); None: the line prefill_fixed_ms + prefill_ms_per_token · tokens"
    )
    iteration_time_dist: Literal["fixed", "exponential"] = Field(
        "fixed",
        description="'fixed': every iteration takes the model's time; 'exponential': the model's time is "
        "the mean of an exponential draw (queueing-theory checks)",
    )
    # A serving machine's departure from its calibration (benchmarks/step_ratios.py --noise measures it from live
    # windows): a decode iteration's time is the model's × the shape of its kind at its rows × the replica's own
    # speed × a slow drift × jitter.
    plain_step_scale_by_batch: list[float] | None = Field(
        None, description="multiplier of a plain (k = 0) decode step's modelled time at 1, 2, … rows (beyond the "
        "last, the last): the shape a serving machine's plain steps take against the calibration's; None: 1"
    )
    speculative_step_scale_by_batch: list[float] | None = Field(
        None, description="the same for speculative steps (some row drafts); None: 1"
    )
    step_offset_sigma: float = Field(
        0.0, ge=0, le=2, description="spread of each replica's own speed factor on every iteration (prefills too), "
        "drawn once when it starts: log-normal with mean 1 (live: runs of one machine differ); 0: none"
    )
    step_drift_sigma: float = Field(
        0.0, ge=0, le=2, description="stationary spread of a slow per-replica speed factor on every iteration "
        "(prefills too): log-normal with mean 1, an Ornstein-Uhlenbeck process in its log; 0: none"
    )
    step_drift_tau_s: float = Field(30.0, gt=0, description="that drift's correlation time (s)")
    step_jitter_sigma: float = Field(
        0.0, ge=0, le=2, description="each iteration's own log-normal factor (mean 1), independent between "
        "iterations; 0: none"
    )
    speculative_step_jitter_sigma: float | None = Field(
        None, ge=0, le=2, description="that jitter's spread on speculative steps (a plain step is one short "
        "forward, a speculative one several: live, their spreads differ by ~3x); None: step_jitter_sigma"
    )

    def plain_coeffs(self) -> tuple[float, float]:
        """``(fixed, per_seq)`` of a k = 0 step: measured, else the verify model at k = 0."""
        a = self.verify_a_ms if self.plain_step_a_ms is None else self.plain_step_a_ms
        b = self.verify_b_ms if self.plain_step_b_ms is None else self.plain_step_b_ms
        return a, b

    @field_validator("plain_step_ms_by_batch")
    @classmethod
    def _positive_steps(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and (not v or not all(math.isfinite(x) and x > 0 for x in v)):
            raise ValueError(f"plain_step_ms_by_batch must be a non-empty list of finite steps > 0, got {v}")
        return v

    @field_validator("plain_step_scale_by_batch", "speculative_step_scale_by_batch")
    @classmethod
    def _positive_scales(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and (not v or not all(math.isfinite(x) and x > 0 for x in v)):
            raise ValueError(f"a step scale by batch must be a non-empty list of finite multipliers > 0, got {v}")
        return v

    @property
    def varies_steps(self) -> bool:
        """Whether iterations depart from the model's time (a shape by batch, offset, drift or jitter)."""
        return (self.plain_step_scale_by_batch is not None or self.speculative_step_scale_by_batch is not None
                or self.step_offset_sigma > 0 or self.step_drift_sigma > 0 or self.step_jitter_sigma > 0
                or bool(self.speculative_step_jitter_sigma))

    def step_scale_table(self, max_batch: int) -> np.ndarray:
        """[2, max_batch + 1] the shapes' multipliers (row 0 plain steps, row 1 speculative) at 0 .. max_batch rows
        (1 where a shape is not given; column 0 unused)."""
        table = np.ones((2, max_batch + 1))
        for kind, given in enumerate((self.plain_step_scale_by_batch, self.speculative_step_scale_by_batch)):
            if given:
                for rows in range(1, max_batch + 1):
                    table[kind, rows] = given[min(rows, len(given)) - 1]
        return table

    @field_validator("prefill_ms_by_tokens")
    @classmethod
    def _ascending_prefills(cls, v: list[tuple[float, float]] | None) -> list[tuple[float, float]] | None:
        if v is None:
            return v
        ok = bool(v) and all(math.isfinite(t) and math.isfinite(ms) and t > 0 and ms > 0 for t, ms in v)
        if not ok or any(b[0] <= a[0] for a, b in zip(v, v[1:], strict=False)):
            raise ValueError("prefill_ms_by_tokens must be a non-empty list of (tokens, ms) pairs, finite and > 0, "
                             f"strictly ascending in tokens, got {v}")
        return v

    def iteration_ms(self, batch: np.ndarray | int | float, k: int) -> np.ndarray:
        """Mean time of one draft+verify iteration (a plain step at k = 0) for batch sizes ``batch``."""
        b = np.asarray(batch, dtype=float)
        if k == 0 and self.plain_step_ms_by_batch:
            fixed, per_row = self.plain_line(b)
            return np.asarray(fixed + per_row * b, dtype=float)
        fixed_ms, per_seq = self.iteration_coeffs(k)
        return np.asarray(fixed_ms + per_seq * b, dtype=float)

    def plain_line(self, batch: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
        """(fixed, per row) of the plain step's segment at ``batch`` rows (one line without a table)."""
        from policies.operating_model import plain_step_line

        a, b = self.plain_coeffs()
        return plain_step_line(self.plain_step_ms_by_batch or (), a, b, batch)

    def plain_table(self, max_batch: int) -> np.ndarray | None:
        """[max_batch + 1] plain step ms at 0 .. max_batch rows (None without measured steps per batch)."""
        if not self.plain_step_ms_by_batch:
            return None
        rows = np.arange(max_batch + 1, dtype=float)
        table = self.iteration_ms(rows, 0)
        table[0] = 0.0
        return np.asarray(table, dtype=float)

    def iteration_coeffs(self, k: int) -> tuple[float, float]:
        """``(fixed, per_seq)`` with iteration_ms(B, k) = fixed + per_seq · B (every row at k; at k = 0
        with measured steps per batch this is the least-squares line, and :meth:`plain_line` the step)."""
        if k == 0:
            return self.plain_coeffs()
        return (
            k * self.draft_a_ms + self.verify_a_ms,
            k * self.draft_b_ms + self.verify_b_ms + self.verify_c_ms * k,
        )

    def mixed_coeffs(self, ks: np.ndarray) -> tuple[float, np.ndarray]:
        """``(fixed, per_row)`` of one step over rows with draft lengths ``ks`` ([B]): step ms = fixed +
        Σ per_row over the rows in the step.

        The draft model runs ``k_max`` steps (rows with a smaller k idle in them, as a padded batch
        does), over every row with k > 0; the verify forward is ``1 + k_r`` tokens wide per row. All
        rows at one k reproduce :meth:`iteration_coeffs`; all at k = 0 is a plain step.
        """
        k_max = int(ks.max()) if ks.size else 0
        if k_max == 0:
            a, b = self.plain_coeffs()
            return a, np.full(ks.shape, b)
        per_row = self.verify_b_ms + self.verify_c_ms * ks + (ks > 0) * (k_max * self.draft_b_ms)
        return k_max * self.draft_a_ms + self.verify_a_ms, per_row.astype(float)

    def speculative_step_ms(self, rows: np.ndarray, verify_tokens: np.ndarray, draft_forwards: np.ndarray,
                            drafting_rows: np.ndarray) -> np.ndarray:
        """:meth:`mixed_coeffs`' step from what the steps held (arrays, one entry per step): ``rows``, Σ k_r
        over them, ``k_max``, the rows with k > 0. Only for steps where some row drafts (``k_max`` > 0)."""
        ms = self.verify_a_ms + draft_forwards * self.draft_a_ms + rows * self.verify_b_ms
        ms += verify_tokens * self.verify_c_ms + draft_forwards * drafting_rows * self.draft_b_ms
        return np.asarray(ms, dtype=float)

    def prefill_ms(self, prompt_tokens: int, drafting_tokens: int | None = None) -> float:
        """A join's prefill of ``prompt_tokens``; ``drafting_tokens`` of them belong to rows joining at k > 0
        (the draft prefills those too; None: all of them)."""
        ms = self.target_prefill_ms(prompt_tokens)
        drafting = prompt_tokens if drafting_tokens is None else drafting_tokens
        if drafting > 0 and self.models_draft_prefill:
            ms += self.draft_catch_up_ms(drafting)
        return ms

    def target_prefill_ms(self, prompt_tokens: float) -> float:
        """The target's prefill of ``prompt_tokens``: through the measured points where the profile has them,
        else the line."""
        if not self.prefill_ms_by_tokens:
            return self.prefill_fixed_ms + self.prefill_ms_per_token * prompt_tokens
        tokens, ms = self._prefill_points
        if prompt_tokens >= tokens[-1]:
            return float(ms[-1] + self.prefill_ms_per_token * (prompt_tokens - tokens[-1]))
        return float(np.interp(prompt_tokens, tokens, ms))

    @cached_property
    def _prefill_points(self) -> tuple[np.ndarray, np.ndarray]:
        """``prefill_ms_by_tokens`` as two arrays, built once (a join's prefill is read once per segment)."""
        points = np.asarray(self.prefill_ms_by_tokens, dtype=float)
        return points[:, 0], points[:, 1]

    @property
    def models_draft_prefill(self) -> bool:
        """Whether the draft's prefill is measured apart (then joins at k = 0 skip it and catch-up costs)."""
        return self.draft_prefill_ms_per_token > 0 or self.draft_prefill_fixed_ms > 0

    def draft_catch_up_ms(self, fed_tokens: int) -> float:
        """One draft forward over ``fed_tokens`` unseen tokens (rows × padded width); 0 when not modelled."""
        if fed_tokens <= 0 or not self.models_draft_prefill:
            return 0.0
        return self.draft_prefill_fixed_ms + self.draft_prefill_ms_per_token * fed_tokens


_QUADRATURE_NODES = 256  # mid-quantile nodes of the per-request Beta (centring expectation)


class RequestAcceptance(BaseModel):
    """Per-request variation in acceptance: some requests are easy to draft for, some hard.

    Each request draws ``a ~ Beta(κ/2, κ/2)`` once (κ = ``concentration``) and runs every position at
    every (T, k) with the profile's acceptance shifted by ``logit(a)`` on the log-odds scale, plus a
    centring offset ``c`` per (T, k): ``α_r = expit(logit(α) + logit(a) + c)``. A request is easy (or
    hard) at every position and T alike; α = 0 and α = 1 stay put and acceptance stays monotone in T.
    Smaller κ = more spread (at α = 0.5 and c = 0 a request's acceptance is exactly Beta(κ/2, κ/2),
    standard deviation ``1 / (2·sqrt(κ + 1))``).

    **What is preserved**: the profile's tokens per step as calibration measures them, pooled over
    steps (``Σ tokens / Σ steps`` over requests of equal length: the harmonic mean of the requests'
    own means). ``c`` solves ``E_a[1 / n(a, c)] = 1 / n_profile``, so the simulator's measured
    acceptance and every request's mean TPOT stay the profile's; the variation widens the spread of
    TPOT across requests. (An uncentred shift would lower the mean: at α ≈ 0.9, κ = 4 by ~6 %.)
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    concentration: float = Field(..., gt=0, description="κ of the Beta(κ/2, κ/2) behind the log-odds shift")
    source: str = Field("", description="where κ came from (a fit, a guess)")

    @field_validator("concentration")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"must be finite, got {v}")
        return v

    @cached_property
    def _quadrature_odds(self) -> np.ndarray:
        """Odds ``a / (1 − a)`` at the mid-quantiles of Beta(κ/2, κ/2) (the expectation's nodes)."""
        return self._odds_at_quantiles((np.arange(_QUADRATURE_NODES) + 0.5) / _QUADRATURE_NODES)

    def _odds_at_quantiles(self, q: np.ndarray) -> np.ndarray:
        """Odds ``a / (1 − a)`` of the requests at quantiles ``q`` of ``a ~ Beta(κ/2, κ/2)`` (hardest first)."""
        from scipy.special import betaincinv

        half = self.concentration / 2.0
        a = np.clip(betaincinv(half, half, q), 1e-12, 1.0 - 1e-12)
        return np.asarray(a / (1.0 - a), dtype=float)

    def centring(self, position_accept: np.ndarray) -> float:
        """Odds multiplier ``exp(c)`` that keeps the step-pooled tokens per step at ``position_accept``'s
        (see the class docstring); 1.0 where nothing can move (k = 0, or every α at 0 or 1)."""
        alpha = np.asarray(position_accept, dtype=float)
        if alpha.size == 0 or np.all((alpha == 0.0) | (alpha == 1.0)) or alpha[0] == 0.0:
            return 1.0
        target = 1.0 / (1.0 + float(np.cumprod(alpha).sum()))
        nodes = self._quadrature_odds[:, None]

        def inverse_tokens(log_c: float) -> float:  # E_a[1 / n(a, c)], decreasing in c
            accept = shifted_acceptance(alpha[None, :], nodes * math.exp(log_c))
            return float(np.mean(1.0 / (1.0 + np.cumprod(accept, axis=1).sum(axis=1))))

        low, high = -30.0, 30.0
        for _ in range(60):  # bisection to ~5e-17 in log-odds
            mid = 0.5 * (low + high)
            if inverse_tokens(mid) > target:
                low = mid
            else:
                high = mid
        return math.exp(0.5 * (low + high))

    def odds_scale_at(self, quantile: float) -> float:
        """The odds multiplier ``a / (1 − a)`` of the request at ``quantile`` of ``a`` (hardest first)."""
        if not (0.0 < quantile < 1.0):
            raise ValueError(f"quantile must be in (0, 1), got {quantile}")
        return float(self._odds_at_quantiles(np.array([quantile]))[0])

    def draw_odds_scales(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """[n] per-request odds multipliers ``a / (1 − a)`` (= exp of the log-odds shift)."""
        half = self.concentration / 2.0
        a = rng.beta(half, half, size=n)
        # A Beta draw can round to exactly 0 or 1 at small κ: keep the odds finite and positive.
        a = np.clip(a, 1e-12, 1.0 - 1e-12)
        return np.asarray(a / (1.0 - a), dtype=float)


class BatchAcceptance(BaseModel):
    """Acceptance against the engine batch: the profile's acceptance is the one measured at
    ``reference_batch`` rows; at a batch of B rows every position's odds at T are multiplied by
    ``scale(B, T)``.

    Why it exists: an int8 *dynamic* draft (the default pair's) quantizes activations with one scale
    over the whole input tensor, i.e. over every row of the batch, so a row's draft distribution moves
    with its neighbours and agrees least with the target when the batch is full (docs/calibration.md,
    "Acceptance depends on the engine batch"). A draft with per-row quantization has no entry here.

    ``odds_scale[B]`` holds one multiplier per entry of ``thresholds`` (1 at the reference batch): in T
    linear between them and held beyond; in B the log-multiplier is linear in log B between measured
    batch sizes and held beyond. The multiplier grows with T on the default pair (a worse draft
    distribution costs fuzzy acceptance more than exact acceptance), so it is per threshold.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    reference_batch: int = Field(..., ge=1, description="engine batch the acceptance table was measured at")
    thresholds: list[float] = Field(..., min_length=1, description="T of each multiplier, increasing")
    odds_scale: dict[int, list[float]] = Field(
        ..., min_length=1, description="batch size -> odds multiplier per entry of thresholds")
    source: str = Field("", description="how the multipliers were measured (the command)")

    @field_validator("thresholds")
    @classmethod
    def _increasing(cls, v: list[float]) -> list[float]:
        if any(not (math.isfinite(t) and t >= 0) for t in v) or any(b <= a for a, b in zip(v, v[1:], strict=False)):
            raise ValueError(f"thresholds must be finite, >= 0 and increasing, got {v}")
        return v

    @field_validator("odds_scale")
    @classmethod
    def _positive(cls, v: dict[int, list[float]]) -> dict[int, list[float]]:
        for batch, scales in v.items():
            if batch < 1:
                raise ValueError(f"batch sizes must be >= 1, got {batch}")
            for scale in scales:
                if not (math.isfinite(scale) and scale > 0):
                    raise ValueError(f"odds multipliers must be finite and > 0, got {scale} at batch {batch}")
        return dict(sorted(v.items()))

    @model_validator(mode="after")
    def _consistent(self) -> BatchAcceptance:
        for batch, scales in self.odds_scale.items():
            if len(scales) != len(self.thresholds):
                raise ValueError(f"odds_scale[{batch}] has {len(scales)} entries for {len(self.thresholds)} thresholds")
        at_ref = self.odds_scale.get(self.reference_batch)
        if at_ref is None or any(abs(x - 1.0) > 1e-9 for x in at_ref):
            raise ValueError(
                f"odds_scale must hold 1.0 at the reference batch {self.reference_batch}, got {at_ref}"
            )
        return self

    def scale(self, batch: float, threshold: float) -> float:
        """The odds multiplier at an engine batch of ``batch`` rows (a mean batch may be fractional) and T."""
        if not (math.isfinite(batch) and batch >= 1):
            raise ValueError(f"batch must be finite and >= 1, got {batch}")
        return float(self.scales(np.array([float(batch)]), threshold)[0])

    def scales(self, batches: np.ndarray, threshold: float) -> np.ndarray:
        """Multipliers at ``batches`` (each >= 1) and T."""
        known = np.log(np.array(list(self.odds_scale), dtype=float))
        at_t = np.array([np.interp(threshold, self.thresholds, row) for row in self.odds_scale.values()])
        return np.asarray(np.exp(np.interp(np.log(batches), known, np.log(at_t))), dtype=float)


def shifted_acceptance(position_accept: np.ndarray, odds_scale: np.ndarray | float) -> np.ndarray:
    """``expit(logit(α) + log(odds_scale))`` elementwise, exact at α ∈ {0, 1} (broadcasts)."""
    scaled = position_accept * odds_scale
    return np.asarray(scaled / (scaled + (1.0 - position_accept)), dtype=float)


@dataclass(frozen=True, slots=True)
class _Grid:
    """One (div, k) slice of the acceptance table, sorted by T."""

    thresholds: np.ndarray  # [n_points]
    position_accept: np.ndarray  # [n_points, k]
    mean_distortion: np.ndarray  # [n_points]
    distorted_per_token: np.ndarray | None  # [n_points]; None unless every point has it


class Profile(BaseModel):
    """Acceptance, distortion and latency of one model pair on one machine (see module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = 1
    provenance: Provenance
    default_div: str = "kl"
    default_k: int = Field(4, ge=1)
    acceptance: list[AcceptancePoint] = Field(..., min_length=1)
    latency: LatencyModel
    replica_startup_s: float | None = Field(
        None, ge=0, description="time from asking for a replica to it serving (process start + model load), "
        "measured; the simulator's autoscaler uses it when the scenario states no startup_s")
    request_acceptance: RequestAcceptance | None = Field(
        None,
        description="per-request variation in acceptance (None: every request at the profile's acceptance)",
    )
    batch_acceptance: BatchAcceptance | None = Field(
        None,
        description="acceptance against the engine batch (None: the same at every batch size)",
    )
    calibration: dict[str, Any] | None = Field(
        None,
        description="raw measurements the acceptance and latency fields were fitted to, written by "
        "`fsd calibrate` (typed and documented in decoder/calibration.py); the simulator ignores it",
    )

    @model_validator(mode="after")
    def _grid_is_consistent(self) -> Profile:
        seen: set[tuple[str, int, float]] = set()
        for p in self.acceptance:
            key = (p.div, p.k, p.threshold)
            if key in seen:
                raise ValueError(f"acceptance: duplicate grid point div={p.div!r} k={p.k} T={p.threshold}")
            seen.add(key)
        for (div, k), grid in self._grids.items():
            if grid.thresholds[0] != 0.0:
                raise ValueError(f"acceptance: div={div!r} k={k} has no T = 0 point (standard SD)")
            if np.any(grid.mean_distortion[0] != 0.0):
                raise ValueError(f"acceptance: div={div!r} k={k} has mean_distortion != 0 at T = 0")
            if np.any(np.diff(grid.position_accept, axis=0) < -1e-12) or np.any(
                np.diff(grid.mean_distortion) < -1e-12
            ):
                raise ValueError(
                    f"acceptance: div={div!r} k={k} must be non-decreasing in T "
                    "(position_accept and mean_distortion)"
                )
        if (self.default_div, self.default_k) not in self._grids:
            raise ValueError(
                f"default_div={self.default_div!r} / default_k={self.default_k} not in the acceptance grid"
            )
        return self

    # ---- loading / saving (explicit; constructing a Profile touches no file) ----

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"profile file {str(path)!r} does not exist") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"profile file {str(path)!r} is not valid JSON: {exc}") from None
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ValueError(f"profile {str(path)!r}: {format_validation_error(exc, first_only=True)}") from None

    @classmethod
    def default(cls) -> Profile:
        """The shipped profile calibrated on the default pair (see its provenance)."""
        return cls.load(DEFAULT_PROFILE_PATH)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=2) + "\n")

    # ---- queries ----

    @cached_property
    def _grids(self) -> dict[tuple[str, int], _Grid]:
        groups: dict[tuple[str, int], list[AcceptancePoint]] = {}
        for p in self.acceptance:
            groups.setdefault((p.div, p.k), []).append(p)
        grids = {}
        for key, points in groups.items():
            points.sort(key=lambda p: p.threshold)
            grids[key] = _Grid(
                thresholds=np.array([p.threshold for p in points]),
                position_accept=np.array([p.position_accept for p in points]),
                mean_distortion=np.array([p.mean_distortion for p in points]),
                distorted_per_token=np.array([p.distorted_per_token for p in points])
                if all(p.distorted_per_token is not None for p in points)
                else None,
            )
        return grids

    def divs(self) -> list[str]:
        return sorted({div for div, _ in self._grids})

    @property
    def plain_decoding_source(self) -> str:
        """Where the k = 0 step time comes from: measured, or derived from the fitted verify forward."""
        lat = self.latency
        if lat.plain_step_a_ms is not None and lat.plain_step_b_ms is not None:
            return "measured"
        return "derived: verify_a_ms + verify_b_ms·B (the fitted target forward at k = 0; not measured)"

    def draft_lengths(self, div: str) -> list[int]:
        """Draft lengths with measured acceptance for ``div`` (k >= 1; see :meth:`available_draft_lengths`)."""
        return sorted(k for d, k in self._grids if d == div)

    def available_draft_lengths(self, div: str) -> list[int]:
        """Draft lengths the simulator can run for ``div``: 0 (plain decoding, always) and the measured k."""
        if div not in self.divs():
            raise ValueError(f"div {div!r} is not in the profile; known divs: {self.divs()}")
        return [0, *self.draft_lengths(div)]

    def thresholds(self, div: str, k: int) -> np.ndarray:
        if k == 0:
            self.available_draft_lengths(div)  # ValueError naming an unknown div
            return np.zeros(1)  # T has no effect at k = 0
        return self._grid(div, k).thresholds.copy()

    def _grid(self, div: str, k: int) -> _Grid:
        grid = self._grids.get((div, k))
        if grid is None:
            if div not in self.divs():
                raise ValueError(f"div {div!r} is not in the profile; known divs: {self.divs()}")
            raise ValueError(
                f"draft length k={k} is not in the profile for div {div!r}; "
                f"known k: {self.draft_lengths(div)}"
            )
        return grid

    def position_accept(self, div: str, threshold: float, k: int, batch: float | None = None) -> np.ndarray:
        """Per-position conditional acceptance at T = ``threshold`` (linear in T between grid points); at
        an engine batch of ``batch`` rows when given and the profile has :class:`BatchAcceptance`."""
        _check_threshold(threshold)
        if k == 0:
            return np.zeros(0)
        grid = self._grid(div, k)
        accept = np.array(
            [np.interp(threshold, grid.thresholds, grid.position_accept[:, i]) for i in range(k)]
        )
        if batch is not None and self.batch_acceptance is not None:
            accept = shifted_acceptance(accept, self.batch_acceptance.scale(batch, threshold))
        return accept

    def request_odds_centring(self, div: str, threshold: float, k: int) -> float:
        """:meth:`RequestAcceptance.centring` at (div, T, k), cached (1.0 without per-request variation)."""
        variation = self.request_acceptance
        if variation is None or k == 0:
            return 1.0
        # Keyed by κ as well: a model_copy with another variation may share this cache.
        key = (div, float(threshold), k, variation.concentration)
        cached = self._centring_cache.get(key)
        if cached is None:
            cached = variation.centring(self.position_accept(div, threshold, k))
            self._centring_cache[key] = cached
        return cached

    @cached_property
    def _centring_cache(self) -> dict[tuple[str, float, int, float], float]:
        return {}

    def tokens_per_iter_at_request_quantile(self, div: str, threshold: float, k: int, quantile: float) -> float:
        """Expected tokens per step of the request at ``quantile`` of per-request acceptance (hardest first;
        :class:`RequestAcceptance`): its odds shift and the centring applied to every position. The mean
        request's (:meth:`expected_tokens_per_iter`) without per-request variation or at k = 0."""
        variation = self.request_acceptance
        if variation is None or k == 0:
            return self.expected_tokens_per_iter(div, threshold, k)
        odds = variation.odds_scale_at(quantile) * self.request_odds_centring(div, threshold, k)
        accept = shifted_acceptance(self.position_accept(div, threshold, k), odds)
        return 1.0 + float(np.cumprod(accept).sum())

    def survival(self, div: str, threshold: float, k: int, batch: float | None = None) -> np.ndarray:
        """``S[i]`` = P(at least i+1 drafts accepted) = prod_{j<=i} position_accept[j]; length k."""
        return np.cumprod(self.position_accept(div, threshold, k, batch))

    def mean_distortion(self, div: str, threshold: float, k: int) -> float:
        _check_threshold(threshold)
        if k == 0:
            return 0.0  # plain target decoding emits exactly the target's law
        grid = self._grid(div, k)
        return float(np.interp(threshold, grid.thresholds, grid.mean_distortion))

    def distortion_events(self, div: str, threshold: float, k: int) -> tuple[float, float] | None:
        """``(p, size)``: each emitted token carries distortion ``size`` with probability ``p``, so the
        mean per token is ``mean_distortion``; None when the profile has no event fractions (mean only)."""
        _check_threshold(threshold)
        if k == 0:
            return (0.0, 0.0)
        grid = self._grid(div, k)
        if grid.distorted_per_token is None:
            return None
        mean = float(np.interp(threshold, grid.thresholds, grid.mean_distortion))
        p = float(np.interp(threshold, grid.thresholds, grid.distorted_per_token))
        if mean <= 0.0:
            return (0.0, 0.0)
        if p < mean:  # TV <= 1 per token, so p >= mean; a point that breaks it is charged the mean
            return (1.0, mean)
        return (p, mean / p)

    def expected_tokens_per_iter(self, div: str, threshold: float, k: int, batch: float | None = None) -> float:
        """E[accepted + 1] per sequence per iteration (at an engine batch of ``batch`` rows when given)."""
        return 1.0 + float(self.survival(div, threshold, k, batch).sum())

    def expected_acceptance_rate(self, div: str, threshold: float, k: int, batch: float | None = None) -> float:
        """E[accepted] / k (the 'acceptance rate' the decoder reports); NaN at k = 0 (nothing drafted)."""
        if k == 0:
            return math.nan
        return float(self.survival(div, threshold, k, batch).sum()) / k

    def tpot_ms(self, div: str, threshold: float, k: int, batch: int) -> float:
        """Mean time per output token of one sequence in a steady batch of ``batch`` (no prefills)."""
        return float(self.latency.iteration_ms(batch, k)) / self.expected_tokens_per_iter(div, threshold, k, batch)

    def to_speed_curve(self, div: str | None = None, k: int | None = None) -> SpeedCurve:
        """The policies package's plain-data ``SpeedCurve`` (tokens/iteration and distortion per T)."""
        from policies.feedforward import SpeedCurve, SpeedPoint

        div = div or self.default_div
        k = k or self.default_k
        return SpeedCurve(
            tuple(
                SpeedPoint(
                    threshold=float(t),
                    tokens_per_iteration=self.expected_tokens_per_iter(div, float(t), k),
                    mean_distortion=self.mean_distortion(div, float(t), k),
                )
                for t in self._grid(div, k).thresholds
            )
        )

    def to_operating_model(self, div: str | None = None, source: str = "") -> OperatingModel:
        """See :func:`to_operating_model`."""
        return to_operating_model(self, div, source)

    def to_latency_model(self, k: int | None = None) -> LinearLatencyModel:
        """The same iteration-time model in the feed-forward policy's ``(b − 1)`` parameterisation."""
        from policies.feedforward import LinearLatencyModel

        k = k or self.default_k
        lat = self.latency
        return LinearLatencyModel(
            draft_ms_per_token=lat.draft_a_ms + lat.draft_b_ms,
            verify_ms=lat.verify_a_ms + lat.verify_b_ms + lat.verify_c_ms * k,
            draft_ms_per_token_per_seq=lat.draft_b_ms,
            verify_ms_per_seq=lat.verify_b_ms + lat.verify_c_ms * k,
            draft_length=k,
        )


#: The per-request acceptance quantiles an operating model carries tokens per step at (hardest first): a tier's
#: attainment target of a reads the request at 1 − a (0.95: the 5 % hardest).
REQUEST_QUANTILES = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


def to_operating_model(profile: Profile, div: str | None = None, source: str = "") -> OperatingModel:
    """The model-predictive policy's plain-data model: (T, k) points of ``div`` (k = 0 included) and the
    step cost. Lives beside :class:`Profile` so the policies package never imports the simulator."""
    from policies.operating_model import OperatingModel, OperatingPoint, StepCost

    div = div or profile.default_div
    # Per-request spread (hard requests' tokens per step) where the profile measured one.
    quantiles = REQUEST_QUANTILES if profile.request_acceptance is not None else ()
    points = [OperatingPoint(threshold=0.0, k=0, tokens_per_step=1.0, mean_distortion=0.0,
                             tokens_per_step_by_quantile=(1.0,) * len(quantiles))]
    # With batch dependence: tokens per step at 1 .. the largest measured batch (held beyond it).
    batches = range(1, max(profile.batch_acceptance.odds_scale) + 1) if profile.batch_acceptance else range(0)
    for k in profile.draft_lengths(div):
        for t in profile.thresholds(div, k):
            points.append(OperatingPoint(
                threshold=float(t), k=k,
                tokens_per_step=profile.expected_tokens_per_iter(div, float(t), k),
                mean_distortion=profile.mean_distortion(div, float(t), k),
                tokens_per_step_by_batch=tuple(profile.expected_tokens_per_iter(div, float(t), k, b) for b in batches),
                tokens_per_step_by_quantile=tuple(
                    profile.tokens_per_iter_at_request_quantile(div, float(t), k, q) for q in quantiles),
            ))
    lat = profile.latency
    plain_a, plain_b = lat.plain_coeffs()
    cost = StepCost(
        draft_fixed_ms=lat.draft_a_ms, draft_per_seq_ms=lat.draft_b_ms, verify_fixed_ms=lat.verify_a_ms,
        verify_per_seq_ms=lat.verify_b_ms, verify_per_token_ms=lat.verify_c_ms, plain_fixed_ms=plain_a,
        plain_per_seq_ms=plain_b, prefill_fixed_ms=lat.prefill_fixed_ms, prefill_ms_per_token=lat.prefill_ms_per_token,
        draft_prefill_fixed_ms=lat.draft_prefill_fixed_ms, draft_prefill_ms_per_token=lat.draft_prefill_ms_per_token,
        plain_ms_by_batch=tuple(lat.plain_step_ms_by_batch or ()),
    )
    return OperatingModel(points=tuple(points), cost=cost,
                          source=source or f"{profile.provenance.pair} (div {div}; k = 0 {profile.plain_decoding_source})",
                          request_quantiles=quantiles)


def _check_threshold(threshold: float) -> None:
    if not (math.isfinite(threshold) and threshold >= 0):
        raise ValueError(f"threshold must be finite and >= 0, got {threshold}")

