"""The NVML source: per-GPU readings of the compute, memory and IO layers.

Capabilities are detected once per GPU when it is first opened: what a GPU cannot give
(``NotSupported``, or ``FunctionNotFound`` on an old driver) is logged once and stays absent. At
run time only two things can go wrong: the GPU is lost (it is set aside and re-opened later by
UUID, the others carry on) or a call fails for a passing reason (that figure is absent this cycle,
logged once until it recovers).

``nvmlDeviceGetPcieThroughput`` blocks for its 20 ms window, so when a GPU has no byte counters
and no GPM, those calls run concurrently on a small pool while the serial reads go on.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pynvml
import structlog

from sidecar.samples import ComputeLayer, GpuIdentity, IoLayer, MemoryLayer
from sidecar.sources.nvml_calls import PreparedCalls
from sidecar.sources.pcie import counter_rate, link_max_bytes_per_second

log = structlog.get_logger("sidecar.nvml")

GPM_MIN_INTERVAL_S = 0.1
NVLINK_LINK_CEILING_BYTES_PER_SECOND = 4 * 50e9  # per link and direction; beyond: a reset
KIB = 1024
MIB = 1024 * 1024

ARCHITECTURES = {
    pynvml.NVML_DEVICE_ARCH_KEPLER: "kepler",
    pynvml.NVML_DEVICE_ARCH_MAXWELL: "maxwell",
    pynvml.NVML_DEVICE_ARCH_PASCAL: "pascal",
    pynvml.NVML_DEVICE_ARCH_VOLTA: "volta",
    pynvml.NVML_DEVICE_ARCH_TURING: "turing",
    pynvml.NVML_DEVICE_ARCH_AMPERE: "ampere",
    pynvml.NVML_DEVICE_ARCH_ADA: "ada",
    pynvml.NVML_DEVICE_ARCH_HOPPER: "hopper",
    getattr(pynvml, "NVML_DEVICE_ARCH_BLACKWELL", 10): "blackwell",
}

_UNSUPPORTED_CODES = {
    pynvml.NVML_ERROR_NOT_SUPPORTED,
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    getattr(pynvml, "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", 25),
}
_LOST_CODES = {pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_GPU_NOT_FOUND}

# GPM metric id -> (field in our layers, scale to our unit)
_GPM_CORE = {
    pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: ("sm_occupancy_ratio", 0.01),
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: ("tensor_core_util_ratio", 0.01),
    pynvml.NVML_GPM_METRIC_SM_UTIL: ("sm_active_ratio", 0.01),
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: ("bandwidth_util_ratio", 0.01),
}
_GPM_PCIE = {
    pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: ("pcie_tx_bytes_per_second", MIB),
    pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: ("pcie_rx_bytes_per_second", MIB),
}
_GPM_NVLINK = {
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: ("nvlink_tx_bytes_per_second", MIB),
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: ("nvlink_rx_bytes_per_second", MIB),
}
# every GPM-derived field -> the metric name users see (for "absent" reports)
GPM_METRIC_NAMES = {
    "sm_occupancy_ratio": "gpu_sm_occupancy_ratio",
    "tensor_core_util_ratio": "gpu_tensor_core_util_ratio",
    "sm_active_ratio": "gpu_sm_active_ratio",
    "bandwidth_util_ratio": "gpu_mem_bandwidth_util_ratio",
}

FI_TX = pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES
FI_RX = pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES
FI_REPLAY = pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER
FI_LINKS = pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT
FI_NVL_TX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
FI_NVL_RX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX

_VALUE_BITS = {
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: 32,
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: 64,
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: 64,
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: 63,
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: 16,
}


class NvmlUnavailable(RuntimeError):
    """NVML could not be initialised; the message says what to set."""


class GpuLost(Exception):
    pass


def error_code(exc: pynvml.NVMLError) -> int:
    return int(getattr(exc, "value", -1))


def error_name(exc: pynvml.NVMLError) -> str:
    return type(exc).__name__.removeprefix("NVMLError_") or "NVMLError"


def field_value(fv: Any) -> tuple[int, int] | None:
    """(value, counter width in bits) of an integer field value, None when it failed."""
    if fv.nvmlReturn != pynvml.NVML_SUCCESS:
        return None
    vt = fv.valueType
    if vt == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT:
        return fv.value.uiVal, 32
    if vt in (pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG):
        return fv.value.ullVal, 64
    if vt == pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return fv.value.sllVal, 63
    if vt == pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT:
        return fv.value.usVal, 16
    return None


class NvmlReading(NamedTuple):
    compute: ComputeLayer
    memory: MemoryLayer
    io: IoLayer


_new = tuple.__new__  # a NamedTuple from one iterable in field order, skipping keyword handling


@dataclass(slots=True)
class _Device:
    identity: GpuIdentity
    handle: Any
    parent_handle: Any = None  # MIG: the physical GPU
    gpu_instance_id: int | None = None
    mig_slot: int | None = None  # MIG: its index under the parent, to re-open it
    # capabilities, decided once at open
    memory: str | None = None  # "v2" | "v1" | None
    utilization: bool = False
    gpm: bool = False
    pcie: str | None = None  # "counters" | "gpm" | "throughput" | None
    pcie_note: str = ""  # why the byte counters were not taken, when they exist
    pcie_max_dt: float = math.inf  # longest gap over which the counters still give a rate
    replay: str | None = None  # "field" | "call" | None
    nvlink_links: int = 0
    nvlink: str | None = None  # "counters" | "gpm" | None
    link_generation: int | None = None
    link_width: int | None = None
    link_max: float | None = None
    absent: dict[str, str] = field(default_factory=dict)  # metric -> why
    # run-time state
    fields: list[Any] = field(default_factory=list)
    prev_pcie: tuple[float, int, int, int, int] | None = None  # t, tx, tx_bits, rx, rx_bits
    prev_nvlink: tuple[float, int, int] | None = None  # t, tx KiB, rx KiB
    gpm_samples: list[Any] = field(default_factory=list)
    gpm_prev_t: float | None = None
    gpm_ids: dict[int, tuple[str, float]] = field(default_factory=dict)
    gpm_slots: list[tuple[int, int, float]] = field(default_factory=list)  # per metric, in order
    gpm_next: int = 1  # which of the two samples the next reading goes into
    calls: PreparedCalls | None = None
    lost_since: float | None = None
    retry_at: float = 0.0
    failing: set[str] = field(default_factory=set)

    @property
    def is_mig(self) -> bool:
        return self.parent_handle is not None


class NvmlSource:
    def __init__(
        self,
        *,
        pcie_peak_bytes_per_second: float | None = None,
        lost_retry_s: float = 30.0,
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.pcie_peak = pcie_peak_bytes_per_second
        self.lost_retry_s = lost_retry_s
        self.interval_s = interval_s
        self.clock = clock
        self.sleep = sleep
        self.driver_version = ""
        self.errors: Counter[str] = Counter()
        self.unreadable_at_start: list[int] = []  # indexes NVML lists but could not open
        self._devices: dict[str, _Device] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0

    # -- life cycle ----------------------------------------------------------------------------

    def open(self) -> None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(_init_advice(exc)) from exc
        try:
            self.driver_version = pynvml.nvmlSystemGetDriverVersion()
        except pynvml.NVMLError:
            self.driver_version = "unknown"
        count = pynvml.nvmlDeviceGetCount()
        for index in range(count):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                for dev in self._open_gpu(handle, index):
                    self._devices[dev.identity.uuid] = dev
            except pynvml.NVMLError as exc:
                self.unreadable_at_start.append(index)
                log.warning("gpu_unreadable_at_start", gpu_index=index, error=str(exc),
                            hint=f"it is left out; check `nvidia-smi -i {index}`")
        # which GPUs this container sees: what a DRA claim or NVIDIA_VISIBLE_DEVICES gave it
        log.info("nvml_opened", driver=self.driver_version, gpus=len(self._devices),
                 visible=[f"{d.identity.uuid} ({d.identity.name})"
                          for d in self._devices.values()])

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        for dev in self._devices.values():
            for sample in dev.gpm_samples:
                with contextlib.suppress(pynvml.NVMLError):
                    pynvml.nvmlGpmSampleFree(sample)
            dev.gpm_samples.clear()
        self._devices.clear()
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()

    def devices(self) -> list[GpuIdentity]:
        return [d.identity for d in self._devices.values()]

    def absent(self, uuid: str) -> dict[str, str]:
        """Metrics this GPU cannot give, with the reason (for ``probe`` and the start-up log)."""
        return dict(self._devices[uuid].absent)

    def capabilities(self, uuid: str) -> dict[str, Any]:
        d = self._devices[uuid]
        caps = {"memory": d.memory, "utilization": d.utilization, "gpm": d.gpm, "pcie": d.pcie,
                "replay": d.replay, "nvlink": d.nvlink, "nvlink_links": d.nvlink_links,
                "link_generation": d.link_generation, "link_width": d.link_width,
                "link_max_bytes_per_second": d.link_max}
        if d.pcie_note:
            caps["pcie_note"] = d.pcie_note
        return caps

    def is_lost(self, uuid: str) -> bool:
        dev = self._devices.get(uuid)
        return dev is not None and dev.lost_since is not None

    # -- opening one GPU -----------------------------------------------------------------------

    def _open_gpu(self, handle: Any, index: int) -> list[_Device]:
        identity = GpuIdentity(
            uuid=pynvml.nvmlDeviceGetUUID(handle),
            name=pynvml.nvmlDeviceGetName(handle),
            index=str(index),
            pci_bus_id=_bus_id(handle),
            architecture=ARCHITECTURES.get(
                _try(lambda: pynvml.nvmlDeviceGetArchitecture(handle), -1), "unknown"),
        )
        dev = _Device(identity=identity, handle=handle)
        self._detect(dev)
        self._prepare(dev)
        devices = [dev]
        mig_mode = _try(lambda: pynvml.nvmlDeviceGetMigMode(handle), [0, 0])
        if mig_mode[0] == 1:
            devices += self._open_migs(dev)
        self._report(dev)
        return devices

    def _open_migs(self, parent: _Device) -> list[_Device]:
        out: list[_Device] = []
        slots = _try(lambda: pynvml.nvmlDeviceGetMaxMigDeviceCount(parent.handle), 0)
        for slot in range(slots):
            try:
                mh = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent.handle, slot)
            except pynvml.NVMLError:
                continue  # empty slot
            identity = GpuIdentity(
                uuid=pynvml.nvmlDeviceGetUUID(mh),
                name=pynvml.nvmlDeviceGetName(mh),
                index=f"{parent.identity.index}/{slot}",
                pci_bus_id=parent.identity.pci_bus_id,
                architecture=parent.identity.architecture,
                parent_uuid=parent.identity.uuid,
            )
            dev = _Device(identity=identity, handle=mh, parent_handle=parent.handle,
                          gpu_instance_id=pynvml.nvmlDeviceGetGpuInstanceId(mh), mig_slot=slot)
            self._detect_memory(dev)
            dev.gpm = parent.gpm
            if dev.gpm:
                self._gpm_setup(dev, _GPM_CORE)
            dev.link_generation, dev.link_width = parent.link_generation, parent.link_width
            dev.link_max = parent.link_max
            for name in ("gpu_utilization_ratio", "gpu_memory_controller_busy_ratio",
                         "gpu_pcie_tx_bytes_per_second", "gpu_pcie_rx_bytes_per_second",
                         "gpu_nvlink_tx_bytes_per_second", "gpu_nvlink_rx_bytes_per_second",
                         "gpu_pcie_replay_errors_total"):
                dev.absent[name] = "MIG instance: reported on the parent GPU only"
            if not dev.gpm:
                for name in GPM_METRIC_NAMES.values():
                    dev.absent[name] = parent.absent.get(name, "no GPM")
            self._prepare(dev)
            self._report(dev)
            out.append(dev)
        return out

    def _detect_memory(self, dev: _Device) -> None:
        try:
            pynvml.nvmlDeviceGetMemoryInfo(dev.handle, version=pynvml.nvmlMemory_v2)
            dev.memory = "v2"
            return
        except pynvml.NVMLError as exc:
            if error_code(exc) not in _UNSUPPORTED_CODES:
                raise
        dev.absent["gpu_memory_reserved_bytes"] = "nvmlDeviceGetMemoryInfo_v2 unavailable (old driver)"
        try:
            pynvml.nvmlDeviceGetMemoryInfo(dev.handle)
            dev.memory = "v1"
        except pynvml.NVMLError as exc:
            if error_code(exc) not in _UNSUPPORTED_CODES:
                raise
            for name in ("gpu_memory_used_bytes", "gpu_memory_total_bytes"):
                dev.absent[name] = error_name(exc)

    def _detect(self, dev: _Device) -> None:
        h = dev.handle
        self._detect_memory(dev)
        try:
            pynvml.nvmlDeviceGetUtilizationRates(h)
            dev.utilization = True
        except pynvml.NVMLError as exc:
            if error_code(exc) not in _UNSUPPORTED_CODES:
                raise
            dev.absent["gpu_utilization_ratio"] = error_name(exc)
            dev.absent["gpu_memory_controller_busy_ratio"] = error_name(exc)

        try:
            dev.gpm = bool(pynvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice)
            gpm_why = "GPM not supported on this GPU (Hopper and newer only)"
        except pynvml.NVMLError as exc:
            if error_code(exc) not in _UNSUPPORTED_CODES:
                raise
            dev.gpm = False
            gpm_why = f"GPM unavailable: {error_name(exc)} (driver too old?)"

        # link: the device's maximum, not the current (idle links train down to save power)
        dev.link_generation = _try(lambda: pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h), None)
        dev.link_width = _try(lambda: pynvml.nvmlDeviceGetMaxPcieLinkWidth(h), None)
        if self.pcie_peak:
            dev.link_max = float(self.pcie_peak)
        elif dev.link_generation and dev.link_width:
            dev.link_max = link_max_bytes_per_second(dev.link_generation, dev.link_width)
        if dev.link_max is None:
            for name in ("gpu_pcie_link_max_bytes_per_second", "gpu_pcie_tx_bandwidth_util_ratio",
                         "gpu_pcie_rx_bandwidth_util_ratio"):
                dev.absent[name] = "link generation/width unknown; set --pcie-peak-bytes-per-second"

        probe: dict[int, tuple[int, int] | None] = {}
        try:
            values = pynvml.nvmlDeviceGetFieldValues(h, [FI_TX, FI_RX, FI_REPLAY, FI_LINKS])
            probe = {v.fieldId: field_value(v) for v in values}
        except pynvml.NVMLError as exc:
            if error_code(exc) not in _UNSUPPORTED_CODES:
                raise
        tx, rx = probe.get(FI_TX), probe.get(FI_RX)
        if tx and rx and self._counter_fits(dev, min(tx[1], rx[1])):
            dev.pcie = "counters"
        elif dev.gpm:
            dev.pcie = "gpm"
        else:
            dev.pcie = "throughput"
        if probe.get(FI_REPLAY):
            dev.replay = "field"
        elif _try(lambda: pynvml.nvmlDeviceGetPcieReplayCounter(h), None) is not None:
            dev.replay = "call"
        else:
            dev.absent["gpu_pcie_replay_errors_total"] = "not supported"
        links = probe.get(FI_LINKS)
        dev.nvlink_links = links[0] if links else 0
        # GPM's all-link totals cost one entry in a call made anyway; per-link counters cost two
        # field values per link (36 on an H200) every cycle, so they are the fallback
        if dev.nvlink_links and dev.gpm:
            dev.nvlink = "gpm"
        elif dev.nvlink_links:
            try:
                check = pynvml.nvmlDeviceGetFieldValues(h, [(FI_NVL_TX, 0), (FI_NVL_RX, 0)])
                if all(field_value(v) for v in check):
                    dev.nvlink = "counters"
            except pynvml.NVMLError as exc:
                if error_code(exc) not in _UNSUPPORTED_CODES:
                    raise
        if dev.nvlink is None:
            why = "no NVLink on this GPU" if not dev.nvlink_links else "NVLink counters unsupported"
            dev.absent["gpu_nvlink_tx_bytes_per_second"] = why
            dev.absent["gpu_nvlink_rx_bytes_per_second"] = why

        ids = [FI_TX, FI_RX] if dev.pcie == "counters" else []
        if dev.replay == "field":
            ids.append(FI_REPLAY)
        if dev.nvlink == "counters":
            ids += [(FI_NVL_TX, link) for link in range(dev.nvlink_links)]
            ids += [(FI_NVL_RX, link) for link in range(dev.nvlink_links)]
        dev.fields = ids

        if dev.gpm:
            metrics = dict(_GPM_CORE)
            if dev.pcie == "gpm":
                metrics |= _GPM_PCIE
            if dev.nvlink == "gpm":
                metrics |= _GPM_NVLINK
            self._gpm_setup(dev, metrics)
        else:
            for name in GPM_METRIC_NAMES.values():
                dev.absent[name] = gpm_why

    def _counter_fits(self, dev: _Device, bits: int) -> bool:
        """A byte counter gives a rate only if it cannot wrap twice between two readings: at
        the link's maximum over twice the interval (a late cycle), it must stay below one wrap.
        A 32-bit counter wraps every 4.29 GB, 15 times a second on a Gen5 x16 link."""
        if bits >= 63:  # a signed 64-bit value: wraps after 292 years at 1 TB/s
            return True
        if dev.link_max is not None and dev.link_max * 2 * self.interval_s < 2**bits:
            dev.pcie_max_dt = 2**bits / dev.link_max
            return True
        link = f"the link's {dev.link_max / 1e9:.1f} GB/s" if dev.link_max else \
            "an unknown link maximum"
        dev.pcie_note = (f"the PCIe byte counters are {bits}-bit: at {link} they "
                         f"could wrap more than once per {self.interval_s:g} s interval, so "
                         "they are not used")
        log.warning("pcie_counters_too_narrow", gpu_uuid=dev.identity.uuid, bits=bits,
                    interval_s=self.interval_s, link_max_bytes_per_second=dev.link_max,
                    effect="PCIe rates come from GPM or nvmlDeviceGetPcieThroughput instead")
        return False

    def _gpm_setup(self, dev: _Device, metrics: dict[int, tuple[str, float]]) -> None:
        dev.gpm_samples = [pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()]
        dev.gpm_ids = metrics
        dev.gpm_slots = [(*_slot(name), scale) for name, scale in metrics.values()]

    def _prepare(self, dev: _Device) -> None:
        dev.calls = PreparedCalls(dev.handle, memory=dev.memory, utilization=dev.utilization,
                                  replay_call=dev.replay == "call",
                                  fields=dev.fields, gpm_metrics=list(dev.gpm_ids),
                                  gpm_samples=dev.gpm_samples, gpm_mig=dev.is_mig)
        dev.gpm_next = 1

    def _report(self, dev: _Device) -> None:
        if dev.absent:
            log.info("gpu_metrics_absent", gpu_uuid=dev.identity.uuid, gpu_name=dev.identity.name,
                     absent=dict(sorted(dev.absent.items())))

    # -- reading -------------------------------------------------------------------------------

    def read(self, uuids: Iterable[str]) -> dict[str, NvmlReading | None]:
        """One reading per requested GPU; None for a GPU that is lost or unknown.

        A reading closer than GPM's minimum to the previous one (the last sample taken at
        shutdown, just after a cycle) first waits out the rest of that minimum, at most 0.1 s,
        rather than dropping the GPM figures."""
        uuids = list(uuids)
        devices = self._devices
        now = self.clock()
        last = max((d.gpm_prev_t for u in uuids if (d := devices.get(u)) is not None and d.gpm
                    and d.gpm_prev_t is not None), default=None)
        if last is not None and 0 <= now - last < GPM_MIN_INTERVAL_S:
            self.sleep(GPM_MIN_INTERVAL_S - (now - last))
            now = self.clock()
        result: dict[str, NvmlReading | None] = {}
        live: list[_Device] = []
        for uuid in uuids:
            dev = devices.get(uuid)
            if dev is None or (dev.lost_since is not None and not self._recover(dev, now)):
                result[uuid] = None
            else:
                live.append(dev)

        pending: dict[str, tuple[Future[int], Future[int]]] = {}
        slow = [d for d in live if d.pcie == "throughput" and not d.is_mig]
        if slow:
            pool = self._executor(len(slow))
            for dev in slow:
                pending[dev.identity.uuid] = (
                    pool.submit(pynvml.nvmlDeviceGetPcieThroughput, dev.handle,
                                pynvml.NVML_PCIE_UTIL_TX_BYTES),
                    pool.submit(pynvml.nvmlDeviceGetPcieThroughput, dev.handle,
                                pynvml.NVML_PCIE_UTIL_RX_BYTES),
                )
        for dev in live:
            try:
                result[dev.identity.uuid] = self._read_serial(dev, now)
            except GpuLost as exc:
                self._mark_lost(dev, now, str(exc.__cause__ or exc))
                result[dev.identity.uuid] = None
        for uuid, (ftx, frx) in pending.items():
            dev = self._devices[uuid]
            try:
                tx, rx = ftx.result(), frx.result()
            except pynvml.NVMLError as exc:
                if error_code(exc) in _LOST_CODES:
                    if result[uuid] is not None:
                        self._mark_lost(dev, now, error_name(exc))
                        result[uuid] = None
                else:
                    self._failed(dev, "pcie_throughput", exc)
                continue
            self._recovered(dev, "pcie_throughput")
            reading = result[uuid]
            if reading is not None:
                io = reading.io._replace(pcie_tx_bytes_per_second=float(tx * KIB),
                                         pcie_rx_bytes_per_second=float(rx * KIB))
                result[uuid] = reading._replace(io=io)
        return result

    def _executor(self, n: int) -> ThreadPoolExecutor:
        """A pool wide enough for every throughput call of a cycle to run at once."""
        if self._pool is None or self._pool_size < 2 * n:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool_size = 2 * n
            self._pool = ThreadPoolExecutor(max_workers=2 * n, thread_name_prefix="pcie")
        return self._pool

    def _call(self, dev: _Device, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            value = fn(*args)
        except pynvml.NVMLError as exc:
            if error_code(exc) in _LOST_CODES:
                raise GpuLost from exc
            self._failed(dev, what, exc)
            return None
        if dev.failing:
            self._recovered(dev, what)
        return value

    def _failed(self, dev: _Device, what: str, exc: pynvml.NVMLError) -> None:
        self.errors["nvml_error"] += 1
        if what not in dev.failing:
            dev.failing.add(what)
            log.warning("nvml_read_failed", gpu_uuid=dev.identity.uuid, read=what,
                        error=error_name(exc), detail=str(exc),
                        effect="figure absent until the read succeeds; logged once")

    def _recovered(self, dev: _Device, what: str) -> None:
        if what in dev.failing:
            dev.failing.discard(what)
            log.info("nvml_read_recovered", gpu_uuid=dev.identity.uuid, read=what)

    def _mark_lost(self, dev: _Device, now: float, why: str = "GPU is lost") -> None:
        if dev.lost_since is None:
            dev.lost_since = now
            self.errors["gpu_lost"] += 1
            log.error("gpu_lost", gpu_uuid=dev.identity.uuid, gpu_name=dev.identity.name,
                      error=why, retry_in_s=self.lost_retry_s,
                      effect="its series stop; the other GPUs keep reporting")
            dev.failing.clear()
        dev.retry_at = now + self.lost_retry_s
        dev.prev_pcie = dev.prev_nvlink = None
        dev.gpm_prev_t = None

    def _recover(self, dev: _Device, now: float) -> bool:
        if now < dev.retry_at:
            return False
        try:
            if dev.is_mig:
                # through its parent: the instance's slot must still hold the same UUID
                parent = pynvml.nvmlDeviceGetHandleByUUID(dev.identity.parent_uuid)
                handle = self._find_mig(parent, dev)
                dev.gpu_instance_id = pynvml.nvmlDeviceGetGpuInstanceId(handle)
                dev.parent_handle = parent
            else:
                handle = pynvml.nvmlDeviceGetHandleByUUID(dev.identity.uuid)
                pynvml.nvmlDeviceGetUUID(handle)
        except pynvml.NVMLError:
            dev.retry_at = now + self.lost_retry_s
            return False
        dev.handle = handle
        dev.failing.clear()
        self._prepare(dev)
        log.info("gpu_recovered", gpu_uuid=dev.identity.uuid,
                 lost_for_s=round(now - (dev.lost_since or now), 3))
        dev.lost_since = None
        return True

    @staticmethod
    def _find_mig(parent: Any, dev: _Device) -> Any:
        """The instance's handle under its parent, by UUID: its old slot first, then every slot
        (NVML keeps UUIDs, not slots, stable across a reset)."""
        slots = _try(lambda: pynvml.nvmlDeviceGetMaxMigDeviceCount(parent), 0)
        for slot in dict.fromkeys([dev.mig_slot, *range(slots)]):
            try:
                handle = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, slot)
                if pynvml.nvmlDeviceGetUUID(handle) == dev.identity.uuid:
                    dev.mig_slot = slot
                    return handle
            except pynvml.NVMLError:
                continue
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)  # re-partitioned: gone for now

    def _error(self, dev: _Device, what: str, exc: pynvml.NVMLError) -> None:
        """A hot-path call failed: a lost GPU ends this GPU's reading, anything else drops only
        that figure for this cycle."""
        if error_code(exc) in _LOST_CODES:
            raise GpuLost from exc
        self._failed(dev, what, exc)

    def _read_serial(self, dev: _Device, now: float) -> NvmlReading:
        """One GPU's reading, less any PCIe throughput calls running on the pool.

        Written flat, on status codes rather than exceptions, with the layers filled as
        positional lists, because this runs for every GPU on every cycle and its cost is the
        agent's cost; failures are handled once at the end."""
        compute: list[Any] = [None, None, None, None]
        memory: list[Any] = [None, None, None, None, None]
        io: list[Any] = [None, None, dev.link_max, dev.link_generation, dev.link_width, None,
                         None, None]
        calls = dev.calls
        assert calls is not None
        handle = calls.handle
        failed: list[tuple[str, int]] = []
        fn = calls.mem_fn
        if fn is not None:
            ret = fn(handle, calls.mem_ref)
            if ret:
                failed.append(("memory", ret))
            else:
                mem = calls.mem
                memory[2] = mem.used  # type: ignore[union-attr]
                memory[3] = mem.total  # type: ignore[union-attr]
                if calls.mem_v2:
                    memory[4] = mem.reserved  # type: ignore[union-attr]
        fn = calls.util_fn
        if fn is not None:
            ret = fn(handle, calls.util_ref)
            if ret:
                failed.append(("utilization", ret))
            else:
                util = calls.util
                compute[3] = util.gpu / 100.0
                memory[1] = util.memory / 100.0
        fn = calls.fields_fn
        if fn is not None:
            ret = fn(handle, calls.nfields, calls.fields_ref)
            if ret:
                failed.append(("field_values", ret))
            else:
                self._counters(dev, calls.field_values(), now, io)
        fn = calls.replay_fn
        if fn is not None:
            ret = fn(handle, calls.replay_ref)
            if ret:
                failed.append(("replay", ret))
            else:
                io[5] = calls.replay.value
        if dev.gpm:
            # GPM: the average of each metric between the previous cycle's sample and this one
            prev_t = dev.gpm_prev_t
            if prev_t is not None and now - prev_t < GPM_MIN_INTERVAL_S:
                self._gpm_too_soon(dev, now - prev_t)
            else:
                into = dev.gpm_next  # the two samples alternate
                sample = dev.gpm_samples[into]
                if dev.parent_handle is not None:  # MIG
                    ret = calls.gpm_sample_fn(dev.parent_handle, dev.gpu_instance_id, sample)
                else:
                    ret = calls.gpm_sample_fn(handle, sample)
                if ret:
                    failed.append(("gpm_sample", ret))
                    dev.gpm_prev_t = None
                else:
                    if prev_t is not None:
                        # request 0 averages sample 0 -> 1, request 1 sample 1 -> 0
                        request = 1 - into
                        ret = calls.gpm_metrics_fn(calls.gpm_refs[request])
                        if ret:
                            failed.append(("gpm_metrics", ret))
                        else:
                            layers = (compute, memory, io)
                            pairs = iter(calls.gpm_values(request))  # nvmlReturn, value, ...
                            for (layer, position, scale), ret, value in zip(
                                    dev.gpm_slots, pairs, pairs, strict=True):
                                if not ret:
                                    layers[layer][position] = value * scale
                    dev.gpm_next = 1 - into
                    dev.gpm_prev_t = now
        if failed:
            for what, code in failed:
                self._error(dev, what, pynvml.NVMLError(code))
        if dev.failing:
            for what in list(dev.failing):
                if what in _HOT_READS and all(what != f for f, _ in failed):
                    self._recovered(dev, what)
            if len(dev.failing) >= 2 and all(v is None for v in (*compute, *memory)) and \
                    io[0] is None and io[5] is None:
                # nothing at all could be read (the driver went away, NVML was unloaded): report
                # the GPU unavailable and re-open it later, not its static link figures
                raise GpuLost("no reading succeeded: " + ", ".join(sorted(dev.failing)))
        return _new(NvmlReading, (_new(ComputeLayer, compute), _new(MemoryLayer, memory),
                                  _new(IoLayer, io)))

    def _counters(self, dev: _Device, flat: tuple[int, ...], now: float, io: list[Any]) -> None:
        """Rates from the cumulative counters; ``flat`` holds (valueType, nvmlReturn, raw) per
        field, in the order ``dev.fields`` asked for them."""
        i = 0
        if dev.pcie == "counters":
            # decoded and differenced in line (``_decode`` and ``pcie.counter_rate`` spelt out):
            # these two are read for every GPU on every cycle
            i = 6
            tx_bits, rx_bits = _VALUE_BITS.get(flat[0]), _VALUE_BITS.get(flat[3])
            if not flat[1] and not flat[4] and tx_bits and rx_bits:
                tx_mod, rx_mod = 1 << tx_bits, 1 << rx_bits
                tx, rx = flat[2] % tx_mod, flat[5] % rx_mod
                prev = dev.prev_pcie
                if prev is not None:
                    dt = now - prev[0]
                    if 0 < dt < dev.pcie_max_dt:  # else it may have wrapped twice: no rate
                        # above four times the link: a counter reset, not traffic
                        ceiling = 4 * dev.link_max if dev.link_max else math.inf
                        tx_rate = (tx - prev[1]) % tx_mod / dt  # across at most one wrap
                        rx_rate = (rx - prev[3]) % rx_mod / dt
                        io[0] = tx_rate if tx_rate <= ceiling else None
                        io[1] = rx_rate if rx_rate <= ceiling else None
                dev.prev_pcie = (now, tx, tx_bits, rx, rx_bits)
        if dev.replay == "field":
            if not flat[i + 1] and flat[i] in _VALUE_BITS:
                io[5] = flat[i + 2] % (1 << _VALUE_BITS[flat[i]])
            i += 3
        if dev.nvlink == "counters":
            totals = [0, 0]
            for direction in (0, 1):
                for _ in range(dev.nvlink_links):
                    value = _decode(flat, i)
                    i += 3
                    if value is None:
                        return  # a link that did not answer: no NVLink figure this cycle
                    totals[direction] += value[0]
            nvl_tx, nvl_rx = totals
            prev_n = dev.prev_nvlink
            if prev_n is not None:
                dt = now - prev_n[0]
                # above four times NVLink 5's 50 GB/s per link and direction: a reset
                ceiling = dev.nvlink_links * NVLINK_LINK_CEILING_BYTES_PER_SECOND / KIB
                tx_rate = counter_rate(prev_n[1], nvl_tx, dt, 64, ceiling)
                rx_rate = counter_rate(prev_n[2], nvl_rx, dt, 64, ceiling)
                io[6] = None if tx_rate is None else tx_rate * KIB
                io[7] = None if rx_rate is None else rx_rate * KIB
            dev.prev_nvlink = (now, nvl_tx, nvl_rx)

    def _gpm_too_soon(self, dev: _Device, interval: float) -> None:
        if "gpm_interval" not in dev.failing:
            dev.failing.add("gpm_interval")
            log.warning("gpm_interval_too_short", gpu_uuid=dev.identity.uuid,
                        interval_s=round(interval, 4), minimum_s=GPM_MIN_INTERVAL_S,
                        effect="GPM figures skipped for this cycle; raise --interval")


