"""Layered samples (compute, memory, IO, health) and their conversion into labelled series
(Contract 1).

A sample is what one cycle learned about one GPU; ``None`` in a field means the GPU could not give
that figure, and it becomes an absent series, never a zero.

Every record is built by keyword. Each field of the three layers names its own series
(``metric=`` in its definition), so the series name travels with the field: reordering, adding
or renaming fields cannot mislabel a series, and a layer field without a series name is an error
at import. ``Series`` stays a NamedTuple because the sinks and encoders downstream treat it as
one (unpacking, equality, sorting); it is built by keyword all the same.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

Labels = tuple[tuple[str, str], ...]


class Series(NamedTuple):
    """One value of one series at one time."""

    name: str
    labels: Labels
    value: float
    timestamp_ms: int


@dataclass(frozen=True, slots=True)
class GpuIdentity:
    uuid: str
    name: str
    index: str
    pci_bus_id: str = ""
    architecture: str = ""
    parent_uuid: str = ""  # set for MIG instances


def _figure(metric: str) -> Any:
    """A layer field: absent (None) unless read, exported as the series ``metric``."""
    return field(default=None, metadata={"metric": metric})


@dataclass(frozen=True, slots=True)
class ComputeLayer:
    sm_occupancy_ratio: float | None = _figure("gpu_sm_occupancy_ratio")
    tensor_core_util_ratio: float | None = _figure("gpu_tensor_core_util_ratio")
    sm_active_ratio: float | None = _figure("gpu_sm_active_ratio")
    utilization_ratio: float | None = _figure("gpu_utilization_ratio")


@dataclass(frozen=True, slots=True)
class MemoryLayer:
    bandwidth_util_ratio: float | None = _figure("gpu_mem_bandwidth_util_ratio")
    controller_busy_ratio: float | None = _figure("gpu_memory_controller_busy_ratio")
    used_bytes: int | None = _figure("gpu_memory_used_bytes")
    total_bytes: int | None = _figure("gpu_memory_total_bytes")
    reserved_bytes: int | None = _figure("gpu_memory_reserved_bytes")


@dataclass(frozen=True, slots=True)
class IoLayer:
    pcie_tx_bytes_per_second: float | None = _figure("gpu_pcie_tx_bytes_per_second")
    pcie_rx_bytes_per_second: float | None = _figure("gpu_pcie_rx_bytes_per_second")
    pcie_link_max_bytes_per_second: float | None = _figure("gpu_pcie_link_max_bytes_per_second")
    pcie_link_generation: int | None = _figure("gpu_pcie_link_generation")
    pcie_link_width: int | None = _figure("gpu_pcie_link_width")
    pcie_replay_errors: int | None = _figure("gpu_pcie_replay_errors_total")
    # the link as trained now: below the maximum while traffic flows, it is degraded (idle links
    # train down to save power, so a low figure alone says nothing)
    pcie_link_current_generation: int | None = _figure("gpu_pcie_link_current_generation")
    pcie_link_current_width: int | None = _figure("gpu_pcie_link_current_width")
    pcie_link_current_bytes_per_second: float | None = _figure(
        "gpu_pcie_link_current_bytes_per_second")
    nvlink_tx_bytes_per_second: float | None = _figure("gpu_nvlink_tx_bytes_per_second")
    nvlink_rx_bytes_per_second: float | None = _figure("gpu_nvlink_rx_bytes_per_second")
    # Grace Hopper / Grace Blackwell: host traffic goes over NVLink-C2C, not PCIe
    c2c_tx_bytes_per_second: float | None = _figure("gpu_c2c_tx_bytes_per_second")
    c2c_rx_bytes_per_second: float | None = _figure("gpu_c2c_rx_bytes_per_second")
    c2c_link_max_bytes_per_second: float | None = _figure("gpu_c2c_link_max_bytes_per_second")


@dataclass(frozen=True, slots=True)
class HealthLayer:
    """Why else a busy GPU is slow, and whether it is about to fail: clocks and what limits
    them, power, heat, link errors, ECC and row remapping. Counters are NVML's own (since the
    driver loaded, or for aggregate ECC over the GPU's life); shares are of the last interval."""

    sm_clock_hertz: float | None = _figure("gpu_sm_clock_hertz")
    sm_clock_max_hertz: float | None = _figure("gpu_sm_clock_max_hertz")
    memory_clock_hertz: float | None = _figure("gpu_memory_clock_hertz")
    memory_clock_max_hertz: float | None = _figure("gpu_memory_clock_max_hertz")
    # share of the interval the clocks were held down by each reason: from NVML's nanosecond
    # counters where the driver has them, else the reason bitmask at the reading (0 or 1)
    power_cap_ratio: float | None = _figure("gpu_clocks_event_power_cap_ratio")
    hw_slowdown_ratio: float | None = _figure("gpu_clocks_event_hw_slowdown_ratio")
    hw_thermal_ratio: float | None = _figure("gpu_clocks_event_hw_thermal_ratio")
    hw_power_brake_ratio: float | None = _figure("gpu_clocks_event_hw_power_brake_ratio")
    sw_thermal_ratio: float | None = _figure("gpu_clocks_event_sw_thermal_ratio")
    sync_boost_ratio: float | None = _figure("gpu_clocks_event_sync_boost_ratio")
    power_watts: float | None = _figure("gpu_power_usage_watts")
    power_limit_watts: float | None = _figure("gpu_power_limit_watts")
    temperature_celsius: float | None = _figure("gpu_temperature_celsius")
    memory_temperature_celsius: float | None = _figure("gpu_memory_temperature_celsius")
    pcie_l0_to_recovery: int | None = _figure("gpu_pcie_l0_to_recovery_total")
    pcie_correctable_errors: int | None = _figure("gpu_pcie_correctable_errors_total")
    pcie_nonfatal_errors: int | None = _figure("gpu_pcie_nonfatal_errors_total")
    pcie_fatal_errors: int | None = _figure("gpu_pcie_fatal_errors_total")
    pcie_naks_received: int | None = _figure("gpu_pcie_naks_received_total")
    pcie_naks_sent: int | None = _figure("gpu_pcie_naks_sent_total")
    pcie_receiver_errors: int | None = _figure("gpu_pcie_receiver_errors_total")
    pcie_bad_tlp: int | None = _figure("gpu_pcie_bad_tlp_total")
    pcie_bad_dllp: int | None = _figure("gpu_pcie_bad_dllp_total")
    pcie_lcrc_errors: int | None = _figure("gpu_pcie_lcrc_errors_total")
    pcie_unsupported_requests: int | None = _figure("gpu_pcie_unsupported_requests_total")
    pcie_lane_errors: int | None = _figure("gpu_pcie_lane_errors_total")
    ecc_corrected_volatile: int | None = _figure("gpu_ecc_corrected_volatile_total")
    ecc_uncorrected_volatile: int | None = _figure("gpu_ecc_uncorrected_volatile_total")
    ecc_corrected_aggregate: int | None = _figure("gpu_ecc_corrected_aggregate_total")
    ecc_uncorrected_aggregate: int | None = _figure("gpu_ecc_uncorrected_aggregate_total")
    remapped_rows_correctable: int | None = _figure("gpu_remapped_rows_correctable")
    remapped_rows_uncorrectable: int | None = _figure("gpu_remapped_rows_uncorrectable")
    row_remap_pending: int | None = _figure("gpu_row_remap_pending")
    row_remap_failed: int | None = _figure("gpu_row_remap_failed")
    last_xid: int | None = _figure("gpu_last_xid")


