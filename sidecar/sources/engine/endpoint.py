"""The serving engine's metrics endpoint, read by a thread of its own.

The agent's cycle never waits for an engine: each endpoint has a reader thread that GETs it once
per interval (``--engine-metrics-timeout`` bounds the whole request, ``--engine-metrics-max-bytes``
the answer), parses what came and keeps the last figures; a cycle only copies them. Figures
older than two intervals and a timeout (a read that hangs) are not exported, nor any after a
failed read: a stalled engine's last reading is not passed off as current. Every failure is
counted by reason; a failing endpoint is logged when the condition starts and when it ends
(at the 1st, 10th, 100th... episode of a flapping one), never once per read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import structlog

from sidecar.log import Episodes
from sidecar.metrics import ENGINE_SERIES
from sidecar.samples import Labels, LatencyHistogram, Series, histogram_series
from sidecar.sources.engine.families import ENGINES, absent_reason
from sidecar.sources.engine.parse import (
    MAX_SAMPLES,
    EngineFigures,
    Malformed,
    TooLarge,
    decoded,
    figures_of,
)
from sidecar.urls import redact_url

log = structlog.get_logger("sidecar.engine")

_ENGINE_TITLES = ", ".join(e.title or e.name for e in ENGINES)
# why a read gave no figures; every reason is exported at 0 from the start
REASONS = ("unreachable", "timeout", "too_large", "malformed", "not_an_engine", "redirect",
           "credentials", "http_status")
HINTS = {
    "unreachable": "is the engine running, and is its metrics port right? (vLLM serves /metrics "
                   "on its API port, SGLang needs --enable-metrics, Triton uses port 8002, "
                   "llama-server needs --metrics)",
    "timeout": "the engine answers too slowly: raise --engine-metrics-timeout, or check the "
               "engine's load",
    "too_large": "raise --engine-metrics-max-bytes if the engine's metrics are really that "
                 f"large (many models or LoRA adapters); more than {MAX_SAMPLES} samples of the "
                 "families read are never parsed (the agent's memory bound)",
    "malformed": "the endpoint does not serve the Prometheus text format: check the URL's path "
                 "(usually /metrics; trtllm-serve's is /prometheus/metrics, its /metrics "
                 "answers JSON); a series given twice means two scrapes joined (a proxy) or an "
                 "exporter's bug",
    "not_an_engine": "the endpoint serves metrics of another program: point "
                     f"--engine-metrics-url at one of {_ENGINE_TITLES}",
    "redirect": "the endpoint redirects, which the agent never follows: give the final URL",
    "credentials": "the endpoint asks for credentials, which the agent does not send to an "
                   "engine: expose the metrics without authentication on localhost",
    "http_status": "the endpoint answered with an error: check the URL's path",
}


@dataclass(frozen=True, slots=True)
class Fetched:
    """One GET's outcome as the HTTP layer gives it: an answer, or the problem that left none
    (``wiring`` adapts ``sinks.http`` to this, so that no source imports a sink)."""

    status: int = 0
    body: bytes = b""  # as sent: compressed if the engine compressed it
    location: str = ""
    encoding: str = ""  # the answer's Content-Encoding
    max_bytes: int = 0  # the body's decoded size may reach this (0: the body's own size)
    problem: tuple[str, str] | None = None  # (reason among REASONS, what happened)


Fetch = Callable[[str], Fetched]


def endpoint_label(url: str) -> str:
    """host:port of the URL (and its path, unless /metrics), its label on every series: two
    engines in a pod stay apart."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return host if parts.path in ("", "/", "/metrics") else host + parts.path


