"""App-side publisher: tells the gpu-sidecar what only the model server's process can know.

Standard library only (torch is used when the app already imported it), safe to import anywhere,
and built never to hurt the app: sends are non-blocking datagrams, dropped and counted when the
sidecar is absent, restarting or slow; no exception ever reaches the caller; nothing is printed.

    from sidecar import client
    client.start()                      # torch apps: allocator figures of every used CUDA device
    with client.timer():                # or client.observe(seconds), or @client.timed
        handle(request)

For apps without torch (JAX, TensorRT, custom allocators)::

    pub = client.start(gpus=["GPU-5e0a..."], use_torch=False)
    pub.send_allocator("GPU-5e0a...", reserved_bytes=r, allocated_bytes=a)

The socket path is the variable ``protocol.SOCKET_ENV`` (``GPU_SIDECAR_SOCKET``) or else
``protocol.DEFAULT_SOCKET_PATH``, as on the sidecar. The figures read from torch, the UUIDs and
the socket are ``sidecar.app_shared``'s, the same file the agent places beside its injected
publisher: the two publishers cannot read the allocator differently.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys
import threading
import time
import weakref
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from sidecar import app_shared, protocol
from sidecar.app_shared import allocator_figures, snapshot_figures

__all__ = ["Histogram", "Publisher", "allocator_figures", "observe", "snapshot_figures", "start",
           "stop", "timed", "timer"]

F = TypeVar("F", bound=Callable[..., Any])
_INF = float("inf")
DRAIN_EVERY_S = 0.25


class Histogram:
    """Fixed-bucket latency histogram whose ``observe`` costs the app one C-level call.

    ``observe`` is ``deque.append`` of a bounded deque: atomic (thread-safe without a lock),
    never blocking, no per-call allocation beyond the float the caller already has. The bucket
    counting happens when the histogram is read: the publisher thread drains the deque every
    quarter second, off the request path. If nothing drains it, the newest ``PENDING_MAX``
    observations are kept and ``overflowed`` says that older ones were lost.
    """

    PENDING_MAX = 1 << 17

    def __init__(self, bounds: Sequence[float] = protocol.DEFAULT_LATENCY_BOUNDS) -> None:
        bounds = tuple(float(b) for b in bounds)
        if not bounds or list(bounds) != sorted(set(bounds)) or bounds[0] <= 0:
            raise ValueError("bounds must be strictly increasing positive seconds")
        if len(bounds) > protocol.MAX_BUCKETS:
            raise ValueError(f"at most {protocol.MAX_BUCKETS} bounds")
        self.bounds = bounds
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._counts = [0] * (len(self.bounds) + 1)  # per bucket, the last one is +Inf
        self._sum = 0.0
        self.ignored = 0  # negative, infinite, NaN or non-numeric observations
        self.overflowed = False
        self._pending: deque[float] = deque(maxlen=self.PENDING_MAX)
        #: Record one request of ``seconds`` (bad values are ignored when counted).
        self.observe: Callable[[float], None] = self._pending.append

    def drain(self) -> None:
        """Count the pending observations into the buckets."""
        with self._lock:
            pending, bounds, counts = self._pending, self.bounds, self._counts
            if len(pending) == pending.maxlen:
                self.overflowed = True
            popleft, total = pending.popleft, 0.0
            while pending:
                value = popleft()
                try:
                    if 0.0 <= value < _INF:
                        counts[bisect_left(bounds, value)] += 1
                        total += value
                        continue
                except TypeError:
                    pass
                self.ignored += 1
            self._sum += total

    def snapshot(self) -> tuple[tuple[int, ...], float]:
        """(cumulative counts, one per bound and one for +Inf; sum of seconds)."""
        self.drain()
        with self._lock:
            cumulative, running = [], 0
            for c in self._counts:
                running += c
                cumulative.append(running)
            return tuple(cumulative), self._sum


class _TorchReader:
    """Reads the caching allocator of the CUDA devices this process uses, never initialising
    CUDA itself (a publisher must not create contexts on GPUs the app does not use)."""

    def __init__(self) -> None:
        self._uuids: dict[int, str] = {}

    @staticmethod
    def torch() -> Any:
        torch = sys.modules.get("torch")  # only if the app imported it: never import it here
        if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        return torch

    def devices(self, torch: Any) -> dict[int, tuple[str, dict[str, int]]]:
        out = {}
        current = torch.cuda.current_device()
        for index in range(torch.cuda.device_count()):
            figures = allocator_figures(torch.cuda.memory_stats(index))
            if figures["reserved_bytes"] == 0 and index != current:
                continue  # a device this process never allocated on
            uuid = self._uuids.get(index)
            if uuid is None:
                uuid = app_shared.uuid_text(torch.cuda.get_device_properties(index).uuid)
                if uuid is None:
                    continue  # not a UUID the agent accepts: nothing to name the figures by
                self._uuids[index] = uuid
            out[index] = (uuid, figures)
        return out

    @staticmethod
    def snapshot(torch: Any) -> dict[int, dict[str, int]]:
        return snapshot_figures(app_shared.memory_snapshot(torch.cuda))


class Publisher:
    """Publishes allocator figures, latency and the process's GPUs on a daemon thread."""

    def __init__(
        self,
        socket_path: str | None = None,
        *,
        interval_s: float = 5.0,
        snapshot_interval_s: float = 60.0,
        gpus: Sequence[str] = (),
        bounds: Sequence[float] = protocol.DEFAULT_LATENCY_BOUNDS,
        use_torch: bool = True,
    ) -> None:
        self.socket_path = socket_path or os.environ.get(protocol.SOCKET_ENV) or \
            protocol.DEFAULT_SOCKET_PATH
        self.interval_s = interval_s
        self.snapshot_interval_s = snapshot_interval_s
        self.gpus = list(gpus)
        self._known: set[str] = set()
        self.histogram = Histogram(bounds)
        self.observe = self.histogram.observe
        self.use_torch = use_torch
        self.errors = 0
        self._torch = _TorchReader()
        self._sender = app_shared.Sender(self.socket_path)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._running = False
        self._last_snapshot = -1e18
        self._last_retries: dict[int, int] = {}
        self._snap: dict[int, dict[str, int]] = {}
        self._pid = os.getpid()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _after_fork(ref))

    # -- counters the app may read ---------------------------------------------------------

    @property
    def sent(self) -> int:
        return self._sender.sent

    @property
    def dropped(self) -> int:
        return self._sender.dropped

    # -- latency ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def timer(self) -> Iterator[None]:
        """Times the block as one request, also when it raises."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.observe(time.perf_counter() - start)

    def timed(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.observe(time.perf_counter() - start)

        return wrapper  # type: ignore[return-value]

    # -- sending ---------------------------------------------------------------------------

    def send_allocator(self, gpu: str, *, reserved_bytes: int, allocated_bytes: int,
                       active_bytes: int | None = None, inactive_split_bytes: int = 0,
                       alloc_retries: int = 0, ooms: int = 0,
                       largest_free_block_bytes: int | None = None,
                       private_pool_bytes: int | None = None) -> bool:
        """Send one allocator message now; False (and counted) when it could not be sent."""
        try:
            if not _is_uuid(gpu):
                raise ValueError(f"{gpu!r} is not a GPU or MIG UUID")
            data = app_shared.allocator_datagram(self._pid, {
                "gpu": gpu, "reserved_bytes": reserved_bytes, "allocated_bytes": allocated_bytes,
                "active_bytes": allocated_bytes if active_bytes is None else active_bytes,
                "inactive_split_bytes": inactive_split_bytes, "alloc_retries": alloc_retries,
                "ooms": ooms, "largest_free_block_bytes": largest_free_block_bytes,
                "private_pool_bytes": private_pool_bytes})
        except Exception:  # a malformed UUID or figure: never into the app
            self.errors += 1
            return False
        if gpu not in self._known:
            self._known.add(gpu)
            if gpu not in self.gpus:
                self.gpus.append(gpu)
        return self._sender.send(data)

    def publish(self) -> None:
        """One round, in one datagram: the GPUs, each device's allocator figures, the latency
        histogram (several datagrams only past ``protocol.MAX_MESSAGE_BYTES``), encoded by
        ``app_shared.round_datagrams``, as the injected publisher's."""
        try:
            with self._lock:
                self._publish()
        except Exception:
            self.errors += 1

    def _publish(self) -> None:
        devices: dict[int, tuple[str, dict[str, int]]] = {}
        torch = self._torch.torch() if self.use_torch else None
        if torch is not None:
            devices = self._torch.devices(torch)
            now = time.monotonic()
            retries_moved = any(fig["alloc_retries"] != self._last_retries.get(i, 0)
                                for i, (_, fig) in devices.items())
            if devices and (retries_moved or now - self._last_snapshot >= self.snapshot_interval_s):
                self._snap = self._torch.snapshot(torch)
                self._last_snapshot = now
            self._last_retries = {i: fig["alloc_retries"] for i, (_, fig) in devices.items()}
        gpus = list(dict.fromkeys([*self.gpus, *(uuid for uuid, _ in devices.values())]))
        if not gpus:
            return
        allocators = [{"gpu": uuid, **fig, **self._snap.get(index, {})}
                      for index, (uuid, fig) in devices.items()]
        gpus = gpus[: protocol.MAX_GPUS]
        counts, total = self.histogram.snapshot()
        # the process's requests are the requests of every GPU it uses (a tensor-parallel
        # server's request runs on all of them): its histogram is sent for each, so each GPU's
        # latency is judged (an agent of any release takes a latency entry per GPU)
        latency = [{"gpu": gpu, "bounds": self.histogram.bounds, "counts": counts, "sum": total}
                   for gpu in gpus] if counts[-1] else []
        for data in app_shared.round_datagrams(self._pid, gpus, allocators, latency,
                                               max_bytes=protocol.MAX_MESSAGE_BYTES):
            self._sender.send(data, patience=app_shared.SEND_PATIENCE)

    # -- life cycle ------------------------------------------------------------------------

    def configure(self, socket_path: str | None = None, *, interval_s: float | None = None,
                  snapshot_interval_s: float | None = None, gpus: Sequence[str] | None = None,
                  use_torch: bool | None = None) -> Publisher:
        """Change settings of a publisher (the latency buckets are fixed at creation)."""
        with self._lock:
            if socket_path and socket_path != self.socket_path:
                self.socket_path = socket_path
                self._sender.close()
                self._sender = app_shared.Sender(socket_path)
            if interval_s is not None:
                self.interval_s = interval_s
            if snapshot_interval_s is not None:
                self.snapshot_interval_s = snapshot_interval_s
            if gpus is not None:
                self.gpus = list(gpus)
            if use_torch is not None:
                self.use_torch = use_torch
        return self

    def start(self) -> Publisher:
        with self._lock:
            if self._running:
                return self
            self._running = True
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name=app_shared.PUBLISHER_THREAD,
                                            daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        next_publish = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_publish:
                self.publish()
                next_publish = now + app_shared.jittered(self.interval_s)
            else:
                self.histogram.drain()
            self._stop.wait(min(DRAIN_EVERY_S, max(0.0, next_publish - time.monotonic())))

    def stop(self) -> None:
        """Stop the thread after a last publish; safe to call twice and at exit."""
        thread = self._thread
        with self._lock:
            if self._stop.is_set() and thread is None:
                return
            self._running = False
            self._stop.set()
            self._thread = None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2)
        self.publish()
        self._sender.close()

    def _after_fork_in_child(self) -> None:
        """A pre-fork worker: its own pid, socket, histogram and (if the parent ran one) thread."""
        was_running = self._running
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._sender = app_shared.Sender(self.socket_path)
        self.histogram._reset()
        self.observe = self.histogram.observe
        self._stop = threading.Event()
        self._thread = None
        self._running = False
        if was_running:
            self.start()


