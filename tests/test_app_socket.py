"""The app socket (Contract 2): every datagram validated alone, bad ones counted by reason."""

from __future__ import annotations

import itertools
import json
import os
import socket
import stat
from pathlib import Path

import pytest

from sidecar import protocol
from sidecar.config import Config
from sidecar.sources.app_socket import (
    AppSocket,
    AppState,
    SocketInUse,
    SocketUnavailable,
    bind_datagram,
)
from tests.conftest import send_datagram
from tests.manual_clock import ManualClock
from tests.waiting import until

GPU = "GPU-0c4b24ac-fb68-413f-6f0c-54be2b5a94c7"
OTHER = "GPU-18f9fd34-4f90-8419-eed6-00c6bc203962"
GiB = 1024**3


def alloc(pid: int = 100, gpu: str = GPU, **kw) -> dict:
    body = {"v": 1, "kind": "allocator", "pid": pid, "gpu": gpu, "reserved_bytes": 10 * GiB,
            "allocated_bytes": 4 * GiB, "active_bytes": 4 * GiB,
            "inactive_split_bytes": 1 * GiB, "alloc_retries": 3, "ooms": 0}
    body.update(kw)
    return body


def latency(pid: int = 100, counts=(1, 5, 7), total: float = 0.5, bounds=(0.1, 0.2)) -> dict:
    return {"v": 1, "kind": "latency", "pid": pid, "gpu": GPU, "bounds": list(bounds),
            "counts": list(counts), "sum": total}


def raw(body: dict) -> bytes:
    return json.dumps(body).encode()


def test_encode_then_decode_gives_back_the_same_message():
    messages = [
        protocol.Hello(7, (GPU, OTHER)),
        protocol.Allocator(7, GPU, 10, 5, 5, 1, 2, 0, largest_free_block_bytes=3,
                           private_pool_bytes=1),
        protocol.Latency(7, GPU, (0.1, 0.5), (1, 2, 3), 0.75),
    ]
    for m in messages:
        assert protocol.decode(protocol.encode(m)) == m


HOSTILE = [
    (b"\xff\xfe not utf-8", "not_json"),
    (b"{not json", "not_json"),
    (b"[" * 4000 + b"]" * 4000, "not_json"),                 # recursion bomb
    (b'{"v": 1, "kind": "allocator", "pid": ' + b"9" * 5000 + b"}", "not_json"),  # 5000-digit int
    (b"[1, 2]", "not_object"),
    (b'"allocator"', "not_object"),
    (raw({"kind": "hello", "pid": 1, "gpus": [GPU]}), "bad_version"),
    (raw({"v": 2, "kind": "hello", "pid": 1, "gpus": [GPU]}), "bad_version"),
    (raw({"v": "1", "kind": "hello", "pid": 1, "gpus": [GPU]}), "bad_version"),
    (raw({"v": 1, "kind": "shell", "pid": 1}), "bad_kind"),
    (raw({**alloc(), "extra": 1}), "unknown_field"),
    (raw({k: v for k, v in alloc().items() if k != "ooms"}), "missing_field"),
    (raw(alloc(reserved_bytes="10")), "bad_type"),
    (raw(alloc(reserved_bytes=10.5)), "bad_type"),
    (raw(alloc(ooms=True)), "bad_type"),
    (raw(alloc(reserved_bytes=-1)), "out_of_range"),
    (raw(alloc(reserved_bytes=2**60)), "out_of_range"),
    (raw(alloc(pid=0)), "out_of_range"),
    (raw(alloc(allocated_bytes=11 * GiB)), "inconsistent"),
    (raw(alloc(gpu="../../etc/passwd")), "bad_uuid"),
    (raw(alloc(gpu=123)), "bad_uuid"),
    (b'{"v": 1, "kind": "latency", "pid": 1, "gpu": "' + GPU.encode()
     + b'", "bounds": [0.1], "counts": [1, 2], "sum": NaN}', "bad_number"),
    (b'{"v": 1, "kind": "latency", "pid": 1, "gpu": "' + GPU.encode()
     + b'", "bounds": [Infinity], "counts": [1, 2], "sum": 1}', "bad_number"),
    (raw(latency(counts=(5, 1, 7))), "inconsistent"),
    (raw(latency(counts=(1, 2))), "bad_type"),
    (raw(latency(bounds=(0.2, 0.1))), "out_of_range"),
    (raw(latency(bounds=(0.0, 0.1))), "out_of_range"),
    (raw(latency(total=-1)), "out_of_range"),
    (raw({"v": 1, "kind": "hello", "pid": 1, "gpus": []}), "bad_type"),
    (raw({"v": 1, "kind": "hello", "pid": 1, "gpus": [GPU] * 65}), "bad_type"),
    (b"x" * (protocol.MAX_MESSAGE_BYTES + 1), "too_large"),
]