class EngineEndpoint:
    """One engine's metrics endpoint: its reader thread and its last figures."""

    def __init__(self, url: str, fetch: Fetch, *, interval_s: float, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.url = url
        self.label = endpoint_label(url)
        self.fetch = fetch
        self.interval_s = interval_s
        self.stale_after_s = 2 * interval_s + timeout_s
        self.clock = clock
        self.failures = dict.fromkeys(REASONS, 0)
        self.last: EngineFigures | None = None
        self.last_ok_at: float | None = None
        self.read_s = 0.0
        self._failing = Episodes()
        self._failing_since: float | None = None
        self._said: set[str] = set()  # reasons logged in this episode
        self._found = ""  # the engine logged as found
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the reader ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"engine {self.label}",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 1.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            began = self.clock()
            try:
                self.read_once()
            except Exception:  # a bug here must not end the reads
                log.exception("engine_metrics_bug", endpoint=self.label,
                              hint="a bug: please report it with this log line")
            took = self.clock() - began
            # once per interval; a read longer than one is followed by a whole interval's rest,
            # never by the next read at once (an endpoint slow to parse costs at most half a core)
            self._stop.wait(self.interval_s - took if took < self.interval_s else self.interval_s)

    def read_once(self) -> None:
        began = self.clock()
        got = self.fetch(self.url)
        problem = got.problem or self._answer_problem(got)
        figures = None
        if problem is None:
            try:
                figures, prefixes = figures_of(decoded(got.body, got.encoding, got.max_bytes))
            except TooLarge as exc:
                problem = ("too_large", str(exc))
            except (Malformed, ValueError) as exc:  # the parser's own errors included
                problem = ("malformed", f"not the Prometheus text format: {exc}")
            else:
                if figures is None:
                    seen = ", ".join(sorted(prefixes)[:8]) or "no metric at all"
                    problem = ("not_an_engine", f"no family of {_ENGINE_TITLES} "
                               f"(metric names seen start with: {seen})")
        del got  # the body is not kept beyond the parse
        self.read_s = self.clock() - began
        if problem is None and figures is not None:
            self._succeeded(figures)
        else:
            assert problem is not None
            self._failed(*problem)

    @staticmethod
    def _answer_problem(got: Fetched) -> tuple[str, str] | None:
        if 300 <= got.status < 400:
            where = f" to {redact_url(got.location)}" if got.location else ""
            return "redirect", f"HTTP {got.status}: redirects{where}"
        if got.status in (401, 403, 407):
            return "credentials", f"HTTP {got.status}: asks for credentials"
        if got.status != 200:
            return "http_status", f"HTTP {got.status}"
        return None

    @property
    def engine_name(self) -> str:
        """The engine last recognised here ("" before): kept while it fails, so that its
        gpu_sidecar_engine_up series reads 0 rather than changing its labels."""
        return self._found

    def _succeeded(self, figures: EngineFigures) -> None:
        self.last_ok_at = self.clock()
        self.last = figures
        if self._failing.ended():
            log.info("engine_metrics_recovered", endpoint=self.label, engine=figures.engine,
                     failed_for_s=round(self.clock() - (self._failing_since or self.clock()), 1))
        self._failing_since = None
        self._said.clear()
        if self._found != figures.engine:
            self._found = figures.engine
            # every figure of ours this engine gave no value for, and why: absent, never zero
            missing = {f: _absent(figures.engine, f) for f in ENGINE_SERIES if f not in figures.figures}
            log.info("engine_metrics_found", endpoint=self.label, engine=figures.engine,
                     models=figures.models, figures=sorted(figures.figures),
                     not_exposed=missing, left_out=list(figures.left_out))

    def _failed(self, reason: str, detail: str) -> None:
        self.failures[reason] += 1
        self.last = None  # the engine's state is unknown now: no figure passes for current
        started = self._failing.started()
        if self._failing_since is None:
            self._failing_since = self.clock()
        if (started or (self._failing.active and self._said)) and reason not in self._said:
            self._said.add(reason)
            log.warning("engine_metrics_failing", endpoint=self.label, reason=reason,
                        detail=detail, failures=self.failures[reason],
                        effect="no engine figures until it answers; GPU sampling goes on",
                        hint=HINTS[reason])

    # -- what a cycle takes --------------------------------------------------------------------

    def current(self) -> EngineFigures | None:
        """The last figures, unless they are older than two intervals and a timeout."""
        last, at = self.last, self.last_ok_at  # once: the reader thread may change them
        if last is None or at is None or self.clock() - at > self.stale_after_s:
            return None
        return last


def _absent(engine: str, figure: str) -> str:
    return next((absent_reason(e, figure) for e in ENGINES if e.name == engine), "not exposed")


class EngineSource:
    """Every configured engine endpoint: started with the agent, copied by each cycle."""

    def __init__(self, endpoints: list[EngineEndpoint]) -> None:
        self.endpoints = endpoints

    def start(self) -> None:
        for e in self.endpoints:
            e.start()

    def stop(self) -> None:
        for e in self.endpoints:
            e._stop.set()
        for e in self.endpoints:
            e.stop()

    def current(self) -> list[tuple[str, EngineFigures]]:
        """(endpoint label, figures) of every endpoint with current figures."""
        return [(e.label, f) for e in self.endpoints if (f := e.current()) is not None]

    def series(self, ts: int, pod: Labels) -> list[Series]:
        out: list[Series] = []
        for e in self.endpoints:
            figures = e.current()
            if figures is not None:
                out.extend(engine_series(figures, e.label, pod, ts))
            labels = tuple(sorted((*pod, ("endpoint", e.label), ("engine", e.engine_name))))
            out.append(Series(name="gpu_sidecar_engine_up", labels=labels,
                              value=1.0 if figures is not None else 0.0, timestamp_ms=ts))
            out.append(Series(name="gpu_sidecar_engine_read_duration_seconds",
                              labels=tuple(sorted((*pod, ("endpoint", e.label)))),
                              value=e.read_s, timestamp_ms=ts))
            for reason, n in e.failures.items():
                out.append(Series(name="gpu_sidecar_engine_read_failures_total",
                                  labels=tuple(sorted((*pod, ("endpoint", e.label),
                                                       ("reason", reason)))),
                                  value=float(n), timestamp_ms=ts))
        return out


def engine_series(figures: EngineFigures, endpoint: str, pod: Labels, ts: int
                  ) -> Iterator[Series]:
    """Our engine series of one endpoint's figures, labelled engine, endpoint and model."""
    base = (*pod, ("engine", figures.engine), ("endpoint", endpoint))
    for name, by_model in figures.figures.items():
        for model, value in sorted(by_model.items()):
            labels = tuple(sorted((*base, ("model", model)) if model else base))
            if isinstance(value, LatencyHistogram):
                yield from histogram_series(name, labels, value, ts)
            elif ENGINE_SERIES[name][0] != "histogram":
                yield Series(name=name, labels=labels, value=value, timestamp_ms=ts)
