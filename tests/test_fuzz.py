"""Fuzzing the app socket: anything an app (or an attacker in the pod) can send.

Property-based tests on the validator, and a seeded run of 100,000 datagrams through the real
socket, valid ones interleaved with every kind of malformed one: no crash, every malformed
message rejected and counted by reason, every valid one accepted.
"""

from __future__ import annotations

import json
import math
import random
import re
import socket

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sidecar import protocol
from sidecar.samples import AppFigures, GpuIdentity, GpuSample, sample_series
from sidecar.sources.app_socket import AppSocket, AppState
from tests.waiting import until

GPUS = ["GPU-0c4b24ac-fb68-413f-6f0c-54be2b5a94c7", "GPU-18f9fd34-4f90-8419-eed6-00c6bc203962"]
STRANGER = "GPU-99999999-9999-9999-9999-999999999999"
REASONS = {"too_large", "not_json", "not_object", "bad_version", "bad_kind", "unknown_field",
           "missing_field", "bad_type", "out_of_range", "inconsistent", "bad_uuid", "bad_number",
           "unknown_gpu", "bucket_mismatch", "too_many_processes", "too_many_gpus"}


@pytest.mark.slow
@settings(max_examples=3000, deadline=None)
@given(st.binary(max_size=protocol.MAX_MESSAGE_BYTES + 64))
def test_any_bytes_are_accepted_or_rejected_with_a_known_reason_never_raised(data):
    state = AppState(known_gpu=set(GPUS).__contains__)
    result = state.feed(data)
    if result is None:
        assert sum(state.rejected.values()) == 1 and set(state.rejected) <= REASONS
    else:
        assert state.accepted == 1


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=20,
)


@pytest.mark.slow
@settings(max_examples=2000, deadline=None)
@given(st.dictionaries(st.sampled_from(["v", "kind", "pid", "gpu", "gpus", "reserved_bytes",
                                        "allocated_bytes", "bounds", "counts", "sum", "x"]),
                       json_values, max_size=8))
def test_any_json_object_is_handled(body):
    state = AppState(known_gpu=set(GPUS).__contains__)
    state.feed(json.dumps(body).encode())
    assert state.accepted + sum(state.rejected.values()) == 1


valid_allocator = st.builds(
    lambda pid, gpu, reserved, a, b, c, retries, ooms: protocol.Allocator(
        pid, gpu, reserved, min(a, reserved), min(b, reserved), min(c, reserved), retries, ooms),
    st.integers(1, 1 << 22), st.sampled_from(GPUS), st.integers(0, 1 << 50),
    st.integers(0, 1 << 50), st.integers(0, 1 << 50), st.integers(0, 1 << 50),
    st.integers(0, 1 << 40), st.integers(0, 1 << 20))


@settings(max_examples=1000, deadline=None)
@given(valid_allocator)
def test_every_valid_allocator_message_is_accepted_exactly(message):
    state = AppState(known_gpu=set(GPUS).__contains__)
    assert state.feed(protocol.encode(message)) == message
    (fig,) = state.figures(message.gpu).allocators
    assert (fig.reserved_bytes, fig.allocated_bytes, fig.alloc_retries) == (
        message.reserved_bytes, message.allocated_bytes, message.alloc_retries)


# -- the long seeded run through the real socket -----------------------------------------------

BOUNDS = list(protocol.DEFAULT_LATENCY_BOUNDS)


def valid_message(rng: random.Random, clock: dict[tuple[str, int], int]) -> bytes:
    kind = rng.choice(["hello", "allocator", "latency"])
    pid, gpu = rng.randint(1, 50), rng.choice(GPUS)
    if kind == "hello":
        return protocol.encode(protocol.Hello(pid, tuple(rng.sample(GPUS, rng.randint(1, 2)))))
    if kind == "allocator":
        reserved = rng.randint(0, 1 << 40)
        return protocol.encode(protocol.Allocator(
            pid, gpu, reserved, rng.randint(0, reserved), rng.randint(0, reserved),
            rng.randint(0, reserved), rng.randint(0, 1000), rng.randint(0, 10)))
    n = clock.get((gpu, pid), 0) + rng.randint(0, 100)
    clock[(gpu, pid)] = n
    counts = [*sorted(rng.randint(0, n) for _ in BOUNDS), n]
    return protocol.encode(protocol.Latency(pid, gpu, tuple(BOUNDS), tuple(counts),
                                            round(rng.random() * n, 3)))


