"""Delivery under the faults an operator's cluster produces: a spool volume remounted read-only, a
spool entry nobody can read, a receiver that redirects, refuses for ever, answers slowly or
hangs, signals at awkward moments, two agents on one spool. Every test runs the real agent as a
process against a real VictoriaMetrics (behind a fault-injecting proxy where the fault is the
receiver's), compares what was stored with what was sampled, and reads the agent's own counters
and log lines: each condition is counted, logged once when it starts, and cleared by itself."""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import structlog

from sidecar.config import Config
from sidecar.durability.spool import DROP_REASONS, STATES, Spool
from sidecar.durability.spool import private_root as _private_root
from sidecar.samples import Series
from sidecar.sinks.answers import FAILURE_REASONS
from sidecar.sinks.remote_write import RemoteWriteSink
from sidecar.wire.remote_write import compress
from tests.conftest import ROOT
from tests.receivers import VM_REL, Agent, FaultProxy, VictoriaMetrics, running
from tests.waiting import until
from tests.write_requests import Batch, GroupedEncoder


def args(url: str, spool: Path, *extra: str) -> list[str]:
    return ["--simulate", "healthy", "--interval", "0.2", "--push-interval", "0.5",
            "--remote-write-url", url, "--spool-dir", str(spool), "--retry-max-backoff", "0.5",
            "--shutdown-timeout", "5", *extra]


def keyed(rows: list[tuple[str, tuple, int, float]]) -> dict[tuple[str, tuple, int], float]:
    return {(n, labels, ts): v for n, labels, ts, v in rows}


def last(agent: Agent, name: str, **labels: str) -> float | None:
    """The newest value the agent sampled of a series of its own."""
    return agent.last(name, **labels)


def events(agent: Agent, name: str) -> list[dict]:
    return agent.logged(name)


def pushed(agent: Agent) -> float:
    """Samples the agent says it delivered, over all its sinks, as of its newest cycle."""
    return agent.total("gpu_sidecar_samples_pushed_total")


def failures(agent: Agent, reason: str | None = None) -> float:
    labels = {"reason": reason} if reason else {}
    return agent.total("gpu_sidecar_push_failures_total", **labels)


def stored_keys(vm: VictoriaMetrics) -> set:
    return set(keyed(vm.samples()))


def delivered(vm: VictoriaMetrics, rows: list, lost: int = 0):
    """A condition: VictoriaMetrics holds every key of ``rows`` but at most ``lost``."""
    keys = set(keyed(rows))
    assert keys, "nothing was sampled"
    return lambda: len(keys - stored_keys(vm)) <= lost


def stored_equals_sampled_but(vm: VictoriaMetrics, agent: Agent) -> set:
    """What the agent sampled and VictoriaMetrics does not hold; everything it holds matches."""
    sampled = keyed(agent.sampled())
    stored = keyed(vm.settled(len(sampled)))
    for key in set(sampled) & set(stored):
        assert stored[key] == pytest.approx(sampled[key], rel=VM_REL), key
    assert not set(stored) - set(sampled), "stored what was never sampled"
    return set(sampled) - set(stored)


def sigterm_and_wait(agent: Agent) -> float:
    """SIGTERM the agent, check it exits 0; the seconds it took."""
    agent.signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert agent.wait() == 0, "".join(agent.err)[-2000:]
    return time.monotonic() - signalled


def stopped(agent: Agent) -> dict:
    found = events(agent, "stopped")
    assert len(found) == 1, "".join(agent.err)[-2000:]
    return found[0]


# -- disk --------------------------------------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path: Path):
    """A real small filesystem for the spool, which the test can remount read-only."""
    if os.geteuid() != 0:
        pytest.fail("mounting a tmpfs needs root: the CI runs as root")
    volume = tmp_path / "volume"
    volume.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", str(volume)],
                   check=True, timeout=10)
    yield volume
    subprocess.run(["umount", "-l", str(volume)], timeout=10)


def remount(volume: Path, mode: str) -> None:
    """Linux refuses a read-only remount while a file is open for writing there: the agent holds
    none between writes, so retrying for a moment always finds a gap."""
    deadline = time.monotonic() + 5
    while True:
        done = subprocess.run(["mount", "-o", f"remount,{mode}", str(volume)],
                              capture_output=True, text=True, timeout=10)
        if done.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"remount {mode} failed: {done.stderr}")
        time.sleep(0.01)


