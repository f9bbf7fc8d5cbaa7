"""The verdict model: what one cycle's series say per GPU (``Figures``), a window of cycles folded
into means and increases (``Window``), and the judgement of a window against
``sidecar.thresholds`` (``Verdict``, ``Finding``). Pure functions and frozen records, shared by
``diagnose`` and the live table, so that the two (and the shipped alert rules, which take the
same thresholds) never disagree about where a layer stops being healthy.

What a verdict needs and what it yields, in the order of precedence (``PRECEDENCE``: a GPU's
findings are listed, and the table shows the first, in this order):

- ``gpu-lost``: the GPU could not be read at the end of the window (a finding: exit 1);
- ``hardware-fault`` (health): a critical Xid during the window (``critical_xids``: 48, 64, 74,
  79, 94, 95, 119, 120), an increase of the uncorrected volatile ECC count, or a failed row
  remap. First after a lost GPU because nothing else is worth tuning on a GPU whose results may
  be wrong: drain the node. A pending row remap is a note (reset to activate it), not a finding;
- ``throttled`` (health): a limiting reason (power cap, HW slowdown, HW thermal, HW power brake,
  SW thermal; not sync boost, which follows another GPU) for more than ``throttle_ratio`` of the
  window, on a busy GPU (utilization above ``busy_utilization_ratio``) whose SM clock averaged
  below ``throttle_clock_ratio`` of its maximum. Before the IO and memory layers because slow
  clocks slow every kernel and copy engine, whatever else is found;
- ``pcie-degraded`` (IO): the PCIe link ran below its maximum generation or width in most of
  the window's samples while carrying more than ``pcie_degraded_traffic_ratio`` of the link as
  trained (its share of the trained link and of the maximum link both shown). An idle link
  trains down to save power: without traffic it is a note, never a finding. Before ``pcie``
  because the fix is the slot, not the copies (a link trained down cannot reach ``pcie`` on the
  maximum link anyway: it carries at most half of it);
- ``pcie`` (IO): either direction above ``pcie_util_ratio`` of the link, averaged over the window;
- ``c2c`` (IO): on Grace Hopper and Grace Blackwell, NVLink-C2C (the host link there) above
  ``pcie_util_ratio`` of its maximum in either direction;
- ``nvlink`` (IO): NVLink between the GPUs above ``nvlink_util_ratio`` of the active links'
  maximum in either direction while the GPU is busy (utilization above
  ``busy_utilization_ratio``) or p99 is above ``p99_latency_s``: with tensor parallelism every
  layer waits for its all-reduce. After the host links (a copy from the host feeds what the
  GPUs then exchange), before the engine's and the allocator's figures;
- ``kv-cache`` (engine): the serving engine's KV cache at ``kv_cache_full_ratio`` or more
  (the window's mean) while requests were preempted during the window or waited (on average at
  least ``kv_cache_waiting_requests``). After the GPU's own faults and links (a throttled GPU or
  a saturated link slows the engine too), before the allocator's figures: an engine that
  preempts recomputes work, whatever the allocator says;
- ``fragmentation`` (memory): ``fragmented()`` on the window's mean ratio and allocator cache;
- ``allocator-retries`` (memory): any allocator retry or OOM during the window;
- ``low-occupancy`` (compute): mean SM occupancy below ``occupancy_ratio`` *and* the window's
  p99 above ``p99_latency_s``;
- ``queueing`` (engine): p99 above ``p99_latency_s`` with the engine's queue time at least
  ``queue_share_ratio`` of it (p99 over p99; where the queue's p99 is within its first bucket,
  an interpolation, the engine's own split of its requests' time into queue, prefill and
  decode, vLLM V1's and trtllm-serve's, where it has one; mean over mean for an engine without
  buckets; the alert GPUEngineQueueing and fleet's figure take the share the same way, in
  PromQL: ``queue_share_promql``), and nothing above found: the GPU layers are unsaturated, so
  the engine's admission is the limit. Last because any other finding explains why requests
  wait;
- ``none``: nothing crossed a threshold. A layer that could not be judged (no GPM before Hopper
  or on an old driver, no app figures) is said in a note, never passed off as healthy; it does
  not change the exit code, which says whether a bottleneck was found.

Each kind is one ``Rule`` of ``RULES`` (in that order): its condition, evidence, remedy, table
cell, title, threshold in words and alert rules; its threshold is a line of
``sidecar.thresholds``. ``PRECEDENCE``, ``ALL_KINDS``, the threshold prose of diagnose's report
(``threshold_prose``) and the shipped alert rules (``sidecar.alert_rules``) are read from
``RULES``; ``kinds_of(layer)`` gives a layer's kinds.

The latency the seed's rule joins is the app's histogram (``sidecar.client``, per GPU) or, when
the app publishes none, the engine's request latency (the pod's, applied to each of its GPUs);
``Figures.latency_source`` says which, and a note says it.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from operator import attrgetter

from sidecar import metrics, thresholds
from sidecar.samples import Series
from sidecar.summary import quantile as histogram_quantile
from sidecar.thresholds import Thresholds

GiB = 1024**3


Hist = tuple[tuple[float, ...], tuple[float, ...]]  # cumulative buckets: bounds (+Inf last), counts


def _link_below_max(self: Figures) -> bool:
    """The PCIe link trained below its maximum generation or width (both figures present)."""
    return ((self.link_gen_now is not None and self.link_gen is not None
             and self.link_gen_now < self.link_gen)
            or (self.link_width_now is not None and self.link_width is not None
                and self.link_width_now < self.link_width))


def _link_known(self: Figures) -> bool:
    return (self.link_gen_now is not None and self.link_gen is not None) or \
        (self.link_width_now is not None and self.link_width is not None)


# series -> Figures field: every entry of the metric table that names a ``figure``
_FIELD_OF = {m.name: m.figure for m in metrics.TABLE if m.figure}
Figures = dataclasses.make_dataclass(
    "Figures",
    [("uuid", str), ("name", str, field(default="")), ("index", str, field(default="")),
     ("available", bool, field(default=True)),
     # one per figure of the metric table the verdict reads (``figure=`` in its entry)
     *((name, float | None, field(default=None)) for name in _FIELD_OF.values()),
     # what is not one series each: the request-latency histogram, the Xid counts by code...
     ("latency", Hist | None, field(default=None)),
     ("xids", tuple[tuple[int, float], ...] | None, field(default=None)),
     # ...and the serving engine's (--engine-metrics-url), the pod's and so every GPU's of
     # it: its histograms as cumulative buckets, its counters and gauges summed over
     # endpoints and models
     ("latency_source", str, field(default="")),  # "app" or "engine": whose ``latency`` is
     ("engine", str, field(default="")),  # the engines seen, e.g. "vllm"
     *((name, Hist | None, field(default=None)) for name in ("engine_latency", "queue", "ttft", "itl")),
     *((name, float | None, field(default=None))
       for name in ("engine_latency_sum", "engine_latency_count", "queue_sum", "queue_count",
                    "kv_usage", "running", "waiting", "preemptions", "prefill_sum",
                    "decode_sum"))],
    frozen=True, slots=True,
    namespace={"link_below_max": _link_below_max, "link_known": _link_known})
Figures.__module__ = __name__
Figures.__doc__ = """One GPU as the series of one cycle describe it (None: absent), or, in a ``Window``,
the mean of the cycles that had the figure (counters, codes and link states: their last value).
Built from the metric table: a figure the verdict reads is an entry with ``figure=`` there."""
_BUCKET = "inference_request_duration_seconds_bucket"
# engine series -> (Figures field, how endpoints and models combine)
_ENGINE_HISTS = {"engine_request_duration_seconds": "engine_latency",
                 "engine_request_queue_duration_seconds": "queue",
                 "engine_time_to_first_token_seconds": "ttft",
                 "engine_inter_token_latency_seconds": "itl"}
_ENGINE_NUMBERS = {"engine_request_duration_seconds_sum": "engine_latency_sum",
                   "engine_request_duration_seconds_count": "engine_latency_count",
                   "engine_request_queue_duration_seconds_sum": "queue_sum",
                   "engine_request_queue_duration_seconds_count": "queue_count",
                   "engine_kv_cache_usage_ratio": "kv_usage", "engine_requests_running": "running",
                   "engine_requests_waiting": "waiting", "engine_preemptions_total": "preemptions",
                   "engine_request_prefill_seconds_total": "prefill_sum",
                   "engine_request_decode_seconds_total": "decode_sum"}
_HISTS = ("latency", "engine_latency", "queue", "ttft", "itl")
_XID = "gpu_xid_errors_total"
_COUNTERS = ("retries", "ooms")  # the app's: increases from the first cycle that had either
# NVML's counters (and the engine's): increases from the first value each had in the window
_HEALTH_COUNTERS = (*(m.figure for m in metrics.TABLE
                      if m.figure and m.kind == "counter" and m.figure not in _COUNTERS),
                    "preemptions", "engine_latency_sum", "engine_latency_count", "queue_sum",
                    "queue_count", "prefill_sum", "decode_sum")
# a window keeps the last value of these, not a mean: counters, and states (a code, the link's
# generation and width)
_LAST = (*_COUNTERS, *_HEALTH_COUNTERS,
         *(m.figure for m in metrics.TABLE if m.figure and m.unit in ("code", "generation", "lanes")))
_NUMBERS = tuple(f.name for f in fields(Figures)
                 if f.name not in ("uuid", "name", "index", "available", "xids", "latency_source",
                                   "engine", *_HISTS))
_LAST_AT = frozenset(i for i, name in enumerate(_NUMBERS) if name in _LAST)
# how ``_Running.add`` takes each number: (position, name, keep the last value, a counter whose
# first value in the window is kept), with all the numbers of a Figures read in one call
_ADDS = tuple((i, name, i in _LAST_AT, name in _HEALTH_COUNTERS) for i, name in enumerate(_NUMBERS))
_NUMBERS_OF = attrgetter(*_NUMBERS)
_ZEROS = [0.0] * len(_NUMBERS)
_ZEROS_I = [0] * len(_NUMBERS)
# a rate above the link as trained at the reading: the link trained down during the interval
# (traffic stopped, the link went idle), so the reading is no sample of a degraded link
_RETRAINED_RATIO = 1.05


def figures_of(series: Iterable[Series]) -> dict[str, Figures]:
    """The GPUs of one cycle's series, by UUID, in the order the cycle gave them.

    Read back from the series rather than from the agent's samples so that diagnose and the
    table judge exactly what is exported."""
    rows: dict[str, dict[str, object]] = {}
    buckets: dict[str, list[tuple[float, float]]] = {}
    xids: dict[str, list[tuple[int, float]]] = {}
    engine = _EngineFigures()
    # each label set read once: its labels, and the GPU's row its series fill (None: no GPU's)
    seen: dict[tuple[tuple[str, str], ...], tuple[dict[str, str], dict[str, object] | None]] = {}
    # a GPU's series come one after another with the same label set (the same object): looked
    # up again only when it changes
    last: tuple[tuple[str, str], ...] | None = None
    labels: dict[str, str] = {}
    row: dict[str, object] | None = None
    for s in series:
        name = s.name
        if name not in _READ and not name.startswith("engine_"):
            continue  # what no verdict reads (the agent's own counters, most health counters)
        if s.labels is not last:
            last = s.labels
            known = seen.get(last)
            if known is None:
                known = seen[last] = _row_of(dict(last), rows)
            labels, row = known
        if row is None:
            if name.startswith("engine_") and "gpu_uuid" not in labels:
                engine.add(name, labels, s.value)
            continue
        field_ = _FIELD_OF.get(name)
        if field_ is not None:
            row[field_] = s.value
        elif name == _BUCKET:
            buckets.setdefault(row["uuid"], []).append((float(labels["le"]), s.value))
        elif name == "gpu_sidecar_gpu_available":
            row["available"] = s.value == 1
        elif name == _XID and labels.get("xid", "").isdigit():
            xids.setdefault(row["uuid"], []).append((int(labels["xid"]), s.value))
    for uuid, pairs in buckets.items():
        pairs.sort()
        rows[uuid]["latency"] = (_shared_bounds(tuple(b for b, _ in pairs)),
                                 tuple(c for _, c in pairs))
    for uuid, codes in xids.items():
        rows[uuid]["xids"] = tuple(sorted(codes))
    pod = engine.figures()
    for row in rows.values():
        row.update(pod)
        if row.get("latency") is not None:
            row["latency_source"] = "app"
        elif pod.get("engine_latency") is not None:  # the app publishes none: the engine's
            row["latency"], row["latency_source"] = pod["engine_latency"], "engine"
    return {uuid: Figures(**row) for uuid, row in rows.items()}  # type: ignore[arg-type]


_BOUNDS: dict[tuple[float, ...], tuple[float, ...]] = {}
_MAX_BOUNDS = 64  # distinct bucket layouts kept; an app that keeps changing its own costs a clear


def _shared_bounds(bounds: tuple[float, ...]) -> tuple[float, ...]:
    """One tuple per bucket layout: the running agent's window keeps two histograms per GPU per
    15-s bucket, whose bounds are the same from cycle to cycle."""
    if len(_BOUNDS) >= _MAX_BOUNDS and bounds not in _BOUNDS:
        _BOUNDS.clear()
    return _BOUNDS.setdefault(bounds, bounds)


def _row_of(labels: dict[str, str], rows: dict[str, dict[str, object]]
            ) -> tuple[dict[str, str], dict[str, object] | None]:
    """A label set, and the row of the GPU it belongs to (made at its first series); no row for
    the pod's series (no GPU) and a process's own (``pid``)."""
    uuid = labels.get("gpu_uuid")
    if uuid is None or "pid" in labels:
        return labels, None
    row = rows.get(uuid)
    if row is None:
        row = rows[uuid] = {"uuid": uuid, "name": labels.get("gpu_name", ""),
                            "index": labels.get("gpu_index", "")}
    return labels, row


# the series figures_of reads: the judged figures, the latency buckets, Xids, availability
_READ = frozenset({*_FIELD_OF, _BUCKET, _XID, "gpu_sidecar_gpu_available"})


def exported_verdicts(series: Iterable[Series]) -> dict[str, str]:
    """Each GPU's verdict as the agent exported it in one cycle (``gpu_verdict`` at 1)."""
    return {dict(s.labels).get("gpu_uuid", ""): dict(s.labels).get("verdict", "")
            for s in series if s.name == "gpu_verdict" and s.value == 1}


