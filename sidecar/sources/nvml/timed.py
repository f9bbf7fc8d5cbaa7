"""Every NVML call the agent makes, timed and counted at the pynvml boundary.

NVML calls serialise in the driver, where the agent meets the model server: the time the agent
holds NVML is its cost to the pod, so it is measured, per pynvml function, for the life of the
process (``gpu_sidecar_nvml_call_seconds_total{call}``, ``gpu_sidecar_nvml_calls_total{call}``).

The NVML modules call pynvml's functions through ``nvml`` (``nvml.nvmlDeviceGetUtilizationRates
(handle)``) and read its constants from pynvml itself. Each function is wrapped once, on first
use; a call then costs two ``perf_counter_ns`` readings, a lock taken uncontended and a few integer
additions. A ``Meter`` made current on a thread (``metered``) also receives that thread's calls:
how the source tells one GPU's share of a cycle, its throughput calls on the pool included.

Not timed: ``nvmlEventSetWait_v2``, which the Xid watcher's thread makes to sleep until an event
arrives or its timeout passes: a wait by design, not work done in the driver.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from time import perf_counter_ns
from typing import Any

import pynvml

UNTIMED = frozenset({"nvmlEventSetWait_v2"})
_NS = 1e-9


@dataclass(slots=True)
class Meter:
    """Nanoseconds and calls spent in NVML by the calls made while it was current."""

    ns: int = 0
    calls: int = 0

    @property
    def seconds(self) -> float:
        return self.ns * _NS


@dataclass(frozen=True, slots=True)
class CallTime:
    """One pynvml function's total: seconds spent in it and calls made, since the start."""

    seconds: float
    calls: int


class _Current(threading.local):
    meter: Meter | None = None


_cells: dict[str, list[int]] = {}  # function name -> [ns, calls]
_lock = threading.Lock()
_current = _Current()


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    cell = _cells.setdefault(name, [0, 0])
    lock, current, clock = _lock, _current, perf_counter_ns

    def call(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = clock() - start
            meter = current.meter
            with lock:  # the throughput calls run on a pool: no increment lost
                cell[0] += spent
                cell[1] += 1
                if meter is not None:
                    meter.ns += spent
                    meter.calls += 1

    call.__name__ = call.__qualname__ = name
    return call


class _Nvml:
    """pynvml with its functions timed; anything else (a constant) is pynvml's own."""

    def __getattr__(self, name: str) -> Any:
        target = getattr(pynvml, name)
        if not (name.startswith("nvml") and callable(target)) or name in UNTIMED:
            return target
        wrapped = self.__dict__[name] = _timed(name, target)
        return wrapped


nvml: Any = _Nvml()


def totals() -> dict[str, CallTime]:
    """Each pynvml function called so far (by this process), with its time and count."""
    with _lock:
        return {name: CallTime(seconds=ns * _NS, calls=calls)
                for name, (ns, calls) in sorted(_cells.items()) if calls}


def since(before: dict[str, CallTime]) -> dict[str, CallTime]:
    """What each function cost since ``before`` (a ``totals()``), the costliest first."""
    out = {}
    for name, now in totals().items():
        then = before.get(name, CallTime(0.0, 0))
        if now.calls > then.calls:
            out[name] = CallTime(seconds=now.seconds - then.seconds, calls=now.calls - then.calls)
    return dict(sorted(out.items(), key=lambda kv: -kv[1].seconds))


@contextlib.contextmanager
def metered(meter: Meter | None) -> Iterator[Meter | None]:
    """Make ``meter`` receive this thread's NVML calls for the block."""
    previous, _current.meter = _current.meter, meter
    try:
        yield meter
    finally:
        _current.meter = previous