def malformed_message(rng: random.Random) -> tuple[bytes, str]:
    base = {"v": 1, "kind": "allocator", "pid": 7, "gpu": GPUS[0], "reserved_bytes": 100,
            "allocated_bytes": 50, "active_bytes": 50, "inactive_split_bytes": 0,
            "alloc_retries": 0, "ooms": 0}
    choice = rng.randrange(14)
    if choice == 0:
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 200))) + b"\xff", "not_json"
    if choice == 1:
        good = json.dumps(base).encode()
        return good[: rng.randint(1, len(good) - 1)], "not_json"  # truncated
    if choice == 2:
        return b"{" + b" " * (protocol.MAX_MESSAGE_BYTES + rng.randint(1, 5000)) + b"}", "too_large"
    if choice == 3:
        return json.dumps({**base, "reserved_bytes": rng.choice(["1", 1.5, None, [], {}])}).encode(), \
            "bad_type"
    if choice == 4:
        text = json.dumps({**base, "reserved_bytes": 1}).replace('"reserved_bytes": 1',
                                                               '"reserved_bytes": NaN')
        return text.encode(), "bad_number"
    if choice == 5:
        return json.dumps({**base, "ooms": -rng.randint(1, 1 << 40)}).encode(), "out_of_range"
    if choice == 6:
        return json.dumps({**base, "reserved_bytes": rng.randint(1 << 51, 1 << 63)}).encode(), \
            "out_of_range"
    if choice == 7:
        return json.dumps({**base, "v": rng.choice([0, 2, 99])}).encode(), "bad_version"
    if choice == 8:
        return json.dumps({**base, "gpu": STRANGER}).encode(), "unknown_gpu"
    if choice == 9:
        return json.dumps({**base, "gpu": "GPU-" + "../" * 5}).encode(), "bad_uuid"
    if choice == 10:
        return json.dumps({**base, "allocated_bytes": 500}).encode(), "inconsistent"
    if choice == 11:
        return json.dumps({**base, "kind": "exec"}).encode(), "bad_kind"
    if choice == 12:
        return json.dumps({"v": 1, "kind": "latency", "pid": 9, "gpu": GPUS[1],
                           "bounds": [0.1, 0.2], "counts": [1, 2, 3], "sum": math.inf}
                          ).encode().replace(b"Infinity", b"1e999"), "out_of_range"
    return json.dumps([base]).encode(), "not_object"


@pytest.mark.slow
def test_hundred_thousand_datagrams_through_the_real_socket(tmp_path):
    path = str(tmp_path / "app.sock")
    state = AppState(known_gpu=set(GPUS).__contains__)
    app = AppSocket(path, state)
    app.start()
    rng = random.Random(20261130)
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # blocking: the kernel paces us
    sender.connect(path)
    expected_valid = 0
    expected_reasons: dict[str, int] = {}
    clock: dict[tuple[str, int], int] = {}
    try:
        for _ in range(100_000):
            if rng.random() < 0.5:
                sender.send(valid_message(rng, clock))
                expected_valid += 1
            else:
                data, reason = malformed_message(rng)
                sender.send(data)
                expected_reasons[reason] = expected_reasons.get(reason, 0) + 1
        until(lambda: state.accepted + sum(state.rejected.values()) >= 100_000, 60,
              what=lambda: f"100000 datagrams read (at "
                           f"{state.accepted + sum(state.rejected.values())})")
        assert app._thread is not None and app._thread.is_alive()  # never crashed
    finally:
        sender.close()
        app.stop()
    assert state.accepted == expected_valid
    assert dict(state.rejected) == expected_reasons


LABEL_VALUE = re.compile(r"\A[0-9A-Za-z_.+/:\- ()]*\Z")  # no control character, quote, backslash


@settings(max_examples=400, deadline=None)
@given(st.lists(st.text(max_size=40), min_size=1, max_size=6), st.integers(1, 1 << 22))
@example(["\n"], 7).via("the trailing newline that a '$' in the pattern let through")
def test_no_string_from_the_socket_reaches_a_label_unless_it_is_a_whole_uuid(texts, pid):
    """Arbitrary strings, alone and glued to a real UUID, in every field that names a GPU, in
    every kind (the other fields are numbers): what is exported is only ever a whole UUID."""
    state = AppState()  # --no-nvml: no NVML list of GPUs to hide behind
    candidates = [*texts, *(GPUS[0] + t for t in texts), *(t + GPUS[0] for t in texts)]
    for text in candidates:
        for body in (
            {"v": 1, "kind": "hello", "pid": pid, "gpus": [text]},
            {"v": 1, "kind": "allocator", "pid": pid, "gpu": text, "reserved_bytes": 10,
             "allocated_bytes": 5, "active_bytes": 5, "inactive_split_bytes": 1,
             "alloc_retries": 0, "ooms": 0},
            {"v": 1, "kind": "latency", "pid": pid, "gpu": text, "bounds": [0.1],
             "counts": [1, 2], "sum": 0.3},
            {"v": 1, "kind": "round", "pid": pid, "gpus": [text], "allocators": [],
             "latency": [{"gpu": text, "bounds": [0.1], "counts": [1, 2], "sum": 0.3}]},
        ):
            state.feed(json.dumps(body).encode())
    figures = state.all_figures()
    for uuid in {*state.announced(), *figures}:
        assert protocol.UUID_RE.match(uuid) and "\n" not in uuid
        identity = GpuIdentity(uuid=uuid, name="unknown (no NVML)", index="unknown")
        sample = GpuSample(identity, 1, app=figures.get(uuid, AppFigures()))
        for series in sample_series(sample, {}):
            for _, value in series.labels:
                assert LABEL_VALUE.match(value), (series.name, value)
