"""The app socket receiver (Contract 2): validated figures from the model server, per GPU.

A blocking receiver thread drains the datagram socket as messages arrive, so a burst from the app
never waits for the next sampling cycle (the kernel would drop what does not fit its buffer).
Every datagram is validated on its own; a bad one is counted by reason and never disturbs the
valid ones around it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from sidecar import protocol
from sidecar.config import Config
from sidecar.samples import AppFigures, LatencyHistogram

log = structlog.get_logger("sidecar.app")

REJECT_LOG_EVERY_S = 60.0


@dataclass
class _Merged:
    bounds: tuple[float, ...]
    counts: list[int]
    total: float
    updated: float
    retired: set[int] = field(default_factory=set)  # pids refused: they use older buckets


class AppState:
    """Latest allocator figures per (GPU, process) and latency histograms merged per GPU.

    Histograms are kept as the agent's own cumulative counters: each message adds its increase
    since the same process's previous message, and a process that restarted (its counts went
    down) contributes its counts afresh. The exported histogram therefore never goes backwards
    when one of several processes restarts.
    """

    def __init__(
        self,
        *,
        stale_after_s: float = Config.app_stale_after,
        known_gpu: Callable[[str], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_processes: int = Config.app_max_processes,
        max_gpus: int = Config.app_max_gpus,
        max_buckets: int = Config.app_max_buckets,
        max_message_bytes: int = Config.app_max_message_bytes,
    ) -> None:
        self.stale_after_s = stale_after_s
        self.max_processes = max_processes
        self.max_gpus = max_gpus
        self.max_buckets = max_buckets
        self.max_message_bytes = max_message_bytes
        self.known_gpu = known_gpu
        self.clock = clock
        self.accepted = 0
        self.rejected: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._announced: dict[str, float] = {}  # GPU -> when the app last named it
        self._alloc: dict[tuple[str, int], tuple[float, protocol.Allocator]] = {}
        # per process, its last cumulative counts as a compact array of int64 (a tuple of Python
        # ints costs about 700 bytes per histogram, and there may be 64 x 256 of them)
        self._last_latency: dict[tuple[str, int], tuple[array[int], float, float]] = {}
        self._merged: dict[str, _Merged] = {}
        # retries and OOMs per GPU, the agent's own counters: each message adds its process's
        # increase, a restarted process (its counts went down) adds its counts afresh
        self._counted: dict[tuple[str, int], tuple[int, int]] = {}
        self._counters: dict[str, list[int]] = {}
        self._stale = 0  # processes that went quiet, for the log's running count
        # per GPU, the processes with any state kept -> when last heard, least recent first
        # (re-inserted on every message), so the slot to reclaim is always the first
        self._pids: dict[str, dict[int, float]] = {}
        self._reject_log: dict[str, tuple[float, int]] = {}
        self._last_rejection: dict[str, tuple[float, str]] = {}  # reason -> (wall time, detail)

    def feed(self, data: bytes) -> protocol.Message | None:
        """Validate and store one datagram; None when it was rejected (and counted)."""
        try:
            message = protocol.decode(data, max_bytes=self.max_message_bytes,
                                      max_buckets=self.max_buckets)
            with self._lock:
                self._store(message, self.clock())
                self.accepted += 1
            return message
        except protocol.Rejected as exc:
            self.reject(exc)
            return None

    def reject(self, exc: protocol.Rejected) -> None:
        """Count a rejection by reason; log it at most once a minute per reason."""
        now = self.clock()
        with self._lock:
            self.rejected[exc.reason] += 1
            self._last_rejection[exc.reason] = (time.time(), str(exc)[:300])
            last, suppressed = self._reject_log.get(exc.reason, (-1e18, 0))
            if now - last < REJECT_LOG_EVERY_S:
                self._reject_log[exc.reason] = (last, suppressed + 1)
                return
            self._reject_log[exc.reason] = (now, 0)
        log.warning("app_message_rejected", reason=exc.reason, detail=str(exc),
                    similar_since_last_log=suppressed,
                    hint="fix the sender; valid messages are unaffected")

    def _check_gpus(self, gpus: set[str]) -> None:
        if self.known_gpu is not None:
            for uuid in gpus:
                if not self.known_gpu(uuid):
                    raise protocol.Rejected("unknown_gpu", f"GPU {uuid} is not on this node")
        new = len(gpus - self._announced.keys())
        if new and len(self._announced) + new > self.max_gpus:
            self._forget_quiet_gpus(self.clock())
            if len(self._announced) + len(gpus - self._announced.keys()) > self.max_gpus:
                raise protocol.Rejected(
                    "too_many_gpus", f"more than {self.max_gpus} GPUs announced; raise "
                    "--app-max-gpus if the pod really has that many")

    def _store(self, message: protocol.Message, now: float) -> None:
        """Every kind is a round: GPUs named, and figures per GPU. Whole or not at all: every
        GPU, and room for the process on each, is checked before anything is kept."""
        parts: tuple[protocol.Allocator | protocol.Latency, ...]
        if isinstance(message, protocol.Round):
            named, parts = set(message.gpus), (*message.allocators, *message.latency)
        elif isinstance(message, protocol.Hello):
            named, parts = set(message.gpus), ()
        else:
            named, parts = set(), (message,)
        with_figures = {part.gpu for part in parts}
        # a process is on every GPU it names or sends figures for (status lists it on each,
        # a tensor-parallel server on all of its GPUs), and takes a slot there
        used = named | with_figures
        pid = message.pid
        # validation: nothing is kept until every check passed
        self._check_gpus(used)
        for uuid in used:
            self._check_room(uuid, pid, now)
        for part in parts:
            if isinstance(part, protocol.Latency):
                self._check_layout(part)
        # storing
        for uuid in used:
            self._announced[uuid] = now
            self._take_slot(uuid, pid, now)
        for part in parts:
            key = (part.gpu, pid)
            if isinstance(part, protocol.Allocator):
                self._alloc[key] = (now, part)  # kept as decoded: samples reads it as is
                self._count(key, part.alloc_retries, part.ooms)
            else:
                self._merge(part, key, now)

    def _count(self, key: tuple[str, int], retries: int, ooms: int) -> None:
        last = self._counted.get(key)
        totals = self._counters.setdefault(key[0], [0, 0])
        if last is not None and retries >= last[0] and ooms >= last[1]:
            totals[0] += retries - last[0]
            totals[1] += ooms - last[1]
        else:  # first message of this process, or it restarted
            totals[0] += retries
            totals[1] += ooms
        self._counted[key] = (retries, ooms)

    def _check_room(self, gpu: str, pid: int, now: float) -> None:
        """Per-process state is bounded: a new process finds room on a full GPU only if the
        least recently heard one has been silent past the staleness window."""
        pids = self._pids.get(gpu)
        if not pids or pid in pids or len(pids) < self.max_processes:
            return
        if next(iter(pids.values())) >= now - self.stale_after_s:
            raise protocol.Rejected(
                "too_many_processes", f"more than {self.max_processes} live processes on {gpu}; "
                "raise --app-max-processes if that many really publish")

    def _take_slot(self, gpu: str, pid: int, now: float) -> None:
        """Mark ``pid`` heard now (last in the order), reclaiming the least recently heard
        process's slot when the GPU is full (``_check_room`` said it may)."""
        pids = self._pids.setdefault(gpu, {})
        if pid not in pids and len(pids) >= self.max_processes:
            oldest = next(iter(pids))
            self._forget((gpu, oldest))
            del pids[oldest]
        pids.pop(pid, None)
        pids[pid] = now

    def _check_layout(self, message: protocol.Latency) -> None:
        merged = self._merged.get(message.gpu)
        if merged is not None and merged.bounds != message.bounds and \
                message.pid in merged.retired:
            raise protocol.Rejected(
                "bucket_mismatch",
                f"latency bounds differ from those now used for {message.gpu}; "
                "every process on a GPU must use the same buckets",
            )

    def _merge(self, message: protocol.Latency, key: tuple[str, int], now: float) -> None:
        merged = self._merged.get(message.gpu)
        if merged is not None and merged.bounds != message.bounds:  # _check_layout allowed it:
            # a process brings other buckets (a redeploy, or a restart under the same pid):
            # its layout is taken and the GPU's histogram restarts from zero, as a counter
            # reset does; processes still on the old layout are refused from then on, so two
            # live layouts never take turns
            merged = self._relayout(message, now)
        last = self._last_latency.get(key)
        counts = message.counts
        if last is not None and all(c >= p for c, p in zip(counts, last[0], strict=True)) and \
                message.sum >= last[1]:
            delta = [c - p for c, p in zip(counts, last[0], strict=True)]
            dsum = message.sum - last[1]
        else:  # first message of this process, or it restarted
            delta, dsum = list(counts), message.sum
        if merged is None:
            merged = self._merged[message.gpu] = _Merged(message.bounds, [0] * len(counts), 0.0, now)
        merged.counts = [m + d for m, d in zip(merged.counts, delta, strict=True)]
        merged.total += dsum
        merged.updated = now
        self._last_latency[key] = (array("q", counts), message.sum, now)

    def _relayout(self, message: protocol.Latency, now: float) -> _Merged:
        old = self._merged[message.gpu]
        # the GPU's own processes, not every process of every GPU
        on_old = [pid for pid in self._pids.get(message.gpu, ())
                  if self._last_latency.pop((message.gpu, pid), None) is not None]
        retired = old.retired | set(on_old)
        if len(retired) > self.max_processes:
            retired = set(sorted(retired)[-self.max_processes:])
        log.warning("latency_buckets_changed", gpu_uuid=message.gpu, pid=message.pid,
                    old_bounds=list(old.bounds), new_bounds=list(message.bounds),
                    effect="the GPU's latency histogram restarts with the new buckets; "
                           "processes still on the old buckets are refused")
        merged = self._merged[message.gpu] = _Merged(
            message.bounds, [0] * (len(message.bounds) + 1), 0.0, now, retired)
        return merged

    def processes(self) -> list[dict[str, object]]:
        """Each publishing process with its GPUs and how long ago it was last heard (for
        ``gpu-sidecar status``), most recently heard first."""
        now = self.clock()
        heard: dict[int, tuple[float, list[str]]] = {}
        with self._lock:
            for gpu, pids in self._pids.items():
                for pid, when in pids.items():
                    last, gpus = heard.get(pid, (when, []))
                    heard[pid] = (max(last, when), [*gpus, gpu])
        return [{"pid": pid, "gpus": sorted(gpus), "last_message_s_ago": round(now - when, 1)}
                for pid, (when, gpus) in sorted(heard.items(), key=lambda kv: -kv[1][0])]

    def last_rejections(self) -> dict[str, tuple[float, str]]:
        """The last rejected message of each reason: when (wall clock) and what was wrong."""
        with self._lock:
            return dict(self._last_rejection)

    def announced(self) -> list[str]:
        with self._lock:
            self._forget_quiet_gpus(self.clock())
            return list(self._announced)

    def _forget_quiet_gpus(self, now: float) -> None:
        """GPUs the app has not named for --app-stale-after are forgotten, with what was kept
        for them (lock held): a pod's GPUs change over its life, and the table stays bounded."""
        horizon = now - self.stale_after_s
        for gpu, seen in [(g, t) for g, t in self._announced.items() if t < horizon]:
            del self._announced[gpu]
            self._merged.pop(gpu, None)
            self._counters.pop(gpu, None)
            for pid in self._pids.pop(gpu, ()):
                self._forget((gpu, pid))
            log.info("app_gpu_forgotten", gpu_uuid=gpu, silent_s=round(now - seen, 1),
                     note="the app has not named this GPU for --app-stale-after seconds")

    def figures(self, gpu: str) -> AppFigures:
        """What the app said about ``gpu`` within the staleness window."""
        return self.all_figures().get(gpu, NO_FIGURES)

    def all_figures(self) -> dict[str, AppFigures]:
        """What the app said about each GPU within the staleness window, in one pass over the
        table (the agent asks once per cycle, not once per GPU)."""
        now = self.clock()
        horizon = now - self.stale_after_s
        allocators: dict[str, list[protocol.Allocator]] = {}
        latency: dict[str, LatencyHistogram] = {}
        with self._lock:
            if not self._alloc and not self._merged:
                return {}
            for key, (seen, fig) in list(self._alloc.items()):
                if seen < horizon:
                    del self._alloc[key]
                    self._log_stale(key, now - seen)
                else:
                    allocators.setdefault(key[0], []).append(fig)
            for gpu, merged in self._merged.items():
                if merged.updated >= horizon:
                    latency[gpu] = LatencyHistogram(merged.bounds, tuple(merged.counts),
                                                    merged.total)
            counters = {gpu: tuple(self._counters.get(gpu, (0, 0))) for gpu in allocators}
        return {gpu: AppFigures(tuple(sorted(allocators.get(gpu, ()), key=_by_pid)),
                                latency.get(gpu), *counters.get(gpu, (None, None)))
                for gpu in allocators.keys() | latency.keys()}

    def _forget(self, key: tuple[str, int]) -> None:
        self._alloc.pop(key, None)
        self._last_latency.pop(key, None)
        self._counted.pop(key, None)

    def _log_stale(self, key: tuple[str, int], age: float) -> None:
        """Logged at the 1st, 10th, 100th, ... process that went quiet: workers that restart
        all day must not write a line each."""
        self._stale += 1
        if 10 ** (len(str(self._stale)) - 1) == self._stale:
            log.warning("app_figures_stale", gpu_uuid=key[0], pid=key[1], age_s=round(age, 1),
                        stale_after_s=self.stale_after_s, processes_gone_quiet=self._stale,
                        effect="a quiet process leaves its GPU's allocator sums until it "
                               "publishes again")


