"""What a production pod throws at the agent: TLS it must not trust, a full or unusable spool, a
socket path already taken, clock jumps, a flooding app. And its own manners: no listening port,
private files."""

from __future__ import annotations

import http.server
import itertools
import json
import os
import resource
import signal
import socket
import ssl
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sidecar import protocol
from sidecar.agent import Agent as SidecarAgent
from sidecar.config import Config
from sidecar.sources.app_socket import AppState
from tests.conftest import ROOT, run_cli
from tests.manual_clock import ManualClock
from tests.receivers import Agent, VictoriaMetrics, running
from tests.waiting import until

# -- TLS ---------------------------------------------------------------------------------------


def make_ca_and_server_cert(tmp: Path) -> tuple[Path, Path, Path]:
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.pem", "-days", "2", "-subj", "/CN=gpu-sidecar test CA")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
            "-subj", "/CN=127.0.0.1")
    (tmp / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "san.ext")
    return tmp / "ca.pem", tmp / "server.pem", tmp / "server.key"


class TlsReceiver:
    """A real local HTTPS remote-write endpoint with a certificate from a private CA (plain
    HTTP with ``tls=False``)."""

    def __init__(self, cert: Path, key: Path, *, tls: bool = True,
                 client_ca: Path | None = None) -> None:
        self.requests = 0
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver.requests += 1
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(cert, key)
            if client_ca is not None:  # mutual TLS: only a client with a certificate of this CA
                context.verify_mode = ssl.CERT_REQUIRED
                context.load_verify_locations(client_ca)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        scheme = "https" if tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self.server.server_address[1]}/api/v1/write"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def brief_run(url: str, tmp: Path, *extra: str, until_: Callable[[Agent], object],
              what: str) -> Agent:
    """The agent runs until ``until_(agent)`` holds, and a few more push intervals (0.3 s, 1.5
    cycles each) in which anything else it would do shows, then stops."""
    agent = Agent(["--simulate", "healthy", "--interval", "0.2", "--push-interval", "0.3",
                   "--remote-write-url", url, "--spool-dir", str(tmp / "spool"),
                   "--retry-max-backoff", "0.3", "--shutdown-timeout", "1", *extra])
    agent.start()
    until(lambda: until_(agent) or agent.proc.poll() is not None, what=what, interval=0.1)
    agent.more_cycles(5)
    assert agent.stop() == 0, "".join(agent.err)[-2000:]
    return agent


def test_tls_is_verified_by_default_and_a_private_ca_must_be_given(tmp_path):
    ca, cert, key = make_ca_and_server_cert(tmp_path)
    receiver = TlsReceiver(cert, key)
    with running(receiver):
        refused = brief_run(receiver.url, tmp_path / "a",
                            until_=lambda agent: agent.logged("push_failing"),
                            what="the push to fail")
        assert receiver.requests == 0
        failing = [e for e in refused.events() if e.get("event") == "push_failing"]
        assert failing and failing[0]["reason"] == "tls" and "--ca-file" in failing[0]["detail"]

        brief_run(receiver.url, tmp_path / "b", "--ca-file", str(ca),
                  until_=lambda agent: receiver.requests > 0, what="a request verified by the CA")
        trusted = receiver.requests
        assert trusted > 0

        insecure = brief_run(receiver.url, tmp_path / "c", "--insecure-skip-verify",
                             until_=lambda agent: receiver.requests > trusted,
                             what="a request without verification")
        assert receiver.requests > trusted  # only when explicitly asked
        warned = [e for e in insecure.events() if e.get("event") == "tls_verification_disabled"]
        assert len(warned) == 1 and "--ca-file" in warned[0]["hint"]  # said once, by us
        assert "InsecureRequestWarning" not in "".join(insecure.err)  # not urllib3 per request


