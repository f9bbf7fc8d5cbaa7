"""Journal cost (issue #11): CPU and memory of the agent before and after the open-batch journal.

    .venv/bin/python bench/bench_journal.py [--pairs 5] [--seconds 20] [--skip 5] [--push-intervals 15,2]

"Before" is commit 9713e4a, checked out in a temporary git worktree; "after" is the working tree
of this repository (the journal: each cycle's series appended to a file in the spool). Both run
as users deploy them, with the same interpreter (this virtualenv) and the same command line:

    python -m sidecar run --simulate healthy --simulate-gpus 8 --interval 0.1 --push-interval P
        --remote-write-url <VictoriaMetrics> --spool-dir <fresh per run> --log-format json

into one real VictoriaMetrics. Each run lasts ``--seconds``; the process's CPU time (utime +
stime from /proc/<pid>/stat, all threads) is read at ``--skip`` seconds and at the end, so the
start-up stays out of the window. The cycles in the window are counted from what the run stored
in VictoriaMetrics (one ``gpu_sidecar_up`` sample per cycle), so CPU per cycle is the window's CPU
divided by the cycles it really ran. Peak resident memory is VmHWM from /proc/<pid>/status.

Runs are interleaved, before / after, ``--pairs`` times per push interval (after one unmeasured
run of each to compile bytecode); each side's figure is the median of its runs, and the ratio is
after / before of the medians. Target: CPU per cycle after / before <= 1.10.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from _report import cpu_seconds, finish, heading, status_mib  # noqa: E402

from tests.receivers import VictoriaMetrics  # noqa: E402

BEFORE_COMMIT = "9713e4a"
PYTHON = str(ROOT / ".venv" / "bin" / "python")
INTERVAL = 0.1
GPUS = 8
TARGET = 1.10


@dataclass
class Tree:
    name: str
    path: Path
    env: dict[str, str]

    def check_import(self) -> str:
        """The file ``sidecar`` is imported from, run as the agent is run (cwd and env)."""
        found = subprocess.run([PYTHON, "-c", "import sidecar; print(sidecar.__file__)"],
                               cwd=self.path, env=self.env, capture_output=True, text=True,
                               timeout=30, check=True).stdout.strip()
        if Path(found).resolve() != (self.path / "sidecar" / "__init__.py").resolve():
            raise SystemExit(f"{self.name}: sidecar imported from {found}, not from {self.path}")
        return found


@dataclass
class Run:
    tree: str
    push: float
    cpu_s: float = 0.0
    window: tuple[float, float] = (0.0, 0.0)
    hwm_mib: float = 0.0
    rss_mib: float = 0.0
    journals: bool = False
    rc: int | None = None
    cycles: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.window[1] - self.window[0]

    @property
    def ms_per_cycle(self) -> float:
        return 1000 * self.cpu_s / self.cycles if self.cycles else float("nan")


def source_digest() -> str:
    """What the working tree's sidecar/ holds: another engineer may edit it during the run."""
    h = hashlib.sha256()
    for path in sorted((ROOT / "sidecar").rglob("*.py")):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def tree_state() -> str:
    """HEAD of this repository, and whether sidecar/ differs from it."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "sidecar"],
                           capture_output=True, text=True, check=True).stdout.strip()
    return head + (" + uncommitted edits to sidecar/" if dirty else "")


def run_once(tree: Tree, vm: VictoriaMetrics, push: float, seconds: float, skip: float,
             tmp: Path, n: int) -> Run:
    run = Run(tree.name, push)
    spool = tmp / f"spool-{n:03d}-{tree.name}"
    log = tmp / f"agent-{n:03d}-{tree.name}.log"
    command = [PYTHON, "-m", "sidecar", "run", "--simulate", "healthy", "--simulate-gpus", str(GPUS),
               "--interval", str(INTERVAL), "--push-interval", f"{push:g}",
               "--remote-write-url", vm.write_url, "--spool-dir", str(spool), "--log-format", "json"]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, cwd=tree.path, env=tree.env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    started = time.monotonic()
    try:
        time.sleep(skip)
        if proc.poll() is not None:
            raise RuntimeError(f"{tree.name} exited early:\n{log.read_text()[-2000:]}")
        cpu0, t0 = cpu_seconds(proc.pid), time.time()
        while (left := started + seconds - time.monotonic()) > 0:
            time.sleep(min(0.5, left))
            run.journals = run.journals or any(spool.rglob("*.journal"))
        cpu1, t1 = cpu_seconds(proc.pid), time.time()
        run.hwm_mib, run.rss_mib = status_mib(proc.pid, "VmHWM"), status_mib(proc.pid, "VmRSS")
        run.cpu_s, run.window = cpu1 - cpu0, (t0, t1)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            run.rc = proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            run.rc = proc.wait()
    return run


def up_timestamps(vm: VictoriaMetrics) -> list[float]:
    """Every stored ``gpu_sidecar_up`` timestamp (s), once ingestion stopped moving."""
    last: list[float] | None = None
    for _ in range(30):
        requests.get(f"{vm.base}/internal/force_flush", timeout=10)
        r = requests.post(f"{vm.base}/api/v1/export", data={"match[]": "gpu_sidecar_up"}, timeout=30)
        r.raise_for_status()
        found = sorted(ts / 1000 for line in r.text.splitlines() if line.strip()
                       for ts in json.loads(line)["timestamps"])
        if found == last:
            return found
        last = found
        time.sleep(1.0)
    return last or []


def median(values: list[float]) -> float:
    return statistics.median(values)


def report(runs: list[Run], pushes: list[float], args: argparse.Namespace, digests: tuple[str, str],
           states: tuple[str, str]) -> tuple[list[str], bool]:
    lines = [
        heading("Journal cost (issue #11)", f"{GPUS} simulated GPUs, {INTERVAL:g} s sampling, "
                f"{args.pairs} interleaved pairs per push interval, window {args.skip:g}..{args.seconds:g} s "
                "of each run"),
        "",
        "Command: `.venv/bin/python bench/bench_journal.py "
        f"--pairs {args.pairs} --seconds {args.seconds:g} --skip {args.skip:g} "
        f"--push-intervals {','.join(f'{p:g}' for p in pushes)}`",
        "",
        f"| push interval | measure | before ({BEFORE_COMMIT}) | after (working tree) "
        "| after / before | target |",
        "|---|---|---|---|---|---|",
    ]
    ok = True
    for push in pushes:
        side = {name: [r for r in runs if r.tree == name and r.push == push]
                for name in ("before", "after")}
        b, a = side["before"], side["after"]
        cpu_b, cpu_a = median([r.ms_per_cycle for r in b]), median([r.ms_per_cycle for r in a])
        ratio = cpu_a / cpu_b
        met = ratio <= TARGET
        ok = ok and met
        pairs = sorted(round(ra.ms_per_cycle / rb.ms_per_cycle, 3) for rb, ra in zip(b, a, strict=True))
        pct_b = median([100 * r.cpu_s / r.seconds for r in b])
        pct_a = median([100 * r.cpu_s / r.seconds for r in a])
        hwm_b, hwm_a = median([r.hwm_mib for r in b]), median([r.hwm_mib for r in a])
        cyc_b, cyc_a = median([r.cycles for r in b]), median([r.cycles for r in a])
        spread_b = f"{min(r.ms_per_cycle for r in b):.3f}..{max(r.ms_per_cycle for r in b):.3f}"
        spread_a = f"{min(r.ms_per_cycle for r in a):.3f}..{max(r.ms_per_cycle for r in a):.3f}"
        p = f"{push:g} s"
        lines += [
            f"| {p} | **CPU per cycle** (process utime+stime / cycles stored), median | "
            f"{cpu_b:.3f} ms ({spread_b}) | {cpu_a:.3f} ms ({spread_a}) | **{ratio:.3f}** | "
            f"<= {TARGET:.2f}: {'met' if met else '**missed**'} |",
            f"| {p} | per-pair ratios, sorted | - | - | {', '.join(f'{x:.3f}' for x in pairs)} | - |",
            f"| {p} | CPU, share of one core over the window, median | {pct_b:.2f} % | {pct_a:.2f} % | "
            f"{pct_a / pct_b:.3f} | - |",
            f"| {p} | cycles in the window, median | {cyc_b:g} | {cyc_a:g} | - | - |",
            f"| {p} | peak RSS (VmHWM), median | {hwm_b:.1f} MiB | {hwm_a:.1f} MiB | {hwm_a / hwm_b:.3f} "
            f"| - |",
        ]
    lines.append("")
    journals = {name: {r.journals for r in runs if r.tree == name} for name in ("before", "after")}
    rcs = sorted({r.rc for r in runs}, key=str)
    lines.append(f"- journal files seen in the spool during the run: before {sorted(journals['before'])}, "
                 f"after {sorted(journals['after'])}; exit codes after SIGTERM: {rcs}")
    moved = f", at the end {states[1]}" if states[1] != states[0] else ""
    lines.append(f"- after = the working tree: at the start {states[0]}{moved}; sidecar/ content "
                 f"{digests[0]} at the start, {digests[1]} at the end")
    if digests[0] != digests[1]:
        lines.append(f"- **sidecar/ of the working tree changed during the benchmark** "
                     f"({digests[0]} -> {digests[1]}): the after runs did not all run the same code")
    for r in runs:
        lines += [f"- {r.tree} push {r.push:g} s: {note}" for note in r.notes]
    return lines, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=5, help="before/after pairs per push interval")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each run (default 20)")
    parser.add_argument("--skip", type=float, default=5.0,
                        help="start of the measured window, seconds into a run (default 5)")
    parser.add_argument("--push-intervals", default="15,2",
                        help="push intervals in seconds, each measured separately (default 15,2)")
    args = parser.parse_args()
    pushes = [float(p) for p in args.push_intervals.split(",") if p.strip()]
    state0 = tree_state()

    with tempfile.TemporaryDirectory(prefix="bench-journal-") as tmp_name:
        tmp = Path(tmp_name)
        before_path = tmp / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before_path),
                        BEFORE_COMMIT], check=True, capture_output=True)
        vm = VictoriaMetrics(tmp)
        try:
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
            before = Tree("before", before_path, {**env, "PYTHONPATH": str(before_path)})
            after = Tree("after", ROOT, env)
            for tree in (before, after):
                print(f"{tree.name}: sidecar from {tree.check_import()}", file=sys.stderr)
            digest0 = source_digest()
            vm.start()
            runs: list[Run] = []
            n = 0
            for push in pushes:
                for tree in (before, after):  # unmeasured: bytecode compiled, page cache warm
                    n += 1
                    run_once(tree, vm, push, args.skip + 1, args.skip, tmp, n)
                for i in range(args.pairs):
                    for tree in (before, after):
                        n += 1
                        run = run_once(tree, vm, push, args.seconds, args.skip, tmp, n)
                        runs.append(run)
                        print(f"push {push:g} pair {i + 1}: {tree.name} cpu {run.cpu_s:.2f} s over "
                              f"{run.seconds:.1f} s, hwm {run.hwm_mib:.1f} MiB, rc {run.rc}",
                              file=sys.stderr)
            stamps = up_timestamps(vm)
            for run in runs:
                t0, t1 = run.window
                run.cycles = sum(t0 < t <= t1 for t in stamps)
                expected = run.seconds / INTERVAL
                if abs(run.cycles - expected) > 0.05 * expected:
                    run.notes.append(f"{run.cycles} cycles stored for a {run.seconds:.1f} s window "
                                     f"(expected about {expected:.0f})")
            digest1, state1 = source_digest(), tree_state()
        finally:
            vm.stop()
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before_path)],
                           check=False, capture_output=True)

    lines, ok = report(runs, pushes, args, (digest0, digest1), (state0, state1))
    return finish(lines, ok, f"Target met (CPU per cycle after / before <= {TARGET:.2f} at every push "
                             "interval measured)")


if __name__ == "__main__":
    raise SystemExit(main())
