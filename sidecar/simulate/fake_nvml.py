"""A stand-in for the loaded NVML library, installed at ``pynvml.nvmlLib``.

pynvml looks every C function up on ``nvmlLib`` and calls it with ctypes arguments; this object
answers those calls the way ``libnvidia-ml.so`` does (return codes, out-parameters written through
``byref``), so every line of pynvml above it runs unchanged. It is both the test double and the
``--simulate`` backend.

Signals are smooth functions of time with closed-form integrals, so cumulative counters (PCIe
bytes, NVLink KiB) and GPM interval averages are exact, and tests can compute by hand what the
agent must report. Clock-event reasons are duty cycles (on for a share of each period): the
reason bitmask at an instant and the cumulative nanosecond counters are the same function, so
they always agree, and the counters are exact integers.

Which field ids and functions exist follows the simulated driver's version (``driver_version``):
the clock-event nanosecond counters arrived in R575 (at 251-253) and moved to 269-271 in R590,
the PCIe error counters and the instant power field in R535, the C2C fields in R525, the C2C GPM
metrics in R575 (NVML change log and the nvml.h of each CUDA release).

A driver that retired the calls nvml.h 13 marks ``DEPRECATED(13.0)`` is one mode of the stand-in
(``FakeNvml(deprecated=True)``, or ``FAKE_NVML_DRIVER=deprecated`` in the environment of a
``--simulate`` run): each such call it has answers ``NVML_ERROR_DEPRECATED`` (26) and its
successor answers as usual.

Xid events are scheduled on the simulated clock; ``nvmlEventSetWait_v2`` blocks on a condition
for at most its timeout in real time and wakes early when an event falls due (or when a clock
with a ``watch`` method, as the tests' ``ManualClock``, is moved), as the real call sleeps until
an event arrives.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import pynvml

SUCCESS = pynvml.NVML_SUCCESS
NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
INVALID_ARGUMENT = pynvml.NVML_ERROR_INVALID_ARGUMENT
NOT_FOUND = pynvml.NVML_ERROR_NOT_FOUND
GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
TIMEOUT = pynvml.NVML_ERROR_TIMEOUT
UINT = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
ULL = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
NO_INSTANCE = 0xFFFFFFFF  # nvmlEventData_t's GPU/compute instance id when not attributable
NS_PER_S = 1_000_000_000

# event sets are pointers in the real library: never reused by a later stand-in, so a set that
# outlived its stand-in is refused by the next one rather than taking its events
_EVENT_SET_ADDRESSES = itertools.count(0x5E70000, 16)

THROUGHPUT_WINDOW_S = 0.020  # nvmlDeviceGetPcieThroughput samples a 20 ms window and blocks for it
KIB = 1024

# Functions an old driver (before R520 or so) lacks; pynvml turns a missing symbol into
# NVMLError_FunctionNotFound, exactly as with the real library. The clock-event-reason names
# came with R535 (the older nvmlDeviceGet*ClocksThrottleReasons remain), the C2C mode call with
# R545.
OLD_DRIVER_MISSING = frozenset(
    {
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlGpmQueryDeviceSupport",
        "nvmlGpmSampleAlloc",
        "nvmlGpmSampleFree",
        "nvmlGpmSampleGet",
        "nvmlGpmMigSampleGet",
        "nvmlGpmMetricsGet",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetSupportedClocksEventReasons",
        "nvmlDeviceGetC2cModeInfoV",
        "nvmlDeviceGetTemperatureV",  # first in the 12.8 header (R570)
    }
)

# Every call nvml.h 13.3 marks DEPRECATED(13.0): in the deprecated driver mode, those the stand-in
# has answer NVML_ERROR_DEPRECATED
DEPRECATED_13 = frozenset({
    "nvmlDeviceGetHandleBySerial", "nvmlDeviceGetApplicationsClock",
    "nvmlDeviceGetDefaultApplicationsClock", "nvmlDeviceGetTemperature",
    "nvmlDeviceGetCurrentClocksThrottleReasons", "nvmlDeviceGetSupportedClocksThrottleReasons",
    "nvmlDeviceGetPowerState", "nvmlDeviceGetPowerManagementMode", "nvmlDeviceGetDetailedEccErrors",
    "nvmlDeviceGetViolationStatus", "nvmlDeviceGetGpuFabricInfo", "nvmlDeviceSetApplicationsClocks",
    "nvmlDeviceResetApplicationsClocks", "nvmlDeviceSetGpcClkVfOffset", "nvmlDeviceSetMemClkVfOffset",
    "nvmlDeviceSetNvLinkUtilizationControl", "nvmlDeviceGetNvLinkUtilizationControl",
    "nvmlDeviceGetNvLinkUtilizationCounter", "nvmlDeviceFreezeNvLinkUtilizationCounter",
    "nvmlDeviceResetNvLinkUtilizationCounter", "nvmlVgpuInstanceGetLicenseStatus",
    "nvmlGpuInstanceSetVgpuSchedulerState", "nvmlGpuInstanceGetVgpuSchedulerState",
    "nvmlGpuInstanceGetVgpuSchedulerLog", "nvmlDeviceGetVgpuSchedulerLog",
    "nvmlDeviceGetVgpuSchedulerState", "nvmlDeviceSetVgpuSchedulerState",
})
DEPRECATED = getattr(pynvml, "NVML_ERROR_DEPRECATED", 26)
DRIVER_MODE_ENV = "FAKE_NVML_DRIVER"  # "deprecated": the mode above, for a --simulate run
# NVML_STRUCT_VERSION(Temperature, 1): the struct's size, version 1 in the top byte (nvml.h)
TEMPERATURE_V1 = ctypes.sizeof(pynvml.c_nvmlTemperature_v1_t) | 1 << 24

DEFAULT_DRIVER_VERSION = "590.44.01"  # R590: the clock-event counters at 269-271, as pynvml 13

# nvmlClocksEventReason* bits of the five reasons with a cumulative nanosecond counter
REASON_SW_POWER_CAP = pynvml.nvmlClocksEventReasonSwPowerCap
REASON_SYNC_BOOST = pynvml.nvmlClocksEventReasonSyncBoost
REASON_SW_THERMAL = pynvml.nvmlClocksEventReasonSwThermalSlowdown
REASON_HW_THERMAL = pynvml.nvmlClocksEventReasonHwThermalSlowdown
REASON_HW_POWER_BRAKE = pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
# what a data-centre Hopper reports as supported: every reason but the display clock setting
DATACENTER_CLOCK_EVENTS = pynvml.nvmlClocksEventReasonAll & ~pynvml.nvmlClocksEventReasonDisplayClockSetting
DEFAULT_EVENT_TYPES = (pynvml.nvmlEventTypeSingleBitEccError | pynvml.nvmlEventTypeDoubleBitEccError
                       | pynvml.nvmlEventTypePState | pynvml.nvmlEventTypeXidCriticalError
                       | pynvml.nvmlEventTypeClock)

ECC_FIELDS = {  # field id -> (corrected, volatile)
    pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL: (True, True),
    pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL: (False, True),
    pynvml.NVML_FI_DEV_ECC_SBE_AGG_TOTAL: (True, False),
    pynvml.NVML_FI_DEV_ECC_DBE_AGG_TOTAL: (False, False),
}
REMAP_FIELDS = (pynvml.NVML_FI_DEV_REMAPPED_COR, pynvml.NVML_FI_DEV_REMAPPED_UNC,
                pynvml.NVML_FI_DEV_REMAPPED_PENDING, pynvml.NVML_FI_DEV_REMAPPED_FAILURE)
PCIE_ERROR_FIELDS = range(pynvml.NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS,
                          pynvml.NVML_FI_DEV_PCIE_COUNT_LANE_ERROR + 1)  # 173..183
C2C_FIELDS = (pynvml.NVML_FI_DEV_C2C_LINK_COUNT, pynvml.NVML_FI_DEV_C2C_LINK_GET_STATUS,
              pynvml.NVML_FI_DEV_C2C_LINK_GET_MAX_BW)


def driver_major(version: str) -> int:
    """The branch of a driver version string ("590.44.01" -> 590)."""
    try:
        return int(version.split(".", 1)[0])
    except ValueError:
        return 0


def clock_event_counter_fields(major: int) -> dict[int, int]:
    """Field id -> reason bit of the cumulative nanosecond counters a driver branch answers.

    R575 added them with SW/HW thermal and power brake at 251-253; those ids overlapped the
    power-smoothing fields of R570, so later drivers moved them to 269-271 (nvml.h of CUDA
    12.9/13.0 against 13.1; the change log files the move under v580, the 13.0 header and
    nvidia-smi 580.65 still use 251-253, so the simulated move is at R590). SW power cap and
    sync boost keep the perf-policy ids 74 and 76."""
    if major < 575:
        return {}
    low = major < 590
    return {
        pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP: REASON_SW_POWER_CAP,  # 74
        pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST: REASON_SYNC_BOOST,  # 76
        (251 if low else 269): REASON_SW_THERMAL,
        (252 if low else 270): REASON_HW_THERMAL,
        (253 if low else 271): REASON_HW_POWER_BRAKE,
    }


@dataclass(frozen=True)
class Signal:
    """``base * (1 + amplitude * sin(2 pi t / period))``, with its exact integral."""

    base: float
    amplitude: float = 0.0
    period: float = 60.0

    def value(self, t: float) -> float:
        return self.base * (1 + self.amplitude * math.sin(2 * math.pi * t / self.period))

    def integral(self, t: float) -> float:
        w = 2 * math.pi / self.period
        return self.base * (t + self.amplitude * (1 - math.cos(w * t)) / w)

    def mean(self, t1: float, t2: float) -> float:
        return (self.integral(t2) - self.integral(t1)) / (t2 - t1)


ZERO = Signal(0.0)


@dataclass(frozen=True)
class DutyCycle:
    """A clock-event reason held for ``share`` of every ``period`` seconds, from ``phase`` on:
    active when ``(t - phase) mod period < share * period``. Times are kept in integer
    nanoseconds, so the cumulative counter is an exact integer a test can work out by hand."""

    share: float
    period: float = 10.0
    phase: float = 0.0

    def _ns(self, t: float) -> tuple[int, int, int]:
        period = round(self.period * NS_PER_S)
        return round((t - self.phase) * NS_PER_S), period, round(self.share * period)

    def active(self, t: float) -> bool:
        elapsed, period, on = self._ns(t)
        return elapsed >= 0 and elapsed % period < on

    def active_ns(self, t: float) -> int:
        """Nanoseconds active in [phase, t]."""
        elapsed, period, on = self._ns(t)
        if elapsed <= 0:
            return 0
        whole, rest = divmod(elapsed, period)
        return whole * on + min(rest, on)


PidView = str  # "host", "namespace" or "mixed": which PIDs the process calls give (below)
PID_VIEWS = ("host", "namespace", "mixed")
PROCESS_SAMPLE_PERIOD_S = 1.0  # the driver's per-process utilization sample period (stand-in's)
PROCESS_SAMPLE_BUFFER = 100  # samples per process the driver keeps; older ones are gone
PROCESS_EPOCH_US = 1_767_225_600_000_000  # CPU µs at simulated t = 0 (2026-01-01T00:00:00Z)


@dataclass(frozen=True)
class FakeProcess:
    """One CUDA process on a simulated GPU.

    ``pid`` is its host PID; ``ns_pid`` its PID in the namespace of the caller (the agent), None
    where that namespace does not hold it (another pod's process, or the app's without a shared
    process namespace). Percentages in 0..100: its share of SM time and of memory bandwidth,
    as ``nvmlDeviceGetProcessUtilization`` samples them; ``mps``: an MPS client, listed by
    ``nvmlDeviceGetMPSComputeRunningProcesses_v3`` instead of the compute list."""

    pid: int
    used_memory: int = 0  # bytes
    sm_util: float = 0.0
    mem_util: float = 0.0
    ns_pid: int | None = None
    mps: bool = False


@dataclass(frozen=True)
class FakeMig:
    gpu_instance_id: int
    uuid: str
    name: str
    memory_total: int
    memory_used: Signal = ZERO
    sm_occupancy: Signal = ZERO
    tensor: Signal = ZERO
    sm_active: Signal = ZERO
    dram_bw: Signal = ZERO


@dataclass(frozen=True)
class FakeGpu:
    """One simulated device; percentages in 0..100, rates in bytes/s, times in seconds."""

    uuid: str
    name: str
    pci_bus_id: str
    architecture: int = pynvml.NVML_DEVICE_ARCH_HOPPER
    memory_total: int = 141 * 1024**3
    memory_driver_reserved: int = 512 * 1024**2
    memory_used: Signal = ZERO
    utilization: Signal = ZERO
    memory_busy: Signal = ZERO
    sm_occupancy: Signal = ZERO
    tensor: Signal = ZERO
    sm_active: Signal = ZERO
    dram_bw: Signal = ZERO
    pcie_tx: Signal = ZERO
    pcie_rx: Signal = ZERO
    nvlink_links: int = 18
    # NVML field 90 (NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON), MBps per active link and direction:
    # NVLink 4 (H100, H200 SXM) links run at 26.562 GB/s each as `nvidia-smi nvlink -s` prints
    # them (NVIDIA's spec says 25 GB/s of data per link and direction, 900 GB/s over 18 links
    # both ways: the 26.562 is the line rate NVML reports, before protocol overhead)
    nvlink_speed_mbps: int = 26562
    nvlink_down: tuple[int, ...] = ()  # links nvmlDeviceGetNvLinkState answers inactive
    nvlink_tx: Signal = ZERO
    nvlink_rx: Signal = ZERO
    link_generation: int = 5
    link_width: int = 16
    current_link_generation: int = 5
    current_link_width: int = 16
    replays_per_second: float = 0.0
    has_gpm: bool = True
    has_pcie_counters: bool = True
    pcie_counter_bits: int = 64
    pcie_counter_offset: int = 0
    mig_capable: bool = True
    mig: tuple[FakeMig, ...] = ()
    lost_between: tuple[float, float | None] | None = None
    # health (defaults: a healthy H200 SXM under load). Clocks in MHz, power in W, °C.
    sm_clock: Signal = Signal(1980.0)  # also the graphics clock
    sm_clock_max: int = 1980
    memory_clock: Signal = Signal(3201.0)
    memory_clock_max: int = 3201
    video_clock: Signal = Signal(1545.0)
    video_clock_max: int = 1545
    power: Signal = Signal(450.0)  # its integral is the energy counter (field 83)
    power_limit: float = 700.0  # enforced
    power_usage_averaged: bool = True  # nvmlDeviceGetPowerUsage: 1 s mean (not on GA100)
    temperature: Signal = Signal(52.0)
    memory_temperature: Signal | None = Signal(58.0)  # None: no HBM sensor (field 82 refused)
    clock_events: tuple[tuple[int, DutyCycle], ...] = ()  # (nvmlClocksEventReason bit, when)
    supported_clock_events: int = DATACENTER_CLOCK_EVENTS
    has_clock_event_counters: bool = True  # fields 74/76/269-271, where the driver has them
    has_ecc: bool = True
    ecc_corrected_per_second: float = 0.0  # volatile counts since the driver loaded (t = 0)
    ecc_uncorrected_per_second: float = 0.0
    ecc_corrected_aggregate_base: int = 0  # aggregate = base + volatile
    ecc_uncorrected_aggregate_base: int = 0
    has_row_remapping: bool = True  # Ampere and later
    remapped_rows_correctable: int = 0
    remapped_rows_uncorrectable: int = 0
    row_remap_pending: bool = False
    row_remap_failed: bool = False
    pcie_correctable_errors_per_second: float = 0.0  # field 173
    pcie_l0_recovery_per_second: float = 0.0  # field 169
    pcie_error_counts: tuple[tuple[int, int], ...] = ()  # other fields 174-183 -> count
    # (t, Xid) or (t, Xid, GPU instance id, compute instance id) on the simulated clock
    xid_events: tuple[tuple[float, int] | tuple[float, int, int, int], ...] = ()
    supported_event_types: int = DEFAULT_EVENT_TYPES
    has_c2c: bool = False  # NVLink-C2C to a Grace CPU
    c2c_links: int = 10
    c2c_link_max_mb_per_second: int = 44712  # field 172, MB/s (1e6 B/s) per link
    c2c_tx: Signal = ZERO  # payload bytes/s, all links
    c2c_rx: Signal = ZERO
    c2c_protocol_overhead: float = 0.05  # GPM C2C TOTAL = DATA * (1 + this)
    # CUDA processes on the GPU, and which PIDs the driver gives for them (NVML-FACTS.md §7):
    # "host" (drivers up to ~470: host PIDs in both calls), "namespace" (both translated to the
    # caller's namespace, processes outside it left out), "mixed" (560.35 in HAMi-core#112: the
    # running-process lists translated, the utilization samples in host PIDs)
    processes: tuple[FakeProcess, ...] = ()
    pid_view: PidView = "namespace"


@dataclass
class _GpmSample:
    key: tuple[int, int | None] | None = None
    t: float = 0.0


@dataclass
class _EventSet:
    # device index -> (registered event types, simulated time of registration)
    registered: dict[int, tuple[int, float]] = field(default_factory=dict)
    # device index -> how many of its Xid events (in time order) are delivered or predate it
    delivered: dict[int, int] = field(default_factory=dict)


def _xid(event: tuple[float, int] | tuple[float, int, int, int]) -> tuple[float, int, int, int]:
    if len(event) == 2:
        return event[0], event[1], NO_INSTANCE, NO_INSTANCE
    return event  # type: ignore[return-value]


class _Fn:
    """A callable that, like a ctypes function pointer, accepts attributes such as ``restype``."""

    __slots__ = ("__name__", "_impl", "_tally", "argtypes", "restype")

    def __init__(self, name: str, impl: Callable[..., int], tally: Counter[str]) -> None:
        self.__name__ = name
        self._impl = impl
        self._tally = tally
        self.restype = None
        self.argtypes = None

    def __call__(self, *args: object) -> object:
        self._tally[self.__name__] += 1
        return self._impl(*args)


_T_co = TypeVar("_T_co", covariant=True)


class _Ref(Protocol[_T_co]):
    """What ``ctypes.byref(x)`` hands the library: ``x`` is its ``_obj``. The stand-in's
    parameters say which ctypes object pynvml passes by reference for each call."""

    @property
    def _obj(self) -> _T_co: ...


class _Array(Protocol[_T_co]):
    """A ctypes array of structures, as pynvml passes it."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int, /) -> _T_co: ...


