"""What the app socket promises: the fragmentation exported is the seed's figure,
(reserved - allocated) / reserved, whatever ``active_bytes`` says (a real datagram to a running
agent); and ``--app-max-gpus N`` takes exactly N GPUs and refuses, and counts, the next."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile

import pytest

from sidecar.sources.app_socket import AppState
from tests.promise_tools import Agent, until

GiB = 1024**3
GPU = "GPU-0c4b24ac-fb68-413f-6f0c-54be2b5a94c7"


@pytest.fixture
def sock_dir():
    # short: a Unix socket path holds at most 107 bytes, more than some tmp_path names leave
    path = tempfile.mkdtemp(prefix="gsp-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def allocator(**figures: int) -> bytes:
    body = {"v": 1, "kind": "allocator", "pid": 4242, "gpu": GPU, "reserved_bytes": 10 * GiB,
            "allocated_bytes": 4 * GiB, "active_bytes": 7 * GiB, "inactive_split_bytes": GiB,
            "alloc_retries": 0, "ooms": 0}
    body.update(figures)
    return json.dumps(body).encode()


def send(path: str, data: bytes) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(data, path)


def test_the_exported_fragmentation_is_reserved_minus_allocated_over_reserved_not_active(sock_dir):
    path = os.path.join(sock_dir, "app.sock")
    args = ["--no-nvml", "--gpus", GPU, "--socket", path, "--output", "json", "--interval", "0.2",
            "--app-process-series"]
    with Agent(args) as agent:
        until(lambda: os.path.exists(path) or not agent.alive(), 30,
              what=lambda: "the agent's socket\n" + agent.stderr_tail())
        assert agent.alive(), agent.stderr_tail()
        send(path, allocator())

        def exported() -> dict[str, float]:
            return {row["name"]: float(row["value"]) for row in agent.series()
                    if row["name"] in ("gpu_memory_fragmentation_ratio",
                                       "gpu_app_process_fragmentation_ratio",
                                       "gpu_allocator_allocated_bytes")}

        figures = until(lambda: len(exported()) == 3 and exported(), 30,
                        what=lambda: "the app's figures on stdout\n" + agent.stderr_tail())
    # (10 - 4) / 10, where active bytes would give (10 - 7) / 10
    assert figures["gpu_memory_fragmentation_ratio"] == pytest.approx(0.6)
    assert figures["gpu_app_process_fragmentation_ratio"] == pytest.approx(0.6)
    assert figures["gpu_allocator_allocated_bytes"] == 4 * GiB


def uuid(n: int) -> str:
    return f"GPU-{n:08x}-aaaa-bbbb-cccc-dddddddddddd"


def hello(*gpus: str, pid: int = 7) -> bytes:
    return json.dumps({"v": 1, "kind": "hello", "pid": pid, "gpus": list(gpus)}).encode()


@pytest.mark.parametrize("limit", [1, 3, 64])
def test_the_app_gpu_limit_takes_exactly_n_gpus_and_refuses_and_counts_the_next(limit):
    state = AppState(max_gpus=limit)
    for n in range(limit):  # one at a time, up to the limit
        assert state.feed(hello(uuid(n))) is not None, f"GPU {n + 1} of {limit} refused"
    assert not state.rejected and state.accepted == limit
    assert state.feed(hello(uuid(limit))) is None
    assert state.rejected == {"too_many_gpus": 1}
    assert sorted(state.announced()) == sorted(uuid(n) for n in range(limit))
    assert state.feed(hello(uuid(0))) is not None  # one already taken is still welcome


@pytest.mark.parametrize("limit", [1, 4])
def test_one_message_naming_exactly_the_limit_is_taken_and_one_more_is_refused_whole(limit):
    taken = AppState(max_gpus=limit)
    assert taken.feed(hello(*(uuid(n) for n in range(limit)))) is not None
    assert len(taken.announced()) == limit and not taken.rejected
    refused = AppState(max_gpus=limit)
    assert refused.feed(hello(*(uuid(n) for n in range(limit + 1)))) is None
    assert refused.rejected == {"too_many_gpus": 1} and refused.announced() == []
