"""OTLP/HTTP metrics sink: the spooled pipeline of ``sidecar.sinks.spooled.SpooledSink`` (batch,
journal, spool, one request in flight, in order) with OTLP bodies: gzip-compressed protobuf
``ExportMetricsServiceRequest`` (``sidecar.wire.otlp``).

Answers (``sidecar.sinks.answers.OTLP``): 429, 500, 502, 503 and 504 are retried with backoff,
``Retry-After`` honoured, like network errors. Retrying a 500 departs from the OTLP/HTTP
specification ("MUST NOT retry"), on purpose: Prometheus 3 answers 500 for transient append
errors, and the product promises that nothing spooled is lost. 400, 413 and 422 are answers
about the data: the refused batch is set aside in the spool's ``rejected/`` (a merged backlog is
split first, as for remote-write). Any other refusal (401, 403, 404, 405, 415, 501, any other
5xx ...) says the URL, the credentials or the receiver are wrong: every batch stays in the
spool, the head retried at the longest backoff (``SpooledSink``). A 2xx with ``partial_success``
is delivered; the points it says were rejected are counted
(``gpu_sidecar_samples_dropped_total{reason="partial_success"}``) and each condition logged once.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping
from typing import Any

from sidecar import __version__, metrics
from sidecar.config import Config
from sidecar.durability.spool import Spool
from sidecar.samples import Series
from sidecar.sinks.answers import OTLP, Response, is_protobuf
from sidecar.sinks.codec import RecordsBatch
from sidecar.sinks.spooled import SpooledSink
from sidecar.urls import sink_label
from sidecar.wire import otlp


def sink_name(url: str) -> str:
    """The ``sink`` label: ``otlp:`` and the URL's scheme-less host, port and path."""
    return sink_label("otlp", url)


class OtlpCodec:
    """OTLP/HTTP protobuf: each cycle an ExportMetricsServiceRequest, gzip."""

    kind = "otlp"
    headers = otlp.CONTENT_HEADERS
    policy = OTLP
    drop_reasons = ("partial_success", otlp.UNENCODABLE)
    ends_series = True  # points flagged NO_RECORDED_VALUE (Prometheus 3, VictoriaMetrics)

    def __init__(self, resource: Mapping[str, str], extra_labels: tuple[str, ...] = (),
                 start_ms: int | None = None) -> None:
        """``resource``: attributes of every request's resource besides the pod's identity,
        which comes with the series (their labels ``namespace``, ``pod``, ``node``,
        ``container``, and each ``--extra-label``, named in ``extra_labels``)."""
        self.encoder = otlp.Encoder(
            tuple(sorted(resource.items())),
            {**metrics.RESOURCE_LABELS, **{k: k for k in extra_labels}},
            int(time.time() * 1000) if start_ms is None else start_ms, __version__)
        self.dropped = self.encoder.dropped  # series it could not encode, by reason

    def cycle(self, series: list[Series]) -> bytes:
        return self.encoder.cycle(series)

    def ended(self, series: list[Series]) -> bytes:
        return self.encoder.cycle(series, ended=True)

    def compress(self, payload: bytes) -> bytes:
        return otlp.compress(payload)

    def open_batch(self) -> RecordsBatch:
        # gzip'd whole at the seal: not every receiver reads gzip members joined
        return RecordsBatch(otlp.compress)

    def decompress(self, body: bytes) -> bytes:
        return otlp.decompress(body)

    def partial(self, response: Response) -> tuple[int, str] | None:
        if not response.content or not is_protobuf(response):  # JSON, text: not ours to read
            return None
        found = otlp.partial_success(response.content)
        return None if found is None else (found.rejected, found.message)


def default_resource() -> dict[str, str]:
    """What the agent says of itself on every resource: service.name and version, host.name
    (the pod's name in Kubernetes); the encoder adds service.instance.id."""
    return {"service.name": "gpu-sidecar", "service.version": __version__,
            "host.name": socket.gethostname()}


def otlp_sink(url: str, spool: Spool, cfg: Config, *, name: str | None = None,
              extra_labels: tuple[str, ...] = (), **pipeline: Any) -> SpooledSink:
    """An OTLP sink: the spooled pipeline with the OTLP codec. ``pipeline``: the keyword
    arguments of ``SpooledSink`` (push_interval_s, max_batch_samples, clock, initial_backoff_s)."""
    codec = OtlpCodec(default_resource(), extra_labels)
    return SpooledSink(url, spool, cfg, codec, name=name or sink_name(url), **pipeline)
