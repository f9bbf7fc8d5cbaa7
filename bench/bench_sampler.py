"""Sampler benchmark: the agent against the seed's naive loop, in one run, as ratios.

    .venv/bin/python bench/bench_sampler.py          # prints a Markdown report

Measures, for 8 simulated GPUs behind the stand-in NVML (pynvml's own code runs for every call):
1. CPU time per cycle, agent vs the naive loop (count GPUs; per GPU serially: handle, name, UUID,
   memory, utilization, PCIe TX and RX throughput, link generation and width; set
   prometheus_client gauges). Target: agent at least 3x lower. What is compared is the CPU of the
   code under test: process CPU less the CPU spent inside the stand-in library (which emulates C
   code in Python) and less the stand-in's own per-call accounting cost, measured on a no-op in
   the same run and subtracted per call from both sides. Each side's figure is its least costly
   block of 50 cycles out of 400; five rounds after a warm-up; the round with the median ratio is
   reported, with every round's ratio beside it.
2. Wall time per cycle when the stand-in blocks ``nvmlDeviceGetPcieThroughput`` for NVML's real
   20 ms (GPUs without byte counters or GPM). Target: at most 1.5 x 20 ms; naive: 8 x 2 x 20 ms.
3. Resident memory over an hour of simulated sampling at 1 s (3600 cycles on a simulated clock,
   app figures arriving through the socket state, series rendered as text), in a fresh process.
   Target: under 40 MiB and flat; the baseline is the same interpreter with the dependencies
   imported.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pynvml
from _naive import NullSink, naive_loop
from _report import finish, heading, standin_calls, standin_seconds

from sidecar.agent import Agent
from sidecar.config import Config
from sidecar.simulate import fake_nvml
from sidecar.simulate.scenarios import build
from sidecar.sources.app_socket import AppState
from sidecar.sources.nvml import NvmlSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ (the hand-moved clock)
from tests.manual_clock import ManualClock

GPUS = 8
WINDOW_S = fake_nvml.THROUGHPUT_WINDOW_S


def naive_loop_factory():
    """The seed's Go sketch translated to pynvml and prometheus_client (``_naive.py``)."""
    return naive_loop()


def agent_for(scenario: str, blocking: bool, clock=time.monotonic) -> Agent:
    sc = build(scenario, GPUS)
    fake_nvml.install(sc.nvml(throughput_blocking=blocking, clock=clock, account_cpu=True))
    source = NvmlSource(clock=clock)
    source.open()
    return Agent(Config(gpus="visible"), source=source, app=AppState(clock=clock), sinks=NullSink(),
                 clock=clock)