class _EngineFigures:
    """The engine series of one cycle, combined over endpoints and models into the pod's:
    histograms summed bucket by bucket (where two layouts differ, the first one seen is kept),
    requests and preemptions summed, the KV cache the fullest."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.hists: dict[str, dict[tuple[str, ...], dict[float, float]]] = {}
        self.numbers: dict[str, float] = {}

    def add(self, name: str, labels: dict[str, str], value: float) -> None:
        self.names.add(labels.get("engine", ""))
        stem = name.removesuffix("_bucket")
        if stem != name and stem in _ENGINE_HISTS:
            le = labels.get("le", "")
            key = tuple(sorted(f"{k}={v}" for k, v in labels.items() if k != "le"))
            bound = float(le) if le != "+Inf" else float("inf")
            self.hists.setdefault(stem, {}).setdefault(key, {})[bound] = value
            return
        field_ = _ENGINE_NUMBERS.get(name)
        if field_ is None:
            return
        if field_ == "kv_usage":
            self.numbers[field_] = max(self.numbers.get(field_, 0.0), value)
        else:
            self.numbers[field_] = self.numbers.get(field_, 0.0) + value

    def figures(self) -> dict[str, object]:
        if not self.numbers and not self.hists:
            return {}
        out: dict[str, object] = {"engine": ",".join(sorted(n for n in self.names if n)),
                                  **self.numbers}
        for stem, by_key in self.hists.items():
            layout: tuple[float, ...] | None = None
            total: dict[float, float] = {}
            for per in by_key.values():
                bounds = tuple(sorted(per))
                if layout is None:
                    layout = bounds
                if bounds == layout:
                    for b, c in per.items():
                        total[b] = total.get(b, 0.0) + c
            bounds = _shared_bounds(tuple(sorted(total)))
            out[_ENGINE_HISTS[stem]] = (bounds, tuple(total[b] for b in bounds))
        return out


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
    # NVML's counters (ECC, PCIe replays, recoveries, correctable errors): increase in the window
    increases: Mapping[str, float] = field(default_factory=dict)
    # Xid code -> count during the window (a code first seen in the window counts from 0)
    xids: Mapping[int, float] = field(default_factory=dict)
    # the cycles whose PCIe link ran below its maximum: their means (None: no such cycle), how
    # many they were, and how many cycles had the link's figures at all
    below_max: Figures | None = None
    below_max_samples: int = 0
    link_samples: int = 0
    # the engine's: p99 of its request latency, queue time, time to first token, inter-token
    # latency over the window, and the queue's share of the request latency (p99 over p99; the
    # engine's split of its requests' time into queue, prefill and decode where the queue's
    # p99 is within its first bucket; mean over mean where the engine has no buckets: Triton),
    # and which of the three it is ("p99", "phases", "mean")
    engine_p99: float | None = None
    queue_p99: float | None = None
    ttft_p99: float | None = None
    itl_p99: float | None = None
    queue_share: float | None = None
    queue_share_of: str = ""


class _Running:
    """Running aggregates of one GPU's figures: sums and counts for the means, the last value of
    the counters, the first and last histogram, and the same for the cycles whose PCIe link ran
    below its maximum. Constant in size, however many cycles it saw."""

    __slots__ = ("below", "counts", "first", "first_counters", "first_hist", "last",
                 "last_hist", "link_n", "n", "sums", "xid_base")
    Hist = tuple[tuple[float, ...], tuple[float, ...]]

    def __init__(self) -> None:
        self.n = 0
        # by position in _NUMBERS: arrays, not dicts, since the running agent keeps one
        # _Running per GPU per bucket of its window (sidecar/recent.py)
        self.sums = array("d", _ZEROS)
        self.counts = array("I", _ZEROS_I)  # cycles: 4 bytes hold any window's
        self.last: Figures | None = None
        self.first_counters: tuple[float | None, float | None] | None = None
        self.first_hist: dict[str, _Running.Hist] = {}  # histogram field -> first, last
        self.last_hist: dict[str, _Running.Hist] = {}
        self.first: dict[str, float] = {}  # NVML counters: the first value in the window
        self.xid_base: dict[int, float] | None = None  # Xid counts of the first cycle
        self.link_n = 0
        self.below: _Running | None = None

    def add(self, f: Figures, *, nested: bool = False) -> None:
        self.n += 1
        self.last = f
        sums, counts = self.sums, self.counts
        for (i, name, last, counter), v in zip(_ADDS, _NUMBERS_OF(f), strict=True):
            if v is None:
                continue
            if last:
                sums[i] = v
            else:
                sums[i] += v
            counts[i] += 1
            if counter:
                self.first.setdefault(name, v)
        if self.first_counters is None and (f.retries is not None or f.ooms is not None):
            self.first_counters = (f.retries, f.ooms)
        for name in _HISTS:
            hist = getattr(f, name)
            if hist is not None:
                self.first_hist.setdefault(name, hist)
                self.last_hist[name] = hist
        if self.xid_base is None:
            self.xid_base = dict(f.xids or ())
        if nested or not f.link_known():
            return
        self.link_n += 1
        retrained = max(f.pcie_tx_now_ratio or 0.0, f.pcie_rx_now_ratio or 0.0) > _RETRAINED_RATIO
        if f.link_below_max() and not retrained:
            if self.below is None:
                self.below = _Running()
            self.below.add(f, nested=True)


    def merge(self, newer: _Running) -> None:
        """Fold in ``newer``, the aggregates of the cycles that came after this one's: the
        result is what one ``_Running`` that saw both runs of cycles in order holds. The running
        agent keeps its window as time buckets and merges those a question spans."""
        self.n += newer.n
        for i, c in enumerate(newer.counts):
            if c:
                self.sums[i] = newer.sums[i] if i in _LAST_AT else self.sums[i] + newer.sums[i]
                self.counts[i] += c
        if newer.last is not None:
            self.last = newer.last
        if self.first_counters is None:
            self.first_counters = newer.first_counters
        for name, h in newer.first_hist.items():
            self.first_hist.setdefault(name, h)
        self.last_hist.update(newer.last_hist)
        for name, v in newer.first.items():
            self.first.setdefault(name, v)
        if self.xid_base is None:
            self.xid_base = newer.xid_base
        self.link_n += newer.link_n
        if newer.below is not None:
            if self.below is None:
                self.below = _Running()
            self.below.merge(newer.below)


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

    def merge(self, newer: Summary) -> None:
        """Fold in ``newer``, the summary of the cycles after this one's (``_Running.merge``)."""
        self.cycles += newer.cycles
        for uuid, (read, unread) in newer._gpus.items():
            mine = self._gpus.setdefault(uuid, (_Running(), _Running()))
            mine[0].merge(read)
            mine[1].merge(unread)
            self._lost[uuid] = newer._lost[uuid]


