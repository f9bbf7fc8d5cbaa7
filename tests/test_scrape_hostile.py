"""``--metrics-listen`` cannot be starved (issue #32, item 7), produced for real against a running
agent on 127.0.0.1: 500 idle connections and 20 slowloris connections (a header byte every
0.5 s), each reopened whenever the agent lets it go, stay open while a real scraper asks for
``/metrics`` every 0.5 s. The
scraper gets its answers, the agent's cycles go on, its file descriptors stay bounded, a
trickling head is cut at the head deadline however steadily its bytes come, and the episode is
logged once.
"""

from __future__ import annotations

import contextlib
import os
import resource
import selectors
import socket
import threading
import time
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from sidecar.sinks.scrape import HEAD_DEADLINE_S, MAX_CONNECTIONS, TICK_S
from tests.receivers import LOCAL, Agent, free_port, listener_pid_owns
from tests.waiting import until

IDLE, SLOW = 500, 20
SCRAPES, SCRAPE_TIMEOUT_S = 10, 10.0  # Prometheus' default scrape timeout
SCRAPE_EVERY_S = 0.5  # so that the scrapes span more than a head deadline
INTERVAL_S = 0.5
SLACK_S = 2.0  # a loaded machine's lateness on top of the deadline


def open_fds(pid: int) -> int:
    """The agent's open sockets: what connections can hold. Its own files (the status file
    rewritten, a batch sealed, a journal) come and go at any time and are no connection."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return n


@pytest.fixture
def descriptors():
    """Room for the attacker's sockets in this process: the soft limit raised within the hard
    one, restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = IDLE + SLOW + 512
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"the test needs {want} file descriptors; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class Idle:
    """``IDLE`` connections that never send a byte, each reopened (checked every 0.5 s) once
    the server has closed it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reopened = 0
        self._selector = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._hold, daemon=True)

    def _open(self) -> None:
        with contextlib.suppress(OSError):
            s = socket.create_connection((LOCAL, self.port), timeout=10)
            self._selector.register(s, selectors.EVENT_READ)

    def __enter__(self) -> Idle:
        for _ in range(IDLE):
            self._open()
        self._thread.start()
        return self

    def _hold(self) -> None:
        while not self._stop.wait(0.5):
            for key, _ in self._selector.select(0):
                self._selector.unregister(key.fileobj)
                key.fileobj.close()  # type: ignore[union-attr]
                self._open()
                self.reopened += 1

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()


class Slowloris:
    """``SLOW`` connections that each send a request head one byte every 0.5 s and never end
    it, reconnecting whenever the server lets one go; records how long each one was held."""

    HEAD = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + b"X-a: b\r\n" * 1000

    def __init__(self, port: int) -> None:
        self.port = port
        self.held_s: list[float] = []  # the life of each connection the server closed
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._attack, daemon=True) for _ in range(SLOW)]

    def __enter__(self) -> Slowloris:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)

    def _attack(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError), \
                    socket.create_connection((LOCAL, self.port), timeout=5) as s:
                opened = time.monotonic()
                for byte in self.HEAD:
                    if self._stop.wait(0.5):
                        return
                    try:
                        s.send(bytes([byte]))
                    except OSError:
                        break
                    s.settimeout(0)
                    try:
                        if s.recv(1) == b"":  # closed by the server
                            break
                    except BlockingIOError:
                        continue
                    except OSError:
                        break
                self.held_s.append(time.monotonic() - opened)


def scrape(address: str) -> bool:
    """One real scrape: answered within the timeout with the GPUs' series."""
    try:
        page = requests.get(f"http://{address}/metrics", timeout=SCRAPE_TIMEOUT_S)
    except requests.RequestException:
        return False
    names = {s.name for f in text_string_to_metric_families(page.text) for s in f.samples}
    return page.status_code == 200 and "gpu_sm_occupancy_ratio" in names


def test_idle_and_slowloris_connections_never_starve_a_scraper_nor_the_agent(tmp_path: Path,
                                                                              descriptors):
    port = free_port()
    address = f"{LOCAL}:{port}"
    agent = Agent(["--simulate", "healthy", "--socket", str(tmp_path / "app.sock"),
                   "--interval", str(INTERVAL_S), "--metrics-listen", address]).start()
    try:
        until(lambda: listener_pid_owns(agent.proc.pid, port),
              what=lambda: f"the agent listening on {address}\n{''.join(agent.err[-5:])}")
        until(lambda: scrape(address), what="a first scrape answered")
        fds_before = open_fds(agent.proc.pid)

        with Slowloris(port) as slow, Idle(port) as idle:
            cut_before = len(slow.held_s)  # the first ones may be dropped for the idle burst
            cycles_then, started = agent.cycles(), time.monotonic()
            answered = most_fds = 0
            for _ in range(SCRAPES):
                asked = time.monotonic()
                answered += scrape(address)
                most_fds = max(most_fds, open_fds(agent.proc.pid))
                time.sleep(max(0.0, SCRAPE_EVERY_S - (time.monotonic() - asked)))
            # the slowloris connections opened during the scrapes have been cut too
            until(lambda: len(slow.held_s) >= cut_before + SLOW, HEAD_DEADLINE_S * 4 + 30,
                  what=lambda: f"{SLOW} more slowloris connections let go "
                               f"(at {len(slow.held_s) - cut_before})")
            elapsed = time.monotonic() - started
            cycles = agent.cycles() - cycles_then
            held = list(slow.held_s)
            reopened = idle.reopened

        assert answered >= SCRAPES - 1, f"{answered} of {SCRAPES} scrapes answered"
        assert reopened >= IDLE - MAX_CONNECTIONS, "the idle connections were not let go"
        # at the cap the oldest is dropped before a newcomer is accepted: never one more (a
        # bare CI run once saw 8 + 65 when the drop came after the accept)
        assert most_fds <= fds_before + MAX_CONNECTIONS, \
            f"{most_fds} descriptors open in the agent ({fds_before} before the attack)"
        # a byte every 0.5 s never extends the head's deadline
        assert max(held) <= HEAD_DEADLINE_S + TICK_S + SLACK_S, sorted(held)[-5:]
        # the cycles went on: at least half the cycles the interval gives in that time
        assert cycles >= elapsed / INTERVAL_S / 2, f"{cycles} cycles in {elapsed:.1f} s"
        dropped = agent.logged("metrics_listen_connections_dropped")
        assert len(dropped) == 1, dropped
        assert dropped[0]["address"] == address and "NetworkPolicy" in dropped[0]["hint"]
        assert agent.proc.poll() is None
    finally:
        with contextlib.suppress(Exception):
            agent.stop()
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait(timeout=10)
