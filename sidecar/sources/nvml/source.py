"""The NVML source: one reading per selected GPU per cycle, and the GPUs' life cycle.

Capabilities are detected once per GPU when it is opened (``capabilities.py``). A GPU whose PCIe
rates only ``nvmlDeviceGetPcieThroughput`` gives (no byte counters, no GPM) makes one such call
every ``THROUGHPUT_CALL_S``, RX and TX in turn, each rate carried until its direction is sampled
again: the call blocks in the driver for its 20 ms window, the time the model server's own NVML
calls may wait. At run time only two things can go wrong: the GPU is lost (it is set aside and
re-opened later by UUID, the others carry on) or a call fails for a passing reason (that figure
is absent this cycle, logged once until it recovers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pynvml
import structlog

from sidecar.config import Config
from sidecar.metrics import RARE_READ_S
from sidecar.samples import GpuIdentity
from sidecar.sources.nvml.devices import Device, open_gpu, reopen
from sidecar.sources.nvml.errors import GpuLost, NvmlUnavailable, error_name, init_advice, is_lost
from sidecar.sources.nvml.processes import (
    PROC_ROOT,
    PROCESS_READ_S,
    ProcessFigures,
    Publishers,
    publisher_pids,
    read_figures,
)
from sidecar.sources.nvml.reading import (
    GPM_MIN_INTERVAL_S,
    KIB,
    NvmlReading,
    read_gpu,
)
from sidecar.sources.nvml.timed import CallTime, Meter, metered, nvml, totals
from sidecar.sources.nvml.xid import XidWatcher

log = structlog.get_logger("sidecar.nvml")

# at most one nvmlDeviceGetPcieThroughput call (a 20 ms sample) per GPU this often, the two
# directions in turn: each rate is at most twice this old, and an 8-GPU node spends 8 x 20 ms
# of driver time every 10 s on it rather than 16 x 20 ms every cycle
THROUGHPUT_CALL_S = 10.0


class NvmlSource:
    def __init__(
        self,
        *,
        pcie_peak_bytes_per_second: float | None = None,
        lost_retry_s: float = Config.gpu_retry_interval,
        interval_s: float = Config.interval,
        rare_read_s: float = RARE_READ_S,
        throughput_call_s: float | None = None,
        process_read_s: float | None = PROCESS_READ_S,
        proc_root: str = PROC_ROOT,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.pcie_peak = pcie_peak_bytes_per_second
        self.lost_retry_s = lost_retry_s
        self.interval_s = interval_s
        self.rare_read_s = rare_read_s
        # None: THROUGHPUT_CALL_S, or less in a sampling session that asks for the rare figures
        # more often (diagnose's own few seconds ask every cycle: rare_read_s=0)
        self.throughput_call_s = (min(THROUGHPUT_CALL_S, rare_read_s) if throughput_call_s is None
                                  else throughput_call_s)
        # how often each GPU's processes are asked for (processes.py); None: never
        self.process_read_s = process_read_s
        self.proc_root = proc_root
        self.clock = clock
        self.sleep = sleep
        self.driver_version = ""
        self.errors: Counter[str] = Counter()
        self.unreadable_at_start: list[int] = []  # indexes NVML lists but could not open
        self._devices: dict[str, Device] = {}
        # uuid -> the NVML time and calls of that GPU's last reading (its throughput calls too)
        self.last_read_nvml: dict[str, Meter] = {}
        self._throughput = ThroughputCalls()
        self._xids = XidWatcher()

    # -- life cycle ----------------------------------------------------------------------------

    def open(self) -> None:
        try:
            nvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(init_advice(exc)) from exc
        try:
            self.driver_version = nvml.nvmlSystemGetDriverVersion()
        except pynvml.NVMLError:
            self.driver_version = "unknown"
        for index in range(nvml.nvmlDeviceGetCount()):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                for dev in open_gpu(handle, index, pcie_peak=self.pcie_peak,
                                    interval_s=self.interval_s, errors=self.errors):
                    self._devices[dev.identity.uuid] = dev
            except pynvml.NVMLError as exc:
                self.unreadable_at_start.append(index)
                log.warning("gpu_unreadable_at_start", gpu_index=index, error=str(exc),
                            hint=f"it is left out; check `nvidia-smi -i {index}`")
        for dev in self._devices.values():
            self._listen_for_xids(dev)
        self._xids.start()
        # which GPUs this container sees: what a DRA claim or NVIDIA_VISIBLE_DEVICES gave it
        log.info("nvml_opened", driver=self.driver_version, gpus=len(self._devices),
                 visible=[f"{d.identity.uuid} ({d.identity.name})"
                          for d in self._devices.values()])

    def _listen_for_xids(self, dev: Device) -> None:
        """Xids are per physical GPU; a MIG instance's figures are its parent's."""
        if dev.handles.is_mig:
            return
        why = self._xids.register(dev.handles.device, dev.identity.uuid)
        if why is not None:
            dev.caps.absent.update(dict.fromkeys(("gpu_xid_errors_total", "gpu_last_xid"), why))

    def close(self) -> None:
        self._xids.close()
        self._throughput.close()
        for dev in self._devices.values():
            dev.free()
        self._devices.clear()
        with contextlib.suppress(pynvml.NVMLError):
            nvml.nvmlShutdown()

    def devices(self) -> list[GpuIdentity]:
        return [d.identity for d in self._devices.values()]

    def absent(self, uuid: str) -> dict[str, str]:
        """Metrics this GPU cannot give, with the reason (for ``probe`` and the start-up log)."""
        return dict(self._devices[uuid].caps.absent)

    def capabilities(self, uuid: str) -> dict[str, Any]:
        return self._devices[uuid].caps.summary()

    def xid_counts(self, uuid: str) -> tuple[tuple[int, int], ...]:
        """The Xid counts of one GPU by code, read or not: the event that lost a GPU (Xid 79)
        is known although the GPU no longer answers."""
        return self._xids.counts(uuid)[1]

    def nvml_calls(self) -> dict[str, CallTime]:
        """Each pynvml function this process has called, with the time spent in it and the
        calls made (``timed.py``): what ``gpu_sidecar_nvml_call*_total`` export."""
        return totals()

    def is_lost(self, uuid: str) -> bool:
        dev = self._devices.get(uuid)
        return dev is not None and dev.lost_since is not None

    # -- reading -------------------------------------------------------------------------------

    def read(self, uuids: Iterable[str], app: Publishers | None = None
             ) -> dict[str, NvmlReading | None]:
        """One reading per requested GPU; None for a GPU that is lost or unknown. ``app``: the
        app's publishers, whose PIDs tell this pod's processes on a GPU from others'.

        A reading closer than GPM's minimum to the previous one (the last sample taken at
        shutdown, just after a cycle) first waits out the rest of that minimum, at most 0.1 s,
        rather than dropping the GPM figures."""
        uuids = list(uuids)
        now = self._after_gpm_minimum([self._devices[u] for u in uuids if u in self._devices])
        live = [dev for u in uuids if (dev := self._live(u, now)) is not None]
        meters = {dev.identity.uuid: Meter() for dev in live}
        slow = [d for d in live if d.caps.pcie == "throughput"]
        pending = self._throughput.start([d for d in slow if self._throughput_due(d, now)],
                                         meters)
        result: dict[str, NvmlReading | None] = dict.fromkeys(uuids)
        app_pids: list[frozenset[int]] = []  # asked of the app once, when a process read is due
        for dev in live:
            try:
                with metered(meters[dev.identity.uuid]):
                    reading = read_gpu(dev.handles, dev.caps, dev.state, dev.failures, now,
                                       self._xids.counts(dev.identity.uuid),
                                       rare_read_s=self.rare_read_s)
                    result[dev.identity.uuid] = self._with_processes(dev, reading, now, app,
                                                                     app_pids)
            except GpuLost as exc:
                self._mark_lost(dev, now, str(exc.__cause__ or exc))
        for dev in slow:
            result[dev.identity.uuid] = self._add_throughput(
                dev, result[dev.identity.uuid], pending.get(dev.identity.uuid), now)
        self.last_read_nvml = meters
        return result

    def _with_processes(self, dev: Device, reading: NvmlReading, now: float,
                        app: Publishers | None, app_pids: list[frozenset[int]]) -> NvmlReading:
        """``reading`` with the GPU's process figures: read when due (every
        ``process_read_s``), else the last read's carried; unchanged where there are none."""
        state = dev.state.processes
        if self.process_read_s is None:
            return reading
        figures: ProcessFigures | None = state.figures
        if state.due(now, self.process_read_s):
            if not app_pids:
                app_pids.append(publisher_pids(app))
            figures = read_figures(dev.handles.device, state, dev.failures, app_pids[0], now,
                                   is_mig=dev.handles.is_mig, proc_root=self.proc_root)
        if figures is None:
            return reading
        compute = dataclasses.replace(reading.compute, **{
            f.name: getattr(figures, f.name) for f in dataclasses.fields(figures)})
        return dataclasses.replace(reading, compute=compute)

    def _after_gpm_minimum(self, devices: list[Device]) -> float:
        """Now, once at least GPM's minimum has passed since any of ``devices``' last sample."""
        now = self.clock()
        last = max((d.state.gpm_prev_t for d in devices
                    if d.caps.gpm and d.state.gpm_prev_t is not None), default=None)
        if last is not None and 0 <= now - last < GPM_MIN_INTERVAL_S:
            self.sleep(GPM_MIN_INTERVAL_S - (now - last))
            now = self.clock()
        return now

    def _live(self, uuid: str, now: float) -> Device | None:
        """The GPU to read, re-opened first if it was lost and its retry is due; None if it is
        unknown or still lost."""
        dev = self._devices.get(uuid)
        if dev is None or (dev.lost_since is not None and not self._recover(dev, now)):
            return None
        return dev

    def _throughput_due(self, dev: Device, now: float) -> bool:
        last = dev.state.throughput_t
        return last is None or not 0 <= now - last < self.throughput_call_s

    def _add_throughput(self, dev: Device, reading: NvmlReading | None,
                        call: Future[int] | None, now: float) -> NvmlReading | None:
        """``reading`` with the PCIe rates of the throughput fallback: this cycle's call (KB/s
        over 20 ms) for its direction, if one was due, and each direction's last rate carried.
        A failed call leaves its direction absent until it is sampled again."""
        state = dev.state
        if call is not None:
            counter = state.throughput_next
            state.throughput_t = now
            rx = counter == pynvml.NVML_PCIE_UTIL_RX_BYTES
            state.throughput_next = (pynvml.NVML_PCIE_UTIL_TX_BYTES if rx
                                     else pynvml.NVML_PCIE_UTIL_RX_BYTES)
            try:
                rate: float | None = float(call.result() * KIB)
            except pynvml.NVMLError as exc:
                if is_lost(exc):
                    if reading is not None:
                        self._mark_lost(dev, now, error_name(exc))
                    return None
                dev.failures.failed("pcie_throughput", exc)
                rate = None
            else:
                dev.failures.recovered("pcie_throughput")
            if rx:
                state.throughput_rx = rate
            else:
                state.throughput_tx = rate
        if reading is None:
            return None
        io = dataclasses.replace(reading.io, pcie_tx_bytes_per_second=state.throughput_tx,
                                 pcie_rx_bytes_per_second=state.throughput_rx)
        return dataclasses.replace(reading, io=io)

    # -- lost GPUs -----------------------------------------------------------------------------

    def _mark_lost(self, dev: Device, now: float, why: str = "GPU is lost") -> None:
        if dev.lost_since is None:
            dev.lost_since = now
            self.errors["gpu_lost"] += 1
            log.error("gpu_lost", gpu_uuid=dev.identity.uuid, gpu_name=dev.identity.name,
                      error=why, retry_in_s=self.lost_retry_s,
                      effect="its series stop; the other GPUs keep reporting")
            dev.failures.clear()
        dev.retry_at = now + self.lost_retry_s
        dev.state.forget()

    def _recover(self, dev: Device, now: float) -> bool:
        if now < dev.retry_at:
            return False
        try:
            dev.handles = reopen(dev)
        except pynvml.NVMLError:
            dev.retry_at = now + self.lost_retry_s
            return False
        dev.failures.clear()
        self._listen_for_xids(dev)  # a new handle: registered afresh
        log.info("gpu_recovered", gpu_uuid=dev.identity.uuid,
                 lost_for_s=round(now - (dev.lost_since or now), 3))
        dev.lost_since = None
        return True