def summarize(cycles: Iterable[Mapping[str, Figures]]) -> dict[str, Window]:
    """Each GPU seen in ``cycles`` (oldest first), summarised over them."""
    summary = Summary()
    for cycle in cycles:
        summary.add(cycle)
    return summary.windows()


def _means(run: _Running) -> Figures:
    values: dict[str, object] = {}
    for i, name in enumerate(_NUMBERS):
        if run.counts[i]:
            values[name] = run.sums[i] if i in _LAST_AT else run.sums[i] / run.counts[i]
    assert run.last is not None
    return dataclasses.replace(run.last, **values)  # type: ignore[arg-type]


def _increase(first: float, last: float) -> float:
    """A counter's increase; one that went backwards was reset (a driver reload, a GPU reset)
    and counts from 0, as Prometheus's ``increase`` counts it."""
    return last - first if last >= first else last


def _window(read: _Running, unread: _Running, lost: bool) -> Window:
    base = read if read.n else unread
    last = base.last
    assert last is not None
    mean = _means(base)
    first_retries, first_ooms = base.first_counters or (last.retries, last.ooms)
    retries = None if last.retries is None else last.retries - (first_retries or 0)
    ooms = None if last.ooms is None else last.ooms - (first_ooms or 0)
    # a GPU lost after one reading gives no increase: its histogram since the app started
    # would be another window than the other GPUs' (theirs: the window), so none is given
    p50, p99, requests, since_start = (_quantiles(base, "latency") if base.n >= 2 or not lost
                                       else (None, None, 0.0, False))
    increases = {name: _increase(base.first[name], base.sums[_NUMBERS.index(name)])
                 for name in base.first}
    engine_p99, queue_p99, ttft_p99, itl_p99 = (_quantiles(base, name)[1] for name in
                                                ("engine_latency", "queue", "ttft", "itl"))
    queue_share = None
    # the engine's own split of its requests' time (vLLM V1, trtllm-serve): queue, prefill, decode
    phases = ("queue_sum", "prefill_sum", "decode_sum")
    queued, prefill, decode = (increases.get(k) for k in phases)
    if not (queued or prefill or decode):  # no request in the window: since the engine started,
        queued, prefill, decode = (getattr(last, k) for k in phases)  # as the quantiles are
    split = (queued / (queued + prefill + decode) if queued is not None and prefill is not None
             and decode is not None and queued + prefill + decode > 0 else None)
    # a queue p99 within the first bucket is the interpolation's, not the queue's (vLLM's first
    # bound is 0.3 s): there the split says more
    resolved = queue_p99 is not None and queue_p99 > _first_bound(base, "queue")
    share_of = ""
    if queue_p99 is not None and engine_p99 and (resolved or split is None):
        queue_share, share_of = queue_p99 / engine_p99, "p99"
    elif split is not None:
        queue_share, share_of = split, "phases"
    elif increases.get("engine_latency_sum") and increases.get("queue_sum") is not None:
        queue_share = increases["queue_sum"] / increases["engine_latency_sum"]
        share_of = "mean"
    xid_base = base.xid_base or {}
    # a GPU lost in the window: its Xids as last known, after the readings (79 lost it)
    latest = unread.last if lost and unread.last is not None else last
    xids = {code: _increase(xid_base.get(code, 0.0), n) for code, n in (latest.xids or ())}
    below = base.below
    return Window(mean=mean, samples=read.n, unreadable=unread.n, lost=lost, retries=retries,
                  ooms=ooms, p50=p50, p99=p99, requests=requests, latency_since_start=since_start,
                  increases=increases, xids=xids,
                  below_max=None if below is None else _means(below),
                  below_max_samples=0 if below is None else below.n, link_samples=base.link_n,
                  engine_p99=engine_p99, queue_p99=queue_p99, ttft_p99=ttft_p99, itl_p99=itl_p99,
                  queue_share=queue_share, queue_share_of=share_of)


def _first_bound(run: _Running, name: str) -> float:
    """The first finite bound of histogram ``name`` (0 where it has none): a quantile at or
    below it is an interpolation from 0, which says only that the values are below it."""
    hist = run.last_hist.get(name)
    return hist[0][0] if hist is not None and hist[0] else 0.0


def _quantiles(run: _Running, name: str) -> tuple[float | None, float | None, float, bool]:
    """p50 and p99 of histogram ``name`` over the window, the requests they are taken from, and
    whether the window saw no increase (then they are of the whole histogram)."""
    first_hist, last_hist = run.first_hist.get(name), run.last_hist.get(name)
    if first_hist is None or last_hist is None:
        return None, None, 0.0, False
    (bounds, first), (last_bounds, now) = first_hist, last_hist
    counts = tuple(b - a for a, b in zip(first, now, strict=True)) if bounds == last_bounds else ()
    since_start = False
    if not counts or counts[-1] <= 0 or min(counts) < 0:  # no requests, or a reset
        counts, since_start = now, True
    return (quantile(0.5, last_bounds, counts), quantile(0.99, last_bounds, counts), counts[-1],
            since_start)


@dataclass(frozen=True)
class Finding:
    """A layer that explains latency on one GPU: its figures, the rule and the remedy."""

    key: str  # one of PRECEDENCE
    layer: str  # GPU, health, IO, memory, compute
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



def cell_of(kind: str) -> str:
    """The table's cell for a verdict kind (``none``: ok)."""
    return ALL_KINDS[kind][1] if kind in ALL_KINDS else "ok"


# the limiting reasons that make a GPU throttled: field: (name, table cell, what to do)
_REASON_OF = {
    "power_cap": ("power cap", "clk: power"),
    "hw_slowdown": ("HW slowdown", "clk: HW slow"),
    "hw_thermal": ("HW thermal", "clk: thermal"),
    "hw_power_brake": ("HW power brake", "clk: brake"),
    "sw_thermal": ("SW thermal", "clk: thermal"),
}
_THROTTLE_REMEDY = {
    "power": (
        "power cap: check the power limit against the board's default and maximum (`nvidia-smi "
        "-q -d POWER`; one set low by an operator or a capping policy is restored with "
        "`nvidia-smi -pl`) and the workload's power ({power} of {limit}): a workload at its "
        "limit is power-bound, so lower precision (BF16, FP8), less redundant work (recomputation, "
        "busy-waiting kernels) or a GPU with a higher limit help"),
    "thermal": (
        "thermal: check the airflow: fans and the chassis's fan profile, the inlet temperature, "
        "blocked or recirculating air, a failed fan or a heatsink losing contact (GPU "
        "{temperature}, HBM {mem_temperature}; `nvidia-smi -q -d TEMPERATURE` gives the "
        "slowdown temperature)"),
    "board": (
        "HW slowdown or power brake: the board: the signal comes from the board or its power "
        "supply, not from the workload: check the PSU and the GPU's power cables, the board's "
        "and the BMC's event logs (`ipmitool sel list`) and, with the node drained, `nvidia-smi "
        "-q -d PERFORMANCE`; if it stays, the board needs service"),
}
_REMEDY_OF_REASON = {"power_cap": "power", "hw_thermal": "thermal", "sw_thermal": "thermal",
                     "hw_slowdown": "board", "hw_power_brake": "board"}
XID_MEANING = {  # NVIDIA's Xid catalogue, in a few words
    13: "graphics engine exception", 31: "memory page fault", 43: "GPU stopped processing",
    45: "preemptive cleanup", 48: "double-bit ECC error", 63: "row remap recorded",
    64: "row remap failed", 74: "NVLink error", 79: "fallen off the bus",
    92: "high single-bit ECC rate", 94: "contained ECC error", 95: "uncontained ECC error",
    119: "GSP RPC timeout", 120: "GSP error",
}


def pct(value: float | None) -> str:
    return "absent" if value is None else f"{value * 100:.1f} %"


def gbps(value: float | None) -> str:
    return "absent" if value is None else f"{value / 1e9:.1f} GB/s"


def ms(value: float | None) -> str:
    return "absent" if value is None else f"{value * 1000:.0f} ms"


def ghz(value: float | None) -> str:
    return "absent" if value is None else f"{value / 1e9:.2f} GHz"


def watts(value: float | None) -> str:
    return "absent" if value is None else f"{value:.0f} W"


def celsius(value: float | None) -> str:
    return "absent" if value is None else f"{value:.0f} °C"


def link(gen: float | None, width: float | None) -> str:
    """A link state as lspci and nvidia-smi say it: Gen4 x16."""
    g = "Gen?" if gen is None else f"Gen{gen:.0f}"
    return g + ("" if width is None else f" x{width:.0f}")


def ratio_of(value: float | None, maximum: float | None) -> float | None:
    return None if value is None or not maximum else value / maximum


def reasons(m: Figures) -> list[tuple[str, float]]:
    """The limiting reasons present, by share of the window, largest first (sync boost apart)."""
    out = [(name, getattr(m, name)) for name in _REASON_OF if getattr(m, name) is not None]
    return sorted(out, key=lambda r: -r[1])


def reason_share(m: Figures) -> float | None:
    found = reasons(m)
    return found[0][1] if found else None


def xids_in_window(w: Window, t: Thresholds, *, critical: bool) -> list[tuple[int, float]]:
    return sorted((c, n) for c, n in w.xids.items() if n > 0 and t.critical_xid(c) == critical)


def _xid_list(found: Iterable[tuple[int, float]]) -> str:
    return ", ".join(f"Xid {c} ({XID_MEANING.get(c, 'see the catalogue')}) x{n:.0f}"
                     for c, n in found)


def _hardware_evidence(w: Window, t: Thresholds) -> str:
    m = w.mean
    parts = []
    if critical := xids_in_window(w, t, critical=True):
        parts.append(_xid_list(critical) + " during the window")
    ecc = w.increases.get("ecc_uncorrected")
    if ecc:
        parts.append(f"uncorrected ECC errors +{ecc:.0f} during the window "
                     f"({m.ecc_uncorrected or 0:.0f} since the driver loaded)")
    if m.remap_failed:
        parts.append(f"a row remap failed (remapped rows: {m.remapped_uncorrectable or 0:.0f} "
                     f"for uncorrectable, {m.remapped_correctable or 0:.0f} for correctable "
                     "errors)")
    return "; ".join(parts) + " (alert GPUHardwareFault)"


