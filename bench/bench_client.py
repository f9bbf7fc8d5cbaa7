"""Client benchmark: what sidecar.client costs the model server, as ratios in one run.

    .venv/bin/python bench/bench_client.py          # prints a Markdown report

1. ``observe()`` against the bare work it cannot avoid: ``bisect`` plus ``list[i] += 1``.
   Target: at most 2x.
2. One publish (``send_allocator``: format and send one message) against a bare
   ``socket.sendto`` of the same payload to the same listening socket. Target: at most 1.5x.
3. With no sidecar listening: a million ``observe()`` and a thousand publishes; the worst single
   call. Target: under 1 ms (nothing ever waits).
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
import time
from bisect import bisect_left

from _report import finish, heading

from sidecar import protocol
from sidecar.client import Publisher

GPU = "GPU-0c4b24ac-fb68-413f-6f0c-54be2b5a94c7"
N = 1_000_000



def per_call(fn, n: int, repeat: int = 5) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn(n)
        best = min(best, (time.perf_counter() - t) / n)
    return best


def observe_benchmark() -> dict:
    pub = Publisher("/nonexistent", gpus=[GPU], use_torch=False)
    observe = pub.observe
    bounds = list(protocol.DEFAULT_LATENCY_BOUNDS)
    counts = [0] * (len(bounds) + 1)
    values = [0.001 * (i % 997) for i in range(1000)]

    def bare(n: int) -> None:
        for i in range(n):
            counts[bisect_left(bounds, values[i % 1000])] += 1

    def ours(n: int) -> None:
        for i in range(n):
            observe(values[i % 1000])

    def loop_only(n: int) -> None:
        for i in range(n):
            values[i % 1000]

    empty = per_call(loop_only, N)
    b = per_call(bare, N) - empty
    o = per_call(ours, N) - empty
    return {"bare_ns": b * 1e9, "observe_ns": o * 1e9, "ratio": o / b}


def publish_benchmark() -> dict:
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "s.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    stop = threading.Event()

    def drain() -> None:  # a sidecar that keeps up
        server.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                server.recv(65536)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    pub = Publisher(path, gpus=[GPU], use_torch=False)
    figures = {"reserved_bytes": 64 << 30, "allocated_bytes": 22 << 30, "active_bytes": 23 << 30,
               "inactive_split_bytes": 9 << 30, "alloc_retries": 4, "ooms": 1,
               "largest_free_block_bytes": 1 << 28}
    payload = protocol.encode(protocol.Allocator(os.getpid(), GPU, **figures))
    bare_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    bare_sock.setblocking(False)

    def bare(n: int) -> None:
        for _ in range(n):
            try:
                bare_sock.sendto(payload, path)
            except BlockingIOError:
                time.sleep(0.0005)

    def ours(n: int) -> None:
        for _ in range(n):
            pub.send_allocator(GPU, **figures)

    b = per_call(bare, 20_000)
    o = per_call(ours, 20_000)
    stop.set()
    return {"bare_us": b * 1e6, "publish_us": o * 1e6, "ratio": o / b,
            "dropped_share": pub.dropped / max(1, pub.sent + pub.dropped)}


def absent_benchmark() -> dict:
    pub = Publisher(os.path.join(tempfile.mkdtemp(), "absent.sock"), gpus=[GPU], use_torch=False)
    worst_observe = worst_send = worst_round = 0.0
    observe = pub.observe
    drain_time = 0.0
    for i in range(N):
        t = time.perf_counter()
        observe(0.001 * (i % 500))
        d = time.perf_counter() - t
        if d > worst_observe:
            worst_observe = d
        if i % 100_000 == 99_999:  # what the publisher thread does every quarter second
            t = time.perf_counter()
            pub.histogram.drain()
            drain_time += time.perf_counter() - t
    for _ in range(1000):
        t = time.perf_counter()
        pub.send_allocator(GPU, reserved_bytes=1, allocated_bytes=1)
        worst_send = max(worst_send, time.perf_counter() - t)
        t = time.perf_counter()
        pub.publish()  # a whole round (hello + latency), as the publisher thread sends it
        worst_round = max(worst_round, time.perf_counter() - t)
    return {"worst_observe_ms": worst_observe * 1e3, "worst_send_ms": worst_send * 1e3,
            "worst_round_ms": worst_round * 1e3, "dropped": pub.dropped,
            "observed": pub.histogram.snapshot()[0][-1], "drain_ns": drain_time / N * 1e9}


def main() -> int:
    obs = observe_benchmark()
    pub = publish_benchmark()
    absent = absent_benchmark()
    ok = obs["ratio"] <= 2 and pub["ratio"] <= 1.5 and absent["worst_observe_ms"] < 1 and \
        absent["worst_send_ms"] < 1 and absent["worst_round_ms"] < 1
    lines = [
        heading("Client"),
        "",
        "| measure | client | baseline | ratio / limit |",
        "|---|---|---|---|",
        f"| `observe()` on the app's thread (loop overhead subtracted) | {obs['observe_ns']:.0f} "
        f"ns | bisect + `list[i] += 1`: {obs['bare_ns']:.0f} ns | {obs['ratio']:.2f}x (limit 2x) |",
        f"| counting one observation later, on the publisher thread (`drain`) | "
        f"{absent['drain_ns']:.0f} ns | - | off the request path |",
        f"| one publish (`send_allocator`) to a listening sidecar | {pub['publish_us']:.2f} us | "
        f"bare `sendto` of the same payload: {pub['bare_us']:.2f} us | {pub['ratio']:.2f}x "
        f"(limit 1.5x) |",
        f"| no sidecar: 1,000,000 `observe()`, 1,000 `send_allocator` and 1,000 publish rounds "
        f"| worst observe {absent['worst_observe_ms']:.3f} ms, worst send "
        f"{absent['worst_send_ms']:.3f} ms, worst round {absent['worst_round_ms']:.3f} ms | - | "
        f"limit 1 ms; {absent['dropped']} messages dropped and counted, {absent['observed']} "
        f"observations counted |",
    ]
    return finish(lines, ok)


if __name__ == "__main__":
    raise SystemExit(main())