Layer = ComputeLayer | MemoryLayer | IoLayer | HealthLayer
LAYERS: tuple[type[Layer], ...] = (ComputeLayer, MemoryLayer, IoLayer, HealthLayer)


def _layer_metrics() -> dict[type[Layer], tuple[tuple[str, str], ...]]:
    """layer class -> ((field name, series name), ...) in field order, read from the fields'
    own definitions. A field that names no series, or two that name the same one, fail here, at
    import, rather than going unexported or overwriting each other."""
    out = {}
    for layer in LAYERS:
        for f in fields(layer):
            if "metric" not in f.metadata:
                raise TypeError(f"{layer.__name__}.{f.name} names no series: use _figure()")
        out[layer] = tuple((f.name, f.metadata["metric"]) for f in fields(layer))
    names = [name for pairs in out.values() for _, name in pairs]
    if len(set(names)) != len(names):
        raise TypeError(f"two layer fields name the same series: {sorted(names)}")
    return out


LAYER_METRICS = _layer_metrics()


def layer_figures(layer: Layer) -> Iterator[tuple[str, float]]:
    """(series name, value) of every figure ``layer`` holds, absent ones left out."""
    for attr, name in LAYER_METRICS[type(layer)]:
        value = getattr(layer, attr)
        if value is not None:
            yield name, value


