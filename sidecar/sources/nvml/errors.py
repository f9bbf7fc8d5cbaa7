"""What an NVML error means for the agent, and how a failing read is logged once.

Three kinds of error matter: *unsupported* (the GPU or driver cannot give the figure, or the driver
answers ``NVML_ERROR_DEPRECATED`` for a call it retired: it is absent for good, decided and said
once at open), *lost* (the GPU fell off the bus: it is set aside and re-opened
later) and everything else (a passing failure: that figure is absent this cycle, logged once until
it recovers).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TypeVar

import pynvml
import structlog

log = structlog.get_logger("sidecar.nvml")

T = TypeVar("T")

# nvml.h (12.0 and later): "The requested functionality has been deprecated"; a driver that
# keeps a DEPRECATED(13.0) call's symbol may answer this instead of the figure
NVML_ERROR_DEPRECATED = getattr(pynvml, "NVML_ERROR_DEPRECATED", 26)
# a call the driver does not have, in the shape pynvml asks for: where a deprecated call's
# successor answers one of these, the driver is older than the successor and the old call is
# tried (the only case it is)
_LACKING_CODES = frozenset({
    pynvml.NVML_ERROR_NOT_SUPPORTED,
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,  # an old driver without the symbol
    getattr(pynvml, "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", 25),  # an older struct version
})
_UNSUPPORTED_CODES = _LACKING_CODES | {NVML_ERROR_DEPRECATED}  # absent for good
_LOST_CODES = frozenset({pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_GPU_NOT_FOUND})


class NvmlUnavailable(RuntimeError):
    """NVML could not be initialised; the message says what to set."""


class GpuLost(Exception):
    """The GPU stopped answering: its reading ends, the other GPUs' go on."""


def error_code(exc: pynvml.NVMLError) -> int:
    return int(getattr(exc, "value", -1))


def error_name(exc: pynvml.NVMLError) -> str:
    return type(exc).__name__.removeprefix("NVMLError_") or "NVMLError"


def is_unsupported(exc: pynvml.NVMLError) -> bool:
    return error_code(exc) in _UNSUPPORTED_CODES


def lacks(exc: pynvml.NVMLError) -> bool:
    """The driver lacks this call (or its struct version): an older call may answer instead."""
    return error_code(exc) in _LACKING_CODES


def is_deprecated(exc: pynvml.NVMLError) -> bool:
    return error_code(exc) == NVML_ERROR_DEPRECATED


def is_lost(exc: pynvml.NVMLError) -> bool:
    return error_code(exc) in _LOST_CODES


class Failures:
    """One GPU's reads that are failing now: each is logged when it starts failing and when it
    recovers, not on every cycle; every failure is counted in the source's ``errors``."""

    def __init__(self, uuid: str, errors: Counter[str]) -> None:
        self.uuid = uuid
        self.errors = errors
        self.failing: set[str] = set()

    def call(self, what: str, fn: Callable[..., T], *args: object) -> T | None:
        """``fn(*args)``, or None when it fails for a passing reason (logged once, counted);
        a lost GPU raises ``GpuLost``, which ends this GPU's reading for the cycle."""
        try:
            value = fn(*args)
        except pynvml.NVMLError as exc:
            if is_lost(exc):
                raise GpuLost from exc
            self.failed(what, exc)
            return None
        self.recovered(what)
        return value

    def failed(self, what: str, exc: pynvml.NVMLError) -> None:
        self.errors["nvml_error"] += 1
        if what not in self.failing:
            self.failing.add(what)
            log.warning("nvml_read_failed", gpu_uuid=self.uuid, read=what,
                        error=error_name(exc), detail=str(exc),
                        effect="figure absent until the read succeeds; logged once")

    def recovered(self, what: str) -> None:
        if what in self.failing:
            self.failing.discard(what)
            log.info("nvml_read_recovered", gpu_uuid=self.uuid, read=what)

    def warn_once(self, what: str, event: str, **details: object) -> None:
        """A condition that is not an NVML error (GPM asked too soon) but drops a figure:
        warned about once, cleared only when the GPU is re-opened."""
        if what not in self.failing:
            self.failing.add(what)
            log.warning(event, gpu_uuid=self.uuid, **details)

    def clear(self) -> None:
        self.failing.clear()


def init_advice(exc: pynvml.NVMLError) -> str:
    code = error_code(exc)
    if code == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
        what = "the NVML library (libnvidia-ml.so.1) is not in this container"
    elif code == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
        what = "the NVIDIA driver is not loaded on this node"
    elif code == pynvml.NVML_ERROR_NO_PERMISSION:
        what = "this user may not open the GPU device files"
    else:
        what = f"NVML failed to initialise ({error_name(exc)}: {exc})"
    return (
        f"{what}. Give the container its GPUs through the NVIDIA runtime: set "
        "NVIDIA_VISIBLE_DEVICES to the pod's GPU UUIDs (or share the app container's devices) and "
        "NVIDIA_DRIVER_CAPABILITIES=utility so libnvidia-ml.so.1 is mounted; or run with "
        "--no-nvml (GPU_SIDECAR_NO_NVML=1) to export only the app's allocator and latency figures; "
        "or try --simulate healthy on a machine without a GPU."
    )
