"""stdout sink: the embedded default, for a first look and for piping into other tools."""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TextIO

from sidecar.metrics import BY_NAME, histogram_of
from sidecar.samples import Labels, Series
from sidecar.views.terminal import capable_terminal

if TYPE_CHECKING:
    from sidecar.judge.verdict import Verdict


def _family(name: str) -> str:
    histogram = histogram_of(name)
    return name if histogram is None else histogram[0]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)


def prometheus_text(series: list[Series], *, timestamps: bool = True) -> str:
    """Text exposition format 0.0.4 with explicit millisecond timestamps (for a scrape, none:
    the scraper stamps them), families grouped."""
    families: dict[str, list[Series]] = {}
    for s in series:
        families.setdefault(_family(s.name), []).append(s)
    out: list[str] = []
    for family, members in families.items():
        spec = BY_NAME.get(family)
        if spec is not None:
            out.append(f"# HELP {family} {spec.help}")
            out.append(f"# TYPE {family} {spec.kind}")
        for s in members:
            labels = ",".join(f'{k}="{_escape(v)}"' for k, v in s.labels)
            head = f"{s.name}{{{labels}}}" if labels else s.name
            out.append(f"{head} {_number(s.value)} {s.timestamp_ms}" if timestamps
                       else f"{head} {_number(s.value)}")
    return "\n".join(out) + "\n"


def json_lines(series: list[Series]) -> str:
    return "".join(
        json.dumps({"name": s.name, "labels": dict(s.labels), "value": s.value,
                    "timestamp_ms": s.timestamp_ms}, separators=(",", ":")) + "\n"
        for s in series
    )


def resolve(fmt: str, stream: TextIO, environ: Mapping[str, str] | None = None) -> str:
    """``auto``: the table for a person at a terminal that can redraw in place, Prometheus text
    for everything else (pipes, files, containers, CI, and a dumb terminal: TERM=dumb or unset,
    as an editor's shell buffer), so that what scripts read stays as it was."""
    if fmt != "auto":
        return fmt
    return "table" if capable_terminal(stream, environ) else "prometheus"


def ask_command(socket: str | None) -> str:
    """The command a second terminal runs to ask the agent on ``socket`` why."""
    import shlex

    from sidecar.protocol import DEFAULT_SOCKET_PATH
    from sidecar.views.table import ASK  # the table's, loaded with it

    if socket is None or socket == DEFAULT_SOCKET_PATH:
        return ASK
    return f"{ASK} --socket {shlex.quote(socket)}"


class StdoutSink:
    name = "stdout"

    def __init__(self, fmt: str = "auto", stream: TextIO | None = None, *,
                 socket: str | None = None) -> None:
        """``socket``: the agent's app socket, named in the table's legend with the command
        that asks this agent why (``diagnose --socket PATH`` where it is not the default)."""
        self.stream = stream or sys.stdout
        self.format = resolve(fmt, self.stream)
        self._table = None
        if self.format == "table":
            from sidecar.views.table import Table  # only here: the push path never loads it

            self._table = Table(self.stream, ask=ask_command(socket))
            self.render = self._table.frame
        else:
            self.render = prometheus_text if self.format == "prometheus" else json_lines

    def follow(self, verdicts: Callable[[], Mapping[str, Verdict]]) -> None:
        """Show the agent's current verdicts (``Agent.verdicts``) in the table's verdict column
        rather than only the kinds its ``gpu_verdict`` series carry: with them, the first
        finding's detail and how many more."""
        if self._table is not None:
            self._table.verdicts = verdicts

    def emit(self, series: list[Series]) -> None:
        if not series:
            return
        try:
            self.stream.write(self.render(series))
            self.stream.flush()
        except BrokenPipeError:  # `gpu-sidecar run | head`: the reader left
            raise SystemExit(0) from None

    def start(self) -> None:
        pass

    def begin_close(self, deadline: float) -> None:
        pass

    def close(self, deadline: float) -> bool:
        if self._table is not None:  # give the terminal back: main screen, cursor, last frame
            with contextlib.suppress(BrokenPipeError, OSError, ValueError):
                self.stream.write(self._table.restore())
                self.stream.flush()
        return True

    def telemetry(self, ts: int, labels: Labels) -> list[Series]:
        return []