def cpu_per_cycle(fn, cycles: int, block: int = 50) -> tuple[float, float, float]:
    """(process CPU per cycle, of which inside the stand-in library, NVML calls per cycle), from
    the block of ``block`` cycles that spent least outside the stand-in: on a shared machine a
    block can be slowed by others, never sped up, so the least is the truest (as timeit does)."""
    fn()  # warm: first readings, lazy imports
    fake = pynvml.nvmlLib.fake
    best: tuple[float, float, float] | None = None
    for _ in range(max(1, cycles // block)):
        inside, calls = standin_seconds(fake), standin_calls(fake)
        start = time.process_time()
        for _ in range(block):
            fn()
        measured = ((time.process_time() - start) / block, (standin_seconds(fake) - inside) / block,
                    (standin_calls(fake) - calls) / block)
        if best is None or measured[0] - measured[1] < best[0] - best[1]:
            best = measured
    assert best is not None
    return best


def accounting_overhead(calls: int = 200_000) -> float:
    """CPU seconds per call that the stand-in's own accounting adds outside what it counts as
    inside (the wrapper's frame and half of each ``thread_time`` system call), measured on a
    no-op and less the cost of calling the no-op bare. Subtracted per call from both sides."""
    fake = fake_nvml.FakeNvml([], account_cpu=True)

    def noop(*args: object) -> int:
        return 0

    accounted = fake._accounted(noop)
    best = []
    for _ in range(5):
        inside = standin_seconds(fake)
        start = time.process_time()
        for _ in range(calls):
            accounted(1, 2)
        with_accounting = time.process_time() - start - (standin_seconds(fake) - inside)
        start = time.process_time()
        for _ in range(calls):
            noop(1, 2)
        best.append((with_accounting - (time.process_time() - start)) / calls)
    return statistics.median(best)


def wall_per_cycle(fn, cycles: int) -> list[float]:
    fn()
    out = []
    for _ in range(cycles):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def cpu_benchmark() -> dict:
    overhead = accounting_overhead()
    results = {"accounting_overhead_us": overhead * 1e6}
    for scenario in ("healthy", "old-driver"):
        cpu_round(scenario, overhead, cycles=100)  # warm-up, not counted: caches, lazy imports
        rounds = [cpu_round(scenario, overhead) for _ in range(ROUNDS)]
        # the round with the median ratio, so the figures in a row come from one round
        rounds.sort(key=lambda r: r["ratio"])
        results[scenario] = {**rounds[ROUNDS // 2],
                             "ratios": [round(r["ratio"], 2) for r in rounds]}
    return results


ROUNDS = 5


def cpu_round(scenario: str, overhead: float, cycles: int = 400) -> dict:
    """One round: the agent, then the naive loop, each on a fresh stand-in of the scenario."""
    # a simulated clock a second apart per cycle, so GPM averages are taken as in production
    # (back-to-back cycles under 100 ms would skip them)
    clock = ManualClock()
    agent = agent_for(scenario, blocking=False, clock=clock)

    def one_cycle(agent=agent, clock=clock) -> None:
        clock.advance(1.0)
        agent.collect()

    a, a_lib, a_calls = cpu_per_cycle(one_cycle, cycles)
    full, full_lib, _ = cpu_per_cycle(
        lambda agent=agent, clock=clock: (clock.advance(1.0), agent.cycle()), cycles)
    agent.source.close()
    fake_nvml.install(build(scenario, GPUS).nvml(throughput_blocking=False, account_cpu=True))
    pynvml.nvmlInit()
    n, n_lib, n_calls = cpu_per_cycle(naive_loop_factory(), cycles)
    own_a = a - a_lib - a_calls * overhead  # the code under test, outside the stand-in
    own_full = full - full_lib - a_calls * overhead
    own_n = n - n_lib - n_calls * overhead
    return {
        "agent_cpu_ms": a * 1e3, "agent_lib_ms": a_lib * 1e3, "agent_calls": a_calls,
        "agent_own_ms": own_a * 1e3, "agent_full_own_ms": own_full * 1e3,
        "naive_cpu_ms": n * 1e3, "naive_lib_ms": n_lib * 1e3, "naive_calls": n_calls,
        "naive_own_ms": own_n * 1e3,
        "ratio_total": n / a, "ratio": own_n / own_a, "ratio_full": own_n / own_full,
        "ratio_uncorrected": (n - n_lib) / (a - a_lib),
    }


def wall_benchmark() -> dict:
    agent = agent_for("old-driver", blocking=True)
    a = wall_per_cycle(agent.cycle, 30)
    agent.source.close()
    fake_nvml.install(build("old-driver", GPUS).nvml(throughput_blocking=True))
    pynvml.nvmlInit()
    n = wall_per_cycle(naive_loop_factory(), 5)
    return {"agent_wall_ms_median": statistics.median(a) * 1e3,
            "agent_wall_ms_max": max(a) * 1e3,
            "naive_wall_ms_median": statistics.median(n) * 1e3,
            "limit_ms": 1.5 * WINDOW_S * 1e3}


MEMORY_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
import pynvml, structlog  # the dependencies the agent imports
base = rss()
from sidecar.agent import Agent
from sidecar.sources.app_socket import AppState
from sidecar.config import Config
from sidecar.sources.nvml import NvmlSource
from sidecar.simulate import fake_nvml
from tests.manual_clock import ManualClock
from sidecar.simulate.scenarios import build
from sidecar.simulate.app import profile_messages
from sidecar.sinks.stdout import prometheus_text
from sidecar import protocol
from sidecar.log import configure
configure("json", "warning")
clock = ManualClock()
sc = build("healthy", 8)
fake_nvml.install(sc.nvml(clock=clock, throughput_blocking=False))
source = NvmlSource(clock=clock); source.open()
state = AppState(clock=clock)
class TextSink:
    name = "text"
    def start(self): pass
    def emit(self, series): self.last = len(prometheus_text(series))
    def close(self, deadline): return True
    def telemetry(self, ts, labels): return []
agent = Agent(Config(gpus="visible", interval=1.0), source=source, app=state, sinks=TextSink(),
              clock=clock, wall=lambda: 1.7e9 + clock())
points = []
for i in range(3600):
    for g in sc.gpus:
        for m in profile_messages(sc.app, g.uuid, 4242 + (i // 600), float(i)):
            state.feed(protocol.encode(m))
    agent.cycle()
    clock.advance(1.0)
    if i % 600 == 599:
        points.append(round(rss(), 2))
print(json.dumps({"baseline_mib": round(base, 2), "points_mib": points}))
"""


def memory_benchmark() -> dict:
    root = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, "-c", MEMORY_CHILD, root], capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    from sidecar.log import configure

    configure("json", "warning")
    cpu = cpu_benchmark()
    wall = wall_benchmark()
    mem = memory_benchmark()
    pts = mem["points_mib"]
    ok = (cpu["healthy"]["ratio"] >= 3
          and wall["agent_wall_ms_max"] <= wall["limit_ms"]
          and max(pts) < 40 and pts[-1] - pts[0] < 1.0)
    lines = [
        heading("Sampler", "8 simulated GPUs"),
        "",
        "| measure | agent | naive loop | ratio / limit |",
        "|---|---|---|---|",
    ]
    for scenario, r in cpu.items():
        if not isinstance(r, dict):
            continue
        target = " (target >= 3x)" if scenario == "healthy" else ""
        lines.append(
            f"| CPU per cycle, sampling (NVML to records), code under test, {scenario} | "
            f"{r['agent_own_ms']:.3f} ms ({r['agent_calls']:.0f} NVML calls) | "
            f"{r['naive_own_ms']:.3f} ms ({r['naive_calls']:.0f} calls) | "
            f"naive/agent = {r['ratio']:.2f}x{target}; rounds {r['ratios']}; "
            f"{r['ratio_uncorrected']:.2f}x with the accounting cost left in |")
        lines.append(
            f"| CPU per cycle, sampling + series building, code under test, {scenario} | "
            f"{r['agent_full_own_ms']:.3f} ms | {r['naive_own_ms']:.3f} ms | "
            f"naive/agent = {r['ratio_full']:.2f}x |")
        lines.append(
            f"| CPU per cycle including the stand-in, {scenario} | {r['agent_cpu_ms']:.3f} ms "
            f"(stand-in {r['agent_lib_ms']:.3f}) | {r['naive_cpu_ms']:.3f} ms (stand-in "
            f"{r['naive_lib_ms']:.3f}) | naive/agent = {r['ratio_total']:.2f}x |")
    lines.append(f"| wall per cycle, 20 ms throughput blocking (old-driver) | median "
                 f"{wall['agent_wall_ms_median']:.1f} ms, max {wall['agent_wall_ms_max']:.1f} ms | "
                 f"median {wall['naive_wall_ms_median']:.1f} ms | limit {wall['limit_ms']:.0f} ms |")
    lines.append(f"| RSS over 3600 cycles at 1 s (every 600) | {', '.join(f'{p:.1f}' for p in pts)} MiB"
                 f" | baseline {mem['baseline_mib']:.1f} MiB (interpreter + pynvml + structlog) |"
                 f" limit 40 MiB, flat |")
    lines.append(f"| stand-in accounting cost per call, subtracted from both | "
                 f"{cpu['accounting_overhead_us']:.2f} us | same | - |")
    return finish(lines, ok)


if __name__ == "__main__":
    raise SystemExit(main())
