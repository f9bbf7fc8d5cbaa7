"""structlog set-up: JSON lines in containers, readable lines on a terminal, always on stderr
(stdout carries samples); and the rule for conditions that repeat: one line when they start,
then ever rarer, never one per cycle."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(fmt: str = "auto", level: str = "info") -> None:
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # the HTTP library's own log lines quote URLs (query values included) and receivers'
    # malformed headers: the agent says what matters itself, through structlog, masked
    urllib3_log = logging.getLogger("urllib3")
    urllib3_log.addHandler(logging.NullHandler())
    urllib3_log.propagate = False


_log = structlog.get_logger("sidecar")


def _decade(count: int) -> bool:
    """1, 10, 100, ...: the occurrences of a repeating condition that are logged."""
    return count >= 1 and 10 ** (len(str(count)) - 1) == count


def log_count(event: str, count: int, *, level: str = "error", **fields: object) -> None:
    """Log a repeating condition at its 1st, 10th, 100th, ... occurrence, with the running
    count: one line when it starts, then ever rarer, never one per batch."""
    if _decade(count):
        getattr(_log, level)(event, count=count, **fields)


class Episodes:
    """A condition that comes and goes, such as a nearly full disk that refuses one write and
    takes the next once a file was deleted: its start is logged at the 1st, 10th, 100th, ...
    episode, and its end only after a start that was logged, so that a flapping condition never
    logs a line per cycle."""

    def __init__(self) -> None:
        self.count = 0
        self.active = False
        self._logged = False

    def started(self) -> bool:
        """A failure; True when this is the start of an episode to log."""
        if self.active:
            return False
        self.active = True
        self.count += 1
        self._logged = _decade(self.count)
        return self._logged

    def ended(self) -> bool:
        """A success; True when it ends an episode whose start was logged."""
        if not self.active:
            return False
        self.active = False
        return self._logged
