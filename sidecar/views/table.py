"""The live table: one row per GPU with the three layers, the app's latency and a verdict.

What a person at a terminal sees instead of about 165 lines of exposition per cycle. Imported
only when the stdout sink draws a table (``sidecar.sinks.stdout``), so an agent that pushes or
pipes never loads it. Plain ANSI escape codes, no curses or third-party library: the table is
drawn on the terminal's alternate screen from the top-left corner each cycle (no page is
appended), and on exit the main screen comes back with the cursor shown and the last frame
printed on it, so it stays in the scrollback.

Besides PCIe's columns, each link of the metric table (``sidecar.views.links``) has a share and a
rate column, named by the short name its maximum declares, where some GPU of the table has the
link.

The figures' columns are the means of the last few cycles (``HISTORY``), folded by the judge's one
window (``sidecar.judge.window``). The verdict column is the agent's own verdict, never judged
here: the ``Verdict`` the agent judged on its recent window (``sidecar.judge.verdict``: the first
finding in the order of ``sidecar.judge.rules.PRECEDENCE`` and how many more), as ``status``,
``diagnose`` and the ``gpu_verdict`` series say it; where only the exported ``gpu_verdict`` is at
hand, its kind. ``gpu-sidecar diagnose`` explains a verdict with its figures and remedies.
"""

from __future__ import annotations

import atexit
import os
import textwrap
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO

from sidecar.judge.figures import Figures
from sidecar.judge.rules import cell_of
from sidecar.judge.series import exported_verdicts, figures_of
from sidecar.judge.verdict import Verdict, ok_cell
from sidecar.judge.window import Window, summarize
from sidecar.samples import Series
from sidecar.views import links
from sidecar.views.links import Link
from sidecar.views.terminal import capable_terminal, isatty

HIDE_CURSOR, SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"
ALT_SCREEN, MAIN_SCREEN = "\x1b[?1049h", "\x1b[?1049l"
HOME, CLEAR_LINE_END, CLEAR_BELOW = "\x1b[H", "\x1b[K", "\x1b[J"
HISTORY = 5  # cycles the figures, the quantiles and the retries are taken over
LEGEND_START = "legend: "
ASK = "gpu-sidecar diagnose"  # the verdict's why, asked of an agent on the default socket
MORE = "… {n} more GPUs not shown (enlarge the terminal or use --output prometheus)"
GiB = 1024**3


@dataclass(frozen=True)
class Column:
    key: str
    title: str
    width: int
    group: str  # the layer it belongs to; "" for the GPU and verdict columns
    left: bool = False
    legend: str = ""  # what the legend says about it, when it is shown


# the columns before the links besides PCIe, and after them
_LEADING = (
    Column("gpu", "GPU", 3, ""),
    Column("util", "util", 4, "compute"),
    Column("occ", "occ", 4, "compute"),
    Column("tensor", "tensor", 6, "compute"),
    Column("used", "used GiB", 8, "memory", legend="used GiB: used/total"),
    Column("dram", "dram", 4, "memory"),
    Column("frag", "frag", 4, "memory"),
    Column("retry", "retry", 5, "memory",
           legend=f"retry: allocator retries in the last {HISTORY} samples"),
    Column("rx", "RX%", 4, "IO", legend="RX%/TX%: PCIe share of the link"),
    Column("tx", "TX%", 4, "IO"),
    Column("rx_rate", "RX GB/s", 7, "IO"),
    Column("tx_rate", "TX GB/s", 7, "IO"),
)
_TRAILING = (
    Column("p50", "p50", 5, "app"),
    Column("p99", "p99", 5, "app"),
    Column("verdict", "verdict", 16, "", left=True, legend="why: " + ASK),
)
# dropped in this order until the table fits the terminal; GPU, p99 and verdict always stay. The
# other links' rates go first, their shares after PCIe's rates (the share is what the verdict
# judges): drop_order() puts them around these
_DROP_FIRST = ("tensor", "p50", "rx_rate", "tx_rate")
_DROP_THEN = ("dram", "used", "util", "retry", "frag", "tx", "rx", "occ")


def _share_key(lk: Link) -> str:
    return f"{lk.key}_share"


def _rate_key(lk: Link) -> str:
    return f"{lk.key}_rate"


