"""Remote-write sink: batch, journal, spool, then send in order with one request in flight.

Sampling never waits for the network: ``emit`` appends the cycle to the open batch and to its
journal on disk (so a crash loses at most the cycle in progress), and every push interval (or
when the batch is full) seals the batch into the spool. A sender thread sends the spool
oldest-first and deletes a batch only after a 2xx. While the receiver is down the spool grows
(bounded, oldest dropped first) and the sender retries the head with backoff; when the receiver
returns, the backlog is sent merged into requests of up to ``max_batch_samples``, in order, so a
receiver slower than the push interval is caught up rather than left behind for ever.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from urllib.parse import urlsplit

import structlog

from sidecar import journal
from sidecar.remote_write import CONTENT_HEADERS, Encoder, compress, decompress
from sidecar.samples import Labels, Series
from sidecar.sinks.delivery import (
    FAILURE_REASONS,
    Http,
    HttpOptions,
    Refused,
    Retryable,
    redact,
    retrying,
)
from sidecar.spool import STATES, Spool, SpooledBatch, log_count

log = structlog.get_logger("sidecar.remote_write")

IDLE_WAIT_S = 60.0


def host_port(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def sink_name(url: str) -> str:
    """The ``sink`` label: scheme-less host, port and path, so two URLs on one host:port (two
    tenants, two paths) are told apart; query and user-info stay out of labels."""
    return f"remote_write:{host_port(url)}{urlsplit(url).path.rstrip('/')}"


class RemoteWriteSink:
    def __init__(
        self,
        url: str,
        spool: Spool,
        http: HttpOptions,
        *,
        name: str | None = None,
        push_interval_s: float = 15.0,
        max_batch_samples: int = 20_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.name = name or sink_name(url)
        self.spool = spool
        self.http = Http(http)
        self.options = http
        self.push_interval_s = push_interval_s
        self.max_batch_samples = max_batch_samples
        self.clock = clock
        self.encoder = Encoder()
        self._cycles: list[bytes] = []  # the open batch: each cycle encoded once, as journaled
        self._open_samples = 0
        self.last_flush = clock()
        self.samples_pushed = 0
        self.batches_pushed = 0
        self.failures: Counter[str] = Counter({reason: 0 for reason in FAILURE_REASONS})
        self.last_push_seconds = 0.0
        self.last_success_time = 0.0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._draining = threading.Event()
        self._failing_since: float | None = None
        self._journal_failing = False
        self._journal = journal.Journal(spool.dir, spool.reserve())
        self._thread = threading.Thread(target=self._run, name=f"sender-{self.name}", daemon=True)

    # -- producer side (the sampling thread) -------------------------------------------------

    def start(self) -> None:
        self._replay_journals()
        self._thread.start()
        if len(self.spool):
            self._wake.set()

    def _replay_journals(self) -> None:
        """Seal the open batches that a crash left in journals, under their own numbers."""
        for seq, path in journal.leftovers(self.spool.dir):
            if seq == self._journal.seq:
                continue
            if self.spool.holds(seq):  # sealed, but the crash came before the journal went
                journal.remove(path)
                continue
            records: list[tuple[bytes, int]] = []
            try:
                records = list(journal.read_records(path))
            except OSError as exc:
                log.error("journal_unreadable", journal=path.name, error=exc.strerror,
                          effect="the samples it held are lost")
            samples = sum(n for _, n in records)
            if samples:
                body = compress(b"".join(body for body, _ in records))
                if self.spool.put(body, samples, seq=seq,
                                  before_publish=lambda p=path: journal.remove(p)) is not None:
                    log.info("journal_replayed", sink=self.name, journal=path.name,
                             samples=samples, note="the open batch of a run that did not stop")
                    continue
            journal.remove(path)  # empty, unreadable, or counted as lost by the spool

    def emit(self, series: list[Series]) -> None:
        record = self.encoder.cycle(series)
        with self._lock:
            self._append_journal(record, len(series))
            self._cycles.append(record)
            self._open_samples += len(series)
            due = (self._open_samples >= self.max_batch_samples
                   or self.clock() - self.last_flush >= self.push_interval_s)
        if due:
            self.flush()

    def _append_journal(self, record: bytes, samples: int) -> None:
        try:
            self._journal.append(record, samples)
        except OSError as exc:
            if not self._journal_failing:
                self._journal_failing = True
                log.error("journal_write_failed", sink=self.name, error=exc.strerror,
                          directory=str(self.spool.dir),
                          effect="the open batch is kept in memory only until the disk recovers: "
                                 "a crash meanwhile would lose it")
            return
        if self._journal_failing:
            self._journal_failing = False
            log.info("journal_write_recovered", sink=self.name)

    def flush(self) -> None:
        """Seal the open batch into the spool; the sender takes it from there."""
        with self._lock:
            cycles, samples = self._cycles, self._open_samples
            self._cycles, self._open_samples = [], 0
            sealed, self._journal = self._journal, journal.Journal(self.spool.dir,
                                                                  self.spool.reserve())
            self.last_flush = self.clock()
        if not samples:
            sealed.discard()
            return
        body = compress(b"".join(cycles))
        if self.spool.put(body, samples, seq=sealed.seq, before_publish=sealed.discard) is None:
            sealed.discard()  # counted as lost: it must not come back at the next start
        self._wake.set()

    def begin_close(self, deadline: float) -> None:
        """Shutdown starts: seal the open batch, cut backoff sleeps and request timeouts to the
        deadline. Every sink begins before any is waited for."""
        self.http.deadline = deadline
        self.flush()
        self._draining.set()
        self._wake.set()

    def close(self, deadline: float) -> bool:
        """Send what the time allows; what is left stays in the spool. True when everything was
        delivered."""
        if not self._draining.is_set():
            self.begin_close(deadline)
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self._stop.set()
        self._wake.set()
        self._journal.discard()
        left = len(self.spool)
        if left:
            log.warning("shutdown_left_in_spool", sink=self.name, batches=left,
                        bytes=self.spool.bytes(), effect="sent by the next start on this spool")
        return left == 0

    # -- sender thread ---------------------------------------------------------------------

    def _run(self) -> None:
        errors = 0
        while not self._stop.is_set():
            try:
                if self._send_next():
                    return
                errors = 0
            except Exception as exc:  # the sender must never die silently
                errors += 1
                self.failures["internal"] += 1
                if self._stop.is_set():
                    return  # closed: the interpreter may be finalising, say nothing more
                log.exception("sender_error", sink=self.name, error=repr(exc), count=errors,
                              effect="retrying; samples wait in the spool")
                self._sleep(min(30.0, 0.5 * 2 ** min(errors, 6)))

    def _send_next(self) -> bool:
        """Send the head of the spool (merged with what follows it); True when drained."""
        draining = self._draining.is_set()  # read before looking: close() flushes, then sets it
        if draining and time.monotonic() >= (self.http.deadline or 0):
            return True
        self._wake.clear()  # before looking: a flush after this point wakes the wait below
        head = self.spool.oldest()
        if head is None:
            if draining:
                return True
            # a flush, shutdown or stop sets it: no periodic wake-up while idle (the long
            # timeout only bounds the harm of a wake-up that was somehow missed)
            self._wake.wait(IDLE_WAIT_S)
            return False
        batches = [head, *self.spool.following(head.seq, self.max_batch_samples - head.samples)]
        self._deliver(batches)
        return False

    def _sleep(self, seconds: float) -> None:
        """A backoff sleep that shutdown cuts short."""
        if self._draining.is_set():
            self._stop.wait(min(seconds, 0.25))
        else:
            self._draining.wait(seconds)

    def _give_up(self, batch: SpooledBatch) -> Callable[[object], bool]:
        def stop(_state: object) -> bool:
            # retry for as long as the spool holds the batch (the size bound may drop it) and
            # the agent is not past its shutdown deadline
            deadline = self.http.deadline
            return (self._stop.is_set() or not batch.path.exists()
                    or (deadline is not None and time.monotonic() >= deadline))
        return stop

    def _deliver(self, batches: list[SpooledBatch]) -> None:
        head = batches[0]
        body, samples = head.body, head.samples
        if len(batches) > 1:
            try:  # requests are WriteRequests joined: a merged backlog is its batches joined
                body = compress(b"".join(decompress(b.body) for b in batches))
                samples = sum(b.samples for b in batches)
            except Exception:  # a batch we cannot read back: send the head alone, as written
                batches = [head]
        attempts = 0
        try:
            for attempt in retrying(self.options, stop=self._give_up(head), sleep=self._sleep,
                                    closing=self._draining.is_set):
                with attempt:
                    attempts += 1
                    # while on the wire (not while waiting to retry) the size bound leaves
                    # these batches alone: the receiver may be storing them
                    self.spool.in_flight(batches)
                    try:
                        if not all(self.spool.holds(b.seq) for b in batches):
                            return  # the bound took one while we waited: start afresh
                        self._post(body)
                    finally:
                        self.spool.in_flight([])
        except Refused as exc:
            if len(batches) > 1:  # find the batch the receiver objects to; the others go on
                for b in batches:
                    self._deliver([b])
                    if self.spool.holds(b.seq) or self._stop.is_set():
                        return  # not delivered (stopping, or past the deadline): keep the order
                return
            self.failures[f"http_{exc.status}"] += 1
            aside = self.spool.set_aside(head)
            log_count("batch_refused", self.failures[f"http_{exc.status}"], sink=self.name,
                      url=redact(self.url), status=exc.status, receiver_said=str(exc),
                      hint=exc.hint, samples=head.samples, set_aside=str(aside),
                      effect="later batches keep flowing")
            return
        except Retryable:
            return  # stopping, or the batch left the spool; the loop decides what is next
        for b in batches:
            self.spool.remove(b)
        self.samples_pushed += samples
        self.batches_pushed += len(batches)
        self.last_success_time = time.time()
        if self._failing_since is not None:
            log.info("receiver_recovered", sink=self.name,
                     outage_s=round(time.monotonic() - self._failing_since, 1), attempts=attempts,
                     backlog_batches=len(self.spool))
            self._failing_since = None

    def _post(self, body: bytes) -> None:
        started = time.monotonic()
        try:
            response = self.http.request("POST", self.url, data=body, headers=CONTENT_HEADERS)
            self.http.check(response)
        except Retryable as exc:
            self.failures[exc.reason] += 1
            if self._failing_since is None and not self._stop.is_set():
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
            *(s("gpu_sidecar_spool_bytes", self.spool.bytes(state), ("state", state))
              for state in STATES),
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
