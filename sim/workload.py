"""Request generators: arrival processes, length distributions and tier mixes (pydantic-validated).

Rate-shaped arrivals (constant, step, ramp, diurnal) are a renewal process in *operational time*
mapped through the inverse cumulative rate Λ⁻¹: with ``burstiness = 1`` the renewal process is
Poisson, so this is an exact non-homogeneous Poisson process (equivalent to thinning, without rejected
draws); otherwise inter-arrival gaps are gamma with shape = burstiness and mean 1 (vLLM's
``benchmark_serving``: shape = burstiness, scale = 1/(rate·burstiness)), so burstiness < 1 is burstier
than Poisson and > 1 smoother. Trace arrivals replay an Azure-format CSV (see :mod:`sim.trace`).

A workload is pure configuration; :meth:`Workload.generate` takes the simulator's RNG and returns
columns, touching no global state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fsd_common.validation import format_validation_error
from sim.trace import AZURE_ATTRIBUTION, read_azure_trace

# ---------------------------------------------------------------- arrival shapes


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ConstantRate(_Strict):
    kind: Literal["poisson", "constant"] = "poisson"
    rate: float = Field(..., gt=0, description="requests per second")

    def rate_at(self, t: np.ndarray) -> np.ndarray:
        return np.full_like(t, self.rate, dtype=float)


class RateStep(_Strict):
    at_s: float = Field(..., ge=0)
    rate: float = Field(..., ge=0)


class StepRate(_Strict):
    kind: Literal["step"] = "step"
    steps: list[RateStep] = Field(..., min_length=1, description="rate from at_s on; first at_s must be 0")

    @field_validator("steps")
    @classmethod
    def _ordered(cls, v: list[RateStep]) -> list[RateStep]:
        if v[0].at_s != 0:
            raise ValueError(f"the first step must start at at_s = 0, got {v[0].at_s}")
        for a, b in zip(v, v[1:], strict=False):
            if b.at_s <= a.at_s:
                raise ValueError(f"steps must have increasing at_s, got {a.at_s} then {b.at_s}")
        if all(s.rate == 0 for s in v):
            raise ValueError("at least one step must have rate > 0")
        return v

    def rate_at(self, t: np.ndarray) -> np.ndarray:
        starts = np.array([s.at_s for s in self.steps])
        rates = np.array([s.rate for s in self.steps])
        return rates[np.searchsorted(starts, t, side="right") - 1]


class RampRate(_Strict):
    kind: Literal["ramp"] = "ramp"
    start_rate: float = Field(..., ge=0)
    end_rate: float = Field(..., ge=0)
    start_s: float = Field(0.0, ge=0, description="ramp begins (rate = start_rate before)")
    end_s: float | None = Field(None, gt=0, description="ramp ends (rate = end_rate after); default: duration")

    @model_validator(mode="after")
    def _check(self) -> RampRate:
        if self.start_rate == 0 and self.end_rate == 0:
            raise ValueError("start_rate and end_rate cannot both be 0")
        if self.end_s is not None and self.end_s <= self.start_s:
            raise ValueError(f"end_s {self.end_s} must exceed start_s {self.start_s}")
        return self

    def rate_at(self, t: np.ndarray, duration_s: float = math.inf) -> np.ndarray:
        end = self.end_s if self.end_s is not None else duration_s
        frac = np.clip((t - self.start_s) / max(end - self.start_s, 1e-9), 0.0, 1.0)
        return self.start_rate + (self.end_rate - self.start_rate) * frac


class DiurnalRate(_Strict):
    kind: Literal["diurnal"] = "diurnal"
    mean_rate: float = Field(..., gt=0)
    amplitude: float = Field(0.5, ge=0, le=1, description="relative: rate swings mean·(1 ± amplitude)")
    period_s: float = Field(..., gt=0)
    phase_s: float = Field(0.0, description="time of the first peak minus period/4")

    def rate_at(self, t: np.ndarray) -> np.ndarray:
        return self.mean_rate * (1.0 + self.amplitude * np.sin(2 * math.pi * (t - self.phase_s) / self.period_s))


class TraceArrivals(_Strict):
    kind: Literal["trace"] = "trace"
    path: str = Field(..., description="CSV in the Azure format TIMESTAMP,ContextTokens,GeneratedTokens")
    time_scale: float = Field(
        1.0, gt=0, description="simulated time = trace time × time_scale (< 1 compresses = more load)"
    )
    sample_fraction: float = Field(1.0, gt=0, le=1, description="keep each request with this probability")
    start_s: float = Field(0.0, ge=0, description="skip the trace before this offset (trace seconds)")


ArrivalSpec = Annotated[
    ConstantRate | StepRate | RampRate | DiurnalRate | TraceArrivals, Field(discriminator="kind")
]

# ---------------------------------------------------------------- lengths


class FixedLength(_Strict):
    kind: Literal["fixed"] = "fixed"
    value: int = Field(..., ge=1)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.value, dtype=np.int64)


class UniformLength(_Strict):
    kind: Literal["uniform"] = "uniform"
    low: int = Field(..., ge=1)
    high: int = Field(..., ge=1, description="inclusive")

    @model_validator(mode="after")
    def _order(self) -> UniformLength:
        if self.high < self.low:
            raise ValueError(f"high {self.high} < low {self.low}")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.low, self.high + 1, size=n, dtype=np.int64)


class LognormalLength(_Strict):
    kind: Literal["lognormal"] = "lognormal"
    median: float = Field(..., gt=0)
    sigma: float = Field(..., ge=0, description="std-dev of log(length)")
    min: int = Field(1, ge=1)
    max: int = Field(4096, ge=1)

    @model_validator(mode="after")
    def _order(self) -> LognormalLength:
        if self.max < self.min:
            raise ValueError(f"max {self.max} < min {self.min}")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raw = rng.lognormal(math.log(self.median), self.sigma, size=n)
        return np.clip(np.rint(raw), self.min, self.max).astype(np.int64)


class TraceLength(_Strict):
    kind: Literal["trace"] = "trace"


LengthSpec = Annotated[FixedLength | UniformLength | LognormalLength | TraceLength, Field(discriminator="kind")]

# ---------------------------------------------------------------- workload


@dataclass(frozen=True, slots=True)
class Requests:
    """Generated requests as columns, sorted by arrival."""

    arrival_s: np.ndarray  # [n] float64
    prompt_tokens: np.ndarray  # [n] int64
    output_tokens: np.ndarray  # [n] int64, >= 1
    tier: np.ndarray  # [n] int16, index into tier_names
    tier_names: tuple[str, ...]
    notes: list[str] = field(default_factory=list)
    attribution: str | None = None

    def __len__(self) -> int:
        return int(self.arrival_s.size)


class Workload(_Strict):
    """Arrivals + lengths + tier mix over ``duration_s`` seconds."""

    name: str = "workload"
    duration_s: float | None = Field(
        None, gt=0, description="arrivals stop here; required for rate-shaped arrivals (traces: whole trace)"
    )
    arrivals: ArrivalSpec
    burstiness: float = Field(1.0, gt=0, description="gamma shape of inter-arrival gaps (1 = Poisson)")
    prompt_tokens: LengthSpec = Field(default_factory=lambda: LognormalLength(median=200, sigma=0.6, max=2048))
    output_tokens: LengthSpec = Field(default_factory=lambda: LognormalLength(median=200, sigma=0.5, max=1024))
    tier_mix: dict[str, float] = Field(
        default_factory=dict, description="tier name → share; empty = every request in the SLO default tier"
    )
    max_context: int = Field(2048, ge=2, description="prompt + output clipped to this many tokens")

    @model_validator(mode="after")
    def _check(self) -> Workload:
        is_trace = isinstance(self.arrivals, TraceArrivals)
        if not is_trace and self.duration_s is None:
            raise ValueError("duration_s is required for rate-shaped arrivals")
        for name in ("prompt_tokens", "output_tokens"):
            if isinstance(getattr(self, name), TraceLength) and not is_trace:
                raise ValueError(f"{name}: kind 'trace' needs trace arrivals")
        for tier, share in self.tier_mix.items():
            if not (math.isfinite(share) and share >= 0):
                raise ValueError(f"tier_mix[{tier!r}] must be a finite share >= 0, got {share}")
        if self.tier_mix and sum(self.tier_mix.values()) <= 0:
            raise ValueError("tier_mix shares must not all be 0")
        return self

    # ---- loading

    @classmethod
    def load(cls, path: str | Path) -> Workload:
        """Load YAML (or JSON); a relative trace path is resolved against the file's directory."""
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"workload file {str(path)!r} does not exist") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"workload file {str(path)!r} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"workload file {str(path)!r} must hold a mapping")
        arr = data.get("arrivals")
        if isinstance(arr, dict) and arr.get("kind") == "trace" and isinstance(arr.get("path"), str):
            p = Path(arr["path"])
            if not p.is_absolute():
                arr = {**arr, "path": str((path.parent / p).resolve())}
                data = {**data, "arrivals": arr}
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, object], source: str = "workload") -> Workload:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ValueError(f"{source}: {format_validation_error(exc, first_only=True)}") from None

    # ---- generation

    def rate_at(self, t: np.ndarray) -> np.ndarray:
        """λ(t) for rate-shaped arrivals (requests/s)."""
        a = self.arrivals
        if isinstance(a, TraceArrivals):
            raise ValueError("rate_at is undefined for trace arrivals")
        if isinstance(a, RampRate):
            return a.rate_at(t, self.duration_s or math.inf)
        return a.rate_at(t)

    def generate(self, rng: np.random.Generator, tier_names: list[str], default_tier: str) -> Requests:
        """Draw the requests. ``tier_names`` are the SLO's tiers; the mix must only name those."""
        for tier in self.tier_mix:
            if tier not in tier_names:
                raise ValueError(f"tier_mix names tier {tier!r}, which the SLO lacks; SLO tiers: {tier_names}")
        notes: list[str] = []
        attribution = None
        trace_tiers: list[str | None] | None = None  # the trace's Tier column, when it has one
        if isinstance(self.arrivals, TraceArrivals):
            arrival, prompt, output, trace_notes, trace_tiers, recorded = self._trace_columns(rng)
            notes.extend(trace_notes)
            attribution = None if recorded else AZURE_ATTRIBUTION
        else:
            arrival = self._rate_arrivals(rng)
            n = arrival.size
            prompt = self.prompt_tokens.sample(rng, n)  # type: ignore[union-attr]
            output = self.output_tokens.sample(rng, n)  # type: ignore[union-attr]
        n = arrival.size
        prompt, output, clip_notes = _clip_to_context(prompt, output, self.max_context)
        notes.extend(clip_notes)
        if self.tier_mix:
            names = list(self.tier_mix)
            shares = np.array([self.tier_mix[t] for t in names], dtype=float)
            pick = rng.choice(len(names), size=n, p=shares / shares.sum())
            index = np.array([tier_names.index(t) for t in names], dtype=np.int16)[pick]
        elif trace_tiers is not None:  # a tier_mix overrides the trace's own tiers
            index = trace_tier_index(trace_tiers, tier_names, default_tier)
        else:
            index = np.full(n, tier_names.index(default_tier), dtype=np.int16)
        return Requests(arrival, prompt, output, index.astype(np.int16), tuple(tier_names), notes, attribution)

    def _rate_arrivals(self, rng: np.random.Generator) -> np.ndarray:
        assert self.duration_s is not None
        duration = self.duration_s
        # Cumulative rate Λ on a fine grid; operational-time arrivals s_i map to t_i = Λ⁻¹(s_i).
        grid = np.linspace(0.0, duration, max(2, int(duration * 20) + 1))
        lam = np.maximum(self.rate_at(grid), 0.0)
        cum = np.concatenate([[0.0], np.cumsum((lam[1:] + lam[:-1]) * 0.5 * np.diff(grid))])
        total = cum[-1]
        if total <= 0:
            return np.empty(0)
        shape = self.burstiness
        # Unit-mean gamma gaps; draw in chunks until the operational horizon is covered.
        expected = int(total * 1.1) + 16
        gaps = rng.gamma(shape, 1.0 / shape, size=expected)
        ops = np.cumsum(gaps)
        while ops[-1] < total:
            more = rng.gamma(shape, 1.0 / shape, size=expected // 2 + 16)
            ops = np.concatenate([ops, ops[-1] + np.cumsum(more)])
        ops = ops[ops < total]
        # Λ is non-decreasing; flat stretches (rate 0) never receive an arrival since np.interp maps
        # values on a plateau's boundary to its left end.
        return np.asarray(np.interp(ops, cum, grid), dtype=np.float64)

    def _trace_columns(
        self, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str], list[str | None] | None, bool]:
        """(arrival, prompt, output, notes, the Tier column or None, whether the service recorded it)."""
        a = self.arrivals
        assert isinstance(a, TraceArrivals)
        trace = read_azure_trace(a.path)
        keep = trace.arrival_s >= a.start_s
        if a.sample_fraction < 1.0:
            keep &= rng.random(len(trace)) < a.sample_fraction
        arrival = (trace.arrival_s[keep] - a.start_s) * a.time_scale
        prompt = trace.prompt_tokens[keep]
        output = trace.output_tokens[keep]
        tiers = [t for t, k in zip(trace.tier, keep.tolist(), strict=True) if k] if trace.tier is not None else None
        max_tokens = trace.max_tokens[keep] if trace.max_tokens is not None else None
        if self.duration_s is not None:
            within = arrival < self.duration_s
            arrival, prompt, output = arrival[within], prompt[within], output[within]
            if tiers is not None:
                tiers = [t for t, k in zip(tiers, within.tolist(), strict=True) if k]
            if max_tokens is not None:
                max_tokens = max_tokens[within]
        n = arrival.size
        if n == 0:
            raise ValueError(f"arrivals: trace {a.path!r} leaves no requests after start_s/sample/duration")
        notes = [
            f"trace {Path(a.path).name}: {n} of {len(trace)} requests "
            f"(start_s={a.start_s}, sample_fraction={a.sample_fraction}, time_scale={a.time_scale}: "
            f"simulated time = trace time x {a.time_scale})"
        ]
        if not isinstance(self.prompt_tokens, TraceLength):
            prompt = self.prompt_tokens.sample(rng, n)
        if not isinstance(self.output_tokens, TraceLength):
            output = self.output_tokens.sample(rng, n)
            if max_tokens is not None:  # a sampled length never exceeds the max_tokens the request asked
                output = np.where(max_tokens > 0, np.minimum(output, max_tokens), output)
        zero = int((output < 1).sum())
        if zero:
            notes.append(f"{zero} requests with GeneratedTokens = 0 given 1 output token")
            output = np.maximum(output, 1)
        return arrival, prompt, output, notes, tiers, trace.status is not None

    def rate_description(self) -> str:
        a = self.arrivals
        if isinstance(a, TraceArrivals):
            return f"trace {Path(a.path).name} x{a.time_scale}"
        return a.kind


