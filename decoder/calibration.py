"""Calibration: measure a model pair with the real engine on this machine, for the simulator's Profile.

This module measures (raw counts and timings, :func:`measure`); ``sim/profile_fit.py`` fits the Profile
from them (the isotonic and least-squares fits described below live there), so the simulator stays
torch-free and this module never imports sim/. ``fsd calibrate`` runs both.

Everything is measured through :meth:`decoder.engine.FSDEngine.step`, the loop a serving replica drives,
so the profile describes what a replica does, bookkeeping included. Two sweeps:

Acceptance (per divergence ``div``, draft length ``k`` and threshold ``T``)
    Acceptance does not depend on the batch size, only on the pair, the sampling settings and the text,
    so it is measured at one batch size with as many tokens as the budget allows. Each (prompt, T) is
    one request carrying its own threshold, so a whole T grid for one (div, k) runs as a single
    continuously batched workload. The requests of one prompt share their sampling seed across T, k and
    div (common random numbers: differences between grid points are less noisy than their values).

    *Per-position acceptance.* Each row-iteration accepts the leading ``A`` of its ``k`` drafts
    (0..k). Draft position ``i`` (0-based) is *tried* when ``A >= i`` and *accepted* when
    ``A >= i + 1``, so the estimate ``p_i = #{A >= i+1} / #{A >= i}`` is the maximum-likelihood
    estimate under the profile's model (independent per-position Bernoulli trials up to the first
    failure); without censoring, ``1 + sum_i prod_{j<=i} p_j`` reproduces the measured tokens per
    iteration exactly. *Censoring*: when a request ends inside a block (eos, ``max_new_tokens`` or a
    stop string cuts it after an accepted draft), the step reports ``accepted == tokens emitted`` and
    only ``A >= accepted`` is known. Such a row-iteration counts as tried-and-accepted at positions
    ``< accepted`` and is not counted beyond (the product-limit / Kaplan-Meier estimator). Dropping
    it instead would bias acceptance down, since long accepted runs are the likeliest to hit the end.

    *Monotone in T.* The profile requires acceptance and distortion non-decreasing in T (each
    position's acceptance probability is, context by context: the fuzzy branch only adds accepts),
    but neighbouring grid points are noisy. The fitted value per position is the weighted isotonic
    regression over T of the raw estimates with weights = trials, which for binomial data is the
    maximum-likelihood estimate under the monotonicity constraint. Raw counts stay in the profile's
    ``calibration`` record.

    *Distortion.* Mean TV distortion per emitted token = sum of the engine's exact per-position
    distortion / tokens emitted (all row-iterations; censoring does not bias it), also made monotone
    in T by weighted isotonic regression (weights = tokens). At T = 0 it is zero by construction.

Latency (per ``k`` and batch size ``B``)
    ``B`` requests that ignore eos fill a batch of exactly ``B`` rows; after a warm-up iteration,
    ``timing_iterations`` steps are timed. The engine reports draft, verify and prefill time per step;
    the rest of the step's wall time (acceptance bookkeeping, emission, cache row moves) is *overhead*,
    and the profile's verify terms absorb it, so draft + verify = a whole step as serving sees it. Fits
    (non-negative least squares, the profile's own model, raw points kept):

    - draft  ``= k · (draft_a + draft_b · B)``
    - verify + overhead ``= verify_a + verify_b · B + verify_c · k · B``
    - prefill ``= prefill_fixed + prefill_per_token · prompt tokens`` per admission step (the engine
      prefills all joining requests in one left-padded batch on each model, as the simulator charges
      one prefill per group of joiners). Points: the timing runs' admissions of B equal prompts, and
      single prompts of ``prefill_lengths`` tokens. Admissions at k = 0 run the target's prefill alone
      (the draft skips the prompt until the row drafts), those at k > 0 both: the fit separates the
      draft's part, which is also what a row pays to catch up when it starts drafting.

The sampling temperature defaults to 1.0, the serving API's default (OpenAI's), because acceptance
depends on it; the profile records it.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from decoder.acceptance import DIVERGENCES
from decoder.engine import FSDEngine, RowStats, SamplingParams, StepStats, default_share_kv
from decoder.models import ModelPair
from fsd_common.validation import format_validation_error

#: The engine's divergence names, in its order.
KNOWN_DIVS: tuple[str, ...] = tuple(DIVERGENCES)

#: Default T grids. kl is unbounded (SmolLM2's int8 self-draft has median KL ≈ 2.5, so 8 is close to
#: accept-all); js ≤ ln 2 ≈ 0.693 and draft_tokens = |p(x) − q(x)| ≤ 1, so their last points accept all.
DEFAULT_THRESHOLDS: dict[str, tuple[float, ...]] = {
    "kl": (0.0, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 4.0, 8.0),
    "reverse_kl": (0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0),
    "js": (0.0, 0.02, 0.05, 0.1, 0.2, 0.35, 0.7),
    "tv": (0.0, 0.05, 0.1, 0.2, 0.35, 0.5, 1.0),
    "draft_tokens": (0.0, 0.01, 0.03, 0.1, 0.2, 0.4, 1.0),
}

#: The fixed prompt set (chat and code, asking for long answers so few requests end early).
CALIBRATION_PROMPTS: tuple[str, ...] = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash map works and what happens when two keys collide.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and tests.",
    "Describe the water cycle to a ten-year-old, step by step.",
    "What are the main differences between TCP and UDP? Give examples of when to use each.",
    "Write a recipe for a vegetable soup, with a list of ingredients and numbered steps.",
    "Implement binary search in JavaScript and explain its time complexity.",
    "Give me ten tips for writing clear technical documentation.",
    "Summarise the causes and consequences of the French Revolution.",
    "Write a SQL query that finds the top five customers by total order value, and explain it.",
    "Explain what a neural network is, starting from a single neuron.",
    "Write a polite email to a colleague asking them to review a pull request by Friday.",
    "Write a bash script that backs up a directory into a dated tar.gz archive.",
    "Compare the planets of the solar system by size, distance from the sun and number of moons.",
    "Explain recursion with three examples in Python.",
    "Write a dialogue between a cat and a dog arguing about who is the better pet.",
)


# ---------------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------------


class CalibrationSettings(BaseModel):
    """What to sweep and how hard (validated; errors name the field)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    divs: tuple[str, ...] = ("kl", "js", "draft_tokens")
    thresholds: dict[str, tuple[float, ...]] = Field(
        default_factory=lambda: dict(DEFAULT_THRESHOLDS), description="T grid per div (T = 0 is always added)"
    )
    ks: tuple[int, ...] = (2, 4, 6)
    acceptance_ks: tuple[int, ...] | None = Field(
        None, description="draft lengths of the acceptance sweep (None: ks); timing always sweeps ks"
    )
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    plain_decoding: bool = Field(
        True, description="also time k = 0 (plain target decoding, no draft forward) at every batch size"
    )
    prompts: int = Field(6, ge=1, description="prompts per grid point (at most the prompt set's size)")
    prompt_texts: tuple[str, ...] | None = Field(
        None, description="the acceptance sweep's prompts (None: CALIBRATION_PROMPTS). Acceptance depends on what is "
        "asked: calibrate on prompts like the traffic served (a profile measured on other prompts mispredicts it)")
    samples_per_prompt: int = Field(
        1, ge=1, description="requests per prompt and grid point, each with its own sampling seed (more data from "
        "a small prompt set)")
    max_new_tokens: int = Field(40, ge=2, description="tokens per acceptance request")
    acceptance_batch_size: int = Field(8, ge=1, description="engine batch of the acceptance sweep")
    timing_iterations: int = Field(6, ge=1, description="timed steps per (k, batch size) after a warm-up")
    timing_prompt_tokens: int = Field(128, ge=2, description="prompt length of the timing requests")
    prefill_lengths: tuple[int, ...] = (16, 64, 128, 256, 512)
    prefill_repeats: int = Field(2, ge=1)
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False, description="sampling temperature (0 = greedy)")
    rule: Literal["reducible", "pure"] = "reducible"
    clock: Literal["wall", "cpu"] = Field(
        "wall",
        description="'wall': step times as measured; 'cpu': scaled by the process's CPU share during the step "
        "(an estimate of an idle machine's times, for calibrating on a loaded one)",
    )
    default_div: str | None = Field(None, description="profile's default div (None: kl if swept, else the first)")
    default_k: int | None = Field(None, description="profile's default k (None: 4 if swept, else the middle)")
    seed: int = 0

    @field_validator("divs")
    @classmethod
    def _divs(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("at least one divergence is needed")
        for d in v:
            if d not in KNOWN_DIVS:
                raise ValueError(f"unknown divergence {d!r}; expected one of {', '.join(KNOWN_DIVS)}")
        if len(set(v)) != len(v):
            raise ValueError(f"duplicate divergence in {v}")
        return v

    @field_validator("ks", "acceptance_ks", "batch_sizes", "prefill_lengths")
    @classmethod
    def _positive_ints(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("must not be empty")
        for x in v:
            if x < 1:
                raise ValueError(f"values must be integers >= 1, got {x}")
        return tuple(sorted(set(v)))

    @field_validator("thresholds")
    @classmethod
    def _grids(cls, v: dict[str, tuple[float, ...]]) -> dict[str, tuple[float, ...]]:
        out = {}
        for div, grid in v.items():
            for t in grid:
                if not (math.isfinite(t) and t >= 0):
                    raise ValueError(f"thresholds[{div!r}]: T must be finite and >= 0, got {t}")
            out[div] = tuple(sorted({0.0, *map(float, grid)}))
        return out

    @field_validator("prompt_texts")
    @classmethod
    def _prompt_texts(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("must hold at least one prompt (None: the built-in set)")
        for i, text in enumerate(v):
            if not text.strip():
                raise ValueError(f"prompt {i} is empty")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> CalibrationSettings:
        if self.prompts > len(self.prompt_set):
            raise ValueError(f"prompts {self.prompts} exceeds the prompt set's {len(self.prompt_set)} prompts")
        for div in self.divs:
            if div not in self.thresholds:
                raise ValueError(f"thresholds: no T grid for divergence {div!r}")
        if self.default_div is not None and self.default_div not in self.divs:
            raise ValueError(f"default_div {self.default_div!r} is not among divs {self.divs}")
        if self.default_k is not None and self.default_k not in self.swept_acceptance_ks:
            raise ValueError(f"default_k {self.default_k} is not among the acceptance ks {self.swept_acceptance_ks}")
        return self

    @property
    def prompt_set(self) -> tuple[str, ...]:
        """The prompts the acceptance sweep draws its first ``prompts`` from."""
        return CALIBRATION_PROMPTS if self.prompt_texts is None else self.prompt_texts

    @property
    def swept_acceptance_ks(self) -> tuple[int, ...]:
        return self.acceptance_ks if self.acceptance_ks is not None else self.ks

    @property
    def timed_ks(self) -> tuple[int, ...]:
        """Draft lengths of the timing sweep: k = 0 (plain decoding, when asked) and ``ks``."""
        return (0, *self.ks) if self.plain_decoding else self.ks

    @classmethod
    def quick(cls, **overrides: Any) -> CalibrationSettings:
        """A smoke calibration (< 1 min on 2 cores for the default pair): kl only, k = 4, coarse grids."""
        base: dict[str, Any] = {
            "divs": ("kl",),
            "thresholds": {"kl": (0.0, 0.5, 1.0, 2.0, 8.0)},
            "ks": (4,),
            "batch_sizes": (1, 4),
            "prompts": 4,
            "max_new_tokens": 24,
            "timing_iterations": 3,
            "prefill_lengths": (32, 256),
            "prefill_repeats": 1,
        }
        base.update(overrides)
        return cls.from_dict(base)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CalibrationSettings:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ValueError(f"calibration settings: {format_validation_error(exc, first_only=True)}") from None

    @property
    def profile_div(self) -> str:
        if self.default_div is not None:
            return self.default_div
        return "kl" if "kl" in self.divs else self.divs[0]

    @property
    def profile_k(self) -> int:
        if self.default_k is not None:
            return self.default_k
        ks = self.swept_acceptance_ks
        return 4 if 4 in ks else ks[len(ks) // 2]


# ---------------------------------------------------------------------------------------------------
# Raw measurements (stored in Profile.calibration)
# ---------------------------------------------------------------------------------------------------


class AcceptanceSample(BaseModel):
    """Raw counts at one (div, k, T) grid point."""

    model_config = ConfigDict(extra="forbid")

    div: str
    k: int
    threshold: float
    row_iterations: int = Field(..., description="uncensored (request, iteration) pairs")
    censored_row_iterations: int = Field(..., description="row-iterations cut by the end of their request")
    accepted_histogram: list[int] = Field(..., description="uncensored row-iterations with A = 0..k accepted")
    censored_histogram: list[int] = Field(..., description="censored row-iterations known to have A >= 0..k")
    position_trials: list[int] = Field(..., description="row-iterations that tried position i = 0..k-1")
    position_accepts: list[int] = Field(..., description="of those, the ones that accepted it")
    emitted_tokens: int = Field(..., description="tokens emitted by decode iterations (all row-iterations)")
    distortion_sum: float
    drafted: int
    accepted: int
    fuzzy_accepted: int
    distorted_tokens: int | None = Field(
        None, description="emitted tokens that carry distortion (None: measured before this was counted)"
    )
    request_accepted: list[int] | None = Field(
        None, description="accepted drafts per request, in prompt order (None: measured before this was recorded)"
    )
    request_drafted: list[int] | None = Field(None, description="drafted tokens per request, aligned")

    @property
    def raw_position_accept(self) -> list[float | None]:
        return [a / n if n else None for a, n in zip(self.position_accepts, self.position_trials, strict=True)]

    @property
    def tokens_per_iteration(self) -> float:
        """E[A + 1] implied by the raw per-position estimates (a position never tried counts as 0)."""
        raw = [p if p is not None else 0.0 for p in self.raw_position_accept]
        return 1.0 + float(np.cumprod(raw).sum())

    @property
    def mean_distortion(self) -> float:
        return self.distortion_sum / self.emitted_tokens if self.emitted_tokens else 0.0


class LatencySample(BaseModel):
    """Mean times of ``n`` engine steps at one (phase, k, batch) point, in ms."""

    model_config = ConfigDict(extra="forbid")

    phase: Literal["decode", "prefill"]
    k: int = Field(..., description="draft length (prefill: the k the requests joined at; 0 skips the draft's prefill)")
    batch: int = Field(..., description="decode: rows in the step; prefill: requests admitted")
    tokens: float = Field(..., description="decode: mean context tokens per row; prefill: prompt tokens")
    n: int
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    overhead_ms: float = Field(0.0, description="step wall time − draft − verify − prefill")
    prefill_ms: float = 0.0
    step_ms_median: float = Field(0.0, description="median step wall time without prefill (decode)")
    step_ms_std: float = 0.0
    cpu_fraction: float = Field(1.0, description="process CPU time / wall time during the steps (1 = no contention)")


class CalibrationRecord(BaseModel):
    """Everything a calibration measured, stored as ``Profile.calibration``."""

    model_config = ConfigDict(extra="forbid")

    settings: CalibrationSettings
    torch_threads: int
    load_average_start: tuple[float, float, float] | None
    load_average_end: tuple[float, float, float] | None
    wall_s: float
    acceptance: list[AcceptanceSample]
    latency: list[LatencySample]
    fit: dict[str, float] | None = Field(
        None, description="how well the profile's latency fit reproduces these points (sim.profile_fit.FitQuality)"
    )
    draft_shares_kv: bool | None = Field(
        None, description="the engine ran the draft on the target's KV cache (no draft prefill to fit apart); "
        "None: not recorded (calibrations before session 28)"
    )


# ---------------------------------------------------------------------------------------------------
# Per-position counts (the censored estimator's input; pure numpy: unit-tested without models)
# ---------------------------------------------------------------------------------------------------


def position_counts(
    histogram: Sequence[int], censored_histogram: Sequence[int] | None = None
) -> tuple[list[int], list[int]]:
    """``(trials, accepts)`` per draft position, i = 0..k-1.

    ``histogram[a]`` = row-iterations with exactly ``A = a`` accepted (a = 0..k);
    ``censored_histogram[a]`` = row-iterations known only to have ``A >= a``. An exact one is tried at
    positions ``0..min(a, k-1)`` and accepted at ``0..a-1``; a censored one is tried and accepted at
    ``0..a-1``.
    """
    h = np.asarray(histogram, dtype=np.int64)
    c = np.zeros_like(h) if censored_histogram is None else np.asarray(censored_histogram, dtype=np.int64)
    if h.ndim != 1 or h.size < 2 or c.shape != h.shape:
        raise ValueError(f"histograms must be 1-D of length k+1 >= 2, got {h.shape} and {c.shape}")
    exact_at_least = h[::-1].cumsum()[::-1]  # [i] = #{exact A >= i}, i = 0..k
    censored_at_least = c[::-1].cumsum()[::-1]  # [i] = #{censored a >= i}
    trials = exact_at_least[:-1] + censored_at_least[1:]  # exact A >= i, or censored a > i
    accepts = exact_at_least[1:] + censored_at_least[1:]
    return trials.tolist(), accepts.tolist()


# ---------------------------------------------------------------------------------------------------
# Measurement (drives the real engine)
# ---------------------------------------------------------------------------------------------------


@dataclass
class _Counts:
    """Accumulator for one (div, k, T) grid point."""

    k: int
    histogram: list[int] = field(default_factory=list)
    censored: list[int] = field(default_factory=list)
    emitted: int = 0
    distortion: float = 0.0
    drafted: int = 0
    accepted: int = 0
    fuzzy: int = 0
    distorted: int = 0

    def __post_init__(self) -> None:
        self.histogram = [0] * (self.k + 1)
        self.censored = [0] * (self.k + 1)

    def add(self, row: RowStats, k: int) -> None:
        """Fold in one RowStats of a step with draft length ``k`` (see the module docstring)."""
        emitted = len(row.new_token_ids)
        self.emitted += emitted
        self.distortion += float(row.distortion)
        self.drafted += row.drafted
        self.accepted += row.accepted
        self.fuzzy += row.fuzzy_accepted
        self.distorted += row.distorted
        if emitted == 0:  # aborted or wholly cut by a stop string: no information
            return
        if emitted == row.accepted + 1 or row.accepted == k:
            self.histogram[row.accepted] += 1  # the block ended with the target's own token: A exact
        else:
            self.censored[row.accepted] += 1  # ended on an accepted draft: only A >= accepted is known


class _Progress:
    """A tqdm bar on stderr, or nothing."""

    def __init__(self, enabled: bool, total: float, desc: str) -> None:
        self._bar: Any = None
        if enabled:
            import sys

            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, dynamic_ncols=True)

    def update(self, n: float, desc: str | None = None) -> None:
        if self._bar is not None:
            if desc is not None:
                self._bar.set_description(desc, refresh=False)
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _engine(pair: ModelPair, settings: CalibrationSettings, div: str, k: int, batch: int) -> FSDEngine:
    return FSDEngine(pair, num_draft_tokens=k, div=div, rule=settings.rule, max_batch_size=batch, seed=settings.seed)


def _params(settings: CalibrationSettings, max_new_tokens: int, seed: int, ignore_eos: bool) -> SamplingParams:
    return SamplingParams(
        temperature=settings.temperature,
        max_new_tokens=max_new_tokens,
        eos_token_ids=() if ignore_eos else None,
        seed=seed,
    )


def _prompt_ids(pair: ModelPair, settings: CalibrationSettings) -> list[list[int]]:
    ids = [pair.encode_prompt(p) for p in settings.prompt_set[: settings.prompts]]
    room = pair.max_context - settings.max_new_tokens
    if room < 2:
        raise ValueError(f"max_new_tokens {settings.max_new_tokens} leaves no room in the pair's context")
    return [p[-room:] for p in ids]


def _filler_ids(pair: ModelPair, length: int) -> list[int]:
    """A prompt of exactly ``length`` tokens: the calibration prompts' text, repeated as needed."""
    text = "\n".join(CALIBRATION_PROMPTS)
    base = [int(t) for t in pair.tokenizer.encode(text, add_special_tokens=False)]
    if not base:
        raise ValueError("the tokenizer encodes the calibration prompts to no tokens")
    reps = length // len(base) + 1
    return (base * reps)[:length]


def measure_acceptance(
    pair: ModelPair, settings: CalibrationSettings, progress: bool = False
) -> list[AcceptanceSample]:
    """Run the (div × k × T × prompt) sweep through the engine's step API; raw counts per grid point."""
    prompts = _prompt_ids(pair, settings)
    ks = settings.swept_acceptance_ks
    # Each prompt samples_per_prompt times (request r of prompt p: its own seed, the same one at every T, k and div).
    requests = [(r * len(prompts) + p, ids) for r in range(settings.samples_per_prompt) for p, ids in enumerate(prompts)]
    total = sum(len(settings.thresholds[d]) for d in settings.divs) * len(ks) * len(requests)
    bar = _Progress(progress, total * settings.max_new_tokens, "acceptance")
    samples: list[AcceptanceSample] = []
    try:
        for div in settings.divs:
            grid = settings.thresholds[div]
            for k in ks:
                bar.update(0, desc=f"acceptance {div} k={k}")
                engine = _engine(pair, settings, div, k, settings.acceptance_batch_size)
                counts = {t: _Counts(k) for t in grid}
                threshold_of: dict[str, float] = {}
                # Per request (accepted, drafted): the spread across requests (sim.profile_fit.fit_request_acceptance).
                per_request: dict[float, dict[str, list[int]]] = {t: {} for t in grid}
                for p, ids in requests:
                    for t in grid:
                        rid = f"{div}/k{k}/T{t}/p{p}"
                        threshold_of[rid] = t
                        per_request[t][rid] = [0, 0]
                        seed = settings.seed * 1_000_003 + p  # common random numbers across T, k, div
                        engine.add_request(rid, ids, _params(settings, settings.max_new_tokens, seed, False), t)
                while engine.has_unfinished():
                    step = engine.step()
                    emitted = 0
                    for row in step.rows:
                        counts[threshold_of[row.request_id]].add(row, step.draft_length)
                        tally = per_request[threshold_of[row.request_id]][row.request_id]
                        tally[0] += row.accepted
                        tally[1] += row.drafted
                        emitted += len(row.new_token_ids)
                        if row.finished:
                            engine.release(row.request_id)
                    bar.update(emitted)
                for t in grid:
                    c = counts[t]
                    trials, accepts = position_counts(c.histogram, c.censored)
                    samples.append(
                        AcceptanceSample(
                            div=div,
                            k=k,
                            threshold=t,
                            row_iterations=sum(c.histogram),
                            censored_row_iterations=sum(c.censored),
                            accepted_histogram=c.histogram,
                            censored_histogram=c.censored,
                            position_trials=trials,
                            position_accepts=accepts,
                            emitted_tokens=c.emitted,
                            distortion_sum=c.distortion,
                            drafted=c.drafted,
                            accepted=c.accepted,
                            fuzzy_accepted=c.fuzzy,
                            distorted_tokens=c.distorted,
                            request_accepted=[a for a, _ in per_request[t].values()],
                            request_drafted=[d for _, d in per_request[t].values()],
                        )
                    )
    finally:
        bar.close()
    return samples


def _summarise_decode(
    k: int, batch: int, steps: list[StepStats], walls: list[float], cpus: list[float], contexts: list[float], clock: str
) -> LatencySample:
    share = np.clip(np.array(cpus) / np.maximum(np.array(walls), 1e-9), 0.0, 1.0)
    scale = share if clock == "cpu" else np.ones_like(share)
    draft = np.array([s.draft_time_s for s in steps]) * 1e3 * scale
    verify = np.array([s.verify_time_s for s in steps]) * 1e3 * scale
    prefill = np.array([s.prefill_time_s for s in steps]) * 1e3 * scale
    wall = np.array(walls) * 1e3 * scale
    no_prefill = wall - prefill
    return LatencySample(
        phase="decode",
        k=k,
        batch=batch,
        tokens=float(np.mean(contexts)),
        n=len(steps),
        draft_ms=float(draft.mean()),
        verify_ms=float(verify.mean()),
        overhead_ms=float(np.maximum(no_prefill - draft - verify, 0.0).mean()),
        step_ms_median=float(np.median(no_prefill)),
        step_ms_std=float(no_prefill.std()),
        cpu_fraction=float(share.mean()),
    )


def _timed_step(engine: FSDEngine) -> tuple[StepStats, float, float]:
    """``(StepStats, wall s, process CPU s)`` of one engine step."""
    c0, t0 = time.process_time(), time.perf_counter()
    step = engine.step()
    return step, time.perf_counter() - t0, time.process_time() - c0


def _prefill_sample(step: StepStats, wall: float, cpu: float, batch: int, clock: str, k: int) -> LatencySample:
    share = min(cpu / max(wall, 1e-9), 1.0)
    return LatencySample(
        phase="prefill",
        k=k,  # the k the requests joined at: 0 = the target's prefill alone (the draft skips the prompt)
        batch=batch,
        tokens=float(step.prefill_tokens),
        n=1,
        prefill_ms=step.prefill_time_s * 1e3 * (share if clock == "cpu" else 1.0),
        cpu_fraction=share,
    )


def measure_latency(pair: ModelPair, settings: CalibrationSettings, progress: bool = False) -> list[LatencySample]:
    """Time decode steps per (k, batch size) and prefills per prompt length."""
    div = settings.profile_div
    prompt_len = min(settings.timing_prompt_tokens, pair.max_context // 2)
    prompt = _filler_ids(pair, prompt_len)
    per_point = settings.timing_iterations + 1
    prefill_lengths = [min(n, pair.max_context - 2) for n in settings.prefill_lengths]
    total = len(settings.timed_ks) * len(settings.batch_sizes) * per_point + len(prefill_lengths) * settings.prefill_repeats
    bar = _Progress(progress, total, "latency")
    if bar._bar is not None:
        bar._bar.unit = "step"
    samples: list[LatencySample] = []
    try:
        _warm_up(pair, settings, prompt)
        for k in settings.timed_ks:  # k = 0: the engine runs no draft forward (plain target decoding)
            max_new = (k + 1) * per_point + 1
            if prompt_len + max_new > pair.max_context:
                raise ValueError(f"timing prompt of {prompt_len} tokens + {max_new} new exceeds the pair's context")
            for batch in settings.batch_sizes:
                bar.update(0, desc=f"latency k={k} B={batch}")
                engine = _engine(pair, settings, div, k, batch)
                for r in range(batch):
                    engine.add_request(f"t{r}", prompt, _params(settings, max_new, settings.seed + r, True), 0.0)
                steps, walls, cpus, contexts = [], [], [], []
                for i in range(per_point):
                    step, wall, cpu = _timed_step(engine)
                    bar.update(1)
                    if i == 0:  # admission: prefill of `batch` requests, then a warm-up decode
                        samples.append(_prefill_sample(step, wall, cpu, batch, settings.clock, k))
                        continue
                    if step.batch_size != batch:  # a row finished early: not a clean point
                        continue
                    steps.append(step)
                    walls.append(wall)
                    cpus.append(cpu)
                    contexts.append(
                        prompt_len + float(np.mean([len(engine.output(f"t{r}").token_ids) for r in range(batch)]))
                    )
                if steps:
                    samples.append(_summarise_decode(k, batch, steps, walls, cpus, contexts, settings.clock))
                for r in range(batch):
                    engine.abort(f"t{r}")
        bar.update(0, desc="latency prefill")
        engine = _engine(pair, settings, div, settings.ks[0], 1)
        for rep in range(settings.prefill_repeats):
            for n, length in enumerate(prefill_lengths):
                rid = f"prefill{rep}-{n}"
                engine.add_request(rid, _filler_ids(pair, length), _params(settings, 1, settings.seed, True), 0.0)
                step, wall, cpu = _timed_step(engine)
                samples.append(_prefill_sample(step, wall, cpu, 1, settings.clock, settings.ks[0]))
                engine.release(rid)
                bar.update(1)
    finally:
        bar.close()
    return samples


def _warm_up(pair: ModelPair, settings: CalibrationSettings, prompt: list[int]) -> None:
    """One short batched run so first-call allocations do not land in the first timed point."""
    batch = max(settings.batch_sizes)
    k = max(settings.ks)
    engine = _engine(pair, settings, settings.profile_div, k, batch)
    for r in range(batch):
        engine.add_request(f"w{r}", prompt, _params(settings, 2 * (k + 1), settings.seed + r, True), 0.0)
    engine.run_to_completion()


# ---------------------------------------------------------------------------------------------------
# The whole calibration
# ---------------------------------------------------------------------------------------------------


def _load_average() -> tuple[float, float, float] | None:
    try:
        one, five, fifteen = os.getloadavg()
    except (AttributeError, OSError):
        return None
    return (round(one, 2), round(five, 2), round(fifteen, 2))


def _describe_dtypes(pair: ModelPair) -> str:
    from decoder.models import describe_dtype

    return f"target {describe_dtype(pair.target)} / draft {describe_dtype(pair.draft)}"


@dataclass(frozen=True)
class EarlierCalibration:
    """What acceptance reuse reads of an earlier calibrated profile (``sim.profile.Profile`` fields)."""

    source: str  # provenance.source: "calibrated" for a profile made by fsd calibrate
    pair: str  # provenance.pair: "<name>: <description>"
    date: str  # provenance.date
    calibration: dict[str, Any] | None  # the profile's raw calibration record


def _earlier_record(source: EarlierCalibration, pair_name: str, flag: str) -> CalibrationRecord:
    if source.source != "calibrated" or source.calibration is None:
        raise ValueError(f"{flag}: the profile has no calibration record (not made by fsd calibrate)")
    if not source.pair.startswith(f"{pair_name}:") and source.pair != pair_name:
        raise ValueError(f"{flag}: the profile is for pair {source.pair!r}, not {pair_name!r}")
    return CalibrationRecord.model_validate(source.calibration)


def reusable_latency(source: EarlierCalibration, pair_name: str, settings: CalibrationSettings) -> tuple[
    list[LatencySample], CalibrationSettings
]:
    """The raw latency samples of an earlier calibrated profile of the same pair (step times do not depend on the
    prompts or the sampling settings), and ``settings`` updated to describe them: acceptance measured again, e.g.
    on the traffic's own prompts and temperature, against the machine model the policy already plans with."""
    record = _earlier_record(source, pair_name, "--latency-from")
    old = record.settings
    keep = ("ks", "batch_sizes", "plain_decoding", "timing_iterations", "timing_prompt_tokens", "prefill_lengths",
            "prefill_repeats", "clock")
    data = settings.model_dump()
    data["acceptance_ks"] = settings.swept_acceptance_ks  # before ks becomes the timing sweep's
    data.update({name: getattr(old, name) for name in keep})
    return record.latency, CalibrationSettings.from_dict(data)


def reusable_acceptance(source: EarlierCalibration, pair_name: str, settings: CalibrationSettings) -> tuple[
    list[AcceptanceSample], CalibrationSettings
]:
    """The raw acceptance samples of an earlier calibrated profile of the same pair and sampling
    settings (acceptance does not depend on the machine), and ``settings`` updated to describe them."""
    record = _earlier_record(source, pair_name, "--acceptance-from")
    old = record.settings
    for name in ("temperature", "rule"):
        if getattr(old, name) != getattr(settings, name):
            raise ValueError(
                f"--acceptance-from: its {name} is {getattr(old, name)!r}, this run's is {getattr(settings, name)!r}"
            )
    keep = ("divs", "thresholds", "prompts", "prompt_texts", "samples_per_prompt", "max_new_tokens",
            "acceptance_batch_size", "seed")
    data = settings.model_dump()
    data.update({name: getattr(old, name) for name in keep})
    data["acceptance_ks"] = old.swept_acceptance_ks
    data["default_div"] = data["default_k"] = None
    return record.acceptance, CalibrationSettings.from_dict(data)


@dataclass(frozen=True)
class Measurement:
    """A whole calibration run: the raw record and what it was measured on. ``sim.profile_fit.fit_profile``
    turns it into the simulator's Profile (this module never imports sim/)."""

    record: CalibrationRecord  # fit is None: fitting is sim's
    pair: str  # "<name>: <description>"
    dtype: str
    machine: str
    torch_version: str
    transformers_version: str
    date: str
    setup_notes: str  # what was swept, how hard
    run_notes: str  # how long it took, clock, reuse
    draft_shares_kv: bool = False  # the engine ran the draft on the target's KV cache: no draft prefill

    @property
    def default_div(self) -> str:
        return self.record.settings.profile_div

    @property
    def default_k(self) -> int:
        return self.record.settings.profile_k

    @property
    def acceptance(self) -> list[AcceptanceSample]:
        return self.record.acceptance

    @property
    def latency(self) -> list[LatencySample]:
        return self.record.latency

    def record_json(self) -> dict[str, Any]:
        """The raw record as JSON-ready data (``Profile.calibration``, before the fit quality is added)."""
        data: dict[str, Any] = self.record.model_dump(mode="json")
        data["draft_shares_kv"] = self.draft_shares_kv  # what refitting the latency needs (Measurement's own)
        return data


def measure(
    pair: ModelPair,
    settings: CalibrationSettings,
    *,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
    acceptance_from: EarlierCalibration | None = None,
    latency_from: EarlierCalibration | None = None,
) -> Measurement:
    """Measure ``pair`` with the engine: the acceptance sweep, then the latency sweep.

    With ``acceptance_from`` (an earlier calibrated profile of the same pair), its acceptance data is
    reused and only the latency is measured; with ``latency_from``, the other way round; with both, nothing is
    measured: one profile's acceptance beside another's latency.
    """
    import torch
    import transformers

    started = time.perf_counter()
    load_start = _load_average()
    reused = ""
    latency: list[LatencySample] | None = None
    if latency_from is not None:
        latency, settings = reusable_latency(latency_from, pair.name, settings)
        reused = f" Latency data reused from a profile measured {latency_from.date}."
    if acceptance_from is not None:
        acceptance, settings = reusable_acceptance(acceptance_from, pair.name, settings)
        reused += f" Acceptance data reused from a profile measured {acceptance_from.date}."
    else:
        acceptance = measure_acceptance(pair, settings, progress=progress)
        if log:
            log(f"acceptance sweep done in {time.perf_counter() - started:.0f} s")
    if latency is None:
        latency = measure_latency(pair, settings, progress=progress)
    load_end = _load_average()
    wall = time.perf_counter() - started
    threads = torch.get_num_threads()
    record = CalibrationRecord(
        settings=settings,
        torch_threads=threads,
        load_average_start=load_start,
        load_average_end=load_end,
        wall_s=round(wall, 1),
        acceptance=acceptance,
        latency=latency,
    )
    machine = (
        f"{platform.platform()}; {platform.machine()}; {os.cpu_count()} CPUs; torch threads {threads}; "
        f"load average (1/5/15 min) at start {load_start}, at end {load_end}"
    )
    setup_notes = (
        f"Measured with `fsd calibrate` through FSDEngine.step(): acceptance at temperature "
        f"{settings.temperature}, rule {settings.rule}, batch {settings.acceptance_batch_size}, "
        f"{settings.prompts} prompts ({'built-in' if settings.prompt_texts is None else 'given'} set) x "
        f"{settings.samples_per_prompt} x {settings.max_new_tokens} tokens per grid point, k "
        f"{list(settings.swept_acceptance_ks)}; latency at batch sizes "
        f"{list(settings.batch_sizes)}, k {list(settings.timed_ks)}, {settings.timing_iterations} timed steps each, "
        f"{settings.timing_prompt_tokens}-token prompts."
    )
    run_notes = (
        f"Took {wall:.0f} s. Timings depend on machine load (see machine); clock {settings.clock!r} "
        f"({'step times scaled by the process CPU share: an idle-machine estimate' if settings.clock == 'cpu' else 'wall time'})."
        f"{reused}"
    )
    return Measurement(
        record=record,
        pair=f"{pair.name}: {pair.description}" if getattr(pair, "description", "") else str(pair.name),
        dtype=_describe_dtypes(pair),
        machine=machine,
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        date=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        setup_notes=setup_notes,
        run_notes=run_notes,
        draft_shares_kv=default_share_kv(pair),
    )
