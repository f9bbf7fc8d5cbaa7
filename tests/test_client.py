"""sidecar.client: the figures it derives, its histogram, and that it never hurts the app."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from sidecar import app_shared, protocol
from sidecar.client import Histogram, Publisher, allocator_figures, snapshot_figures
from tests.conftest import ROOT
from tests.waiting import until

GPU = "GPU-0c4b24ac-fb68-413f-6f0c-54be2b5a94c7"
MiB, GiB = 1 << 20, 1 << 30


def memory_stats(**over: int) -> dict[str, int]:
    """Shaped like torch.cuda.memory_stats(): flat 'name.pool.metric' keys plus counters."""
    stats: dict[str, int] = {}
    for name, current in (("allocated_bytes", 4 * GiB), ("reserved_bytes", 10 * GiB),
                          ("active_bytes", 5 * GiB), ("inactive_split_bytes", 1 * GiB),
                          ("requested_bytes", 4 * GiB - 3 * MiB)):
        for pool in ("all", "large_pool", "small_pool"):
            share = current if pool == "all" else current // 2
            stats[f"{name}.{pool}.current"] = share
            stats[f"{name}.{pool}.peak"] = share + MiB
            stats[f"{name}.{pool}.allocated"] = share * 3
            stats[f"{name}.{pool}.freed"] = share * 2
    stats.update({"num_alloc_retries": 3, "num_ooms": 1, "num_sync_all_streams": 0,
                  "num_device_alloc": 12, "num_device_free": 2, "max_split_size": -1})
    stats.update(over)
    return stats


def block(size: int, state: str) -> dict:
    return {"size": size, "requested_size": size, "address": 0, "state": state, "frames": []}


def segment(device: int, blocks: list[dict], pool: tuple[int, int] = (0, 0),
            expandable: bool = False) -> dict:
    total = sum(b["size"] for b in blocks)
    seg = {"device": device, "address": 0x7F0000000000, "total_size": total, "stream": 0,
           "segment_type": "large", "segment_pool_id": pool,
           "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
           "active_size": sum(b["size"] for b in blocks if b["state"] != "inactive"),
           "requested_size": 0, "blocks": blocks}
    if expandable:
        seg["is_expandable"] = True
    return seg


def test_allocator_figures_come_from_the_all_pool_current_values():
    assert allocator_figures(memory_stats()) == {
        "reserved_bytes": 10 * GiB, "allocated_bytes": 4 * GiB, "active_bytes": 5 * GiB,
        "inactive_split_bytes": 1 * GiB, "alloc_retries": 3, "ooms": 1}
    assert allocator_figures({})["reserved_bytes"] == 0  # CUDA not initialised: torch gives {}


def test_snapshot_gives_the_largest_inactive_block_per_device():
    segments = [
        segment(0, [block(20 * MiB, "active_allocated"), block(6 * MiB, "inactive"),
                    block(2 * MiB, "active_awaiting_free"), block(8 * MiB, "inactive")]),
        segment(0, [block(64 * MiB, "active_allocated")]),
        segment(1, [block(1 * MiB, "inactive")]),
    ]
    figs = snapshot_figures(segments)
    assert figs[0]["largest_free_block_bytes"] == 8 * MiB  # awaiting-free is not free yet
    assert figs[1]["largest_free_block_bytes"] == 1 * MiB
    assert figs[0]["private_pool_bytes"] == 0


def test_private_pools_of_cuda_graphs_are_counted_apart():
    segments = [segment(0, [block(32 * MiB, "active_allocated")], pool=(1, 0)),
                segment(0, [block(16 * MiB, "inactive")], pool=(2, 1)),
                segment(0, [block(4 * MiB, "inactive")])]
    figs = snapshot_figures(segments)
    assert figs[0]["private_pool_bytes"] == 48 * MiB
    # a free block inside a graph's private pool only serves that graph, but it is still cached
    # memory the process holds; the figure is the largest free block of the whole cache
    assert figs[0]["largest_free_block_bytes"] == 16 * MiB


def test_expandable_segments_are_read_like_any_other_segment():
    # with expandable_segments:True there is one growing segment per stream; its free tail is
    # an inactive block until empty_cache() unmaps it
    segments = [segment(0, [block(100 * MiB, "active_allocated"), block(2 * MiB, "inactive"),
                            block(50 * MiB, "active_allocated"), block(40 * MiB, "inactive")],
                        expandable=True)]
    figs = snapshot_figures(segments)
    assert figs[0]["largest_free_block_bytes"] == 40 * MiB


def test_uuids_from_device_properties_become_ones_the_agent_accepts(monkeypatch):
    """torch prints the bare UUID; both publishers name the device as the agent does (a MIG
    instance as the container's visible-devices variables name it)."""
    for name in app_shared.VISIBLE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    bare = "0c4b24ac-fb68-413f-6f0c-54be2b5a94c7"
    named = [app_shared.uuid_text(bare), app_shared.uuid_text(f" GPU-{bare} "),
             app_shared.uuid_text(bare, f"GPU-1234abcd, MIG-{bare}")]
    assert named == [f"GPU-{bare}", f"GPU-{bare}", f"MIG-{bare}"]
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", f"MIG-{bare}")
    assert app_shared.uuid_text(bare) == f"MIG-{bare}"  # read from the environment by default
    assert all(protocol.UUID_RE.match(u) for u in named)
    assert app_shared.uuid_text("not a uuid!") is None and app_shared.uuid_text("") is None
    assert app_shared.uuid_text("x" * 200) is None  # longer than the agent takes
    assert not protocol.UUID_RE.match("GPU-" + "x" * 200)


def test_histogram_buckets_are_upper_inclusive_cumulative_and_ignore_nonsense():
    h = Histogram((0.1, 0.2, 0.5))
    for v in (0.05, 0.1, 0.15, 0.2, 0.3, 9.0, -1.0, float("nan"), float("inf")):
        h.observe(v)
    counts, total = h.snapshot()
    assert counts == (2, 4, 5, 6)  # <=0.1, <=0.2, <=0.5, +Inf
    assert total == pytest.approx(0.05 + 0.1 + 0.15 + 0.2 + 0.3 + 9.0)
    assert h.ignored == 3


def test_histogram_is_exact_under_concurrent_observers_while_it_is_drained():
    h = Histogram((0.001, 1.0))
    done = threading.Event()

    def work() -> None:  # request handlers: a burst of observations between pauses
        for i in range(40_000):
            h.observe(0.5)
            if i % 1000 == 999:
                time.sleep(0.0005)

    def drainer() -> None:  # what the publisher thread does every quarter second
        while not done.is_set():
            h.drain()
            time.sleep(0.001)

    d = threading.Thread(target=drainer)
    d.start()
    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    d.join()
    counts, total = h.snapshot()
    assert counts == (0, 320_000, 320_000)
    assert total == pytest.approx(160_000)
    assert not h.overflowed and h.ignored == 0


def test_undrained_observations_are_bounded_and_the_loss_is_flagged():
    h = Histogram((1.0,))
    for _ in range(Histogram.PENDING_MAX + 10):
        h.observe(0.5)
    counts, _ = h.snapshot()
    assert counts == (Histogram.PENDING_MAX, Histogram.PENDING_MAX)
    assert h.overflowed
    h.observe("slow")  # a caller's bug is ignored and counted, never raised
    h.observe(None)
    assert h.snapshot()[0][-1] == Histogram.PENDING_MAX and h.ignored == 2


def test_bad_bounds_are_refused():
    for bounds in ((), (0.2, 0.1), (0.0, 1.0), tuple(range(1, 70))):
        with pytest.raises(ValueError):
            Histogram(bounds)


def test_client_messages_are_valid_protocol_messages(tmp_path):
    received = bind(tmp_path / "s.sock")
    pub = Publisher(str(tmp_path / "s.sock"), gpus=[GPU], use_torch=False)
    pub.observe(0.08)
    pub.observe(0.3)
    assert pub.send_allocator(GPU, reserved_bytes=10, allocated_bytes=4, inactive_split_bytes=1,
                              alloc_retries=2, largest_free_block_bytes=3, private_pool_bytes=5)
    pub.publish()
    messages = [protocol.decode(m) for m in drain(received)]
    pid = os.getpid()
    assert messages[0] == protocol.Allocator(pid, GPU, 10, 4, 4, 1, 2, 0, 3, 5)
    assert len(messages) == 2, "a publish round is one datagram"
    round_ = messages[1]
    assert isinstance(round_, protocol.Round) and round_.gpus == (GPU,)
    (latency,) = round_.latency
    assert latency.gpu == GPU and latency.counts[-1] == 2
    assert latency.bounds == protocol.DEFAULT_LATENCY_BOUNDS and latency.sum == pytest.approx(0.38)
    assert not pub.send_allocator('GPU-x"}', reserved_bytes=1, allocated_bytes=1)  # no raise


def bind(path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.settimeout(2)
    return s


def drain(sock: socket.socket, timeout: float = 0.3) -> list[bytes]:
    out = []
    sock.settimeout(timeout)
    while True:
        try:
            out.append(sock.recv(protocol.MAX_MESSAGE_BYTES + 1))
        except (TimeoutError, BlockingIOError):
            return out


def test_with_no_sidecar_messages_are_dropped_and_counted_never_raised(tmp_path):
    pub = Publisher(str(tmp_path / "nobody-here.sock"), gpus=[GPU], use_torch=False)
    worst = 0.0
    for _ in range(200):
        t = time.perf_counter()
        assert pub.send_allocator(GPU, reserved_bytes=1, allocated_bytes=1) is False
        pub.observe(0.1)
        worst = max(worst, time.perf_counter() - t)
    assert pub.dropped == 200 and pub.sent == 0 and pub.errors == 0
    assert worst < 0.05  # never waits for anything


def test_a_sidecar_that_stops_reading_makes_sends_drop_not_block(tmp_path):
    stalled = bind(tmp_path / "s.sock")  # bound, never read
    pub = Publisher(str(tmp_path / "s.sock"), gpus=[GPU], use_torch=False)
    worst = 0.0
    for _ in range(20_000):
        t = time.perf_counter()
        pub.send_allocator(GPU, reserved_bytes=1, allocated_bytes=1)
        worst = max(worst, time.perf_counter() - t)
    assert pub.sent > 0 and pub.dropped > 0
    assert pub.sent + pub.dropped == 20_000
    assert worst < 0.05
    stalled.close()


def test_the_publisher_reconnects_when_the_sidecar_comes_back(tmp_path, monkeypatch):
    monkeypatch.setattr(app_shared.Sender, "RECONNECT_EVERY_S", 0.05)
    path = tmp_path / "s.sock"
    pub = Publisher(str(path), gpus=[GPU], use_torch=False)
    assert not pub.send_allocator(GPU, reserved_bytes=1, allocated_bytes=1)
    first = bind(path)
    # sends fail until the next reconnect attempt is due, then reach the sidecar
    until(lambda: pub.send_allocator(GPU, reserved_bytes=2, allocated_bytes=1), 10,
          interval=0.01, what="a send through the socket that appeared")
    assert [protocol.decode(m).reserved_bytes for m in drain(first)][-1] == 2
    first.close()
    path.unlink()  # the sidecar restarts: a new socket at the same path
    second = bind(path)
    pub.send_allocator(GPU, reserved_bytes=3, allocated_bytes=1)  # fails on the stale socket
    until(lambda: pub.send_allocator(GPU, reserved_bytes=4, allocated_bytes=1), 10,
          interval=0.01, what="a send through the new socket")
    got = [protocol.decode(m).reserved_bytes for m in drain(second)]
    assert got[-1] == 4


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_worker_publishes_with_its_own_pid_socket_histogram_and_thread(tmp_path):
    received = bind(tmp_path / "s.sock")
    pub = Publisher(str(tmp_path / "s.sock"), gpus=[GPU], use_torch=False, interval_s=0.05)
    for _ in range(5):
        pub.observe(0.01)
    pub.start()
    until(lambda: pub.sent >= 1, 30, interval=0.01, what="a round of the parent's thread")
    child = os.fork()
    if child == 0:  # the worker: observe its own requests, let its thread publish, leave
        status = 1
        try:
            for _ in range(3):
                pub.observe(0.2)
            # two rounds sent after the observations: the second began after them
            sent = pub.sent
            deadline = time.monotonic() + 30
            while pub.sent < sent + 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            status = 0 if pub.sent >= sent + 2 else 3
        finally:
            os._exit(status)
    latest: dict[int, protocol.Latency] = {}

    def read() -> dict[int, protocol.Latency]:  # drained as it comes: the queue holds only 10
        for m in drain(received, timeout=0.01):
            msg = protocol.decode(m)
            if isinstance(msg, protocol.Round) and msg.latency:
                latest[msg.pid] = msg.latency[0]
        return latest

    try:
        until(lambda: child in read() and latest[child].counts[-1] == 3, 30, interval=0.01,
              what=lambda: f"a round of the child with its 3 requests (latest: {latest})")
    finally:
        _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child's thread did not publish"
    pub.stop()
    read()
    assert latest[child].counts[-1] == 3  # its own requests, not the parent's five
    assert latest[os.getpid()].counts[-1] == 5


def test_importing_and_using_the_client_prints_nothing_and_needs_no_gpu(tmp_path):
    code = (
        "from sidecar import client\n"
        "pub = client.start(gpus=['" + GPU + "'], interval_s=0.05)\n"
        "client.observe(0.1)\n"
        "with client.timer():\n    pass\n"
        "@client.timed\ndef f():\n    return 1\n"
        "f()\n"
        "import time\n"
        "deadline = time.monotonic() + 30\n"  # the thread tried to publish, twice, to no one
        "while pub.dropped < 2 and time.monotonic() < deadline:\n    time.sleep(0.01)\n"
        "assert pub.dropped >= 2, pub.dropped\n"
        "import sys; assert 'pynvml' not in sys.modules and 'structlog' not in sys.modules\n"
        "assert pub.histogram.snapshot()[0][-1] == 3, pub.histogram.snapshot()\n"
    )
    env = {**os.environ, "GPU_SIDECAR_SOCKET": str(tmp_path / "absent.sock")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""


class _Props:
    def __init__(self, uuid: str) -> None:
        self.uuid = uuid


class _FakeCuda:
    """Shaped like torch.cuda for two visible devices of which the process uses device 1."""

    def __init__(self) -> None:
        self.snapshots = 0
        self.retries = 3

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def current_device(self) -> int:
        return 1

    def device_count(self) -> int:
        return 2

    def memory_stats(self, index: int) -> dict:
        if index == 0:
            return memory_stats(**{"reserved_bytes.all.current": 0})  # never allocated on
        return memory_stats(num_alloc_retries=self.retries)

    def get_device_properties(self, index: int) -> _Props:
        return _Props(f"0c4b24ac-fb68-413f-6f0c-54be2b5a94c{index}")

    def memory_snapshot(self, include_traces: bool = True) -> list:
        self.snapshots += 1
        return [segment(1, [block(64 * MiB, "active_allocated"), block(8 * MiB, "inactive")]),
                segment(1, [block(32 * MiB, "active_allocated")], pool=(3, 0))]


def test_a_torch_process_reports_only_the_devices_it_uses_with_torchs_uuids(tmp_path,
                                                                              monkeypatch):
    fake_torch = type(sys)("torch")
    fake_torch.cuda = _FakeCuda()
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    received = bind(tmp_path / "s.sock")
    pub = Publisher(str(tmp_path / "s.sock"), snapshot_interval_s=60)
    pub.publish()
    (round_,) = [protocol.decode(m) for m in drain(received)]
    uuid = "GPU-0c4b24ac-fb68-413f-6f0c-54be2b5a94c1"
    assert round_.pid == os.getpid() and round_.gpus == (uuid,)
    (alloc,) = round_.allocators
    assert alloc.gpu == uuid and alloc.reserved_bytes == 10 * GiB and alloc.alloc_retries == 3
    assert alloc.largest_free_block_bytes == 8 * MiB and alloc.private_pool_bytes == 32 * MiB
    pub.publish()
    assert fake_torch.cuda.snapshots == 1  # not again within the snapshot interval...
    fake_torch.cuda.retries = 4
    pub.publish()
    assert fake_torch.cuda.snapshots == 2  # ...unless the retry counter moved


def test_a_process_that_never_initialised_cuda_is_left_alone(tmp_path, monkeypatch):
    cuda = _FakeCuda()
    cuda.is_initialized = lambda: False  # type: ignore[method-assign]
    cuda.memory_stats = None  # type: ignore[assignment]  # would fail if called
    fake_torch = type(sys)("torch")
    fake_torch.cuda = cuda
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    received = bind(tmp_path / "s.sock")
    pub = Publisher(str(tmp_path / "s.sock"))
    pub.publish()
    assert drain(received) == [] and pub.errors == 0
