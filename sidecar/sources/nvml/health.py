"""The health layer and the link figures that utilization hides: clocks and what limits them,
power, heat, PCIe link training and errors, ECC and row remapping; NVLink-C2C on Grace nodes.

Detected once per GPU when it is opened, like the other layers (``capabilities.py``): every
figure the GPU or its driver cannot give is absent for good, with the reason, and the per-cycle
read asks only for the rest. Most figures are NVML field values, read in the one
``nvmlDeviceGetFieldValues`` call a cycle already makes; the rest are one call each (clocks,
power limit, temperature, the current PCIe link, the clock-event bitmask).

No deprecated call where a successor exists (nvml.h 13 marks ``DEPRECATED(13.0)``
``nvmlDeviceGetTemperature`` and ``nvmlDeviceGet{Current,Supported}ClocksThrottleReasons``):
detection asks the successor first (``nvmlDeviceGetTemperatureV`` with its versioned struct,
``nvmlDeviceGet*ClocksEventReasons``) and the old call only where the driver lacks the successor
(``FUNCTION_NOT_FOUND``, ``NOT_SUPPORTED``, an older struct version); a driver that answers the
old call ``NVML_ERROR_DEPRECATED`` leaves the figure absent, said once with the reason.

Clock events: where the driver has the cumulative nanosecond counters (fields 74, 76, 269, 270,
271), each reason's figure is the share of the interval it held the clocks down; elsewhere it is
the reason bitmask at the reading, 0 or 1. Hardware slowdown has no counter: always the bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pynvml

from sidecar.samples import LAYER_METRICS, HealthLayer
from sidecar.sources.nvml.errors import Failures, error_name, is_deprecated, is_lost, lacks
from sidecar.sources.nvml.timed import nvml
from sidecar.sources.pcie import link_max_bytes_per_second

MHZ = 1e6
MB = 1e6  # NVML_FI_DEV_C2C_LINK_GET_MAX_BW is in MB/s per link

# HealthLayer field <- NVML field value (scale to the field's unit)
FIELD_FIGURES: tuple[tuple[int, str, float], ...] = (
    (pynvml.NVML_FI_DEV_MEMORY_TEMP, "memory_temperature_celsius", 1.0),
    (pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, "energy_joules", 1e-3),  # mJ since load
    (pynvml.NVML_FI_DEV_PCIE_L0_TO_RECOVERY_COUNTER, "pcie_l0_to_recovery", 1),
    (pynvml.NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS, "pcie_correctable_errors", 1),
    (pynvml.NVML_FI_DEV_PCIE_COUNT_NAKS_RECEIVED, "pcie_naks_received", 1),
    (pynvml.NVML_FI_DEV_PCIE_COUNT_RECEIVER_ERROR, "pcie_receiver_errors", 1),
    (pynvml.NVML_FI_DEV_PCIE_COUNT_BAD_TLP, "pcie_bad_tlp", 1),
    (pynvml.NVML_FI_DEV_PCIE_COUNT_NAKS_SENT, "pcie_naks_sent", 1),
    (pynvml.NVML_FI_DEV_PCIE_COUNT_BAD_DLLP, "pcie_bad_dllp", 1),
    (pynvml.NVML_FI_DEV_PCIE_COUNT_NON_FATAL_ERROR, "pcie_nonfatal_errors", 1),
    (pynvml.NVML_FI_DEV_PCIE_COUNT_FATAL_ERROR, "pcie_fatal_errors", 1),
    (pynvml.NVML_FI_DEV_PCIE_COUNT_UNSUPPORTED_REQ, "pcie_unsupported_requests", 1),
    (pynvml.NVML_FI_DEV_PCIE_COUNT_LCRC_ERROR, "pcie_lcrc_errors", 1),
    (pynvml.NVML_FI_DEV_PCIE_COUNT_LANE_ERROR, "pcie_lane_errors", 1),
    (pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL, "ecc_corrected_volatile", 1),
    (pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL, "ecc_uncorrected_volatile", 1),
    (pynvml.NVML_FI_DEV_ECC_SBE_AGG_TOTAL, "ecc_corrected_aggregate", 1),
    (pynvml.NVML_FI_DEV_ECC_DBE_AGG_TOTAL, "ecc_uncorrected_aggregate", 1),
    (pynvml.NVML_FI_DEV_REMAPPED_COR, "remapped_rows_correctable", 1),
    (pynvml.NVML_FI_DEV_REMAPPED_UNC, "remapped_rows_uncorrectable", 1),
    (pynvml.NVML_FI_DEV_REMAPPED_PENDING, "row_remap_pending", 1),
    (pynvml.NVML_FI_DEV_REMAPPED_FAILURE, "row_remap_failed", 1),
)
FI_POWER = pynvml.NVML_FI_DEV_POWER_INSTANT  # mW
FI_C2C_LINKS = pynvml.NVML_FI_DEV_C2C_LINK_COUNT
FI_C2C_MAX = pynvml.NVML_FI_DEV_C2C_LINK_GET_MAX_BW

# HealthLayer field <- (cumulative ns counter field, or None; bit of the reason bitmask)
CLOCK_EVENTS: tuple[tuple[str, int | None, int], ...] = (
    ("power_cap_ratio", pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP,
     pynvml.nvmlClocksEventReasonSwPowerCap),
    ("hw_slowdown_ratio", None, pynvml.nvmlClocksEventReasonHwSlowdown),
    ("hw_thermal_ratio", pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN,
     pynvml.nvmlClocksEventReasonHwThermalSlowdown),
    ("hw_power_brake_ratio", pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN,
     pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown),
    ("sw_thermal_ratio", pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN,
     pynvml.nvmlClocksEventReasonSwThermalSlowdown),
    ("sync_boost_ratio", pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST,
     pynvml.nvmlClocksEventReasonSyncBoost),
)

# Every clock-event reason bit nvml.h 13.3 defines, by name (the hardware ones still only as
# nvmlClocksThrottleReason*; 0x200 and up are no reason there): how probe names a GPU's reasons
CLOCK_EVENT_REASONS: tuple[tuple[int, str], ...] = (
    (pynvml.nvmlClocksEventReasonGpuIdle, "gpu_idle"),
    (pynvml.nvmlClocksEventReasonApplicationsClocksSetting, "applications_clocks_setting"),
    (pynvml.nvmlClocksEventReasonSwPowerCap, "sw_power_cap"),
    (pynvml.nvmlClocksThrottleReasonHwSlowdown, "hw_slowdown"),
    (pynvml.nvmlClocksEventReasonSyncBoost, "sync_boost"),
    (pynvml.nvmlClocksEventReasonSwThermalSlowdown, "sw_thermal_slowdown"),
    (pynvml.nvmlClocksThrottleReasonHwThermalSlowdown, "hw_thermal_slowdown"),
    (pynvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown, "hw_power_brake_slowdown"),
    (pynvml.nvmlClocksEventReasonDisplayClockSetting, "display_clock_setting"),
)
# bits pynvml (13.615) names that no nvml.h defines: named as pynvml names them
PYNVML_ONLY_REASONS: tuple[tuple[int, str], ...] = (
    (getattr(pynvml, "nvmlClocksThrottleReasonBoardLimit", 0x200), "board_limit"),
    (getattr(pynvml, "nvmlClocksThrottleReasonReliability", 0x400), "reliability"),
)
_REASON_NAMES = dict(CLOCK_EVENT_REASONS + PYNVML_ONLY_REASONS)

_SERIES = dict(LAYER_METRICS[HealthLayer])  # HealthLayer field -> series
HEALTH_SERIES = (*_SERIES.values(), "gpu_xid_errors_total")
CURRENT_LINK_SERIES = ("gpu_pcie_link_current_generation", "gpu_pcie_link_current_width",
                       "gpu_pcie_link_current_bytes_per_second",
                       "gpu_pcie_tx_current_link_util_ratio", "gpu_pcie_rx_current_link_util_ratio")
C2C_SERIES = ("gpu_c2c_tx_bytes_per_second", "gpu_c2c_rx_bytes_per_second",
              "gpu_c2c_link_max_bytes_per_second", "gpu_c2c_tx_bandwidth_util_ratio",
              "gpu_c2c_rx_bandwidth_util_ratio")
NO_C2C = "no NVLink-C2C (not a Grace Hopper or Grace Blackwell GPU)"
"""Why the C2C series are absent on a GPU without the link: the hardware's shape, not a fault."""


