"""The real-GPU check of docs/gpu-check.md, as one prepared script (not run by CI).

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
   ``torch.cuda.memory_stats()`` at the same moment; and five ``memory_snapshot()`` calls timed,
   to judge the client's snapshot interval;
5. NVML facts the tests take on trust from the stand-in (``sidecar/simulate/fake_nvml.py``),
   read with pynvml directly: the value types of the PCIe byte counters (197/198) and NVLink
   fields, and the PCIe path the agent chose from them; whether
   ``nvmlDeviceGetPcieThroughput`` counts KB or KiB (against the byte counter during a copy
   loop; NVLink's per-link unit too when two peer GPUs are visible); on a GPU already in MIG
   mode (never switched), what a MIG instance's own handle answers;
6. health: every NVML field and call the health layer reads (id, value type, value, return
   code), the clock-event nanosecond counters over one second of matmuls (a share must lie in
   0..1), an Xid event set created, registered and waited on for 0.1 s (TIMEOUT expected), and
   the agent's own health and C2C reading beside them;
7. overhead: the agent's CPU seconds and peak RSS over a minute of 1 s sampling;
8. injection (issue #25): a real agent places the injected publisher; a script that imports
   nothing of ours, started with only PYTHONPATH=<the placed directory> and the socket path,
   allocates in a fragmenting pattern with real torch; the figures in the agent's output
   against that script's ``torch.cuda.memory_stats()`` and ``memory_snapshot()``, how long
   after CUDA's initialisation they first appeared, the app's stderr (must be empty), and
   ``import torch`` and CUDA's initialisation timed with and without the injection;
9. NVML time (issue #47): the real driver's time per NVML call, measured by the agent's own
   wrapper over 20 agent readings of every GPU (per call: count, seconds, mean; per reading and
   per GPU), and every call the agent's code made in the whole run;
10. GPM beside DCGM: where ``dcgmi`` is on PATH or a dcgm-exporter process runs, the agent's GPM
   readings and DCGM's profiling fields (``dcgmi dmon -e 1002,1003,1004``, or dcgm-exporter's
   ``DCGM_FI_PROF_`` samples) read at the same time: both must succeed; skipped, saying why,
   where neither runs or the GPU has no GPM.

``--dcgm-only`` runs the DCGM presence check alone (no torch, no GPU needed): what step 10 would
find on this machine.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml

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
    from sidecar.client import Publisher
    from sidecar.sources.app_socket import AppSocket, AppState

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
    # the client takes a snapshot every snapshot_interval_s: its cost, taken a few times because
    # the first call may pay one-off set-up, says how often that can be afforded
    snapshot_s = []
    for _ in range(5):
        t0 = time.perf_counter()
        snapshot = torch.cuda.memory_snapshot()
        snapshot_s.append(time.perf_counter() - t0)
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
        "snapshot_seconds_median": statistics.median(snapshot_s),
        "snapshot_seconds_max": max(snapshot_s),
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


# -- step 8: the injected publisher against real torch ---------------------------------------------

INJECTED_APP = r'''
import json, os, sys, threading, time
import torch  # nothing of gpu-sidecar: the injection alone publishes
here = sys.argv[1]
t0 = time.time()
torch.cuda.set_device(0)
keep = []
for i in range(400):  # varied sizes, every other one freed: a fragmented cache
    t = torch.empty((1 + (i * 7919) % 97) * (1 << 18), dtype=torch.uint8, device="cuda")
    if i % 2:
        keep.append(t)
    del t
torch.cuda.synchronize()
stats = torch.cuda.memory_stats(0)
largest = max([b["size"] for s in torch.cuda.memory_snapshot() for b in s["blocks"]
               if s["device"] == 0 and b["state"] == "inactive"] or [0])
print(json.dumps({"pid": os.getpid(), "cuda_init": t0,
                  "reserved": stats["reserved_bytes.all.current"],
                  "allocated": stats["allocated_bytes.all.current"],
                  "inactive_split": stats["inactive_split_bytes.all.current"],
                  "largest_free": largest,
                  "threads": sorted(t.name for t in threading.enumerate()),
                  "modules": sorted(m for m in sys.modules if "sidecar" in m)}), flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(here, "release")) and time.monotonic() < deadline:
    time.sleep(0.05)
'''


def _median_run(cmd: list[str], env: dict, runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, env=env, capture_output=True, timeout=300, check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_injection(uuid: str, out_dir: Path) -> dict:
    tmp = Path(tempfile.mkdtemp())
    sock, inject_dir = tmp / "run" / "app.sock", tmp / "run" / "python"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("GPU_SIDECAR_")}
    agent = subprocess.Popen([sys.executable, "-m", "sidecar", "run", "--gpus", "announced",
                              "--socket", str(sock), "--interval", "1", "--app-process-series",
                              "--stdout", "--output", "json", "--log-format", "json"],
                             stdout=subprocess.PIPE, stderr=(out_dir / "agent-inject.log").open("w"),
                             text=True, cwd=ROOT, env=env)
    rows: list[dict] = []
    threading.Thread(target=lambda: rows.extend(json.loads(line) for line in agent.stdout
                                                if line.startswith("{")), daemon=True).start()
    try:
        deadline = time.monotonic() + 30
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        app_env = {k: v for k, v in os.environ.items()
                   if k not in ("PYTHONPATH",) and not k.startswith("GPU_SIDECAR_")}
        app_env.update({"PYTHONPATH": str(inject_dir), "GPU_SIDECAR_SOCKET": str(sock)})
        script = tmp / "app.py"
        script.write_text(INJECTED_APP)
        app = subprocess.Popen([sys.executable, str(script), str(tmp)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=app_env, cwd=tmp)
        said = json.loads(app.stdout.readline())
        pid = str(said["pid"])

        def agent_says(name: str, gpu: bool = False) -> float | None:
            found = [r for r in rows if r["name"] == name and r["labels"].get("gpu_uuid") == uuid
                     and (gpu or r["labels"].get("pid") == pid)]
            return float(max(found, key=lambda r: r["timestamp_ms"])["value"]) if found else None

        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and (
                agent_says("gpu_app_process_reserved_bytes") != said["reserved"]
                or agent_says("gpu_allocator_largest_free_block_bytes", gpu=True)
                != said["largest_free"]):
            time.sleep(0.2)
        first = [r["timestamp_ms"] / 1000 for r in rows
                 if r["name"] == "gpu_app_process_reserved_bytes"
                 and r["labels"].get("pid") == pid and r["value"] == said["reserved"]]
        (tmp / "release").touch()
        _, app_err = app.communicate(timeout=60)
        timings = {}
        bare_env = {k: v for k, v in app_env.items() if k != "PYTHONPATH"}
        init = "import torch; torch.cuda.init(); torch.cuda.synchronize()"
        for label, cmd in (("import_torch_s", "import torch"), ("import_and_cuda_init_s", init)):
            timings[label] = {"bare": _median_run([sys.executable, "-c", cmd], bare_env),
                              "injected": _median_run([sys.executable, "-c", cmd], app_env)}
    finally:
        agent.terminate()
        agent.wait(timeout=30)
    return {
        "app": said, "app_stderr": app_err, "app_exit": app.returncode,
        "agent_reserved": agent_says("gpu_app_process_reserved_bytes"),
        "agent_allocated": agent_says("gpu_app_process_allocated_bytes"),
        "agent_largest_free_block": agent_says("gpu_allocator_largest_free_block_bytes", gpu=True),
        "agent_fragmentation": agent_says("gpu_memory_fragmentation_ratio", gpu=True),
        "torch_fragmentation": (said["reserved"] - said["allocated"]) / said["reserved"],
        "first_figures_after_cuda_init_s": (min(first) - said["cuda_init"]) if first else None,
        "matches": agent_says("gpu_app_process_reserved_bytes") == said["reserved"]
        and agent_says("gpu_app_process_allocated_bytes") == said["allocated"],
        "placed": sorted(os.listdir(inject_dir)) if inject_dir.exists() else None,
        **timings,
    }


# -- step 5: NVML facts the stand-in assumes ------------------------------------------------------

FI_TX = pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES  # 197
FI_RX = pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES  # 198
FI_LINKS = pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT
FI_NVL_TX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
FI_NVL_RX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX

VALUE_TYPE_NAMES = {getattr(pynvml, n): n.removeprefix("NVML_VALUE_TYPE_") for n in dir(pynvml)
                    if n.startswith("NVML_VALUE_TYPE_") and n != "NVML_VALUE_TYPE_COUNT"}
# valueType -> (member of the value union, width in bits for counter arithmetic)
VALUE_MEMBERS = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: ("dVal", None),
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: ("uiVal", 32),
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: ("ulVal", 64),
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: ("ullVal", 64),
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: ("sllVal", 63),
    pynvml.NVML_VALUE_TYPE_SIGNED_INT: ("siVal", 31),
    pynvml.NVML_VALUE_TYPE_UNSIGNED_SHORT: ("usVal", 16),
}
# KB and KiB differ by 2.4 %: a unit verdict needs one of the two ratios within half of that of 1
UNIT_TOLERANCE = 0.012


def guarded(fn: Callable[[], Any]) -> Any:
    """Run one sub-check; an exception is recorded in its place so the others still run."""
    try:
        return fn()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def return_name(code: int) -> str:
    if code == pynvml.NVML_SUCCESS:
        return "SUCCESS"
    cls = pynvml.NVMLError._valClassMapping.get(code)
    return cls.__name__ if cls else f"NVML return {code}"


def describe_field(fv: Any) -> dict:
    """Everything a field value says about itself, the value decoded by its own valueType (of
    a failed field the type is left unnamed: NVML need not set it)."""
    member, bits = VALUE_MEMBERS.get(fv.valueType, (None, None))
    ok = fv.nvmlReturn == pynvml.NVML_SUCCESS
    return {"fieldId": fv.fieldId, "scopeId": fv.scopeId, "valueType": fv.valueType,
            "valueTypeName": VALUE_TYPE_NAMES.get(fv.valueType, "?") if ok else None,
            "bits": bits if ok else None,
            "nvmlReturn": fv.nvmlReturn, "nvmlReturnName": return_name(fv.nvmlReturn),
            "value": getattr(fv.value, member) if ok and member else None}


def jsonable(value: Any) -> Any:
    """An NVML call's result as JSON: structures as dicts, field values described."""
    if isinstance(value, (int, float, str)) or value is None:
        return value
    if hasattr(value, "fieldId") and hasattr(value, "valueType"):
        return describe_field(value)
    if hasattr(value, "_fields_"):
        return {name: jsonable(getattr(value, name)) for name, *_ in value._fields_}
    if isinstance(value, (list, tuple, ctypes.Array)):
        return [jsonable(v) for v in value]
    return None  # an opaque handle or sample (a pointer: iterating it would never end)