def link_columns(lk: Link) -> tuple[Column, Column]:
    """A link's two columns, named by its short name (``link=`` on its maximum in the metric
    table): its RX/TX shares of its maximum (``SHORT%``), then its RX/TX rates (``SHORT GB/s``)."""
    share, rate = f"{lk.short}%", f"{lk.short} GB/s"
    return (Column(_share_key(lk), share, max(7, len(share)), "IO",
                   legend=f"{share}: {lk.name} RX/TX share of its maximum"),
            Column(_rate_key(lk), rate, max(8, len(rate)), "IO", legend=f"{rate}: {lk.name} RX/TX"))


def columns(shown: Sequence[Link] = ()) -> tuple[Column, ...]:
    """Every column of a table whose GPUs have the links ``shown`` besides PCIe."""
    return (*_LEADING, *(c for lk in shown for c in link_columns(lk)), *_TRAILING)


def drop_order(shown: Sequence[Link] = ()) -> tuple[str, ...]:
    """The columns' keys in the order they go when the terminal is narrow."""
    return (*map(_rate_key, shown), *_DROP_FIRST, *map(_share_key, shown), *_DROP_THEN)


_GROUP_SEP = " | "
_SHORT_GROUP = {"compute": "comp", "memory": "mem"}


def _groups(cols: Sequence[Column]) -> list[list[int]]:
    """Indexes of ``cols``, grouped by consecutive layer."""
    out: list[list[int]] = []
    for i, col in enumerate(cols):
        if out and cols[out[-1][0]].group == col.group:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def width_of(cols: Sequence[Column]) -> int:
    groups = _groups(cols)
    return (sum(c.width for c in cols) + len(cols) - len(groups)
            + len(_GROUP_SEP) * (len(groups) - 1))


def layout(width: int | None, shown: Sequence[Link] = ()) -> tuple[Column, ...]:
    """The columns that fit ``width`` characters (all of them for None) of a table whose GPUs
    have the links ``shown``: the less important ones are dropped whole, never cut."""
    cols = columns(shown)
    for key in drop_order(shown):
        if width is None or width_of(cols) <= width:
            break
        cols = tuple(c for c in cols if c.key != key)
    return cols


def shown_links(windows: Iterable[Window]) -> tuple[Link, ...]:
    """The links besides PCIe that some GPU of the table has (its maximum or a rate read): a
    node without a link shows no columns for it, a Grace Hopper node its C2C columns."""
    windows = tuple(windows)
    return tuple(lk for lk in links.beside_pcie() if any(lk.present(w.mean) for w in windows))


def _line(cells: Mapping[str, str], cols: Sequence[Column]) -> str:
    parts = []
    for group in _groups(cols):
        parts.append(" ".join(
            cells[cols[i].key].ljust(cols[i].width) if cols[i].left
            else cells[cols[i].key].rjust(cols[i].width) for i in group))
    return _GROUP_SEP.join(parts).rstrip()


def header(cols: Sequence[Column]) -> list[str]:
    """Two lines: the layers over their columns, then the columns; and a rule."""
    layer = []
    for group in _groups(cols):
        span = sum(cols[i].width for i in group) + len(group) - 1
        name = cols[group[0]].group
        if len(name) > span:
            name = _SHORT_GROUP.get(name, name)[:span]
        layer.append(name.ljust(span))
    titles = _line({c.key: c.title for c in cols}, cols)
    return [_GROUP_SEP.join(layer).rstrip(), titles, "-" * len(titles)]


def legend(cols: Sequence[Column], ask: str = ASK) -> str:
    """The columns' legend; ``ask``: the exact command that asks this agent why (with its
    ``--socket`` when it is not the default one, as a simulated agent's private socket is not:
    a second terminal's plain ``diagnose`` would not find it)."""
    return LEGEND_START + "; ".join(("why: " + ask) if c.key == "verdict" else c.legend
                                    for c in cols if c.legend)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def _rate(value: float | None) -> str:
    """GB/s, the number only (the header says the unit)."""
    if value is None:
        return "-"
    gb = value / 1e9
    return f"{gb:.1f}" if gb < 100 else f"{gb:.0f}"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.1f}s"


