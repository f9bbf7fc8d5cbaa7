"""Xid errors: the driver's reports of faults (79: the GPU fell off the bus; 48, 63, 64, 94, 95:
ECC and row remapping; 13, 31, 43: faults of the app), heard through an NVML event set.

Waiting for events blocks, so it happens on a thread of its own and never on the sampling path:
the thread counts each GPU's Xids by code and keeps the last one; a cycle only copies those
counts under a lock. A GPU that cannot deliver Xid events (a MIG instance, a driver without
them) is registered with nothing, said once in the log, and its Xid series are absent.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections import Counter
from typing import Any

import pynvml
import structlog

from sidecar.log import log_count
from sidecar.sources.nvml.errors import error_code, error_name, is_unsupported
from sidecar.sources.nvml.timed import nvml

log = structlog.get_logger("sidecar.nvml")

WAIT_MS = 1000  # one wait; also how long closing may take
# what each well-known Xid says, for the log line (NVIDIA's Xid catalogue)
MEANING = {
    13: "graphics engine exception (often the app's fault)",
    31: "GPU memory page fault (often the app's fault)",
    43: "GPU stopped processing (the app's kernel was killed)",
    45: "preemptive cleanup after an earlier error",
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}


class XidWatcher:
    """One event set for every GPU of the source; ``counts(uuid)`` is what a cycle reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set: Any = None
        self._handles: dict[int, tuple[Any, str]] = {}  # handle address -> (handle, uuid)
        self._counts: dict[str, Counter[int]] = {}
        self._last: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wait_failures = 0

    def register(self, handle: Any, uuid: str) -> str | None:
        """Listen for ``handle``'s Xids; the reason when it cannot deliver them."""
        try:
            supported = nvml.nvmlDeviceGetSupportedEventTypes(handle)
            if not supported & pynvml.nvmlEventTypeXidCriticalError:
                return "Xid events not supported on this GPU"
            with self._lock:  # held while registering: a rebuild cannot swap the set meanwhile
                if self._set is None:
                    self._set = nvml.nvmlEventSetCreate()
                nvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError,
                                                self._set)
                self._handles[_address(handle)] = (handle, uuid)
                self._counts.setdefault(uuid, Counter())
        except pynvml.NVMLError as exc:
            if is_unsupported(exc):
                return f"Xid events unavailable: {error_name(exc)}"
            return f"Xid events could not be registered: {error_name(exc)}"
        self.start()  # a set created after open (a GPU re-opened) gets its thread too
        return None

    def start(self) -> None:
        if self._set is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="nvml-xid", daemon=True)
        self._thread.start()

    def counts(self, uuid: str) -> tuple[int | None, tuple[tuple[int, int], ...]]:
        """(last Xid code, counts by code) of one GPU; (None, ()) when it has had none."""
        with self._lock:
            counts = self._counts.get(uuid)
            return self._last.get(uuid), tuple(sorted(counts.items())) if counts else ()

    def close(self) -> None:
        """Stop listening. A wait in progress cannot be cut short: rather than hold shutdown
        for it (up to ``WAIT_MS``), the thread, a daemon, ends when it returns; the set is freed
        here only when no wait is in progress (else NVML's shutdown or the process's end does)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=0.05)
        if self._set is not None and (self._thread is None or not self._thread.is_alive()):
            with contextlib.suppress(pynvml.NVMLError):
                nvml.nvmlEventSetFree(self._set)
            self._set = None

    def _run(self) -> None:
        rebuilt = False  # the set was just rebuilt for a lost GPU: once only, then back off
        while not self._stop.is_set():
            try:
                with self._lock:
                    event_set = self._set
                data = pynvml.nvmlEventSetWait_v2(event_set, WAIT_MS)
            except pynvml.NVMLError as exc:
                code = error_code(exc)
                if code == pynvml.NVML_ERROR_TIMEOUT or self._stop.is_set():
                    rebuilt = False
                    continue
                if code in (pynvml.NVML_ERROR_UNINITIALIZED, pynvml.NVML_ERROR_INVALID_ARGUMENT):
                    return  # NVML was shut down under it, or the set is gone: nothing to hear
                if code == pynvml.NVML_ERROR_GPU_IS_LOST and not rebuilt:
                    rebuilt = self._rebuild()
                    continue
                self._wait_failed(exc)
                self._stop.wait(WAIT_MS / 1000)
                continue
            rebuilt = False
            if data.eventType & pynvml.nvmlEventTypeXidCriticalError:
                self._heard(data)

    def _rebuild(self) -> bool:
        """A GPU of the set was lost, and the set answers nothing else: a new set with every
        GPU that still registers, so that the others' Xids are still heard (the lost one is
        registered again when the source re-opens it)."""
        with self._lock:  # registering is quick; holding the lock keeps register() out
            old, handles = self._set, list(self._handles.values())
            try:
                fresh = nvml.nvmlEventSetCreate()
            except pynvml.NVMLError:
                return False
            kept = {}
            for handle, uuid in handles:
                with contextlib.suppress(pynvml.NVMLError):
                    nvml.nvmlDeviceRegisterEvents(handle,
                                                    pynvml.nvmlEventTypeXidCriticalError, fresh)
                    kept[_address(handle)] = (handle, uuid)
            self._set, self._handles = fresh, kept
        with contextlib.suppress(pynvml.NVMLError):
            nvml.nvmlEventSetFree(old)
        log.info("xid_listening_without_lost_gpu", gpus=sorted(uuid for _, uuid in kept.values()))
        return True

    def _heard(self, data: Any) -> None:
        code = int(data.eventData)
        with self._lock:
            found = self._handles.get(_address(data.device))
            if found is None:
                return
            uuid = found[1]
            self._counts[uuid][code] += 1
            self._last[uuid] = code
            count = self._counts[uuid][code]
        # each code at its 1st, 10th, 100th ...: a storm of one code must not flood the log
        log_count("xid_error", count, gpu_uuid=uuid, xid=code,
                  meaning=MEANING.get(code, "see NVIDIA's Xid catalogue"),
                  effect="counted in gpu_xid_errors_total{xid=...}; gpu_last_xid holds the code")

    def _wait_failed(self, exc: pynvml.NVMLError) -> None:
        self._wait_failures += 1
        if self._wait_failures in (1, 10, 100) or self._wait_failures % 1000 == 0:
            log.warning("xid_wait_failed", error=error_name(exc), count=self._wait_failures,
                        effect="Xid events may be missed meanwhile; the watcher keeps trying")


def _address(handle: Any) -> int:
    """A device handle's identity: the address it points to (ctypes pointers compare by object,
    not by what they point to, so a handle NVML gives back in an event is a new object)."""
    return ctypes.cast(handle, ctypes.c_void_p).value or 0
