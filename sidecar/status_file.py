"""The status file the running agent writes beside its socket, for ``gpu-sidecar status``
(``sidecar.commands.status`` reads it).

The agent writes a small JSON file, ``status.json`` beside its app socket (the socket's volume,
writable while the root file system is read-only), after its cycles: at most every
``WRITE_EVERY_S`` (a new file and a rename cost about as much as a tenth of a cycle of 8 GPUs:
at 1 s sampling, every cycle would be paid for a file read by a person now and then), and at
the agent's stop; replaced in one rename so a reader never sees half of it. It is built from the cycle's own
series (the figures a receiver gets) and the app socket's state: per sink the last success,
backlog and failures; per app process the last message, and the rejections by reason; the GPUs
exported and why; per engine endpoint whether it is read; the agent's time in NVML (``nvml``):
the last cycle's, in all, per GPU and its costliest calls, and the costliest calls since the
start (what ``gpu_sidecar_nvml_call_seconds_total`` exports), at most ``NVML_CALLS_KEPT`` each.

``status`` prints it for a person; ``status --alive`` is the liveness probe: exit 0 while the
agent's heartbeat is younger than ``alive_after_s`` (three intervals, at least 30 s), 1 otherwise,
so that only an agent whose cycles stopped is restarted (a receiver outage, a missing app, a lost
GPU or a full volume leave the cycles running).

The heartbeat is the file's modification time, not its content: after each cycle whose status
cannot be rewritten (a full volume refuses the new file's blocks) the agent sets the old file's
time with ``utime``, which needs no free block, so a full volume never has a healthy agent
restarted; ``status`` then says the content is stale and why. The file lies in a volume the app's
container shares, so the reader trusts nothing of it: only a regular file (never through a
symbolic link, never a FIFO that would block it), at most ``MAX_BYTES``, and a time in the
future is no proof of life.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sidecar.samples import Series

if TYPE_CHECKING:
    from sidecar.agent import Agent
    from sidecar.sources.nvml.timed import CallTime

FILE_NAME = "status.json"
WRITE_EVERY_S = 5.0  # the file is rewritten at most this often (the default interval)
ALIVE_MIN_S = 30.0  # --alive: the least age that counts as stuck
ALIVE_INTERVALS = 3  # ...or this many intervals, if longer
# the largest status a reader takes: the biggest the agent writes (64 GPUs x 256 processes, each
# with its GPUs) is about 1.6 MB; a bound keeps a planted 1 GB file or /dev/zero out of memory
MAX_BYTES = 4 << 20
FUTURE_SKEW_S = 5.0  # a time later than now by more than this was not set by the agent's clock
STALE_CONTENT_S = 2.0  # heartbeat newer than the content by more: the content could not be written
NVML_CALLS_KEPT = 5  # the costliest NVML calls the status names, of the last cycle and in all


def status_path(socket: str) -> Path:
    return Path(socket).parent / FILE_NAME


def alive_after_s(interval_s: float) -> float:
    return max(ALIVE_INTERVALS * interval_s, ALIVE_MIN_S)


class StatusWriter:
    """Called by the agent after each cycle with its series; writes the status file."""

    def __init__(self, path: Path, agent: Agent, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.path = path
        self.agent = agent
        self.clock = clock
        self.wall = wall
        self.started_at = wall()
        self._last = -1e18
        self._failed = False
        # the NVML totals after the previous cycle and after this one: their difference is the
        # last cycle's NVML time (a copy of ~30 counters per cycle, a few microseconds)
        self._calls_before: dict[str, CallTime] = {}
        self._calls: dict[str, CallTime] = {}

    def __call__(self, series: list[Series]) -> None:
        if self.agent.source is not None:
            self._calls_before, self._calls = self._calls, self.agent.source.nvml_calls()
        now = self.clock()
        if now - self._last < WRITE_EVERY_S and not self.agent.stopping:
            return
        self._last = now
        try:
            _write(self.path, snapshot(self.agent, series, started_at=self.started_at,
                                       written_at=self.wall(),
                                       nvml=nvml_figures(self.agent, self._calls,
                                                         self._calls_before)))
        except Exception as exc:  # never the cycle's end: the status is a report
            beating = _beat(self.path)
            if not self._failed:  # once per episode
                self._failed = True
                import structlog

                structlog.get_logger("sidecar.status").warning(
                    "status_write_failed", path=str(self.path),
                    error=getattr(exc, "strerror", None) or type(exc).__name__,
                    effect=("gpu-sidecar status shows the last status written, marked stale; "
                            "the liveness probe still passes (the file's time is kept fresh)"
                            if beating else "gpu-sidecar status and the liveness probe read an "
                            "old status: the kubelet will restart the agent"),
                    hint="free space on the socket's volume (an emptyDir shared with the app), "
                         "or make its directory writable by the agent")
            return
        if self._failed:
            self._failed = False
            import structlog

            structlog.get_logger("sidecar.status").info("status_write_recovered",
                                                         path=str(self.path))


def _beat(path: Path) -> bool:
    """The heartbeat when the status cannot be rewritten: the file's time set to now, which
    takes no data block (only the inode changes), or, with no file yet, an empty one (an inode,
    no block). Never through a symbolic link another container placed. True when it beat."""
    try:
        os.utime(path, follow_symlinks=False)
        return True
    except FileNotFoundError:
        pass
    except OSError:
        return False
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600))  # as mkstemp makes the status
        return True
    except OSError:
        return False


def _write(path: Path, data: dict[str, Any]) -> None:
    """A new file (O_EXCL: never one the app's container placed in the shared directory), then
    one rename over the old status: a reader sees the old or the new, whole."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, separators=(",", ":")))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def nvml_figures(agent: Agent, calls: dict[str, CallTime],
                 before: dict[str, CallTime]) -> dict[str, Any] | None:
    """The agent's time in NVML for the status: the last cycle's (``calls`` less ``before``, the
    totals after it and after the cycle before; the first cycle's includes the priming read), in
    all and per GPU (that GPU's reading, its throughput calls included), and since the start,
    each with its ``NVML_CALLS_KEPT`` costliest calls. None without NVML (--no-nvml)."""
    if agent.source is None:
        return None
    cycle: dict[str, tuple[float, int]] = {}  # name -> seconds, calls
    for name, now in calls.items():
        then = before.get(name)
        then_s, then_n = (then.seconds, then.calls) if then is not None else (0.0, 0)
        if now.calls > then_n:
            cycle[name] = (now.seconds - then_s, now.calls - then_n)
    since_start = {name: (c.seconds, c.calls) for name, c in calls.items()}

    def costliest(table: dict[str, tuple[float, int]]) -> list[list[Any]]:
        top = sorted(table.items(), key=lambda kv: -kv[1][0])[:NVML_CALLS_KEPT]
        return [[name, seconds, n] for name, (seconds, n) in top]

    per_gpu = agent.source.last_read_nvml
    return {
        "cycle_seconds": sum(seconds for seconds, _ in cycle.values()),
        "cycle_calls": sum(n for _, n in cycle.values()),
        "cycle_costliest": costliest(cycle),
        # in index order, as every other view lists GPUs (the reads finish in any order)
        "gpus": sorted(({"uuid": uuid, "index": agent.identity(uuid).index, "seconds": m.seconds,
                         "calls": m.calls} for uuid, m in per_gpu.items()),
                       key=lambda g: (len(g["index"]), g["index"])),
        "total_seconds": sum(c.seconds for c in calls.values()),
        "total_calls": sum(c.calls for c in calls.values()),
        "total_costliest": costliest(since_start),
    }


