"""The agent: joins NVML readings and app figures into samples on a fixed schedule.

Data flow: sources (``NvmlSource``, ``AppState``) -> ``GpuSample`` per GPU per cycle -> series
-> sink. The schedule is anchored to the start time on the monotonic clock, so a slow cycle
shifts nothing after it; a cycle that starts after its slot is counted as an overrun and the
missed slots are skipped rather than run back to back.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

import structlog

from sidecar import __version__, signals
from sidecar.config import Config
from sidecar.judge.cycle import figures_of_cycle
from sidecar.judge.figures import Figures
from sidecar.judge.verdict import Verdict
from sidecar.log import Episodes, log_count
from sidecar.recent import CURRENT_S, Recent
from sidecar.samples import (
    GpuIdentity,
    GpuSample,
    Labels,
    Series,
    gpu_labels,
    sample_series,
    with_labels,
)
from sidecar.sinks import Sink
from sidecar.sources.app_socket import NO_FIGURES, AppState
from sidecar.sources.engine import EngineSource
from sidecar.sources.nvml import NvmlSource
from sidecar.summary import Checkpoint, RunSummary

log = structlog.get_logger("sidecar.agent")

# no app message this long after the start is said once (no_app_announced)
NO_APP_AFTER_S = 30.0
# rates and GPM averages need two readings (GPM's at least 0.1 s apart): --once and probe wait
# this long between them, and a run takes its first sample this long after the priming reading
PRIME_WINDOW_S = 0.25
# a verdict no longer current is still sent, at 0, this long: a query for ``== 1`` ends at once
# where the receiver would otherwise keep its last 1 until the series went stale (5 minutes)
VERDICT_GONE_S = 300.0


class Agent:
    def __init__(
        self,
        config: Config,
        *,
        source: NvmlSource | None,
        app: AppState,
        sinks: Sink | list[Sink],
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        mode: str = "nvml",
        checkpoint: Checkpoint | None = None,
        engine: EngineSource | None = None,
        recent: Recent | None = None,
    ) -> None:
        self.config = config
        # the recent window (diagnose beside the agent, status, the gpu_verdict series)
        self.recent = recent
        self.verdicts: dict[str, Verdict] = {}  # each GPU's current verdict (CURRENT_S)
        self._verdicts_seen: dict[str, dict[str, float]] = {}  # uuid -> kind -> last current
        self._readable: set[str] = set()  # the GPUs read in the cycle last judged
        self._first_seen: dict[str, float] = {}  # uuid -> when the window first had it
        self.source = source
        self.engine = engine
        self.app = app
        self.sinks: list[Sink] = sinks if isinstance(sinks, list) else [sinks]
        self.clock = clock
        self.wall = wall
        self.mode = mode
        self.pod = config.pod_labels()
        self._pod_labels = tuple(sorted(self.pod.items()))
        self.collected = 0
        self.dropped: Counter[str] = Counter()
        self.overruns = 0
        self.pauses = 0
        self.paused_s = 0.0  # slots missed while the process did not run, in seconds
        self.stopping = False  # the last cycle of a stopped run says gpu_sidecar_up 0
        self.last_cycle_s = 0.0
        self.cycles = 0
        # called with each cycle's series once the sinks have them (the status file)
        self.on_cycle: Callable[[list[Series]], None] | None = None
        self._started = clock()
        self._no_app_said = False
        self._app_heard = False  # the app announced a GPU at some point
        self._app_quiet = Episodes()
        self._identities: dict[str, GpuIdentity] = {}
        self._warned_missing: set[str] = set()
        self._selection: tuple[str, ...] = ()
        self._label_cache: dict[tuple[tuple[str, str], ...], Labels] = {}
        self._fixed_selection: list[str] | None = None
        self._gpu_labels: dict[str, tuple[GpuIdentity, Labels]] = {}  # uuid -> labels, kept
        self._emit_errors: set[tuple[str, str]] = set()  # (sink, error type) logged once
        # a batch Job's run summary, fed every cycle and sent with the last one
        self.summary = RunSummary(config.batch_job, self._pod_labels,
                                  index=config.batch_job_index) if config.batch_job else None
        self.checkpoint = checkpoint if self.summary is not None else None
        if self.checkpoint is not None and self.summary is not None:
            self.checkpoint.resume(self.summary)
        if source is not None:
            self._identities = {i.uuid: i for i in source.devices()}

    # -- selection -----------------------------------------------------------------------------

    def selected(self) -> list[str]:
        if self._fixed_selection is not None:
            return self._fixed_selection
        explicit = self.config.gpu_list()
        if explicit:
            chosen = list(explicit)
        elif self.config.gpus == "visible":
            chosen = list(self._identities)
        else:
            chosen = self.app.announced()
            self._watch_announced(chosen)
        if tuple(chosen) != self._selection:
            self._selection = tuple(chosen)
            log.info("gpus_selected", mode=self.config.gpus, gpus=chosen)
        if self.source is not None:
            for uuid in chosen:
                if uuid not in self._identities and uuid not in self._warned_missing:
                    self._warned_missing.add(uuid)
                    log.error("gpu_not_visible", gpu_uuid=uuid,
                              visible=sorted(self._identities),
                              hint="this UUID is not among the GPUs NVML shows this container; "
                                   "check --gpus and NVIDIA_VISIBLE_DEVICES")
        if self.config.gpus != "announced":
            self._fixed_selection = chosen  # named or visible: decided once, logged once
        return chosen

    def _watch_announced(self, chosen: list[str]) -> None:
        """--gpus announced: the GPUs exported are the app's; its going quiet is said (once per
        episode), since the GPUs' NVML series stop with its figures."""
        if chosen:
            self._app_heard = True
            if self._app_quiet.ended():
                log.info("app_publishing_again", gpus=chosen)
        elif self._app_heard and self._app_quiet.started():
            log.warning("app_quiet", silent_for_s=self.config.app_stale_after,
                        effect="--gpus announced: the GPUs the app announced are no longer "
                               "exported, their NVML series included, until it publishes again",
                        hint="expected if the model server stopped; to export the GPUs "
                             "whatever the app does, run with --gpus visible")

    def _watch_app(self) -> None:
        """No app message at all this long after the start: said once, with where to look."""
        if self._no_app_said or self.app.accepted or \
                self.clock() - self._started < NO_APP_AFTER_S:
            return
        self._no_app_said = True
        announced = self.config.gpus == "announced"
        log.warning("no_app_announced", socket=self.config.socket, waited_s=NO_APP_AFTER_S,
                    effect=("no GPU is exported until the app announces one (--gpus announced)"
                            if announced else "no allocator or app latency figures"),
                    hint="is a publisher running in the model server? With the k8s component "
                         "the app container needs PYTHONPATH starting with the injected "
                         "publisher's directory (python/ beside the socket), GPU_SIDECAR_SOCKET "
                         "set to this socket and the socket's volume mounted; or call "
                         "sidecar.client.start() in the app. `gpu-sidecar status` shows what "
                         "arrives and what is rejected")

    def identity(self, uuid: str) -> GpuIdentity:
        return self._identities.get(uuid) or GpuIdentity(uuid=uuid, name="unknown (no NVML)",
                                                         index="unknown")

    # -- one cycle -----------------------------------------------------------------------------

    def prime(self) -> None:
        """Take the first of the two readings that counter rates and GPM averages need."""
        if self.source is not None:
            self.source.read(self.selected())

    def collect(self) -> tuple[list[GpuSample], dict[str, bool]]:
        uuids = self.selected()
        ts = int(self.wall() * 1000)
        available: dict[str, bool] = {}
        samples: list[GpuSample] = []
        readings = self.source.read(uuids, app=self.app) if self.source is not None else {}
        figures = self.app.all_figures()
        for uuid in uuids:
            app = figures.get(uuid, NO_FIGURES)
            if self.source is None:
                samples.append(GpuSample(identity=self.identity(uuid), timestamp_ms=ts, app=app))
                available[uuid] = True
                continue
            reading = readings.get(uuid)
            available[uuid] = reading is not None
            if reading is None:
                self.dropped["gpu_unavailable"] += 1
                continue
            samples.append(GpuSample(identity=self.identity(uuid), timestamp_ms=ts,
                                     compute=reading.compute, memory=reading.memory,
                                     io=reading.io, health=reading.health, app=app,
                                     xids=reading.xids))
        self.collected += len(samples)
        return samples, available

    def cycle(self, *, last: bool = False) -> list[Series]:
        """One cycle to every sink; the ``last`` one of a run also carries the run summary."""
        started = self.clock()
        self.cycles += 1
        self._watch_app()
        samples, available = self.collect()
        series: list[Series] = []
        for sample in samples:
            series.extend(sample_series(sample, self.pod, self._labels(sample.identity),
                                        per_process=self.config.app_process_series))
        ts = samples[0].timestamp_ms if samples else int(self.wall() * 1000)
        lost_xids: dict[str, tuple[tuple[int, int], ...]] = {}
        if self.source is not None:  # a GPU not read: its Xids still (79: fallen off the bus)
            for uuid in (u for u, ok in available.items() if not ok):
                if xids := self.source.xid_counts(uuid):
                    lost_xids[uuid] = xids
                    gone = GpuSample(identity=self.identity(uuid), timestamp_ms=ts, xids=xids)
                    series.extend(sample_series(gone, self.pod, self._labels(gone.identity)))
        engine: list[Series] = []
        if self.engine is not None:  # its readers' last figures: a copy, never a wait
            engine = self.engine.series(ts, self._pod_labels)
            series.extend(engine)
        series.extend(self.self_series(ts, available))
        if self.recent is not None:
            cycle = figures_of_cycle(samples, available, lost_xids=lost_xids, engine=engine,
                                     identity={u: self.identity(u) for u in available})
            series.extend(self._judge(cycle, ts))
        self.last_cycle_s = self.clock() - started
        if self.summary is not None:
            self.summary.add(series)
            if last:
                series.extend(self.summary.series())
        for sink in self.sinks:
            try:
                sink.emit(series)
            except Exception as exc:  # one sink's fault costs it this cycle, never the others'
                self._emit_failed(sink, exc, len(series))
        if self.checkpoint is not None and self.summary is not None:
            # after the sinks: once the last cycle is in their journals, the run is over
            if last:
                self.checkpoint.discard()
            else:
                self.checkpoint.save(self.summary)
        if self.on_cycle is not None:
            self.on_cycle(series)
        return series

    def _judge(self, cycle: dict[str, Figures], ts: int) -> list[Series]:
        """The cycle into the recent window, each GPU's verdict over its last ``CURRENT_S``, and
        that verdict as ``gpu_verdict{verdict=KIND} 1``; a kind that stopped being the verdict is
        sent at 0 for ``VERDICT_GONE_S`` after, so a dashboard or an alert sees it end."""
        assert self.recent is not None
        now = self.clock()
        # judged again when a bucket begins (the window moved), or the GPUs or which of them
        # can be read changed (a lost GPU is said at once); in between the verdict holds, so
        # judging costs one cycle in a bucket, not every one
        readable = {uuid for uuid, f in cycle.items() if f.available}
        # ...and every cycle while a GPU is newer than the verdict's window: its first cycles
        # lack what needs two readings (rates) or the app (its figures), and a verdict taken on
        # them must not hold for a bucket (a short Job would be judged on nothing)
        for uuid in cycle.keys() - self._first_seen.keys():
            self._first_seen[uuid] = now
        young = any(now - self._first_seen[uuid] < CURRENT_S for uuid in cycle)
        if (self.recent.add(cycle, now) or cycle.keys() != self.verdicts.keys()
                or readable != self._readable or young):
            self.verdicts, _ = self.recent.verdicts(CURRENT_S, now)
            self._readable = readable
        out: list[Series] = []
        for uuid, v in self.verdicts.items():
            labels = self._labels(self.identity(uuid))
            current = self._verdicts_seen.setdefault(uuid, {})
            current[v.key] = now
            for kind, at in list(current.items()):
                if now - at > VERDICT_GONE_S:
                    del current[kind]
                    continue
                out.append(Series(name="gpu_verdict", labels=with_labels(labels, verdict=kind),
                                  value=1.0 if kind == v.key else 0.0, timestamp_ms=ts))
        return out

    def _emit_failed(self, sink: Sink, exc: Exception, count: int) -> None:
        self.dropped["sink_error"] += count
        kind = (sink.name, type(exc).__name__)
        if kind not in self._emit_errors:
            self._emit_errors.add(kind)
            log.exception("sink_emit_failed", sink=sink.name, error=type(exc).__name__,
                          effect="this sink lost the cycle; sampling and the other sinks go on",
                          hint="a bug: please report it with this log line")

    def _labels(self, identity: GpuIdentity) -> Labels:
        """A GPU's labels, kept from cycle to cycle (they change only if its identity does)."""
        kept = self._gpu_labels.get(identity.uuid)
        if kept is None or (kept[0] is not identity and kept[0] != identity):
            kept = self._gpu_labels[identity.uuid] = (identity, gpu_labels(identity, self.pod))
        return kept[1]

    def self_series(self, ts: int, available: dict[str, bool]) -> list[Series]:
        pl = self._pod_labels
        cache = self._label_cache

        def s(name: str, value: float, *extra: tuple[str, str]) -> Series:
            labels = cache.get(extra)
            if labels is None:
                labels = cache[extra] = tuple(sorted((*pl, *extra)))
            return Series(name=name, labels=labels, value=float(value), timestamp_ms=ts)

        out = [
            s("gpu_sidecar_up", 0 if self.stopping else 1),
            s("gpu_sidecar_info", 1, ("version", __version__), ("mode", self.mode)),
            s("gpu_sidecar_nvml_available", 1 if self.source is not None else 0),
            s("gpu_sidecar_samples_collected_total", self.collected),
            s("gpu_sidecar_cycle_overruns_total", self.overruns),
            s("gpu_sidecar_paused_seconds_total", self.paused_s),
            s("gpu_sidecar_cycle_duration_seconds", self.last_cycle_s),
            s("gpu_sidecar_app_messages_accepted_total", self.app.accepted),
        ]
        for reason, n in sorted(self.app.rejected.items()):
            out.append(s("gpu_sidecar_app_messages_rejected_total", n, ("reason", reason)))
        for reason, n in sorted(self.dropped.items()):
            out.append(s("gpu_sidecar_samples_dropped_total", n, ("reason", reason)))
        if self.source is not None:
            for reason, n in sorted(self.source.errors.items()):
                out.append(s("gpu_sidecar_collection_errors_total", n, ("reason", reason)))
            for call, spent in self.source.nvml_calls().items():
                out.append(s("gpu_sidecar_nvml_call_seconds_total", spent.seconds, ("call", call)))
                out.append(s("gpu_sidecar_nvml_calls_total", spent.calls, ("call", call)))
        for uuid, ok in available.items():
            labels = self._labels(self.identity(uuid))
            out.append(Series(name="gpu_sidecar_gpu_available", labels=labels,
                              value=1.0 if ok else 0.0, timestamp_ms=ts))
        for sink in self.sinks:
            out.extend(sink.telemetry(ts, pl))
        return out

    # -- schedule ------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        interval = self.config.interval
        self.prime()
        stop.wait(min(interval, PRIME_WINDOW_S))
        start = self.clock()
        slot = 0
        resumed = len(signals.continued)
        while not stop.is_set():
            began = self.clock()
            self.cycle()
            slot += 1
            now = self.clock()
            due = start + slot * interval
            if now > due:
                late = int((now - due) // interval) + 1
                slot += late
                if len(signals.continued) != resumed or now - began < interval:
                    self._paused(late, interval, now - began, sigcont=len(signals.continued)
                                 != resumed)
                else:
                    self._overrun(late, interval)
                due = start + slot * interval
            resumed = len(signals.continued)  # a stop that cost no slot is forgotten
            stop.wait(max(0.0, due - self.clock()))

    def _overrun(self, late: int, interval: float) -> None:
        """The cycle itself took longer than its slot: the work is too much for the interval."""
        self.overruns += 1
        if self.overruns == 1 or self.overruns % 100 == 0:
            log.warning("cycle_overrun", cycle_s=round(self.last_cycle_s, 4),
                        interval_s=interval, skipped_slots=late, overruns=self.overruns,
                        hint="raise --interval or select fewer GPUs")

    def _paused(self, late: int, interval: float, cycle_s: float, *, sigcont: bool) -> None:
        """Slots were missed although the cycle itself was short, or the process was stopped
        and continued (SIGSTOP, SIGTSTP, a debugger): the process did not run, which more
        interval would not cure. Said once per pause, with how long it lasted; the missed slots
        are skipped, never run back to back."""
        self.pauses += 1
        self.paused_s += late * interval
        log_count("process_paused", self.pauses, level="warning",
                  paused_about_s=round(late * interval, 1),
                    skipped_slots=late, cycle_s=round(cycle_s, 4), interval_s=interval,
                    cause=("stopped and continued (SIGSTOP or SIGTSTP, then SIGCONT)" if sigcont
                           else "not scheduled: a frozen cgroup, a suspended node or VM, or "
                                "CPU throttling by the pod's limit"),
                  effect="no samples for that time; the schedule goes on from now")
