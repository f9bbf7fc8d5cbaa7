"""Real receivers for the tests: Debian's victoria-metrics, vmagent, prometheus and
prometheus-pushgateway, each on 127.0.0.1 with a free port and a temporary data directory, plus
a small fault-injecting HTTP proxy. Nothing here talks to anything but 127.0.0.1."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest
import requests

from sidecar.metrics import RARE
from sidecar.samples import Series
from sidecar.sinks.cadence import Cadence
from tests.conftest import ROOT

LOCAL = "127.0.0.1"


# Listening ports are drawn below Linux's ephemeral range (32768-60999 by default), where the
# kernel never hands out ports for outgoing connections; another listener can still take one
# between our check and the receiver's bind, which Process.start detects and survives.
PORTS = range(20000, 32000)


def free_port() -> int:
    """A port nobody listens on right now (a hint, not a reservation)."""
    while True:
        port = random.choice(PORTS)
        with socket.socket() as s:
            try:
                s.bind((LOCAL, port))
            except OSError:
                continue
            return port


def need(binary: str) -> str:
    """A tool the tests need, where scripts/test installs it: the test environment's own
    bin directory (pip's console scripts), then the system's (apt-get). Never skipped."""
    venv_bin = Path(sys.executable).parent
    for found in (venv_bin / binary, *(Path(d) / binary for d in SYSTEM_BIN)):
        if found.is_file() and os.access(found, os.X_OK):
            return str(found)
    pytest.fail(f"{binary} is not installed: run `bash scripts/test`, which installs every tool "
                f"the tests need (looked in {venv_bin} and {', '.join(SYSTEM_BIN)})")


SYSTEM_BIN = ("/usr/local/bin", "/usr/bin", "/usr/sbin", "/bin", "/sbin")


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(url, timeout=1).status_code < 500:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not come up in {timeout} s")


def listener_pid_owns(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds the socket listening on 127.0.0.1:``port`` (from /proc):
    a health check alone would also pass against a stranger that took the port."""
    wanted = f"0100007F:{port:04X}"
    inodes = set()
    with contextlib.suppress(OSError), open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if cols[1].upper() == wanted and cols[3] == "0A":  # 0A: LISTEN
                inodes.add(cols[9])
    if not inodes:
        return False
    fd_dir = Path(f"/proc/{pid}/fd")
    with contextlib.suppress(OSError):
        for fd in fd_dir.iterdir():
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return True
    return False


class PortTaken(Exception):
    """The receiver could not bind its port: someone took it after free_port() saw it free."""


@dataclass
class Process:
    """A receiver process bound to a port of ours. ``command(port)`` builds its arguments and
    ``health`` is the path that answers once it serves."""

    command: Callable[[int], list[str]]
    log: Path
    health: str
    port: int = field(default_factory=lambda: free_port())
    published: bool = False  # someone was given our URL: the port can no longer change
    proc: subprocess.Popen | None = None

    @property
    def base(self) -> str:
        self.published = True
        return f"http://{LOCAL}:{self.port}"

    def start(self, attempts: int = 5) -> None:
        for _ in range(attempts):
            try:
                self._start_once()
                self.published = True
                return
            except PortTaken:
                if self.published:
                    raise RuntimeError(
                        f"port {self.port} was taken by another process, and the test already "
                        f"handed out this receiver's URL") from None
                self.port = free_port()
        raise RuntimeError(f"{self.log.stem}: no free port after {attempts} attempts")

    def _start_once(self) -> None:
        offset = self.log.stat().st_size if self.log.exists() else 0
        self.proc = subprocess.Popen(self.command(self.port), stdout=self.log.open("ab"),
                                     stderr=subprocess.STDOUT, cwd=self.log.parent)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                text = self.log.read_text(errors="replace")[offset:]
                if "address already in use" in text.lower():
                    raise PortTaken(self.port)
                raise RuntimeError(f"{self.log.stem} exited at start:\n{text[-2000:]}")
            if listener_pid_owns(self.proc.pid, self.port):
                break
            time.sleep(0.05)
        else:
            self.stop()
            raise RuntimeError(f"{self.log.stem} did not listen on port {self.port} in 30 s:\n"
                               f"{self.log.read_text(errors='replace')[offset:][-2000:]}")
        try:
            wait_http(f"http://{LOCAL}:{self.port}{self.health}")
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"{self.log.stem} failed to start:\n"
                               f"{self.log.read_text(errors='replace')[offset:][-2000:]}") from None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


