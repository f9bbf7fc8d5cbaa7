"""The spooled sender: batch, journal, spool, then send in order with one request in flight, the
pipeline of every push protocol that must not lose what it sampled (remote-write, OTLP), and its
self-telemetry. What an answer means is ``sidecar.sinks.answers``; the wire is
``sidecar.sinks.http``.
"""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable

import structlog
import tenacity

from sidecar.config import Config
from sidecar.durability import journal
from sidecar.durability.spool import STATES, URL_CONFIRMED, Spool, SpooledBatch
from sidecar.log import Episodes, log_count
from sidecar.samples import Labels, Series
from sidecar.sinks import IDLE_WAIT_S
from sidecar.sinks.answers import BODY_LOGGED, INITIAL_BACKOFF_S, Held, Refused, Response, Retryable, mask
from sidecar.sinks.cadence import Cadence
from sidecar.sinks.codec import Codec
from sidecar.sinks.http import Http
from sidecar.summary import is_summary
from sidecar.urls import redact_url as redact

# Prometheus' staleness marker (prometheus/model/value.StaleNaN): a NaN that no arithmetic makes,
# which a receiver that knows it stores as "this series ended here"
STALE_NAN_BITS = 0x7FF0000000000002
STALE_NAN: float = struct.unpack("<d", struct.pack("<Q", STALE_NAN_BITS))[0]
# a series last sent this long before the newest sample is stale at every receiver already
# (Prometheus' look-back, VictoriaMetrics' longest): a clean stop's markers need not end it
LOOKBACK_MS = 300_000


