"""HTTP delivery shared by the push sinks: connection, credentials, outcome of a response, backoff,
and the spooled pipeline (``SpooledSink``) of the protocols that must not lose a sample.

Rules (DESIGN.md, "Reliability promises"): 5xx, 429 and network errors are retried with
exponential backoff and jitter, honouring ``Retry-After`` (which answers are retried is the
protocol's: ``Answers.retried``). Any other answer is a refusal, and the spooled sinks tell two
kinds apart:

- an answer about the data itself (400, 413, 422: ``DATA_REFUSALS``) sets a batch aside in the
  spool's ``rejected/``; a merged backlog that meets one is split, each batch sent alone, and
  only the batch that is refused alone is set aside;
- any other refusal (401, 403, 404, 405, 407, 415, 501, ...) says that the receiver, the URL or
  the credentials are wrong, not the data: every batch stays in the spool and the head is
  retried every ``--retry-max-backoff`` seconds (counted per attempt as ``http_<status>``,
  logged once when it starts, with what to fix, and once when it ends), so a rotated token or a
  fixed URL delivers the whole backlog. The spool bound still applies (oldest dropped first).

Secrets are read from files (re-read when the file changes, so rotated tokens work) and never
appear in a log line or an error: URLs are logged without their user-info part.
"""

from __future__ import annotations

import base64
import contextlib
import email.utils
import http.client
import os
import select
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import unquote, urljoin, urlsplit

import structlog
import tenacity

from sidecar import __version__
from sidecar.durability import journal
from sidecar.durability.spool import STATES, Spool, SpooledBatch
from sidecar.log import Episodes, log_count
from sidecar.samples import Labels, Series
from sidecar.urls import redact_url as redact

if TYPE_CHECKING:
    import ssl

USER_AGENT = f"gpu-sidecar/{__version__}"
RETRY_AFTER_CAP_S = 300.0
IDLE_WAIT_S = 60.0


@dataclass(frozen=True)
class HttpOptions:
    timeout_s: float = 10.0
    bearer_token_file: str | None = None
    basic_auth_user: str | None = None
    basic_auth_password_file: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure_skip_verify: bool = False
    headers: tuple[tuple[str, str], ...] = ()
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0


