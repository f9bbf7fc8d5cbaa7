"""What ``gpu-sidecar diagnose --output json`` prints: the report as one JSON document.

The same verdicts, figures, notes and remedies as ``views.report`` prints, for scripts that page
on them, whatever the window came from (the running agent's window, long-term storage, sampled
afresh). A pure renderer of ``Verdict``s, like the text.

The schema is versioned by ``SCHEMA``: a field is added within a version, never renamed or
removed; a change that would break a reader is a new version. docs/diagnose.md lists the fields.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping

from sidecar import thresholds
from sidecar.judge.figures import Figures
from sidecar.judge.verdict import Verdict
from sidecar.judge.window import Window
from sidecar.thresholds import Thresholds
from sidecar.views.report import shared_of

SCHEMA = "gpu-sidecar/diagnose/v1"
# the Figures fields that are no figure: who the GPU is, or a histogram the quantiles summarise
_NOT_FIGURES = frozenset({"uuid", "name", "index", "available", "latency", "xids",
                          "latency_source", "engine", "engine_latency", "queue", "ttft", "itl"})


def document(verdicts: Mapping[str, Verdict], *, seconds: float, samples: int, source: str,
             origin: str, t: Thresholds | None = None, held: str = "",
             partial: bool = False) -> dict[str, object]:
    """The report as a JSON-ready mapping. ``origin`` names where the window came from
    (``agent-window``, ``store``, ``fresh``); ``source`` is the text's ``window:`` line."""
    t = t or thresholds.THRESHOLDS
    gpus = [_gpu(key, v) for key, v in verdicts.items()]
    found = [g for g in gpus if g["findings"]]
    # a GPU two pods report is keyed "UUID (pod ...)": its finding says which pod's it is
    named = {id(g): f"GPU {g['index']}{shared_of(key, v)} {g['verdict']}"
             for g, (key, v) in zip(gpus, verdicts.items(), strict=True)}
    return {
        "schema": SCHEMA,
        "origin": origin,
        "source": source,
        "seconds": _number(seconds),
        "samples": samples,
        "partial": partial,
        "note": held or None,
        "thresholds": {f.name: getattr(t, f.name) for f in dataclasses.fields(t)},
        "gpus": gpus,
        "result": {"code": 1 if found else 0,
                   "findings": [named[id(g)] for g in found]},
    }


def dumps(doc: Mapping[str, object]) -> str:
    """One document, one line, strict JSON (no NaN: a figure that is not finite is absent)."""
    return json.dumps(doc, allow_nan=False, sort_keys=False) + "\n"


def _gpu(key: str, v: Verdict) -> dict[str, object]:
    m: Figures = v.window.mean
    return {
        "key": key,
        "uuid": m.uuid,
        "index": m.index,
        "name": m.name,
        "verdict": v.key,
        "compute_judged": v.compute_judged,
        "findings": [{"kind": f.key, "layer": f.layer, "title": f.title,
                      "evidence": f.evidence, "remedy": f.remedy} for f in v.findings],
        "notes": list(v.notes),
        "figures": _figures(m),
        "window": _window(v.window),
    }


def _figures(m: Figures) -> dict[str, float]:
    """Every figure the window had (means; counters and states their last value), by the
    verdict's figure names (``figure=`` in sidecar/metrics.py); absent ones are left out."""
    out: dict[str, float] = {}
    for f in dataclasses.fields(m):
        if f.name in _NOT_FIGURES:
            continue
        value = getattr(m, f.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value):
            out[f.name] = float(value)
    return out


def _window(w: Window) -> dict[str, object]:
    return {
        "samples": w.samples,
        "unreadable": w.unreadable,
        "lost": w.lost,
        "allocator_retries": _number(w.retries),
        "allocator_ooms": _number(w.ooms),
        "p50_seconds": _number(w.p50),
        "p99_seconds": _number(w.p99),
        "requests": _number(w.requests),
        "latency_since_start": w.latency_since_start,
        "increases": {k: x for k, x in ((k, _number(v)) for k, v in w.increases.items())
                      if x is not None},
        "xids": {str(code): n for code, n in sorted(w.xids.items()) if math.isfinite(n)},
        "engine": {"p99_seconds": _number(w.engine_p99), "queue_p99_seconds": _number(w.queue_p99),
                   "ttft_p99_seconds": _number(w.ttft_p99), "itl_p99_seconds": _number(w.itl_p99),
                   "queue_share": _number(w.queue_share)},
    }


def _number(value: float | None) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None
