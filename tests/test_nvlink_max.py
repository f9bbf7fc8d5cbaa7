"""The NVLink maximum is what NVML says of the GPU's links: the links it answers active
(``nvmlDeviceGetNvLinkState``) times the common speed it reports for active links (field 90,
MBps per link and direction). Where NVML cannot say (no NVLink, no active link, the speed field
unsupported) the maximum and both shares are absent with the reason, never 0 and never guessed
from a generation.

Each case asks the stand-in library through pynvml's public functions first (what a person
with ``nvidia-smi nvlink -s`` would see), then runs the NVML source over it and reads the series
the agent exports."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pynvml
import pytest

from sidecar.samples import GpuSample, gpu_labels, sample_series
from sidecar.simulate import fake_nvml
from sidecar.simulate.fake_nvml import FakeGpu, FakeNvml
from sidecar.simulate.scenarios import build
from sidecar.sources.nvml import NvmlSource
from tests.manual_clock import ManualClock

MAX = "gpu_nvlink_link_max_bytes_per_second"
SHARES = ("gpu_nvlink_tx_bandwidth_util_ratio", "gpu_nvlink_rx_bandwidth_util_ratio")
INTERVAL_S = 5.0


def tensor_parallel_gpu(**changed: object) -> FakeGpu:
    """A GPU of the nvlink-saturated scenario (an H200 SXM, 18 links), with ``changed``."""
    return replace(build("nvlink-saturated", 1).gpus[0], **changed)  # type: ignore[arg-type]


def pcie_card() -> FakeGpu:
    """The old-driver scenario's A100 PCIe: a card without NVLink."""
    return build("old-driver", 1).gpus[0]


@pytest.fixture
def nvml() -> Iterator[ManualClock]:
    clock = ManualClock()
    yield clock
    fake_nvml.uninstall()


def what_nvml_says(gpu: FakeGpu, clock: ManualClock) -> tuple[int, int | None]:
    """(active links, common speed in MBps) as pynvml's public functions answer them; the speed
    None where NVML refuses the field."""
    fake_nvml.install(FakeNvml([gpu], clock=clock, throughput_blocking=False))
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        count, speed = pynvml.nvmlDeviceGetFieldValues(
            handle, [pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT,
                     pynvml.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON])
        links = count.value.uiVal if count.nvmlReturn == pynvml.NVML_SUCCESS else 0
        active = sum(pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED
                     for link in range(links))
        return active, speed.value.uiVal if speed.nvmlReturn == pynvml.NVML_SUCCESS else None
    finally:
        pynvml.nvmlShutdown()


def exported(gpu: FakeGpu, clock: ManualClock) -> tuple[dict[str, float], dict[str, str]]:
    """The series of the source's second reading (rates need two), and the absent figures with
    their reasons."""
    fake_nvml.install(FakeNvml([gpu], clock=clock, throughput_blocking=False))
    source = NvmlSource(clock=clock, sleep=clock.advance)
    source.open()
    try:
        identity = source.devices()[0]
        series: dict[str, float] = {}
        for _ in range(2):
            reading = source.read([identity.uuid])[identity.uuid]
            sample = GpuSample(identity=identity, timestamp_ms=0, compute=reading.compute,
                               memory=reading.memory, io=reading.io, health=reading.health,
                               xids=reading.xids)
            series = {s.name: s.value
                      for s in sample_series(sample, {}, gpu_labels(identity, {}))}
            clock.advance(INTERVAL_S)
        return series, source.absent(identity.uuid)
    finally:
        source.close()


def test_the_maximum_is_the_active_links_times_the_speed_nvml_reports(nvml):
    gpu = tensor_parallel_gpu(nvlink_down=(3,))  # one link down, as nvidia-smi nvlink -s shows
    active, speed = what_nvml_says(gpu, nvml)
    assert active == gpu.nvlink_links - 1 and speed
    series, absent = exported(gpu, nvml)
    assert series[MAX] == active * speed * 1e6  # MBps: 1e6 bytes/s, per direction
    assert series["gpu_nvlink_rx_bandwidth_util_ratio"] == pytest.approx(
        series["gpu_nvlink_rx_bytes_per_second"] / series[MAX])
    assert series["gpu_nvlink_tx_bandwidth_util_ratio"] == pytest.approx(
        series["gpu_nvlink_tx_bytes_per_second"] / series[MAX])
    assert MAX not in absent


def test_an_h200_sxm_reports_nvlink_4_at_the_line_rate_nvidia_smi_prints(nvml):
    """nvidia-smi nvlink -s prints 26.562 GB/s for each of an H100's or H200's 18 links."""
    active, speed = what_nvml_says(tensor_parallel_gpu(), nvml)
    assert (active, speed) == (18, 26562)


def test_a_card_without_nvlink_has_no_maximum_and_no_share_never_0(nvml):
    card = pcie_card()
    assert what_nvml_says(card, nvml) == (0, None)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        fake_nvml.install(FakeNvml([card], clock=nvml))
        pynvml.nvmlInit()
        try:
            pynvml.nvmlDeviceGetNvLinkState(pynvml.nvmlDeviceGetHandleByIndex(0), 0)
        finally:
            pynvml.nvmlShutdown()
    series, absent = exported(card, nvml)
    assert {MAX, *SHARES}.isdisjoint(series)
    assert {absent[name] for name in (MAX, *SHARES)} == {"no NVLink on this GPU"}


@pytest.mark.parametrize(("changed", "why"), [
    ({"nvlink_speed_mbps": 0}, "NVLink speed unsupported (NVML field 90)"),
    ({"nvlink_down": tuple(range(18))}, "no active NVLink link"),
])
def test_where_nvml_cannot_say_the_maximum_is_absent_with_the_reason(nvml, changed, why):
    series, absent = exported(tensor_parallel_gpu(**changed), nvml)
    assert "gpu_nvlink_tx_bytes_per_second" in series  # the rates are still read
    assert {MAX, *SHARES}.isdisjoint(series)
    assert {absent[name] for name in (MAX, *SHARES)} == {why}


def test_the_default_scenarios_gpus_without_nvlink_keep_none(nvml):
    """The maximum appears where the stand-in has links (an SXM H200) and nowhere else."""
    series, _ = exported(build("healthy", 1).gpus[0], nvml)
    assert series[MAX] > 0
    series, _ = exported(pcie_card(), nvml)
    assert MAX not in series
