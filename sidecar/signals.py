"""Stop signals, caught from the first instant of the process; SIGCONT heard, so that a paused
process is said as such.

As PID 1 in a container, a signal without a handler is ignored by the kernel, and a SIGTERM that
arrives while Python still imports the agent would be lost: the pod would then wait for its
grace period and SIGKILL us, losing the final flush. So the entry point installs these handlers
before importing anything heavy; the agent later waits on ``STOP``. SIGTERM, SIGINT and SIGHUP
(a closed terminal, or a supervisor's reload) all mean: take a last sample, flush, exit 0. A
SIGHUP that the parent set to be ignored (``nohup``) stays ignored.

The handler only writes a byte to a pipe; a small thread sets ``STOP``. Setting an Event from
the handler could deadlock: the handler runs in the main thread, which may be holding that
Event's lock inside ``wait()`` at that very instant. Standard library only, for the same reason
as the early install.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

STOP = threading.Event()
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
received: list[int] = []
_pipe: tuple[int, int] | None = None
continued: list[float] = []  # monotonic instants of each SIGCONT: the process had been stopped


def _continued(_signum: int, _frame: object) -> None:
    # an append is all: a stopped process (SIGSTOP, SIGTSTP, a debugger) is being resumed, and
    # the schedule must say it was paused rather than blame its own cycles
    continued.append(time.monotonic())


def _handler(signum: int, _frame: object) -> None:
    received.append(signum)
    if _pipe is not None:
        with contextlib.suppress(OSError):  # full pipe: a stop is already on its way
            os.write(_pipe[1], b"s")


def _watch(read_fd: int) -> None:
    while True:
        try:
            if os.read(read_fd, 64):
                STOP.set()
        except InterruptedError:
            continue
        except OSError:
            return


def install() -> None:
    global _pipe
    if _pipe is None:
        _pipe = os.pipe()
        os.set_blocking(_pipe[1], False)
        threading.Thread(target=_watch, args=(_pipe[0],), name="stop-signals",
                         daemon=True).start()
    for sig in STOP_SIGNALS:
        if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
            continue
        signal.signal(sig, _handler)
    signal.signal(signal.SIGCONT, _continued)  # resuming is the kernel's: a handler only hears it
    signal.siginterrupt(signal.SIGCONT, False)  # calls in flight (NVML's) restart, as without it


def restore_defaults() -> None:
    """For one-shot commands (probe): a signal stops them the usual way."""
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) == _handler:
            signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if received:
        raise SystemExit(128 + received[0])
