"""Where series go: stdout here; remote-write and Pushgateway sinks build on the same interface.

A sink takes the series of one cycle, already named and labelled, and owns what happens next.
"""

from __future__ import annotations

from typing import Protocol
from urllib.parse import urlsplit, urlunsplit

from sidecar.samples import Labels, Series


def redact_url(url: str) -> str:
    """``url`` without its user-info part and with query values masked (some vendors take a
    licence key there), for logs and errors."""
    parts = urlsplit(url)
    if parts.username or parts.password:
        host = parts.hostname or ""
        if parts.port:
            host = f"{host}:{parts.port}"
        parts = parts._replace(netloc=host)
    if parts.query:
        masked = "&".join(f"{k}=***" if eq else "***"
                          for k, eq, _ in (p.partition("=") for p in parts.query.split("&")))
        parts = parts._replace(query=masked)
    return urlunsplit(parts._replace(fragment=""))


def host_port(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def sink_label(kind: str, url: str) -> str:
    """The ``sink`` label: the protocol, then the scheme-less host, port and path, so two URLs
    on one host:port (two tenants, two paths) are told apart; query and user-info stay out of
    labels."""
    return f"{kind}:{host_port(url)}{urlsplit(url).path.rstrip('/')}"


class Sink(Protocol):
    name: str

    def start(self) -> None: ...

    def emit(self, series: list[Series]) -> None: ...

    def begin_close(self, deadline: float) -> None:
        """Shutdown starts: stop waiting, use the time until ``deadline`` to deliver."""
        ...

    def close(self, deadline: float) -> bool:
        """Deliver what the time until ``deadline`` (monotonic) allows; True when all was."""
        ...

    def telemetry(self, ts: int, labels: Labels) -> list[Series]: ...
