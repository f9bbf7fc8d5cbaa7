"""One cycle's reading of one GPU, through pynvml's public functions.

The read follows the choices detection made (``capabilities.py``): it asks only for what the GPU
can give. Rates need two readings, so each GPU keeps the previous counters and GPM sample in a
``ReadState``; the first reading after start or after a lost GPU comes back gives no rate
(absent, not zero). A read that fails for a passing reason costs only its figures this cycle; a
lost GPU raises ``GpuLost``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pynvml

from sidecar.metrics import RARE_READ_S
from sidecar.samples import ComputeLayer, HealthLayer, IoLayer, MemoryLayer, layer_figures
from sidecar.sources.nvml.capabilities import (
    FI_NVL_RX,
    FI_NVL_TX,
    FI_REPLAY,
    FI_RX,
    FI_TX,
    Capabilities,
    CounterValue,
    FieldId,
    field_value,
)
from sidecar.sources.nvml.errors import Failures, GpuLost
from sidecar.sources.nvml.health import ClockEventTotals, current_link, read_health
from sidecar.sources.nvml.processes import ProcessState
from sidecar.sources.nvml.timed import nvml
from sidecar.sources.pcie import counter_rate

GPM_MIN_INTERVAL_S = 0.1  # NVML's minimum between two GPM samples
NVLINK_LINK_CEILING_BYTES_PER_SECOND = 4 * 50e9  # per link and direction; beyond: a reset
KIB = 1024


@dataclass(frozen=True, slots=True)
class NvmlReading:
    """What NVML said about one GPU in one cycle; None in a field: absent."""

    compute: ComputeLayer
    memory: MemoryLayer
    io: IoLayer
    health: HealthLayer = field(default_factory=HealthLayer)
    xids: tuple[tuple[int, int], ...] = ()  # (Xid code, count), from the Xid watcher


@dataclass(frozen=True, slots=True)
class Handles:
    """How to address a GPU: its handle, and for a MIG instance the parent GPU's handle and the
    GPU instance id (GPM samples a MIG instance through its parent)."""

    device: Any
    parent: Any = None
    gpu_instance_id: int | None = None

    @property
    def is_mig(self) -> bool:
        return self.parent is not None


@dataclass(frozen=True, slots=True)
class Totals:
    """Two cumulative counters (TX, RX) at one time, for the next cycle's rate."""

    t: float
    tx: int
    rx: int


@dataclass(slots=True)
class ReadState:
    """What one GPU's next reading needs from this one.

    GPM averages between two samples: the two buffers alternate, so each cycle's sample is the
    next cycle's starting point without a copy."""

    gpm_samples: tuple[Any, ...] = ()
    gpm_request: Any = None  # the GPM metrics request, built once (see gpm_request)
    gpm_next: int = 1  # which buffer the next sample goes into
    gpm_prev_t: float | None = None
    pcie: Totals | None = None  # bytes
    nvlink: Totals | None = None  # KiB, summed over links
    clock_events: ClockEventTotals | None = None  # ns in each clock-limiting reason
    rare: dict[FieldId, CounterValue | None] = field(default_factory=dict)  # the last answer
    rare_t: float | None = None  # when the rare figures were last asked for
    power_limit_watts: float | None = None  # the last answer, asked for with the rare ones
    # the PCIe throughput fallback (source.py): when its last call was made, which direction
    # the next one samples (RX first: host-to-device copies), each direction's last rate (B/s)
    throughput_t: float | None = None
    throughput_next: int = pynvml.NVML_PCIE_UTIL_RX_BYTES
    throughput_tx: float | None = None
    throughput_rx: float | None = None
    # the process calls (processes.py), every PROCESS_READ_S, their figures carried between
    processes: ProcessState = field(default_factory=ProcessState)

    def forget(self) -> None:
        """The GPU was lost: counters and samples from before are no base for a rate."""
        self.pcie = self.nvlink = None
        self.throughput_t, self.throughput_tx, self.throughput_rx = None, None, None
        self.throughput_next = pynvml.NVML_PCIE_UTIL_RX_BYTES
        self.rare, self.rare_t, self.power_limit_watts = {}, None, None
        self.clock_events = None
        self.gpm_prev_t = None
        self.gpm_next = 1
        self.processes = ProcessState()


