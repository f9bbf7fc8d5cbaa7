"""What each GPU can give, and why the rest is absent: detected once, when the GPU is opened.

A figure the GPU or its driver cannot give (``NotSupported``, or ``FunctionNotFound`` on an old
driver) is absent for good: detection records the reason under the series name, the start-up log
and ``gpu-sidecar probe`` report it once, and the per-cycle read never asks for it. Where a figure
has several sources, detection picks one here (PCIe rates: byte counters, else GPM, else the
blocking throughput call; NVLink: GPM's all-link totals, else per-link counters), so the
per-cycle read only follows the choice.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import pynvml
import structlog

from sidecar.metrics import TABLE
from sidecar.samples import LAYER_METRICS
from sidecar.sources.nvml.errors import error_name, is_unsupported
from sidecar.sources.nvml.health import (
    C2C_SERIES,
    CURRENT_LINK_SERIES,
    HEALTH_SERIES,
    HealthCaps,
    detect_health,
)
from sidecar.sources.nvml.timed import nvml
from sidecar.sources.pcie import link_max_bytes_per_second

log = structlog.get_logger("sidecar.nvml")

MIB = 1024 * 1024
# the layer fields of the figures that change a few times a year (sent when they change, and
# asked of NVML every RARE_READ_S: reading.py)
RARE_FIELDS = frozenset(m.field for m in TABLE if m.cadence == "rare" and m.field)

FI_TX = pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES
FI_RX = pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES
FI_REPLAY = pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER
FI_LINKS = pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT
FI_NVL_TX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
FI_NVL_RX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
FI_NVL_SPEED = pynvml.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON  # MBps (1e6 B/s) per active link
MBPS = 1e6

FieldId = tuple[int, int]  # (field id, scope id): the scope is the NVLink link, else 0


@dataclass(frozen=True, slots=True)
class GpmFigure:
    """One GPM metric and the layer field it fills, times ``scale`` for the field's unit."""

    metric_id: int
    field: str
    scale: float


GPM_CORE = (
    GpmFigure(pynvml.NVML_GPM_METRIC_SM_OCCUPANCY, "sm_occupancy_ratio", 0.01),
    GpmFigure(pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL, "tensor_core_util_ratio", 0.01),
    GpmFigure(pynvml.NVML_GPM_METRIC_SM_UTIL, "sm_active_ratio", 0.01),
    GpmFigure(pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL, "bandwidth_util_ratio", 0.01),
)
GPM_PCIE = (  # MiB/s
    GpmFigure(pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC, "pcie_tx_bytes_per_second", MIB),
    GpmFigure(pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC, "pcie_rx_bytes_per_second", MIB),
)
GPM_C2C = (  # MiB/s, like the PCIe metrics
    GpmFigure(pynvml.NVML_GPM_METRIC_C2C_TOTAL_TX_PER_SEC, "c2c_tx_bytes_per_second", MIB),
    GpmFigure(pynvml.NVML_GPM_METRIC_C2C_TOTAL_RX_PER_SEC, "c2c_rx_bytes_per_second", MIB),
)
GPM_NVLINK = (  # MiB/s
    GpmFigure(pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC, "nvlink_tx_bytes_per_second", MIB),
    GpmFigure(pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC, "nvlink_rx_bytes_per_second", MIB),
)

_SERIES_OF_FIELD = {attr: name for pairs in LAYER_METRICS.values() for attr, name in pairs}
# Reasons that say what the hardware is, not that anything is wrong: logged at debug only
# (devices._report); `probe` lists them all the same.
NO_NVLINK = "no NVLink on this GPU"
MIG_PARENT_ONLY = "MIG instance: reported on the parent GPU only"

# the series only GPM gives: absent, with the reason, on a GPU without it
GPM_ONLY_SERIES = tuple(_SERIES_OF_FIELD[f.field] for f in GPM_CORE)

_MIG_PARENT_ONLY = ("gpu_utilization_ratio", "gpu_memory_controller_busy_ratio",
                    "gpu_pcie_tx_bytes_per_second", "gpu_pcie_rx_bytes_per_second",
                    "gpu_nvlink_tx_bytes_per_second", "gpu_nvlink_rx_bytes_per_second",
                    "gpu_nvlink_link_max_bytes_per_second", "gpu_nvlink_tx_bandwidth_util_ratio",
                    "gpu_nvlink_rx_bandwidth_util_ratio", "gpu_pcie_replay_errors_total")
_NVLINK_MAX = ("gpu_nvlink_link_max_bytes_per_second", "gpu_nvlink_tx_bandwidth_util_ratio",
               "gpu_nvlink_rx_bandwidth_util_ratio")
