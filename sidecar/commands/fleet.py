"""``gpu-sidecar fleet --query-url URL``: every GPU with data in the window, grouped by verdict,
worst first, one line per pod and GPU with its pod, node and the figure that decided.

The work is done where the data lives: the agents already judge their own GPUs and export the
verdict (``gpu_verdict{verdict=KIND} 1``, the kind at 0 for a while after it ends), so the store
is asked for aggregates only, a fixed number of queries whatever the fleet's size:

1. each GPU's verdict at the window's end (``last_over_time(gpu_verdict[D]) == 1``);
2. the kinds each GPU had at any time in the window (``max_over_time(...) == 1``);
3. the GPUs that pushed in the window without a verdict (agents of an older release);
4. when each agent was last seen (``seen_query``), and whether its last cycle was a clean
   stop's (``gpu_sidecar_up 0``);
5. for each kind found, one or two aggregates of its deciding figure over the window, grouped
   by pod and GPU (or by pod for the engine's), e.g. ``max by (..., gpu_uuid) (avg_over_time(
   PCIe RX|TX))``.

So at most ``MAX_QUERIES`` queries for 10 GPUs or 10,000; ``bench/bench_fleet.py`` measures it.

Every query keeps the pod's labels (``LINE``): two pods that report one GPU UUID in the window
(a rollout's old and new pod, a GPU time-sliced between two pods) are two lines, each with its
own verdict and figure, and each says which other pod has the GPU too.

An agent's verdict stays the last value stored for the store's whole look-back after it stopped,
so a verdict is only taken as current when its agent was seen near the window's end
(``state_of``): an agent whose last cycle said ``gpu_sidecar_up 0`` is ``stopped`` (a clean
stop), one with nothing stored for longer than ``SILENT_INTERVALS`` times its cycle and push
intervals (at least ``SILENT_FLOOR_S``) is ``silent`` (killed, or its pushes not arriving). Their
GPUs are listed apart with their last verdict and the time they were last seen, and never count
as a finding.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from sidecar import thresholds
from sidecar.commands.from_store import Refused, Window, explain_empty, stamp, window_of
from sidecar.config import Config
from sidecar.judge.rule import Deciding
from sidecar.judge.rules import ALL_KINDS, PRECEDENCE, RULES
from sidecar.recent import CURRENT_S
from sidecar.store import GPU_LABELS, Row, Store, StoreError, duration, selector
from sidecar.thresholds import Thresholds

if TYPE_CHECKING:
    from collections.abc import Iterable

# one line of the view: a pod's GPU (the pod's identity labels and the GPU's UUID)
LINE = ("namespace", "pod", "node", "container", "gpu_uuid")
POD = LINE[:-1]
OLDER = "older-agent"  # a GPU with data and no verdict: its agent predates gpu_verdict
CURRENT, STOPPED, SILENT = "current", "stopped", "silent"  # what its agent was at the end
# silent: nothing stored for longer than this many of its cycle-plus-push intervals (a live
# agent's newest stored cycle is at most one push and one cycle old), and at least the floor
# (a store's own ingestion delay)
SILENT_INTERVALS = 3.0
SILENT_FLOOR_S = 10.0
SEEN_STEPS = 3000  # the last-seen subquery's steps over the window, at most ...
SEEN_STEP_MIN_S = 0.1  # ... and at least this far apart


# kind -> its deciding figure, each read from its rule (sidecar.judge.rules.RULES): a kind
# without one is listed with no figure
DECIDING: dict[str, Deciding] = {r.kind: r.deciding for r in RULES if r.deciding is not None}
FIXED_QUERIES = 4  # verdicts, kinds in the window, older agents, last seen
# the bound a fleet of any size stays under: the fixed ones, and each kind's figures
MAX_QUERIES = FIXED_QUERIES + sum(len(f.queries) for f in DECIDING.values())

# a rule's per-GPU figure is grouped ``by (gpu_uuid...``: the fleet asks it per pod and GPU
_PER_GPU = re.compile(r"\bby \(gpu_uuid\b")


def per_line(expr: str) -> str:
    """A rule's aggregate grouped by the line's labels instead of the UUID alone, so a GPU two
    pods share gets each pod's own figure, never one folded from both."""
    return _PER_GPU.sub("by (" + ", ".join(LINE), expr)


