"""Stop signals, caught from the first instant of the process.

As PID 1 in a container, a signal without a handler is ignored by the kernel, and a SIGTERM that
arrives while Python still imports the agent would be lost: the pod would then wait for its
grace period and SIGKILL us, losing the final flush. So the entry point installs these handlers
before importing anything heavy; the agent later waits on ``STOP``. SIGTERM, SIGINT and SIGHUP
(a closed terminal, or a supervisor's reload) all mean: take a last sample, flush, exit 0.
Standard library only, for the same reason.
"""

from __future__ import annotations

import signal
import threading

STOP = threading.Event()
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
received: list[int] = []


def _handler(signum: int, _frame: object) -> None:
    received.append(signum)
    STOP.set()


def install() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, _handler)


def restore_defaults() -> None:
    """For one-shot commands (probe): a signal stops them the usual way."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if received:
        raise SystemExit(128 + received[0])
