"""The CUDA processes on a GPU, and which of them are this pod's.

NVML's process calls are among its slowest (milliseconds on real drivers, serialised with the
model server's own NVML calls), so they are made every ``PROCESS_READ_S`` for each GPU, never
every cycle, and their last answer is carried between two reads, as the rare figures are in
``reading.py``. Each read makes three calls through the timed wrapper:
``nvmlDeviceGetComputeRunningProcesses_v3`` and ``nvmlDeviceGetMPSComputeRunningProcesses_v3``
(pid, GPU memory) and ``nvmlDeviceGetProcessUtilization`` since the last sample seen (each
process's SM and memory-bandwidth share over the interval). ``NOT_FOUND`` from the last means no
process had the SMs since the previous read: shares of nothing, not an error. A call the GPU
refuses (``NOT_SUPPORTED``, a MIG instance's utilization, an old driver without the symbol)
leaves its figures absent for good, said once in the log and not asked again.

Whose a process is, is said, never guessed (``attribute``). NVML gives PIDs in the host's
namespace or the caller's, depending on the driver (NVML-FACTS.md §7), and the app's publishers
give theirs as the app sees them. A PID is this pod's when ``<proc_root>/<pid>`` is a process
(not a thread) in the agent's view whose cgroup is under the pod's (the parent of the agent's
own container's cgroup). The agent sees the pod's other containers only when the pod shares one
PID namespace (``shareProcessNamespace: true``); without it no answer is attributed
(``gpu_processes_attributed`` 0) and no process is counted as another pod's. An answer that has
processes of which none is the pod's (host PIDs in a pod's own namespace, which ``/proc`` cannot
map back) is not attributed either.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import pynvml
import structlog

from sidecar.sources.nvml.errors import Failures, GpuLost, error_name, is_lost, is_unsupported
from sidecar.sources.nvml.timed import nvml

log = structlog.get_logger("sidecar.nvml")

PROCESS_READ_S = 10.0  # how often each GPU's processes are asked for (three NVML calls)
PROC_ROOT = "/proc"
LIST, MPS, UTILIZATION = "processes", "mps_processes", "process_utilization"


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """One process of a running-process list, its PID as NVML gave it."""

    pid: int
    used_memory: int | None  # bytes; None where the driver cannot tell (WDDM)
    mps: bool = False


@dataclass(frozen=True, slots=True)
class ProcessShare:
    """One process's share of the GPU over the interval since the previous read (0..1)."""

    pid: int
    sm: float
    memory: float


@dataclass(frozen=True, slots=True)
class ProcessAnswer:
    """What one read of a GPU's process calls gave; None in a field: not given."""

    processes: tuple[GpuProcess, ...] | None = None
    shares: tuple[ProcessShare, ...] | None = None


@dataclass(slots=True)
class ProcessState:
    """One GPU's process reads: when the last was made, the last sample seen (CPU µs, the
    next utilization call's lastSeenTimeStamp) and the calls the GPU refused for good."""

    t: float | None = None
    last_seen_us: int = 0
    figures: ProcessFigures | None = None  # the last read's, carried until the next
    refused: set[str] = field(default_factory=set)
    said_unattributed: bool = False

    def due(self, now: float, every_s: float) -> bool:
        return self.t is None or not 0 <= now - self.t < every_s


def read_processes(device: Any, state: ProcessState, failures: Failures, *,
                   is_mig: bool = False) -> ProcessAnswer:
    """One read of the GPU's process calls (the caller keeps the cadence). A lost GPU raises
    ``GpuLost``; a passing failure leaves that call's figures absent this time. Where both
    lists are empty the utilization call is not made: a GPU without processes costs two calls
    every ``PROCESS_READ_S``."""
    lists = [_listed(call, fn, device, state, failures) for call, fn in (
        (LIST, nvml.nvmlDeviceGetComputeRunningProcesses_v3),
        (MPS, nvml.nvmlDeviceGetMPSComputeRunningProcesses_v3))]
    if is_mig:
        _refuse(state, failures, UTILIZATION, "not supported on MIG instances (nvml.h)")
    processes: tuple[GpuProcess, ...] | None = None
    if lists[0] is not None:
        processes = lists[0] + tuple(GpuProcess(p.pid, p.used_memory, mps=True)
                                     for p in lists[1] or ())
    if processes == ():  # no CUDA process on the GPU: no sample worth a third call
        return ProcessAnswer(processes=(), shares=())
    return ProcessAnswer(processes=processes, shares=_shares(device, state, failures))


def _listed(call: str, fn: Callable[..., list[Any]], device: Any, state: ProcessState,
            failures: Failures) -> tuple[GpuProcess, ...] | None:
    got = _call(call, fn, device, state, failures)
    if got is None:
        return None
    return tuple(GpuProcess(int(p.pid), p.usedGpuMemory) for p in got)


