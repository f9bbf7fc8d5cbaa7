"""``gpu-sidecar status``: what the running agent knows, read from beside it (the file
``sidecar.status_file`` writes), and ``status --alive``, the liveness probe.

The file lies in a volume the app's container shares, so the reader trusts nothing of it: only a
regular file (never through a symbolic link, never a FIFO that would block it), at most
``MAX_BYTES``, and a time in the future is no proof of life.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sidecar.config import Config
from sidecar.recent import CURRENT_S
from sidecar.status_file import (
    FUTURE_SKEW_S,
    MAX_BYTES,
    NVML_CALLS_KEPT,
    STALE_CONTENT_S,
    alive_after_s,
    status_path,
)

# -- the command ------------------------------------------------------------------------------


class Refused(Exception):
    """The status file is not one the agent writes; the message says what it is and what to do."""


@dataclass(frozen=True)
class Reading:
    """What the status file says: its content (None for the empty file an agent leaves as its
    heartbeat when it could not yet write any status) and its time, the agent's heartbeat."""

    data: dict[str, Any] | None
    beat_at: float


_KINDS = ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
          (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))


def read_status(path: Path) -> Reading:
    """The status file, read without trusting it: opened without following a symbolic link and
    without blocking (a FIFO), taken only as a regular file of at most ``MAX_BYTES``.
    FileNotFoundError when there is none; Refused for anything else that is not a status."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused(f"{path} is a symbolic link: the agent writes a regular file there, so "
                          "another container placed it; remove it (the agent writes a new status "
                          "within a second)") from None
        raise Refused(f"cannot open {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _KINDS if test(st.st_mode)), "special file")
            raise Refused(f"{path} is a {kind}, not the regular file the agent writes; remove "
                          "it (the agent writes a new status within a second)")
        if st.st_size > MAX_BYTES:
            raise Refused(f"{path} holds {st.st_size} bytes, more than the {MAX_BYTES} a status "
                          "can take: it is not the agent's; remove it")
        raw = bytearray()
        while len(raw) <= MAX_BYTES and (chunk := os.read(fd, MAX_BYTES + 1 - len(raw))):
            raw += chunk
    finally:
        os.close(fd)
    if len(raw) > MAX_BYTES:
        raise Refused(f"{path} grew past the {MAX_BYTES} bytes a status can take while read: it "
                      "is not the agent's; remove it")
    if not raw:
        return Reading(None, st.st_mtime)
    try:
        data = json.loads(bytes(raw))
    except ValueError as exc:
        raise Refused(f"{path} is not the agent's status (not JSON: {exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("written_at"), (int, float)):
        raise Refused(f"{path} is not the agent's status (no written_at time)")
    return Reading(data, st.st_mtime)


@dataclass(frozen=True)
class Judgement:
    """Whether the agent lives, from its heartbeat: ``why`` says why not (or is empty)."""

    alive: bool
    beat_age_s: float
    limit_s: float
    why: str
    future: bool = False  # not alive for a time in the future, not for an old heartbeat


def judge(reading: Reading, now: float, default_limit_s: float) -> Judgement:
    """Alive while the heartbeat is younger than the agent's limit. A time in the future (the
    file's or the content's) proves nothing: the agent, on this host's clock, never writes one,
    so such a file is judged not alive rather than alive for ever."""
    data = reading.data or {}
    limit = data.get("alive_after_s")
    limit = float(limit) if isinstance(limit, (int, float)) and limit > 0 else default_limit_s
    age = now - reading.beat_at
    pid = data.get("pid", "unknown")
    for what, at in (("the file's modification time", reading.beat_at),
                     ("its written_at", data.get("written_at", reading.beat_at))):
        if at - now > FUTURE_SKEW_S:
            return Judgement(False, age, limit, (
                f"{what} lies {at - now:.0f} s in the future: the agent (pid {pid}) never "
                "writes one, so it proves no cycle; judged not alive (a clock stepped back "
                "heals at the agent's next cycle; otherwise remove the file)"), future=True)
    if age > limit:
        return Judgement(False, age, limit, (
            f"the agent (pid {pid}) has written no status for {age:.0f} s (more than "
            f"{limit:.0f} s): its cycles have stopped"))
    return Judgement(True, age, limit, "")


def _free(directory: Path) -> str:
    """Why the status could not be rewritten, as far as the volume tells."""
    try:
        vfs = os.statvfs(directory)
    except OSError:
        return "its volume could not be asked"
    free = vfs.f_bavail * vfs.f_frsize
    if free < 64 << 10:
        return f"the volume of {directory} is full ({free} bytes free)"
    return f"the volume of {directory} has {free} bytes free (was it full, or not writable?)"


def status(cfg: Config, *, alive: bool) -> int:
    """0: the running agent's status (printed), or alive; 1: not alive (no heartbeat for too
    long, or a time in the future), or missing with --alive; 2: no status to read (no agent ever
    ran on this socket's volume, or the file is not one the agent writes)."""
    path = status_path(cfg.socket)
    try:
        reading = read_status(path)
    except FileNotFoundError:
        print(f"gpu-sidecar status: no {path}: no agent runs with --socket {cfg.socket} (give "
              "the socket path the agent uses; in a pod, run this in its container; a "
              "simulated agent's socket is private: the `why:` of its table's legend names the "
              "--socket that reaches it)", file=sys.stderr)
        return 1 if alive else 2
    except Refused as exc:
        print(f"gpu-sidecar status: {exc}", file=sys.stderr)
        return 1 if alive else 2
    now = time.time()
    verdict = judge(reading, now, alive_after_s(cfg.interval))
    if alive:
        if not verdict.alive:
            print(f"gpu-sidecar status: {verdict.why}", file=sys.stderr)
        return 0 if verdict.alive else 1
    if reading.data is None:
        print(f"gpu-sidecar status: the agent beat {verdict.beat_age_s:.0f} s ago but could not "
              f"write any status yet: {_free(path.parent)}", file=sys.stderr)
        return 0 if verdict.alive else 1
    stale = reading.beat_at - float(reading.data["written_at"])
    note = (f"; the content below is {stale:.0f} s older than the agent's last heartbeat: it "
            f"could not be rewritten since ({_free(path.parent)})"
            if verdict.alive and stale > STALE_CONTENT_S else "")
    try:
        text = report(reading.data, now - float(reading.data["written_at"]), verdict, note)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        print(f"gpu-sidecar status: {path} is not the agent's status ({type(exc).__name__}: "
              f"{exc}); remove it (the agent writes a new status within a second)",
              file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0 if verdict.alive else 1


def _ago(at: float | None, now: float) -> str:
    return "never" if not at else f"{now - at:.0f} s ago"


def report(data: dict[str, Any], age: float, verdict: Judgement, note: str = "") -> str:
    now = time.time()
    started = data.get("started_at")
    started = started if isinstance(started, (int, float)) else 0
    lines = [f"gpu-sidecar {data.get('version')} (pid {data.get('pid')}, {data.get('mode')}): "
             f"{data.get('cycles')} cycles every {data.get('interval_s')} s since "
             f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}; "
             f"status written {age:.0f} s ago"
             + ("" if verdict.alive else f" (NOT ALIVE: {verdict.why})" if verdict.future
                else " (STALE: its cycles have stopped)")
             + note
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
                                      else "; NOT READABLE (lost or failing)")
                     + (f"; verdict {g['verdict']} (the last {CURRENT_S:.0f} s; why: "
                        "gpu-sidecar diagnose)" if "verdict" in g else ""))
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
    lines += _nvml_lines(data)
    return "\n".join(lines) + "\n"


