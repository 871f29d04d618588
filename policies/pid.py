"""PID control of T on normalised SLO slack.

Two layers, in the shape of simple-pid:

* :class:`PID` — the controller core: callable ``pid(measurement, dt) -> output``, output limits that
  also clamp the integral, conditional integration (anti-windup), derivative on measurement (no kick
  when the setpoint moves), an output rate limit, a deadband, ``components`` and ``reset()``.
* :class:`PIDPolicy` — a :class:`policies.base.Policy` that runs one :class:`PID` per controlled tier.
  The measurement is the tier's normalised slack ``e = (observed − target) / target`` of the chosen
  latency signal at the tier's percentile (positive ⇒ the SLO is violated ⇒ raise T); the output is
  the fraction ``u`` of the tier's T range, mapped to ``T = min + u · (max − min)``.

Sign convention: ``error = measurement − setpoint`` and the output *rises* while the measurement is
above the setpoint. That is the natural direction here — more T means more accepted tokens per
iteration, hence lower latency — so all gains are positive.
"""

from __future__ import annotations

import math
from typing import Any

from policies.decision import Decision
from policies.signals import CONTROL_METRICS, ControlMetric, metric_target_ms, normalised_slack
from policies.slo import SLOSpec
from policies.telemetry import Telemetry
from policies.tiers import (
    controllable_tiers,
    fraction_from_threshold,
    resolve_tiers,
    safe_thresholds,
    threshold_from_fraction,
)


