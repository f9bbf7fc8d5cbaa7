"""Crash: gpu-sidecar and vmagent through the same receiver outage and the same SIGKILL.

    .venv/bin/python bench/bench_crash.py [--push-intervals 2,15] [--outage 22]   # Markdown report

One run per gpu-sidecar push interval; in each, both agents sample every 1 s and remote-write to
one real VictoriaMetrics, side by side:

- gpu-sidecar: ``run --simulate healthy --interval 1 --push-interval P`` with its spool on disk,
  pushed series labelled ``agent=gpu-sidecar``; its ``--stdout --output json`` record says what
  it sampled (every ``gpu_*`` series of the two simulated GPUs is counted, not ``gpu_sidecar_*``).
- vmagent, the anchor: scrapes a Prometheus text endpoint served by this process every 1 s
  (10 gauges whose value is the number of the scrape, so a stored sample says which scrape it
  came from), flushes every 1 s, buffers on disk (``-remoteWrite.tmpDataPath``), default
  in-memory queues, series labelled ``agent=vmagent``.

Timeline: 15 s with the receiver up; the receiver stops for ``--outage`` seconds; 55 % into the
outage both agents are SIGKILLed and restarted at once on the same spool / tmpDataPath; the
receiver comes back; 20 s more; SIGTERM to both; then VictoriaMetrics' export is read.

Per series, the stored timestamps are sorted and the missing 1 s slots between the first and the
last stored sample are counted (a gap of g s is round(g) - 1 lost samples). Part of that is the
restart itself (slots nobody sampled while the process was down, from each agent's own record);
the rest is what the crash lost. The record also gives an exact check: samples sampled inside
the stored window and never stored.
"""

from __future__ import annotations

import argparse
import http.server
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from _report import finish, heading  # noqa: E402

from tests.receivers import LOCAL, VictoriaMetrics, free_port, need  # noqa: E402

UP_S = 15.0          # receiver up before the outage
AFTER_S = 20.0       # after the receiver is back: longer than a 15 s push interval plus the drain
KILL_AT = 0.55       # SIGKILL this far into the outage
ANCHOR_SERIES = 10
ANCHOR_METRIC = "crash_anchor_value"
SIDECAR, VMAGENT = "gpu-sidecar", "vmagent"

Key = tuple[str, tuple[tuple[str, str], ...]]


class Target:
    """The Prometheus text endpoint vmagent scrapes. Each scrape is numbered; that number is the
    value of every gauge in it, and (wall time, number) is kept as vmagent's sampling record."""

    def __init__(self) -> None:
        self.scrapes: list[tuple[float, int]] = []
        self.lock = threading.Lock()
        target = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with target.lock:
                    n = len(target.scrapes) + 1
                    target.scrapes.append((time.time(), n))
                body = "".join(f'{ANCHOR_METRIC}{{series="{i}"}} {n}\n'
                               for i in range(ANCHOR_SERIES)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((LOCAL, 0), Handler)
        self.address = f"{LOCAL}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Child:
    """An agent process; each life (start) writes its own stdout and stderr files."""

    name: str
    command: list[str]
    tmp: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None
    lives: list[Path] = field(default_factory=list)
    killed_ms: int = 0

    def start(self) -> None:
        out = self.tmp / f"{self.name}-{len(self.lives) + 1}.out"
        self.lives.append(out)
        self.proc = subprocess.Popen(self.command, stdout=out.open("wb"),
                                     stderr=out.with_suffix(".err").open("wb"), cwd=ROOT,
                                     env=self.env, start_new_session=True)

    def kill(self, wait: bool = True) -> None:
        assert self.proc is not None
        self.killed_ms = int(time.time() * 1000)
        os.killpg(self.proc.pid, signal.SIGKILL)  # the whole process (its own group)
        if wait:
            self.proc.wait()

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode


def sidecar_child(tmp: Path, vm: VictoriaMetrics, push_interval: float) -> Child:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
    return Child(SIDECAR, [
        sys.executable, "-m", "sidecar", "run", "--simulate", "healthy", "--interval", "1",
        "--push-interval", f"{push_interval:g}", "--remote-write-url", vm.write_url,
        "--spool-dir", str(tmp / "spool"), "--extra-label", f"agent={SIDECAR}",
        "--log-format", "json", "--stdout", "--output", "json"],
        tmp, env={**env, "PYTHONUNBUFFERED": "1"})


def vmagent_child(tmp: Path, vm: VictoriaMetrics, target: Target) -> Child:
    config = tmp / "scrape.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n"
                      f"  - job_name: crash-anchor\n    static_configs:\n"
                      f"      - targets: ['{target.address}']\n")
    child = Child(VMAGENT, [
        need("vmagent"), f"-httpListenAddr={LOCAL}:{free_port()}", f"-promscrape.config={config}",
        f"-remoteWrite.url={vm.write_url}", f"-remoteWrite.tmpDataPath={tmp / 'vmagent-data'}",
        "-remoteWrite.flushInterval=1s", f"-remoteWrite.label=agent={VMAGENT}"], tmp)
    return child


