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

With ``--real-torch`` (issue #37) it measures instead, with this venv's Python and the real
PyTorch installed in it (2.13.0, a CPU build), the placed publisher on ``PYTHONPATH`` and
``GPU_SIDECAR_SOCKET`` naming a socket this benchmark binds, as the k8s component sets up an
app container:

- ``import torch`` wall time with and without the injection, interleaved, medians of
  ``--torch-runs`` (at least 20). Target: within 2 % and within 20 ms of without;
- the publisher thread's CPU per publish, with the stand-in CUDA (tests/standins/torch: real
  torch has no CUDA here): an app that initialises CUDA on 2 stand-in GPUs and allocates, the
  placed interval 1 s; the thread's CPU from /proc/<pid>/task/<tid>/schedstat over a window,
  divided by the rounds the bound socket received in it;
- a storm of 300 short-lived ``python -c pass`` processes (16 at a time), with and without the
  injection, interleaved storms: each storm's total wall time, and the median process's;
- threads and file descriptors of ``python -c "import torch, time; time.sleep(1)"`` (it
  prints a line once torch is imported, then sleeps) with and without the injection, counted
  from /proc while it sleeps. Target: no thread, file or socket more in a process that never
  initialises CUDA.

    python bench/bench_inject_startup.py --real-torch [--torch-runs 30] [--results FILE]

``--results FILE`` writes the real-torch report into FILE's section "Injected publisher with
real torch" (from its heading to its "Checks:" line and the verdict line after it).

Waits while /tmp/bench_running exists (another benchmark on the machine).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _report import finish, heading, replace_section, section, stop, wait_until  # noqa: E402

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


# -- with the real torch (issue #37) -----------------------------------------------------------

TORCH_RATIO = 1.02  # import torch injected: within 2 % of without...
TORCH_EXTRA_S = 0.020  # ...and within 20 ms
STORM = 300
STORM_PARALLEL = 16
PUBLISH_WINDOW_S = 30.0
STANDIN_GPUS = ("GPU-0c4b24ac-fb68-413f-6f0c-54be2b5a94c7,"
                "GPU-5d8a2b1e-3c4f-4e6a-9b7c-8d9e0f1a2b3c")

# an app on the stand-in CUDA: initialises it, allocates on both GPUs, says its publisher
# thread's native id, and holds its memory until the file named by its argument exists
PUBLISHING_APP = r"""
import os, sys, threading, time
import torch
torch.cuda.init()
held = [torch.empty(n << 20, dtype=torch.uint8, device=f"cuda:{d}")
        for d in (0, 1) for n in (3, 7, 3, 12, 5)]
del held[::2]
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    found = [t for t in threading.enumerate() if t.name == "gpu-sidecar-inject"]
    if found:
        print(found[0].native_id, flush=True)
        break
    time.sleep(0.01)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
"""
SLEEPER = "import torch, time; print('imported', flush=True); time.sleep(1)"


def schedstat_s(pid: int, tid: int) -> float:
    """CPU seconds of one thread (/proc/<pid>/task/<tid>/schedstat, in ns)."""
    return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9


def drain(sock: socket.socket) -> list[dict]:
    """Every datagram waiting on ``sock``, parsed."""
    out = []
    while True:
        try:
            out.append(json.loads(sock.recv(65536)))
        except BlockingIOError:
            return out


