"""The disk spool: every encoded batch is on disk before its first send.

One file per batch, named by a sequence number so that the directory order is the send order.
A file is written to a temporary name, flushed to disk and renamed, so a crash leaves either the
whole batch or nothing; it is deleted only after the receiver accepted it. Beyond the size bound
the oldest batches go first (counted). A file that fails its checksum (torn write on a full disk,
bit rot, someone else's file) is moved to ``corrupt/`` and counted, never a crash; a batch the
receiver refused for good is moved to ``rejected/`` for a person to look at.

File layout: ``GSB1`` | body length (u32) | samples (u32) | CRC-32 of body (u32) | body, where the
body is the request exactly as sent (snappy-compressed remote-write protobuf).
"""

from __future__ import annotations

import os
import re
import struct
import threading
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger("sidecar.spool")

MAGIC = b"GSB1"
HEADER = struct.Struct("<4sIII")
NAME = re.compile(r"^(\d{20})\.batch$")


class SpoolError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class SpooledBatch:
    seq: int
    path: Path
    samples: int
    body: bytes


class Spool:
    def __init__(self, directory: str | Path, max_bytes: int) -> None:
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self.dropped_samples: Counter[str] = Counter()  # by reason: spool_full, corrupt, rejected
        self.dropped_batches: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._write_failing = False
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(self.dir, 0o700)
            probe = self.dir / ".write-test"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise SpoolError(
                f"spool directory {self.dir} is not writable ({exc.strerror}); mount a writable "
                "emptyDir there or set --spool-dir / GPU_SIDECAR_SPOOL_DIR"
            ) from exc
        for leftover in self.dir.glob("*.tmp"):
            leftover.unlink(missing_ok=True)  # a write interrupted by a crash: never renamed
        self._index: dict[int, tuple[Path, int, int]] = {}  # seq -> (path, size, samples)
        for entry in sorted(self.dir.iterdir()):
            m = NAME.match(entry.name)
            if m:
                self._index[int(m.group(1))] = (entry, entry.stat().st_size, self._samples(entry))
        self._next = max(self._index, default=0) + 1
        if self._index:
            log.info("spool_replay", directory=str(self.dir), batches=len(self._index),
                     bytes=self.bytes())

    @staticmethod
    def _samples(path: Path) -> int:
        try:
            with path.open("rb") as f:
                head = f.read(HEADER.size)
            if len(head) == HEADER.size and head[:4] == MAGIC:
                return HEADER.unpack(head)[2]
        except OSError:
            pass
        return 0

    def bytes(self) -> int:
        with self._lock:
            return sum(size for _, size, _ in self._index.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def put(self, body: bytes, samples: int) -> SpooledBatch | None:
        """Write a batch durably; returns None when it alone exceeds the bound (dropped)."""
        data = HEADER.pack(MAGIC, len(body), samples, zlib.crc32(body)) + body
        with self._lock:
            if len(data) > self.max_bytes:
                self._count_drop("spool_full", samples)
                log.error("batch_larger_than_spool", bytes=len(data), max_bytes=self.max_bytes,
                          samples=samples, hint="raise --spool-max-bytes or lower --push-interval")
                return None
            total = sum(size for _, size, _ in self._index.values())
            while self._index and total + len(data) > self.max_bytes:
                oldest = min(self._index)
                path, size, old_samples = self._index.pop(oldest)
                path.unlink(missing_ok=True)
                total -= size
                self._count_drop("spool_full", old_samples)
                log.warning("spool_full_dropped_oldest", batch=path.name, samples=old_samples,
                            max_bytes=self.max_bytes,
                            effect="oldest samples lost; the receiver has been down too long")
            seq = self._next
            self._next += 1
        path = self.dir / f"{seq:020d}.batch"
        tmp = path.with_suffix(".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # private to the agent
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self._count_drop("spool_write_failed", samples)
            if not self._write_failing:  # once per episode, not once per batch
                self._write_failing = True
                log.error("spool_write_failed", error=exc.strerror, directory=str(self.dir),
                          samples=samples, hint="free space in the spool volume or raise its size",
                          effect="batches are dropped and counted until a write succeeds")
            return None
        if self._write_failing:
            self._write_failing = False
            log.info("spool_write_recovered", directory=str(self.dir))
        with self._lock:
            self._index[seq] = (path, len(data), samples)
        return SpooledBatch(seq, path, samples, body)

    def _count_drop(self, reason: str, samples: int) -> None:
        self.dropped_batches[reason] += 1
        self.dropped_samples[reason] += samples

    def oldest(self) -> SpooledBatch | None:
        """The next batch to send, verified; corrupt files are moved aside on the way."""
        while True:
            with self._lock:
                if not self._index:
                    return None
                seq = min(self._index)
                path, _, samples = self._index[seq]
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                with self._lock:
                    self._index.pop(seq, None)
                continue
            problem = _verify(data)
            if problem is None:
                return SpooledBatch(seq, path, samples, data[HEADER.size:])
            self._move(seq, "corrupt", samples)
            log.error("spool_batch_corrupt", batch=path.name, problem=problem,
                      moved_to=str(self.dir / "corrupt"), effect="skipped; later batches flow")

    def remove(self, batch: SpooledBatch) -> bool:
        """The receiver accepted ``batch``. If the size bound dropped it while it was in flight,
        it was delivered after all: take it back out of the dropped counts."""
        with self._lock:
            held = self._index.pop(batch.seq, None) is not None
            if not held:
                self.dropped_batches["spool_full"] -= 1
                self.dropped_samples["spool_full"] -= batch.samples
        batch.path.unlink(missing_ok=True)
        return held

    def set_aside(self, batch: SpooledBatch) -> Path:
        return self._move(batch.seq, "rejected", batch.samples)

    def _move(self, seq: int, where: str, samples: int) -> Path:
        with self._lock:
            entry = self._index.pop(seq, None)
            self._count_drop(where, samples)
        target_dir = self.dir / where
        target_dir.mkdir(exist_ok=True, mode=0o700)
        target = target_dir / f"{seq:020d}.batch"
        if entry is not None:
            try:
                os.replace(entry[0], target)
            except OSError:
                entry[0].unlink(missing_ok=True)
        return target


def _verify(data: bytes) -> str | None:
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
