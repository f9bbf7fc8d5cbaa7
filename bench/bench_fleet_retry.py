"""Fleet retries after an outage: many real agents, one receiver that goes away and comes back.

    .venv/bin/python bench/bench_fleet_retry.py [--agents 40] [--warmup 30] [--outage 60] \
        [--recovery 90] [--mode 503|refuse] [--retry-max-backoff 30] [--results bench/RESULTS.md]

Issue #23: "Backoff has a floor and full jitter ... a fleet's retries after an outage spread over
the backoff window". N agents (``python -m sidecar run --simulate healthy --interval 1
--push-interval 1 --retry-max-backoff B --log-format json``, each with its own spool in a
temporary directory, stdout to /dev/null, stderr kept) remote-write to ONE receiver that this
script runs on 127.0.0.1: a threaded ``http.server`` that records the arrival time, the agent
(each agent has its own URL path), the size of every POST and its answer, 204 when up.

Timeline, from the moment every agent has had one push accepted: ``--warmup`` s up, ``--outage``
s down, ``--recovery`` s up again; then SIGTERM to every agent (SIGKILL after a bound).

Outage modes:

- ``503`` (default): the receiver answers every POST at once with 503, an outage the receiver
  signals; every attempt is seen, so the retry schedule of each agent is measured.
- ``refuse``: the listening socket is closed and every open connection shut, so the port refuses
  connections; attempts during the outage are not seen by the receiver (only the recovery is).

Reported: the steady request rate (warm-up), the attempt rate during the outage (peak 1 s bin,
median), each agent's k-th attempt after the outage began (spread across agents, the largest
share of agents inside one 1 s window), the recovery (peak 1 s request and byte rates, when each
agent's first request was accepted again and when its backlog was drained), and log lines per
agent. Beside the measured figures, a schedule WITHOUT jitter is computed (not run) from the
same measured first failures: tenacity's ``wait_exponential`` with the same floor and cap, i.e.
what the agents would do if only the jitter were removed; and the fully synchronized fleet (all
N in the same second).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import http.server
import itertools
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv" / "bin" / "python"
TITLE = "Fleet retries after an outage (bench_fleet_retry.py)"
INITIAL_BACKOFF_S = 0.5   # sidecar.sinks.answers.INITIAL_BACKOFF_S: the floor
IDLE_GAP_S = 0.3          # an agent whose next request comes this much later has a drained spool
TERM_BOUND_S = 20.0       # SIGTERM, then SIGKILL after this long
SETTLE_S = 5              # the fleet's rate is back to steady when its 5 s averages are


@dataclass
class Post:
    t: float        # time.monotonic() when the request's headers had arrived
    agent: int
    status: int
    nbytes: int


@dataclass
class Receiver:
    """One remote-write receiver for the whole fleet: records every POST, answers 204, or 503
    while ``down``; ``refuse()`` closes the port, ``reopen()`` binds it again."""

    posts: list[Post] = field(default_factory=list)
    down: bool = False
    port: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _conns: set[socket.socket] = field(default_factory=set)
    _server: http.server.ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    def start(self) -> None:
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a real receiver

            def setup(self) -> None:
                super().setup()
                with receiver._lock:
                    receiver._conns.add(self.connection)

            def finish(self) -> None:
                with receiver._lock:
                    receiver._conns.discard(self.connection)
                with contextlib.suppress(OSError):
                    super().finish()

            def do_POST(self) -> None:
                t = time.monotonic()
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                try:
                    agent = int(self.path.strip("/").split("/")[0].removeprefix("agent-"))
                except ValueError:
                    agent = -1
                status = 503 if receiver.down else 204
                with receiver._lock:
                    receiver.posts.append(Post(t, agent, status, len(body)))
                if status == 204:
                    self.send_response(204)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                else:
                    answer = b"outage (bench_fleet_retry)\n"
                    self.send_response(503)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self._handler = Handler
        self._serve()

    def _serve(self) -> None:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), self._handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="receiver", daemon=True)
        self._thread.start()

    def refuse(self) -> None:
        """The port refuses connections: no listener, every kept-alive connection shut."""
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._server = None

    def reopen(self) -> None:
        self._serve()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def snapshot(self) -> list[Post]:
        with self._lock:
            return list(self.posts)


# -- the fleet -------------------------------------------------------------------------------

@dataclass
class Agent:
    index: int
    proc: subprocess.Popen[bytes]
    stderr_path: Path
    exit_code: int | None = None
    killed: bool = False


def start_agents(n: int, port: int, tmp: Path, max_backoff: float) -> list[Agent]:
    agents = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
    for i in range(n):
        url = f"http://127.0.0.1:{port}/agent-{i}/api/v1/write"
        stderr_path = tmp / f"agent-{i}.stderr"
        cmd = [str(PYTHON), "-m", "sidecar", "run", "--simulate", "healthy", "--interval", "1",
               "--push-interval", "1", "--remote-write-url", url,
               "--spool-dir", str(tmp / f"spool-{i}"),
               "--retry-max-backoff", f"{max_backoff:g}", "--log-format", "json"]
        with open(stderr_path, "wb") as err:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=err)
        agents.append(Agent(i, proc, stderr_path))
    return agents


def agent_cpu(agent: Agent) -> float:
    """CPU seconds (user + system, all threads) of one agent process so far, from /proc."""
    try:
        with open(f"/proc/{agent.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop_agents(agents: list[Agent], bound_s: float = TERM_BOUND_S) -> None:
    for a in agents:
        if a.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                a.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + bound_s
    for a in agents:
        try:
            a.exit_code = a.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            a.killed = True
            with contextlib.suppress(ProcessLookupError):
                a.proc.kill()
            a.exit_code = a.proc.wait()


# -- figures ---------------------------------------------------------------------------------

def bins(times: list[float], start: float, end: float) -> list[int]:
    """Requests per 1 s bin over [start, end)."""
    n = max(0, round(end - start))
    counts = [0] * n
    for t in times:
        i = int(t - start)
        if 0 <= i < n and t >= start:
            counts[i] += 1
    return counts


def densest(times: list[float], width: float = 1.0) -> int:
    """The most of ``times`` inside any window of ``width`` seconds (sliding, not aligned)."""
    ts = sorted(times)
    best = 0
    for i, t in enumerate(ts):
        best = max(best, bisect.bisect_left(ts, t + width) - i)
    return best


def fixed_wait(attempt: int, floor: float, cap: float) -> float:
    """tenacity's ``wait_exponential(multiplier=floor, min=floor, max=cap)``: the agent's wait
    after the ``attempt``-th try with the jitter taken out (the top of its random window)."""
    return max(floor, min(cap, floor * 2 ** (attempt - 1)))


def jitter_window(attempt: int, floor: float, cap: float) -> tuple[float, float]:
    """The agent's wait after attempt k: the floor plus a uniform draw in
    [0, min(cap - floor, floor * 2^(k-1))] (sidecar/sinks/answers.py, ``_Backoff``)."""
    return floor, floor + min(cap - floor, floor * 2 ** (attempt - 1))


def fmt(x: float, digits: int = 1) -> str:
    return f"{x:.{digits}f}"


@dataclass
class Timeline:
    t0: float      # warm-up starts
    down: float    # outage starts
    up: float      # receiver back
    end: float     # recovery window ends


def log_summary(agents: list[Agent]) -> tuple[list[int], Counter[str], Counter[str], int]:
    """Lines per agent, events (all agents), levels, lines that are not JSON."""
    lines, events, levels, other = [], Counter(), Counter(), 0
    for a in agents:
        text = a.stderr_path.read_text(errors="replace").splitlines()
        lines.append(len(text))
        for line in text:
            try:
                rec = json.loads(line)
            except ValueError:
                other += 1
                continue
            events[str(rec.get("event"))] += 1
            levels[str(rec.get("level"))] += 1
    return lines, events, levels, other


def analyse(posts: list[Post], tl: Timeline, n: int, args: argparse.Namespace,
            agents: list[Agent]) -> tuple[list[str], bool]:
    floor, cap = INITIAL_BACKOFF_S, args.retry_max_backoff
    warm = [p for p in posts if tl.t0 <= p.t < tl.down]
    out = [p for p in posts if tl.down <= p.t < tl.up]
    rec = [p for p in posts if tl.up <= p.t < tl.end]
    steady_rate = len(warm) / (tl.down - tl.t0)
    steady_bytes = sum(p.nbytes for p in warm) / (tl.down - tl.t0)
    warm_bins = bins([p.t for p in warm], tl.t0, tl.down)
    gaps = []  # between one agent's pushes during the warm-up
    for i in range(n):
        ts = [p.t for p in warm if p.agent == i]
        gaps += [b - a for a, b in itertools.pairwise(ts)]
    long_gaps = sum(g > 1.5 for g in gaps)

    # -- the outage: every attempt (503 mode) -------------------------------------------------
    out_bins = bins([p.t for p in out], tl.down, tl.up)
    per_agent: dict[int, list[float]] = {i: [] for i in range(n)}
    for p in out:
        if p.agent in per_agent:
            per_agent[p.agent].append(p.t - tl.down)
    attempts = [len(v) for v in per_agent.values()]
    ok_in_outage = sum(1 for p in out if p.status != 503)

    # -- recovery: first accepted request, drained spool ---------------------------------------
    by_agent: dict[int, list[Post]] = {i: [] for i in range(n)}
    for p in posts:
        if p.agent in by_agent and p.t >= tl.up:
            by_agent[p.agent].append(p)
    back, drained, backlog_requests, backlog_bytes = [], [], [], []
    for i in range(n):
        seq = [p for p in by_agent[i] if p.status == 204]
        if not seq:
            continue
        back.append(seq[0].t - tl.up)
        j = 0
        while j + 1 < len(seq) and seq[j + 1].t - seq[j].t < IDLE_GAP_S:
            j += 1
        drained.append(seq[j].t - tl.up)
        backlog_requests.append(j + 1)
        backlog_bytes.append(sum(p.nbytes for p in seq[:j + 1]))
    rec_bins = bins([p.t for p in rec], tl.up, tl.end)
    rec_byte_bins = [0] * len(rec_bins)
    for p in rec:
        i = int(p.t - tl.up)
        if 0 <= i < len(rec_byte_bins):
            rec_byte_bins[i] += p.nbytes
    # when the fleet's request rate is back to steady: the first second from which on every
    # 5 s average of the rest of the window lies within 25 % of the steady rate
    avg = [sum(rec_bins[s:s + SETTLE_S]) / SETTLE_S
           for s in range(len(rec_bins) - SETTLE_S + 1)]
    settle = next((s for s in range(len(avg))
                   if all(abs(a - steady_rate) <= 0.25 * steady_rate for a in avg[s:])), None)

    # -- without jitter, from the same first failures (computed) --------------------------------
    first = {i: v[0] for i, v in per_agent.items() if v}
    model_out: list[float] = []
    model_back: list[float] = []
    model_kth: dict[int, list[float]] = {}
    model_attempts: list[int] = []
    for f in first.values():
        t, k = f, 1
        while t < tl.up - tl.down:
            model_out.append(t)
            model_kth.setdefault(k, []).append(t)
            t += fixed_wait(k, floor, cap)
            k += 1
        model_attempts.append(k - 1)
        model_back.append(t - (tl.up - tl.down))
    model_out_bins = bins([t + tl.down for t in model_out], tl.down, tl.up)

    # -- report ------------------------------------------------------------------------------
    lines_per_agent, events, levels, other = log_summary(agents)
    mode = "503 at once" if args.mode == "503" else "port refuses connections"
    lines = [
        f"## {TITLE}",
        "",
        f"{time.strftime('%Y-%m-%d')}, commit {args.commit}, {os.cpu_count()} CPUs (nproc), "
        f"Python {sys.version.split()[0]}, **{n} agents**, timeline {args.warmup:g} s up + "
        f"{args.outage:g} s outage ({mode}) + {args.recovery:g} s recovery, "
        f"`--retry-max-backoff {cap:g}`, backoff floor {floor:g} s; load average at the start of "
        f"the warm-up {args.load_start}, at the end {args.load_end}; the agents used "
        f"{args.agent_cpu_s:.0f} CPU s in {args.wall_s:.0f} s "
        f"({args.agent_cpu_s / args.wall_s:.2f} cores)."
        + (f" **{args.label}**" if args.label else ""),
        "",
        f"    {args.command}",
        "",
        f"Each agent: `python -m sidecar run --simulate healthy --interval 1 --push-interval 1 "
        f"--remote-write-url http://127.0.0.1:PORT/agent-i/api/v1/write --spool-dir "
        f"TMP/spool-i --retry-max-backoff {cap:g} --log-format json`, all pushing to one "
        "threaded `http.server` receiver of the bench (204 when up; keep-alive). Times are "
        "arrival times at the receiver; the outage starts at 0 s. Agents started "
        f"{args.ready_s:.1f} s before every one of them had a push accepted (then the warm-up "
        "began).",
        "",
        "| figure | measured (full jitter) | without jitter (computed) | synchronized fleet |",
        "|---|---|---|---|",
        f"| steady request rate (warm-up) | {fmt(steady_rate)} req/s (1 s bins "
        f"{min(warm_bins)}..{max(warm_bins)}), {fmt(steady_bytes / 1024)} KiB/s; "
        f"{fmt(steady_rate / n, 2)} req/s per agent | | |",
        "| steady: gaps between one agent's pushes (median; share over 1.5 s) | "
        + (f"{fmt(statistics.median(gaps), 2)} s; {100 * long_gaps / len(gaps):.0f} % "
           f"({long_gaps} of {len(gaps)})" if gaps else "")
        + " | | |",
    ]
    if args.mode == "503":
        lines += [
            f"| outage: attempts per 1 s, peak | {max(out_bins)} req/s "
            f"({fmt(max(out_bins) / steady_rate, 2)}x steady) | {max(model_out_bins)} req/s | "
            f"{n} req/s (all N in one second, each retry wave) |",
            f"| outage: attempts per 1 s, median | {statistics.median(out_bins):g} req/s | "
            f"{statistics.median(model_out_bins):g} req/s | 0 between waves |",
            f"| outage: attempts per agent (min/median/max) | {min(attempts)}/"
            f"{statistics.median(attempts):g}/{max(attempts)} | {min(model_attempts)}/"
            f"{statistics.median(model_attempts):g}/{max(model_attempts)} | same as without "
            "jitter |",
        ]
    lines += [
        f"| recovery: peak 1 s request rate | {max(rec_bins) if rec_bins else 0} req/s "
        f"({fmt((max(rec_bins) if rec_bins else 0) / steady_rate, 2)}x steady) | | |",
        f"| recovery: peak 1 s bytes | {fmt(max(rec_byte_bins) / 1024 if rec_byte_bins else 0)} "
        f"KiB ({fmt((max(rec_byte_bins) if rec_byte_bins else 0) / max(1.0, steady_bytes), 1)}x "
        "steady) | | |",
    ]
    if back:
        lines += [
            f"| recovery: first accepted request after the receiver is back, per agent "
            f"(min/median/max) | {fmt(min(back))}/{fmt(statistics.median(back))}/"
            f"{fmt(max(back))} s | "
            + (f"{fmt(min(model_back))}/{fmt(statistics.median(model_back))}/"
               f"{fmt(max(model_back))} s" if model_back else "")
            + " | all at the same instant |",
            f"| recovery: agents whose first accepted request fell in one 1 s window (most) | "
            f"{densest(back)} of {len(back)} | "
            + (f"{densest(model_back)} of {len(model_back)}" if model_back else "")
            + f" | {n} of {n} |",
            f"| recovery: backlog drained, per agent (min/median/max) | {fmt(min(drained))}/"
            f"{fmt(statistics.median(drained))}/{fmt(max(drained))} s, in "
            f"{min(backlog_requests)}..{max(backlog_requests)} requests of "
            f"{fmt(statistics.median(backlog_bytes) / 1024)} KiB (median) | | |",
            "| recovery: fleet rate back to steady (every later 5 s average within 25 %) | "
            + (f"{settle} s after the receiver is back" if settle is not None else
               "not within the window")
            + " | | |",
        ]
    if len(back) < n:
        lines.append(f"| agents without an accepted request after recovery | {n - len(back)} | | |")
    if args.mode == "503" and ok_in_outage:
        lines.append(f"| requests answered 2xx during the outage (should be 0) | {ok_in_outage} "
                     "| | |")

    if args.mode == "503":
        lines += [
            "",
            "Each agent's k-th attempt after the outage began (the 1st is its scheduled push "
            "that failed; the wait before the next is the floor plus tenacity's "
            f"`wait_random_exponential`: {floor:g} + uniform in [0, min({cap - floor:g}, "
            f"{floor:g}*2^(k-1))] s):",
            "",
            "| k | agents | at (s): min / median / max | spread | most agents in one 1 s window "
            "| wait before k+1, window | without jitter: at (median), most in 1 s |",
            "|---|---|---|---|---|---|---|",
        ]
        kmax = max(attempts) if attempts else 0
        for k in range(1, kmax + 1):
            ts = [v[k - 1] for v in per_agent.values() if len(v) >= k]
            if len(ts) < max(2, n // 4):
                break
            lo, hi = jitter_window(k, floor, cap)
            model = model_kth.get(k, [])
            lines.append(
                f"| {k} | {len(ts)} | {fmt(min(ts), 2)} / {fmt(statistics.median(ts), 2)} / "
                f"{fmt(max(ts), 2)} | {fmt(max(ts) - min(ts), 2)} s | {densest(ts)} "
                f"({100 * densest(ts) / len(ts):.0f} %) | {lo:g}..{hi:g} s | "
                + (f"{fmt(statistics.median(model), 2)} s, {densest(model)} "
                   f"({100 * densest(model) / len(model):.0f} %)" if model else "past the outage")
                + " |")
        lines += [
            "",
            "Attempts per 1 s during the outage (measured): " + " ".join(map(str, out_bins)),
        ]
    lines += [
        "",
        "Requests per 1 s after the receiver is back (measured): " + " ".join(map(str, rec_bins)),
        "",
        f"Log lines per agent on stderr (min/median/max): {min(lines_per_agent)}/"
        f"{statistics.median(lines_per_agent):g}/{max(lines_per_agent)}; events over all "
        "agents: " + ", ".join(f"`{e}` {c}" for e, c in events.most_common())
        + "; levels: " + ", ".join(f"{lv} {c}" for lv, c in levels.most_common())
        + (f"; {other} lines not JSON" if other else "") + ".",
        f"Shutdown: SIGTERM to every agent, SIGKILL after {TERM_BOUND_S:g} s: "
        f"{sum(a.killed for a in agents)} killed; exit codes "
        + ", ".join(f"{c}: {k}" for c, k in Counter(a.exit_code for a in agents).most_common())
        + ".",
        "",
        "Not covered: one machine and loopback (no network latency, no connection set-up cost "
        "to speak of, no load balancer); the receiver is a Python `http.server` that stores "
        "nothing, so its answer time does not grow with the load the way a real receiver's "
        "does; agents share the machine's CPUs (startup and sampling contend, which itself "
        "spreads their push phases); one outage length and one run, no repeats, so the "
        "spread figures carry the noise of one draw of the jitter; the 'without jitter' and "
        "'synchronized' columns are computed from the schedule, not run"
        + ("; in this mode the attempts during the outage are not seen by the receiver"
           if args.mode == "refuse" else "")
        + ".",
        "",
    ]
    ok = len(back) == n and (args.mode != "503" or ok_in_outage == 0)
    return lines, ok


def write_results(path: Path, text: str) -> None:
    old = path.read_text().split("\n") if path.exists() else []
    start = next((i for i, line in enumerate(old) if line.startswith(f"## {TITLE}")), None)
    if start is None:
        body = "\n".join(old).rstrip("\n")
        path.write_text(body + "\n\n" + text.rstrip("\n") + "\n")
        return
    end = next((i for i in range(start + 1, len(old)) if old[i].startswith("## ")), len(old))
    new = [*old[:start], *text.rstrip("\n").split("\n"), *([""] if end < len(old) else []),
           *old[end:]]
    path.write_text("\n".join(new).rstrip("\n") + "\n")


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "sidecar"], cwd=ROOT,
                               capture_output=True, text=True).stdout.rstrip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    if dirty:
        files = ", ".join(line[3:] for line in dirty.splitlines())
        return f"{head} with uncommitted changes to {files}"
    return head


def sleep_until(t: float) -> None:
    while (left := t - time.monotonic()) > 0:
        time.sleep(min(left, 0.5))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=40)
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds up before the outage")
    ap.add_argument("--outage", type=float, default=60.0)
    ap.add_argument("--recovery", type=float, default=90.0, help="seconds up after the outage")
    ap.add_argument("--mode", choices=("503", "refuse"), default="503")
    ap.add_argument("--retry-max-backoff", type=float, default=30.0)
    ap.add_argument("--startup-timeout", type=float, default=300.0,
                    help="seconds for every agent to have one push accepted")
    ap.add_argument("--results", type=Path, help="write the section into this RESULTS.md")
    ap.add_argument("--label", default="", help="a note in the section (e.g. 'smoke run')")
    args = ap.parse_args()
    args.command = shlex.join([".venv/bin/python", "bench/bench_fleet_retry.py", *sys.argv[1:]])
    args.commit = git_commit()

    receiver = Receiver()
    receiver.start()
    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    try:
        return run(args, receiver, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace, receiver: Receiver, tmp: Path) -> int:
    n = args.agents
    agents: list[Agent] = []
    try:
        started = time.monotonic()
        agents = start_agents(n, receiver.port, tmp, args.retry_max_backoff)
        print(f"{n} agents started, receiver on port {receiver.port}, tmp {tmp}", file=sys.stderr)
        while True:
            accepted = {p.agent for p in receiver.snapshot() if p.status == 204}
            dead = [a.index for a in agents if a.proc.poll() is not None]
            if dead:
                for i in dead[:3]:
                    print(f"agent {i} exited:\n{agents[i].stderr_path.read_text()[-2000:]}",
                          file=sys.stderr)
                raise SystemExit(f"{len(dead)} agents exited before the warm-up")
            if len(accepted & set(range(n))) == n:
                break
            if time.monotonic() - started > args.startup_timeout:
                raise SystemExit(f"only {len(accepted)} of {n} agents pushed within "
                                 f"{args.startup_timeout:g} s")
            time.sleep(0.2)
        t0 = time.monotonic()
        args.ready_s = t0 - started
        args.load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
        tl = Timeline(t0, t0 + args.warmup, t0 + args.warmup + args.outage,
                      t0 + args.warmup + args.outage + args.recovery)
        print(f"all pushing after {args.ready_s:.1f} s; warm-up {args.warmup:g} s",
              file=sys.stderr)
        sleep_until(tl.down)
        if args.mode == "503":
            receiver.down = True
        else:
            receiver.refuse()
        print(f"outage ({args.mode}) for {args.outage:g} s", file=sys.stderr)
        sleep_until(tl.up)
        if args.mode == "503":
            receiver.down = False
        else:
            receiver.reopen()
        print(f"receiver back; recovery {args.recovery:g} s", file=sys.stderr)
        sleep_until(tl.end)
        args.load_end = " ".join(f"{x:.2f}" for x in os.getloadavg())
        args.agent_cpu_s = sum(agent_cpu(a) for a in agents)
        args.wall_s = time.monotonic() - started
        posts = receiver.snapshot()
    finally:
        stop_agents(agents)
        receiver.stop()
    lines, ok = analyse(posts, tl, n, args, agents)
    text = "\n".join(lines)
    print(text)
    if args.results:
        write_results(args.results, text)
        print(f"written to {args.results}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