def trace_tier_index(tiers: list[str | None] | tuple[str | None, ...], tier_names: list[str],
                     default_tier: str) -> np.ndarray:
    """Tier indices ([n] int16) for a trace's Tier column (None = ``default_tier``); ValueError names a
    tier the SLO lacks."""
    lookup = {name: i for i, name in enumerate(tier_names)}
    out = np.empty(len(tiers), dtype=np.int16)
    for i, name in enumerate(tiers):
        key = default_tier if name is None else name
        if key not in lookup:
            raise ValueError(f"trace Tier {key!r} (request {i}) is not an SLO tier; SLO tiers: {tier_names}")
        out[i] = lookup[key]
    return out


def _clip_to_context(prompt: np.ndarray, output: np.ndarray, max_context: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Clip prompts to max_context-1 and outputs so prompt + output <= max_context; report counts."""
    notes = []
    p = np.minimum(prompt, max_context - 1)
    p = np.maximum(p, 1)
    o = np.minimum(output, max_context - p)
    n_p = int((p < prompt).sum())
    n_o = int((o < output).sum())
    if n_p or n_o:
        notes.append(
            f"clipped to max_context={max_context}: {n_p} prompts and {n_o} outputs of {prompt.size} requests"
        )
    return p.astype(np.int64), o.astype(np.int64), notes

