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

import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

import cramjam

from sidecar.samples import Labels, Series

_DOUBLE = struct.Struct("<d")
CONTENT_HEADERS = {
    "Content-Encoding": "snappy",
    "Content-Type": "application/x-protobuf",
    "X-Prometheus-Remote-Write-Version": "0.1.0",
}


def varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64 in two's complement, as protobuf does
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    return bytes((tag,)) + varint(len(payload)) + payload


def _string(tag: int, text: str) -> bytes:
    return _field(tag, text.encode())


def encode_labels(name: str, labels: Labels) -> bytes:
    """The repeated ``labels`` fields of one TimeSeries, ``__name__`` included, sorted."""
    pairs = sorted((("__name__", name), *labels))
    return b"".join(_field(0x0A, _string(0x0A, k) + _string(0x12, v)) for k, v in pairs)


SeriesKey = tuple[str, Labels]


@dataclass
class Batch:
    """Samples accumulated between flushes, grouped by series, in arrival order."""

    series: dict[SeriesKey, list[tuple[int, float]]] = field(default_factory=dict)
    samples: int = 0

    def add(self, items: Iterable[Series]) -> None:
        for s in items:
            self.series.setdefault((s.name, s.labels), []).append((s.timestamp_ms, s.value))
            self.samples += 1

    def __len__(self) -> int:
        return self.samples


class Encoder:
    """Encodes batches; remembers the label block of each series it has seen."""

    def __init__(self, max_cached_series: int = 50_000) -> None:
        self._labels: dict[SeriesKey, bytes] = {}
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
        pack = _DOUBLE.pack
        prefixes = self._prefixes
        tails: dict[int, bytes] = {}
        out: list[bytes] = []
        for s in series:
            tail = tails.get(s.timestamp_ms)
            if tail is None:
                tail = tails[s.timestamp_ms] = b"\x10" + varint(s.timestamp_ms)
            key = (s.name, s.labels, len(tail))
            prefix = prefixes.get(key)
            if prefix is None:
                labels = encode_labels(s.name, s.labels)
                sample = 9 + len(tail)  # Sample = 0x09 double (9 bytes) + 0x10 varint
                prefix = prefixes[key] = (b"\x0a" + varint(len(labels) + 2 + sample) + labels
                                          + b"\x12" + bytes((sample,)) + b"\x09")
            out.append(prefix + pack(s.value) + tail)
        return b"".join(out)

    def write_request(self, series: dict[SeriesKey, list[tuple[int, float]]]) -> bytes:
        """A batch grouped by series, one TimeSeries each with its samples in order: the
        compact form, for bodies built in one go (tests, the encoding benchmark)."""
        if len(self._labels) > self._max:
            self._labels.clear()
        pack = _DOUBLE.pack
        # every series of a cycle shares its timestamp: encode the parts around the value once
        framing: dict[int, tuple[bytes, bytes]] = {}
        parts: list[bytes] = []
        for key, points in series.items():
            label_block = self._labels.get(key)
            if label_block is None:
                label_block = self._labels[key] = encode_labels(*key)
            if any(points[i][0] > points[i + 1][0] for i in range(len(points) - 1)):
                points = sorted(points, key=lambda p: p[0])
            chunks = [label_block]
            for ts, value in points:
                frame = framing.get(ts)
                if frame is None:
                    tail = b"\x10" + varint(ts)
                    # Sample = 0x09 double (9 bytes) + 0x10 varint; one length byte suffices
                    frame = framing[ts] = (b"\x12" + bytes((9 + len(tail),)) + b"\x09", tail)
                chunks.append(frame[0] + pack(value) + frame[1])
            body = b"".join(chunks)
            parts.append(b"\x0a" + varint(len(body)) + body)
        return b"".join(parts)


def compress(payload: bytes) -> bytes:
    """Snappy *block* format, as remote-write requires (not the framed stream format)."""
    return bytes(cramjam.snappy.compress_raw(payload))


def decompress(body: bytes) -> bytes:
    return bytes(cramjam.snappy.decompress_raw(body))


