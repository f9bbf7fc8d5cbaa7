"""As deployed: whole-process CPU and memory of five topologies, in one run (issues #22, #37).

    .venv/bin/python bench/bench_deployed.py [--window 60] [--rounds 3] [--warmup 10]
        [--baseline f5ecbae] [--results bench/RESULTS.md]

Every topology runs as real OS processes on the same simulated node: scenario "healthy", 8 GPUs,
the stand-in NVML library of ``sidecar/simulate/fake_nvml.py`` behind pynvml (as
``scenario.nvml()`` builds it, the same defaults on every side: PCIe throughput calls block for
NVML's 20 ms), one sample every 1 s (A5: every 5 s). Receivers are the real Debian binaries,
fresh per run.

A. **gpu-sidecar as deployed**: ``python -m sidecar run --simulate healthy --simulate-gpus 8
   --no-simulated-app --gpus announced --socket <tmp>/app.sock --interval 1 --remote-write-url
   <VictoriaMetrics>/api/v1/write --spool-dir <tmp> --log-format json`` (default push interval,
   15 s; disk spool; the diagnose window and its socket, as every run has them). The model
   server is a separate process (``--role app`` of this file:
   ``sidecar.simulate.app.SimulatedApp`` publishing the scenario's app profile for the 8 GPUs
   every min(interval, 5 s), as ``sidecar/wiring.py`` runs it in-process and as the injected
   publisher is placed, over the agent's socket). Measured: the agent process; the publisher's
   CPU is shown for information, not counted.
A5. **A at the default interval**: the same, with ``--interval 5`` (``Config.interval``), the
   publisher every 5 s.
A0. **gpu-sidecar as deployed at the baseline commit** (``--baseline REV``, default f5ecbae, the
   landed main before issues #32 to #37): A's command line, flags and publisher exactly, but the
   agent is the baseline's ``sidecar/`` package, exported once per benchmark run with
   ``git archive REV sidecar | tar -x`` into a temporary directory, with the same interpreter
   and virtualenv. Both agents are started alike from their tree (this checkout for A):
   working directory and ``PYTHONPATH`` the tree, ``PYTHONSAFEPATH`` removed, so
   ``sys.path[0]`` is the tree and its package wins over the editable install (whose finder
   comes after ``sys.path``). Before the rounds a child started the same way from each tree
   prints ``sidecar.__file__``; it must lie in that tree, and the report names both. Bytecode is
   treated alike: nothing is compiled into the exported tree beforehand. The publisher is this
   checkout's for A0 too (the socket protocol is unchanged); the stand-in NVML and the scenario
   are in the package, so A0's agent runs the baseline's (``sidecar/simulate``).
B. **naive loop + Pushgateway** (``--role naive --gateway URL``): installs the same stand-in,
   then every 1 s, per GPU, serially: handle, name, UUID, memory, utilization, PCIe TX and RX
   throughput, link generation and width (the reads of ``_naive.naive_loop``), sets
   6 prometheus_client gauges, and ``push_to_gateway`` to a real Pushgateway every cycle.
   Measured: the loop's process (the Pushgateway is the receiver, as VictoriaMetrics is for A).
C. **exporter + vmagent**: the same loop without the push (``--role naive --port P``), serving its
   gauges with ``prometheus_client.start_http_server``; a real vmagent scrapes it every 1 s and
   remote-writes to a real VictoriaMetrics (vmagent's default flush). Measured: exporter +
   vmagent, both parts shown.

Runs are interleaved A0, A, A5, B, C, A0, ... (``--rounds``), each with fresh processes and
fresh receivers: start, ``--warmup`` s, then a window of ``--window`` s. CPU = utime + stime of the
whole process from /proc/<pid>/stat (all its threads, ended ones included) over the window, as
mCPU = CPU s / window s x 1000; RSS = VmRSS at the end of the window, and VmHWM. Each run is
checked: all 8 GPUs reached the receiver. Reported: medians and every run's value; the ratios of
the targets from the medians, and per round.

Delivered figures (A0, A, A5, C): the samples VictoriaMetrics holds at the end of the run whose
timestamps lie in the measured window (read once its count stops changing), divided by the
window: samples stored per second. For the agents that is every series they sent, their own
``gpu_sidecar_*`` included, the rare figures only when sent (``sidecar/sinks/cadence.py``); for
C it is what vmagent stored: the exporter's 48 gauges per scrape plus the series vmagent adds to
every scrape of its own (``up``, ``scrape_duration_seconds``, ...), shown apart. CPU per
thousand delivered figures per second = mCPU / (figures per s / 1000).

The stand-in's share is measured, never subtracted: in this process, against a stand-in built
with ``account_cpu=True`` (the CPU time spent inside its functions, by ``thread_time``), the
agent's ``Agent.cycle()`` (NVML reading, series building, the diagnose window, and the emit of
a real remote-write sink as ``wiring.build_sinks`` builds it, rare cadence, encoding and journal
included, its sender thread not started, on a simulated clock 1 s per cycle) and the naive
loop's cycle (the same function as B and C run) are run for a number of cycles; stand-in CPU per
cycle at one cycle per second is its mCPU, shown next to each whole-process figure. Where the
rest goes: the same cycles again under cProfile, each part's cumulative time as a share of the
profiled cycle. The diagnose window's memory when full (a deployed run's RSS holds only its
first 70 s): the same in-process agent with a fresh window run on to 15 simulated minutes, then
the window dropped; what it held is what the traced memory (tracemalloc) lost.

Start-up: wall time of ``python -m sidecar run --simulate healthy --simulate-gpus 8 --once``
(stdout), median of 5; it includes by design the priming window (``PRIME_WINDOW_S``: rates
and GPM averages need two readings) and the wait for the in-process simulated app's first
announcement; this checkout's agent only. Beside it: ``python -c "import sidecar.cli"`` and
``python -c pass``.

Figures per cycle: the agent's, from VictoriaMetrics after runs A0, A, A5 (samples per
timestamp, the median over the run's cycles: the agent writes one timestamp per cycle), all of
them and the GPU series alone (without its own ``gpu_sidecar_*``), the latter compared with the
naive loop's: the samples its registry holds after a cycle. Also measured in-process, for
reading the stand-in's share: the CPU of the 16 20-ms sleeps by which the stand-in emulates the
naive loop's blocking throughput calls (the agent makes none of those on Hopper).

Targets (issue #37), the exit code: agent RSS (A and A5) <= 48 MiB; agent mCPU <= 0.5 x
(exporter + vmagent), for A (1 s) and for A5 (5 s; C scrapes every 1 s in both comparisons); all
from the medians (ratios per round shown beside them), and every run's GPUs all at the receiver.
Exit 0 only if all are met; a missed one is said MISSED with where the CPU goes. Reported for
information: A against A0 (issue #36: not above the baseline), the targets of issue #13 (agent
mCPU <= naive loop + Pushgateway while exporting at least 3x its figures; ``--once`` <= 0.8 s).

``--results FILE`` also writes the report into FILE (bench/RESULTS.md): it replaces the
generated part of the section "As deployed: whole processes", from its heading to its
"Checks:" line (and the verdict line after it); the prose after that is left as it is, for
whoever runs it to bring up to date.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import os
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from _report import (  # noqa: E402
    cpu_seconds,
    finish,
    heading,
    replace_section,
    section,
    standin_seconds,
    status_mib,
    stop,
    wait_until,
)

SCENARIO = "healthy"
GPUS = 8
INTERVAL_S = 1.0
LOCAL = "127.0.0.1"
ONCE_RUNS = 5

DEFAULT_INTERVAL_S = 5.0  # sidecar.config.Config.interval (checked in main)

BASELINE = "f5ecbae"  # the landed main before issues #32 to #37

# issue #37: the exit code
RSS_LIMIT_MIB = 48.0
CPU_RATIO_EXPORTER = 0.5

# reported for information: issue #36 (not above the baseline), issue #13
CPU_RATIO_BASELINE = 1.0
OLD_CPU_RATIO_NAIVE = 1.0
OLD_FIGURES_RATIO = 3.0
OLD_ONCE_LIMIT_S = 0.8


# -- the naive loop and the publisher, run as child processes of this file ----------------------

def naive_cycle(registry):
    """The seed's sketch (``_naive.py``, as ``bench_sampler`` uses it): reads every GPU through
    pynvml and sets 6 gauges of ``registry`` per GPU."""
    from _naive import naive_loop

    return naive_loop(registry)


def role_naive(gateway: str | None, port: int | None) -> None:
    """B (``gateway``: push every cycle) or C (``port``: serve for scraping). SIGTERM ends it."""
    import pynvml
    from prometheus_client import CollectorRegistry, push_to_gateway, start_http_server

    from sidecar.simulate import fake_nvml
    from sidecar.simulate.scenarios import build

    fake_nvml.install(build(SCENARIO, GPUS).nvml())
    pynvml.nvmlInit()
    registry = CollectorRegistry()
    cycle = naive_cycle(registry)
    if port is not None:
        start_http_server(port, addr=LOCAL, registry=registry)
    start = time.monotonic()
    slot = 0
    while True:
        cycle()
        if gateway is not None:
            try:
                push_to_gateway(gateway, job="naive", registry=registry, timeout=5)
            except OSError as exc:  # a naive loop logs and carries on
                print(f"push failed: {exc}", file=sys.stderr, flush=True)
        slot += 1
        now = time.monotonic()
        due = start + slot * INTERVAL_S
        if now > due:  # anchored schedule, late slots skipped (as the agent does)
            slot += int((now - due) // INTERVAL_S) + 1
            due = start + slot * INTERVAL_S
        time.sleep(max(0.0, due - time.monotonic()))


def role_app(socket_path: str, interval: float) -> None:
    """The simulated model server, as ``sidecar/wiring.py`` starts it, in its own process: it
    publishes every min(agent interval, default interval), as the placed publisher does."""
    from sidecar.simulate.app import SimulatedApp
    from sidecar.simulate.scenarios import build

    sc = build(SCENARIO, GPUS)
    app = SimulatedApp(socket_path, [g.uuid for g in sc.gpus], sc.app,
                       interval_s=min(interval, DEFAULT_INTERVAL_S))
    app.start()
    while True:
        signal.pause()


# -- processes --------------------------------------------------------------------------------

def child_env(tree: Path | None = None) -> dict[str, str]:
    """This environment without ``GPU_SIDECAR_*``; with ``tree``, for an agent whose ``sidecar``
    package must be imported from ``tree`` (``PYTHONPATH`` the tree, no ``PYTHONSAFEPATH``, so
    that ``sys.path[0]``, the working directory, is the tree too)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
    if tree is not None:
        env.pop("PYTHONSAFEPATH", None)
        env["PYTHONPATH"] = str(tree)
    return env