@dataclass(frozen=True, slots=True)
class AllocatorFigures:
    """What one process's caching allocator said about one GPU."""

    pid: int
    reserved_bytes: int
    allocated_bytes: int
    active_bytes: int
    inactive_split_bytes: int
    alloc_retries: int
    ooms: int
    largest_free_block_bytes: int | None = None
    private_pool_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class LatencyHistogram:
    """Cumulative request-latency buckets; ``counts[i]`` counts requests <= ``bounds[i]``,
    the last entry is +Inf."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]  # whole numbers from the app; an engine's text may say 3.0
    sum_seconds: float

    @property
    def count(self) -> float:
        return self.counts[-1]


@dataclass(frozen=True, slots=True)
class AppFigures:
    """What the GPU's live processes said. ``alloc_retries`` and ``ooms`` are the agent's own
    counters over every process the GPU has had (they survive a process restart, as the
    latency histogram does); None takes the sum of the live processes' figures."""

    allocators: tuple[AllocatorFigures, ...] = ()
    latency: LatencyHistogram | None = None
    alloc_retries: int | None = None
    ooms: int | None = None


@dataclass(frozen=True, slots=True)
class GpuSample:
    identity: GpuIdentity
    timestamp_ms: int
    compute: ComputeLayer = ComputeLayer()
    memory: MemoryLayer = MemoryLayer()
    io: IoLayer = IoLayer()
    health: HealthLayer = HealthLayer()
    app: AppFigures = AppFigures()
    xids: tuple[tuple[int, int], ...] = ()  # (Xid code, count since the agent started), by code


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def gpu_labels(identity: GpuIdentity, pod: Mapping[str, str]) -> Labels:
    base = {"gpu_uuid": identity.uuid, "gpu_name": identity.name, "gpu_index": identity.index}
    base.update(pod)
    return tuple(sorted(base.items()))


def with_labels(labels: Labels, **extra: str) -> Labels:
    return tuple(sorted((*labels, *extra.items())))


def format_bound(bound: float) -> str:
    """Bucket bounds the way Prometheus clients write them (``0.1``, ``1.0``, ``+Inf``)."""
    return repr(float(bound))


def sample_series(
    sample: GpuSample, pod: Mapping[str, str], labels: Labels | None = None, *,
    per_process: bool = False,
) -> list[Series]:
    """Every series of one sample, named and labelled as Contract 1 says.

    ``labels`` are the GPU's labels (``gpu_labels(sample.identity, pod)``) when the caller keeps
    them from cycle to cycle. ``per_process`` adds the opt-in ``gpu_app_process_*`` series."""
    if labels is None:
        labels = gpu_labels(sample.identity, pod)
    ts = sample.timestamp_ms
    io = sample.io
    link = io.pcie_link_max_bytes_per_second
    current = io.pcie_link_current_bytes_per_second
    c2c = io.c2c_link_max_bytes_per_second
    figures = [*layer_figures(sample.compute), *layer_figures(sample.memory),
               *layer_figures(io), *layer_figures(sample.health),
               ("gpu_pcie_tx_bandwidth_util_ratio", ratio(io.pcie_tx_bytes_per_second, link)),
               ("gpu_pcie_rx_bandwidth_util_ratio", ratio(io.pcie_rx_bytes_per_second, link)),
               ("gpu_pcie_tx_current_link_util_ratio", ratio(io.pcie_tx_bytes_per_second, current)),
               ("gpu_pcie_rx_current_link_util_ratio", ratio(io.pcie_rx_bytes_per_second, current)),
               ("gpu_c2c_tx_bandwidth_util_ratio", ratio(io.c2c_tx_bytes_per_second, c2c)),
               ("gpu_c2c_rx_bandwidth_util_ratio", ratio(io.c2c_rx_bytes_per_second, c2c))]
    out = [Series(name=name, labels=labels, value=float(value), timestamp_ms=ts)
           for name, value in figures if value is not None]
    out.extend(Series(name="gpu_xid_errors_total", labels=with_labels(labels, xid=str(code)),
                      value=float(count), timestamp_ms=ts) for code, count in sample.xids)
    app = sample.app
    if app.allocators or app.latency is not None:
        out.extend(_app_series(app, labels, ts))
        if per_process:
            out.extend(_process_series(app, labels, ts))
    return out


