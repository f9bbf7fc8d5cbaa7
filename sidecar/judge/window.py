"""A window of cycles, folded: each GPU's figures as running aggregates (``Summary``, constant in
size, mergeable), and what a verdict is taken from (``Window``: means, increases, quantiles).
The one aggregator: the agent's recent window (``sidecar.recent``), diagnose sampling afresh,
the store's commands and a batch Job's summary all fold their cycles here.
"""

from __future__ import annotations

import dataclasses
import math
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from operator import attrgetter

from sidecar import metrics
from sidecar.judge.figures import Figures


def link_below_max(self: Figures) -> bool:
    """The PCIe link trained below its maximum generation or width (both figures present)."""
    return ((self.link_gen_now is not None and self.link_gen is not None
             and self.link_gen_now < self.link_gen)
            or (self.link_width_now is not None and self.link_width is not None
                and self.link_width_now < self.link_width))


def link_known(self: Figures) -> bool:
    return (self.link_gen_now is not None and self.link_gen is not None) or \
        (self.link_width_now is not None and self.link_width is not None)




_HISTS = ("latency", "engine_latency", "queue", "ttft", "itl")
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



def histogram_quantile(q: float, cumulative: dict[float, float]) -> float | None:
    """The q-quantile of a cumulative histogram (upper bound -> count, ``inf`` included),
    interpolated linearly within its bucket as Prometheus' ``histogram_quantile`` does: a
    quantile in the +Inf bucket is the highest finite bound, and a histogram of fewer than two
    buckets has none (Triton's durations: a sum and a count)."""
    bounds = sorted(cumulative)
    if len(bounds) < 2 or bounds[-1] != math.inf or cumulative[math.inf] <= 0:
        return None
    rank = q * cumulative[math.inf]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank:
            if bound == math.inf:
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> float | None:
    """``histogram_quantile`` as Prometheus computes it , so
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
        if nested or not link_known(f):
            return
        self.link_n += 1
        retrained = max(f.pcie_tx_now_ratio or 0.0, f.pcie_rx_now_ratio or 0.0) > _RETRAINED_RATIO
        if link_below_max(f) and not retrained:
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

