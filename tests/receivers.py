"""Real receivers for the tests: Debian's victoria-metrics, vmagent, prometheus and
prometheus-pushgateway, each on 127.0.0.1 with a free port and a temporary data directory, plus
a small fault-injecting HTTP proxy. Nothing here talks to anything but 127.0.0.1."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

from tests.conftest import ROOT

LOCAL = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOCAL, 0))
        return s.getsockname()[1]


def need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{binary} is not installed: scripts/test installs it with apt-get")
        pytest.skip(f"{binary} not installed (run scripts/test, which installs it)")
    return path


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


@dataclass
class Process:
    args: list[str]
    log: Path
    health: str
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, stdout=self.log.open("ab"),
                                     stderr=subprocess.STDOUT, cwd=self.log.parent)
        try:
            wait_http(self.health)
        except TimeoutError:
            self.stop()
            raise RuntimeError(
                f"{self.args[0]} failed to start:\n{self.log.read_text()[-2000:]}") from None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@dataclass
class VictoriaMetrics:
    tmp: Path
    port: int = field(default_factory=free_port)

    def __post_init__(self) -> None:
        self.base = f"http://{LOCAL}:{self.port}"
        self.write_url = f"{self.base}/api/v1/write"
        self.process = Process(
            [need("victoria-metrics"), f"-httpListenAddr={LOCAL}:{self.port}",
             f"-storageDataPath={self.tmp / 'vm-data'}", "-retentionPeriod=100y",
             "-search.latencyOffset=0s", "-loggerLevel=WARN"],
            self.tmp / "victoria-metrics.log", f"{self.base}/health")

    def start(self) -> VictoriaMetrics:
        self.process.start()
        return self

    def stop(self) -> None:
        self.process.stop()

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
                out.append((name, key, ts, float(value)))
        return out


@dataclass
class VmAgent:
    tmp: Path
    target: str
    port: int = field(default_factory=free_port)

    def __post_init__(self) -> None:
        self.base = f"http://{LOCAL}:{self.port}"
        self.write_url = f"{self.base}/api/v1/write"
        self.process = Process(
            [need("vmagent"), f"-httpListenAddr={LOCAL}:{self.port}",
             f"-remoteWrite.url={self.target}",
             f"-remoteWrite.tmpDataPath={self.tmp / 'vmagent-data'}",
             "-remoteWrite.flushInterval=200ms", "-loggerLevel=WARN"],
            self.tmp / "vmagent.log", f"{self.base}/health")

    def start(self) -> VmAgent:
        self.process.start()
        return self

    def stop(self) -> None:
        self.process.stop()


@dataclass
class Prometheus:
    tmp: Path
    port: int = field(default_factory=free_port)

    def __post_init__(self) -> None:
        self.base = f"http://{LOCAL}:{self.port}"
        self.write_url = f"{self.base}/api/v1/write"
        config = self.tmp / "prometheus.yml"
        config.write_text("global:\n  scrape_interval: 1h\n")
        self.process = Process(
            [need("prometheus"), f"--config.file={config}",
             f"--storage.tsdb.path={self.tmp / 'prom-data'}",
             f"--web.listen-address={LOCAL}:{self.port}", "--web.enable-remote-write-receiver",
             "--log.level=warn"],
            self.tmp / "prometheus.log", f"{self.base}/-/ready")

    def start(self) -> Prometheus:
        self.process.start()
        return self

    def stop(self) -> None:
        self.process.stop()

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


@dataclass
class Pushgateway:
    tmp: Path
    port: int = field(default_factory=free_port)

    def __post_init__(self) -> None:
        self.base = f"http://{LOCAL}:{self.port}"
        self.process = Process(
            [need("prometheus-pushgateway"), f"--web.listen-address={LOCAL}:{self.port}",
             "--log.level=warn"],
            self.tmp / "pushgateway.log", f"{self.base}/-/ready")

    def start(self) -> Pushgateway:
        self.process.start()
        return self

    def stop(self) -> None:
        self.process.stop()

    def groups(self) -> list[dict]:
        r = requests.get(f"{self.base}/api/v1/metrics", timeout=10)
        r.raise_for_status()
        return r.json()["data"]


class FaultProxy:
    """Forwards POSTs to ``target``; ``plan(n)`` may answer request n itself (status, headers,
    body). Records every request: arrival time and the status the agent got."""

    def __init__(self, target: str, plan: Callable[[int, bytes], tuple[int, dict, bytes] | None]):
        self.target = target
        self.plan = plan
        self.log: list[tuple[float, int, bytes]] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with proxy.lock:
                    n = len(proxy.log)
                    answer = proxy.plan(n, body)
                if answer is None:
                    headers = {k: v for k, v in self.headers.items()
                               if k.lower() not in ("host", "content-length")}
                    r = requests.post(proxy.target, data=body, headers=headers, timeout=10)
                    answer = (r.status_code, {}, r.content)
                status, extra, text = answer
                with proxy.lock:
                    proxy.log.append((time.monotonic(), status, body))
                self.send_response(status)
                for k, v in extra.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((LOCAL, 0), Handler)
        self.url = f"http://{LOCAL}:{self.server.server_address[1]}/api/v1/write"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Agent:
    """``gpu-sidecar run`` as a subprocess; its stdout (--stdout --output json) is the record of
    what was sampled."""

    args: list[str]
    proc: subprocess.Popen | None = None
    out: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)

    def start(self) -> Agent:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "run", "--stdout", "--output", "json",
             "--log-format", "json", *self.args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
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

    def sampled(self) -> list[tuple[str, tuple, int, float]]:
        rows = []
        for line in list(self.out):
            if line.startswith("{"):
                r = json.loads(line)
                rows.append((r["name"], tuple(sorted(r["labels"].items())), r["timestamp_ms"],
                             float(r["value"])))
        return rows

    def events(self) -> list[dict]:
        out = []
        for line in list(self.err):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out


@contextlib.contextmanager
def running(*things: object) -> Iterator[None]:
    try:
        yield
    finally:
        for thing in reversed(things):
            with contextlib.suppress(Exception):
                thing.stop()  # type: ignore[attr-defined]