def _after_fork(ref: weakref.ref[Publisher]) -> None:
    pub = ref()
    if pub is not None:
        with contextlib.suppress(Exception):
            pub._after_fork_in_child()


@functools.lru_cache(maxsize=256)
def _is_uuid(gpu: str) -> bool:
    """A name the agent takes (checked here, so a bad one is refused before it is sent)."""
    return protocol.UUID_RE.match(gpu) is not None


# -- the process-wide default publisher ----------------------------------------------------

_default: Publisher | None = None
_default_lock = threading.Lock()


def _get() -> Publisher:
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Publisher()
                atexit.register(_default.stop)
    return _default


def start(socket_path: str | None = None, **kwargs: Any) -> Publisher:
    """Start the process-wide publisher (idempotent); keyword arguments as for ``Publisher``
    (``bounds`` only before the first ``observe``)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Publisher(socket_path, **kwargs)
            atexit.register(_default.stop)
            return _default.start()
    kwargs.pop("bounds", None)
    return _default.configure(socket_path, **kwargs).start()


def stop() -> None:
    if _default is not None:
        _default.stop()


def observe(seconds: float) -> None:
    """Record one request's latency in the process-wide histogram."""
    _get().observe(seconds)


def timer() -> contextlib.AbstractContextManager[None]:
    return _get().timer()


def timed(fn: F) -> F:
    """Decorator: time every call as one request."""
    return _get().timed(fn)