@dataclass(frozen=True, slots=True)
class HealthCaps:
    """What the health read asks for on one GPU, decided at open."""

    fields: tuple[tuple[int, str, float], ...] = ()  # (field id, HealthLayer field, scale)
    counters: tuple[tuple[str, int], ...] = ()  # clock events with a ns counter
    bits: tuple[tuple[str, int], ...] = ()  # clock events read from the bitmask
    reasons_call: Any = None  # the call that reads the bitmask (its name changed in R535)
    supported_reasons: int | None = None  # the bitmask of reasons the GPU reports, at open
    power_field: bool = False  # NVML field 186, else the call
    power_call: bool = False
    power_limit: bool = False
    temperature: Any = None  # the call that reads it: nvmlDeviceGetTemperatureV, else the old one
    clocks: bool = False  # SM and memory clock now
    sm_clock_max_hertz: float | None = None
    memory_clock_max_hertz: float | None = None
    current_link: bool = False
    c2c_link_max_bytes_per_second: float | None = None  # links x per-link maximum, when C2C

    @property
    def field_attrs(self) -> tuple[tuple[int, str], ...]:
        """(field id, HealthLayer field it gives) of every field value the health read uses."""
        return (*((fid, attr) for fid, attr, _ in self.fields), *((fid, attr) for attr, fid in
                                                                  self.counters),
                *(((FI_POWER, "power_watts"),) if self.power_field else ()))

    def summary(self) -> dict[str, Any]:
        """What ``probe`` shows of it under "sources"."""
        return {"clock_events": "ns counters" if self.counters else ("bitmask" if self.bits
                                                                      else None),
                "clock_event_reasons": (None if self.supported_reasons is None
                                        else reason_names(self.supported_reasons)),
                "temperature_call": getattr(self.temperature, "__name__", None),
                "power": "field" if self.power_field else ("call" if self.power_call else None),
                "health_fields": len(self.fields),
                "host_link": "c2c" if self.c2c_link_max_bytes_per_second else "pcie",
                "c2c_link_max_bytes_per_second": self.c2c_link_max_bytes_per_second}


