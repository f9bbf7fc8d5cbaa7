"""The agent's memory once its diagnose window is full (issue #37: RSS at most 48 MiB, the
window included): bench_deployed's run A (8 simulated GPUs, 1 s, remote-write to a real
VictoriaMetrics, the simulated model server publishing from its own process) kept running for
longer than the window's 15 minutes; the agent's VmRSS and VmHWM from /proc every minute.

    .venv/bin/python bench/bench_rss_window.py [MINUTES, default 17]

bench_deployed measures 70 s of a run, when the window holds a tenth of what it will.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_deployed as b  # its ROOT goes on sys.path: tests.receivers comes from there

from tests.receivers import VictoriaMetrics

minutes = float(sys.argv[1]) if len(sys.argv) > 1 else 17.0
tmp = Path(tempfile.mkdtemp(prefix="rss-long-"))
vm = VictoriaMetrics(tmp)
vm.start()
sock = tmp / "app.sock"
agent = b.spawn([sys.executable, "-m", "sidecar", "run", "--simulate", "healthy",
                 "--simulate-gpus", "8", "--no-simulated-app", "--gpus", "announced",
                 "--socket", str(sock), "--interval", "1", "--remote-write-url", vm.write_url,
                 "--spool-dir", str(tmp / "spool"), "--log-format", "json"], tmp / "agent.log")
while not sock.exists():
    time.sleep(0.1)
app = b.spawn(b.this_file("--role", "app", "--socket", str(sock), "--interval", "1"), tmp / "app.log")


def status(pid: int) -> dict[str, float]:
    d = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                d[k] = int(v.split()[0]) / 1024
    return d


t0 = time.monotonic()
try:
    while time.monotonic() - t0 < minutes * 60:
        time.sleep(60)
        s = status(agent.pid)
        print(f"{(time.monotonic() - t0) / 60:.1f} min: VmRSS {s['VmRSS']:.1f} MiB, "
              f"VmHWM {s['VmHWM']:.1f} MiB", flush=True)
finally:
    b.stop(app)
    b.stop(agent)
    vm.stop()
