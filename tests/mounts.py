"""Real filesystems for the tests of the disk and volume promises: a tmpfs mounted for the test
(read-only, or small enough to fill), unmounted afterwards whatever the test did. Mounting needs
root (CI here runs as root); where the kernel refuses, the test is skipped with the reason."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(where: Path, *, size: str = "1m", read_only: bool = False) -> Iterator[Path]:
    """Mount a fresh tmpfs at ``where`` (created) for the block, then unmount it."""
    where.mkdir(parents=True, exist_ok=True)
    options = f"size={size},mode=0755" + (",ro" if read_only else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): needs root and a "
                    "kernel that allows mounts")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def fill(directory: Path) -> None:
    """Fill the filesystem of ``directory`` to the last block: the next write gets ENOSPC."""
    with open(directory / "filler", "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    with open(directory / "filler-tail", "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0")
            f.flush()