def read_gpu(handles: Handles, caps: Capabilities, state: ReadState, failures: Failures,
             now: float, xids: tuple[int | None, tuple[tuple[int, int], ...]] = (None, ()),
             *, rare_read_s: float = RARE_READ_S) -> NvmlReading:
    """One GPU's reading, less the PCIe throughput calls (``pcie == "throughput"``), which the
    source runs concurrently for every GPU and adds afterwards. ``xids``: the last Xid code and
    the counts by code, as the Xid watcher has them; ``rare_read_s``: how often the rare
    figures' field values are asked for."""
    device = handles.device
    mem = failures.call("memory", _memory_info, device, caps.memory) if caps.memory else None
    util = (failures.call("utilization", nvml.nvmlDeviceGetUtilizationRates, device)
            if caps.utilization else None)
    # the rare figures (error counters, the power limit) are asked for every ``rare_read_s``
    rare_due = state.rare_t is None or not 0 <= now - state.rare_t < rare_read_s
    if rare_due:
        state.rare_t = now  # unset by a refused field-values call: all asked again next cycle
    values = _field_values(device, caps, state, failures, rare_due)
    gpm = _gpm_figures(handles, caps, state, failures, now)

    pcie, nvlink = _link_rates(values, gpm, caps, state, now)
    replay = _replay_errors(device, caps, values, failures)
    health = _health(handles, caps, values, state, failures, now, xids[0], rare_due)
    link = current_link(device, caps.health, failures)  # the link as trained now
    reading = NvmlReading(
        compute=ComputeLayer(
            sm_occupancy_ratio=gpm.get("sm_occupancy_ratio"),
            tensor_core_util_ratio=gpm.get("tensor_core_util_ratio"),
            sm_active_ratio=gpm.get("sm_active_ratio"),
            utilization_ratio=None if util is None else util.gpu / 100.0,
        ),
        memory=MemoryLayer(
            bandwidth_util_ratio=gpm.get("bandwidth_util_ratio"),
            controller_busy_ratio=None if util is None else util.memory / 100.0,
            used_bytes=None if mem is None else mem.used,
            total_bytes=None if mem is None else mem.total,
            reserved_bytes=mem.reserved if mem is not None and caps.memory == "v2" else None,
        ),
        io=_io_layer(caps, gpm, pcie, nvlink, replay, link),
        health=health,
        xids=xids[1],
    )
    if len(failures.failing) >= 2 and _nothing_read(reading):
        # the driver went away or NVML was unloaded: report the GPU unavailable and re-open it
        # later, rather than a reading of nothing but its static link figures
        raise GpuLost("no reading succeeded: " + ", ".join(sorted(failures.failing)))
    return reading


Rates = tuple[float | None, float | None]  # (tx, rx) bytes per second


def _link_rates(values: dict[FieldId, CounterValue | None], gpm: dict[str, float],
                caps: Capabilities, state: ReadState, now: float) -> tuple[Rates, Rates]:
    """PCIe and NVLink (tx, rx) from whichever source the GPU has: the byte counters among the
    field values, or GPM's figures; no NVML call of its own (the throughput call is the
    source's, run concurrently for every GPU)."""
    pcie: Rates = (None, None)
    if caps.pcie == "counters":
        pcie = _pcie_rates(values, caps, state, now)
    elif caps.pcie == "gpm":
        pcie = gpm.get("pcie_tx_bytes_per_second"), gpm.get("pcie_rx_bytes_per_second")
    nvlink: Rates = (None, None)
    if caps.nvlink == "counters":
        nvlink = _nvlink_rates(values, caps, state, now)
    elif caps.nvlink == "gpm":
        nvlink = gpm.get("nvlink_tx_bytes_per_second"), gpm.get("nvlink_rx_bytes_per_second")
    return pcie, nvlink


def _replay_errors(device: Any, caps: Capabilities, values: dict[FieldId, CounterValue | None],
                   failures: Failures) -> int | None:
    """The PCIe replay counter: a field value where the driver has it, else its own call."""
    if caps.replay == "field":
        return _value(values.get((FI_REPLAY, 0)))
    if caps.replay == "call":
        return failures.call("replay", nvml.nvmlDeviceGetPcieReplayCounter, device)
    return None