def torch_env(placed: Path | None, sock_path: Path, extra: str = "") -> dict[str, str]:
    """An app container's environment: with ``placed``, what the k8s component adds."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/"),
           "PYTHONDONTWRITEBYTECODE": "1"}
    paths = [str(p) for p in (placed, extra) if p]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    if placed is not None:
        env["GPU_SIDECAR_SOCKET"] = str(sock_path)
    return env


def import_torch(runs: int, envs: dict[str, dict[str, str]]) -> dict[str, list[float]]:
    wall: dict[str, list[float]] = {k: [] for k in envs}
    for env in envs.values():  # warm the page cache
        timed([sys.executable, "-c", "import torch"], env)
    for _ in range(runs):
        for name, env in envs.items():
            wall[name].append(timed([sys.executable, "-c", "import torch"], env)[0])
    return wall


def publish_cost(placed: Path, sock: socket.socket, sock_path: Path, tmp: Path) -> dict:
    """The publisher thread's CPU per round it sent, in an app on the stand-in CUDA."""
    env = torch_env(placed, sock_path, str(STANDINS))
    env["TORCH_STANDIN_GPUS"] = STANDIN_GPUS
    release = tmp / "release"
    app = subprocess.Popen([sys.executable, "-c", PUBLISHING_APP, str(release)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp)
    try:
        tid = int(app.stdout.readline() or 0)
        if not tid:
            raise RuntimeError(f"the app named no publisher thread: {app.stderr.read()[-2000:]}")
        got: list[dict] = []

        def first_round() -> bool:
            got.extend(drain(sock))
            return any(m.get("kind") == "round" for m in got)

        wait_until(first_round, 30, "the publisher's first round")
        drain(sock)
        cpu0, t0 = schedstat_s(app.pid, tid), time.monotonic()
        # read as the agent does, all along: the socket's queue holds only
        # net.unix.max_dgram_qlen datagrams (10 here), and the publisher drops a round it cannot
        # queue, so a window left unread would count too few rounds
        sent: list[dict] = []
        while time.monotonic() - t0 < PUBLISH_WINDOW_S:
            time.sleep(0.1)
            sent.extend(drain(sock))
        cpu1, t1 = schedstat_s(app.pid, tid), time.monotonic()
        sent.extend(drain(sock))
        rounds = sum(1 for m in sent if m.get("kind") == "round")
        release.touch()
        app.wait(timeout=30)
        return {"cpu_s": cpu1 - cpu0, "window_s": t1 - t0, "rounds": rounds,
                "hellos": sum(1 for m in sent if m.get("kind") == "hello"),
                "gpus": sorted({g for m in sent for g in m.get("gpus", ())}),
                "per_round_us": (cpu1 - cpu0) / rounds * 1e6 if rounds else float("nan")}
    finally:
        release.touch()
        stop(app)


def storm(env: dict[str, str]) -> tuple[float, list[float]]:
    """``STORM`` short-lived ``python -c pass``, ``STORM_PARALLEL`` at a time: total wall and
    each process's."""
    t = time.perf_counter()
    with ThreadPoolExecutor(STORM_PARALLEL) as pool:
        each = list(pool.map(lambda _: timed([sys.executable, "-c", "pass"], env)[0],
                             range(STORM)))
    return time.perf_counter() - t, each


def at_rest(env: dict[str, str]) -> dict:
    """Threads and descriptors of a process that imported torch and sleeps (no CUDA)."""
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd="/")
    try:
        if proc.stdout.readline().strip() != "imported":
            raise RuntimeError("the sleeper did not import torch")
        tasks = sorted(Path(f"/proc/{proc.pid}/task").iterdir())
        fds = []
        for fd in Path(f"/proc/{proc.pid}/fd").iterdir():
            with contextlib.suppress(OSError):  # the listing's own descriptor, gone
                fds.append(re.sub(r"\[\d+\]$", "", os.readlink(fd)))  # pipe:[inode]
        return {"threads": len(tasks), "fds": sorted(fds)}
    finally:
        proc.wait(timeout=30)


