"""What the journal and the spool promise a crash: a damaged journal record costs only itself (it
is never replayed, every intact record after it is, in order, and the damage is counted:
``journal.parse``), a record torn by the crash is the cycle in progress, and a replayed batch
keeps its sequence number, so it is sent in its place: after the batches sealed before it,
before every batch of the new run."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.durability import journal
from sidecar.durability.journal import RECORD, Journal, read
from sidecar.durability.spool import Spool

CYCLES = [(b"cycle-0 " * 5, 3), (b"cycle-1 " * 7, 4), (b"cycle-2 " * 6, 5)]


def written(directory: Path, seq: int = 7) -> Journal:
    j = Journal(directory, seq)
    for body, samples in CYCLES:
        j.append(body, samples)
    return j


def record_offset(n: int) -> int:
    return sum(RECORD.size + len(body) for body, _ in CYCLES[:n])


@pytest.mark.parametrize("damaged", [0, 1, 2])
@pytest.mark.parametrize("where", ["crc field", "body byte"])
def test_a_journal_record_whose_checksum_is_wrong_costs_only_itself(tmp_path, damaged, where):
    j = written(tmp_path)
    assert list(read(j.path).records) == CYCLES  # intact: every cycle comes back, in order
    data = bytearray(j.path.read_bytes())
    at = record_offset(damaged) + (8 if where == "crc field" else RECORD.size + 3)
    data[at] ^= 0x5A
    j.path.write_bytes(bytes(data))
    # the damaged record is not replayed; every intact one after it is, in order; counted
    assert list(read(j.path).records) == CYCLES[:damaged] + CYCLES[damaged + 1:]
    replay = read(j.path)
    assert (replay.damaged, replay.torn) == (1, False)


@pytest.mark.parametrize("damaged", [0, 1])
def test_a_journal_record_whose_length_is_damaged_costs_only_itself(tmp_path, damaged):
    j = written(tmp_path)
    data = bytearray(j.path.read_bytes())
    data[record_offset(damaged) + 1] ^= 0x01  # its length, by 256 bytes: the frame is lost
    j.path.write_bytes(bytes(data))
    assert list(read(j.path).records) == CYCLES[:damaged] + CYCLES[damaged + 1:]
    assert read(j.path).damaged == 1


def test_a_torn_last_record_is_not_replayed_and_the_whole_ones_before_it_are(tmp_path):
    j = written(tmp_path)
    data = j.path.read_bytes()
    j.path.write_bytes(data[:-4])  # power lost mid-write of the last cycle
    assert list(read(j.path).records) == CYCLES[:2]
    replay = read(j.path)
    assert (replay.damaged, replay.torn) == (0, True)  # the cycle in progress, not damage


def replay(spool: Spool) -> list[int]:
    """What the sink does at start with the journals a crash left (``SpooledSink``): seal each
    into the spool under its own number; the sequence numbers sealed, oldest first."""
    sealed = []
    for seq, path in journal.leftovers(spool.dir):
        records = list(journal.read(path).records)
        body = b"".join(body for body, _ in records)
        batch = spool.put(body, sum(n for _, n in records), seq=seq,
                          journaled=(path, sum(n for _, n in records)))
        assert batch is not None
        sealed.append(batch.seq)
    return sealed


def drain(spool: Spool) -> list[tuple[int, bytes]]:
    sent = []
    while (batch := spool.oldest()) is not None:
        sent.append((batch.seq, batch.body))
        spool.remove(batch)
    return sent


def test_a_replayed_journal_batch_keeps_its_number_and_is_sent_before_the_new_runs_batches(
        tmp_path):
    # the run that crashed: two batches sealed, the third still being filled in its journal
    first = Spool(tmp_path, max_bytes=1 << 20)
    assert first.put(b"sealed-1", 2).seq == 1
    assert first.put(b"sealed-2", 2).seq == 2
    open_seq = first.reserve()
    assert open_seq == 3
    open_batch = Journal(tmp_path, open_seq)
    open_batch.append(b"journaled-a|", 1)
    open_batch.append(b"journaled-b|", 1)
    first.close()  # SIGKILL: nothing else happens

    again = Spool(tmp_path, max_bytes=1 << 20)
    new_journal = again.reserve()  # the new run's open batch, reserved before the replay
    assert new_journal > open_seq, "a new batch took the number of the batch still in a journal"
    assert replay(again) == [open_seq]
    assert not open_batch.path.exists(), "the journal outlived its sealed batch: replayed twice"
    again.put(b"new-run-1", 1, seq=new_journal)
    again.put(b"new-run-2", 1)
    assert drain(again) == [(1, b"sealed-1"), (2, b"sealed-2"),
                            (open_seq, b"journaled-a|journaled-b|"),
                            (new_journal, b"new-run-1"), (new_journal + 1, b"new-run-2")]


def test_several_leftover_journals_are_replayed_oldest_first_each_under_its_own_number(tmp_path):
    for seq in (12, 5, 9):  # written in no particular order
        Journal(tmp_path, seq).append(f"journal-{seq}".encode(), 1)
    spool = Spool(tmp_path, max_bytes=1 << 20)
    later = spool.put(b"after", 1)
    assert later.seq > 12
    assert replay(spool) == [5, 9, 12]
    assert drain(spool) == [(5, b"journal-5"), (9, b"journal-9"), (12, b"journal-12"),
                            (later.seq, b"after")]
