"""Assemble the Serve application: ingress → replicas, with the controller beside them.

::

    HTTP ──► FSDIngress ──► FSDReplica × N   (continuous batching, T per tier, fail-safe)
                  │               ▲
                  └──► FSDController ─┘       (every interval: stats → Telemetry → Policy → T push)

``build_app(config)`` returns the bound application; ``serve run controller.app:app`` uses the
module attribute ``app``, built lazily from ``$FSD_CONFIG`` (or the defaults) when first accessed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray import serve
from ray.serve import Application

from controller.api import FSDIngress
from controller.config import FSDConfig, config_from_env, parse_config
from controller.control_loop import FSDController
from controller.replica import FSDReplica

REPLICA_DEPLOYMENT = "FSDReplica"
CONTROLLER_DEPLOYMENT = "FSDController"
INGRESS_DEPLOYMENT = "FSDIngress"


def replica_options(cfg: FSDConfig) -> dict[str, Any]:
    """Serve options of the replica deployment (the slow loop lives here: replicas or autoscaling)."""
    opts: dict[str, Any] = {
        "name": REPLICA_DEPLOYMENT,
        "max_ongoing_requests": cfg.serve.max_ongoing_requests,
        "max_queued_requests": cfg.serve.max_queued_requests,
        "ray_actor_options": {"num_cpus": cfg.serve.replica_num_cpus},
        "health_check_period_s": cfg.serve.health_check_period_s,
        "health_check_timeout_s": cfg.serve.health_check_timeout_s,
        # Waiting requests get a bounded drain on scale-down / redeploy instead of being cut.
        "graceful_shutdown_timeout_s": 10.0,
        "graceful_shutdown_wait_loop_s": 0.5,
        # The controller calls stats/set_thresholds every tick; per-call access lines would drown the log.
        "logging_config": {"enable_access_log": False},
    }
    if cfg.serve.autoscaling_config is not None:
        opts["autoscaling_config"] = dict(cfg.serve.autoscaling_config)
    else:
        opts["num_replicas"] = cfg.serve.num_replicas
    return opts


def build_app(args: FSDConfig | Mapping[str, Any] | None = None) -> Application:
    """The bound Serve application for an fsd config (a parsed one, or its mapping as Serve's ``args``)."""
    cfg = args if isinstance(args, FSDConfig) else parse_config(dict(args or {}))
    config = cfg.model_dump(mode="json")
    replica = serve.deployment(**replica_options(cfg))(FSDReplica)
    controller = serve.deployment(
        name=CONTROLLER_DEPLOYMENT,
        num_replicas=1,
        max_ongoing_requests=64,
        ray_actor_options={"num_cpus": 0},
        health_check_period_s=5.0,
        logging_config={"enable_access_log": False},
    )(FSDController)
    ingress = serve.deployment(
        name=INGRESS_DEPLOYMENT,
        num_replicas=1,
        max_ongoing_requests=1024,
        ray_actor_options={"num_cpus": cfg.serve.ingress_num_cpus},
    )(FSDIngress)
    replicas = replica.bind(config)
    return ingress.bind(config, replicas, controller.bind(config, replicas))


def __getattr__(name: str) -> Any:
    # `serve run controller.app:app` reads this attribute; build it only when asked.
    if name == "app":
        return build_app(config_from_env())
    raise AttributeError(name)
