"""Fitting a simulator :class:`~sim.profile.Profile` to what a calibration measured (pure numpy/scipy).

``decoder/calibration.py`` drives the real engine and returns raw counts and timings (a
``decoder.calibration.Measurement``); :func:`fit_profile` turns them into a validated Profile. This module
never imports the decoder: it reads the measurement through the small protocols below, so the simulator
stays torch-free. What is fitted and why:

- *Acceptance per position*: the raw estimate ``accepts / trials`` per draft position (censoring is
  handled when counting, in the decoder module), made monotone in T by weighted isotonic regression with
  weights = trials — for binomial data the maximum-likelihood estimate under the monotonicity constraint.
- *Distortion*: mean TV distortion per emitted token, 0 at T = 0 by construction, isotonic in T with
  weights = tokens; likewise the fraction of emitted tokens that carry distortion.
- *Latency*: non-negative least squares of the profile's own model,
  draft ``= k · (draft_a + draft_b · B)``, verify + overhead ``= verify_a + verify_b · B + verify_c · k · B``,
  prefill ``= prefill_fixed + prefill_per_token · prompt tokens`` (+ ``draft_prefill_fixed +
  draft_prefill_per_token · prompt tokens`` for joins at k > 0, when joins at k = 0 were timed too); fit
  quality kept as ``FitQuality``. The target's prefills are also kept as measured per prompt length
  (``prefill_ms_by_tokens``, median over repeats), which the simulator reads; the line stays for longer prompts.
  Decode points at k = 0 (plain target decoding, no draft forward) are fitted on their own,
  step ``= plain_step_a + plain_step_b · B``, and kept as measured per batch (``plain_step_ms_by_batch``,
  straight lines between measured batch sizes), which the simulator and the policy use; without them the
  profile derives k = 0 from the verify fit.
- *Per-request acceptance variation* (:func:`fit_request_acceptance`, not part of :func:`fit_profile`:
  a calibration pools its counts over prompts and records none per request): the concentration κ of
  :class:`~sim.profile.RequestAcceptance` from accepted / drafted counts per request, by matching the
  spread of the requests' empirical log-odds (less their sampling noise) to the model's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from numpy.typing import ArrayLike
from pydantic import BaseModel, ConfigDict, ValidationError

from sim.profile import AcceptancePoint, BatchAcceptance, LatencyModel, Profile, Provenance, RequestAcceptance

# ---------------------------------------------------------------------------------------------------
# What a measurement provides (decoder.calibration's types satisfy these; no import of the decoder)
# ---------------------------------------------------------------------------------------------------


class AcceptanceCounts(Protocol):
    """Raw counts at one (div, k, T) grid point (``decoder.calibration.AcceptanceSample``)."""

    @property
    def div(self) -> str: ...
    @property
    def k(self) -> int: ...
    @property
    def threshold(self) -> float: ...
    @property
    def position_trials(self) -> list[int]: ...
    @property
    def position_accepts(self) -> list[int]: ...
    @property
    def emitted_tokens(self) -> int: ...
    @property
    def mean_distortion(self) -> float: ...
    @property
    def distorted_tokens(self) -> int | None: ...


class LatencyPoint(Protocol):
    """Mean step times at one (phase, k, batch) point (``decoder.calibration.LatencySample``)."""

    @property
    def phase(self) -> str: ...
    @property
    def k(self) -> int: ...
    @property
    def batch(self) -> int: ...
    @property
    def tokens(self) -> float: ...
    @property
    def draft_ms(self) -> float: ...
    @property
    def verify_ms(self) -> float: ...
    @property
    def overhead_ms(self) -> float: ...
    @property
    def prefill_ms(self) -> float: ...


class CalibrationMeasurement(Protocol):
    """A whole calibration run (``decoder.calibration.Measurement``)."""

    @property
    def pair(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def machine(self) -> str: ...
    @property
    def torch_version(self) -> str: ...
    @property
    def transformers_version(self) -> str: ...
    @property
    def date(self) -> str: ...
    @property
    def default_div(self) -> str: ...
    @property
    def default_k(self) -> int: ...
    @property
    def acceptance(self) -> Sequence[AcceptanceCounts]: ...
    @property
    def latency(self) -> Sequence[LatencyPoint]: ...
    @property
    def setup_notes(self) -> str: ...
    @property
    def run_notes(self) -> str: ...
    @property
    def draft_shares_kv(self) -> bool: ...
    def record_json(self) -> dict[str, Any]: ...


# ---------------------------------------------------------------------------------------------------
# Fitting
# ---------------------------------------------------------------------------------------------------


class FitQuality(BaseModel):
    """How well each latency fit reproduces its points (relative error of the mean, per point)."""

    model_config = ConfigDict(extra="forbid")

    draft_max_rel_error: float
    verify_max_rel_error: float
    iteration_max_rel_error: float
    prefill_max_rel_error: float
    plain_max_rel_error: float | None = None  # k = 0 step fit (None: k = 0 not measured)


def isotonic_increasing(values: ArrayLike, weights: ArrayLike) -> np.ndarray:
    """Weighted least-squares non-decreasing fit (pool adjacent violators).

    Points with zero weight carry no information: they take the fitted value of the nearest weighted
    point before them (or after, for leading ones).
    """
    from scipy.optimize import isotonic_regression

    y = np.asarray(values, dtype=float)
    w = np.asarray(weights, dtype=float)
    if y.shape != w.shape or y.ndim != 1:
        raise ValueError(f"values and weights must be equal-length 1-D, got {y.shape} and {w.shape}")
    informative = w > 0
    if not informative.any():
        raise ValueError("isotonic fit needs at least one point with positive weight")
    fitted = np.empty_like(y)
    idx = np.flatnonzero(informative)
    fitted[idx] = isotonic_regression(y[idx], weights=w[idx], increasing=True).x
    for i in range(y.size):  # fill uninformative points from the left neighbour (keeps monotone)
        if not informative[i]:
            left = idx[idx < i]
            fitted[i] = fitted[left[-1]] if left.size else fitted[idx[0]]
    return fitted


def fit_acceptance(samples: Iterable[AcceptanceCounts]) -> list[AcceptancePoint]:
    """Profile acceptance points from raw samples: per (div, k), monotone in T (see module docstring)."""
    groups: dict[tuple[str, int], list[AcceptanceCounts]] = {}
    for s in samples:
        groups.setdefault((s.div, s.k), []).append(s)
    points: list[AcceptancePoint] = []
    for (div, k), group in sorted(groups.items()):
        group.sort(key=lambda s: s.threshold)
        if group[0].threshold != 0.0:
            raise ValueError(f"acceptance samples for div={div!r} k={k} have no T = 0 point")
        n_t = len(group)
        trials = np.array([s.position_trials for s in group], dtype=float)  # [n_t, k]
        accepts = np.array([s.position_accepts for s in group], dtype=float)
        if trials[:, 0].sum() == 0:
            raise ValueError(f"no uncensored iterations measured for div={div!r} k={k}; raise max_new_tokens")
        raw = np.divide(accepts, trials, out=np.full_like(accepts, np.nan), where=trials > 0)
        fitted = np.empty((n_t, k))
        for i in range(k):
            if trials[:, i].sum() > 0:
                fitted[:, i] = isotonic_increasing(np.nan_to_num(raw[:, i]), trials[:, i])
            else:  # never reached at any T: the best guess is the previous position's value
                fitted[:, i] = fitted[:, i - 1]
        tokens = np.array([s.emitted_tokens for s in group], dtype=float)
        distortion = np.array([s.mean_distortion for s in group])
        distortion[0] = 0.0  # T = 0 never takes the fuzzy branch (exact by construction)
        if tokens[1:].sum() > 0:
            distortion[1:] = isotonic_increasing(distortion[1:], tokens[1:])
        distortion = np.maximum(distortion, 0.0)
        # Fraction of emitted tokens that carry distortion: with the mean it lets the simulator draw
        # distortion as events, with the per-window noise a quality guard reacts to.
        distorted = None
        if all(s.distorted_tokens is not None for s in group):
            distorted = np.array([(s.distorted_tokens or 0) / s.emitted_tokens if s.emitted_tokens else 0.0
                                  for s in group])
            distorted[0] = 0.0
            if tokens[1:].sum() > 0:
                distorted[1:] = isotonic_increasing(distorted[1:], tokens[1:])
            distorted = np.clip(distorted, 0.0, 1.0)
        for j, s in enumerate(group):
            points.append(
                AcceptancePoint(
                    div=div,
                    k=k,
                    threshold=s.threshold,
                    position_accept=[float(np.clip(x, 0.0, 1.0)) for x in fitted[j]],
                    mean_distortion=float(distortion[j]),
                    distorted_per_token=None if distorted is None else float(distorted[j]),
                )
            )
    return points


@dataclass(frozen=True)
class LatencyFit:
    model: LatencyModel
    quality: FitQuality


def _nnls(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    from scipy.optimize import nnls

    coef, _ = nnls(design, target)
    return np.asarray(coef)


def _max_rel_error(predicted: np.ndarray, measured: np.ndarray) -> float:
    if predicted.size == 0:
        return 0.0
    return float(np.max(np.abs(predicted - measured) / np.maximum(np.abs(measured), 1e-9)))


def fit_latency(samples: Sequence[LatencyPoint], draft_prefill_apart: bool = True) -> LatencyFit:
    """Non-negative least-squares fit of the profile's latency model to the measured points (``draft_prefill_apart``:
    the draft's prefill fitted apart where joins at k = 0 and k > 0 were both timed)."""
    decode = [s for s in samples if s.phase == "decode" and s.k >= 1]
    plain = [s for s in samples if s.phase == "decode" and s.k == 0]
    prefill = [s for s in samples if s.phase == "prefill"]
    if not decode:
        raise ValueError("no decode timing samples at k >= 1 to fit")
    if not prefill:
        raise ValueError("no prefill timing samples to fit")
    k = np.array([s.k for s in decode], dtype=float)
    b = np.array([s.batch for s in decode], dtype=float)
    draft = np.array([s.draft_ms for s in decode])
    verify = np.array([s.verify_ms + s.overhead_ms for s in decode])
    draft_design = np.stack([k, k * b], axis=1)
    verify_design = np.stack([np.ones_like(b), b, k * b], axis=1)
    draft_a, draft_b = _nnls(draft_design, draft)
    verify_a, verify_b, verify_c = _nnls(verify_design, verify)

    tok = np.array([s.tokens for s in prefill], dtype=float)
    pre = np.array([s.prefill_ms for s in prefill])
    drafting = np.array([s.k > 0 for s in prefill], dtype=float)
    draft_prefill_fixed = draft_prefill_per_token = 0.0
    if draft_prefill_apart and 0.0 < drafting.mean() < 1.0:
        # Joins at k = 0 (target alone) and at k > 0 (target and draft): the draft's prefill apart.
        prefill_design = np.stack([np.ones_like(tok), tok, drafting, drafting * tok], axis=1)
        prefill_fixed, prefill_per_token, draft_prefill_fixed, draft_prefill_per_token = _nnls(prefill_design, pre)
    else:  # one kind of join only: one prefill for target and draft together
        prefill_design = np.stack([np.ones_like(tok), tok], axis=1)
        prefill_fixed, prefill_per_token = _nnls(prefill_design, pre)
    # The measured prefills themselves, by prompt tokens (median over repeats; joins at k = 0 only where
    # the draft's prefill is fitted apart): short prompts cost more than the line says (a fixed cost its
    # intercept does not carry: 121-125 ms measured at 16 tokens against a line at 78-84 in session 27's
    # calibrations), and the simulator reads a join's prefill from these points.
    target_only = drafting == 0 if draft_prefill_apart and 0.0 < drafting.mean() < 1.0 else np.ones_like(tok, bool)
    lengths = np.unique(tok[target_only])
    prefill_by_tokens = [(float(n), float(np.median(pre[target_only & (tok == n)]))) for n in lengths]
    plain_a = plain_b = None
    plain_by_batch: list[float] | None = None
    plain_error = None
    if plain:
        plain_b_sizes = np.array([s.batch for s in plain], dtype=float)
        plain_step = np.array([s.draft_ms + s.verify_ms + s.overhead_ms for s in plain])
        plain_design = np.stack([np.ones_like(plain_b_sizes), plain_b_sizes], axis=1)
        plain_a, plain_b = (float(c) for c in _nnls(plain_design, plain_step))
        # The measured steps themselves, by batch (mean over repeats, straight lines between measured
        # batch sizes): the plain step is not linear in the batch (concave on the default pair), and
        # the simulator and the policy read it from this table; the line stays for what lies beyond.
        sizes = np.unique(plain_b_sizes)
        means = np.array([plain_step[plain_b_sizes == size].mean() for size in sizes])
        if sizes[0] == 1:
            plain_by_batch = [float(v) for v in np.interp(np.arange(1, int(sizes[-1]) + 1), sizes, means)]
        plain_error = _max_rel_error(plain_design @ np.array([plain_a, plain_b]), plain_step)

    model = LatencyModel(
        draft_a_ms=float(draft_a),
        draft_b_ms=float(draft_b),
        verify_a_ms=float(verify_a),
        verify_b_ms=float(verify_b),
        verify_c_ms=float(verify_c),
        prefill_ms_per_token=float(prefill_per_token),
        prefill_fixed_ms=float(prefill_fixed),
        draft_prefill_ms_per_token=float(draft_prefill_per_token),
        draft_prefill_fixed_ms=float(draft_prefill_fixed),
        plain_step_a_ms=plain_a,
        plain_step_b_ms=plain_b,
        plain_step_ms_by_batch=plain_by_batch,
        prefill_ms_by_tokens=prefill_by_tokens if len(prefill_by_tokens) >= 2 else None,
    )
    draft_pred = draft_design @ np.array([draft_a, draft_b])
    verify_pred = verify_design @ np.array([verify_a, verify_b, verify_c])
    iteration_pred = np.array([float(model.iteration_ms(int(s.batch), int(s.k))) for s in decode])
    prefill_pred = prefill_design @ np.array(
        [prefill_fixed, prefill_per_token, draft_prefill_fixed, draft_prefill_per_token][: prefill_design.shape[1]]
    )
    quality = FitQuality(
        draft_max_rel_error=_max_rel_error(draft_pred, draft),
        verify_max_rel_error=_max_rel_error(verify_pred, verify),
        iteration_max_rel_error=_max_rel_error(iteration_pred, draft + verify),
        prefill_max_rel_error=_max_rel_error(prefill_pred, pre),
        plain_max_rel_error=plain_error,
    )
    return LatencyFit(model, quality)


