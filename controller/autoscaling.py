"""The slow loop's hand-off: the SLO policy's ``Decision.replicas`` drives Ray Serve's own autoscaler.

Ray Serve (2.60) lets a deployment name a custom autoscaling policy in its ``autoscaling_config``
(``policy: {policy_function: "module:function"}``). Serve's controller calls it every control-loop
period with an :class:`ray.serve.config.AutoscalingContext` and applies the count it returns with its
own machinery: ``upscale_delay_s`` / ``downscale_delay_s``, the scaling factors, ``min_replicas`` /
``max_replicas`` (adjusted for target capacity), replica start-up and graceful drain. There is no scaler
of our own: :func:`fsd_autoscaling_policy` only tells Serve which count the SLO policy wants.

How the count gets there without waiting behind the data plane::

    FSDController.tick ── Decision.replicas ──► ReplicaCountPublisher ──(GCS internal KV, off the loop)──┐
                                                                                                       ▼
    Serve controller ── every ~0.1 s ──► fsd_autoscaling_policy(ctx) ── KV read, at most every 1 s ──► count

* the control loop publishes a small JSON record (:class:`PublishedReplicas`) under the app's key every
  tick, in a worker thread, skipping a tick whose previous write is still in flight (as Serve's own
  metrics pusher does); a record carries ``valid_until_unix`` so a reader can tell a dead controller;
* the hook reads the record from the GCS key-value store (a small local call, never a replica nor an
  actor method), caches it in Serve's ``policy_state`` between reads, and returns the count clamped to
  ``ctx.capacity_adjusted_min_replicas`` / ``capacity_adjusted_max_replicas``;
* no record, a stale one (controller gone), or one without a count (the policy steers no replicas, or
  its fail-safe tripped) → Serve's default request-based policy decides, exactly as without the hook.

This module is pickled by value into Serve's controller: it imports only the standard library and Ray.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger("ray.serve")

#: What ``autoscaling_config.policy.policy_function`` names (``controller.app`` sets it by default).
POLICY_FUNCTION = "controller.autoscaling:fsd_autoscaling_policy"
#: Internal-KV namespace of the published counts; the key is the Serve application's name.
KV_NAMESPACE = "fsd-runtime-replicas"
#: The hook reads the store at most this often (Serve calls it every ~0.1 s).
READ_EVERY_S = 1.0
#: A record is trusted for this long at least (and for 10 control intervals when those are longer).
MIN_VALID_S = 10.0

#: ``policy_state`` keys the hook keeps between Serve's calls.
_STATE_READ_AT = "fsd_read_unix"
_STATE_RECORD = "fsd_record"
_STATE_SOURCE = "fsd_source"


@dataclass(frozen=True, slots=True)
class PublishedReplicas:
    """What the control loop publishes for the hook: the replica count the active policy asks for
    (None: it asks for none), when, until when to trust it, and which decision it came from."""

    replicas: int | None
    published_unix: float
    valid_until_unix: float
    epoch: str = ""
    version: int = 0

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> PublishedReplicas:
        """ValueError on anything that is not a well-formed record."""
        try:
            data = json.loads(raw)
            replicas = data["replicas"]
            if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0):
                raise ValueError(f"replicas must be an int >= 0 or null, got {replicas!r}")
            published, valid_until = float(data["published_unix"]), float(data["valid_until_unix"])
            if not (math.isfinite(published) and math.isfinite(valid_until)):
                raise ValueError("timestamps must be finite")
            return cls(replicas, published, valid_until, str(data.get("epoch", "")), int(data.get("version", 0)))
        except (KeyError, TypeError, ValueError) as exc:  # JSONDecodeError is a ValueError
            raise ValueError(f"published replica record: malformed ({exc})") from None

    def usable(self, now_unix: float) -> bool:
        return self.replicas is not None and now_unix <= self.valid_until_unix


def kv_key(app_name: str) -> str:
    return f"app/{app_name}"


def _kv_get(key: str) -> bytes | None:
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized

    if not _internal_kv_initialized():  # type: ignore[no-untyped-call]
        return None
    value: bytes | None = _internal_kv_get(key, namespace=KV_NAMESPACE)
    return value


def _kv_put(key: str, value: bytes) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(key, value, overwrite=True, namespace=KV_NAMESPACE)


def kv_available() -> bool:
    """True inside a Ray worker or driver connected to a cluster (the store is reachable)."""
    try:
        from ray.experimental.internal_kv import _internal_kv_initialized

        return bool(_internal_kv_initialized())  # type: ignore[no-untyped-call]
    except Exception:
        return False


def read_published(app_name: str) -> PublishedReplicas | None:
    """The record the app's controller published last (None: none, unreadable or malformed)."""
    try:
        raw = _kv_get(kv_key(app_name))
    except Exception:  # the GCS briefly unreachable: Serve's default decides this round
        return None
    if raw is None:
        return None
    try:
        return PublishedReplicas.from_json(raw)
    except ValueError:
        return None


