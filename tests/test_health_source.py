"""The health layer and Grace IO as the NVML source reads them (issue #24), through pynvml's
public functions above the stand-in library: what each figure is on the four new scenarios, in
its unit; absent (never zero) where the GPU cannot give it, with the reason; Xids heard on a
thread of their own, never on the sampling path."""

from __future__ import annotations

import time

import pytest

from sidecar.metrics import RARE_READ_S
from sidecar.samples import GpuSample, gpu_labels, sample_series
from sidecar.simulate import fake_nvml
from sidecar.simulate.fake_nvml import FakeMig
from sidecar.simulate.scenarios import build
from sidecar.sources.nvml import NvmlSource
from sidecar.sources.pcie import link_max_bytes_per_second
from tests.manual_clock import ManualClock
from tests.waiting import until


@pytest.fixture
def scenario_source():
    opened: list[NvmlSource] = []

    def open_(name: str, clock: ManualClock | None = None) -> tuple[NvmlSource, list[str]]:
        clock = clock or ManualClock()
        fake_nvml.install(build(name).nvml(clock=clock, throughput_blocking=False))
        source = NvmlSource(clock=clock, sleep=clock.advance)
        source.open()
        opened.append(source)
        return source, [d.uuid for d in source.devices()]

    yield open_
    for source in opened:
        source.close()
    fake_nvml.uninstall()


def series_of(source: NvmlSource, uuid: str, reading) -> dict[str, float]:
    identity = next(d for d in source.devices() if d.uuid == uuid)
    sample = GpuSample(identity=identity, timestamp_ms=0, compute=reading.compute,
                       memory=reading.memory, io=reading.io, health=reading.health,
                       xids=reading.xids)
    out = {}
    for s in sample_series(sample, {}, gpu_labels(identity, {})):
        xid = dict(s.labels).get("xid")
        out[f"{s.name}{{xid={xid}}}" if xid else s.name] = s.value
    return out


def two_readings(source: NvmlSource, uuids: list[str], clock: ManualClock, dt: float = 5.0):
    source.read(uuids)
    clock.advance(dt)
    return source.read(uuids)


def test_a_gpu_at_its_power_cap_shows_the_share_of_time_capped_clocks_down_and_power_at_limit(
        scenario_source):
    clock = ManualClock()
    source, uuids = scenario_source("throttled", clock)
    series = series_of(source, uuids[0], two_readings(source, uuids, clock)[uuids[0]])
    # the stand-in holds the SW power cap 80 % of each 5 s period: over one whole period, 0.8
    assert series["gpu_clocks_event_power_cap_ratio"] == pytest.approx(0.8, abs=1e-6)
    assert series["gpu_clocks_event_hw_thermal_ratio"] == 0.0
    assert series["gpu_sm_clock_hertz"] < 0.75 * series["gpu_sm_clock_max_hertz"]
    assert series["gpu_sm_clock_max_hertz"] == 1980e6  # MHz from NVML, Hz exported
    assert series["gpu_power_usage_watts"] == pytest.approx(series["gpu_power_limit_watts"],
                                                            rel=0.01)
    assert series["gpu_power_limit_watts"] == 700.0  # mW from NVML, W exported


def test_a_link_trained_below_its_maximum_shows_the_share_of_the_trained_link_beside_the_max(
        scenario_source):
    clock = ManualClock()
    source, uuids = scenario_source("pcie-degraded", clock)
    series = series_of(source, uuids[0], two_readings(source, uuids, clock)[uuids[0]])
    assert (series["gpu_pcie_link_generation"], series["gpu_pcie_link_width"]) == (5, 16)
    assert (series["gpu_pcie_link_current_generation"],
            series["gpu_pcie_link_current_width"]) == (3, 8)
    assert series["gpu_pcie_link_current_bytes_per_second"] == link_max_bytes_per_second(3, 8)
    assert series["gpu_pcie_rx_current_link_util_ratio"] == pytest.approx(0.95, abs=0.03)
    assert series["gpu_pcie_rx_bandwidth_util_ratio"] == pytest.approx(
        0.95 * link_max_bytes_per_second(3, 8) / link_max_bytes_per_second(5, 16), abs=0.01)


def test_a_grace_hopper_gpu_shows_its_host_traffic_on_c2c_against_the_links_maximum(
        scenario_source):
    clock = ManualClock()
    source, uuids = scenario_source("grace-hopper", clock)
    series = series_of(source, uuids[0], two_readings(source, uuids, clock)[uuids[0]])
    assert series["gpu_c2c_link_max_bytes_per_second"] == 10 * 44712e6  # links x MB/s per link
    # the stand-in's data fills 90 % of the links; GPM's TOTAL, which the agent reads, adds the
    # protocol's 5 % (it is what occupies the links)
    assert series["gpu_c2c_rx_bandwidth_util_ratio"] == pytest.approx(0.9 * 1.05, abs=0.03)
    assert series["gpu_c2c_rx_bytes_per_second"] > 100 * series["gpu_pcie_rx_bytes_per_second"]
    assert source.capabilities(uuids[0])["host_link"] == "c2c"