class _Int(Protocol):
    """An integer out-parameter or argument: c_uint, c_int, c_ulonglong (an enum's too)."""

    value: int


class _PciInfo(Protocol):
    busId: bytes


class _Memory(Protocol):  # nvmlMemory_t
    total: int
    used: int
    free: int


class _MemoryV2(_Memory, Protocol):  # nvmlMemory_v2_t
    version: int
    reserved: int


class _Utilization(Protocol):  # nvmlUtilization_t
    gpu: int
    memory: int


class _ValueUnion(Protocol):  # nvmlValue_t, the members the stand-in writes
    uiVal: int
    ullVal: int


class _FieldValue(Protocol):  # nvmlFieldValue_t
    fieldId: int
    scopeId: int
    timestamp: int
    latencyUsec: int
    valueType: int
    nvmlReturn: int
    value: _ValueUnion


class _ProcessInfo(Protocol):  # nvmlProcessInfo_v2_t (= _v3)
    pid: int
    usedGpuMemory: int
    gpuInstanceId: int
    computeInstanceId: int


class _ProcessSample(Protocol):  # nvmlProcessUtilizationSample_t
    pid: int
    timeStamp: int
    smUtil: int
    memUtil: int
    encUtil: int
    decUtil: int


class _TemperatureV(Protocol):  # nvmlTemperature_v1_t
    version: int
    sensorType: int
    temperature: int


