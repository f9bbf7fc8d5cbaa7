"""Long-term storage as a source for ``diagnose --query-url`` and ``fleet``: the Prometheus HTTP
query API (``/api/v1/query``), which Prometheus, VictoriaMetrics (single node and the cluster's
``select`` path), Mimir and Thanos all serve, so one client works against each unchanged.

Requests go through ``sidecar.sinks.http.Http``: the receivers' credentials (bearer token file,
basic auth, ``--header`` such as ``X-Scope-OrgID``), TLS, masked secrets, and a deadline over the
whole request (``--query-timeout``), so a store that trickles its answer cannot hold the command.
No retry: a person waits at a terminal, and one clear failure beats a minute of silent tries.

What the store answers becomes one of four outcomes, each its own exception and exit code (see
``EXIT_CODES``): an answer, no answer (unreachable, too slow: 6), credentials refused (401, 403:
7), the query refused (400, 413, 422, 503 with the store's reason: too many series, too long a
range: 8). An answer is checked whole before anything reads it: one in a shape no query API
answers (a value that is not a number, a series twice as a proxy merging two stores gives) is
exit 6, saying what was wrong, never a verdict from figures it did not really hold.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlencode, urlsplit

from sidecar.config import Config
from sidecar.sinks.answers import Retryable
from sidecar.sinks.http import Http
from sidecar.urls import redact_url

ANSWER_MAX_BYTES = 256 << 20  # a query's answer is read up to this; larger: narrow the query
GPU_LABELS = ("gpu_uuid", "gpu_name", "gpu_index")  # only the GPU series carry these
EXIT_UNREACHABLE, EXIT_DENIED, EXIT_REFUSED = 6, 7, 8
EXIT_CODES = {EXIT_UNREACHABLE: "the store did not answer within --query-timeout (unreachable, "
                                "too slow, or an answer that is no query API's, or in a "
                                "shape no query API answers)",
              EXIT_DENIED: "the store refused the credentials (401, 403)",
              EXIT_REFUSED: "the store refused the query (400, 413, 422, 503: too many series, "
                            "too long a range, a bad expression)"}


class StoreError(Exception):
    """Why the store gave no answer; ``code`` is the command's exit code."""

    code = EXIT_UNREACHABLE


class StoreUnreachable(StoreError):
    code = EXIT_UNREACHABLE


class StoreDenied(StoreError):
    code = EXIT_DENIED


class StoreRefused(StoreError):
    code = EXIT_REFUSED


@dataclass(frozen=True)
class Point:
    """One stored sample: Unix seconds and value."""

    t: float
    v: float


@dataclass(frozen=True)
class Row:
    """One series of an answer: its labels (``__name__`` included where the store kept it) and
    its samples (one for an instant vector)."""

    labels: tuple[tuple[str, str], ...]
    points: tuple[Point, ...]

    @property
    def name(self) -> str:
        return dict(self.labels).get("__name__", "")

    def label(self, key: str) -> str:
        return dict(self.labels).get(key, "")

    @property
    def value(self) -> float:
        return self.points[-1].v


def matchers(select: Sequence[tuple[str, str, str]], *, skip: Sequence[str] = ()) -> str:
    """The ``--select`` matchers as PromQL (``namespace="prod",pod=~"web-.*"``), without the
    labels in ``skip`` (the GPU's, for series the pod exports: the engine's)."""
    return ",".join(f"{label}{op}{json.dumps(value)}" for label, op, value in select
                    if label not in skip)


def selector(name_or_regex: str, select: Sequence[tuple[str, str, str]], *extra: str,
             skip: Sequence[str] = ()) -> str:
    """``{__name__=~"...", <select>, <extra>}``: a name or a regex of names, always as a
    ``__name__`` matcher (it works on every engine, for one name or several)."""
    op = "=~" if any(c in name_or_regex for c in "|.*+") else "="
    parts = [f"__name__{op}{json.dumps(name_or_regex)}", *extra]
    if m := matchers(select, skip=skip):
        parts.append(m)
    return "{" + ",".join(parts) + "}"


def duration(seconds: float) -> str:
    """A PromQL duration in whole seconds (at least 1s)."""
    return f"{max(1, round(seconds))}s"