def wait_for(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("an agent did not take its first sample in 30 s")
        time.sleep(0.05)


def sampled_sidecar(paths: list[Path]) -> list[dict[Key, list[int]]]:
    """Per life of gpu-sidecar: the timestamps it sampled, per GPU series."""
    lives = []
    for path in paths:
        life: dict[Key, list[int]] = {}
        for line in path.read_text().splitlines():
            if not line.startswith("{"):
                continue
            try:
                r = json.loads(line)
            except ValueError:
                continue  # the line the SIGKILL cut
            if counted(r["name"]):
                labels = tuple(sorted((k, v) for k, v in r["labels"].items() if k != "agent"))
                life.setdefault((r["name"], labels), []).append(r["timestamp_ms"])
        lives.append(life)
    return lives


def counted(name: str) -> bool:
    return name.startswith("gpu_") and not name.startswith("gpu_sidecar_")


def stored(vm: VictoriaMetrics, agent: str) -> dict[Key, list[tuple[int, float]]]:
    """Per series of one agent: every stored (timestamp ms, value), stale markers left out."""
    out: dict[Key, list[tuple[int, float]]] = {}
    for row in vm.export(f'{{agent="{agent}"}}'):
        labels = {k: v for k, v in row["metric"].items() if k != "agent"}
        name = labels.pop("__name__")
        if name != ANCHOR_METRIC and not counted(name):
            continue
        points = [(ts, float(v)) for ts, v in zip(row["timestamps"], row["values"], strict=True)
                  if v is not None and math.isfinite(float(v))]
        out.setdefault((name, tuple(sorted(labels.items()))), []).extend(points)
    return out


def settle(vm: VictoriaMetrics, timeout: float = 20.0) -> None:
    """Wait until the stored sample count stops moving (VictoriaMetrics makes rows searchable up
    to a second after it acknowledged them)."""
    deadline, last, stable = time.monotonic() + timeout, -1, 0
    while time.monotonic() < deadline and stable < 3:
        n = sum(len(r["timestamps"]) for r in vm.export('{agent=~".+"}'))
        stable = stable + 1 if n == last else 0
        last = n
        time.sleep(0.5)


def exact_duplicates_kept(vm: VictoriaMetrics) -> bool:
    """Whether VictoriaMetrics' export shows a sample written twice (same series, timestamp and
    value) twice: if not, duplicates a re-send would make are invisible here."""
    line = json.dumps({"metric": {"__name__": "crash_duplicate_probe"}, "values": [1.0],
                       "timestamps": [int(time.time() * 1000)]})
    for _ in range(2):
        requests.post(f"{vm.base}/api/v1/import", data=line, timeout=10).raise_for_status()
    deadline, n = time.monotonic() + 10, 0
    while time.monotonic() < deadline:
        n = sum(len(r["timestamps"]) for r in vm.export('{__name__="crash_duplicate_probe"}'))
        if n >= 2:
            break
        time.sleep(0.5)
    return n >= 2


def gap_loss(timestamps: list[int]) -> int:
    """Missing 1 s slots between consecutive stored samples."""
    return sum(max(0, round((b - a) / 1000) - 1) for a, b in itertools.pairwise(timestamps))


@dataclass
class SeriesLoss:
    stored: int           # distinct timestamps stored
    gaps: int             # missing 1 s slots between the first and last stored sample
    not_sampled: int      # slots the restart left unsampled (inside the stored window)
    down_s: float         # SIGKILL to the restarted process's first sample of this series
    never_stored: int     # sampled inside the stored window, never stored (the record check)
    tail: int             # sampled after the last stored sample (left unsent at exit)
    foreign: int          # stored but never sampled (should be 0)
    duplicates: int       # timestamps stored more than once
    lost_at: list[float]  # when the never-stored samples were sampled, s from the SIGKILL

    @property
    def crash(self) -> int:
        return self.gaps - self.not_sampled


def restart_slots(before: list[int], after: list[int], window: tuple[int, int]) -> int:
    if not before or not after or not (window[0] <= max(before) and min(after) <= window[1]):
        return 0
    return max(0, round((min(after) - max(before)) / 1000) - 1)


def sidecar_losses(vm: VictoriaMetrics, lives: list[Path], kill_ms: int) -> list[SeriesLoss]:
    sampled = sampled_sidecar(lives)
    out = []
    for key, points in stored(vm, SIDECAR).items():
        ts = sorted(t for t, _ in points)
        unique = sorted(set(ts))
        have = set(unique)
        before, after = sampled[0].get(key, []), sampled[1].get(key, [])
        window = (unique[0], unique[-1])
        record = set(before) | set(after)
        lost = [t for t in record if window[0] <= t <= window[1] and t not in have]
        out.append(SeriesLoss(
            stored=len(unique), gaps=gap_loss(unique),
            not_sampled=restart_slots(before, after, window),
            down_s=(min(after) - kill_ms) / 1000 if after else math.nan,
            never_stored=len(lost), tail=sum(1 for t in record if t > window[1]),
            foreign=len(have - record), duplicates=len(ts) - len(unique),
            lost_at=[(t - kill_ms) / 1000 for t in lost]))
    return out


def vmagent_losses(vm: VictoriaMetrics, scrapes: list[tuple[float, int]], kill_ms: int
                   ) -> list[SeriesLoss]:
    before = [round(t * 1000) for t, _ in scrapes if t * 1000 < kill_ms]
    after = [round(t * 1000) for t, _ in scrapes if t * 1000 >= kill_ms]
    served = {n: t for t, n in scrapes}
    out = []
    for points in stored(vm, VMAGENT).values():
        ts = sorted(t for t, _ in points)
        unique = sorted(set(ts))
        values = {round(v) for _, v in points}
        low, high = min(values), max(values)
        lost = [n for n in served if low <= n <= high and n not in values]
        out.append(SeriesLoss(
            stored=len(unique), gaps=gap_loss(unique),
            not_sampled=restart_slots(before, after, (unique[0], unique[-1])),
            down_s=(min(after) - kill_ms) / 1000 if after else math.nan,
            never_stored=len(lost), tail=sum(1 for n in served if n > high),
            foreign=len(values - served.keys()), duplicates=len(ts) - len(unique),
            lost_at=[served[n] - kill_ms / 1000 for n in lost]))
    return out


def crash_run(push_interval: float, outage: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="gpu-sidecar-crash-") as d:
        tmp = Path(d)
        vm = VictoriaMetrics(tmp).start()
        target = Target()
        sidecar = sidecar_child(tmp, vm, push_interval)
        vmagent = vmagent_child(tmp, vm, target)
        events: list[tuple[float, str]] = []
        try:
            sidecar.start()
            vmagent.start()
            wait_for(lambda: target.scrapes and sidecar.lives[0].stat().st_size > 0)
            t0 = time.monotonic()

            def at(seconds: float, what: str) -> None:
                time.sleep(max(0.0, seconds - (time.monotonic() - t0)))
                events.append((time.monotonic() - t0, what))

            at(UP_S, "receiver down")
            vm.stop()
            at(UP_S + KILL_AT * outage, "SIGKILL both, restarted")
            for child in (sidecar, vmagent):
                child.kill(wait=False)
            for child in (sidecar, vmagent):
                child.proc.wait()  # type: ignore[union-attr]
            sidecar.start()
            vmagent.start()
            at(UP_S + outage, "receiver up")
            vm.start()
            at(UP_S + outage + AFTER_S, "SIGTERM both")
            rcs = {SIDECAR: sidecar.stop(), VMAGENT: vmagent.stop()}
            settle(vm)
            losses = {SIDECAR: sidecar_losses(vm, sidecar.lives, sidecar.killed_ms),
                      VMAGENT: vmagent_losses(vm, list(target.scrapes), vmagent.killed_ms)}
            duplicates_kept = exact_duplicates_kept(vm)
        finally:
            for child in (sidecar, vmagent):
                child.stop()
            target.stop()
            vm.stop()
    return {"push_interval": push_interval, "events": events, "rcs": rcs, "losses": losses,
            "duplicates_kept": duplicates_kept}


def spread(values: list[int]) -> str:
    return f"{statistics.median(values):g} / {max(values)} ({sum(values)})" if values else "-"


def row(run: dict, agent: str) -> str:
    series: list[SeriesLoss] = run["losses"][agent]
    if not series:
        return f"| push {run['push_interval']:g} s | {agent} | 0 | nothing stored |||||||"
    down = [s.down_s for s in series if not math.isnan(s.down_s)]
    label = agent if agent == SIDECAR else f"{agent} (flush 1 s)"
    return (f"| push {run['push_interval']:g} s | {label} | {len(series)} | "
            f"{statistics.median(s.stored for s in series):g} | {spread([s.gaps for s in series])} | "
            f"{statistics.median(down):.1f} s / {statistics.median(s.not_sampled for s in series):g} | "
            f"**{spread([s.crash for s in series])}** | {sum(s.never_stored for s in series)} | "
            f"{sum(s.tail for s in series)} | {sum(s.duplicates for s in series)} |")


def lost_span(series: list[SeriesLoss]) -> str:
    at = [t for s in series for t in s.lost_at]
    return f"{min(at):+.1f} s to {max(at):+.1f} s" if at else "none"


def versions() -> str:
    """Debian's victoria-metrics package (both binaries) version, where dpkg knows it."""
    try:
        found = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "victoria-metrics"],
                               capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return f", VictoriaMetrics and vmagent {found.split('+')[0]}" if found else ""