def _throttled(w: Window, t: Thresholds) -> tuple[str, str, str]:
    """The finding's table cell, evidence and remedy: by the reasons that held the clocks."""
    m = w.mean
    held = [(name, share) for name, share in reasons(m) if share > t.throttle_ratio]
    cell = _REASON_OF[held[0][0]][1]
    limited = ", ".join(f"{_REASON_OF[name][0]} {pct(share)}" for name, share in held)
    evidence = (
        f"SM clock {ghz(m.sm_clock)} of its {ghz(m.sm_clock_max)} maximum "
        f"({pct(ratio_of(m.sm_clock, m.sm_clock_max))}, below {t.throttle_clock_ratio:.0%}) "
        f"while utilization is {pct(m.utilization)} (above {t.busy_utilization_ratio:.0%}); "
        f"clocks limited by {limited} of the window (more than {t.throttle_ratio:.0%}); memory "
        f"clock {ghz(m.mem_clock)} of {ghz(m.mem_clock_max)}; power {watts(m.power)} of "
        f"{watts(m.power_limit)}; GPU {celsius(m.temperature)}, HBM "
        f"{celsius(m.mem_temperature)} (alert GPUClocksThrottled)")
    remedies: list[str] = []
    for name, _ in held:
        text = _THROTTLE_REMEDY[_REMEDY_OF_REASON[name]].format(
            power=watts(m.power), limit=watts(m.power_limit), temperature=celsius(m.temperature),
            mem_temperature=celsius(m.mem_temperature))
        if text not in remedies:
            remedies.append(text)
    return cell, evidence, "; ".join(remedies)


def _degraded_evidence(w: Window, t: Thresholds) -> str:
    b, m = w.below_max, w.mean
    assert b is not None
    saturated = max(b.pcie_tx_now_ratio or 0.0, b.pcie_rx_now_ratio or 0.0) > t.pcie_util_ratio
    errors = ""
    if any(w.increases.get(k) for k in ("l0_recovery", "replays", "pcie_correctable")):
        errors = (f"; during the window the link left L0 for recovery "
                  f"{w.increases.get('l0_recovery', 0):.0f} times, replayed "
                  f"{w.increases.get('replays', 0):.0f} packets and corrected "
                  f"{w.increases.get('pcie_correctable', 0):.0f} errors")
    return (
        f"the link ran at {link(b.link_gen_now, b.link_width_now)} ({gbps(b.link_now)} per "
        f"direction) of its {link(m.link_gen, m.link_width)} maximum ({gbps(m.link_max)}) in "
        f"{w.below_max_samples} of {w.link_samples} samples, carrying RX "
        f"{pct(b.pcie_rx_now_ratio)} ({gbps(b.pcie_rx)}), TX {pct(b.pcie_tx_now_ratio)} "
        f"({gbps(b.pcie_tx)}) of the link as trained (above {t.pcie_degraded_traffic_ratio:.0%}"
        + ("; saturated" if saturated else "")
        + f"), which is RX {pct(b.pcie_rx_ratio)}, TX {pct(b.pcie_tx_ratio)} of the maximum "
        f"link{errors} (alert GPUPcieLinkDegraded)")


def _degraded(w: Window, t: Thresholds) -> bool:
    b = w.below_max
    return (b is not None and 2 * w.below_max_samples > w.link_samples
            and t.pcie_degraded(True, b.pcie_tx_now_ratio, b.pcie_rx_now_ratio))


def stored(name: str, *extra: str, pod: bool = False, before: bool = False) -> str:
    """A series in a ``Deciding`` query, as a placeholder the fleet fills in with the --select
    matchers and the window's range (``sidecar.commands.fleet``); ``extra`` ``CRITICAL``
    narrows it to the critical Xids of the thresholds, ``pod`` keeps only the pod's labels (the
    engine's series have no GPU); ``before``: the 5 minutes before the window instead (a
    look-back: whether the series existed when the window began)."""
    scope = "pod" if pod else ("before" if before else "gpu")
    return f"@@SEL:{name}:{'|'.join(extra)}:{scope}@@"


def _either(a: str, b: str) -> str:
    """The larger of two per-GPU window means (RX and TX), in one query: the two are told
    apart by a label of their own so the ``or`` keeps both."""
    return (f'max by (gpu_uuid) (label_replace(avg_over_time({stored(a)}), "d", "1", "", "") or '
            f'label_replace(avg_over_time({stored(b)}), "d", "2", "", ""))')


def _at(values: Sequence[float | None], i: int = 0) -> float | None:
    return values[i] if len(values) > i else None


def _count(v: float | None) -> str:
    return "absent" if v is None else f"{v:.0f}"


def _whole(v: float | None) -> str:
    return "?" if v is None else f"{v:.0f}"


@dataclass(frozen=True)
class Deciding:
    """A kind's deciding figure in long-term storage: what ``gpu-sidecar fleet`` prints beside a
    GPU with that verdict. PromQL aggregates over the window (their series written with
    ``stored``), the labels their answers are keyed by, and how the values read."""

    queries: tuple[str, ...]
    by: tuple[str, ...]  # ("gpu_uuid",), or ("namespace", "pod") for the engine's
    text: Callable[[Sequence[float | None], Thresholds], str]


@dataclass(frozen=True)
class Rule:
    """One verdict kind, whole: where it stands (``RULES`` is in precedence order), its layer,
    table cell and title, when it holds on a window (``found``, against a threshold of
    ``sidecar.thresholds``), the figures behind it (``evidence``), what to do (``remedy``), its
    threshold in words (the head of diagnose's report) and its alert rules (PromQL with the
    thresholds as ``%(name)s``, rendered by ``sidecar.alert_rules``), and its deciding figure in
    long-term storage (``deciding``: what ``gpu-sidecar fleet`` prints beside the GPU).
    ``alone``: judged only where no rule before it found anything (queueing: any other finding
    explains why requests wait).

    ``evidence`` returns the text, or (cell, text, remedy) where the finding's cell and remedy
    follow the figures (throttled: by the reasons that held the clocks)."""

    kind: str
    layer: str  # GPU, health, IO, engine, memory, compute
    cell: str  # the live table's verdict column
    title: str
    remedy: str
    found: Callable[[Window, Thresholds], bool]
    evidence: Callable[[Window, Thresholds], str | tuple[str, str, str]]
    threshold: Callable[[Thresholds], str] | None = None  # None: no threshold (a lost GPU)
    alerts: str = ""  # alert rules in the group of its layer ("" : none of its own)
    deciding: Deciding | None = None  # fleet's figure (None: the GPU is listed without one)
    alone: bool = False


# the queueing rule's series: the engine's queue time and request latency (histograms), and its
# requests' prefill and decode seconds (the _sum of vLLM V1's and trtllm-serve's histograms)
_QUEUE, _REQUEST = "engine_request_queue_duration_seconds", "engine_request_duration_seconds"
_PREFILL, _DECODE = "engine_request_prefill_seconds_total", "engine_request_decode_seconds_total"
# which way queue_share_promql took the share, as its ``arm=True`` form answers
_SHARE_ARMS = {1: "p99", 2: "phases", 3: "p99", 4: "mean"}


def queue_share_promql(over: Callable[[str], str], by: str, *, arm: bool = False) -> str:
    """The queueing rule's queue share in PromQL, taken as ``_window`` takes it (the module's
    docstring): the queue's p99 over the request's where the queue's p99 lies above the queue
    histogram's first finite bound; else the engine's own split of its requests' time, queue
    sum over queue, prefill and decode sums, where it exports the phases; else p99 over p99
    all the same; else, without buckets, mean over mean. Each way holds only where ``_window``
    takes it (a denominator above 0), so an ``or`` keeps the first that holds.

    The first bound is the 1-quantile of the queue's buckets each set to 1: histogram_quantile
    interpolates from 0 within the first bucket, so that answers its upper bound, in Prometheus
    and in VictoriaMetrics alike (a bound is a label, which PromQL cannot compare). ``over``
    gives a series' rate or increase over the window (the alert's ``rate(...[5m])``, the fleet's
    ``increase`` over its window); ``by`` the labels the share is kept per. ``arm``: the number
    of the way taken instead of the share (``_SHARE_ARMS``)."""
    def hist(name: str) -> str:
        return f"sum by ({by}, le) ({over(name + '_bucket')})"

    def total(name: str) -> str:
        return f"sum by ({by}) ({over(name)})"

    on = f"on ({by})"
    queue_p99 = f"histogram_quantile(0.99, {hist(_QUEUE)})"
    request_p99 = f"histogram_quantile(0.99, {hist(_REQUEST)})"
    first_bound = f"histogram_quantile(1, {hist(_QUEUE)} * 0 + 1)"
    ratio = f"{queue_p99}\n  / {on} ({request_p99} > 0)"
    ways = (
        f"{ratio}\n  and {on} {queue_p99}\n  > {on} {first_bound}",
        f"{total(_QUEUE + '_sum')}\n  / {on} ({total(_QUEUE + '_sum')}\n"
        f"    + {on} {total(_PREFILL)}\n    + {on} {total(_DECODE)} > 0)",
        ratio,
        f"{total(_QUEUE + '_sum')}\n  / {on} ({total(_REQUEST + '_sum')} > 0)")
    return f"\nor {on}\n".join(f"({way}) * 0 + {n}" if arm else f"({way})"
                               for n, way in enumerate(ways, 1))


def _indented(text: str, spaces: int) -> str:
    return "".join(" " * spaces + line + "\n" for line in text.splitlines())


_QUEUEING_BY = "namespace, pod, engine, endpoint, model"


def _queueing_deciding(v: Sequence[float | None], t: Thresholds) -> str:
    """Fleet's figure for queueing: the share as the rule took it, and the way it took it."""
    share, way, queue_p99, request_p99 = (_at(v, i) for i in range(4))
    if share is None:
        return (f"queue share not stored (queue p99 {ms(queue_p99)}, request p99 "
                f"{ms(request_p99)})")
    of = _SHARE_ARMS.get(round(way) if way is not None else 0)
    if of == "phases":
        return (f"queue {pct(share)} of the engine's time per request (its split into queue, "
                "prefill and decode" + ("" if queue_p99 is None else
                                        f"; queue p99 {ms(queue_p99)} within its first bucket")
                + ")")
    if of == "mean":
        return f"mean queue time {pct(share)} of the mean request time"
    return f"queue p99 {ms(queue_p99)} is {pct(share)} of request p99 {ms(request_p99)}"