def attempt(fn: Callable[[], Any]) -> dict:
    """One NVML call's outcome: SUCCESS and its value, or the name of the error it raised."""
    try:
        value = fn()
    except pynvml.NVMLError as exc:
        return {"result": type(exc).__name__, "code": getattr(exc, "value", None)}
    except Exception as exc:
        return {"result": "exception", "error": f"{type(exc).__name__}: {exc}"}
    return {"result": "SUCCESS", "value": jsonable(value)}


def physical_handle(uuid: str) -> Any:
    """The NVML handle of the physical GPU torch's device 0 is on (its parent, for a MIG one)."""
    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    if uuid.startswith("MIG-"):
        handle = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
    return handle


def check_field_types(source, uuid: str) -> dict:
    """The value types the agent's counter arithmetic depends on: 197/198 are assumed 64-bit;
    32-bit ones make ``_counter_fits`` send the agent to GPM instead."""
    handle = physical_handle(uuid)
    fields = {"pcie_tx_bytes_197": FI_TX, "pcie_rx_bytes_198": FI_RX,
              "nvlink_data_tx_link0": (FI_NVL_TX, 0), "nvlink_data_rx_link0": (FI_NVL_RX, 0),
              "nvlink_link_count": FI_LINKS}
    out: dict[str, Any] = {}
    for name, fid in fields.items():  # one call each, so one refused field cannot hide another
        out[name] = guarded(lambda fid=fid: describe_field(
            pynvml.nvmlDeviceGetFieldValues(handle, [fid])[0]))
    caps = source.capabilities(pynvml.nvmlDeviceGetUUID(handle))
    out["agent_pcie_path"] = caps["pcie"]
    out["agent_pcie_note"] = caps.get("pcie_note")
    out["agent_nvlink_path"] = caps["nvlink"]
    return out


