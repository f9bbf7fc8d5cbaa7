"""``gpu-sidecar status``: what the running agent knows, read from beside it.

The agent writes a small JSON file, ``status.json`` beside its app socket (the socket's volume,
writable while the root file system is read-only), after its cycles: at most twice a second,
replaced in one rename so a reader never sees half of it. It is built from the cycle's own
series (the figures a receiver gets) and the app socket's state: per sink the last success,
backlog and failures; per app process the last message, and the rejections by reason; the GPUs
exported and why; per engine endpoint whether it is read.

``status`` prints it for a person; ``status --alive`` is the liveness probe: exit 0 while the
file is younger than ``alive_after_s`` (three intervals, at least 30 s), 1 otherwise, so that
only an agent whose cycles stopped is restarted (a receiver outage, a missing app or a lost GPU
leave the cycles running).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sidecar.samples import Series

if TYPE_CHECKING:
    from sidecar.agent import Agent
    from sidecar.config import Config

FILE_NAME = "status.json"
WRITE_EVERY_S = 0.5  # the file is rewritten at most this often
ALIVE_MIN_S = 30.0  # --alive: the least age that counts as stuck
ALIVE_INTERVALS = 3  # ...or this many intervals, if longer


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

    def __call__(self, series: list[Series]) -> None:
        now = self.clock()
        if now - self._last < WRITE_EVERY_S and not self.agent.stopping:
            return
        self._last = now
        try:
            _write(self.path, snapshot(self.agent, series, started_at=self.started_at,
                                       written_at=self.wall()))
            self._failed = False
        except Exception as exc:  # never the cycle's end: the status is a report
            if not self._failed:  # once per episode
                self._failed = True
                import structlog

                structlog.get_logger("sidecar.status").warning(
                    "status_write_failed", path=str(self.path),
                    error=getattr(exc, "strerror", None) or type(exc).__name__,
                    effect="gpu-sidecar status and the liveness probe read an old status",
                    hint="the socket's directory must be writable by the agent")


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


def snapshot(agent: Agent, series: Iterable[Series], *, started_at: float,
             written_at: float) -> dict[str, Any]:
    """The status: what the cycle's series and the agent's parts say."""
    sinks: dict[str, dict[str, Any]] = {}
    engines: dict[str, dict[str, Any]] = {}
    available: dict[str, dict[str, str]] = {}
    for s in series:
        labels = dict(s.labels)
        name = s.name
        if "sink" in labels:
            # pushed_samples None: a sink that counts no samples (the Pushgateway's, which
            # replaces a group rather than appending samples)
            sink = sinks.setdefault(labels["sink"], {"pushed_samples": None, "last_success_at": None,
                                                     "failures": {}, "spool_bytes": {},
                                                     "spool_batches": 0, "dropped": {}})
            if name == "gpu_sidecar_samples_pushed_total":
                sink["pushed_samples"] = s.value
            elif name == "gpu_sidecar_last_push_success_timestamp_seconds":
                sink["last_success_at"] = s.value
            elif name == "gpu_sidecar_push_failures_total":
                sink["failures"][labels.get("reason", "")] = s.value
            elif name == "gpu_sidecar_spool_bytes":
                sink["spool_bytes"][labels.get("state", "")] = s.value
            elif name == "gpu_sidecar_spool_batches":
                sink["spool_batches"] = s.value
            elif name == "gpu_sidecar_samples_dropped_total":
                sink["dropped"][labels.get("reason", "")] = s.value
        elif name.startswith("gpu_sidecar_engine_") and "endpoint" in labels:
            e = engines.setdefault(labels["endpoint"], {"failures": {}})
            if name == "gpu_sidecar_engine_up":
                e["up"] = s.value == 1
                e["engine"] = labels.get("engine", "")
            elif name == "gpu_sidecar_engine_read_failures_total":
                e["failures"][labels.get("reason", "")] = s.value
        elif name == "gpu_sidecar_gpu_available":
            available[labels.get("gpu_uuid", "")] = {
                "index": labels.get("gpu_index", ""), "name": labels.get("gpu_name", ""),
                "available": "yes" if s.value == 1 else "no"}
    cfg = agent.config
    selected = list(agent._selection) if agent._selection else list(available)
    why = {"announced": "announced by the app", "visible": "visible to NVML"}.get(
        cfg.gpus, "named with --gpus")
    left_out = {"announced": "not announced by the app (--gpus announced)"}.get(
        cfg.gpus, "not named with --gpus")
    gpus = [{"uuid": u, **available.get(u, {}), "why": why} for u in selected]
    not_exported = [{"uuid": i.uuid, "index": i.index, "name": i.name,
                     "why": left_out}
                    for i in agent._identities.values() if i.uuid not in selected]
    app = agent.app
    return {
        "version": _version(), "pid": os.getpid(), "mode": agent.mode,
        "started_at": started_at, "written_at": written_at, "interval_s": cfg.interval,
        "alive_after_s": alive_after_s(cfg.interval), "stopping": agent.stopping,
        "cycles": agent.cycles, "overruns": agent.overruns, "pauses": agent.pauses,
        "sinks": sinks,
        "app": {"socket": cfg.socket, "accepted": app.accepted, "rejected": dict(app.rejected),
                "last_rejections": app.last_rejections(), "processes": app.processes()},
        "gpus": {"mode": cfg.gpus, "exported": gpus, "not_exported": not_exported},
        "engines": engines,
    }


def _version() -> str:
    from sidecar import __version__

    return __version__


# -- the command ------------------------------------------------------------------------------


def status(cfg: Config, *, alive: bool) -> int:
    """0: the running agent's status (printed), or alive; 1: not alive (the file too old, or
    missing); 2: no status to read (no agent ever ran on this socket's volume)."""
    path = status_path(cfg.socket)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        print(f"gpu-sidecar status: no {path}: no agent runs with --socket {cfg.socket} (give "
              "the socket path the agent uses; in a pod, run this in its container)",
              file=sys.stderr)
        return 1 if alive else 2
    except (OSError, ValueError) as exc:
        print(f"gpu-sidecar status: cannot read {path}: {exc}", file=sys.stderr)
        return 1 if alive else 2
    age = time.time() - float(data.get("written_at", 0))
    limit = float(data.get("alive_after_s", ALIVE_MIN_S))
    if alive:
        if age <= limit:
            return 0
        print(f"gpu-sidecar status: the agent (pid {data.get('pid')}) has written no status "
              f"for {age:.0f} s (more than {limit:.0f} s): its cycles have stopped",
              file=sys.stderr)
        return 1
    sys.stdout.write(report(data, age))
    return 0 if age <= limit else 1


def _ago(at: float | None, now: float) -> str:
    return "never" if not at else f"{now - at:.0f} s ago"


def report(data: dict[str, Any], age: float) -> str:
    now = time.time()
    lines = [f"gpu-sidecar {data.get('version')} (pid {data.get('pid')}, {data.get('mode')}): "
             f"{data.get('cycles')} cycles every {data.get('interval_s')} s since "
             f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(data.get('started_at', 0)))}; "
             f"status written {age:.0f} s ago"
             + (" (STALE: its cycles have stopped)" if age > data.get("alive_after_s", 30) else "")
             + (", stopping" if data.get("stopping") else "")]
    lines.append("sinks:")
    for name, s in sorted(data.get("sinks", {}).items()):
        failures = ", ".join(f"{r} {n:.0f}" for r, n in sorted(s["failures"].items()) if n) \
            or "none"
        spool = s.get("spool_bytes", {})
        backlog = (f"; backlog {s.get('spool_batches', 0):.0f} batches, "
                   f"{spool.get('pending', 0):.0f} bytes pending, {spool.get('rejected', 0):.0f} "
                   "set aside") if spool else ""
        pushed = s.get("pushed_samples")
        lines.append(f"  {name}: last success {_ago(s.get('last_success_at'), now)}"
                     + (f", {pushed:.0f} samples pushed" if pushed is not None else "")
                     + f"{backlog}; failures: {failures}")
    if not data.get("sinks"):
        lines.append("  stdout only (no receiver configured)")
    app = data.get("app", {})
    rejected = ", ".join(f"{r} {n}" for r, n in sorted(app.get("rejected", {}).items())) or "none"
    lines.append(f"app socket {app.get('socket')}: {app.get('accepted', 0)} messages accepted, "
                 f"rejected: {rejected}")
    for reason, (at, detail) in sorted(app.get("last_rejections", {}).items()):
        lines.append(f"  last {reason}: {_ago(at, now)}: {detail}")
    for p in app.get("processes", []):
        lines.append(f"  process {p['pid']}: last message {p['last_message_s_ago']:.0f} s ago, "
                     f"GPUs {', '.join(p['gpus'])}")
    if not app.get("processes"):
        lines.append("  no process publishes (is the injected publisher on the app's "
                     "PYTHONPATH, or sidecar.client started, on this socket?)")
    gpus = data.get("gpus", {})
    lines.append(f"GPUs (--gpus {gpus.get('mode')}):")
    for g in gpus.get("exported", []):
        lines.append(f"  exported GPU {g.get('index', '?')} {g.get('name', '')} {g['uuid']}: "
                     f"{g['why']}" + ("" if g.get("available", "yes") == "yes"
                                      else "; NOT READABLE (lost or failing)"))
    for g in gpus.get("not_exported", []):
        lines.append(f"  not exported GPU {g.get('index')} {g.get('name')} {g['uuid']}: "
                     f"{g['why']}")
    if not gpus.get("exported"):
        lines.append("  none exported" + (": no GPU announced by the app yet"
                                          if gpus.get("mode") == "announced" else ""))
    for endpoint, e in sorted(data.get("engines", {}).items()):
        failures = ", ".join(f"{r} {n:.0f}" for r, n in sorted(e["failures"].items()) if n) \
            or "none"
        lines.append(f"engine {endpoint} ({e.get('engine') or 'not recognised'}): "
                     f"{'read' if e.get('up') else 'NOT READ'}; failures: {failures}")
    return "\n".join(lines) + "\n"