def _memory(used: float | None, total: float | None) -> str:
    if used is None:
        return "-"
    return f"{used / GiB:.0f}/{total / GiB:.0f}" if total else f"{used / GiB:.0f}"


def _pair(values: Sequence[float | None], show: Callable[[float], str]) -> str:
    """RX/TX in one cell, in the order of PCIe's columns (``-`` for a direction not read)."""
    if all(v is None for v in values):
        return "-"
    return "/".join("-" if v is None else show(v) for v in values)


def _rates(values: Sequence[float | None]) -> str:
    return _pair(values, lambda v: f"{v / 1e9:.0f}")


def _shares(values: Sequence[float | None]) -> str:
    """Both directions' shares in percent, as PCIe's RX%/TX% columns round them."""
    return _pair(values, lambda v: f"{v * 100:.0f}")


def _verdict_cell(w: Window, v: Verdict | None, exported: str | None) -> str:
    """The agent's verdict: its ``Verdict`` (the first finding, the clock's reason, how many
    more), else the kind its ``gpu_verdict`` series carried; ``-`` before it judged the GPU."""
    if v is not None:
        return v.short()
    if exported is None:
        return "-"
    return ok_cell(w.mean) if exported == "none" else cell_of(exported)


def cells(w: Window, v: Verdict | None = None, exported: str | None = None) -> dict[str, str]:
    """Every column's cell for one GPU, the columns of every link besides PCIe included: the
    figures of ``w``, the verdict the agent gave (``v``, or the kind it ``exported``)."""
    m = w.mean
    others = links.beside_pcie()
    if w.lost:
        out = {c.key: "-" for c in columns(others)}
        out.update(gpu=m.index, verdict=_verdict_cell(w, v, exported))
        return out
    out = {
        "gpu": m.index, "util": _pct(m.utilization), "occ": _pct(m.occupancy),
        "tensor": _pct(m.tensor), "used": _memory(m.mem_used, m.mem_total),
        "dram": _pct(m.dram_bw), "frag": _pct(m.fragmentation),
        "retry": "-" if w.retries is None else f"{w.retries:.0f}",
        "rx": _pct(m.pcie_rx_ratio), "tx": _pct(m.pcie_tx_ratio),
        "rx_rate": _rate(m.pcie_rx), "tx_rate": _rate(m.pcie_tx), "p50": _seconds(w.p50),
        "p99": _seconds(w.p99), "verdict": _verdict_cell(w, v, exported),
    }
    for lk in others:
        out[_share_key(lk)] = _shares([getattr(m, r.share) for r in lk.received_first])
        out[_rate_key(lk)] = _rates([getattr(m, r.figure) for r in lk.received_first])
    return out


def render(cycles: Sequence[Mapping[str, Figures]], title: str, *,
           verdicts: Mapping[str, Verdict] | None = None, exported: Mapping[str, str] | None = None,
           width: int | None = None, height: int | None = None, ask: str = ASK) -> str:
    """One frame, plain text: the title, the header and a row per GPU, its figures the means of
    ``cycles``, its verdict the agent's (``verdicts``, else the kinds it ``exported``).

    With ``width``, only the columns that fit it (``layout``) and prose wrapped to it; with
    ``height``, at most that many lines: when not every GPU fits, the legend goes, the GPUs that
    are lost or have a bottleneck come first and a last line says how many are not shown. The
    links besides PCIe have columns where some GPU of the table has them (``shown_links``)."""

    def wrap(text: str) -> list[str]:
        if width is None:
            return [text]
        return textwrap.wrap(text, max(width, 20), subsequent_indent="  ",
                             break_on_hyphens=False) or [""]

    windows = summarize(cycles)
    cols = layout(width, shown_links(windows.values()))
    verdicts, exported = verdicts or {}, exported or {}

    def row(uuid: str) -> str:
        return _line(cells(windows[uuid], verdicts.get(uuid), exported.get(uuid)), cols)

    order = sorted(windows, key=lambda u: (len(windows[u].mean.index), windows[u].mean.index))
    head = [*wrap(title), *header(cols)]
    rows = [row(uuid) for uuid in order]
    if not order:
        rows = wrap("no GPU selected yet: waiting for the app to announce its GPUs (--gpus)")
    tail = [*_engine_line(windows, wrap), *wrap(legend(cols, ask))]
    if height is None or len(head) + len(rows) + len(tail) <= height:
        return "\n".join(head + rows + tail)
    # short of lines: the legend goes, the title and the note of GPUs left out take one line
    # each, and at least one GPU is shown (a small terminal still answers "is it healthy?")
    def urgent_first(uuid: str) -> bool:
        v, kind = verdicts.get(uuid), exported.get(uuid, "none")
        return not (windows[uuid].lost or (v.findings if v is not None else kind != "none"))

    urgent = sorted(order, key=urgent_first)
    head = [_one_line(title, width), *header(cols)]
    fits = height - len(head)
    if fits >= len(order):
        return "\n".join(head + rows[:max(fits, 1)])
    shown = max(fits - 1, 1)
    more = _one_line(MORE.format(n=len(order) - shown), width)
    return "\n".join(head + [row(u) for u in urgent[:shown]] + [more])


