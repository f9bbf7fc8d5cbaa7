"""A batch Job's run summary: how each GPU's three layers went over the whole run.

A Job's history in a time-series database answers "how did it go" only while someone keeps the
Job's time range, the dashboard and the thresholds in mind; the summary answers it in a few
series pushed once, at the end, keyed by the Job: the peak and the mean of each ratio, the share
of the run each verdict kind was the GPU's verdict (the agent's own, as its ``gpu_verdict``
series say it: the one judge, ``sidecar.judge``, every kind of ``PRECEDENCE``), the allocator's
retries and OOMs, and the p99 request latency over the run.

It reads the series each cycle emits, so the summary is by construction a function of what the
sinks received (and what the test reads back from stdout). Memory is constant in the length of
the run: per GPU a few running figures and one counter per latency bucket, no sample history.

The figures so far are also kept on the spool volume (``Checkpoint``), rewritten every push
interval, so that an agent killed mid-run (an OOM kill, SIGKILL) and restarted in the same pod
goes on with the run's summary instead of starting a new one from its restart.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from sidecar.judge.rules import PRECEDENCE
from sidecar.judge.window import histogram_quantile as quantile
from sidecar.log import Episodes
from sidecar.samples import Labels, Series, with_labels

# the ratios of the three layers whose peak and mean the summary keeps
RATIOS = (
    "gpu_sm_occupancy_ratio", "gpu_tensor_core_util_ratio", "gpu_mem_bandwidth_util_ratio",
    "gpu_pcie_tx_bandwidth_util_ratio", "gpu_pcie_rx_bandwidth_util_ratio",
    "gpu_memory_fragmentation_ratio",
)
# counters whose increase over the run the summary reports
COUNTERS = {"gpu_allocator_alloc_retries_total": "gpu_run_alloc_retries",
            "gpu_allocator_ooms_total": "gpu_run_ooms"}
# the agent's verdict each cycle (its gpu_verdict series at 1): every kind, and none
KINDS = (*PRECEDENCE, "none")
_VERDICT = "gpu_verdict"
_AVAILABLE = "gpu_sidecar_gpu_available"  # 0 in a cycle the GPU was selected but not read
_BUCKET = "inference_request_duration_seconds_bucket"
# the serving engine's (the pod's): the run's latency on a GPU whose app publishes none
_ENGINE_BUCKET = "engine_request_duration_seconds_bucket"
_WATCHED = frozenset((*RATIOS, *COUNTERS, _AVAILABLE))
STATE_VERSION = 2  # 2: the verdicts' kinds, not three conditions of the summary's own

log = structlog.get_logger("sidecar.summary")


@dataclass
class _Increase:
    """A counter's increase since zero, a reset (a process restart) counted as a new start."""

    last: float = 0.0
    total: float = 0.0

    def see(self, value: float) -> None:
        self.total += value - self.last if value >= self.last else value
        self.last = value


