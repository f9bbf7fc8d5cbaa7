"""Pushgateway sink: the latest value of every series, grouped by job and pod.

The Pushgateway refuses timestamps and keeps only the last push of a group, so this sink has no
history and no spool: each push replaces the group with the newest cycle. For history (and for
nothing lost during an outage) use remote-write. It never forgets a group by itself, so
``--pushgateway-delete-on-exit`` deletes this pod's group at shutdown; a batch Job's group is
kept, holding only the run summary after the Job's last push.

A Job's run summary is pushed once, at the end, when nothing comes after it: a Pushgateway that
is out during the few seconds of the Job's shutdown must not lose it without a word. The final
push is therefore retried with the same policy as every push (``answers.REMOTE_WRITE``, waits cut
short while closing) until the shutdown deadline, and its fate is logged once: delivered after
retries (info), or lost for this sink (an error naming the Job), with ``close`` returning False.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import structlog
import tenacity
from prometheus_client import CollectorRegistry, delete_from_gateway, push_to_gateway
from prometheus_client.metrics_core import Metric

from sidecar.config import Config
from sidecar.metrics import BY_NAME, histogram_of
from sidecar.samples import Labels, Series
from sidecar.sinks import IDLE_WAIT_S
from sidecar.sinks.answers import FAILURE_REASONS, INITIAL_BACKOFF_S, REMOTE_WRITE, Refused, Retryable
from sidecar.sinks.http import MIN_REQUEST_S, Http
from sidecar.summary import is_summary
from sidecar.urls import redact_url as redact

log = structlog.get_logger("sidecar.pushgateway")


def family_of(name: str) -> tuple[str, str]:
    """(family name, type) for a series name, as prometheus_client wants them."""
    histogram = histogram_of(name)
    if histogram is not None:
        return histogram[0], "histogram"
    spec = BY_NAME.get(name)
    if spec is None:
        return name, "untyped"
    if spec.kind == "counter":
        return name.removesuffix("_total"), "counter"
    return name, spec.kind


class _Latest:
    """A collector that exposes one cycle's series (without timestamps)."""

    def __init__(self) -> None:
        self.series: list[Series] = []

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for s in self.series:
            family, kind = family_of(s.name)
            metric = families.get(family)
            if metric is None:
                spec = BY_NAME.get(family) or BY_NAME.get(s.name)
                metric = families[family] = Metric(family, spec.help if spec else s.name, kind)
            metric.add_sample(s.name, dict(s.labels), s.value)
        return iter(families.values())


@dataclass
class _Outcome:
    """How a push of the latest values went: kept up to date while it is being retried, so that
    ``close`` can tell what it knows even of a push still on the wire at the deadline."""

    delivered: bool = False
    attempts: int = 0
    reason: str | None = None  # the last failure's reason (``failures`` label), when one failed
    detail: str | None = None  # what the network or the Pushgateway said, masked


