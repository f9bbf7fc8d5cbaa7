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


TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a whole process (all its threads), from /proc (fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def status_mib(pid: int, key: str) -> float:
    """A memory figure of /proc/<pid>/status (VmRSS, VmHWM, ...) in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)
