"""Figures in words, as every report, table and verdict writes them: one place per unit, so a
share reads the same in diagnose's evidence, the live table and fleet ("absent" where there is
no figure, never a zero)."""

from __future__ import annotations

GiB = 1024**3


def pct(value: float | None) -> str:
    return "absent" if value is None else f"{value * 100:.1f} %"


def gbps(value: float | None) -> str:
    return "absent" if value is None else f"{value / 1e9:.1f} GB/s"


def ms(value: float | None) -> str:
    return "absent" if value is None else f"{value * 1000:.0f} ms"


def ghz(value: float | None) -> str:
    return "absent" if value is None else f"{value / 1e9:.2f} GHz"


def watts(value: float | None) -> str:
    return "absent" if value is None else f"{value:.0f} W"


def celsius(value: float | None) -> str:
    return "absent" if value is None else f"{value:.0f} °C"


def link(gen: float | None, width: float | None) -> str:
    """A link state as lspci and nvidia-smi say it: Gen4 x16."""
    g = "Gen?" if gen is None else f"Gen{gen:.0f}"
    return g + ("" if width is None else f" x{width:.0f}")


def ratio_of(value: float | None, maximum: float | None) -> float | None:
    return None if value is None or not maximum else value / maximum



def gib(value: float | None) -> str:
    return "absent" if value is None else f"{value / GiB:.1f} GiB"