class _C2cModeInfo(Protocol):  # nvmlC2cModeInfo_v1_t
    isC2cEnabled: int


class _EventData(Protocol):  # nvmlEventData_t
    device: object
    eventType: int
    eventData: int
    gpuInstanceId: int
    computeInstanceId: int


class _GpmSupport(Protocol):  # nvmlGpmSupport_t
    version: int
    isSupportedDevice: int


class _GpmMetric(Protocol):  # nvmlGpmMetric_t
    metricId: int
    nvmlReturn: int
    value: float


class _GpmMetricsGet(Protocol):  # nvmlGpmMetricsGet_t
    version: int
    numMetrics: int
    sample1: object
    sample2: object
    metrics: _Array[_GpmMetric]


def _out(ref: _Ref[_T_co]) -> _T_co:
    """The ctypes object behind ``byref(x)``."""
    return ref._obj


def _int_of(arg: int | _Int) -> int:
    """An integer argument, passed as a ctypes integer by pynvml or as an int by a test."""
    return arg if isinstance(arg, int) else arg.value


def _set_pointer(ref: _Ref[ctypes._CData], value: int) -> None:
    ctypes.c_void_p.from_address(ctypes.addressof(_out(ref))).value = value


def _pointer_value(ptr: object) -> int:
    if type(ptr) is int:
        return ptr
    if ptr is None:
        return 0
    if isinstance(ptr, ctypes._Pointer):
        return ctypes.c_void_p.from_buffer(ptr).value or 0
    return ctypes.cast(ptr, ctypes.c_void_p).value or 0  # type: ignore[arg-type]


class _Library:
    def __init__(self, fns: dict[str, Callable[..., object]]) -> None:
        self.__dict__.update(fns)
        self.fake: FakeNvml | None = None


_HANDLE_BASE = 0x5EED0000


