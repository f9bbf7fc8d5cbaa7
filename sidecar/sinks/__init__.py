"""Where series go: stdout here; remote-write and Pushgateway sinks build on the same interface.

A sink takes the series of one cycle, already named and labelled, and owns what happens next.
"""

from __future__ import annotations

from typing import Protocol

from sidecar.samples import Series


class Sink(Protocol):
    def emit(self, series: list[Series]) -> None: ...

    def close(self) -> None: ...