NO_FIGURES = AppFigures()


def _by_pid(figures: protocol.Allocator) -> int:
    return figures.pid


class SocketUnavailable(RuntimeError):
    """The app socket cannot be bound here: the agent stops with exit 4 and this message, which
    says what was wrong and what to do."""


class SocketInUse(SocketUnavailable):
    """A live process (a second agent, or the agent beside which ``diagnose`` runs) holds the
    socket."""


class AppSocket:
    """Binds the datagram socket and feeds every datagram to an ``AppState``."""

    def __init__(self, path: str, state: AppState) -> None:
        self.path = path
        self.state = state
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._inode: int | None = None

    def start(self) -> None:
        self._sock = bind_datagram(self.path)
        self._inode = os.stat(self.path).st_ino
        self._thread = threading.Thread(target=self._serve, name="app-socket", daemon=True)
        self._thread.start()
        log.info("app_socket_listening", path=self.path)

    def _serve(self) -> None:
        sock = self._sock
        assert sock is not None
        limit = self.state.max_message_bytes
        buf = bytearray(limit + 1)
        view = memoryview(buf)
        while not self._stop.is_set():
            try:
                n = sock.recv_into(buf, len(buf), socket.MSG_TRUNC)
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    return
                log.error("app_socket_receive_failed", error=str(exc))
                time.sleep(0.1)
                continue
            if self._stop.is_set():
                return
            if n > limit:
                self.state.reject(protocol.Rejected(
                    "too_large", f"datagram of {n} bytes exceeds {limit}; split it "
                    "(protocol.split_round) or raise --app-max-message-bytes"))
                continue
            self.state.feed(bytes(view[:n]))

    def stop(self) -> None:
        self._stop.set()
        if self._sock is not None:
            # an empty datagram wakes the blocked receive now rather than at its timeout
            with contextlib.suppress(OSError), \
                    socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as waker:
                waker.setblocking(False)
                waker.sendto(b"", self.path)
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._sock is not None:
            self._sock.close()
        try:
            if self._inode is not None and os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass


