"""The GPU's energy as a counter (issue #36: a figure is one table entry plus its read):
``gpu_energy_joules_total`` is NVML field 83, millijoules since the driver loaded, exported in
joules. The stand-in answers the field as NVML does (an unsigned long long of whole millijoules,
the integral of the power it reports; NOT_SUPPORTED before Volta and on a MIG instance's handle),
and a simulated agent exports the counter for every GPU, rising at the rate of the power it
reports, absent where NVML refuses the field."""

from __future__ import annotations

import math
import re
import signal
import subprocess
import sys
from collections import defaultdict
from dataclasses import replace
from itertools import pairwise

import pynvml
import pytest

from sidecar import metrics
from sidecar.samples import GpuSample, gpu_labels, sample_series
from sidecar.simulate import fake_nvml
from sidecar.simulate.fake_nvml import FakeGpu, FakeMig, Signal
from sidecar.simulate.scenarios import DEFAULT_GPUS, build
from sidecar.sources.nvml import NvmlSource
from tests.conftest import ROOT
from tests.manual_clock import ManualClock
from tests.waiting import until

FI_ENERGY = pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION
ENERGY, POWER = "gpu_energy_joules_total", "gpu_power_usage_watts"
GiB = 1024**3


def hopper(i: int = 0, **kw: object) -> FakeGpu:
    base = FakeGpu(uuid=f"GPU-e000000{i}-aaaa-bbbb-cccc-dddddddddddd", name="Simulated H200",
                   pci_bus_id=f"00000000:2{i}:00.0", power=Signal(600.0, 0.5, 4))
    return replace(base, **kw)  # type: ignore[arg-type]


def energy_field(handle: object) -> tuple[int, int, int | None]:
    """(nvmlReturn, valueType, value) of field 83 as pynvml hands it over."""
    fv = pynvml.nvmlDeviceGetFieldValues(handle, [FI_ENERGY])[0]
    return fv.nvmlReturn, fv.valueType, fv.value.ullVal if fv.nvmlReturn == 0 else None


# -- the stand-in --------------------------------------------------------------------------------

def test_the_stand_in_counts_whole_millijoules_since_load_as_the_integral_of_its_power(
        install_fake, clock):
    fake = install_fake([hopper()], clock=clock)
    clock.advance(-fake.now())  # the driver loaded at t = 0
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert energy_field(h) == (pynvml.NVML_SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, 0)
    # 600 W * (1 + 0.5 sin(2 pi t / 4)): over a whole period, 600 W * 4 s = 2400 J; after a
    # quarter more, 600 * (1 + 0.5 (1 - cos(pi/2)) / (pi/2)) = 600 (1 + 1/pi) J on top
    clock.advance(4.0)
    assert energy_field(h)[2] == 2_400_000
    clock.advance(1.0)
    assert energy_field(h)[2] == int(1000 * (2400 + 600 * (1 + 1 / math.pi)))
    readings = []
    for _ in range(40):  # monotonic through the signal's troughs
        clock.advance(0.1)
        readings.append(energy_field(h)[2])
    assert readings == sorted(readings) and len(set(readings)) == len(readings)


def test_the_stand_in_refuses_the_field_before_volta_and_on_a_mig_instance(install_fake, clock):
    instance = FakeMig(gpu_instance_id=1, uuid="MIG-e1111111-2222-3333-4444-555555555555",
                       name="Simulated H200 MIG 3g", memory_total=71 * GiB)
    install_fake([hopper(0, mig=(instance,)),
                  hopper(1, architecture=pynvml.NVML_DEVICE_ARCH_PASCAL)], clock=clock)
    pynvml.nvmlInit()
    parent, pascal = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(1)
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0)
    assert energy_field(pascal)[0] == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert energy_field(mig)[0] == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert energy_field(parent)[0] == pynvml.NVML_SUCCESS  # the board's, MIG on or not


# -- the agent's counter -------------------------------------------------------------------------

@pytest.fixture
def source_on():
    opened: list[NvmlSource] = []

    def open_(nvml: fake_nvml.FakeNvml, clock: ManualClock) -> NvmlSource:
        fake_nvml.install(nvml)
        source = NvmlSource(clock=clock, sleep=clock.advance)
        source.open()
        opened.append(source)
        return source

    yield open_
    for source in opened:
        source.close()
    fake_nvml.uninstall()


def series_of(source: NvmlSource, uuid: str, reading) -> dict[str, tuple[float, dict]]:
    """Series name -> (value, labels) of one GPU's reading, as the agent exports them."""
    identity = next(d for d in source.devices() if d.uuid == uuid)
    sample = GpuSample(identity=identity, timestamp_ms=0, compute=reading.compute,
                       memory=reading.memory, io=reading.io, health=reading.health)
    return {s.name: (s.value, dict(s.labels))
            for s in sample_series(sample, {}, gpu_labels(identity, {}))}


