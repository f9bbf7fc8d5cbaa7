"""What the app's two publishers share: ``sidecar.client`` (the app imports it) and the injected
publisher (the agent places it in the socket volume). One source for both: the client imports
this module, and the agent places this file, byte for byte, beside the injected publisher as
``_gpu_sidecar_shared.py`` (``sidecar/inject/placement.py``), where that publisher loads it by
its path. Do not edit a placed copy: the source is sidecar/app_shared.py of gpu-sidecar.

It runs inside the app's processes, on the app's Python, where no ``sidecar`` package may be
installed: Python 3.9+, the standard library only, nothing of gpu-sidecar imported. Loading it
defines names and nothing more (``socket``, ``random`` and ``json`` are imported at first use: a
process that never publishes never loads them); nothing here prints or keeps a thread.

The datagrams themselves (Contract 2, ``sidecar.protocol``'s docstring) are encoded here, once
for both publishers: ``sidecar.client`` and the injected publisher call the functions below, so
the two cannot send the same figures differently. ``sidecar.protocol`` keeps an encoder of its
own (``encode``, ``split_round``: the agent's tests and simulator) because it must import alone
(docs/client.md); tests/test_app_encoder.py holds the two to the same bytes.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import socket
    from collections.abc import Iterable, Mapping, Sequence

# sidecar.client's thread: where it runs, the app publishes itself and the injected publisher
# stands down (one publisher per process)
PUBLISHER_THREAD = "gpu-sidecar-publisher"
# the kernel queues only net.unix.max_dgram_qlen (10 by default) datagrams per receiver: the
# publisher's own thread (never an app thread) tries a full queue this many times more
SEND_PATIENCE = 3
SEND_PAUSE_S = 0.002
VISIBLE_VARIABLES = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
_UUID_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ/-")

# Contract 2's format version and allocator fields, as sidecar.protocol's (which imports alone,
# so cannot take them from here; tests/test_app_encoder.py holds them equal)
VERSION = 1
ALLOCATOR_REQUIRED = (
    "reserved_bytes",
    "allocated_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "alloc_retries",
    "ooms",
)
ALLOCATOR_OPTIONAL = ("largest_free_block_bytes", "private_pool_bytes")
_REQUIRED_MEMBERS = "".join(f',"{name}":%d' for name in ALLOCATOR_REQUIRED).encode()
_OPTIONAL_MEMBERS = tuple((name, f',"{name}":%d'.encode()) for name in ALLOCATOR_OPTIONAL)


def allocator_figures(stats: Mapping[str, Any]) -> dict[str, int]:
    """The figures the agent wants, from ``torch.cuda.memory_stats(device)`` (``{}`` where CUDA
    is not initialised: every figure 0)."""

    def get(key: str) -> int:
        return int(stats.get(key, 0) or 0)

    return {
        "reserved_bytes": get("reserved_bytes.all.current"),
        "allocated_bytes": get("allocated_bytes.all.current"),
        "active_bytes": get("active_bytes.all.current"),
        "inactive_split_bytes": get("inactive_split_bytes.all.current"),
        "alloc_retries": get("num_alloc_retries"),
        "ooms": get("num_ooms"),
    }


def snapshot_figures(segments: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, int]]:
    """Per device index, from ``torch.cuda.memory_snapshot()``: the largest inactive block (the
    biggest request the cache can serve without cudaMalloc) and the bytes held by private pools
    (CUDA graphs: ``segment_pool_id`` other than (0, 0))."""
    out: dict[int, dict[str, int]] = {}
    for seg in segments:
        fig = out.setdefault(int(seg.get("device", 0)),
                             {"largest_free_block_bytes": 0, "private_pool_bytes": 0})
        pool = tuple(seg.get("segment_pool_id") or (0, 0))
        if pool != (0, 0):
            fig["private_pool_bytes"] += int(seg.get("total_size", 0))
        for block in seg.get("blocks", ()):
            if block.get("state") == "inactive":
                size = int(block.get("size", 0))
                if size > fig["largest_free_block_bytes"]:
                    fig["largest_free_block_bytes"] = size
    return out


def memory_snapshot(cuda: Any) -> list[Any]:
    """``torch.cuda.memory_snapshot()`` without the stack traces (they can be large), where the
    release of torch lets them be left out."""
    try:
        return cuda.memory_snapshot(include_traces=False)
    except TypeError:  # an older torch: no include_traces
        return cuda.memory_snapshot()


def uuid_text(raw: object, visible: str | None = None) -> str | None:
    """``GPU-...`` or ``MIG-...`` from ``get_device_properties(i).uuid`` (torch prints the bare
    UUID); a MIG instance named so in ``visible`` (by default CUDA_VISIBLE_DEVICES and
    NVIDIA_VISIBLE_DEVICES) keeps its prefix. None if it cannot be a UUID the agent accepts."""
    if visible is None:
        visible = ",".join(os.environ.get(v, "") for v in VISIBLE_VARIABLES)
    text = str(raw).strip()
    if not text.startswith(("GPU-", "MIG-")):
        text = ("MIG-" if "MIG-" + text in visible.replace(" ", "").split(",") else "GPU-") + text
    body = text[4:]
    if not 4 <= len(body) <= 96 or not body[0].isalnum() or not set(body) <= _UUID_CHARS:
        return None
    return text


def jittered(interval_s: float) -> float:
    """The interval +-10 %: workers started (or forked) together must not all publish in the
    same instant."""
    import random

    return interval_s * random.uniform(0.9, 1.1)


class Sender:
    """A non-blocking datagram socket connected to the agent, connected again when the agent
    comes back. A send never blocks and never raises: what cannot be sent is counted."""

    RECONNECT_EVERY_S = 1.0

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock: socket.socket | None = None
        self.next_try = 0.0
        self.connected = 0  # connections made: a new one is a new agent, maybe
        self.sent = 0
        self.dropped = 0

    def _connect(self) -> socket.socket | None:
        now = time.monotonic()
        if now < self.next_try:
            return None
        self.next_try = now + self.RECONNECT_EVERY_S
        import socket

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            return None
        self.sock = sock
        self.connected += 1
        return sock

    def send(self, data: bytes, patience: int = 0) -> bool:
        """Send ``data`` now; False (and counted) when it could not be. ``patience`` > 0 (a
        publisher's own thread only, never the app's threads) tries a full queue that many times
        more, ``SEND_PAUSE_S`` apart."""
        sock = self.sock or self._connect()
        if sock is None:
            self.dropped += 1
            return False
        while True:
            try:
                sock.send(data)
            except BlockingIOError:  # the agent is slow: its receive queue is full
                if patience > 0:
                    patience -= 1
                    time.sleep(SEND_PAUSE_S)
                    continue
            except OSError:  # the agent went away or restarted: connect again later
                self.close()
            else:
                self.sent += 1
                return True
            self.dropped += 1
            return False

    def close(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
            self.sock = None


# -- the datagrams: one JSON object each, compact, as json.dumps(separators=(",", ":")) writes it


def _json(value: Any) -> bytes:
    import json

    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


_required = operator.itemgetter(*ALLOCATOR_REQUIRED)


@functools.lru_cache(maxsize=256)
def _gpu_member(gpu: str) -> bytes:
    return b'"gpu":' + _json(gpu)


def _head(kind: str, pid: int) -> bytes:
    return b'{"v":%d,"kind":"%s","pid":%d' % (VERSION, kind.encode(), pid)


def allocator_object(figures: Mapping[str, Any]) -> bytes:
    """One allocator's ``gpu`` and figures as a JSON object: the required figures, then the
    optional ones that are not None, in the order of ``ALLOCATOR_REQUIRED`` and
    ``ALLOCATOR_OPTIONAL``. The figures are integers (Contract 2), formatted directly (what json
    writes for an integer): a publish costs about one send."""
    members = _REQUIRED_MEMBERS % _required(figures)
    for name, member in _OPTIONAL_MEMBERS:
        value = figures.get(name)
        if value is not None:
            members += member % value
    return b"{" + _gpu_member(figures["gpu"]) + members + b"}"


def latency_object(histogram: Mapping[str, Any]) -> bytes:
    """One latency histogram (``gpu``, ``bounds``, ``counts``, ``sum``) as a JSON object."""
    return _json({"gpu": histogram["gpu"], "bounds": list(histogram["bounds"]),
                  "counts": list(histogram["counts"]), "sum": histogram["sum"]})


def hello_datagram(pid: int, gpus: Iterable[str], publisher: str | None = None) -> bytes:
    """The hello: the GPUs the process uses and, when given, what publishes (name/version)."""
    tail = b',"publisher":' + _json(publisher) if publisher is not None else b""
    return _head("hello", pid) + b',"gpus":' + _json(list(gpus)) + tail + b"}"


def allocator_datagram(pid: int, figures: Mapping[str, Any]) -> bytes:
    """The single allocator message (``figures`` as for ``allocator_object``)."""
    return _head("allocator", pid) + b"," + allocator_object(figures)[1:]


def _round(pid: int, gpus: Iterable[str], allocators: Iterable[bytes],
           latency: Iterable[bytes] | None) -> bytes:
    tail = b',"latency":[' + b",".join(latency) + b"]" if latency is not None else b""
    return (_head("round", pid) + b',"gpus":' + _json(list(gpus)) + b',"allocators":['
            + b",".join(allocators) + b"]" + tail + b"}")


def round_datagrams(pid: int, gpus: Sequence[str], allocators: Sequence[Mapping[str, Any]],
                    latency: Sequence[Mapping[str, Any]] | None = None, *,
                    max_bytes: int) -> list[bytes]:
    """A publish round: one datagram, or as few as fit ``max_bytes`` when it does not, each
    carrying whole GPUs (a GPU's figures are never split) and naming only its own GPUs in
    ``gpus`` (the first also those without figures), so the UUID list is not repeated.
    ``latency`` None leaves the list out (the injected publisher times no requests; an agent
    reads no list as an empty one). ``max_bytes`` is the protocol's ``MAX_MESSAGE_BYTES``, which
    each publisher passes (the agent writes it into the injected one). Raises ValueError where
    one GPU's figures alone exceed ``max_bytes``."""
    objects = [(a["gpu"], allocator_object(a)) for a in allocators]
    timed = None if latency is None else [(h["gpu"], latency_object(h)) for h in latency]

    def part(names: Sequence[str]) -> bytes:
        return _round(pid, names, [o for g, o in objects if g in names],
                      None if timed is None else [o for g, o in timed if g in names])

    whole = _round(pid, gpus, [o for _, o in objects], None if timed is None else
                   [o for _, o in timed])
    if len(whole) <= max_bytes:
        return [whole]
    order = list(dict.fromkeys([*(g for g, _ in objects), *(g for g, _ in timed or ())]))
    bare = [g for g in gpus if g not in order]
    out: list[bytes] = []
    if bare and (not order or len(part([*bare, order[0]])) > max_bytes):
        out.append(_fits(part(bare), "the GPU list", max_bytes))  # on its own
        bare = []
    taken: list[str] = []
    last = b""
    for gpu in order:  # greedy: add GPUs while the part still fits
        trial = part([*(bare if not out else ()), *taken, gpu])
        if len(trial) <= max_bytes:
            taken.append(gpu)
            last = trial
            continue
        if not taken:
            raise ValueError(f"the figures of {gpu} alone exceed {max_bytes} bytes")
        out.append(last)
        taken, last = [gpu], _fits(part([gpu]), f"the figures of {gpu}", max_bytes)
    if last:
        out.append(last)
    return out


def _fits(data: bytes, what: str, max_bytes: int) -> bytes:
    if len(data) > max_bytes:
        raise ValueError(f"{what} alone exceed {max_bytes} bytes")
    return data