def _health(handles: Handles, caps: Capabilities, values: dict[FieldId, CounterValue | None],
            state: ReadState,
            failures: Failures, now: float, xid: int | None, rare_due: bool) -> HealthLayer:
    """The health layer, left empty for a MIG instance. The power limit is asked for with the
    rare figures, and again next cycle after a refusal (a refusal is never carried)."""
    if handles.is_mig:
        return HealthLayer()
    if caps.health.power_limit and (rare_due or state.power_limit_watts is None):
        mw = failures.call("power_limit", nvml.nvmlDeviceGetEnforcedPowerLimit, handles.device)
        state.power_limit_watts = None if mw is None else mw / 1000  # None: asked again
    health, state.clock_events = read_health(handles.device, caps.health, values,
                                             state.clock_events, failures, now, xid,
                                             state.power_limit_watts)
    return health


def _io_layer(caps: Capabilities, gpm: dict[str, float], pcie: Rates, nvlink: Rates,
              replay: int | None, link: tuple[int | None, int | None, float | None]) -> IoLayer:
    """The links' layer: the rates read this cycle beside the static link figures of the
    capabilities and the link as currently trained (``current_link``)."""
    generation, width, trained = link
    return IoLayer(
        pcie_tx_bytes_per_second=pcie[0],
        pcie_rx_bytes_per_second=pcie[1],
        pcie_link_max_bytes_per_second=caps.link.max_bytes_per_second,
        pcie_link_generation=caps.link.generation,
        pcie_link_width=caps.link.width,
        pcie_replay_errors=replay,
        pcie_link_current_generation=generation,
        pcie_link_current_width=width,
        pcie_link_current_bytes_per_second=trained,
        nvlink_tx_bytes_per_second=nvlink[0],
        nvlink_rx_bytes_per_second=nvlink[1],
        nvlink_link_max_bytes_per_second=caps.nvlink_max_bytes_per_second,
        c2c_tx_bytes_per_second=gpm.get("c2c_tx_bytes_per_second"),
        c2c_rx_bytes_per_second=gpm.get("c2c_rx_bytes_per_second"),
        c2c_link_max_bytes_per_second=caps.health.c2c_link_max_bytes_per_second,
    )


def _nothing_read(reading: NvmlReading) -> bool:
    """No figure that NVML is asked for each cycle came back (the link figures are static)."""
    io = reading.io
    return (next(layer_figures(reading.compute), None) is None
            and next(layer_figures(reading.memory), None) is None
            and io.pcie_tx_bytes_per_second is None and io.pcie_replay_errors is None)


def _memory_info(device: Any, version: str) -> Any:
    if version == "v2":
        return nvml.nvmlDeviceGetMemoryInfo(device, version=pynvml.nvmlMemory_v2)
    return nvml.nvmlDeviceGetMemoryInfo(device)


def _field_values(device: Any, caps: Capabilities, state: ReadState, failures: Failures,
                  rare_due: bool) -> dict[FieldId, CounterValue | None]:
    """This cycle's field values by (field id, scope), in one call: those that move, and the
    rare ones when ``rare_due`` (else their last answer). Empty when none were asked for or the
    call failed (the rare ones are then asked again next cycle)."""
    ids = caps.field_ids + caps.rare_field_ids if rare_due else caps.field_ids
    if not ids:
        return dict(state.rare)
    values = failures.call("field_values", nvml.nvmlDeviceGetFieldValues, device, list(ids))
    if values is None:
        if rare_due:
            state.rare, state.rare_t = {}, None
        return {}
    # NVML answers in the caller's array, entry for entry: each id is where it was asked for
    # (reading fieldId and scopeId back would cost two of pynvml's converting reads a value)
    got = {key: field_value(fv) for key, fv in zip(ids, values, strict=True)}
    if rare_due:
        state.rare = {key: got[key] for key in caps.rare_field_ids}
    else:
        got.update(state.rare)
    return got


def _value(counter: CounterValue | None) -> int | None:
    return None if counter is None else counter.value


