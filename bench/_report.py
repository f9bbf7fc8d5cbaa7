"""Shared tail of the benchmark reports: a Markdown section printed last, and the exit code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def heading(title: str, detail: str = "") -> str:
    extra = f", {detail}" if detail else ""
    return (f"## {title} ({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, Python "
            f"{sys.version.split()[0]}{extra})")


def section(lines: list[str], ok: bool, what: str = "All targets met") -> str:
    """The report's Markdown: ``lines`` and the verdict line."""
    return "\n".join([*lines, "", f"{what}: {'yes' if ok else 'NO'}", ""])


def finish(lines: list[str], ok: bool, what: str = "All targets met") -> int:
    """Print the report; the exit code."""
    print(section(lines, ok, what))
    return 0 if ok else 1


def replace_section(path: Path, text: str, title: str, last: str,
                    what: str = "All targets met") -> None:
    """Put ``text`` (a ``section``) in place of the generated part of ``path``'s section whose
    heading starts with ``## {title}``: from the heading to its first line starting with ``last``,
    and the verdict line (``{what}: ``) if that comes next. What follows (the prose on the
    figures) stays. Raises if there is no such section, or no such line before the next one."""
    old = path.read_text().split("\n")
    start = next((i for i, line in enumerate(old) if line.startswith(f"## {title}")), None)
    if start is None:
        raise ValueError(f"{path}: no section '## {title}'")
    end = next((i for i in range(start + 1, len(old)) if old[i].startswith((last, "## "))),
               len(old))
    if end == len(old) or not old[end].startswith(last):
        raise ValueError(f"{path}: section '{title}' has no line starting with '{last}'")
    end += 1  # past the ``last`` line
    rest = end
    while rest < len(old) and not old[rest].strip():
        rest += 1
    if rest < len(old) and old[rest].startswith(f"{what}: "):
        end = rest + 1
    new = text.rstrip("\n").split("\n")
    path.write_text("\n".join([*old[:start], *new, *old[end:]]))


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


def stop(proc: subprocess.Popen | None, timeout: float = 20.0) -> None:
    """SIGTERM, as a pod's end sends it; SIGKILL only past ``timeout``."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_until(condition, timeout: float, what: str) -> None:
    """Poll ``condition`` every 50 ms until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not within {timeout} s")
        time.sleep(0.05)


def standin_seconds(fake) -> float:
    """CPU seconds spent inside the stand-in NVML's functions so far (a ``FakeNvml`` built with
    ``account_cpu=True`` records each call's), to tell them apart from the code under test's."""
    return sum(list(fake.spent))


def standin_calls(fake) -> int:
    """The stand-in NVML calls accounted so far (``account_cpu=True``)."""
    return len(fake.spent)
