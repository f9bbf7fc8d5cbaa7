"""Remote-write sink: batch, spool, then send in order with one request in flight.

Sampling never waits for the network: ``emit`` only appends to the open batch and, every push
interval (or when the batch is full), encodes it into the spool. A sender thread sends the spool
oldest-first and deletes a batch only after a 2xx. While the receiver is down the spool grows
(bounded, oldest dropped first) and the sender retries the head batch with backoff; when the
receiver returns the backlog drains in order.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from urllib.parse import urlsplit

import structlog

from sidecar.remote_write import CONTENT_HEADERS, Batch, Encoder, compress
from sidecar.samples import Labels, Series
from sidecar.sinks.delivery import Http, HttpOptions, Refused, Retryable, check, redact, retrying
from sidecar.spool import Spool, SpooledBatch

log = structlog.get_logger("sidecar.remote_write")


def sink_name(url: str) -> str:
    parts = urlsplit(url)
    return f"remote_write:{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


class RemoteWriteSink:
    def __init__(
        self,
        url: str,
        spool: Spool,
        http: HttpOptions,
        *,
        push_interval_s: float = 15.0,
        max_batch_samples: int = 20_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.name = sink_name(url)
        self.spool = spool
        self.http = Http(http)
        self.options = http
        self.push_interval_s = push_interval_s
        self.max_batch_samples = max_batch_samples
        self.clock = clock
        self.encoder = Encoder()
        self.batch = Batch()
        self.last_flush = clock()
        self.samples_pushed = 0
        self.batches_pushed = 0
        self.failures: Counter[str] = Counter()
        self.last_push_seconds = 0.0
        self.last_success_time = 0.0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._draining = threading.Event()
        self._failing_since: float | None = None
        self._thread = threading.Thread(target=self._run, name=f"sender-{self.name}", daemon=True)

    # -- producer side (the sampling thread) -------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        if len(self.spool):
            self._wake.set()

    def emit(self, series: list[Series]) -> None:
        with self._lock:
            self.batch.add(series)
            due = (len(self.batch) >= self.max_batch_samples
                   or self.clock() - self.last_flush >= self.push_interval_s)
        if due:
            self.flush()

    def flush(self) -> None:
        """Encode the open batch into the spool; the sender takes it from there."""
        with self._lock:
            batch, self.batch = self.batch, Batch()
            self.last_flush = self.clock()
        if not len(batch):
            return
        body = compress(self.encoder.write_request(batch.series))
        self.spool.put(body, len(batch))
        self._wake.set()

    def close(self, deadline: float) -> bool:
        """Flush and send what the time allows; what is left stays in the spool. True when
        everything was delivered."""
        self.flush()
        self._draining.set()
        self._wake.set()
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=1.0)
        left = len(self.spool)
        if left:
            log.warning("shutdown_left_in_spool", sink=self.name, batches=left,
                        bytes=self.spool.bytes(), effect="sent by the next start on this spool")
        return left == 0

    # -- sender thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            draining = self._draining.is_set()  # read before looking: close() flushes, then sets it
            batch = self.spool.oldest()
            if batch is None:
                if draining:
                    return
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            self._deliver(batch)

    def _give_up(self, batch: SpooledBatch) -> Callable[[object], bool]:
        def stop(_state: object) -> bool:
            # retry for as long as the spool holds the batch (the size bound may drop it) and
            # the agent is not past its shutdown deadline
            return self._stop.is_set() or not batch.path.exists()
        return stop

    def _deliver(self, batch: SpooledBatch) -> None:
        attempts = 0
        try:
            for attempt in retrying(self.options, stop=self._give_up(batch),
                                    sleep=self._stop.wait):
                with attempt:
                    attempts += 1
                    self._post(batch)
        except Refused as exc:
            self.failures[f"http_{exc.status}"] += 1
            aside = self.spool.set_aside(batch)
            log.error("batch_refused", sink=self.name, url=redact(self.url), status=exc.status,
                      receiver_said=str(exc), hint=exc.hint, samples=batch.samples,
                      set_aside=str(aside), effect="later batches keep flowing")
            return
        except Retryable:
            return  # stopping, or the batch left the spool; the loop decides what is next
        if not self.spool.remove(batch):
            log.info("dropped_batch_delivered_after_all", sink=self.name, samples=batch.samples,
                     note="the size bound dropped it while it was in flight; not counted as lost")
        self.samples_pushed += batch.samples
        self.batches_pushed += 1
        self.last_success_time = time.time()
        if self._failing_since is not None:
            log.info("receiver_recovered", sink=self.name,
                     outage_s=round(time.monotonic() - self._failing_since, 1), attempts=attempts,
                     backlog_batches=len(self.spool))
            self._failing_since = None

    def _post(self, batch: SpooledBatch) -> None:
        started = time.monotonic()
        try:
            response = self.http.request("POST", self.url, data=batch.body, headers=CONTENT_HEADERS)
            check(response)
        except Retryable as exc:
            self.failures[exc.reason] += 1
            if self._failing_since is None:
                self._failing_since = started
                log.warning("push_failing", sink=self.name, reason=exc.reason, detail=str(exc),
                            retry_after_s=exc.retry_after,
                            effect="retrying with backoff; samples wait in the spool")
            raise
        finally:
            self.last_push_seconds = time.monotonic() - started

    # -- self-telemetry --------------------------------------------------------------------

    def telemetry(self, ts: int, labels: Labels) -> list[Series]:
        base = tuple(sorted((*labels, ("sink", self.name))))

        def s(name: str, value: float, *extra: tuple[str, str]) -> Series:
            return Series(name, tuple(sorted((*base, *extra))) if extra else base, float(value), ts)

        out = [
            s("gpu_sidecar_samples_pushed_total", self.samples_pushed),
            s("gpu_sidecar_spool_bytes", self.spool.bytes()),
            s("gpu_sidecar_spool_batches", len(self.spool)),
            s("gpu_sidecar_push_duration_seconds", self.last_push_seconds),
        ]
        if self.last_success_time:
            out.append(s("gpu_sidecar_last_push_success_timestamp_seconds", self.last_success_time))
        for reason, n in sorted(self.failures.items()):
            out.append(s("gpu_sidecar_push_failures_total", n, ("reason", reason)))
        for reason, n in sorted(self.spool.dropped_samples.items()):
            out.append(s("gpu_sidecar_samples_dropped_total", n, ("reason", reason)))
        return out
