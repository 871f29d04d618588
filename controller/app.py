"""Assemble the Serve application: ingress → replicas, with the controller beside them.

::

    HTTP ──► FSDIngress ──► FSDReplica × N   (continuous batching, T per tier, fail-safe; VLLMReplica
                  │               ▲            with `model.engine: vllm`: controller/vllm_replica.py)
                  └──► FSDController ─┘       (every interval: stats → Telemetry → Policy → T push)

Three ways to deploy the same application:

* ``fsd serve my.yaml`` — starts (or joins) Ray and Serve itself, host/port from ``http.*``.
* Ray Serve's own path: ``build_app`` is an *application builder* — its one argument is the fsd config
  (Serve's ``args``), so a standard Serve config file deploys it unchanged with ``serve run config.yaml``,
  ``serve deploy config.yaml`` or KubeRay's RayService (``serveConfigV2``). There the HTTP host/port and
  proxy location come from the file's ``http_options``/``proxy_location``, the app name and route prefix
  from its ``applications`` entry, Ray's settings from the cluster and ``runtime_env``; per-deployment
  overrides (``num_replicas``, ``autoscaling_config``, ``ray_actor_options``…) go in its ``deployments``
  list under the names ``FSDReplica``, ``FSDController``, ``FSDIngress`` and win over ``args.serve``.
  ``python -m controller.app my.yaml`` prints that Serve config for an fsd config (the shipped
  ``controller/configs/serve_config.yaml`` is ``example.yaml`` through it).
* ``serve run controller.app:app`` — the module attribute ``app``, built lazily from ``$FSD_CONFIG`` (or
  the defaults) when first accessed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray import serve
from ray.serve import Application

from controller.api import FSDIngress
from controller.autoscaling import POLICY_FUNCTION as AUTOSCALING_POLICY_FUNCTION
from controller.config import (
    FSDConfig,
    config_from_env,
    parse_config,
    steered_replica_bounds,
)
from controller.control_loop import FSDController
from controller.replica import FSDReplica
from controller.vllm_replica import VLLMReplica, prepare_vllm_config, replica_actor_options

REPLICA_DEPLOYMENT = "FSDReplica"
CONTROLLER_DEPLOYMENT = "FSDController"
INGRESS_DEPLOYMENT = "FSDIngress"


def replica_options(cfg: FSDConfig) -> dict[str, Any]:
    """Serve options of the replica deployment (the slow loop lives here: replicas or autoscaling)."""
    opts: dict[str, Any] = {
        "name": REPLICA_DEPLOYMENT,
        "max_ongoing_requests": cfg.serve.max_ongoing_requests,
        "max_queued_requests": cfg.serve.max_queued_requests,
        "ray_actor_options": (replica_actor_options(cfg) if cfg.model.engine == "vllm"
                              else {"num_cpus": cfg.serve.replica_num_cpus}),
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
        if steered_replica_bounds(cfg) is not None:
            # The hand-off (controller/autoscaling.py): Serve's autoscaler scales to the policy's
            # Decision.replicas, or by its default policy while the controller publishes none.
            opts["autoscaling_config"]["policy"] = {"policy_function": AUTOSCALING_POLICY_FUNCTION}
    else:
        opts["num_replicas"] = cfg.serve.num_replicas
    return opts


def build_app(args: FSDConfig | Mapping[str, Any] | None = None) -> Application:
    """The bound Serve application for an fsd config (a parsed one, or its mapping as Serve's ``args``)."""
    cfg = args if isinstance(args, FSDConfig) else parse_config(dict(args or {}))
    # engine: vllm — the replicas run in the vLLM environment's interpreter on HF directories resolved here.
    cfg = prepare_vllm_config(cfg)
    config = cfg.model_dump(mode="json")
    replica_class = VLLMReplica if cfg.model.engine == "vllm" else FSDReplica
    replica = serve.deployment(**replica_options(cfg))(replica_class)
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


#: What ``import_path`` names in a Serve config file.
IMPORT_PATH = "controller.app:build_app"
#: No model hub at run time (weights come from the local cache) and quiet tokenizers, on every worker.
SERVE_ENV_VARS = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
#: fsd config keys that Serve's own config decides under `serve run`/`serve deploy`, so `args` omits them.
_SERVE_DECIDES = {"http": ("host", "port", "proxy_location"), "serve": ("app_name", "route_prefix"), "ray": None}


def serve_config(fsd_config: Mapping[str, Any]) -> dict[str, Any]:
    """A Ray Serve config file (``ServeDeploySchema``) deploying this app for an fsd config mapping.

    ``args`` is the mapping as written (validated first, so a bad key fails here, naming the field) minus
    what Serve's own fields decide: host, port, proxy location, app name, route prefix and the ``ray``
    section.
    """
    cfg = parse_config(dict(fsd_config))
    args = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in fsd_config.items()}
    for section, keys in _SERVE_DECIDES.items():
        if keys is None:
            args.pop(section, None)
        elif section in args:
            for key in keys:
                args[section].pop(key, None)
            if not args[section]:
                del args[section]
    return {
        "proxy_location": cfg.http.proxy_location,
        "http_options": {"host": cfg.http.host, "port": cfg.http.port},
        "applications": [{
            "name": cfg.serve.app_name,
            "route_prefix": cfg.serve.route_prefix,
            "import_path": IMPORT_PATH,
            "runtime_env": {"env_vars": dict(SERVE_ENV_VARS)},
            "args": args,
        }],
    }


def serve_config_yaml(fsd_config_path: str | None) -> str:
    """The Serve config for an fsd YAML file (None = the defaults), as YAML text with a header."""
    import yaml

    from controller.config import load_config

    load_config(fsd_config_path)  # a missing file or a bad key fails with the config's own message
    if fsd_config_path is None:
        data: dict[str, Any] = {}
    else:
        with open(fsd_config_path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    source = fsd_config_path or "the default fsd config"
    header = (f"# Ray Serve config for fsd-runtime, generated from {source} by\n"
              f"#   python -m controller.app {fsd_config_path or ''}\n"
              "# Deploy: serve run <this file> | serve deploy <this file> | KubeRay RayService serveConfigV2.\n"
              "# Host/port/proxy come from http_options, name/route_prefix from the application entry;\n"
              "# args is the fsd config (see example.yaml); per-deployment overrides go in a `deployments:`\n"
              "# list (FSDReplica, FSDController, FSDIngress). The workers must import `controller`\n"
              "# (install the package, or add runtime_env working_dir/py_modules).\n")
    body: str = yaml.safe_dump(serve_config(data), sort_keys=False, default_flow_style=False)
    return header + body


def __getattr__(name: str) -> Any:
    # `serve run controller.app:app` reads this attribute; build it only when asked.
    if name == "app":
        return build_app(config_from_env())
    raise AttributeError(name)


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 2 or (len(sys.argv) == 2 and sys.argv[1].startswith("-")):
        print("usage: python -m controller.app [fsd-config.yaml]  (prints a Ray Serve config)", file=sys.stderr)
        sys.exit(2)
    try:
        sys.stdout.write(serve_config_yaml(sys.argv[1] if len(sys.argv) == 2 else None))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