class SpooledSink:
    """Batch, journal, spool, then send in order with one request in flight: the pipeline of
    every push protocol that must not lose what it sampled (remote-write, OTLP).

    Sampling never waits for the network: ``emit`` appends the cycle to the open batch and to its
    journal on disk (so a crash loses at most the cycle in progress), and every push interval (or
    when the batch is full) seals the batch into the spool. A sender thread sends the spool
    oldest-first and deletes a batch only after a 2xx. While the receiver is down the spool grows
    (bounded, oldest dropped first) and the sender retries the head with backoff; when the
    receiver returns, the backlog is sent merged into requests of up to ``max_batch_samples``, in
    order, so a receiver slower than the push interval is caught up rather than left behind.

    What differs between protocols is the ``Codec`` (``sidecar.sinks.codec``): how a cycle is
    encoded (each cycle as a whole request, so that requests joined are one request), how the
    open batch keeps its cycles and a body is compressed, the headers, and what the receiver's
    answers mean."""

    # what happens to batches left at exit: the next start sends them, unless the spool is a
    # temporary directory (a demo's) that goes with this run (the wiring sets these per sink)
    left_in_spool_effect = "sent by the next start on this spool"
    set_aside_effect = ("refused by the receiver for their data in this run: not delivered, kept "
                        "for a person to look at")
    set_aside_hint = ("once the cause is fixed, `gpu-sidecar resend-rejected` with the same "
                      "configuration sends them again")

    def __init__(
        self,
        url: str,
        spool: Spool,
        cfg: Config,
        codec: Codec,
        *,
        name: str,
        push_interval_s: float = Config.push_interval,
        max_batch_samples: int = Config.batch_max_samples,
        clock: Callable[[], float] = time.monotonic,
        cadence: Cadence | None = None,
        initial_backoff_s: float = INITIAL_BACKOFF_S,
    ) -> None:
        self.url = url
        self.cadence = cadence  # the rare figures sent when they change (sinks/cadence.py)
        self.name = name
        self.codec = codec
        self.log = structlog.get_logger(f"sidecar.{codec.kind}")
        self.spool = spool
        self.http = Http(cfg)  # the receivers' credentials, headers and TLS: cfg's
        self.policy = codec.policy
        self.initial_backoff_s, self.max_backoff_s = initial_backoff_s, cfg.retry_max_backoff
        self.push_interval_s = push_interval_s
        self.max_batch_samples = max_batch_samples
        self.clock = clock
        self._batch = codec.open_batch()  # the open batch, as the codec keeps it
        self._open_samples = 0
        self._unjournaled = 0  # samples of the open batch its journal could not take
        self.last_flush = clock()
        self._last_emit: float | None = None
        self.samples_pushed = 0
        self.batches_pushed = 0
        self.failures: Counter[str] = Counter(
            {reason: 0 for reason in codec.policy.failure_reasons()})
        self.points_rejected = 0  # what receivers said they dropped from accepted requests
        self._partial_answers = 0
        self._unreadable_answers = 0  # 2xx answers whose body could not be read whole
        self.journal_records_damaged = 0  # journal records skipped at replay (cycles lost)
        self.set_aside_this_run = 0  # batches refused for their data (in rejected/)
        self.samples_set_aside_this_run = 0
        self._partial_condition: tuple[bool, str] | None = None  # the last one logged
        self._refused: tuple[int, float, int] | None = None  # status, since, attempts
        # a request was ever accepted at this URL (its spool says so): a 400 is about the data
        self._url_confirmed = (spool.dir / URL_CONFIRMED).exists()
        self.last_push_seconds = 0.0
        self.last_success_time = 0.0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._draining = threading.Event()
        self._failing_since: float | None = None
        self._journal_failures = Episodes()
        self._journal = journal.Journal(spool.dir, spool.reserve())
        # each series sent in this run, and the time of its newest sample (ms): those sent
        # within LOOKBACK_MS of the newest are what a clean stop ends (pruned at every seal)
        self._sent: dict[tuple[str, Labels], int] = {}
        self._newest_ms = 0
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
            replay = journal.Replay()
            try:
                replay = journal.read(path)
            except OSError as exc:
                self.log.error("journal_unreadable", journal=path.name, error=exc.strerror,
                          effect="the samples it held are lost")
            records = replay.records
            if replay.damaged:
                self.journal_records_damaged += replay.damaged
                self.log.error("journal_record_damaged", sink=self.name, journal=path.name,
                               cycles_lost=replay.damaged, cycles_replayed=len(records),
                               effect="the damaged records' cycles are lost; the intact records "
                                      "around them are replayed")
            samples = sum(n for _, n in records)
            if samples:
                body = self.codec.compress(b"".join(body for body, _ in records))
                if self.spool.put(body, samples, seq=seq, journaled=(path, samples)) is not None:
                    self.log.info("journal_replayed", sink=self.name, journal=path.name,
                             samples=samples, note="the open batch of a run that did not stop")
                    continue
            journal.remove(path)  # empty, unreadable, or counted as lost by the spool

    def emit(self, series: list[Series]) -> None:
        if self.cadence is not None:
            series = self.cadence.due(series)
        if self.codec.ends_series:
            sent, newest = self._sent, self._newest_ms
            for s in series:
                ts = sent[(s.name, s.labels)] = s.timestamp_ms
                if ts > newest:
                    newest = ts
            self._newest_ms = newest
        self._append(self.codec.cycle(series), len(series))

    def end_series(self) -> int:
        """A clean stop, after the last cycle: every series sent in this run that a receiver
        still holds as current (sent within ``LOOKBACK_MS`` of the newest sample) gets a
        staleness marker 1 ms after that newest sample, as Prometheus ends the series of a
        target that vanished, so that instant queries and the alerts built on them (a
        ``gpu_verdict`` at 1) end now, not when the look-back runs out. The markers are a cycle
        like any other (journal, spool, in order), so a receiver down at the stop gets them
        from the next start. Never on a kill: nothing runs then. A batch Job's run summary
        (``gpu_run_*``, sent with the last cycle to be read after it) is left to go stale with
        the look-back. The number of markers."""
        if not self.codec.ends_series:
            return 0
        with self._lock:
            newest, sent = self._newest_ms, self._sent
            self._sent = {}
        # a batch Job's run summary is read after the run (GPUJobRunBottleneck): it goes stale
        # with the look-back, as it always did
        ended = [Series(name, labels, STALE_NAN, newest + 1)
                 for (name, labels), at in sent.items()
                 if newest - at < LOOKBACK_MS and not is_summary(name)]
        if ended:
            self._append(self.codec.ended(ended), len(ended))
            self.log.info("series_ended", sink=self.name, series=len(ended),
                          timestamp_ms=newest + 1,
                          note="staleness markers: the receiver ends every series now")
        return len(ended)

    def _append(self, record: bytes, samples: int) -> None:
        """One encoded cycle into the journal and the open batch; sealed when due."""
        now = self.clock()
        with self._lock:
            self._append_journal(record, samples)
            self._batch.add(record)
            self._open_samples += samples
            # sealed at the cycle nearest to the push interval: one whose interval equals the
            # push interval seals every cycle, though its clock reads a hair early each time
            cycle_gap = now - self._last_emit if self._last_emit is not None else 0.0
            self._last_emit = now
            due = (self._open_samples >= self.max_batch_samples
                   or now - self.last_flush + cycle_gap / 2 >= self.push_interval_s)
        if due:
            self.flush(now)

    def _append_journal(self, record: bytes, samples: int) -> None:
        try:
            self._journal.append(record, samples)
            self.spool.journal_grew(self._journal.bytes)
        except OSError as exc:
            self._unjournaled += samples
            self.spool.open_batch_unjournaled(self._unjournaled)
            if self._journal_failures.started():
                self.log.error("journal_write_failed", sink=self.name, error=exc.strerror,
                          directory=str(self.spool.dir), episodes=self._journal_failures.count,
                          effect="the open batch is kept in memory only until the disk recovers: "
                                 "a crash meanwhile would lose it")
            return
        if self._journal_failures.ended():
            self.log.info("journal_write_recovered", sink=self.name)

    def flush(self, now: float | None = None) -> None:
        """Seal the open batch into the spool; the sender takes it from there. ``now``: the
        clock of the cycle that sealed it, from which the next push interval counts."""
        with self._lock:
            batch, samples = self._batch, self._open_samples
            self._batch, self._open_samples = self.codec.open_batch(), 0
            unjournaled, self._unjournaled = self._unjournaled, 0
            sealed, self._journal = self._journal, journal.Journal(self.spool.dir,
                                                                  self.spool.reserve())
            self.last_flush = self.clock() if now is None else now
            self.spool.journal_grew(0)  # the sealed journal becomes the batch put below
            if self._sent:  # forget what is stale anyway: the set stays what 5 minutes send
                oldest = self._newest_ms - LOOKBACK_MS
                if min(self._sent.values()) <= oldest:
                    self._sent = {k: at for k, at in self._sent.items() if at > oldest}
        if not samples:
            sealed.discard()
            return
        body = batch.seal()
        journaled = (sealed.path, sealed.samples) if sealed.records else None
        if self.spool.put(body, samples, seq=sealed.seq, journaled=journaled) is None:
            sealed.discard()  # counted as lost: it must not come back at the next start
        if unjournaled:  # after the put: a kill in between counts them twice, never not at all
            self.spool.open_batch_unjournaled(0)
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
        if not self._thread.is_alive():  # a request still on the wire keeps its connection
            self.http.close()
        self._journal.discard()
        self.spool.release_held()
        left = len(self.spool)
        if left:
            self.log.warning("shutdown_left_in_spool", sink=self.name, batches=left,
                             bytes=self.spool.bytes(), effect=self.left_in_spool_effect)
        if self.set_aside_this_run:
            self.log.warning("shutdown_with_batches_set_aside", sink=self.name,
                             batches=self.set_aside_this_run,
                             samples=self.samples_set_aside_this_run,
                             directory=str(self.spool.dir / "rejected"),
                             effect=self.set_aside_effect, hint=self.set_aside_hint)
        return left == 0 and not self.set_aside_this_run

    # -- sender thread ---------------------------------------------------------------------

    def _run(self) -> None:
        # the sender must never die silently: anything unexpected is logged, counted and retried
        # with the same backoff as a push (tenacity; a success starts the count afresh)
        sender = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(Exception),
            wait=self.policy.wait(initial_s=self.initial_backoff_s, max_s=self.max_backoff_s,
                                  closing=self._draining.is_set),
            stop=lambda _state: self._stop.is_set(),
            sleep=self._sleep,
            after=self._sender_failed,
            reraise=True)
        while not self._stop.is_set():
            try:
                if sender(self._send_next):
                    return
            except Exception:  # stopped while failing: already logged and counted
                return

    def _sender_failed(self, state: tenacity.RetryCallState) -> None:
        self.failures["internal"] += 1
        if self._stop.is_set():
            return  # closed: the interpreter may be finalising, say nothing more
        exc = state.outcome.exception() if state.outcome is not None else None
        self.log.error("sender_error", sink=self.name, error=repr(exc), count=state.attempt_number,
                       effect="retrying; samples wait in the spool", exc_info=exc)

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
        """tenacity's sleep: one that shutdown cuts short (the wait itself is the policy's)."""
        if self._draining.is_set():
            self._stop.wait(min(seconds, self.policy.closing_retry_s))
        else:
            self._draining.wait(seconds)

    def _give_up(self, batch: SpooledBatch) -> Callable[[object], bool]:
        def stop(_state: object) -> bool:
            # retry for as long as the spool holds the batch (the size bound may drop it) and
            # the agent is not past its shutdown deadline
            deadline = self.http.deadline
            return (self._stop.is_set() or not self.spool.holds(batch.seq)
                    or (deadline is not None and time.monotonic() >= deadline))
        return stop

    def _deliver(self, batches: list[SpooledBatch]) -> None:
        head = batches[0]
        batches, body, samples = self._merged(batches)
        attempts = 0
        response: Response | None = None
        try:
            for attempt in self.policy.retrying(
                    initial_s=self.initial_backoff_s, max_s=self.max_backoff_s,
                    stop=self._give_up(head), sleep=self._sleep, closing=self._draining.is_set):
                with attempt:
                    attempts = attempt.retry_state.attempt_number
                    # while on the wire (not while waiting to retry) the size bound leaves
                    # these batches alone: the receiver may be storing them
                    self.spool.in_flight(batches)
                    try:
                        if not all(self.spool.holds(b.seq) for b in batches):
                            return  # the bound took one while we waited: start afresh
                        response = self._post(body)
                    finally:
                        self.spool.in_flight([])
        except Refused as exc:  # about the data itself (Policy.data_refusals): others are Held
            self._refused_for_data(batches, exc)
            return
        except Retryable:
            return  # stopping, or the batch left the spool; the loop decides what is next
        self._delivered(batches, samples, attempts, response)

    def _merged(self, batches: list[SpooledBatch]) -> tuple[list[SpooledBatch], bytes, int]:
        """(the batches sent, the body, its samples): requests are cycles joined, so a merged
        backlog is its batches joined; one that cannot be read back is sent alone, as written."""
        head = batches[0]
        if len(batches) > 1:
            try:
                body = self.codec.compress(b"".join(self.codec.decompress(b.body) for b in batches))
                return batches, body, sum(b.samples for b in batches)
            except Exception:  # a batch we cannot read back: send the head alone, as written
                pass
        return [head], head.body, head.samples

    def _refused_for_data(self, batches: list[SpooledBatch], exc: Refused) -> None:
        """The receiver refused the request for its data: in a merged request, each batch is
        sent alone to find the one it objects to (the others go on); that one is set aside."""
        if len(batches) > 1:
            for b in batches:
                self._deliver([b])
                if self.spool.holds(b.seq) or self._stop.is_set():
                    return  # not delivered (stopping, or past the deadline): keep the order
            return
        head = batches[0]
        self.failures[f"http_{exc.status}"] += 1
        aside = self.spool.set_aside(head)
        self.set_aside_this_run += 1
        self.samples_set_aside_this_run += head.samples
        log_count("batch_refused", self.failures[f"http_{exc.status}"], sink=self.name,
                  url=redact(self.url), status=exc.status, receiver_said=str(exc),
                  hint=exc.hint, samples=head.samples, set_aside=str(aside),
                  effect="later batches keep flowing")

    def _delivered(self, batches: list[SpooledBatch], samples: int, attempts: int,
                   response: Response | None) -> None:
        # accepted: the batches leave the spool before anything else is read of the answer,
        # so that nothing going wrong afterwards can send them again
        for b in batches:
            self.spool.remove(b)
        self.samples_pushed += samples
        self.batches_pushed += len(batches)
        if not self.last_success_time:  # the first of this run: the receiver takes what we send
            self.log.info("first_push_delivered", sink=self.name, url=redact(self.url),
                          samples=samples, batches=len(batches), attempts=attempts)
        self.last_success_time = time.time()
        if self._failing_since is not None:
            self.log.info("receiver_recovered", sink=self.name,
                          outage_s=round(time.monotonic() - self._failing_since, 1),
                          attempts=attempts, backlog_batches=len(self.spool))
            self._failing_since = None
        if response is not None:
            try:
                self._accepted(response)
            except Exception as exc:  # an answer we cannot read: the request was stored all the same
                self.failures["internal"] += 1
                self.log.exception("answer_unreadable", sink=self.name, error=repr(exc),
                                   effect="the batch was accepted (2xx) and is not sent again")

    def _accepted(self, response: Response) -> None:
        """A 2xx may still say that part of the request was dropped, or warn (OTLP's
        partial_success): the rejected points are counted, and each condition is logged once
        (points rejected, or a warning only; a new message is a new condition), not once per
        batch. A 2xx whose body could not be read whole is delivered all the same: counted as
        ``internal``, logged at the 1st, 10th, 100th ... such answer (a receiver that always
        trickles its answers must not log one line per push)."""
        if response.unread is not None:
            self.failures["internal"] += 1
            self._unreadable_answers += 1
            log_count("answer_unreadable", self._unreadable_answers, sink=self.name,
                      error=response.unread,
                      effect="the batch was accepted (2xx) and is not sent again")
            return
        partial = self.codec.partial(response)
        if partial is None:
            return
        rejected, message = partial
        self.points_rejected += max(0, rejected)
        self._partial_answers += 1
        condition = (rejected > 0, message)
        if condition == self._partial_condition:
            return
        self._partial_condition = condition
        said = mask(message, self.http.secrets(self.url))[:BODY_LOGGED].strip()
        if rejected > 0:
            self.log.error("partial_success", sink=self.name, url=redact(self.url),
                           points_rejected=rejected, points_rejected_total=self.points_rejected,
                           answers=self._partial_answers, receiver_said=said,
                           effect="the rest of the request was stored; the rejected points are "
                                  "not sent again (the receiver would refuse them again)")
        else:
            self.log.warning("partial_success", sink=self.name, url=redact(self.url),
                             points_rejected=0, answers=self._partial_answers,
                             receiver_said=said,
                             effect="the whole request was stored; the receiver warns")

    def _post(self, body: bytes) -> Response:
        started = time.monotonic()
        try:
            response = self.http.request("POST", self.url, data=body, headers=self.codec.headers)
            self.http.check(response, self.policy)
        except Retryable as exc:
            self._refusal_ended()
            self.failures[exc.reason] += 1
            if self._failing_since is None and not self._stop.is_set():
                self._failing_since = started
                self.log.warning("push_failing", sink=self.name, reason=exc.reason, detail=str(exc),
                            retry_after_s=exc.retry_after,
                            retry_after_honoured_s=(None if exc.retry_after is None else
                                                    min(exc.retry_after,
                                                        self.policy.retry_after_cap_s)),
                            effect="retrying with backoff; samples wait in the spool")
            raise
        except Refused as exc:
            if exc.about_data and exc.status == 400 and not self._url_confirmed:
                exc = self._url_or_data(exc)
            if exc.about_data:
                self._refusal_ended()
                raise
            self._hold(exc)
            raise Held(exc) from None
        finally:
            self.last_push_seconds = time.monotonic() - started
        self._confirm_url()
        self._refusal_ended()
        return response

    def _confirm_url(self) -> None:
        """Remember, in the spool, that this URL took a request: after a restart, a 400 for a
        bad first batch is then about the data at once, not checked (and held) again."""
        if self._url_confirmed:
            return
        self._url_confirmed = True
        with contextlib.suppress(OSError):
            (self.spool.dir / URL_CONFIRMED).touch()

    def _url_or_data(self, refused: Refused) -> Refused:
        """A 400 before this run had any request accepted: the URL or the data? Some receivers
        answer an unknown path with 400 (VictoriaMetrics: "unsupported path"), and setting the
        whole backlog aside for a typo in the URL would lose it. So ask the receiver once more,
        with an empty request of the same protocol (it stores nothing): accepted, the URL is
        right and the 400 was about the data; refused too, the URL is wrong and every batch is
        kept (``Held``). A network failure meanwhile is retried like any other."""
        try:
            response = self.http.request("POST", self.url, data=self.codec.compress(b""),
                                         headers=self.codec.headers)
            self.http.check(response, self.policy)
        except Retryable as exc:  # the network meanwhile: counted like any failed attempt
            self.failures[exc.reason] += 1
            raise
        except Refused as again:
            return Refused(refused.status, str(refused),
                           "the receiver refuses even an empty request at this URL (HTTP "
                           f"{again.status}), so it objects to the URL, not the data: "
                           f"{self.policy.url_hint(self.url)}", about_data=False)
        self._confirm_url()
        return refused

    def _hold(self, exc: Refused) -> None:
        """A refusal that is not about the data: counted per attempt, logged once when it starts
        (or its status changes); every batch stays in the spool."""
        self.failures[f"http_{exc.status}"] += 1
        if self._refused is not None and self._refused[0] == exc.status:
            status, since, attempts = self._refused
            self._refused = (status, since, attempts + 1)
            return
        self._refusal_ended()
        self._refused = (exc.status, time.monotonic(), 1)
        if self._stop.is_set():
            return
        self.log.error("push_refused", sink=self.name, url=redact(self.url), status=exc.status,
                       receiver_said=str(exc), hint=exc.hint, backlog_batches=len(self.spool),
                       retry_every_s=self.max_backoff_s,
                       effect="every batch stays in the spool (within its bound) and is sent "
                              "once the receiver accepts")

    def _refusal_ended(self) -> None:
        if self._refused is None:
            return
        status, since, attempts = self._refused
        self._refused = None
        self.log.info("push_refused_ended", sink=self.name, url=redact(self.url), status=status,
                      refused_for_s=round(time.monotonic() - since, 1), attempts=attempts,
                      backlog_batches=len(self.spool))

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
            s("gpu_sidecar_spool_write_failing", float(self.spool.write_failing)),
            s("gpu_sidecar_push_duration_seconds", self.last_push_seconds),
            s("gpu_sidecar_journal_records_damaged_total", self.journal_records_damaged),
        ]
        if self.last_success_time:
            out.append(s("gpu_sidecar_last_push_success_timestamp_seconds", self.last_success_time))
        for reason, n in sorted(self.failures.items()):
            out.append(s("gpu_sidecar_push_failures_total", n, ("reason", reason)))
        dropped = Counter(self.spool.dropped_samples)
        for reason in self.codec.drop_reasons:
            dropped[reason] = self.codec.dropped.get(reason, 0)
        if "partial_success" in self.codec.drop_reasons:
            dropped["partial_success"] = self.points_rejected
        for reason, n in sorted(dropped.items()):
            out.append(s("gpu_sidecar_samples_dropped_total", n, ("reason", reason)))
        return out
