"""Layered samples (compute, memory, IO, health) and their conversion into labelled series
(Contract 1).

A sample is what one cycle learned about one GPU; ``None`` in a field means the GPU could not give
that figure, and it becomes an absent series, never a zero.

Every record is built by keyword. The four NVML layers (``sidecar.layers``) are generated from
the metric table (``sidecar.metrics.TABLE``: an entry with ``field=`` is a field of its layer),
with each field's series name beside it (``LAYER_METRICS``), so the name travels with the field:
reordering, adding or renaming figures cannot mislabel a series. Shares (``ratio_of=``) are
computed here from the two series the table names. ``Series`` stays a NamedTuple because the
sinks and encoders downstream treat it as one (unpacking, equality, sorting); it is built by
keyword all the same.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from sidecar import metrics, protocol
from sidecar.layers import LAYER_METRICS, ComputeLayer, HealthLayer, IoLayer, Layer, MemoryLayer

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


LAYERS: tuple[type[Layer], ...] = (ComputeLayer, MemoryLayer, IoLayer, HealthLayer)
# every figure absent: a sample's defaults, typed layer by layer (one tuple type for all four
# would not say which is which)
_UNREAD: tuple[ComputeLayer, MemoryLayer, IoLayer, HealthLayer] = (
    ComputeLayer(), MemoryLayer(), IoLayer(), HealthLayer())


def layer_figures(layer: Layer) -> Iterator[tuple[str, float]]:
    """(series name, value) of every figure ``layer`` holds, absent ones left out."""
    for attr, name in LAYER_METRICS[type(layer)]:
        value = getattr(layer, attr)
        if value is not None:
            yield name, value


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

    allocators: tuple[protocol.Allocator, ...] = ()  # as the app socket decoded them
    latency: LatencyHistogram | None = None
    alloc_retries: int | None = None
    ooms: int | None = None


@dataclass(frozen=True, slots=True)
class GpuSample:
    identity: GpuIdentity
    timestamp_ms: int
    compute: ComputeLayer = _UNREAD[0]
    memory: MemoryLayer = _UNREAD[1]
    io: IoLayer = _UNREAD[2]
    health: HealthLayer = _UNREAD[3]
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


def sample_values(sample: GpuSample) -> dict[str, float | int]:
    """Series name -> value of every figure NVML's reading gave, in the layers' order, then the
    shares of them: what ``sample_series`` exports, and what the agent's judge reads of the
    sample (``sidecar.judge.cycle``), the same values by construction."""
    read: dict[str, float | int] = {}
    for layer in (sample.compute, sample.memory, sample.io, sample.health):
        for attr, name in LAYER_METRICS[type(layer)]:
            value = getattr(layer, attr)
            if value is not None:
                read[name] = value
    for m in metrics.RATIOS:
        value = ratio(read.get(m.ratio_of[0]), read.get(m.ratio_of[1]))  # type: ignore[index]
        if value is not None:
            read[m.name] = value
    return read


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
    read = sample_values(sample)
    out = [Series(name=name, labels=labels, value=float(value), timestamp_ms=ts)
           for name, value in read.items()]
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


def app_values(app: AppFigures) -> tuple[tuple[str, float | int | None], ...]:
    """The app's figures of one GPU, one value each however many processes use it
    (cardinality): bytes summed over the live processes, ratios computed from those sums, the
    largest free block of any one process (a request is served from one process's cache), and
    how many processes there are. None: absent. Exported by ``sample_series`` and read by the
    agent's judge (``sidecar.judge.cycle``) alike."""
    allocators = app.allocators
    if not allocators:
        return ()
    reserved = sum(a.reserved_bytes for a in allocators)
    allocated = sum(a.allocated_bytes for a in allocators)
    largest = [a.largest_free_block_bytes for a in allocators
               if a.largest_free_block_bytes is not None]
    private = [a.private_pool_bytes for a in allocators if a.private_pool_bytes is not None]
    retries = app.alloc_retries if app.alloc_retries is not None else \
        sum(a.alloc_retries for a in allocators)
    ooms = app.ooms if app.ooms is not None else sum(a.ooms for a in allocators)
    return (
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


def _app_series(app: AppFigures, labels: Labels, ts: int) -> Iterator[Series]:
    """The app's series of one GPU (``app_values``) and its request-latency histogram."""
    for name, value in app_values(app):
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