@pytest.mark.parametrize(("data", "reason"), HOSTILE, ids=[f"{i}-{r}" for i, (_, r) in enumerate(HOSTILE)])
def test_malformed_and_hostile_messages_are_rejected_with_their_reason(data, reason):
    with pytest.raises(protocol.Rejected) as err:
        protocol.decode(data)
    assert err.value.reason == reason
    assert str(err.value)  # says what was wrong


def test_message_for_a_gpu_not_on_this_node_is_rejected():
    state = AppState(known_gpu={GPU}.__contains__)
    assert state.feed(raw(alloc(gpu=OTHER))) is None
    assert state.rejected == {"unknown_gpu": 1}
    assert state.announced() == []


def test_allocator_figures_are_kept_per_process_and_expire_when_the_app_goes_quiet():
    clock = ManualClock()
    state = AppState(stale_after_s=30, clock=clock)
    state.feed(raw(alloc(pid=100)))
    state.feed(raw(alloc(pid=200, allocated_bytes=9 * GiB, active_bytes=9 * GiB)))
    figs = state.figures(GPU)
    assert [a.pid for a in figs.allocators] == [100, 200]
    assert figs.allocators[1].allocated_bytes == 9 * GiB
    clock.advance(20)
    state.feed(raw(alloc(pid=200)))
    clock.advance(15)  # pid 100 last spoke 35 s ago: stale; pid 200 15 s ago
    assert [a.pid for a in state.figures(GPU).allocators] == [200]
    clock.advance(20)
    assert state.figures(GPU).allocators == ()
    assert state.announced() == []  # silent past --app-stale-after: the GPU is forgotten too


def test_latency_histograms_merge_across_processes_and_survive_a_restart():
    clock = ManualClock()
    state = AppState(clock=clock)
    state.feed(raw(latency(pid=1, counts=(1, 5, 7), total=1.0)))
    state.feed(raw(latency(pid=2, counts=(2, 2, 3), total=0.5)))
    h = state.figures(GPU).latency
    assert h.counts == (3, 7, 10) and h.sum_seconds == 1.5
    state.feed(raw(latency(pid=1, counts=(2, 6, 9), total=1.25)))  # +1, +1, +2
    assert state.figures(GPU).latency.counts == (4, 8, 12)
    state.feed(raw(latency(pid=2, counts=(1, 1, 1), total=0.1)))  # pid 2 restarted: counts afresh
    h = state.figures(GPU).latency
    assert h.counts == (5, 9, 13) and h.sum_seconds == pytest.approx(1.85)
    assert h.bounds == (0.1, 0.2)


def test_a_redeploy_with_other_buckets_restarts_the_histogram_and_old_layouts_are_refused():
    state = AppState()
    state.feed(raw(latency(pid=1)))
    assert state.figures(GPU).latency.counts == (1, 5, 7)
    # the new process of a redeploy, other buckets: taken, the histogram restarts from zero
    assert state.feed(raw(latency(pid=2, counts=(2, 3, 4, 4), bounds=(0.1, 0.3, 0.9)))) is not None
    h = state.figures(GPU).latency
    assert h.bounds == (0.1, 0.3, 0.9) and h.counts == (2, 3, 4, 4)
    # the old process, still alive on the old buckets, is refused: the layouts never alternate
    assert state.feed(raw(latency(pid=1, counts=(2, 6, 9)))) is None
    assert state.rejected == {"bucket_mismatch": 1}
    assert state.feed(raw(latency(pid=2, counts=(3, 4, 5, 6), bounds=(0.1, 0.3, 0.9))))
    assert state.figures(GPU).latency.counts == (3, 4, 5, 6)


def test_a_round_carries_every_gpu_of_a_process_in_one_datagram_and_is_kept_whole_or_not():
    other = "GPU-22222222-3333-4444-5555-666666666666"
    state = AppState(known_gpu={GPU, other}.__contains__)
    body = {"v": 1, "kind": "round", "pid": 9, "gpus": [GPU, other],
            "allocators": [{k: v for k, v in alloc(gpu=g).items() if k not in ("v", "kind", "pid")}
                           for g in (GPU, other)],
            "latency": [{k: v for k, v in latency(pid=9).items() if k not in ("v", "kind", "pid")}]}
    assert state.feed(raw(body)) is not None
    assert set(state.announced()) == {GPU, other}
    assert state.figures(other).allocators[0].pid == 9
    assert state.figures(GPU).latency.counts == (1, 5, 7)
    stranger = "GPU-99999999-3333-4444-5555-666666666666"  # not on this node
    bad = {**body, "pid": 10, "gpus": [GPU, stranger]}
    assert state.feed(raw(bad)) is None and state.rejected == {"unknown_gpu": 1}
    assert all(a.pid == 9 for a in state.figures(GPU).allocators)  # nothing of it was kept


