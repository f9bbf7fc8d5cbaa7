"""What differs between the spooled protocols (remote-write, OTLP): the ``Codec`` a
``sidecar.sinks.spooled.SpooledSink`` is built with, and the open batch it fills."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from sidecar.samples import Series
from sidecar.sinks.answers import Policy, Response


class OpenBatch(Protocol):
    """The cycles of the batch being filled, kept until it is sealed into the spool."""

    def add(self, record: bytes) -> None: ...

    def seal(self) -> bytes:
        """The batch's body, compressed: every record added, in order, as one request."""
        ...


class RecordsBatch:
    """An open batch kept as its records, joined and compressed whole when sealed."""

    def __init__(self, compress: Callable[[bytes], bytes]) -> None:
        self._records: list[bytes] = []
        self._compress = compress

    def add(self, record: bytes) -> None:
        self._records.append(record)

    def seal(self) -> bytes:
        return self._compress(b"".join(self._records))


class Codec(Protocol):
    """What a spooled protocol decides; the pipeline (``SpooledSink``) is the same for all."""

    # read-only members (properties), so that a codec's own narrower types fit them
    @property
    def kind(self) -> str:
        """Names the logger: sidecar.<kind>."""
        ...

    @property
    def headers(self) -> Mapping[str, str]:
        """Sent with every request (content type and encoding)."""
        ...

    @property
    def policy(self) -> Policy:
        """What its receivers' answers mean (sidecar.sinks.answers)."""
        ...

    @property
    def drop_reasons(self) -> tuple[str, ...]:
        """Reasons of its own for gpu_sidecar_samples_dropped_total."""
        ...

    @property
    def dropped(self) -> Mapping[str, int]:
        """Samples the codec itself could not send, by reason."""
        ...

    @property
    def ends_series(self) -> bool:
        """Its receivers are told that a series ended (a clean stop's ``end_series``)."""
        ...

    def cycle(self, series: list[Series]) -> bytes:
        """One cycle as a whole uncompressed request: requests joined are one request."""
        ...

    def ended(self, series: list[Series]) -> bytes:
        """A cycle that ends these series (their values are ``STALE_NAN``): remote-write sends
        the marker as the value, OTLP flags each point NO_RECORDED_VALUE."""
        ...

    def compress(self, payload: bytes) -> bytes: ...

    def open_batch(self) -> OpenBatch:
        """An empty open batch, which keeps the cycles' records as suits the compression."""
        ...

    def decompress(self, body: bytes) -> bytes: ...

    def partial(self, response: Response) -> tuple[int, str] | None:
        """What a 2xx answer says was dropped all the same: (points rejected, message)."""
        ...
