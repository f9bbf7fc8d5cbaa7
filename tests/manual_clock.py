"""A clock the tests (and the benchmarks) move by hand."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ManualClock:
    """A clock tests move by hand; shared by the fake library and the agent. Moving it wakes
    whatever the stand-in (``sidecar.simulate.fake_nvml``, which calls a clock's ``watch`` where
    it has one) has blocked on the simulated time (an event-set wait)."""

    _now: list[float] = field(default_factory=lambda: [1000.0])
    _watchers: list[weakref.WeakMethod] = field(default_factory=list, compare=False, repr=False)

    def __call__(self) -> float:
        return self._now[0]

    def watch(self, method: Callable[[], object]) -> None:
        """Call the bound ``method`` after each move (held weakly)."""
        self._watchers.append(weakref.WeakMethod(method))  # type: ignore[arg-type]

    def advance(self, seconds: float) -> None:
        self._now[0] += seconds
        for ref in list(self._watchers):
            method = ref()
            if method is None:
                self._watchers.remove(ref)
            else:
                method()
