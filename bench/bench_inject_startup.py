"""What the injected publisher costs an app's interpreter: start-up, and the import of torch.

The files are placed as the agent places them (``sidecar.inject.placement``), and no bytecode is
written (PYTHONDONTWRITEBYTECODE): in a pod the directory is mounted read-only, so
``sitecustomize.py`` is compiled at every start, and the publisher module at ``import torch``.
Each interpreter found (3.9 to 3.13) is started again and again, the variants interleaved so
that a drift of the machine hits them alike, and the medians are compared:

- ``python -c pass``, wall time, with PYTHONPATH unset, with PYTHONPATH naming an empty
  directory (what any extra entry costs), and with the placed directory (the injection);
- ``python -X importtime -c pass``: the outer ``sitecustomize`` line's cumulative microseconds
  (reading, compiling or loading the bytecode, running it, and the chained lookup);
- the stand-in torch's ``import torch`` (tests/standins/), with and without the injection: the
  publisher module is loaded then (compiled: no ``__pycache__``), its start queued with torch;
- ``torch.cuda.init()`` of the stand-in, timed inside the process, with and without the
  injection: what the queued call (the publisher's thread started) adds to CUDA's initialisation;
- the import watcher's cost on every import of a module not yet imported (one more entry of
  ``sys.meta_path`` asked first): its ``find_spec``, timed with timeit in the injected process.

    python bench/bench_inject_startup.py [--runs 200] [--json out.json]

Waits while /tmp/bench_running exists (another benchmark on the machine).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sidecar import config  # noqa: E402
from sidecar.inject import placement  # noqa: E402

STANDINS = ROOT / "tests" / "standins"
BUSY = Path("/tmp/bench_running")


def wait_for_quiet() -> None:
    while BUSY.exists():
        print("waiting: /tmp/bench_running exists", file=sys.stderr, flush=True)
        time.sleep(60)


def interpreters() -> list[str]:
    found = {}
    candidates = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.*/bin/python3")))
    candidates.append(getattr(sys, "_base_executable", sys.executable))
    for exe in candidates:
        try:
            out = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out and (3, 9) <= tuple(map(int, out.split("."))) <= (3, 13):
            found.setdefault(out, exe)
    return [found[v] for v in sorted(found, key=lambda v: tuple(map(int, v.split("."))))]


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/")
    elapsed = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed: {proc.stderr[-500:]}")
    return elapsed, proc.stderr


def sitecustomize_us(stderr: str) -> int:
    """The cumulative time of the outer ``sitecustomize`` import (ours, which imports the
    image's, if any, inside it)."""
    found = [int(m.group(1)) for m in (re.match(r"import time:\s+\d+ \|\s+(\d+) \|\s+sitecustomize$",
                                                line) for line in stderr.splitlines()) if m]
    return max(found, default=0)


CUDA_INIT = ("import time, torch\nt = time.perf_counter()\ntorch.cuda.init()\n"
             "print(time.perf_counter() - t)")
WATCHER = ("import sys, timeit\n"
           "f = sys.meta_path[0].find_spec\n"
           "assert type(sys.meta_path[0]).__name__ == 'GpuSidecarWatch'\n"
           "n = 200000\n"
           "t = min(timeit.repeat('f(\\'json.decoder\\', None, None)', globals={'f': f},\n"
           "                      number=n, repeat=5))\n"
           "print(t / n * 1e9)")


def run(exe: str, runs: int, placed: Path, empty: Path) -> dict:
    # no bytecode written: in a pod the placed directory is mounted read-only, so its files are
    # compiled at every start (as root here, the 0555 mode alone would not stop Python)
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GPU_SIDECAR_SOCKET": "/nonexistent",
            "TORCH_STANDIN_GPUS": "GPU-0c4b24ac-fb68-413f-6f0c-54be2b5a94c7",
            "PYTHONDONTWRITEBYTECODE": "1"}
    variants = {
        "bare": dict(base),
        "empty entry": {**base, "PYTHONPATH": str(empty)},
        "injected": {**base, "PYTHONPATH": str(placed)},
        "injected, off": {**base, "PYTHONPATH": str(placed), "GPU_SIDECAR_INJECT": "false"},
    }
    torch_env = {"bare": {**base, "PYTHONPATH": str(STANDINS)},
                 "injected": {**base, "PYTHONPATH": f"{placed}{os.pathsep}{STANDINS}"}}
    wall = {k: [] for k in variants}
    importtime = []
    torch_wall = {k: [] for k in torch_env}
    for _ in range(3):  # warm the page cache
        for env in variants.values():
            timed([exe, "-c", "pass"], env)
    for _ in range(runs):
        for name, env in variants.items():
            wall[name].append(timed([exe, "-c", "pass"], env)[0])
        importtime.append(sitecustomize_us(timed([exe, "-X", "importtime", "-c", "pass"],
                                                 variants["injected"])[1]))
    for _ in range(max(runs // 4, 10)):
        for name, env in torch_env.items():
            torch_wall[name].append(timed([exe, "-c", "import torch"], env)[0])
    init_us = {k: [] for k in torch_env}
    for _ in range(max(runs // 4, 10)):
        for name, env in torch_env.items():
            out = subprocess.run([exe, "-c", CUDA_INIT], env=env, check=True, capture_output=True,
                                 text=True).stdout
            init_us[name].append(float(out) * 1e6)
    watcher_ns = float(subprocess.run([exe, "-c", WATCHER], env=variants["injected"], check=True,
                                      capture_output=True, text=True).stdout)
    version = subprocess.run([exe, "-c", "import platform; print(platform.python_version())"],
                             capture_output=True, text=True).stdout.strip()

    def ms(values: list[float]) -> float:
        return round(statistics.median(values) * 1000, 2)

    return {
        "python": version, "runs": runs,
        "pass_ms": {k: ms(v) for k, v in wall.items()},
        "sitecustomize_importtime_us": int(statistics.median(importtime)),
        "import_torch_standin_ms": {k: ms(v) for k, v in torch_wall.items()},
        "cuda_init_standin_us": {k: round(statistics.median(v)) for k, v in init_us.items()},
        "watcher_ns_per_import": round(watcher_ns),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    wait_for_quiet()
    with tempfile.TemporaryDirectory(prefix="inject-bench-") as tmp:
        tmp_path = Path(tmp)
        cfg = config.Config(socket=str(tmp_path / "run" / "app.sock"))
        placed = placement.place(placement.inject_dir(cfg), placement.render(cfg)).directory
        empty = tmp_path / "empty"
        empty.mkdir()
        for exe in interpreters():  # the stand-in's bytecode, once
            subprocess.run([exe, "-c", "import torch"], check=True, env={
                "PYTHONPATH": str(STANDINS), "PATH": os.environ.get("PATH", "")})
        # the agent's own Python's bytecode only (hash-checked): the others compile each start
        print("placed bytecode:", sorted(os.listdir(placed / "__pycache__")), flush=True)
        results = []
        for exe in interpreters():
            wait_for_quiet()
            r = run(exe, args.runs, placed, empty)
            results.append(r)
            print(json.dumps(r), flush=True)
    print("\n| Python | `-c pass` bare | empty entry | injected | injected, off | "
          "sitecustomize (-X importtime) | `import torch` (stand-in) bare / injected | "
          "`torch.cuda.init()` (stand-in) bare / injected | watcher per import |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        p, t = r["pass_ms"], r["import_torch_standin_ms"]
        print(f"| {r['python']} | {p['bare']} ms | {p['empty entry']} ms | {p['injected']} ms | "
              f"{p['injected, off']} ms | {r['sitecustomize_importtime_us']} µs | "
              f"{t['bare']} / {t['injected']} ms | {r['cuda_init_standin_us']['bare']} / "
              f"{r['cuda_init_standin_us']['injected']} µs | {r['watcher_ns_per_import']} ns |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