def _shares(device: Any, state: ProcessState,
            failures: Failures) -> tuple[ProcessShare, ...] | None:
    """Each process's SM and memory-bandwidth share since the last sample seen."""
    if UTILIZATION in state.refused:
        return None
    try:
        samples = nvml.nvmlDeviceGetProcessUtilization(device, state.last_seen_us)
    except pynvml.NVMLError as exc:
        if exc.value == pynvml.NVML_ERROR_NOT_FOUND:  # no process used the SMs since then
            failures.recovered(UTILIZATION)
            return ()
        _failed(UTILIZATION, exc, state, failures)
        return None
    failures.recovered(UTILIZATION)
    if samples:
        state.last_seen_us = max(int(s.timeStamp) for s in samples)
    return shares_of((int(s.pid), int(s.timeStamp), int(s.smUtil), int(s.memUtil))
                     for s in samples)


def shares_of(samples: Iterable[tuple[int, int, int, int]]) -> tuple[ProcessShare, ...]:
    """(pid, timeStamp, smUtil %, memUtil %) samples -> each process's mean share over the
    sample periods the answer holds (a process without a sample in a period had none of the
    GPU then: the driver gives only processes with non-zero utilization)."""
    periods: set[int] = set()
    sums: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for pid, stamp, sm, mem in samples:
        periods.add(stamp)
        sums[pid][0] += sm
        sums[pid][1] += mem
    n = len(periods) or 1
    return tuple(ProcessShare(pid, sm / n / 100, mem / n / 100)
                 for pid, (sm, mem) in sorted(sums.items()))


def _call(call: str, fn: Callable[..., list[Any]], device: Any, state: ProcessState,
          failures: Failures) -> list[Any] | None:
    if call in state.refused:
        return None
    try:
        got = fn(device)
    except pynvml.NVMLError as exc:
        _failed(call, exc, state, failures)
        return None
    failures.recovered(call)
    return got


def _failed(call: str, exc: pynvml.NVMLError, state: ProcessState, failures: Failures) -> None:
    if is_lost(exc):
        raise GpuLost from exc
    if is_unsupported(exc):
        _refuse(state, failures, call, error_name(exc))
    else:
        failures.failed(call, exc)


def _refuse(state: ProcessState, failures: Failures, call: str, why: str) -> None:
    """A call the GPU does not answer: its figures absent for good, said once."""
    if call not in state.refused:
        state.refused.add(call)
        log.info("nvml_process_figures_not_given", gpu_uuid=failures.uuid, read=call, why=why,
                 effect="its per-process figures are absent; not asked again")


# -- whose processes -------------------------------------------------------------------------


class Publishers(Protocol):
    """The app socket's view of its publishers (``AppState.processes``)."""

    def processes(self) -> list[dict[str, object]]: ...


def publisher_pids(app: Publishers | None) -> frozenset[int]:
    """The PIDs of the app's publishing processes, as the app gives them (its namespace)."""
    if app is None:
        return frozenset()
    return frozenset(p for entry in app.processes() if isinstance(p := entry.get("pid"), int))


@dataclass(frozen=True, slots=True)
class Own:
    """Which PIDs are this pod's: ``visible`` when the agent sees the pod's other containers'
    processes (a shared PID namespace), ``pids`` those of the PIDs asked about that are the
    pod's."""

    visible: bool
    pids: frozenset[int] = frozenset()


def own_processes(pids: Collection[int], app_pids: Collection[int], *,
                  proc_root: str = PROC_ROOT) -> Own:
    """Which of ``pids`` (NVML's) are the pod's processes, as ``proc_root`` shows them."""
    own_cgroup = _cgroup(proc_root, "self")
    if own_cgroup is None:
        return Own(visible=False)
    pod = _parent(own_cgroup)
    pod_pids, visible = set(), False
    for pid in {*pids, *app_pids}:
        cgroup = _cgroup(proc_root, str(pid)) if _is_process(proc_root, pid) else None
        if cgroup is None or _parent(cgroup) != pod:
            continue
        pod_pids.add(pid)
        visible = visible or cgroup != own_cgroup  # another container of the pod: shared
    return Own(visible=visible, pids=frozenset(pod_pids) & frozenset(pids))


def _is_process(proc_root: str, pid: int) -> bool:
    """``<proc_root>/<pid>`` is a process as this /proc's namespace numbers it (not a thread,
    whose status is there too): NSpid's first PID, that of the /proc mount's namespace, and
    Tgid are ``pid``."""
    try:
        with open(os.path.join(proc_root, str(pid), "status"), encoding="ascii",
                  errors="replace") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return False
    nspid = status.get("NSpid", status.get("Pid", "")).split()
    return bool(nspid) and nspid[0] == str(pid) and status.get("Tgid", "").strip() == str(pid)


