"""``gpu-sidecar fleet --query-url URL``: every GPU with data in the window, grouped by verdict,
worst first, one line per GPU with its pod, node and the figure that decided.

The work is done where the data lives: the agents already judge their own GPUs and export the
verdict (``gpu_verdict{verdict=KIND} 1``, the kind at 0 for a while after it ends), so the store
is asked for aggregates only, a fixed number of queries whatever the fleet's size:

1. each GPU's verdict at the window's end (``last_over_time(gpu_verdict[D]) == 1``);
2. the kinds each GPU had at any time in the window (``max_over_time(...) == 1``);
3. the GPUs that pushed in the window without a verdict (agents of an older release);
4. for each kind found, one or two aggregates of its deciding figure over the window, grouped
   by GPU (or by pod for the engine's), e.g. ``max by (gpu_uuid) (avg_over_time(PCIe RX|TX))``.

So at most ``MAX_QUERIES`` (21) queries for 10 GPUs or 10,000; ``bench/bench_fleet.py``
measures it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from sidecar import thresholds
from sidecar.commands.from_store import Refused, Window, explain_empty, window_of
from sidecar.store import GPU_LABELS, Store, StoreError, duration, selector
from sidecar.thresholds import Thresholds
from sidecar.views.verdict import ALL_KINDS, PRECEDENCE, RULES, Deciding

if TYPE_CHECKING:
    from sidecar.config import Config

IDENTITY = ("namespace", "pod", "node", "container", "gpu_index", "gpu_name")
OLDER = "older-agent"  # a GPU with data and no verdict: its agent predates gpu_verdict


# kind -> its deciding figure, each read from its rule (sidecar.views.verdict.RULES): a kind
# without one is listed with no figure
DECIDING: dict[str, Deciding] = {r.kind: r.deciding for r in RULES if r.deciding is not None}
# the bound a fleet of any size stays under: three, and each kind's figures
MAX_QUERIES = 3 + sum(len(f.queries) for f in DECIDING.values())


def _expand(expr: str, select: Sequence[tuple[str, str, str]], rng: str,
            t: Thresholds) -> str:
    """Fill in each placeholder selector (``verdict.stored``): its name, the --select
    matchers, the range."""
    out = expr
    while "@@SEL:" in out:
        head, _, rest = out.partition("@@SEL:")
        spec, _, tail = rest.partition("@@")
        name, extra, scope = spec.split(":")
        more = []
        if extra == "CRITICAL":
            more.append(f'xid=~"{"|".join(str(x) for x in t.critical_xids)}"')
        skip = GPU_LABELS if scope == "pod" else ()
        out = head + selector(name, select, *more, skip=skip) + rng + tail
    return out


@dataclass(frozen=True)
class Gpu:
    """One line of the fleet view."""

    uuid: str
    verdict: str
    namespace: str
    pod: str
    node: str
    index: str
    name: str
    figure: str
    during: tuple[str, ...]  # other kinds it had at some time in the window


def fleet_of(store: Store, select: Sequence[tuple[str, str, str]], w: Window,
             t: Thresholds | None = None) -> list[Gpu]:
    """Every GPU with data in the window, worst verdict first."""
    t = t or thresholds.THRESHOLDS
    rng = f"[{duration(w.end - w.start)}]"
    verdict = selector("gpu_verdict", select) + rng
    current = store.query(f"last_over_time({verdict}) == 1", w.end)
    seen = store.query(f"max by (gpu_uuid, verdict) (max_over_time({verdict})) == 1", w.end)
    older = store.query(
        f"last_over_time({selector('gpu_sidecar_gpu_available', select)}{rng}) unless on "
        f"(gpu_uuid) last_over_time({verdict})", w.end)
    gpus: dict[str, dict[str, str]] = {}
    for row in current:
        uuid = row.label("gpu_uuid")
        known = gpus.get(uuid)
        kind = row.label("verdict")
        # two kinds at 1 in one GPU's last samples (a restart between them): the worse one
        if known is None or _rank(kind) < _rank(known["verdict"]):
            gpus[uuid] = {"verdict": kind, **{k: row.label(k) for k in IDENTITY}}
    for row in older:
        uuid = row.label("gpu_uuid")
        gpus.setdefault(uuid, {"verdict": OLDER, **{k: row.label(k) for k in IDENTITY}})
    during: dict[str, set[str]] = {}
    for row in seen:
        during.setdefault(row.label("gpu_uuid"), set()).add(row.label("verdict"))
    figures: dict[str, str] = {}
    for kind in PRECEDENCE:
        uuids = [u for u, g in gpus.items() if g["verdict"] == kind]
        if not uuids or kind not in DECIDING:
            continue
        spec = DECIDING[kind]
        answers = [store.query(_expand(q, select, rng, t), w.end) for q in spec.queries]
        keyed = [{tuple(r.label(k) for k in spec.by): r.value for r in rows} for rows in answers]
        for u in uuids:
            g = gpus[u]
            key = (u,) if spec.by == ("gpu_uuid",) else tuple(g[k] for k in spec.by)
            figures[u] = spec.text([k.get(key) for k in keyed], t)
    out = []
    for u, g in gpus.items():
        kind = g["verdict"]
        figure = figures.get(u, "")
        if kind == OLDER:
            figure = "no gpu_verdict series: its agent is of an older release; upgrade it"
        elif kind == "none":
            figure = "nothing crossed a threshold"
        out.append(Gpu(u, kind, g["namespace"], g["pod"], g["node"], g["gpu_index"],
                       g["gpu_name"], figure,
                       tuple(k for k in PRECEDENCE if k in during.get(u, set()) and k != kind)))
    return sorted(out, key=lambda g: (_rank(g.verdict), g.namespace, g.pod, g.index, g.uuid))


def _rank(kind: str) -> int:
    if kind in PRECEDENCE:
        return PRECEDENCE.index(kind)
    return len(PRECEDENCE) + (0 if kind == OLDER else 1 if kind == "none" else 2)


def render(gpus: Sequence[Gpu], w: Window, store: Store) -> str:
    groups: dict[str, list[Gpu]] = {}
    for g in gpus:
        groups.setdefault(g.verdict, []).append(g)
    found = [g for g in gpus if g.verdict in ALL_KINDS]
    out = [f"gpu-sidecar fleet: {len(gpus)} GPU(s) with data in {store.shown}, window "
           f"{w.shown()} (UTC); {store.queries} queries, {store.seconds:.2f} s in the store",
           "verdicts: each agent's own (gpu_verdict, its last minute at the window's end, the "
           "thresholds of the shipped alert rules); figures: means over the window"]
    for kind, members in groups.items():
        title = ALL_KINDS[kind][2] if kind in ALL_KINDS else (
            "not judged: agents of an older release" if kind == OLDER else "nothing found")
        out += ["", f"{kind} ({len(members)}): {title}"]
        for g in members:
            where = f"{g.namespace or '-'}/{g.pod or '-'}"
            also = f"; also in the window: {', '.join(g.during)}" if g.during else ""
            out.append(f"  {where}  node {g.node or '-'}  GPU {g.index or '?'} {g.uuid}  "
                       f"{g.figure}{also}")
    counts = ", ".join(f"{k} {len(v)}" for k, v in groups.items() if k in ALL_KINDS)
    out += ["", f"result: a finding on {len(found)} of {len(gpus)} GPU(s): {counts}" if found
            else f"result: nothing found on {len(gpus)} GPU(s)"]
    return "\n".join(out) + "\n"


def as_json(gpus: Sequence[Gpu], w: Window, store: Store) -> str:
    groups: dict[str, list[dict[str, object]]] = {}
    for g in gpus:
        groups.setdefault(g.verdict, []).append(
            {k: v for k, v in asdict(g).items() if k != "verdict"})
    return json.dumps({
        "store": store.shown, "window": {"start": w.start, "end": w.end}, "queries": store.queries,
        "gpus": len(gpus), "found": sum(1 for g in gpus if g.verdict in ALL_KINDS),
        "groups": [{"verdict": k, "count": len(v), "gpus": v} for k, v in groups.items()],
    }, indent=1) + "\n"


def fleet(cfg: Config, *, t: Thresholds | None = None) -> int:
    """The command: 0 nothing found, 1 a finding on some GPU, 2 no GPU (or a bad --at), 6/7/8
    the store unreachable / refusing the credentials / refusing the query."""
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
    return 1 if any(g.verdict in ALL_KINDS for g in gpus) else 0
