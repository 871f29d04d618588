"""The service configuration: one YAML file, validated by pydantic at the boundary.

Every section rejects unknown keys (a typo is an error, not a silent default) and every error names the
offending field by its dotted path, e.g. ``control.interval_s: Input should be greater than 0``.

Layout (all sections optional; ``FSDConfig()`` is the shipped default service)::

    model:    pair, engine (native | vllm) and its parameters (k, divergence, acceptance rule, batch size)
    replica:  queue bound, request limits, fail-safe staleness
    slo:      a policies.slo.SLOSpec (tiers with latency targets, quality budgets, T bounds)
    control:  interval, active policy, optional shadow policy, history length
    serve:    Ray Serve options (num_replicas or autoscaling_config, max_ongoing_requests, CPUs)
    http:     host, port, admin token, body and timeout limits
    ray:      address of an existing cluster (None ⇒ start a local one)
    recording: traffic recording (off by default): path, size bound, shadow-estimate window
    vllm:     options of `model.engine: vllm` replicas (interpreter, HF directories, KV cache)
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from controller.autoscaling import POLICY_FUNCTION as AUTOSCALING_POLICY_FUNCTION
from fsd_common.validation import format_validation_error
from policies.slo import SLOSpec

#: Environment variable that names the config file for ``serve run controller.app:app``.
CONFIG_ENV = "FSD_CONFIG"
#: Environment variable holding the admin bearer token (overrides ``http.admin_token``).
ADMIN_TOKEN_ENV = "FSD_ADMIN_TOKEN"


#: The replica engines ``model.engine`` names.
ENGINES = ("native", "vllm")
#: Pairs whose HF directories the vLLM engine finds by itself (others need ``vllm.target_dir``).
VLLM_PAIRS = ("smollm2-135m",)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    """The model pair and the engine's static parameters."""

    pair: str = Field("smollm2-135m", description="pair name for decoder.models.load_pair; 'tiny' = test pair")
    dtype: str | None = Field(None, description="target compute dtype (fp32, bf16…; None = the pair's)")
    draft_dtype: str | None = Field(None, description="draft dtype: a float dtype, 'int8' or 'int8-row' (None = the pair's)")
    seed: int = Field(0, description="seed of the tiny test pair and of the engine's request seeds")
    linear_layout: Literal["auto", "off", "transposed"] | None = Field(
        None, description="target's small-batch weight layout (decoder.linear_layout): 'auto' times it at load, "
        "'off', 'transposed' (None = the pair's: auto for real pairs)"
    )
    num_draft_tokens: int = Field(4, ge=1, le=16, description="draft length k")
    div: str = Field("kl", min_length=1, description="divergence D compared with T (decoder's names)")
    rule: str = Field("reducible", min_length=1, description="FSD acceptance rule (decoder's names)")
    max_batch_size: int = Field(8, ge=1, le=256, description="max sequences in one engine step")
    share_kv: bool | None = Field(
        None, description="native engine: the draft runs on the target's KV cache (no draft prefill, no catch-up "
        "when a row starts drafting); None = the pair's default: shared where the draft is a copy of the target "
        "(smollm2-135m), not for separate draft models"
    )
    torch_threads: int | None = Field(
        1, ge=1, description="torch intra-op threads per replica (None = torch's default)"
    )
    engine: Literal["native", "vllm"] = Field(
        "native", description="replica engine: 'native' (decoder/, HF transformers) or 'vllm' (vLLM with the "
        "fsd_vllm plugin, in its own environment: `make vllm-env`; see the `vllm` section and docs/vllm.md)"
    )

    @field_validator("engine", mode="before")
    @classmethod
    def _known_engine(cls, v: Any) -> Any:
        # pydantic's own Literal message does not say what was given; name the offending value.
        if v not in ENGINES:
            raise ValueError(f"unknown engine {v!r}; expected one of {list(ENGINES)}")
        return v