R = TypeVar("R", bound="Receiver")


class Receiver:
    """What every receiver shares: one Process, its URL, start and stop."""

    process: Process

    @property
    def port(self) -> int:
        return self.process.port

    @property
    def base(self) -> str:
        return self.process.base

    @property
    def write_url(self) -> str:
        return f"{self.base}/api/v1/write"

    def start(self: R) -> R:
        self.process.start()
        return self

    def stop(self) -> None:
        self.process.stop()


# VictoriaMetrics stores each float as an int64 decimal mantissa found by scaling until the
# fraction is below 1e-12 of the integer part (lib/decimal, conversionPrecision = 1e12), and
# truncates it: 0.7123729215517124 comes back as 0.712372921551, a relative error just above
# 1e-12. Ten times that still catches any value that is not the one sampled.
VM_REL = 1e-11


class VictoriaMetrics(Receiver):
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.process = Process(
            lambda port: [need("victoria-metrics"), f"-httpListenAddr={LOCAL}:{port}",
                          f"-storageDataPath={tmp / 'vm-data'}", "-retentionPeriod=100y",
                          "-search.latencyOffset=0s", "-loggerLevel=WARN"],
            tmp / "victoria-metrics.log", "/health")

    def export(self, match: str = '{__name__=~".+"}') -> list[dict]:
        requests.get(f"{self.base}/internal/force_flush", timeout=10)
        r = requests.post(f"{self.base}/api/v1/export", data={"match[]": match}, timeout=30)
        r.raise_for_status()
        return [json.loads(line) for line in r.text.splitlines() if line.strip()]

    def settled(self, expect: int | None = None, timeout: float = 15.0
                ) -> list[tuple[str, tuple, int, float]]:
        """Stored samples once ingestion settled: VictoriaMetrics makes rows searchable up to a
        second after it acknowledged them, even after /internal/force_flush."""
        deadline = time.monotonic() + timeout
        rows, stable = self.samples(), 0
        while time.monotonic() < deadline:
            if expect is not None and len(rows) >= expect:
                return rows
            time.sleep(0.5)
            again = self.samples()
            stable = stable + 1 if len(again) == len(rows) else 0
            rows = again
            if expect is None and stable >= 4:
                return rows
        return rows

    def samples(self, match: str = '{__name__=~".+"}') -> list[tuple[str, tuple, int, float]]:
        """Every stored sample as (name, sorted labels without __name__, ts ms, value)."""
        out = []
        for row in self.export(match):
            labels = dict(row["metric"])
            name = labels.pop("__name__")
            key = tuple(sorted(labels.items()))
            for ts, value in zip(row["timestamps"], row["values"], strict=True):
                if value is None:  # a staleness marker (a clean stop's): the end, no sample
                    continue
                out.append((name, key, ts, float(value)))
        return out


class VmAgent(Receiver):
    def __init__(self, tmp: Path, target: str) -> None:
        self.tmp = tmp
        self.process = Process(
            lambda port: [need("vmagent"), f"-httpListenAddr={LOCAL}:{port}",
                          f"-remoteWrite.url={target}",
                          f"-remoteWrite.tmpDataPath={tmp / 'vmagent-data'}",
                          "-remoteWrite.flushInterval=200ms", "-loggerLevel=WARN"],
            tmp / "vmagent.log", "/health")


