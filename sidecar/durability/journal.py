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
journal's tail, which the per-record CRC detects. Record layout: body length (u32) | samples
(u32) | CRC-32 of body (u32) | body, where the body is one cycle encoded by the sink's codec as
a whole uncompressed request (a remote-write ``WriteRequest``, an OTLP
``ExportMetricsServiceRequest``): requests of either protocol joined are one request, so the
sealed batch is these bodies joined (then compressed by the codec), and a replay needs no
decoding.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import zlib
from collections.abc import Iterator
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

    def append(self, body: bytes, samples: int) -> None:
        """Raises OSError when the disk refuses; the caller counts that and goes on.

        The file is opened for each record rather than held open: an agent that holds no file
        open for writing between cycles does not stop its volume from being remounted (and
        three system calls a cycle cost nothing next to sampling)."""
        data = RECORD.pack(len(body), samples, zlib.crc32(body)) + body
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            before = os.fstat(fd).st_size
            if os.write(fd, data) != len(data):  # a nearly full disk: no torn record left
                os.ftruncate(fd, before)
                raise OSError(errno.ENOSPC, "short write to the journal (disk full)")
        finally:
            os.close(fd)
        self.records += 1
        self.samples += samples

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


def read_records(path: Path) -> Iterator[tuple[bytes, int]]:
    """The intact records of a journal, (body, samples) in order, up to the first torn or
    damaged one."""
    data = path.read_bytes()
    offset = 0
    while offset + RECORD.size <= len(data):
        length, samples, crc = RECORD.unpack_from(data, offset)
        body = data[offset + RECORD.size:offset + RECORD.size + length]
        if len(body) != length or zlib.crc32(body) != crc:
            return
        yield body, samples
        offset += RECORD.size + length


def leftovers(directory: Path) -> list[tuple[int, Path]]:
    """Journals of batches that were never sealed (the agent died), oldest first."""
    found = []
    for entry in directory.glob(f"*{SUFFIX}"):
        stem = entry.name.removesuffix(SUFFIX)
        if stem.isdigit() and len(stem) == 20:
            found.append((int(stem), entry))
    return sorted(found)
