"""``fsd serve [config.yaml] [--port N] [--host H] [--address RAY_ADDRESS] [--pair NAME] [--detach]``.

No config file ⇒ the default pair (smollm2-135m), ``SLOSpec.default()`` and the default SLO policy (PID
wrapped in QualityGuard + FailSafe) on 127.0.0.1:8000. With ``--address`` (or ``$RAY_ADDRESS``) the app
is deployed onto that existing cluster; otherwise a local one is started (``ray.num_cpus`` CPUs).
Runs until SIGINT (Ctrl-C, or ``kill -INT <pid>`` — handled explicitly, since a shell starts background
jobs with SIGINT ignored) or SIGTERM, then tears everything it started down and exits 0.
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

    def request_stop(signum: int, _frame: Any) -> None:
        if not stop.is_set():
            print(f"fsd serve: {signal.Signals(signum).name} received; stopping", flush=True)
        stop.set()

    def install_handlers() -> None:
        # Both signals set the same event; the main thread then shuts down in order (never from a
        # handler). Installed again once Ray is up: ray.init puts in its own fatal-signal handler for
        # SIGTERM, which aborts the process (exit -6) after the teardown started.
        signal.signal(signal.SIGINT, request_stop)
        signal.signal(signal.SIGTERM, request_stop)

    install_handlers()
    service = Service(cfg, address=address)
    try:
        url = service.start()
        install_handlers()
        if stop.is_set():  # a signal arrived while starting
            return 0
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
            # A second signal while tearing down must not abort the teardown half-way.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            service.stop()
            print("fsd serve: stopped", flush=True)
    return 0
