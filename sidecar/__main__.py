"""``python -m sidecar`` and the ``gpu-sidecar`` command: stop signals first, then the rest."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from sidecar import signals

# Modules that map OpenSSL (libssl, libcrypto) as they are imported: 4.8 MiB of resident memory
# in the agent, measured (bench/RESULTS.md), for TLS that most agents never use (the receiver is
# plain HTTP inside the cluster). ``ssl`` is imported at import time by ``http.client`` and by
# ``asyncio`` (which structlog imports), and ``_hashlib`` by ``hashlib``; both modules work
# without them (``hashlib`` falls back to its built-in SHA-256, ``http.client`` leaves out
# ``HTTPSConnection``, which ``sidecar.sinks.delivery`` does not use). A https URL imports ``ssl``
# when its first connection is made.
_OPENSSL_MODULES = ("ssl", "_hashlib")


@contextlib.contextmanager
def openssl_on_demand() -> Iterator[None]:
    """Import the agent with OpenSSL's modules hidden, then let them be imported on first use."""
    hidden = [name for name in _OPENSSL_MODULES if name not in sys.modules]
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
    with openssl_on_demand():
        from sidecar.cli import main as cli_main
        from sidecar.sinks import delivery  # noqa: F401  # with http.client, for the sinks

    return cli_main()


if __name__ == "__main__":
    raise SystemExit(main())
