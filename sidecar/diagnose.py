"""``gpu-sidecar diagnose``: the seed's question ("utilization 98 %, why is p99 up?") as a command.

It samples with the agent itself (NVML or the simulated node, and the app socket) for a window,
reads each cycle back from the series a sink would get, and judges every GPU with
``sidecar.thresholds``: the numbers of the shipped alert rules, so that ``diagnose`` and an alert
never disagree about where a layer stops being healthy. The live table (``sidecar.table``) uses
the same reading and judging on its last few cycles for its verdict column.

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

import contextlib
import dataclasses
import sys
import textwrap
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import structlog

from sidecar import thresholds
from sidecar.samples import Series
from sidecar.summary import quantile as histogram_quantile
from sidecar.thresholds import Thresholds

if TYPE_CHECKING:
    from sidecar.agent import Agent
    from sidecar.config import Config

log = structlog.get_logger("sidecar.diagnose")

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
         f"{pct(m.fragmentation)} of the allocator's {_gib(m.alloc_reserved)} cache holds no "
         f"tensor, above {t.fragmentation_ratio:.0%} on a cache over "
         f"{_gib(t.fragmentation_min_reserved_bytes)}; {pct(m.nonreleasable)} cannot be "
         f"released; largest free block {_gib(m.largest_free)} (alert GPUMemoryFragmentationHigh)"),
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


def _gib(value: float | None) -> str:
    return "absent" if value is None else f"{value / GiB:.1f} GiB"


def report(verdicts: Mapping[str, Verdict], *, seconds: float, samples: int, label: str,
           t: Thresholds | None = None, held: str = "") -> str:
    """What diagnose prints: a block per GPU, then one line of result."""
    t = t or thresholds.THRESHOLDS
    out = [f"gpu-sidecar diagnose: {len(verdicts)} GPU(s), {samples} samples over "
           f"{seconds:.1f} s{label}",
           *textwrap.wrap(f"NOTE: {held}" if held else "", 100, subsequent_indent="  "),
           *textwrap.wrap(
               f"thresholds (sidecar/thresholds.py, as in the shipped alert rules): PCIe above "
               f"{t.pcie_util_ratio:.0%} of the link; fragmentation above "
               f"{t.fragmentation_ratio:.0%} of a cache over "
               f"{_gib(t.fragmentation_min_reserved_bytes)}; any allocator retry or OOM; SM "
               f"occupancy below {t.occupancy_ratio:.0%} with p99 above {ms(t.p99_latency_s)}",
               100, subsequent_indent="  ")]
    for uuid, v in verdicts.items():
        out += ["", *_block(uuid, v)]
    bad = [f"GPU {v.window.mean.index} {v.key}" for v in verdicts.values() if v.findings]
    out += ["", f"result: a bottleneck on {len(bad)} of {len(verdicts)} GPU(s): {', '.join(bad)}"
            if bad else f"result: nothing found on {len(verdicts)} GPU(s)"]
    return "\n".join(out) + "\n"


def _block(uuid: str, v: Verdict) -> list[str]:
    w, m = v.window, v.window.mean
    head = f"GPU {m.index}  {m.name}  {uuid}"
    if v.findings:
        verdict = f"  verdict: {v.key} ({v.findings[0].layer}: {v.findings[0].title})"
    else:
        verdict = "  verdict: none" + ("" if v.compute_judged else " (compute not judged)")
    lines = [head, verdict]
    if w.samples:
        since = " since the app started" if w.latency_since_start else " in the window"
        lines += [
            f"  compute: utilization {pct(m.utilization)}, SM occupancy {pct(m.occupancy)}, "
            f"tensor {pct(m.tensor)}, SM active {pct(m.sm_active)}",
            f"  memory:  device {_gib(m.mem_used)} of {_gib(m.mem_total)}, DRAM bandwidth "
            f"{pct(m.dram_bw)}, fragmentation {pct(m.fragmentation)}"
            + ("" if m.alloc_reserved is None else f" of {_gib(m.alloc_reserved)}")
            + f", retries {_count(w.retries)}, OOMs {_count(w.ooms)}",
            f"  IO:      PCIe RX {pct(m.pcie_rx_ratio)} ({gbps(m.pcie_rx)}), TX "
            f"{pct(m.pcie_tx_ratio)} ({gbps(m.pcie_tx)}) of {gbps(m.link_max)}; NVLink TX "
            f"{gbps(m.nvlink_tx)}, RX {gbps(m.nvlink_rx)}",
            f"  app:     p50 {ms(w.p50)}, p99 {ms(w.p99)} over {w.requests:.0f} requests{since}"
            if w.p99 is not None else "  app:     no request latency",
        ]
    for n, f in enumerate(v.findings, 1):
        tag = f"{n}. " if len(v.findings) > 1 else ""
        lines += [*_wrapped("why:", f"{tag}{f.layer}: {f.evidence}"), *_wrapped("do:", f.remedy)]
    for note in v.notes:
        lines += _wrapped("note:", note)
    return lines


def _wrapped(tag: str, text: str) -> list[str]:
    """Prose lines wrapped for a terminal, continued under the text."""
    return textwrap.wrap(text, 100, initial_indent=f"  {tag:<9}", subsequent_indent=" " * 11,
                         break_on_hyphens=False)


def _count(value: float | None) -> str:
    return "absent" if value is None else f"+{value:.0f}"


def sample_window(agent: Agent, duration_s: float, interval_s: float,
                  stop: threading.Event) -> tuple[Summary, float]:
    """Cycles of ``agent`` every ``interval_s`` for ``duration_s`` (or until ``stop``), folded
    into running aggregates as they come (no cycle is kept), and the seconds the window lasted."""
    from sidecar.agent import PRIME_WINDOW_S

    agent.prime()
    stop.wait(PRIME_WINDOW_S)
    start = time.monotonic()
    end = start + duration_s
    summary = Summary()
    while True:
        summary.add(figures_of(agent.cycle()))
        left = end - time.monotonic()
        if left <= 0 or stop.wait(min(interval_s, left)):
            break
    return summary, time.monotonic() - start


HELD = ("the app socket {socket} is held by a running agent: the app layer (allocator, "
        "fragmentation, request latency) is NOT judged here, only what NVML gives")


def diagnose(cfg: Config, *, t: Thresholds | None = None) -> int:
    """The command: 0 nothing found, 1 a bottleneck (or a lost GPU), 2 no GPU to judge, 128 +
    the signal (130 SIGINT, 143 SIGTERM) when interrupted before the window ended, after the
    partial report; NVML missing raises NvmlUnavailable (exit 3 in the command line)."""
    from sidecar import cli, signals
    from sidecar.agent import Agent
    from sidecar.app_socket import SocketInUse

    with cli.simulated_paths(cfg) as cfg, contextlib.ExitStack() as stack:
        held = ""
        try:
            source, scenario, state = stack.enter_context(cli.sampling(cfg))
        except SocketInUse as exc:
            # beside a running agent, which holds the socket: no app can announce its GPUs to
            # this process, so judge every visible GPU's NVML layers (as --gpus visible would)
            held = HELD.format(socket=cfg.socket)
            if cfg.gpus == "announced" and not cfg.no_nvml:
                cfg = dataclasses.replace(cfg, gpus="visible")
                held += "; judging every visible GPU (--gpus visible)"
            log.warning("app_socket_in_use", error=str(exc),
                        effect="app figures (fragmentation, retries, latency) are not judged")
            source, scenario, state = stack.enter_context(cli.sampling(cfg, listen=False))
        mode = "simulated" if scenario is not None else ("nvml" if source else "app-only")
        agent = Agent(cfg, source=source, app=state, sinks=[], mode=mode)
        summary, seconds = sample_window(agent, cfg.duration, cfg.interval, signals.STOP)
    interrupted = signals.STOP.is_set()
    code_interrupted = 128 + (signals.received[0] if signals.received else 2)
    windows = summary.windows()
    if not windows:
        why = f" ({held})" if held else ""
        print(f"gpu-sidecar diagnose: no GPU to judge: with --gpus {cfg.gpus} the app announced "
              f"none over {cfg.socket}{why} in {seconds:.0f} s; start sidecar.client in the "
              "model server, or name GPUs with --gpus (UUIDs from `gpu-sidecar probe`, or "
              "'visible')", file=sys.stderr)
        return code_interrupted if interrupted else 2
    order = sorted(windows, key=lambda u: (len(windows[u].mean.index), windows[u].mean.index))
    verdicts = {uuid: judge(windows[uuid], t) for uuid in order}
    label = f"  [SIMULATED: scenario {cfg.simulate}]" if cfg.simulate else ""
    if cfg.no_nvml:
        label += "  [--no-nvml: app layer only]"
    if interrupted:
        label += (f"  PARTIAL: interrupted after {seconds:.1f} of {cfg.duration:.0f} s, judged "
                  "on what was sampled")
    sys.stdout.write(report(verdicts, seconds=seconds, samples=summary.cycles, label=label, t=t,
                            held=held))
    if interrupted:
        return code_interrupted
    return 1 if any(v.findings for v in verdicts.values()) else 0