def report(runs: list[dict], outage: float) -> list[str]:
    lines = [
        heading("Crash", f"1 s sampling, receiver outage {outage:g} s, SIGKILL "
                         f"{KILL_AT * outage:.0f} s into it{versions()}"),
        "",
        "| run | agent | series | stored per series (median) | lost per series, gaps in the "
        "stored timestamps: median / max (total) | restart: first sample after SIGKILL / 1 s slots "
        "not sampled (median) | **lost to the crash** (gaps less slots not sampled): median / max "
        "(total) | check: sampled, never stored | left unsent at exit | duplicates |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [row(run, agent) for run in runs for agent in (SIDECAR, VMAGENT)]
    lines.append("")
    for run in runs:
        events = ", ".join(f"{t:.0f} s {what}" for t, what in run["events"])
        lost = "; ".join(f"{agent} {lost_span(run['losses'][agent])}" for agent in (SIDECAR, VMAGENT))
        lines.append(f"- push {run['push_interval']:g} s: {events}; exit codes after SIGTERM: "
                     f"gpu-sidecar {run['rcs'][SIDECAR]}, vmagent {run['rcs'][VMAGENT]}; samples "
                     f"never stored were sampled, relative to the SIGKILL: {lost}")
    kept = {run["duplicates_kept"] for run in runs}
    lines.append("- duplicates: a sample written twice (same series, timestamp, value) shows "
                 + ("twice in VictoriaMetrics' export, so the column counts re-sent samples"
                    if kept == {True} else
                    "once in VictoriaMetrics' export: re-sent samples cannot be counted here, "
                    "the column stays 0 whatever was re-sent" if kept == {False} else
                    "sometimes once, sometimes twice in VictoriaMetrics' export"))
    foreign = sum(s.foreign for run in runs for agent in run["losses"] for s in run["losses"][agent])
    lines.append(f"- stored but never sampled (should be 0): {foreign}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--push-intervals", default="2,15",
                        help="gpu-sidecar push intervals in seconds, one run each (default 2,15)")
    parser.add_argument("--outage", type=float, default=22.0,
                        help="seconds the receiver is down (default 22)")
    args = parser.parse_args()
    runs = [crash_run(float(p), args.outage) for p in args.push_intervals.split(",") if p.strip()]
    lines = report(runs, args.outage)
    ok = all(max((s.crash for s in run["losses"][SIDECAR]), default=math.inf) <= 1
             and run["rcs"][SIDECAR] == 0 for run in runs)
    return finish(lines, ok, "Target met (gpu-sidecar loses at most 1 sample per series to the "
                             "crash, beyond its restart downtime, at every push interval)")


if __name__ == "__main__":
    raise SystemExit(main())