def fit_profile(measurement: CalibrationMeasurement, command: str = "") -> Profile:
    """The validated Profile of a calibration: acceptance and latency fitted, the raw data kept in
    ``Profile.calibration`` (the measurement's record plus the fit quality)."""
    # An engine whose draft reads the target's KV cache never prefills the draft: one prefill for every join.
    fit = fit_latency(measurement.latency, draft_prefill_apart=not measurement.draft_shares_kv)
    points = fit_acceptance(measurement.acceptance)
    notes = (
        f"{measurement.setup_notes} Acceptance/distortion are isotonic (in T) fits of "
        f"the raw counts; verify_* include the step's bookkeeping overhead. Raw data: `calibration`. "
        f"{measurement.run_notes}"
    )
    calibration = measurement.record_json()
    calibration["fit"] = fit.quality.model_dump(mode="json")
    try:
        return Profile(
            provenance=Provenance(
                pair=measurement.pair,
                dtype=measurement.dtype,
                machine=measurement.machine,
                torch_version=measurement.torch_version,
                transformers_version=measurement.transformers_version,
                date=measurement.date,
                source="calibrated",
                notes=notes,
                command=command,
            ),
            default_div=measurement.default_div,
            default_k=measurement.default_k,
            acceptance=points,
            latency=fit.model,
            calibration=calibration,
        )
    except ValidationError as exc:  # a bug here, not bad input: say what broke
        raise ValueError(f"calibration produced an invalid profile: {exc}") from exc


