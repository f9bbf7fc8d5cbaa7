"""The verdict model: what one cycle's series say per GPU (``Figures``), a window of cycles folded
into means and increases (``Window``), and the judgement of a window against
``sidecar.thresholds`` (``Verdict``, ``Finding``). Pure functions and frozen records, shared by
``diagnose`` and the live table, so that the two (and the shipped alert rules, which take the
same thresholds) never disagree about where a layer stops being healthy.

What a verdict needs and what it yields:

- ``gpu-lost``: the GPU could not be read at the end of the window (a finding: exit 1);
- ``pcie`` (IO): either direction above ``pcie_util_ratio`` of the link, averaged over the window;
- ``fragmentation`` (memory): ``fragmented()`` on the window's mean ratio and allocator cache;
- ``allocator-retries`` (memory): any allocator retry or OOM during the window;
- ``low-occupancy`` (compute): mean SM occupancy below ``occupancy_ratio`` *and* the window's
  p99 above ``p99_latency_s``;
- ``none``: nothing crossed a threshold. A layer that could not be judged (no GPM before Hopper
  or on an old driver, no app figures) is said in a note, never passed off as healthy; it does
  not change the exit code, which says whether a bottleneck was found.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields

from sidecar import thresholds
from sidecar.samples import Series
from sidecar.summary import quantile as histogram_quantile
from sidecar.thresholds import Thresholds

GiB = 1024**3


@dataclass(frozen=True)
class Figures:
    """One GPU as the series of one cycle describe it (None: absent), or, in a ``Window``, the
    mean of the cycles that had the figure (counters: their last value)."""

    uuid: str
    name: str = ""
    index: str = ""
    available: bool = True
    utilization: float | None = None
    occupancy: float | None = None
    tensor: float | None = None
    sm_active: float | None = None
    dram_bw: float | None = None
    mem_used: float | None = None
    mem_total: float | None = None
    fragmentation: float | None = None
    nonreleasable: float | None = None
    alloc_reserved: float | None = None
    largest_free: float | None = None
    retries: float | None = None
    ooms: float | None = None
    pcie_tx: float | None = None
    pcie_rx: float | None = None
    pcie_tx_ratio: float | None = None
    pcie_rx_ratio: float | None = None
    link_max: float | None = None
    nvlink_tx: float | None = None
    nvlink_rx: float | None = None
    # cumulative request-latency buckets: upper bounds (+Inf last) and counts
    latency: tuple[tuple[float, ...], tuple[float, ...]] | None = None


_FIELD_OF = {
    "gpu_utilization_ratio": "utilization", "gpu_sm_occupancy_ratio": "occupancy",
    "gpu_tensor_core_util_ratio": "tensor", "gpu_sm_active_ratio": "sm_active",
    "gpu_mem_bandwidth_util_ratio": "dram_bw", "gpu_memory_used_bytes": "mem_used",
    "gpu_memory_total_bytes": "mem_total", "gpu_memory_fragmentation_ratio": "fragmentation",
    "gpu_allocator_nonreleasable_ratio": "nonreleasable",
    "gpu_allocator_reserved_bytes": "alloc_reserved",
    "gpu_allocator_largest_free_block_bytes": "largest_free",
    "gpu_allocator_alloc_retries_total": "retries", "gpu_allocator_ooms_total": "ooms",
    "gpu_pcie_tx_bytes_per_second": "pcie_tx", "gpu_pcie_rx_bytes_per_second": "pcie_rx",
    "gpu_pcie_tx_bandwidth_util_ratio": "pcie_tx_ratio",
    "gpu_pcie_rx_bandwidth_util_ratio": "pcie_rx_ratio",
    "gpu_pcie_link_max_bytes_per_second": "link_max",
    "gpu_nvlink_tx_bytes_per_second": "nvlink_tx", "gpu_nvlink_rx_bytes_per_second": "nvlink_rx",
}
_BUCKET = "inference_request_duration_seconds_bucket"
_COUNTERS = ("retries", "ooms")
_NUMBERS = tuple(f.name for f in fields(Figures)
                 if f.name not in ("uuid", "name", "index", "available", "latency"))


def figures_of(series: Iterable[Series]) -> dict[str, Figures]:
    """The GPUs of one cycle's series, by UUID, in the order the cycle gave them.

    Read back from the series rather than from the agent's samples so that diagnose and the
    table judge exactly what is exported."""
    rows: dict[str, dict[str, object]] = {}
    buckets: dict[str, list[tuple[float, float]]] = {}
    for s in series:
        labels = dict(s.labels)
        uuid = labels.get("gpu_uuid")
        if uuid is None or "pid" in labels:
            continue
        row = rows.setdefault(uuid, {"uuid": uuid, "name": labels.get("gpu_name", ""),
                                     "index": labels.get("gpu_index", "")})
        if s.name == "gpu_sidecar_gpu_available":
            row["available"] = s.value == 1
        elif s.name == _BUCKET:
            buckets.setdefault(uuid, []).append((float(labels["le"]), s.value))
        elif s.name in _FIELD_OF:
            row[_FIELD_OF[s.name]] = s.value
    for uuid, pairs in buckets.items():
        pairs.sort()
        rows[uuid]["latency"] = (tuple(b for b, _ in pairs), tuple(c for _, c in pairs))
    return {uuid: Figures(**row) for uuid, row in rows.items()}  # type: ignore[arg-type]


def quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> float | None:
    """``histogram_quantile`` as Prometheus computes it (the batch summary's implementation), so
    the p99 here is the p99 the alert sees."""
    return histogram_quantile(q, dict(zip(bounds, counts, strict=True)))


@dataclass(frozen=True)
class Window:
    """One GPU over several cycles: what a verdict is taken from."""

    mean: Figures  # means of what was present, counters as their last value
    samples: int  # cycles in which the GPU was read
    unreadable: int  # cycles in which it was selected but could not be read
    lost: bool  # could not be read in the last cycle
    retries: float | None  # allocator retries during the window
    ooms: float | None
    p50: float | None
    p99: float | None
    requests: float  # requests the quantiles are taken from
    latency_since_start: bool  # no increase in the window: quantiles of the whole histogram


class _Running:
    """Running aggregates of one GPU's figures: sums and counts for the means, the last value of
    the counters, the first and last histogram. Constant in size, however many cycles it saw."""

    __slots__ = ("counts", "first_counters", "first_hist", "last", "last_hist", "n", "sums")

    def __init__(self) -> None:
        self.n = 0
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.last: Figures | None = None
        self.first_counters: tuple[float | None, float | None] | None = None
        self.first_hist: tuple[tuple[float, ...], tuple[float, ...]] | None = None
        self.last_hist: tuple[tuple[float, ...], tuple[float, ...]] | None = None

    def add(self, f: Figures) -> None:
        self.n += 1
        self.last = f
        for name in _NUMBERS:
            v = getattr(f, name)
            if v is None:
                continue
            if name in _COUNTERS:
                self.sums[name] = v
            else:
                self.sums[name] = self.sums.get(name, 0.0) + v
            self.counts[name] = self.counts.get(name, 0) + 1
        if self.first_counters is None and (f.retries is not None or f.ooms is not None):
            self.first_counters = (f.retries, f.ooms)
        if f.latency is not None:
            if self.first_hist is None:
                self.first_hist = f.latency
            self.last_hist = f.latency


class Summary:
    """Each GPU over the cycles given to ``add``, as running aggregates: what ``diagnose`` keeps
    for its window, so its memory does not grow with ``--duration``."""

    def __init__(self) -> None:
        self._gpus: dict[str, tuple[_Running, _Running]] = {}  # readable, unreadable
        self._lost: dict[str, bool] = {}
        self.cycles = 0

    def add(self, cycle: Mapping[str, Figures]) -> None:
        self.cycles += 1
        for uuid, fig in cycle.items():
            read, unread = self._gpus.setdefault(uuid, (_Running(), _Running()))
            (read if fig.available else unread).add(fig)
            self._lost[uuid] = not fig.available

    def windows(self) -> dict[str, Window]:
        return {uuid: _window(read, unread, self._lost[uuid])
                for uuid, (read, unread) in self._gpus.items()}


def summarize(cycles: Iterable[Mapping[str, Figures]]) -> dict[str, Window]:
    """Each GPU seen in ``cycles`` (oldest first), summarised over them."""
    summary = Summary()
    for cycle in cycles:
        summary.add(cycle)
    return summary.windows()


def _window(read: _Running, unread: _Running, lost: bool) -> Window:
    base = read if read.n else unread
    values: dict[str, object] = {}
    for name, total in base.sums.items():
        values[name] = total if name in _COUNTERS else total / base.counts[name]
    last = base.last
    assert last is not None
    mean = dataclasses.replace(last, **values)  # type: ignore[arg-type]
    first_retries, first_ooms = base.first_counters or (last.retries, last.ooms)
    retries = None if last.retries is None else last.retries - (first_retries or 0)
    ooms = None if last.ooms is None else last.ooms - (first_ooms or 0)
    p50 = p99 = None
    requests = 0.0
    since_start = False
    if base.first_hist is not None and base.last_hist is not None:
        (bounds, first), (last_bounds, now) = base.first_hist, base.last_hist
        counts = tuple(b - a for a, b in zip(first, now, strict=True)) \
            if bounds == last_bounds else ()
        if not counts or counts[-1] <= 0 or min(counts) < 0:  # no requests, or a reset
            counts, since_start = now, True
        p50, p99 = quantile(0.5, last_bounds, counts), quantile(0.99, last_bounds, counts)
        requests = counts[-1]
    return Window(mean=mean, samples=read.n, unreadable=unread.n, lost=lost, retries=retries,
                  ooms=ooms, p50=p50, p99=p99, requests=requests, latency_since_start=since_start)


@dataclass(frozen=True)
class Finding:
    """A layer that explains latency on one GPU: its figures, the rule and the remedy."""

    key: str  # gpu-lost, pcie, fragmentation, allocator-retries, low-occupancy
    layer: str  # GPU, IO, memory, compute
    short: str  # for the table's verdict column
    title: str
    evidence: str
    remedy: str


@dataclass(frozen=True)
class Verdict:
    window: Window
    findings: tuple[Finding, ...]
    notes: tuple[str, ...]

    @property
    def key(self) -> str:
        return self.findings[0].key if self.findings else "none"

    @property
    def compute_judged(self) -> bool:
        return self.window.mean.occupancy is not None

    def short(self) -> str:
        """The table's verdict cell: the first finding (and how many more), or ok."""
        if self.findings:
            more = f" +{len(self.findings) - 1}" if len(self.findings) > 1 else ""
            return self.findings[0].short + more
        if self.compute_judged:
            return "ok"
        return "ok? no GPM" if self.window.mean.utilization is not None else "ok? no NVML"


KINDS = {  # key: (layer, table cell, title, what to do)
    "gpu-lost": (
        "GPU", "LOST", "the GPU stopped answering NVML",
        "check `nvidia-smi` and the kernel log (`dmesg | grep -i xid`: Xid 79 is a GPU fallen off "
        "the bus, 48/63/64/94/95 memory errors); the agent re-opens it every --gpu-retry-interval "
        "s; if it stays lost, drain the node and reset or replace the GPU, and move the pod's "
        "work to its other GPUs"),
    "pcie": (
        "IO", "IO: PCIe", "the PCIe link is saturated",
        "pin host buffers (DataLoader(pin_memory=True), tensor.pin_memory()) and copy with "
        "non_blocking=True; prefetch the next batch on a side CUDA stream so copies overlap "
        "compute; keep weights and reused inputs resident on the GPU instead of re-uploading; "
        "send smaller dtypes or pre-processed tensors; return only what the client needs (top-k "
        "on the GPU) for TX; check gpu_pcie_link_generation/width for a link trained down, or "
        "give --pcie-peak-bytes-per-second a measured peak"),
    "fragmentation": (
        "memory", "mem: frag", "the allocator's cache is fragmented",
        "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; bucket or pad batch shapes (fixed "
        "sequence-length buckets) so freed blocks fit the next request; call "
        "torch.cuda.empty_cache() between phases (after loading, after a shape change), not per "
        "request; warm up with the largest batch at start-up"),
    "allocator-retries": (
        "memory", "mem: retries", "the allocator had to retry cudaMalloc",
        "each retry flushed the allocator cache and synchronised the device: lower the peak (a "
        "smaller maximum batch or sequence length), apply the fragmentation remedies "
        "(expandable_segments), and leave headroom beside other processes on the GPU"),
    "low-occupancy": (
        "compute", "compute: occ", "small kernels leave the SMs idle",
        "give the SMs more work per launch: batch requests (dynamic batching, a larger maximum "
        "batch), capture the steady path with CUDA graphs (torch.compile(mode='reduce-overhead')) "
        "to remove launch gaps, and fuse small kernels (torch.compile, fused attention, TensorRT)"),
}


def pct(value: float | None) -> str:
    return "absent" if value is None else f"{value * 100:.1f} %"


def gbps(value: float | None) -> str:
    return "absent" if value is None else f"{value / 1e9:.1f} GB/s"


def ms(value: float | None) -> str:
    return "absent" if value is None else f"{value * 1000:.0f} ms"


def judge(w: Window, t: Thresholds | None = None) -> Verdict:
    """The findings on one GPU, most fundamental first, and what could not be judged.

    ``t`` defaults to ``sidecar.thresholds.THRESHOLDS`` as it is at call time (one place to
    change a threshold, for the rules and for this)."""
    t = t or thresholds.THRESHOLDS
    m = w.mean
    checks = (
        ("gpu-lost", w.lost,
         f"unreadable in {w.unreadable} of {w.samples + w.unreadable} samples, including the "
         "last (alert GPUSidecarGPUUnavailable)"),
        ("pcie", t.pcie_saturated(m.pcie_tx_ratio, m.pcie_rx_ratio),
         f"PCIe RX {pct(m.pcie_rx_ratio)} ({gbps(m.pcie_rx)}), TX {pct(m.pcie_tx_ratio)} "
         f"({gbps(m.pcie_tx)}) of the link's {gbps(m.link_max)}, above "
         f"{t.pcie_util_ratio:.0%} (alert GPUPCIeSaturated)"),
        ("fragmentation", t.fragmented(m.fragmentation, m.alloc_reserved),
         f"{pct(m.fragmentation)} of the allocator's {gib(m.alloc_reserved)} cache holds no "
         f"tensor, above {t.fragmentation_ratio:.0%} on a cache over "
         f"{gib(t.fragmentation_min_reserved_bytes)}; {pct(m.nonreleasable)} cannot be "
         f"released; largest free block {gib(m.largest_free)} (alert GPUMemoryFragmentationHigh)"),
        ("allocator-retries", t.allocator_retrying(w.retries, w.ooms),
         f"{w.retries or 0:.0f} allocation retries and {w.ooms or 0:.0f} OOMs during the window "
         "(alerts GPUAllocatorRetrying, GPUOutOfMemory)"),
        ("low-occupancy", t.occupancy_explains_latency(m.occupancy, w.p99),
         f"SM occupancy {pct(m.occupancy)} (below {t.occupancy_ratio:.0%}) while p99 "
         f"{ms(w.p99)} is above the {ms(t.p99_latency_s)} objective; utilization reads "
         f"{pct(m.utilization)}, tensor {pct(m.tensor)} (alert GPULowOccupancyAndSlowRequests)"),
    )
    found = [Finding(key, *KINDS[key][:3], evidence, KINDS[key][3])
             for key, hit, evidence in checks if hit]
    notes: list[str] = []
    if not w.lost:
        notes.extend(_unjudged(w, t, found))
    return Verdict(w, tuple(found), tuple(notes))


def _unjudged(w: Window, t: Thresholds, found: list[Finding]) -> Iterable[str]:
    """What the findings cannot say: a layer without figures, and latency nothing explains."""
    m = w.mean
    if m.occupancy is None:
        yield ("compute not judged: no SM occupancy or tensor activity on this GPU (GPM needs "
               f"Hopper or newer and a recent driver); utilization {pct(m.utilization)} only "
               "says that some kernel ran")
    if m.pcie_tx_ratio is None and m.pcie_rx_ratio is None:
        yield "IO not judged: no PCIe rate or link maximum on this GPU"
    if m.fragmentation is None and m.latency is None:
        yield ("memory (allocator) and latency not judged: no app figures arrived during the "
               "window (is sidecar.client started in the model server, on this --socket?)")
    elif w.p99 is None:
        yield "latency not judged: no request was counted"
    if t.low_occupancy(m.occupancy) and not t.slow(w.p99) and w.p99 is not None:
        yield (f"SM occupancy {pct(m.occupancy)} is low but p99 {ms(w.p99)} meets the "
               f"{ms(t.p99_latency_s)} objective: normal for a small model, not a bottleneck")
    if t.slow(w.p99) and not found:
        yield (f"p99 {ms(w.p99)} is above the {ms(t.p99_latency_s)} objective, yet no GPU layer "
               "crossed its threshold: look outside the GPU (CPU pre/post-processing, queueing, "
               "network)")


def gib(value: float | None) -> str:
    return "absent" if value is None else f"{value / GiB:.1f} GiB"