def _expand(expr: str, select: Sequence[tuple[str, str, str]], rng: str,
            t: Thresholds) -> str:
    """Fill in each placeholder selector (``judge.rule.stored``): its name, the --select
    matchers, the range; per pod and GPU."""
    out = per_line(expr)
    while "@@SEL:" in out:
        head, _, rest = out.partition("@@SEL:")
        spec, _, tail = rest.partition("@@")
        name, extra, scope = spec.split(":")
        more = []
        if extra == "CRITICAL":
            more.append(f'xid=~"{"|".join(str(x) for x in t.critical_xids)}"')
        skip = GPU_LABELS if scope == "pod" else ()
        span = rng if scope != "before" else f"[5m] offset {rng.strip('[]')}"
        out = head + selector(name, select, *more, skip=skip) + span + tail
    return out


@dataclass(frozen=True)
class Gpu:
    """One line of the fleet view: one pod's GPU."""

    uuid: str
    verdict: str  # its agent's verdict at the window's end (its last one, unless current)
    namespace: str
    pod: str
    node: str
    container: str
    index: str
    name: str
    figure: str
    during: tuple[str, ...]  # other kinds it had at some time in the window
    state: str = CURRENT  # CURRENT, STOPPED or SILENT: its agent at the window's end
    last_seen: float | None = None  # Unix time of its newest stored cycle (None: not known)
    shared_with: tuple[str, ...] = ()  # the other pods that report this GPU UUID

    @property
    def group(self) -> str:
        return self.verdict if self.state == CURRENT else self.state


@dataclass(frozen=True)
class Seen:
    """When one line's agent was last seen, and what that makes it at the window's end."""

    state: str
    last: float | None
    silent_after_s: float


def seen_query(select: Sequence[tuple[str, str, str]], w: Window) -> str:
    """One query for every line's last-seen time and the figures its ``state_of`` needs, each
    arm told apart by a label ``f`` of its own (plain PromQL: Prometheus and VictoriaMetrics
    alike):

    - last, first: the newest and oldest stored cycle of the line (``timestamp()`` of
      ``gpu_sidecar_gpu_available``, sent every cycle: a sample's own time, exact at the
      window's end, within a step of the subquery before it; after a clean stop's staleness
      markers, 1 ms after its last cycle, Prometheus' ``timestamp()`` answers nothing from the
      marker on, so a stopped agent's last seen is the newest cycle a step saw: within a step
      and a cycle of its last);
    - count: its cycles in the window (with first and last, its interval);
    - up: its pod's last ``gpu_sidecar_up`` (0: the last cycle of a clean stop);
    - push: its pod's mean time between accepted pushes (the values of
      ``gpu_sidecar_last_push_success_timestamp_seconds`` over their changes);
    - now: the store's own time for the window's end (VictoriaMetrics moves a query near now
      back by its ``-search.latencyOffset``, 30 s by default, and so does ``time()``)."""
    span = w.end - w.start
    rng = f"[{duration(span)}]"
    step_ms = round(max(SEEN_STEP_MIN_S, span / SEEN_STEPS) * 1000)
    sub = f"[{duration(span)}:{step_ms}ms]"
    avail = selector("gpu_sidecar_gpu_available", select)
    up = selector("gpu_sidecar_up", select, skip=GPU_LABELS)
    pushed = selector("gpu_sidecar_last_push_success_timestamp_seconds", select,
                      skip=GPU_LABELS)
    line, pod = ", ".join(LINE), ", ".join(POD)
    arms = {
        "last": f"max by ({line}) (timestamp({avail}) or max_over_time(timestamp({avail}){sub}))",
        "first": f"min by ({line}) (min_over_time(timestamp({avail}){sub}))",
        "count": f"max by ({line}) (count_over_time({avail}{rng}))",
        "up": f"max by ({pod}) (last_over_time({up}{rng}))",
        "push": f"max by ({pod}) ((max_over_time({pushed}{rng}) - min_over_time({pushed}{rng}))"
                f" / (changes({pushed}{rng}) > 0))",
        "now": "vector(time())",
    }
    return " or ".join(f'label_replace({expr}, "f", "{f}", "", "")' for f, expr in arms.items())


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def state_of(rows: Sequence[Row], w: Window) -> tuple[dict[tuple[str, ...], Seen], float]:
    """Each line's ``Seen``, and the store's time for the window's end. The rule:

    - ``stopped``: its pod's last ``gpu_sidecar_up`` in the window is 0 (the agent's last cycle
      on a stop signal; a later run of the same pod sends 1 again);
    - ``silent``: its newest cycle is older, at the window's end, than ``SILENT_INTERVALS``
      times its interval plus its push interval (each measured from its own series; where one
      cannot be, the default of ``run``'s option), and at least ``SILENT_FLOOR_S``;
    - ``current`` otherwise, and where nothing says when it was last seen (no
      ``gpu_sidecar_gpu_available``): kept as its verdict says, never passed off as stopped."""
    figures: dict[str, dict[tuple[str, ...], float]] = {}
    for r in rows:
        f = r.label("f")
        keys = POD if f in ("up", "push") else LINE
        if (v := _finite(r.value)) is not None:
            figures.setdefault(f, {})[tuple(r.label(k) for k in keys)] = v
    now = min(w.end, figures.get("now", {}).get(("",) * len(LINE), w.end))
    start = now - (w.end - w.start)
    out: dict[tuple[str, ...], Seen] = {}
    for key, last in figures.get("last", {}).items():
        pod = key[:len(POD)]
        count = figures.get("count", {}).get(key, 0.0)
        first = max(figures.get("first", {}).get(key, last), start)
        interval = (last - first) / (count - 1) if count >= 2 and last > first else None
        push = figures.get("push", {}).get(pod)
        after = max(SILENT_FLOOR_S, SILENT_INTERVALS * (
            (interval or Config.interval) + (push if push and push > 0 else Config.push_interval)))
        if figures.get("up", {}).get(pod) == 0:
            state = STOPPED
        elif now - last > after:
            state = SILENT
        else:
            state = CURRENT
        out[key] = Seen(state, last, after)
    return out, now


