"""``--metrics-listen``: the last cycle's series on ``/metrics``, for a Prometheus that scrapes.

Off by default: no port is opened unless asked. The sink keeps only the last cycle (a scrape
reads the present; history is the push sinks' job) and renders it when a scrape asks, without
timestamps, as a scraped target's samples are stamped by the scraper. A GET of any other path
is a 404 (another method a 501); the server is a thread of its own, so a slow scraper never
holds a cycle.
"""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import structlog

from sidecar.samples import Labels, Series
from sidecar.sinks.stdout import prometheus_text

log = structlog.get_logger("sidecar.scrape")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SCRAPE_TIMEOUT_S = 10.0  # a connection idle this long is closed
MAX_CONNECTIONS = 8  # scrapes served at once; more are closed unanswered


class _Server(ThreadingHTTPServer):
    """At most ``MAX_CONNECTIONS`` threads, whatever connects; a scraper that goes away in the
    middle of an answer is no traceback on the agent's stderr (its log is JSON)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: Any, *, family: int) -> None:
        self.address_family = family
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # the scraper hung up: nothing for the agent to do


class ListenError(OSError):
    """The address cannot be listened on (taken, not this host's, not permitted)."""


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


class ScrapeSink:
    name = "metrics-listen"

    def __init__(self, address: str) -> None:
        self.address = address
        self._series: list[Series] = []
        self._lock = threading.Lock()
        self.scrapes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            timeout = SCRAPE_TIMEOUT_S  # an idle or trickling scraper is let go

            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                body = sink.exposition().encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # one line per scrape would be noise in the agent's log

        host, port = _split(address)
        try:
            self._server = _Server((host, port), Handler,
                                   family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        except OSError as exc:
            raise ListenError(exc.errno, f"cannot listen on {address} (--metrics-listen): "
                              f"{exc.strerror}; give a free port of this host") from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-listen",
                                        daemon=True)

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
        if self._thread.is_alive():  # shutdown() waits for serve_forever, which may never have run
            self._server.shutdown()
        self._server.server_close()
        return True

    def telemetry(self, ts: int, labels: Labels) -> list[Series]:
        return []
