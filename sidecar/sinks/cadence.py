"""Which series a pushing sink sends in a cycle: every figure that moves, every cycle; the few
that change a few times a year (maxima, the link's trained maximum, ECC and PCIe error
counters, row remapping, Xid counts) when they change, and again every ``RESEND_S`` so that no
receiver ever sees them go stale (Prometheus' look-back is 5 minutes).

Only what is sent is thinned, never what is read or judged: the agent's window, the live table,
``/metrics`` and the Pushgateway (which replaces a whole group each push) take every series of
every cycle. A counter's increase is sent in the cycle that saw it; a new process sends
everything in its first cycle. docs/metrics.md says which figures follow which cadence.
"""

from __future__ import annotations

from collections.abc import Iterable

from sidecar.samples import Labels, Series

RESEND_S = 60.0  # an unchanged rare figure is sent again this often: well within 5 minutes


class Cadence:
    """One sink's memory of what it last sent of each rare series: (value, time)."""

    def __init__(self, rare: Iterable[str], *, resend_s: float = RESEND_S) -> None:
        self.rare = frozenset(rare)
        self.resend_ms = int(resend_s * 1000)
        self._sent: dict[tuple[str, Labels], tuple[float, int]] = {}

    def due(self, series: list[Series]) -> list[Series]:
        """The series of one cycle this sink sends: all, but the rare ones unchanged since they
        were sent less than ``RESEND_S`` ago."""
        out = []
        sent = self._sent
        for s in series:
            if s.name in self.rare:
                key = (s.name, s.labels)
                last = sent.get(key)
                if (last is not None and last[0] == s.value
                        and 0 <= s.timestamp_ms - last[1] < self.resend_ms):
                    continue
                sent[key] = (s.value, s.timestamp_ms)
            out.append(s)
        return out