def fill(volume: Path) -> Path:
    """Take every free byte of the volume, as another writer on a shared emptyDir would."""
    filler = volume / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    chunk = 1 << 20
    try:
        while chunk:
            try:
                os.write(fd, b"\0" * chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                chunk //= 2
    finally:
        os.close(fd)
    return filler


@contextlib.contextmanager
def kept_full(volume: Path):
    """The volume stays full: whatever the agent frees (a journal it deletes) is taken again
    within milliseconds, as by a busy neighbour on the same volume."""
    stop = threading.Event()

    def refill() -> None:
        while not stop.wait(0.005):
            fill(volume)

    fill(volume)
    neighbour = threading.Thread(target=refill, daemon=True)
    neighbour.start()
    try:
        yield
    finally:
        stop.set()
        neighbour.join(timeout=5)
        (volume / "filler").unlink()


def test_spool_volume_remounted_read_only_mid_run_loses_nothing_the_receiver_can_take(
        tmp_path, tmpfs):
    vm = VictoriaMetrics(tmp_path).start()
    with running(vm):
        agent = Agent(args(vm.write_url, tmpfs / "spool")).start()
        until(lambda: pushed(agent) > 0, what="a first delivery before the fault")
        remount(tmpfs, "ro")
        # the window: the refusal seen by the spool and the journal, the alert's gauge up, and
        # then several more push intervals (0.5 s, 2.5 cycles each) of sealing on a read-only disk
        until(lambda: events(agent, "spool_write_failed") and events(agent, "journal_write_failed")
              and last(agent, "gpu_sidecar_spool_write_failing") == 1.0,
              what="the read-only volume to be noticed")
        agent.more_cycles(8, "on the read-only volume")
        assert agent.proc.poll() is None, "".join(agent.err)[-2000:]
        remount(tmpfs, "rw")
        until(lambda: events(agent, "spool_write_recovered")
              and last(agent, "gpu_sidecar_spool_write_failing") == 0.0
              and last(agent, "gpu_sidecar_spool_bytes", state="memory") == 0,
              what="the spool to recover once the volume takes writes")
        agent.more_cycles(8, "after the recovery")  # a second failure or recovery would show
        assert agent.stop() == 0, "".join(agent.err)[-2000:]
        lost = stored_equals_sampled_but(vm, agent)
    assert lost == set(), "the batches the volume refused waited in memory and were sent"
    # their journals, which the read-only volume kept, went once it took writes: a next start
    # replays nothing a second time
    assert not list((tmpfs / "spool").rglob("*.journal"))
    assert len(events(agent, "spool_write_failed")) == 1
    assert len(events(agent, "spool_write_recovered")) == 1
    assert len(events(agent, "journal_write_failed")) == 1
    assert last(agent, "gpu_sidecar_samples_dropped_total", reason="spool_write_failed") == 0
    assert not events(agent, "spool_write_failed_at_exit")
    failing = [v for n, _, _, v in agent.sampled() if n == "gpu_sidecar_spool_write_failing"]
    assert 1.0 in failing and failing[-1] == 0.0, "the gauge the alert reads rose and fell"


def test_batches_a_full_volume_refused_are_written_out_once_it_has_room(tmp_path, tmpfs):
    spool = tmpfs / "spool"
    vm = VictoriaMetrics(tmp_path)  # down: what the volume refuses can only wait
    first = Agent(args(vm.write_url, spool)).start()
    until(lambda: list(spool.rglob("*.batch")), what="a batch spooled before the volume fills")
    filler = fill(tmpfs)
    until(lambda: (last(first, "gpu_sidecar_spool_bytes", state="memory") or 0) > 0,
          what="batches held in memory while the volume is full")
    filler.unlink()
    until(lambda: last(first, "gpu_sidecar_spool_bytes", state="memory") == 0,
          what="the held batches written out once the volume has room")
    assert first.stop() == 0, "".join(first.err)[-2000:]
    assert events(first, "spool_write_failed") and events(first, "spool_write_recovered")
    assert not events(first, "spool_write_failed_at_exit")
    vm.start()
    with running(vm):
        second = Agent(args(vm.write_url, spool)).start()
        until(lambda: pushed(second) > 0 and delivered(vm, first.sampled())(),
              what="the second agent delivering, and the first agent's spool")
        assert second.stop() == 0
        stored = keyed(vm.settled(len(first.sampled())))
    sampled = keyed(first.sampled())
    assert set(sampled) <= set(stored), "a batch held in memory never reached the disk"
    assert all(stored[k] == pytest.approx(v, rel=VM_REL) for k, v in sampled.items())


def test_batches_still_in_memory_when_the_agent_stops_are_the_only_loss_and_counted(
        tmp_path, tmpfs):
    spool = tmpfs / "spool"
    vm = VictoriaMetrics(tmp_path)  # down
    first = Agent(args(vm.write_url, spool, "--spool-memory-max-bytes", "30000")).start()
    until(lambda: list(spool.rglob("*.batch")), what="a batch spooled before the volume fills")
    with kept_full(tmpfs):
        # the bound of memory is reached: the oldest held batches go, counted
        until(lambda: (last(first, "gpu_sidecar_samples_dropped_total",
                            reason="spool_write_failed") or 0) > 0,
              what="the memory bound to drop held batches")
        assert events(first, "spool_memory_full_dropped_oldest")
        assert (last(first, "gpu_sidecar_spool_bytes", state="memory") or 0) <= 30000
        assert first.stop() == 0, "".join(first.err)[-2000:]
    [at_exit] = events(first, "spool_write_failed_at_exit")
    assert at_exit["samples"] > 0
    # the stop's staleness markers (one per series, after the last cycle) were held in memory
    # with it: lost and counted too, though no cycle printed them
    [ended] = events(first, "series_ended")
    lost_sampled = at_exit["dropped_samples_total"] - ended["series"]
    vm.start()
    with running(vm):
        second = Agent(args(vm.write_url, spool)).start()
        until(lambda: pushed(second) > 0 and delivered(
                  vm, first.sampled(), lost=lost_sampled)(),
              what="the second agent delivering, and the first agent's spool but what it "
                   "counted lost")
        assert second.stop() == 0
        stored = keyed(vm.settled())
    sampled = keyed(first.sampled())
    lost = set(sampled) - set(stored)
    assert len(lost) == lost_sampled, "every lost sample is counted"
    assert all(stored[k] == pytest.approx(sampled[k], rel=VM_REL) for k in set(sampled) - lost)


def test_samples_held_in_memory_when_the_agent_is_killed_are_counted_by_the_next_start(
        tmp_path, tmpfs):
    """SIGKILL (an OOM kill) while the volume refuses writes: what was only in memory is lost,
    and the next start counts it from the ledger the first kept on the volume."""
    spool = tmpfs / "spool"
    vm = VictoriaMetrics(tmp_path)  # down: what the volume refuses can only wait in memory
    first = Agent(args(vm.write_url, spool)).start()
    until(lambda: list(spool.rglob("*.batch")), what="a batch spooled before the volume fills")
    with kept_full(tmpfs):
        until(lambda: (last(first, "gpu_sidecar_spool_bytes", state="memory") or 0) > 0,
              what="batches held in memory while the volume is full")
        first.more_cycles(3, "with the volume full")
        first.signal(signal.SIGKILL)
        first.wait()
    vm.start()
    with running(vm):
        second = Agent(args(vm.write_url, spool)).start()
        [counted] = until(lambda: events(second, "spool_write_failed_before_restart"),
                          what="the loss of the killed run counted")
        until(lambda: pushed(second) > 0
              and delivered(vm, first.sampled(), lost=counted["samples"])(),
              what="the first agent's spool delivered but what was counted lost")
        until(lambda: last(second, "gpu_sidecar_samples_dropped_total",
                           reason="spool_write_failed") == counted["samples"],
              what="the count exported")
        assert second.stop() == 0
        stored = keyed(vm.settled())
    sampled = keyed(first.sampled())
    lost = set(sampled) - set(stored)
    assert counted["samples"] > 0
    # every sample lost to the refusing volume is counted; counted and not printed is at most
    # the cycle the kill cut short between the ledger and stdout (fed last), no bigger than the
    # first cycle, which sends every series
    cycles = Counter(ts for _, _, ts in sampled)
    assert 0 <= counted["samples"] - len(lost) <= max(cycles.values()), (
        counted["samples"], len(lost))
    assert all(stored[k] == pytest.approx(sampled[k], rel=VM_REL) for k in set(sampled) - lost)


def test_every_byte_the_spool_keeps_counts_against_its_bound_the_open_journal_included(
        tmp_path):
    """A long push interval on a small bound: the open batch's journal, uncompressed, is larger
    than the batches; it counts against --spool-max-bytes like they do."""
    bound = 1_200_000  # a 2 s journal of 10 cycles a second is about 670 kB uncompressed
    vm = VictoriaMetrics(tmp_path)  # down: the spool fills to its bound
    spool = tmp_path / "spool"
    agent = Agent(args(vm.write_url, spool, "--interval", "0.1", "--push-interval", "2",
                       "--spool-max-bytes", str(bound))).start()
    until(lambda: events(agent, "spool_full_dropped_oldest"), what="the bound reached")
    peaks, journals = [], []
    for _ in range(3):  # at three instants of the journal's growth
        agent.more_cycles(7)
        peaks.append(sum(p.stat().st_size for p in spool.rglob("*")
                         if p.is_file() and not p.is_symlink()))
        journals += [p.stat().st_size for p in spool.rglob("*.journal")]
    agent.signal(signal.SIGKILL)
    agent.wait()
    peaks.append(sum(p.stat().st_size for p in spool.rglob("*") if p.is_file()))
    journals += [p.stat().st_size for p in spool.rglob("*.journal")]
    # (a kill may land between a batch's seal and the next cycle's record: the journal is
    # looked for at every instant measured, not at the kill alone)
    assert journals and max(journals) > 0, "no journal open at any instant: nothing measured"
    # 64 bytes of bookkeeping: the lock (a pid) and the ledger
    assert max(peaks) <= bound + 64, f"the spool held {max(peaks)} bytes against {bound}"


def test_held_batches_on_the_wire_when_the_agent_stops_are_counted_lost(tmp_path, tmpfs):
    """A request that outlives the shutdown deadline ends with the process: the held batches it
    carries are lost, and counted, not reported as left in the spool."""
    spool = tmpfs / "spool"
    vm = VictoriaMetrics(tmp_path)
    busy = {"on": True}
    proxy = FaultProxy(vm.write_url, lambda n, body: (503, {}, b"busy") if busy["on"] else None,
                       delay=3.0)
    # full from the start (the agent still starts): every batch is held in memory
    # one proxy for both agents: the spool directory is named after the URL the agent pushes to
    with running(proxy):
        with kept_full(tmpfs):
            first = Agent(args(proxy.url, spool, "--shutdown-timeout", "1",
                               "--push-timeout", "10")).start()
            # the first request is on the wire, waiting for its slow 503, and more batches are
            # held behind it; then SIGTERM while a request is still unanswered
            until(lambda: proxy.arrivals, what="a request to reach the slow receiver")
            first.more_cycles(3, "behind the request on the wire")
            until(lambda: len(proxy.arrivals) > len(proxy.log), interval=0.01,
                  what="a request on the wire")
            first.signal(signal.SIGTERM)
            assert first.wait() == 0, "".join(first.err)[-2000:]
        [at_exit] = events(first, "spool_write_failed_at_exit")
        assert at_exit["on_the_wire_samples"] > 0
        assert not events(first, "shutdown_left_in_spool"), \
            "nothing in memory is left for a restart"
        # the stop's staleness markers (one per series, after the last cycle) were held in
        # memory with it: lost and counted too, though no cycle printed them
        [ended] = events(first, "series_ended")
        lost_sampled = at_exit["dropped_samples_total"] - ended["series"]
        busy["on"], proxy.delay = False, 0.0  # the proxy now passes everything on at once
        vm.start()
        with running(vm):
            second = Agent(args(proxy.url, spool)).start()
            until(lambda: pushed(second) > 0 and delivered(
                      vm, first.sampled(), lost=lost_sampled)(),
                  what="the second agent delivering, and the first agent's spool but what it "
                       "counted lost")
            assert second.stop() == 0
            stored = keyed(vm.settled())
    lost = set(keyed(first.sampled())) - set(stored)
    assert len(lost) == lost_sampled, "every lost sample is counted"


def test_an_unreadable_spool_entry_is_set_aside_and_the_sender_goes_on(tmp_path):
    spool = tmp_path / "spool"
    vm = VictoriaMetrics(tmp_path)  # down: batches pile up in the spool
    first = Agent(args(vm.write_url, spool, "--shutdown-timeout", "0.5")).start()
    until(lambda: len(list(spool.rglob("*.batch"))) >= 3, what="3 batches in the spool")
    assert first.stop() == 0
    batches = sorted(spool.rglob("*.batch"))
    assert len(batches) >= 3
    victim = batches[1]
    victim.unlink()
    victim.mkdir()  # a directory where a batch should be: reading it fails
    vm.start()
    with running(vm):
        second = Agent(args(vm.write_url, spool)).start()
        # past the bad entry: the second agent's own cycles reach VictoriaMetrics
        until(lambda: events(second, "spool_batch_unreadable")
              and set(keyed(second.sampled())) & stored_keys(vm),
              what="the bad entry set aside and the second agent's own cycles stored")
        assert second.stop() == 0
        stored = keyed(vm.settled())
    after = keyed(second.sampled())
    assert set(after) <= set(stored), "the sender kept sending after the bad entry"
    assert [e["count"] for e in events(second, "spool_batch_unreadable")] == [1]
    assert (victim.parent / "corrupt" / victim.name).is_dir()
    before = keyed(first.sampled())
    assert len(set(before) & set(stored)) > 0  # the readable batches around it were sent


def test_a_fifo_and_a_link_named_like_batches_neither_hang_the_agent_nor_send_from_outside(
        tmp_path):
    spool = tmp_path / "spool"
    vm = VictoriaMetrics(tmp_path)  # down: batches pile up in the spool
    first = Agent(args(vm.write_url, spool, "--shutdown-timeout", "0.5")).start()
    until(lambda: len(list(spool.rglob("*.batch"))) >= 4, what="4 batches in the spool")
    assert first.stop() == 0
    batches = sorted(spool.rglob("*.batch"))
    outside = Spool(tmp_path / "outside", max_bytes=1 << 20)  # a valid batch, not this spool's
    left = Batch()
    left.add([Series("from_outside_the_spool", (), 1.0, 1_700_000_000_000)])
    foreign = outside.put(compress(GroupedEncoder().write_request(left.series)), samples=1)
    outside.close()
    before = (os.lstat(foreign.path).st_ino, foreign.path.read_bytes())
    batches[1].unlink()
    os.mkfifo(batches[1])
    batches[2].unlink()
    batches[2].symlink_to(foreign.path)
    vm.start()
    with running(vm):
        second = Agent(args(vm.write_url, spool)).start()
        until(lambda: set(keyed(second.sampled())) & stored_keys(vm),
              what="the second agent's own cycles stored: start-up did not hang")
        assert second.stop() == 0
        stored = keyed(vm.settled())
    assert not [k for k in stored if k[0] == "from_outside_the_spool"], "sent from outside"
    assert (os.lstat(foreign.path).st_ino, foreign.path.read_bytes()) == before
    assert sorted(e["kind"] for e in events(second, "spool_batch_unreadable")) == ["fifo", "symlink"]
    assert os.path.islink(batches[2].parent / "corrupt" / batches[2].name)
    real = [b for i, b in enumerate(batches) if i not in (1, 2)]
    assert not any(b.exists() for b in real), "every real batch was delivered"


# -- receiver ----------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [301, 302, 307])
def test_a_redirect_is_never_followed_nor_counted_as_delivered(tmp_path, status):
    vm = VictoriaMetrics(tmp_path).start()
    redirecting = {"on": True}
    proxy = FaultProxy(vm.write_url, lambda n, body: (
        status, {"Location": vm.write_url}, b"moved") if redirecting["on"] else None)
    with running(vm, proxy):
        agent = Agent(args(proxy.url, tmp_path / "spool")).start()
        until(lambda: failures(agent, "redirect") >= 2, what="redirects counted as failures")
        assert keyed(vm.samples()) == {}, "a redirect was followed"
        assert last(agent, "gpu_sidecar_samples_pushed_total") == 0
        redirecting["on"] = False
        until(lambda: events(agent, "receiver_recovered") and pushed(agent) > 0,
              what="delivery once the receiver stops redirecting")
        agent.more_cycles(5, "after the recovery")  # a second episode would show
        assert agent.stop() == 0
        assert stored_equals_sampled_but(vm, agent) == set()
    failing = events(agent, "push_failing")
    assert len(failing) == 1 and failing[0]["reason"] == "redirect"
    assert vm.write_url in failing[0]["detail"] and "configure that URL" in failing[0]["detail"]
    assert len(events(agent, "receiver_recovered")) == 1


def test_a_receiver_that_refuses_every_batch_keeps_the_spool_within_its_bound(tmp_path):
    # the first request is taken (the URL is right), then every batch is refused for its data
    proxy = FaultProxy("http://127.0.0.1:9/unused",
                       lambda n, body: (204, {}, b"") if n == 0 else (400, {}, b"never"))
    bound = 40_000
    with running(proxy):
        agent = Agent(args(proxy.url, tmp_path / "spool", "--push-interval", "0.2",
                           "--spool-max-bytes", str(bound))).start()
        # refused long enough for the refused copies to reach the bound, and be trimmed
        until(lambda: failures(agent, "http_400") >= 12
              and events(agent, "spool_trimmed_kept_copy"),
              what=lambda: f"12 refusals (at {failures(agent, 'http_400')}) and the kept copies "
                           f"trimmed to the bound")
        assert agent.stop() == 0
    spool_files = [p for p in (tmp_path / "spool").rglob("*.batch") if p.is_file()]
    assert 0 < sum(p.stat().st_size for p in spool_files) <= bound
    rejected = last(agent, "gpu_sidecar_spool_bytes", state="rejected")
    assert rejected and 0 < rejected <= bound
    refusals = last(agent, "gpu_sidecar_push_failures_total", reason="http_400")
    assert refusals >= 12
    logged = events(agent, "batch_refused")
    assert [e["count"] for e in logged] == [1, 10][:len(logged)] and logged  # not one per batch


def test_a_slow_receiver_is_caught_up_by_merging_the_backlog(tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    proxy = FaultProxy(vm.write_url, lambda n, body: None, delay=1.0)
    with running(vm, proxy):
        agent = Agent(args(proxy.url, tmp_path / "spool", "--push-interval", "0.2",
                           "--push-timeout", "5")).start()
        # a backlog builds behind each slow answer: several answered requests
        until(lambda: len(proxy.log) >= 5, what="5 answers of the slow receiver")
        assert sigterm_and_wait(agent) < 5.5
        assert stopped(agent)["all_delivered"] is True
        assert stored_equals_sampled_but(vm, agent) == set()
    sealed = len({ts for _, _, ts, _ in agent.sampled()})  # a batch a cycle at this push interval
    assert len(proxy.log) < sealed / 2, "each request carried several spooled batches"


def test_a_hanging_receiver_does_not_hold_shutdown_past_its_timeout(tmp_path):
    proxy = FaultProxy("http://127.0.0.1:9/unused", lambda n, body: (204, {}, b""), delay=60)
    with running(proxy):
        agent = Agent(args(proxy.url, tmp_path / "spool", "--shutdown-timeout", "2",
                           "--push-timeout", "30")).start()
        until(lambda: proxy.arrivals, what="a request to hang at the receiver")
        assert sigterm_and_wait(agent) < 2.5
    assert stopped(agent)["all_delivered"] is False
    assert list((tmp_path / "spool").rglob("*.batch")), "what was not sent stays in the spool"


def test_sigterm_just_after_the_receiver_returns_sends_the_whole_backlog(tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    with running(vm):
        agent = Agent(args(vm.write_url, tmp_path / "spool", "--retry-max-backoff", "30",
                           "--shutdown-timeout", "5")).start()
        until(lambda: pushed(agent) > 0, what="a first delivery")
        vm.stop()
        # the backoff doubles from 0.5 s: after the 5th failed attempt the sender sleeps 8 s
        until(lambda: failures(agent) >= 5,
              what=lambda: f"5 failed attempts (at {failures(agent)})")
        vm.start()  # and SIGTERM at once, while the sender sleeps
        assert sigterm_and_wait(agent) < 5.5
        assert stopped(agent)["all_delivered"] is True
        assert stored_equals_sampled_but(vm, agent) == set()


def test_every_counter_the_alerts_use_exists_at_zero_from_the_first_push(tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    with running(vm):
        agent = Agent(args(vm.write_url, tmp_path / "spool")).start()
        until(lambda: pushed(agent) > 0, what="a first push")
        assert agent.stop() == 0
        rows = vm.settled(len(agent.sampled()))
    first_ts = min(ts for _, _, ts, _ in rows)
    at_first = {(n, dict(lab).get("reason") or dict(lab).get("state")): v
                for n, lab, ts, v in rows if ts == first_ts}
    for reason in FAILURE_REASONS:
        assert at_first[("gpu_sidecar_push_failures_total", reason)] == 0, reason
    for reason in DROP_REASONS:
        assert at_first[("gpu_sidecar_samples_dropped_total", reason)] == 0, reason
    for state in STATES:
        assert ("gpu_sidecar_spool_bytes", state) in at_first


# -- the process -------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_every_stop_signal_takes_a_last_sample_and_flushes(tmp_path, sig):
    """Started as the kubelet starts it (every stop signal at its default disposition), whatever
    the disposition the test run itself inherited (``nohup`` ignores SIGHUP)."""
    vm = VictoriaMetrics(tmp_path).start()
    with running(vm):
        agent = Agent(args(vm.write_url, tmp_path / "spool", "--push-interval", "60"),
                      wrapper=("env", "--default-signal=HUP,INT,TERM")).start()
        try:
            until(lambda: agent.cycles() >= 3, what="3 cycles sampled, none pushed yet")
            agent.signal(sig)
            assert agent.wait() == 0
        finally:
            agent.stop()
        assert stopped(agent)["all_delivered"] is True
        assert stopped(agent)["signals"] == [sig.name]
        assert stored_equals_sampled_but(vm, agent) == set()


def test_an_agent_started_with_sighup_ignored_keeps_it_ignored(tmp_path):
    """Under ``nohup`` the parent asks for SIGHUP to be ignored: the agent honours that (a
    terminal closing must not stop it) and still stops on SIGTERM, flushing as always."""
    agent = Agent(args("http://127.0.0.1:9/api/v1/write", tmp_path / "spool",
                       "--shutdown-timeout", "1"),
                  wrapper=("env", "--ignore-signal=HUP")).start()
    try:
        until(lambda: agent.cycles() >= 2, what="2 cycles sampled")
        agent.signal(signal.SIGHUP)
        after = agent.cycles()
        until(lambda: agent.cycles() >= after + 2 or agent.proc.poll() is not None,
              what="2 more cycles after SIGHUP")
        assert agent.proc.poll() is None, "SIGHUP stopped an agent started with it ignored"
        agent.signal(signal.SIGTERM)
        assert agent.wait() == 0
    finally:
        agent.stop()
    assert stopped(agent)["signals"] == ["SIGTERM"]


def _spawn(argv: list[str], prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
    return subprocess.Popen([*prefix, sys.executable, "-m", "sidecar", "run", "--log-format",
                             "json", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"})


def _child_of(pid: int, timeout: float = 30.0) -> int:
    def children() -> list[str]:
        with contextlib.suppress(OSError):
            return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return []
    return int(until(children, timeout, interval=0.01, what=f"a child process of {pid}")[0])


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``sig`` (its SigCgt mask)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


@pytest.mark.parametrize("as_pid_1", [False, True])
def test_a_signal_during_start_up_is_honoured(tmp_path, as_pid_1):
    """As PID 1 of a container the kernel drops a signal that has no handler: the handlers are
    installed before the agent imports anything heavy."""
    prefix = ("unshare", "--pid", "--fork") if as_pid_1 else ()
    proc = _spawn(args("http://127.0.0.1:9/api/v1/write", tmp_path / "spool",
                       "--shutdown-timeout", "1"), prefix)
    try:
        target = _child_of(proc.pid) if as_pid_1 else proc.pid
        # the moment the entry point has its handler, while the agent is still importing
        until(lambda: _catches(target, signal.SIGTERM) or proc.poll() is not None,
              interval=0.005, what="the SIGTERM handler to be installed")
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        os.kill(target, signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert '"stopped"' in err


def test_a_second_agent_on_the_same_spool_exits_5_naming_the_first(tmp_path):
    spool = tmp_path / "spool"
    first = Agent(args("http://127.0.0.1:9/api/v1/write", spool)).start()
    try:
        def locked_by_first() -> bool:  # its pid in the spool directory's lock file
            with contextlib.suppress(OSError):
                return any(p.read_text().strip() == str(first.proc.pid)
                           for p in spool.rglob(".lock"))
            return False
        until(locked_by_first, what="the first agent to lock the spool")
        second = _spawn(args("http://127.0.0.1:9/api/v1/write", spool))
        _, err = second.communicate(timeout=30)
        assert second.returncode == 5
        assert f"pid {first.proc.pid}" in err and "--spool-dir" in err
    finally:
        assert first.stop() == 0


def test_two_urls_on_one_host_and_port_get_their_own_spool_and_sink_label(tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    with running(vm):
        other = vm.write_url.replace("/api/v1/write", "/prometheus/api/v1/write")
        agent = Agent([*args(vm.write_url, tmp_path / "spool"), "--remote-write-url", other])
        agent.start()
        until(lambda: len({dict(lab)["sink"] for n, lab, _, v in agent.sampled()
                           if n == "gpu_sidecar_samples_pushed_total" and v > 0}) == 2,
              what="both sinks to deliver")
        assert agent.stop() == 0
        stored = vm.settled(2 * len(agent.sampled()) - 100)
    sinks = {dict(lab)["sink"] for n, lab, _, _ in agent.sampled()
             if n == "gpu_sidecar_samples_pushed_total"}
    assert len(sinks) == 2
    assert len([p for p in (tmp_path / "spool").iterdir() if p.is_dir()]) == 2
    for sink in sinks:  # each sink's own counter only ever grows
        values = [v for _, _, v in sorted((ts, n, v) for n, lab, ts, v in agent.sampled()
                                          if n == "gpu_sidecar_samples_pushed_total"
                                          and dict(lab)["sink"] == sink)]
        assert values == sorted(values) and values[-1] > 0
    assert any(n == "gpu_utilization_ratio" for n, _, _, _ in stored)


def test_a_receiver_echoing_the_request_never_puts_a_secret_in_the_log(tmp_path):
    token = tmp_path / "token"
    token.write_text("tok-0a1b2c3d4e5f\n")

    basic = base64.b64encode(b"u:pw-secret-77")

    def echo(n: int, body: bytes) -> tuple[int, dict, bytes]:
        return 401, {}, (b"denied for Authorization: Bearer tok-0a1b2c3d4e5f, X-Key hdr-9z8y7x, "
                         b"Authorization: Basic " + basic)

    proxy = FaultProxy("http://127.0.0.1:9/unused", echo)
    with running(proxy):
        agent = Agent(args(proxy.url.replace("http://", "http://u:pw-secret-77@"),
                           tmp_path / "spool", "--bearer-token-file", str(token),
                           "--header", "X-Key=hdr-9z8y7x", "--log-level", "debug")).start()
        # refused several times over: logged when it starts, not per attempt
        until(lambda: len(proxy.log) >= 3 and events(agent, "push_refused"),
              what=lambda: f"3 refused requests (at {len(proxy.log)}) and their log line")
        assert agent.stop() == 0
    text = "".join(agent.err) + "".join(agent.out)
    refused = events(agent, "push_refused")  # a 401: logged once, every batch kept
    assert len(refused) == 1 and "***" in refused[0]["receiver_said"]
    for secret in ("tok-0a1b2c3d4e5f", "hdr-9z8y7x", "pw-secret-77", basic.decode()):
        assert secret not in text
    assert json.dumps(refused[0])  # the log line is whole JSON


# -- the sender itself (in process: the faults are inside the agent) ----------------------------


def _sink(url: str, spool_dir: Path) -> tuple[RemoteWriteSink, Spool]:
    spool = Spool(spool_dir, max_bytes=1 << 20)
    cfg = Config(push_timeout=5, retry_max_backoff=0.1)
    return RemoteWriteSink(url, spool, cfg, push_interval_s=0.0, initial_backoff_s=0.05), spool


def test_an_unexpected_error_in_the_sender_is_logged_counted_and_retried(tmp_path, monkeypatch):
    proxy = FaultProxy("http://127.0.0.1:9/unused", lambda n, body: (204, {}, b""))
    sink, spool = _sink(proxy.url, tmp_path / "spool")
    real, calls = spool.oldest, []

    def fails_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("controller reset")
        return real()

    monkeypatch.setattr(spool, "oldest", fails_once)
    with running(proxy), structlog.testing.capture_logs() as logs:
        sink.start()
        sink.emit([Series("x", (), 1.0, 1000)])
        until(lambda: len(proxy.log) >= 1, what="a request: the sender must not die")
        assert len(proxy.log) == 1
        assert sink.close(time.monotonic() + 2)
    assert sink.failures["internal"] == 1
    errors = [e for e in logs if e["event"] == "sender_error"]
    assert len(errors) == 1 and "controller reset" in errors[0]["error"]
    assert sink.samples_pushed == 1


def test_a_spooled_batch_that_cannot_be_merged_is_sent_alone_and_the_rest_flows(tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    garbage = b"checksummed, but not snappy"
    proxy = FaultProxy(vm.write_url, lambda n, body: (400, {}, b"bad snappy")
                       if body == garbage else None)
    with running(vm, proxy):
        sink, spool = _sink(proxy.url, tmp_path / "spool")
        spool.put(garbage, samples=3)  # e.g. written by an older version, or bit rot with its CRC
        good = Batch()
        good.add([Series("after_the_bad_one", (("k", "v"),), 2.5, 1_700_000_000_000)])
        spool.put(compress(GroupedEncoder().write_request(good.series)), samples=1)
        sink.start()
        until(lambda: len(spool) == 0, what=lambda: f"an empty spool (at {len(spool)})")
        assert not sink.close(time.monotonic() + 2), "a batch set aside is not all delivered"
        assert [(n, v) for n, _, _, v in vm.settled(1)] == [("after_the_bad_one", 2.5)]
    assert spool.dropped_samples["rejected"] == 3


def test_a_spool_root_owned_by_someone_else_keeps_its_mode_and_the_agent_starts(tmp_path):
    """A Kubernetes emptyDir belongs to root, mode 0777, and the agent runs as 65532: only the
    owner may chmod it, so the agent must not try (the per-URL directories are 0700)."""
    root = tmp_path / "emptydir"
    root.mkdir()
    root.chmod(0o777)
    os.chown(root, 12345, 12345)
    _private_root(str(root))
    assert stat.S_IMODE(root.stat().st_mode) == 0o777


def test_a_spool_root_the_agent_creates_is_0700_and_one_it_finds_keeps_its_mode(tmp_path):
    """The agent changes nothing it did not make (docs/reliability.md, what the agent may
    touch), its own directory included when someone else made it."""
    found = tmp_path / "found"
    found.mkdir()
    found.chmod(0o755)
    _private_root(str(found))
    assert stat.S_IMODE(found.stat().st_mode) == 0o755
    made = tmp_path / "made" / "spool"
    old = os.umask(0)
    try:
        _private_root(str(made))
    finally:
        os.umask(old)
    assert stat.S_IMODE(made.stat().st_mode) == 0o700


def test_the_spool_of_an_earlier_release_is_adopted_and_sent(tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    with running(vm):
        host_port = vm.write_url.split("/")[2].replace(":", "_")
        old = Spool(tmp_path / "spool" / f"remote_write_{host_port}", max_bytes=1 << 20)
        left = Batch()
        left.add([Series("left_by_the_old_release", (), 7.0, 1_700_000_000_000)])
        old.put(compress(GroupedEncoder().write_request(left.series)), samples=1)
        old.close()
        agent = Agent(args(vm.write_url, tmp_path / "spool")).start()
        until(lambda: events(agent, "spool_adopted") and pushed(agent) > 0,
              what="the old spool adopted and a push")
        assert agent.stop() == 0
        assert ("left_by_the_old_release", (), 1_700_000_000_000, 7.0) in vm.settled()
    assert len(events(agent, "spool_adopted")) == 1


def test_pushgateway_values_that_arrive_while_a_push_fails_are_pushed_without_waiting(tmp_path):
    # the first push is answered 503 slowly; a newer cycle arrives meanwhile and must be pushed
    # as soon as the retry gives up on the older values, not a push interval later
    from sidecar.sinks.pushgateway import PushgatewaySink

    proxy = FaultProxy("http://127.0.0.1:9/unused",
                       lambda n, body: (503, {}, b"busy") if n == 0 else (200, {}, b""),
                       delay=0.5)
    sink = PushgatewaySink(proxy.url.removesuffix("/api/v1/write"),
                           Config(retry_max_backoff=0.2),
                           push_interval_s=0.0, initial_backoff_s=0.1)
    labels = (("gpu_uuid", "GPU-x"),)
    with running(proxy):
        sink.start()
        sink.emit([Series("gpu_utilization_ratio", labels, 0.25, 1)])
        until(lambda: proxy.arrivals, what="the first push on the wire")
        sink.emit([Series("gpu_utilization_ratio", labels, 0.75, 2)])
        until(lambda: any(s < 300 for _, s, _ in proxy.log), what="a successful push")
        sink.close(time.monotonic() + 2)
    pushed = [body for _, status, body in proxy.log if status < 300]
    assert pushed and b"0.75" in pushed[0], proxy.log


def _backlog_sink(url: str, spool_dir: Path, token: Path, batches: int = 30,
                  max_bytes: int = 1 << 20) -> tuple[RemoteWriteSink, Spool]:
    """A remote-write sink with ``batches`` single-sample batches waiting in its spool."""
    spool = Spool(spool_dir, max_bytes=max_bytes)
    cfg = Config(push_timeout=5, retry_max_backoff=0.1, bearer_token_file=str(token))
    sink = RemoteWriteSink(url, spool, cfg, push_interval_s=0.0, initial_backoff_s=0.05)
    for i in range(batches):
        sink.emit([Series("backlog_sample", (("i", str(i)),), float(i), 1_700_000_000_000 + i)])
    return sink, spool


def test_a_backlog_refused_401_is_kept_whole_and_delivered_once_the_token_is_fixed(tmp_path):
    """30 spooled batches (one merged request) meet an authenticating gateway that answers 401
    to the token the agent has; 2 s later the Secret is fixed. Nothing may be set aside: the
    whole backlog reaches VictoriaMetrics, the refusal counted per attempt and logged once when
    it starts, once when it ends."""
    vm = VictoriaMetrics(tmp_path).start()
    proxy = FaultProxy(vm.write_url, lambda n, body: None,
                       require={"Authorization": "Bearer new-token"})
    token = tmp_path / "token"
    token.write_text("old-token\n")
    with running(vm, proxy), structlog.testing.capture_logs() as logs:
        sink, spool = _backlog_sink(proxy.url, tmp_path / "spool", token)
        assert len(spool) == 30
        sink.start()
        until(lambda: sum(1 for _, status, _ in proxy.log if status == 401) >= 5,
              what="5 refusals of the old token")
        assert len(spool) == 30, "a refusal about credentials must keep every batch"
        token.write_text("new-token\n")  # the kubelet swapped the Secret
        until(lambda: len(spool) == 0, what=lambda: f"an empty spool (at {len(spool)})")
        assert sink.close(time.monotonic() + 2)
        stored = vm.settled(30)
    assert sorted(v for n, _, _, v in stored if n == "backlog_sample") == [float(i) for i in range(30)]
    assert not list((tmp_path / "spool").rglob("rejected/*"))
    assert spool.dropped_samples["rejected"] == 0
    refusals = sum(1 for _, status, _ in proxy.log if status == 401)
    assert refusals >= 5 and sink.failures["http_401"] == refusals
    began = [e for e in logs if e["event"] == "push_refused"]
    ended = [e for e in logs if e["event"] == "push_refused_ended"]
    assert len(began) == 1 and "authentication failed" in began[0]["hint"]
    assert "old-token" not in str(logs) and "new-token" not in str(logs)
    assert len(ended) == 1 and ended[0]["attempts"] == refusals


def test_a_receiver_refusing_403_for_ever_keeps_the_spool_within_its_bound(tmp_path):
    """Held batches are not exempt from the bound: the oldest go as spool_full, never to
    rejected/."""
    proxy = FaultProxy("http://127.0.0.1:9/unused", lambda n, body: (403, {}, b"forbidden"))
    token = tmp_path / "token"
    token.write_text("t\n")
    bound = 4_000
    with running(proxy):
        sink, spool = _backlog_sink(proxy.url, tmp_path / "spool", token, batches=10,
                                    max_bytes=bound)
        sink.start()
        for i in range(200):
            sink.emit([Series("more", (("i", str(i)),), float(i), 1_700_000_001_000 + i)])
            time.sleep(0.005)  # paced like cycles; the count below does not depend on it
        until(lambda: any(status == 403 for _, status, _ in proxy.log), what="a refused request")
        sink.close(time.monotonic() + 0.5)
        sink._thread.join(timeout=5)
    # a request on the wire is left alone by the bound (spool.py, _trim), so the spool may
    # exceed it by that request until the next batch is written: one more, then measure
    assert spool.put(b"", 0) is not None
    assert 0 < spool.bytes() <= bound
    assert spool.dropped_samples["spool_full"] > 0 and spool.dropped_samples["rejected"] == 0
    assert not list((tmp_path / "spool").rglob("rejected/*"))
    assert sink.failures["http_403"] == sum(1 for _, status, _ in proxy.log if status == 403) > 0