class FakeNvml:
    """The NVML library of a simulated node."""

    def __init__(
        self,
        gpus: Iterable[FakeGpu],
        *,
        clock: Callable[[], float] = time.monotonic,
        driver_version: str = DEFAULT_DRIVER_VERSION,
        missing: Iterable[str] = (),
        throughput_blocking: bool = True,
        record_calls: bool = False,
        account_cpu: bool = False,
        deprecated: bool | None = None,
    ) -> None:
        self.gpus = list(gpus)
        # the deprecated driver mode: None takes it from the environment (DRIVER_MODE_ENV)
        self.deprecated = (os.environ.get(DRIVER_MODE_ENV, "").strip().lower() == "deprecated"
                           if deprecated is None else deprecated)
        self.clock = clock
        self.t0 = clock()
        self.driver_version = driver_version
        self.driver_major = driver_major(driver_version)
        self.clock_counter_fields = clock_event_counter_fields(self.driver_major)
        self.throughput_blocking = throughput_blocking
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._inflight = 0
        self.spent: list[float] = []  # account_cpu: each call's CPU seconds inside the stand-in
        self._devices: dict[int, tuple[int, FakeGpu, FakeMig | None]] = {}
        self._gpm_tables: dict[tuple[int, int | None], dict[int, tuple[Signal, float]]] = {}
        self.max_concurrent_throughput = 0
        # calls refused because a MIG instance's handle was given where the real library wants
        # the parent GPU's: tests assert there are none
        self.mig_handle_refused: Counter[str] = Counter()
        self._gpm: dict[int, _GpmSample] = {}
        self._next_gpm = 0x6F000000
        # event sets; waiters sleep on the condition, woken by a due event or a moved clock
        self._events = threading.Condition()
        self._event_sets: dict[int, _EventSet] = {}
        watch = getattr(clock, "watch", None)
        if callable(watch):
            watch(self._clock_moved)
        self._fns: dict[str, Callable[..., object]] = {}
        missing = set(missing)
        for attr in dir(type(self)):
            if attr.startswith("nvml") and attr not in missing:
                # a C function pointer takes attributes (restype); a bound method does not
                wrap = record_calls or attr == "nvmlErrorString"
                impl = getattr(self, attr)
                if self.deprecated and attr in DEPRECATED_13:
                    impl = self._retired
                if account_cpu:
                    impl = self._accounted(impl)
                self._fns[attr] = _Fn(attr, impl, self.calls) if wrap else impl
        # what pynvml sees as the loaded library: the C symbols and nothing else, so a symbol an
        # old driver lacks is an AttributeError (pynvml's FunctionNotFound), as with dlsym
        self.library = _Library(self._fns)

    def _accounted(self, impl: Callable[..., int]) -> Callable[..., int]:
        """Count the CPU time spent inside the stand-in, which emulates C code in Python, so a
        benchmark can tell it apart from the CPU time of the code under test."""
        thread_time = time.thread_time
        spent = self.spent

        def timed(*args: object) -> int:
            start = thread_time()
            result = impl(*args)
            spent.append(thread_time() - start)  # list.append is atomic across threads
            return result

        return timed

    # -- helpers -----------------------------------------------------------------------------

    @staticmethod
    def _retired(*args: object) -> int:
        """A call this driver retired (the deprecated mode): the symbol is there, the figure
        is not."""
        return DEPRECATED

    def now(self) -> float:
        return self.clock() - self.t0

    def _clock_moved(self) -> None:
        with self._events:
            self._events.notify_all()

    def is_lost(self, index: int) -> bool:
        window = self.gpus[index].lost_between
        if window is None:
            return False
        start, end = window
        t = self.now()
        return t >= start and (end is None or t < end)

    def _handle(self, index: int, mig: int | None = None) -> int:
        return _HANDLE_BASE + (index << 4) + (0 if mig is None else mig + 1)

    def _resolve(self, handle: object) -> tuple[int, int | None] | None:
        value = _pointer_value(handle) - _HANDLE_BASE
        index, sub = value >> 4, value & 0xF
        if value < 0 or index >= len(self.gpus):
            return None
        if sub and sub > len(self.gpus[index].mig):
            return None
        return index, (sub - 1 if sub else None)

    def _device(self, handle: object) -> tuple[int, FakeGpu, FakeMig | None] | int:
        """The addressed device, or an NVML error code."""
        found = self._devices.get(_pointer_value(handle))
        if found is None:
            key = self._resolve(handle)
            if key is None:
                return INVALID_ARGUMENT
            index, mig = key
            gpu = self.gpus[index]
            found = self._devices[_pointer_value(handle)] = (
                index, gpu, gpu.mig[mig] if mig is not None else None)
        if found[1].lost_between is not None and self.is_lost(found[0]):
            return GPU_IS_LOST
        return found

    def _physical(self, handle: object) -> tuple[int, FakeGpu] | int:
        """The addressed physical GPU for a per-board figure (clocks, power, heat, ECC, events):
        a MIG instance's handle is answered NOT_SUPPORTED, as the real library answers it for
        the queries it keeps to the parent GPU (the parent's handle is the one to ask)."""
        dev = self._device(handle)
        if isinstance(dev, int):
            return dev
        if dev[2] is not None:
            return NOT_SUPPORTED
        return dev[0], dev[1]

    def _gpu(self, handle: object, call: str) -> tuple[int, FakeGpu, None] | int:
        """The addressed physical GPU; a MIG instance's handle is refused, as the real library
        refuses it for GPU-wide queries, and counted."""
        dev = self._device(handle)
        if isinstance(dev, int):
            return dev
        if dev[2] is not None:
            self.mig_handle_refused[call] += 1
            return INVALID_ARGUMENT
        return dev[0], dev[1], None

    # -- library -----------------------------------------------------------------------------

    def nvmlInitWithFlags(self, flags: object) -> int:
        return SUCCESS

    def nvmlShutdown(self) -> int:
        return SUCCESS

    def nvmlErrorString(self, code: object) -> bytes:
        return f"simulated NVML error {getattr(code, 'value', code)}".encode()

    def nvmlSystemGetDriverVersion(self, buf: ctypes.Array, size: object) -> int:
        buf.value = self.driver_version.encode()
        return SUCCESS

    def nvmlDeviceGetCount_v2(self, ref: _Ref[_Int]) -> int:
        _out(ref).value = len(self.gpus)
        return SUCCESS

    def nvmlDeviceGetHandleByIndex_v2(self, index: _Int, ref: _Ref[ctypes._CData]) -> int:
        i = index.value
        if i >= len(self.gpus):
            return INVALID_ARGUMENT
        if self.is_lost(i):
            return GPU_IS_LOST
        _set_pointer(ref, self._handle(i))
        return SUCCESS

    def nvmlDeviceGetHandleByUUID(self, uuid: object, ref: _Ref[ctypes._CData]) -> int:
        wanted = uuid.value.decode()  # type: ignore[attr-defined]
        for i, gpu in enumerate(self.gpus):
            if gpu.uuid == wanted:
                if self.is_lost(i):
                    return GPU_IS_LOST
                _set_pointer(ref, self._handle(i))
                return SUCCESS
        return NOT_FOUND

    # -- identity ----------------------------------------------------------------------------

    def nvmlDeviceGetName(self, handle: object, buf: ctypes.Array, size: object) -> int:
        dev = self._device(handle)
        if isinstance(dev, int):
            return dev
        _, gpu, mig = dev
        buf.value = (mig.name if mig else gpu.name).encode()
        return SUCCESS

    def nvmlDeviceGetUUID(self, handle: object, buf: ctypes.Array, size: object) -> int:
        dev = self._device(handle)
        if isinstance(dev, int):
            return dev
        _, gpu, mig = dev
        buf.value = (mig.uuid if mig else gpu.uuid).encode()
        return SUCCESS

    def nvmlDeviceGetIndex(self, handle: object, ref: _Ref[_Int]) -> int:
        dev = self._device(handle)
        if isinstance(dev, int):
            return dev
        _out(ref).value = dev[0]
        return SUCCESS

    def nvmlDeviceGetPciInfo_v3(self, handle: object, ref: _Ref[_PciInfo]) -> int:
        dev = self._device(handle)
        if isinstance(dev, int):
            return dev
        _out(ref).busId = dev[1].pci_bus_id.encode()
        return SUCCESS

    def nvmlDeviceGetArchitecture(self, handle: object, ref: _Ref[_Int]) -> int:
        dev = self._device(handle)
        if isinstance(dev, int):
            return dev
        _out(ref).value = dev[1].architecture
        return SUCCESS

    # -- MIG ---------------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, handle: object, current: _Ref[_Int], pending: _Ref[_Int]) -> int:
        dev = self._gpu(handle, "nvmlDeviceGetMigMode")
        if isinstance(dev, int):
            return dev
        gpu = dev[1]
        if not gpu.mig_capable:
            return NOT_SUPPORTED
        _out(current).value = _out(pending).value = 1 if gpu.mig else 0
        return SUCCESS

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: object, ref: _Ref[_Int]) -> int:
        dev = self._gpu(handle, "nvmlDeviceGetMaxMigDeviceCount")
        if isinstance(dev, int):
            return dev
        _out(ref).value = 7 if dev[1].mig_capable else 0
        return SUCCESS

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: object, index: _Int,
                                            ref: _Ref[ctypes._CData]) -> int:
        dev = self._gpu(handle, "nvmlDeviceGetMigDeviceHandleByIndex")
        if isinstance(dev, int):
            return dev
        i = index.value
        if i >= len(dev[1].mig):
            return NOT_FOUND
        _set_pointer(ref, self._handle(dev[0], i))
        return SUCCESS

    def nvmlDeviceGetGpuInstanceId(self, handle: object, ref: _Ref[_Int]) -> int:
        dev = self._device(handle)
        if isinstance(dev, int):
            return dev
        if dev[2] is None:
            return INVALID_ARGUMENT
        _out(ref).value = dev[2].gpu_instance_id
        return SUCCESS

    # -- memory and utilization ----------------------------------------------------------------

    def _memory(self, handle: object) -> tuple[int, int, int] | int:
        dev = self._device(handle)
        if isinstance(dev, int):
            return dev
        _, gpu, mig = dev
        t = self.now()
        if mig is not None:
            return mig.memory_total, 0, int(mig.memory_used.value(t))
        return gpu.memory_total, gpu.memory_driver_reserved, int(gpu.memory_used.value(t))

    def nvmlDeviceGetMemoryInfo(self, handle: object, ref: _Ref[_Memory]) -> int:
        mem = self._memory(handle)
        if isinstance(mem, int):
            return mem
        total, reserved, used = mem
        out = _out(ref)
        out.total, out.used, out.free = total, used + reserved, total - used - reserved
        return SUCCESS

    def nvmlDeviceGetMemoryInfo_v2(self, handle: object, ref: _Ref[_MemoryV2]) -> int:
        mem = self._memory(handle)
        if isinstance(mem, int):
            return mem
        total, reserved, used = mem
        out = _out(ref)
        if out.version != pynvml.nvmlMemory_v2:
            return pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        out.total, out.reserved, out.used = total, reserved, used
        out.free = total - used - reserved
        return SUCCESS

    def nvmlDeviceGetUtilizationRates(self, handle: object, ref: _Ref[_Utilization]) -> int:
        dev = self._device(handle)
        if isinstance(dev, int):
            return dev
        if dev[2] is not None:
            return NOT_SUPPORTED  # as on real MIG instances
        t = self.now()
        out = _out(ref)
        out.gpu = round(dev[1].utilization.value(t))
        out.memory = round(dev[1].memory_busy.value(t))
        return SUCCESS

    # -- processes -----------------------------------------------------------------------------

    @staticmethod
    def _pid(gpu: FakeGpu, proc: FakeProcess, call: str) -> int | None:
        """The PID ``call`` gives for ``proc`` under the GPU's ``pid_view``; None: left out (a
        process outside the caller's namespace, in a translated answer)."""
        translated = gpu.pid_view == "namespace" or (gpu.pid_view == "mixed" and call == "list")
        return proc.ns_pid if translated else proc.pid

    def _running(self, handle: object, count: _Ref[_Int], infos: _Array[_ProcessInfo] | None,
                 mps: bool) -> int:
        """nvmlDevice{,MPS}ComputeRunningProcesses_v3: *count in is the array's room; too little
        room (0 with a NULL array: the size query) answers INSUFFICIENT_SIZE with the number
        needed, none running answers SUCCESS and 0. A MIG instance's handle lists what runs in
        it (no process is declared on an instance); ids are 0xFFFFFFFF outside MIG."""
        dev = self._device(handle)
        if isinstance(dev, int):
            return dev
        _, gpu, mig = dev
        found: list[tuple[int, FakeProcess]] = []
        if mig is None:
            for proc in gpu.processes:
                pid = self._pid(gpu, proc, "list")
                if proc.mps == mps and pid is not None:
                    found.append((pid, proc))
        room, out = _out(count), infos
        if not found:
            room.value = 0
            return SUCCESS
        if room.value < len(found) or out is None:
            if out is None and room.value:
                return INVALID_ARGUMENT
            room.value = len(found)
            return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        for i, (pid, proc) in enumerate(found):
            info = out[i]
            info.pid, info.usedGpuMemory = pid, proc.used_memory
            info.gpuInstanceId = info.computeInstanceId = NO_INSTANCE
        room.value = len(found)
        return SUCCESS

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: object, count: _Ref[_Int],
                                                infos: _Array[_ProcessInfo] | None) -> int:
        return self._running(handle, count, infos, mps=False)

    def nvmlDeviceGetMPSComputeRunningProcesses_v3(self, handle: object, count: _Ref[_Int],
                                                   infos: _Array[_ProcessInfo] | None) -> int:
        return self._running(handle, count, infos, mps=True)

    def process_samples(self, gpu: FakeGpu, last_seen_us: int) -> list[tuple[int, int, FakeProcess]]:
        """(pid, timeStamp µs, process) of each sample newer than ``last_seen_us``: one per
        sample period and process with non-zero utilization, the last PROCESS_SAMPLE_BUFFER
        periods kept, as the driver's ring buffer."""
        t = self.now()
        last = math.floor(t / PROCESS_SAMPLE_PERIOD_S + 1e-9)
        ticks = range(max(1, last - PROCESS_SAMPLE_BUFFER + 1), last + 1)
        out = []
        for k in ticks:
            stamp = PROCESS_EPOCH_US + round(k * PROCESS_SAMPLE_PERIOD_S * 1e6)
            if stamp <= last_seen_us:
                continue
            for proc in gpu.processes:
                pid = self._pid(gpu, proc, "utilization")
                if pid is not None and (round(proc.sm_util) or round(proc.mem_util)):
                    out.append((pid, stamp, proc))
        return out

    def nvmlDeviceGetProcessUtilization(self, handle: object,
                                        samples: _Array[_ProcessSample] | None,
                                        count: _Ref[_Int], last_seen: _Int | int) -> int:
        """Samples since ``last_seen`` (CPU µs; 0: the whole buffer): NOT_FOUND when none is
        newer, INSUFFICIENT_SIZE with the number needed for a NULL array or too little room;
        refused (NOT_SUPPORTED) on a MIG-enabled GPU and a MIG instance, as nvml.h says."""
        dev = self._device(handle)
        if isinstance(dev, int):
            return dev
        _, gpu, mig = dev
        if mig is not None or gpu.mig:
            return NOT_SUPPORTED
        found = self.process_samples(gpu, _int_of(last_seen))
        if not found:
            return NOT_FOUND
        room = _out(count)
        if samples is None or room.value < len(found):
            room.value = len(found)
            return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        for i, (pid, stamp, proc) in enumerate(found):
            sample = samples[i]
            sample.pid, sample.timeStamp = pid, stamp
            sample.smUtil, sample.memUtil = round(proc.sm_util), round(proc.mem_util)
            sample.encUtil = sample.decUtil = 0
        room.value = len(found)
        return SUCCESS

    # -- PCIe ----------------------------------------------------------------------------------

    def _link(self, handle: object, attr: str, ref: _Ref[_Int]) -> int:
        dev = self._gpu(handle, attr)
        if isinstance(dev, int):
            return dev
        _out(ref).value = getattr(dev[1], attr)
        return SUCCESS

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: object, ref: _Ref[_Int]) -> int:
        return self._link(handle, "link_generation", ref)

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: object, ref: _Ref[_Int]) -> int:
        return self._link(handle, "link_width", ref)

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: object, ref: _Ref[_Int]) -> int:
        return self._link(handle, "current_link_generation", ref)

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: object, ref: _Ref[_Int]) -> int:
        return self._link(handle, "current_link_width", ref)

    def nvmlDeviceGetPcieReplayCounter(self, handle: object, ref: _Ref[_Int]) -> int:
        dev = self._gpu(handle, "nvmlDeviceGetPcieReplayCounter")
        if isinstance(dev, int):
            return dev
        _out(ref).value = int(dev[1].replays_per_second * self.now())
        return SUCCESS

    def nvmlDeviceGetPcieThroughput(self, handle: object, counter: _Int, ref: _Ref[_Int]) -> int:
        dev = self._device(handle)
        if isinstance(dev, int):
            return dev
        if dev[2] is not None:
            return NOT_SUPPORTED
        with self._lock:
            self._inflight += 1
            self.max_concurrent_throughput = max(self.max_concurrent_throughput, self._inflight)
        try:
            if self.throughput_blocking:
                time.sleep(THROUGHPUT_WINDOW_S)
        finally:
            with self._lock:
                self._inflight -= 1
        t = self.now()
        which = counter.value
        signal = dev[1].pcie_tx if which == pynvml.NVML_PCIE_UTIL_TX_BYTES else dev[1].pcie_rx
        start = max(0.0, t - THROUGHPUT_WINDOW_S)
        rate = signal.mean(start, t) if t > start else signal.value(t)
        _out(ref).value = int(rate / KIB)
        return SUCCESS

    def pcie_counter(self, gpu: FakeGpu, signal: Signal, t: float) -> int:
        return (gpu.pcie_counter_offset + int(signal.integral(t))) % (1 << gpu.pcie_counter_bits)

    def nvmlDeviceGetFieldValues(self, handle: object, count: _Int,
                                 ref: _Ref[_Array[_FieldValue]]) -> int:
        dev = self._device(handle)
        if isinstance(dev, int):
            return dev
        _, gpu, mig = dev
        t = self.now()
        values = _out(ref)
        for i in range(count.value):
            fv = values[i]
            fv.timestamp = int(time.time() * 1e6)
            fv.latencyUsec = 0
            fv.nvmlReturn = SUCCESS
            fid, scope = fv.fieldId, fv.scopeId
            if mig is not None:
                fv.nvmlReturn = NOT_SUPPORTED
            elif fid in (pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
                         pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES) and gpu.has_pcie_counters:
                tx = fid == pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES
                value = self.pcie_counter(gpu, gpu.pcie_tx if tx else gpu.pcie_rx, t)
                if gpu.pcie_counter_bits == 32:
                    fv.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                    fv.value.uiVal = value
                else:
                    fv.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                    fv.value.ullVal = value
            elif fid == pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER:
                fv.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                fv.value.uiVal = int(gpu.replays_per_second * t)
            elif fid == pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT and gpu.nvlink_links:
                fv.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                fv.value.uiVal = gpu.nvlink_links
            elif (fid == pynvml.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON and gpu.nvlink_links
                  and gpu.nvlink_speed_mbps):
                fv.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                fv.value.uiVal = gpu.nvlink_speed_mbps
            elif (fid in (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
                          pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX)
                  and scope < gpu.nvlink_links):
                tx = fid == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
                total = (gpu.nvlink_tx if tx else gpu.nvlink_rx).integral(t)
                fv.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                fv.value.ullVal = int(total / gpu.nvlink_links / KIB)
            else:
                answer = self._health_field(gpu, fid, scope, t)
                if answer is None:
                    fv.nvmlReturn = NOT_SUPPORTED
                elif answer[0] == UINT:
                    fv.valueType, fv.value.uiVal = answer
                else:
                    fv.valueType, fv.value.ullVal = answer
        return SUCCESS

    def _health_field(self, gpu: FakeGpu, fid: int, scope: int,
                      t: float) -> tuple[int, int] | None:
        """(value type, value) of a health field on a physical GPU, or None where the real
        library answers this field NOT_SUPPORTED (or does not know the id, on an older driver).
        Value types as the driver fills them: the nanosecond counters, ECC totals and energy
        (nvmlDeviceGetTotalEnergyConsumption's unsigned long long) 64-bit, the rest unsigned int
        (what NCCL, DCGM and nvidia-smi read them as)."""
        major = self.driver_major
        if fid in self.clock_counter_fields:
            if not gpu.has_clock_event_counters:
                return None
            return ULL, self.reason_ns(gpu, self.clock_counter_fields[fid], t)
        if fid == pynvml.NVML_FI_DEV_MEMORY_TEMP:
            sensor = gpu.memory_temperature
            return None if sensor is None else (UINT, round(sensor.value(t)))  # °C
        if fid == pynvml.NVML_FI_DEV_POWER_INSTANT:  # scope 0: the GPU alone
            return (UINT, round(gpu.power.value(t) * 1000)) if major >= 535 and scope == 0 \
                else None  # mW
        if fid == pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION:  # nvml.h: Volta and newer
            return (ULL, self.energy_mj(gpu, t)) \
                if gpu.architecture >= pynvml.NVML_DEVICE_ARCH_VOLTA else None
        if fid in ECC_FIELDS:
            corrected, volatile = ECC_FIELDS[fid]
            if not gpu.has_ecc or (volatile and gpu.mig):
                return None
            return ULL, self.ecc_count(gpu, corrected, volatile, t)
        if fid in REMAP_FIELDS:
            rows = self._remapped_rows(gpu)
            return None if rows is None else (UINT, rows[REMAP_FIELDS.index(fid)])
        if fid == pynvml.NVML_FI_DEV_PCIE_L0_TO_RECOVERY_COUNTER:
            return (UINT, int(gpu.pcie_l0_recovery_per_second * t)) if major >= 525 else None
        if fid in PCIE_ERROR_FIELDS:
            if major < 535 or (fid == pynvml.NVML_FI_DEV_PCIE_COUNT_LANE_ERROR
                               and scope >= gpu.link_width):  # scope: the lane
                return None
            count = dict(gpu.pcie_error_counts).get(fid, 0)
            if fid == pynvml.NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS:
                count += int(gpu.pcie_correctable_errors_per_second * t)
            return UINT, count
        if fid in C2C_FIELDS:
            if major < 525 or not gpu.has_c2c:
                return None  # per field, on GPUs without NVLink-C2C
            if fid == pynvml.NVML_FI_DEV_C2C_LINK_COUNT:
                return UINT, gpu.c2c_links
            if scope >= gpu.c2c_links:  # scope: the link
                return None
            if fid == pynvml.NVML_FI_DEV_C2C_LINK_GET_STATUS:
                return UINT, 1  # active
            return UINT, gpu.c2c_link_max_mb_per_second
        return None

    def energy_mj(self, gpu: FakeGpu, t: float) -> int:
        """Whole millijoules the board has used since the driver loaded (t = 0): the exact
        integral of the power it reports, so the counter's rate is that power."""
        return int(gpu.power.integral(t) * 1000)

    def reason_ns(self, gpu: FakeGpu, bit: int, t: float) -> int:
        """Cumulative nanoseconds the reason ``bit`` has held the clocks down."""
        return sum(duty.active_ns(t) for reason, duty in gpu.clock_events if reason == bit)

    def ecc_count(self, gpu: FakeGpu, corrected: bool, volatile: bool, t: float) -> int:
        rate = gpu.ecc_corrected_per_second if corrected else gpu.ecc_uncorrected_per_second
        count = int(rate * t)  # volatile: since the driver loaded
        if not volatile:
            count += gpu.ecc_corrected_aggregate_base if corrected \
                else gpu.ecc_uncorrected_aggregate_base
        return count

    def _remapped_rows(self, gpu: FakeGpu) -> tuple[int, int, int, int] | None:
        """(correctable, uncorrectable, pending, failed); None where not supported: before
        Ampere, and with MIG enabled (nvml.h: "If MIG is enabled ... NOT_SUPPORTED")."""
        if (not gpu.has_row_remapping or gpu.architecture < pynvml.NVML_DEVICE_ARCH_AMPERE
                or gpu.mig):
            return None
        return (gpu.remapped_rows_correctable, gpu.remapped_rows_uncorrectable,
                int(gpu.row_remap_pending), int(gpu.row_remap_failed))

    # -- clocks, power, temperature ------------------------------------------------------------

    def _clock(self, handle: object, kind: object, ref: _Ref[_Int], maximum: bool) -> int:
        dev = self._physical(handle)
        if isinstance(dev, int):
            return dev
        gpu = dev[1]
        which = getattr(kind, "value", kind)
        if which in (pynvml.NVML_CLOCK_GRAPHICS, pynvml.NVML_CLOCK_SM):  # one domain on Hopper
            current, top = gpu.sm_clock, gpu.sm_clock_max
        elif which == pynvml.NVML_CLOCK_MEM:
            current, top = gpu.memory_clock, gpu.memory_clock_max
        elif which == pynvml.NVML_CLOCK_VIDEO:
            current, top = gpu.video_clock, gpu.video_clock_max
        else:
            return INVALID_ARGUMENT
        _out(ref).value = top if maximum else round(current.value(self.now()))  # MHz
        return SUCCESS

    def nvmlDeviceGetClockInfo(self, handle: object, kind: object, ref: _Ref[_Int]) -> int:
        return self._clock(handle, kind, ref, maximum=False)

    def nvmlDeviceGetMaxClockInfo(self, handle: object, kind: object, ref: _Ref[_Int]) -> int:
        return self._clock(handle, kind, ref, maximum=True)

    def active_reasons(self, gpu: FakeGpu, t: float) -> int:
        """The clock-event bitmask at ``t``: the reasons whose duty cycle is on, and GpuIdle
        while nothing runs; only reasons the GPU supports are ever reported."""
        mask = 0
        for bit, duty in gpu.clock_events:
            if duty.active(t):
                mask |= bit
        if gpu.utilization.value(t) < 0.5:
            mask |= pynvml.nvmlClocksEventReasonGpuIdle
        return mask & gpu.supported_clock_events

    def _reasons(self, handle: object, ref: _Ref[_Int], supported: bool) -> int:
        dev = self._physical(handle)
        if isinstance(dev, int):
            return dev
        gpu = dev[1]
        _out(ref).value = gpu.supported_clock_events if supported \
            else self.active_reasons(gpu, self.now())
        return SUCCESS

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: object, ref: _Ref[_Int]) -> int:
        return self._reasons(handle, ref, supported=False)

    def nvmlDeviceGetSupportedClocksEventReasons(self, handle: object, ref: _Ref[_Int]) -> int:
        return self._reasons(handle, ref, supported=True)

    # the deprecated names of the same two calls, which older drivers have instead
    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: object, ref: _Ref[_Int]) -> int:
        return self._reasons(handle, ref, supported=False)

    def nvmlDeviceGetSupportedClocksThrottleReasons(self, handle: object, ref: _Ref[_Int]) -> int:
        return self._reasons(handle, ref, supported=True)

    def power_usage_mw(self, gpu: FakeGpu, t: float) -> int:
        """nvmlDeviceGetPowerUsage: on Ampere and later (except GA100) the mean over the last
        second, else the instantaneous draw (nvml.h); milliwatts."""
        if gpu.power_usage_averaged and t > 0:
            watts = gpu.power.mean(max(0.0, t - 1.0), t)
        else:
            watts = gpu.power.value(t)
        return round(watts * 1000)

    def nvmlDeviceGetPowerUsage(self, handle: object, ref: _Ref[_Int]) -> int:
        dev = self._physical(handle)
        if isinstance(dev, int):
            return dev
        _out(ref).value = self.power_usage_mw(dev[1], self.now())
        return SUCCESS

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: object, ref: _Ref[_Int]) -> int:
        dev = self._physical(handle)
        if isinstance(dev, int):
            return dev
        _out(ref).value = round(dev[1].power_limit * 1000)  # mW
        return SUCCESS

    def nvmlDeviceGetTemperature(self, handle: object, sensor: object, ref: _Ref[_Int]) -> int:
        dev = self._physical(handle)
        if isinstance(dev, int):
            return dev
        if getattr(sensor, "value", sensor) != pynvml.NVML_TEMPERATURE_GPU:
            return INVALID_ARGUMENT  # the only sensor this call knows before R615
        _out(ref).value = round(dev[1].temperature.value(self.now()))  # °C
        return SUCCESS

    def nvmlDeviceGetTemperatureV(self, handle: object, ref: _Ref[_TemperatureV]) -> int:
        """The successor of nvmlDeviceGetTemperature: an ``nvmlTemperature_v1_t`` (version,
        sensorType in, temperature out as a signed int, °C); another struct version is
        ARGUMENT_VERSION_MISMATCH, another sensor INVALID_ARGUMENT (the GPU's is the one every
        product has)."""
        dev = self._physical(handle)
        if isinstance(dev, int):
            return dev
        out = _out(ref)
        if out.version != TEMPERATURE_V1:
            return pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        if out.sensorType != pynvml.NVML_TEMPERATURE_GPU:
            return INVALID_ARGUMENT
        out.temperature = round(dev[1].temperature.value(self.now()))
        return SUCCESS

    # -- ECC and row remapping -------------------------------------------------------------------

    def nvmlDeviceGetTotalEccErrors(self, handle: object, error_type: object,
                                    counter_type: object, ref: _Ref[_Int]) -> int:
        dev = self._physical(handle)
        if isinstance(dev, int):
            return dev
        gpu = dev[1]
        kind = getattr(error_type, "value", error_type)
        counter = getattr(counter_type, "value", counter_type)
        if kind not in (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                        pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED) \
                or counter not in (pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC):
            return INVALID_ARGUMENT
        volatile = counter == pynvml.NVML_VOLATILE_ECC
        if not gpu.has_ecc or (volatile and gpu.mig):  # volatile not by device handle in MIG
            return NOT_SUPPORTED
        corrected = kind == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
        _out(ref).value = self.ecc_count(gpu, corrected, volatile, self.now())
        return SUCCESS

    def nvmlDeviceGetEccMode(self, handle: object, current: _Ref[_Int], pending: _Ref[_Int]) -> int:
        """ECC mode, current and pending: enabled on a GPU with ECC (the data-centre Hopper
        captures print "Enabled" for both), NOT_SUPPORTED on one without."""
        dev = self._physical(handle)
        if isinstance(dev, int):
            return dev
        if not dev[1].has_ecc:
            return NOT_SUPPORTED
        _out(current).value = _out(pending).value = pynvml.NVML_FEATURE_ENABLED
        return SUCCESS

    def nvmlDeviceGetRemappedRows(self, handle: object, corr: _Ref[_Int], unc: _Ref[_Int],
                                  pending: _Ref[_Int], failure: _Ref[_Int]) -> int:
        dev = self._physical(handle)
        if isinstance(dev, int):
            return dev
        rows = self._remapped_rows(dev[1])
        if rows is None:
            return NOT_SUPPORTED
        for ref, value in zip((corr, unc, pending, failure), rows, strict=True):
            _out(ref).value = value
        return SUCCESS

    # -- NVLink ----------------------------------------------------------------------------------

    def nvmlDeviceGetNvLinkState(self, handle: object, link: object, ref: _Ref[_Int]) -> int:
        """NVML_FEATURE_ENABLED for an active link, DISABLED for one down; NOT_SUPPORTED on a
        GPU without NVLink (or a link it does not have), INVALID_ARGUMENT past NVML's maximum."""
        dev = self._physical(handle)
        if isinstance(dev, int):
            return dev
        gpu, index = dev[1], int(link)  # type: ignore[call-overload]
        if not 0 <= index < pynvml.NVML_NVLINK_MAX_LINKS:
            return INVALID_ARGUMENT
        if index >= gpu.nvlink_links:
            return NOT_SUPPORTED
        _out(ref).value = (pynvml.NVML_FEATURE_DISABLED if index in gpu.nvlink_down
                           else pynvml.NVML_FEATURE_ENABLED)
        return SUCCESS

    # -- NVLink-C2C ------------------------------------------------------------------------------

    def nvmlDeviceGetC2cModeInfoV(self, handle: object, ref: _Ref[_C2cModeInfo]) -> int:
        """Enabled on a GPU with NVLink-C2C to a Grace CPU; disabled (answered, 0) on other
        Hopper and later GPUs, as ``nvidia-smi -q`` prints "GPU C2C Mode : Disabled" on an H100
        SXM and an H200 (tests/realworld/); NOT_SUPPORTED before Hopper."""
        dev = self._physical(handle)
        if isinstance(dev, int):
            return dev
        gpu = dev[1]
        if not gpu.has_c2c and gpu.architecture < pynvml.NVML_DEVICE_ARCH_HOPPER:
            return NOT_SUPPORTED
        _out(ref).isC2cEnabled = int(gpu.has_c2c)
        return SUCCESS

    # -- events (Xid) ----------------------------------------------------------------------------

    def nvmlEventSetCreate(self, ref: _Ref[ctypes._CData]) -> int:
        with self._events:
            addr = next(_EVENT_SET_ADDRESSES)  # unique across stand-ins, as pointers are
            self._event_sets[addr] = _EventSet()
        _set_pointer(ref, addr)
        return SUCCESS

    def nvmlEventSetFree(self, event_set: object) -> int:
        with self._events:
            gone = self._event_sets.pop(_pointer_value(event_set), None)
            self._events.notify_all()
        return SUCCESS if gone is not None else INVALID_ARGUMENT

    def nvmlDeviceGetSupportedEventTypes(self, handle: object, ref: _Ref[_Int]) -> int:
        dev = self._physical(handle)
        if isinstance(dev, int):
            return dev
        _out(ref).value = dev[1].supported_event_types
        return SUCCESS

    def nvmlDeviceRegisterEvents(self, handle: object, event_types: int | _Int,
                                 event_set: object) -> int:
        """Record ``event_types`` of the GPU in the set from now on: events before this call
        are not recorded. A MIG instance's handle is NOT_SUPPORTED (nvml.h: no per-instance
        event reporting with MIG device handles; register the parent, whose Xids carry the
        instance ids); a type the GPU lacks is NOT_SUPPORTED and registers nothing."""
        types = _int_of(event_types)
        dev = self._physical(handle)
        if isinstance(dev, int):
            return dev
        index, gpu = dev
        with self._events:
            s = self._event_sets.get(_pointer_value(event_set))
            if s is None or not types or types & ~pynvml.nvmlEventTypeAll:
                return INVALID_ARGUMENT
            if types & ~gpu.supported_event_types:
                return NOT_SUPPORTED
            now = self.now()
            mask, since = s.registered.get(index, (0, now))
            s.registered[index] = (mask | types, since)
            if index not in s.delivered:
                s.delivered[index] = sum(1 for e in self._xid_schedule(index) if e[0] < now)
            self._events.notify_all()
        return SUCCESS

    def _xid_schedule(self, index: int) -> list[tuple[float, int, int, int]]:
        return sorted(_xid(e) for e in self.gpus[index].xid_events)

    def _next_xid(self, s: _EventSet,
                  now: float) -> tuple[tuple[int, tuple[float, int, int, int]] | None, float | None]:
        """The earliest due, undelivered Xid of the set's GPUs, and when the next one falls
        due (simulated time) if none is due yet."""
        due: tuple[int, tuple[float, int, int, int]] | None = None
        upcoming: float | None = None
        for index, (mask, _) in s.registered.items():
            if not mask & pynvml.nvmlEventTypeXidCriticalError:
                continue
            schedule = self._xid_schedule(index)
            cursor = s.delivered.get(index, 0)
            if cursor >= len(schedule):
                continue
            event = schedule[cursor]
            if event[0] <= now:
                if due is None or event[0] < due[1][0]:
                    due = index, event
            elif upcoming is None or event[0] < upcoming:
                upcoming = event[0]
        return due, upcoming

    def nvmlEventSetWait_v2(self, event_set: object, ref: _Ref[_EventData],
                            timeout_ms: int | _Int) -> int:
        """Deliver the earliest due event, else sleep until one falls due, but no longer than
        ``timeout_ms`` of real time (TIMEOUT). Events already due are delivered even after
        their GPU fell off the bus; once none is due, a lost GPU in the set is GPU_IS_LOST."""
        deadline = time.monotonic() + _int_of(timeout_ms) / 1000
        addr = _pointer_value(event_set)
        with self._events:
            while True:
                s = self._event_sets.get(addr)
                if s is None:
                    return INVALID_ARGUMENT
                now = self.now()
                due, upcoming = self._next_xid(s, now)
                if due is not None:
                    index, (_, code, gi, ci) = due
                    s.delivered[index] += 1
                    out = _out(ref)
                    out.device = ctypes.cast(ctypes.c_void_p(self._handle(index)),
                                             pynvml.c_nvmlDevice_t)
                    out.eventType = pynvml.nvmlEventTypeXidCriticalError
                    out.eventData = code
                    out.gpuInstanceId, out.computeInstanceId = gi, ci
                    return SUCCESS
                if any(self.is_lost(index) for index in s.registered):
                    return GPU_IS_LOST
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return TIMEOUT
                # the simulated clock runs at real speed, or is moved by hand (which notifies)
                self._events.wait(remaining if upcoming is None
                                  else min(remaining, max(upcoming - now, 1e-3)))

    # -- GPM -----------------------------------------------------------------------------------

    def nvmlGpmQueryDeviceSupport(self, handle: object, ref: _Ref[_GpmSupport]) -> int:
        dev = self._gpu(handle, "nvmlGpmQueryDeviceSupport")
        if isinstance(dev, int):
            return dev
        out = _out(ref)
        if out.version != pynvml.NVML_GPM_SUPPORT_VERSION:
            return pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        out.isSupportedDevice = int(dev[1].has_gpm)
        return SUCCESS

    def nvmlGpmSampleAlloc(self, ref: _Ref[ctypes._CData]) -> int:
        with self._lock:
            self._next_gpm += 16
            addr = self._next_gpm
            self._gpm[addr] = _GpmSample()
        _set_pointer(ref, addr)
        return SUCCESS

    def nvmlGpmSampleFree(self, sample: object) -> int:
        with self._lock:
            return SUCCESS if self._gpm.pop(_pointer_value(sample), None) else INVALID_ARGUMENT

    def _take(self, sample: object, key: tuple[int, int | None]) -> int:
        slot = self._gpm.get(_pointer_value(sample))
        if slot is None:
            return INVALID_ARGUMENT
        slot.key, slot.t = key, self.now()
        return SUCCESS

    def nvmlGpmSampleGet(self, handle: object, sample: object) -> int:
        dev = self._device(handle)
        if isinstance(dev, int):
            return dev
        if not dev[1].has_gpm or dev[2] is not None:
            return NOT_SUPPORTED
        return self._take(sample, (dev[0], None))

    def nvmlGpmMigSampleGet(self, handle: object, gi_id: int, sample: object) -> int:
        dev = self._gpu(handle, "nvmlGpmMigSampleGet")  # the parent's handle and the GI id
        if isinstance(dev, int):
            return dev
        index, gpu, _ = dev
        gi = getattr(gi_id, "value", gi_id)
        for m, mig in enumerate(gpu.mig):
            if mig.gpu_instance_id == gi and gpu.has_gpm:
                return self._take(sample, (index, m))
        return NOT_FOUND

    def _gpm_table(self, index: int, mig_index: int | None) -> dict[int, tuple[Signal, float]]:
        gpu = self.gpus[index]
        source: FakeGpu | FakeMig = gpu if mig_index is None else gpu.mig[mig_index]
        signals: dict[int, tuple[Signal, float]] = {
            pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: (source.sm_occupancy, 1.0),
            pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: (source.tensor, 1.0),
            pynvml.NVML_GPM_METRIC_SM_UTIL: (source.sm_active, 1.0),
            pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: (source.dram_bw, 1.0),
        }
        if mig_index is None:
            mib = 1.0 / (1024 * 1024)
            signals |= {
                pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: (gpu.pcie_tx, mib),
                pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: (gpu.pcie_rx, mib),
                pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: (gpu.nvlink_tx, mib),
                pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: (gpu.nvlink_rx, mib),
            }
            if gpu.has_c2c and self.driver_major >= 575:  # MiB/s, like the PCIe metrics
                total = mib * (1 + gpu.c2c_protocol_overhead)
                signals |= {
                    pynvml.NVML_GPM_METRIC_C2C_TOTAL_TX_PER_SEC: (gpu.c2c_tx, total),
                    pynvml.NVML_GPM_METRIC_C2C_TOTAL_RX_PER_SEC: (gpu.c2c_rx, total),
                    pynvml.NVML_GPM_METRIC_C2C_DATA_TX_PER_SEC: (gpu.c2c_tx, mib),
                    pynvml.NVML_GPM_METRIC_C2C_DATA_RX_PER_SEC: (gpu.c2c_rx, mib),
                }
        return signals

    def nvmlGpmMetricsGet(self, ref: _Ref[_GpmMetricsGet]) -> int:
        mg = _out(ref)
        if mg.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            return pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        if mg.numMetrics > len(mg.metrics):  # more than NVML_GPM_METRIC_MAX
            return INVALID_ARGUMENT
        s1 = self._gpm.get(_pointer_value(mg.sample1))
        s2 = self._gpm.get(_pointer_value(mg.sample2))
        if s1 is None or s2 is None or s1.key is None or s1.key != s2.key or s2.t <= s1.t:
            return INVALID_ARGUMENT
        signals = self._gpm_tables.get(s1.key)
        if signals is None:
            signals = self._gpm_tables[s1.key] = self._gpm_table(*s1.key)
        for i in range(mg.numMetrics):
            metric = mg.metrics[i]
            found = signals.get(metric.metricId)
            if found is None:
                metric.nvmlReturn = NOT_SUPPORTED
                continue
            signal, scale = found
            metric.value = (signal.integral(s2.t) - signal.integral(s1.t)) / (s2.t - s1.t) * scale
            metric.nvmlReturn = SUCCESS
        return SUCCESS