class SecretFile:
    """A secret kept in a file (a mounted Kubernetes Secret); re-read when the file changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[float, int] | None = None
        self._value = ""

    def value(self) -> str:
        st = os.stat(self.path)
        stamp = (st.st_mtime, st.st_size)
        if stamp != self._stamp:
            with open(self.path, encoding="utf-8") as f:
                self._value = f.read().strip()
            self._stamp = stamp
        return self._value


class Retryable(Exception):
    def __init__(self, reason: str, detail: str, retry_after: float | None = None) -> None:
        super().__init__(detail)
        self.reason = reason
        self.retry_after = retry_after


class Refused(Exception):
    def __init__(self, status: int, detail: str, hint: str) -> None:
        super().__init__(detail)
        self.status = status
        self.hint = hint


class Held(Retryable):
    """A refusal that is not about the data (wrong URL, credentials, receiver): the batch stays
    in the spool and is tried again after the longest backoff."""

    def __init__(self, refused: Refused) -> None:
        super().__init__(f"http_{refused.status}", str(refused))
        self.status = refused.status
        self.hint = refused.hint


# answers about the data itself: only these set a batch aside (and split a merged request)
DATA_REFUSALS = frozenset({400, 413, 422})


@dataclass(frozen=True)
class Response:
    """What a receiver answered; only what the sinks and ``check`` look at."""

    status_code: int
    headers: Mapping[str, str]  # case-insensitive ``get``
    content: bytes
    url: str
    will_close: bool = False  # the receiver closes the connection after this answer

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


class Http:
    """HTTP/1.1 to the receivers with the configured TLS and credentials, on the standard
    library's ``http.client``: one kept-alive connection per host, one request at a time (each
    sink has one sender). ``requests`` would cost the agent about 8 MiB of resident memory for
    features a push to a known URL does not use. Proxies from ``HTTP(S)_PROXY`` are not used:
    receivers are reached directly."""

    def __init__(self, options: HttpOptions) -> None:
        self.options = options
        self._token = SecretFile(options.bearer_token_file) if options.bearer_token_file else None
        self._password = (SecretFile(options.basic_auth_password_file)
                          if options.basic_auth_password_file else None)
        self._connections: dict[tuple[str, str, int], http.client.HTTPConnection] = {}
        self._tls: ssl.SSLContext | None = None
        self._lock = threading.Lock()
        self.deadline: float | None = None  # monotonic; set at shutdown

    def headers(self) -> dict[str, str]:
        out = {"User-Agent": USER_AGENT, **dict(self.options.headers)}
        if self._token is not None:
            out["Authorization"] = f"Bearer {self._token.value()}"
        return out

    def auth(self) -> tuple[str, str] | None:
        if self.options.basic_auth_user is None:
            return None
        return (self.options.basic_auth_user, self._password.value() if self._password else "")

    def secrets(self, url: str = "") -> list[str]:
        """Every secret value this session sends, so that no receiver's answer echoing the
        request can carry one into a log line."""
        out = [v for _, v in self.options.headers]
        with contextlib.suppress(OSError):
            if self._token is not None:
                out.append(self._token.value())
            if self._password is not None:
                out.append(self._password.value())
        parts = urlsplit(url) if "@" in url else None
        if parts is not None and parts.password:
            out += [parts.password, unquote(parts.password),
                    _basic(unquote(parts.username or ""), unquote(parts.password))]
        with contextlib.suppress(OSError):
            auth = self.auth()
            if auth is not None:
                out.append(_basic(*auth))  # what an echoed "Authorization: Basic ..." carries
        return [v for v in out if len(v) >= 3]

    def request(self, method: str, url: str, *, data: bytes | None = None,
                headers: dict[str, str] | None = None) -> Response:
        """One request; redirects are never followed (a POST turned into a GET loses its body,
        and the credentials would go to a host nobody configured)."""
        parts = urlsplit(url)
        try:
            sent = {**self.headers(), **(headers or {})}
            auth = self.auth()
        except OSError as exc:  # an unreadable secret file
            raise Retryable("credentials", f"cannot read a credentials file: {exc.strerror}") from None
        if auth is None and parts.username is not None:  # credentials in the URL
            auth = (unquote(parts.username), unquote(parts.password or ""))
        if auth is not None:
            sent["Authorization"] = f"Basic {_basic(*auth)}"
        timeout = self.options.timeout_s
        if self.deadline is not None:  # shutting down: no request may outlast the deadline
            timeout = max(0.05, min(timeout, self.deadline - time.monotonic()))
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        key = (parts.scheme, parts.hostname or "", parts.port or _PORTS[parts.scheme])
        with self._lock:  # at shutdown a final push may overlap the sender's last request
            failure: Retryable | None = None
            fresh = True
            try:
                try:
                    conn = self._connection(key, timeout)
                    fresh = conn.sock is None  # a new connection: its TLS handshake comes first
                    response = self._exchange(conn, method, target, data, sent, url)
                except _CLOSED_WHILE_IDLE:
                    if fresh:
                        raise
                    # the receiver closed the kept connection as the request went out (it
                    # closes idle ones on its own schedule): once more, on a new connection
                    self._drop(key)
                    conn = self._connection(key, timeout)
                    fresh = True
                    response = self._exchange(conn, method, target, data, sent, url)
                if response.will_close:
                    self._drop(key)
            except (OSError, http.client.HTTPException) as exc:
                failure = _network_failure(exc, fresh and key[0] == "https", url)
            except ValueError as exc:  # a header or path http.client cannot send as is
                # the message would quote the header, a secret maybe: the type only
                failure = Retryable("credentials", f"{type(exc).__name__}: a header (token, "
                                    "password or --header) or the URL holds characters HTTP "
                                    "cannot carry; check the files and the URL")
            if failure is not None:
                self._drop(key)
                raise failure
        return response

    @staticmethod
    def _exchange(conn: http.client.HTTPConnection, method: str, target: str,
                  data: bytes | None, headers: dict[str, str], url: str) -> Response:
        conn.request(method, target, body=data, headers=headers)
        answer = conn.getresponse()
        return Response(answer.status, answer.headers, answer.read(), url, answer.will_close)

    def _connection(self, key: tuple[str, str, int], timeout: float) -> http.client.HTTPConnection:
        """The host's kept-alive connection, unless the receiver closed it while idle."""
        conn = self._connections.get(key)
        if conn is not None and conn.sock is not None:
            # readable while no request is out: the peer closed it (or sent junk); start afresh
            idle = select.poll()
            idle.register(conn.sock, select.POLLIN)
            if idle.poll(0):
                self._drop(key)
                conn = None
            else:
                conn.sock.settimeout(timeout)
        if conn is None:
            scheme, host, port = key
            if scheme == "https":
                conn = TlsConnection(host, port, timeout=timeout, context=self._tls_context())
            else:
                conn = http.client.HTTPConnection(host, port, timeout=timeout)
            self._connections[key] = conn
        conn.timeout = timeout
        return conn

    def _drop(self, key: tuple[str, str, int]) -> None:
        conn = self._connections.pop(key, None)
        if conn is not None:
            conn.close()

    def _tls_context(self) -> ssl.SSLContext:
        """Made on the first https request: the system's CAs or --ca-file, the client
        certificate if given, or no verification at all with --insecure-skip-verify."""
        if self._tls is None:
            import ssl  # only now: see sidecar/__main__.py

            options = self.options
            try:
                context = ssl.create_default_context(cafile=options.ca_file)
                if options.insecure_skip_verify:
                    context.check_hostname = False
                    context.verify_mode = ssl.CERT_NONE
                if options.cert_file:
                    context.load_cert_chain(options.cert_file, options.key_file)
            except (OSError, ssl.SSLError) as exc:
                raise Retryable("tls", f"cannot load the TLS files (--ca-file, --cert-file, "
                                f"--key-file): {type(exc).__name__}") from None
            self._tls = context
        return self._tls

    def check(self, response: Response, answers: Answers | None = None) -> None:
        """Raise ``Retryable`` or ``Refused`` unless the receiver accepted the request; what the
        receiver said is shortened and has every configured secret masked."""
        check(response, self.secrets(response.url), answers or REMOTE_WRITE)


