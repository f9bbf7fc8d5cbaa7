"""Stop signals: 200 stops of a real agent, each acted on within the shutdown timeout.

    .venv/bin/python bench/bench_stop_signals.py [--runs 200] [--shutdown-timeout 2]

Each run starts ``gpu-sidecar run --simulate healthy --interval 0.2 --push-interval 0.5`` with
remote-write to a receiver served by this process and its spool in a temporary directory, through
coreutils' ``env --default-signal`` (every stop signal at its default disposition, as a kubelet
starts it, whatever this process inherited), then sends SIGTERM, SIGINT or SIGHUP in turn at one
of four moments of the agent's life, in turn:

- ``start-up``: as soon as the entry point has its handler (``SigCgt`` in /proc), while it imports;
- ``sampling``: after its first sample reached stdout, receiver answering 204;
- ``backoff``: receiver refusing connections, after the first ``push_failing`` line;
- ``in-flight``: receiver accepting the request and never answering, while a push hangs.

Measured: seconds from the signal to the process' exit, its exit code, and whether it logged
``stopped``. Target: every run exits 0 within ``--shutdown-timeout`` + 1 s (the interpreter's own
exit). Prints a Markdown section for ``bench/RESULTS.md``; exit 1 when a run missed.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import itertools
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from _report import finish, heading  # noqa: E402

MOMENTS = ("start-up", "sampling", "backoff", "in-flight")
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Receiver:
    """A remote-write receiver on 127.0.0.1 whose behaviour the run sets: answer 204, or take
    the request and hang until closed."""

    def __init__(self) -> None:
        self.hang = threading.Event()
        self.release = threading.Event()
        self.got = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.got.set()
                if outer.hang.is_set():
                    outer.release.wait(60)
                    return
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/api/v1/write"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _catches(pid: int, sig: int) -> bool:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def _wait(condition, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return False


def one_stop(moment: str, sig: int, receiver: Receiver, shutdown_timeout: float,
             workdir: Path) -> tuple[float, int, bool]:
    """Start an agent, signal it at ``moment``; (seconds to exit, exit code, logged stopped)."""
    receiver.hang.clear()
    receiver.release.clear()
    receiver.got.clear()
    url = receiver.url
    if moment == "backoff":
        url = f"http://127.0.0.1:{_closed_port()}/api/v1/write"
    if moment == "in-flight":
        receiver.hang.set()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
    env["PYTHONUNBUFFERED"] = "1"
    spool = tempfile.mkdtemp(dir=workdir)
    proc = subprocess.Popen(
        ["env", "--default-signal=HUP,INT,TERM", sys.executable, "-m", "sidecar", "run",
         "--simulate", "healthy", "--interval", "0.2", "--push-interval", "0.5",
         "--remote-write-url", url, "--spool-dir", spool, "--retry-max-backoff", "5",
         "--shutdown-timeout", str(shutdown_timeout), "--stdout", "--output", "json",
         "--log-format", "json", "--socket", os.path.join(spool, "app.sock")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    out: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=lambda s=s, k=k: k.extend(s), daemon=True)
               for s, k in ((proc.stdout, out), (proc.stderr, err))]
    for r in readers:
        r.start()
    try:
        ready = {
            "start-up": lambda: _catches(proc.pid, signal.SIGTERM),
            "sampling": lambda: bool(out),
            "backoff": lambda: any('"push_failing"' in line for line in err[:]),
            "in-flight": receiver.got.is_set,
        }[moment]
        if not _wait(lambda: ready() or proc.poll() is not None):
            raise RuntimeError(f"{moment}: the moment never came; {''.join(err)[-800:]}")
        if proc.poll() is not None:
            raise RuntimeError(f"{moment}: the agent ended early; {''.join(err)[-800:]}")
        signalled = time.monotonic()
        proc.send_signal(sig)
        try:
            code = proc.wait(timeout=shutdown_timeout + 30)
        except subprocess.TimeoutExpired:
            code = -1
        took = time.monotonic() - signalled
    finally:
        receiver.release.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for r in readers:
            r.join(timeout=5)
    return took, code, any('"stopped"' in line for line in err)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--shutdown-timeout", type=float, default=2.0)
    opts = parser.parse_args()
    bound = opts.shutdown_timeout + 1.0
    receiver = Receiver()
    results: dict[str, list[tuple[float, int, bool, str]]] = {m: [] for m in MOMENTS}
    with tempfile.TemporaryDirectory() as tmp:
        plan = itertools.islice(zip(itertools.cycle(MOMENTS), itertools.cycle(SIGNALS)), opts.runs)
        for n, (moment, sig) in enumerate(plan, 1):
            took, code, logged = one_stop(moment, sig, receiver, opts.shutdown_timeout, Path(tmp))
            results[moment].append((took, code, logged, sig.name))
            print(f"run {n}: {moment} {sig.name}: exit {code} after {took:.2f} s", file=sys.stderr)
    receiver.close()
    lines = [heading("Stop signals", f"{opts.runs} stops, --shutdown-timeout "
                     f"{opts.shutdown_timeout:g} s"), "",
             "Command: `.venv/bin/python bench/bench_stop_signals.py`. Target: every stop exits 0, "
             f"logs `stopped`, within {bound:g} s (the shutdown timeout + 1 s).", "",
             "| moment | stops | exit 0 and `stopped` | median s | max s | within target |",
             "|---|---:|---:|---:|---:|---:|"]
    ok = True
    for moment, rows in results.items():
        if not rows:
            continue
        clean = sum(1 for _, code, logged, _ in rows if code == 0 and logged)
        within = sum(1 for took, code, logged, _ in rows if code == 0 and logged and took <= bound)
        ok = ok and within == len(rows)
        times = [took for took, *_ in rows]
        lines.append(f"| {moment} | {len(rows)} | {clean} | {statistics.median(times):.2f} | "
                     f"{max(times):.2f} | {within} of {len(rows)} |")
    return finish(lines, ok, "Every stop within the target")


if __name__ == "__main__":
    raise SystemExit(main())
