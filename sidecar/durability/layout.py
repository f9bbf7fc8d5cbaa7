"""The spool directory on disk: the batch file's format, the names of its entries, and reading
only entries that are regular files of the agent's own (``journal.read_own``).

File layout: ``GSB1`` | body length (u32) | samples (u32) | CRC-32 of body (u32) | body, where the
body is the request exactly as sent (compressed by the sink's codec: snappy remote-write
protobuf, or gzip OTLP protobuf).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from sidecar.durability import journal

MAGIC = b"GSB1"
HEADER = struct.Struct("<4sIII")
URL_CONFIRMED = ".url-confirmed"  # its URL has taken a request (sinks.spooled._url_or_data)
NAME = re.compile(r"^(\d{20})\.batch$")
ASIDE = ("rejected", "corrupt")


@dataclass(frozen=True, slots=True)
class SpooledBatch:
    """A waiting batch as read for sending: ``body`` is the request as it goes on the wire."""

    seq: int
    path: Path
    samples: int
    body: bytes


class SpoolError(RuntimeError):
    pass


class SpoolLocked(SpoolError):
    pass


def entries(directory: Path, own_directory: bool = False) -> list[os.DirEntry[str]]:
    """The entries of a directory, by name; none when it cannot be listed or (``own_directory``)
    is not a directory itself, such as a link to elsewhere."""
    try:
        if own_directory and not stat.S_ISDIR(os.lstat(directory).st_mode):
            return []
        with os.scandir(directory) as entries:
            return sorted(entries, key=lambda e: e.name)
    except OSError:
        return []


def lsize(entry: os.DirEntry[str]) -> int:
    """The bytes a spool entry itself holds: a regular file's size, 0 for anything else (never
    the size of what a link points to)."""
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def lsize_path(path: Path) -> int:
    """``lsize`` of a path: never what a link there points to."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def read_batch(path: Path) -> tuple[int, bytes]:
    """A batch file's samples and body (the request as sent), read only when it is a regular
    file of the agent's own (``journal.NotOwnFile``, an OSError, otherwise); ValueError when it
    fails its check."""
    data = journal.read_own(path)
    problem = verify(data)
    if problem is not None:
        raise ValueError(problem)
    return HEADER.unpack_from(data)[2], data[HEADER.size:]


def verify(data: bytes) -> str | None:
    """What is wrong with a batch file's bytes (truncated, not ours, corrupt), or None."""
    if len(data) < HEADER.size:
        return f"truncated header ({len(data)} bytes)"
    magic, length, _, crc = HEADER.unpack_from(data)
    if magic != MAGIC:
        return "not a gpu-sidecar batch (bad magic)"
    if len(data) - HEADER.size != length:
        return f"truncated body ({len(data) - HEADER.size} of {length} bytes)"
    if zlib.crc32(data[HEADER.size:]) != crc:
        return "checksum mismatch"
    return None


def header_samples(path: Path) -> int:
    """The sample count in a batch's header; raises ``NotOwnFile`` for anything but a
    regular file of the agent's own, 0 when it cannot be read."""
    try:
        head = journal.read_own(path, HEADER.size)
    except journal.NotOwnFile:
        raise
    except OSError:
        return 0
    if len(head) == HEADER.size and head[:4] == MAGIC:
        return HEADER.unpack(head)[2]
    return 0


def write_temporary(path: Path, data: bytes) -> Path:
    """Write beside ``path`` under a temporary name and fsync it: the rename that follows
    publishes the whole file or nothing, whenever the process dies."""
    tmp = path.with_suffix(".tmp")
    # private to the agent; never through a link (a link there must not truncate its target)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def aside_dir(spool_dir: Path, where: str) -> Path:
    """``rejected/`` or ``corrupt/``, created when missing; refused (OSError) when it is not
    a directory of the spool's own, such as a link to elsewhere."""
    directory = spool_dir / where
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    if not stat.S_ISDIR(os.lstat(directory).st_mode):
        raise OSError(errno.ENOTDIR, "not a directory of the spool's own", str(directory))
    return directory