def _cgroup(proc_root: str, pid: str) -> str | None:
    """The process's cgroup path (the unified hierarchy's, else the first listed)."""
    try:
        with open(os.path.join(proc_root, pid, "cgroup"), encoding="utf-8",
                  errors="replace") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    if not lines:
        return None
    unified = [path for hid, _, path in lines if hid == "0"]
    return unified[0] if unified else lines[0][2]


def _parent(path: str) -> str:
    """The cgroup above a container's: the pod's. A path relative to a private cgroup
    namespace (``/`` for the agent's own, ``/../<sibling>`` for the pod's other containers)
    has the same parent as its siblings."""
    stripped = path.rstrip("/")
    if not stripped:
        return "/.."
    return stripped.rpartition("/")[0] or "/"


@dataclass(frozen=True, slots=True)
class ProcessFigures:
    """The exported per-GPU figures of one read; None: not given or not attributed."""

    processes_attributed: int | None = None
    process_utilization_attributed: int | None = None
    pod_processes: float | None = None
    other_processes: float | None = None
    pod_process_memory_bytes: int | None = None
    other_process_memory_bytes: int | None = None
    pod_sm_share_ratio: float | None = None
    other_sm_share_ratio: float | None = None
    pod_mem_bandwidth_share_ratio: float | None = None
    other_mem_bandwidth_share_ratio: float | None = None


def attribute(answer: ProcessAnswer, *, own: Own) -> ProcessFigures:
    """This pod's and the others' counts, memory and shares. An answer is attributed when the
    agent sees the pod's processes and the answer is empty or holds one of them: an answer of
    processes none of which is the pod's is in PIDs the agent cannot map (host PIDs seen from
    the pod's namespace), and counting them as others' would be a guess."""
    procs, shares = answer.processes, answer.shares
    listed = procs is not None and _attributable([p.pid for p in procs], own)
    sampled = shares is not None and _attributable([s.pid for s in shares], own)
    figures = ProcessFigures(
        processes_attributed=None if procs is None else int(listed),
        process_utilization_attributed=None if shares is None else int(sampled))
    if listed and procs is not None:
        mine = [p for p in procs if p.pid in own.pids]
        theirs = [p for p in procs if p.pid not in own.pids]
        figures = replace(figures, pod_processes=float(len(mine)),
                           other_processes=float(len(theirs)),
                           pod_process_memory_bytes=_memory(mine), other_process_memory_bytes=_memory(theirs))
    if sampled and shares is not None:
        mine_s = [s for s in shares if s.pid in own.pids]
        theirs_s = [s for s in shares if s.pid not in own.pids]
        figures = replace(figures, pod_sm_share_ratio=sum(s.sm for s in mine_s),
                           other_sm_share_ratio=sum(s.sm for s in theirs_s),
                           pod_mem_bandwidth_share_ratio=sum(s.memory for s in mine_s),
                           other_mem_bandwidth_share_ratio=sum(s.memory for s in theirs_s))
    return figures


def _attributable(pids: list[int], own: Own) -> bool:
    return own.visible and (not pids or any(pid in own.pids for pid in pids))


def _memory(procs: list[GpuProcess]) -> int | None:
    if any(p.used_memory is None for p in procs):
        return None  # one process's memory unknown: the sum is not known either
    return sum(p.used_memory or 0 for p in procs)


def read_figures(device: Any, state: ProcessState, failures: Failures, app_pids: Collection[int],
                 now: float, *, is_mig: bool = False,
                 proc_root: str = PROC_ROOT) -> ProcessFigures | None:
    """One read of the GPU's processes, attributed; kept in ``state`` to be carried. None
    where no process is on the GPU: no figure is exported then (a GPU without processes, the
    stand-in's scenarios among them, has the series it always had)."""
    answer = read_processes(device, state, failures, is_mig=is_mig)
    pids = {p.pid for p in answer.processes or ()} | {s.pid for s in answer.shares or ()}
    if not pids:  # no CUDA process on the GPU (or none given): nothing to tell apart
        state.t, state.figures = now, None
        return None
    own = own_processes(pids, app_pids, proc_root=proc_root)
    figures = attribute(answer, own=own)
    if pids and not own.visible and not state.said_unattributed:
        state.said_unattributed = True
        log.info("nvml_processes_not_attributed", gpu_uuid=failures.uuid,
                 effect="the agent does not see the app's processes (shareProcessNamespace is "
                        "not set on the pod?): this pod's and the others' figures are absent")
    state.t, state.figures = now, figures
    return figures
