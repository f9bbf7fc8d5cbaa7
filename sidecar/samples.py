"""Three-layer samples and their conversion into labelled series (Contract 1).

A sample is what one cycle learned about one GPU; ``None`` in a field means the GPU could not give
that figure, and it becomes an absent series, never a zero.

The records made afresh for every GPU on every cycle (the three layers, the sample, the series)
are NamedTuples; the rest are frozen dataclasses. Both are immutable, but a frozen dataclass pays
one ``object.__setattr__`` per field to build (about 0.1 us each), which at 25 records per GPU per
cycle was most of the agent's own CPU time (bench/bench_sampler.py, bench/RESULTS.md).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

Labels = tuple[tuple[str, str], ...]


class Series(NamedTuple):
    """One value of one series at one time.

    The most numerous record (about 20 per GPU per cycle), built from one tuple in ``sample_series``."""

    name: str
    labels: Labels
    value: float
    timestamp_ms: int


_new = tuple.__new__  # a NamedTuple from one tuple in field order, without keyword handling


@dataclass(frozen=True, slots=True)
class GpuIdentity:
    uuid: str
    name: str
    index: str
    pci_bus_id: str = ""
    architecture: str = ""
    parent_uuid: str = ""  # set for MIG instances


class ComputeLayer(NamedTuple):
    sm_occupancy_ratio: float | None = None
    tensor_core_util_ratio: float | None = None
    sm_active_ratio: float | None = None
    utilization_ratio: float | None = None


class MemoryLayer(NamedTuple):
    bandwidth_util_ratio: float | None = None
    controller_busy_ratio: float | None = None
    used_bytes: int | None = None
    total_bytes: int | None = None
    reserved_bytes: int | None = None


class IoLayer(NamedTuple):
    pcie_tx_bytes_per_second: float | None = None
    pcie_rx_bytes_per_second: float | None = None
    pcie_link_max_bytes_per_second: float | None = None
    pcie_link_generation: int | None = None
    pcie_link_width: int | None = None
    pcie_replay_errors: int | None = None
    nvlink_tx_bytes_per_second: float | None = None
    nvlink_rx_bytes_per_second: float | None = None


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
    counts: tuple[int, ...]
    sum_seconds: float

    @property
    def count(self) -> int:
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


class GpuSample(NamedTuple):
    identity: GpuIdentity
    timestamp_ms: int
    compute: ComputeLayer = ComputeLayer()
    memory: MemoryLayer = MemoryLayer()
    io: IoLayer = IoLayer()
    app: AppFigures = AppFigures()


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


# the per-GPU series: the fields of the three layers in order, then the two PCIe ratios
_LAYER_NAMES = (
    "gpu_sm_occupancy_ratio", "gpu_tensor_core_util_ratio", "gpu_sm_active_ratio",
    "gpu_utilization_ratio",
    "gpu_mem_bandwidth_util_ratio", "gpu_memory_controller_busy_ratio", "gpu_memory_used_bytes",
    "gpu_memory_total_bytes", "gpu_memory_reserved_bytes",
    "gpu_pcie_tx_bytes_per_second", "gpu_pcie_rx_bytes_per_second",
    "gpu_pcie_link_max_bytes_per_second", "gpu_pcie_link_generation", "gpu_pcie_link_width",
    "gpu_pcie_replay_errors_total", "gpu_nvlink_tx_bytes_per_second",
    "gpu_nvlink_rx_bytes_per_second",
    "gpu_pcie_tx_bandwidth_util_ratio", "gpu_pcie_rx_bandwidth_util_ratio",
)


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
    tx, rx = io.pcie_tx_bytes_per_second, io.pcie_rx_bytes_per_second
    values = (*sample.compute, *sample.memory, *io,
              None if tx is None or not link else tx / link,
              None if rx is None or not link else rx / link)
    out = [_new(Series, (name, labels, float(value), ts))
           for name, value in zip(_LAYER_NAMES, values, strict=True) if value is not None]
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
        yield Series("gpu_app_process_reserved_bytes", own, float(a.reserved_bytes), ts)
        yield Series("gpu_app_process_allocated_bytes", own, float(a.allocated_bytes), ts)
        frag = ratio(a.reserved_bytes - a.allocated_bytes, a.reserved_bytes)
        if frag is not None:
            yield Series("gpu_app_process_fragmentation_ratio", own, frag, ts)


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
                yield _new(Series, (name, labels, float(value), ts))

    hist = app.latency
    if hist is not None:
        yield from histogram_series("inference_request_duration_seconds", labels, hist, ts)


def histogram_series(
    name: str, labels: Labels, hist: LatencyHistogram, ts: int
) -> Iterator[Series]:
    bucket = f"{name}_bucket"
    for le_labels, count in zip(bucket_labels(labels, hist.bounds), hist.counts, strict=True):
        yield _new(Series, (bucket, le_labels, float(count), ts))
    yield _new(Series, (f"{name}_sum", labels, float(hist.sum_seconds), ts))
    yield _new(Series, (f"{name}_count", labels, float(hist.count), ts))


@functools.lru_cache(maxsize=1024)
def bucket_labels(labels: Labels, bounds: tuple[float, ...]) -> tuple[Labels, ...]:
    """The labels of each bucket, ``+Inf`` last: the same every cycle for a GPU and a layout,
    so they are sorted and formatted once rather than for every bucket of every cycle."""
    return (*(with_labels(labels, le=format_bound(b)) for b in bounds), with_labels(labels, le="+Inf"))