def test_ecc_and_row_remapping_are_read_and_xids_are_counted_by_code_then_the_gpu_is_lost(
        scenario_source):
    clock = ManualClock()
    source, uuids = scenario_source("hardware-fault", clock)
    faulty, ecc = uuids[1], uuids[2]
    first = source.read(uuids)
    clock.advance(1.3)  # both Xid 79s are due (1.0 s, 1.2 s); the GPU is lost from 1.5 s
    counted = until(lambda: source._xids.counts(faulty)[1], 10, interval=0.01,
                    what="the Xid watcher to hear the two 79s")
    until(lambda: source._xids.counts(faulty)[1] == ((79, 2),), 10, interval=0.01,
          what=lambda: f"two Xid 79s (heard {counted})")
    readings = source.read(uuids)
    series = series_of(source, faulty, readings[faulty])
    assert series["gpu_xid_errors_total{xid=79}"] == 2
    assert series["gpu_last_xid"] == 79
    assert "gpu_xid_errors_total{xid=79}" not in series_of(source, uuids[0], readings[uuids[0]])
    assert "gpu_last_xid" not in series_of(source, uuids[0], readings[uuids[0]])  # absent, not 0
    clock.advance(RARE_READ_S)  # the error counters are asked for again after this long
    later = source.read(uuids)
    assert later[faulty] is None  # lost: its series stop, the others go on
    assert source.is_lost(faulty)
    before = series_of(source, ecc, first[ecc])
    after = series_of(source, ecc, later[ecc])
    assert after["gpu_ecc_uncorrected_volatile_total"] > before["gpu_ecc_uncorrected_volatile_total"]
    assert after["gpu_row_remap_pending"] == 1.0
    assert "gpu_xid_errors_total{xid=79}" in series_of(source, faulty, readings[faulty])


def test_a_cycle_never_waits_for_the_xid_watcher(scenario_source):
    clock = ManualClock()
    source, uuids = scenario_source("hardware-fault", clock)
    source.read(uuids)
    took = []
    for _ in range(20):  # the watcher sits in its 1 s wait all along
        started = time.perf_counter()
        clock.advance(0.05)
        source.read([uuids[0]])
        took.append(time.perf_counter() - started)
    assert max(took) < 0.5, f"a cycle took {max(took):.3f} s while the watcher waited"


def test_what_an_old_driver_cannot_give_is_absent_with_the_reason_never_zero(scenario_source):
    clock = ManualClock()
    source, uuids = scenario_source("old-driver", clock)
    absent = source.absent(uuids[0])
    series = series_of(source, uuids[0], two_readings(source, uuids, clock)[uuids[0]])
    for name in ("gpu_c2c_tx_bytes_per_second", "gpu_clocks_event_power_cap_ratio",
                 "gpu_pcie_correctable_errors_total", "gpu_power_usage_watts"):
        if name in absent:
            assert name not in series, f"{name} absent ({absent[name]}) yet exported"
    assert "no NVLink-C2C" in absent["gpu_c2c_tx_bytes_per_second"]
    # an R515 driver has neither the nanosecond counters nor the clocks-event calls
    assert "gpu_clocks_event_power_cap_ratio" in absent or \
        series["gpu_clocks_event_power_cap_ratio"] in (0.0, 1.0)  # the older throttle bitmask
    assert "gpu_temperature_celsius" in series  # what an old driver has is still read


def test_a_mig_instance_reports_its_health_on_the_parent_only(install_fake, clock):
    from tests.test_fake_nvml_health import gpu

    instance = FakeMig(gpu_instance_id=1, uuid="MIG-11111111-2222-3333-4444-555555555555",
                       name="Simulated H200 MIG 1g.18gb", memory_total=18 * 2**30)
    install_fake([gpu(0, mig=(instance,))], clock=clock)
    source = NvmlSource(clock=clock, sleep=clock.advance)
    source.open()
    try:
        absent = source.absent(instance.uuid)
        for name in ("gpu_sm_clock_hertz", "gpu_power_usage_watts", "gpu_xid_errors_total",
                     "gpu_ecc_uncorrected_volatile_total", "gpu_pcie_link_current_width"):
            assert absent[name] == "MIG instance: reported on the parent GPU only"
        parent = next(d.uuid for d in source.devices() if d.uuid.startswith("GPU-"))
        source.read([parent, instance.uuid])
        clock.advance(1.0)
        readings = source.read([parent, instance.uuid])
        assert "gpu_sm_clock_hertz" not in series_of(source, instance.uuid,
                                                     readings[instance.uuid])
        assert "gpu_sm_clock_hertz" in series_of(source, parent, readings[parent])
    finally:
        source.close()