_HOT_READS = frozenset({"memory", "utilization", "field_values", "replay", "gpm_sample",
                        "gpm_metrics"})


def _decode(flat: tuple[int, ...], i: int) -> tuple[int, int] | None:
    """(value, counter width in bits) of the field value at ``flat[i:i + 3]``, None when it
    failed or is not an integer."""
    if flat[i + 1]:
        return None
    bits = _VALUE_BITS.get(flat[i])
    if bits is None:
        return None
    raw = flat[i + 2]  # the 8-byte union read as unsigned: narrower types are its low bytes
    return raw & ((1 << bits) - 1), bits


def _slot(name: str) -> tuple[int, int]:
    """(layer, position) of a layer field in the positional lists of ``_read_serial``."""
    for layer, cls in enumerate((ComputeLayer, MemoryLayer, IoLayer)):
        if name in cls._fields:
            return layer, cls._fields.index(name)
    raise KeyError(name)


def _try(fn: Callable[[], Any], default: Any) -> Any:
    try:
        return fn()
    except pynvml.NVMLError:
        return default


def _bus_id(handle: Any) -> str:
    raw = _try(lambda: pynvml.nvmlDeviceGetPciInfo(handle).busId, b"")
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)


def _init_advice(exc: pynvml.NVMLError) -> str:
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