class Prometheus(Receiver):
    def __init__(self, tmp: Path, scrape: str | None = None) -> None:
        """``scrape``: a host:port to scrape every second with ``honor_labels`` (a Pushgateway,
        as its documentation asks); otherwise it only receives remote-write."""
        self.tmp = tmp
        config = tmp / "prometheus.yml"
        text = "global:\n  scrape_interval: 1h\n"
        if scrape:
            text += ("scrape_configs:\n  - job_name: pushgateway\n    honor_labels: true\n"
                     f"    scrape_interval: 1s\n    static_configs:\n      - targets: ['{scrape}']\n")
        config.write_text(text)
        self.process = Process(
            lambda port: [need("prometheus"), f"--config.file={config}",
                          f"--storage.tsdb.path={tmp / 'prom-data'}",
                          f"--web.listen-address={LOCAL}:{port}",
                          "--web.enable-remote-write-receiver", "--log.level=warn"],
            tmp / "prometheus.log", "/-/ready")

    def query(self, expr: str) -> list[dict]:
        r = requests.get(f"{self.base}/api/v1/query", params={"query": expr}, timeout=30)
        r.raise_for_status()
        return r.json()["data"]["result"]

    def samples(self, selector: str, at: float) -> list[tuple[str, tuple, int, float]]:
        r = requests.get(f"{self.base}/api/v1/query",
                         params={"query": f"{selector}[1h]", "time": at}, timeout=30)
        r.raise_for_status()
        out = []
        for row in r.json()["data"]["result"]:
            labels = dict(row["metric"])
            name = labels.pop("__name__")
            key = tuple(sorted(labels.items()))
            for ts, value in row["values"]:
                out.append((name, key, round(float(ts) * 1000), float(value)))
        return out


class Pushgateway(Receiver):
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        # Debian's build persists to /var/lib/prometheus/pushgateway.data unless told otherwise:
        # groups of earlier runs would come back, and the file would outlive the test
        self.process = Process(
            lambda port: [need("prometheus-pushgateway"), f"--web.listen-address={LOCAL}:{port}",
                          f"--persistence.file={tmp / 'pushgateway.data'}",
                          "--persistence.interval=1s", "--log.level=warn"],
            tmp / "pushgateway.log", "/-/ready")

    def groups(self) -> list[dict]:
        r = requests.get(f"{self.base}/api/v1/metrics", timeout=10)
        r.raise_for_status()
        return r.json()["data"]

    @staticmethod
    def values(group: dict) -> dict[tuple[str, tuple], float]:
        """A group's series as {(name, sorted labels): value}, histograms as their _bucket,
        _sum and _count series, without the grouping key's job and instance labels."""
        stored: dict[tuple[str, tuple], float] = {}
        for name, family in group.items():
            if not isinstance(family, dict) or name in (
                    "labels", "push_time_seconds", "push_failure_time_seconds"):
                continue  # the Pushgateway's own bookkeeping
            for m in family["metrics"]:
                labels = {k: v for k, v in m["labels"].items() if k not in ("job", "instance")}
                key = tuple(sorted(labels.items()))
                if "value" in m:
                    stored[(name, key)] = float(m["value"])
                else:  # histogram
                    for le, count in m["buckets"].items():
                        le = "+Inf" if le == "+Inf" else repr(float(le))
                        stored[(f"{name}_bucket", tuple(sorted((*key, ("le", le)))))] = float(count)
                    stored[(f"{name}_sum", key)] = float(m["sum"])
                    stored[(f"{name}_count", key)] = float(m["count"])
        return stored


def answer_with(handler: http.server.BaseHTTPRequestHandler, status: int, headers: dict,
                body: bytes) -> None:
    handler.send_response(status)
    for k, v in headers.items():
        handler.send_header(k, v)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


