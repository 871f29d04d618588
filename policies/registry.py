"""Build policies from config by name: ``make_policy({"policy": "pid", "kp": 0.5}, slo)``.

A spec is either a name (``"pid"``, ``"bandit"``, ``"static:0.5"``…, every parameter at its default) or
a mapping with ``policy`` plus that policy's parameters and an optional ``guards`` block::

    {"policy": "pid", "metric": "tpot", "kp": 0.3, "ki": 0.1,
     "guards": {"quality": true, "stale_after_s": 5, "max_rate": 0.5, "min_change": 0.02}}

``quality`` is ``true``/``false`` or the quality guard's parameters (``{"alpha": 0.1, "margin": 0}``).

Parameters are validated by one pydantic model per policy (``extra="forbid"``); any problem raises
ValueError naming the field, e.g. ``pid.kp: Input should be a valid number``. Guards default to
``quality: true, stale_after_s: 5`` (pass ``"guards": false`` for the bare policy).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fsd_common.validation import format_validation_error
from policies.bandit import BanditPolicy
from policies.base import Policy
from policies.feedforward import FeedForwardPolicy, LinearLatencyModel, SpeedCurve, SpeedPoint
from policies.guards import guarded
from policies.mpc import ModelPredictivePolicy
from policies.operating_model import OperatingModel
from policies.pid import PIDPolicy
from policies.signals import ControlMetric, LoadSignal
from policies.slo import SLOSpec
from policies.static import StaticPolicy


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StaticParams(_Params):
    thresholds: float | dict[str, float] = Field(0.0, description="one T for every tier, or tier → T")
    draft_lengths: int | dict[str, int] | None = Field(None, description="one k for every tier, or tier → k")
    batch_cap: int | None = Field(None, ge=1, description="the most requests a replica decodes at once (None: no cap)")


class PIDParams(_Params):
    tiers: list[str] | None = None
    metric: ControlMetric = "tpot"
    kp: float = Field(0.3, ge=0)
    ki: float = Field(0.2, ge=0)
    kd: float = Field(0.0, ge=0)
    setpoint: float = 0.0
    deadband: float = Field(0.02, ge=0)
    max_rate: float | None = Field(0.2, gt=0)
    error_clip: float = Field(2.0, gt=0)
    max_dt_s: float | None = Field(None, gt=0)
    min_samples: int = Field(1, ge=1)


class BanditParams(_Params):
    tier: str | None = None
    arms: list[float] | list[tuple[float, int]] | None = None
    min_credited: int = Field(3, ge=1)
    window: int | None = Field(100, ge=1)
    discount: float | None = Field(None, gt=0, le=1)
    c: float = Field(0.2, ge=0)
    distortion_weight: float = Field(0.1, ge=0)
    distortion_penalty: float = Field(2.0, ge=0)
    context: LoadSignal = "arrival_rate"
    context_bins: list[float] | None = None
    seed: int = 0


class SpeedPointParams(_Params):
    threshold: float = Field(ge=0)
    tokens_per_iteration: float = Field(gt=0)
    mean_distortion: float = Field(0.0, ge=0)


class LatencyParams(_Params):
    draft_ms_per_token: float = Field(ge=0)
    verify_ms: float = Field(gt=0)
    draft_ms_per_token_per_seq: float = Field(0.0, ge=0)
    verify_ms_per_seq: float = Field(0.0, ge=0)
    draft_length: int = Field(4, ge=1)


class FeedForwardParams(_Params):
    curve: list[SpeedPointParams] | None = None
    latency: LatencyParams | None = None
    tiers: list[str] | None = None
    headroom: float = Field(0.8, gt=0, le=1)
    respect_budget: bool = True
    trim_kp: float = Field(0.2, ge=0)
    trim_ki: float = Field(0.2, ge=0)
    trim_deadband: float = Field(0.02, ge=0)
    trim_setpoint: float = 0.0
    max_batch_size: int | None = Field(None, ge=1)


class MPCParams(_Params):
    model: str | None = Field(None, description="operating-model JSON (None: the injected one, else the default pair's)")
    max_batch: int = Field(8, ge=1)
    prompt_tokens: float = Field(200.0, ge=0)
    initial_margin: float = Field(1.7, ge=1)
    margin_gain_up: float = Field(0.6, ge=0)
    margin_gain_down: float = Field(0.1, ge=0)
    margin_limits: tuple[float, float] = (1.0, 4.0)
    budget_margin: float = Field(0.1, ge=0, lt=1)
    alpha: float = Field(0.3, gt=0, le=1)
    rate_decay: float = Field(0.97, ge=0, lt=1)
    step_decay: float = Field(0.9, ge=0, lt=1)
    step_slope_prior: float = Field(0.05, gt=0, description="spread of the step fits' prior on a batch-dependent "
                                    "correction; smaller: one ratio for every batch until far-apart batches differ "
                                    "(the plain fit's; session 37: 1.5 before)")
    draft_slope_prior: float | None = Field(1.5, gt=0, description="the same for speculative steps' fits alone "
                                            "(None: step_slope_prior)")
    draft_prior: Literal["model", "plain"] = Field("model", description="speculative steps before any is measured: "
                                                  "the profile's step, or the plain steps' measured correction")
    step_fit: Literal["line", "batch"] = Field("line", description="step-time fits: a line in the per-row share "
                                               "(fixed and per-row parts) or a ratio per batch size, shrunk "
                                               "toward the pooled ratio where no window ran")
    switch_margin: float = Field(0.1, ge=0)
    probe_after: int = Field(30, ge=1)
    probe_hold_ticks: int = Field(0, ge=0, description="a probe that switched the kind of step holds it until a window "
                                  "of that kind is measured, at most this many ticks (0: off; session 44: no gain)")
    min_samples: int = Field(5, ge=1)
    batch_z: float = Field(1.65, ge=0)
    short_enter: float = Field(0.05, ge=0, le=1)
    short_exit: float = Field(0.02, ge=0, le=1)
    t_grid: list[float] = Field(default_factory=list)
    min_replicas: int | None = Field(None, ge=1, description="None: the owner's (Serve's autoscaling_config), else 1")
    max_replicas: int | None = Field(
        None, ge=1, description="None: the owner's; with neither, the policy emits no replica count")
    scale_down_slack: float = Field(0.15, ge=0)
    spread_prior: float = Field(0.3, gt=0, description="log-spread of request latencies until measured")
    look_ahead_windows: int = Field(10, ge=0, description="windows whose peak rows (plus Little's batch) every "
                                    "candidate is planned for where the draft's catch-up is modelled; 0: off")
    rate_z: float = Field(2.0, ge=0, description="with the look-ahead, candidates must meet at this Poisson upper "
                          "bound (standard deviations) of the recent windows' arrival rate; 0: off")
    best_effort_relax_s: float = Field(20.0, ge=0, description="seconds a move to less distortion waits where no "
                                       "candidate is predicted to meet (0: at once; 20 since session 45)")
    higher_t_ties: bool = Field(False, description="where no candidate is predicted to meet, a tie the model cannot "
                                "separate goes to the higher T (acceptance only rises with T); off: the lower")
    batch_cap: bool = Field(False, description="also cap the batch where the TPOT target needs fewer rows and the "
                            "TTFT target has room for the queue (Decision.batch_cap)")
    cap_utilisation: float = Field(0.85, gt=0, lt=1, description="with batch_cap: the most load, as a share of what "
                                   "the capped rows serve, a cap is planned for")
    rate_prior_s: float = Field(0.0, ge=0, description="the arrival rate is read over at least this many seconds from "
                                "the start (0: from the first window)")
    rate_rise_decay: float = Field(0.0, ge=0, lt=1, description="a second, shorter memory of the arrival rate (per-window "
                                   "decay); the rate is the larger of the two: it rises within a few windows, falls "
                                   "over rate_decay's (0: off)")
    queue_joins: bool = Field(True, description="plan every candidate for at least the rows running plus those "
                              "queued where the batch has room (they join at the next step); false: the rows running "
                              "alone (the default before session 31)")
    relax_delay_s: float = Field(4.0, ge=0, description="a tier moves to a point of less distortion than the one in "
                                 "force only once every decision over this many seconds wanted it (0: at once, the "
                                 "default before session 34)")
    stall_windows: int = Field(0, ge=0, description="plan the joiners' prefill stall at no less than the share of "
                               "replica time the last this many windows spent prefilling (0: off)")
    hard_requests: bool = Field(False, description="a TPOT target is met where the request at the tier's attainment "
                                "quantile of acceptance meets it (the model's per-request spread), not the mean request "
                                "(session 40: the default for live seeds 67-68, then off)")


class QualityParams(_Params):
    """The quality guard's parameters (:class:`policies.guards.QualityGuard`)."""

    backoff: float = Field(0.7, gt=0, lt=1)
    alpha: float = Field(0.5, gt=0, le=1, description="EWMA weight of the newest window's distortion")
    margin: float = Field(0.1, ge=0, lt=1, description="back off above (1 - margin) x budget")
    recover_rate: float = Field(0.02, ge=0, description="cap recovery, share of the tier's range per second")
    cooldown_s: float | None = Field(None, ge=0)


