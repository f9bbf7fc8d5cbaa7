"""Flood: an app sending to the socket as fast as it can for 30 s.

    .venv/bin/python bench/bench_flood.py            # prints a Markdown report

The agent (2 simulated GPUs, 0.25 s sampling, no simulated app) runs as a subprocess; a
non-blocking sender floods its socket with valid allocator messages from many "processes" and a
share of malformed ones. Reported: what the sender managed and whether it ever waited, the
agent's resident memory before and after, and the gaps between its cycles.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from _report import finish, heading  # noqa: E402

from sidecar import protocol  # noqa: E402
from sidecar.simulate.scenarios import simulated_uuid  # noqa: E402

SECONDS = 30.0
INTERVAL = 0.25



def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="gpu-sidecar-flood-"))
    sock = tmp / "run" / "app.sock"
    out = tmp / "out.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
    agent = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "run", "--simulate", "healthy", "--no-simulated-app",
         "--interval", str(INTERVAL), "--socket", str(sock), "--output", "json",
         "--log-format", "json"],
        stdout=out.open("w"), stderr=subprocess.DEVNULL, cwd=ROOT, env=env)
    while not sock.exists():
        time.sleep(0.05)
    time.sleep(1.0)
    before = rss_mib(agent.pid)
    gpus = [simulated_uuid("healthy", i) for i in range(2)]
    rng = random.Random(7)
    messages = [protocol.encode(protocol.Allocator(pid, gpu, 10 << 30, 4 << 30, 4 << 30, 1 << 30,
                                                   pid % 5, 0))
                for pid in range(1, 201) for gpu in gpus]
    messages += [b"{not json", b'{"v":9}', b"x" * 9000]
    flooder = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    flooder.setblocking(False)
    flooder.connect(str(sock))
    sent = refused = 0
    worst = 0.0
    slow = 0  # sends that took over 1 ms
    peak = before
    end = time.monotonic() + SECONDS
    next_rss = time.monotonic() + 1
    while time.monotonic() < end:
        data = rng.choice(messages)
        t = time.perf_counter()
        try:
            flooder.send(data)
            sent += 1
        except BlockingIOError:
            refused += 1
        except OSError:
            refused += 1
        spent = time.perf_counter() - t
        if spent > worst:
            worst = spent
        if spent > 0.001:
            slow += 1
        if time.monotonic() > next_rss:
            peak = max(peak, rss_mib(agent.pid))
            next_rss += 1
    flooder.close()
    time.sleep(1.0)
    after = rss_mib(agent.pid)
    agent.terminate()
    agent.wait(timeout=30)
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
    stamps = sorted({r["timestamp_ms"] for r in rows})
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    accepted = max((r["value"] for r in rows
                    if r["name"] == "gpu_sidecar_app_messages_accepted_total"), default=0)
    rejected = sum(v for v in {(r["labels"].get("reason")): r["value"] for r in rows
                               if r["name"] == "gpu_sidecar_app_messages_rejected_total"}.values())
    calls = sent + refused
    # a non-blocking send cannot wait; the rare slow call is the sender being preempted on a
    # saturated machine (2 cores, the agent busy on the other)
    ok = slow / calls < 1e-4 and peak - before < 16 and max(gaps) < 2 * INTERVAL * 1000
    lines = [
        heading("Flood", f"{SECONDS:g} s"),
        "",
        f"- sender: {sent} datagrams sent, {refused} refused by the kernel (receive queue full: "
        f"dropped on the app side, as designed); calls over 1 ms: {slow} of {calls} "
        f"({slow / calls:.1e}), the slowest {worst * 1e3:.1f} ms (preemption: the socket is "
        f"non-blocking)",
        f"- agent: {accepted:.0f} accepted, {rejected:.0f} rejected by reason; resident memory "
        f"{before:.1f} MiB before, peak {peak:.1f} MiB, {after:.1f} MiB after",
        f"- schedule: {len(stamps)} cycles at {INTERVAL:g} s; largest gap between cycles "
        f"{max(gaps):.0f} ms",
    ]
    return finish(lines, ok, "All targets met (under 1e-4 of sends over 1 ms, memory growth "
                             "< 16 MiB, no skipped slot)")


if __name__ == "__main__":
    raise SystemExit(main())