def headline(profile: Profile) -> dict[str, Any]:
    """The numbers worth printing: acceptance and tokens/iteration per T at the default (div, k), and
    iteration time per batch size."""
    div, k = profile.default_div, profile.default_k
    lat = profile.latency
    return {
        "pair": profile.provenance.pair,
        "div": div,
        "k": k,
        "per_threshold": [
            {
                "T": float(t),
                "acceptance_rate": round(profile.expected_acceptance_rate(div, float(t), k), 4),
                "tokens_per_iteration": round(profile.expected_tokens_per_iter(div, float(t), k), 3),
                "mean_distortion": round(profile.mean_distortion(div, float(t), k), 4),
            }
            for t in profile.thresholds(div, k)
        ],
        "iteration_ms": {str(b): round(float(lat.iteration_ms(b, k)), 1) for b in (1, 2, 4, 8)},
        "prefill_ms_per_token": round(lat.prefill_ms_per_token, 3),
        "prefill_fixed_ms": round(lat.prefill_fixed_ms, 2),
        "draft_prefill_ms_per_token": round(lat.draft_prefill_ms_per_token, 3),
        "draft_prefill_fixed_ms": round(lat.draft_prefill_fixed_ms, 2),
    }


#: Accepted and rejected drafts a request must expect for :func:`fit_request_acceptance` to use its group.
_MIN_EXPECTED = 5.0