_PCIE_RATIOS = ("gpu_pcie_link_max_bytes_per_second", "gpu_pcie_tx_bandwidth_util_ratio",
                "gpu_pcie_rx_bandwidth_util_ratio")

_VALUE_BITS = {  # NVML value type -> counter width in bits (a signed 64-bit value has 63)
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: 32,
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: 64,
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: 64,
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: 63,
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: 16,
}
_VALUE_MEMBER = {
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal",
}


@dataclass(frozen=True, slots=True)
class CounterValue:
    """An integer field value: its value and the width of the counter it comes from."""

    value: int
    bits: int


def field_value(fv: Any) -> CounterValue | None:
    """The integer in one ``c_nvmlFieldValue_t``, None when that field failed or is no integer."""
    if fv.nvmlReturn != pynvml.NVML_SUCCESS:
        return None
    kind = fv.valueType  # read once: each read of a pynvml struct's member runs Python code
    member = _VALUE_MEMBER.get(kind)
    if member is None:
        return None
    return CounterValue(value=getattr(fv.value, member), bits=_VALUE_BITS[kind])


@dataclass(frozen=True, slots=True)
class Link:
    """The PCIe link at its maximum (idle links train down to save power, so not the current)."""

    generation: int | None = None
    width: int | None = None
    max_bytes_per_second: float | None = None  # per direction; or the calibrated peak


@dataclass(frozen=True, slots=True)
class Capabilities:
    memory: Literal["v2", "v1"] | None = None
    utilization: bool = False
    gpm: bool = False
    gpm_figures: tuple[GpmFigure, ...] = ()  # what each GPM reading asks for
    pcie: Literal["counters", "gpm", "throughput"] | None = None
    pcie_note: str = ""  # why the byte counters were not taken, when they exist
    pcie_max_dt: float = math.inf  # longest gap over which the counters still give a rate
    replay: Literal["field", "call"] | None = None
    nvlink: Literal["counters", "gpm"] | None = None
    nvlink_links: int = 0
    nvlink_max_bytes_per_second: float | None = None  # per direction: active links x speed
    link: Link = Link()
    health: HealthCaps = field(default_factory=HealthCaps)
    absent: dict[str, str] = field(default_factory=dict)  # series name -> why

    @property
    def field_ids(self) -> tuple[FieldId, ...]:
        """The field values every cycle reads, by (field id, scope): those that move."""
        ids: list[FieldId] = []
        if self.pcie == "counters":
            ids += [(FI_TX, 0), (FI_RX, 0)]
        if self.nvlink == "counters":
            ids += [(FI_NVL_TX, link) for link in range(self.nvlink_links)]
            ids += [(FI_NVL_RX, link) for link in range(self.nvlink_links)]
        ids += [(fid, 0) for fid, attr in self.health.field_attrs if attr not in RARE_FIELDS]
        return tuple(ids)

    @property
    def rare_field_ids(self) -> tuple[FieldId, ...]:
        """The field values of the rare figures (error, ECC and remapping counters: metrics.TABLE's
        ``cadence="rare"``), which the read asks for less often than every cycle."""
        ids = [(FI_REPLAY, 0)] if self.replay == "field" else []
        ids += [(fid, 0) for fid, attr in self.health.field_attrs if attr in RARE_FIELDS]
        return tuple(ids)

    def summary(self) -> dict[str, Any]:
        """What ``gpu-sidecar probe`` shows under "sources"."""
        out: dict[str, Any] = {
            "memory": self.memory, "utilization": self.utilization, "gpm": self.gpm,
            "pcie": self.pcie, "replay": self.replay, "nvlink": self.nvlink,
            "nvlink_links": self.nvlink_links,
            "nvlink_max_bytes_per_second": self.nvlink_max_bytes_per_second,
            "link_generation": self.link.generation,
            "link_width": self.link.width,
            "link_max_bytes_per_second": self.link.max_bytes_per_second,
            **self.health.summary()}
        if self.pcie_note:
            out["pcie_note"] = self.pcie_note
        return out