class LocalServer:
    """An HTTP server of the test's own on 127.0.0.1, a free port, a thread."""

    def serve(self, handler: type[http.server.BaseHTTPRequestHandler], path: str) -> str:
        self.server = http.server.ThreadingHTTPServer((LOCAL, 0), handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return f"http://{LOCAL}:{self.server.server_address[1]}{path}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class FaultProxy(LocalServer):
    """Forwards POSTs to ``target``; ``plan(n)`` may answer request n itself (status, headers,
    body). Records every request: arrival time and the status the agent got. ``require``: headers
    a request must carry, as an authenticating gateway checks them; one without them is answered
    401 (the plan is not asked)."""

    def __init__(self, target: str, plan: Callable[[int, bytes], tuple[int, dict, bytes] | None],
                 delay: float = 0.0, require: dict[str, str] | None = None):
        self.target = target
        self.plan = plan
        self.delay = delay  # seconds before each answer: a slow or hanging receiver
        self.require = dict(require or {})  # may be changed while it runs
        self.log: list[tuple[float, int, bytes]] = []
        self.headers: list[dict[str, str]] = []  # per request, as it arrived on the wire
        self.arrivals: list[float] = []  # when each request arrived, before its answer
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with proxy.lock:
                    proxy.arrivals.append(time.monotonic())
                    n = len(proxy.log)
                    if any(self.headers.get(k) != v for k, v in proxy.require.items()):
                        answer = (401, {}, b"unauthorized: bad or missing credentials")
                    else:
                        answer = proxy.plan(n, body)
                if proxy.delay:
                    time.sleep(proxy.delay)
                if answer is None:
                    headers = {k: v for k, v in self.headers.items()
                               if k.lower() not in ("host", "content-length")}
                    r = requests.post(proxy.target, data=body, headers=headers, timeout=10)
                    answer = (r.status_code, {}, r.content)
                status, extra, text = answer
                with proxy.lock:
                    proxy.log.append((time.monotonic(), status, body))
                    proxy.headers.append(dict(self.headers.items()))
                answer_with(self, status, extra, text)

            do_PUT = do_POST  # the Pushgateway's method

            def log_message(self, *args: object) -> None:
                pass

        self.url = self.serve(Handler, "/api/v1/write")


@dataclass
class Agent:
    """``gpu-sidecar run`` as a subprocess; its stdout (--stdout --output json) is the record of
    what was sampled."""

    args: list[str]
    proc: subprocess.Popen | None = None
    out: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)
    preexec_fn: Callable[[], None] | None = None  # e.g. a resource limit for the agent alone
    # a command the agent is started through, e.g. coreutils' ``env --default-signal=HUP``:
    # signal dispositions the test states itself instead of inheriting pytest's (nohup)
    wrapper: tuple[str, ...] = ()
    _rows: list[tuple[str, tuple, int, float]] = field(default_factory=list, repr=False)
    _sent: list[tuple[str, tuple, int, float]] = field(default_factory=list, repr=False)
    _cadence: Cadence = field(default_factory=lambda: Cadence(RARE), repr=False)
    _parsed: int = field(default=0, repr=False)

    def start(self) -> Agent:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen(
            [*self.wrapper, sys.executable, "-m", "sidecar", "run", "--stdout", "--output", "json",
             "--log-format", "json", *self.args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
            preexec_fn=self.preexec_fn)
        self._readers = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for t in self._readers:
            t.start()
        return self

    @staticmethod
    def _pump(stream, sink: list[str]) -> None:
        for line in stream:
            sink.append(line)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30) -> int:
        assert self.proc is not None
        rc = self.proc.wait(timeout=timeout)
        for t in self._readers:
            t.join(timeout=5)
        return rc

    def stop(self, timeout: float = 30) -> int:
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGTERM)
        return self.wait(timeout)

    def recorded(self) -> list[tuple[str, tuple, int, float]]:
        """Every series of every cycle, as the agent printed them on stdout."""
        # parsed once per line: tests poll this while the agent runs
        lines = self.out[:]  # whole lines only: the reader appends complete ones
        for line in lines[self._parsed:]:
            if line.startswith("{"):
                r = json.loads(line)
                row = (r["name"], tuple(sorted(r["labels"].items())), r["timestamp_ms"],
                       float(r["value"]))
                self._rows.append(row)
                if self._cadence.due([Series(row[0], row[1], row[3], row[2])]):
                    self._sent.append(row)
        self._parsed = len(lines)
        return list(self._rows)

    def sampled(self) -> list[tuple[str, tuple, int, float]]:
        """What the agent sent a pushing sink (remote-write, OTLP): its stdout record thinned
        by the same cadence (sidecar/sinks/cadence.py: a rare figure when it changes and every
        minute), which is what a receiver must hold, no more and no less."""
        self.recorded()
        return list(self._sent)

    def events(self) -> list[dict]:
        out = []
        for line in list(self.err):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def logged(self, event: str) -> list[dict]:
        """The agent's log lines of one event."""
        return [e for e in self.events() if isinstance(e, dict) and e.get("event") == event]

    def cycles(self) -> int:
        """How many cycles the agent has printed so far (one timestamp each)."""
        return len({ts for _, _, ts, _ in self.sampled()})

    def last(self, name: str, **labels: str) -> float | None:
        """The newest value printed of a series (the first matching ``labels``), or None."""
        found = [(ts, v) for n, lab, ts, v in self.sampled()
                 if n == name and all(dict(lab).get(k) == x for k, x in labels.items())]
        return max(found)[1] if found else None

    def total(self, name: str, **labels: str) -> float:
        """The sum over every label set of a series in the newest cycle that printed it (a
        counter's total over reasons or sinks); 0 before it was printed."""
        found = [(ts, v) for n, lab, ts, v in self.sampled()
                 if n == name and all(dict(lab).get(k) == x for k, x in labels.items())]
        if not found:
            return 0.0
        newest = max(ts for ts, _ in found)
        return sum(v for ts, v in found if ts == newest)

    def more_cycles(self, n: int, what: str = "", timeout: float = 60.0) -> int:
        """Wait until the agent has printed ``n`` more cycles than now; the count reached."""
        from tests.waiting import until

        want = self.cycles() + n
        until(lambda: self.cycles() >= want or self.proc.poll() is not None, timeout,
              interval=0.1, what=lambda: f"{n} more cycles of the agent{' ' + what if what else ''}"
                                         f" (at {self.cycles()} of {want})")
        assert self.proc.poll() is None, "the agent exited:\n" + "".join(self.err)[-2000:]
        return self.cycles()


