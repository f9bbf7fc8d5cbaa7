"""``--metrics-listen``: the last cycle's series on ``/metrics``, for a Prometheus that scrapes.

Off by default: no port is opened unless asked. The sink keeps only the last cycle (a scrape
reads the present; history is the push sinks' job) and renders it when a scrape asks, without
timestamps, as a scraped target's samples are stamped by the scraper. A GET of any other path
is a 404 (another method a 501); the server is a thread of its own, so a slow scraper never
holds a cycle.

The port may face a hostile network, so no client can starve a real scraper: one thread serves
every connection through a selector (no thread per connection), at most ``MAX_CONNECTIONS`` are
held (the process's file descriptors stay bounded), a connection must send its whole request
head within ``HEAD_DEADLINE_S`` of its accept (a deadline for the head, not per read: a client
trickling a byte at a time is let go as surely as an idle one) and be answered within
``REQUEST_DEADLINE_S``; when the cap is reached, the oldest connection still without a request
is dropped for the new one, so idle connections cannot keep a scraper out. Each answer closes its
connection (``Connection: close``): a scraper's next scrape opens a new one.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from sidecar.samples import Labels, Series
from sidecar.sinks.stdout import prometheus_text

log = structlog.get_logger("sidecar.scrape")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_CONNECTIONS = 64  # held at once; the oldest without a request is dropped for a new one
HEAD_DEADLINE_S = 3.0  # the whole request head, from the accept (a scraper sends it at once)
REQUEST_DEADLINE_S = 10.0  # the whole exchange, answer included (Prometheus' default timeout)
MAX_HEAD_BYTES = 8192  # a scrape's head is a few hundred bytes
BACKLOG = 128  # connections the kernel queues until the thread accepts them
QUIET_S = 60.0  # connections dropped unanswered end their episode after this long without one
TICK_S = 0.25  # the longest the thread sleeps: deadlines are checked at least this often


@dataclass
class _Conn:
    """One connection: what it sent so far and, once its head is whole, the answer left to send."""

    sock: socket.socket
    accepted_at: float
    head: bytearray = field(default_factory=bytearray)
    answer: memoryview | None = None


@dataclass(frozen=True)
class _Answer:
    status: str
    body: bytes
    content_type: str = "text/plain; charset=utf-8"

    def encode(self) -> bytes:
        return (f"HTTP/1.1 {self.status}\r\nContent-Type: {self.content_type}\r\n"
                f"Content-Length: {len(self.body)}\r\nConnection: close\r\n\r\n").encode() \
            + self.body


class ListenError(OSError):
    """The address cannot be listened on (taken, not this host's, not permitted)."""


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


class _Server:
    """The selector loop: accepts, reads heads, answers, and drops who breaks a deadline or
    the cap, saying so once per episode (a start, then an end after ``QUIET_S`` without one)."""

    def __init__(self, address: str, answer: Callable[[str, str], _Answer], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        host, port = _split(address)
        self.address = address
        self.answer = answer
        self.clock = clock
        self.listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                                      socket.SOCK_STREAM)
        try:
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.listener.bind((host, port))
            self.listener.listen(BACKLOG)
        except OSError:
            self.listener.close()
            raise
        self.listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._conns: dict[socket.socket, _Conn] = {}  # in order of accept: oldest first
        self._stop = False
        self.dropped: dict[str, int] = {}  # in the current episode, by reason
        self._last_drop: float | None = None
        self._fault_logged = False  # an unexpected fault, said once in the agent's life

    # -- the loop ------------------------------------------------------------------------------

    def serve(self) -> None:
        while not self._stop:
            for key, events in self._selector.select(TICK_S):
                if key.fileobj is self.listener:
                    self._accept()
                elif key.fileobj is self._wake_r:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(64)
                elif key.fileobj in self._conns:
                    conn = self._conns[key.fileobj]  # type: ignore[index]
                    try:
                        if events & selectors.EVENT_READ:
                            self._read(conn)
                        elif events & selectors.EVENT_WRITE:
                            self._write(conn)
                    except Exception:  # one connection's fault never ends the endpoint
                        self._failed(conn)
            self._expire(self.clock())
        self.release()

    def release(self) -> None:
        """Every connection and the port closed (also for a server whose loop never ran)."""
        for conn in list(self._conns.values()):
            self._close(conn)
        self._selector.close()
        self.listener.close()
        self._wake_r.close()
        self._wake_w.close()

    def stop(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _accept(self) -> None:
        for turn in range(BACKLOG):  # drain what the kernel queued, a bounded batch per turn
            if len(self._conns) >= MAX_CONNECTIONS:
                # room is made before the accept, so never more than the cap are held; only
                # the turn's first accept, which the listener's readiness says is queued,
                # drops one (the selector calls again while more wait)
                if turn:
                    return
                waiting = [c for c in self._conns.values() if c.answer is None]
                self._drop(waiting[0] if waiting else next(iter(self._conns.values())),
                           "connection_cap")
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, or the peer gone already: try next turn
                return
            sock.setblocking(False)
            self._conns[sock] = _Conn(sock, self.clock())
            self._selector.register(sock, selectors.EVENT_READ)

    def _read(self, conn: _Conn) -> None:
        try:
            got = conn.sock.recv(MAX_HEAD_BYTES + 1 - len(conn.head))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            got = b""
        if not got:  # the client went away before asking
            self._close(conn)
            return
        conn.head += got
        end = conn.head.find(b"\r\n\r\n")
        if end < 0:
            end = conn.head.find(b"\n\n")
        if end < 0:
            if len(conn.head) > MAX_HEAD_BYTES:
                self._drop(conn, "head_too_large")
            return
        request_line = bytes(conn.head[:conn.head.find(b"\n")]).decode("latin-1").strip()
        parts = request_line.split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            reply = _Answer("400 Bad Request", b"not an HTTP request\n")
        else:
            reply = self.answer(parts[0], parts[1])
        conn.answer = memoryview(reply.encode())
        self._selector.modify(conn.sock, selectors.EVENT_WRITE)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        assert conn.answer is not None
        try:
            sent = conn.sock.send(conn.answer)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # the scraper hung up: nothing for the agent to do
            self._close(conn)
            return
        conn.answer = conn.answer[sent:]
        if not conn.answer:
            self._close(conn)

    def _expire(self, now: float) -> None:
        for conn in list(self._conns.values()):
            age = now - conn.accepted_at
            if conn.answer is None and age > HEAD_DEADLINE_S:
                self._drop(conn, "head_deadline")
            elif age > REQUEST_DEADLINE_S:
                self._drop(conn, "request_deadline")
        if self._last_drop is not None and now - self._last_drop > QUIET_S:
            log.info("metrics_listen_connections_normal", address=self.address,
                     dropped=dict(self.dropped))
            self._last_drop = None
            self.dropped = {}

    def _drop(self, conn: _Conn, reason: str) -> None:
        """A connection let go unanswered: its slot is for a scraper."""
        if self._last_drop is None:
            log.warning("metrics_listen_connections_dropped", address=self.address,
                        reason=reason, held=len(self._conns), max_connections=MAX_CONNECTIONS,
                        effect="connections that send no whole request within "
                        f"{HEAD_DEADLINE_S:g} s, or beyond {MAX_CONNECTIONS} held, are closed "
                        "unanswered; scrapes and pushes go on",
                        hint="something connects to the metrics port without scraping (a port "
                        "scan, a health check that never sends, an attack): restrict who "
                        "reaches --metrics-listen, e.g. with a NetworkPolicy")
        self._last_drop = self.clock()
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        self._close(conn)

    def _failed(self, conn: _Conn) -> None:
        if not self._fault_logged:
            self._fault_logged = True
            log.exception("metrics_listen_connection_failed", address=self.address,
                          effect="that connection was closed; the others are served")
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        self._conns.pop(conn.sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()


class ScrapeSink:
    name = "metrics-listen"

    def __init__(self, address: str) -> None:
        self.address = address
        self._series: list[Series] = []
        self._lock = threading.Lock()
        self.scrapes = 0
        try:
            self._server = _Server(address, self._answer)
        except OSError as exc:
            raise ListenError(exc.errno, f"cannot listen on {address} (--metrics-listen): "
                              f"{exc.strerror}; give a free port of this host") from None
        self._thread = threading.Thread(target=self._server.serve, name="metrics-listen",
                                        daemon=True)

    def _answer(self, method: str, target: str) -> _Answer:
        if method != "GET":
            return _Answer("501 Not Implemented", b"only GET /metrics is served here\n")
        if target.split("?", 1)[0] != "/metrics":
            return _Answer("404 Not Found", b"only /metrics is served here\n")
        return _Answer("200 OK", self.exposition().encode(), CONTENT_TYPE)

    def exposition(self) -> str:
        with self._lock:
            series = self._series
            self.scrapes += 1
        return prometheus_text(series, timestamps=False) if series else ""

    def start(self) -> None:
        self._thread.start()
        log.info("metrics_listening", address=self.address, path="/metrics")

    def emit(self, series: list[Series]) -> None:
        with self._lock:
            self._series = series

    def begin_close(self, deadline: float) -> None:
        pass

    def close(self, deadline: float) -> bool:
        self._server.stop()
        if self._thread.is_alive():  # it may never have run
            self._thread.join(timeout=max(0.0, deadline - time.monotonic()) + TICK_S)
        else:
            self._server.release()
        return True

    def telemetry(self, ts: int, labels: Labels) -> list[Series]:
        return []
