"""A replica autoscaler modelled on Ray Serve's default policy.

Ray Serve (``serve/autoscaling_policy.py``): desired = ceil(total ongoing requests /
``target_ongoing_requests``), clamped to [``min_replicas``, ``max_replicas``]; a scale-up is applied
only after the desire to scale up has held for ``upscale_delay_s``, a scale-down after
``downscale_delay_s``; a new replica serves only after its start-up time (the scenario's
``startup_s``, else the profile's measured ``replica_startup_s``, else 20 s) and costs replica-seconds
from the moment it is asked for. Here the decision is evaluated at every control tick; a policy's
``Decision.replicas`` replaces the metric-based desire when the simulator is told to honour it
(``honour_policy_replicas``), as the live hook (``controller.autoscaling``) replaces Serve's: the same
delays and bounds apply to it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from sim.profile import Profile


class AutoscalerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(8, ge=1)
    target_ongoing_requests: float = Field(4.0, gt=0)
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)
    startup_s: float | None = Field(
        None, ge=0, description="time from scale-up to a replica taking requests (None: the profile's, else 20 s)")

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalerConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas {self.max_replicas} < min_replicas {self.min_replicas}")
        return self


#: Start-up time of a new replica when neither the scenario nor the profile states one.
DEFAULT_REPLICA_STARTUP_S = 20.0


def replica_startup_s(config: AutoscalerConfig | None, profile: Profile) -> float:
    """Scale-up → serving: the scenario's ``startup_s``, else the profile's, else the default."""
    if config is not None and config.startup_s is not None:
        return config.startup_s
    if profile.replica_startup_s is not None:
        return profile.replica_startup_s
    return DEFAULT_REPLICA_STARTUP_S


class Autoscaler:
    """Stateful owner of the delay logic; time comes in as an argument (no clock reads)."""

    def __init__(self, config: AutoscalerConfig) -> None:
        self.config = config
        self._upscale_since: float | None = None
        self._downscale_since: float | None = None

    def desired_from_load(self, ongoing: int) -> int:
        c = self.config
        return self.clamp(math.ceil(ongoing / c.target_ongoing_requests))

    def clamp(self, n: int) -> int:
        return min(max(n, self.config.min_replicas), self.config.max_replicas)

    def target(self, now: float, current: int, desired: int) -> int:
        """The replica count to move to now (``current`` until a desire has held long enough)."""
        desired = self.clamp(desired)
        if desired > current:
            self._downscale_since = None
            if self._upscale_since is None:
                self._upscale_since = now
            if now - self._upscale_since >= self.config.upscale_delay_s:
                self._upscale_since = None
                return desired
        elif desired < current:
            self._upscale_since = None
            if self._downscale_since is None:
                self._downscale_since = now
            if now - self._downscale_since >= self.config.downscale_delay_s:
                self._downscale_since = None
                return desired
        else:
            self._upscale_since = self._downscale_since = None
        return current
