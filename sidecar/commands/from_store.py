"""``gpu-sidecar diagnose --query-url URL``: the same judgement as the live diagnose, on the
series the agents stored in long-term storage, for a window that may be hours old.

The store is asked for the raw samples of the window (a range selector in an instant query: one
query for the GPU series, one for the engine's and the agent's own, whatever the number of
GPUs), so each stored cycle is rebuilt exactly as the agent exported it and read back through
``judge.series.figures_of``: one mapping from series to figures, one judge, one set of thresholds for
the three sources. What the store cannot give as the agent had it is said, never smoothed over:

- a counter that went backwards (the agent or the app restarted) counts on from its previous
  value, as PromQL's ``increase()`` counts it, and a note says when;
- cycles missing for longer than three intervals are a gap, said with its times; nothing is
  filled in (a raw selector, not ``query_range``'s five-minute look-back, which would repeat the
  last value across a gap and keep an old process's series alive beside the new one's);
- a layer with no series is "not judged" (``judge.verdict.judge``'s notes), never healthy.

Then, for each finding and for p99, **when it started**: the judge on a trailing window
(``onset_window``) slid over the cycles gives the first time from which each finding held to
the end of the window, and the report lists them in time order.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import itertools
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sidecar import thresholds
from sidecar.judge.figures import Figures
from sidecar.judge.rules import ALL_KINDS
from sidecar.judge.series import figures_of
from sidecar.judge.verdict import Verdict, judge
from sidecar.judge.window import Summary
from sidecar.metrics import RARE
from sidecar.option_values import instant
from sidecar.samples import Series
from sidecar.sinks.cadence import RESEND_S
from sidecar.store import (
    EXIT_UNREACHABLE,
    GPU_LABELS,
    Point,
    Row,
    Store,
    StoreError,
    duration,
    selector,
)
from sidecar.thresholds import Thresholds
from sidecar.units import ms
from sidecar.views.document import document, dumps
from sidecar.views.report import report

if TYPE_CHECKING:
    from sidecar.config import Config

POD_KEY = ("namespace", "pod", "node")  # what ties a pod's engine series to its GPUs
GPU_FAMILIES = "gpu_.+|inference_request_duration_seconds_bucket"
POD_FAMILIES = "engine_.+|gpu_sidecar_samples_collected_total"
RESTARTS = "gpu_sidecar_samples_collected_total"  # goes back to 0 when the agent restarts
CUMULATIVE = ("_total", "_bucket", "_sum", "_count")
GAP_INTERVALS = 3.0  # cycles missing for longer than this many intervals are a gap
ONSET_MAX_S = 30.0  # the trailing window an onset is judged on (at least 3 cycles)
LOOKED_BACK_S = 7 * 86400  # how far back an empty window looks for the selector's GPUs
NOT_FUTURE_S = 60.0  # --at may be this far past the local clock (clock skew), no further
# a window's end this far past the last stored cycle is said: less is the agents' push interval
# (15 s by default) and the store's ingestion, behind any --at now
PUSH_LAG_S = 60.0


class Refused(ValueError):
    """A window the command cannot ask for (a time in the future): exit 2, as a bad option."""


@dataclass(frozen=True)
class Window:
    start: float
    end: float

    def shown(self) -> str:
        return f"{stamp(self.start)}..{stamp(self.end)}"


@dataclass(frozen=True)
class Pod:
    """One pod's stored cycles, rebuilt: series by cycle time, and what was said about them."""

    key: tuple[str, ...]
    cycles: tuple[tuple[float, tuple[Series, ...]], ...]
    notes: tuple[str, ...] = ()
    interval_s: float = 0.0
    # (GPU UUID, or "" for the pod's own series) -> the series stored as NaN or an infinity in
    # the window, and in how many cycles: left out, so what they alone feed is not judged
    unreadable: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = ()


@dataclass
class Stored:
    """What the store held for the window: the pods, each with its GPUs' cycles."""

    pods: list[Pod] = field(default_factory=list)