class CopyLoop(threading.Thread):
    """Copies ``src`` into ``dst`` back to back until ``halt`` is set, counting the bytes, so
    NVML can be read meanwhile from the main thread while the link is busy."""

    def __init__(self, torch, dst, src) -> None:
        super().__init__(daemon=True)
        self.torch, self.dst, self.src = torch, dst, src
        self.halt = threading.Event()
        self.bytes = 0
        self.seconds = 0.0
        self.error: str | None = None

    def run(self) -> None:
        devices = {t.device for t in (self.dst, self.src) if t.device.type == "cuda"}
        t0 = time.monotonic()
        try:
            while not self.halt.is_set():
                self.dst.copy_(self.src, non_blocking=True)
                for device in devices:
                    self.torch.cuda.synchronize(device)
                self.bytes += self.src.numel() * self.src.element_size()
        except Exception as exc:  # the thread excepthook is silenced: keep it for the report
            self.error = f"{type(exc).__name__}: {exc}"
        self.seconds = time.monotonic() - t0

    def rate(self) -> float | None:
        return self.bytes / self.seconds if self.seconds else None


@contextlib.contextmanager
def copying(torch, dst, src) -> Iterator[CopyLoop]:
    loop = CopyLoop(torch, dst, src)
    loop.start()
    try:
        yield loop
    finally:
        loop.halt.set()
        loop.join(timeout=60)
    if loop.error:
        raise RuntimeError(f"copy loop failed: {loop.error}")


def read_counters(handle, ids: list) -> tuple[float, list[tuple[int, int]]]:
    """(time, [(value, width in bits)] per field) from one nvmlDeviceGetFieldValues call."""
    before = time.monotonic()
    values = pynvml.nvmlDeviceGetFieldValues(handle, ids)
    t = (before + time.monotonic()) / 2
    out = []
    for fv in values:
        if fv.nvmlReturn != pynvml.NVML_SUCCESS:
            raise pynvml.NVMLError(fv.nvmlReturn)
        member, bits = VALUE_MEMBERS[fv.valueType]
        out.append((int(getattr(fv.value, member)), bits or 64))
    return t, out


def unit_ratios(raw_per_second: float, reference: float | None) -> dict:
    """raw x 1000 and raw x 1024 over a rate in bytes/s: the one near 1 names the unit."""
    if not reference:
        return {"raw_x1000_over_reference": None, "raw_x1024_over_reference": None,
                "verdict": "unknown (no reference rate)"}
    x1000, x1024 = raw_per_second * 1000 / reference, raw_per_second * 1024 / reference
    best = min((abs(x1000 - 1), "KB (x1000)"), (abs(x1024 - 1), "KiB (x1024)"))
    verdict = best[1] if best[0] <= UNIT_TOLERANCE else "unclear (neither ratio within 1.2 % of 1)"
    return {"raw_x1000_over_reference": x1000, "raw_x1024_over_reference": x1024,
            "verdict": verdict}


