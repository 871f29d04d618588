"""``fsd serve [config.yaml] [--port N] [--host H] [--address RAY_ADDRESS] [--pair NAME] [--engine E] [--detach]``.

No config file ⇒ the default pair (smollm2-135m), ``SLOSpec.default()`` and the default SLO policy (PID
wrapped in QualityGuard + FailSafe) on 127.0.0.1:8000. With ``--address`` (or ``$RAY_ADDRESS``) the app
is deployed onto that existing cluster; otherwise a local one is started (``ray.num_cpus`` CPUs).
Runs until SIGINT (Ctrl-C, or ``kill -INT <pid>`` — handled explicitly, since a shell starts background
jobs with SIGINT ignored) or SIGTERM, then tears everything it started down and exits 0.

Checked before Ray starts, each failing with one line naming the problem and exit code 2: the config
(missing, a directory, unreadable, not YAML, an invalid field), the HTTP port (already in use, local
cluster only), the model pair (unknown name; for a local cluster also not fetched / not on disk), and
with ``--engine vllm`` / ``model.engine: vllm`` the vLLM environment (``make vllm-env``, docs/vllm.md).
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
    p.add_argument("--engine", choices=("native", "vllm"),
                   help="replica engine (overrides model.engine; vllm needs `make vllm-env`, docs/vllm.md)")
    p.add_argument("--detach", action="store_true",
                   help="with --address: deploy and exit, leaving the app running on the cluster")
    p.set_defaults(func=handle)


def check_port_free(host: str, port: int) -> None:
    """ValueError if something already listens on host:port (Serve's proxy would fail to bind it)."""
    import socket

    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # SO_REUSEADDR: a port in TIME_WAIT is free to a server; only a live listener makes bind fail.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ValueError(f"port {port} on {host} is not available ({exc.strerror or exc}); "
                             "stop what uses it or pass --port") from None


def check_pair_available(pair: str, local: bool) -> None:
    """ValueError naming the pair if it is unknown, or (on a local cluster) not fetched / not on disk."""
    if "," in pair:  # "target,draft" paths or hub ids: must be on disk or in the offline HF cache
        if local:
            for source in (part.strip() for part in pair.split(",", 1)):
                if not _model_source_present(source):
                    raise ValueError(f"model {source!r} of pair {pair!r} is neither a local path nor in the "
                                     "local Hugging Face cache (the runtime never downloads)")
        return
    from decoder.pairs import get_pair_spec

    spec = get_pair_spec(pair)  # ValueError listing the registered pairs
    if local:
        status = spec.status(spec)
        if not status.available:
            raise ValueError(f"model pair {pair!r} is not available: {status.state}")


def _model_source_present(source: str) -> bool:
    from pathlib import Path

    if Path(source).expanduser().exists():
        return True
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(source, "config.json"), str)
    except Exception:  # not a valid repo id either
        return False


def handle(args: argparse.Namespace) -> int:
    from controller.config import config_with_overrides
    from controller.runtime import Service, resolve_address

    cfg = config_with_overrides(args.config, port=args.port, host=args.host, pair=args.pair,
                                engine=args.engine)
    address = resolve_address(args.address, cfg)
    if args.detach and not address:
        raise ValueError("--detach needs an existing cluster (--address or RAY_ADDRESS)")
    if not address:  # on an existing cluster Serve's proxy may already (rightly) hold the port
        check_port_free(cfg.http.host, cfg.http.port)
    if cfg.model.engine == "vllm":
        from controller.vllm_replica import vllm_python

        vllm_python(cfg)  # the vLLM environment exists (make vllm-env)
    if cfg.model.engine == "native" or cfg.vllm.target_dir is None:  # else the pair name only names the model
        check_pair_available(cfg.model.pair, local=not address)
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
