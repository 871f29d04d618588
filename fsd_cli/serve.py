"""``fsd serve [config.yaml] [--port N] [--host H] [--address RAY_ADDRESS] [--pair NAME] [--detach]``.

No config file ⇒ the default pair (smollm2-135m), ``SLOSpec.default()`` and the default SLO policy (PID
wrapped in QualityGuard + FailSafe) on 127.0.0.1:8000. With ``--address`` (or ``$RAY_ADDRESS``) the app
is deployed onto that existing cluster; otherwise a local one is started (``ray.num_cpus`` CPUs).
Runs until Ctrl-C / SIGTERM, then tears everything it started down.
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible FSD API on Ray Serve with live SLO control",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="YAML config (see controller/configs/example.yaml)")
    p.add_argument("--port", type=int, help="HTTP port (overrides http.port)")
    p.add_argument("--host", help="bind address (overrides http.host; default 127.0.0.1)")
    p.add_argument("--address", help="existing Ray cluster address (else $RAY_ADDRESS, else start a local one)")
    p.add_argument("--pair", help="model pair (overrides model.pair; 'tiny' = random test pair)")
    p.add_argument("--detach", action="store_true",
                   help="with --address: deploy and exit, leaving the app running on the cluster")
    p.set_defaults(func=handle)


def config_with_overrides(path: str | None, **overrides: Any) -> Any:
    """Load the config and apply CLI overrides (re-validated, so bad values still name the field)."""
    from controller.config import load_config, parse_config

    data = load_config(path).model_dump(mode="json")
    if overrides.get("port") is not None:
        data["http"]["port"] = overrides["port"]
    if overrides.get("host") is not None:
        data["http"]["host"] = overrides["host"]
    if overrides.get("pair") is not None:
        data["model"]["pair"] = overrides["pair"]
    return parse_config(data)


def handle(args: argparse.Namespace) -> int:
    from controller.runtime import Service, resolve_address

    cfg = config_with_overrides(args.config, port=args.port, host=args.host, pair=args.pair)
    address = resolve_address(args.address, cfg)
    if args.detach and not address:
        raise ValueError("--detach needs an existing cluster (--address or RAY_ADDRESS)")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    service = Service(cfg, address=address)
    try:
        url = service.start()
        print(f"fsd serve: {cfg.model.pair} on {url}  (OpenAI API: {url}/v1/completions, "
              f"status: {url}/v1/fsd/status, metrics: {url}/metrics)", flush=True)
        if args.detach:
            print(f"fsd serve: detached; app {cfg.serve.app_name!r} keeps running on {address}", flush=True)
            import ray

            ray.shutdown()
            return 0
        print("fsd serve: Ctrl-C to stop", flush=True)
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        if not args.detach:
            print("fsd serve: shutting down", flush=True)
            service.stop()
    return 0