def _key(row: Row) -> tuple[str, ...]:
    return tuple(row.label(k) for k in LINE)


def fleet_of(store: Store, select: Sequence[tuple[str, str, str]], w: Window,
             t: Thresholds | None = None) -> list[Gpu]:
    """Every pod's GPU with data in the window, current findings worst first, then those of
    agents that stopped or fell silent."""
    t = t or thresholds.THRESHOLDS
    rng = f"[{duration(w.end - w.start)}]"
    verdict = selector("gpu_verdict", select) + rng
    line = ", ".join(LINE)
    current = store.query(f"last_over_time({verdict}) == 1", w.end)
    seen = store.query(f"max by ({line}, verdict) (max_over_time({verdict})) == 1", w.end)
    older = store.query(
        f"last_over_time({selector('gpu_sidecar_gpu_available', select)}{rng}) unless on "
        f"({line}) last_over_time({verdict})", w.end)
    states, _ = state_of(store.query(seen_query(select, w), w.end), w)
    gpus: dict[tuple[str, ...], dict[str, str]] = {}
    for row in current:
        if row.value != 1:  # the answer to "== 1": anything else (NaN from a proxy) is no verdict
            continue
        key = _key(row)
        known = gpus.get(key)
        kind = row.label("verdict")
        # two kinds at 1 in one GPU's last samples (a restart between them): the worse one
        if known is None or _rank(kind) < _rank(known["verdict"]):
            gpus[key] = {"verdict": kind, "gpu_index": row.label("gpu_index"),
                         "gpu_name": row.label("gpu_name")}
    for row in older:
        gpus.setdefault(_key(row), {"verdict": OLDER, "gpu_index": row.label("gpu_index"),
                                    "gpu_name": row.label("gpu_name")})
    during: dict[tuple[str, ...], set[str]] = {}
    for row in seen:
        during.setdefault(_key(row), set()).add(row.label("verdict"))
    figures = _figures(store, select, rng, t, {k: g["verdict"] for k, g in gpus.items()}, w)
    pods_of: dict[str, set[tuple[str, ...]]] = {}
    for key in gpus:
        pods_of.setdefault(key[-1], set()).add(key[:-1])
    out = []
    for key, g in gpus.items():
        labels = dict(zip(LINE, key, strict=True))
        kind = g["verdict"]
        figure = figures.get(key, "")
        if kind == OLDER:
            figure = "no gpu_verdict series: its agent is of an older release; upgrade it"
        elif kind == "none":
            figure = "nothing crossed a threshold"
        s = states.get(key)
        out.append(Gpu(
            uuid=labels["gpu_uuid"], verdict=kind, namespace=labels["namespace"],
            pod=labels["pod"], node=labels["node"], container=labels["container"],
            index=g["gpu_index"], name=g["gpu_name"], figure=figure,
            during=tuple(k for k in PRECEDENCE if k in during.get(key, set()) and k != kind),
            state=s.state if s else CURRENT, last_seen=s.last if s else None,
            shared_with=tuple(sorted(_pod_shown(p) for p in pods_of[key[-1]] - {key[:-1]}))))
    return sorted(out, key=lambda g: (_group_rank(g.group), _rank(g.verdict), g.namespace,
                                      g.pod, g.container, g.index, g.uuid))


