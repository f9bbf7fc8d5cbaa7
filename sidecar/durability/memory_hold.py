"""The memory hold: a batch the volume refuses (full, read-only) waits in memory, within
``max_memory_bytes``, and is sent from there like any other; it is written out once the volume
takes writes again. Its journal stays on disk meanwhile, so that a crash loses only what no
journal holds, and the ledger (``sidecar.durability.ledger``) keeps that figure on disk for the
next start to count."""

from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

import structlog

from sidecar.durability.layout import HEADER, SpooledBatch, write_temporary
from sidecar.durability.ledger import write_ledger
from sidecar.log import Episodes, log_count

log = structlog.get_logger("sidecar.spool")


@dataclass(frozen=True, slots=True)
class Entry:
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


class MemoryHold:
    """The spool's memory hold, mixed into ``Spool``, whose state it shares: the index of waiting
    batches (an ``Entry`` each, ``held`` when only in memory), the lock, the drop counters and
    the bound (``_trim``, ``_count_drop``)."""

    dir: Path
    max_memory_bytes: int
    dropped_samples: Counter[str]
    _lock: threading.Lock
    _index: dict[int, Entry]
    _in_flight: frozenset[int]
    _write_failures: Episodes
    _stale_journals: deque[Path]
    _journal_remove_failures: int
    _open_unjournaled: int
    _ledger_written: int

    def _trim(self) -> None:
        raise NotImplementedError

    def _count_drop(self, reason: str, samples: int) -> None:
        raise NotImplementedError

    @property
    def write_failing(self) -> bool:
        """The last write to the volume failed: batches are being held in memory."""
        return self._write_failures.active

    def open_batch_unjournaled(self, samples: int) -> None:
        """The samples of the batch being filled that its journal could not take (the volume
        refused): in memory only until sealed, so they join the ledger (``_note_held``)."""
        with self._lock:
            self._open_unjournaled = samples
            self._note_held()

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
        """The ledger rewritten (``ledger.write_ledger``); the figure remembered only once it is
        on disk, so a refused write is tried again at the next change."""
        if write_ledger(self.dir, samples, create=create):
            self._ledger_written = samples

    def _hold(self, seq: int, entry: Entry, exc: OSError) -> SpooledBatch | None:
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
                write_temporary(entry.path, entry.held)
                with self._lock:  # published only while the batch still waits (see remove())
                    if self._index.get(seq) is entry:
                        os.replace(tmp, entry.path)
                        self._index[seq] = Entry(entry.path, entry.size, entry.samples)
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
