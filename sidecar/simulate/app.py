"""A simulated model server that publishes through the real app socket.

It sends what a torch server's publisher would: a hello with its GPUs, allocator figures and a
cumulative latency histogram per GPU, as non-blocking datagrams that are dropped (and counted)
when nobody listens.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence

from sidecar import protocol
from sidecar.config import Config
from sidecar.simulate.scenarios import AppProfile

_Z99 = 2.3263478740408408  # standard normal quantile of 0.99


def lognormal_cdf(x: float, median: float, sigma: float) -> float:
    return 0.5 * (1 + math.erf((math.log(x) - math.log(median)) / (sigma * math.sqrt(2))))


def profile_messages(
    profile: AppProfile, gpu: str, pid: int, elapsed_s: float,
    bounds: Sequence[float] = protocol.DEFAULT_LATENCY_BOUNDS,
) -> tuple[protocol.Allocator, protocol.Latency]:
    """The allocator and latency messages the profile implies ``elapsed_s`` after start."""
    reserved = profile.reserved_bytes
    allocated = int(reserved * (1 - profile.fragmentation))
    free = reserved - allocated
    alloc = protocol.Allocator(
        pid=pid, gpu=gpu, reserved_bytes=reserved, allocated_bytes=allocated,
        active_bytes=allocated, inactive_split_bytes=int(reserved * profile.nonreleasable),
        alloc_retries=int(profile.retries_per_minute * elapsed_s / 60), ooms=0,
        largest_free_block_bytes=int(free * profile.largest_free_fraction),
    )
    total = int(profile.requests_per_second * elapsed_s)
    sigma = math.log(profile.latency_p99_s / profile.latency_median_s) / _Z99
    counts = [round(total * lognormal_cdf(b, profile.latency_median_s, sigma)) for b in bounds]
    mean = profile.latency_median_s * math.exp(sigma * sigma / 2)
    latency = protocol.Latency(pid=pid, gpu=gpu, bounds=tuple(bounds),
                               counts=(*counts, total), sum=round(total * mean, 6))
    return alloc, latency


class SimulatedApp:
    def __init__(
        self,
        path: str,
        gpus: Sequence[str],
        profile: AppProfile,
        *,
        interval_s: float = Config.interval,
        clock: Callable[[], float] = time.monotonic,
        warm_up_s: float = 600.0,
    ) -> None:
        self.path = path
        self.gpus = list(gpus)
        self.profile = profile
        self.interval_s = interval_s
        self.clock = clock
        self.pid = os.getpid()
        self.sent = 0
        self.dropped = 0
        # as if the server had been up for a while, so a first look shows real histograms
        self._start = clock() - warm_up_s
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self._thread = threading.Thread(target=self._loop, name="simulated-app", daemon=True)

    def send(self, data: bytes) -> None:
        try:
            self._sock.sendto(data, self.path)
            self.sent += 1
        except OSError:
            self.dropped += 1

    def publish(self) -> None:
        """One round, as the client sends it: every GPU in one datagram."""
        elapsed = self.clock() - self._start
        parts = [profile_messages(self.profile, gpu, self.pid, elapsed) for gpu in self.gpus]
        latencies = tuple(h for _, h in parts) if self.profile.publishes_latency else ()
        round_ = protocol.Round(self.pid, tuple(self.gpus), tuple(a for a, _ in parts), latencies)
        for data in protocol.split_round(round_):
            self.send(data)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.publish()
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()