def check_pcie_unit(torch, uuid: str) -> dict:
    """KB or KiB: nvmlDeviceGetPcieThroughput against the byte counters (which count bytes)
    while pinned host-to-device copies keep the link busy. The agent multiplies by 1024."""
    handle = physical_handle(uuid)
    size = 1 << 30
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    raw: dict[str, list[int]] = {"tx": [], "rx": []}
    with copying(torch, dev, host) as loop:
        time.sleep(0.5)  # past the first copy, with the link trained up
        t0, before = read_counters(handle, [FI_TX, FI_RX])
        for _ in range(5):  # each call blocks for its 20 ms window
            time.sleep(0.3)
            raw["rx"].append(pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_RX_BYTES))
            raw["tx"].append(pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_TX_BYTES))
        time.sleep(0.3)
        t1, after = read_counters(handle, [FI_TX, FI_RX])
    dt = t1 - t0
    copy_rate = loop.rate()
    out: dict[str, Any] = {"window_seconds": dt, "copy_bytes_per_second": copy_rate}
    for name, (v0, bits), (v1, _) in zip(("tx", "rx"), before, after, strict=True):
        counter_rate = (v1 - v0) % (1 << bits) / dt
        median = statistics.median(raw[name])
        ratios = unit_ratios(median, counter_rate)
        out[name] = {"counter_bits": bits, "counter_bytes_per_second": counter_rate,
                     "throughput_raw": raw[name], "throughput_raw_median": median,
                     "raw_x1000_over_counter_rate": ratios["raw_x1000_over_reference"],
                     "raw_x1024_over_counter_rate": ratios["raw_x1024_over_reference"],
                     "verdict_vs_counter": ratios["verdict"]}
    rx = out["rx"]
    rx["counter_over_copy"] = rx["counter_bytes_per_second"] / copy_rate if copy_rate else None
    vs_copy = unit_ratios(rx["throughput_raw_median"], copy_rate)
    rx["raw_x1000_over_copy_rate"] = vs_copy["raw_x1000_over_reference"]
    rx["raw_x1024_over_copy_rate"] = vs_copy["raw_x1024_over_reference"]
    rx["verdict_vs_copy"] = vs_copy["verdict"]
    # a counter narrower than 64 bits may wrap more than once in the window at this rate
    wrapped = rx["counter_bits"] < 64 and (copy_rate or 0) * dt >= 1 << rx["counter_bits"]
    out["counter_may_have_wrapped"] = wrapped
    out["verdict"] = rx["verdict_vs_copy"] if wrapped else rx["verdict_vs_counter"]
    return out


def check_nvlink_unit(torch, uuid: str) -> dict:
    """The NVLink data fields' unit (the agent assumes KiB), from device 0's per-link TX
    counters summed over a device 0 -> device 1 copy loop. Needs two GPUs with peer access."""
    count = torch.cuda.device_count()
    if count < 2 or not torch.cuda.can_device_access_peer(0, 1):
        return {"skipped": f"needs two GPUs with peer access; torch sees {count}"}
    handle = physical_handle(uuid)
    links = int(describe_field(pynvml.nvmlDeviceGetFieldValues(handle, [FI_LINKS])[0])["value"] or 0)
    if not links:
        return {"skipped": "no NVLink links reported"}
    ids = [(FI_NVL_TX, link) for link in range(links)]
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:1")
    with copying(torch, dst, src) as loop:
        time.sleep(0.5)
        t0, before = read_counters(handle, ids)
        time.sleep(2.0)
        t1, after = read_counters(handle, ids)
    raw_rate = sum((v1 - v0) % (1 << bits) for (v0, bits), (v1, _) in zip(before, after, strict=True))
    raw_rate /= t1 - t0
    return {"links": links, "raw_tx_per_second": raw_rate, "copy_bytes_per_second": loop.rate(),
            **unit_ratios(raw_rate, loop.rate())}


def check_mig(source) -> dict | str:
    """What a MIG instance's own handle answers (the agent takes GPM through the parent's; the
    stand-in refuses the instance's handle with INVALID_ARGUMENT). Read only: a GPU is checked
    only if it is already in MIG mode."""
    modes = {}
    found = None
    for index in range(pynvml.nvmlDeviceGetCount()):
        parent = pynvml.nvmlDeviceGetHandleByIndex(index)
        try:
            modes[index] = pynvml.nvmlDeviceGetMigMode(parent)[0]
        except pynvml.NVMLError as exc:
            modes[index] = type(exc).__name__
        if modes[index] == 1 and found is None:
            found = (index, parent)
    if found is None:
        return "no GPU in MIG mode: not checked (the check never changes the mode)"
    index, parent = found
    mig = None
    for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(parent)):
        with contextlib.suppress(pynvml.NVMLError):  # an empty slot
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, slot)
            break
    if mig is None:
        return {"gpu_index": index, "mig_modes": modes, "result": "MIG mode on, but no instance"}
    mig_uuid = pynvml.nvmlDeviceGetUUID(mig)
    gi = pynvml.nvmlDeviceGetGpuInstanceId(mig)
    sample = pynvml.nvmlGpmSampleAlloc()
    try:
        calls = {
            "memory_info_v2(mig)": lambda: pynvml.nvmlDeviceGetMemoryInfo(
                mig, version=pynvml.nvmlMemory_v2),
            "gpm_mig_sample_get(parent, gi)": lambda: pynvml.nvmlGpmMigSampleGet(parent, gi, sample),
            "gpm_mig_sample_get(mig, gi)": lambda: pynvml.nvmlGpmMigSampleGet(mig, gi, sample),
            "utilization_rates(mig)": lambda: pynvml.nvmlDeviceGetUtilizationRates(mig),
            "field_values(mig, [197])": lambda: pynvml.nvmlDeviceGetFieldValues(mig, [FI_TX]),
            "max_pcie_link_generation(mig)": lambda: pynvml.nvmlDeviceGetMaxPcieLinkGeneration(mig),
            "gpm_query_device_support(mig)": lambda: pynvml.nvmlGpmQueryDeviceSupport(mig),
        }
        results = {name: attempt(fn) for name, fn in calls.items()}
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlGpmSampleFree(sample)
    return {"gpu_index": index, "mig_modes": modes, "mig_uuid": mig_uuid, "gpu_instance_id": gi,
            "calls": results,
            "agent_capabilities": guarded(lambda: source.capabilities(mig_uuid))}


