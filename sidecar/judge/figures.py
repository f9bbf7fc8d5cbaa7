"""The figures a verdict reads, per GPU: ``Figures``, the metric table's figures
(``TableFigures``, generated from ``sidecar.metrics.TABLE``) and what is not one series each:
who the GPU is, the request-latency histogram, the Xid counts, and the serving engine's.

One cycle's figures come from the agent's samples (``sidecar.judge.samples``) or are decoded from
stored series (``sidecar.judge.series``); a ``Window`` holds their means.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.judge.table_figures import TableFigures

Hist = tuple[tuple[float, ...], tuple[float, ...]]  # cumulative buckets: bounds (+Inf last), counts


@dataclass(frozen=True, slots=True, kw_only=True)
class Figures(TableFigures):
    """One GPU as one cycle describes it (None: absent), or, in a ``Window``, the mean of the
    cycles that had the figure (counters, codes and link states: their last value)."""

    uuid: str
    name: str = ""
    index: str = ""
    available: bool = True
    # what is not one series each: the request-latency histogram, the Xid counts by code...
    latency: Hist | None = None
    xids: tuple[tuple[int, float], ...] | None = None
    # ...and the serving engine's (--engine-metrics-url), the pod's and so every GPU's of it:
    # its histograms as cumulative buckets, its counters and gauges summed over endpoints and
    # models
    latency_source: str = ""  # "app" or "engine": whose ``latency`` it is
    engine: str = ""  # the engines seen, e.g. "vllm"
    engine_latency: Hist | None = None
    queue: Hist | None = None
    ttft: Hist | None = None
    itl: Hist | None = None
    engine_latency_sum: float | None = None
    engine_latency_count: float | None = None
    queue_sum: float | None = None
    queue_count: float | None = None
    kv_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions: float | None = None
    prefill_sum: float | None = None
    decode_sum: float | None = None