def bind_datagram(path: str) -> socket.socket:
    """The app socket: ``bind_unix`` of a datagram socket."""
    sock = bind_unix(path, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    # stop() wakes the receive with an empty datagram; the timeout is only a backstop, long
    # so an idle agent does not wake twice a second for nothing
    sock.settimeout(5.0)
    return sock


def bind_unix(path: str, kind: int) -> socket.socket:
    """Bind a Unix socket of ``kind`` at ``path`` with mode 0660, replacing a stale socket file
    but never a live one.

    Every refusal of the directory (read-only volume, no write permission, full) becomes one
    ``SocketUnavailable`` naming the path and the fix, never a traceback."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, mode=0o770, exist_ok=True)
    except OSError as exc:
        raise SocketUnavailable(
            f"cannot create the socket directory {directory}: {exc.strerror}; mount a writable "
            "emptyDir there or set --socket / GPU_SIDECAR_SOCKET"
        ) from exc
    try:
        return _bind_in(directory, path, kind)
    except SocketUnavailable:
        raise
    except OSError as exc:
        raise SocketUnavailable(
            f"cannot bind the socket {path}: {exc.strerror} (errno {exc.errno}); the "
            f"directory {directory} must be writable by this user (uid {os.getuid()}): mount a "
            "writable emptyDir there (not read-only) or set --socket / GPU_SIDECAR_SOCKET"
        ) from exc


def _bind_in(directory: str, path: str, kind: int) -> socket.socket:
    st = os.stat(directory)
    if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o007:
        os.chmod(directory, stat.S_IMODE(st.st_mode) & ~0o007)
    try:
        existing = os.lstat(path)
    except FileNotFoundError:
        existing = None
    if existing is not None:
        if not stat.S_ISSOCK(existing.st_mode):
            raise SocketUnavailable(
                f"{path} exists and is not a socket; remove it or choose another --socket path"
            )
        probe = socket.socket(socket.AF_UNIX, kind)
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise
            os.unlink(path)  # stale: left by a previous run
        else:
            raise SocketInUse(
                f"another process is listening on {path}; is a second gpu-sidecar running in "
                "this pod? Stop it or choose another --socket path"
            )
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, kind)
    old = os.umask(0o117)
    try:
        sock.bind(path)
        os.chmod(path, 0o660)
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old)
    return sock
