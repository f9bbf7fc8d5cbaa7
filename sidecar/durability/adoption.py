"""Adoption's side of the other spool (``Spool.adopt``): its lock taken, its own files listed in
their order, and what is left of it cleared afterwards. Only regular files of the agent's own
move; anything else stays where it is, never opened."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from sidecar.durability import journal
from sidecar.durability.layout import ASIDE, NAME, URL_CONFIRMED, entries
from sidecar.durability.ledger import LEDGER


def lock_other(other: Path) -> int | None:
    """The other spool's lock, held (its descriptor), or None when another agent holds it (or
    it cannot be opened): two agents must never move the same batches."""
    try:
        fd = os.open(other / ".lock", os.O_RDONLY | os.O_CREAT, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def movable(other: Path) -> Iterator[tuple[str, Path]]:
    """(where, path) of each file to move: the waiting batches and journals, then the kept
    copies of ``rejected/`` and ``corrupt/``, each directory listed when its turn comes."""
    for where in ("", *ASIDE):
        for path in own_batches_and_journals(other / where, journals=not where):
            yield where, path


def release_other(other: Path, fd: int) -> None:
    """Clear what adoption leaves of the other spool (its lock, probe, ledger, URL mark and
    interrupted writes; its directories when empty), then let go of its lock."""
    for name in (".lock", ".write-test", LEDGER, URL_CONFIRMED,
                 *(p.name for p in other.glob("*.tmp"))):
        with contextlib.suppress(OSError):
            (other / name).unlink()  # a link itself, never its target
    for directory in (*(other / where for where in ASIDE), other):
        with contextlib.suppress(OSError):
            directory.rmdir()  # only when empty: what was not ours stays
    os.close(fd)


def own_batches_and_journals(directory: Path, *, journals: bool) -> list[Path]:
    """The batches (and ``journals``) of a directory that are regular files of the agent's own,
    in their order. A journal whose batch was sealed before a crash is deleted on the way, as
    the replay would: renumbered apart from its batch, it would be sent a second time."""
    found_entries = entries(directory, own_directory=True)
    sealed = {m.group(1) for e in found_entries if (m := NAME.match(e.name))}
    out = []
    for found in found_entries:
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