def _pod_shown(pod: Sequence[str]) -> str:
    labels = dict(zip(POD, pod, strict=True))
    shown = f"{labels['namespace'] or '-'}/{labels['pod'] or '-'}"
    return shown + (f" ({labels['container']})" if labels["container"] else "")


def _figures(store: Store, select: Sequence[tuple[str, str, str]], rng: str, t: Thresholds,
             kinds: Mapping[tuple[str, ...], str], w: Window) -> dict[tuple[str, ...], str]:
    """Each line's deciding figure: per kind found, its rule's aggregates, one query each."""
    out: dict[tuple[str, ...], str] = {}
    for kind in PRECEDENCE:
        keys = [k for k, v in kinds.items() if v == kind]
        if not keys or kind not in DECIDING:
            continue
        spec = DECIDING[kind]
        per_gpu = spec.by == ("gpu_uuid",)
        answers = [store.query(_expand(q, select, rng, t), w.end) for q in spec.queries]
        keyed = [{(_key(r) if per_gpu else tuple(r.label(k) for k in spec.by)): r.value
                  for r in rows} for rows in answers]
        for key in keys:
            labels = dict(zip(LINE, key, strict=True))
            wanted = key if per_gpu else tuple(labels.get(k, "") for k in spec.by)
            values = [k.get(wanted) for k in keyed]
            if any(v is not None and not math.isfinite(v) for v in values):
                # NaN (or an infinity) is no figure: never printed, never read as one
                out[key] = ("its deciding figure is not a number in the store's answer (NaN "
                            "or an infinity): not read; diagnose --query-url says which series")
            else:
                out[key] = spec.text(values, t)
    return out


def _rank(kind: str) -> int:
    if kind in PRECEDENCE:
        return PRECEDENCE.index(kind)
    return len(PRECEDENCE) + (0 if kind == OLDER else 1 if kind == "none" else 2)


def _group_rank(group: str) -> int:
    """Current findings in precedence, then older agents, nothing found, stopped, silent."""
    return len(PRECEDENCE) + 3 + (0 if group == STOPPED else 1) if group in (
        STOPPED, SILENT) else _rank(group)


def _ago(g: Gpu, w: Window) -> str:
    if g.last_seen is None:
        return "last seen: not known"
    return (f"last seen {stamp(g.last_seen)}, {max(0.0, w.end - g.last_seen):.0f} s before the "
            "window's end")


TITLES = {
    OLDER: "not judged: agents of an older release",
    "none": "nothing found",
    STOPPED: "their agents stopped cleanly (the last cycle said gpu_sidecar_up 0): their last "
             "verdicts, not current",
    SILENT: f"their agents fell silent (nothing stored for over {SILENT_INTERVALS:g} of their "
            "cycle and push intervals before the window's end: killed, or their pushes not "
            "arriving): their last verdicts, not current",
}


def _groups(gpus: Iterable[Gpu]) -> dict[str, list[Gpu]]:
    groups: dict[str, list[Gpu]] = {}
    for g in gpus:
        groups.setdefault(g.group, []).append(g)
    return groups


