"""The real fault "a host name that never resolves": a DNS server that receives every query
and never answers. The test builds that world in a network namespace of its own (``unshare
-rnm``: user, network and mount namespaces, no real root needed): only ``lo``, a resolv.conf,
hosts and nsswitch.conf of the test's temporary directory bind-mounted over /etc's (the system's
resolver, its /etc/hosts and any NSS module such as systemd-resolved are out of reach), and on
127.0.0.1:53 a UDP and TCP server that records each query and answers none. libc itself is told
to wait far longer than ``--push-timeout`` (``timeout:30 attempts:5``), so that only the agent's
own deadline can end an attempt.

The real agent runs in that namespace. What it must do (DESIGN: ``--push-timeout`` bounds the
whole request, name resolution included): say once that pushes fail because the name of the
receiver was not resolved within the push timeout, naming the host; end each attempt at that
timeout, never at libc's; keep sampling while the batches wait in the spool; and at SIGTERM exit
0 within its shutdown timeout, saying that the batches stay in the spool.

Machine: ``unshare`` (util-linux), ``mount`` (mount) and ``ip`` (iproute2). The test is skipped
only where the machine refuses the namespaces; a missing tool fails it (scripts/test installs
what the tests need)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.receivers import Agent, need
from tests.waiting import until

HOST = "receiver.never-answers.test"  # .test: reserved (RFC 2606), in no hosts file
URL = f"http://{HOST}:8428/api/v1/write"
PUSH_TIMEOUT_S = 2.0
SHUTDOWN_TIMEOUT_S = 2.0
LIBC_TIMEOUT = "options timeout:30 attempts:5"  # libc alone would wait minutes, not seconds

# The DNS server of the namespace: binds UDP and TCP 127.0.0.1:53, appends one line per query
# ("udp <qtype> <name>") to the queries file, answers nothing, and ends by itself after a bound
# (should the test's own clean-up ever miss it).
DNS_SERVER = r'''
import os, select, socket, sys, time

here = sys.argv[1]
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.bind(("127.0.0.1", 53))
tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
tcp.bind(("127.0.0.1", 53))
tcp.listen(16)
log = open(os.path.join(here, "dns.queries"), "a", buffering=1)
ready = os.path.join(here, "dns.ready")
with open(ready + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(ready + ".tmp", ready)


def question(msg):
    labels, i = [], 12
    while i < len(msg) and msg[i]:
        labels.append(msg[i + 1:i + 1 + msg[i]].decode("ascii", "replace"))
        i += 1 + msg[i]
    qtype = int.from_bytes(msg[i + 1:i + 3], "big") if i + 3 <= len(msg) else -1
    return {1: "A", 28: "AAAA"}.get(qtype, str(qtype)), ".".join(labels)


held = {}  # TCP connections: kept open, never answered
end = time.monotonic() + 300
while time.monotonic() < end:
    readable, _, _ = select.select([udp, tcp, *held], [], [], 1.0)
    for s in readable:
        if s is udp:
            msg, _ = udp.recvfrom(4096)
            log.write("udp %s %s\n" % question(msg))
        elif s is tcp:
            conn, _ = tcp.accept()
            held[conn] = b""
        else:
            data = s.recv(4096)
            if not data:
                del held[s]
                s.close()
                continue
            held[s] += data
            while len(held[s]) >= 2 and len(held[s]) >= 2 + int.from_bytes(held[s][:2], "big"):
                n = int.from_bytes(held[s][:2], "big")
                log.write("tcp %s %s\n" % question(held[s][2:2 + n]))
                held[s] = held[s][2 + n:]
'''

# Run by `unshare -rnm sh namespace.sh DIR PYTHON AGENT-ARGS...`: the namespace's world, then the
# agent in place of the shell (so that the test's process is the agent: its signals, its exit).
NAMESPACE_SH = r'''
set -eu
dir="$1"; py="$2"; shift 2
ip link set lo up
mount --bind "$dir/resolv.conf" /etc/resolv.conf
mount --bind "$dir/hosts" /etc/hosts
mount --bind "$dir/nsswitch.conf" /etc/nsswitch.conf
"$py" "$dir/dns_server.py" "$dir" >>"$dir/dns.log" 2>&1 &
i=0
while [ ! -e "$dir/dns.ready" ]; do
  i=$((i + 1))
  if [ "$i" -gt 600 ]; then
    echo "the namespace's DNS server did not start:" >&2; cat "$dir/dns.log" >&2; exit 97
  fi
  sleep 0.05
done
exec "$py" -m sidecar run "$@"
'''


PROBE_SH = "ip link set lo up && mount --bind /etc/hosts /etc/hosts"


def unshare_refused(unshare: str) -> str | None:
    """Why the machine refuses what the test needs of its namespaces (creating them, bringing up
    their ``lo``, bind-mounting in them: some kernels allow the first and refuse the others to
    unprivileged users), or None when it allows it all. The mounts stay in the probe's own
    namespace (``unshare -m`` makes its mounts private)."""
    try:
        probe = subprocess.run([unshare, "-rnm", "sh", "-c", PROBE_SH], capture_output=True,
                               text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return f"`unshare -rnm sh -c '{PROBE_SH}'` did not finish in 30 s"
    if probe.returncode != 0:
        return (f"`unshare -rnm sh -c '{PROBE_SH}'` failed (exit {probe.returncode}): "
                f"{probe.stderr.strip()}")
    return None


@dataclass
class NamespacedAgent(Agent):
    """``Agent`` (its log and series readers), started in a namespace of its own by ``unshare``
    and in a process group of its own: ``kill`` ends the agent and the namespace's DNS server."""

    def start(self) -> NamespacedAgent:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
        env["PYTHONUNBUFFERED"] = "1"
        unshare, script, directory, *agent_args = self.args
        self.proc = subprocess.Popen(
            [unshare, "-rnm", "sh", script, directory, sys.executable,
             "--stdout", "--output", "json", "--log-format", "json", *agent_args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
            start_new_session=True)
        self._readers = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for t in self._readers:
            t.start()
        return self

    def kill(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def queries(directory: Path) -> list[str]:
    with contextlib.suppress(FileNotFoundError):
        return (directory / "dns.queries").read_text().splitlines()
    return []


def values(agent: NamespacedAgent, name: str) -> list[float]:
    """Every value the agent printed of one of its own series, oldest first."""
    return [v for _, v in sorted((ts, v) for n, _, ts, v in agent.sampled() if n == name)]


def batches(spool: Path) -> int:
    return len(list(spool.rglob("*.batch")))


def test_a_resolver_that_never_answers_fails_each_push_at_the_push_timeout(tmp_path):
    unshare, _, _ = need("unshare"), need("ip"), need("mount")
    refused = unshare_refused(unshare)
    if refused is not None:
        pytest.skip(f"this machine refuses the test's own namespaces: {refused}")

    world = tmp_path / "ns"
    world.mkdir()
    (world / "resolv.conf").write_text(f"nameserver 127.0.0.1\n{LIBC_TIMEOUT}\n")
    (world / "hosts").write_text("127.0.0.1 localhost\n::1 localhost\n")
    (world / "nsswitch.conf").write_text("hosts: files dns\n")
    (world / "dns_server.py").write_text(DNS_SERVER)
    (world / "namespace.sh").write_text(NAMESPACE_SH)
    spool = tmp_path / "spool"

    agent = NamespacedAgent([
        unshare, str(world / "namespace.sh"), str(world),
        "--simulate", "healthy", "--interval", "0.5", "--push-interval", "1",
        "--remote-write-url", URL, "--push-timeout", f"{PUSH_TIMEOUT_S:g}",
        "--retry-max-backoff", "0.5", "--shutdown-timeout", f"{SHUTDOWN_TIMEOUT_S:g}",
        "--spool-dir", str(spool)]).start()

    def state() -> str:
        return (f"exit {agent.proc.poll()}; queries {queries(world)[-4:]}; "
                f"log: {''.join(agent.err)[-1500:]}")

    try:
        # (1) the namespace's resolver is the one asked, for the receiver's name
        asked = until(lambda: [q for q in queries(world) if q.endswith(f" {HOST}")]
                      or agent.proc.poll() is not None, 30,
                      what=lambda: f"a DNS query for {HOST} at 127.0.0.1:53 ({state()})")
        assert agent.proc.poll() is None, f"the agent exited: {state()}"
        assert asked

        # (2) the failure, said once, names name resolution, the host and the push timeout
        failing = until(lambda: agent.logged("push_failing") or agent.proc.poll() is not None,
                        30, what=lambda: f"push_failing in the agent's log ({state()})")
        assert agent.proc.poll() is None, f"the agent exited: {state()}"
        (event,) = failing
        detail = event["detail"]
        assert event["reason"] == "network", event
        assert "name resolution" in detail and HOST in detail, detail
        assert f"{PUSH_TIMEOUT_S:g} s" in detail and "--push-timeout" in detail, detail
        assert "spool" in event["effect"], event

        # each attempt ends at the push timeout: the agent's own counters and durations over
        # several attempts (libc, told to wait minutes, never gave up in between)
        until(lambda: agent.total("gpu_sidecar_push_failures_total", reason="network") >= 3
              or agent.proc.poll() is not None, 60,
              what=lambda: "3 failed attempts counted (at "
                           f"{agent.total('gpu_sidecar_push_failures_total', reason='network')};"
                           f" {state()})")
        assert agent.proc.poll() is None, f"the agent exited: {state()}"
        durations = [d for d in values(agent, "gpu_sidecar_push_duration_seconds") if d > 0]
        assert durations, "no push duration printed"
        assert all(PUSH_TIMEOUT_S - 0.1 <= d <= PUSH_TIMEOUT_S + 1.0 for d in durations), \
            f"each attempt should end at the {PUSH_TIMEOUT_S:g} s push timeout: {durations}"
        assert len(agent.logged("push_failing")) == 1, "logged once, not once per attempt"
        assert not [e for e in agent.events() if "gaierror" in str(e.get("detail", ""))], \
            "libc gave up: the resolver answered, or libc did not wait as told"
        # every attempt joined the one lookup in flight (a hanging resolver costs one thread):
        # the resolver was asked once per address family, not once per attempt
        assert len(queries(world)) <= 4, queries(world)

        # sampling goes on; the batches wait in the spool
        cycles, spooled = agent.cycles(), batches(spool)
        assert spooled > 0, "the batches should wait in the spool"
        agent.more_cycles(4, "while the receiver's name does not resolve")
        until(lambda: batches(spool) > spooled, 30,
              what=lambda: f"the spool to grow past {spooled} batches (at {batches(spool)})")
        assert agent.cycles() > cycles
        assert (agent.last("gpu_sidecar_spool_batches") or 0) > 0

        # (3) SIGTERM: exit 0 within the shutdown timeout, the batches kept in the spool
        agent.signal(signal.SIGTERM)
        signalled = time.monotonic()
        rc = agent.wait(timeout=30)
        took = time.monotonic() - signalled
        assert rc == 0, state()
        assert took < SHUTDOWN_TIMEOUT_S + 1.0, f"took {took:.2f} s to stop: {state()}"
        (left,) = agent.logged("shutdown_left_in_spool")
        assert left["batches"] > 0 and "next start" in left["effect"], left
        (stopped,) = agent.logged("stopped")
        assert stopped["all_delivered"] is False, stopped
        assert batches(spool) > 0, "what was not sent stays in the spool"
    finally:
        agent.kill()