class PushgatewaySink:
    def __init__(
        self,
        url: str,
        cfg: Config,
        *,
        job: str = Config.pushgateway_job,
        grouping: dict[str, str] | None = None,
        push_interval_s: float = Config.push_interval,
        delete_on_exit: bool = False,
        summary_at_exit: bool = False,
        clock: Callable[[], float] = time.monotonic,
        initial_backoff_s: float = INITIAL_BACKOFF_S,
    ) -> None:
        self.url = url.rstrip("/")
        self.name = "pushgateway"
        self.job = job
        self.grouping = dict(grouping or {}) or {"instance": socket.gethostname()}
        self.http = Http(cfg)  # the receivers' credentials, headers and TLS: cfg's
        self.initial_backoff_s, self.max_backoff_s = initial_backoff_s, cfg.retry_max_backoff
        self.push_interval_s = push_interval_s
        self.delete_on_exit = delete_on_exit
        self.summary_at_exit = summary_at_exit
        self.clock = clock
        self.pushes = 0
        self.failures: Counter[str] = Counter({reason: 0 for reason in FAILURE_REASONS})
        self.last_success_time = 0.0
        self.last_push_seconds = 0.0
        self._latest = _Latest()
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self._latest)  # type: ignore[arg-type]
        self._pending: list[Series] | None = None
        self._unpushed = False  # _latest holds values not yet accepted by the Pushgateway
        self._last_emit = -1e18
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="sender-pushgateway", daemon=True)
        self._final: threading.Thread | None = None
        self._done = threading.Event()
        self._closed = threading.Event()  # close() waits no longer: the final push stops too
        self._final_push = _Outcome()
        self._summary_pushed = False  # a push that carried the run summary was accepted
        self._reported = False

    def start(self) -> None:
        self._thread.start()

    def emit(self, series: list[Series]) -> None:
        now = self.clock()
        with self._lock:
            self._pending = series
            due = now - self._last_emit >= self.push_interval_s
            if due:
                self._last_emit = now
        if due:
            self._wake.set()

    def _handler(self, url: str, method: str, timeout: float | None, headers: list[tuple[str, str]],
                 data: bytes) -> Callable[[], None]:
        def send() -> None:
            response = self.http.request(method, url, data=data, headers=dict(headers))
            self.http.check(response)
        return send

    def _retrying(self, *, stop: Callable[[Any], bool], sleep: Callable[[float], object],
                  closing: Callable[[], bool] = lambda: False) -> Any:
        """The Pushgateway answers as remote-write receivers do (``answers.REMOTE_WRITE``)."""
        return REMOTE_WRITE.retrying(initial_s=self.initial_backoff_s,
                                     max_s=self.max_backoff_s, stop=stop, sleep=sleep,
                                     closing=closing)

    def _push_latest(self, stop: Callable[[Any], bool], *,
                     sleep: Callable[[float], object] | None = None,
                     closing: Callable[[], bool] = lambda: False,
                     outcome: _Outcome | None = None) -> _Outcome:
        """Push the newest values, retried until ``stop``; how it went (``outcome``, when given,
        is the one kept up to date)."""
        outcome = outcome if outcome is not None else _Outcome()
        with self._lock:
            series, self._pending = self._pending, None
        if series is not None:
            self._latest.series = series
            self._unpushed = True
        if not self._unpushed:  # also values a retry took in and then gave up on
            outcome.delivered = True
            return outcome
        started = time.monotonic()
        try:
            for attempt in self._retrying(stop=stop, sleep=sleep or self._stop.wait,
                                          closing=closing):
                with attempt:
                    outcome.attempts = attempt.retry_state.attempt_number
                    try:
                        push_to_gateway(self.url, job=self.job, registry=self._registry,
                                        grouping_key=self.grouping, handler=self._handler)
                    except Retryable as exc:
                        self.failures[exc.reason] += 1
                        outcome.reason, outcome.detail = exc.reason, str(exc)
                        if not self._failing:
                            self._failing = True
                            log.warning("pushgateway_failing", url=redact(self.url),
                                        detail=str(exc), effect="retrying with the newest values")
                        with self._lock:  # newer values arrived meanwhile: push those instead
                            if self._pending is not None:
                                self._latest.series, self._pending = self._pending, None
                        raise
        except Refused as exc:
            self._unpushed = False  # these values are refused: not again
            self.failures[f"http_{exc.status}"] += 1
            outcome.reason, outcome.detail = f"http_{exc.status}", str(exc)
            log.error("pushgateway_refused", url=redact(self.url), receiver_said=str(exc),
                      hint="a label may clash with the grouping key, or the body is invalid")
            return outcome
        except Retryable:
            return outcome
        finally:
            self.last_push_seconds = time.monotonic() - started
        self._unpushed = False
        self.pushes += 1
        if not self.last_success_time:  # the first of this run
            log.info("first_push_delivered", sink=self.name, url=redact(self.url))
        self.last_success_time = time.time()
        if self.summary_at_exit and any(is_summary(s.name) for s in self._latest.series):
            self._summary_pushed = True
        if self._failing:
            self._failing = False
            log.info("pushgateway_recovered", url=redact(self.url))
        outcome.delivered = True
        return outcome

    def _run(self) -> None:
        while not self._stop.is_set():
            # every emit and the stop set it: no periodic wake-up while idle (the long timeout
            # only bounds the harm of a wake-up that was somehow missed)
            self._wake.wait(IDLE_WAIT_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            # a new cycle supersedes a push still retrying: give up on the older values then
            try:
                self._push_latest(lambda _s: self._stop.is_set() or self._wake.is_set())
            except Exception as exc:  # the sender must never die silently
                self.failures["internal"] += 1
                if self._stop.is_set():
                    return
                log.exception("sender_error", sink=self.name, error=type(exc).__name__,
                              effect="retrying at the next cycle with the newest values")
                self._stop.wait(1.0)

    def begin_close(self, deadline: float) -> None:
        """The final push (and the group's deletion when asked) starts now, beside the other
        sinks' draining, rather than after them."""
        self.http.deadline = deadline
        self._stop.set()
        self._wake.set()

        def final() -> None:
            self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if self.summary_at_exit:
                self._keep_summary_only()
            with self._lock:
                idle = self._pending is None and not self._unpushed
            # past the deadline no request could be answered (and a push of the sender may
            # still hold the connection): nothing is tried then, and close() says so
            if idle or deadline - time.monotonic() >= MIN_REQUEST_S:
                self._push_latest(self._until(deadline), sleep=self._sleep_until(deadline),
                                  closing=lambda: True, outcome=self._final_push)
            if self.delete_on_exit:
                self._delete(deadline)
            self._done.set()

        self._final = threading.Thread(target=final, name="pushgateway-final", daemon=True)
        self._final.start()

    def _until(self, deadline: float) -> Callable[[tenacity.RetryCallState], bool]:
        """tenacity's stop for the final push: once ``close`` stopped waiting, or when no request
        could get an answer before the deadline any more."""
        def stop(_state: tenacity.RetryCallState) -> bool:
            return self._closed.is_set() or deadline - time.monotonic() < MIN_REQUEST_S
        return stop

    def _sleep_until(self, deadline: float) -> Callable[[float], object]:
        """tenacity's sleep for the final push: the policy's wait (short while closing), ended
        early so that the next attempt still has time for an answer, and by ``close``."""
        def sleep(seconds: float) -> None:
            left = deadline - time.monotonic() - MIN_REQUEST_S
            self._closed.wait(max(0.0, min(seconds, left)))
        return sleep

    def _keep_summary_only(self) -> None:
        """A finished Job's group keeps its run summary alone: its last live values would read as
        current at every scrape (and keep alerts on them firing) until the Job runs again."""
        with self._lock:
            last = self._pending if self._pending is not None else self._latest.series
            self._pending = [s for s in last if is_summary(s.name)]

    def close(self, deadline: float) -> bool:
        """True when the final values (a Job's: its run summary) reached the Pushgateway. A
        request begun just before the deadline still gets ``MIN_REQUEST_S``: waited for, so that
        the log says what became of a Job's summary before the agent exits."""
        if self._final is None:
            self.begin_close(deadline)
        assert self._final is not None
        self._final.join(timeout=max(0.0, deadline - time.monotonic()) + MIN_REQUEST_S)
        self._closed.set()
        self._stop.set()
        if self._done.is_set():  # nothing left on the wire
            self.http.close()
        final = self._final_push
        if self.summary_at_exit:
            self._report_summary(final)
            return final.delivered or self._summary_pushed
        return final.delivered and self._done.is_set()

    def _report_summary(self, final: _Outcome) -> None:
        """One line on what became of the Job's run summary at this Pushgateway: it is pushed
        once, with nothing after it, so a loss must be said where the Job's owner will look."""
        if self._reported:
            return
        self._reported = True
        named: dict[str, str] = {k: self.grouping[k] for k in ("job_name", "job_index")
                                 if k in self.grouping}
        where: dict[str, object] = {"job": self.job, **named, "grouping": self.grouping,
                                    "url": redact(self.url)}
        if final.delivered:
            if final.attempts > 1:
                log.info("run_summary_delivered", **where, attempts=final.attempts,
                         effect="the Pushgateway took the run summary after retries")
            return
        if self._summary_pushed:  # with the last live values, before the summary-only push
            log.warning("run_summary_with_last_values", **where, attempts=final.attempts,
                        reason=final.reason or "deadline", detail=final.detail,
                        effect="the group holds the run summary, and beside it the run's last "
                               "live values, which read as current until the Job runs again")
            return
        log.error("run_summary_lost", **where, attempts=final.attempts,
                  reason=final.reason or "deadline",
                  detail=final.detail or "the shutdown deadline passed before an answer",
                  effect="the Job's run summary is lost for this Pushgateway; any other "
                         "configured sink was given it with the same last cycle",
                  hint="raise --shutdown-timeout (and the pod's terminationGracePeriodSeconds) "
                       "or keep the Pushgateway reachable while Jobs end")

    def _delete(self, deadline: float) -> None:
        try:
            for attempt in self._retrying(stop=lambda _s: time.monotonic() >= deadline,
                                          sleep=time.sleep):
                with attempt:
                    delete_from_gateway(self.url, job=self.job, grouping_key=self.grouping,
                                        handler=self._handler)
            log.info("pushgateway_group_deleted", job=self.job, grouping=self.grouping)
        except (Retryable, Refused) as exc:
            log.error("pushgateway_delete_failed", detail=str(exc),
                      effect="the group stays on the Pushgateway until deleted by hand")

    def telemetry(self, ts: int, labels: Labels) -> list[Series]:
        base = tuple(sorted((*labels, ("sink", self.name))))
        out = [Series("gpu_sidecar_push_duration_seconds", base, self.last_push_seconds, ts)]
        if self.last_success_time:
            out.append(Series("gpu_sidecar_last_push_success_timestamp_seconds", base,
                              self.last_success_time, ts))
        for reason, n in sorted(self.failures.items()):
            out.append(Series("gpu_sidecar_push_failures_total",
                              tuple(sorted((*base, ("reason", reason)))), float(n), ts))
        return out
