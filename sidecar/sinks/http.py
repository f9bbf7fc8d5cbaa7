"""HTTP to one receiver, on ``requests``: one ``Session`` (its own connection pool) per receiver,
configured TLS and credentials, and the promises made of a request (docs/reliability.md):

- redirects are never followed (a POST turned into a GET loses its body, and the credentials
  would go to a host nobody configured): a 3xx is an answer, for ``answers.Policy``;
- ``--push-timeout`` bounds the whole request: name resolution, connect, TLS, sending and reading
  the whole answer. ``requests``' own timeout bounds each socket operation only (a receiver
  trickling a byte a second would hold a request for ever), so each request has a deadline:
  names are resolved by a helper thread waited for until then, and a watchdog shuts the
  request's socket down when it passes;
- a kept-alive connection the receiver closed while idle (it does so on its own schedule) is
  detected before use; one found closed as the request went out (the receiver's "connection
  reset" or "closed without an answer", before any byte of an answer) is tried once more on a
  new connection, the only retry inside a request: anything later may have been stored;
- secrets (URL user-info, query values, tokens, passwords, header values) go in requests only,
  never in an error text: ``Http.secrets`` lists them for masking what receivers echo.

Proxies, ``.netrc`` and ``REQUESTS_CA_BUNDLE`` from the environment are not used
(``trust_env=False``): receivers are reached directly, and TLS trusts the system's CA store (or
``--ca-file``) through an ``ssl.SSLContext`` of the agent's own.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import http.cookiejar
import ipaddress
import os
import socket
import ssl
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

import requests
import urllib3
from requests.adapters import HTTPAdapter
from requests.structures import CaseInsensitiveDict
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from sidecar import __version__
from sidecar.config import Config
from sidecar.sinks.answers import REMOTE_WRITE, Policy, Response, Retryable
from sidecar.urls import effective_port
from sidecar.urls import redact_url as redact

USER_AGENT = f"gpu-sidecar/{__version__}"
MIN_REQUEST_S = 0.05  # a request cut to the shutdown deadline still gets this long
RESOLVED_FOR_S = 30.0  # a name's addresses are looked up again after this (or a failure)
ANSWER_MAX_BYTES = 4 << 20  # more than any receiver's answer to a push needs
CHUNK_BYTES = 64 << 10


class SecretFile:
    """A secret kept in a file (a mounted Kubernetes Secret); re-read when the file changes, so
    that a rotated token works without a restart."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[float, int] | None = None
        self._value = ""

    def value(self) -> str:
        st = os.stat(self.path)
        stamp = (st.st_mtime, st.st_size)
        if stamp != self._stamp:
            try:
                with open(self.path, encoding="utf-8") as f:
                    self._value = f.read().strip()
            except UnicodeDecodeError:  # its repr would quote the file's bytes: the secret
                raise OSError(errno.EINVAL, "not UTF-8 text", self.path) from None
            self._stamp = stamp
        return self._value


def _basic(user: str, password: str) -> str:
    return base64.b64encode(f"{user}:{password}".encode()).decode()


# -- the deadline of one request -------------------------------------------------------------


class _Watch:
    """The deadline of the request in progress on this thread: the sockets it uses are shut
    down when it passes, which ends any send or receive blocked on them."""

    def __init__(self, end: float) -> None:
        self.end = end
        self.connected = False  # a new connection was made for this request
        self.expired = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def left(self) -> float:
        return self.end - time.monotonic()

    def add(self, sock: socket.socket | None) -> None:
        if sock is None:
            return
        with self._lock:
            self._sockets.append(sock)
            if self.expired:
                _shut(sock)

    def expire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._sockets:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    # the plain socket's shutdown, also under TLS: it ends the blocked call in the other thread
    # without touching the TLS state that thread is using
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


_current = threading.local()  # .watch: the _Watch of the request this thread is making


def _watch_socket(conn: HTTPConnection) -> None:
    watch: _Watch | None = getattr(_current, "watch", None)
    if watch is not None:
        watch.add(conn.sock)