class GuardParams(_Params):
    quality: bool | QualityParams = True
    stale_after_s: float | None = Field(5.0, gt=0)
    max_gap_s: float | None = Field(None, gt=0)
    max_rate: float | None = Field(None, gt=0)
    min_change: float | None = Field(None, gt=0)


def _build_static(p: StaticParams, slo: SLOSpec, ctx: _Context) -> Policy:
    return StaticPolicy(slo, p.thresholds, p.draft_lengths, p.batch_cap)


def _build_pid(p: PIDParams, slo: SLOSpec, ctx: _Context) -> Policy:
    return PIDPolicy(slo, **p.model_dump())


def _build_bandit(p: BanditParams, slo: SLOSpec, ctx: _Context) -> Policy:
    return BanditPolicy(slo, **p.model_dump())


def _build_feedforward(p: FeedForwardParams, slo: SLOSpec, ctx: _Context) -> Policy:
    curve = ctx.speed_curve
    if p.curve is not None:
        curve = SpeedCurve(tuple(SpeedPoint(**pt.model_dump()) for pt in p.curve))
    if curve is None:
        raise ValueError("feedforward.curve: a speed curve is required (in the spec or from a profile)")
    latency: LinearLatencyModel | Callable[[float, float], float] | None = ctx.latency_model
    if p.latency is not None:
        latency = LinearLatencyModel(**p.latency.model_dump())
    if latency is None:
        raise ValueError("feedforward.latency: a latency model is required (in the spec or from a profile)")
    return FeedForwardPolicy(
        slo,
        curve,
        latency,
        tiers=p.tiers,
        headroom=p.headroom,
        respect_budget=p.respect_budget,
        trim_kp=p.trim_kp,
        trim_ki=p.trim_ki,
        trim_deadband=p.trim_deadband,
        trim_setpoint=p.trim_setpoint,
        max_batch_size=p.max_batch_size,
    )


