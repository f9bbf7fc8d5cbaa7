"""The memory ledger: how many samples the spool holds only in memory (the volume refused them
and no journal has them), kept on disk so that a SIGKILL or an OOM kill, which would lose them
without a word, is counted by the next start (``spool_write_failed``)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

from sidecar.durability import journal

LEDGER = ".memory-ledger"  # samples held only in memory: what a kill would lose
LEDGER_RECORD = struct.Struct("<4sQ")
LEDGER_MAGIC = b"GSL1"


def read_ledger(directory: Path) -> int:
    """The samples a previous run held only in memory when it ended (0 when it ended cleanly,
    or when there is no ledger to read)."""
    try:
        data = journal.read_own(directory / LEDGER, LEDGER_RECORD.size)
    except OSError:
        return 0
    if len(data) != LEDGER_RECORD.size:
        return 0
    magic, samples = LEDGER_RECORD.unpack(data)
    return samples if magic == LEDGER_MAGIC else 0


def write_ledger(directory: Path, samples: int, *, create: bool = False) -> bool:
    """Overwrite the ledger in place; False when the volume refused. Created (and synced) while
    the volume takes writes, its bytes are already allocated, so a full volume still takes the
    overwrite; a read-only one does not, and a kill then loses the count with the samples."""
    flags = os.O_WRONLY | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
    try:
        fd = os.open(directory / LEDGER, flags, 0o600)
        try:
            os.pwrite(fd, LEDGER_RECORD.pack(LEDGER_MAGIC, samples), 0)
            if create:
                os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        return False
    return True