def fsd_autoscaling_policy(ctx: Any) -> tuple[int | float, dict[str, Any]]:
    """Ray Serve custom autoscaling policy (``AutoscalingContext`` → (replicas, policy_state)).

    Returns the count the controller published, clamped to the context's capacity-adjusted bounds;
    without a usable record, whatever Serve's default request-based policy returns. Serve then applies
    its delays, scaling factors and bounds to either.
    """
    from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

    state: dict[str, Any] = dict(ctx.policy_state or {})
    now = float(ctx.current_time if ctx.current_time is not None else time.time())
    record: PublishedReplicas | None = None
    read_at = state.get(_STATE_READ_AT)
    cached = state.get(_STATE_RECORD)
    if isinstance(read_at, int | float) and now - read_at < READ_EVERY_S and isinstance(cached, str):
        try:
            record = PublishedReplicas.from_json(cached)
        except ValueError:
            record = None
    else:
        record = read_published(ctx.app_name or "")
        state[_STATE_READ_AT] = now
        state[_STATE_RECORD] = record.to_json().decode() if record is not None else None
    if record is None or not record.usable(now):
        desired, default_state = replica_queue_length_autoscaling_policy(ctx)
        state.update(default_state or {})
        state[_STATE_SOURCE] = "serve-default"
        return desired, state
    assert record.replicas is not None
    low, high = int(ctx.capacity_adjusted_min_replicas), int(ctx.capacity_adjusted_max_replicas)
    state[_STATE_SOURCE] = "fsd-controller"
    return min(max(record.replicas, low), high), state


class ReplicaCountPublisher:
    """The control loop's side: :meth:`publish` hands the record to a worker thread and returns at once;
    while the previous write is still in flight a new one is skipped (the next tick carries the news)."""

    def __init__(self, app_name: str, interval_s: float, put: Callable[[str, bytes], None] = _kv_put,
                 clock: Callable[[], float] = time.time) -> None:
        self.app_name = app_name
        self.valid_s = max(MIN_VALID_S, 10.0 * interval_s)
        self._put, self._clock = put, clock
        self._in_flight = threading.Event()
        self.published = 0
        self.skipped = 0
        self.failures = 0
        self.last: PublishedReplicas | None = None

    def publish(self, replicas: int | None, epoch: str, version: int) -> bool:
        """Start writing the record; False when skipped (a write in flight)."""
        if self._in_flight.is_set():
            self.skipped += 1
            return False
        now = self._clock()
        record = PublishedReplicas(replicas, now, now + self.valid_s, epoch, version)
        self._in_flight.set()
        threading.Thread(target=self._write, args=(record,), name="fsd-replica-count", daemon=True).start()
        return True

    def _write(self, record: PublishedReplicas) -> None:
        try:
            self._put(kv_key(self.app_name), record.to_json())
            self.published += 1
            self.last = record
        except Exception:
            self.failures += 1
            if self.failures == 1 or self.failures % 100 == 0:
                logger.exception("publishing the replica count failed (%d so far); Serve keeps its last count",
                                 self.failures)
        finally:
            self._in_flight.clear()

    def stats(self) -> dict[str, Any]:
        last = self.last
        return {"app_name": self.app_name, "published": self.published, "skipped": self.skipped,
                "failures": self.failures, "last": asdict(last) if last is not None else None}
