"""The live table: one row per GPU with the three layers, the app's latency and a verdict.

What a person at a terminal sees instead of about 165 lines of exposition per cycle. Imported
only when the stdout sink draws a table (``sidecar.sinks.stdout``), so an agent that pushes or
pipes never loads it. Plain ANSI escape codes, no curses or third-party library: the table is
drawn on the terminal's alternate screen from the top-left corner each cycle (no page is
appended), and on exit the main screen comes back with the cursor shown and the last frame
printed on it, so it stays in the scrollback.

The verdict column is ``sidecar.diagnose.judge`` on the last few cycles: the thresholds of the
shipped alert rules, without their ``for:`` durations; ``gpu-sidecar diagnose`` explains a
verdict with its figures and remedies.
"""

from __future__ import annotations

import atexit
import os
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO

from sidecar.diagnose import Figures, Verdict, figures_of, judge, summarize
from sidecar.samples import Series
from sidecar.thresholds import Thresholds

HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"
ALT_SCREEN, MAIN_SCREEN = "\x1b[?1049h", "\x1b[?1049l"
HOME, CLEAR_LINE_END, CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"
HISTORY = 5  # cycles the verdict and the quantiles are taken over
LEGEND = ("used: GiB of total; retry: allocator retries; PCIe: share of link, GB/s; NVLink: "
          "TX/RX GB/s; why: gpu-sidecar diagnose")
GiB = 1024**3


@dataclass(frozen=True)
class Column:
    title: str
    width: int
    group: str  # the layer it belongs to; "" for the GPU and verdict columns
    left: bool = False


COLUMNS = (
    Column("GPU", 3, ""),
    Column("util", 4, "compute"), Column("occ", 4, "compute"), Column("tensor", 6, "compute"),
    Column("used", 8, "memory"), Column("dram", 4, "memory"), Column("frag", 4, "memory"),
    Column("retry", 5, "memory"),
    Column("PCIe RX", 10, "IO"), Column("PCIe TX", 10, "IO"), Column("NVLink", 9, "IO"),
    Column("p50", 5, "app"), Column("p99", 5, "app"),
    Column("verdict", 16, "", left=True),
)
_GROUP_SEP = " | "


def _groups() -> list[list[int]]:
    """Indexes of COLUMNS, grouped by consecutive layer."""
    out: list[list[int]] = []
    for i, col in enumerate(COLUMNS):
        if out and COLUMNS[out[-1][0]].group == col.group:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _line(cells: Sequence[str]) -> str:
    parts = []
    for group in _groups():
        parts.append(" ".join(
            cells[i].ljust(COLUMNS[i].width) if COLUMNS[i].left else cells[i].rjust(COLUMNS[i].width)
            for i in group))
    return _GROUP_SEP.join(parts).rstrip()


def header() -> list[str]:
    """Two lines: the layers over their columns, then the columns."""
    layer = []
    for group in _groups():
        span = sum(COLUMNS[i].width for i in group) + len(group) - 1
        layer.append(COLUMNS[group[0]].group.ljust(span))
    titles = _line([c.title for c in COLUMNS])
    return [_GROUP_SEP.join(layer).rstrip(), titles, "-" * len(titles)]


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def _rate(value: float | None) -> str:
    """GB/s in at most five characters."""
    if value is None:
        return "-"
    gb = value / 1e9
    return f"{gb:.1f}G" if gb < 100 else f"{gb:.0f}G"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.1f}s"


def _share(ratio: float | None, rate: float | None) -> str:
    if ratio is None and rate is None:
        return "-"
    return f"{_pct(ratio)} {_rate(rate)}"


def _memory(used: float | None, total: float | None) -> str:
    if used is None:
        return "-"
    return f"{used / GiB:.0f}/{total / GiB:.0f}G" if total else f"{used / GiB:.0f}G"


def _nvlink(tx: float | None, rx: float | None) -> str:
    if tx is None and rx is None:
        return "-"
    return "/".join("-" if v is None else f"{v / 1e9:.0f}" for v in (tx, rx)) + "G"