def fit_request_acceptance(accepted: ArrayLike, drafted: ArrayLike, source: str = "",
                           groups: ArrayLike | None = None,
                           expected: ArrayLike | None = None) -> RequestAcceptance | None:
    """κ of :class:`~sim.profile.RequestAcceptance` from per-request counts (drafted tokens and how many
    were accepted), at one operating point — or at several, labelled by ``groups`` (e.g. one label per
    (batch, T)): then the spread is the pooled within-group variance, each group about its own mean;
    None when the requests vary no more than sampling noise, or when too few requests are left in groups
    that can be fitted (of two or more requests, acceptance not saturated); a ValueError when the input
    itself has too few requests for its groups.

    The model shifts every request's log-odds by ``logit(a)``, ``a ~ Beta(κ/2, κ/2)``, whose variance is
    ``2·ψ₁(κ/2)`` (trigamma). Each request's empirical log-odds (Haldane's +½ correction) has that
    variance plus its binomial sampling variance ``1/(D·p·(1 − p))`` (delta method, at the pooled rate
    through the request's shift); method of moments: ``2·ψ₁(κ/2) = var(logit p̂) − mean sampling
    variance``, solved for κ (ψ₁ is decreasing). Per-position acceptance is summarised by the
    per-request rate accepted / drafted, so the fit is approximate; it needs tens of requests with
    tens of drafts each. The delta method's sampling variance holds only where a request expects at least
    ``_MIN_EXPECTED`` accepted and as many rejected drafts (mean drafts × min(rate, 1 − rate), the normal
    approximation's rule); a group outside it (acceptance saturating near 1 at a large T) is left out: its
    rates pile up at 1, where the formula overstates the noise several times and would cancel the spread the
    other groups measure (session 27: the session-26 calibration's T = 0 groups show κ ≈ 16, pooled with
    its T = 0.5 and 1 groups they showed none).

    ``expected`` (instead of ``groups``) gives each request the rate a model predicts for it, e.g. the
    profile's at the T and batch the request actually ran at on a live service, where no two requests share
    an operating point: the spread is then about ``logit(expected)`` plus one common offset (the model's
    level error, which the simulator's centring takes out anyway), and the rule above reads each request's
    own expected rate.
    """
    acc = np.asarray(accepted, dtype=float)
    drf = np.asarray(drafted, dtype=float)
    if acc.shape != drf.shape or acc.ndim != 1:
        raise ValueError(f"accepted and drafted must be 1-D of one length, got {acc.shape} and {drf.shape}")
    if acc.size < 3:
        raise ValueError(f"need at least 3 requests to fit a spread, got {acc.size}")
    if np.any(drf <= 0) or np.any(acc < 0) or np.any(acc > drf):
        raise ValueError("every request needs drafted > 0 and 0 <= accepted <= drafted")
    if expected is not None:
        if groups is not None:
            raise ValueError("pass groups or expected, not both")
        return _fit_about_expected(acc, drf, np.asarray(expected, dtype=float), source)
    if groups is None:
        index = np.zeros(acc.size, dtype=np.int64)
    else:
        labels = np.asarray(groups)
        if labels.shape != acc.shape:
            raise ValueError(f"groups must label every request, got shape {labels.shape} for {acc.shape}")
        _, index = np.unique(labels, return_inverse=True)
        n_groups = int(index.max()) + 1
        if acc.size - n_groups < 2:
            raise ValueError(f"need at least 2 more requests than groups, got {acc.size} in {n_groups} groups")
    # Groups where the binomial noise of a request's log-odds follows the delta method (see the docstring).
    counts = np.bincount(index)
    group_rate = np.bincount(index, weights=acc) / np.bincount(index, weights=drf)
    expected = np.bincount(index, weights=drf) / counts * np.minimum(group_rate, 1.0 - group_rate)
    usable = (expected >= _MIN_EXPECTED) & (counts >= 2)
    keep = usable[index]
    if not keep.any():
        return None
    total = acc.size
    acc, drf, index = acc[keep], drf[keep], np.unique(index[keep], return_inverse=True)[1]
    n_groups = int(index.max()) + 1
    if acc.size - n_groups < 2:
        return None
    log_odds = np.log((acc + 0.5) / (drf - acc + 0.5))
    means = np.bincount(index, weights=log_odds) / np.bincount(index)
    variance = float(np.sum((log_odds - means[index]) ** 2) / (acc.size - n_groups))
    kappa = _kappa_from_variance(variance, acc, drf)
    if kappa is None:
        return None
    if acc.size == total:
        return RequestAcceptance(concentration=kappa, source=source or f"fit_request_acceptance over {total} requests")
    used = f"fit_request_acceptance over {acc.size} requests of {total} (the others in groups of one request or whose acceptance saturates)"
    return RequestAcceptance(concentration=kappa, source=f"{source}; {used}" if source else used)


