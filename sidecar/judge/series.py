"""Series into figures: one cycle's series, as a sink sent them or a store kept them, decoded into
each GPU's ``Figures`` (``figures_of``), and the verdicts the agent exported
(``exported_verdicts``). The boundary of the judge for whatever reads series back: the store's
commands, a test that reads a sink's output.
"""

from __future__ import annotations

from collections.abc import Iterable

from sidecar.judge.figures import Figures
from sidecar.judge.table_figures import FIELD_OF
from sidecar.samples import Series

_BUCKET = "inference_request_duration_seconds_bucket"
_XID = "gpu_xid_errors_total"
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
        field_ = FIELD_OF.get(name)
        if field_ is not None:
            row[field_] = s.value
        elif name == _BUCKET:
            buckets.setdefault(labels["gpu_uuid"], []).append((float(labels["le"]), s.value))
        elif name == "gpu_sidecar_gpu_available":
            row["available"] = s.value == 1
        elif name == _XID and labels.get("xid", "").isdigit():
            xids.setdefault(labels["gpu_uuid"], []).append((int(labels["xid"]), s.value))
    for uuid, pairs in buckets.items():
        pairs.sort()
        rows[uuid]["latency"] = (shared_bounds(tuple(b for b, _ in pairs)),
                                 tuple(c for _, c in pairs))
    for uuid, codes in xids.items():
        rows[uuid]["xids"] = tuple(sorted(codes))
    return figures_with_engine(rows, engine.figures())


def figures_with_engine(rows: dict[str, dict[str, object]], pod: dict[str, object]
                        ) -> dict[str, Figures]:
    """Each GPU's row of figures, with the pod's engine figures (``pod``) on every GPU, and
    whose latency the verdict joins: the app's histogram where it publishes one, else the
    engine's."""
    for row in rows.values():
        row.update(pod)
        if row.get("latency") is not None:
            row["latency_source"] = "app"
        elif pod.get("engine_latency") is not None:  # the app publishes none: the engine's
            row["latency"], row["latency_source"] = pod["engine_latency"], "engine"
    return {uuid: Figures(**row) for uuid, row in rows.items()}  # type: ignore[arg-type]


def engine_figures(series: Iterable[Series]) -> dict[str, object]:
    """The pod's engine figures of one cycle's engine series (no GPU label), combined over
    endpoints and models."""
    engine = _EngineFigures()
    for s in series:
        labels = dict(s.labels)
        if s.name.startswith("engine_") and "gpu_uuid" not in labels:
            engine.add(s.name, labels, s.value)
    return engine.figures()


_BOUNDS: dict[tuple[float, ...], tuple[float, ...]] = {}
_MAX_BOUNDS = 64  # distinct bucket layouts kept; an app that keeps changing its own costs a clear


def shared_bounds(bounds: tuple[float, ...]) -> tuple[float, ...]:
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
_READ = frozenset({*FIELD_OF, _BUCKET, _XID, "gpu_sidecar_gpu_available"})


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
            bounds = shared_bounds(tuple(sorted(total)))
            out[_ENGINE_HISTS[stem]] = (bounds, tuple(total[b] for b in bounds))
        return out