@contextlib.contextmanager
def running(*things: object) -> Iterator[None]:
    try:
        yield
    finally:
        for thing in reversed(things):
            with contextlib.suppress(Exception):
                thing.stop()  # type: ignore[attr-defined]


class OtlpReceiver(LocalServer):
    """An OTLP/HTTP metrics receiver for the tests (no real one is installable here): every
    request is gunzipped and decoded with the official ``opentelemetry-proto`` classes.
    ``plan(n, request)`` may answer request n itself (status, headers, body); otherwise 200 with
    an empty ExportMetricsServiceResponse. ``delay`` holds every answer: a hanging receiver.
    ``stored`` holds the requests answered 2xx, ``log`` every request: (time, status, request)."""

    def __init__(self, plan: Callable[[int, object], tuple[int, dict, bytes] | None]
                 = lambda n, request: None, delay: float = 0.0) -> None:
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
            ExportMetricsServiceRequest,
            ExportMetricsServiceResponse,
        )

        self.plan = plan
        self.delay = delay
        self.log: list[tuple[float, int, object]] = []
        self.headers: list[dict[str, str]] = []
        self.stored: list[object] = []
        self.lock = threading.Lock()
        ok = ExportMetricsServiceResponse().SerializeToString()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # kept-alive connections, as a Collector does

            def do_POST(self) -> None:
                import gzip

                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportMetricsServiceRequest.FromString(body)
                with receiver.lock:
                    n = len(receiver.log)
                    answer = receiver.plan(n, request)
                if receiver.delay:
                    time.sleep(receiver.delay)
                status, extra, text = answer or (200, {"Content-Type": "application/x-protobuf"}, ok)
                with receiver.lock:
                    receiver.log.append((time.monotonic(), status, request))
                    receiver.headers.append(dict(self.headers.items()))
                    if 200 <= status < 300:
                        receiver.stored.append(request)
                answer_with(self, status, extra, text)

            def log_message(self, *args: object) -> None:
                pass

        self.url = self.serve(Handler, "/v1/metrics")


def otlp_io(requests: list) -> dict[tuple[str, str], list[tuple[int, int, float]]]:
    """The ``hw.gpu.io`` points of decoded OTLP requests, per (hw.id, network.io.direction):
    (start ns, time ns, bytes) in the order sent, checking on the way that each is a cumulative
    monotonic Sum in By with the GPU's attributes. ``otlp_rows`` leaves them out: they are no
    series of the agent's."""
    from sidecar.metrics import GPU_ATTRIBUTES, GPU_IO

    out: dict[tuple[str, str], list[tuple[int, int, float]]] = {}
    for request in requests:
        for rm in request.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name != GPU_IO.name:
                        continue
                    assert metric.WhichOneof("data") == "sum" and metric.unit == "By"
                    assert metric.sum.is_monotonic and metric.sum.aggregation_temporality == 2
                    for p in metric.sum.data_points:
                        attrs = {kv.key: kv.value.string_value for kv in p.attributes}
                        assert {k: attrs.pop(k) for k, _ in GPU_ATTRIBUTES} == dict(GPU_ATTRIBUTES)
                        assert attrs.keys() == {"hw.id", "hw.model", "gpu.index",
                                                "network.io.direction"}, attrs
                        if p.flags & 1:  # NO_RECORDED_VALUE: a clean stop ended it, no sample
                            continue
                        assert p.WhichOneof("value") == "as_double"
                        key = (attrs["hw.id"], attrs["network.io.direction"])
                        out.setdefault(key, []).append(
                            (p.start_time_unix_nano, p.time_unix_nano, p.as_double))
    return out