def step_health(torch, source, uuid: str) -> dict:
    """What the health layer reads, from the real library, and the agent's reading beside it."""
    from dataclasses import asdict

    from sidecar.sources.nvml.health import (
        CLOCK_EVENTS,
        FI_C2C_LINKS,
        FI_C2C_MAX,
        FI_POWER,
        FIELD_FIGURES,
    )

    pynvml.nvmlInit()
    try:
        handle = physical_handle(uuid)
        ids = [fid for fid, _, _ in FIELD_FIGURES] + [fid for _, fid, _ in CLOCK_EVENTS if fid]
        ids += [FI_POWER, FI_C2C_LINKS, FI_C2C_MAX]
        fields = {str(fid): guarded(lambda fid=fid: describe_field(
            pynvml.nvmlDeviceGetFieldValues(handle, [fid])[0])) for fid in ids}
        calls = {
            "clock_sm": attempt(lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
            "clock_mem": attempt(lambda: pynvml.nvmlDeviceGetClockInfo(handle,
                                                                       pynvml.NVML_CLOCK_MEM)),
            "max_clock_sm": attempt(lambda: pynvml.nvmlDeviceGetMaxClockInfo(
                handle, pynvml.NVML_CLOCK_SM)),
            "max_clock_mem": attempt(lambda: pynvml.nvmlDeviceGetMaxClockInfo(
                handle, pynvml.NVML_CLOCK_MEM)),
            "clocks_event_reasons": attempt(
                lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle)),
            "supported_clocks_event_reasons": attempt(
                lambda: pynvml.nvmlDeviceGetSupportedClocksEventReasons(handle)),
            "power_usage_mw": attempt(lambda: pynvml.nvmlDeviceGetPowerUsage(handle)),
            "enforced_power_limit_mw": attempt(
                lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(handle)),
            "temperature_c": attempt(lambda: pynvml.nvmlDeviceGetTemperature(
                handle, pynvml.NVML_TEMPERATURE_GPU)),
            "curr_link_gen": attempt(lambda: pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)),
            "curr_link_width": attempt(lambda: pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle)),
            "ecc_uncorrected_volatile": attempt(lambda: pynvml.nvmlDeviceGetTotalEccErrors(
                handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)),
            "remapped_rows": attempt(lambda: pynvml.nvmlDeviceGetRemappedRows(handle)),
            "c2c_mode": attempt(lambda: pynvml.nvmlDeviceGetC2cModeInfoV1(handle)),
            "supported_event_types": attempt(
                lambda: pynvml.nvmlDeviceGetSupportedEventTypes(handle)),
        }
        counters = [fid for _, fid, _ in CLOCK_EVENTS if fid]
        a = time.monotonic(), pynvml.nvmlDeviceGetFieldValues(handle, counters)
        x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            x @ x  # keeps the GPU busy (and maybe at its power limit)
        torch.cuda.synchronize()
        b = time.monotonic(), pynvml.nvmlDeviceGetFieldValues(handle, counters)
        shares = {}
        for fa, fb in zip(a[1], b[1], strict=True):
            da, db = describe_field(fa), describe_field(fb)
            if da["value"] is not None and db["value"] is not None:
                shares[str(fa.fieldId)] = (db["value"] - da["value"]) / ((b[0] - a[0]) * 1e9)
        xid = guarded(_xid_wait_once)
    finally:
        pynvml.nvmlShutdown()
    source.read([uuid])
    time.sleep(0.5)
    reading = source.read([uuid])[uuid]
    return {"fields": fields, "calls": calls, "clock_event_shares_over_1s_matmul": shares,
            "xid_event_set": xid,
            "agent_health": asdict(reading.health) if reading is not None else None,
            "agent_io": asdict(reading.io) if reading is not None else None}


def _xid_wait_once() -> dict:
    """An event set for every GPU, registered for Xids, waited on for 0.1 s."""
    event_set = pynvml.nvmlEventSetCreate()
    try:
        registered = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            registered[index] = attempt(lambda h=h: pynvml.nvmlDeviceRegisterEvents(
                h, pynvml.nvmlEventTypeXidCriticalError, event_set))
        waited = attempt(lambda: pynvml.nvmlEventSetWait_v2(event_set, 100))
    finally:
        pynvml.nvmlEventSetFree(event_set)
    return {"registered": registered, "wait_100ms": waited}


