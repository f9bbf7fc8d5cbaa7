"""The disk spool: every encoded batch is on disk before its first send, while the disk lets it.

One file per batch, named by a sequence number so that the directory order is the send order.
A file is written to a temporary name, flushed to disk and renamed, so a crash leaves either the
whole batch or nothing; it is deleted only after the receiver accepted it. The batch still being
filled has a journal (``sidecar.durability.journal``) under the number it will get, replayed at start.

The size bound covers everything the spool keeps: batches waiting to be sent (``pending``), and
the copies kept for a person to look at, batches the receiver refused for good (``rejected/``)
and files that failed their check (``corrupt/``). Past the bound the kept copies go first,
oldest first (their samples are already counted as lost), then the oldest waiting batches
(counted as ``spool_full``).

A disk that fails (full, read-only, a file of another owner, a directory where a batch should
be) never stops the agent, nor delivery: a batch the disk refuses is held in memory under its
number, within ``max_memory_bytes``, sent from there like any other, and written out as soon as
the disk takes writes again; only what is still held in memory when the agent stops (or what
overflows that bound) is lost, and counted (``spool_write_failed``). What cannot be read is moved
aside or skipped and counted, and each condition is logged when it starts.

The spool reads only regular files of its own (``journal.read_own``): an entry named like a batch
or a journal that is a link, a FIFO, a socket, a device, a directory or another user's file is
never opened nor followed, nor sized by what it points to; it is moved to ``corrupt/`` itself
(a link as a link, never its target), counted as an unreadable batch and logged once per kind.
Nothing outside the spool directory is ever read, sent or deleted.

The directory is locked (``flock`` on ``.lock``, which holds the owner's pid): two agents on one
spool would send each other's batches twice and delete them under each other.

File layout: ``GSB1`` | body length (u32) | samples (u32) | CRC-32 of body (u32) | body, where the
body is the request exactly as sent (compressed by the sink's codec: snappy remote-write
protobuf, or gzip OTLP protobuf).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import stat
import struct
import threading
import zlib
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from sidecar.config import Config
from sidecar.durability import journal
from sidecar.log import Episodes, log_count
from sidecar.urls import host_port, redact_url

log = structlog.get_logger("sidecar.spool")

MAGIC = b"GSB1"
HEADER = struct.Struct("<4sIII")
LEDGER = ".memory-ledger"  # samples held only in memory: what a kill would lose (``_note_held``)
LEDGER_RECORD = struct.Struct("<4sQ")
LEDGER_MAGIC = b"GSL1"
URL_CONFIRMED = ".url-confirmed"  # its URL has taken a request (sinks.spooled._url_or_data)
NAME = re.compile(r"^(\d{20})\.batch$")
ASIDE = ("rejected", "corrupt")
STATES = ("pending", "memory", *ASIDE)
DROP_REASONS = ("spool_full", "spool_write_failed", "rejected", "corrupt", "unreadable")


class SpoolError(RuntimeError):
    pass


class SpoolLocked(SpoolError):
    pass


@dataclass(frozen=True, slots=True)
class _Entry:
    """A waiting batch. ``held`` is the whole file's bytes when the disk refused them: the batch
    waits in memory instead, and ``path`` is where it will go once the disk takes writes; its
    journal, which holds the cycles journaled before the disk refused (``journaled`` samples),
    stays on disk meanwhile, so that a crash loses only the rest."""

    path: Path
    size: int
    samples: int
    held: bytes | None = None
    journal: Path | None = None
    journaled: int = 0
    journal_bytes: int = 0  # the journal's size on the volume, counted against the bound


@dataclass(frozen=True, slots=True)
class SpooledBatch:
    seq: int
    path: Path
    samples: int
    body: bytes


class Spool:
    def __init__(self, directory: str | Path, max_bytes: int,
                 max_memory_bytes: int = Config.spool_memory_max_bytes) -> None:
        self.dir = Path(directory)
        self.max_bytes = max_bytes
        self.max_memory_bytes = max_memory_bytes
        self.dropped_samples: Counter[str] = Counter({r: 0 for r in DROP_REASONS})
        self.dropped_batches: Counter[str] = Counter({r: 0 for r in DROP_REASONS})
        self._lock = threading.Lock()
        self._write_failures = Episodes()
        # journals of batches delivered or written out that the volume would not let us delete
        # (read-only): tried again once it takes writes, else the next start replays them
        self._stale_journals: deque[Path] = deque()
        self._journal_remove_failures = 0
        self._remove_failures = 0
        self._lock_fd: int | None = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(self.dir, 0o700)
            self._take_lock()
            probe = self.dir / ".write-test"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            self.close()
            raise SpoolError(
                f"spool directory {self.dir} is not writable ({exc.strerror}); mount a writable "
                "emptyDir there or set --spool-dir / GPU_SIDECAR_SPOOL_DIR"
            ) from exc
        self._ledger_written = 0
        self._lost_before_restart = _read_ledger(self.dir)
        for leftover in self.dir.glob("*.tmp"):
            with contextlib.suppress(OSError):
                leftover.unlink()  # a write interrupted by a crash (a link: the link itself)
        self._index: dict[int, _Entry] = {}  # waiting batches by sequence number
        self._aside: dict[str, dict[Path, int]] = {where: {} for where in ASIDE}  # oldest first
        self._odd_kinds: set[str] = set()  # kinds of entry set aside, each logged once
        for where in ASIDE:
            for found in _entries(self.dir / where, own_directory=True):
                if found.name.endswith(".tmp"):  # a copy a crash interrupted
                    with contextlib.suppress(OSError):
                        os.unlink(found.path)
                    continue
                self._aside[where][Path(found.path)] = _lsize(found)
        for found in _entries(self.dir):
            m = NAME.match(found.name)
            if not m and not journal.is_journal_name(found.name):
                continue
            path = Path(found.path)
            try:
                kind = journal.not_own_file(found.stat(follow_symlinks=False))
                if kind is not None:
                    raise journal.NotOwnFile(kind, path)
                if m:  # sized by the entry itself (lstat), never by what it points to
                    self._index[int(m.group(1))] = _Entry(path, _lsize(found),
                                                          self._samples(path))
            except journal.NotOwnFile as exc:
                self._set_aside_odd(path, exc.kind)
            except OSError:
                continue  # gone meanwhile
        # a journal left by a crash keeps its number: new batches come after it, and after the
        # kept copies too, so that a new copy never replaces an older one of the same number
        unsealed = [seq for seq, _ in journal.leftovers(self.dir)]
        kept = [int(m.group(1)) for where in ASIDE for p in self._aside[where]
                if (m := NAME.match(p.name))]
        self._next = max([*self._index, *unsealed, *kept], default=0) + 1
        self._in_flight: frozenset[int] = frozenset()
        self._journal_bytes = 0  # the open batch's journal (``journal_grew``)
        self._open_unjournaled = 0  # samples of the open batch its journal could not take
        self._settled = 0  # bytes besides it, as of the last trim
        self._count_lost_before_restart(self._lost_before_restart)
        self._write_ledger(0, create=True)
        self._trim()
        if self._index:
            log.info("spool_replay", directory=str(self.dir), batches=len(self._index),
                     bytes=self.bytes())

    def adopt(self, other: Path) -> tuple[int, int] | None:
        """Take over the spool of a receiver no longer configured (a typo in the URL fixed, a
        receiver moved): its waiting batches, the journals a crash left and the copies kept aside
        are renamed into this spool, in their order, after what this one already holds, so that
        the next send delivers them and the bound counts them. A crash midway leaves each file in
        one spool or the other, never both: the next start finishes the move. Only regular files
        of the agent's own move; anything else stays where it is, never opened. Returns (batches,
        samples) taken, or None when another agent holds the other spool's lock."""
        try:
            fd = os.open(other / ".lock", os.O_RDONLY | os.O_CREAT, 0o600)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
        batches = samples = 0
        with self._lock:
            self._count_lost_before_restart(_read_ledger(other))
        try:
            for where in ("", *ASIDE):
                for path in _own_batches_and_journals(other / where, journals=not where):
                    taken = self._take(path, where)
                    if taken is not None:
                        batches += 1
                        samples += taken
        finally:
            with self._lock:
                self._trim()
            for name in (".lock", ".write-test", LEDGER, URL_CONFIRMED,
                         *(p.name for p in other.glob("*.tmp"))):
                with contextlib.suppress(OSError):
                    (other / name).unlink()  # a link itself, never its target
            for directory in (*(other / where for where in ASIDE), other):
                with contextlib.suppress(OSError):
                    directory.rmdir()  # only when empty: what was not ours stays
            os.close(fd)
        return batches, samples

    def _take(self, path: Path, where: str) -> int | None:
        """Rename one adopted file under this spool's next number; the samples of a waiting
        batch so taken, else None."""
        with self._lock:
            seq = self._next
            self._next += 1
        suffix = path.name[path.name.index("."):]
        target = (self.dir / where if where else self.dir) / f"{seq:020d}{suffix}"
        try:
            if where:
                self._aside_dir(where)
            os.rename(path, target)
        except OSError:
            return None
        if NAME.match(target.name) is None:
            return None  # a journal: sealed by the sink's replay at start
        with self._lock:
            if where:
                self._aside[where][target] = _lsize_path(target)
                return None
            try:
                samples = self._samples(target)
            except journal.NotOwnFile:
                samples = 0
            self._index[seq] = _Entry(target, _lsize_path(target), samples)
            return samples

    def _count_lost_before_restart(self, samples: int) -> None:
        """The previous run was killed while the volume refused writes: the samples it held only
        in memory (``_note_held``) are lost; counted here, since that run could not."""
        if not samples:
            return
        self.dropped_samples["spool_write_failed"] += samples
        log.error("spool_write_failed_before_restart", directory=str(self.dir), samples=samples,
                  effect="the previous run was killed while the spool volume refused writes: "
                         "the samples it held only in memory are lost (counted as "
                         "reason=\"spool_write_failed\")",
                  hint="free space in the spool volume, or make it writable; raise the pod's "
                       "memory limit if it was an OOM kill")

    def _note_held(self) -> None:
        """Keep the ledger true: the samples held only in memory (refused by the volume, not in
        a journal), which a SIGKILL or an OOM kill would lose without a word. The next start
        reads it and counts them. Lock held; written only when the figure changes."""
        held = self._open_unjournaled + sum(e.samples - e.journaled
                                            for e in self._index.values() if e.held is not None)
        if held != self._ledger_written:
            self._write_ledger(held)

    def _write_ledger(self, samples: int, *, create: bool = False) -> None:
        """Overwrite the ledger in place. Created (and synced) while the volume takes writes,
        its bytes are already allocated, so a full volume still takes the overwrite; a read-only
        one does not, and a kill then loses the count with the samples."""
        flags = os.O_WRONLY | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
        try:
            fd = os.open(self.dir / LEDGER, flags, 0o600)
            try:
                os.pwrite(fd, LEDGER_RECORD.pack(LEDGER_MAGIC, samples), 0)
                if create:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            return
        self._ledger_written = samples

    def _take_lock(self) -> None:
        path = self.dir / ".lock"
        # locked through a read-only descriptor: nothing stays open for writing, so the volume
        # can still be remounted (read-only, by an operator or by the kernel after an error)
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise SpoolLocked(
                    f"spool directory {self.dir} is in use by another gpu-sidecar (pid {holder}); "
                    "give each agent its own --spool-dir / GPU_SIDECAR_SPOOL_DIR") from None
            raise
        self._lock_fd = fd
        with contextlib.suppress(OSError):  # for the error of a second agent; a full volume
            path.write_text(f"{os.getpid()}\n")  # must not stop this one from starting

    def close(self) -> None:
        """Release the directory lock (the process exiting does it too)."""
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            os.close(fd)

    @staticmethod
    def _samples(path: Path) -> int:
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

    def _set_aside_odd(self, path: Path, kind: str, seq: int | None = None,
                       samples: int = 0) -> None:
        """An entry named like a batch or a journal that is not a regular file of ours: the entry
        itself is renamed into ``corrupt/`` (a link as a link: its target is never opened,
        sized, moved or deleted), counted as an unreadable batch, logged once per kind."""
        target = self.dir / "corrupt" / path.name
        with self._lock:
            if seq is not None and self._index.pop(seq, None) is None:
                return  # already gone (and counted) some other way
            self._count_drop("unreadable", samples)
            count = self.dropped_batches["unreadable"]
        moved = False
        try:
            self._aside_dir("corrupt")
            os.replace(path, target)
            moved = True
        except OSError:
            pass  # left where it is, never read: the next start meets it again
        if moved:
            with self._lock:
                self._aside["corrupt"][target] = _lsize_path(target)
        if kind not in self._odd_kinds:
            self._odd_kinds.add(kind)
            log.error("spool_batch_unreadable", batch=path.name, kind=kind, count=count,
                      moved_to=str(target.parent) if moved else None, directory=str(self.dir),
                      effect="not a regular file of the agent's own: never opened nor followed; "
                             "skipped, later batches flow (logged once per kind, counted as "
                             "reason=\"unreadable\")")

    def _aside_dir(self, where: str) -> Path:
        """``rejected/`` or ``corrupt/``, created when missing; refused (OSError) when it is not
        a directory of the spool's own, such as a link to elsewhere."""
        directory = self.dir / where
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=0o700)
        if not stat.S_ISDIR(os.lstat(directory).st_mode):
            raise OSError(errno.ENOTDIR, "not a directory of the spool's own", str(directory))
        return directory

    def bytes(self, state: str = "pending") -> int:
        with self._lock:
            if state in ("pending", "memory"):
                in_memory = state == "memory"
                return sum(e.size for e in self._index.values() if (e.held is not None) == in_memory)
            return sum(self._aside[state].values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def write_failing(self) -> bool:
        """The last write to the volume failed: batches are being held in memory."""
        return self._write_failures.active

    def journal_grew(self, size: int) -> None:
        """The open batch's journal now holds ``size`` bytes on the volume: they count against
        the bound like any batch (uncompressed, a journal can be larger than the batch it
        becomes), so a long push interval on a small volume drops the oldest batch rather than
        exceeding the bound. Cheap when within it: the sampling thread calls this every cycle."""
        self._journal_bytes = size
        if self._settled + size > self.max_bytes:
            with self._lock:
                self._trim()

    def open_batch_unjournaled(self, samples: int) -> None:
        """The samples of the batch being filled that its journal could not take (the volume
        refused): in memory only until sealed, so they join the ledger (``_note_held``)."""
        with self._lock:
            self._open_unjournaled = samples
            self._note_held()

    def reserve(self) -> int:
        """A sequence number for a batch still being filled (its journal is named after it)."""
        with self._lock:
            seq = self._next
            self._next += 1
            return seq

    def holds(self, seq: int) -> bool:
        with self._lock:
            return seq in self._index

    def put(self, body: bytes, samples: int, *, seq: int | None = None,
            journaled: tuple[Path, int] | None = None) -> SpooledBatch | None:
        """Write a batch durably, or hold it in memory when the disk refuses; returns None when
        it could not be kept at all (counted).

        ``journaled`` is the batch's journal and the samples it holds. Once the batch is on disk,
        and before the sender can see it, the journal is deleted, so that a batch is never both
        sent and replayed; a batch held in memory keeps its journal until it is written out,
        delivered or dropped."""
        data = HEADER.pack(MAGIC, len(body), samples, zlib.crc32(body)) + body
        with self._lock:
            if len(data) > self.max_bytes:
                self._count_drop("spool_full", samples)
                log.error("batch_larger_than_spool", bytes=len(data), max_bytes=self.max_bytes,
                          samples=samples, hint="raise --spool-max-bytes or lower --push-interval")
                return None
            if seq is None:
                seq = self._next
                self._next += 1
        path = self.dir / f"{seq:020d}.batch"
        try:
            os.replace(self._write_temporary(path, data), path)
        except OSError as exc:
            with contextlib.suppress(OSError):  # a read-only volume refuses the cleanup too
                path.with_suffix(".tmp").unlink()
            journal_path, journal_samples = journaled or (None, 0)
            return self._hold(seq, _Entry(path, len(data), samples, data, journal_path,
                                          journal_samples,
                                          _lsize_path(journal_path) if journal_path else 0), exc)
        if self._write_failures.ended():
            log.info("spool_write_recovered", directory=str(self.dir),
                     dropped_samples=self.dropped_samples["spool_write_failed"])
        if journaled is not None:
            self._forget_journal(journaled[0])
        with self._lock:
            self._index[seq] = _Entry(path, len(data), samples)
            # trimmed once the new batch is safe: a write that fails must not cost older ones
            self._trim()
        self.write_out_held()
        return SpooledBatch(seq, path, samples, body)

    @staticmethod
    def _write_temporary(path: Path, data: bytes) -> Path:
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

    def _hold(self, seq: int, entry: _Entry, exc: OSError) -> SpooledBatch | None:
        """The disk refused a batch: keep it in memory, within ``max_memory_bytes``, so that a
        full or read-only volume does not cost the samples a working receiver can still take."""
        if self._write_failures.started():
            log.error("spool_write_failed", error=exc.strerror, directory=str(self.dir),
                      episodes=self._write_failures.count,
                      samples=entry.samples, held_in_memory_up_to_bytes=self.max_memory_bytes,
                      hint="free space in the spool volume, or make it writable again; the agent "
                           "resumes by itself",
                      effect="batches wait in memory and are sent from there; what is still in "
                             "memory when the agent stops, or beyond that bound, is lost and "
                             "counted")
        if entry.size > self.max_memory_bytes:
            with self._lock:
                self._count_drop("spool_write_failed", entry.samples)
            self._forget_journal(entry.journal)
            return None
        with self._lock:
            self._index[seq] = entry
            self._trim()
        assert entry.held is not None
        return SpooledBatch(seq, entry.path, entry.samples, entry.held[HEADER.size:])

    def _forget_journal(self, path: Path | None) -> None:
        """A batch's journal is no longer needed. One the volume will not let go (read-only) is
        tried again when the volume next takes a write: left behind, the next start would replay
        it and send its cycles a second time. Safe under the lock: no lock taken."""
        if path is None:
            return
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._stale_journals.append(path)
            # unlocked (callers may hold the lock): a lost increment only shifts when it logs
            self._journal_remove_failures += 1
            log_count("journal_remove_failed", self._journal_remove_failures, journal=path.name,
                      error=exc.strerror, effect="tried again once the volume takes writes; a "
                      "restart before that sends the batch's journaled cycles a second time")

    def _retry_stale_journals(self) -> None:
        for _ in range(len(self._stale_journals)):
            path = self._stale_journals.popleft()
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError:
                self._stale_journals.append(path)
                return

    def write_out_held(self) -> None:
        """Write the batches held in memory to disk, oldest first, once the disk takes writes
        again: from then on they survive a restart like the others, and their journals go. A
        batch sent meanwhile is not written (its file would be sent a second time by the next
        start)."""
        self._retry_stale_journals()
        with self._lock:
            held = sorted(seq for seq, e in self._index.items() if e.held is not None)
        for seq in held:
            with self._lock:
                entry = self._index.get(seq)
            if entry is None or entry.held is None:
                continue
            tmp = entry.path.with_suffix(".tmp")
            try:
                self._write_temporary(entry.path, entry.held)
                with self._lock:  # published only while the batch still waits (see remove())
                    if self._index.get(seq) is entry:
                        os.replace(tmp, entry.path)
                        self._index[seq] = _Entry(entry.path, entry.size, entry.samples)
                        self._forget_journal(entry.journal)
                        continue
            except OSError:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                return  # still refused: they stay in memory
            with contextlib.suppress(OSError):
                tmp.unlink()  # sent while it was being written
        with self._lock:
            self._note_held()

    def release_held(self) -> int:
        """The agent stops: write out what the disk takes now; of what is still only in memory,
        the cycles its journal holds are replayed by the next start, the rest is counted lost
        (``spool_write_failed``). A batch on the wire counts as lost too: the sender outlived
        the shutdown deadline and the process ends without its answer (should the receiver
        take it in the last instant, the count is high by that request, never low). Logs the
        total, which the last pushed counter could not carry. Returns the samples lost."""
        self.write_out_held()
        lost = replayed = on_the_wire = 0
        with self._lock:
            for seq in [seq for seq, e in self._index.items() if e.held is not None]:
                entry = self._index.pop(seq)
                self._count_drop("spool_write_failed", entry.samples - entry.journaled)
                lost += entry.samples - entry.journaled
                replayed += entry.journaled
                if seq in self._in_flight:
                    on_the_wire += entry.samples - entry.journaled
            total = self.dropped_samples["spool_write_failed"]
            self._note_held()  # counted now: the next start must not count them again
        if total:
            log.error("spool_write_failed_at_exit", directory=str(self.dir), samples=lost,
                      journaled_samples=replayed, on_the_wire_samples=on_the_wire,
                      dropped_samples_total=total,
                      effect="batches the volume refused and the receiver had not taken are "
                             "lost, but for the cycles journaled before it refused, which the "
                             "next start sends", hint="free space in the spool volume, or make "
                             "it writable")
        return lost

    def _trim(self) -> None:
        """Bring the spool back under its bounds (lock held): kept copies first; batches held in
        memory within their own bound too."""
        in_memory = sum(e.size for e in self._index.values() if e.held is not None)
        while in_memory > self.max_memory_bytes:
            held = [seq for seq, e in self._index.items()
                    if e.held is not None and seq not in self._in_flight]
            if len(held) <= 1:
                break
            entry = self._index.pop(min(held))
            in_memory -= entry.size
            self._count_drop("spool_write_failed", entry.samples)
            self._forget_journal(entry.journal)
            log_count("spool_memory_full_dropped_oldest", self.dropped_batches["spool_write_failed"],
                      samples=entry.samples, max_memory_bytes=self.max_memory_bytes,
                      effect="the disk refuses batches and the receiver is not taking them: the "
                             "oldest held in memory are lost")
        total = (sum(e.size + e.journal_bytes for e in self._index.values())
                 + sum(sum(kept.values()) for kept in self._aside.values())
                 + self._journal_bytes)
        for where in ASIDE:
            kept = self._aside[where]
            while kept and total > self.max_bytes:
                path = next(iter(kept))
                total -= kept.pop(path)
                with contextlib.suppress(OSError):
                    path.unlink()
                if where == "rejected":
                    log.info("spool_trimmed_kept_copy", batch=path.name, kept_in=where,
                             max_bytes=self.max_bytes)
        while total > self.max_bytes:
            # the batches of the request in flight stay: the receiver may be storing them now
            # (the bound is exceeded by at most one request meanwhile)
            waiting = [seq for seq in self._index if seq not in self._in_flight]
            if len(waiting) <= 1:
                break  # the newest batch stays whatever the bound: it was just written
            entry = self._index.pop(min(waiting))
            if entry.held is None:
                with contextlib.suppress(OSError):
                    entry.path.unlink()
            self._forget_journal(entry.journal)
            total -= entry.size + entry.journal_bytes
            self._count_drop("spool_full", entry.samples)
            log_count("spool_full_dropped_oldest", self.dropped_batches["spool_full"],
                      batch=entry.path.name, samples=entry.samples, max_bytes=self.max_bytes,
                      effect="oldest samples lost; the receiver has been down too long")
        self._settled = total - self._journal_bytes
        self._note_held()

    def _count_drop(self, reason: str, samples: int) -> None:
        self.dropped_batches[reason] += 1
        self.dropped_samples[reason] += samples

    def oldest(self) -> SpooledBatch | None:
        """The next batch to send, verified; unreadable or corrupt files are moved aside (or,
        when even that fails, forgotten) on the way, and counted."""
        while True:
            with self._lock:
                if not self._index:
                    return None
                seq = min(self._index)
                entry = self._index[seq]
            path, samples = entry.path, entry.samples
            try:
                data = journal.read_own(path) if entry.held is None else entry.held
            except FileNotFoundError:
                with self._lock:
                    self._index.pop(seq, None)
                continue
            except journal.NotOwnFile as exc:  # swapped in since the start: never opened
                self._set_aside_odd(path, exc.kind, seq, samples)
                continue
            except OSError as exc:  # a file the agent may not read, an I/O error
                self._move(seq, "corrupt", samples, reason="unreadable")
                log_count("spool_batch_unreadable", self.dropped_batches["unreadable"],
                          batch=path.name, error=exc.strerror, moved_to=str(self.dir / "corrupt"),
                          effect="skipped; later batches flow")
                continue
            problem = _verify(data)
            if problem is None:
                return SpooledBatch(seq, path, samples, data[HEADER.size:])
            self._move(seq, "corrupt", samples)
            log_count("spool_batch_corrupt", self.dropped_batches["corrupt"], batch=path.name,
                      problem=problem, moved_to=str(self.dir / "corrupt"),
                      effect="skipped; later batches flow")

    def following(self, after: int, max_samples: int, max_batches: int = 64) -> list[SpooledBatch]:
        """Verified batches that follow ``after`` in order, while their samples fit in
        ``max_samples``: a backlog is sent merged, so a slow receiver is caught up."""
        out: list[SpooledBatch] = []
        with self._lock:
            candidates = sorted(s for s in self._index if s > after)[:max_batches]
        total = 0
        for seq in candidates:
            with self._lock:
                entry = self._index.get(seq)
            if entry is None:
                continue
            path, samples = entry.path, entry.samples
            if total + samples > max_samples:
                break
            try:
                data = journal.read_own(path) if entry.held is None else entry.held
            except OSError:
                break  # oldest() deals with it when it reaches that batch
            if _verify(data) is not None:
                break
            out.append(SpooledBatch(seq, path, samples, data[HEADER.size:]))
            total += samples
        return out

    def in_flight(self, batches: list[SpooledBatch]) -> None:
        """The batches of the request being sent: the size bound leaves them alone."""
        with self._lock:
            self._in_flight = frozenset(b.seq for b in batches)

    def remove(self, batch: SpooledBatch) -> bool:
        """The receiver accepted ``batch``: forget it."""
        with self._lock:
            entry = self._index.pop(batch.seq, None)
            if entry is not None and entry.held is not None:
                self._note_held()
        if entry is not None:
            self._forget_journal(entry.journal)
        try:
            batch.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:  # a read-only volume: the next start may send it again
            log_count("spool_remove_failed", self._count_remove_failed(), batch=batch.path.name,
                      error=exc.strerror, effect="a restart may send this batch a second time, "
                      "with identical timestamps and values")
        return entry is not None

    def _count_remove_failed(self) -> int:
        self._remove_failures += 1
        return self._remove_failures

    def set_aside(self, batch: SpooledBatch) -> Path:
        return self._move(batch.seq, "rejected", batch.samples)

    def _move(self, seq: int, where: str, samples: int, reason: str | None = None) -> Path:
        target = self.dir / where / f"{seq:020d}.batch"
        with self._lock:
            entry = self._index.pop(seq, None)
            if entry is None:
                return target  # already gone (and counted) some other way
            self._count_drop(reason or where, samples)
            if entry.held is not None:
                self._note_held()
        try:
            self._aside_dir(where)
            if entry.held is None:
                os.replace(entry.path, target)
            else:  # the copy for a person to look at is written if the disk takes it now
                self._forget_journal(entry.journal)
                os.replace(self._write_temporary(target, entry.held), target)
        except OSError:
            with contextlib.suppress(OSError):
                (entry.path if entry.held is None else target.with_suffix(".tmp")).unlink()
            return target
        with self._lock:
            self._aside[where][target] = entry.size
            self._trim()
        return target


def _entries(directory: Path, own_directory: bool = False) -> list[os.DirEntry[str]]:
    """The entries of a directory, by name; none when it cannot be listed or (``own_directory``)
    is not a directory itself, such as a link to elsewhere."""
    try:
        if own_directory and not stat.S_ISDIR(os.lstat(directory).st_mode):
            return []
        with os.scandir(directory) as entries:
            return sorted(entries, key=lambda e: e.name)
    except OSError:
        return []




def _own_batches_and_journals(directory: Path, *, journals: bool) -> list[Path]:
    """The batches (and ``journals``) of a directory that are regular files of the agent's own,
    in their order. A journal whose batch was sealed before a crash is deleted on the way, as
    the replay would: renumbered apart from its batch, it would be sent a second time."""
    entries = _entries(directory, own_directory=True)
    sealed = {m.group(1) for e in entries if (m := NAME.match(e.name))}
    out = []
    for found in entries:
        is_journal = journals and journal.is_journal_name(found.name)
        if not NAME.match(found.name) and not is_journal:
            continue
        try:
            if journal.not_own_file(found.stat(follow_symlinks=False)) is not None:
                continue
            if is_journal and found.name.removesuffix(journal.SUFFIX) in sealed:
                os.unlink(found.path)
                continue
        except OSError:
            continue
        out.append(Path(found.path))
    return out


def _read_ledger(directory: Path) -> int:
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


def _lsize(entry: os.DirEntry[str]) -> int:
    """The bytes a spool entry itself holds: a regular file's size, 0 for anything else (never
    the size of what a link points to)."""
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def _lsize_path(path: Path) -> int:
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
    problem = _verify(data)
    if problem is not None:
        raise ValueError(problem)
    return HEADER.unpack_from(data)[2], data[HEADER.size:]


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


# -- naming: a directory per receiver under the spool root, and the orphans adopted -----------


def _safe_dir(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in name)


def spool_dir_name(name: str, url: str) -> str:
    """The sink's name made safe for a path, plus a short digest of its URL (credentials left
    out): two URLs whose names read alike on disk still get two directories."""
    digest = hashlib.sha256(redact_url(url).encode()).hexdigest()[:8]
    return f"{_safe_dir(name)}-{digest}"


def _old_dir_name(kind: str, url: str) -> str:
    """Where earlier releases kept a URL's spool: one directory per host and port."""
    return _safe_dir(f"{kind}:{host_port(url)}")


def open_spools(root: str, kind: str, named: Sequence[tuple[str, str]], max_bytes: int,
                max_memory_bytes: int) -> list[tuple[str, str, Spool]]:
    """Each (URL, sink name) of one kind of sink with its spool, opened under ``root``; the
    spools of this kind that no configured URL uses any more (a URL fixed or changed, a
    directory of an earlier release) adopted by the URL they most likely belong to, so that
    nothing they hold is orphaned."""
    urls = [url for url, _ in named]
    existed = {spool_dir_name(name, url) for url, name in named
               if os.path.isdir(os.path.join(root, spool_dir_name(name, url)))}
    opened = [(url, name, Spool(os.path.join(root, spool_dir_name(name, url)), max_bytes,
                                max_memory_bytes)) for url, name in named]
    in_use = {spool.dir.name for _, _, spool in opened}
    per_host = Counter(_old_dir_name(kind, url) for url in urls)
    for directory in _spool_dirs(root, kind):
        if directory.name in in_use:
            continue
        # an earlier release's directory goes to the URL on its host and port; any other to
        # the one configured URL only when that URL is new here (the URL was fixed or moved):
        # a URL that already had its spool was running beside the orphan's, and a receiver
        # removed on purpose (one of two replicas) must not send its backlog to the other
        old_release = [spool for url, _, spool in opened
                       if directory.name == _old_dir_name(kind, url)
                       and per_host[directory.name] == 1]
        fresh = [spool for _, _, spool in opened if spool.dir.name not in existed]
        heirs = old_release or (fresh if len(opened) == 1 else [])
        if len(heirs) != 1:
            log.error("spool_orphaned", directory=str(directory), kind=kind,
                      effect="its batches are not sent: no configured URL of this kind is "
                             "surely its receiver",
                      hint="configure its URL again, or start once with only the URL it "
                           "should go to on a new spool: that sink adopts it")
            continue
        taken = heirs[0].adopt(directory)
        if taken is None:
            log.warning("spool_not_adopted", directory=str(directory), kind=kind,
                        effect="another gpu-sidecar holds it: left alone")
        elif taken != (0, 0) or directory.exists():
            log.info("spool_adopted", old=str(directory), new=str(heirs[0].dir),
                     batches=taken[0], samples=taken[1], left_behind=directory.exists(),
                     note="the spool of a URL no longer configured: its batches are sent to "
                          "this receiver, in their order; what is not the agent's own file "
                          "stays in the old directory")
    return opened


def _spool_dirs(root: str, kind: str) -> list[Path]:
    """The spool directories of one kind of sink under ``root``, by name (never a link)."""
    prefix = _safe_dir(f"{kind}:")
    try:
        with os.scandir(root) as entries:
            return sorted(Path(e.path) for e in entries
                          if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False))
    except OSError:
        return []


def private_root(root: str) -> None:
    """The spool root, created 0700: batches carry pod names and figures. A root that already
    exists keeps its mode (the agent changes nothing it did not make; a Kubernetes emptyDir
    belongs to root): the per-URL directories inside it are 0700 anyway."""
    try:
        created = not os.path.isdir(root)
        os.makedirs(root, mode=0o700, exist_ok=True)
        if created:
            os.chmod(root, 0o700)  # the umask may have narrowed makedirs' mode, never widened
    except OSError as exc:
        raise SpoolError(
            f"spool directory {root} is not writable ({exc.strerror}); mount a writable "
            "emptyDir there or set --spool-dir / GPU_SIDECAR_SPOOL_DIR") from exc