@dataclass
class _GpuRun:
    cycles: int = 0
    unreadable: int = 0  # cycles in which the GPU was selected but could not be read (lost)
    peak: dict[str, float] = field(default_factory=dict)
    total: dict[str, float] = field(default_factory=dict)
    seen: dict[str, int] = field(default_factory=dict)
    verdicts: dict[str, int] = field(default_factory=dict)  # kind -> cycles it was the verdict
    judged: int = 0  # cycles with a verdict
    counters: dict[str, _Increase] = field(default_factory=dict)
    buckets: dict[float, _Increase] = field(default_factory=dict)  # upper bound -> increase

    def add(self, figures: dict[str, float]) -> None:
        if figures.get(_AVAILABLE) == 0.0:
            self.unreadable += 1
            return
        self.cycles += 1
        for name in RATIOS:
            value = figures.get(name)
            if value is None or math.isnan(value):
                continue
            self.peak[name] = max(value, self.peak.get(name, -math.inf))
            self.total[name] = self.total.get(name, 0.0) + value
            self.seen[name] = self.seen.get(name, 0) + 1
        for name in COUNTERS:
            if name in figures:
                self.counters.setdefault(name, _Increase()).see(figures[name])

    def see_verdict(self, kind: str) -> None:
        self.judged += 1
        self.verdicts[kind] = self.verdicts.get(kind, 0) + 1

    def add_buckets(self, counts: dict[float, float]) -> None:
        if self.buckets.keys() != counts.keys():
            # the app brought other buckets (a redeploy; the agent restarts the GPU's histogram
            # from zero): two layouts do not add up to one histogram, so the run's p99 counts
            # from the change, and the table holds one layout however often the app changes
            self.buckets = {}
        for bound, count in counts.items():
            increase = self.buckets.get(bound)
            if increase is None:
                increase = self.buckets[bound] = _Increase()
            increase.see(count)

    def p99(self) -> float | None:
        return quantile(0.99, {b: c.total for b, c in self.buckets.items()})

    def state(self) -> dict[str, Any]:
        # written out by hand: dataclasses.asdict deep-copies, some fifty times slower
        return {"cycles": self.cycles, "unreadable": self.unreadable, "peak": self.peak,
                "total": self.total, "seen": self.seen, "verdicts": self.verdicts,
                "judged": self.judged,
                "counters": {k: [c.last, c.total] for k, c in self.counters.items()},
                "buckets": [[b, c.last, c.total] for b, c in self.buckets.items()]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> _GpuRun:
        counters = {str(k): _Increase(float(last), float(total))
                    for k, (last, total) in state["counters"].items()}
        buckets = {float(b): _Increase(float(last), float(total))
                   for b, last, total in state["buckets"]}
        return cls(cycles=int(state["cycles"]), unreadable=int(state["unreadable"]),
                   peak=_floats(state["peak"]), total=_floats(state["total"]),
                   seen=_ints(state["seen"]), verdicts=_ints(state["verdicts"]),
                   judged=int(state["judged"]), counters=counters, buckets=buckets)


def _floats(d: dict[str, Any]) -> dict[str, float]:
    return {str(k): float(v) for k, v in d.items()}


def _ints(d: dict[str, Any]) -> dict[str, int]:
    return {str(k): int(v) for k, v in d.items()}




def is_summary(name: str) -> bool:
    return name.startswith("gpu_run_")


class RunSummary:
    """Fed every cycle's series; ``series`` gives the summary at the end of the run."""

    def __init__(self, job_name: str, pod_labels: Labels, *, index: str = "") -> None:
        # the Job and, for an Indexed Job's pod, its completion index
        self.job: Labels = (("job_name", job_name), *((("job_index", index),) if index else ()))
        self.labels = tuple(sorted((*pod_labels, *self.job)))
        self.start_ms: int | None = None
        self.end_ms: int | None = None
        self._gpus: dict[Labels, _GpuRun] = {}
        # a bucket series' labels -> (its GPU's labels, its upper bound): the same few hundred
        # label sets every cycle, parsed once
        self._buckets: dict[Labels, tuple[Labels, float]] = {}

    def _bucket_of(self, labels: Labels) -> tuple[Labels, float]:
        known = self._buckets.get(labels)
        if known is None:
            if len(self._buckets) >= 65_536:  # an app that keeps changing its bounds
                self._buckets.clear()
            le = dict(labels)["le"]
            known = self._buckets[labels] = (tuple(p for p in labels if p[0] != "le"),
                                             math.inf if le == "+Inf" else float(le))
        return known

    def add(self, series: list[Series]) -> None:
        figures: dict[Labels, dict[str, float]] = {}
        buckets: dict[Labels, dict[float, float]] = {}
        engine: dict[float, float] = {}  # summed over endpoints and models
        verdicts: dict[Labels, str] = {}  # a GPU's labels -> the agent's verdict this cycle
        ts = None
        for s in series:
            ts = s.timestamp_ms
            if s.name in _WATCHED:
                figures.setdefault(s.labels, {})[s.name] = s.value
            elif s.name == _VERDICT and s.value == 1:
                gpu = tuple(p for p in s.labels if p[0] != "verdict")
                verdicts[gpu] = dict(s.labels).get("verdict", "")
            elif s.name == _BUCKET:
                gpu, bound = self._bucket_of(s.labels)
                buckets.setdefault(gpu, {})[bound] = s.value
            elif s.name == _ENGINE_BUCKET:
                _, bound = self._bucket_of(s.labels)
                engine[bound] = engine.get(bound, 0.0) + s.value
        if engine:
            for labels in figures:
                if any(k == "gpu_uuid" for k, _ in labels):
                    buckets.setdefault(labels, engine)
        if ts is None:
            return
        if self.start_ms is None:
            self.start_ms = ts
        self.end_ms = ts
        for labels, figs in figures.items():
            self._gpu(labels).add(figs)
        for labels, kind in verdicts.items():
            self._gpu(labels).see_verdict(kind)
        for labels, counts in buckets.items():
            self._gpu(labels).add_buckets(counts)

    def _gpu(self, labels: Labels) -> _GpuRun:
        run = self._gpus.get(labels)
        if run is None:
            run = self._gpus[labels] = _GpuRun()
        return run

    def state(self) -> dict[str, Any]:
        """The running figures, for ``Checkpoint``: JSON-ready, and no larger than they are."""
        return {"version": STATE_VERSION, "labels": [list(p) for p in self.labels],
                "start_ms": self.start_ms, "end_ms": self.end_ms,
                "gpus": [[[list(p) for p in labels], run.state()]
                         for labels, run in self._gpus.items()]}

    def resume(self, state: dict[str, Any]) -> None:
        """Go on from ``state``, a run of this same Job and pod. Raises (ValueError, or whatever
        a state of the wrong shape provokes) when it is not one, leaving the summary as it was."""
        if state["version"] != STATE_VERSION:
            raise ValueError(f"state version {state['version']!r}, not {STATE_VERSION}")
        labels = tuple(tuple(p) for p in state["labels"])
        if labels != self.labels:
            raise ValueError("another Job, index or pod")
        start_ms, end_ms = int(state["start_ms"]), int(state["end_ms"])
        gpus = {tuple(tuple(p) for p in gpu): _GpuRun.from_state(run) for gpu, run in state["gpus"]}
        before = self.start_ms, self.end_ms, self._gpus
        self.start_ms, self.end_ms, self._gpus = start_ms, end_ms, gpus
        try:
            self.series()  # parts that disagree fail now, not in the run's last cycle
        except Exception:
            self.start_ms, self.end_ms, self._gpus = before
            raise

    def series(self) -> list[Series]:
        if self.start_ms is None or self.end_ms is None:
            return []
        ts = self.end_ms
        out = [
            Series("gpu_run_start_timestamp_seconds", self.labels, self.start_ms / 1000, ts),
            Series("gpu_run_end_timestamp_seconds", self.labels, self.end_ms / 1000, ts),
            Series("gpu_run_duration_seconds", self.labels, (self.end_ms - self.start_ms) / 1000, ts),
        ]
        for gpu_labels, run in sorted(self._gpus.items()):
            labels = tuple(sorted((*gpu_labels, *self.job)))
            out.append(Series("gpu_run_samples", labels, float(run.cycles), ts))
            out.append(Series("gpu_run_unreadable_samples", labels, float(run.unreadable), ts))
            for name in RATIOS:
                if name in run.seen:
                    figure = with_labels(labels, figure=name)
                    out.append(Series("gpu_run_max_ratio", figure, run.peak[name], ts))
                    out.append(Series("gpu_run_mean_ratio", figure,
                                      run.total[name] / run.seen[name], ts))
            if run.judged:  # every kind, 0 for those never the verdict: judged, not found
                for kind in KINDS:
                    out.append(Series("gpu_run_above_threshold_ratio",
                                      with_labels(labels, condition=kind),
                                      run.verdicts.get(kind, 0) / run.judged, ts))
            for counter, name in COUNTERS.items():
                if counter in run.counters:
                    out.append(Series(name, labels, run.counters[counter].total, ts))
            p99 = run.p99()
            if p99 is not None:
                out.append(Series("gpu_run_request_duration_p99_seconds", labels, p99, ts))
        return out


class Checkpoint:
    """The run's summary so far, in a small file on the spool volume, rewritten at most every
    ``every_s`` seconds (the push interval: some 20 KB of JSON for 8 GPUs costs about a
    millisecond, a cycle's worth of CPU, and a run's summary hardly misses its last seconds).
    A write and a rename: a process killed at any point leaves the old file or the new one; no
    fsync, since what it guards against is the process dying, not the node.

    A restarted agent resumes from it only when it is the same Job, index and pod, and the file
    is recent (``RESUME_WITHIN_S``: a container restart, even after back-off, is minutes; a file
    older than that belongs to an earlier run on a reused directory). A clean end of the run,
    with the summary handed to the sinks, deletes it."""

    RESUME_WITHIN_S = 900.0

    def __init__(self, path: Path, every_s: float = 0.0,
                 wall: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.every_s = every_s
        self.wall = wall
        self.clock = clock
        self._saved_at: float | None = None
        self._failures = Episodes()  # a nearly full volume refuses one save and takes the next

    def resume(self, summary: RunSummary) -> None:
        """Never fails: a checkpoint that cannot be used is logged and the summary starts
        afresh (whatever a damaged file holds must not stop an agent from starting)."""
        for leftover in self.path.parent.glob(f"{self.path.name}.*.tmp"):  # a save cut short
            with contextlib.suppress(OSError):
                leftover.unlink()
        try:
            state = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return
        except Exception as exc:  # unreadable, not JSON, nested beyond the parser
            log.warning("run_summary_checkpoint_unreadable", path=str(self.path),
                        error=f"{type(exc).__name__}: {exc}"[:200],
                        effect="the run summary starts afresh from this start")
            return
        try:
            age_s = self.wall() - int(state["end_ms"]) / 1000
            if age_s > self.RESUME_WITHIN_S:
                raise ValueError(f"last written {round(age_s)} s ago, more than "
                                 f"{round(self.RESUME_WITHIN_S)} s: an earlier run")
            summary.resume(state)
        except Exception as exc:  # another run's, or of a shape no agent writes
            log.info("run_summary_not_resumed", path=str(self.path),
                     reason=f"{type(exc).__name__}: {exc}"[:200],
                     effect="the run summary starts afresh from this start")
            return
        log.info("run_summary_resumed", path=str(self.path), start_ms=summary.start_ms,
                 note="the agent restarted mid-run; the summary covers the run from its start")

    def save(self, summary: RunSummary) -> None:
        """Rewrite the file, unless it was rewritten less than ``every_s`` ago."""
        now = self.clock()
        if self._saved_at is not None and now - self._saved_at < self.every_s:
            return
        self._saved_at = now
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            # dumps, not dump: only the one-shot encoder is the C one
            data = json.dumps(summary.state(), separators=(",", ":")).encode()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if self._failures.started():
                log.warning("run_summary_checkpoint_failed", path=str(self.path),
                          error=exc.strerror, effect="an agent killed now and restarted would "
                          "summarise the run from its restart only")
            return
        if self._failures.ended():
            log.info("run_summary_checkpoint_recovered", path=str(self.path))

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()