class _Watched:
    """Mixed into urllib3's connections: the socket goes to the request's watchdog as soon as
    it is connected, before a TLS handshake (which a receiver could trickle too), and again at
    each request on a kept-alive connection (``connect`` is not called then)."""

    def _new_conn(self) -> socket.socket:
        watch: _Watch | None = getattr(_current, "watch", None)
        if watch is not None:
            watch.connected = True
        sock = super()._new_conn()  # type: ignore[misc]
        if watch is not None:
            watch.add(sock)
        return sock

    def request(self, *args: Any, **kwargs: Any) -> None:
        _watch_socket(self)  # type: ignore[arg-type]
        super().request(*args, **kwargs)  # type: ignore[misc]


class _Connection(_Watched, HTTPConnection):
    pass


class _TlsConnection(_Watched, HTTPSConnection):
    pass


class _Pool(HTTPConnectionPool):
    ConnectionCls = _Connection


class _TlsPool(HTTPSConnectionPool):
    ConnectionCls = _TlsConnection


class _Adapter(HTTPAdapter):
    """``requests``' adapter, connecting to the address resolved within the deadline (the URL's
    host name still names the receiver: the ``Host`` header and TLS's server name and
    certificate check) and verifying TLS with the agent's own context."""

    def __init__(self, tls: Callable[[], ssl.SSLContext]) -> None:
        self._tls = tls
        self.address: str | None = None  # where the next request connects to
        super().__init__(pool_connections=4, pool_maxsize=1, max_retries=0)

    def init_poolmanager(self, connections: int, maxsize: int, block: bool = False,
                         **pool_kwargs: Any) -> None:
        super().init_poolmanager(connections, maxsize, block, **pool_kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _Pool, "https": _TlsPool}

    def build_connection_pool_key_attributes(
            self, request: requests.PreparedRequest, verify: Any,
            cert: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
        host, _ = super().build_connection_pool_key_attributes(request, verify, None)
        name = host["host"]
        if self.address is not None:
            host["host"] = self.address
        if host["scheme"] != "https":
            return host, {}
        return host, {"ssl_context": self._tls(), "server_hostname": name}

    def cert_verify(self, conn: Any, url: str, verify: Any, cert: Any) -> None:
        """Nothing to add: the pool's TLS context says what is trusted and which certificate
        the agent shows (``requests`` would add certifi's CA bundle to it)."""


class _Resolver:
    """Host names to addresses, each lookup in a helper thread that the request waits for only
    until its deadline (``getaddrinfo`` cannot be interrupted). A lookup still running is
    joined, not doubled, so a hanging resolver costs one thread. Addresses are kept for
    ``RESOLVED_FOR_S`` or until a request to them fails."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, int], tuple[float, list[str]]] = {}
        self._pending: dict[tuple[str, int], _Lookup] = {}
        self._lock = threading.Lock()

    def addresses(self, host: str, port: int, timeout: float) -> list[str]:
        with contextlib.suppress(ValueError):
            return [str(ipaddress.ip_address(host))]
        key = (host, port)
        with self._lock:
            known = self._known.get(key)
            if known is not None and known[0] > time.monotonic():
                return known[1]
            lookup = self._pending.get(key)
            if lookup is None:
                lookup = self._pending[key] = _Lookup(host, port)
        if not lookup.done.wait(max(0.0, timeout)):
            raise TimeoutError("name resolution")
        with self._lock:
            if self._pending.get(key) is lookup:
                del self._pending[key]
        if lookup.error is not None:
            raise lookup.error
        with self._lock:
            self._known[key] = (time.monotonic() + RESOLVED_FOR_S, lookup.found)
        return lookup.found

    def forget(self, host: str, port: int) -> None:
        with self._lock:
            self._known.pop((host, port), None)


class _Lookup:
    def __init__(self, host: str, port: int) -> None:
        self.found: list[str] = []
        self.error: OSError | None = None
        self.done = threading.Event()
        threading.Thread(target=self._run, args=(host, port), name="resolve",
                         daemon=True).start()

    def _run(self, host: str, port: int) -> None:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            self.found = list(dict.fromkeys(str(info[4][0]) for info in infos))
            if not self.found:
                self.error = socket.gaierror("no address")
        except OSError as exc:
            self.error = exc
        finally:
            self.done.set()


# -- the client ---------------------------------------------------------------------------------


class _Session(requests.Session):
    """A ``Session`` for which no answer is a redirect: with ``allow_redirects=False``
    ``requests`` still reads a 3xx answer's whole body (uncapped) to prepare the next request;
    here the 3xx is an answer like any other, read by ``Http._read``."""

    def get_redirect_target(self, resp: requests.Response) -> None:
        return None


class Http:
    """HTTP/1.1 to one receiver with the configured TLS and credentials: one ``requests.Session``
    and its kept-alive connection, one request at a time (each sink has one sender; at shutdown
    a final push may overlap the sender's last request, hence the lock)."""

    def __init__(self, cfg: Config, *, timeout_s: float | None = None,
                 max_answer_bytes: int = ANSWER_MAX_BYTES) -> None:
        """The credentials, headers and TLS files are ``cfg``'s, read off it where used, never
        copied (one place says what the command line configures); ``timeout_s`` is
        ``--push-timeout`` unless a client's own (the store's query timeout, an engine's), and an
        answer's body is read up to ``max_answer_bytes``, no further."""
        self.cfg = cfg
        self.timeout_s = cfg.push_timeout if timeout_s is None else timeout_s
        self.max_answer_bytes = max_answer_bytes
        self._token = SecretFile(cfg.bearer_token_file) if cfg.bearer_token_file else None
        self._password = (SecretFile(cfg.basic_auth_password_file)
                          if cfg.basic_auth_password_file else None)
        self._tls: ssl.SSLContext | None = None
        self._resolver = _Resolver()
        self._adapter = _Adapter(self._tls_context)
        self.session = _Session()
        self.session.trust_env = False  # no proxy, .netrc or CA bundle from the environment
        # no cookies: a receiver's Set-Cookie is not sent back, as a push needs none
        self.session.cookies.set_policy(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
        # answers uncompressed: the body is read as sent, under its size cap
        self.session.headers = CaseInsensitiveDict({"User-Agent": USER_AGENT,
                                                    "Accept-Encoding": "identity"})
        self.session.mount("http://", self._adapter)
        self.session.mount("https://", self._adapter)
        self._lock = threading.Lock()
        self.deadline: float | None = None  # monotonic; set at shutdown
        if cfg.insecure_skip_verify:  # said once at start by the agent, not per request
            warnings.filterwarnings("ignore", category=urllib3.exceptions.InsecureRequestWarning)

    def headers(self) -> dict[str, str]:
        out = {"User-Agent": USER_AGENT, **dict(self.cfg.header)}
        if self._token is not None:
            out["Authorization"] = f"Bearer {self._token.value()}"
        return out

    def auth(self) -> tuple[str, str] | None:
        if self.cfg.basic_auth_user is None:
            return None
        return (self.cfg.basic_auth_user, self._password.value() if self._password else "")

    def secrets(self, url: str = "") -> list[str]:
        """Every secret value this session sends, so that no receiver's answer echoing the
        request can carry one into a log line."""
        out = [v for _, v in self.cfg.header]
        with contextlib.suppress(OSError):
            if self._token is not None:
                out.append(self._token.value())
            if self._password is not None:
                out.append(self._password.value())
        parts = urlsplit(url)
        if parts.password:
            out += [parts.password, unquote(parts.password),
                    _basic(unquote(parts.username or ""), unquote(parts.password))]
        for _, value in parse_qsl(parts.query, keep_blank_values=True):
            out.append(value)  # some vendors take a licence key there
        for raw in parts.query.split("&"):
            out.append(raw.partition("=")[2])
        with contextlib.suppress(OSError):
            auth = self.auth()
            if auth is not None:
                out.append(_basic(*auth))  # what an echoed "Authorization: Basic ..." carries
        return [v for v in out if len(v) >= 3]

    def check(self, response: Response, policy: Policy = REMOTE_WRITE) -> None:
        """Raise ``Retryable`` or ``Refused`` unless the receiver accepted the request; what the
        receiver said is shortened and has every configured secret masked. A 2xx returns
        before the secrets are read: nothing may turn an accepted request into a failure."""
        if 200 <= response.status_code < 300:
            return
        policy.check(response, self.secrets(response.url))

    def close(self) -> None:
        """Close the kept-alive connection (the sink is done with this receiver)."""
        self.session.close()

    def request(self, method: str, url: str, *, data: bytes | None = None,
                headers: Mapping[str, str] | None = None) -> Response:
        """One request, within ``--push-timeout`` (cut to the shutdown deadline); redirects are
        never followed. Raises ``Retryable`` when no answer came."""
        parts = urlsplit(url)
        # here and below: the failure is raised after the ``except`` block, so that the original
        # exception (whose text may quote a header, a token or the URL) is not its context
        failure: Retryable | None = None
        try:
            sent = self._headers(parts, headers)
        except OSError as exc:  # an unreadable secret file
            failure = Retryable("credentials", f"cannot read a credentials file: {exc.strerror}")
        if failure is not None:
            raise failure
        timeout = self.timeout_s
        if self.deadline is not None:  # shutting down: no request may outlast the deadline
            timeout = max(MIN_REQUEST_S, min(timeout, self.deadline - time.monotonic()))
        watch = _Watch(time.monotonic() + timeout)
        # the URL without user-info: ``requests`` would turn it into its own basic auth
        target = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2], fragment=""))
        with self._lock:
            return self._send(method, url, target, parts, data, sent, watch)

    def _headers(self, parts: Any, extra: Mapping[str, str] | None) -> dict[str, str]:
        sent = {**self.headers(), **(extra or {})}
        auth = self.auth()
        if auth is None and parts.username is not None:  # credentials in the URL
            auth = (unquote(parts.username), unquote(parts.password or ""))
        if auth is not None:
            sent["Authorization"] = f"Basic {_basic(*auth)}"
        # the receiver's name, as the URL gives it: the connection goes to its address
        sent.setdefault("Host", parts.netloc.rpartition("@")[2])
        return sent

    def _send(self, method: str, url: str, target: str, parts: Any, data: bytes | None,
              headers: dict[str, str], watch: _Watch) -> Response:
        host = parts.hostname or ""
        port = effective_port(parts)
        failure: Retryable | None = None
        try:
            addresses = self._resolver.addresses(host, port, watch.left())
        except TimeoutError:
            failure = Retryable("network", f"name resolution of {host} took longer than "
                                f"{self.timeout_s:g} s (--push-timeout)")
        except OSError as exc:
            failure = Retryable("network", f"cannot resolve {host}: {type(exc).__name__}")
        if failure is not None:
            raise failure
        retried_stale = False
        index = 0
        while True:
            self._adapter.address = addresses[index]
            outcome = self._exchange(method, url, target, data, headers, watch)
            if isinstance(outcome, Response):
                return outcome
            kind, error = outcome
            if kind == "stale" and not retried_stale and watch.left() > 0:
                # the receiver closed the kept connection as the request went out: once more,
                # on a new connection (only ever once: see the module's docstring)
                retried_stale = True
                continue
            if kind == "connect" and index + 1 < len(addresses) and watch.left() > 0:
                index += 1  # nothing was sent: the name's next address
                continue
            self._resolver.forget(host, port)
            raise self._failure(kind, error, watch, url)

    def _exchange(self, method: str, url: str, target: str, data: bytes | None,
                  headers: dict[str, str], watch: _Watch
                  ) -> Response | tuple[str, BaseException]:
        """One try on the wire: the answer, or what kind of failure ("stale", "connect", "tls",
        "headers", "network") with its exception. Never raises a ``requests`` error."""
        left = watch.left()
        if left <= 0:
            return "network", TimeoutError("deadline")
        watch.connected = False
        timer = threading.Timer(left, watch.expire)
        timer.daemon = True
        _current.watch = watch
        timer.start()
        try:
            try:
                answer = self.session.request(method, target, data=data, headers=headers,
                                              stream=True, allow_redirects=False,
                                              timeout=(left, left))
            except (requests.exceptions.InvalidHeader, requests.exceptions.InvalidURL) as exc:
                return "headers", exc
            except requests.exceptions.SSLError as exc:
                return "tls", exc
            except (requests.RequestException, OSError) as exc:
                return _kind(exc, watch), exc
            except ValueError as exc:  # a header or path the HTTP library cannot send as is
                return "headers", exc
            return self._read(answer, url, watch, self.max_answer_bytes)
        finally:
            timer.cancel()
            _current.watch = None

    @staticmethod
    def _read(answer: requests.Response, url: str, watch: _Watch, limit: int) -> Response:
        """The whole answer within the deadline. Its status is what counts: a body that cannot be
        read (too slow, cut, too long) leaves it as it is, said in ``unread``, so that a 2xx
        stays final."""
        chunks: list[bytes] = []
        size = 0
        unread: str | None = None
        try:
            for chunk in answer.raw.stream(CHUNK_BYTES, decode_content=False):
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    unread = f"answer longer than {limit} bytes: the rest not read"
                    break
                if watch.left() <= 0:
                    raise TimeoutError("deadline")
        except (requests.RequestException, OSError, urllib3.exceptions.HTTPError) as exc:
            unread = ("the answer's body was not read whole within --push-timeout"
                      if watch.expired or watch.left() <= 0
                      else f"{type(exc).__name__} reading the answer's body")
        finally:
            answer.close()  # the connection goes back to the pool only if the body was read
        if unread is None and watch.expired:  # cut at the deadline where the body might end
            unread = "the answer's body was not read whole within --push-timeout"
        return Response(answer.status_code, answer.headers, b"".join(chunks), url, unread)

    def _failure(self, kind: str, exc: BaseException, watch: _Watch, url: str) -> Retryable:
        """What went wrong, for the log: never the exception's text, which may quote a header
        (a secret) or the URL."""
        if kind == "headers":
            return Retryable("credentials", f"{type(exc).__name__}: a header (token, password or "
                             "--header) or the URL holds characters HTTP cannot carry; check the "
                             "files and the URL")
        if watch.expired or watch.left() <= 0:
            return Retryable("network", f"no answer from {redact(url)} within "
                             f"{self.timeout_s:g} s (--push-timeout)")
        if kind == "tls" and (watch.connected or _verification_failed(exc)):
            return Retryable("tls", f"TLS handshake with {redact(url)} failed: "
                             f"{_root(exc).__class__.__name__}; give its CA with --ca-file")
        return Retryable("network", f"{_root(exc).__class__.__name__} talking to {redact(url)}")

    def _tls_context(self) -> ssl.SSLContext:
        """Made on the first https request: the system's CAs or --ca-file, the client
        certificate if given, or no verification at all with --insecure-skip-verify. A file
        that cannot be loaded is a failure of that request (retried), not of the agent."""
        if self._tls is None:
            cfg = self.cfg
            failure: Retryable | None = None
            try:
                context = ssl.create_default_context(cafile=cfg.ca_file)
                if cfg.insecure_skip_verify:
                    context.check_hostname = False
                    context.verify_mode = ssl.CERT_NONE
                if cfg.cert_file:
                    context.load_cert_chain(cfg.cert_file, cfg.key_file)
            except (OSError, ssl.SSLError) as exc:
                failure = Retryable("tls", f"cannot load the TLS files (--ca-file, --cert-file, "
                                    f"--key-file): {type(exc).__name__}")
            if failure is not None:
                raise failure
            self._tls = context
        return self._tls