RULES: tuple[Rule, ...] = (
    Rule("gpu-lost", "GPU", "LOST", "the GPU stopped answering NVML",
         "check `nvidia-smi` and the kernel log (`dmesg | grep -i xid`: Xid 79 is a GPU fallen "
         "off the bus, 48/63/64/94/95 memory errors); the agent re-opens it every "
         "--gpu-retry-interval s; if it stays lost, drain the node and reset or replace the GPU, "
         "and move the pod's work to its other GPUs",
         found=lambda w, t: w.lost,
         evidence=lambda w, t: f"unreadable in {w.unreadable} of {w.samples + w.unreadable} "
                               "samples, including the last (alert GPUSidecarGPUUnavailable)",
         deciding=Deciding(
             (f"min by (gpu_uuid) (min_over_time({stored('gpu_sidecar_gpu_available')}))",),
             ("gpu_uuid",),
             lambda v, t: "unreadable in the window" if _at(v) == 0 else
                          "readable again by the window's end")),
    Rule("hardware-fault", "health", "HW FAULT", "the GPU reported a hardware fault",
         "drain the node (`kubectl cordon NODE`, then `kubectl drain NODE --ignore-daemonsets`) "
         "so no new work lands on this GPU, and treat what ran on it since the fault as suspect "
         "(an uncorrected error may have changed results: rerun or check them); then reset the "
         "GPU (`nvidia-smi -r -i INDEX`, or reboot the node) and run `dcgmi diag -r 3`; replace "
         "it (RMA, with `nvidia-bug-report.sh`) if a row remap failed or the fault comes back; "
         "`dmesg | grep -i xid` has the driver's own record",
         found=lambda w, t: t.hardware_fault(dict(xids_in_window(w, t, critical=True)),
                                             w.increases.get("ecc_uncorrected"),
                                             w.mean.remap_failed),
         evidence=lambda w, t: _hardware_evidence(w, t),
         threshold=lambda t: f"a critical Xid ({', '.join(map(str, t.critical_xids))}), an "
                             "uncorrected ECC error or a failed row remap",
         deciding=Deciding(
             # a code's first Xid arrives as a new series at 1, which increase() reads as 0:
             # counted whole where the series was not there before the window (as the alert)
             (f"sum by (gpu_uuid) ((increase({stored('gpu_xid_errors_total', 'CRITICAL')}) > 0) or "
              f"(last_over_time({stored('gpu_xid_errors_total', 'CRITICAL')}) unless "
              f"last_over_time({stored('gpu_xid_errors_total', 'CRITICAL', before=True)})))",
              f"sum by (gpu_uuid) (increase({stored('gpu_ecc_uncorrected_volatile_total')}))"),
             ("gpu_uuid",),
             # no series is no count: no critical Xid's counter was stored (none seen), no
             # ECC counter was (a GPU without ECC)
             lambda v, t: ("no critical Xid seen" if _at(v) is None else
                           f"critical Xids {_at(v):.0f}") + ", " + (
                 "uncorrected ECC not stored" if _at(v, 1) is None else
                 f"uncorrected ECC {_at(v, 1):.0f}") + " in the window"),
         alerts="""\
      - alert: GPUHardwareFault
        # the GPU itself failed: a critical Xid (%(critical_xids_list)s; the first
        # of a code arrives as a new series at 1, which increase() alone would read as 0, hence
        # the second arm), an uncorrected ECC error, or a failed row remap. Each is a reason to
        # drain the node
        expr: |
          label_replace(
            increase(gpu_xid_errors_total{xid=~"%(critical_xids_regex)s"}[10m]) > 0
            or
            (gpu_xid_errors_total{xid=~"%(critical_xids_regex)s"} > 0
              unless gpu_xid_errors_total{xid=~"%(critical_xids_regex)s"} offset 10m),
            "cause", "Xid $1", "xid", "(.+)")
          or
          label_replace(increase(gpu_ecc_uncorrected_volatile_total[10m]) > 0,
            "cause", "uncorrected ECC errors", "", "")
          or
          label_replace(gpu_row_remap_failed == 1, "cause", "a failed row remap", "", "")
        for: 0m
        labels:
          severity: critical
        annotations:
          summary: "Hardware fault on GPU {{ $labels.gpu_uuid }} of {{ $labels.pod }}: {{ $labels.cause }}"
          description: >-
            GPU {{ $labels.gpu_uuid }} ({{ $labels.pod }}, {{ $labels.namespace }}) reported
            {{ $labels.cause }}: its results may be wrong and it needs a reset or a replacement.
            Drain the node, reset the GPU (nvidia-smi -r) and run dcgmi diag; replace it if a
            row remap failed or the fault comes back. dmesg | grep -i xid has the driver's record.
"""),
    Rule("throttled", "health", "clocks", "the clocks are held below their maximum",
         "",  # by reason: _THROTTLE_REMEDY
         found=lambda w, t: t.throttled(reason_share(w.mean), w.mean.utilization,
                                        w.mean.sm_clock, w.mean.sm_clock_max),
         evidence=lambda w, t: _throttled(w, t),
         threshold=lambda t: f"a clock limit for over {t.throttle_ratio:.0%} of the window with "
                             f"the SM clock below {t.throttle_clock_ratio:.0%} of its maximum "
                             f"and utilization above {t.busy_utilization_ratio:.0%}",
         deciding=Deciding(
             (f"avg by (gpu_uuid) (avg_over_time({stored('gpu_sm_clock_hertz')})) / avg by "
              f"(gpu_uuid) (avg_over_time({stored('gpu_sm_clock_max_hertz')}))",),
             ("gpu_uuid",),
             lambda v, t: f"SM clock {pct(_at(v))} of its maximum (below "
                          f"{t.throttle_clock_ratio:.0%})"),
         alerts="""\
      - alert: GPUClocksThrottled
        # a limiting reason for more than %(throttle_percent)s %% of 5 minutes on a busy GPU (utilization
        # above %(busy_percent)s %%) whose SM clock averaged below %(throttle_clock_percent)s %% of its
        # maximum; sync boost is not a reason here (it follows the slowest GPU of its group,
        # whose own reason fires there)
        expr: |
          (
            %(throttle_reasons_expr)s
          )
          and on (namespace, pod, gpu_uuid)
          avg_over_time(gpu_utilization_ratio[5m]) > %(busy_utilization_ratio)s
          and on (namespace, pod, gpu_uuid)
          avg_over_time(gpu_sm_clock_hertz[5m])
            < %(throttle_clock_ratio)s * avg_over_time(gpu_sm_clock_max_hertz[5m])
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: >-
            GPU {{ $labels.gpu_uuid }} clocks limited by {{ $labels.reason }}
            {{ $value | humanizePercentage }} of the time
          description: >-
            The clocks of GPU {{ $labels.gpu_uuid }} ({{ $labels.pod }}) are held below
            %(throttle_clock_percent)s %% of their maximum while it is busy: every kernel runs slower. Power
            cap: check the power limit (gpu_power_limit_watts) and the workload's power;
            thermal: the airflow (gpu_temperature_celsius); HW slowdown or power brake: the
            board and its power supply.
"""),
    Rule("pcie-degraded", "IO", "IO: PCIe link", "the PCIe link trained below its maximum",
         "reseat the GPU (and its riser or cable), check the slot (its electrical width, a "
         "bifurcation of x16 into x8x8) and the BIOS's PCIe settings (a generation forced low, "
         "ASPM); compare LnkCap with LnkSta in `lspci -vv -s BUS_ID` and `nvidia-smi -q -d PCIE`; "
         "a link that keeps leaving L0 for recovery or replaying "
         "(gpu_pcie_l0_to_recovery_total, gpu_pcie_replay_errors_total) is a failing slot, "
         "riser or card: move the GPU to another slot to tell which; until then the copy "
         "remedies of `pcie` apply to the slower link",
         found=lambda w, t: _degraded(w, t),
         evidence=lambda w, t: _degraded_evidence(w, t),
         threshold=lambda t: f"a PCIe link below its maximum carrying over "
                             f"{t.pcie_degraded_traffic_ratio:.0%} of the link as trained",
         deciding=Deciding(
             (f"min by (gpu_uuid) (min_over_time({stored('gpu_pcie_link_current_generation')}))",
              f"max by (gpu_uuid) (max_over_time({stored('gpu_pcie_link_generation')}))"),
             ("gpu_uuid",),
             lambda v, t: f"link trained at Gen{_whole(_at(v))} of its Gen{_whole(_at(v, 1))} "
                          "maximum"),
         alerts="""\
      - alert: GPUPcieLinkDegraded
        # the link trained below its maximum generation or width while either direction carries
        # more than %(pcie_degraded_percent)s %% of the link as trained: an idle link trains down to save
        # power and is never this alert
        expr: |
          max by (namespace, pod, gpu_uuid, gpu_name, gpu_index) (
            {__name__=~"gpu_pcie_(tx|rx)_current_link_util_ratio"}
          ) > %(pcie_degraded_traffic_ratio)s
          and on (namespace, pod, gpu_uuid)
          (
            gpu_pcie_link_current_generation < gpu_pcie_link_generation
            or
            gpu_pcie_link_current_width < gpu_pcie_link_width
          )
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: >-
            PCIe link of GPU {{ $labels.gpu_uuid }} below its maximum, at
            {{ $value | humanizePercentage }} of the link as trained
          description: >-
            The PCIe link of GPU {{ $labels.gpu_uuid }} ({{ $labels.pod }}) carries traffic
            while trained below its maximum: compare gpu_pcie_link_current_generation/width
            with gpu_pcie_link_generation/width. Reseat the GPU, check the slot, the riser and
            the BIOS's PCIe settings.
"""),
    Rule("pcie", "IO", "IO: PCIe", "the PCIe link is saturated",
         "pin host buffers (DataLoader(pin_memory=True), tensor.pin_memory()) and copy with "
         "non_blocking=True; prefetch the next batch on a side CUDA stream so copies overlap "
         "compute; keep weights and reused inputs resident on the GPU instead of re-uploading; "
         "send smaller dtypes or pre-processed tensors; return only what the client needs "
         "(top-k on the GPU) for TX; check gpu_pcie_link_generation/width for a link trained "
         "down, or give --pcie-peak-bytes-per-second a measured peak",
         found=lambda w, t: t.pcie_saturated(w.mean.pcie_tx_ratio, w.mean.pcie_rx_ratio),
         evidence=lambda w, t: (
             f"PCIe RX {pct(w.mean.pcie_rx_ratio)} ({gbps(w.mean.pcie_rx)}), TX "
             f"{pct(w.mean.pcie_tx_ratio)} ({gbps(w.mean.pcie_tx)}) of the link's "
             f"{gbps(w.mean.link_max)}, above {t.pcie_util_ratio:.0%} (alert GPUPCIeSaturated)"),
         threshold=lambda t: f"PCIe above {t.pcie_util_ratio:.0%} of the link",
         deciding=Deciding(
             (_either("gpu_pcie_rx_bandwidth_util_ratio", "gpu_pcie_tx_bandwidth_util_ratio"),),
             ("gpu_uuid",),
             lambda v, t: f"PCIe {pct(_at(v))} of the link (above {t.pcie_util_ratio:.0%})"),
         alerts="""\
      - alert: GPUPCIeSaturated
        # either direction above %(pcie_percent)s %% of the link maximum (the device's max generation x width,
        # or the calibrated peak given to the agent)
        expr: |
          max by (namespace, pod, gpu_uuid, gpu_name) (
            {__name__=~"gpu_pcie_(tx|rx)_bandwidth_util_ratio"}
          ) > %(pcie_util_ratio)s
        for: 3m
        labels:
          severity: warning
        annotations:
          summary: "PCIe link of GPU {{ $labels.gpu_uuid }} at {{ $value | humanizePercentage }}"
          description: >-
            Host-device copies on {{ $labels.pod }} use more than %(pcie_percent)s %% of the PCIe link: model
            loads, large batches or pageable copies. gpu_pcie_link_max_bytes_per_second shows the
            maximum used.
"""),
    Rule("c2c", "IO", "IO: C2C", "the NVLink-C2C link to the Grace CPU is saturated",
         "the GPU streams host (Grace) memory at the link's limit: keep what kernels reuse in "
         "HBM (weights, the KV cache: no CPU offload of hot tensors), place managed memory on "
         "the GPU before use (cudaMemPrefetchAsync, cudaMemAdvise with SetPreferredLocation) "
         "instead of faulting pages across the link, do not oversubscribe HBM with unified "
         "memory, and batch host copies into large ones that overlap compute on a side stream",
         found=lambda w, t: t.c2c_saturated(w.mean.c2c_tx_ratio, w.mean.c2c_rx_ratio),
         evidence=lambda w, t: (
             f"NVLink-C2C RX {pct(w.mean.c2c_rx_ratio)} ({gbps(w.mean.c2c_rx)}), TX "
             f"{pct(w.mean.c2c_tx_ratio)} ({gbps(w.mean.c2c_tx)}) of the links' "
             f"{gbps(w.mean.c2c_max)}, above {t.pcie_util_ratio:.0%} (alert GPUC2CSaturated)"),
         threshold=lambda t: f"NVLink-C2C above {t.pcie_util_ratio:.0%} of its maximum",
         deciding=Deciding(
             (_either("gpu_c2c_rx_bandwidth_util_ratio", "gpu_c2c_tx_bandwidth_util_ratio"),),
             ("gpu_uuid",),
             lambda v, t: f"NVLink-C2C {pct(_at(v))} of its maximum (above "
                          f"{t.pcie_util_ratio:.0%})"),
         alerts="""\
      - alert: GPUC2CSaturated
        # Grace Hopper / Grace Blackwell: either direction of NVLink-C2C, the host link there,
        # above %(pcie_percent)s %% of its maximum
        expr: |
          max by (namespace, pod, gpu_uuid, gpu_name) (
            {__name__=~"gpu_c2c_(tx|rx)_bandwidth_util_ratio"}
          ) > %(pcie_util_ratio)s
        for: 3m
        labels:
          severity: warning
        annotations:
          summary: "NVLink-C2C of GPU {{ $labels.gpu_uuid }} at {{ $value | humanizePercentage }}"
          description: >-
            Host memory traffic of {{ $labels.pod }} uses more than %(pcie_percent)s %% of the C2C link to
            the Grace CPU: keep reused data in HBM, prefetch managed memory to the GPU, avoid
            oversubscribing HBM.
"""),
    Rule("nvlink", "IO", "IO: NVLink", "NVLink between the GPUs is saturated",
         "the tensor-parallel all-reduce fills the links: check the tensor-parallel degree against "
         "the model's size (a model that fits on fewer GPUs runs faster with a smaller TP degree "
         "and more replicas, or with pipeline parallelism across nodes instead of a wider TP "
         "group); overlap communication with compute (the engine's async or fused all-reduce, "
         "NCCL on a side stream); keep each TP group within one NVSwitch domain, on GPUs "
         "connected by NVLink (`nvidia-smi topo -m`: NV# between each pair, not PIX/PHB/SYS), "
         "and check `nvidia-smi nvlink -s` for a link down or running slow",
         found=lambda w, t: t.nvlink_saturated(w.mean.nvlink_tx_ratio, w.mean.nvlink_rx_ratio,
                                               w.mean.utilization, w.p99),
         evidence=lambda w, t: (
             f"NVLink RX {pct(w.mean.nvlink_rx_ratio)} ({gbps(w.mean.nvlink_rx)}), TX "
             f"{pct(w.mean.nvlink_tx_ratio)} ({gbps(w.mean.nvlink_tx)}) of the active links' "
             f"{gbps(w.mean.nvlink_max)}, above {t.nvlink_util_ratio:.0%}, while utilization is "
             f"{pct(w.mean.utilization)} (busy above {t.busy_utilization_ratio:.0%}) and p99 "
             f"{ms(w.p99)} (objective {ms(t.p99_latency_s)}); SM occupancy "
             f"{pct(w.mean.occupancy)} (alert GPUNVLinkSaturated)"),
         threshold=lambda t: f"NVLink above {t.nvlink_util_ratio:.0%} of its maximum on a busy "
                             "GPU or with p99 above the objective",
         deciding=Deciding(
             (_either("gpu_nvlink_rx_bandwidth_util_ratio",
                      "gpu_nvlink_tx_bandwidth_util_ratio"),),
             ("gpu_uuid",),
             lambda v, t: f"NVLink {pct(_at(v))} of its maximum (above "
                          f"{t.nvlink_util_ratio:.0%})"),
         alerts="""\
      - alert: GPUNVLinkSaturated
        # either direction of NVLink between the GPUs above %(nvlink_util_ratio)s of the active
        # links' maximum while the GPU is busy (utilization above %(busy_utilization_ratio)s) or the
        # app's p99 is above the %(p99_latency_s)s s objective: a full link on an idle GPU with
        # fast requests costs nothing yet
        expr: |
          max by (namespace, pod, gpu_uuid, gpu_name) (
            {__name__=~"gpu_nvlink_(tx|rx)_bandwidth_util_ratio"}
          ) > %(nvlink_util_ratio)s
          and on (namespace, pod, gpu_uuid)
          (
            max by (namespace, pod, gpu_uuid) (
              avg_over_time(gpu_utilization_ratio[5m])
            ) > %(busy_utilization_ratio)s
            or
            histogram_quantile(0.99,
              sum by (namespace, pod, gpu_uuid, le) (
                rate(inference_request_duration_seconds_bucket[5m]))
            ) > %(p99_latency_s)s
          )
        for: 3m
        labels:
          severity: warning
        annotations:
          summary: "NVLink of GPU {{ $labels.gpu_uuid }} at {{ $value | humanizePercentage }}"
          description: >-
            The GPUs of {{ $labels.pod }} exchange more over NVLink than its links carry: with
            tensor parallelism every layer waits for its all-reduce. Check the tensor-parallel
            degree against the model size, overlap communication with compute, and keep the
            group on NVLink-connected GPUs (nvidia-smi topo -m). gpu_nvlink_link_max_bytes_per_second
            shows the maximum used.
"""),
    Rule("kv-cache", "engine", "engine: KV", "the engine's KV cache is full",
         "give the KV cache more room or ask less of it: raise vLLM's --gpu-memory-utilization "
         "(SGLang: --mem-fraction-static; trtllm-serve: --kv_cache_free_gpu_memory_fraction; "
         "llama-server: a larger --ctx-size) if the GPU has free memory, shorten --max-model-len "
         "to what the traffic needs, lower --max-num-seqs so fewer requests share the cache, "
         "use an FP8 KV cache (--kv-cache-dtype fp8) or prefix caching for shared prompts; "
         "otherwise add replicas (or tensor-parallel GPUs) so each holds fewer requests",
         found=lambda w, t: t.kv_cache_full(w.mean.kv_usage, w.increases.get("preemptions"),
                                            w.mean.waiting),
         evidence=lambda w, t: (
             f"KV cache {pct(w.mean.kv_usage)} in use (at least {t.kv_cache_full_ratio:.0%}) "
             f"with {w.increases.get('preemptions') or 0:.0f} preemptions during the window and "
             f"{w.mean.waiting or 0:.1f} requests waiting, {w.mean.running or 0:.1f} running on "
             f"average; the engine's p99 request {ms(w.engine_p99)}, of it queue "
             f"{ms(w.queue_p99)} (engine {w.mean.engine}; alert GPUEngineKVCacheFull)"),
         threshold=lambda t: f"an engine's KV cache at {t.kv_cache_full_ratio:.0%} with "
                             "preemptions or waiting requests",
         deciding=Deciding(
             ("max by (namespace, pod) (avg_over_time("
              f"{stored('engine_kv_cache_usage_ratio', pod=True)}))",),
             ("namespace", "pod"),
             lambda v, t: f"KV cache {pct(_at(v))} in use (at least "
                          f"{t.kv_cache_full_ratio:.0%})"),
         alerts="""\
      - alert: GPUEngineKVCacheFull
        # the serving engine's KV cache (--engine-metrics-url) at %(kv_cache_percent)s %% or more
        # while requests are preempted or wait for room: a full cache alone is normal
        expr: |
          max by (namespace, pod, engine, endpoint, model) (
            avg_over_time(engine_kv_cache_usage_ratio[5m])
          ) >= %(kv_cache_full_ratio)s
          and on (namespace, pod, engine, endpoint, model)
          (
            max by (namespace, pod, engine, endpoint, model) (
              increase(engine_preemptions_total[5m])) > 0
            or
            max by (namespace, pod, engine, endpoint, model) (
              avg_over_time(engine_requests_waiting[5m])) >= %(kv_cache_waiting_requests)s
          )
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: "KV cache of {{ $labels.model }} on {{ $labels.pod }} at {{ $value | humanizePercentage }}"
          description: >-
            The {{ $labels.engine }} engine of {{ $labels.pod }} has no KV-cache room left and
            preempts or queues requests: raise gpu_memory_utilization, shorten max_model_len,
            lower the number of concurrent sequences, or add replicas.
"""),
    Rule("fragmentation", "memory", "mem: frag", "the allocator's cache is fragmented",
         "set PYTORCH_ALLOC_CONF=expandable_segments:True (PyTorch 2.8 and newer; before 2.8 "
         "the older name PYTORCH_CUDA_ALLOC_CONF, which later releases still read); bucket or "
         "pad batch shapes (fixed sequence-length buckets) so freed blocks fit the next request; "
         "call torch.cuda.empty_cache() between phases (after loading, after a shape change), "
         "not per request; warm up with the largest batch at start-up",
         found=lambda w, t: t.fragmented(w.mean.fragmentation, w.mean.alloc_reserved),
         evidence=lambda w, t: (
             f"{pct(w.mean.fragmentation)} of the allocator's {gib(w.mean.alloc_reserved)} cache "
             f"holds no tensor, above {t.fragmentation_ratio:.0%} on a cache over "
             f"{gib(t.fragmentation_min_reserved_bytes)}; {pct(w.mean.nonreleasable)} cannot be "
             f"released; largest free block {gib(w.mean.largest_free)} (alert "
             "GPUMemoryFragmentationHigh)"),
         threshold=lambda t: f"fragmentation above {t.fragmentation_ratio:.0%} of a cache over "
                             f"{gib(t.fragmentation_min_reserved_bytes)}",
         deciding=Deciding(
             (f"avg by (gpu_uuid) (avg_over_time({stored('gpu_memory_fragmentation_ratio')}))",
              f"avg by (gpu_uuid) (avg_over_time({stored('gpu_allocator_reserved_bytes')}))"),
             ("gpu_uuid",),
             lambda v, t: f"fragmentation {pct(_at(v))} of a {gib(_at(v, 1))} cache (above "
                          f"{t.fragmentation_ratio:.0%})"),
         alerts="""\
      - alert: GPUMemoryFragmentationHigh
        # more than %(fragmentation_percent)s %% of the allocator's cache holds no tensor, on a
        # cache worth looking at
        expr: |
          gpu_memory_fragmentation_ratio > %(fragmentation_ratio)s
          and on (namespace, pod, gpu_uuid)
          gpu_allocator_reserved_bytes > %(fragmentation_min_reserved_bytes)s
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: "GPU allocator cache {{ $value | humanizePercentage }} empty on {{ $labels.pod }}"
          description: >-
            The caching allocator of {{ $labels.pod }} ({{ $labels.namespace }}) on GPU
            {{ $labels.gpu_uuid }} holds memory that no tensor uses: large requests may need
            cudaMalloc, flushes and retries. Look at gpu_allocator_nonreleasable_ratio and
            gpu_allocator_largest_free_block_bytes; consider
            PYTORCH_ALLOC_CONF=expandable_segments:True (PYTORCH_CUDA_ALLOC_CONF before
            PyTorch 2.8).
"""),
    Rule("allocator-retries", "memory", "mem: retries", "the allocator had to retry cudaMalloc",
         "each retry flushed the allocator cache and synchronised the device: lower the peak (a "
         "smaller maximum batch or sequence length), apply the fragmentation remedies "
         "(expandable_segments), and leave headroom beside other processes on the GPU",
         found=lambda w, t: t.allocator_retrying(w.retries, w.ooms),
         evidence=lambda w, t: f"{w.retries or 0:.0f} allocation retries and {w.ooms or 0:.0f} "
                               "OOMs during the window (alerts GPUAllocatorRetrying, "
                               "GPUOutOfMemory)",
         threshold=lambda t: "any allocator retry or OOM",
         deciding=Deciding(
             (f"sum by (gpu_uuid) (increase({stored('gpu_allocator_alloc_retries_total')}))",
              f"sum by (gpu_uuid) (increase({stored('gpu_allocator_ooms_total')}))"),
             ("gpu_uuid",),
             lambda v, t: f"{_count(_at(v))} allocator retries, {_count(_at(v, 1))} OOMs in the "
                          "window"),
         alerts="""\
      - alert: GPUAllocatorRetrying
        # the direct symptom: cudaMalloc failed, the cache was flushed and the call retried
        expr: increase(gpu_allocator_alloc_retries_total[5m]) > 0
        for: 0m
        labels:
          severity: warning
        annotations:
          summary: "GPU allocator retries on {{ $labels.pod }}"
          description: >-
            {{ $labels.pod }} needed {{ $value }} allocation retries on GPU {{ $labels.gpu_uuid }}
            in 5 minutes: each one synchronises the device and stalls requests.

      - alert: GPUOutOfMemory
        expr: increase(gpu_allocator_ooms_total[5m]) > 0
        for: 0m
        labels:
          severity: critical
        annotations:
          summary: "CUDA out-of-memory errors on {{ $labels.pod }}"
          description: "{{ $labels.pod }} raised {{ $value }} OOM errors on GPU {{ $labels.gpu_uuid }}."
"""),
    Rule("low-occupancy", "compute", "compute: occ", "small kernels leave the SMs idle",
         "give the SMs more work per launch: batch requests (dynamic batching, a larger maximum "
         "batch), capture the steady path with CUDA graphs "
         "(torch.compile(mode='reduce-overhead')) to remove launch gaps, and fuse small kernels "
         "(torch.compile, fused attention, TensorRT)",
         found=lambda w, t: t.occupancy_explains_latency(w.mean.occupancy, w.p99),
         evidence=lambda w, t: (
             f"SM occupancy {pct(w.mean.occupancy)} (below {t.occupancy_ratio:.0%}) while p99 "
             f"{ms(w.p99)} is above the {ms(t.p99_latency_s)} objective; utilization reads "
             f"{pct(w.mean.utilization)}, tensor {pct(w.mean.tensor)} (alert "
             "GPULowOccupancyAndSlowRequests)"),
         threshold=lambda t: f"SM occupancy below {t.occupancy_ratio:.0%} with p99 above "
                             f"{ms(t.p99_latency_s)}",
         deciding=Deciding(
             (f"avg by (gpu_uuid) (avg_over_time({stored('gpu_sm_occupancy_ratio')}))",
              "histogram_quantile(0.99, sum by (gpu_uuid, le) (increase("
              f"{stored('inference_request_duration_seconds_bucket')})))"),
             ("gpu_uuid",),
             lambda v, t: f"SM occupancy {pct(_at(v))} (below {t.occupancy_ratio:.0%}), p99 "
                          f"{ms(_at(v, 1))} (above {ms(t.p99_latency_s)})"),
         alerts="""\
      - alert: GPULowOccupancyAndSlowRequests
        # low occupancy alone is normal for small models; it matters when latency suffers too.
        # %(p99_latency_s)s s is the p99 objective used here: set your own.
        # The latency is the app's (per GPU) or, on a GPU whose app publishes none, the
        # serving engine's (--engine-metrics-url: the pod's, for each of its GPUs).
        expr: |
          (
            avg by (namespace, pod, gpu_uuid) (gpu_sm_occupancy_ratio) < %(occupancy_ratio)s
            and on (namespace, pod, gpu_uuid)
            histogram_quantile(0.99,
              sum by (namespace, pod, gpu_uuid, le) (
                rate(inference_request_duration_seconds_bucket[5m]))
            ) > %(p99_latency_s)s
          )
          or
          (
            avg by (namespace, pod, gpu_uuid) (gpu_sm_occupancy_ratio) < %(occupancy_ratio)s
            unless on (namespace, pod, gpu_uuid) inference_request_duration_seconds_count
            and on (namespace, pod)
            histogram_quantile(0.99,
              sum by (namespace, pod, le) (rate(engine_request_duration_seconds_bucket[5m]))
            ) > %(p99_latency_s)s
          )
        for: 10m
        labels:
          severity: warning
        annotations:
          summary: "Low SM occupancy with slow requests on {{ $labels.pod }}"
          description: >-
            GPU {{ $labels.gpu_uuid }} keeps its SMs mostly empty while p99 latency is above the
            objective: small, fragmented kernels; consider batching, CUDA graphs or fusion.
"""),
    Rule("queueing", "engine", "engine: queue", "requests wait in the engine's queue",
         "the GPU has room and requests wait to be admitted: raise the batch budget (vLLM "
         "--max-num-seqs, --max-num-batched-tokens; SGLang --max-running-requests; TGI "
         "--max-batch-total-tokens; Triton's dynamic batcher max_batch_size and queue delay; "
         "trtllm-serve --max_batch_size, --max_num_tokens; llama-server --parallel) "
         "so more requests run at once; if the GPU is already full at a larger batch, add "
         "replicas and spread the traffic",
         found=lambda w, t: t.queueing(w.queue_share, w.p99),
         evidence=lambda w, t: _queueing(w, t),
         threshold=lambda t: f"an engine's queue time at {t.queue_share_ratio:.0%} of p99 above "
                             f"{ms(t.p99_latency_s)}",
         # fleet's figure: the share as the rule takes it, the way it took it, the two p99s
         deciding=Deciding(
             (*(queue_share_promql(lambda name: f"increase({stored(name, pod=True)})",
                                   "namespace, pod", arm=arm) for arm in (False, True)),
              *(f"histogram_quantile(0.99, sum by (namespace, pod, le) (increase("
                f"{stored(name + '_bucket', pod=True)})))" for name in (_QUEUE, _REQUEST))),
             ("namespace", "pod"),
             _queueing_deciding),
         alerts="""\
      - alert: GPUEngineQueueing
        # requests spend at least %(queue_share_percent)s %% of their time waiting in the engine's
        # queue, p99 above the %(p99_latency_s)s s objective, and the KV cache is not the reason
        # (GPUEngineKVCacheFull); diagnose also checks that no GPU layer explains it. The
        # queue's share is taken as diagnose takes it: its p99 over the request p99 where the
        # queue's p99 lies above its first bucket's bound (the 1-quantile of its buckets set
        # to 1); within it, an interpolation (vLLM's first bound is 0.3 s), the engine's own
        # split of its requests' time (queue, prefill, decode sums) where it has one; mean
        # over mean without queue buckets. An engine without request buckets (Triton) has no
        # p99 here: it is not judged
        expr: |
          (
""" + _indented(queue_share_promql(lambda name: f"rate({name}[5m])", _QUEUEING_BY), 12) + """\
          ) >= %(queue_share_ratio)s
          and on (namespace, pod, engine, endpoint, model)
          histogram_quantile(0.99, sum by (namespace, pod, engine, endpoint, model, le) (
            rate(engine_request_duration_seconds_bucket[5m]))) > %(p99_latency_s)s
          unless on (namespace, pod, engine, endpoint, model)
          avg_over_time(engine_kv_cache_usage_ratio[5m]) >= %(kv_cache_full_ratio)s
        for: 10m
        labels:
          severity: warning
        annotations:
          summary: "{{ $labels.model }} on {{ $labels.pod }}: {{ $value | humanizePercentage }} queued"
          description: >-
            The {{ $labels.engine }} engine of {{ $labels.pod }} admits requests too slowly for
            the traffic: raise the batch budget (max_num_seqs, max_num_batched_tokens) if the
            GPU has room, or add replicas.
""", alone=True),
)
PRECEDENCE = tuple(r.kind for r in RULES)
RULE_OF: dict[str, Rule] = {r.kind: r for r in RULES}
LAYERS = ("GPU", "health", "IO", "engine", "memory", "compute")  # of the kinds, as RULES name them
# kind -> (layer, table cell, title, what to do), in PRECEDENCE order: what the views and the
# store's commands read of a kind
ALL_KINDS: dict[str, tuple[str, str, str, str]] = {
    r.kind: (r.layer, r.cell, r.title, r.remedy) for r in RULES}


