"""``python -m sidecar`` and the ``gpu-sidecar`` command: stop signals first, then the rest."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from sidecar import signals

# Modules that map OpenSSL (libssl, libcrypto) as they are imported: 4.8 MiB of resident memory
# in the agent, measured (bench/RESULTS.md), for TLS that most agents never use (the receiver is
# plain HTTP inside the cluster). ``ssl`` is imported at import time by ``http.client`` and by
# ``asyncio`` (which structlog imports), and ``_hashlib`` by ``hashlib``; both modules work
# without them (``hashlib`` falls back to its built-in SHA-256, ``http.client`` leaves out
# ``HTTPSConnection``, which ``sidecar.sinks.delivery`` does not use). Modules imported later
# that need ``http.client``'s HTTPS support (``urllib.request``, which the Pushgateway's client
# library imports) would then break, so OpenSSL is hidden only when the command line and the
# environment name neither https nor a Pushgateway; ``ssl`` is imported by the first https
# connection should one be configured some other way.
_OPENSSL_MODULES = ("ssl", "_hashlib")


def may_need_tls(argv: list[str], environ: dict[str, str]) -> bool:
    """Conservative: any mention of https or of a Pushgateway keeps OpenSSL as usual."""
    words = [*argv, *(f"{k}={v}" for k, v in environ.items() if k.startswith("GPU_SIDECAR_"))]
    return any("https:" in w.lower() or "pushgateway" in w.lower() for w in words)


@contextlib.contextmanager
def openssl_on_demand(hide: bool = True) -> Iterator[None]:
    """Import the agent with OpenSSL's modules hidden, then let them be imported on first use."""
    hidden = [name for name in _OPENSSL_MODULES if hide and name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # ``import`` raises ImportError
    try:
        yield
    finally:
        for name in hidden:
            if sys.modules.get(name, ...) is None:
                del sys.modules[name]


def main() -> int:
    signals.install()
    with openssl_on_demand(hide=not may_need_tls(sys.argv, dict(os.environ))):
        from sidecar.cli import main as cli_main
        from sidecar.sinks import delivery  # noqa: F401  # with http.client, for the sinks

    return cli_main()


if __name__ == "__main__":
    raise SystemExit(main())