def _kappa_from_variance(variance: float, acc: np.ndarray, drf: np.ndarray) -> float | None:
    """κ whose log-odds spread ``2·ψ₁(κ/2)`` is ``variance`` less the requests' mean sampling variance (None
    when nothing is left)."""
    from scipy.special import polygamma

    rates = (acc + 0.5) / (drf + 1.0)
    excess = variance - float(np.mean(1.0 / (drf * rates * (1.0 - rates))))
    if excess <= 0.0:
        return None

    def spread(kappa: float) -> float:
        return float(2.0 * polygamma(1, kappa / 2.0))

    low, high = 1e-6, 1e9
    if excess >= spread(low):
        return low
    for _ in range(200):  # bisection in log κ
        mid = math.sqrt(low * high)
        if spread(mid) > excess:
            low = mid
        else:
            high = mid
    return math.sqrt(low * high)


def _fit_about_expected(acc: np.ndarray, drf: np.ndarray, expected: np.ndarray,
                        source: str) -> RequestAcceptance | None:
    """:func:`fit_request_acceptance` with a model rate per request (see its docstring)."""
    if expected.shape != acc.shape:
        raise ValueError(f"expected must give every request a rate, got shape {expected.shape} for {acc.shape}")
    bad = ~((expected >= 0.0) & (expected <= 1.0))
    if bad.any():
        raise ValueError(f"expected rates must lie in [0, 1], got {float(expected[bad][0])!r}")
    total = acc.size
    # A rate of 0 or 1 (a saturated operating point) expects no rejected (accepted) drafts: left out here.
    keep = drf * np.minimum(expected, 1.0 - expected) >= _MIN_EXPECTED
    if int(keep.sum()) < 3:
        return None
    acc, drf, expected = acc[keep], drf[keep], expected[keep]
    residual = np.log((acc + 0.5) / (drf - acc + 0.5)) - np.log(expected / (1.0 - expected))
    kappa = _kappa_from_variance(float(residual.var(ddof=1)), acc, drf)
    if kappa is None:
        return None
    used = (f"fit_request_acceptance about per-request expected rates over {acc.size} requests of {total}"
            f" (the others expect fewer than {_MIN_EXPECTED:g} accepted or rejected drafts)")
    return RequestAcceptance(concentration=kappa, source=f"{source}; {used}" if source else used)