def test_a_round_too_large_for_one_datagram_is_split_into_whole_gpus():
    gpus = [f"GPU-{i:08d}-3333-4444-5555-666666666666" for i in range(40)]
    message = protocol.Round(
        5, tuple(gpus),
        tuple(protocol.Allocator(5, g, 100, 50, 50, 10, 1, 0, 40, 0) for g in gpus),
        tuple(protocol.Latency(5, g, protocol.DEFAULT_LATENCY_BOUNDS,
                               tuple(range(len(protocol.DEFAULT_LATENCY_BOUNDS) + 1)), 1.5)
              for g in gpus))
    data = protocol.split_round(message)
    parts = [protocol.decode(d) for d in data]
    assert len(parts) > 1 and all(len(d) <= protocol.MAX_MESSAGE_BYTES for d in data)
    # as few datagrams as whole GPUs allow: no two neighbours would have fitted in one
    assert all(len(a) + len(b) > protocol.MAX_MESSAGE_BYTES for a, b in itertools.pairwise(data))
    assert sorted(a.gpu for p in parts for a in p.allocators) == sorted(gpus)
    assert sorted(h.gpu for p in parts for h in p.latency) == sorted(gpus)
    for p in parts:  # a GPU's figures are never split, and each part names only its GPUs
        assert {a.gpu for a in p.allocators} == {h.gpu for h in p.latency} == set(p.gpus)


@pytest.mark.parametrize("uuid", [GPU + "\n", "GPU-abcd\n", GPU + "\r", " " + GPU, GPU + '"'])
def test_a_uuid_with_anything_around_it_never_reaches_a_label(uuid):
    state = AppState()
    assert state.feed(raw({"v": 1, "kind": "hello", "pid": 3, "gpus": [uuid]})) is None
    assert state.rejected == {"bad_uuid": 1} and state.announced() == []


def test_per_process_state_is_bounded():
    clock = ManualClock()
    state = AppState(clock=clock, stale_after_s=30)
    for pid in range(1, Config.app_max_processes + 1):
        state.feed(raw(alloc(pid=pid)))
    assert state.feed(raw(alloc(pid=99_999))) is None
    assert state.rejected == {"too_many_processes": 1}
    clock.advance(31)  # all silent now: the oldest make room
    assert state.feed(raw(alloc(pid=99_999))) is not None


@pytest.fixture
def sock_path(tmp_path):
    return str(tmp_path / "run" / "app.sock")


def test_real_socket_keeps_valid_messages_around_bad_ones(sock_path):
    state = AppState()
    app = AppSocket(sock_path, state)
    app.start()
    try:
        send_datagram(sock_path, raw({"v": 1, "kind": "hello", "pid": 5, "gpus": [GPU]}))
        send_datagram(sock_path, b"\x00garbage")
        send_datagram(sock_path, raw(alloc(pid=5)))
        send_datagram(sock_path, b"{" * 70_000)  # oversized: the kernel truncates, we notice
        send_datagram(sock_path, raw(latency(pid=5)))
        send_datagram(sock_path, raw(alloc(pid=5, ooms=-1)))
        until(lambda: state.accepted + sum(state.rejected.values()) >= 6, 30, interval=0.01,
              what="the 6 datagrams to be read")
        assert state.accepted == 3
        assert state.rejected == {"not_json": 1, "too_large": 1, "out_of_range": 1}
        figs = state.figures(GPU)
        assert figs.allocators[0].pid == 5 and figs.latency is not None
    finally:
        app.stop()
    assert not os.path.exists(sock_path)


def test_socket_is_mode_0660_in_a_directory_closed_to_others(sock_path):
    app = AppSocket(sock_path, AppState())
    app.start()
    try:
        assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o660
        assert stat.S_IMODE(os.stat(os.path.dirname(sock_path)).st_mode) & 0o007 == 0
    finally:
        app.stop()


def test_stale_socket_file_is_replaced(sock_path):
    os.makedirs(os.path.dirname(sock_path))
    old = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    old.bind(sock_path)
    old.close()  # the file stays, nobody listens: what a killed sidecar leaves
    sock = bind_datagram(sock_path)
    sock.close()


