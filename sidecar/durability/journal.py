"""The journal of the open batch: every cycle reaches disk before the next one is sampled.

A spooled sink (remote-write, OTLP: ``sidecar.sinks.spooled.SpooledSink``) keeps the batch it
is filling in memory for a whole push interval (15 s by default). Without a journal, a SIGKILL
or an OOM kill loses that batch: up to fifteen samples per series. So each cycle's series are
also appended, as one record, to a file named after the spool sequence number the batch will
have once sealed. Sealing writes the batch to the spool, then deletes the journal; a journal
found at start-up was never sealed and is replayed into the spool under its own number, so the
send order stays the sampling order.

Records are appended with ``write(2)`` and not fsynced: a process that dies keeps what it wrote
(the kernel has it), which is the failure this is for; a node that loses power may lose the
journal's tail, which the per-record CRC detects. A damaged record costs only itself: the records
after it are still replayed (``parse``), and the damage is counted. Record layout: body length (u32) | samples
(u32) | CRC-32 of body (u32) | body, where the body is one cycle encoded by the sink's codec as
a whole uncompressed request (a remote-write ``WriteRequest``, an OTLP
``ExportMetricsServiceRequest``): requests of either protocol joined are one request, so the
sealed batch is these bodies joined (then compressed by the codec), and a replay needs no
decoding.

A journal is read only when it is a regular file of the agent's own (``read_own``): a link, a
FIFO, a socket, a device or a directory named like one is never opened nor followed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

RECORD = struct.Struct("<III")
SUFFIX = ".journal"


def journal_path(directory: Path, seq: int) -> Path:
    return directory / f"{seq:020d}{SUFFIX}"


class Journal:
    """An append-only file of cycle records for the batch that will be spooled as ``seq``."""

    def __init__(self, directory: Path, seq: int) -> None:
        self.seq = seq
        self.path = journal_path(directory, seq)
        self.records = 0
        self.samples = 0
        self.bytes = 0  # on the volume: counted against the spool's bound

    def append(self, body: bytes, samples: int) -> None:
        """Raises OSError when the disk refuses; the caller counts that and goes on.

        The file is opened for each record rather than held open: an agent that holds no file
        open for writing between cycles does not stop its volume from being remounted (and
        three system calls a cycle cost nothing next to sampling)."""
        data = RECORD.pack(len(body), samples, zlib.crc32(body)) + body
        # never through a link: a link named like the journal must not make the agent append
        # to a file outside the spool (ELOOP, counted by the caller as a refused write)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        try:
            before = os.fstat(fd).st_size
            if os.write(fd, data) != len(data):  # a nearly full disk: no torn record left
                os.ftruncate(fd, before)
                raise OSError(errno.ENOSPC, "short write to the journal (disk full)")
        finally:
            os.close(fd)
        self.records += 1
        self.samples += samples
        self.bytes += len(data)

    def discard(self) -> None:
        """The batch is sealed in the spool (or counted as lost): nothing left to recover."""
        if self.records:
            remove(self.path)


def remove(path: Path) -> None:
    """Delete a journal. One that cannot be deleted (a read-only volume, a directory of that
    name) stays where it is: the next start replays it, which sends nothing twice (its batch was
    not spooled either), and start-up never fails on it."""
    with contextlib.suppress(OSError):
        path.unlink()


class NotOwnFile(OSError):
    """A spool entry that is not a regular file of the agent's own: never opened, read, sized or
    followed. ``kind`` says what it is (``symlink``, ``fifo``, ``socket``, ``device``,
    ``directory``, ``file of another owner``)."""

    def __init__(self, kind: str, path: Path | str) -> None:
        super().__init__(errno.EPERM, f"not a regular file of the agent's own ({kind})", str(path))
        self.kind = kind


def not_own_file(st: os.stat_result) -> str | None:
    """What an entry is, from its ``lstat``, when it is not a regular file of this agent's
    user; None when it is one."""
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return None if st.st_uid == os.geteuid() else "file of another owner"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "special file"


def read_own(path: Path, limit: int | None = None) -> bytes:
    """The bytes of ``path`` (the first ``limit`` of them), only when it is a regular file of the
    agent's own; anything else raises ``NotOwnFile`` before it is opened. A link is never
    followed (``O_NOFOLLOW``), a FIFO swapped in after the check never blocks (``O_NONBLOCK``),
    and the opened file is checked again (``fstat``: the same inode, still a regular file)."""
    before = os.lstat(path)
    kind = not_own_file(before)
    if kind is not None:
        raise NotOwnFile(kind, path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotOwnFile("symlink", path) from None
        if exc.errno == errno.ENXIO:
            raise NotOwnFile("socket", path) from None
        raise
    try:
        st = os.fstat(fd)
        kind = not_own_file(st)
        if kind is None and (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
            kind = "file replaced while being opened"
        if kind is not None:
            raise NotOwnFile(kind, path)
        chunks, left = [], limit
        while left is None or left > 0:
            chunk = os.read(fd, 1 << 20 if left is None else min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            if left is not None:
                left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class Replay:
    """What a journal holds: its intact records, (body, samples) in order; ``damaged``, the
    records skipped because they failed their check (each one cycle lost; a region whose
    lengths cannot be followed counts as one: at least that many were lost); ``torn``, whether it
    ends in a record cut short (the cycle being written when the process died, not counted as
    damage)."""

    records: list[tuple[bytes, int]] = field(default_factory=list)
    damaged: int = 0
    torn: bool = False


def _intact_end(data: bytes, offset: int, *, strict: bool = False) -> int | None:
    """The end of the intact record at ``offset``, or None. ``strict`` (when resynchronising
    inside damage) also asks for a plausible frame: a body and samples, no more samples than
    body bytes, so that zeroes or stray bytes are not taken for an empty record."""
    if offset + RECORD.size > len(data):
        return None
    length, samples, crc = RECORD.unpack_from(data, offset)
    end = offset + RECORD.size + length
    if end > len(data) or (strict and not 0 < samples <= length):
        return None
    return end if zlib.crc32(data[offset + RECORD.size:end]) == crc else None


def _records_between(data: bytes, start: int, stop: int) -> int:
    """How many records lie between ``start`` and ``stop`` by their own lengths, when those lead
    exactly from one to the other; else one (its length is what was damaged)."""
    hops, at = 0, start
    while at + RECORD.size <= stop:
        at += RECORD.size + RECORD.unpack_from(data, at)[0]
        hops += 1
    return hops if at == stop else 1


def parse(data: bytes) -> Replay:
    """Every intact record, in order, skipping damaged ones. A record that fails its CRC but
    whose length leads to the next intact record (or exactly to the end) is skipped by its
    length; one whose length is damaged is skipped by scanning forward for the next offset where
    an intact record starts. A record cut short at the end, with nothing intact after it, is
    torn (a crash mid-write): the cycle in progress, not damage."""
    records: list[tuple[bytes, int]] = []
    damaged = 0
    offset = 0
    while offset + RECORD.size <= len(data):
        end = _intact_end(data, offset)
        if end is not None:
            samples = RECORD.unpack_from(data, offset)[1]
            records.append((data[offset + RECORD.size:end], samples))
            offset = end
            continue
        framed = offset + RECORD.size + RECORD.unpack_from(data, offset)[0]
        if framed == len(data) or (framed < len(data) and _intact_end(data, framed) is not None):
            offset = framed  # its frame holds: only its body or checksum is damaged
            damaged += 1
            continue
        resync = next((at for at in range(offset + 1, len(data) - RECORD.size + 1)
                       if _intact_end(data, at, strict=True) is not None), None)
        if resync is None:  # nothing intact after it: the last record
            if framed > len(data):
                return Replay(records=records, damaged=damaged, torn=True)
            return Replay(records=records, damaged=damaged + 1)
        damaged += _records_between(data, offset, resync)
        offset = resync
    return Replay(records=records, damaged=damaged, torn=offset < len(data))


def read(path: Path) -> Replay:
    """A journal's records (``parse``); raises ``NotOwnFile`` for anything but a regular file of
    the agent's own, OSError when it cannot be read."""
    return parse(read_own(path))


def is_journal_name(name: str) -> bool:
    """A journal's file name: the batch's 20-digit sequence number and ``SUFFIX``."""
    stem = name.removesuffix(SUFFIX)
    return name.endswith(SUFFIX) and stem.isdigit() and len(stem) == 20


def leftovers(directory: Path) -> list[tuple[int, Path]]:
    """Journals of batches that were never sealed (the agent died), oldest first: regular files
    only, by ``lstat`` (the spool moves anything else named like a journal aside at start)."""
    found = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if is_journal_name(entry.name) and entry.is_file(follow_symlinks=False):
                    found.append((int(entry.name.removesuffix(SUFFIX)), Path(entry.path)))
    except OSError:
        return []
    return sorted(found)