@dataclass(frozen=True, slots=True)
class BatchAcceptanceSample:
    """Tokens per row-iteration measured at one (engine batch, T) point (``benchmarks/acceptance_by_batch.py``)."""

    batch: int
    threshold: float
    tokens_per_row_iteration: float
    row_iterations: int


def _odds_scale_for(profile: Profile, div: str, k: int, sample: BatchAcceptanceSample) -> float:
    """The odds multiplier of the profile's acceptance at the sample's T whose tokens per row-iteration
    are the sample's: tokens rise with the multiplier, so a bisection in log-odds over [-8, 8] (held at
    the ends when the sample lies beyond them)."""
    from sim.profile import shifted_acceptance

    alpha = profile.position_accept(div, sample.threshold, k)
    target = sample.tokens_per_row_iteration
    low, high = -8.0, 8.0
    for _ in range(60):  # to ~1e-17 in log-odds
        mid = 0.5 * (low + high)
        if 1.0 + float(np.cumprod(shifted_acceptance(alpha, math.exp(mid))).sum()) < target:
            low = mid
        else:
            high = mid
    return math.exp(0.5 * (low + high))


def fit_batch_acceptance(
    profile: Profile,
    samples: Sequence[BatchAcceptanceSample],
    reference_batch: int,
    div: str | None = None,
    k: int | None = None,
    source: str = "",
) -> BatchAcceptance:
    """Odds multipliers per (engine batch, T), relative to ``reference_batch`` (the batch the profile's
    acceptance table was measured at): :class:`~sim.profile.BatchAcceptance`.

    At each measured (batch, T) the one multiplier of the profile's acceptance at T that reproduces the
    measured tokens per row-iteration, divided by the same fit at (reference batch, T) — so the
    measurement's own level at the reference batch, which differs from the calibration's by sampling,
    cancels. Every batch needs the reference batch's thresholds.
    """
    div = div or profile.default_div
    k = k or profile.default_k
    by_batch: dict[int, dict[float, BatchAcceptanceSample]] = {}
    for s in samples:
        if s.batch < 1:
            raise ValueError(f"batch sizes must be >= 1, got {s.batch}")
        if s.row_iterations < 1:
            raise ValueError(f"row_iterations must be >= 1, got {s.row_iterations} at batch {s.batch}")
        by_batch.setdefault(s.batch, {})[s.threshold] = s
    if reference_batch not in by_batch:
        raise ValueError(f"no sample at the reference batch {reference_batch}; measured: {sorted(by_batch)}")
    thresholds = sorted(by_batch[reference_batch])
    for b, group in by_batch.items():
        if sorted(group) != thresholds:
            raise ValueError(f"batch {b} measured T = {sorted(group)}, the reference batch T = {thresholds}")
    ref = {t: _odds_scale_for(profile, div, k, by_batch[reference_batch][t]) for t in thresholds}
    scales = {b: [1.0 if b == reference_batch else _odds_scale_for(profile, div, k, group[t]) / ref[t]
                  for t in thresholds] for b, group in sorted(by_batch.items())}
    return BatchAcceptance(reference_batch=reference_batch, thresholds=thresholds, odds_scale=scales, source=source)