def step_nvml_facts(torch, source, uuid: str) -> dict:
    """Facts the tests take from the stand-in NVML, read from the real library (its own
    nvmlInit, reference-counted, so the agent's session stays open)."""
    pynvml.nvmlInit()
    try:
        return {"field_types": guarded(lambda: check_field_types(source, uuid)),
                "pcie_throughput_unit": guarded(lambda: check_pcie_unit(torch, uuid)),
                "nvlink_throughput_unit": guarded(lambda: check_nvlink_unit(torch, uuid)),
                "mig": guarded(lambda: check_mig(source))}
    finally:
        pynvml.nvmlShutdown()


# -- step 9: the real driver's time per NVML call ------------------------------------------------

NVML_TIME_READINGS = 20  # agent readings of every GPU timed, after a first one
NVML_TIME_GAP_S = 0.2  # between them: over GPM's 0.1 s minimum, a few seconds in all


def call_table(calls: dict) -> dict:
    """Per pynvml function: calls, seconds and the mean time of one call in microseconds."""
    return {name: {"calls": c.calls, "seconds": c.seconds,
                   "mean_us": c.seconds / c.calls * 1e6 if c.calls else None}
            for name, c in calls.items()}


def step_nvml_time(source, sleep: Callable[[float], None] = time.sleep) -> dict:
    """The time the real driver takes per NVML call (issue #47), measured by the agent's own
    wrapper (``sidecar/sources/nvml/timed.py``, what ``gpu_sidecar_nvml_call_seconds_total``
    exports): ``NVML_TIME_READINGS`` agent readings of every visible GPU after a first one (whose
    counters and GPM take their first samples), per call, per reading and per GPU."""
    from sidecar.sources.nvml import timed

    uuids = [d.uuid for d in source.devices()]
    source.read(uuids)
    before = timed.totals()
    readings: list[float] = []
    per_gpu: dict[str, list[float]] = {u: [] for u in uuids}
    for _ in range(NVML_TIME_READINGS):
        sleep(NVML_TIME_GAP_S)
        start = timed.totals()
        source.read(uuids)
        readings.append(sum(c.seconds for c in timed.since(start).values()))
        for uuid, meter in source.last_read_nvml.items():
            per_gpu.setdefault(uuid, []).append(meter.seconds)
    calls = timed.since(before)
    return {"readings": NVML_TIME_READINGS, "gap_s": NVML_TIME_GAP_S, "gpus": len(uuids),
            "per_call": call_table(calls),
            "calls_per_reading": sum(c.calls for c in calls.values()) / NVML_TIME_READINGS,
            "reading_seconds_median": statistics.median(readings),
            "reading_seconds_max": max(readings),
            "per_gpu_seconds_median": {u: statistics.median(v) for u, v in per_gpu.items() if v}}


# -- step 10: GPM beside DCGM profiling ----------------------------------------------------------

DCGM_PROFILING_FIELDS = "1002,1003,1004"  # DCGM_FI_PROF_SM_ACTIVE, _SM_OCCUPANCY, _PIPE_TENSOR_ACTIVE
DCGM_DMON_SAMPLES = 10
DCGM_DMON_EVERY_MS = 200
# dcgm-exporter's default listen address; DCGM_EXPORTER_URL names another
DCGM_EXPORTER_URL = "http://127.0.0.1:9400/metrics"


def dcgm_present(which: Callable[[str], str | None] | None = None,
                 proc: Path = Path("/proc")) -> dict:
    """Where DCGM runs here: ``dcgmi`` on PATH, and the processes named dcgm-exporter (from
    /proc: in a container, those of its own PID namespace only)."""
    import shutil

    pids = []
    for entry in proc.glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if "dcgm-exporter" in (entry / "cmdline").read_bytes().split(b"\0")[0].decode(
                    errors="replace").rsplit("/", 1)[-1]:
                pids.append(int(entry.name))
    return {"dcgmi": (which or shutil.which)("dcgmi"), "dcgm_exporter_pids": sorted(pids)}


