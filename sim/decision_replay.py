"""A recorded control history replayed through a policy, open loop: what it decides on the windows the
live controller decided on.

The controller's status history (``GET /v1/fsd/status?history=N``; ``benchmarks/load.py --ticks``) keeps
every window it decided on (the :class:`~policies.telemetry.Telemetry` as JSON) beside the decision, and an
entry with an ``event`` where a fresh policy object took over, with the spec, the SLO and the T it was seeded
at (``controller.control_loop.policy_event_record``). A policy never reads a clock, so fed the same windows
the spec that ran decides what it decided live: replaying it is a check that the history is complete (every
tick equal), and replaying another spec answers "what would it have chosen, tick by tick, on what the live
one saw". Open loop: from the first tick a candidate decides otherwise, the windows after it are what the
recorded choices produced, not what the candidate's would have; the replay shows decisions, not their
outcome (that is the simulator's, ``fsd sim compare --trace``).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policies.base import Policy
from policies.decision import decision_to_json
from policies.operating_model import OperatingModel
from policies.registry import ADDED_SINCE_RECORDED, resolve_spec
from policies.slo import SLOSpec
from policies.telemetry import telemetry_from_json
from policies.tiers import seed_policy
from sim.profile import Profile

#: What a replayed decision must equal to count as the same (its reason is prose and may differ).
COMPARED_FIELDS = ("thresholds", "draft_lengths", "batch_cap", "replicas")


@dataclass(frozen=True, slots=True)
class PolicySpan:
    """The ticks one policy object decided: the event where it took over (None: the history does not reach
    back to it, so a replay starts from a state the live policy did not have) and the tick entries after it."""

    event: Mapping[str, Any] | None
    ticks: list[Mapping[str, Any]]

    @property
    def spec(self) -> Mapping[str, Any] | None:
        """The spec that built the policy: written out in full where the history has it (it rebuilds the same
        policy after a default changed), else as it was given under today's defaults; either way a parameter added
        since the recording (``policies.registry.ADDED_SINCE_RECORDED``) at the value that did what ran."""
        if self.event is None:
            return None
        event: Mapping[str, Any] = self.event["event"]
        recorded: Mapping[str, Any] | None = event.get("resolved_policy")
        if recorded is not None:
            base: Mapping[str, Any] = recorded
            keep = set(recorded)  # written out: every parameter it holds is what ran
        else:
            # From before specs were written out, so before every parameter in ADDED_SINCE_RECORDED: today's
            # defaults, those at what they were, what was given as given.
            given = event["policy"]
            try:
                base = resolve_spec(given)
            except ValueError:
                spec: Mapping[str, Any] = given
                return spec
            keep = set(given) if isinstance(given, Mapping) else set()
        # A parameter added since: at the value that does what the policy did then.
        added = ADDED_SINCE_RECORDED.get(str(base.get("policy")), {})
        return {**base, **{k: v for k, v in added.items() if k not in keep}}

    @property
    def slo(self) -> SLOSpec | None:
        raw = None if self.event is None else self.event.get("slo")
        return None if raw is None else SLOSpec.model_validate(raw)

    @property
    def operating_model(self) -> OperatingModel | None:
        """The model the policy was built with (None: the policy's default, or not recorded)."""
        raw = None if self.event is None else self.event.get("operating_model")
        return None if raw is None else OperatingModel.from_dict(raw)

    @property
    def replica_bounds(self) -> tuple[int, int] | None:
        raw = None if self.event is None else self.event.get("replica_bounds")
        return None if raw is None else (int(raw[0]), int(raw[1]))


def last_policy_span(history: Sequence[Mapping[str, Any]]) -> PolicySpan:
    """The span of the policy object that decided last in ``history`` (oldest entry first)."""
    start = 0
    event: Mapping[str, Any] | None = None
    for i, entry in enumerate(history):
        if not isinstance(entry, Mapping):
            raise ValueError(f"history[{i}]: expected an object, got {type(entry).__name__}")
        if entry.get("event"):
            start, event = i + 1, entry
    ticks = [entry for entry in history[start:] if not entry.get("event") and entry.get("telemetry") is not None]
    return PolicySpan(event, ticks)


@dataclass(frozen=True, slots=True)
class ReplayedTick:
    time_s: float
    recorded: Mapping[str, Any] | None  # the decision as the history shows it (None: the policy raised)
    replayed: Mapping[str, Any] | None

    @property
    def same(self) -> bool:
        if self.recorded is None or self.replayed is None:
            return self.recorded is None and self.replayed is None
        # Plain equality: a decision's T is finite and its k, cap and replicas are ints (Decision validates them).
        return all(self.recorded.get(f) == self.replayed.get(f) for f in COMPARED_FIELDS)


def build_policy(spec: str | Mapping[str, Any], slo: SLOSpec, operating_model: OperatingModel | None = None,
                 replica_bounds: tuple[int, int] | None = None) -> Policy:
    """``spec`` built as the live controller builds it: the model-predictive policy's model is the controller's
    (its status names it under ``operating_model``: a profile's, :func:`profile_model`, or None for the
    policy's default, the default pair's), nothing else injected."""
    from policies.registry import make_policy

    return make_policy(spec, slo, operating_model=operating_model, replica_bounds=replica_bounds)


def profile_model(profile: Profile, div: str | None = None) -> OperatingModel:
    """The operating model the controller derives from ``profile`` (``div`` where the profile has it)."""
    return profile.to_operating_model(div=div if div is not None and div in profile.divs() else profile.default_div)


def load_histories(path: str | Path) -> dict[str, list[Mapping[str, Any]]]:
    """The histories in ``path``, by label: a saved ``/v1/fsd/status`` answer (label ``"status"``), or a
    ``benchmarks/load.py --ticks`` file (``NAME:ROUND`` per run); ``.gz`` is read compressed."""
    p = Path(path)
    try:
        raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
        data = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise ValueError(f"history file {str(p)!r}: {exc}") from None
    if isinstance(data, Mapping) and isinstance(data.get("history"), list):
        return {"status": data["history"]}
    if isinstance(data, Mapping) and isinstance(data.get("runs"), list):
        return {f"{run['name']}:{run['round']}": run["history"] for run in data["runs"]}
    raise ValueError(f"history file {str(p)!r}: expected a /v1/fsd/status answer (with 'history') or a "
                     "benchmarks/load.py --ticks file (with 'runs')")


def replay(span: PolicySpan, policy: Policy, slo: SLOSpec) -> list[ReplayedTick]:
    """``policy`` (fresh) seeded where the span's policy was, fed the span's windows in order."""
    if span.event is not None:
        seed_policy(policy, slo, span.event.get("thresholds") or {})
    out: list[ReplayedTick] = []
    for i, entry in enumerate(span.ticks):
        try:
            telemetry = telemetry_from_json(entry["telemetry"])
        except ValueError as exc:
            raise ValueError(f"tick {i} (time_s {entry.get('time_s')}): {exc}") from None
        try:
            replayed = decision_to_json(policy.decide(telemetry))
        except Exception:  # as live: a policy that raises holds the thresholds (the history records None)
            replayed = None
        out.append(ReplayedTick(telemetry.time_s, entry.get("decision"), replayed))
    return out


def summary(ticks: Sequence[ReplayedTick]) -> dict[str, Any]:
    """Counts, and the first ticks where the replay decides otherwise (both decisions shown)."""
    differ = [t for t in ticks if not t.same]
    return {
        "ticks": len(ticks),
        "same": len(ticks) - len(differ),
        "differ": len(differ),
        "first_differences": [{"time_s": t.time_s, "recorded": t.recorded, "replayed": t.replayed}
                              for t in differ[:5]],
    }