class VLLMConfig(_Section):
    """Options of ``model.engine: vllm`` replicas (ignored by the native engine). The replica process runs
    in the vLLM environment's interpreter; vLLM needs the pair as HF directories (docs/vllm.md)."""

    python: str | None = Field(
        None, description="interpreter of the vLLM environment (None = $FSD_VLLM_PYTHON, else "
        "<source checkout>/.venv-vllm/bin/python, what `make vllm-env` builds)"
    )
    target_dir: str | None = Field(
        None, description="HF directory of the target (None = the pair's: smollm2-135m's dequantized target)"
    )
    draft_dir: str | None = Field(
        None, description="HF directory of the draft (None = the target's first `draft_layers` layers)"
    )
    draft_layers: int = Field(
        24, ge=1, description="layers of the layer-truncated target used as draft when draft_dir is None"
    )
    max_model_len: int = Field(2048, ge=16, description="vLLM max_model_len: the replica's context")
    kv_cache_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE of a CPU replica (whole GiB)")
    memory_fraction: float = Field(
        0.12, gt=0, le=1, description="vLLM gpu_memory_utilization (on GPU: share of device memory)"
    )
    enforce_eager: bool = Field(True, description="no CUDA graphs / compilation (start-up time on CPU)")

    @field_validator("python", "target_dir", "draft_dir")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        # Absolute at load time (Serve replicas run in another working directory), symlinks kept: a venv's
        # bin/python is a symlink, and resolving it would lose the venv.
        return os.path.abspath(os.path.expanduser(v)) if v is not None else None


class ReplicaConfig(_Section):
    """Per-replica limits and the fail-safe."""

    max_queued: int = Field(32, ge=1, description="waiting + running requests before 503")
    max_new_tokens_limit: int = Field(2048, ge=1, description="largest max_tokens a request may ask")
    default_max_new_tokens: int = Field(128, ge=1, description="max_tokens when a request sets none")
    stale_after_s: float = Field(
        10.0, gt=0, description="no controller update for this long ⇒ every tier drops to its safe T"
    )
    initial_thresholds: dict[str, float] = Field(
        default_factory=dict, description="T per tier before the first controller update (default: safe T)"
    )
    report_interval_s: float | None = Field(
        None, gt=0, le=60, description="how often a replica pushes its report to the controller "
        "(None = control.interval_s)"
    )
    report_timeout_s: float = Field(
        5.0, gt=0, description="a report the controller has not answered in this long is re-sent with the next"
    )
    step_hang_s: float = Field(
        120.0, gt=0, description="an engine step running longer than this makes the replica unhealthy"
    )
    max_consecutive_step_failures: int = Field(
        3, ge=1, description="this many engine steps in a row raising makes the replica unhealthy"
    )

    @field_validator("initial_thresholds")
    @classmethod
    def _finite(cls, v: dict[str, float]) -> dict[str, float]:
        for tier, t in v.items():
            if not (math.isfinite(t) and t >= 0):
                raise ValueError(f"threshold for tier {tier!r} must be finite and >= 0, got {t}")
        return v

    @model_validator(mode="after")
    def _default_within_limit(self) -> ReplicaConfig:
        if self.default_max_new_tokens > self.max_new_tokens_limit:
            raise ValueError(
                f"default_max_new_tokens {self.default_max_new_tokens} exceeds "
                f"max_new_tokens_limit {self.max_new_tokens_limit}"
            )
        return self


class ControlConfig(_Section):
    """The control loop: how often, which policy, which candidate in shadow."""

    interval_s: float = Field(1.0, gt=0, le=60, description="control tick period")
    policy: dict[str, Any] | str | None = Field(
        None,
        description="policy spec for policies.registry.make_policy: a mapping or a name such as 'slo', "
        "'pid', 'static:0.5' (None = the shipped SLO policy)",
    )
    shadow_policy: dict[str, Any] | str | None = Field(
        None, description="candidate policy run beside the active one; logged, never applied"
    )
    profile: str | None = Field(
        None, description="profile JSON (sim/profile.py) whose operating model the model-predictive policy uses, "
        "e.g. one calibrated on the serving machine (`fsd calibrate`); None = the served pair's shipped profile "
        "sim/profiles/<pair>.json when there is one. A path on the node that runs the controller")
    history: int = Field(300, ge=1, le=100_000, description="(telemetry, decision) records kept for status")
    stats_timeout_s: float = Field(
        2.0, gt=0, description="unused since replicas push their reports (kept so old configs still load)"
    )
    forget_replica_after_s: float = Field(
        60.0, gt=0, description="a replica silent this long leaves status and the window's state"
    )
    steer_replicas: bool = Field(
        True, description="with serve.autoscaling_config: the policy's Decision.replicas drives Serve's autoscaler "
        "through its custom-policy hook (controller.autoscaling); false = Serve's default request-based policy",
    )