def _build_mpc(p: MPCParams, slo: SLOSpec, ctx: _Context) -> Policy:
    model = OperatingModel.load(p.model) if p.model is not None else ctx.operating_model
    params = p.model_dump(exclude={"model", "min_replicas", "max_replicas"})
    # Replica bounds: the spec's, else the owner's (the autoscaler the decision is handed to).
    owner_min, owner_max = ctx.replica_bounds if ctx.replica_bounds is not None else (None, None)
    min_replicas = p.min_replicas if p.min_replicas is not None else (owner_min or 1)
    max_replicas = p.max_replicas if p.max_replicas is not None else owner_max
    return ModelPredictivePolicy(slo, model, min_replicas=min_replicas, max_replicas=max_replicas, **params)


class _Context:
    """Things a spec cannot carry as plain data, injected by the caller (e.g. the simulator's profile)."""

    def __init__(
        self,
        speed_curve: SpeedCurve | None,
        latency_model: LinearLatencyModel | Callable[[float, float], float] | None,
        operating_model: OperatingModel | None = None,
        replica_bounds: tuple[int, int] | None = None,
    ) -> None:
        self.speed_curve = speed_curve
        self.latency_model = latency_model
        self.operating_model = operating_model
        self.replica_bounds = replica_bounds


_REGISTRY: dict[str, tuple[type[_Params], Callable[[Any, SLOSpec, _Context], Policy]]] = {
    "static": (StaticParams, _build_static),
    "pid": (PIDParams, _build_pid),
    "bandit": (BanditParams, _build_bandit),
    "feedforward": (FeedForwardParams, _build_feedforward),
    "mpc": (MPCParams, _build_mpc),
}

