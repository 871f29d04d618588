"""Start and stop the service: Ray (local or an existing cluster), Serve's HTTP proxy, the app.

Used by ``fsd serve``, ``fsd demo`` and the load benchmark. A locally started cluster is shut down
completely on :meth:`Service.stop` (``serve.shutdown`` then ``ray.shutdown``, which stops every Ray
process it started); on an existing cluster only this application is deleted and the driver detaches.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import httpx

from controller.config import FSDConfig

logger = logging.getLogger(__name__)


def resolve_address(cli_address: str | None, cfg: FSDConfig) -> str | None:
    """Cluster address: ``--address``, else ``$RAY_ADDRESS``, else ``ray.address`` in the config."""
    return cli_address or os.environ.get("RAY_ADDRESS") or cfg.ray.address


class Service:
    """One deployed FSD application (see the module docstring)."""

    def __init__(self, cfg: FSDConfig, address: str | None = None, quiet: bool = False) -> None:
        self.cfg = cfg
        self.address = address
        self.quiet = quiet
        self._own_cluster = False
        self._started = False

    @property
    def url(self) -> str:
        host = self.cfg.http.host
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1"
        return f"http://{host}:{self.cfg.http.port}{self.cfg.serve.route_prefix.rstrip('/')}"

    def start(self, ready_timeout_s: float = 600.0) -> str:
        import ray
        from ray import serve

        from controller.app import build_app

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        init_kwargs: dict[str, Any] = {"log_to_driver": not self.quiet}
        if self.address:
            ray.init(address=self.address, **init_kwargs)
        else:
            # address="local": start a new cluster even if a `ray start` one runs on this machine.
            init_kwargs.update(address="local", num_cpus=self.cfg.ray.num_cpus, include_dashboard=False)
            if self.cfg.ray.object_store_memory is not None:
                init_kwargs["object_store_memory"] = self.cfg.ray.object_store_memory
            ray.init(**init_kwargs)
            self._own_cluster = True
        self._started = True
        serve.start(proxy_location=self.cfg.http.proxy_location,
                    http_options={"host": self.cfg.http.host, "port": self.cfg.http.port})
        serve.run(build_app(self.cfg), name=self.cfg.serve.app_name, route_prefix=self.cfg.serve.route_prefix)
        self._wait_ready(ready_timeout_s)
        return self.url

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"service at {self.url} not ready after {timeout_s}s")
            time.sleep(0.5)

    def stop(self) -> None:
        if not self._started:
            return
        import ray
        from ray import serve

        try:
            if self._own_cluster:
                serve.shutdown()
            else:
                serve.delete(self.cfg.serve.app_name)
        except Exception:  # shutting down anyway; Ray's own teardown still runs below
            logger.warning("serve teardown raised", exc_info=True)
        finally:
            ray.shutdown()
            self._started = False

    def __enter__(self) -> Service:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