class _Symbol:
    """One C symbol as pynvml keeps it: pynvml looks each symbol up once per process and caches
    what it got, so the object it caches must follow whichever stand-in is installed now. A call
    goes to the installed fake's function; a symbol that fake lacks answers FUNCTION_NOT_FOUND,
    which pynvml raises as the same ``NVMLError_FunctionNotFound`` its own look-up would."""

    __slots__ = ("__name__", "argtypes", "restype")

    def __init__(self, name: str) -> None:
        self.__name__ = name
        self.argtypes = self.restype = None  # pynvml sets restype on some, as on a C pointer

    def __call__(self, *args: object) -> object:
        fake = _installed.fake
        fn = None if fake is None else fake.library.__dict__.get(self.__name__)
        if fn is None:
            return pynvml.NVML_ERROR_UNINITIALIZED if fake is None else \
                pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
        return fn(*args)


class _Installed:
    """What pynvml sees at ``pynvml.nvmlLib`` while a stand-in is installed: the installed
    fake's symbols and nothing else, so a symbol it lacks is an AttributeError (pynvml's
    FunctionNotFound), as with dlsym. One object for the whole process, with one ``_Symbol`` per
    name, so installing another fake needs nothing of pynvml's cache.

    A process that installed the stand-in keeps it in pynvml's cache: it cannot load the real
    library afterwards (the CLI and the benchmarks use one or the other per process)."""

    def __init__(self) -> None:
        self.fake: FakeNvml | None = None
        self._symbols: dict[str, _Symbol] = {}

    def __getattr__(self, name: str) -> _Symbol:
        fake = self.fake
        if fake is None or name not in fake.library.__dict__ or not name.startswith("nvml"):
            raise AttributeError(name)
        return self._symbols.setdefault(name, _Symbol(name))


_installed = _Installed()
_install_lock = threading.Lock()


def install(fake: FakeNvml) -> FakeNvml:
    """Put ``fake`` where pynvml keeps the loaded library; pynvml's own code then talks to it."""
    with _install_lock:
        fake.library.fake = fake
        _installed.fake = fake
        pynvml.nvmlLib = _installed
    return fake


def uninstall() -> None:
    with _install_lock:
        _installed.fake = None
        pynvml.nvmlLib = None