class ThroughputCalls:
    """``nvmlDeviceGetPcieThroughput`` for GPUs without byte counters or GPM (before Hopper),
    the calls due in a cycle (one per GPU at most, ``THROUGHPUT_CALL_S``) run concurrently on a
    small thread pool.

    The pool is there because the call blocks for its 20 ms sampling window: the due GPUs'
    calls one after the other would cost 20 ms each, 160 ms on an 8-GPU node, while all of them
    at once cost one window, overlapped with the other GPUs' reads. pynvml releases the GIL
    during the C call, so the threads wait in parallel. No pool exists on a GPU with counters or
    GPM (Hopper and newer), where no such call is made."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._size = 0

    def start(self, devices: list[Device], meters: dict[str, Meter]) -> dict[str, Future[int]]:
        """uuid -> the call of each of ``devices``, running, for the direction its state says
        is next; each GPU's time in it goes to its meter."""
        if not devices:
            return {}
        pool = self._executor(len(devices))
        return {dev.identity.uuid: pool.submit(
            _metered_call, meters[dev.identity.uuid], nvml.nvmlDeviceGetPcieThroughput,
            dev.handles.device, dev.state.throughput_next) for dev in devices}

    def _executor(self, calls: int) -> ThreadPoolExecutor:
        """A pool wide enough for every throughput call of a cycle to run at once."""
        if self._pool is None or self._size < calls:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._size = calls
            self._pool = ThreadPoolExecutor(max_workers=calls, thread_name_prefix="pcie")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _metered_call(meter: Meter, fn: Callable[..., int], *args: object) -> int:
    """``fn(*args)`` on a pool thread, its NVML time going to ``meter`` (one GPU's)."""
    with metered(meter):
        return fn(*args)
