"""Shared tail of the benchmark reports: a Markdown section printed last, and the exit code."""

from __future__ import annotations

import os
import sys
import time


def heading(title: str, detail: str = "") -> str:
    extra = f", {detail}" if detail else ""
    return (f"## {title} ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, Python "
            f"{sys.version.split()[0]}{extra})")


def finish(lines: list[str], ok: bool, what: str = "All targets met") -> int:
    print("\n".join([*lines, "", f"{what}: {'yes' if ok else 'NO'}", ""]))
    return 0 if ok else 1
