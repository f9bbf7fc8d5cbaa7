"""Remote-write sink: the spooled pipeline of ``sidecar.sinks.spooled.SpooledSink`` (batch,
journal, spool, then send in order with one request in flight) with remote-write 1.0 bodies:
snappy-compressed WriteRequests, every 5xx, 429 and network error retried with backoff; 400, 413
and 422 set the refused batch aside; any other refusal (401, 403, 404, ...) keeps the whole
spool and retries at the longest backoff until the receiver accepts
(``sidecar.sinks.answers.REMOTE_WRITE``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sidecar.config import Config
from sidecar.durability.spool import Spool
from sidecar.samples import Series
from sidecar.sinks.answers import INITIAL_BACKOFF_S, REMOTE_WRITE, Response
from sidecar.sinks.cadence import Cadence
from sidecar.sinks.spooled import SpooledSink
from sidecar.urls import sink_label
from sidecar.wire.remote_write import CONTENT_HEADERS, Encoder, SnappyBatch, compress, decompress

__all__ = ["RemoteWriteCodec", "RemoteWriteSink", "sink_name"]


def sink_name(url: str) -> str:
    """The ``sink`` label: ``remote_write:`` and the URL's scheme-less host, port and path."""
    return sink_label("remote_write", url)


class RemoteWriteCodec:
    """Remote-write 1.0: each cycle a WriteRequest (``sidecar.wire.remote_write.Encoder.cycle``),
    snappy block compression; a 2xx says nothing more."""

    kind = "remote_write"
    headers = CONTENT_HEADERS
    policy = REMOTE_WRITE
    drop_reasons: tuple[str, ...] = ()
    ends_series = True  # a sample of value STALE_NAN: Prometheus and VictoriaMetrics take it

    def __init__(self) -> None:
        self.encoder = Encoder()
        self.dropped: dict[str, int] = {}  # none: every float and int encodes as a double

    def cycle(self, series: list[Series]) -> bytes:
        return self.encoder.cycle(series)

    def ended(self, series: list[Series]) -> bytes:
        return self.encoder.cycle(series)  # the value is the marker

    def compress(self, payload: bytes) -> bytes:
        return compress(payload)

    def open_batch(self) -> SnappyBatch:
        return SnappyBatch()

    def decompress(self, body: bytes) -> bytes:
        return decompress(body)

    def partial(self, response: Response) -> tuple[int, str] | None:
        return None


class RemoteWriteSink(SpooledSink):
    def __init__(
        self,
        url: str,
        spool: Spool,
        cfg: Config,
        *,
        name: str | None = None,
        push_interval_s: float = Config.push_interval,
        max_batch_samples: int = Config.batch_max_samples,
        clock: Callable[[], float] = time.monotonic,
        cadence: Cadence | None = None,
        initial_backoff_s: float = INITIAL_BACKOFF_S,
    ) -> None:
        super().__init__(url, spool, cfg, RemoteWriteCodec(), name=name or sink_name(url),
                         push_interval_s=push_interval_s, max_batch_samples=max_batch_samples,
                         clock=clock, cadence=cadence, initial_backoff_s=initial_backoff_s)