#: Parameters added with a default that changes what the policy did before them, per policy name, with the value
#: that does what it did. A resolved spec (every parameter written out, ``resolve_spec``) recorded before one of them
#: existed lacks it; filled with this value, it rebuilds the policy that ran (``sim.decision_replay``). Also a
#: default changed since specs were written out (session 40): a spec recorded as given, not written out, ran it.
ADDED_SINCE_RECORDED: dict[str, dict[str, Any]] = {
    "mpc": {
        "relax_delay_s": 0.0,  # session 34: default 4 s
        "initial_margin": 1.3,  # session 43: default 1.7; every spec recorded as given ran 1.3
        "best_effort_relax_s": 0.0,  # session 45: default 20 s
    },
}

#: Names ``make_policy`` accepts.
POLICY_NAMES: tuple[str, ...] = tuple(_REGISTRY)

#: The shipped SLO policy (what `fsd serve` runs when the config names none, and the "slo" alias):
#: model-predictive control of (T, k) per tier (policies/mpc.py) in the default guards. It predicts
#: each tier's TPOT/TTFT from the operating model (the simulator injects its profile's; otherwise the
#: default pair's, policies/models/smollm2-135m.json), corrects the model online and learns its margin
#: from measured attainment. Evaluated on held-out cases by `benchmarks/policy_compare.py` (README, docs/figures.md).
#: The previous default, a PID on the live mean TPOT 25 % under target, is
#: {"policy": "pid", "metric": "tpot_live", "setpoint": -0.25}.
#: Its quality guard is a safety net, not a second budget: the policy already keeps each tier
#: ``budget_margin`` under its budget with a measured correction of its distortion model (a tier measured
#: short plans to the budget itself), so the guard backs off only when a ~10-window average (``alpha``
#: 0.1) exceeds the budget itself (``margin`` 0).
#: At the default guard (one-window-weighted estimate against 0.9 x budget) it fired on the
#: noise of the points the policy picks deliberately within budget (an economy tier at 0.29 of 0.35).
DEFAULT_POLICY_SPEC: dict[str, Any] = {"policy": "mpc", "guards": {"quality": {"alpha": 0.1, "margin": 0.0}}}


def _normalise_spec(spec: str | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(spec, str):
        text = spec.strip()
        if text.startswith("{"):
            try:
                loaded = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"policy spec: invalid JSON ({exc})") from None
            if not isinstance(loaded, dict):
                raise ValueError("policy spec: JSON must be an object")
            return loaded
        name, _, arg = text.partition(":")
        if name == "static" and arg:
            try:
                return {"policy": "static", "thresholds": float(arg)}
            except ValueError:
                raise ValueError(f"static.thresholds: not a number: {arg!r}") from None
        return {"policy": name}
    if not isinstance(spec, Mapping):
        raise ValueError(f"policy spec must be a name or a mapping, got {type(spec).__name__}")
    return dict(spec)


def _parse_spec(spec: str | Mapping[str, Any]) -> tuple[str, _Params, GuardParams | None]:
    """The policy's name, its validated parameters and its guards' (None: no guards) from a spec."""
    raw = _normalise_spec(spec)
    if raw.get("policy") == "slo":
        # The alias expands to the shipped spec; keys given beside it (guards, gains) override. A guards
        # mapping overrides key by key, so setting stale_after_s keeps the shipped quality guard.
        given = {k: v for k, v in raw.items() if k != "policy"}
        if isinstance(given.get("guards"), Mapping):
            given["guards"] = {**DEFAULT_POLICY_SPEC["guards"], **given["guards"]}
        raw = {**DEFAULT_POLICY_SPEC, **given}
    name = raw.pop("policy", None)
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(
            f"policy: unknown policy {name!r}; known policies: {['slo', *POLICY_NAMES]}"
        )
    guards_raw = raw.pop("guards", {})
    params_model = _REGISTRY[name][0]
    try:
        params = params_model.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(format_validation_error(exc, root=name)) from None
    if guards_raw is False or guards_raw is None:
        guard_params: GuardParams | None = None
    else:
        if guards_raw is True:
            guards_raw = {}
        guards_raw = dict(guards_raw) if isinstance(guards_raw, Mapping) else guards_raw
        quality_raw = guards_raw.pop("quality", True) if isinstance(guards_raw, dict) else True
        try:
            guard_params = GuardParams.model_validate(guards_raw)
        except ValidationError as exc:
            raise ValueError(format_validation_error(exc, root="guards")) from None
        if isinstance(quality_raw, Mapping):  # validated apart, so that errors name the field alone
            try:
                quality: bool | QualityParams = QualityParams.model_validate(quality_raw)
            except ValidationError as exc:
                raise ValueError(format_validation_error(exc, root="guards.quality")) from None
        elif isinstance(quality_raw, bool):
            quality = quality_raw
        else:
            raise ValueError(f"guards.quality: expected true, false or the guard's parameters, got {quality_raw!r}")
        guard_params = guard_params.model_copy(update={"quality": quality})
    return name, params, guard_params


