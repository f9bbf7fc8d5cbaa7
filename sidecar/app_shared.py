"""What the app's two publishers share: ``sidecar.client`` (the app imports it) and the injected
publisher (the agent places it in the socket volume). One source for both: the client imports
this module, and the agent places this file, byte for byte, beside the injected publisher as
``_gpu_sidecar_shared.py`` (``sidecar/inject/placement.py``), where that publisher loads it by
its path. Do not edit a placed copy: the source is sidecar/app_shared.py of gpu-sidecar.

It runs inside the app's processes, on the app's Python, where no ``sidecar`` package may be
installed: Python 3.9+, the standard library only, nothing of gpu-sidecar imported. Loading it
defines names and nothing more (``socket`` and ``random`` are imported at first use: a process
that never publishes never loads them); nothing here prints or keeps a thread.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import socket
    from collections.abc import Mapping, Sequence

# sidecar.client's thread: where it runs, the app publishes itself and the injected publisher
# stands down (one publisher per process)
PUBLISHER_THREAD = "gpu-sidecar-publisher"
# the kernel queues only net.unix.max_dgram_qlen (10 by default) datagrams per receiver: the
# publisher's own thread (never an app thread) tries a full queue this many times more
SEND_PATIENCE = 3
SEND_PAUSE_S = 0.002
VISIBLE_VARIABLES = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
_UUID_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ/-")


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
