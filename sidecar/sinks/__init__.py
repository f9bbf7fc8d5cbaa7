"""Where series go: stdout here; remote-write and Pushgateway sinks build on the same interface.

A sink takes the series of one cycle, already named and labelled, and owns what happens next.
"""

from __future__ import annotations

from typing import Protocol

from sidecar.samples import Labels, Series

# the longest a sink's thread waits for a wake-up: only bounds the harm of one somehow missed
IDLE_WAIT_S = 60.0


class Sink(Protocol):
    name: str

    def start(self) -> None: ...

    def emit(self, series: list[Series]) -> None: ...

    def begin_close(self, deadline: float) -> None:
        """Shutdown starts: stop waiting, use the time until ``deadline`` to deliver."""
        ...

    def close(self, deadline: float) -> bool:
        """Deliver what the time until ``deadline`` (monotonic) allows; True when all was."""
        ...

    def telemetry(self, ts: int, labels: Labels) -> list[Series]: ...