def resolve_spec(spec: str | Mapping[str, Any]) -> dict[str, Any]:
    """``spec`` with every parameter written out (the alias expanded, defaults filled in, guards resolved):
    it builds the same policy as ``spec`` under today's defaults and keeps building it after a default
    changes (a recorded history replays exactly). Raises ValueError like :func:`make_policy`."""
    name, params, guard_params = _parse_spec(spec)
    resolved: dict[str, Any] = {"policy": name, **params.model_dump(mode="json")}
    if guard_params is None:
        resolved["guards"] = False
    else:
        quality = guard_params.quality
        if quality is True:  # the guard at its defaults, written out
            quality = QualityParams()
        resolved["guards"] = {**guard_params.model_dump(mode="json"),
                              "quality": quality if quality is False else quality.model_dump(mode="json")}
    return resolved


def make_policy(
    spec: str | Mapping[str, Any],
    slo: SLOSpec,
    *,
    speed_curve: SpeedCurve | None = None,
    latency_model: LinearLatencyModel | Callable[[float, float], float] | None = None,
    operating_model: OperatingModel | None = None,
    replica_bounds: tuple[int, int] | None = None,
) -> Policy:
    """The policy ``spec`` names, with its parameters validated, wrapped in its guards.

    ``speed_curve`` / ``latency_model`` feed the feed-forward policy and ``operating_model`` the
    model-predictive one when the spec does not carry them (the simulator passes the ones derived from
    its profile). ``replica_bounds`` (min, max): the autoscaler a ``Decision.replicas`` is handed to
    (Serve's ``autoscaling_config``, the simulator's autoscaler); the model-predictive policy asks for
    replicas within them when its spec sets none (None and no ``max_replicas``: it asks for none).
    Raises ValueError naming the bad field,
    or listing the known names for an unknown policy.
    """
    name, params, guard_params = _parse_spec(spec)
    build = _REGISTRY[name][1]
    try:
        policy = build(params, slo, _Context(speed_curve, latency_model, operating_model, replica_bounds))
    except ValueError as exc:
        message = str(exc)
        if message.startswith(f"{name}."):
            raise
        # Messages that start with a field name ("kp must be ...", "tiers: ...") get the policy prefix.
        sep = "." if re.match(r"^[A-Za-z_]\w*(\[[^\]]*\])?(:| must)", message) else ": "
        raise ValueError(f"{name}{sep}{message}") from None
    if guard_params is None:
        return policy
    quality = guard_params.quality
    return guarded(policy, slo, quality=quality if isinstance(quality, bool) else quality.model_dump(),
                   stale_after_s=guard_params.stale_after_s, max_gap_s=guard_params.max_gap_s,
                   max_rate=guard_params.max_rate, min_change=guard_params.min_change)


def describe(policy: object) -> dict[str, Any]:
    """A JSON-able description for status endpoints: name, params, last decision, inner policy."""
    out: dict[str, Any] = {"name": getattr(policy, "name", type(policy).__name__)}
    params = getattr(policy, "params", None)
    out["params"] = params() if callable(params) else {}
    last = getattr(policy, "last_decision", None)
    if last is not None:
        out["last_decision"] = {
            "thresholds": dict(last.thresholds),
            "draft_lengths": dict(last.draft_lengths),
            "batch_cap": last.batch_cap,
            "replicas": last.replicas,
            "reason": last.reason,
        }
    else:
        out["last_decision"] = None
    inner = getattr(policy, "inner", None)
    if inner is not None:
        out["inner"] = describe(inner)
    return out


__all__ = ["POLICY_NAMES", "describe", "make_policy"]