def snapshot(agent: Agent, series: Iterable[Series], *, started_at: float,
             written_at: float, nvml: dict[str, Any] | None = None) -> dict[str, Any]:
    """The status: what the cycle's series and the agent's parts say."""
    sinks: dict[str, dict[str, Any]] = {}
    engines: dict[str, dict[str, Any]] = {}
    available: dict[str, dict[str, str]] = {}
    verdicts: dict[str, str] = {}  # the agent's current verdict per GPU (gpu_verdict)
    for s in series:
        labels = dict(s.labels)
        name = s.name
        if "sink" in labels:
            _add_sink_figure(sinks, name, labels, s.value)
        elif name.startswith("gpu_sidecar_engine_") and "endpoint" in labels:
            _add_engine_figure(engines, name, labels, s.value)
        elif name == "gpu_verdict" and s.value == 1:
            verdicts[labels.get("gpu_uuid", "")] = labels.get("verdict", "")
        elif name == "gpu_sidecar_gpu_available":
            available[labels.get("gpu_uuid", "")] = {
                "index": labels.get("gpu_index", ""), "name": labels.get("gpu_name", ""),
                "available": "yes" if s.value == 1 else "no"}
    cfg = agent.config
    app = agent.app
    return {
        "version": _version(), "pid": os.getpid(), "mode": agent.mode,
        "started_at": started_at, "written_at": written_at, "interval_s": cfg.interval,
        "alive_after_s": alive_after_s(cfg.interval), "stopping": agent.stopping,
        "cycles": agent.cycles, "overruns": agent.overruns, "pauses": agent.pauses,
        "sinks": sinks,
        "app": {"socket": cfg.socket, "accepted": app.accepted, "rejected": dict(app.rejected),
                "last_rejections": app.last_rejections(), "processes": app.processes()},
        "gpus": _gpus_section(agent, available, verdicts),
        "engines": engines,
        "nvml": nvml,
    }


