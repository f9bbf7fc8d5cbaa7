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

Beside this module: the file format and names (``layout``), the memory hold (``memory_hold``) and
its ledger (``ledger``), the other spool's side of an adoption (``adoption``) and where each
receiver's spool lives (``directories``); the names their users import stay importable here.
"""

from __future__ import annotations

import builtins  # Spool.put's body: in the class, ``bytes`` is its method Spool.bytes
import contextlib
import errno
import fcntl
import os
import threading
import zlib
from collections import Counter, deque
from collections.abc import Sequence
from pathlib import Path

import structlog

from sidecar.config import Config
from sidecar.durability import adoption, journal
from sidecar.durability.directories import old_dir_name, private_root, spool_dir_name, spool_dirs
from sidecar.durability.layout import (
    ASIDE,
    HEADER,
    MAGIC,
    NAME,
    URL_CONFIRMED,
    SpooledBatch,
    SpoolError,
    SpoolLocked,
    aside_dir,
    entries,
    header_samples,
    lsize,
    lsize_path,
    read_batch,
    verify,
    write_temporary,
)
from sidecar.durability.ledger import read_ledger
from sidecar.durability.memory_hold import Entry, MemoryHold
from sidecar.log import Episodes, log_count

__all__ = ["DROP_REASONS", "HEADER", "MAGIC", "STATES", "URL_CONFIRMED", "Spool", "SpoolError",
           "SpoolLocked", "SpooledBatch", "open_spools", "private_root", "read_batch",
           "spool_dir_name"]

log = structlog.get_logger("sidecar.spool")

STATES = ("pending", "memory", *ASIDE)
DROP_REASONS = ("spool_full", "spool_write_failed", "rejected", "corrupt", "unreadable")


class Spool(MemoryHold):
    """The spool of one receiver's sink (see the module's docstring); thread-safe: the sampling
    thread puts batches and the sender takes them."""

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
        self._open_directory()
        self._ledger_written = 0
        self._lost_before_restart = read_ledger(self.dir)
        self._index: dict[int, Entry] = {}  # waiting batches by sequence number
        self._aside: dict[str, dict[Path, int]] = {where: {} for where in ASIDE}  # oldest first
        self._odd_kinds: set[str] = set()  # kinds of entry set aside, each logged once
        self._scan()
        self._next = self._first_free_seq()
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

    def _open_directory(self) -> None:
        """The directory made (0700), locked and proved writable, or SpoolError saying what to
        mount: a spool that cannot take a batch must stop the start, not lose them later."""
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

    def _scan(self) -> None:
        """What a previous run left: interrupted writes removed, the kept copies sized, the
        waiting batches indexed (sized by the entry itself, lstat, never by what it points to)
        and any entry named like ours that is not our regular file set aside unread."""
        for leftover in self.dir.glob("*.tmp"):
            with contextlib.suppress(OSError):
                leftover.unlink()  # a write interrupted by a crash (a link: the link itself)
        for where in ASIDE:
            for found in entries(self.dir / where, own_directory=True):
                if found.name.endswith(".tmp"):  # a copy a crash interrupted
                    with contextlib.suppress(OSError):
                        os.unlink(found.path)
                    continue
                self._aside[where][Path(found.path)] = lsize(found)
        for found in entries(self.dir):
            m = NAME.match(found.name)
            if not m and not journal.is_journal_name(found.name):
                continue
            path = Path(found.path)
            try:
                kind = journal.not_own_file(found.stat(follow_symlinks=False))
                if kind is not None:
                    raise journal.NotOwnFile(kind, path)
                if m:
                    self._index[int(m.group(1))] = Entry(path, lsize(found), header_samples(path))
            except journal.NotOwnFile as exc:
                self._set_aside_odd(path, exc.kind)
            except OSError:
                continue  # gone meanwhile

    def _first_free_seq(self) -> int:
        """A journal left by a crash keeps its number: new batches come after it, and after the
        kept copies too, so that a new copy never replaces an older one of the same number."""
        unsealed = [seq for seq, _ in journal.leftovers(self.dir)]
        kept = [int(m.group(1)) for where in ASIDE for p in self._aside[where]
                if (m := NAME.match(p.name))]
        return max([*self._index, *unsealed, *kept], default=0) + 1

    def adopt(self, other: Path) -> tuple[int, int] | None:
        """Take over the spool of a receiver no longer configured (a typo in the URL fixed, a
        receiver moved): its waiting batches, the journals a crash left and the copies kept aside
        are renamed into this spool, in their order, after what this one already holds, so that
        the next send delivers them and the bound counts them. A crash midway leaves each file in
        one spool or the other, never both: the next start finishes the move. Only regular files
        of the agent's own move; anything else stays where it is, never opened. Returns (batches,
        samples) taken, or None when another agent holds the other spool's lock."""
        fd = adoption.lock_other(other)
        if fd is None:
            return None
        batches = samples = 0
        with self._lock:
            self._count_lost_before_restart(read_ledger(other))
        try:
            for where, path in adoption.movable(other):
                taken = self._take(path, where)
                if taken is not None:
                    batches += 1
                    samples += taken
        finally:
            with self._lock:
                self._trim()
            adoption.release_other(other, fd)
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
                aside_dir(self.dir, where)
            os.rename(path, target)
        except OSError:
            return None
        if NAME.match(target.name) is None:
            return None  # a journal: sealed by the sink's replay at start
        with self._lock:
            if where:
                self._aside[where][target] = lsize_path(target)
                return None
            try:
                samples = header_samples(target)
            except journal.NotOwnFile:
                samples = 0
            self._index[seq] = Entry(target, lsize_path(target), samples)
            return samples

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
            aside_dir(self.dir, "corrupt")
            os.replace(path, target)
            moved = True
        except OSError:
            pass  # left where it is, never read: the next start meets it again
        if moved:
            with self._lock:
                self._aside["corrupt"][target] = lsize_path(target)
        if kind not in self._odd_kinds:
            self._odd_kinds.add(kind)
            log.error("spool_batch_unreadable", batch=path.name, kind=kind, count=count,
                      moved_to=str(target.parent) if moved else None, directory=str(self.dir),
                      effect="not a regular file of the agent's own: never opened nor followed; "
                             "skipped, later batches flow (logged once per kind, counted as "
                             "reason=\"unreadable\")")

    def bytes(self, state: str = "pending") -> int:
        with self._lock:
            if state in ("pending", "memory"):
                in_memory = state == "memory"
                return sum(e.size for e in self._index.values() if (e.held is not None) == in_memory)
            return sum(self._aside[state].values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def journal_grew(self, size: int) -> None:
        """The open batch's journal now holds ``size`` bytes on the volume: they count against
        the bound like any batch (uncompressed, a journal can be larger than the batch it
        becomes), so a long push interval on a small volume drops the oldest batch rather than
        exceeding the bound. Cheap when within it: the sampling thread calls this every cycle."""
        self._journal_bytes = size
        if self._settled + size > self.max_bytes:
            with self._lock:
                self._trim()

    def reserve(self) -> int:
        """A sequence number for a batch still being filled (its journal is named after it)."""
        with self._lock:
            seq = self._next
            self._next += 1
            return seq

    def holds(self, seq: int) -> bool:
        with self._lock:
            return seq in self._index

    def put(self, body: builtins.bytes, samples: int, *, seq: int | None = None,
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
            os.replace(write_temporary(path, data), path)
        except OSError as exc:
            with contextlib.suppress(OSError):  # a read-only volume refuses the cleanup too
                path.with_suffix(".tmp").unlink()
            journal_path, journal_samples = journaled or (None, 0)
            return self._hold(seq, Entry(path, len(data), samples, data, journal_path,
                                          journal_samples,
                                          lsize_path(journal_path) if journal_path else 0), exc)
        if self._write_failures.ended():
            log.info("spool_write_recovered", directory=str(self.dir),
                     dropped_samples=self.dropped_samples["spool_write_failed"])
        if journaled is not None:
            self._forget_journal(journaled[0])
        with self._lock:
            self._index[seq] = Entry(path, len(data), samples)
            # trimmed once the new batch is safe: a write that fails must not cost older ones
            self._trim()
        self.write_out_held()
        return SpooledBatch(seq, path, samples, body)

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
            problem = verify(data)
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
            if verify(data) is not None:
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
            aside_dir(self.dir, where)
            if entry.held is None:
                os.replace(entry.path, target)
            else:  # the copy for a person to look at is written if the disk takes it now
                self._forget_journal(entry.journal)
                os.replace(write_temporary(target, entry.held), target)
        except OSError:
            with contextlib.suppress(OSError):
                (entry.path if entry.held is None else target.with_suffix(".tmp")).unlink()
            return target
        with self._lock:
            self._aside[where][target] = entry.size
            self._trim()
        return target


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
    per_host = Counter(old_dir_name(kind, url) for url in urls)
    for directory in spool_dirs(root, kind):
        if directory.name in in_use:
            continue
        # an earlier release's directory goes to the URL on its host and port; any other to
        # the one configured URL only when that URL is new here (the URL was fixed or moved):
        # a URL that already had its spool was running beside the orphan's, and a receiver
        # removed on purpose (one of two replicas) must not send its backlog to the other
        old_release = [spool for url, _, spool in opened
                       if directory.name == old_dir_name(kind, url)
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
