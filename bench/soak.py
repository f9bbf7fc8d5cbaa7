"""Soak: a long run against a real VictoriaMetrics that goes away and comes back, with one SIGKILL.

    .venv/bin/python bench/soak.py --minutes 10      # prints a Markdown report

Two simulated GPUs (the healthy scenario with its simulated app), 1 s sampling, remote-write
every 5 s. VictoriaMetrics is stopped and restarted several times; the agent is killed with
SIGKILL once and restarted on the same spool. At the end every sample the agents printed (their
``--stdout`` record) is looked up in VictoriaMetrics: the only ones allowed missing are those of
the push interval open at the SIGKILL. Resident memory and open file descriptors of the agent
are read from /proc every 10 s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from _report import finish, heading  # noqa: E402

from tests.receivers import VictoriaMetrics  # noqa: E402

PUSH_INTERVAL = 5.0



def start_agent(vm: VictoriaMetrics, spool: Path, out: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
    return subprocess.Popen(
        [sys.executable, "-m", "sidecar", "run", "--simulate", "healthy", "--interval", "1",
         "--push-interval", str(PUSH_INTERVAL), "--remote-write-url", vm.write_url,
         "--spool-dir", str(spool), "--stdout", "--output", "json", "--log-format", "json",
         "--retry-max-backoff", "2"],
        stdout=out.open("w"), stderr=out.with_suffix(".log").open("w"), cwd=ROOT,
        env={**env, "PYTHONUNBUFFERED": "1"})


def proc_stats(pid: int) -> tuple[float, int]:
    rss = 0.0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def sampled(path: Path) -> dict[tuple, float]:
    out = {}
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out[(r["name"], tuple(sorted(r["labels"].items())), r["timestamp_ms"])] = r["value"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=10.0)
    args = parser.parse_args()
    total = args.minutes * 60
    tmp = Path(tempfile.mkdtemp(prefix="gpu-sidecar-soak-"))
    vm = VictoriaMetrics(tmp).start()
    spool = tmp / "spool"
    outs = [tmp / "agent-1.jsonl", tmp / "agent-2.jsonl"]
    agent = start_agent(vm, spool, outs[0])
    t0 = time.monotonic()
    # (start, length) of receiver outages, and the SIGKILL time, as fractions of the run
    outages = [(0.15, 0.05), (0.40, 0.08), (0.70, 0.04), (0.85, 0.03)]
    kill_at = 0.55
    stats: list[tuple[float, float, int, int]] = []  # t, rss MiB, fds, agent
    events: list[str] = []
    killed_last_ts = 0
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(10):
            try:
                rss, fds = proc_stats(agent.pid)
                stats.append((time.monotonic() - t0, rss, fds, 1 if outs_index[0] == 0 else 2))
            except (FileNotFoundError, ProcessLookupError):
                pass

    outs_index = [0]
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    schedule = sorted([(s * total, "down") for s, _ in outages] +
                      [((s + d) * total, "up") for s, d in outages] + [(kill_at * total, "kill")])
    for at, what in schedule:
        time.sleep(max(0.0, at - (time.monotonic() - t0)))
        if what == "down":
            vm.stop()
        elif what == "up":
            vm.start()
        else:
            agent.send_signal(signal.SIGKILL)
            agent.wait()
            killed_last_ts = max(k[2] for k in sampled(outs[0]))
            outs_index[0] = 1
            agent = start_agent(vm, spool, outs[1])
        events.append(f"{time.monotonic() - t0:.0f}s {what}")
    time.sleep(max(0.0, total - (time.monotonic() - t0)))
    agent.send_signal(signal.SIGTERM)
    rc = agent.wait(timeout=60)
    stop.set()
    produced = {**sampled(outs[0]), **sampled(outs[1])}
    expect = len(produced)
    stored: dict[tuple, float] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rows = vm.samples()
        stored = {}
        duplicates = 0
        for name, labels, ts, value in rows:
            key = (name, labels, ts)
            duplicates += key in stored
            stored[key] = value
        if len(stored) >= expect - 2000:
            break
        time.sleep(1)
    vm.stop()
    missing = set(produced) - set(stored)
    extra = set(stored) - set(produced)
    around_kill = all(killed_last_ts - k[2] <= (PUSH_INTERVAL + 1) * 1000 for k in missing)
    first = [s for s in stats if s[3] == 1]
    second = [s for s in stats if s[3] == 2]

    def span(rows: list, i: int) -> str:
        return f"{min(r[i] for r in rows):.1f}..{max(r[i] for r in rows):.1f}" if rows else "-"

    ok = rc == 0 and around_kill and not extra and duplicates == 0
    lines = [
        heading("Soak", f"{args.minutes:g} min, 1 s sampling, 2 simulated GPUs, push every "
                        f"{PUSH_INTERVAL:g} s"),
        "",
        f"- events: {', '.join(events)}",
        f"- samples produced {len(produced)}, stored {len(stored)}, missing {len(missing)} "
        f"(all within the push interval open at the SIGKILL: {'yes' if around_kill else 'NO'}), "
        f"stored but never produced {len(extra)}, duplicates {duplicates}",
        f"- resident memory, first agent {span(first, 1)} MiB, second {span(second, 1)} MiB; "
        f"open file descriptors {span(first, 2)} / {span(second, 2)}",
        f"- exit code after SIGTERM: {rc}",
    ]
    return finish(lines, ok, "All promises kept")


if __name__ == "__main__":
    raise SystemExit(main())