_PORTS = {"http": 80, "https": 443}
# what a kept-alive connection the receiver has just closed raises on the next request
_CLOSED_WHILE_IDLE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


class TlsConnection(http.client.HTTPConnection):
    """HTTPS: the plain connection, wrapped in TLS once connected. ``http.client`` defines its
    own ``HTTPSConnection`` only when ``ssl`` could be imported with it, and the agent imports
    ``http.client`` before ``ssl`` on purpose (sidecar/__main__.py); no proxy tunnel here."""

    default_port = 443

    def __init__(self, host: str, port: int, *, timeout: float, context: ssl.SSLContext) -> None:
        super().__init__(host, port, timeout=timeout)
        self.context = context

    def connect(self) -> None:
        super().connect()
        self.sock = self.context.wrap_socket(self.sock, server_hostname=self.host)


def _network_failure(exc: Exception, tls_handshake: bool, url: str) -> Retryable:
    """A certificate the agent does not trust, or a failed handshake, is a TLS matter with
    advice; an SSL error on a connection already up is a broken connection."""
    ssl = sys.modules.get("ssl")  # imported by the TLS context if this was https
    if ssl is not None and isinstance(exc, ssl.SSLError) and (
            tls_handshake or isinstance(exc, ssl.SSLCertVerificationError)):
        return Retryable("tls", f"TLS handshake with {redact(url)} failed: "
                         f"{type(exc).__name__}; give its CA with --ca-file")
    return Retryable("network", f"{type(exc).__name__} talking to {redact(url)}")


def _basic(user: str, password: str) -> str:
    return base64.b64encode(f"{user}:{password}".encode()).decode()


def parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


HINTS = {
    400: "the receiver refused the data itself; the batch is set aside in the spool's rejected/",
    401: "authentication failed: check the bearer token or basic-auth files",
    403: "not authorised: check the token's permissions or the tenant header",
    404: "no remote-write endpoint at this URL: Prometheus needs "
         "--web.enable-remote-write-receiver and the path /api/v1/write; VictoriaMetrics and "
         "vmagent take /api/v1/write; Mimir /api/v1/push",
    405: "wrong method for this URL: is it the remote-write path?",
    413: "batch too large for the receiver: lower --batch-max-samples",
    422: "the receiver refused the data itself (unprocessable); the batch is set aside in the "
         "spool's rejected/",
}


def failure_reasons(hints: Mapping[int, str]) -> tuple[str, ...]:
    """The push-failure reasons a sink counts from its first push, at 0 until they happen."""
    return ("network", "tls", "credentials", "redirect", "http_429", "http_5xx", "internal",
            *(f"http_{status}" for status in hints))


FAILURE_REASONS = failure_reasons(HINTS)
BODY_LOGGED = 300  # characters of a receiver's answer kept in a log line