def kinds_of(layer: str) -> tuple[str, ...]:
    """The kinds of one layer (``GPU``, ``health``, ``IO``, ``engine``, ``memory``,
    ``compute``), in precedence order."""
    return tuple(r.kind for r in RULES if r.layer == layer)


def threshold_prose(t: Thresholds) -> str:
    """Every rule's threshold in words, in precedence order: the head of diagnose's report."""
    return "; ".join(r.threshold(t) for r in RULES if r.threshold is not None)


def judge(w: Window, t: Thresholds | None = None) -> Verdict:
    """The findings on one GPU, in ``PRECEDENCE`` order, and what could not be judged.

    ``t`` defaults to ``sidecar.thresholds.THRESHOLDS`` as it is at call time (one place to
    change a threshold, for the rules and for this)."""
    t = t or thresholds.THRESHOLDS
    found: list[Finding] = []
    for rule in RULES:
        if (rule.alone and found) or not rule.found(w, t):
            continue
        cell, said, remedy = rule.cell, rule.evidence(w, t), rule.remedy
        if isinstance(said, tuple):  # the cell and the remedy follow the figures
            cell, said, remedy = said
        found.append(Finding(rule.kind, rule.layer, cell, rule.title, said, remedy))
    notes: list[str] = []
    if not w.lost:
        notes.extend(_unjudged(w, t, found))
    notes.extend(_health_notes(w, t, found))
    return Verdict(w, tuple(found), tuple(notes))


