"""The running agent's recent window: what ``diagnose`` beside the agent, ``status``, the live
table and the ``gpu_verdict`` series judge.

Every figure a verdict needs (NVML, health, app, engine) comes as each cycle's ``Figures``, taken
by the agent from its samples (``judge.cycle``: the values its series carry, no round trip
through them), and is folded into time buckets of running aggregates (``judge.window.Summary``,
the one window). A question over the last D seconds merges the buckets
that D spans, which gives what one summary over those cycles gives. Memory is bounded by the
number of buckets times the GPUs, whatever the interval: ``WINDOW_S / BUCKET_S`` buckets of one
small aggregate per GPU (docs/diagnose.md gives the measured size).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from sidecar.config import Config
from sidecar.judge.figures import Figures
from sidecar.judge.verdict import Verdict, judge
from sidecar.judge.window import Summary
from sidecar.thresholds import Thresholds

WINDOW_S = 900.0  # how far back the agent can answer: 15 minutes, at any interval
# the window's resolution: a question's start is rounded out to a bucket; 15 s keeps the window
# of 8 GPUs near 4 MiB (bench/bench_deployed.py measures it; tests/test_agent_window.py holds it
# to its bound)
BUCKET_S = 15.0
# the current verdict (the table's column, status, the gpu_verdict series): the window of a
# plain `diagnose` (its default --duration), so that beside the agent all four say the same
CURRENT_S = Config.duration


@dataclass(frozen=True, kw_only=True)
class Span:
    """What a question over the window got: the cycles merged and the time they cover."""

    asked_s: float
    covered_s: float
    cycles: int
    oldest_s: float  # the age of the oldest cycle the window still holds

    def short(self) -> str:
        """Said by every report from the window: how far back it reaches."""
        text = f"the agent's window: {self.cycles} cycles over the last {self.covered_s:.0f} s"
        if self.covered_s + BUCKET_S < self.asked_s:
            text += (f" (asked for {self.asked_s:.0f} s: the window holds "
                     f"{'only ' if self.oldest_s < WINDOW_S else ''}{self.oldest_s:.0f} s)")
        return text


class _Bucket:
    __slots__ = ("first_at", "last_at", "summary")

    def __init__(self, at: float) -> None:
        self.first_at = at
        self.last_at = at
        self.summary = Summary()


class Recent:
    """The last ``WINDOW_S`` seconds of cycles, as buckets. ``add`` is called by the agent's
    loop, ``summary`` and ``verdicts`` by anyone (the diagnose socket's thread): a lock keeps
    the buckets whole; merging a question's buckets is the only work done under it."""

    def __init__(self, *, window_s: float = WINDOW_S, bucket_s: float = BUCKET_S) -> None:
        self.window_s = window_s
        self.bucket_s = bucket_s
        self._buckets: deque[_Bucket] = deque()
        self._lock = threading.Lock()

    def add(self, cycle: Mapping[str, Figures], now: float) -> bool:
        """Fold one cycle in; True when it began a new bucket (what the window says changed
        enough to judge again)."""
        with self._lock:
            b = self._buckets[-1] if self._buckets else None
            began = b is None or now - b.first_at >= self.bucket_s
            if began:
                b = _Bucket(now)
                self._buckets.append(b)
            assert b is not None
            b.summary.add(cycle)
            b.last_at = now
            while self._buckets and now - self._buckets[0].last_at > self.window_s:
                self._buckets.popleft()
            return began

    def summary(self, seconds: float, now: float) -> tuple[Summary, Span]:
        """The cycles of the last ``seconds`` (from the start of the bucket that holds the
        oldest of them), merged; and what they span."""
        merged = Summary()
        with self._lock:
            chosen = [b for b in self._buckets if now - b.last_at <= seconds]
            for b in chosen:
                merged.merge(b.summary)
            oldest = now - self._buckets[0].first_at if self._buckets else 0.0
        covered = (chosen[-1].last_at - chosen[0].first_at) if chosen else 0.0
        return merged, Span(asked_s=seconds, covered_s=covered, cycles=merged.cycles,
                            oldest_s=oldest)

    def verdicts(self, seconds: float, now: float,
                 t: Thresholds | None = None) -> tuple[dict[str, Verdict], Span]:
        """Each GPU of the last ``seconds`` judged, in index order."""
        merged, span = self.summary(seconds, now)
        windows = merged.windows()
        order = sorted(windows, key=lambda u: (len(windows[u].mean.index), windows[u].mean.index))
        return {uuid: judge(windows[uuid], t) for uuid in order}, span
