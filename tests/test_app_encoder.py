"""One datagram encoder for the app's two publishers (sidecar.app_shared): sidecar.client and the
injected publisher send the same bytes for the same figures, and both send what
sidecar.protocol's own encoder (which must import alone, so keeps its own) would send."""

from __future__ import annotations

import os
import random
import socket
import sys
import types

import pytest

from sidecar import app_shared, protocol
from sidecar.client import Publisher
from tests.test_inject_placement import payload_module, rendered

GPUS = [f"GPU-{i:08x}-fb68-413f-6f0c-54be2b5a94c7" for i in range(64)]


def test_the_shared_encoder_speaks_the_protocol_s_version_and_fields():
    assert app_shared.VERSION == protocol.VERSION
    assert app_shared.ALLOCATOR_REQUIRED == protocol.ALLOCATOR_REQUIRED
    assert app_shared.ALLOCATOR_OPTIONAL == protocol.ALLOCATOR_OPTIONAL


def _allocator(rng: random.Random, pid: int, gpu: str) -> protocol.Allocator:
    reserved = rng.randint(0, 1 << 50)
    return protocol.Allocator(
        pid, gpu, reserved, rng.randint(0, reserved), rng.randint(0, reserved),
        rng.randint(0, reserved), rng.randint(0, 1 << 40), rng.randint(0, 1 << 20),
        rng.choice([None, rng.randint(0, reserved)]), rng.choice([None, rng.randint(0, reserved)]))


def _figures(a: protocol.Allocator) -> dict:
    return {"gpu": a.gpu, **{n: getattr(a, n)
                             for n in (*protocol.ALLOCATOR_REQUIRED, *protocol.ALLOCATOR_OPTIONAL)}}


@pytest.mark.parametrize("seed", range(40))
def test_the_shared_encoder_writes_the_bytes_protocol_encode_writes(seed):
    rng = random.Random(seed)
    pid = rng.randint(1, 1 << 22)
    gpus = rng.sample(GPUS, rng.randint(1, 64))
    a = _allocator(rng, pid, gpus[0])
    assert app_shared.allocator_datagram(pid, _figures(a)) == protocol.encode(a)
    publisher = rng.choice([None, "gpu-sidecar-inject/1.2.3"])
    assert app_shared.hello_datagram(pid, gpus, publisher) == \
        protocol.encode(protocol.Hello(pid, tuple(gpus), publisher))
    # a round, split where it is large: some GPUs without figures, some without latency
    bounds = tuple(sorted({round(rng.uniform(0.001, 10), 6) for _ in range(rng.randint(1, 64))}))
    counts = tuple(sorted(rng.randint(0, 1 << 40) for _ in range(len(bounds) + 1)))
    total = rng.uniform(0, 1e6)
    allocators = tuple(_allocator(rng, pid, g) for g in gpus if rng.random() < 0.7)
    latency = tuple(protocol.Latency(pid, g, bounds, counts, total) for g in gpus
                    if rng.random() < 0.5)
    expected = protocol.split_round(protocol.Round(pid, tuple(gpus), allocators, latency))
    assert app_shared.round_datagrams(
        pid, gpus, [_figures(x) for x in allocators],
        [{"gpu": h.gpu, "bounds": h.bounds, "counts": h.counts, "sum": h.sum} for h in latency],
        max_bytes=protocol.MAX_MESSAGE_BYTES) == expected


class _Props:
    def __init__(self, uuid: str) -> None:
        self.uuid = uuid


def _fake_cuda(figures: list[dict]) -> types.SimpleNamespace:
    """What both publishers read of torch.cuda: per device its memory_stats and a snapshot."""
    segments = [{"device": i, "segment_pool_id": (0, 1) if i else (0, 0), "total_size": 3 << 20,
                 "blocks": [{"state": "inactive", "size": (i + 1) << 20}]}
                for i in range(len(figures))]
    return types.SimpleNamespace(
        is_available=lambda: True, is_initialized=lambda: True, current_device=lambda: 0,
        device_count=lambda: len(figures), memory_stats=lambda i: figures[i],
        get_device_properties=lambda i: _Props(GPUS[i][4:]),  # torch prints the bare UUID
        memory_snapshot=lambda include_traces=True: segments)


def _received(server: socket.socket) -> list[bytes]:
    out = []
    while True:
        try:
            out.append(server.recv(1 << 16))
        except BlockingIOError:
            return out


def test_the_client_and_the_injected_publisher_send_the_same_round_for_the_same_figures(
        tmp_path, monkeypatch):
    stats = [{"reserved_bytes.all.current": (i + 2) << 30,
              "allocated_bytes.all.current": (i + 1) << 30,
              "active_bytes.all.current": (i + 1) << 30,
              "inactive_split_bytes.all.current": i << 20,
              "num_alloc_retries": i, "num_ooms": 0} for i in range(3)]
    cuda = _fake_cuda(stats)
    path = str(tmp_path / "app.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    server.setblocking(False)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))

    client = Publisher(path, use_torch=True)
    client.publish()
    (from_client,) = _received(server)

    injected = payload_module(rendered(tmp_path))._Injected()
    injected.sender = app_shared.Sender(path)
    injected.publish(cuda)
    hello, from_injected = _received(server)
    assert isinstance(protocol.decode(hello), protocol.Hello)

    round_ = protocol.decode(from_injected)
    assert isinstance(round_, protocol.Round) and round_.pid == os.getpid()
    assert [a.gpu for a in round_.allocators] == GPUS[:3]
    assert round_.allocators[1].largest_free_block_bytes == 2 << 20
    # byte for byte, but for the client's latency list (empty here: no request was timed),
    # which the injected publisher, timing no requests, leaves out
    assert from_client == from_injected[:-1] + b',"latency":[]}'
