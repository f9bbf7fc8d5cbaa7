"""The hand-written remote-write encoder, checked by decoding with the real protobuf runtime."""

from __future__ import annotations

import struct

import cramjam
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.samples import Series
from sidecar.wire import protobuf, remote_write
from sidecar.wire.remote_write import Encoder, compress, decompress, encode_labels, varint
from tests.prompb import Label, Sample, TimeSeries, WriteRequest
from tests.write_requests import Batch, GroupedEncoder


def decode(body: bytes) -> dict[tuple[str, tuple], list[tuple[int, float]]]:
    wr = WriteRequest()
    wr.ParseFromString(body)
    out = {}
    for ts in wr.timeseries:
        labels = [(lab.name, lab.value) for lab in ts.labels]
        assert labels == sorted(labels), "labels must be sorted by name"
        assert len({k for k, _ in labels}) == len(labels), "label names must be unique"
        d = dict(labels)
        name = d.pop("__name__")
        points = [(s.timestamp, s.value) for s in ts.samples]
        assert points == sorted(points, key=lambda p: p[0]), "samples in timestamp order"
        out[(name, tuple(sorted(d.items())))] = points
    return out


def test_varint_matches_protobuf_encoding():
    assert varint(0) == b"\x00"
    assert varint(1) == b"\x01"
    assert varint(300) == b"\xac\x02"
    assert varint(-1) == b"\xff" * 9 + b"\x01"  # int64 two's complement, 10 bytes
    for value in (127, 128, 2**32, 1_700_000_000_123, 2**63 - 1, -5):
        sample = Sample(timestamp=value).SerializeToString()
        assert sample == b"\x10" + varint(value)
    for value in (1 << 64, -(1 << 63) - 1):  # fits no 64 bits: refused, never wrapped or overlong
        with pytest.raises(ValueError):
            varint(value)


def test_every_named_tag_is_the_one_protobuf_writes_for_that_field():
    """Each tag the encoder names is what the protobuf runtime writes for that field alone."""
    for message, tag in [
        (WriteRequest(timeseries=[TimeSeries()]), remote_write.WRITE_REQUEST_TIMESERIES),
        (TimeSeries(labels=[Label()]), remote_write.TIMESERIES_LABELS),
        (TimeSeries(samples=[Sample()]), remote_write.TIMESERIES_SAMPLES),
        (Label(name="n"), remote_write.LABEL_NAME),
        (Label(value="v"), remote_write.LABEL_VALUE),
        (Sample(value=1.5), remote_write.SAMPLE_VALUE),
        (Sample(timestamp=7), remote_write.SAMPLE_TIMESTAMP),
    ]:
        assert message.SerializeToString()[:len(tag)] == tag, (message, tag)


def test_the_shared_reader_reads_back_what_the_shared_helpers_write():
    labels = encode_labels("up", (("job", "gpu"),))
    pairs = [[v.decode() for _, v in protobuf.fields(lab)] for _, lab in protobuf.fields(labels)]
    assert pairs == [["__name__", "up"], ["job", "gpu"]]
    assert list(protobuf.fields(b"\x10" + varint(-5))) == [(2, (1 << 64) - 5)]
    assert protobuf.int64((1 << 64) - 5) == -5
    with pytest.raises(ValueError):
        list(protobuf.fields(b"\x0a\x05ab"))  # truncated


def test_batch_round_trips_through_protobuf_and_snappy_block_format():
    batch = Batch()
    labels = (("gpu_uuid", "GPU-1"), ("pod", "p\u00e9-0"))
    batch.add([Series("gpu_utilization_ratio", labels, 0.5, 1000),
               Series("gpu_memory_used_bytes", labels, 2.0**53, 1000)])
    batch.add([Series("gpu_utilization_ratio", labels, 0.75, 2000)])
    body = compress(GroupedEncoder().write_request(batch.series))
    # snappy *block* format: decodable by the raw decoder, not the framed one
    raw = bytes(cramjam.snappy.decompress_raw(body))
    assert decode(raw) == {
        ("gpu_utilization_ratio", labels): [(1000, 0.5), (2000, 0.75)],
        ("gpu_memory_used_bytes", labels): [(1000, 2.0**53)],
    }
    assert decompress(body) == raw


