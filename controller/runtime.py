"""Start and stop the service: Ray (local or an existing cluster), Serve's HTTP proxy, the app.

Used by ``fsd serve``, ``fsd demo`` and the load benchmark. A locally started cluster is shut down
completely on :meth:`Service.stop` (``serve.shutdown`` then ``ray.shutdown``, which stops every Ray
process it started); on an existing cluster only this application is deleted and the driver detaches.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from typing import Any

import httpx

from controller.config import FSDConfig

logger = logging.getLogger(__name__)

#: Serve's deadlines for its HTTP proxy, raised so a busy machine (CI, a shared box) does not fail start-up,
#: and the workers' niceness (below).
#: Ray Serve 2.60 (``serve/_private/proxy_state.py``) marks a proxy UNHEALTHY after three ready checks in a
#: row that each took longer than ``RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S`` (default 5 s) and kills it with
#: ``ray.kill``; ``serve.start``, waiting on that proxy, then fails with ``ActorDiedError`` on the
#: ``ProxyActor``. Health checks (default every 10 s, 10 s timeout, three misses) kill a slow proxy the same
#: way later. Serve's controller actor reads these at import, so they must be in the environment before
#: ``ray.init`` starts the raylet whose workers inherit it; an operator's own values win (setdefault). On an
#: existing cluster (``--address``) the cluster's own environment applies.
SLOW_MACHINE_SERVE_ENV: dict[str, str] = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S": "20",
    # Deployments without their own health_check_timeout_s (the FSD controller deployment).
    "RAY_SERVE_DEPLOYMENT_ACTOR_HEALTH_CHECK_TIMEOUT_S": "120",
    # Ray starts every worker process (Serve's controller and proxy, our replicas) at nice 15 so that the
    # raylet and GCS win the CPU. On a machine shared with anything at nice 0 that starves the whole
    # serving path: beside two busy loops on 2 cores the replicas got ~4 % CPU each and the control-plane
    # test took > 7 min (84 s at nice 0). Here the workers *are* the workload; Ray's own job manager sets
    # the same for job drivers (dashboard/modules/job/job_manager.py).
    "RAY_worker_niceness": "0",
}


def apply_slow_machine_env() -> None:
    """Put :data:`SLOW_MACHINE_SERVE_ENV` into ``os.environ`` (call before ``ray.init``)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    for name, value in SLOW_MACHINE_SERVE_ENV.items():
        os.environ.setdefault(name, value)


def init_local_ray(attempts: int = 3, **init_kwargs: Any) -> None:
    """``ray.init(address="local", ...)`` and check the cluster runs a task; start-up retried.

    On a saturated machine start-up fails for reasons of the environment, not the code: a raylet dies
    waiting a bounded time for its metrics agent, or ``ray.init`` gives up on the node registering within
    a fixed 30 s (Ray 2.60 ``_private/node.py``, not configurable: "The current node timed out during
    startup"). Either way the partial cluster is shut down and a fresh one tried, up to ``attempts`` times.
    """
    import ray

    @ray.remote(num_cpus=0)
    def ping() -> int:
        return 1

    apply_slow_machine_env()
    for attempt in range(1, attempts + 1):
        try:
            # address="local": always a fresh cluster, never one a stray `ray start` left behind.
            ray.init(address="local", **init_kwargs)
            if ray.get(ping.remote(), timeout=300) == 1:
                return
        except Exception:
            if attempt == attempts:
                raise
            logger.warning("local Ray cluster did not run a task (attempt %d/%d); restarting it", attempt,
                           attempts, exc_info=True)
        ray.shutdown()
        # The failed attempt's processes (GCS, raylet, agents) carry a session named after this pid.
        kill_session_leftovers(re.compile(rf"session_\d{{4}}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+_{os.getpid()}(?!\d)"))


