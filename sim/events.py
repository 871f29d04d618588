"""Events: one small class each. The loop pops the earliest (time, order, seq) and calls ``handle``,
which returns the follow-up events. ``ORDER`` breaks ties at equal times: replicas come up and
decisions land before arrivals are routed; arrivals join before a segment closes (so a request
arriving exactly at a boundary joins there); reports and control ticks see everything up to their time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from policies.decision import Decision

if TYPE_CHECKING:
    from sim.simulator import Simulator


class Event:
    __slots__ = ("time_s",)
    ORDER: ClassVar[int] = 0

    def __init__(self, time_s: float) -> None:
        self.time_s = time_s

    def handle(self, sim: Simulator) -> list[Event]:
        raise NotImplementedError


class ReplicaReady(Event):
    __slots__ = ("replica_id",)
    ORDER = 0

    def __init__(self, time_s: float, replica_id: int) -> None:
        super().__init__(time_s)
        self.replica_id = replica_id

    def handle(self, sim: Simulator) -> list[Event]:
        return sim.on_replica_ready(self.time_s, self.replica_id)


class ApplyDecision(Event):
    __slots__ = ("decision",)
    ORDER = 1

    def __init__(self, time_s: float, decision: Decision) -> None:
        super().__init__(time_s)
        self.decision = decision

    def handle(self, sim: Simulator) -> list[Event]:
        return sim.on_apply_decision(self.time_s, self.decision)


class Arrival(Event):
    __slots__ = ("request_id",)
    ORDER = 2

    def __init__(self, time_s: float, request_id: int) -> None:
        super().__init__(time_s)
        self.request_id = request_id

    def handle(self, sim: Simulator) -> list[Event]:
        return sim.on_arrival(self.time_s, self.request_id)


class SegmentEnd(Event):
    """A replica's drawn segment of iterations ends (stale if the replica's version moved on)."""

    __slots__ = ("replica_id", "version")
    ORDER = 3

    def __init__(self, time_s: float, replica_id: int, version: int) -> None:
        super().__init__(time_s)
        self.replica_id = replica_id
        self.version = version

    def handle(self, sim: Simulator) -> list[Event]:
        return sim.on_segment_end(self.time_s, self.replica_id, self.version)


class ReplicaReport(Event):
    """The replicas report (``SimConfig.report_age_s``): the next tick's telemetry is sealed as of now."""

    __slots__ = ()
    ORDER = 4

    def handle(self, sim: Simulator) -> list[Event]:
        return sim.on_replica_report(self.time_s)


class ControlTick(Event):
    __slots__ = ()
    ORDER = 5

    def handle(self, sim: Simulator) -> list[Event]:
        return sim.on_control_tick(self.time_s)