def _clamp(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


class PID:
    """A positional PID controller with explicit ``dt``.

    ``kp``, ``ki`` (per second), ``kd`` (seconds) act on ``error = measurement − setpoint``.
    ``output_limits`` bound both the output and the integral term. When the output is held at a limit
    (by the bounds or by ``max_rate``) and the error would push it further, the integral is frozen
    (conditional integration), so after a long saturation the output leaves the limit as soon as the
    error changes sign. ``max_rate`` bounds the output change per second; inside ``deadband``
    (``|error| <= deadband``) the output is held and nothing integrates. A NaN measurement (a window
    without evidence) holds the output; the next derivative spans the whole gap.
    """

    def __init__(
        self,
        kp: float,
        ki: float,
        kd: float = 0.0,
        setpoint: float = 0.0,
        output_limits: tuple[float, float] = (0.0, 1.0),
        max_rate: float | None = None,
        deadband: float = 0.0,
        initial_output: float | None = None,
    ) -> None:
        low, high = output_limits
        for name, value in (("kp", kp), ("ki", ki), ("kd", kd), ("deadband", deadband)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if not (math.isfinite(low) and math.isfinite(high) and low <= high):
            raise ValueError(f"output_limits must be finite with low <= high, got {output_limits}")
        if max_rate is not None and not (math.isfinite(max_rate) and max_rate > 0):
            raise ValueError(f"max_rate must be finite and > 0 (or None), got {max_rate}")
        if not math.isfinite(setpoint):
            raise ValueError(f"setpoint must be finite, got {setpoint}")
        self.kp, self.ki, self.kd = kp, ki, kd
        self.setpoint = setpoint
        self.output_limits = (low, high)
        self.max_rate = max_rate
        self.deadband = deadband
        self.initial_output = _clamp(low if initial_output is None else initial_output, low, high)
        self.reset()

    def reset(self) -> None:
        """Forget the integral, the last measurement and the last output."""
        self._integral = self.initial_output
        self._output = self.initial_output
        self._last_measurement: float | None = None
        self._dt_since_measurement = 0.0
        self._proportional = 0.0
        self._derivative = 0.0

    def set_output_limits(self, low: float, high: float) -> None:
        """Move the output limits; the integral and the held output are clamped into them at once."""
        if not (math.isfinite(low) and math.isfinite(high) and low <= high):
            raise ValueError(f"output_limits must be finite with low <= high, got {(low, high)}")
        self.output_limits = (low, high)
        self._integral = _clamp(self._integral, low, high)
        self._output = _clamp(self._output, low, high)

    @property
    def components(self) -> tuple[float, float, float]:
        """The (P, I, D) terms of the last update (I includes the initial output)."""
        return self._proportional, self._integral, self._derivative

    @property
    def output(self) -> float:
        return self._output

    def __call__(self, measurement: float, dt: float) -> float:
        if not (math.isfinite(dt) and dt > 0):
            raise ValueError(f"dt must be finite and > 0, got {dt}")
        self._dt_since_measurement += dt
        if math.isnan(measurement):
            return self._output
        derivative_dt = self._dt_since_measurement
        self._dt_since_measurement = 0.0
        last = self._last_measurement
        self._last_measurement = measurement

        error = measurement - self.setpoint
        if abs(error) <= self.deadband:
            return self._output

        low, high = self.output_limits
        self._proportional = self.kp * error
        # Derivative on measurement: a setpoint change moves P only, never kicks D.
        self._derivative = 0.0 if last is None else self.kd * (measurement - last) / derivative_dt
        integral = _clamp(self._integral + self.ki * error * dt, low, high)

        raw = self._proportional + integral + self._derivative
        out = _clamp(raw, low, high)
        if self.max_rate is not None:
            step = self.max_rate * dt
            out = _clamp(out, self._output - step, self._output + step)
        # Conditional integration: freeze the integral while the output is held at a limit and the
        # error keeps pushing into it (anti-windup).
        if not ((raw - out) * error > 0 and self.ki > 0):
            self._integral = integral
        self._output = out
        return out

    def __repr__(self) -> str:
        return (
            f"PID(kp={self.kp!r}, ki={self.ki!r}, kd={self.kd!r}, setpoint={self.setpoint!r}, "
            f"output_limits={self.output_limits!r}, max_rate={self.max_rate!r}, "
            f"deadband={self.deadband!r}, initial_output={self.initial_output!r})"
        )


class PIDPolicy:
    """One :class:`PID` per controlled tier, each on its own tier's slack, output = T in its bounds.

    Parameters (gains act on normalised slack and on the fraction ``u`` of the tier's T range, so they
    mean the same for every tier):

    * ``tiers`` — tiers to control; None ⇒ every unpinned tier with a target for ``metric``.
      Unpinned tiers that are not controlled get their ``safe_threshold``; pinned tiers their pin.
    * ``metric`` — ``tpot`` | ``ttft`` | ``e2e`` (percentiles of finished requests), ``queue_delay``
      (Little's-law wait, held to the TTFT target) or ``tpot_live`` (mean TPOT of the sequences decoding
      now; dense and unlagged, pair it with a negative setpoint) — see :mod:`policies.signals`.
    * ``kp``, ``ki`` (1/s), ``kd`` (s), ``setpoint`` (target slack; −0.1 aims 10 % under the target).
    * ``deadband`` — slack within ±deadband of the setpoint holds T (no churn on noise).
    * ``max_rate`` — largest change of T per second, as a fraction of the tier's range.
    * ``error_clip`` — slack is clipped to ``[−1, error_clip]`` so one terrible window cannot slam T.
    * ``max_dt_s`` — longest dt credited to the integral (after a gap); None ⇒ 4 windows.
    * ``min_samples`` — a window with fewer latencies than this counts as no evidence (hold): at low
      traffic the p95 of one or two requests is mostly noise.

    ``dt`` is the time between consecutive telemetry windows (the first window uses ``window_s``); a
    window whose time does not advance holds the previous decision.
    """

    name = "pid"

    def __init__(
        self,
        slo: SLOSpec,
        tiers: str | list[str] | tuple[str, ...] | None = None,
        metric: ControlMetric = "tpot",
        kp: float = 0.3,
        ki: float = 0.2,
        kd: float = 0.0,
        setpoint: float = 0.0,
        deadband: float = 0.02,
        max_rate: float | None = 0.2,
        error_clip: float = 2.0,
        max_dt_s: float | None = None,
        min_samples: int = 1,
    ) -> None:
        if metric not in CONTROL_METRICS:
            raise ValueError(f"metric must be one of {CONTROL_METRICS}, got {metric!r}")
        if not (math.isfinite(error_clip) and error_clip > 0):
            raise ValueError(f"error_clip must be finite and > 0, got {error_clip}")
        if max_dt_s is not None and not (math.isfinite(max_dt_s) and max_dt_s > 0):
            raise ValueError(f"max_dt_s must be finite and > 0 (or None), got {max_dt_s}")
        if min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples}")
        self.min_samples = min_samples
        self.slo = slo
        self.metric: ControlMetric = metric
        if tiers is None:
            names = [n for n in controllable_tiers(slo) if metric_target_ms(slo.tiers[n], metric) is not None]
            if not names:
                raise ValueError(f"metric: no unpinned tier has a target for {metric!r}")
        else:
            names = resolve_tiers(slo, tiers)
            for n in names:
                if metric_target_ms(slo.tiers[n], metric) is None:
                    raise ValueError(f"tiers: tier {n!r} has no target for metric {metric!r}")
        self.tiers = names
        self.kp, self.ki, self.kd, self.setpoint = kp, ki, kd, setpoint
        self.deadband, self.max_rate, self.error_clip, self.max_dt_s = (
            deadband,
            max_rate,
            error_clip,
            max_dt_s,
        )
        self.controllers = {
            name: PID(
                kp=kp,
                ki=ki,
                kd=kd,
                setpoint=setpoint,
                output_limits=(0.0, 1.0),
                max_rate=max_rate,
                deadband=deadband,
                initial_output=fraction_from_threshold(slo.tiers[name], slo.tiers[name].safe_threshold),
            )
            for name in names
        }
        self.reset()

    def reset(self) -> None:
        for pid in self.controllers.values():
            pid.reset()
        self._last_time_s: float | None = None
        self.last_decision: Decision | None = None
        self.last_slack: dict[str, float] = {}

    def _thresholds(self) -> dict[str, float]:
        out = safe_thresholds(self.slo)
        for name, pid in self.controllers.items():
            out[name] = threshold_from_fraction(self.slo.tiers[name], pid.output)
        return out

    def decide(self, telemetry: Telemetry) -> Decision:
        dt = telemetry.window_s if self._last_time_s is None else telemetry.time_s - self._last_time_s
        if dt <= 0:
            decision = Decision(
                thresholds=self._thresholds(),
                reason=f"hold: time did not advance ({telemetry.time_s} after {self._last_time_s})",
            )
            self.last_decision = decision
            return decision
        self._last_time_s = telemetry.time_s
        dt = min(dt, self.max_dt_s if self.max_dt_s is not None else 4.0 * telemetry.window_s)

        parts: list[str] = []
        for name, pid in self.controllers.items():
            tier = self.slo.tiers[name]
            slack = normalised_slack(
                telemetry, name, tier, self.metric, clip=self.error_clip, min_samples=self.min_samples
            )
            self.last_slack[name] = slack
            pid(slack, dt)
            t = threshold_from_fraction(tier, pid.output)
            if math.isnan(slack):
                parts.append(f"{name}: no {self.metric} evidence, hold T={t:.3g}")
            else:
                parts.append(f"{name}: {self.metric} slack {slack:+.2f} -> T={t:.3g}")
        decision = Decision(thresholds=self._thresholds(), reason="pid " + "; ".join(parts))
        self.last_decision = decision
        return decision

    def params(self) -> dict[str, Any]:
        return {
            "tiers": list(self.tiers),
            "metric": self.metric,
            "kp": self.kp,
            "ki": self.ki,
            "kd": self.kd,
            "setpoint": self.setpoint,
            "deadband": self.deadband,
            "max_rate": self.max_rate,
            "error_clip": self.error_clip,
            "max_dt_s": self.max_dt_s,
            "min_samples": self.min_samples,
        }

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"PIDPolicy({inner})"