def _pcie_rates(values: dict[FieldId, CounterValue | None], caps: Capabilities,
                state: ReadState, now: float) -> tuple[float | None, float | None]:
    """(TX, RX) bytes/s from the cumulative byte counters, across at most one wrap."""
    tx, rx = values.get((FI_TX, 0)), values.get((FI_RX, 0))
    if tx is None or rx is None:
        return None, None  # the previous reading stays the base for the next rate
    prev, state.pcie = state.pcie, Totals(t=now, tx=tx.value, rx=rx.value)
    if prev is None:
        return None, None
    dt = now - prev.t
    if not dt < caps.pcie_max_dt:
        return None, None  # the counters may have wrapped twice
    # above four times the link: a counter reset, not traffic
    link = caps.link.max_bytes_per_second
    ceiling = 4 * link if link else None
    return (counter_rate(prev.tx, tx.value, dt, tx.bits, ceiling),
            counter_rate(prev.rx, rx.value, dt, rx.bits, ceiling))


def _nvlink_rates(values: dict[FieldId, CounterValue | None], caps: Capabilities,
                  state: ReadState, now: float) -> tuple[float | None, float | None]:
    """(TX, RX) bytes/s from the per-link KiB counters, summed over the links."""
    links = range(caps.nvlink_links)
    tx = [values.get((FI_NVL_TX, link)) for link in links]
    rx = [values.get((FI_NVL_RX, link)) for link in links]
    if any(v is None for v in (*tx, *rx)):
        return None, None  # a link that did not answer: no NVLink figure this cycle
    prev = state.nvlink
    state.nvlink = Totals(t=now, tx=sum(v.value for v in tx if v is not None),
                          rx=sum(v.value for v in rx if v is not None))
    if prev is None:
        return None, None
    dt = now - prev.t
    # above four times NVLink 5's 50 GB/s per link and direction: a reset
    ceiling = caps.nvlink_links * NVLINK_LINK_CEILING_BYTES_PER_SECOND / KIB
    tx_rate = counter_rate(prev.tx, state.nvlink.tx, dt, 64, ceiling)
    rx_rate = counter_rate(prev.rx, state.nvlink.rx, dt, 64, ceiling)
    return (None if tx_rate is None else tx_rate * KIB, None if rx_rate is None else rx_rate * KIB)


def _gpm_figures(handles: Handles, caps: Capabilities, state: ReadState, failures: Failures,
                 now: float) -> dict[str, float]:
    """Layer field -> GPM's average of it between the previous cycle's sample and this one's;
    empty on the first sample, when the sample failed, or when too soon after the last one."""
    if not caps.gpm:
        return {}
    prev_t = state.gpm_prev_t
    if prev_t is not None and now - prev_t < GPM_MIN_INTERVAL_S:
        failures.warn_once("gpm_interval", "gpm_interval_too_short",
                           interval_s=round(now - prev_t, 4), minimum_s=GPM_MIN_INTERVAL_S,
                           effect="GPM figures skipped for this cycle; raise --interval")
        return {}
    newer = state.gpm_samples[state.gpm_next]
    older = state.gpm_samples[1 - state.gpm_next]
    if failures.call("gpm_sample", _take_sample, handles, newer) is None:
        state.gpm_prev_t = None
        return {}
    state.gpm_next = 1 - state.gpm_next
    state.gpm_prev_t = now
    if prev_t is None:
        return {}
    request = state.gpm_request
    request.sample1, request.sample2 = older, newer
    got = failures.call("gpm_metrics", nvml.nvmlGpmMetricsGet, request)
    if got is None:
        return {}
    # the request holds NVML_GPM_METRIC_MAX entries; only the first len(gpm_figures) were asked
    return {figure.field: metric.value * figure.scale
            for figure, metric in zip(caps.gpm_figures, got.metrics, strict=False)
            if metric.nvmlReturn == pynvml.NVML_SUCCESS}


def _take_sample(handles: Handles, sample: Any) -> Any:
    if handles.is_mig:
        return nvml.nvmlGpmMigSampleGet(handles.parent, handles.gpu_instance_id, sample)
    return nvml.nvmlGpmSampleGet(handles.device, sample)


def gpm_request(caps: Capabilities) -> Any:
    """The GPM metrics request a GPU with GPM asks every cycle: the same metrics each time, so
    built once; each cycle sets only its two samples (NVML writes the answers over the last).
    None without GPM."""
    if not caps.gpm:
        return None
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = len(caps.gpm_figures)
    for i, figure in enumerate(caps.gpm_figures):
        request.metrics[i].metricId = figure.metric_id
    return request


def alloc_gpm_samples(caps: Capabilities) -> tuple[Any, ...]:
    """The two GPM sample buffers a GPU with GPM alternates between."""
    if not caps.gpm:
        return ()
    return (nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc())