class Store:
    """One store's query API, counting the queries it made (the fleet view promises a fixed
    number whatever the fleet's size, and the benchmark reports it)."""

    def __init__(self, cfg: Config) -> None:
        assert cfg.query_url
        self.url = cfg.query_url.rstrip("/")
        self.shown = redact_url(self.url)
        self.timeout_s = cfg.query_timeout
        self.http = Http(cfg, timeout_s=cfg.query_timeout, max_answer_bytes=ANSWER_MAX_BYTES)
        self.queries = 0
        self.seconds = 0.0  # spent waiting for answers

    def close(self) -> None:
        self.http.close()

    def query(self, expr: str, at: float) -> list[Row]:
        """An instant query at ``at``: a vector (one point per row) or, for a range selector, a
        matrix (every sample in the range). POST, so a long selector fits."""
        self.queries += 1
        body = urlencode({"query": expr, "time": f"{at:.3f}"}).encode()
        started = time.monotonic()
        failure: StoreError | None = None
        try:
            answer = self.http.request(
                "POST", f"{self.url}/api/v1/query", data=body,
                headers={"Content-Type": "application/x-www-form-urlencoded",
                         "Accept": "application/json"})
        except Retryable as exc:  # no answer: its text names the push's option, not ours
            failure = StoreUnreachable(str(exc).replace("--push-timeout", "--query-timeout"))
        finally:
            self.seconds += time.monotonic() - started
        if failure is not None:
            raise failure
        return self._rows(answer.status_code, answer.content, answer.unread)

    def _said(self, content: bytes) -> str:
        """The store's own reason (its JSON ``error``, or the start of its text), secrets
        masked: a proxy may echo the request."""
        text = content[:2000].decode("utf-8", "replace")
        try:
            doc = json.loads(text)
            if isinstance(doc, dict) and doc.get("error"):
                text = str(doc["error"])
        except ValueError:
            pass
        for secret in self.http.secrets(self.url):
            text = text.replace(secret, "***")
        return " ".join(text.split())[:400]

    def _rows(self, status: int, content: bytes, unread: str | None) -> list[Row]:
        where = self.shown
        if status in (401, 403):
            raise StoreDenied(
                f"{where} refused the credentials ({status}: {self._said(content)}): give the "
                "ones it expects with --bearer-token-file, --basic-auth-user and "
                "--basic-auth-password-file, and the tenant with --header X-Scope-OrgID=TENANT "
                "(Mimir, a gateway) or in the URL's path (VictoriaMetrics cluster: "
                "/select/TENANT/prometheus)")
        if status == 404:
            raise StoreUnreachable(
                f"{where}/api/v1/query does not exist (404): --query-url is the base of the "
                f"Prometheus query API{_write_hint(self.url)}, e.g. http://victoria-metrics:8428, "
                "http://vmselect:8481/select/0/prometheus, http://mimir/prometheus")
        if status in (400, 405) and not _api_error(content):
            # no query API's refusal (those are JSON: {"status": "error", ...}): the URL names
            # something else, such as VictoriaMetrics' "unsupported path" for a write URL
            raise StoreUnreachable(
                f"{where}/api/v1/query answered {status} with no query API's error "
                f"({self._said(content)}): --query-url is not the base of a Prometheus query API"
                f"{_write_hint(self.url)}; e.g. http://victoria-metrics:8428, "
                "http://vmselect:8481/select/0/prometheus, http://mimir/prometheus")
        if status in (400, 413, 422, 503) or 400 <= status < 500:
            raise StoreRefused(
                f"{where} refused the query ({status}: {self._said(content)}): narrow it with "
                "--select (fewer GPUs) or a shorter --duration, or raise the store's limits "
                "(VictoriaMetrics -search.maxUniqueTimeseries, -search.maxSamplesPerQuery; "
                "Prometheus --query.max-samples, --query.timeout)")
        if status != 200:
            raise StoreUnreachable(f"{where} answered {status}: {self._said(content)}")
        if unread is not None and "longer than" in unread:
            raise StoreRefused(f"{where}: {unread}; narrow the query with --select or a shorter "
                               "--duration")
        if unread is not None:  # the deadline passed while the answer came in
            raise StoreUnreachable(
                f"{where} did not send its whole answer within --query-timeout "
                f"{self.timeout_s:g} s (a store too slow, or a proxy trickling it): raise "
                "--query-timeout, or ask less with --select or a shorter --duration")
        try:
            return _read_answer(json.loads(content))
        except (ValueError, RecursionError) as exc:  # json's errors are ValueErrors too
            raise StoreUnreachable(f"{where} answered 200 with something that is no Prometheus "
                                   f"query API answer ({_brief(exc)}): check --query-url"
                                   ) from None