def test_out_of_order_samples_are_sorted_per_series():
    batch = Batch()
    batch.add([Series("x", (), 2.0, 2000), Series("x", (), 1.0, 1000)])
    assert decode(GroupedEncoder().write_request(batch.series)) == {("x", ()): [(1000, 1.0), (2000, 2.0)]}


STALE_NAN = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000002))[0]


def bits(value: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", value))[0]


label_text = st.text(min_size=0, max_size=20)
series_strategy = st.lists(
    st.tuples(
        st.sampled_from(["a", "gpu_x_ratio", "inference_request_duration_seconds_bucket"]),
        st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True), label_text,
                        max_size=4),
        st.integers(min_value=0, max_value=2**62),
        st.floats(allow_nan=True) | st.just(STALE_NAN),
    ),
    max_size=40,
)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(series_strategy)
def test_encoder_agrees_with_protobuf_for_any_series(items):
    batch = Batch()
    expected: dict = {}
    for name, labels, ts, value in items:
        key = (name, tuple(sorted(labels.items())))
        batch.add([Series(name, key[1], value, ts)])
        expected.setdefault(key, []).append((ts, value))
    got = decode(GroupedEncoder().write_request(batch.series))
    assert set(got) == set(expected)
    for key, points in expected.items():
        want = sorted(points, key=lambda p: p[0])
        assert [t for t, _ in got[key]] == [t for t, _ in want]
        # bit for bit: -0.0 is not 0.0, and Prometheus' stale marker is one NaN among many
        assert [bits(v) for _, v in got[key]] == [bits(v) for _, v in want]


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.lists(series_strategy, min_size=1, max_size=5))
def test_cycles_joined_are_one_write_request_with_every_sample_in_order(cycles):
    """What the agent sends: each cycle encoded once, a request is cycles (or batches) joined."""
    encoder = Encoder()
    expected: dict = {}
    for ts, items in enumerate(cycles, start=1_700_000_000_000):
        for name, labels, _, value in items:
            expected.setdefault((name, tuple(sorted(labels.items()))), []).append((ts, value))
    body = b"".join(encoder.cycle([Series(n, tuple(sorted(lab.items())), v, ts)
                                   for n, lab, _, v in items])
                    for ts, items in enumerate(cycles, start=1_700_000_000_000))
    wr = WriteRequest()
    wr.ParseFromString(body)
    got: dict = {}
    for series in wr.timeseries:
        labels = [(lab.name, lab.value) for lab in series.labels]
        assert labels == sorted(labels)
        d = dict(labels)
        name = d.pop("__name__")
        got.setdefault((name, tuple(sorted(d.items()))), []).extend(
            (s.timestamp, bits(s.value)) for s in series.samples)
    assert got == {k: [(t, bits(v)) for t, v in pts] for k, pts in expected.items()}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=300) | st.sampled_from([b"", b"ab" * 40_000]), max_size=8))
def test_snappy_blocks_joined_unopened_are_the_block_of_their_payloads_joined(payloads):
    """How the open batch is sealed (its cycles are held compressed), read back by a snappy
    decoder (cramjam's; the sinks' tests send such bodies to VictoriaMetrics, Go's), whatever the
    sizes (a payload past 64 KiB is compressed in fragments)."""
    joined = remote_write.join_compressed([compress(p) for p in payloads])
    assert bytes(cramjam.snappy.decompress_raw(joined)) == b"".join(payloads)


@pytest.mark.parametrize("gpus", [1, 8])
def test_an_open_batch_kept_compressed_is_the_request_and_as_small_as_the_whole_compressed(gpus):
    """A push interval of cycles (15 at 1 s) of one GPU's 60 series (14 KB a cycle: several go
    into one snappy fragment) and of eight GPUs' (each cycle past a fragment)."""
    labels = [(("gpu_uuid", f"GPU-{g}"), ("pod", "vllm-0")) for g in range(gpus)]
    encoder, batch, records = Encoder(), remote_write.SnappyBatch(), []
    for cycle in range(15):
        ts = 1_700_000_000_000 + 1000 * cycle
        record = encoder.cycle([Series(f"gpu_figure_{n}_ratio", lab, (n * 7 + cycle) % 10 / 10, ts)
                                for lab in labels for n in range(60)])
        batch.add(record)
        records.append(record)
    body = batch.seal()
    assert decompress(body) == b"".join(records)
    whole = compress(b"".join(records))
    assert len(body) <= len(whole) * 1.02, (len(body), len(whole))