def test_live_socket_of_another_process_is_not_stolen(sock_path):
    first = bind_datagram(sock_path)
    try:
        with pytest.raises(SocketInUse, match="another process is listening"):
            bind_datagram(sock_path)
    finally:
        first.close()


def test_regular_file_at_the_socket_path_is_an_error_not_deleted(sock_path):
    os.makedirs(os.path.dirname(sock_path))
    with open(sock_path, "w") as f:
        f.write("precious")
    with pytest.raises(SocketUnavailable, match="not a socket"):
        bind_datagram(sock_path)
    assert Path(sock_path).read_text() == "precious"


def test_eight_processes_on_eight_gpus_publishing_at_once_lose_no_round(tmp_path):
    """The kernel queues 10 datagrams per socket: a round of 8 GPUs as 17 messages from each of
    8 processes (136 at once) overflowed it; as one datagram each (8 at once) nothing is lost."""
    gpus = tuple(f"GPU-{i:08d}-3333-4444-5555-666666666666" for i in range(8))
    state = AppState()
    app_socket = AppSocket(str(tmp_path / "app.sock"), state)
    app_socket.start()
    senders = [socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(8)]
    refused = 0
    try:
        for s in senders:
            s.setblocking(False)
        for round_no in range(20):
            for pid, s in enumerate(senders, start=1000):
                message = protocol.Round(
                    pid, gpus,
                    tuple(protocol.Allocator(pid, g, 64 << 30, 20 << 30, 20 << 30, 1 << 30,
                                             round_no, 0) for g in gpus),
                    tuple(protocol.Latency(pid, g, protocol.DEFAULT_LATENCY_BOUNDS,
                                           (round_no,) * 16, 0.5 * round_no) for g in gpus))
                (data,) = protocol.split_round(message)
                try:
                    s.sendto(data, app_socket.path)
                except BlockingIOError:
                    refused += 1
            # the next round once this one is read, as rounds come seconds apart
            if refused:
                break
            read = 8 * (round_no + 1)
            until(lambda read=read: state.accepted + sum(state.rejected.values()) >= read, 30,
                  interval=0.005, what=f"round {round_no} to be read")
    finally:
        for s in senders:
            s.close()
        app_socket.stop()
    assert refused == 0 and state.accepted == 160 and not state.rejected
    assert all(len(state.figures(g).allocators) == 8 for g in gpus)


def test_retries_and_ooms_are_counters_of_the_gpu_that_survive_process_restarts():
    state = AppState()
    state.feed(raw(alloc(pid=1, alloc_retries=5, ooms=1)))
    state.feed(raw(alloc(pid=2, alloc_retries=2, ooms=0)))
    f = state.figures(GPU)
    assert (f.alloc_retries, f.ooms) == (7, 1)
    state.feed(raw(alloc(pid=1, alloc_retries=6, ooms=1)))  # +1
    state.feed(raw(alloc(pid=2, alloc_retries=1, ooms=0)))  # pid 2 restarted: its 1 is new
    f = state.figures(GPU)
    assert (f.alloc_retries, f.ooms) == (9, 1) and len(f.allocators) == 2


def test_a_gpu_the_app_stops_naming_is_forgotten_with_what_was_kept_for_it():
    clock = ManualClock()
    state = AppState(stale_after_s=30, clock=clock)
    state.feed(raw(alloc(pid=1)))
    state.feed(raw(latency(pid=1)))
    assert state.announced() == [GPU]
    clock.advance(31.0)
    assert state.announced() == [] and state.all_figures() == {}
    state.feed(raw(alloc(pid=1)))  # back: counted afresh, as a restart
    assert state.announced() == [GPU] and state.figures(GPU).alloc_retries == 3


def test_the_bounds_are_options_and_say_which_option_to_raise():
    state = AppState(max_processes=2, max_gpus=1)
    other = "GPU-22222222-3333-4444-5555-666666666666"
    for pid in (1, 2, 3):
        state.feed(raw(alloc(pid=pid)))
    state.feed(raw(alloc(gpu=other)))
    assert state.rejected == {"too_many_processes": 1, "too_many_gpus": 1}
    assert len(state.figures(GPU).allocators) == 2


