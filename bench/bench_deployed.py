"""As deployed: whole-process CPU and memory of four topologies, in one run (issue #22).

    .venv/bin/python bench/bench_deployed.py [--window 60] [--rounds 3] [--warmup 10]
        [--baseline cdbc8c2] [--results bench/RESULTS.md]

Every topology runs as real OS processes on the same simulated node: scenario "healthy", 8 GPUs,
the stand-in NVML library of ``sidecar/simulate/fake_nvml.py`` behind pynvml (as
``scenario.nvml()`` builds it, the same defaults on every side: PCIe throughput calls block for
NVML's 20 ms), one sample every 1 s. Receivers are the real Debian binaries, fresh per run.

A. **gpu-sidecar as deployed**: ``python -m sidecar run --simulate healthy --simulate-gpus 8
   --no-simulated-app --gpus announced --socket <tmp>/app.sock --interval 1 --remote-write-url
   <VictoriaMetrics>/api/v1/write --spool-dir <tmp> --log-format json`` (default push interval,
   15 s; disk spool). The model server is a separate process (``--role app`` of this file:
   ``sidecar.simulate.app.SimulatedApp`` publishing the scenario's app profile for the 8 GPUs
   every 1 s over the agent's socket, as ``sidecar/wiring.py`` runs it in-process). Measured: the
   agent process; the publisher's CPU is shown for information, not counted.
A0. **gpu-sidecar as deployed at the baseline commit** (``--baseline REV``, default cdbc8c2, the
   commit before issue #22's change): A's command line, flags and publisher exactly, but the
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

Runs are interleaved A0, A, B, C, A0, A, B, C, ... (``--rounds``), each with fresh processes and
fresh receivers: start, ``--warmup`` s, then a window of ``--window`` s. CPU = utime + stime of the
whole process from /proc/<pid>/stat (all its threads, ended ones included) over the window, as
mCPU = CPU s / window s x 1000; RSS = VmRSS at the end of the window, and VmHWM. Each run is
checked: all 8 GPUs reached the receiver. Reported: medians and every run's value; the ratios of
the targets from the medians, and per round.

The stand-in's share is measured, never subtracted: in this process, against a stand-in built
with ``account_cpu=True`` (the CPU time spent inside its functions, by ``thread_time``), the
agent's ``Agent.cycle()`` (NVML reading and series building for 8 GPUs with app figures, on a
simulated clock 1 s per cycle) and the naive loop's cycle (the same function as B and C run) are
run for a number of cycles; stand-in CPU per cycle at one cycle per second is its mCPU, shown
next to each whole-process figure. The whole in-process cycle is shown too, for where the
agent's CPU goes.

Start-up: wall time of ``python -m sidecar run --simulate healthy --simulate-gpus 8 --once``
(stdout), median of 5; it includes by design the priming window (``PRIME_WINDOW_S``: rates
and GPM averages need two readings) and the wait for the in-process simulated app's first
announcement; this checkout's agent only. Beside it: ``python -c "import sidecar.cli"`` and
``python -c pass``.

Figures per cycle: the agent's, from VictoriaMetrics after runs A0 and A (samples per timestamp, the
median over the run's cycles: the agent writes one timestamp per cycle), all of them and the GPU
series alone (without its own ``gpu_sidecar_*``), the latter compared with the naive loop's: the
samples its registry holds after a cycle. Also measured in-process, for reading the stand-in's
share: the CPU of the 16 20-ms sleeps by which the stand-in emulates the naive loop's blocking
throughput calls (the agent makes none of those on Hopper).

Targets (issue #22), the exit code: agent RSS <= 48 MiB; agent mCPU <= 1.25 x A0's; agent mCPU
<= 0.5 x (exporter + vmagent); all from the medians (ratios per round shown beside them), and
every run's GPUs all at the receiver. Exit 0 only if all are met. The targets of issue #13
(agent mCPU <= 0.4 x (exporter + vmagent); agent mCPU <= naive loop + Pushgateway while exporting
at least 3x its figures; agent RSS <= 32 MiB; ``--once`` <= 0.8 s wall) are still reported, for
information only.

``--results FILE`` also writes the report into FILE (bench/RESULTS.md): it replaces the
generated part of the section "As deployed: whole processes", from its heading to its
"Checks:" line (and the verdict line after it); the prose after that is left as it is, for
whoever runs it to bring up to date.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
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
    status_mib,
    stop,
    wait_until,
)

SCENARIO = "healthy"
GPUS = 8
INTERVAL_S = 1.0
LOCAL = "127.0.0.1"
ONCE_RUNS = 5

BASELINE = "cdbc8c2"  # the commit before issue #22's change

# issue #22: the exit code
RSS_LIMIT_MIB = 48.0
CPU_RATIO_BASELINE = 1.25
CPU_RATIO_EXPORTER = 0.5

# issue #13: reported for information
OLD_CPU_RATIO_EXPORTER = 0.4
OLD_CPU_RATIO_NAIVE = 1.0
OLD_FIGURES_RATIO = 3.0
OLD_RSS_LIMIT_MIB = 32.0
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


def role_app(socket_path: str) -> None:
    """The simulated model server, as ``sidecar/wiring.py`` starts it, in its own process."""
    from sidecar.simulate.app import SimulatedApp
    from sidecar.simulate.scenarios import build

    sc = build(SCENARIO, GPUS)
    app = SimulatedApp(socket_path, [g.uuid for g in sc.gpus], sc.app,
                       interval_s=min(INTERVAL_S, 5.0))
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
            ) -> dict[str, dict[str, float]]:
    """CPU over the window and memory at its end, per named process; for the process named
    ``split``, also its main thread's CPU and that of its other threads (from schedstat: threads
    that started or ended inside the window count only in part there, never in "mcpu")."""
    c0 = {k: cpu_seconds(p) for k, p in pids.items()}
    s0 = thread_cpu(pids[split]) if split else {}
    t0 = time.monotonic()
    time.sleep(window)
    c1 = {k: cpu_seconds(p) for k, p in pids.items()}
    s1 = thread_cpu(pids[split]) if split else {}
    t1 = time.monotonic()
    out = {k: {"mcpu": (c1[k] - c0[k]) / (t1 - t0) * 1000, "rss": status_mib(p, "VmRSS"),
               "hwm": status_mib(p, "VmHWM")} for k, p in pids.items()}
    if split:
        main = pids[split]
        spent = {tid: s1[tid] - s0.get(tid, 0.0) for tid in s1}
        out[split]["main_mcpu"] = spent.get(main, 0.0) / (t1 - t0) * 1000
        out[split]["other_mcpu"] = sum(v for t, v in spent.items() if t != main) / (t1 - t0) * 1000
        out[split]["threads"] = len(s1)
    return out


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

def run_agent(tmp: Path, warmup: float, window: float, tree: Path = ROOT) -> dict:
    """A, or A0 with ``tree`` the baseline's: the agent's ``sidecar`` is ``tree``'s."""
    from tests.receivers import VictoriaMetrics

    vm = VictoriaMetrics(tmp)
    agent = app = None
    try:
        vm.start()
        sock = tmp / "app.sock"
        agent = spawn([sys.executable, "-m", "sidecar", "run", "--simulate", SCENARIO,
                       "--simulate-gpus", str(GPUS), "--no-simulated-app", "--gpus", "announced",
                       "--socket", str(sock), "--interval", str(INTERVAL_S),
                       "--remote-write-url", vm.write_url, "--spool-dir", str(tmp / "spool"),
                       "--log-format", "json"], tmp / "agent.log", tree)
        wait_until(lambda: sock.exists() or agent.poll() is not None, 30, "agent socket")
        alive(agent)
        app = spawn(this_file("--role", "app", "--socket", str(sock)), tmp / "app.log")
        time.sleep(warmup)
        alive(agent, app)
        parts = measure({"agent": agent.pid, "publisher": app.pid}, window, split="agent")
        alive(agent, app)
        stop(app)
        stop(agent)  # SIGTERM: a last cycle and a flush of what is batched
        rows = vm.export()
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
                "gpu_metric_names": len(gpu_names), "cycles": len(per_ts)}
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
        parts = measure({"naive loop": naive.pid}, window)
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
        parts = measure({"exporter": exporter.pid, "vmagent": vmagent.proc.pid}, window)
        alive(exporter)
        rows = vm.export('{__name__="gpu_memory_used_bytes"}')
        uuids = {r["metric"].get("uuid") for r in rows} - {None}
        return {"parts": parts, "gpus": len(uuids)}
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
        "B": ("naive loop + Pushgateway", run_naive_push),
        "C": ("exporter + vmagent -> VictoriaMetrics", run_exporter),
    }