def _process_series(app: AppFigures, labels: Labels, ts: int) -> Iterator[Series]:
    """Opt-in: a few series per live process, labelled by pid. Bounded by the app state's
    per-GPU process limit; every restarted worker is a new series for the receiver."""
    for a in app.allocators:
        own = with_labels(labels, pid=str(a.pid))
        yield Series(name="gpu_app_process_reserved_bytes", labels=own,
                     value=float(a.reserved_bytes), timestamp_ms=ts)
        yield Series(name="gpu_app_process_allocated_bytes", labels=own,
                     value=float(a.allocated_bytes), timestamp_ms=ts)
        frag = ratio(a.reserved_bytes - a.allocated_bytes, a.reserved_bytes)
        if frag is not None:
            yield Series(name="gpu_app_process_fragmentation_ratio", labels=own, value=frag,
                         timestamp_ms=ts)


def _app_series(app: AppFigures, labels: Labels, ts: int) -> Iterator[Series]:
    """One set of series per GPU however many processes use it (cardinality): bytes summed over
    the live processes, ratios computed from those sums, the largest free block of any one
    process (a request is served from one process's cache), and how many processes there are."""
    allocators = app.allocators
    if allocators:
        reserved = sum(a.reserved_bytes for a in allocators)
        allocated = sum(a.allocated_bytes for a in allocators)
        largest = [a.largest_free_block_bytes for a in allocators
                   if a.largest_free_block_bytes is not None]
        private = [a.private_pool_bytes for a in allocators if a.private_pool_bytes is not None]
        retries = app.alloc_retries if app.alloc_retries is not None else \
            sum(a.alloc_retries for a in allocators)
        ooms = app.ooms if app.ooms is not None else sum(a.ooms for a in allocators)
        fig: tuple[tuple[str, float | int | None], ...] = (
            ("gpu_memory_fragmentation_ratio", ratio(reserved - allocated, reserved)),
            ("gpu_allocator_nonreleasable_ratio",
             ratio(sum(a.inactive_split_bytes for a in allocators), reserved)),
            ("gpu_allocator_largest_free_block_bytes", max(largest) if largest else None),
            ("gpu_allocator_reserved_bytes", reserved),
            ("gpu_allocator_allocated_bytes", allocated),
            ("gpu_allocator_private_pool_bytes", sum(private) if private else None),
            ("gpu_allocator_alloc_retries_total", retries),
            ("gpu_allocator_ooms_total", ooms),
            ("gpu_app_processes", len(allocators)),
        )
        for name, value in fig:
            if value is not None:
                yield Series(name=name, labels=labels, value=float(value), timestamp_ms=ts)

    hist = app.latency
    if hist is not None:
        yield from histogram_series("inference_request_duration_seconds", labels, hist, ts)


def histogram_series(
    name: str, labels: Labels, hist: LatencyHistogram, ts: int
) -> Iterator[Series]:
    bucket = f"{name}_bucket"
    for le_labels, count in zip(bucket_labels(labels, hist.bounds), hist.counts, strict=True):
        yield Series(name=bucket, labels=le_labels, value=float(count), timestamp_ms=ts)
    yield Series(name=f"{name}_sum", labels=labels, value=float(hist.sum_seconds),
                 timestamp_ms=ts)
    yield Series(name=f"{name}_count", labels=labels, value=float(hist.count), timestamp_ms=ts)


@functools.lru_cache(maxsize=1024)
def bucket_labels(labels: Labels, bounds: tuple[float, ...]) -> tuple[Labels, ...]:
    """The labels of each bucket, ``+Inf`` last: the same every cycle for a GPU and a layout,
    so they are sorted and formatted once rather than for every bucket of every cycle."""
    return (*(with_labels(labels, le=format_bound(b)) for b in bounds), with_labels(labels, le="+Inf"))