# a pynvml function's name, as the agent's wrapper records it: nothing else is printed
_CALL_NAME = re.compile(r"nvml[A-Za-z0-9_]{1,80}")
_MAX_GPUS = 1024  # more GPUs than any node holds: not the agent's


def _amount(value: object, what: str) -> float:
    """A figure of the NVML section: a finite number, not negative (ValueError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0:
        raise ValueError(f"nvml {what} is {value!r}, not a number of seconds or calls")
    return float(value)


def _calls(rows: object, what: str) -> str:
    """The costliest calls as the agent wrote them ([name, seconds, calls], at most
    NVML_CALLS_KEPT), checked, as text."""
    if not isinstance(rows, list) or len(rows) > NVML_CALLS_KEPT:
        raise ValueError(f"nvml {what} is not a list of at most {NVML_CALLS_KEPT} calls")
    out = []
    for row in rows:
        if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str)
                and _CALL_NAME.fullmatch(row[0])):
            raise ValueError(f"nvml {what} holds {str(row)[:80]!r}, not an NVML call")
        out.append(f"{row[0]} {_ms(_amount(row[1], what))} x{_amount(row[2], what):.0f}")
    return ", ".join(out) or "none"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _nvml_lines(data: dict[str, Any]) -> list[str]:
    """The agent's time in NVML (the driver's lock, which the model server waits on): the last
    cycle's in all, per GPU and its costliest calls, and the costliest since the start (what
    gpu_sidecar_nvml_call_seconds_total exports). Every figure checked: the file is shared."""
    nvml = data.get("nvml")
    if nvml is None:
        return ["NVML time: " + ("not used (--no-nvml)" if data.get("mode") == "app-only"
                                 else "not in this status (an agent that did not measure it "
                                      "wrote it)")]
    if not isinstance(nvml, dict):
        raise ValueError("nvml is not an object")
    gpus = nvml.get("gpus")
    if not isinstance(gpus, list) or len(gpus) > _MAX_GPUS:
        raise ValueError("nvml gpus is not a list of GPUs")
    per_gpu = []
    for g in gpus:
        if not isinstance(g, dict) or not isinstance(g.get("index"), str) \
                or not re.fullmatch(r"[0-9]{1,4}(/[0-9]{1,4}){0,2}|unknown", g["index"]):
            raise ValueError(f"nvml gpus holds {str(g)[:80]!r}, not a GPU's time")
        per_gpu.append(f"GPU {g['index']} {_ms(_amount(g.get('seconds'), 'GPU seconds'))} "
                       f"({_amount(g.get('calls'), 'GPU calls'):.0f} calls)")
    return [
        f"NVML time in the last cycle: {_ms(_amount(nvml.get('cycle_seconds'), 'cycle_seconds'))}"
        f" in {_amount(nvml.get('cycle_calls'), 'cycle_calls'):.0f} calls; per GPU: "
        + (", ".join(per_gpu) or "none"),
        f"  costliest calls of the last cycle: {_calls(nvml.get('cycle_costliest'), 'cycle')}",
        f"  since the start: {_ms(_amount(nvml.get('total_seconds'), 'total_seconds'))} in "
        f"{_amount(nvml.get('total_calls'), 'total_calls'):.0f} calls; costliest: "
        f"{_calls(nvml.get('total_costliest'), 'total')} "
        "(gpu_sidecar_nvml_call_seconds_total{call})",
    ]