def stamp(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def clock(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%H:%M:%S")


def window_of(cfg: Config, now: float | None = None) -> Window:
    """The window --at and --duration name; a time in the future is refused."""
    now = time.time() if now is None else now
    try:
        end = instant(cfg.at, now)
    except (ValueError, OverflowError) as exc:
        raise Refused(f"--at {cfg.at!r} {exc}") from None
    if end > now + NOT_FUTURE_S:
        raise Refused(f"--at {cfg.at!r} is {end - now:.0f} s in the future (by this machine's "
                      "clock): nothing is stored there yet; give a past time or 'now'")
    if not end - cfg.duration >= 0:  # NaN included; the report could name no such time either
        raise Refused(f"--at {cfg.at!r} with --duration {cfg.duration:g} begins before "
                      "1970-01-01T00:00:00Z (Unix time 0), where no store holds anything: give "
                      "a later time")
    return Window(end - cfg.duration, end)


def fetch(store: Store, select: Sequence[tuple[str, str, str]], w: Window) -> Stored:
    """The window's raw samples: two queries, whatever the number of GPUs."""
    # from before the window too: a rare figure (sent every minute) stands in its first cycles
    rng = f"[{duration(w.end - w.start + RARE_BEFORE_S)}]"
    gpu_rows = store.query(selector(GPU_FAMILIES, select, 'gpu_uuid!=""', 'pid=""') + rng, w.end)
    keys = sorted({_pod_key(r) for r in gpu_rows})
    pod_rows: list[Row] = []
    if keys:
        pods = sorted({dict(zip(POD_KEY, k, strict=True))["pod"] for k in keys} - {""})
        extra = [f"pod=~{json.dumps('|'.join(_literal(p) for p in pods))}"] if pods else []
        pod_rows = store.query(selector(POD_FAMILIES, select, *extra, skip=GPU_LABELS) + rng,
                               w.end)
    by_pod: dict[tuple[str, ...], list[Row]] = {k: [] for k in keys}
    for row in (*gpu_rows, *pod_rows):
        if (k := _pod_key(row)) in by_pod:
            by_pod[k].append(row)
    # a pod whose rows all came from before the window (fetched for the rare figures: its agent
    # stopped before the window began) has nothing to judge in it
    return Stored([pod for k, rows in by_pod.items() if (pod := _rebuild(k, rows, w.start)).cycles])


def _literal(text: str) -> str:
    """``text`` as an RE2 regex matching itself (PromQL's regexes are RE2, fully anchored)."""
    return re.sub(r"([\\.+*?()|\[\]{}^$])", r"\\\1", text)


def _pod_key(row: Row) -> tuple[str, ...]:
    return tuple(row.label(k) for k in POD_KEY)


LOOKBACK_MS = 300_000  # Prometheus' default look-back: a sample stands this long
RARE_BEFORE_S = 2 * RESEND_S  # fetched before the window, for the rare figures' last values


def _rebuild(key: tuple[str, ...], rows: list[Row], start: float) -> Pod:
    """A pod's cycles from its rows: counters made monotonic as PromQL's increase() reads them
    (each reset said), samples grouped by their time (one cycle of the agent each)."""
    by_time: dict[int, list[Series]] = {}
    resets: dict[str, list[float]] = {}
    unreadable: dict[str, dict[str, int]] = {}  # GPU UUID -> series -> cycles stored as NaN
    for row in rows:
        name = row.name
        labels = tuple((k, v) for k, v in row.labels if k != "__name__")
        offset, previous = 0.0, None
        points = sorted(row.points, key=lambda p: p.t)
        for i, p in enumerate(points):
            value = p.v
            if not math.isfinite(value):
                if _series_end(points, i):
                    continue  # a staleness marker: the agent's clean stop ended the series
                # no agent sends one: absent, and said, never judged
                if p.t >= start:
                    per = unreadable.setdefault(row.label("gpu_uuid"), {})
                    per[name] = per.get(name, 0) + 1
                continue
            if name.endswith(CUMULATIVE):
                if previous is not None and value < previous:
                    offset += previous
                    what = "agent" if name == RESTARTS else "counter"
                    if p.t >= start:  # said only inside the window
                        resets.setdefault(what, []).append(p.t)
                previous = value
                value += offset
            if name == RESTARTS:
                continue
            ms_ = round(p.t * 1000)
            by_time.setdefault(ms_, []).append(Series(name, labels, value, ms_))
    _carry_rare(by_time, sorted(by_time))
    for ms_ in [ms_ for ms_ in by_time if ms_ < start * 1000]:  # fetched only to carry from
        del by_time[ms_]
    times = sorted(by_time)
    notes: list[str] = []
    if restarts := sorted(set(resets.get("agent", []))):
        notes.append(f"the agent restarted inside the window (at {_times(restarts)}): its "
                     "counters and histograms count on across the restart, as PromQL's "
                     "increase() counts them")
    others = sorted(set(resets.get("counter", [])) - set(resets.get("agent", [])))
    if others:
        notes.append(f"a counter went back to a lower value at {_times(others)} (a restart of "
                     "the app or the agent): counted on from its previous value, as PromQL's "
                     "increase() does")
    interval = statistics.median(b - a for a, b in itertools.pairwise(times)) / 1000 \
        if len(times) > 1 else 0.0
    gaps = [(a / 1000, b / 1000) for a, b in itertools.pairwise(times)
            if interval and (b - a) / 1000 > GAP_INTERVALS * interval]
    if gaps:
        notes.append("no cycle stored from " + ", from ".join(
            f"{clock(a)} to {clock(b)} ({b - a:.0f} s)" for a, b in gaps[:5])
            + (f" and {len(gaps) - 5} more gaps" if len(gaps) > 5 else "")
            + ": judged on the cycles stored, nothing filled in (the agent was down, or its "
            "pushes were lost)")
    cycles = tuple((ms_ / 1000, tuple(by_time[ms_])) for ms_ in times)
    return Pod(key, cycles, tuple(notes), interval, tuple(
        (uuid, tuple(sorted(per.items()))) for uuid, per in sorted(unreadable.items())))


def _series_end(points: Sequence[Point], i: int) -> bool:
    """Whether the NaN at ``points[i]`` is a staleness marker: the agent ends each series it
    sent when it stops cleanly, and VictoriaMetrics answers the marker as ``NaN`` in a raw range
    (Prometheus leaves it out). The marker's bits do not survive JSON, so it is told by its
    place: one NaN after a number, the series' last sample or followed by a number (the agent
    started again). NaN cycle after cycle is a figure no agent sends, never a marker."""
    if not math.isnan(points[i].v):
        return False
    before = i == 0 or math.isfinite(points[i - 1].v)
    after = i == len(points) - 1 or math.isfinite(points[i + 1].v)
    return before and after


def unreadable_note(unreadable: Sequence[tuple[str, int]]) -> str:
    """What the store held as NaN or an infinity (values no agent sends): left out, so a layer
    they alone feed is "not judged", never healthy."""
    said = [f"{name} ({n} cycle(s))" for name, n in unreadable]
    return ("not judged where these figures feed it (stored as not a number: NaN or an "
            "infinity, which no agent sends; left out): " + ", ".join(said[:8])
            + (f" and {len(said) - 8} more" if len(said) > 8 else "")
            + "; what the other notes say of this GPU's layers is of the figures read only")


def _carry_rare(by_time: dict[int, list[Series]], times: list[int]) -> None:
    """The rare figures are pushed when they change and every minute (sinks/cadence.py):
    each stored cycle without one takes its last value, as PromQL's look-back does (up to 5
    minutes), so the cycles judged here are the ones the agent judged."""
    last: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[int, float]] = {}
    for ms_ in times:
        cycle = by_time[ms_]
        present = set()
        for s in cycle:
            if s.name in RARE:
                last[(s.name, s.labels)] = (ms_, s.value)
                present.add((s.name, s.labels))
        for (name, labels), (at, value) in last.items():
            if (name, labels) not in present and ms_ - at <= LOOKBACK_MS:
                cycle.append(Series(name, labels, value, ms_))


def _times(ts: Iterable[float]) -> str:
    found = sorted(ts)
    shown = ", ".join(clock(t) for t in found[:5])
    return shown + (f" and {len(found) - 5} more" if len(found) > 5 else "")


@dataclass(frozen=True)
class Judged:
    verdicts: dict[str, Verdict]
    cycles: int
    interval_s: float
    # the GPUs (verdicts' keys) with figures stored as NaN or an infinity: never "seen healthy"
    unreadable: frozenset[str] = frozenset()


def judge_stored(stored: Stored, w: Window, t: Thresholds | None = None) -> Judged:
    """Each GPU's verdict over the window, with the store's notes and the onsets: one per pod and
    GPU, keyed by the GPU's UUID, or by pod and UUID where two pods report one UUID in the window
    (a rollout's old and new pod, a time-sliced GPU): neither replaces the other."""
    t = t or thresholds.THRESHOLDS
    found: list[tuple[tuple[str, ...], str, Verdict, bool]] = []  # pod, UUID, verdict, unreadable
    cycles, intervals = 0, []
    for pod in stored.pods:
        bad = dict(pod.unreadable)
        summary = Summary()
        timeline: dict[str, list[tuple[float, Figures]]] = {}
        for at, series in pod.cycles:
            figures = figures_of(series)
            summary.add(figures)
            for uuid, fig in figures.items():
                timeline.setdefault(uuid, []).append((at, fig))
        cycles = max(cycles, summary.cycles)
        if pod.interval_s:
            intervals.append(pod.interval_s)
        for uuid, window in summary.windows().items():
            v = judge(window, t)
            extra = [*pod.notes]
            if lost := (*bad.get(uuid, ()), *bad.get("", ())):
                extra.append(unreadable_note(lost))
            if said := onset_note(v, timeline[uuid], w, pod.interval_s, t):
                extra.append(said)
            found.append((pod.key, uuid, dataclasses.replace(v, notes=(*v.notes, *extra)),
                          bool(lost)))
    pods_of = collections.Counter(uuid for _, uuid, _, _ in found)
    verdicts = {(uuid if pods_of[uuid] == 1 else pod_gpu(key, uuid)): v
                for key, uuid, v, _ in found}
    unreadable = frozenset(uuid if pods_of[uuid] == 1 else pod_gpu(key, uuid)
                           for key, uuid, _, lost in found if lost)
    order = sorted(verdicts, key=lambda u: (_ident(verdicts[u]), u))
    return Judged({u: verdicts[u] for u in order}, cycles,
                  statistics.median(intervals) if intervals else 0.0, unreadable)


def pod_gpu(key: tuple[str, ...], uuid: str) -> str:
    """A GPU's key where two pods report its UUID: the UUID, the pod and its node."""
    labels = dict(zip(POD_KEY, key, strict=True))
    return f"{uuid} (pod {labels['namespace']}/{labels['pod']}, node {labels['node']})"


def _ident(v: Verdict) -> tuple[int, str]:
    index = v.window.mean.index
    return (int(index) if index.isdigit() else 1 << 20, index)


def onset_window(w: Window, interval_s: float) -> float:
    """The trailing window an onset is judged on: short enough to place a change within it, long
    enough (at least three cycles) that one slow request does not make a p99."""
    return max(3 * interval_s, min(ONSET_MAX_S, (w.end - w.start) / 10))


def onsets(v: Verdict, timeline: Sequence[tuple[float, Figures]], w: Window, interval_s: float,
           t: Thresholds) -> list[tuple[float, str, bool]]:
    """For each finding of ``v`` and for a p99 above the objective: (since when it held to the
    end of the window on a trailing window, what, whether it held from the window's start)."""
    wanted = [f.key for f in v.findings]
    slow_overall = t.slow(v.window.p99)
    if not wanted and not slow_overall:
        return []
    span = onset_window(w, interval_s)
    held: dict[str, float | None] = {k: None for k in (*wanted, "p99")}
    first_at = timeline[0][0] if timeline else w.start
    settled = first_at + span - interval_s  # the first trailing window that is full
    start = 0
    for i, (at, _) in enumerate(timeline):
        while timeline[start][0] <= at - span:
            start += 1
        s = Summary()
        for _, fig in timeline[start:i + 1]:
            s.add({"gpu": fig})
        trailing = judge(s.windows()["gpu"], t)
        now = {f.key for f in trailing.findings}
        if t.slow(trailing.window.p99):
            now.add("p99")
        for key in held:
            if key in now:
                if held[key] is None:
                    held[key] = at
            else:
                held[key] = None
    out = []
    for key, since in held.items():
        if since is None or (key == "p99" and not slow_overall):
            continue
        out.append((since, key, since <= settled))
    return sorted(out)


def onset_note(v: Verdict, timeline: Sequence[tuple[float, Figures]], w: Window,
               interval_s: float, t: Thresholds) -> str:
    found = onsets(v, timeline, w, interval_s, t)
    if not found:
        return ""
    span = onset_window(w, interval_s)
    parts = []
    first = timeline[0][0] if timeline else w.start
    # the data may begin after the window does (the agent started later): then "from the start"
    # is from the first stored cycle, never the window's start, which held nothing
    start_said = ("already at the window's start" if not late_start(first, w, interval_s)
                  else f"from the first stored cycle, at {clock(first)}")
    for since, key, from_start in found:
        what = (f"p99 above {ms(t.p99_latency_s)}" if key == "p99"
                else f"{key} ({ALL_KINDS[key][2]})")
        parts.append(f"{what} {start_said}" if from_start else f"{what} from {clock(since)}")
    unsettled = [f.key for f in v.findings if f.key not in {k for _, k, _ in found}]
    tail = (f"; {', '.join(unsettled)} found over the whole window but not held to its end"
            if unsettled else "")
    return (f"when it started (UTC, each judged on the trailing {span:.0f} s, held to the "
            f"window's end): {'; '.join(parts)}{tail}")


def late_start(first: float, w: Window, interval_s: float) -> bool:
    """Whether the first stored cycle comes later than the window's start by more than a gap."""
    return first - w.start > max(GAP_INTERVALS * interval_s, 1.0)


def held_note(stored: Stored, w: Window, interval_s: float) -> str:
    """The part of the window that holds stored cycles, where it is not the whole window (the
    agents started after its start or stopped before its end): said on the window line, as the
    live diagnose says a window longer than the agent's."""
    times = [t for pod in stored.pods for t, _ in pod.cycles]
    if not times:
        return ""
    first, last = min(times), max(times)
    late = late_start(first, w, interval_s)
    early = w.end - last > max(GAP_INTERVALS * interval_s, PUSH_LAG_S)
    if not late and not early:
        return ""
    held = last - first + interval_s
    return (f"; the window holds only {held:.0f} s of stored cycles, from {clock(first)} to "
            f"{clock(last)} (" + " and ".join(
                [*(["the agents' first cycle came after its start"] if late else []),
                 *(["their last before its end"] if early else [])])
            + "): judged on those")


def explain_empty(store: Store, select: Sequence[tuple[str, str, str]], w: Window) -> str:
    """Why no GPU matched: the selector matches nothing lately, or the window holds nothing
    (before the agents pushed, or outside the store's retention). One more query."""
    shown = ", ".join(f"{a}{op}{b}" for a, op, b in select) or "(none)"
    rows = store.query(f"count(last_over_time({selector('gpu_sidecar_gpu_available', select)}"
                       f"[{duration(LOOKED_BACK_S)}]))", time.time())
    lately = int(rows[0].value) if rows else 0
    if lately:
        return (f"no GPU series in the window {w.shown()} with --select {shown}, though "
                f"{lately} GPU(s) match it in the last {LOOKED_BACK_S // 86400} days: the window "
                "is before the agents pushed, or older than the store keeps (its retention: "
                "VictoriaMetrics -retentionPeriod, Prometheus --storage.tsdb.retention.time); "
                "pick another --at")
    return (f"no GPU matches --select {shown} in {store.shown}, in the window {w.shown()} nor in "
            f"the last {LOOKED_BACK_S // 86400} days: check the labels (namespace, pod, node, "
            "gpu_uuid, job_name as the agents set them; `gpu-sidecar fleet --query-url URL` "
            "lists what the store holds) and that the agents push there")


def from_store(cfg: Config, *, t: Thresholds | None = None) -> int:
    """The command with --query-url: 0 nothing found, 1 a finding, 2 no GPU matched (or a bad
    --at), 6/7/8 the store unreachable or not a query API / refusing the credentials / refusing
    the query; 6 also where a GPU without a finding had figures stored as not a number (it was
    not seen healthy)."""
    try:
        w = window_of(cfg)
    except Refused as exc:
        print(f"gpu-sidecar diagnose: {exc}", file=sys.stderr)
        return 2
    store = Store(cfg)
    try:
        stored = fetch(store, cfg.select, w)
        if not stored.pods:
            print(f"gpu-sidecar diagnose: {explain_empty(store, cfg.select, w)}",
                  file=sys.stderr)
            return 2
    except StoreError as exc:
        print(f"gpu-sidecar diagnose: {exc}", file=sys.stderr)
        return exc.code
    finally:
        store.close()
    judged = judge_stored(stored, w, t)
    if not judged.verdicts:  # series in the window, but none a GPU's figure by name and labels
        print(f"gpu-sidecar diagnose: the window {w.shown()} in {store.shown} holds series of "
              f"{len(stored.pods)} pod(s) matching --select, but none that is a GPU's figure "
              "(a gpu_* name the agent exports, with its gpu_uuid label): nothing to judge; "
              "check that --query-url is the store the agents push to, unchanged (no relabelling "
              "that drops __name__ or gpu_uuid)", file=sys.stderr)
        return 2
    every = (f"every stored cycle (the agents' interval, about {judged.interval_s:g} s)"
             if judged.interval_s else "every stored cycle")
    source = (f"long-term storage {store.shown}, window {w.shown()} (UTC), {every}; "
              f"{store.queries} queries{held_note(stored, w, judged.interval_s)}")
    unjudged = sorted(judged.verdicts[u].window.mean.index for u in judged.unreadable
                      if not judged.verdicts[u].findings)
    said = (f"GPU {', '.join(unjudged)} not judged whole: figures stored as not a number (see "
            "its notes)") if unjudged else ""
    code = (1 if any(v.findings for v in judged.verdicts.values())
            else EXIT_UNREACHABLE if unjudged else 0)
    if cfg.output == "json":
        doc = document(judged.verdicts, seconds=w.end - w.start, samples=judged.cycles,
                       source=source, origin="store", t=t, held=said)
        doc["result"] = {**doc["result"], "code": code}  # type: ignore[dict-item]
        sys.stdout.write(dumps(doc))
    else:
        sys.stdout.write(report(
            judged.verdicts, seconds=w.end - w.start, samples=judged.cycles,
            label="  [from long-term storage]", t=t, source=source, unjudged=said))
    if code == EXIT_UNREACHABLE:  # not seen healthy: what the store held was no agent's figure
        print(f"gpu-sidecar diagnose: {store.shown} holds figures that are not a number (NaN "
              f"or an infinity) for GPU {', '.join(unjudged)}: left out, so nothing is said "
              "healthy (exit 6)", file=sys.stderr)
    return code