def render(gpus: Sequence[Gpu], w: Window, store: Store) -> str:
    groups = _groups(gpus)
    now = [g for g in gpus if g.state == CURRENT]
    uuids = {g.uuid for g in gpus}
    shared = {g.uuid for g in gpus if g.shared_with}
    also_shared = (f" ({len(uuids)} distinct, {len(shared)} reported by more than one pod)"
                   if shared else "")
    out = [f"gpu-sidecar fleet: {len(gpus)} GPU(s) with data in {store.shown}{also_shared}, "
           f"window {w.shown()} (UTC); {store.queries} queries, {store.seconds:.2f} s in the "
           "store",
           f"verdicts: each agent's own (gpu_verdict, its judgement over its last {CURRENT_S:g} "
           "s, at the window's end; the thresholds of the shipped alert rules); figures: means "
           "over the window"]
    for group, members in groups.items():
        title = ALL_KINDS[group][2] if group in ALL_KINDS else TITLES.get(group, group)
        out += ["", f"{group} ({len(members)}): {title}"]
        for g in members:
            where = f"{g.namespace or '-'}/{g.pod or '-'}"
            if g.container:
                where += f" ({g.container})"
            what = g.figure if g.state == CURRENT else (
                f"last verdict {g.verdict}: {g.figure}; {_ago(g, w)}")
            also = f"; also in the window: {', '.join(g.during)}" if g.during else ""
            share = f"; shared: also in pod {', '.join(g.shared_with)}" if g.shared_with else ""
            out.append(f"  {where}  node {g.node or '-'}  GPU {g.index or '?'} {g.uuid or '?'}  "
                       f"{what}{also}{share}")
    out += ["", result_line(gpus)]
    if not now:
        out[-1] += f" ({len(gpus)} not current)"
    elif len(now) < len(gpus):
        late = _groups(g for g in gpus if g.state != CURRENT)
        out[-1] += "; not judged now: " + ", ".join(f"{len(v)} of {k} agents" for k, v in
                                                  late.items())
    return "\n".join(out) + "\n"


def result_line(gpus: Sequence[Gpu]) -> str:
    now = [g for g in gpus if g.state == CURRENT]
    found = [g for g in now if g.verdict in ALL_KINDS]
    if not now:
        return "result: no agent seen at the window's end: every GPU's agent stopped or is silent"
    counts = ", ".join(f"{k} {len(v)}" for k, v in _groups(found).items())
    return (f"result: a finding on {len(found)} of {len(now)} GPU(s): {counts}" if found
            else f"result: nothing found on {len(now)} GPU(s)")


def as_json(gpus: Sequence[Gpu], w: Window, store: Store) -> str:
    groups: dict[str, list[dict[str, object]]] = {}
    for g in gpus:
        entry = {k: v for k, v in asdict(g).items() if k != "verdict"}
        if g.state != CURRENT:
            entry["last_verdict"] = g.verdict
        groups.setdefault(g.group, []).append(entry)
    return json.dumps({
        "store": store.shown, "window": {"start": w.start, "end": w.end}, "queries": store.queries,
        "gpus": len(gpus), "distinct_gpus": len({g.uuid for g in gpus}),
        "current": sum(1 for g in gpus if g.state == CURRENT),
        "found": sum(1 for g in gpus if g.state == CURRENT and g.verdict in ALL_KINDS),
        "groups": [{"verdict": k, "count": len(v), "gpus": v} for k, v in groups.items()],
    }, indent=1) + "\n"


def fleet(cfg: Config, *, t: Thresholds | None = None) -> int:
    """The command: 0 nothing found on the GPUs seen at the window's end, 1 a finding on one of
    them, 2 no GPU (or a bad --at), or none seen at the window's end (every agent stopped or
    silent: listed, with why), 6/7/8 the store unreachable / refusing the credentials /
    refusing the query."""
    try:
        w = window_of(cfg)
    except Refused as exc:
        print(f"gpu-sidecar fleet: {exc}", file=sys.stderr)
        return 2
    store = Store(cfg)
    try:
        gpus = fleet_of(store, cfg.select, w, t)
        if not gpus:
            print(f"gpu-sidecar fleet: {explain_empty(store, cfg.select, w)}", file=sys.stderr)
            return 2
    except StoreError as exc:
        print(f"gpu-sidecar fleet: {exc}", file=sys.stderr)
        return exc.code
    finally:
        store.close()
    sys.stdout.write(as_json(gpus, w, store) if cfg.output == "json" else render(gpus, w, store))
    now = [g for g in gpus if g.state == CURRENT]
    if not now:
        print(f"gpu-sidecar fleet: no agent was seen at the window's end: the {len(gpus)} GPU(s) "
              "listed are of agents that stopped or fell silent, their verdicts the last they "
              "sent, not current; give an --at when they ran to judge them", file=sys.stderr)
        return 2
    return 1 if any(g.verdict in ALL_KINDS for g in now) else 0