def test_every_simulated_gpu_counts_joules_at_the_rate_of_the_power_it_reports(source_on):
    clock = ManualClock()
    scenario = build("healthy")
    nvml = scenario.nvml(clock=clock, throughput_blocking=False)
    source = source_on(nvml, clock)
    uuids = [d.uuid for d in source.devices()]
    assert len(uuids) == DEFAULT_GPUS["healthy"]
    cycles = []
    for _ in range(12):  # 1 s cycles over 11 s of the power's 17 s period
        readings = source.read(uuids)
        cycles.append((nvml.now(), {u: series_of(source, u, readings[u]) for u in uuids}))
        clock.advance(1.0)
    for uuid, gpu in zip(uuids, scenario.gpus, strict=True):
        for (t1, before), (t2, after) in pairwise(cycles):
            (e1, labels), (e2, _) = before[uuid][ENERGY], after[uuid][ENERGY]
            assert labels["gpu_name"].startswith("Simulated ") and labels["gpu_uuid"] == uuid
            # the stand-in's power, integrated, in joules: whole millijoules at each end
            assert e2 - e1 == pytest.approx(gpu.power.integral(t2) - gpu.power.integral(t1),
                                            abs=2e-3)
            # and what the agent itself reports: the mean of the power read at both ends
            reported = (before[uuid][POWER][0] + after[uuid][POWER][0]) / 2
            assert (e2 - e1) / (t2 - t1) == pytest.approx(reported, rel=2e-3)


def test_the_counter_is_absent_where_nvml_refuses_the_field_with_the_reason(source_on):
    clock = ManualClock()
    instance = FakeMig(gpu_instance_id=1, uuid="MIG-e2222222-2222-3333-4444-555555555555",
                       name="Simulated H200 MIG 3g", memory_total=71 * GiB)
    nvml = fake_nvml.FakeNvml([hopper(0, mig=(instance,)),
                               hopper(1, architecture=pynvml.NVML_DEVICE_ARCH_PASCAL)],
                              clock=clock, throughput_blocking=False)
    source = source_on(nvml, clock)
    uuids = [d.uuid for d in source.devices()]
    parent, pascal = hopper(0).uuid, hopper(1).uuid
    assert source.absent(pascal)[ENERGY] == f"NVML field {FI_ENERGY} not supported on this GPU"
    assert source.absent(instance.uuid)[ENERGY] == "MIG instance: reported on the parent GPU only"
    assert ENERGY not in source.absent(parent)
    source.read(uuids)
    clock.advance(1.0)
    readings = source.read(uuids)
    assert ENERGY not in series_of(source, pascal, readings[pascal])  # absent, never 0
    assert POWER in series_of(source, pascal, readings[pascal])  # the rest of it still read
    assert ENERGY not in series_of(source, instance.uuid, readings[instance.uuid])
    assert series_of(source, parent, readings[parent])[ENERGY][0] > 0


_SAMPLE = re.compile(r'^(gpu_energy_joules_total|gpu_power_usage_watts)\{([^}]*)\} (\S+) (\d+)$')


def test_the_simulated_agent_prints_a_rising_counter_for_every_gpu(tmp_path):
    """The real agent, its stdout in Prometheus text: every GPU's counter, labelled as the
    simulated GPU, rising every cycle at about the mean of the power it printed (the printed
    timestamp is the cycle's, taken just before NVML is read, hence the looser bound)."""
    out = tmp_path / "stdout.prom"
    with out.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "run", "--simulate", "healthy", "--interval", "0.5",
             "--output", "prometheus"], stdout=sink, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        def cycles() -> dict[tuple[str, str], dict[int, float]]:
            got: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
            for line in out.read_text().splitlines():
                if m := _SAMPLE.match(line):
                    labels = dict(re.findall(r'(\w+)="([^"]*)"', m[2]))
                    got[(m[1], f"{labels['gpu_uuid']} {labels['gpu_name']}")][int(m[4])] = \
                        float(m[3])
            return got

        got = until(lambda: (c := cycles()) and len(c) == 2 * DEFAULT_GPUS["healthy"]
                    and all(len(v) >= 8 for v in c.values()) and c, 60,
                    what="8 cycles of energy and power for every GPU")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    gpus = {gpu for name, gpu in got if name == ENERGY}
    assert len(gpus) == DEFAULT_GPUS["healthy"]
    for gpu in gpus:
        assert gpu.split(" ", 1)[1].startswith("Simulated ")
        energy, power = got[(ENERGY, gpu)], got[(POWER, gpu)]
        ts = sorted(energy)[:8]
        values = [energy[t] for t in ts]
        assert all(b > a for a, b in pairwise(values)), values
        joules = sum((power[a] + power[b]) / 2 * (b - a) / 1000 for a, b in pairwise(ts))
        assert values[-1] - values[0] == pytest.approx(joules, rel=0.05)


def test_the_metrics_reference_lists_the_counter_with_its_otel_and_dcgm_names():
    text = (ROOT / "docs" / "metrics.md").read_text()
    spec = metrics.BY_NAME[ENERGY]
    assert (spec.kind, spec.unit, spec.layer, spec.cadence) == ("counter", "joules", "health",
                                                                "cycle")
    assert re.search(rf"^\| `{ENERGY}` \| counter \| joules \|.*DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
                     text, re.M)
    assert f"| `{ENERGY}` | `hw.energy` | Sum (monotonic) | `J` |" in text