def _add_sink_figure(sinks: dict[str, dict[str, Any]], name: str, labels: dict[str, str],
                     value: float) -> None:
    """One sink series into its sink's section: a sink appears with its first series, every
    field present (a reader need not guess which a sink that never pushed lacks)."""
    # pushed_samples None: a sink that counts no samples (the Pushgateway's, which
    # replaces a group rather than appending samples)
    sink = sinks.setdefault(labels["sink"], {"pushed_samples": None, "last_success_at": None,
                                             "failures": {}, "spool_bytes": {},
                                             "spool_batches": 0, "dropped": {}})
    if name == "gpu_sidecar_samples_pushed_total":
        sink["pushed_samples"] = value
    elif name == "gpu_sidecar_last_push_success_timestamp_seconds":
        sink["last_success_at"] = value
    elif name == "gpu_sidecar_push_failures_total":
        sink["failures"][labels.get("reason", "")] = value
    elif name == "gpu_sidecar_spool_bytes":
        sink["spool_bytes"][labels.get("state", "")] = value
    elif name == "gpu_sidecar_spool_batches":
        sink["spool_batches"] = value
    elif name == "gpu_sidecar_samples_dropped_total":
        sink["dropped"][labels.get("reason", "")] = value


def _add_engine_figure(engines: dict[str, dict[str, Any]], name: str, labels: dict[str, str],
                       value: float) -> None:
    """One engine series into its endpoint's section: whether it answered, and its failures."""
    e = engines.setdefault(labels["endpoint"], {"failures": {}})
    if name == "gpu_sidecar_engine_up":
        e["up"] = value == 1
        e["engine"] = labels.get("engine", "")
    elif name == "gpu_sidecar_engine_read_failures_total":
        e["failures"][labels.get("reason", "")] = value


def _gpus_section(agent: Agent, available: dict[str, dict[str, str]],
                  verdicts: dict[str, str]) -> dict[str, Any]:
    """The GPUs exported, each with why (the --gpus mode) and its verdict, and those the agent
    sees but leaves out, with why: a person asking "where is GPU 3" finds the answer here."""
    cfg = agent.config
    selected = list(agent._selection) if agent._selection else list(available)
    why = {"announced": "announced by the app", "visible": "visible to NVML"}.get(
        cfg.gpus, "named with --gpus")
    left_out = {"announced": "not announced by the app (--gpus announced)"}.get(
        cfg.gpus, "not named with --gpus")
    gpus = [{"uuid": u, **available.get(u, {}), "why": why,
             **({"verdict": verdicts[u]} if u in verdicts else {})} for u in selected]
    not_exported = [{"uuid": i.uuid, "index": i.index, "name": i.name,
                     "why": left_out}
                    for i in agent._identities.values() if i.uuid not in selected]
    return {"mode": cfg.gpus, "exported": gpus, "not_exported": not_exported}


def _version() -> str:
    from sidecar import __version__

    return __version__