def real_torch(runs: int) -> tuple[list[str], bool]:
    import torch

    with tempfile.TemporaryDirectory(prefix="inject-bench-torch-") as tmp:
        tmp_path = Path(tmp)
        sock_path = tmp_path / "run" / "app.sock"
        cfg = config.Config(socket=str(sock_path), interval=1.0)
        placed = placement.place(placement.inject_dir(cfg), placement.render(cfg)).directory
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(sock_path))
        sock.setblocking(False)
        try:
            envs = {"without": torch_env(None, sock_path),
                    "injected": torch_env(placed, sock_path)}
            wall = import_torch(runs, envs)
            print(f"import torch: {json.dumps(wall)}", file=sys.stderr, flush=True)
            pub = publish_cost(placed, sock, sock_path, tmp_path)
            print(f"publish: {pub}", file=sys.stderr, flush=True)
            storms: dict[str, list[tuple[float, list[float]]]] = {k: [] for k in envs}
            for _ in range(3):
                for name, env in envs.items():
                    storms[name].append(storm(env))
            rest = {name: at_rest(env) for name, env in envs.items()}
            sent_at_rest = drain(sock)
        finally:
            sock.close()

    def ms(values: list[float]) -> float:
        return statistics.median(values) * 1000

    without, injected = ms(wall["without"]), ms(wall["injected"])
    torch_ok = (injected <= without * TORCH_RATIO and injected - without <= TORCH_EXTRA_S * 1000)
    rest_ok = (rest["injected"]["threads"] == rest["without"]["threads"]
               and rest["injected"]["fds"] == rest["without"]["fds"] and not sent_at_rest)

    def runs_of(values: list[float]) -> str:
        return ", ".join(f"{v * 1000:.0f}" for v in values)

    total = {k: [t for t, _ in storms[k]] for k in storms}
    each = {k: ms([x for _, e in storms[k] for x in e]) for k in storms}
    fds = {k: len(rest[k]["fds"]) for k in rest}

    def v(ok: bool) -> str:
        return "met" if ok else "**MISSED**"

    lines = [
        heading("Injected publisher with real torch (issue #37, bench_inject_startup.py "
                "--real-torch)", f"torch {torch.__version__}, {runs} interleaved runs"),
        "",
        "| measure | without the injection | injected | difference | target | verdict |",
        "|---|---|---|---|---|---|",
        f"| `import torch`, wall, median of {runs} | {without:.1f} ms | {injected:.1f} ms | "
        f"{injected - without:+.1f} ms ({(injected / without - 1) * 100:+.1f} %) | within "
        f"{(TORCH_RATIO - 1) * 100:.0f} % and {TORCH_EXTRA_S * 1000:.0f} ms | {v(torch_ok)} |",
        f"| a process that imports torch and sleeps (never initialises CUDA): threads | "
        f"{rest['without']['threads']} | {rest['injected']['threads']} | "
        f"{rest['injected']['threads'] - rest['without']['threads']:+d} | none more | "
        f"{v(rest['injected']['threads'] == rest['without']['threads'])} |",
        f"| the same: open descriptors (files, sockets, pipes) | {fds['without']} | "
        f"{fds['injected']} | {fds['injected'] - fds['without']:+d} | none more | "
        f"{v(rest['injected']['fds'] == rest['without']['fds'])} |",
        f"| storm of {STORM} `python -c pass`, {STORM_PARALLEL} at a time: total wall, median of "
        f"3 storms (each) | {ms(total['without']):.0f} ms ({runs_of(total['without'])}) | "
        f"{ms(total['injected']):.0f} ms ({runs_of(total['injected'])}) | "
        f"{ms(total['injected']) - ms(total['without']):+.0f} ms | - | - |",
        f"| the same: one process's wall, median of {3 * STORM} | {each['without']:.1f} ms | "
        f"{each['injected']:.1f} ms | {each['injected'] - each['without']:+.1f} ms | - | - |",
        "",
        f"Publisher thread with the stand-in CUDA (2 GPUs, placed interval 1 s): "
        f"{pub['cpu_s'] * 1000:.1f} ms of CPU over {pub['window_s']:.1f} s and {pub['rounds']} "
        f"rounds ({pub['hellos']} hellos): **{pub['per_round_us']:.0f} µs per publish** "
        f"(schedstat of its thread; at the default 5 s interval, "
        f"{pub['per_round_us'] / 5 / 1000:.3f} mCPU).",
        "",
        f"Checks: descriptors without {rest['without']['fds']}, injected "
        f"{rest['injected']['fds']}; datagrams from the sleeping processes: "
        f"{len(sent_at_rest)}; the publisher's rounds named {pub['gpus']}.",
    ]
    return lines, torch_ok and rest_ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--real-torch", action="store_true",
                        help="measure with this venv's real torch instead (issue #37)")
    parser.add_argument("--torch-runs", type=int, default=30)
    parser.add_argument("--results", type=Path, metavar="FILE",
                        help="with --real-torch: also write the report into FILE's section")
    args = parser.parse_args()
    wait_for_quiet()
    if args.real_torch:
        if args.torch_runs < 20:
            parser.error("--torch-runs: at least 20 (medians of at least 20 each)")
        lines, ok = real_torch(args.torch_runs)
        if args.results is not None:
            replace_section(args.results, section(lines, ok),
                            "Injected publisher with real torch", last="Checks:")
        return finish(lines, ok)
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
