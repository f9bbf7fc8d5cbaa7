"""NVML budget benchmark: the calls and the time the agent spends in NVML per cycle, on 8
simulated GPUs of each kind the scenarios have (issue #47).

    .venv/bin/python bench/bench_nvml_budget.py                      # this checkout
    .venv/bin/python bench/bench_nvml_budget.py --before /tmp/before  # and another, beside it

``--before DIR``: a tree holding an older ``sidecar/`` (e.g. ``git archive COMMIT sidecar | tar -x
-C DIR``), measured the same way in a process of its own with ``DIR`` first on its path: the
before/after table of bench/RESULTS.md. The older tree must time its NVML calls
(``sidecar/sources/nvml/timed.py``, #47's first commit).

Each kind: 8 GPUs behind the stand-in NVML (pynvml's own code runs for every call), opened and
primed, then ``CYCLES`` readings 1 s apart on a simulated clock. The stand-in sleeps NVML's one
documented wait, the 20 ms of ``nvmlDeviceGetPcieThroughput``, for real; every other call costs
what its Python emulation costs, which is not a real driver's time (``bench/gpu_check.py``
records that on a real GPU). Per cycle: the calls made (``timed.totals()`` before and after), the
time inside them summed over calls (what the agent held NVML for; calls made concurrently count
each), the most of that in any one cycle, and the reading's wall time. Targets (issue #47): where
only the throughput fallback gives PCIe rates, at most one throughput call per GPU per 10 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from _report import finish, heading

ROOT = Path(__file__).resolve().parent.parent
GPUS = 8
CYCLES = 40
INTERVAL_S = 1.0
THROUGHPUT_BUDGET_PER_10_S = 1  # calls per GPU
ROUNDS = 3  # interleaved runs of each tree; the median round of each figure is reported


def kinds() -> dict[str, object]:
    """Kind -> its Scenario of 8 GPUs: each generation of the scenarios, with and without the
    sources of PCIe rates a driver may lack."""
    from sidecar.simulate.fake_nvml import OLD_DRIVER_MISSING
    from sidecar.simulate.scenarios import build

    old = build("old-driver", GPUS)
    healthy = build("healthy", GPUS)
    return {
        "Hopper H200, R590: byte counters, GPM": healthy,
        "Hopper H200, R550: no byte counters, PCIe from GPM": replace(
            healthy, gpus=tuple(replace(g, has_pcie_counters=False) for g in healthy.gpus),
            driver_version="550.54.15"),
        "Grace Hopper GH200, R590: C2C from GPM": build("grace-hopper", GPUS),
        "Ampere A100, R590: byte counters, no GPM": replace(
            old, gpus=tuple(replace(g, has_pcie_counters=True) for g in old.gpus),
            missing=frozenset(OLD_DRIVER_MISSING - {"nvmlDeviceGetMemoryInfo_v2"}
                              - {n for n in OLD_DRIVER_MISSING if n.startswith("nvmlGpm")}),
            driver_version="590.44.01"),
        "Ampere A100, R515: throughput fallback only": old,
    }


def measure() -> dict[str, dict[str, float]]:
    """Each kind's figures, measured in this process with whatever ``sidecar`` it imports."""
    from sidecar.simulate import fake_nvml
    try:
        from tests.manual_clock import ManualClock
    except ImportError:  # a tree from before the clock moved out of the stand-in
        from sidecar.simulate.fake_nvml import ManualClock  # type: ignore[attr-defined,no-redef]
    from sidecar.sources.nvml import NvmlSource, timed

    out: dict[str, dict[str, float]] = {}
    for kind, scenario in kinds().items():
        clock = ManualClock()
        fake_nvml.install(scenario.nvml(clock=clock, throughput_blocking=True))
        source = NvmlSource(clock=clock, sleep=clock.advance, interval_s=INTERVAL_S)
        source.open()
        uuids = [d.uuid for d in source.devices()]
        source.read(uuids)  # the priming reading (a run's first, before its first sample)
        per_cycle: list[tuple[int, float, float, int]] = []
        for _ in range(CYCLES):
            clock.advance(INTERVAL_S)
            before = timed.totals()
            began = time.perf_counter()
            source.read(uuids)
            wall = time.perf_counter() - began
            cycle = timed.since(before)
            per_cycle.append((sum(c.calls for c in cycle.values()),
                              sum(c.seconds for c in cycle.values()), wall,
                              cycle.get("nvmlDeviceGetPcieThroughput",
                                        timed.CallTime(0.0, 0)).calls))
        source.close()
        fake_nvml.uninstall()
        throughput = sum(p[3] for p in per_cycle)
        seconds = CYCLES * INTERVAL_S
        out[kind] = {
            "calls": statistics.fmean(p[0] for p in per_cycle),
            "calls_per_gpu": statistics.fmean(p[0] for p in per_cycle) / GPUS,
            "nvml_ms": statistics.fmean(p[1] for p in per_cycle) * 1e3,
            "nvml_max_ms": max(p[1] for p in per_cycle) * 1e3,
            "wall_ms": statistics.median(p[2] for p in per_cycle) * 1e3,
            "throughput_per_gpu_per_10s": throughput / GPUS / (seconds / 10),
        }
    return out