def _one_line(text: str, width: int | None) -> str:
    if width is None or len(text) <= width:
        return text
    return text[: max(width - 1, 1)] + "…"


def _engine_line(windows: Mapping[str, Window], wrap: Callable[[str], list[str]]
                 ) -> list[str]:
    """The serving engine's figures (the pod's, the same for every GPU), when one is read."""
    w = next((w for w in windows.values() if w.mean.engine), None)
    if w is None:
        return []
    m = w.mean
    preempted = w.increases.get("preemptions")
    whose = " (p50/p99 above are the engine's: the app publishes none)" \
        if m.latency_source == "engine" else ""
    return wrap(f"engine {m.engine}: KV cache {_pct(m.kv_usage)}, running "
                f"{'-' if m.running is None else f'{m.running:.0f}'}, waiting "
                f"{'-' if m.waiting is None else f'{m.waiting:.0f}'}, preempted "
                f"{'-' if preempted is None else f'+{preempted:.0f}'}; p99 request "
                f"{_seconds(w.engine_p99)}, queue {_seconds(w.queue_p99)}, first token "
                f"{_seconds(w.ttft_p99)}{whose}")


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
                 ask: str = ASK, verdicts: Callable[[], Mapping[str, Verdict]] | None = None
                 ) -> None:
        """``verdicts``: the agent's current verdicts (``Agent.verdicts``), read at each frame;
        without it, the kinds of the ``gpu_verdict`` series the cycle carries."""
        self.stream = stream
        self.ask = ask
        self.live = capable_terminal(stream) if live is None else live
        self.verdicts = verdicts
        self._cycles: deque[dict[str, Figures]] = deque(maxlen=history)
        self._exported: dict[str, str] = {}  # the agent's verdicts in the last cycle
        self._title = ""  # of the last frame drawn live, and its terminal's width: what
        self._width = 0  # restore() leaves on the main screen
        self._on_screen = False

    def frame(self, series: list[Series]) -> str:
        gpus = figures_of(series)
        self._cycles.append(gpus)
        self._exported = exported_verdicts(series)
        title = title_of(series, gpus)
        if not self.live:  # a file, a pipe or a dumb terminal: whole frames, one after another
            width = _size(self.stream)[0] if isatty(self.stream) else None
            return self._render(title, width=width) + "\n\n"
        columns, rows = _size(self.stream)
        self._title, self._width = title, columns
        drawn = self._render(title, width=columns, height=max(rows - 1, 1))
        lines = [line[:columns] for line in drawn.splitlines()][:max(rows - 1, 1)]
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
        # what stays on the main screen at exit: every GPU, at the terminal's width
        last = self._render(self._title, width=self._width)
        return MAIN_SCREEN + SHOW_CURSOR + last + "\n"

    def _render(self, title: str, *, width: int | None, height: int | None = None) -> str:
        verdicts = dict(self.verdicts()) if self.verdicts is not None else None
        return render(self._cycles, title, verdicts=verdicts, exported=self._exported,
                      width=width, height=height, ask=self.ask)

    def _restore_at_exit(self) -> None:
        """An exit that skipped the sink's close (an exception) must not leave the terminal on
        the alternate screen with its cursor hidden."""
        try:
            self.stream.write(self.restore())
            self.stream.flush()
        except (OSError, ValueError):
            pass


def _size(stream: TextIO) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return 120, 50
    return size.columns or 120, size.lines or 50