@dataclass(frozen=True)
class Answers:
    """How one protocol's receivers answer: which failures are worth another try, how to read
    what they said, the advice per status for the log line."""

    retried: Callable[[int], bool] = lambda status: status == 429 or status >= 500
    said: Callable[[Response], str] = lambda response: response.text
    hints: Mapping[int, str] = field(default_factory=lambda: HINTS)


REMOTE_WRITE = Answers()  # remote-write 1.0 and the Pushgateway: every 5xx is retried


def mask(text: str, secrets: list[str]) -> str:
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def check(response: Response, secrets: list[str] | None = None,
          answers: Answers = REMOTE_WRITE) -> None:
    """Raise ``Retryable`` or ``Refused`` unless the receiver accepted the request."""
    status = response.status_code
    if 200 <= status < 300:
        return
    said = mask(answers.said(response), secrets or [])[:BODY_LOGGED].strip()
    detail = f"HTTP {status}: {said}"
    if 300 <= status < 400:
        location = response.headers.get("Location", "")
        target = mask(redact(urljoin(response.url, location)), secrets or []) if location else "?"
        raise Retryable("redirect", f"HTTP {status}: the receiver redirects to {target}; "
                        "redirects are never followed: configure that URL instead")
    if answers.retried(status):
        raise Retryable("http_429" if status == 429 else f"http_{status // 100}xx", detail,
                        parse_retry_after(response.headers.get("Retry-After")))
    raise Refused(status, detail, answers.hints.get(status, "the receiver refused the request"))


class Backoff(tenacity.wait.wait_base):
    """Exponential backoff with jitter, or the receiver's ``Retry-After`` when it gave one;
    while the agent shuts down, short waits only, so the time left goes to sending."""

    def __init__(self, initial: float, maximum: float,
                 closing: Callable[[], bool] = lambda: False) -> None:
        # initial x 2^(n-1) plus up to one initial of jitter, capped (wait_exponential_jitter's
        # 'initial' is deprecated in recent tenacity, and its jitter is a fixed second)
        self.exponential = tenacity.wait_exponential(multiplier=initial, max=maximum) + \
            tenacity.wait_random(0, initial)
        self.maximum = maximum
        self.closing = closing

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        outcome = retry_state.outcome
        exc = outcome.exception() if outcome is not None else None
        if isinstance(exc, Held):  # nothing changes by itself soon: the longest wait
            wait = self.maximum
        elif isinstance(exc, Retryable) and exc.retry_after is not None:
            wait = min(exc.retry_after, RETRY_AFTER_CAP_S)
        else:
            wait = min(float(self.exponential(retry_state)), self.maximum)
        return min(wait, CLOSING_RETRY_S) if self.closing() else wait


CLOSING_RETRY_S = 0.25


def retrying(options: HttpOptions, *, stop: Any, sleep: Any,
             closing: Callable[[], bool] = lambda: False) -> tenacity.Retrying:
    return tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(Retryable),
        wait=Backoff(options.initial_backoff_s, options.max_backoff_s, closing),
        stop=stop,
        sleep=sleep,
        reraise=True,
    )