def median_of(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {kind: {k: statistics.median(r[kind][k] for r in rounds) for k in rounds[0][kind]}
            for kind in rounds[0]}


def measured_in(tree: Path) -> dict[str, dict[str, float]]:
    """``measure()`` in a process of its own, ``tree``'s sidecar first on its path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT / "bench")])}
    proc = subprocess.run([sys.executable, __file__, "--json"], capture_output=True, text=True,
                          env=env, cwd=tree, timeout=600, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"measuring {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def commit_of(tree: Path) -> str:
    proc = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)
    return proc.stdout.strip() or tree.name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="a tree with an older sidecar/")
    parser.add_argument("--before-name", help="what to call it in the report (its commit)")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure()))
        return 0
    afters, befores = [], []
    for _ in range(ROUNDS):  # interleaved: a busy machine weighs on both alike
        if args.before:
            befores.append(measured_in(args.before))
        afters.append(measured_in(ROOT))
    after = median_of(afters)
    before = median_of(befores) if befores else None
    lines = [heading("NVML budget: calls and time in NVML per cycle (issue #47)",
                     f"{GPUS} simulated GPUs per kind, {CYCLES} cycles at {INTERVAL_S:g} s on a "
                     "simulated clock, the stand-in sleeping the throughput call's 20 ms"),
             "", "Command: `.venv/bin/python bench/bench_nvml_budget.py"
             + (" --before DIR` (DIR: the sidecar/ of the commit named below)" if before else "`"),
             ""]
    cols = ("calls/cycle", "per GPU", "NVML ms/cycle", "max ms", "wall ms", "throughput calls "
            "/GPU/10 s")
    lines.append("| kind | code | " + " | ".join(cols) + " |")
    lines.append("|---|---|" + "---:|" * len(cols))
    ok = True
    for kind in after:
        rows = ([("before", before[kind])] if before and kind in before else []) + \
            [("after", after[kind])]
        for label, f in rows:
            lines.append(f"| {kind} | {label} | {f['calls']:.1f} | {f['calls_per_gpu']:.1f} | "
                         f"{f['nvml_ms']:.2f} | {f['nvml_max_ms']:.2f} | {f['wall_ms']:.2f} | "
                         f"{f['throughput_per_gpu_per_10s']:.1f} |")
        ok &= after[kind]["throughput_per_gpu_per_10s"] <= THROUGHPUT_BUDGET_PER_10_S
    lines += ["", f"- Target: at most {THROUGHPUT_BUDGET_PER_10_S} throughput call per GPU per "
              "10 s where only the fallback gives PCIe rates."]
    if before:
        lines.append(f"- before: {args.before_name or commit_of(args.before)}; after: this "
                     f"checkout ({commit_of(ROOT)}); each figure the median of {ROUNDS} "
                     "interleaved rounds.")
    return finish(lines, ok)


if __name__ == "__main__":
    sys.exit(main())
