"""Remote-write bodies built in one go, for tests and the encoding benchmark: the agent itself
only ever sends cycles joined (``sidecar.wire.remote_write.Encoder.cycle``), so these stay out of
the package."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from sidecar.samples import Series
from sidecar.wire.protobuf import DOUBLE, length_delimited, varint
from sidecar.wire.remote_write import (
    SAMPLE_TIMESTAMP,
    WRITE_REQUEST_TIMESERIES,
    SeriesKey,
    encode_labels,
    sample_head,
)


@dataclass
class Batch:
    """Samples grouped by series, in arrival order."""

    series: dict[SeriesKey, list[tuple[int, float]]] = field(default_factory=dict)
    samples: int = 0

    def add(self, items: Iterable[Series]) -> None:
        for s in items:
            self.series.setdefault((s.name, s.labels), []).append((s.timestamp_ms, s.value))
            self.samples += 1

    def __len__(self) -> int:
        return self.samples


class GroupedEncoder:
    """Writes a batch grouped by series: one TimeSeries each with its samples in order (the
    compact form); remembers each series' label block, as a warm encoder would."""

    def __init__(self, max_cached_series: int = 50_000) -> None:
        self._labels: dict[SeriesKey, bytes] = {}
        self._max = max_cached_series

    def write_request(self, series: dict[SeriesKey, list[tuple[int, float]]]) -> bytes:
        if len(self._labels) > self._max:
            self._labels.clear()
        pack = DOUBLE.pack
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
                    tail = SAMPLE_TIMESTAMP + varint(ts)
                    frame = framing[ts] = (sample_head(tail), tail)
                chunks.append(frame[0] + pack(value) + frame[1])
            parts.append(length_delimited(WRITE_REQUEST_TIMESERIES, b"".join(chunks)))
        return b"".join(parts)
