"""Simulator inputs from files and names: SLO specs, policies, trace workloads, and a reach check.

Shared by ``fsd sim`` and the benchmarks (which import this, never the CLI). Bad input is a ``ValueError``
naming the file and the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from policies.base import Policy
from policies.slo import SLOSpec
from sim.profile import Profile
from sim.workload import Workload

#: The shipped steady workload, the default of ``fsd sim``.
DEFAULT_WORKLOAD = Path(__file__).resolve().parent / "workloads" / "steady.yaml"


def load_mapping(path: Path, what: str) -> dict[str, Any]:
    """The mapping a YAML or JSON file holds (``what`` names the file's role in errors)."""
    import yaml

    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"{what} file {str(path)!r} does not exist") from None
    try:
        data = yaml.safe_load(text)  # YAML is a superset of JSON
    except yaml.YAMLError as exc:
        raise ValueError(f"{what} file {str(path)!r} is not valid YAML/JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} file {str(path)!r} must hold a mapping")
    return data


def load_slo(path: str | None) -> SLOSpec:
    """The SLO spec in a YAML/JSON file, or ``SLOSpec.default()`` without one."""
    from pydantic import ValidationError

    from fsd_common.validation import format_validation_error

    if path is None:
        return SLOSpec.default()
    try:
        return SLOSpec.model_validate(load_mapping(Path(path), "slo"))
    except ValidationError as exc:
        raise ValueError(f"slo {path!r}: {format_validation_error(exc, first_only=True)}") from None


def policy_spec(text: str) -> str | dict[str, Any]:
    """A policy name/JSON string, or the mapping in a YAML/JSON file when ``text`` names one."""
    if text.lstrip().startswith("{"):  # JSON, never a path (a written-out spec is longer than a file name may be)
        return text
    candidate = Path(text)
    try:
        is_file = candidate.is_file()
    except OSError:  # not a name the filesystem takes: a name or JSON, as given
        is_file = False
    if candidate.suffix in (".yaml", ".yml", ".json") or is_file:
        return load_mapping(candidate, "policy")
    return text


def build_policy(text: str, slo: SLOSpec, profile: Profile, k: int | None = None,
                 replica_bounds: tuple[int, int] | None = None) -> Policy:
    """The policy ``text`` names (see :func:`policy_spec`), given the profile's speed curve and latency model
    (and ``replica_bounds``, ``SimConfig.policy_replica_bounds()``, when its replica count is honoured)."""
    from policies.registry import make_policy

    return make_policy(
        policy_spec(text), slo,
        speed_curve=profile.to_speed_curve(k=k), latency_model=profile.to_latency_model(k=k),
        operating_model=profile.to_operating_model(), replica_bounds=replica_bounds,
    )


def trace_workload(path: str, *, time_scale: float = 1.0, sample_fraction: float = 1.0,
                   max_context: int = 2048, duration_s: float | None = None) -> Workload:
    """A workload replaying an Azure-format trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``)."""
    return Workload.from_dict(
        {
            "name": Path(path).stem,
            "duration_s": duration_s,
            "arrivals": {"kind": "trace", "path": path, "time_scale": time_scale,
                         "sample_fraction": sample_fraction},
            "prompt_tokens": {"kind": "trace"},
            "output_tokens": {"kind": "trace"},
            "max_context": max_context,
        },
        source="--trace",
    )


def unreachable_tpot_targets(slo: SLOSpec, profile: Profile, div: str, k: int) -> list[str]:
    """Tiers whose p95 TPOT target is below the profile's best case (one sequence, no queue, the tier's
    highest T): no policy can meet them, which an operator should hear before reading attainment."""
    out = []
    for name, tier in slo.tiers.items():
        if tier.tpot_ms is None:
            continue
        ceiling = tier.fixed_threshold if tier.fixed_threshold is not None else tier.max_threshold
        best = profile.tpot_ms(div, ceiling, k, batch=1)
        if best > tier.tpot_ms:
            out.append(f"tier {name!r}: p95 TPOT target {tier.tpot_ms:g} ms is below this profile's best case "
                       f"({best:.0f} ms per token at batch 1, T = {ceiling:g}); no policy can meet it "
                       f"({profile.provenance.pair}; --profile or --slo to change)")
    return out