def row(v: Verdict) -> str:
    w, m = v.window, v.window.mean
    if w.lost:
        return _line([m.index] + ["-"] * (len(COLUMNS) - 2) + [v.short()])
    return _line([
        m.index, _pct(m.utilization), _pct(m.occupancy), _pct(m.tensor),
        _memory(m.mem_used, m.mem_total), _pct(m.dram_bw), _pct(m.fragmentation),
        "-" if m.retries is None else f"{m.retries:.0f}",
        _share(m.pcie_rx_ratio, m.pcie_rx), _share(m.pcie_tx_ratio, m.pcie_tx),
        _nvlink(m.nvlink_tx, m.nvlink_rx), _seconds(w.p50), _seconds(w.p99), v.short(),
    ])


def render(cycles: Sequence[Mapping[str, Figures]], title: str, t: Thresholds | None = None) -> str:
    """One frame, plain text: the title, the header and a row per GPU, judged on ``cycles``."""
    windows = summarize(cycles)
    order = sorted(windows, key=lambda u: (len(windows[u].mean.index), windows[u].mean.index))
    lines = [title, *header()]
    lines += [row(judge(windows[uuid], t)) for uuid in order]
    if not order:
        lines.append("no GPU selected yet: waiting for the app to announce its GPUs (--gpus)")
    lines.append(LEGEND)
    return "\n".join(lines)


def title_of(series: Sequence[Series], gpus: Mapping[str, Figures]) -> str:
    """The first line: version, mode (SIMULATED said loudly), the GPU models and the time."""
    info = next((dict(s.labels) for s in series if s.name == "gpu_sidecar_info"), {})
    models: dict[str, int] = {}
    for fig in gpus.values():
        models[fig.name] = models.get(fig.name, 0) + 1
    names = ", ".join(f"{n} x {name}" for name, n in models.items()) or "no GPU"
    mode = info.get("mode", "")
    mode = "SIMULATED" if mode == "simulated" else mode
    ts = series[0].timestamp_ms / 1000 if series else time.time()
    clock = time.strftime("%H:%M:%S", time.localtime(ts))
    return f"gpu-sidecar {info.get('version', '')}  {mode}  {names}  {clock}"


class Table:
    """Frames for the stdout sink. On a terminal (``live``) each frame redraws the screen in
    place; elsewhere (``--output table`` into a file or pipe) frames follow each other, plain."""

    def __init__(self, stream: TextIO, *, live: bool | None = None, history: int = HISTORY,
                 thresholds: Thresholds | None = None) -> None:
        self.stream = stream
        self.live = _isatty(stream) if live is None else live
        self.thresholds = thresholds
        self._cycles: deque[dict[str, Figures]] = deque(maxlen=history)
        self._last = ""
        self._on_screen = False

    def frame(self, series: list[Series]) -> str:
        gpus = figures_of(series)
        self._cycles.append(gpus)
        self._last = render(self._cycles, title_of(series, gpus), self.thresholds)
        if not self.live:
            return self._last + "\n\n"
        columns, rows = _size(self.stream)
        lines = [line[:columns] for line in self._last.splitlines()][:max(rows - 1, 1)]
        start = ""
        if not self._on_screen:
            self._on_screen = True
            atexit.register(self._restore_at_exit)
            start = ALT_SCREEN + HIDE_CURSOR
        return start + HOME + "".join(line + CLEAR_LINE_END + "\n" for line in lines) + CLEAR_BELOW

    def restore(self) -> str:
        """What gives the terminal back: the main screen, the cursor, and the last frame printed
        there so that it stays visible after exit. Empty when nothing was drawn live."""
        if not self._on_screen:
            return ""
        self._on_screen = False
        atexit.unregister(self._restore_at_exit)
        return MAIN_SCREEN + SHOW_CURSOR + self._last + "\n"

    def _restore_at_exit(self) -> None:
        """An exit that skipped the sink's close (an exception) must not leave the terminal on
        the alternate screen with its cursor hidden."""
        try:
            self.stream.write(self.restore())
            self.stream.flush()
        except (OSError, ValueError):
            pass


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _size(stream: TextIO) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return 120, 50
    return size.columns or 120, size.lines or 50