class ServeOptions(_Section):
    """Ray Serve options of the replica deployment (the slow loop)."""

    num_replicas: int | None = Field(1, ge=1, description="fixed replica count (ignored with autoscaling)")
    autoscaling_config: dict[str, Any] | None = Field(
        None, description="Ray Serve autoscaling_config (min_replicas, max_replicas, target_ongoing_requests…)"
    )
    max_ongoing_requests: int = Field(16, ge=1, description="Serve's per-replica concurrency cap")
    max_queued_requests: int = Field(64, ge=-1, description="Serve handle queue cap (-1 = unbounded)")
    replica_num_cpus: float = Field(1.0, gt=0, description="ray_actor_options num_cpus per replica")
    ingress_num_cpus: float = Field(0.0, ge=0, description="num_cpus of the HTTP ingress")
    health_check_period_s: float = Field(5.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)
    app_name: str = Field("fsd", min_length=1)
    route_prefix: str = Field("/")

    @field_validator("route_prefix")
    @classmethod
    def _slash(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError(f"route_prefix must start with '/', got {v!r}")
        return v


class HTTPConfig(_Section):
    """The HTTP front door."""

    host: str = Field("127.0.0.1", description="bind address (loopback by default)")
    proxy_location: Literal["HeadOnly", "EveryNode"] = Field(
        "HeadOnly", description="where Serve runs HTTP proxies; EveryNode with a routable host on real clusters"
    )
    port: int = Field(8000, ge=0, le=65535)
    admin_token: str | None = Field(
        None, description=f"bearer token for PUT /v1/fsd/*; env {ADMIN_TOKEN_ENV} overrides"
    )
    max_body_bytes: int = Field(1_000_000, ge=1024, description="larger bodies ⇒ 413")
    request_timeout_s: float = Field(120.0, gt=0, description="whole-request deadline ⇒ 504")
    retry_after_s: int = Field(1, ge=1, description="Retry-After sent with 503")
    model_name: str | None = Field(None, description="model id reported by the API (default: the pair name)")

    def resolved_admin_token(self) -> str | None:
        return os.environ.get(ADMIN_TOKEN_ENV) or self.admin_token


class RayConfig(_Section):
    address: str | None = Field(None, description="existing cluster (e.g. 'auto' or 'ray://…'); None = local")
    num_cpus: int | None = Field(2, ge=1, description="CPUs of a locally started cluster")
    object_store_memory: int | None = Field(None, ge=78_643_200, description="bytes, local cluster only")


class RecordingConfig(_Section):
    """Record the service's own traffic as a trace (arrival time, token counts, tier, max_tokens,
    status; never prompt or output text) for replay in the simulator (:mod:`controller.recording`)."""

    enabled: bool = Field(False, description="record every request the ingress admits or refuses for overload")
    path: str = Field("fsd_recording.csv", min_length=1,
                      description="CSV file; a relative path resolves against the working directory of `fsd serve`")
    max_bytes: int = Field(10_000_000, ge=1024, description="rotate the file when it would exceed this size")
    backups: int = Field(1, ge=0, le=100, description="rotated files kept (path.1 … path.N); older ones deleted")
    shadow_window_s: float = Field(
        60.0, gt=0, description="the shadow estimate replays the arrivals of this last window in the simulator"
    )
    shadow_every_s: float = Field(5.0, gt=0, description="recompute the shadow estimate at most this often")
    profile: str | None = Field(None, description="sim profile JSON for the shadow estimate (None = shipped)")

    @field_validator("path", "profile")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        # Absolute at load time: Serve replicas run in another working directory.
        return str(Path(v).expanduser().resolve()) if v is not None else None


class FSDConfig(_Section):
    """The whole service."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    replica: ReplicaConfig = Field(default_factory=ReplicaConfig)
    slo: SLOSpec = Field(default_factory=SLOSpec.default)
    control: ControlConfig = Field(default_factory=ControlConfig)
    serve: ServeOptions = Field(default_factory=ServeOptions)
    http: HTTPConfig = Field(default_factory=HTTPConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    recording: RecordingConfig = Field(default_factory=RecordingConfig)
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)

    @model_validator(mode="after")
    def _vllm_pair(self) -> FSDConfig:
        if self.model.engine == "vllm" and self.vllm.target_dir is None and self.model.pair not in VLLM_PAIRS:
            raise ValueError(
                f"model.engine 'vllm' with pair {self.model.pair!r}: vLLM needs HF directories; the vLLM "
                f"engine finds them for {list(VLLM_PAIRS)} only: set vllm.target_dir (and vllm.draft_dir)"
            )
        return self

    @model_validator(mode="after")
    def _tiers_known(self) -> FSDConfig:
        unknown = sorted(set(self.replica.initial_thresholds) - set(self.slo.tiers))
        if unknown:
            raise ValueError(
                f"replica.initial_thresholds: unknown tier(s) {unknown}; known tiers: {sorted(self.slo.tiers)}"
            )
        for name, t in self.replica.initial_thresholds.items():
            tier = self.slo.tiers[name]
            if not tier.min_threshold <= t <= tier.max_threshold:
                raise ValueError(
                    f"replica.initial_thresholds.{name}: {t} outside the tier's bounds "
                    f"[{tier.min_threshold}, {tier.max_threshold}]"
                )
        from policies.registry import DEFAULT_POLICY_SPEC, make_policy

        for name, spec in (("control.policy", self.control.policy), ("control.shadow_policy", self.control.shadow_policy)):
            if spec is not None or name == "control.policy":
                try:
                    make_policy(spec if spec is not None else DEFAULT_POLICY_SPEC, self.slo)
                except ValueError as exc:
                    raise ValueError(f"{name}: {exc}") from None
        return self

    @property
    def model_name(self) -> str:
        return self.http.model_name or self.model.pair


def parse_config(data: dict[str, Any] | None) -> FSDConfig:
    """Validate a config mapping; ValueError naming each bad field."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"config must be a mapping at the top level, got {type(data).__name__}")
    try:
        return FSDConfig.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"invalid config: {format_validation_error(exc)}") from None