def detect_health(handle: Any, absent: dict[str, str], probe: Any) -> HealthCaps:
    """One GPU's health capabilities; ``probe(ids)`` reads field values once (id -> value, None
    for a field the GPU refused). Everything refused goes into ``absent`` with the reason."""
    ids = (*(fid for fid, _, _ in FIELD_FIGURES), *(fid for _, fid, _ in CLOCK_EVENTS if fid),
           FI_POWER, FI_C2C_LINKS, FI_C2C_MAX)
    values = probe(ids)
    fields = tuple(f for f in FIELD_FIGURES if values.get(f[0]) is not None)
    for fid, attr, _ in FIELD_FIGURES:
        if values.get(fid) is None:
            absent[_SERIES[attr]] = f"NVML field {fid} not supported on this GPU"
    counters = tuple((attr, fid) for attr, fid, _ in CLOCK_EVENTS
                     if fid is not None and values.get(fid) is not None)
    counted = {attr for attr, _ in counters}
    bitmask, reasons_call, reasons_why = _supported_reasons(handle)
    bits = tuple((attr, bit) for attr, _, bit in CLOCK_EVENTS
                 if attr not in counted and bitmask is not None and bitmask & bit)
    for attr, _, _ in CLOCK_EVENTS:
        if attr not in counted and attr not in dict(bits):
            absent[_SERIES[attr]] = (reasons_why if bitmask is None
                                     else "this reason is not reported by this GPU")
    power_field = values.get(FI_POWER) is not None
    power_call = not power_field and _answers(nvml.nvmlDeviceGetPowerUsage, handle)
    if not (power_field or power_call):
        absent["gpu_power_usage_watts"] = "power readings not supported"
    power_limit = _answers(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
    if not power_limit:
        absent["gpu_power_limit_watts"] = "power limit not supported"
    temperature, _, why = _successor_first(
        (nvml.nvmlDeviceGetTemperatureV, nvml.nvmlDeviceGetTemperature),
        handle, pynvml.NVML_TEMPERATURE_GPU)
    if temperature is None:
        absent["gpu_temperature_celsius"] = f"temperature: {why}"
    clocks = (_answers(nvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM)
              and _answers(nvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_MEM))
    if not clocks:
        absent["gpu_sm_clock_hertz"] = absent["gpu_memory_clock_hertz"] = "clocks not supported"
    sm_max = _max_clock(handle, pynvml.NVML_CLOCK_SM, absent, "gpu_sm_clock_max_hertz")
    mem_max = _max_clock(handle, pynvml.NVML_CLOCK_MEM, absent, "gpu_memory_clock_max_hertz")
    current_link = (_answers(nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle)
                    and _answers(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle))
    if not current_link:
        absent.update(dict.fromkeys(CURRENT_LINK_SERIES, "current PCIe link not reported"))
    links, per_link = values.get(FI_C2C_LINKS), values.get(FI_C2C_MAX)
    c2c = (links.value * per_link.value * MB
           if links is not None and per_link is not None and links.value and per_link.value
           else None)
    if c2c is None:
        absent.update(dict.fromkeys(C2C_SERIES, NO_C2C))
    return HealthCaps(fields=fields, counters=counters, bits=bits,
                      reasons_call=reasons_call if bits else None, power_field=power_field,
                      power_call=power_call, power_limit=power_limit, temperature=temperature,
                      clocks=clocks, sm_clock_max_hertz=sm_max, memory_clock_max_hertz=mem_max,
                      current_link=current_link, c2c_link_max_bytes_per_second=c2c,
                      supported_reasons=bitmask)


def _answers(fn: Any, *args: Any) -> bool:
    """Whether ``fn`` answers on this GPU. Only a lost GPU propagates: a health figure the GPU
    refuses for any other reason (no permission in a vGPU guest, say) is absent, and must not
    cost the layers that worked before it."""
    try:
        fn(*args)
        return True
    except pynvml.NVMLError as exc:
        if is_lost(exc):
            raise
        return False


def _successor_first(calls: tuple[Any, ...], *args: Any) -> tuple[Any, Any, str]:
    """The first of ``calls`` (a successor, then the call it replaces) that answers, its answer
    and ''; or None, None and why none did. A call is tried only where the driver lacks the one before it
    (``errors.lacks``); one answered ``NVML_ERROR_DEPRECATED`` is absent, said once at open
    with the reason. Only a lost GPU propagates (as ``_answers``)."""
    tried: list[str] = []
    for fn in calls:
        try:
            return fn, fn(*args), ""
        except pynvml.NVMLError as exc:
            if is_lost(exc):
                raise
            name = getattr(fn, "__name__", "call")
            tried.append(f"{name} {error_name(exc)}")
            if is_deprecated(exc):
                return None, None, (f"{name} is deprecated by this driver (NVML_ERROR_DEPRECATED)"
                              + (f"; {'; '.join(tried[:-1])}" if len(tried) > 1 else ""))
            if not lacks(exc):
                break
    return None, None, "not supported (" + "; ".join(tried) + ")"


def _supported_reasons(handle: Any) -> tuple[int | None, Any, str]:
    """The reasons the GPU reports, the call that reads them now and, without one, why: the
    clocks-event names (R535 and later), else, on a driver without them, their older
    "throttle reasons" names (same bits, ``DEPRECATED(13.0)``)."""
    supported, mask, why = _successor_first((nvml.nvmlDeviceGetSupportedClocksEventReasons,
                                       nvml.nvmlDeviceGetSupportedClocksThrottleReasons), handle)
    if supported is None:
        return None, None, f"clock event reasons: {why}"
    current = (nvml.nvmlDeviceGetCurrentClocksEventReasons
               if supported is nvml.nvmlDeviceGetSupportedClocksEventReasons
               else nvml.nvmlDeviceGetCurrentClocksThrottleReasons)
    return int(mask), current, ""


def reason_names(mask: int) -> tuple[str, ...]:
    """The clock-event reasons set in ``mask``, by name; a bit no header names as its hex."""
    names = [name for bit, name in (*CLOCK_EVENT_REASONS, *PYNVML_ONLY_REASONS) if mask & bit]
    known = 0
    for bit in _REASON_NAMES:
        known |= bit
    rest = mask & ~known
    names += [hex(1 << i) for i in range(rest.bit_length()) if rest >> i & 1]
    return tuple(names)


def _max_clock(handle: Any, clock: int, absent: dict[str, str], series: str) -> float | None:
    try:
        mhz = nvml.nvmlDeviceGetMaxClockInfo(handle, clock)
    except pynvml.NVMLError as exc:
        if is_lost(exc):
            raise
        absent[series] = error_name(exc)
        return None
    return mhz * MHZ if mhz else None


@dataclass(slots=True)
class ClockEventTotals:
    """The nanosecond counters at one reading, for the next interval's shares."""

    t: float
    ns: dict[str, int]


def read_health(device: Any, caps: HealthCaps, values: dict[tuple[int, int], Any],
                previous: ClockEventTotals | None, failures: Failures, now: float,
                last_xid: int | None, power_limit_watts: float | None = None,
                ) -> tuple[HealthLayer, ClockEventTotals | None]:
    """One cycle's health figures, and the counters the next cycle's shares start from.
    ``power_limit_watts`` is read by the caller, with the rare figures: it changes when an
    operator sets it, not from cycle to cycle."""
    figures: dict[str, float | int | None] = {
        attr: (None if (v := values.get((fid, 0))) is None else v.value * scale)
        for fid, attr, scale in caps.fields}
    if caps.power_field:
        power = values.get((FI_POWER, 0))
        figures["power_watts"] = None if power is None else power.value / 1000
    elif caps.power_call:
        mw = failures.call("power", nvml.nvmlDeviceGetPowerUsage, device)
        figures["power_watts"] = None if mw is None else mw / 1000
    if caps.power_limit:
        figures["power_limit_watts"] = power_limit_watts
    if caps.temperature is not None:
        figures["temperature_celsius"] = failures.call(
            "temperature", caps.temperature, device, pynvml.NVML_TEMPERATURE_GPU)
    if caps.clocks:
        sm = failures.call("sm_clock", nvml.nvmlDeviceGetClockInfo, device,
                           pynvml.NVML_CLOCK_SM)
        mem = failures.call("memory_clock", nvml.nvmlDeviceGetClockInfo, device,
                            pynvml.NVML_CLOCK_MEM)
        figures["sm_clock_hertz"] = None if sm is None else sm * MHZ
        figures["memory_clock_hertz"] = None if mem is None else mem * MHZ
    figures["sm_clock_max_hertz"] = caps.sm_clock_max_hertz
    figures["memory_clock_max_hertz"] = caps.memory_clock_max_hertz
    if caps.bits:
        mask = failures.call("clock_events", caps.reasons_call, device)
        for attr, bit in caps.bits:
            figures[attr] = None if mask is None else (1.0 if mask & bit else 0.0)
    totals = None
    if caps.counters:
        ns = {attr: v.value for attr, fid in caps.counters
              if (v := values.get((fid, 0))) is not None}
        totals = ClockEventTotals(t=now, ns=ns) if len(ns) == len(caps.counters) else None
        figures.update(_shares(previous, totals))
    figures["last_xid"] = last_xid
    # the fields are named at run time, by the tables: the checker sees every value as a float,
    # where each count's is NVML's int (its scale is the int 1)
    return HealthLayer(**figures), totals if totals is not None else previous  # type: ignore[arg-type]


def _shares(previous: ClockEventTotals | None,
            current: ClockEventTotals | None) -> dict[str, float | None]:
    """Each counted reason's share of the interval: its nanoseconds over the interval's, at
    most 1 (NVML's clock and ours are not the same). None without two readings, or when a
    counter went backwards (a driver reload). Without a previous reading a counted reason has
    no share yet: its current bit (held at this instant or not, 0 or 1) is no share of an
    interval, and a window's mean of shares that began with it was off by up to 1/cycles."""
    if current is None:
        return {}
    if previous is None or current.t <= previous.t:
        return dict.fromkeys(current.ns)
    span_ns = (current.t - previous.t) * 1e9
    out: dict[str, float | None] = {}
    for attr, ns in current.ns.items():
        before = previous.ns.get(attr)
        out[attr] = (None if before is None or ns < before
                     else min(1.0, (ns - before) / span_ns))
    return out


def current_link(device: Any, caps: HealthCaps,
                 failures: Failures) -> tuple[int | None, int | None, float | None]:
    """(generation, width, per-direction bytes/s) of the PCIe link as trained now."""
    if not caps.current_link:
        return None, None, None
    generation = failures.call("current_link_generation",
                               nvml.nvmlDeviceGetCurrPcieLinkGeneration, device)
    width = failures.call("current_link_width", nvml.nvmlDeviceGetCurrPcieLinkWidth, device)
    rate = link_max_bytes_per_second(generation, width) if generation and width else None
    return generation, width, rate