def start_serve(http_options: dict[str, Any], proxy_location: str | None = None, attempts: int = 3) -> None:
    """``serve.start``, retried when the proxy does not come up (a busy machine, not the code under test).

    ``serve.start`` waits a fixed 60 s for its proxy and fails with ``TimeoutError``, or with a
    ``RayActorError`` when Serve's controller gave up on the proxy and killed it; either way Serve is shut
    down and started afresh, up to ``attempts`` times.
    """
    from ray import serve
    from ray.exceptions import RayActorError

    kwargs: dict[str, Any] = {"http_options": http_options}
    if proxy_location is not None:
        kwargs["proxy_location"] = proxy_location
    for attempt in range(1, attempts + 1):
        try:
            serve.start(**kwargs)
            return
        except (TimeoutError, RayActorError) as exc:
            if attempt == attempts:
                raise
            logger.warning("serve.start failed (attempt %d/%d: %s); restarting Serve", attempt, attempts,
                           type(exc).__name__)
            try:
                serve.shutdown()  # type: ignore[no-untyped-call]  # Ray Serve's shutdown() is unannotated
            except Exception:  # a half-started Serve; the next serve.start builds a fresh controller
                logger.warning("serve.shutdown after a failed start raised", exc_info=True)


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
        apply_slow_machine_env()
        handlers = _python_signal_handlers()
        init_kwargs: dict[str, Any] = {"log_to_driver": not self.quiet}
        if self.address:
            ray.init(address=self.address, **init_kwargs)
        else:
            # address="local": start a new cluster even if a `ray start` one runs on this machine.
            init_kwargs.update(num_cpus=self.cfg.ray.num_cpus, include_dashboard=False)
            if self.cfg.ray.object_store_memory is not None:
                init_kwargs["object_store_memory"] = self.cfg.ray.object_store_memory
            init_local_ray(**init_kwargs)
            self._own_cluster = True
        _restore_signal_handlers(handlers)
        self._started = True
        start_serve({"host": self.cfg.http.host, "port": self.cfg.http.port},
                    proxy_location=self.cfg.http.proxy_location)
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
        """Tear down what :meth:`start` started. Serve's graceful shutdown lets in-flight requests finish
        for ``graceful_shutdown_timeout_s``; a replica stopped after that fails what it still runs with
        an explicit error ("replica is shutting down"). On a cluster of our own, ``ray.shutdown()``
        always runs, and Ray processes of this session that outlive it are killed."""
        if not self._started:
            return
        import ray
        from ray import serve

        session = _session_name() if self._own_cluster else None
        try:
            self._cancel_in_flight()
        except BaseException:  # best effort: the teardown below runs regardless
            logger.warning("cancelling in-flight requests failed", exc_info=True)
        try:
            if self._own_cluster:
                serve.shutdown()  # type: ignore[no-untyped-call]  # Ray Serve's shutdown() is unannotated
            else:
                serve.delete(self.cfg.serve.app_name)
        except BaseException:  # shutting down anyway (even on a second Ctrl-C); Ray's teardown still runs
            logger.warning("serve teardown raised", exc_info=True)
        finally:
            ray.shutdown()
            self._started = False
            if session is not None:
                kill_session_leftovers(session)

    def _cancel_in_flight(self, settle_s: float = 1.0) -> None:
        """Tell the replicas (through the controller's next replies) to fail in-flight requests with an
        explicit error, and wait until every replica reports it did — bounded by a few control
        intervals — plus ``settle_s`` for the ingress to send the final events."""
        from ray import serve

        from controller.protocol import CONTROLLER_DEPLOYMENT

        controller = serve.get_deployment_handle(CONTROLLER_DEPLOYMENT, self.cfg.serve.app_name)
        controller.begin_shutdown.remote().result(timeout_s=10)
        interval = self.cfg.replica.report_interval_s or self.cfg.control.interval_s
        deadline = time.monotonic() + 3 * interval + 5.0
        while time.monotonic() < deadline:
            replicas = controller.status.remote(history=0).result(timeout_s=10)["replicas"]
            if all(r["stopping"] and r["in_flight"] == 0 for r in replicas):
                break
            time.sleep(min(0.2, interval))
        time.sleep(settle_s)

    def __enter__(self) -> Service:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _session_name() -> str | None:
    """This driver's Ray session directory name (``session_<date>_<pid>``), or None."""
    try:
        import ray

        node = ray._private.worker._global_node
        return os.path.basename(node.get_session_dir_path()) if node is not None else None
    except Exception:
        return None


def kill_session_leftovers(session: str | re.Pattern[str], grace_s: float = 5.0) -> list[int]:
    """Kill the processes of Ray session ``session`` still alive after ``ray.shutdown()``.

    Some of Ray's agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) ignore SIGTERM and outlive
    the raylet; they carry the session directory on their command line, which is how only *this*
    session's processes are matched (another cluster on the machine is never touched). SIGTERM, then
    SIGKILL after ``grace_s``. Returns the pids signalled.
    """
    me = os.getpid()
    victims: list[int] = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone, or not ours to read
            continue
        if (session.search(cmdline) is not None) if isinstance(session, re.Pattern) else (session in cmdline):
            victims.append(int(entry))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [pid for pid in victims if _signal(pid, sig)]
        deadline = time.monotonic() + grace_s
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [pid for pid in alive if _signal(pid, 0)]
        if not alive:
            break
    if victims:
        logger.info("killed %d leftover Ray process(es) of %s", len(victims), session)
    return victims


def _signal(pid: int, sig: int) -> bool:
    """Send ``sig`` (0: just probe); False when the process is gone (a zombie child is reaped)."""
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        if waited == pid:
            return False
    except ChildProcessError:  # not our child
        pass
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    return True


def _python_signal_handlers() -> dict[int, Any]:
    """SIGINT/SIGTERM handlers as Python sees them (main thread only; elsewhere nothing to keep)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}


def _restore_signal_handlers(handlers: dict[int, Any]) -> None:
    """``ray.init`` installs a native fatal-signal handler for SIGTERM that aborts the driver (exit -6)
    part-way through a teardown; give the signals back to the handlers the caller had installed."""
    for sig, handler in handlers.items():
        if handler is not None:
            signal.signal(sig, handler)