def dcgmi_profiling(dcgmi: str) -> dict:
    """DCGM's profiling fields read by ``dcgmi dmon``: ok when it exits 0 with a row of numbers
    per sample and no error (a profiler holding perfmon answers 'The third-party Profiling
    module returned an unrecoverable error'; no host engine, an error too)."""
    cmd = [dcgmi, "dmon", "-e", DCGM_PROFILING_FIELDS, "-c", str(DCGM_DMON_SAMPLES),
           "-d", str(DCGM_DMON_EVERY_MS)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    out = done.stdout + done.stderr
    rows = [line.split()[2:] for line in done.stdout.splitlines()
            if line.split()[:1] == ["GPU"] and len(line.split()) > 2]
    numbers = [r for r in rows if r and all(_is_number(v) for v in r)]
    return {"ok": done.returncode == 0 and bool(numbers) and "error" not in out.lower(),
            "exit_code": done.returncode, "rows": len(rows), "rows_of_numbers": len(numbers),
            "first_rows": numbers[:3], "output_tail": out[-1500:]}


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def exporter_profiling(url: str) -> dict:
    """dcgm-exporter's /metrics read twice, a second apart: ok when both answers hold
    DCGM_FI_PROF_ samples (its profiling metrics, collected while the agent reads GPM)."""
    import urllib.request

    answers = []
    for i in range(2):
        if i:
            time.sleep(1)
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                text = answer.read().decode(errors="replace")
        except OSError as exc:
            return {"ok": False, "url": url, "error": f"{type(exc).__name__}: {exc}"}
        answers.append(sorted({line.split("{")[0].split()[0] for line in text.splitlines()
                               if line.startswith("DCGM_FI_PROF_")}))
    return {"ok": all(answers), "url": url, "profiling_metrics": answers[-1]}


def step_dcgm_coexist(source, uuid: str, present: dict | None = None) -> dict:
    """Issue #47 item 5: where dcgmi or a dcgm-exporter runs, the agent's GPM readings and DCGM's
    profiling fields read at the same time, both must succeed (GPM does not take the perfmon
    subsystem DCGM profiling holds: docs/deployment.md); skipped, saying why, where neither
    runs or the GPU has no GPM."""
    found = dcgm_present() if present is None else present
    if not found["dcgmi"] and not found["dcgm_exporter_pids"]:
        return {"skipped": "neither dcgmi on PATH nor a dcgm-exporter process here: GPM beside "
                           "DCGM profiling not checked", **found}
    if not source.capabilities(uuid)["gpm"]:
        return {"skipped": "this GPU has no GPM (before Hopper): nothing read beside DCGM",
                **found}
    occupancy: list[float | None] = []
    stop = threading.Event()

    def read_gpm() -> None:
        source.read([uuid])
        while not stop.wait(NVML_TIME_GAP_S):
            reading = source.read([uuid]).get(uuid)
            occupancy.append(None if reading is None else reading.compute.sm_occupancy_ratio)

    reader = threading.Thread(target=read_gpm, name="gpm-beside-dcgm", daemon=True)
    reader.start()
    try:
        dcgm = {}
        if found["dcgmi"]:
            dcgm["dcgmi"] = guarded(lambda: dcgmi_profiling(found["dcgmi"]))
        if found["dcgm_exporter_pids"]:
            dcgm["exporter"] = guarded(lambda: exporter_profiling(
                os.environ.get("DCGM_EXPORTER_URL", DCGM_EXPORTER_URL)))
    finally:
        stop.set()
        reader.join(timeout=30)
    gpm_ok = bool(occupancy) and all(v is not None for v in occupancy)
    dcgm_ok = any(d.get("ok") for d in dcgm.values())
    return {**found, "gpm_readings": len(occupancy), "gpm_sm_occupancy": occupancy[:20],
            "gpm_ok": gpm_ok, "dcgm": dcgm, "dcgm_ok": dcgm_ok, "both_ok": gpm_ok and dcgm_ok}


# -- the table printed last ------------------------------------------------------------------------

def dig(report: dict, *keys: str) -> Any:
    """report[k1][k2]..., or None where a step failed or a key is missing."""
    for key in keys:
        if not isinstance(report, dict):
            return None
        report = report.get(key)
    return report


def fmt(value: Any, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec) if isinstance(value, float) else str(value)


def field_type_summary(facts: dict) -> str:
    parts = []
    for name in ("pcie_tx_bytes_197", "pcie_rx_bytes_198"):
        fv = dig(facts, "field_types", name) or {}
        parts.append(fv.get("error") or f"{fv.get('valueTypeName')} ({fv.get('nvmlReturnName')})")
    return " / ".join(parts)


def mig_summary(facts: dict) -> str:
    mig = facts.get("mig")
    if not isinstance(mig, dict):
        return str(mig)  # "no GPU in MIG mode ..."
    if "calls" not in mig:
        return str(mig.get("error") or mig.get("result"))
    calls = mig["calls"]
    short = {"gpm_mig_sample_get(parent, gi)": "GPM via parent",
             "gpm_mig_sample_get(mig, gi)": "GPM via MIG handle",
             "memory_info_v2(mig)": "memory v2"}
    return "; ".join(f"{label}: {calls[name]['result'].removeprefix('NVMLError_')}"
                     for name, label in short.items())


def nvml_time_rows(report: dict) -> list[tuple[str, str]]:
    """Steps 9 and 10 in the table: the reading's NVML time, its three costliest calls' mean,
    and GPM beside DCGM (or why not checked)."""
    nt, dc = report.get("nvml_time", {}), report.get("dcgm_coexist", {})
    top = sorted(dig(nt, "per_call") or {}, key=lambda n: -nt["per_call"][n]["seconds"])[:3]
    return [
        ("NVML per reading s: median / max",
         f"{fmt(dig(nt, 'reading_seconds_median'))} / {fmt(dig(nt, 'reading_seconds_max'))}"
         f" ({fmt(dig(nt, 'calls_per_reading'))} calls, {dig(nt, 'gpus')} GPUs)"),
        ("NVML costliest calls, mean us",
         ", ".join(f"{n} {fmt(nt['per_call'][n]['mean_us'])}" for n in top) or "none"),
        ("GPM beside DCGM profiling",
         str(dc.get("skipped") or (f"both ok: {dc.get('both_ok')} (GPM {dc.get('gpm_ok')}, "
                                    f"DCGM {dc.get('dcgm_ok')})" if dc else None))),
    ]


def summary_rows(report: dict) -> list[tuple[str, str]]:
    facts = report.get("nvml_facts", {})
    compute, alloc, over = (report.get(k, {}) for k in ("compute", "allocator", "overhead"))
    pcie_path = str(dig(facts, "field_types", "agent_pcie_path"))
    if dig(facts, "field_types", "agent_pcie_note"):
        pcie_path += f" ({dig(facts, 'field_types', 'agent_pcie_note')})"
    pcie_unit, nvlink_unit = facts.get("pcie_throughput_unit"), facts.get("nvlink_throughput_unit")
    rows = [
        ("GPU", f"{dig(report, 'gpu', 'name')}, driver {dig(report, 'probe', 'driver')}"),
        ("agent RX / copy rate", fmt(dig(report, "pcie", "agent_over_copy"))),
        ("tensor util: matmul / tiny",
         f"{fmt(dig(compute, 'matmul_bf16', 'tensor_core_util_ratio'))} / "
         f"{fmt(dig(compute, 'tiny_kernels', 'tensor_core_util_ratio'))}"),
        ("reserved bytes: pushed / torch",
         f"{fmt(dig(alloc, 'published_reserved'))} / {fmt(dig(alloc, 'torch_reserved'))}"),
        ("overhead: CPU s/min, peak MiB",
         f"{fmt(dig(over, 'cpu_seconds_per_minute'))}, {fmt(dig(over, 'peak_rss_mib'))}"),
        ("value type 197 / 198", field_type_summary(facts)),
        ("agent PCIe path", pcie_path),
        ("PcieThroughput unit", str(dig(pcie_unit, "verdict") or dig(pcie_unit, "error"))),
        ("NVLink field unit", str(dig(nvlink_unit, "verdict") or dig(nvlink_unit, "skipped")
                                  or dig(nvlink_unit, "error"))),
        ("MIG", mig_summary(facts)),
        ("health: SM clock / max Hz",
         f"{fmt(dig(report, 'health', 'agent_health', 'sm_clock_hertz'))} / "
         f"{fmt(dig(report, 'health', 'agent_health', 'sm_clock_max_hertz'))}"),
        ("health: power / limit W",
         f"{fmt(dig(report, 'health', 'agent_health', 'power_watts'))} / "
         f"{fmt(dig(report, 'health', 'agent_health', 'power_limit_watts'))}"),
        ("health: clock-event shares (1 s)",
         str(dig(report, "health", "clock_event_shares_over_1s_matmul"))),
        ("health: Xid wait 0.1 s",
         str(dig(report, "health", "xid_event_set", "wait_100ms", "result"))),
        ("C2C link max B/s", fmt(dig(report, "health", "agent_io",
                                     "c2c_link_max_bytes_per_second"))),
        ("memory_snapshot() median / max s",
         f"{fmt(dig(alloc, 'snapshot_seconds_median'))} / {fmt(dig(alloc, 'snapshot_seconds_max'))}"
         f" ({dig(alloc, 'snapshot_blocks')} blocks)"),
    ]
    inj = report.get("injection", {})
    rows += [
        ("injected: reserved agent / torch",
         f"{fmt(dig(inj, 'agent_reserved'))} / {fmt(dig(inj, 'app', 'reserved'))}"),
        ("injected: largest free agent / torch",
         f"{fmt(dig(inj, 'agent_largest_free_block'))} / {fmt(dig(inj, 'app', 'largest_free'))}"),
        ("injected: first figures after init s", fmt(dig(inj, "first_figures_after_cuda_init_s"))),
        ("injected: app stderr empty", str(dig(inj, "app_stderr") == "")),
        ("injected: import torch s bare / inj",
         f"{fmt(dig(inj, 'import_torch_s', 'bare'))} / {fmt(dig(inj, 'import_torch_s', 'injected'))}"),
        ("injected: + CUDA init s bare / inj",
         f"{fmt(dig(inj, 'import_and_cuda_init_s', 'bare'))} / "
         f"{fmt(dig(inj, 'import_and_cuda_init_s', 'injected'))}"),
    ]
    rows += nvml_time_rows(report)
    rows += [(f"step {name} failed", value["error"]) for name, value in report.items()
             if isinstance(value, dict) and "error" in value]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--dcgm-only", action="store_true",
                        help="say what step 10 finds of DCGM here (dcgmi, dcgm-exporter), no GPU")
    args = parser.parse_args()
    if args.dcgm_only:
        print(json.dumps(dcgm_present()))
        return 0
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    import torch

    from sidecar.log import configure
    from sidecar.sources.nvml import NvmlSource

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
             ("nvml_facts", lambda: step_nvml_facts(torch, source, uuid)),
             ("health", lambda: step_health(torch, source, uuid)),
             ("overhead", lambda: step_overhead(out_dir)),
             ("injection", lambda: step_injection(uuid, out_dir)),
             ("nvml_time", lambda: step_nvml_time(source)),
             ("dcgm_coexist", lambda: step_dcgm_coexist(source, uuid))]
    for name, fn in steps:
        t0 = time.monotonic()
        try:
            report[name] = fn()
        except Exception as exc:  # one failing step must not cost the others
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        report[name]["_seconds"] = round(time.monotonic() - t0, 1)
        (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    from sidecar.sources.nvml import timed

    # every NVML call the agent's code made in this process, all steps together
    report["nvml_calls_whole_run"] = call_table(timed.totals())
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    source.close()
    print(json.dumps(report, indent=1, default=str)[-6000:])
    rows = summary_rows(report)
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    threading.excepthook = lambda args: None
    raise SystemExit(main())