def _queueing(w: Window, t: Thresholds) -> str:
    m = w.mean
    share = (f"queue p99 {ms(w.queue_p99)} is {pct(w.queue_share)} of the request p99 "
             f"{ms(w.engine_p99)}" if w.queue_share_of == "p99" else
             f"the queue holds {pct(w.queue_share)} of the engine's time per request (its own "
             "split into queue, prefill and decode"
             + (f"; the queue p99 {ms(w.queue_p99)} is within its first bucket)"
                if w.queue_p99 is not None else ")")
             if w.queue_share_of == "phases" else
             f"the mean queue time is {pct(w.queue_share)} of the mean request time")
    return (f"{share} (at least {t.queue_share_ratio:.0%}), p99 above the "
            f"{ms(t.p99_latency_s)} objective, while no GPU layer is saturated: SM occupancy "
            f"{pct(m.occupancy)}, utilization {pct(m.utilization)}, KV cache {pct(m.kv_usage)}; "
            f"{m.waiting or 0:.1f} requests waiting, {m.running or 0:.1f} running on average "
            f"(engine {m.engine}; alert GPUEngineQueueing)")


def _unjudged(w: Window, t: Thresholds, found: list[Finding]) -> Iterable[str]:
    """What the findings cannot say: a layer without figures, and latency nothing explains."""
    m = w.mean
    if m.occupancy is None:
        yield ("compute not judged: no SM occupancy or tensor activity on this GPU (GPM needs "
               f"Hopper or newer and a recent driver); utilization {pct(m.utilization)} only "
               "says that some kernel ran")
    if m.pcie_tx_ratio is None and m.pcie_rx_ratio is None and m.c2c_tx_ratio is None \
            and m.c2c_rx_ratio is None and m.nvlink_tx_ratio is None and m.nvlink_rx_ratio is None:
        yield "IO not judged: no PCIe rate or link maximum on this GPU"
    if m.utilization is not None and m.sm_clock is None and reason_share(m) is None:
        yield "clocks not judged: no SM clock or clock-event reasons on this GPU"
    if m.fragmentation is None and m.latency is None:
        yield ("memory (allocator) and latency not judged: no app figures arrived during the "
               "window (is sidecar.client started in the model server, on this --socket?), and "
               "no engine latency (--engine-metrics-url)")
    elif w.p99 is None:
        yield "latency not judged: no request was counted"
    elif m.fragmentation is None:
        yield ("memory (allocator) not judged: no app figures arrived during the window (is "
               "the injected publisher or sidecar.client running in the model server?)")
    if m.latency_source == "engine":
        yield (f"latency from the engine ({m.engine}'s request latency histogram): the app "
               "publishes none")
    elif m.latency_source == "app" and m.engine_latency is not None:
        yield (f"latency from the app (sidecar.client); the engine ({m.engine}) says p99 "
               f"{ms(w.engine_p99)}")
    if t.low_occupancy(m.occupancy) and not t.slow(w.p99) and w.p99 is not None:
        yield (f"SM occupancy {pct(m.occupancy)} is low but p99 {ms(w.p99)} meets the "
               f"{ms(t.p99_latency_s)} objective: normal for a small model, not a bottleneck")
    if t.slow(w.p99) and not found:
        # "outside the GPU" only as far as the GPU was judged: a layer without figures may
        # hold the cause
        unread = [name for name, gone in (
            ("SM occupancy", m.occupancy is None),
            ("PCIe", m.pcie_tx_ratio is None and m.pcie_rx_ratio is None),
            ("the allocator", m.fragmentation is None)) if gone]
        also = (f", or in what was not judged ({', '.join(unread)})" if unread else "")
        if m.engine:
            yield (f"p99 {ms(w.p99)} is above the {ms(t.p99_latency_s)} objective, yet no GPU or "
                   f"engine layer judged explains it (queue {pct(w.queue_share)} of it, KV cache "
                   f"{pct(m.kv_usage)}, time to first token p99 {ms(w.ttft_p99)}, inter-token "
                   f"p99 {ms(w.itl_p99)}): look outside the GPU and the engine (CPU pre/post-"
                   f"processing, the network, the client){also}")
        else:
            yield (f"p99 {ms(w.p99)} is above the {ms(t.p99_latency_s)} objective, yet no GPU "
                   "layer judged crossed its threshold: look outside the GPU (CPU pre/post-"
                   f"processing, queueing, network){also}")