def otlp_rows(requests: list) -> list[tuple[str, tuple, int, float]]:
    """Decoded OTLP requests turned back into the agent's Prometheus series (name, sorted labels,
    ts ms, value) through the mapping table, checking on the way what the mapping promises:
    units, instrument types, cumulative temporality, start times, GPU attributes. ``hw.gpu.io``
    is left out (``otlp_io``)."""
    from sidecar.metrics import GPU_ATTRIBUTES, GPU_IO, OTEL, POINT_LABELS, RESOURCE_LABELS
    from sidecar.samples import format_bound

    back_point = {v: k for k, v in POINT_LABELS.items()}
    back_resource = {v: k for k, v in RESOURCE_LABELS.items()}
    own = {"service.name", "service.version", "host.name", "service.instance.id"}
    rows = []
    for request in requests:
        for rm in request.resource_metrics:
            resource = {kv.key: kv.value.string_value for kv in rm.resource.attributes}
            assert resource["service.name"] == "gpu-sidecar" and resource["host.name"]
            pod, namespace = resource.get("k8s.pod.name"), resource.get("k8s.namespace.name")
            assert resource["service.instance.id"] == (
                (f"{namespace}/{pod}" if namespace else pod) if pod else resource["host.name"])
            res_labels = [(back_resource.get(k, k), v) for k, v in resource.items() if k not in own]
            for sm in rm.scope_metrics:
                assert sm.scope.name == "gpu-sidecar"
                for metric in sm.metrics:
                    if metric.name == GPU_IO.name:
                        continue
                    kind = metric.WhichOneof("data")
                    points = getattr(metric, kind).data_points
                    if kind in ("sum", "histogram"):
                        assert getattr(metric, kind).aggregation_temporality == 2  # cumulative
                    for p in points:
                        attrs = {kv.key: (str(kv.value.int_value) if kv.value.HasField("int_value")
                                          else kv.value.string_value) for kv in p.attributes}
                        matches = [name for name, o in OTEL.items() if o.name == metric.name
                                   and all(attrs.get(k) == v for k, v in o.attributes)]
                        assert len(matches) == 1, (metric.name, attrs)
                        prom = matches[0]
                        spec = OTEL[prom]
                        assert metric.unit == spec.unit, (metric.name, metric.unit)
                        expected = {"gauge": "gauge", "counter": "sum", "updowncounter": "sum",
                                    "histogram": "histogram"}[spec.instrument]
                        assert kind == expected, (metric.name, kind)
                        if kind == "sum":
                            assert metric.sum.is_monotonic == (spec.instrument == "counter")
                        if kind != "gauge":
                            assert 0 < p.start_time_unix_nano <= p.time_unix_nano
                        for k, _ in spec.attributes:
                            attrs.pop(k)
                        if "hw.id" in attrs:
                            for k, v in GPU_ATTRIBUTES:
                                assert attrs.pop(k) == v
                        labels = sorted([*res_labels, *((back_point.get(k, k), v)
                                                        for k, v in attrs.items())])
                        ts = p.time_unix_nano // 1_000_000
                        assert p.time_unix_nano == ts * 1_000_000
                        if p.flags & 1:  # NO_RECORDED_VALUE: a clean stop ended it, no sample
                            continue
                        if kind != "histogram":
                            rows.append((prom, tuple(labels), ts, p.as_double))
                            continue
                        cumulative = 0
                        for bound, count in zip([*p.explicit_bounds, float("inf")],
                                                p.bucket_counts, strict=True):
                            cumulative += count
                            le = "+Inf" if bound == float("inf") else format_bound(bound)
                            rows.append((f"{prom}_bucket", tuple(sorted([*labels, ("le", le)])),
                                         ts, float(cumulative)))
                        assert cumulative == p.count
                        rows.append((f"{prom}_sum", tuple(labels), ts, p.sum))
                        rows.append((f"{prom}_count", tuple(labels), ts, float(p.count)))
    return rows
