"""The disk spool: durable, ordered, bounded, and never crashed by a bad file."""

from __future__ import annotations

import hashlib
import itertools
import os
import socket
import stat
import threading
import time

import pytest
import structlog

from sidecar.config import Config
from sidecar.durability import journal
from sidecar.durability.journal import RECORD, Journal, read
from sidecar.durability.spool import HEADER, Spool, SpoolError, SpoolLocked
from sidecar.samples import Series
from sidecar.sinks.remote_write import RemoteWriteSink


def test_batches_come_back_oldest_first_and_survive_a_restart(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    for i in range(3):
        spool.put(f"body-{i}".encode(), samples=10 + i)
    first = spool.oldest()
    assert first.body == b"body-0" and first.samples == 10
    spool.remove(first)
    (tmp_path / "00000000000000000099.tmp").write_bytes(b"half-written")  # a crash mid-write
    spool.close()
    again = Spool(tmp_path, max_bytes=1 << 20)  # the agent restarted
    assert not list(tmp_path.glob("*.tmp"))
    assert [again.oldest().body] == [b"body-1"]
    assert len(again) == 2
    batch = again.put(b"body-3", samples=1)
    assert batch.seq == 4  # numbering continues after the replayed batches


def test_size_bound_drops_the_oldest_and_counts_their_samples(tmp_path):
    body = b"x" * 1000
    size = HEADER.size + len(body)
    spool = Spool(tmp_path, max_bytes=3 * size)
    for i in range(5):
        spool.put(body, samples=100 + i)
    assert len(spool) == 3
    assert spool.bytes() == 3 * size
    assert spool.dropped_samples["spool_full"] == 100 + 101
    assert spool.oldest().samples == 102


def test_a_batch_larger_than_the_whole_spool_is_dropped_and_counted(tmp_path):
    spool = Spool(tmp_path, max_bytes=5000)
    assert spool.put(b"y" * 6000, samples=7) is None
    assert spool.dropped_samples["spool_full"] == 7 and len(spool) == 0


@pytest.mark.parametrize("damage", ["garbage", "truncated", "flipped"])
def test_corrupt_or_truncated_file_is_moved_aside_and_counted_never_a_crash(tmp_path, damage):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    bad = spool.put(b"A" * 100, samples=5)
    spool.put(b"B" * 100, samples=6)
    data = bad.path.read_bytes()
    if damage == "garbage":
        bad.path.write_bytes(b"not a batch at all")
    elif damage == "truncated":
        bad.path.write_bytes(data[:-30])
    else:
        bad.path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    spool.close()
    reopened = Spool(tmp_path, max_bytes=1 << 20)
    good = reopened.oldest()
    assert good.body == b"B" * 100
    assert reopened.dropped_batches["corrupt"] == 1
    assert (tmp_path / "corrupt" / bad.path.name).exists()


def test_rejected_batch_is_set_aside_for_a_person_to_inspect(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    batch = spool.put(b"refused", samples=3)
    target = spool.set_aside(batch)
    assert target.read_bytes().endswith(b"refused")
    assert spool.oldest() is None and spool.dropped_samples["rejected"] == 3


def test_unusable_spool_directory_is_a_clear_start_up_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SpoolError, match=r"not writable.*--spool-dir"):
        Spool(blocker / "spool", max_bytes=1 << 20)


def test_spool_directory_is_private(tmp_path):
    spool = Spool(tmp_path / "s", max_bytes=1 << 20)
    spool.put(b"z", samples=1)
    assert (tmp_path / "s").stat().st_mode & 0o077 == 0


def test_a_second_spool_on_the_same_directory_is_refused_naming_the_holder(tmp_path):
    first = Spool(tmp_path, max_bytes=1 << 20)
    with pytest.raises(SpoolLocked, match=rf"in use by another gpu-sidecar \(pid {os.getpid()}\)"):
        Spool(tmp_path, max_bytes=1 << 20)
    first.close()
    Spool(tmp_path, max_bytes=1 << 20).close()  # free again once the holder is gone


def test_unreadable_entry_is_moved_aside_counted_and_later_batches_flow(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    spool.put(b"first", samples=2)
    (tmp_path / "00000000000000000002.batch").mkdir()  # not a file: reading it fails
    spool.close()
    spool = Spool(tmp_path, max_bytes=1 << 20)
    spool.put(b"third", samples=4)
    bodies = []
    while (batch := spool.oldest()) is not None:
        bodies.append(batch.body)
        spool.remove(batch)
    assert bodies == [b"first", b"third"]
    assert spool.dropped_batches["unreadable"] == 1
    assert (tmp_path / "corrupt" / "00000000000000000002.batch").is_dir()


def test_kept_copies_count_against_the_bound_and_go_first(tmp_path):
    body = b"x" * 1000
    size = HEADER.size + len(body)
    spool = Spool(tmp_path, max_bytes=3 * size)
    for i in range(2):
        spool.set_aside(spool.put(body, samples=1 + i))
    assert spool.bytes("rejected") == 2 * size
    for _ in range(2):
        spool.put(body, samples=10)
    assert spool.bytes("rejected") == size and spool.bytes() == 2 * size
    assert sorted(p.name for p in (tmp_path / "rejected").iterdir()) == ["00000000000000000002.batch"]
    assert spool.dropped_samples["spool_full"] == 0  # nothing waiting was lost for the copies



def test_the_batches_of_the_request_in_flight_are_never_dropped_for_room(tmp_path):
    body = b"x" * 1000
    size = HEADER.size + len(body)
    spool = Spool(tmp_path, max_bytes=3 * size)
    first = spool.put(body, samples=1)
    spool.in_flight([first])  # the receiver may be storing it right now
    for _ in range(3):
        spool.put(body, samples=10)
    assert spool.oldest().seq == first.seq
    assert spool.dropped_samples["spool_full"] == 10  # the next oldest went instead
    spool.in_flight([])
    spool.remove(first)
    assert spool.dropped_samples["spool_full"] == 10  # a counter never goes down


def test_a_failed_write_costs_no_older_batch(tmp_path):
    body = b"x" * 1000
    size = HEADER.size + len(body)
    spool = Spool(tmp_path, max_bytes=2 * size, max_memory_bytes=0)
    spool.put(body, samples=1)
    spool.put(body, samples=2)
    blocker = tmp_path / "00000000000000000003.tmp"
    blocker.mkdir()  # the temporary file cannot be created: the write fails
    assert spool.put(body, samples=3) is None
    assert len(spool) == 2 and spool.dropped_samples["spool_full"] == 0
    assert spool.dropped_samples["spool_write_failed"] == 3


def test_a_batch_the_disk_refuses_waits_in_memory_in_order_and_is_written_out_later(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    spool.put(b"first", samples=1)
    blocker = tmp_path / "00000000000000000002.tmp"
    blocker.mkdir()  # the temporary file cannot be created: the write fails
    held = spool.put(b"second", samples=2)
    assert held is not None and held.body == b"second"
    assert not held.path.exists() and spool.bytes("memory") == HEADER.size + len(b"second")
    assert spool.dropped_samples["spool_write_failed"] == 0
    first = spool.oldest()
    assert first is not None and first.body == b"first"
    assert [b.body for b in spool.following(first.seq, 100)] == [b"second"]
    blocker.rmdir()  # the disk takes writes again: the next batch writes the held one out
    spool.put(b"third", samples=3)
    assert held.path.read_bytes()[HEADER.size:] == b"second"
    assert spool.bytes("memory") == 0
    spool.close()
    reopened = Spool(tmp_path, max_bytes=1 << 20)  # what a restart finds on disk
    found = []
    while (batch := reopened.oldest()) is not None:
        found.append(batch.body)
        reopened.remove(batch)
    assert found == [b"first", b"second", b"third"]


def test_batches_held_in_memory_are_bounded_and_counted_lost_at_exit(tmp_path):
    body = b"x" * 1000
    size = HEADER.size + len(body)
    spool = Spool(tmp_path, max_bytes=1 << 20, max_memory_bytes=2 * size)
    for seq in (1, 2, 3):
        (tmp_path / f"{seq:020d}.tmp").mkdir()  # every write fails
    for samples in (1, 2, 3):
        assert spool.put(body, samples=samples) is not None
    assert spool.dropped_samples["spool_write_failed"] == 1  # the oldest held went
    assert spool.bytes("memory") == 2 * size and len(spool) == 2
    assert spool.release_held() == 5  # the agent stops with the disk still refusing
    assert len(spool) == 0 and spool.dropped_samples["spool_write_failed"] == 6


def test_a_held_batch_keeps_its_journal_until_it_is_written_out_or_delivered(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    journals = [tmp_path / f"{seq:020d}.journal" for seq in (1, 2)]
    for path in journals:
        path.write_bytes(b"cycles journaled before the disk refused")
        (tmp_path / path.name.replace(".journal", ".tmp")).mkdir()  # every write fails
    first = spool.put(b"first", samples=5, seq=1, journaled=(journals[0], 3))
    second = spool.put(b"second", samples=5, seq=2, journaled=(journals[1], 3))
    assert first is not None and second is not None
    assert all(p.exists() for p in journals), "a crash now would still replay them"
    spool.remove(first)  # delivered from memory: its journal must not be replayed
    assert not journals[0].exists() and journals[1].exists()
    (tmp_path / "00000000000000000002.tmp").rmdir()
    spool.write_out_held()  # the disk takes writes: on disk now, the journal goes
    assert second.path.exists() and not journals[1].exists()


def test_at_exit_the_journaled_part_of_a_held_batch_is_left_for_the_next_start(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    journal = tmp_path / f"{1:020d}.journal"
    journal.write_bytes(b"three samples' worth")
    for seq in (1, 2):
        (tmp_path / f"{seq:020d}.tmp").mkdir()
    held = spool.put(b"x", samples=5, seq=1, journaled=(journal, 3))
    on_the_wire = spool.put(b"y", samples=7, seq=2)
    assert held is not None and on_the_wire is not None
    spool.in_flight([on_the_wire])  # the sender outlived the shutdown deadline
    # 5 samples, 3 of them journaled; and the 7 on the wire, which the exit cuts off
    assert spool.release_held() == 2 + 7
    assert journal.exists() and spool.dropped_samples["spool_write_failed"] == 9
    assert len(spool) == 0


def test_a_kept_copy_interrupted_by_a_crash_is_cleaned_up_at_start(tmp_path):
    Spool(tmp_path, max_bytes=1 << 20).close()
    (tmp_path / "rejected").mkdir()
    (tmp_path / "rejected" / f"{4:020d}.tmp").write_bytes(b"half a cop")
    spool = Spool(tmp_path, max_bytes=1 << 20)
    assert spool.bytes("rejected") == 0
    assert not list((tmp_path / "rejected").iterdir())


# -- entries that are not regular files of the agent's own (issue 23) ---------------------------


def _bounded(fn, seconds: float = 20.0):
    """Run ``fn`` in a thread and fail, rather than hang, if it does not return in time."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s (a FIFO opened?)"
    return result[0]


def _drain(spool: Spool) -> list[tuple[int, bytes]]:
    out = []
    while (batch := spool.oldest()) is not None:
        out.append((batch.seq, batch.body))
        spool.remove(batch)
    return out


def _fingerprint(path) -> tuple[int, int, bytes]:
    st = os.lstat(path)
    return st.st_ino, st.st_size, hashlib.sha256(path.read_bytes()).digest()


def test_links_fifos_sockets_and_directories_named_like_batches_are_never_opened_nor_followed(
        tmp_path, monkeypatch):
    outside, directory = tmp_path / "outside", tmp_path / "spool"
    other = Spool(outside, max_bytes=1 << 20)  # a valid batch, but not this spool's
    foreign = other.put(b"outside the spool: never to be sent", samples=99)
    other.close()
    foreign_journal = outside / f"{50:020d}.journal"
    Journal(outside, 50).append(b"a journal outside the spool", 7)
    big = outside / "big"
    with big.open("wb") as f:
        f.truncate(300 << 20)  # 300 MB, sparse
    before = {p: _fingerprint(p) for p in (foreign.path, foreign_journal)}
    big_ino = os.lstat(big).st_ino

    body = b"r" * 1000
    size = HEADER.size + len(body) + 1  # each body is ``body`` and one byte more
    spool = Spool(directory, max_bytes=1 << 20)
    real = [spool.put(body + bytes([i]), samples=10 + i) for i in range(8)]
    spool.close()
    name = {seq: f"{seq:020d}.batch" for seq in range(1, 9)}
    for seq in (2, 3, 4, 5, 6):
        (directory / name[seq]).unlink()
    os.mkfifo(directory / name[2])
    (directory / name[3]).symlink_to(big)
    (directory / name[4]).symlink_to(foreign.path)
    (directory / name[5]).mkdir()
    monkeypatch.chdir(directory)  # a short relative path: AF_UNIX paths are short
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(name[6])
    os.mkfifo(directory / f"{20:020d}.journal")
    (directory / f"{21:020d}.journal").symlink_to(foreign_journal)
    odd = [name[s] for s in (2, 3, 4, 5, 6)] + [f"{20:020d}.journal", f"{21:020d}.journal"]
    kept = 0  # bytes moved aside: only a regular file counts, by its own size
    if os.geteuid() == 0:  # a regular file of another user, where one can be made
        stranger = directory / f"{9:020d}.batch"
        stranger.write_bytes((directory / name[1]).read_bytes())
        os.chown(stranger, 12345, 12345)
        odd.append(stranger.name)
        kept = size

    try:
        with structlog.testing.capture_logs() as logs:
            # a link sized by its target would flood this bound
            reopened = _bounded(lambda: Spool(directory, max_bytes=4 * size))
            sent = _bounded(lambda: _drain(reopened))
            assert journal.leftovers(directory) == []
    finally:
        listener.close()
    # the real batches, all of them, in order; nothing from outside; none dropped for room
    assert sent == [(b.seq, b.body) for b in real if b.seq in (1, 7, 8)]
    assert reopened.dropped_samples["spool_full"] == 0
    assert reopened.dropped_batches["unreadable"] == len(odd)
    assert reopened.bytes("corrupt") == kept  # nothing sized by what it points to
    # each odd entry moved aside as itself: the links still links, to the same targets
    for entry in odd:
        assert os.path.lexists(directory / "corrupt" / entry), entry
        assert not os.path.lexists(directory / entry), entry
    assert os.readlink(directory / "corrupt" / name[3]) == str(big)
    assert os.readlink(directory / "corrupt" / name[4]) == str(foreign.path)
    assert stat.S_ISFIFO(os.lstat(directory / "corrupt" / name[2]).st_mode)
    # nothing outside the spool was read into a batch, moved, changed or deleted
    assert {p: _fingerprint(p) for p in before} == before
    assert os.lstat(big).st_ino == big_ino and big.stat().st_size == 300 << 20
    kinds = [e["kind"] for e in logs if e["event"] == "spool_batch_unreadable"]
    assert sorted(kinds) == sorted(set(kinds))  # logged once per kind
    assert {"fifo", "symlink", "directory", "socket"} <= set(kinds)
    reopened.close()
    again = _bounded(lambda: Spool(directory, max_bytes=4 * size))  # the next start
    assert again.bytes("corrupt") == kept and len(again) == 0


def test_a_waiting_batch_swapped_for_a_fifo_or_a_link_is_set_aside_without_blocking(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "target.batch"
    spool = Spool(tmp_path / "spool", max_bytes=1 << 20)
    batches = [spool.put(f"body-{i}".encode(), samples=1 + i) for i in range(4)]
    target.write_bytes(batches[2].path.read_bytes())  # a valid batch, outside the spool
    before = _fingerprint(target)
    batches[1].path.unlink()
    os.mkfifo(batches[1].path)  # swapped after the start: the sender meets it
    batches[2].path.unlink()
    batches[2].path.symlink_to(target)
    sent = _bounded(lambda: _drain(spool))
    assert sent == [(batches[0].seq, b"body-0"), (batches[3].seq, b"body-3")]
    assert spool.dropped_batches["unreadable"] == 2
    assert spool.dropped_samples["unreadable"] == 2 + 3  # their counts were known from the start
    assert _fingerprint(target) == before
    assert os.path.islink(tmp_path / "spool" / "corrupt" / batches[2].path.name)


# -- the crash journal: a damaged record costs only itself (issue 23) ---------------------------


N = 14


def _journal(directory, seq: int = 3) -> Journal:
    j = Journal(directory, seq)
    for k in range(N):
        j.append(f"cycle-{k:02d}|".encode() * (3 + k % 4), k + 1)
    return j


def _offset(j: Journal, k: int) -> int:
    return sum(RECORD.size + len(body) for body, _ in list(read(j.path).records)[:k])


@pytest.mark.parametrize("k", [0, 2, 7, N - 2])
@pytest.mark.parametrize("where", ["crc", "body", "length"])
def test_one_damaged_journal_record_of_many_costs_only_its_cycle(tmp_path, k, where):
    j = _journal(tmp_path)
    intact = list(read(j.path).records)
    data = bytearray(j.path.read_bytes())
    at = _offset(j, k) + {"crc": 8, "body": RECORD.size + 5, "length": 0}[where]
    data[at] ^= {"crc": 0x01, "body": 0x20, "length": 0x40}[where]
    j.path.write_bytes(bytes(data))
    replay = journal.read(j.path)
    assert replay.records == intact[:k] + intact[k + 1:]
    assert (replay.damaged, replay.torn) == (1, False)


def test_the_sink_replays_every_intact_record_logs_and_counts_the_damage(tmp_path):
    directory = tmp_path / "spool"
    Spool(directory, max_bytes=1 << 20).close()
    j = _journal(directory)
    data = bytearray(j.path.read_bytes())
    data[_offset(j, 2) + RECORD.size + 1] ^= 0xFF  # one flipped byte in record 3 of 14
    j.path.write_bytes(bytes(data))
    spool = Spool(directory, max_bytes=1 << 20)
    sink = RemoteWriteSink("http://127.0.0.1:9/api/v1/write", spool,
                           Config(push_timeout=1, retry_max_backoff=5),
                           push_interval_s=60.0, initial_backoff_s=5)
    with structlog.testing.capture_logs() as logs:
        sink.start()
        sink.close(time.monotonic() + 0.2)
    assert spool.oldest().samples == N * (N + 1) // 2 - 3  # all but record 3's cycle
    damaged = [e for e in logs if e["event"] == "journal_record_damaged"]
    assert [(e["cycles_lost"], e["cycles_replayed"]) for e in damaged] == [(1, N - 1)]
    assert sink.journal_records_damaged == 1
    series = {s.name: s.value for s in sink.telemetry(0, ())}
    assert series["gpu_sidecar_journal_records_damaged_total"] == 1


@pytest.mark.parametrize(("interval", "push", "sealed_every"), [(1.0, 1.0, 1), (1.0, 3.0, 3),
                                                              (0.2, 0.5, 2)])
def test_a_batch_is_sealed_at_the_cycle_nearest_to_the_push_interval(tmp_path, interval, push,
                                                                     sealed_every):
    """A cycle's clock reads a little early or late: a push interval equal to the sampling
    interval still seals every cycle, not every other one."""
    readings = iter(t * interval + jitter for t in range(1, 40)
                    for jitter in (-0.003 if t % 2 else 0.002,))
    now = {"t": 0.0}
    spool = Spool(tmp_path / "spool", max_bytes=1 << 20)
    sink = RemoteWriteSink("http://127.0.0.1:9/api/v1/write", spool,
                           Config(push_timeout=1, retry_max_backoff=5),
                           push_interval_s=push, clock=lambda: now["t"], initial_backoff_s=5)
    sealed = []
    for cycle in range(1, 31):
        now["t"] = next(readings)
        before = len(spool)
        sink.emit([Series("x", (), float(cycle), cycle)])
        if len(spool) > before:
            sealed.append(cycle)
    spool.close()
    gaps = {b - a for a, b in itertools.pairwise(sealed)}
    assert gaps == {sealed_every}, sealed
