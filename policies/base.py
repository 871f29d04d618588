"""The policy interface shared by the simulator and the live controller."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from policies.decision import Decision
from policies.telemetry import Telemetry


@runtime_checkable
class Policy(Protocol):
    """A small stateful object: telemetry in, decision out.

    Contract: ``decide`` is deterministic given the sequence of telemetry it has seen (and its own
    seeded RNG); it never reads a clock (time is ``telemetry.time_s``); ``reset`` forgets all state.
    """

    def decide(self, telemetry: Telemetry) -> Decision: ...

    def reset(self) -> None: ...
