"""HTTP delivery shared by the push sinks: connection, credentials, outcome of a response, backoff.

Rules (DESIGN.md, "Reliability promises"): 5xx, 429 and network errors are retried with
exponential backoff and jitter, honouring ``Retry-After``; any other 4xx is final for that
request. Secrets are read from files (re-read when the file changes, so rotated tokens work) and
never appear in a log line or an error: URLs are logged without their user-info part.
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urljoin, urlsplit

import tenacity

from sidecar import __version__
from sidecar.sinks import redact_url as redact

if TYPE_CHECKING:
    import ssl

USER_AGENT = f"gpu-sidecar/{__version__}"
RETRY_AFTER_CAP_S = 300.0


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
        if isinstance(exc, Retryable) and exc.retry_after is not None:
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