def detect(handle: Any, *, uuid: str, pcie_peak: float | None, interval_s: float) -> Capabilities:
    """A physical GPU's capabilities. An error other than "unsupported" propagates: the GPU is
    then unreadable at start and left out."""
    absent: dict[str, str] = {}
    memory = detect_memory(handle, absent)
    utilization = _detect_utilization(handle, absent)
    gpm, gpm_why = _detect_gpm(handle)
    link = _detect_link(handle, pcie_peak, absent)
    probe = _probe_fields(handle, (FI_TX, FI_RX, FI_REPLAY, FI_LINKS, FI_NVL_SPEED))
    pcie, pcie_note, pcie_max_dt = _choose_pcie(probe, gpm=gpm, link=link, interval_s=interval_s,
                                                uuid=uuid)
    replay = _choose_replay(handle, probe, absent)
    links = probe.get(FI_LINKS)
    nvlink_links = links.value if links is not None else 0
    nvlink = _choose_nvlink(handle, nvlink_links, gpm=gpm, absent=absent)
    nvlink_max = _nvlink_max(handle, nvlink_links, probe.get(FI_NVL_SPEED), absent)
    health = detect_health(handle, absent, lambda ids: _probe_fields(handle, ids))
    c2c = health.c2c_link_max_bytes_per_second is not None
    figures: tuple[GpmFigure, ...] = ()
    if gpm:
        figures = (GPM_CORE + (GPM_PCIE if pcie == "gpm" else ())
                   + (GPM_NVLINK if nvlink == "gpm" else ()) + (GPM_C2C if c2c else ()))
    else:
        absent.update(dict.fromkeys(GPM_ONLY_SERIES, gpm_why))
        if c2c:
            absent.update(dict.fromkeys(C2C_SERIES[:2] + C2C_SERIES[3:], gpm_why))
    return Capabilities(memory=memory, utilization=utilization, gpm=gpm, gpm_figures=figures,
                        pcie=pcie, pcie_note=pcie_note, pcie_max_dt=pcie_max_dt, replay=replay,
                        nvlink=nvlink, nvlink_links=nvlink_links,
                        nvlink_max_bytes_per_second=nvlink_max, link=link, health=health,
                        absent=absent)


def detect_mig(handle: Any, parent: Capabilities) -> Capabilities:
    """A MIG instance's capabilities: its own memory and GPM, its parent's link; the GPU-wide
    figures (utilization, PCIe, NVLink, replays) are the parent's only."""
    absent: dict[str, str] = {}
    memory = detect_memory(handle, absent)
    absent.update(dict.fromkeys((*_MIG_PARENT_ONLY, *HEALTH_SERIES, *CURRENT_LINK_SERIES,
                                 *C2C_SERIES), MIG_PARENT_ONLY))
    if not parent.gpm:
        absent.update({name: parent.absent.get(name, "no GPM") for name in GPM_ONLY_SERIES})
    return Capabilities(memory=memory, gpm=parent.gpm,
                        gpm_figures=GPM_CORE if parent.gpm else (), link=parent.link,
                        absent=absent)


def detect_memory(handle: Any, absent: dict[str, str]) -> Literal["v2", "v1"] | None:
    """v2 (with the driver's reservation) where the driver has it, else v1."""
    try:
        nvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        return "v2"
    except pynvml.NVMLError as exc:
        if not is_unsupported(exc):
            raise
    absent["gpu_memory_reserved_bytes"] = "nvmlDeviceGetMemoryInfo_v2 unavailable (old driver)"
    try:
        nvml.nvmlDeviceGetMemoryInfo(handle)
        return "v1"
    except pynvml.NVMLError as exc:
        if not is_unsupported(exc):
            raise
        absent.update(dict.fromkeys(("gpu_memory_used_bytes", "gpu_memory_total_bytes"),
                                    error_name(exc)))
    return None


def _detect_utilization(handle: Any, absent: dict[str, str]) -> bool:
    try:
        nvml.nvmlDeviceGetUtilizationRates(handle)
        return True
    except pynvml.NVMLError as exc:
        if not is_unsupported(exc):
            raise
        absent["gpu_utilization_ratio"] = error_name(exc)
        absent["gpu_memory_controller_busy_ratio"] = error_name(exc)
        return False