def test_bucket_count_and_message_size_are_bounds_with_their_own_reasons(sock_path):
    state = AppState(max_buckets=2, max_message_bytes=1024)
    assert state.feed(raw(latency(pid=1))) is not None  # 2 bounds: at the limit
    assert state.feed(raw(latency(pid=2, bounds=(0.1, 0.2, 0.3), counts=(1, 2, 3, 4)))) is None
    padded = raw(alloc(pid=3)) + b" " * 1024  # valid JSON, too large for this agent
    assert state.feed(padded) is None
    assert state.rejected == {"too_many_buckets": 1, "too_large": 1}
    # the socket's own receive buffer follows the option: a datagram one byte over is refused
    app = AppSocket(sock_path, state)
    app.start()
    try:
        body = raw(alloc(pid=4))
        send_datagram(sock_path, body + b" " * (1025 - len(body)))
        send_datagram(sock_path, body + b" " * (1024 - len(body)))
        until(lambda: state.accepted + state.rejected["too_large"] >= 4, 30, interval=0.01,
              what="the 4 datagrams to be read")
        assert state.accepted == 2 and state.rejected["too_large"] == 2
    finally:
        app.stop()


def test_a_round_refused_for_a_full_gpu_keeps_nothing_of_its_other_gpus():
    other = "GPU-22222222-3333-4444-5555-666666666666"
    state = AppState(max_processes=1)
    state.feed(raw(alloc(pid=1, gpu=other)))  # `other` is full
    part = {k: v for k, v in alloc().items() if k not in ("v", "kind", "pid")}
    body = {"v": 1, "kind": "round", "pid": 2, "gpus": [GPU, other],
            "allocators": [part, {**part, "gpu": other}], "latency": []}
    assert state.feed(raw(body)) is None and state.rejected == {"too_many_processes": 1}
    assert state.figures(GPU).allocators == ()  # GPU had room, yet nothing was kept there
    assert [a.pid for a in state.figures(other).allocators] == [1]


def test_a_round_refused_for_old_buckets_keeps_nothing_of_its_other_parts():
    state = AppState()
    state.feed(raw(latency(pid=1, bounds=(0.1, 0.2))))
    state.feed(raw(latency(pid=2, bounds=(0.5, 1.0))))  # a redeploy: pid 1 is on old buckets
    part = {k: v for k, v in alloc(gpu=OTHER, reserved_bytes=999, allocated_bytes=1,
                                   active_bytes=1, inactive_split_bytes=0).items()
            if k not in ("v", "kind", "pid")}
    old = {k: v for k, v in latency(pid=1, bounds=(0.1, 0.2)).items() if k not in ("v", "kind", "pid")}
    body = {"v": 1, "kind": "round", "pid": 1, "gpus": [OTHER, GPU], "allocators": [part],
            "latency": [old]}
    assert state.feed(raw(body)) is None and state.rejected == {"bucket_mismatch": 1}
    assert OTHER not in state.all_figures() and OTHER not in state.announced()


def test_refused_rounds_leave_no_state_behind():
    state = AppState(max_processes=1)
    state.feed(raw(alloc(pid=1)))  # GPU is full
    part = {k: v for k, v in alloc().items() if k not in ("v", "kind", "pid")}
    for i in range(200):  # each names a GPU never seen before next to the full one
        fresh = f"GPU-{i:08d}-3333-4444-5555-666666666666"
        body = {"v": 1, "kind": "round", "pid": 2, "gpus": [fresh, GPU],
                "allocators": [{**part, "gpu": fresh}, part], "latency": []}
        assert state.feed(raw(body)) is None
    assert state.rejected == {"too_many_processes": 200}
    assert state.announced() == [GPU]
    assert set(state._pids) == {GPU}  # the table did not grow with the refused GPUs


def test_a_process_is_listed_on_every_gpu_it_names_not_only_those_it_sent_figures_for():
    """status lists a process on each GPU it uses: a tensor-parallel server that named two GPUs
    and has timed no request yet, and one whose allocator figures are for one GPU of the two."""
    clock = ManualClock()
    state = AppState(clock=clock)
    state.feed(raw({"v": 1, "kind": "hello", "pid": 7, "gpus": [GPU, OTHER]}))
    part = {k: v for k, v in alloc().items() if k not in ("v", "kind", "pid")}
    state.feed(raw({"v": 1, "kind": "round", "pid": 8, "gpus": [OTHER, GPU],
                    "allocators": [part], "latency": []}))
    clock.advance(2.0)
    assert not state.rejected
    assert sorted((p["pid"], tuple(p["gpus"])) for p in state.processes()) == [
        (7, tuple(sorted((GPU, OTHER)))), (8, tuple(sorted((GPU, OTHER))))]
    # a process that only names a GPU takes one of its slots, as one that sends figures does
    full = AppState(max_processes=1)
    full.feed(raw(alloc(pid=1)))
    assert full.feed(raw({"v": 1, "kind": "hello", "pid": 2, "gpus": [GPU]})) is None
    assert full.rejected == {"too_many_processes": 1}
