"""Prometheus remote-write 1.0 bodies: a protobuf ``WriteRequest``, snappy block-compressed.

The message is four nested types (WriteRequest > TimeSeries > Label, Sample), so it is written
directly in protobuf wire format rather than through generated classes. The agent encodes each
cycle once (``Encoder.cycle``: one TimeSeries per series, the bytes before each value kept from
cycle to cycle) and builds every request by joining such encodings: WriteRequests concatenate
into a WriteRequest, so a batch, a merged backlog and a replayed journal are never decoded and
encoded again. The tests decode the output with the real protobuf runtime, and the benchmark
compares the encoding against building the same message with protobuf.

Rules from the spec followed here: labels sorted by name with ``__name__`` among them, names
unique per series, samples of a series in timestamp order (cycles are joined in time order),
timestamps in milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import cramjam

from sidecar.samples import Labels, Series
from sidecar.wire.protobuf import DOUBLE, WireType, length_delimited, read_varint, string, tag, varint

CONTENT_HEADERS = {
    "Content-Encoding": "snappy",
    "Content-Type": "application/x-protobuf",
    "X-Prometheus-Remote-Write-Version": "0.1.0",
}

# The tag of each field written, named after it (prometheus/prompb remote.proto, types.proto)
WRITE_REQUEST_TIMESERIES = tag(1, WireType.LEN)  # WriteRequest: repeated TimeSeries timeseries = 1
TIMESERIES_LABELS = tag(1, WireType.LEN)  # TimeSeries: repeated Label labels = 1
TIMESERIES_SAMPLES = tag(2, WireType.LEN)  # TimeSeries: repeated Sample samples = 2
LABEL_NAME = tag(1, WireType.LEN)  # Label: string name = 1
LABEL_VALUE = tag(2, WireType.LEN)  # Label: string value = 2
SAMPLE_VALUE = tag(1, WireType.I64)  # Sample: double value = 1
SAMPLE_TIMESTAMP = tag(2, WireType.VARINT)  # Sample: int64 timestamp = 2 (milliseconds)

# A Sample's value is its tag and 8 bytes: with the timestamp (tag and at most 10 bytes) the whole
# Sample is under 128 bytes, so its length always takes one byte
_SAMPLE_VALUE_SIZE = len(SAMPLE_VALUE) + DOUBLE.size


def encode_labels(name: str, labels: Labels) -> bytes:
    """The repeated ``labels`` fields of one TimeSeries, ``__name__`` included, sorted."""
    pairs = sorted((("__name__", name), *labels))
    return b"".join(length_delimited(TIMESERIES_LABELS, string(LABEL_NAME, k) + string(LABEL_VALUE, v))
                    for k, v in pairs)


def sample_head(tail: bytes) -> bytes:
    """What comes before a Sample's value: the TimeSeries.samples tag, the Sample's length (its
    value and ``tail``, the encoded timestamp) and the value's tag."""
    return TIMESERIES_SAMPLES + bytes((_SAMPLE_VALUE_SIZE + len(tail),)) + SAMPLE_VALUE


SeriesKey = tuple[str, Labels]


class Encoder:
    """Encodes batches; remembers the label block of each series it has seen."""

    def __init__(self, max_cached_series: int = 50_000) -> None:
        self._prefixes: dict[tuple[str, Labels, int], bytes] = {}
        self._max = max_cached_series

    def cycle(self, series: Iterable[Series]) -> bytes:
        """One cycle as a WriteRequest with one TimeSeries per series (Prometheus' own sender
        writes one per sample too). Requests are made of these joined: a batch is its cycles
        side by side, a merged backlog its batches side by side, a journal replay its records;
        nothing is ever decoded and encoded again. Per series, the bytes before the value are
        kept from cycle to cycle, so a cycle costs a lookup, a pack and a join per series."""
        if len(self._prefixes) > self._max:
            self._prefixes.clear()
        pack = DOUBLE.pack
        prefixes = self._prefixes
        out: list[bytes] = []
        ts, tail, width = None, b"", 0  # a cycle's series share one timestamp: encoded once
        for s in series:
            if s.timestamp_ms != ts:
                ts = s.timestamp_ms
                tail = SAMPLE_TIMESTAMP + varint(ts)
                width = len(tail)
            key = (s.name, s.labels, width)
            prefix = prefixes.get(key)
            if prefix is None:
                labels = encode_labels(s.name, s.labels)
                sample = sample_head(tail)
                # the TimeSeries: its tag and length, then its labels and its one sample
                size = len(labels) + len(sample) + DOUBLE.size + width
                prefix = prefixes[key] = WRITE_REQUEST_TIMESERIES + varint(size) + labels + sample
            out += (prefix, pack(s.value), tail)
        return b"".join(out)

def compress(payload: bytes) -> bytes:
    """Snappy *block* format, as remote-write requires (not the framed stream format)."""
    return bytes(cramjam.snappy.compress_raw(payload))


def decompress(body: bytes) -> bytes:
    return bytes(cramjam.snappy.decompress_raw(body))


def join_compressed(blocks: Sequence[bytes]) -> bytes:
    """Snappy blocks as one block of their payloads joined, none decompressed. A block is its
    payload's length (a varint) and then elements that copy only from earlier in the same
    block, so the elements of several blocks, after the length of all their payloads, are a
    block of the whole."""
    total = 0
    parts: list[bytes | memoryview] = [b""]  # the first: the total's varint, once it is known
    for block in blocks:
        length, start = read_varint(block, 0)
        total += length
        parts.append(memoryview(block)[start:])
    parts[0] = varint(total)
    return b"".join(parts)


# snappy compresses its input in fragments of 64 KiB, each on its own (nothing is matched across
# two): cycles compressed in groups of at least this much compress as well as their whole join
FRAGMENT_BYTES = 1 << 16


class SnappyBatch:
    """An open batch kept compressed: cycles are gathered until they fill a snappy fragment,
    then compressed together; sealing joins the blocks unopened (``join_compressed``). The batch
    is never held, or compressed, whole: at 1 s with a 15 s push, 8 GPUs' cycles of about 90 KB
    are kept in a ninth of that, and the 1.3 MB join is never made."""

    def __init__(self) -> None:
        self._blocks: list[bytes] = []
        self._pending: list[bytes] = []  # less than a fragment, not yet compressed
        self._pending_bytes = 0

    def add(self, record: bytes) -> None:
        self._pending.append(record)
        self._pending_bytes += len(record)
        if self._pending_bytes >= FRAGMENT_BYTES:
            self._compress_pending()

    def seal(self) -> bytes:
        self._compress_pending()
        return join_compressed(self._blocks)

    def _compress_pending(self) -> None:
        if self._pending:
            self._blocks.append(compress(b"".join(self._pending)))
            self._pending, self._pending_bytes = [], 0
