"""The agent's own time in NVML: every pynvml call timed and counted at one boundary
(``sidecar/sources/nvml/timed.py``), stored by a real receiver per call, and shown by ``probe``
per cycle, per GPU and by the costliest calls."""

from __future__ import annotations

import re
from collections import defaultdict
from itertools import pairwise

import pynvml
import pytest

from sidecar.simulate import fake_nvml
from sidecar.simulate.fake_nvml import FakeGpu, Signal
from sidecar.sources.nvml import NvmlSource, timed
from tests.conftest import run_cli
from tests.receivers import Agent, VictoriaMetrics, running
from tests.waiting import until

GiB = 1024**3
PER_CYCLE_CALLS = ("nvmlDeviceGetFieldValues", "nvmlDeviceGetMemoryInfo", "nvmlGpmSampleGet",
                   "nvmlDeviceGetUtilizationRates")


def pynvml_function(name: str) -> bool:
    return name.startswith("nvml") and callable(getattr(pynvml, name, None))


def h200(i: int = 0) -> FakeGpu:
    return FakeGpu(uuid=f"GPU-cost{i:04d}-0000-0000-0000-000000000000",
                   name="Simulated NVIDIA H200", pci_bus_id=f"00000000:{0x18 + i:02X}:00.0",
                   memory_used=Signal(10 * GiB), pcie_rx=Signal(4e9), utilization=Signal(50))


def test_each_gpus_meter_counts_every_pynvml_call_of_its_reading_once(install_fake, clock):
    """What one GPU's reading cost: as many calls as the stand-in library answered C calls,
    and the process-wide totals grew by as much."""
    fake = install_fake([h200()], clock=clock, record_calls=True)
    source = NvmlSource(clock=clock, sleep=clock.advance)
    source.open()
    try:
        uuid = source.devices()[0].uuid
        source.read([uuid])
        clock.advance(1.0)
        def answered_so_far() -> int:  # the Xid watcher's wait, on its thread, is no call of it
            return sum(n for name, n in fake.calls.items() if name != "nvmlEventSetWait_v2")

        c_calls, before = answered_so_far(), timed.totals()
        source.read([uuid])
        answered = answered_so_far() - c_calls
        meter = source.last_read_nvml[uuid]
        cycle = timed.since(before)
    finally:
        source.close()
    assert meter.calls == answered == sum(c.calls for c in cycle.values()) > 0
    assert 0 < meter.seconds <= sum(c.seconds for c in cycle.values()) + 1e-9
    assert all(pynvml_function(name) for name in cycle), cycle
    assert set(PER_CYCLE_CALLS) <= set(cycle)
    assert list(cycle) == sorted(cycle, key=lambda n: -cycle[n].seconds)  # costliest first


def test_a_failing_call_is_counted_and_timed_too(install_fake, clock):
    install_fake([h200()], clock=clock)
    pynvml.nvmlInit()
    try:
        handle = timed.nvml.nvmlDeviceGetHandleByIndex(0)
        before = timed.totals()
        with pytest.raises(pynvml.NVMLError):
            timed.nvml.nvmlDeviceGetGpuInstanceId(handle)  # not a MIG handle: refused
        spent = timed.since(before)["nvmlDeviceGetGpuInstanceId"]
    finally:
        pynvml.nvmlShutdown()
    assert spent.calls == 1 and spent.seconds > 0
    assert timed.nvml.NVML_SUCCESS == pynvml.NVML_SUCCESS  # constants are pynvml's own


def test_the_xid_wait_is_not_counted_as_time_in_the_driver():
    assert timed.nvml.nvmlEventSetWait_v2 is pynvml.nvmlEventSetWait_v2


def test_a_real_agent_stores_its_nvml_time_per_call_in_victoriametrics(tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    agent = Agent(["--simulate", "healthy", "--interval", "0.2", "--push-interval", "0.5",
                   "--remote-write-url", vm.write_url, "--spool-dir", str(tmp_path / "spool"),
                   "--socket", str(tmp_path / "run" / "app.sock")])
    with running(vm, agent):
        agent.start()

        def stored() -> dict[tuple[str, str], list[tuple[int, float]]]:
            out: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)
            for name, labels, ts, value in vm.samples(
                    '{__name__=~"gpu_sidecar_nvml_calls?(_seconds)?_total"}'):
                out[name, dict(labels)["call"]].append((ts, value))
            return out

        def enough() -> dict | None:
            got = stored()
            fields = got.get(("gpu_sidecar_nvml_calls_total", "nvmlDeviceGetFieldValues"), [])
            return got if len(fields) >= 5 else None

        got = until(enough, 60, interval=0.5, what="five stored cycles of the NVML call series")
        assert agent.stop() == 0
    calls = {c for n, c in got if n == "gpu_sidecar_nvml_calls_total"}
    seconds = {c for n, c in got if n == "gpu_sidecar_nvml_call_seconds_total"}
    assert calls == seconds and all(pynvml_function(c) for c in calls), calls
    assert {"nvmlInit", "nvmlDeviceGetHandleByIndex", *PER_CYCLE_CALLS} <= calls
    for call in PER_CYCLE_CALLS:  # made every cycle: both counters climb at every sample
        for name in ("gpu_sidecar_nvml_calls_total", "gpu_sidecar_nvml_call_seconds_total"):
            values = [v for _, v in sorted(got[name, call])]
            assert values[0] > 0 and all(b > a for a, b in pairwise(values)), (call, values)
    # made once, at open: stored, flat, and sent as a rare figure (when it changes, every
    # minute), not with every cycle
    init = got["gpu_sidecar_nvml_calls_total", "nvmlInit"]
    assert {v for _, v in init} == {1.0}
    assert len(init) < len(got["gpu_sidecar_nvml_calls_total", "nvmlDeviceGetFieldValues"])


def test_probe_shows_the_nvml_time_of_a_cycle_per_gpu_and_the_costliest_calls():
    proc = run_cli("probe", "--simulate", "old-driver")
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("NVML time in one cycle:"))
    m = re.match(r"NVML time in one cycle: ([\d.]+) ms in (\d+) calls; per GPU: (.*)$", line)
    assert m, line
    per_gpu = re.findall(r"GPU (\d+) ([\d.]+) ms \((\d+) calls\)", m[3])
    assert [g for g, _, _ in per_gpu] == ["0", "1"]
    assert sum(float(ms) for _, ms, _ in per_gpu) == pytest.approx(float(m[1]), abs=0.01)
    costliest = proc.stdout.split("  costliest calls: ", 1)[1].splitlines()[0]
    names = re.findall(r"(nvml\w+) [\d.]+ ms x\d+", costliest)
    assert names and all(pynvml_function(n) for n in names), costliest
    assert len(names) <= 5


def test_the_stand_in_library_is_what_a_run_times(install_fake, clock):
    """Timing wraps pynvml, not the library: the stand-in answers the same calls unchanged."""
    fake = install_fake([h200()], clock=clock, record_calls=True)
    pynvml.nvmlInit()
    try:
        timed.nvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()
    assert fake.calls["nvmlDeviceGetCount_v2"] == 1
    assert fake_nvml.DEFAULT_DRIVER_VERSION