def load_config(path: str | Path | None) -> FSDConfig:
    """Read and validate a YAML config (None ⇒ the default service)."""
    if path is None:
        return FSDConfig()
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ValueError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
    return parse_config(data)


def config_from_env() -> FSDConfig:
    """The config named by ``$FSD_CONFIG`` (default service when unset) — for ``serve run``."""
    return load_config(os.environ.get(CONFIG_ENV) or None)


def steered_replica_bounds(cfg: FSDConfig) -> tuple[int, int] | None:
    """(min, max) replicas the policy may ask for when its ``Decision.replicas`` drives Serve's
    autoscaler: ``serve.autoscaling_config`` is set, ``control.steer_replicas`` is on and the config
    names no other autoscaling policy. None otherwise (the policy asks for no count). The bounds are
    Serve's (its defaults when absent: 1 and 1)."""
    auto = cfg.serve.autoscaling_config
    if auto is None or not cfg.control.steer_replicas:
        return None
    policy = auto.get("policy")
    if policy is not None:
        name = policy.get("policy_function") if isinstance(policy, dict) else None
        if name != AUTOSCALING_POLICY_FUNCTION:
            return None
    low, high = int(auto.get("min_replicas", 1)), int(auto.get("max_replicas", 1))
    return max(1, low), max(1, low, high)


def _one_line_message(message: str) -> str:
    # YAML and pydantic messages span lines; a CLI error is one line (grep-able, log-friendly).
    return " ".join(message.split())


def config_with_overrides(path: str | None, **overrides: Any) -> FSDConfig:
    """Load the config file and apply command-line overrides (``port``, ``host``, ``pair``, ``engine``;
    re-validated, so a bad value still names its field). Errors are one-line ValueErrors naming the file."""
    if path is not None and Path(path).is_dir():
        raise ValueError(f"config {path!r} is a directory, not a YAML file")
    try:
        data = load_config(path).model_dump(mode="json")
    except OSError as exc:  # exists but unreadable (permissions, I/O)
        raise ValueError(f"config file {path!r} is not readable: {exc.strerror or exc}") from None
    except ValueError as exc:
        message = _one_line_message(str(exc))
        if path is not None and path not in message:  # say which file the bad field is in
            message = f"{path}: {message}"
        raise ValueError(message) from None
    if overrides.get("port") is not None:
        data["http"]["port"] = overrides["port"]
    if overrides.get("host") is not None:
        data["http"]["host"] = overrides["host"]
    if overrides.get("pair") is not None:
        data["model"]["pair"] = overrides["pair"]
    if overrides.get("engine") is not None:
        data["model"]["engine"] = overrides["engine"]
    try:
        return parse_config(data)
    except ValueError as exc:
        raise ValueError(_one_line_message(str(exc))) from None