def spawn(command: list[str], log: Path, tree: Path | None = None) -> subprocess.Popen:
    """``command`` in this checkout, or with ``tree``'s ``sidecar`` package (``child_env``)."""
    with log.open("wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                cwd=tree or ROOT, env=child_env(tree))


def this_file(*args: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *args]


def scraping_vmagent(tmp: Path, write_url: str, target_port: int):
    """vmagent as the exporter topology deploys it: scrape every 1 s, remote-write with its
    default flush, buffer on disk. A ``tests.receivers.Process`` (start/stop, free port)."""
    from tests.receivers import Process, need

    config = tmp / "scrape.yml"
    config.write_text("global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: naive\n"
                      f"    static_configs:\n      - targets: ['{LOCAL}:{target_port}']\n")
    return Process(lambda port: [need("vmagent"), f"-httpListenAddr={LOCAL}:{port}",
                                 f"-promscrape.config={config}", f"-remoteWrite.url={write_url}",
                                 f"-remoteWrite.tmpDataPath={tmp / 'vmagent-data'}",
                                 "-loggerLevel=WARN"],
                   tmp / "vmagent.log", "/health")


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each live thread of ``pid`` (/proc/<pid>/task/*/schedstat, in ns)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that ended
            out[int(tid)] = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text()
                                .split()[0]) / 1e9
    return out


def measure(pids: dict[str, int], window: float, split: str | None = None
            ) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """CPU over the window and memory at its end, per named process; for the process named
    ``split``, also its main thread's CPU and that of its other threads (from schedstat: threads
    that started or ended inside the window count only in part there, never in "mcpu"). And
    the window's wall-clock bounds, in ms (what the receiver's timestamps are compared with)."""
    c0 = {k: cpu_seconds(p) for k, p in pids.items()}
    s0 = thread_cpu(pids[split]) if split else {}
    t0, wall0 = time.monotonic(), time.time()
    time.sleep(window)
    c1 = {k: cpu_seconds(p) for k, p in pids.items()}
    s1 = thread_cpu(pids[split]) if split else {}
    t1, wall1 = time.monotonic(), time.time()
    out = {k: {"mcpu": (c1[k] - c0[k]) / (t1 - t0) * 1000, "rss": status_mib(p, "VmRSS"),
               "hwm": status_mib(p, "VmHWM")} for k, p in pids.items()}
    if split:
        main = pids[split]
        spent = {tid: s1[tid] - s0.get(tid, 0.0) for tid in s1}
        out[split]["main_mcpu"] = spent.get(main, 0.0) / (t1 - t0) * 1000
        out[split]["other_mcpu"] = sum(v for t, v in spent.items() if t != main) / (t1 - t0) * 1000
        out[split]["threads"] = len(s1)
    return out, {"from_ms": wall0 * 1000, "to_ms": wall1 * 1000}


def stored(vm) -> list[dict]:
    """Everything ``vm`` holds, once its sample count has stopped changing (VictoriaMetrics makes
    rows searchable up to a second after it acknowledged them)."""
    rows = vm.export()
    count = sum(len(r["timestamps"]) for r in rows)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        time.sleep(0.5)
        again = vm.export()
        now = sum(len(r["timestamps"]) for r in again)
        if now == count:
            return again
        rows, count = again, now
    return rows


def delivered(rows: list[dict], window: dict) -> tuple[int, float]:
    """Samples of ``rows`` stamped inside the measured window: their number, and per second."""
    n = sum(1 for r in rows for ts in r["timestamps"] if window["from_ms"] <= ts < window["to_ms"])
    return n, n / ((window["to_ms"] - window["from_ms"]) / 1000)


def alive(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is not None:
            raise RuntimeError(f"{p.args[:4]} exited with {p.returncode} during the run")


# -- the baseline's agent ----------------------------------------------------------------------

def export_baseline(rev: str) -> tuple[Path, str]:
    """The ``sidecar/`` package as committed at ``rev``, in a fresh temporary directory (the
    caller removes it); returns the directory and the full commit."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                            capture_output=True, text=True, check=True).stdout.strip()
    tree = Path(tempfile.mkdtemp(prefix="bench-deployed-baseline-")).resolve()
    archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", commit, "sidecar"],
                               stdout=subprocess.PIPE)
    untar = subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout)
    archive.stdout.close()
    if archive.wait() != 0 or untar.returncode != 0 or not (tree / "sidecar").is_dir():
        raise RuntimeError(f"could not export sidecar/ of {rev} into {tree}")
    return tree, commit


def imported_from(tree: Path) -> str:
    """``sidecar.__file__`` in a child started as an agent from ``tree`` is (same interpreter,
    environment and working directory: ``sys.path[0]`` is the working directory for ``-c`` as for
    ``-m``); raises unless both lie in ``tree``."""
    probe = "import os, sys, sidecar; print(os.path.abspath(sys.path[0])); print(sidecar.__file__)"
    first, where = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                  check=True, cwd=tree, env=child_env(tree)).stdout.split()
    if Path(first) != tree or not Path(where).resolve().is_relative_to(tree / "sidecar"):
        raise RuntimeError(f"an agent started from {tree} would import sidecar from {where} "
                           f"(sys.path[0] {first})")
    return where


# -- the four topologies ----------------------------------------------------------------------

def run_agent(tmp: Path, warmup: float, window: float, tree: Path = ROOT,
              interval: float = INTERVAL_S) -> dict:
    """A, A5 (``interval`` the default), or A0 with ``tree`` the baseline's: the agent's
    ``sidecar`` is ``tree``'s."""
    from tests.receivers import VictoriaMetrics

    vm = VictoriaMetrics(tmp)
    agent = app = None
    try:
        vm.start()
        sock = tmp / "app.sock"
        agent = spawn([sys.executable, "-m", "sidecar", "run", "--simulate", SCENARIO,
                       "--simulate-gpus", str(GPUS), "--no-simulated-app", "--gpus", "announced",
                       "--socket", str(sock), "--interval", str(interval),
                       "--remote-write-url", vm.write_url, "--spool-dir", str(tmp / "spool"),
                       "--log-format", "json"], tmp / "agent.log", tree)
        wait_until(lambda: sock.exists() or agent.poll() is not None, 30, "agent socket")
        alive(agent)
        app = spawn(this_file("--role", "app", "--socket", str(sock), "--interval",
                              str(interval)), tmp / "app.log")
        time.sleep(warmup)
        alive(agent, app)
        parts, span = measure({"agent": agent.pid, "publisher": app.pid}, window, split="agent")
        alive(agent, app)
        stop(app)
        stop(agent)  # SIGTERM: a last cycle and a flush of what is batched
        rows = stored(vm)
        n_delivered, per_s = delivered(rows, span)
        uuids = {r["metric"].get("gpu_uuid") for r in rows} - {None}
        per_ts: Counter[int] = Counter()
        gpu_per_ts: Counter[int] = Counter()  # without the agent's own gpu_sidecar_* series
        for r in rows:
            per_ts.update(r["timestamps"])
            if not r["metric"]["__name__"].startswith("gpu_sidecar_"):
                gpu_per_ts.update(r["timestamps"])
        figures = statistics.median(per_ts.values()) if per_ts else 0
        gpu_figures = statistics.median(gpu_per_ts.values()) if gpu_per_ts else 0
        gpu_names = {r["metric"]["__name__"] for r in rows
                     if r["metric"]["__name__"].startswith("gpu_")
                     and not r["metric"]["__name__"].startswith("gpu_sidecar_")}
        return {"parts": parts, "gpus": len(uuids), "figures": figures,
                "gpu_figures": gpu_figures, "series": len(rows),
                "gpu_metric_names": len(gpu_names), "cycles": len(per_ts),
                "delivered": n_delivered, "delivered_per_s": per_s}
    finally:
        stop(app)
        stop(agent)
        vm.stop()


def run_naive_push(tmp: Path, warmup: float, window: float) -> dict:
    import requests

    from tests.receivers import Pushgateway

    pg = Pushgateway(tmp)
    naive = None
    try:
        pg.start()
        naive = spawn(this_file("--role", "naive", "--gateway", pg.base), tmp / "naive.log")
        time.sleep(warmup)
        alive(naive)
        parts, _ = measure({"naive loop": naive.pid}, window)
        alive(naive)
        text = requests.get(f"{pg.base}/metrics", timeout=10).text
        uuids = {line.split('uuid="')[1].split('"')[0] for line in text.splitlines()
                 if line.startswith("gpu_memory_used_bytes{")}
        failed = (tmp / "naive.log").read_text().count("push failed")
        return {"parts": parts, "gpus": len(uuids), "push_failures": failed}
    finally:
        stop(naive)
        pg.stop()


def run_exporter(tmp: Path, warmup: float, window: float) -> dict:
    from tests.receivers import VictoriaMetrics, free_port, wait_http

    vm = VictoriaMetrics(tmp)
    vmagent = exporter = None
    try:
        vm.start()
        port = free_port()
        exporter = spawn(this_file("--role", "naive", "--port", str(port)), tmp / "exporter.log")
        wait_http(f"http://{LOCAL}:{port}/metrics")
        vmagent = scraping_vmagent(tmp, vm.write_url, port)
        vmagent.start()
        time.sleep(warmup)
        alive(exporter)
        parts, span = measure({"exporter": exporter.pid, "vmagent": vmagent.proc.pid}, window)
        alive(exporter)
        vmagent.stop()  # SIGTERM: vmagent sends what it buffered before it exits
        rows = stored(vm)
        uuids = {r["metric"].get("uuid") for r in rows
                 if r["metric"]["__name__"] == "gpu_memory_used_bytes"} - {None}
        # the exporter's gauges are all gpu_*; the rest vmagent adds to each scrape (up, ...)
        own = [r for r in rows if not r["metric"]["__name__"].startswith("gpu_")]
        n_delivered, per_s = delivered(rows, span)
        return {"parts": parts, "gpus": len(uuids), "delivered": n_delivered,
                "delivered_per_s": per_s, "vmagent_own_per_s": delivered(own, span)[1],
                "vmagent_own_names": sorted({r["metric"]["__name__"] for r in own})}
    finally:
        if vmagent is not None:
            vmagent.stop()
        stop(exporter)
        vm.stop()


def topologies(baseline: Path) -> dict:
    """Name: (what, run(tmp, warmup, window)), in the order of a round."""
    return {
        "A0": ("gpu-sidecar at the baseline commit, remote-write to VictoriaMetrics",
               lambda tmp, warmup, window: run_agent(tmp, warmup, window, tree=baseline)),
        "A": ("gpu-sidecar, remote-write to VictoriaMetrics", run_agent),
        "A5": ("gpu-sidecar at the default interval, remote-write to VictoriaMetrics",
               lambda tmp, warmup, window: run_agent(tmp, warmup, window,
                                                     interval=DEFAULT_INTERVAL_S)),
        "B": ("naive loop + Pushgateway", run_naive_push),
        "C": ("exporter + vmagent -> VictoriaMetrics", run_exporter),
    }


# -- in-process: the stand-in's share, and the cycle itself ----------------------------------

# where the profiled cycle goes: (label, file the function is in, its name); cumulative times
PROFILED = (
    ("reading the GPUs and the app (NVML through pynvml, the stand-in below it)", "sidecar/agent.py",
     "collect"),
    ("building the series (labels included)", "sidecar/samples.py", "sample_series"),
    ("the diagnose window and the verdicts", "sidecar/agent.py", "_judge"),
    ("the remote-write sink's emit, all of it", "sidecar/sinks/spooled.py", "emit"),
    ("of which the rare cadence", "sidecar/sinks/cadence.py", "due"),
    ("of which encoding (remote-write protobuf)", "sidecar/sinks/remote_write.py", "cycle"),
    ("of which journaling (a record appended to the open batch's journal)",
     "sidecar/sinks/spooled.py", "_append_journal"),
    ("of which sealing a batch (snappy, into the spool), every push interval",
     "sidecar/sinks/spooled.py", "flush"),
)


def in_process(agent_cycles: int = 300, naive_cycles: int = 20) -> dict:
    """CPU per cycle inside the stand-in (accounted by it) and of the whole cycle (process CPU
    of the cycle call), for the agent and the naive loop, in this process; for the agent, its
    parts under cProfile, and the diagnose window's memory once full."""
    import pynvml
    from prometheus_client import CollectorRegistry

    from sidecar import protocol, wiring
    from sidecar.agent import Agent
    from sidecar.config import Config
    from sidecar.log import configure
    from sidecar.recent import WINDOW_S, Recent
    from sidecar.simulate import fake_nvml
    from sidecar.simulate.app import profile_messages
    from sidecar.simulate.scenarios import build
    from sidecar.sources.app_socket import AppState
    from sidecar.sources.nvml import NvmlSource
    from tests.manual_clock import ManualClock

    configure("json", "warning")

    sc = build(SCENARIO, GPUS)
    clock = ManualClock()
    fake = fake_nvml.install(sc.nvml(clock=clock, account_cpu=True))
    source = NvmlSource(clock=clock, interval_s=INTERVAL_S)
    source.open()
    state = AppState(clock=clock)
    spool = Path(tempfile.mkdtemp(prefix="bench-deployed-inprocess-"))
    # the remote-write sink as the wiring builds it (rare cadence, journal, spool); its sender
    # thread is never started (nothing listens at port 9): only the sampling thread's part runs
    cfg = Config(gpus="visible", interval=INTERVAL_S, spool_dir=str(spool),
                 remote_write_url=(f"http://{LOCAL}:9/api/v1/write",))
    sinks = wiring.build_sinks(cfg, str(spool))
    for sink in sinks:  # its push interval on the simulated clock too
        sink.clock = clock
        sink.last_flush = clock()
    agent = Agent(cfg, source=source, app=state, sinks=sinks, clock=clock,
                  wall=lambda: 1.7e9 + clock(), recent=Recent())

    def feed(i: int) -> None:
        for g in sc.gpus:
            for m in profile_messages(sc.app, g.uuid, 4242, 600.0 + i):
                state.feed(protocol.encode(m))

    def cycle(i: int) -> int:
        feed(i)  # the app publishes every cycle, as in A
        clock.advance(INTERVAL_S)
        return len(agent.cycle())

    try:
        feed(0)
        agent.prime()
        clock.advance(INTERVAL_S)
        agent.cycle()  # warm: first readings, lazy imports
        series = 0
        cpu = inside = 0.0
        read_in_cycle = [0.0]  # the GPUs' reading as part of each cycle, timed where it runs
        read = source.read

        def timed_read(uuids: list[str], **kw: object) -> dict:
            t = time.process_time()
            try:
                return read(uuids, **kw)
            finally:
                read_in_cycle[0] += time.process_time() - t

        source.read = timed_read  # type: ignore[method-assign]
        for i in range(1, agent_cycles + 1):
            lib, t = standin_seconds(fake), time.process_time()
            series = cycle(i)
            cpu += time.process_time() - t
            inside += standin_seconds(fake) - lib
        source.read = read  # type: ignore[method-assign]
        out = {"agent_cycle_ms": cpu / agent_cycles * 1e3,
               "agent_standin_ms": inside / agent_cycles * 1e3,
               "agent_series_in_process": series,
               "read_in_cycle_ms": read_in_cycle[0] / agent_cycles * 1e3}
        # the floor under any agent exporting these figures: the GPUs' reading alone (the same
        # NVML calls through pynvml, nothing built from them), and the app's messages of a
        # cycle decoded (the app-socket thread's work), each measured on its own
        uuids = agent.selected()
        lib, t = standin_seconds(fake), time.process_time()
        for _ in range(agent_cycles):
            clock.advance(INTERVAL_S)
            source.read(uuids)
        out["read_ms"] = (time.process_time() - t) / agent_cycles * 1e3
        out["read_standin_ms"] = (standin_seconds(fake) - lib) / agent_cycles * 1e3
        datagrams = [[protocol.encode(m) for g in sc.gpus
                      for m in profile_messages(sc.app, g.uuid, 4242, 600.0 + agent_cycles + i)]
                     for i in range(1, agent_cycles + 1)]
        t = time.process_time()
        for cycle_datagrams in datagrams:
            for datagram in cycle_datagrams:
                state.feed(datagram)
        out["app_feed_ms"] = (time.process_time() - t) / agent_cycles * 1e3
        agent_cycles_done = 2 * agent_cycles  # the app's clock goes on from here
        # a fresh window filled whole (15 minutes and a bucket): what it holds is what this
        # process's traced memory loses when the window is dropped
        tracemalloc.start()
        agent.recent = Recent()
        full = int(WINDOW_S / INTERVAL_S) + 15
        for i in range(1, full + 1):
            cycle(agent_cycles_done + i)
        held = tracemalloc.get_traced_memory()[0]
        agent.recent = None
        gc.collect()
        out["window_mib"] = (held - tracemalloc.get_traced_memory()[0]) / 2**20
        out["window_to_s"] = full * INTERVAL_S
        tracemalloc.stop()
        agent.recent = Recent()
        done = agent_cycles_done + full
        profile = cProfile.Profile()
        for i in range(done + 1, done + agent_cycles + 1):
            profile.enable()
            cycle(i)
            profile.disable()
        stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
        total = sum(tt for _, _, tt, _, _ in stats.values())
        out["profiled_cycle_ms"] = total / agent_cycles * 1e3
        out["profile"] = []
        for label, file, name in PROFILED:
            found = [ct for (f, _, n), (_, _, _, ct, _) in stats.items()
                     if n == name and f.endswith(file)]
            out["profile"].append((label, sum(found) / total * 100 if found else None))
    finally:
        source.close()
        shutil.rmtree(spool, ignore_errors=True)

    fake = fake_nvml.install(sc.nvml(account_cpu=True))  # blocking throughput calls, as in B/C
    pynvml.nvmlInit()
    registry = CollectorRegistry()
    naive = naive_cycle(registry)
    naive()
    cpu = inside = 0.0
    for _ in range(naive_cycles):
        lib, t = standin_seconds(fake), time.process_time()
        naive()
        cpu += time.process_time() - t
        inside += standin_seconds(fake) - lib
    pynvml.nvmlShutdown()
    fake_nvml.uninstall()
    out.update(naive_cycle_ms=cpu / naive_cycles * 1e3,
               naive_standin_ms=inside / naive_cycles * 1e3,
               naive_figures=sum(len(m.samples) for m in registry.collect()))
    # what the stand-in's emulation of NVML's blocking throughput call costs by itself: the
    # thread's CPU over as many 20 ms sleeps as the naive loop makes per cycle (16)
    waits, repeat = 2 * GPUS, 5
    t = time.thread_time()
    for _ in range(waits * repeat):
        time.sleep(fake_nvml.THROUGHPUT_WINDOW_S)
    out["naive_waits_ms"] = (time.thread_time() - t) / repeat * 1e3
    return out


# -- start-up -------------------------------------------------------------------------------

def wall(command: list[str], runs: int = ONCE_RUNS) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True,
                       cwd=ROOT, env=child_env())
        out.append(time.perf_counter() - t)
    return out


def startup() -> dict:
    once = [sys.executable, "-m", "sidecar", "run", "--simulate", SCENARIO, "--simulate-gpus",
            str(GPUS), "--once"]
    json_once = subprocess.run([*once, "--output", "json"], capture_output=True, text=True,
                               check=True, cwd=ROOT, env=child_env())
    return {"once": wall(once), "import_cli": wall([sys.executable, "-c", "import sidecar.cli"]),
            "bare": wall([sys.executable, "-c", "pass"]),
            "once_series": sum(1 for line in json_once.stdout.splitlines()
                               if line.startswith("{"))}


# -- report ---------------------------------------------------------------------------------

def med(values: list[float]) -> float:
    return statistics.median(values)


def fmt(values: list[float], digits: int = 1) -> str:
    return f"**{med(values):.{digits}f}** ({', '.join(f'{v:.{digits}f}' for v in values)})"


def report(runs: dict[str, list[dict]], ip: dict, st: dict, warmup: float, window: float,
           rounds: int, baseline: dict) -> tuple[list[str], bool]:
    """The Markdown section and whether issue #37's targets are met."""
    from sidecar.agent import PRIME_WINDOW_S
    from sidecar.recent import WINDOW_S

    def part(t: str, name: str, key: str) -> list[float]:
        return [r["parts"][name][key] for r in runs[t]]

    def ratios(num: list[float], den: list[float]) -> tuple[float, str]:
        """The ratio of the medians, and the ratios per round."""
        per_round = ", ".join(f"{a / b:.3f}" for a, b in zip(num, den, strict=True))
        return med(num) / med(den), per_round

    cpu = {t: part(t, "agent", "mcpu") for t in ("A0", "A", "A5")}
    naive_cpu = part("B", "naive loop", "mcpu")
    exp_cpu = part("C", "exporter", "mcpu")
    vma_cpu = part("C", "vmagent", "mcpu")
    topo_cpu = [e + v for e, v in zip(exp_cpu, vma_cpu, strict=True)]
    topo_rss = [e + v for e, v in zip(part("C", "exporter", "rss"), part("C", "vmagent", "rss"),
                                      strict=True)]
    rss = {t: part(t, "agent", "rss") for t in ("A0", "A", "A5")}
    agent_gpu_figures = med([r["gpu_figures"] for r in runs["A"]])
    naive_figures = ip["naive_figures"]
    all_gpus = all(r["gpus"] == GPUS for t in runs for r in runs[t])
    a_sc, n_sc = ip["agent_standin_ms"], ip["naive_standin_ms"]

    cpu_vs_base, per_round_base = ratios(cpu["A"], cpu["A0"])
    cpu_vs_exp, per_round_exp = ratios(cpu["A"], topo_cpu)
    cpu5_vs_exp, per_round_exp5 = ratios(cpu["A5"], topo_cpu)
    cpu_vs_naive, per_round_naive = ratios(cpu["A"], naive_cpu)
    fig_ratio = agent_gpu_figures / naive_figures
    once = med(st["once"])
    verdicts = {  # issue #37: the exit code
        "rss": med(rss["A"]) <= RSS_LIMIT_MIB,
        "rss5": med(rss["A5"]) <= RSS_LIMIT_MIB,
        "cpu_exp": cpu_vs_exp <= CPU_RATIO_EXPORTER,
        "cpu5_exp": cpu5_vs_exp <= CPU_RATIO_EXPORTER,
    }
    info = {  # for information: issue #36, issue #13
        "cpu_base": cpu_vs_base <= CPU_RATIO_BASELINE,
        "cpu_naive": cpu_vs_naive <= OLD_CPU_RATIO_NAIVE and fig_ratio >= OLD_FIGURES_RATIO,
        "once": once <= OLD_ONCE_LIMIT_S,
    }

    def v(ok: bool) -> str:
        return "met" if ok else "**MISSED**"

    def per_second(t: str) -> list[float]:
        return [r["delivered_per_s"] for r in runs[t]]

    def per_thousand(mcpu: list[float], t: str) -> list[float]:
        """mCPU per thousand delivered figures per second, run by run."""
        return [m / (f / 1000) for m, f in zip(mcpu, per_second(t), strict=True)]

    def agent_rows(t: str, what: str, stand_in: str) -> list[str]:
        figures = med([r["figures"] for r in runs[t]])
        gpu_figures = med([r["gpu_figures"] for r in runs[t]])
        return [
            f"| {t}. {what} | agent | {fmt(cpu[t], 2)} | {stand_in} | "
            f"{fmt(rss[t])} | {med(part(t, 'agent', 'hwm')):.1f} | "
            f"{figures:.0f} ({gpu_figures:.0f} GPU series + the agent's own) |",
            f"| {t}. (not counted) | simulated model server, own process | "
            f"{fmt(part(t, 'publisher', 'mcpu'), 2)} | 0 | {fmt(part(t, 'publisher', 'rss'))} | "
            f"{med(part(t, 'publisher', 'hwm')):.1f} | - |",
        ]

    def figure_row(t: str, what: str, mcpu: list[float]) -> str:
        per_k = per_thousand(mcpu, t)
        against = med(per_k) / med(per_thousand(topo_cpu, "C"))
        return (f"| {t}. {what} | {fmt(mcpu, 2)} | {fmt(per_second(t), 0)} | {fmt(per_k, 2)} | "
                f"{against:.3f}x |")

    def threads(t: str) -> str:
        return f"{med(part(t, 'agent', 'threads')) - 1:.0f}"

    def share(label: str, pct: float | None) -> str:
        return f"| {label} | {'-' if pct is None else f'{pct:.1f} %'} |"

    short = baseline["commit"][:7]
    lines = [
        heading("As deployed: whole processes (issues #22, #37)",
                f"{GPUS} simulated GPUs, 1 s sampling (A5: {DEFAULT_INTERVAL_S:g} s), {rounds} "
                f"interleaved rounds of {window:.0f} s, baseline {short}"),
        "",
        "| topology | process | CPU, mCPU: median (runs) | of which stand-in NVML (measured "
        "in-process) | RSS at end, MiB: median (runs) | peak RSS (VmHWM), MiB | figures per "
        "cycle |",
        "|---|---|---|---|---|---|---|",
        *agent_rows("A0", f"gpu-sidecar at {short} (baseline), 1 s, remote-write to "
                    "VictoriaMetrics", "not measured"),
        *agent_rows("A", "gpu-sidecar, 1 s, remote-write to VictoriaMetrics", f"{a_sc:.2f}"),
        *agent_rows("A5", f"gpu-sidecar, {DEFAULT_INTERVAL_S:g} s (the default), remote-write to "
                    "VictoriaMetrics", "not measured"),
        f"| B. naive loop + Pushgateway (push every cycle) | loop | {fmt(naive_cpu, 2)} | "
        f"{n_sc:.2f} | {fmt(part('B', 'naive loop', 'rss'))} | "
        f"{med(part('B', 'naive loop', 'hwm')):.1f} | {naive_figures} |",
        f"| C. exporter + vmagent -> VictoriaMetrics | exporter | {fmt(exp_cpu, 2)} | {n_sc:.2f} | "
        f"{fmt(part('C', 'exporter', 'rss'))} | {med(part('C', 'exporter', 'hwm')):.1f} | "
        f"{naive_figures} |",
        f"| C. | vmagent | {fmt(vma_cpu, 2)} | 0 | {fmt(part('C', 'vmagent', 'rss'))} | "
        f"{med(part('C', 'vmagent', 'hwm')):.1f} | - |",
        f"| C. | exporter + vmagent | {fmt(topo_cpu, 2)} | {n_sc:.2f} | {fmt(topo_rss)} | - | "
        f"{naive_figures} |",
        "",
        "| target (issue #37, the exit code) | measured | limit | verdict |",
        "|---|---|---|---|",
        f"| agent RSS at 1 s | {med(rss['A']):.1f} MiB (peak "
        f"{med(part('A', 'agent', 'hwm')):.1f}; baseline {med(rss['A0']):.1f} MiB, peak "
        f"{med(part('A0', 'agent', 'hwm')):.1f}) | <= {RSS_LIMIT_MIB:.0f} MiB | "
        f"{v(verdicts['rss'])} |",
        f"| agent RSS at {DEFAULT_INTERVAL_S:g} s | {med(rss['A5']):.1f} MiB (peak "
        f"{med(part('A5', 'agent', 'hwm')):.1f}) | <= {RSS_LIMIT_MIB:.0f} MiB | "
        f"{v(verdicts['rss5'])} |",
        f"| agent CPU at 1 s vs exporter + vmagent (1 s) | {med(cpu['A']):.2f} / "
        f"{med(topo_cpu):.2f} mCPU = {cpu_vs_exp:.3f}x (per round {per_round_exp}) | "
        f"<= {CPU_RATIO_EXPORTER}x | {v(verdicts['cpu_exp'])} |",
        f"| agent CPU at {DEFAULT_INTERVAL_S:g} s vs exporter + vmagent (1 s) | "
        f"{med(cpu['A5']):.2f} / {med(topo_cpu):.2f} mCPU = {cpu5_vs_exp:.3f}x (per round "
        f"{per_round_exp5}) | <= {CPU_RATIO_EXPORTER}x | {v(verdicts['cpu5_exp'])} |",
        "",
        f"The diagnose window is in every agent's RSS above as far as it had filled: "
        f"{warmup + window:.0f} s of its {WINDOW_S / 60:.0f} minutes. Filled on to "
        f"{ip['window_to_s'] / 60:.0f} minutes in-process (the same agent, cycles and sink), "
        f"the whole window holds {ip['window_mib']:.2f} MiB (tracemalloc: what the process's "
        f"traced memory lost when the window was dropped).",
        "",
        "| delivered figures (samples VictoriaMetrics stored, stamped in the window) | CPU, mCPU "
        "| figures per s: median (runs) | mCPU per 1000 figures per s | against C |",
        "|---|---|---|---|---|",
        figure_row("A0", f"gpu-sidecar at {short}, 1 s", cpu["A0"]),
        figure_row("A", "gpu-sidecar, 1 s", cpu["A"]),
        figure_row("A5", f"gpu-sidecar, {DEFAULT_INTERVAL_S:g} s", cpu["A5"]),
        figure_row("C", "exporter + vmagent, 1 s", topo_cpu),
        "",
        f"C's figures are everything vmagent stored: the exporter's {naive_figures} gauges per "
        f"scrape and vmagent's own series of each scrape "
        f"({', '.join(f'`{n}`' for n in runs['C'][0]['vmagent_own_names'])}: "
        f"{fmt([r['vmagent_own_per_s'] for r in runs['C']], 1)} per s of them). The agents' are "
        f"every series they sent, their own `gpu_sidecar_*` included, the rare ones when sent.",
        "",
        "| for information (not in the exit code) | measured | limit | verdict |",
        "|---|---|---|---|",
        f"| issue #36: agent CPU vs the baseline agent ({short}), both at 1 s | "
        f"{med(cpu['A']):.2f} / {med(cpu['A0']):.2f} mCPU = {cpu_vs_base:.3f}x (per round "
        f"{per_round_base}) | <= {CPU_RATIO_BASELINE}x | {v(info['cpu_base'])} |",
        f"| issue #13: agent CPU vs naive loop + Pushgateway, while exporting >= "
        f"{OLD_FIGURES_RATIO:.0f}x its figures | {med(cpu['A']):.2f} / {med(naive_cpu):.2f} mCPU "
        f"= {cpu_vs_naive:.3f}x (per round {per_round_naive}); GPU figures per cycle "
        f"{agent_gpu_figures:.0f} / {naive_figures} = {fig_ratio:.1f}x | "
        f"<= {OLD_CPU_RATIO_NAIVE:.0f}x, >= {OLD_FIGURES_RATIO:.0f}x | {v(info['cpu_naive'])} |",
        f"| issue #13: `--once` start-up, wall | {fmt(st['once'], 2)} s | <= {OLD_ONCE_LIMIT_S} s "
        f"| {v(info['once'])} |",
        "",
        "| where the CPU goes (nothing is subtracted anywhere) | agent, 1 s | agent, "
        f"{DEFAULT_INTERVAL_S:g} s | baseline agent | naive loop |",
        "|---|---|---|---|---|",
        f"| whole process, mCPU (median, from the first table) | {med(cpu['A']):.2f} | "
        f"{med(cpu['A5']):.2f} | {med(cpu['A0']):.2f} | {med(naive_cpu):.2f} |",
        f"| main thread, same windows (schedstat), mCPU | "
        f"{fmt(part('A', 'agent', 'main_mcpu'), 2)} | {fmt(part('A5', 'agent', 'main_mcpu'), 2)} "
        f"| {fmt(part('A0', 'agent', 'main_mcpu'), 2)} | - |",
        f"| other threads ({threads('A')} besides the main one; baseline {threads('A0')}), same "
        f"windows, mCPU | {fmt(part('A', 'agent', 'other_mcpu'), 2)} | "
        f"{fmt(part('A5', 'agent', 'other_mcpu'), 2)} | "
        f"{fmt(part('A0', 'agent', 'other_mcpu'), 2)} | - |",
        "| in-process, per cycle at 1 s (this checkout only): |  |  |  |  |",
        f"| whole cycle with the remote-write sink's emit, CPU ms (= mCPU at one cycle per "
        f"second) | {ip['agent_cycle_ms']:.3f} | - | - | {ip['naive_cycle_ms']:.3f} |",
        f"| of which inside the stand-in NVML | {a_sc:.3f} | - | - | {n_sc:.3f} |",
        f"| the GPUs' reading alone (`NvmlSource.read` of {GPUS} GPUs: every NVML call a cycle "
        f"makes, through pynvml, nothing built from it), CPU ms | {ip['read_ms']:.3f} | - | - "
        f"| - |",
        f"| of which inside the stand-in NVML | {ip['read_standin_ms']:.3f} | - | - | - |",
        f"| the same reading as part of each cycle above (timed where it runs: the rest of the "
        f"cycle leaves it colder caches), CPU ms | {ip['read_in_cycle_ms']:.3f} | - | - | - |",
        f"| the app's datagrams of one cycle decoded alone (`AppState.feed`, {2 * GPUS} "
        f"messages: the app-socket thread's work), CPU ms | {ip['app_feed_ms']:.3f} | - | - | - |",
        f"| CPU of the stand-in's 20 ms waits alone (16 `time.sleep(0.02)`, as the naive loop's "
        f"throughput calls make; the agent makes none on Hopper) | 0 | - | 0 | "
        f"{ip['naive_waits_ms']:.3f} |",
        "",
        f"| the in-process cycle under cProfile ({ip['profiled_cycle_ms']:.2f} ms per cycle "
        f"profiled, the profiler's own cost included): cumulative time | share of the cycle |",
        "|---|---|",
        *(share(label, pct) for label, pct in ip["profile"]),
        share("the rest of the cycle (100 % less the four parts above: the agent's own series, "
              "the loop)", 100 - sum(pct or 0 for label, pct in ip["profile"]
                                     if not label.startswith("of which"))),
        "",
        f"Start-up parts, wall, median of {ONCE_RUNS}: `python -c pass` {fmt(st['bare'], 2)} s; "
        f"`python -c \"import sidecar.cli\"` {fmt(st['import_cli'], 2)} s; `--once` includes the "
        f"{PRIME_WINDOW_S:g} s priming window by design. `--once` wrote {st['once_series']} series.",
        "",
        f"Agents: A0 = `sidecar/` of {baseline['commit']} (`git archive`; its processes import "
        f"`{baseline['file']}`), A and A5 = this checkout at {baseline['head']} (imports "
        f"`{baseline['current_file']}`).",
        "",
        f"Checks: all {GPUS} GPUs reached the receiver in every run: "
        f"{'yes' if all_gpus else 'NO'} ("
        + ", ".join(f"{t} {[r['gpus'] for r in runs[t]]}" for t in runs)
        + f"); Pushgateway push failures {[r['push_failures'] for r in runs['B']]}; agent cycles "
        f"stored per run " + ", ".join(f"{t} {[r['cycles'] for r in runs[t]]}"
                                       for t in ("A0", "A", "A5"))
        + "; series stored " + ", ".join(f"{t} {[r['series'] for r in runs[t]]}"
                                         for t in ("A0", "A", "A5"))
        + "; GPU metric names " + ", ".join(f"{t} {runs[t][0]['gpu_metric_names']}"
                                            for t in ("A0", "A", "A5")) + ".",
    ]
    return lines, all(verdicts.values()) and all_gpus


def checkout_state() -> str:
    """HEAD, and whether ``sidecar/`` differs from it in the working tree."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              check=True).stdout.strip()

    dirty = git("status", "--porcelain", "--", "sidecar")
    return git("rev-parse", "--short", "HEAD") + (" with uncommitted changes in sidecar/"
                                                  if dirty else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=("app", "naive"), help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    parser.add_argument("--gateway", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--interval", type=float, default=INTERVAL_S, help=argparse.SUPPRESS)
    parser.add_argument("--window", type=float, default=60.0, help="seconds measured per run")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before the window")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds A0, A, A5, B, C")
    parser.add_argument("--baseline", default=BASELINE, metavar="REV",
                        help=f"commit whose sidecar/ runs as A0 (default {BASELINE})")
    parser.add_argument("--results", type=Path, metavar="FILE",
                        help="also write the report into FILE's section (bench/RESULTS.md)")
    args = parser.parse_args()
    if args.role == "app":
        role_app(args.socket, args.interval)
        return 0
    if args.role == "naive":
        role_naive(args.gateway, args.port)
        return 0

    from sidecar.config import Config

    if Config.interval != DEFAULT_INTERVAL_S:
        raise SystemExit(f"the default interval is now {Config.interval} s: set "
                         "DEFAULT_INTERVAL_S to it (the A5 row and the report name it)")
    tree, commit = export_baseline(args.baseline)
    try:
        baseline = {"commit": commit, "file": imported_from(tree), "head": checkout_state(),
                    "current_file": imported_from(ROOT)}
        print(f"A0: {args.baseline} = {commit}, imports {baseline['file']}; A: "
              f"{baseline['head']}, imports {baseline['current_file']}", file=sys.stderr,
              flush=True)
        order = topologies(tree)
        runs: dict[str, list[dict]] = {t: [] for t in order}
        for n in range(args.rounds):
            for t, (what, fn) in order.items():
                tmp = Path(tempfile.mkdtemp(prefix=f"bench-deployed-{t}-"))
                try:
                    result = fn(tmp, args.warmup, args.window)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                runs[t].append(result)
                shown = ", ".join(f"{k} {p['mcpu']:.2f} mCPU {p['rss']:.1f} MiB"
                                  for k, p in result["parts"].items())
                print(f"round {n + 1} {t} ({what}): {shown}; GPUs {result['gpus']}",
                      file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    ip = in_process()
    print(f"in-process: {ip}", file=sys.stderr, flush=True)
    st = startup()
    print(f"start-up: {st}", file=sys.stderr, flush=True)
    lines, ok = report(runs, ip, st, args.warmup, args.window, args.rounds, baseline)
    if args.results is not None:
        replace_section(args.results, section(lines, ok), "As deployed: whole processes",
                        last="Checks:")
        print(f"wrote the generated part of 'As deployed: whole processes' into {args.results}; "
              "the prose after it is the previous run's: bring it up to date", file=sys.stderr)
    return finish(lines, ok)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