# -- in-process: the stand-in's share, and the cycle itself ----------------------------------

def in_process(agent_cycles: int = 300, naive_cycles: int = 20) -> dict:
    """CPU per cycle inside the stand-in (accounted by it) and of the whole cycle (process CPU
    of the cycle call), for the agent and the naive loop, in this process."""
    import pynvml
    from prometheus_client import CollectorRegistry

    from sidecar import protocol
    from sidecar.agent import Agent
    from sidecar.config import Config
    from sidecar.log import configure
    from sidecar.simulate import fake_nvml
    from sidecar.simulate.app import profile_messages
    from sidecar.simulate.scenarios import build
    from sidecar.sources.app_socket import AppState
    from sidecar.sources.nvml import NvmlSource

    configure("json", "warning")

    from _naive import NullSink

    sc = build(SCENARIO, GPUS)
    clock = fake_nvml.ManualClock()
    fake = fake_nvml.install(sc.nvml(clock=clock, account_cpu=True))
    source = NvmlSource(clock=clock, interval_s=INTERVAL_S)
    source.open()
    state = AppState(clock=clock)
    agent = Agent(Config(gpus="visible", interval=INTERVAL_S), source=source, app=state,
                  sinks=NullSink(), clock=clock, wall=lambda: 1.7e9 + clock())

    def feed(i: int) -> None:
        for g in sc.gpus:
            for m in profile_messages(sc.app, g.uuid, 4242, 600.0 + i):
                state.feed(protocol.encode(m))

    feed(0)
    agent.prime()
    clock.advance(INTERVAL_S)
    agent.cycle()  # warm: first readings, lazy imports
    series = 0
    cpu = inside = 0.0
    for i in range(agent_cycles):
        feed(i + 1)
        clock.advance(INTERVAL_S)
        lib, t = fake.cpu_seconds, time.process_time()
        series = len(agent.cycle())
        cpu += time.process_time() - t
        inside += fake.cpu_seconds - lib
    source.close()
    out = {"agent_cycle_ms": cpu / agent_cycles * 1e3,
           "agent_standin_ms": inside / agent_cycles * 1e3, "agent_series_in_process": series}

    fake = fake_nvml.install(sc.nvml(account_cpu=True))  # blocking throughput calls, as in B/C
    pynvml.nvmlInit()
    registry = CollectorRegistry()
    cycle = naive_cycle(registry)
    cycle()
    cpu = inside = 0.0
    for _ in range(naive_cycles):
        lib, t = fake.cpu_seconds, time.process_time()
        cycle()
        cpu += time.process_time() - t
        inside += fake.cpu_seconds - lib
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