WRITE_PATHS = ("/api/v1/write", "/api/v1/push", "/write", "/insert", "/v1/metrics",
               "/metrics/job")  # the receivers' write paths, never a query API's base


def _write_hint(url: str) -> str:
    path = urlsplit(url).path.rstrip("/")
    if any(path.endswith(w) or f"{w}/" in path for w in WRITE_PATHS):
        return (f" (its path {path} is a write path, where agents push: give the store's base, "
                "without it)")
    return ""


def _api_error(content: bytes) -> bool:
    """Whether a refusal is a query API's own: a JSON error document."""
    try:
        doc = json.loads(content[:1 << 20])
    except (ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and doc.get("status") == "error"


class _Malformed(ValueError):
    """What in an answer is not the query API's shape (said in the exit-6 message)."""


def _brief(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."


def _quoted(value: object) -> str:
    try:
        text = json.dumps(value)
    except (ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _read_answer(doc: object) -> list[Row]:
    """The answer's rows, every part checked against the query API's shape: a value that is not
    a number, labels that are not strings, a timestamp that is not one, a series twice (a proxy
    merging two stores) or a sample twice in a series. A wrong part raises ``_Malformed``, never
    a guess: a verdict read from figures the answer did not really hold could be a wrong
    'healthy' (or every GPU 'lost')."""
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), dict):
        raise _Malformed(f"no 'data' object: {_quoted(doc)}")
    data = doc["data"]
    kind, result = data.get("resultType"), data.get("result")
    if kind == "scalar":
        return [Row((), (_point(result, "result"),))]
    if kind not in ("matrix", "vector"):
        raise _Malformed(f"resultType {_quoted(kind)}, which no query here asks for")
    if not isinstance(result, list):
        raise _Malformed(f"result is {_quoted(result)}, not a list")
    rows: list[Row] = []
    seen: dict[tuple[tuple[str, str], ...], int] = {}
    for i, r in enumerate(result):
        where = f"result[{i}]"
        if not isinstance(r, dict):
            raise _Malformed(f"{where} is {_quoted(r)}, not an object")
        labels = _labels(r.get("metric"), where)
        if labels in seen:
            raise _Malformed(f"{where} has the labels of result[{seen[labels]}] "
                             f"({_quoted(dict(labels))}): the same series twice, as a proxy "
                             "merging two stores answers; ask one store")
        seen[labels] = i
        if "value" not in r and "values" not in r and ("histogram" in r or "histograms" in r):
            continue  # a native histogram's samples only (Prometheus): no float figure here
        if kind == "vector":
            points: tuple[Point, ...] = (_point(r.get("value"), f"{where}.value"),)
        else:
            values = r.get("values")
            if not isinstance(values, list) or not values:
                raise _Malformed(f"{where}.values is {_quoted(values)}, not a list of samples")
            points = tuple(_point(v, f"{where}.values[{j}]") for j, v in enumerate(values))
            for j, (a, b) in enumerate(itertools.pairwise(points)):
                if b.t <= a.t:
                    raise _Malformed(f"{where}.values[{j + 1}] at {b.t:.3f} does not follow "
                                     f"the sample at {a.t:.3f}: a series' samples out of order "
                                     "or twice, as a proxy merging two stores answers")
        rows.append(Row(labels, points))
    return rows


def _point(pair: object, where: str) -> Point:
    """A ``[unix seconds, "value"]`` pair: the time a finite number, the value a number's text
    (``"NaN"`` and ``"+Inf"`` included: the store's own, read by whoever judges the figure)."""
    if not isinstance(pair, list) or len(pair) != 2:
        raise _Malformed(f"{where} is {_quoted(pair)}, not a [time, value] pair")
    t, v = pair
    try:
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
            raise ValueError
        when = float(t)
    except (ValueError, OverflowError):  # an int of 400 digits is no time either
        raise _Malformed(f"{where} has the time {_quoted(t)}, not a number of seconds") from None
    try:
        if isinstance(v, bool) or not isinstance(v, str | int | float):
            raise ValueError
        return Point(when, float(v))
    except (ValueError, OverflowError):
        raise _Malformed(f"{where} has the value {_quoted(v)}, not a number") from None


def _labels(metric: object, where: str = "result") -> tuple[tuple[str, str], ...]:
    if not isinstance(metric, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metric.items()):
        raise _Malformed(f"{where}.metric is {_quoted(metric)}, not an object of label strings")
    return tuple(sorted(metric.items()))