def make_client_cert(tmp: Path) -> tuple[Path, Path]:
    """A client certificate signed by the CA of ``make_ca_and_server_cert`` (call that first)."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp, timeout=60)

    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "client.key", "-out", "client.csr",
            "-subj", "/CN=gpu-sidecar test client")
    openssl("x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "client.pem", "-days", "2")
    return tmp / "client.pem", tmp / "client.key"


def test_a_receiver_requiring_a_client_certificate_gets_the_one_configured(tmp_path):
    """Mutual TLS: without --cert-file/--key-file the handshake is refused and nothing is
    stored; with them every push is taken."""
    ca, cert, key = make_ca_and_server_cert(tmp_path)
    client_cert, client_key = make_client_cert(tmp_path)
    receiver = TlsReceiver(cert, key, client_ca=ca)
    with running(receiver):
        refused = brief_run(receiver.url, tmp_path / "a", "--ca-file", str(ca),
                            until_=lambda agent: agent.logged("push_failing"),
                            what="the push without a client certificate to fail")
        assert receiver.requests == 0
        assert refused.logged("push_failing")[0]["reason"] in ("tls", "network")
        brief_run(receiver.url, tmp_path / "b", "--ca-file", str(ca),
                  "--cert-file", str(client_cert), "--key-file", str(client_key),
                  until_=lambda agent: receiver.requests > 0, what="a push with the certificate")
        assert receiver.requests > 0


def test_the_http_library_logs_nothing_of_its_own_whatever_a_receiver_answers(tmp_path):
    """A receiver answering a malformed header line: urllib3 logs a warning quoting the URL
    (query values included) and the header text. Even in a process whose root logger prints
    (an embedding program's ``logging.basicConfig()``), stderr has only the agent's own JSON
    lines, and no secret of the URL."""
    secret = "licence-key-5ecret"

    class Malformed(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.wfile.write(b"HTTP/1.1 204 No Content\r\nX-Ok: 1\r\nbroken header line "
                             + secret.encode() + b"\r\nContent-Length: 0\r\n\r\n")

        def log_message(self, *args: object) -> None:
            pass

    answered = []
    Malformed.do_POST = _counting(Malformed.do_POST, answered)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Malformed)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/api/v1/write?key={secret}"
    code = ("import logging, sys; logging.basicConfig(); from sidecar import cli; "
            "sys.exit(cli.main(sys.argv[1:]))")
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, "run", "--simulate", "healthy", "--interval", "0.2",
             "--push-interval", "0.3", "--remote-write-url", url,
             "--spool-dir", str(tmp_path / "spool"), "--log-format", "json"],
            stdout=subprocess.DEVNULL, stderr=err, text=True, cwd=ROOT)
        try:
            until(lambda: len(answered) >= 3 or proc.poll() is not None,
                  what=lambda: f"3 malformed answers sent (at {len(answered)})")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            server.shutdown()
            server.server_close()
        err.seek(0)
        stderr = err.read()
    assert len(answered) >= 3
    assert secret not in stderr
    events = [json.loads(line) for line in stderr.splitlines()]  # all the agent's own
    assert next(e for e in events if e["event"] == "stopped")["all_delivered"] is True


def _counting(handler: Callable[..., None], seen: list) -> Callable[..., None]:
    def counted(self: http.server.BaseHTTPRequestHandler) -> None:
        handler(self)
        seen.append(1)
    return counted


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_a_receiver_with_ca_file_works_over_http_and_https(tmp_path, tls):
    """--ca-file set and a plain-HTTP receiver: pushes go out unencrypted and are taken; the
    same with https: verified against the CA. OpenSSL loads the ordinary way in both."""
    ca, cert, key = make_ca_and_server_cert(tmp_path)
    receiver = TlsReceiver(cert, key, tls=tls)
    agent = Agent(["--simulate", "healthy", "--interval", "0.2", "--push-interval", "0.3",
                   "--remote-write-url", receiver.url, "--ca-file", str(ca),
                   "--spool-dir", str(tmp_path / "spool")])
    with running(receiver, agent):
        agent.start()
        until(lambda: receiver.requests >= 2 or agent.proc.poll() is not None,
              what=lambda: f"2 requests at the receiver (at {receiver.requests})")
        assert receiver.requests >= 2, "".join(agent.err)[-2000:]
        assert agent.stop() == 0


_MODULES_AFTER = """
import runpy, sys
sys.argv = ["gpu-sidecar", "run", "--simulate", "healthy", "--once", "--output", "json",
            "--log-level", "error"]
{start}
import ssl, urllib.request  # nothing the agent loaded hides a module from a later import
print("MODULES", " ".join(sorted(m for m in sys.modules if m.startswith(("sidecar", "ssl",
      "_ssl", "_hashlib", "requests", "urllib3")))))
"""


def test_python_dash_m_and_an_in_process_main_load_the_same_modules():
    """No import trick depends on how the agent was started: ``python -m sidecar`` and a caller
    of ``cli.main()`` load the same modules, and ``ssl`` and ``urllib.request`` stay importable."""
    by_module = "try:\n    runpy.run_module('sidecar', run_name='__main__')\nexcept SystemExit:\n    pass"
    in_process = "from sidecar import cli\ncli.main(sys.argv[1:])"
    seen = []
    for start in (by_module, in_process):
        out = subprocess.run([sys.executable, "-c", _MODULES_AFTER.format(start=start)],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-2000:]
        line = next(x for x in out.stdout.splitlines() if x.startswith("MODULES"))
        seen.append(set(line.split()[1:]) - {"sidecar.__main__"})
    assert seen[0] == seen[1]
    assert {"ssl", "_ssl", "sidecar.cli"} <= seen[0]


# -- manners -----------------------------------------------------------------------------------


def socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def test_the_agent_opens_no_listening_network_port_and_keeps_its_files_private(tmp_path):
    vm = VictoriaMetrics(tmp_path)  # down: batches stay in the spool where we can see them
    sock = tmp_path / "run" / "app.sock"
    agent = Agent(["--simulate", "healthy", "--interval", "0.2", "--push-interval", "0.3",
                   "--remote-write-url", vm.write_url, "--spool-dir", str(tmp_path / "spool"),
                   "--pushgateway-url", "http://127.0.0.1:9", "--socket", str(sock)])
    agent.start()
    try:
        # running in full: its socket bound, batches spooled, a push tried at each receiver
        until(lambda: sock.exists() and list((tmp_path / "spool").rglob("*.batch"))
              and agent.total("gpu_sidecar_push_failures_total") > 0, interval=0.1,
              what="the socket, a spooled batch and failed pushes")
        agent.more_cycles(3)
        pid = agent.proc.pid
        inodes = socket_inodes(pid)
        listening = []
        for table in ("tcp", "tcp6", "udp", "udp6"):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                state, inode = fields[3], fields[9]
                if inode in inodes and (table.startswith("udp") or state == "0A"):
                    listening.append((table, fields[1], state))
        assert listening == []
        assert stat.S_IMODE(sock.stat().st_mode) == 0o660
        assert stat.S_IMODE(sock.parent.stat().st_mode) & 0o007 == 0
        spool_dirs = [p for p in (tmp_path / "spool").iterdir() if p.is_dir()]
        assert spool_dirs and all(stat.S_IMODE(d.stat().st_mode) == 0o700 for d in spool_dirs)
        batches = list((tmp_path / "spool").rglob("*.batch"))
        assert batches and all(stat.S_IMODE(b.stat().st_mode) == 0o600 for b in batches)
    finally:
        agent.stop()


# -- configuration and environment faults -------------------------------------------------------


def test_unusable_spool_directory_stops_the_agent_with_advice(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    proc = run_cli("run", "--simulate", "healthy", "--remote-write-url", "http://127.0.0.1:9/w",
                   "--spool-dir", str(blocker / "spool"))
    assert proc.returncode == 5
    assert "--spool-dir" in proc.stderr and "not writable" in proc.stderr


def test_a_spool_volume_refusing_every_write_holds_batches_in_memory_and_keeps_sampling(
        tmp_path):
    def tiny_files() -> None:  # every write beyond 2 KB fails with EFBIG, like a full volume
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))

    agent = Agent(["--simulate", "healthy", "--interval", "0.2", "--push-interval", "0.3",
                   "--remote-write-url", "http://127.0.0.1:9/api/v1/write",
                   "--spool-dir", str(tmp_path / "spool"), "--shutdown-timeout", "1"],
                  preexec_fn=tiny_files)
    with running(agent):
        agent.start()
        until(lambda: (agent.logged("spool_write_failed") and agent.cycles() >= 10
              and (agent.last("gpu_sidecar_spool_bytes", state="memory") or 0) > 0)
              or agent.proc.poll() is not None, interval=0.1,
              what=lambda: f"a refused write, 10 cycles (at {agent.cycles()}) and batches held "
                           f"in memory")
        agent.more_cycles(5, "with every write refused")  # several more batches refused
        assert agent.stop() == 0, "".join(agent.err)[-2000:]
    assert len(agent.logged("spool_write_failed")) == 1  # logged once, not per batch
    assert agent.cycles() >= 10  # sampling went on
    in_memory = [v for n, lab, _, v in agent.sampled() if n == "gpu_sidecar_spool_bytes"
                 and dict(lab).get("state") == "memory"]
    assert in_memory and in_memory[-1] > 0  # the receiver is down: the batches wait there
    [lost] = agent.logged("spool_write_failed_at_exit")
    assert lost["samples"] > 0  # the disk never took them: lost at exit, and counted


@pytest.mark.parametrize("occupant", ["live socket", "regular file"])
def test_a_socket_path_already_taken_is_a_clear_error_not_a_takeover(tmp_path, occupant):
    path = tmp_path / "app.sock"
    holder = None
    if occupant == "live socket":
        holder = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        holder.bind(str(path))
    else:
        path.write_text("someone's file")
    try:
        proc = run_cli("run", "--simulate", "healthy", "--once", "--socket", str(path))
    finally:
        if holder is not None:
            holder.close()
    assert proc.returncode == 4
    assert ("another process is listening" if holder else "is not a socket") in proc.stderr
    if occupant == "regular file":
        assert path.read_text() == "someone's file"


def test_wall_clock_jumps_move_timestamps_but_never_the_schedule():
    clock = ManualClock()
    wall = [1_800_000_000.0]
    stamps: list[int] = []
    starts: list[float] = []

    class Sink:
        name = "probe"

        def start(self) -> None: ...
        def close(self, deadline: float) -> bool: return True
        def telemetry(self, ts: int, labels: tuple) -> list: return []

        def emit(self, series: list) -> None:
            starts.append(clock())
            stamps.append(series[0].timestamp_ms)
            wall[0] += -3600.0 if len(stamps) == 2 else 1.0  # NTP steps the clock back an hour

    class Stop:
        def is_set(self) -> bool:
            return len(stamps) >= 5

        def wait(self, seconds: float) -> bool:
            clock.advance(max(0.0, seconds))
            wall[0] += max(0.0, seconds)
            return self.is_set()

    agent = SidecarAgent(Config(no_nvml=True, interval=1.0), source=None, app=AppState(clock=clock),
                         sinks=[Sink()], clock=clock, wall=lambda: wall[0])
    agent.run(Stop())
    assert [round(t - starts[0], 6) for t in starts] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert stamps[2] < stamps[1]  # timestamps follow the wall clock, as receivers expect
    assert agent.overruns == 0


def test_a_flooding_app_neither_blocks_nor_bloats_the_agent_nor_shifts_its_schedule(tmp_path):
    sock = tmp_path / "run" / "app.sock"
    agent = Agent(["--simulate", "healthy", "--no-simulated-app", "--interval", "0.25",
                   "--socket", str(sock), "--remote-write-url", "http://127.0.0.1:9/w",
                   "--spool-dir", str(tmp_path / "spool"), "--spool-max-bytes", "1000000"])
    agent.start()
    try:
        until(sock.exists, what="the agent's socket")
        agent.more_cycles(2, "before the flood")  # warmed up: a baseline to measure against
        rss_before = _rss_kib(agent.proc.pid)
        flooder = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        flooder.setblocking(False)
        flooder.connect(str(sock))
        gpu = __import__("sidecar.simulate.scenarios", fromlist=["x"]).simulated_uuid("healthy", 0)
        message = protocol.encode(protocol.Allocator(4242, gpu, 10, 5, 5, 1, 0, 0))
        sent = refused = 0
        worst = 0.0
        end = time.monotonic() + 5.0
        while time.monotonic() < end:
            t = time.perf_counter()
            try:
                flooder.send(message)
                sent += 1
            except BlockingIOError:
                refused += 1
            worst = max(worst, time.perf_counter() - t)
        flooder.close()
        agent.more_cycles(2, "after the flood")  # what was queued is read and counted
        rss_after = _rss_kib(agent.proc.pid)
    finally:
        assert agent.stop() == 0
    assert sent > 10_000
    assert worst < 0.05  # the sender never blocked
    assert rss_after - rss_before < 10 * 1024  # bounded: state per (GPU, process), not per message
    stamps = sorted({r[2] for r in agent.sampled()})
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    assert max(gaps[1:-1]) < 600  # 250 ms grid kept under the flood (< 2 slots)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")