def _detect_gpm(handle: Any) -> tuple[bool, str]:
    """Whether the GPU has GPM, and why not when it has none."""
    try:
        supported = bool(nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
        return supported, "GPM not supported on this GPU (Hopper and newer only)"
    except pynvml.NVMLError as exc:
        if not is_unsupported(exc):
            raise
        return False, f"GPM unavailable: {error_name(exc)} (driver too old?)"


def _detect_link(handle: Any, pcie_peak: float | None, absent: dict[str, str]) -> Link:
    generation = try_nvml(lambda: nvml.nvmlDeviceGetMaxPcieLinkGeneration(handle), None)
    width = try_nvml(lambda: nvml.nvmlDeviceGetMaxPcieLinkWidth(handle), None)
    peak: float | None = None
    if pcie_peak:
        peak = float(pcie_peak)
    elif generation and width:
        peak = link_max_bytes_per_second(generation, width)
    if peak is None:
        absent.update(dict.fromkeys(
            _PCIE_RATIOS, "link generation/width unknown; set --pcie-peak-bytes-per-second"))
    return Link(generation=generation, width=width, max_bytes_per_second=peak)


def _probe_fields(handle: Any, ids: tuple[int, ...]) -> dict[int, CounterValue | None]:
    """One reading of the field values ``ids``; empty where the driver has no field values."""
    try:
        values = nvml.nvmlDeviceGetFieldValues(handle, list(ids))
    except pynvml.NVMLError as exc:
        if not is_unsupported(exc):
            raise
        return {}
    return {fv.fieldId: field_value(fv) for fv in values}


def _choose_pcie(probe: dict[int, CounterValue | None], *, gpm: bool, link: Link, interval_s: float,
                 uuid: str) -> tuple[Literal["counters", "gpm", "throughput"], str, float]:
    """(where PCIe rates come from, why not the byte counters, the longest gap over which the
    counters still give a rate)."""
    tx, rx = probe.get(FI_TX), probe.get(FI_RX)
    note = ""
    if tx is not None and rx is not None:
        fits, note, max_dt = _counter_fits(min(tx.bits, rx.bits), link.max_bytes_per_second,
                                           interval_s, uuid)
        if fits:
            return "counters", "", max_dt
    return ("gpm" if gpm else "throughput"), note, math.inf


def _counter_fits(bits: int, link_max: float | None, interval_s: float,
                  uuid: str) -> tuple[bool, str, float]:
    """A byte counter gives a rate only if it cannot wrap twice between two readings: at the
    link's maximum over twice the interval (a late cycle), it must stay below one wrap. A 32-bit
    counter wraps every 4.29 GB, 15 times a second on a Gen5 x16 link.

    Returns (fits, why not, the longest gap between readings that still gives a rate)."""
    if bits >= 63:  # a signed 64-bit value: wraps after 292 years at 1 TB/s
        return True, "", math.inf
    if link_max is not None and link_max * 2 * interval_s < 2**bits:
        return True, "", 2**bits / link_max
    link = f"the link's {link_max / 1e9:.1f} GB/s" if link_max else "an unknown link maximum"
    note = (f"the PCIe byte counters are {bits}-bit: at {link} they could wrap more than once per "
            f"{interval_s:g} s interval, so they are not used")
    log.warning("pcie_counters_too_narrow", gpu_uuid=uuid, bits=bits, interval_s=interval_s,
                link_max_bytes_per_second=link_max,
                effect="PCIe rates come from GPM or nvmlDeviceGetPcieThroughput instead")
    return False, note, math.inf


def _choose_replay(handle: Any, probe: dict[int, CounterValue | None],
                   absent: dict[str, str]) -> Literal["field", "call"] | None:
    if probe.get(FI_REPLAY) is not None:
        return "field"
    if try_nvml(lambda: nvml.nvmlDeviceGetPcieReplayCounter(handle), None) is not None:
        return "call"
    absent["gpu_pcie_replay_errors_total"] = "not supported"
    return None


def _choose_nvlink(handle: Any, links: int, *, gpm: bool,
                   absent: dict[str, str]) -> Literal["counters", "gpm"] | None:
    """GPM's all-link totals cost one entry in a call made anyway; per-link counters cost two
    field values per link (36 on an H200) every cycle, so they are the fallback."""
    if links and gpm:
        return "gpm"
    if links:
        try:
            check = nvml.nvmlDeviceGetFieldValues(handle, [(FI_NVL_TX, 0), (FI_NVL_RX, 0)])
            if all(field_value(v) is not None for v in check):
                return "counters"
        except pynvml.NVMLError as exc:
            if not is_unsupported(exc):
                raise
    why = NO_NVLINK if not links else "NVLink counters unsupported"
    absent["gpu_nvlink_tx_bytes_per_second"] = why
    absent["gpu_nvlink_rx_bytes_per_second"] = why
    return None


def _nvlink_max(handle: Any, links: int, speed: CounterValue | None,
                absent: dict[str, str]) -> float | None:
    """The NVLink maximum per direction: the links NVML says are active times the common speed
    it reports for active links (field 90, MBps per link and direction). Never guessed from a
    generation: a GPU whose NVML cannot say has none (absent, with the reason), and a link
    down (``nvidia-smi nvlink -s`` prints it inactive) is not counted, so the share is of what
    the GPU can send now."""
    why = NO_NVLINK
    active = 0
    if links:
        for link in range(links):
            try:
                active += nvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED
            except pynvml.NVMLError as exc:
                if not is_unsupported(exc):
                    raise
        why = "no active NVLink link" if not active else \
            "NVLink speed unsupported (NVML field 90)"
    if active and speed is not None and speed.value > 0:
        return active * speed.value * MBPS
    absent.update(dict.fromkeys(_NVLINK_MAX, why))
    return None


def try_nvml(fn: Callable[[], Any], default: Any) -> Any:
    """``fn()``, or ``default`` when NVML refuses: for figures that are only nice to have."""
    try:
        return fn()
    except pynvml.NVMLError:
        return default
