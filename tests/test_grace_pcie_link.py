"""A GH200's PCIe link as the real one reports it, Gen4 x1 at its maximum (host traffic goes over
NVLink-C2C; tests/realworld/nvidia_smi_q_GH200_480GB_driver550.txt), judged by the same verdicts
as any link: the narrow link neither hides nor invents a ``pcie`` or ``pcie-degraded`` finding.

Each case runs the NVML source (pynvml's public functions above the stand-in library) over a
window of readings, turns them into series as the agent does, and judges the window; the
commands are run as an operator runs them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sidecar.judge.series import figures_of
from sidecar.judge.verdict import Verdict, judge
from sidecar.judge.window import summarize
from sidecar.samples import GpuSample, gpu_labels, sample_series
from sidecar.simulate import fake_nvml
from sidecar.simulate.fake_nvml import FakeGpu, FakeNvml, Signal
from sidecar.simulate.scenarios import GH200_C2C, build
from sidecar.sources.nvml import NvmlSource
from sidecar.sources.pcie import link_max_bytes_per_second
from tests.conftest import run_cli
from tests.manual_clock import ManualClock

GEN4_X1 = link_max_bytes_per_second(4, 1) or 0.0
GEN1_X1 = link_max_bytes_per_second(1, 1) or 0.0
READINGS = 6  # a window of six cycles, 5 s apart
INTERVAL_S = 5.0


def grace_gpu(**load: object) -> FakeGpu:
    """The grace-hopper scenario's GH200 (C2C 90 % full, PCIe Gen4 x1 carrying a few MB/s),
    with ``load`` changed."""
    return replace(build("grace-hopper").gpus[0], **load)  # type: ignore[arg-type]


@pytest.fixture
def judged():
    """Judge a window of NVML readings of one simulated GPU, as the agent and diagnose would."""
    opened: list[NvmlSource] = []

    def run(gpu: FakeGpu) -> tuple[Verdict, dict[str, float]]:
        clock = ManualClock()
        fake_nvml.install(FakeNvml([gpu], clock=clock, throughput_blocking=False))
        source = NvmlSource(clock=clock, sleep=clock.advance)
        source.open()
        opened.append(source)
        identity = source.devices()[0]
        cycles, last = [], {}
        for _ in range(READINGS):
            reading = source.read([identity.uuid])[identity.uuid]
            sample = GpuSample(identity=identity, timestamp_ms=0, compute=reading.compute,
                               memory=reading.memory, io=reading.io, health=reading.health,
                               xids=reading.xids)
            series = list(sample_series(sample, {}, gpu_labels(identity, {})))
            cycles.append(figures_of(series))
            last = {s.name: s.value for s in series}
            clock.advance(INTERVAL_S)
        return judge(summarize(cycles)[identity.uuid]), last

    yield run
    for source in opened:
        source.close()
    fake_nvml.uninstall()


def keys(v: Verdict) -> list[str]:
    return [f.key for f in v.findings]


def test_a_gh200_at_its_x1_maximum_is_judged_on_c2c_with_no_pcie_finding_or_note(judged):
    v, series = judged(grace_gpu())
    assert keys(v) == ["c2c"]
    # the PCIe shares are of the Gen4 x1 link the GPU reports, not of a Gen5 x16 one
    assert series["gpu_pcie_link_max_bytes_per_second"] == GEN4_X1
    assert (series["gpu_pcie_link_generation"], series["gpu_pcie_link_width"]) == (4, 1)
    assert series["gpu_pcie_rx_bandwidth_util_ratio"] == pytest.approx(
        series["gpu_pcie_rx_bytes_per_second"] / GEN4_X1)
    assert 0 < series["gpu_pcie_rx_bandwidth_util_ratio"] < 0.01
    # x1 of a maximum x1 is no link trained down: not even the "idle link" note
    assert not any("PCIe link ran at" in note for note in v.notes), v.notes


def test_a_gh200_whose_x1_pcie_link_is_saturated_gets_the_pcie_finding(judged):
    """Host traffic is C2C's, but a full x1 link is still full: C2C does not hide it."""
    v, series = judged(grace_gpu(pcie_rx=Signal(0.9 * GEN4_X1, 0.02, 19),
                                 c2c_rx=Signal(0.3 * GH200_C2C, 0.02, 19)))
    assert keys(v) == ["pcie"]
    assert series["gpu_pcie_rx_bandwidth_util_ratio"] == pytest.approx(0.9, abs=0.05)
    assert "of the link's 2.0 GB/s" in v.findings[0].evidence


def test_a_gh200_whose_x1_link_trained_down_under_traffic_is_degraded(judged):
    """Below its own maximum (Gen1 of Gen4) while carrying half the trained link: the same
    finding as on any GPU."""
    v, _ = judged(grace_gpu(current_link_generation=1,
                            pcie_rx=Signal(0.5 * GEN1_X1, 0.02, 19),
                            c2c_rx=Signal(0.3 * GH200_C2C, 0.02, 19)))
    assert keys(v) == ["pcie-degraded"]
    assert "Gen1 x1" in v.findings[0].evidence and "Gen4 x1 maximum" in v.findings[0].evidence


def test_diagnose_of_the_grace_hopper_scenario_names_c2c_and_exits_1():
    proc = run_cli("diagnose", "--simulate", "grace-hopper", "--duration", "5", timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "verdict: c2c" in proc.stdout
    assert "of 2.0 GB/s (Gen4 x1)" in proc.stdout  # the PCIe shares are of the real link
    assert "verdict: pcie" not in proc.stdout and "PCIe link ran at" not in proc.stdout


def test_probe_of_the_grace_hopper_scenario_says_gen4_x1_and_that_c2c_carries_host_traffic():
    proc = run_cli("probe", "--simulate", "grace-hopper")
    assert proc.returncode == 0, proc.stderr
    assert "link: PCIe gen 4 x1, 1.97 GB/s per direction" in proc.stdout
    assert "host traffic: over NVLink-C2C" in proc.stdout and "not PCIe" in proc.stdout