def report(runs: dict[str, list[dict]], ip: dict, st: dict, window: float, rounds: int,
           baseline: dict) -> tuple[list[str], bool]:
    """The Markdown section and whether issue #22's targets are met."""
    from sidecar.agent import PRIME_WINDOW_S

    def part(t: str, name: str, key: str) -> list[float]:
        return [r["parts"][name][key] for r in runs[t]]

    def ratios(num: list[float], den: list[float]) -> tuple[float, str]:
        """The ratio of the medians, and the ratios per round."""
        per_round = ", ".join(f"{a / b:.3f}" for a, b in zip(num, den, strict=True))
        return med(num) / med(den), per_round

    base_cpu = part("A0", "agent", "mcpu")
    agent_cpu = part("A", "agent", "mcpu")
    naive_cpu = part("B", "naive loop", "mcpu")
    exp_cpu = part("C", "exporter", "mcpu")
    vma_cpu = part("C", "vmagent", "mcpu")
    topo_cpu = [e + v for e, v in zip(exp_cpu, vma_cpu, strict=True)]
    topo_rss = [e + v for e, v in zip(part("C", "exporter", "rss"), part("C", "vmagent", "rss"),
                                      strict=True)]
    agent_rss = part("A", "agent", "rss")
    agent_hwm = med(part("A", "agent", "hwm"))
    agent_gpu_figures = med([r["gpu_figures"] for r in runs["A"]])
    naive_figures = ip["naive_figures"]
    all_gpus = all(r["gpus"] == GPUS for t in runs for r in runs[t])
    a_sc, n_sc = ip["agent_standin_ms"], ip["naive_standin_ms"]

    cpu_vs_base, per_round_base = ratios(agent_cpu, base_cpu)
    cpu_vs_exp, per_round_exp = ratios(agent_cpu, topo_cpu)
    cpu_vs_naive, per_round_naive = ratios(agent_cpu, naive_cpu)
    fig_ratio = agent_gpu_figures / naive_figures
    once = med(st["once"])
    verdicts = {  # issue #22: the exit code
        "rss": med(agent_rss) <= RSS_LIMIT_MIB,
        "cpu_base": cpu_vs_base <= CPU_RATIO_BASELINE,
        "cpu_exp": cpu_vs_exp <= CPU_RATIO_EXPORTER,
    }
    old = {  # issue #13: for information
        "cpu_exp": cpu_vs_exp <= OLD_CPU_RATIO_EXPORTER,
        "cpu_naive": cpu_vs_naive <= OLD_CPU_RATIO_NAIVE and fig_ratio >= OLD_FIGURES_RATIO,
        "rss": med(agent_rss) <= OLD_RSS_LIMIT_MIB,
        "once": once <= OLD_ONCE_LIMIT_S,
    }

    def v(ok: bool) -> str:
        return "met" if ok else "**missed**"

    def agent_rows(t: str, what: str, stand_in: str) -> list[str]:
        figures = med([r["figures"] for r in runs[t]])
        gpu_figures = med([r["gpu_figures"] for r in runs[t]])
        return [
            f"| {t}. {what} | agent | {fmt(part(t, 'agent', 'mcpu'), 2)} | {stand_in} | "
            f"{fmt(part(t, 'agent', 'rss'))} | {med(part(t, 'agent', 'hwm')):.1f} | "
            f"{figures:.0f} ({gpu_figures:.0f} GPU series + the agent's own) |",
            f"| {t}. (not counted) | simulated model server, own process | "
            f"{fmt(part(t, 'publisher', 'mcpu'), 2)} | 0 | {fmt(part(t, 'publisher', 'rss'))} | "
            f"{med(part(t, 'publisher', 'hwm')):.1f} | - |",
        ]

    def threads(t: str) -> str:
        return f"{med(part(t, 'agent', 'threads')) - 1:.0f}"

    short = baseline["commit"][:7]
    lines = [
        heading("As deployed: whole processes (issue #22)",
                f"{GPUS} simulated GPUs, 1 s sampling, {rounds} interleaved rounds of "
                f"{window:.0f} s, baseline {short}"),
        "",
        "| topology | process | CPU, mCPU: median (runs) | of which stand-in NVML (measured "
        "in-process) | RSS at end, MiB: median (runs) | peak RSS (VmHWM), MiB | figures per "
        "cycle |",
        "|---|---|---|---|---|---|---|",
        *agent_rows("A0", f"gpu-sidecar at {short} (baseline), remote-write to VictoriaMetrics",
                    "not measured"),
        *agent_rows("A", "gpu-sidecar, remote-write to VictoriaMetrics", f"{a_sc:.2f}"),
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
        "| target (issue #22) | measured | limit | verdict |",
        "|---|---|---|---|",
        f"| agent RSS | {med(agent_rss):.1f} MiB (peak {agent_hwm:.1f}; baseline "
        f"{med(part('A0', 'agent', 'rss')):.1f} MiB, peak {med(part('A0', 'agent', 'hwm')):.1f}) "
        f"| <= {RSS_LIMIT_MIB:.0f} MiB | {v(verdicts['rss'])} |",
        f"| agent CPU vs the baseline agent ({short}) | {med(agent_cpu):.2f} / "
        f"{med(base_cpu):.2f} mCPU = {cpu_vs_base:.3f}x (per round {per_round_base}) | "
        f"<= {CPU_RATIO_BASELINE}x | {v(verdicts['cpu_base'])} |",
        f"| agent CPU vs exporter + vmagent | {med(agent_cpu):.2f} / {med(topo_cpu):.2f} mCPU = "
        f"{cpu_vs_exp:.3f}x (per round {per_round_exp}) | <= {CPU_RATIO_EXPORTER}x | "
        f"{v(verdicts['cpu_exp'])} |",
        "",
        "| target of issue #13 (for information, not in the exit code) | measured | limit | "
        "verdict |",
        "|---|---|---|---|",
        f"| agent CPU vs exporter + vmagent | {cpu_vs_exp:.3f}x (per round {per_round_exp}) | "
        f"<= {OLD_CPU_RATIO_EXPORTER}x | {v(old['cpu_exp'])} |",
        f"| agent CPU vs naive loop + Pushgateway, while exporting >= {OLD_FIGURES_RATIO:.0f}x "
        f"its figures | {med(agent_cpu):.2f} / {med(naive_cpu):.2f} mCPU = {cpu_vs_naive:.3f}x "
        f"(per round {per_round_naive}); GPU figures {agent_gpu_figures:.0f} / {naive_figures} = "
        f"{fig_ratio:.1f}x | <= {OLD_CPU_RATIO_NAIVE:.0f}x, >= {OLD_FIGURES_RATIO:.0f}x | "
        f"{v(old['cpu_naive'])} |",
        f"| agent RSS | {med(agent_rss):.1f} MiB (peak {agent_hwm:.1f}) | "
        f"<= {OLD_RSS_LIMIT_MIB:.0f} MiB | {v(old['rss'])} |",
        f"| `--once` start-up, wall | {fmt(st['once'], 2)} s | <= {OLD_ONCE_LIMIT_S} s | "
        f"{v(old['once'])} |",
        "",
        "| where the CPU goes (nothing is subtracted anywhere) | agent | baseline agent | "
        "naive loop |",
        "|---|---|---|---|",
        f"| whole process, mCPU (median, from the first table) | {med(agent_cpu):.2f} | "
        f"{med(base_cpu):.2f} | {med(naive_cpu):.2f} |",
        f"| main thread, same windows (schedstat), mCPU | "
        f"{fmt(part('A', 'agent', 'main_mcpu'), 2)} | {fmt(part('A0', 'agent', 'main_mcpu'), 2)} "
        f"| - |",
        f"| other threads ({threads('A')} besides the main one; baseline {threads('A0')}), same "
        f"windows, mCPU | {fmt(part('A', 'agent', 'other_mcpu'), 2)} | "
        f"{fmt(part('A0', 'agent', 'other_mcpu'), 2)} | - |",
        "| in-process, per cycle (this checkout only): |  |  |  |",
        f"| whole cycle, CPU ms (= mCPU at one cycle per second) | {ip['agent_cycle_ms']:.3f} | - "
        f"| {ip['naive_cycle_ms']:.3f} |",
        f"| of which inside the stand-in NVML | {a_sc:.3f} | - | {n_sc:.3f} |",
        f"| CPU of the stand-in's 20 ms waits alone (16 `time.sleep(0.02)`, as the naive loop's "
        f"throughput calls make; the agent makes none on Hopper) | 0 | 0 | "
        f"{ip['naive_waits_ms']:.3f} |",
        "",
        f"Start-up parts, wall, median of {ONCE_RUNS}: `python -c pass` {fmt(st['bare'], 2)} s; "
        f"`python -c \"import sidecar.cli\"` {fmt(st['import_cli'], 2)} s; `--once` includes the "
        f"{PRIME_WINDOW_S:g} s priming window by design. `--once` wrote {st['once_series']} series.",
        "",
        f"Agents: A0 = `sidecar/` of {baseline['commit']} (`git archive`; its processes import "
        f"`{baseline['file']}`), A = this checkout at {baseline['head']} (imports "
        f"`{baseline['current_file']}`).",
        "",
        f"Checks: all {GPUS} GPUs reached the receiver in every run: "
        f"{'yes' if all_gpus else 'NO'} (A0 {[r['gpus'] for r in runs['A0']]}, A "
        f"{[r['gpus'] for r in runs['A']]}, B {[r['gpus'] for r in runs['B']]}, C "
        f"{[r['gpus'] for r in runs['C']]}); Pushgateway push failures "
        f"{[r['push_failures'] for r in runs['B']]}; agent cycles stored per run A0 "
        f"{[r['cycles'] for r in runs['A0']]}, A {[r['cycles'] for r in runs['A']]}; series "
        f"stored A0 {[r['series'] for r in runs['A0']]}, A {[r['series'] for r in runs['A']]}; "
        f"GPU metric names A0 {runs['A0'][0]['gpu_metric_names']}, A "
        f"{runs['A'][0]['gpu_metric_names']}.",
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
    parser.add_argument("--window", type=float, default=60.0, help="seconds measured per run")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before the window")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds A0, A, B, C")
    parser.add_argument("--baseline", default=BASELINE, metavar="REV",
                        help=f"commit whose sidecar/ runs as A0 (default {BASELINE})")
    parser.add_argument("--results", type=Path, metavar="FILE",
                        help="also write the report into FILE's section (bench/RESULTS.md)")
    args = parser.parse_args()
    if args.role == "app":
        role_app(args.socket)
        return 0
    if args.role == "naive":
        role_naive(args.gateway, args.port)
        return 0

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
    lines, ok = report(runs, ip, st, args.window, args.rounds, baseline)
    if args.results is not None:
        replace_section(args.results, section(lines, ok), "As deployed: whole processes",
                        last="Checks:")
        print(f"wrote the generated part of 'As deployed: whole processes' into {args.results}; "
              "the prose after it is the previous run's: bring it up to date", file=sys.stderr)
    return finish(lines, ok)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
