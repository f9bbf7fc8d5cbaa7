"""Small black-box tools for the ``test_*_promises.py`` files: the command line as a subprocess,
a local HTTP receiver that records every request and answers by plan; waits are
``tests.waiting.until``, re-exported here.

Kept apart from ``tests/receivers.py`` and ``tests/conftest.py`` on purpose: these tests go
through the command line and real sockets only, so they keep meaning the same thing while the
agent's insides move."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.waiting import until

__all__ = ["Agent", "Receiver", "cli", "until"]

ROOT = Path(__file__).resolve().parent.parent
LOCAL = "127.0.0.1"


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def cli(*args: str, env: dict[str, str] | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``gpu-sidecar ARGS`` to completion."""
    return subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True,
                          text=True, timeout=timeout, env=clean_env(env), cwd=ROOT)


@dataclass
class Agent:
    """``gpu-sidecar run ARGS --log-format json`` in the background; stdout and stderr are
    collected line by line."""

    args: list[str]
    env: dict[str, str] | None = None
    out: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None

    def __enter__(self) -> Agent:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "run", "--log-format", "json", *self.args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            env=clean_env(self.env))
        self._threads = [threading.Thread(target=self._pump, args=(s, sink), daemon=True)
                         for s, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @staticmethod
    def _pump(stream, sink: list[str]) -> None:
        for line in stream:
            sink.append(line)

    def stop(self, timeout: float = 20) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(timeout=10)
        for t in self._threads:
            t.join(timeout=5)
        return rc

    def alive(self) -> bool:
        assert self.proc is not None
        return self.proc.poll() is None

    def logged(self, event: str) -> list[dict]:
        found = []
        for line in list(self.err):
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and record.get("event") == event:
                    found.append(record)
        return found

    def series(self) -> list[dict]:
        """The JSON lines printed (``--output json``)."""
        rows = []
        for line in list(self.out):
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    rows.append(json.loads(line))
        return rows

    def stderr_tail(self) -> str:
        return "".join(self.err)[-3000:]


Answer = tuple[int, dict[str, str], bytes]


class Receiver:
    """An HTTP server on 127.0.0.1 (a free port chosen by the kernel) that records every request
    (arrival time, path, body) and answers ``plan(n)`` for the n-th request (0-based); 204 when
    the plan says None."""

    def __init__(self, plan: Callable[[int], Answer | None] = lambda n: None) -> None:
        self.plan = plan
        self.requests: list[tuple[float, str, bytes]] = []
        self.answers: list[int] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver.lock:
                    n = len(receiver.requests)
                    receiver.requests.append((time.monotonic(), self.path, body))
                    answer = receiver.plan(n) or (204, {}, b"")
                    receiver.answers.append(answer[0])
                status, headers, text = answer
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            do_PUT = do_GET = do_POST

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((LOCAL, 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://{LOCAL}:{self.port}/api/v1/write"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def count(self) -> int:
        with self.lock:
            return len(self.requests)

    def snapshot(self) -> list[tuple[float, str, bytes]]:
        with self.lock:
            return list(self.requests)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)