# what a kept-alive connection the receiver has just closed raises, before any byte of an answer
# (the standard library's "RemoteDisconnected" is a ConnectionResetError)
_CLOSED_WHILE_IDLE = (ConnectionResetError, BrokenPipeError)


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what it wraps: ``requests`` and urllib3 keep the original in ``args``,
    ``reason`` or ``__cause__``/``__context__``."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo.extend(a for a in e.args if isinstance(a, BaseException))
        for nested in (getattr(e, "reason", None), e.__cause__, e.__context__):
            if isinstance(nested, BaseException):
                todo.append(nested)


def _root(exc: BaseException) -> BaseException:
    """The innermost cause, whose type name says what happened (``ConnectionRefusedError``)."""
    found = exc
    for e in _causes(exc):
        found = e
    return found


def _kind(exc: BaseException, watch: _Watch) -> str:
    causes = list(_causes(exc))
    if any(isinstance(e, urllib3.exceptions.NewConnectionError | requests.exceptions.ConnectTimeout)
           for e in causes) and watch.connected:
        return "connect"
    if not watch.connected and any(
            isinstance(e, _CLOSED_WHILE_IDLE) for e in causes):
        return "stale"
    return "network"


def _verification_failed(exc: BaseException) -> bool:
    return any(isinstance(e, ssl.SSLCertVerificationError) for e in _causes(exc))
