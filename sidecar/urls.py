"""Receiver URLs as the agent shows them: masked for logs and errors, and named for the ``sink``
label and spool directories. Shared by the configuration, the wiring and the sinks."""

from __future__ import annotations

from urllib.parse import SplitResult, urlsplit, urlunsplit

DEFAULT_PORTS = {"http": 80, "https": 443}


def effective_port(parts: SplitResult) -> int:
    """The port a request to the URL goes to: the one it names, or its scheme's default."""
    return parts.port or DEFAULT_PORTS[parts.scheme]


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
    return f"{parts.hostname}:{effective_port(parts)}"


def sink_label(kind: str, url: str) -> str:
    """The ``sink`` label: the protocol, then the scheme-less host, port and path, so two URLs
    on one host:port (two tenants, two paths) are told apart; query and user-info stay out of
    labels."""
    return f"{kind}:{host_port(url)}{urlsplit(url).path.rstrip('/')}"