def _health_notes(w: Window, t: Thresholds, found: list[Finding]) -> Iterable[str]:
    """What the health figures say that is no finding: a remap waiting for a reset, faults
    counted before the window, the app's Xids, sync boost, an idle link trained down."""
    m = w.mean
    keys = {f.key for f in found}
    if m.remap_pending:
        yield (f"a row remap waits for the GPU's next reset (remapped rows: "
               f"{m.remapped_uncorrectable or 0:.0f} for uncorrectable, "
               f"{m.remapped_correctable or 0:.0f} for correctable errors): reset the GPU once "
               "drained (`nvidia-smi -r`) to activate it (alert GPURowRemapPending)")
    if m.ecc_uncorrected and not w.increases.get("ecc_uncorrected"):
        yield (f"{m.ecc_uncorrected:.0f} uncorrected ECC errors since the driver loaded, none "
               "during the window: the GPU has not been reset since; reset it once drained")
    earlier = sorted((c, n) for c, n in (m.xids or ()) if t.critical_xid(c)
                     and not w.xids.get(c))
    if earlier:
        yield ("before the window, since the agent started: "
               + _xid_list(earlier) + "; see `dmesg | grep -i xid`")
    if other := xids_in_window(w, t, critical=False):
        yield (_xid_list(other) + " during the window: not the hardware's fault by itself (13, "
               "31, 43: the app's kernels; 63: a row remap recorded; 92: corrected errors to "
               "watch)")
    if "throttled" not in keys and m.sync_boost is not None and m.sync_boost > t.throttle_ratio \
            and t.throttled(m.sync_boost, m.utilization, m.sm_clock, m.sm_clock_max):
        yield (f"clocks held by sync boost for {pct(m.sync_boost)} of the window (SM clock "
               f"{ghz(m.sm_clock)} of {ghz(m.sm_clock_max)}): this GPU follows the slowest GPU "
               "of its sync-boost group; look at the group's other GPUs")
    b = w.below_max
    if b is not None and "pcie-degraded" not in keys:
        yield (f"the PCIe link ran at {link(b.link_gen_now, b.link_width_now)} of its "
               f"{link(m.link_gen, m.link_width)} maximum in {w.below_max_samples} of "
               f"{w.link_samples} samples, carrying RX {pct(b.pcie_rx_now_ratio)}, TX "
               f"{pct(b.pcie_tx_now_ratio)} of it: an idle link trains down to save power, so it "
               "is a finding only while it stays below its maximum under traffic (above "
               f"{t.pcie_degraded_traffic_ratio:.0%} of the trained link) for most of the window")


def gib(value: float | None) -> str:
    return "absent" if value is None else f"{value / GiB:.1f} GiB"