class Codec(Protocol):
    """What a spooled protocol decides; the pipeline (``SpooledSink``) is the same for all."""

    kind: str  # names the logger: sidecar.<kind>
    headers: Mapping[str, str]  # sent with every request (content type and encoding)
    answers: Answers
    drop_reasons: tuple[str, ...]  # reasons of its own for gpu_sidecar_samples_dropped_total
    dropped: Mapping[str, int]  # samples the codec itself could not send, by reason

    def cycle(self, series: list[Series]) -> bytes:
        """One cycle as a whole uncompressed request: requests joined are one request."""
        ...

    def compress(self, payload: bytes) -> bytes: ...

    def decompress(self, body: bytes) -> bytes: ...

    def partial(self, response: Response) -> tuple[int, str] | None:
        """What a 2xx answer says was dropped all the same: (points rejected, message)."""
        ...


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

    What differs between protocols is the ``Codec``: how a cycle is encoded (each cycle as a
    whole request, so that requests joined are one request), how a body is compressed, the
    headers, and what the receiver's answers mean."""

    def __init__(
        self,
        url: str,
        spool: Spool,
        http: HttpOptions,
        codec: Codec,
        *,
        name: str,
        push_interval_s: float = 15.0,
        max_batch_samples: int = 20_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.name = name
        self.codec = codec
        self.log = structlog.get_logger(f"sidecar.{codec.kind}")
        self.spool = spool
        self.http = Http(http)
        self.options = http
        self.push_interval_s = push_interval_s
        self.max_batch_samples = max_batch_samples
        self.clock = clock
        self._cycles: list[bytes] = []  # the open batch: each cycle encoded once, as journaled
        self._open_samples = 0
        self.last_flush = clock()
        self.samples_pushed = 0
        self.batches_pushed = 0
        self.failures: Counter[str] = Counter(
            {reason: 0 for reason in failure_reasons(codec.answers.hints)})
        self.points_rejected = 0  # what receivers said they dropped from accepted requests
        self._partial_answers = 0
        self._partial_condition: tuple[bool, str] | None = None  # the last one logged
        self._refused: tuple[int, float, int] | None = None  # status, since, attempts
        self.last_push_seconds = 0.0
        self.last_success_time = 0.0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._draining = threading.Event()
        self._failing_since: float | None = None
        self._journal_failures = Episodes()
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
                self.log.error("journal_unreadable", journal=path.name, error=exc.strerror,
                          effect="the samples it held are lost")
            samples = sum(n for _, n in records)
            if samples:
                body = self.codec.compress(b"".join(body for body, _ in records))
                if self.spool.put(body, samples, seq=seq, journaled=(path, samples)) is not None:
                    self.log.info("journal_replayed", sink=self.name, journal=path.name,
                             samples=samples, note="the open batch of a run that did not stop")
                    continue
            journal.remove(path)  # empty, unreadable, or counted as lost by the spool

    def emit(self, series: list[Series]) -> None:
        record = self.codec.cycle(series)
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
            if self._journal_failures.started():
                self.log.error("journal_write_failed", sink=self.name, error=exc.strerror,
                          directory=str(self.spool.dir), episodes=self._journal_failures.count,
                          effect="the open batch is kept in memory only until the disk recovers: "
                                 "a crash meanwhile would lose it")
            return
        if self._journal_failures.ended():
            self.log.info("journal_write_recovered", sink=self.name)

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
        body = self.codec.compress(b"".join(cycles))
        journaled = (sealed.path, sealed.samples) if sealed.records else None
        if self.spool.put(body, samples, seq=sealed.seq, journaled=journaled) is None:
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
        self.spool.release_held()
        left = len(self.spool)
        if left:
            self.log.warning("shutdown_left_in_spool", sink=self.name, batches=left,
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
                self.log.exception("sender_error", sink=self.name, error=repr(exc), count=errors,
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
            return (self._stop.is_set() or not self.spool.holds(batch.seq)
                    or (deadline is not None and time.monotonic() >= deadline))
        return stop

    def _deliver(self, batches: list[SpooledBatch]) -> None:
        head = batches[0]
        body, samples = head.body, head.samples
        if len(batches) > 1:
            try:  # requests are cycles joined: a merged backlog is its batches joined
                body = self.codec.compress(b"".join(self.codec.decompress(b.body) for b in batches))
                samples = sum(b.samples for b in batches)
            except Exception:  # a batch we cannot read back: send the head alone, as written
                batches = [head]
        attempts = 0
        response: Response | None = None
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
                        response = self._post(body)
                    finally:
                        self.spool.in_flight([])
        except Refused as exc:  # about the data itself (DATA_REFUSALS): the others are Held
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
        # accepted: the batches leave the spool before anything else is read of the answer,
        # so that nothing going wrong afterwards can send them again
        for b in batches:
            self.spool.remove(b)
        self.samples_pushed += samples
        self.batches_pushed += len(batches)
        self.last_success_time = time.time()
        if self._failing_since is not None:
            self.log.info("receiver_recovered", sink=self.name,
                     outage_s=round(time.monotonic() - self._failing_since, 1), attempts=attempts,
                     backlog_batches=len(self.spool))
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
        batch."""
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
            self.http.check(response, self.codec.answers)
        except Retryable as exc:
            self._refusal_ended()
            self.failures[exc.reason] += 1
            if self._failing_since is None and not self._stop.is_set():
                self._failing_since = started
                self.log.warning("push_failing", sink=self.name, reason=exc.reason, detail=str(exc),
                            retry_after_s=exc.retry_after,
                            effect="retrying with backoff; samples wait in the spool")
            raise
        except Refused as exc:
            if exc.status in DATA_REFUSALS:
                self._refusal_ended()
                raise
            self._hold(exc)
            raise Held(exc) from None
        finally:
            self.last_push_seconds = time.monotonic() - started
        self._refusal_ended()
        return response

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
                       retry_every_s=self.options.max_backoff_s,
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
