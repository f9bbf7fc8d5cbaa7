"""The real-GPU check of shared/GPU-CHECK.md, as one prepared script (not run by CI).

On a machine with an NVIDIA GPU, torch, nvidia-ml-py and requests (the lent H200 has those), and
the other dependencies carried as wheels (structlog, tenacity, cramjam), from the repo root:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:. python3 bench/gpu_check.py --out "$OUT"

It writes ``gpu_check.json`` (and ``fixtures.json``: a real ``memory_stats()`` and a trimmed
``memory_snapshot()`` for the tests) under ``--out`` and prints a table last. Steps:

1. probe: what this GPU and driver support (GPM included?), against ``nvidia-smi``'s link;
2. PCIe truth: pinned host-to-device copies timed with CUDA events vs the agent's RX rate;
3. compute truth: a bf16 matmul loop vs a loop of tiny kernels: occupancy and tensor activity;
4. allocator truth: a fragmenting workload published through sidecar.client, compared with
   ``torch.cuda.memory_stats()`` at the same moment;
5. overhead: the agent's CPU seconds and peak RSS over a minute of 1 s sampling.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def nvidia_smi_link() -> dict:
    fields = "pcie.link.gen.max,pcie.link.width.max,pcie.link.gen.current,name,driver_version"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)}
    first = [x.strip() for x in out.splitlines()[0].split(",")]
    return dict(zip(fields.split(","), first, strict=False))


def step_probe(source, uuid: str) -> dict:
    return {"capabilities": source.capabilities(uuid), "absent": source.absent(uuid),
            "driver": source.driver_version, "nvidia_smi": nvidia_smi_link()}


def sample_during(source, uuid: str, fn, seconds: float) -> tuple[dict, object]:
    """Run ``fn`` for ``seconds`` between two agent readings; the second is the interval's
    average (GPM) or rate (counters)."""
    source.read([uuid])
    result = fn(seconds)
    reading = source.read([uuid])[uuid]
    return result, reading


def step_pcie(torch, source, uuid: str) -> dict:
    size = 1 << 30
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")

    def copies(seconds: float) -> dict:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = 0
        t0 = time.monotonic()
        start.record()
        while time.monotonic() - t0 < seconds:
            dev.copy_(host, non_blocking=True)
            n += 1
            torch.cuda.synchronize()
        end.record()
        torch.cuda.synchronize()
        return {"bytes": n * size, "seconds": start.elapsed_time(end) / 1000}

    timing, reading = sample_during(source, uuid, copies, 3.0)
    copy_rate = timing["bytes"] / timing["seconds"]
    io = reading.io if reading else None
    return {"copy_bytes_per_second": copy_rate,
            "agent_rx_bytes_per_second": io.pcie_rx_bytes_per_second if io else None,
            "agent_over_copy": (io.pcie_rx_bytes_per_second / copy_rate)
            if io and io.pcie_rx_bytes_per_second else None,
            "link_max_bytes_per_second": io.pcie_link_max_bytes_per_second if io else None,
            "link_generation": io.pcie_link_generation if io else None,
            "link_width": io.pcie_link_width if io else None}


def step_compute(torch, source, uuid: str) -> dict:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    small = torch.zeros(256, device="cuda")

    def matmuls(seconds: float) -> int:
        n, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < seconds:
            a @ b
            n += 1
            if n % 20 == 0:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return n

    def tiny(seconds: float) -> int:
        n, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < seconds:
            small.add_(1)
            n += 1
        torch.cuda.synchronize()
        return n

    out = {}
    for name, fn in (("matmul_bf16", matmuls), ("tiny_kernels", tiny)):
        n, reading = sample_during(source, uuid, fn, 3.0)
        c = reading.compute if reading else None
        out[name] = {"launches": n,
                     "sm_occupancy_ratio": c.sm_occupancy_ratio if c else None,
                     "tensor_core_util_ratio": c.tensor_core_util_ratio if c else None,
                     "sm_active_ratio": c.sm_active_ratio if c else None,
                     "utilization_ratio": c.utilization_ratio if c else None}
    return out


def step_allocator(torch, uuid: str, out_dir: Path) -> dict:
    from sidecar.app_socket import AppSocket, AppState
    from sidecar.client import Publisher

    tmp = Path(tempfile.mkdtemp())
    state = AppState()
    app = AppSocket(str(tmp / "app.sock"), state)
    app.start()
    keep = []
    for i in range(400):  # varied sizes, every other one freed: a fragmented cache
        t = torch.empty((1 + (i * 7919) % 97) * (1 << 18), dtype=torch.uint8, device="cuda")
        if i % 2:
            keep.append(t)
        del t
    pub = Publisher(str(tmp / "app.sock"), snapshot_interval_s=0)
    t0 = time.perf_counter()
    snapshot = torch.cuda.memory_snapshot()
    snapshot_s = time.perf_counter() - t0
    pub.publish()
    stats = torch.cuda.memory_stats()
    time.sleep(0.5)
    figures = state.figures(uuid).allocators
    app.stop()
    fig = figures[0] if figures else None
    (out_dir / "fixtures.json").write_text(json.dumps({
        "memory_stats": stats,
        "memory_snapshot": [{**s, "blocks": [{k: v for k, v in b.items() if k != "frames"}
                                             for b in s.get("blocks", [])[:50]]}
                            for s in snapshot[:20]],
    }, default=str, indent=1))
    return {
        "published_reserved": fig.reserved_bytes if fig else None,
        "torch_reserved": stats.get("reserved_bytes.all.current"),
        "published_allocated": fig.allocated_bytes if fig else None,
        "torch_allocated": stats.get("allocated_bytes.all.current"),
        "published_inactive_split": fig.inactive_split_bytes if fig else None,
        "torch_inactive_split": stats.get("inactive_split_bytes.all.current"),
        "largest_free_block": fig.largest_free_block_bytes if fig else None,
        "snapshot_seconds": snapshot_s,
        "snapshot_blocks": sum(len(s.get("blocks", ())) for s in snapshot),
        "uuid_matches": bool(fig),
    }


def step_overhead(out_dir: Path) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "sidecar", "run", "--gpus", "visible",
                             "--interval", "1", "--output", "json", "--socket",
                             str(Path(tempfile.mkdtemp()) / "app.sock")],
                            stdout=(out_dir / "agent-minute.jsonl").open("w"),
                            stderr=(out_dir / "agent-minute.log").open("w"), cwd=ROOT, env=env)
    peak = 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = 0.0
    stop = time.monotonic() + 60
    while time.monotonic() < stop and proc.poll() is None:
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                peak = max(peak, int(line.split()[1]) / 1024)
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / ticks
        time.sleep(1)
    proc.terminate()
    proc.wait(timeout=30)
    return {"cpu_seconds_per_minute": cpu, "peak_rss_mib": peak, "exit_code": proc.returncode}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import torch

    from sidecar.log import configure
    from sidecar.nvml_source import NvmlSource

    configure("json", "warning")
    report: dict = {"torch": torch.__version__}
    source = NvmlSource()
    source.open()
    torch.cuda.init()
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    uuid = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    names = {d.uuid: d for d in source.devices()}
    report["gpu"] = {"uuid": uuid, "name": names[uuid].name if uuid in names else "?"}
    steps = [("probe", lambda: step_probe(source, uuid)),
             ("pcie", lambda: step_pcie(torch, source, uuid)),
             ("compute", lambda: step_compute(torch, source, uuid)),
             ("allocator", lambda: step_allocator(torch, uuid, out_dir)),
             ("overhead", lambda: step_overhead(out_dir))]
    for name, fn in steps:
        t0 = time.monotonic()
        try:
            report[name] = fn()
        except Exception as exc:  # one failing step must not cost the others
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        report[name]["_seconds"] = round(time.monotonic() - t0, 1)
        (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    source.close()
    print(json.dumps(report, indent=1, default=str)[-6000:])
    return 0


if __name__ == "__main__":
    threading.excepthook = lambda args: None
    raise SystemExit(main())
