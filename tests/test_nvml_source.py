"""The NVML source against the stand-in library: pynvml's own code runs for every call."""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from dataclasses import replace

import pynvml
import pytest
import structlog

from sidecar.simulate import fake_nvml
from sidecar.simulate.fake_nvml import OLD_DRIVER_MISSING, FakeGpu, FakeMig, FakeNvml, Signal
from sidecar.simulate.scenarios import build
from sidecar.sources.nvml import NvmlSource, NvmlUnavailable

GiB = 1024**3
GEN5_X16 = 32e9 * 128 / 130 / 8 * 16


def gpu(i: int = 0, **kw) -> FakeGpu:
    base = FakeGpu(uuid=f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd", name="Simulated H200",
                   pci_bus_id=f"00000000:1{i}:00.0", memory_used=Signal(10 * GiB),
                   utilization=Signal(97), memory_busy=Signal(40), sm_occupancy=Signal(20),
                   tensor=Signal(10), sm_active=Signal(90), dram_bw=Signal(30),
                   pcie_tx=Signal(1e9), pcie_rx=Signal(50e9), nvlink_tx=Signal(36e9),
                   nvlink_rx=Signal(18e9))
    return replace(base, **kw)


def open_source(clock, **kw) -> NvmlSource:
    source = NvmlSource(clock=clock, **kw)
    source.open()
    return source


def test_two_readings_give_rates_from_byte_counters_and_gpm_averages(install_fake, clock):
    install_fake([gpu()], clock=clock)
    source = open_source(clock)
    uuid = source.devices()[0].uuid
    first = source.read([uuid])[uuid]
    assert first is not None
    # one reading cannot give a rate or an interval average: absent, not zero
    assert first.io.pcie_rx_bytes_per_second is None
    assert first.compute.sm_occupancy_ratio is None
    assert first.compute.utilization_ratio == 0.97
    clock.advance(5.0)
    r = source.read([uuid])[uuid]
    assert r.io.pcie_rx_bytes_per_second == pytest.approx(50e9, rel=1e-9)
    assert r.io.pcie_tx_bytes_per_second == pytest.approx(1e9, rel=1e-9)
    assert r.io.pcie_link_max_bytes_per_second == pytest.approx(GEN5_X16)
    assert (r.io.pcie_link_generation, r.io.pcie_link_width) == (5, 16)
    # NVLink: per-link KiB counters over 18 links, summed (integer KiB truncation per link)
    assert r.io.nvlink_tx_bytes_per_second == pytest.approx(36e9, rel=1e-6)
    assert r.io.nvlink_rx_bytes_per_second == pytest.approx(18e9, rel=1e-6)
    assert r.compute.sm_occupancy_ratio == pytest.approx(0.20)
    assert r.compute.tensor_core_util_ratio == pytest.approx(0.10)
    assert r.compute.sm_active_ratio == pytest.approx(0.90)
    assert r.memory.bandwidth_util_ratio == pytest.approx(0.30)
    assert r.memory.controller_busy_ratio == 0.40
    assert r.memory.used_bytes == 10 * GiB
    assert r.memory.reserved_bytes == 512 * 1024**2
    assert r.memory.total_bytes == 141 * GiB
    source.close()


def test_gpm_figure_is_the_average_over_the_interval_not_a_point_value(install_fake, clock):
    # occupancy 40 % * (1 + 0.5 sin(2 pi t / 20)); between t=0 and t=5 its mean is
    # 40 * (1 + 0.5 * (20 / 2pi) * (cos 0 - cos(pi/2)) / 5) = 40 * (1 + 1/pi) = 52.732 %
    install_fake([gpu(sm_occupancy=Signal(40, 0.5, 20))], clock=clock)
    source = open_source(clock)
    uuid = source.devices()[0].uuid
    fake = pynvml.nvmlLib.fake
    clock.advance(-fake.now())  # put the fake's t at exactly 0 for the first sample
    source.read([uuid])
    clock.advance(5.0)
    r = source.read([uuid])[uuid]
    assert r.compute.sm_occupancy_ratio == pytest.approx(0.40 * (1 + 1 / math.pi), rel=1e-9)
    # the point value at t=5 would be 0.60: the agent must not report it
    assert r.compute.sm_occupancy_ratio != pytest.approx(0.60)


def test_consecutive_gpm_intervals_each_average_their_own_span(install_fake, clock):
    # the agent alternates between two GPM samples; every interval must run from the previous
    # cycle's sample to this one's, whichever buffer each landed in
    occupancy, dram = Signal(40, 0.5, 20), Signal(30, 0.8, 7)
    install_fake([gpu(sm_occupancy=occupancy, dram_bw=dram)], clock=clock)
    source = open_source(clock)
    uuid = source.devices()[0].uuid
    fake = pynvml.nvmlLib.fake
    source.read([uuid])
    t = fake.now()
    for span in (3.0, 5.0, 7.0, 2.0, 4.5):
        clock.advance(span)
        r = source.read([uuid])[uuid]
        assert r.compute.sm_occupancy_ratio == pytest.approx(
            occupancy.mean(t, t + span) / 100, rel=1e-9)
        assert r.memory.bandwidth_util_ratio == pytest.approx(dram.mean(t, t + span) / 100,
                                                              rel=1e-9)
        t += span


def test_a_reading_within_100ms_of_the_last_waits_out_gpms_minimum_and_keeps_its_figures(
        install_fake, clock):
    # the last sample at shutdown often lands just after a cycle: it must neither warn nor
    # drop GPM, so the source waits out the rest of GPM's 100 ms minimum first
    install_fake([gpu(sm_occupancy=Signal(40, 0.5, 2))], clock=clock)
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock.advance(seconds)

    with structlog.testing.capture_logs() as logs:
        source = open_source(clock, sleep=sleep)
        uuid = source.devices()[0].uuid
        fake = pynvml.nvmlLib.fake
        source.read([uuid])
        t0 = fake.now()
        clock.advance(0.03)
        got = source.read([uuid])[uuid].compute.sm_occupancy_ratio
    assert slept == [pytest.approx(0.07)]
    assert got == pytest.approx(Signal(40, 0.5, 2).mean(t0, t0 + 0.1) / 100, rel=1e-9)
    assert not [e for e in logs if e["log_level"] == "warning"]


def test_a_pcie_counter_that_goes_backwards_is_a_reset_not_traffic(install_fake, clock):
    install_fake([gpu(pcie_counter_offset=10**15)], clock=clock)
    source = open_source(clock)
    uuid = source.devices()[0].uuid
    source.read([uuid])
    clock.advance(1.0)
    assert source.read([uuid])[uuid].io.pcie_rx_bytes_per_second == pytest.approx(50e9, rel=1e-9)
    fake = pynvml.nvmlLib.fake
    for key, (index, g, mig) in list(fake._devices.items()):  # a driver reload: counters restart
        fake._devices[key] = (index, replace(g, pcie_counter_offset=0), mig)
    clock.advance(1.0)
    r = source.read([uuid])[uuid]
    assert r.io.pcie_rx_bytes_per_second is None and r.io.pcie_tx_bytes_per_second is None
    clock.advance(1.0)
    assert source.read([uuid])[uuid].io.pcie_rx_bytes_per_second == pytest.approx(50e9, rel=1e-9)


@pytest.mark.parametrize(("bits", "generation"), [(64, 5), (32, 1)])
def test_pcie_byte_counter_wrap_is_handled(install_fake, clock, bits, generation):
    # the counter starts 1 GB below its wrap point and receives 2 GB/s: it wraps in the middle
    # of the 1 s interval, so the second reading is below the first. A 32-bit counter is used
    # only where it cannot wrap twice in an interval: a Gen1 x16 link (4 GB/s) at 1 s
    rate = 2e9
    install_fake([gpu(pcie_counter_bits=bits, pcie_counter_offset=2**bits - 10**9,
                      pcie_rx=Signal(rate), link_generation=generation)], clock=clock)
    source = open_source(clock, interval_s=0.5)
    uuid = source.devices()[0].uuid
    assert source.capabilities(uuid)["pcie"] == "counters"
    fake, g = pynvml.nvmlLib.fake, pynvml.nvmlLib.fake.gpus[0]
    before = fake.pcie_counter(g, g.pcie_rx, fake.now())
    source.read([uuid])
    clock.advance(1.0)
    assert fake.pcie_counter(g, g.pcie_rx, fake.now()) < before, "the test must cross the wrap"
    r = source.read([uuid])[uuid]
    assert r.io.pcie_rx_bytes_per_second == pytest.approx(rate, rel=1e-9)
    if bits == 32:  # a gap long enough for two wraps at the link maximum gives no rate
        clock.advance(2.0)
        assert source.read([uuid])[uuid].io.pcie_rx_bytes_per_second is None


@pytest.mark.parametrize(("gpm", "way"), [(True, "gpm"), (False, "throughput")])
def test_a_32_bit_counter_that_could_wrap_twice_per_interval_is_never_used(
        install_fake, clock, gpm, way):
    # fields 197/198 as 32-bit values on a Gen5 x16 link: 4.29 GB is 68 ms of traffic
    install_fake([gpu(pcie_counter_bits=32, has_gpm=gpm, pcie_tx=Signal(3e9),
                      pcie_rx=Signal(60e9))], clock=clock)
    with structlog.testing.capture_logs() as logs:
        source = open_source(clock, interval_s=1.0)
        uuid = source.devices()[0].uuid
        for _ in range(3):  # the throughput fallback samples RX, then TX 10 s later
            clock.advance(1.0 if way == "gpm" else 10.0)
            r = source.read([uuid])[uuid]
    caps = source.capabilities(uuid)
    assert caps["pcie"] == way and "32-bit" in caps["pcie_note"]
    assert r.io.pcie_rx_bytes_per_second == pytest.approx(60e9, rel=1e-6)
    assert r.io.pcie_tx_bytes_per_second == pytest.approx(3e9, rel=1e-6)
    assert [e["event"] for e in logs].count("pcie_counters_too_narrow") == 1


def test_pcie_from_gpm_when_the_byte_counters_are_missing(install_fake, clock):
    # GPM reports MiB/s per direction; TX and RX differ by 50x, so a swap cannot pass, and
    # MB instead of MiB would be 4.6 % off
    install_fake([gpu(has_pcie_counters=False)], clock=clock)
    source = open_source(clock)
    uuid = source.devices()[0].uuid
    assert source.capabilities(uuid)["pcie"] == "gpm"
    source.read([uuid])
    clock.advance(2.0)
    r = source.read([uuid])[uuid]
    assert r.io.pcie_tx_bytes_per_second == pytest.approx(1e9, rel=1e-9)
    assert r.io.pcie_rx_bytes_per_second == pytest.approx(50e9, rel=1e-9)


def test_nvlink_from_per_link_field_counters_without_gpm(install_fake, clock):
    # without GPM the per-link KiB counters are summed over the 18 links
    install_fake([gpu(has_gpm=False)], clock=clock)
    source = open_source(clock)
    uuid = source.devices()[0].uuid
    assert source.capabilities(uuid)["nvlink"] == "counters"
    source.read([uuid])
    clock.advance(2.0)
    r = source.read([uuid])[uuid]
    assert r.io.nvlink_tx_bytes_per_second == pytest.approx(36e9, rel=1e-6)
    assert r.io.nvlink_rx_bytes_per_second == pytest.approx(18e9, rel=1e-6)
    # the counters restart (a GPU reset): a reset, not 16 EB/s of traffic
    fake = pynvml.nvmlLib.fake
    for key, (index, g, mig) in list(fake._devices.items()):
        fake._devices[key] = (index, replace(g, nvlink_tx=Signal(36e6),
                                             nvlink_rx=Signal(18e6)), mig)
    clock.advance(2.0)
    r = source.read([uuid])[uuid]
    assert r.io.nvlink_tx_bytes_per_second is None and r.io.nvlink_rx_bytes_per_second is None
    clock.advance(2.0)
    r = source.read([uuid])[uuid]
    assert r.io.nvlink_tx_bytes_per_second == pytest.approx(36e6, rel=1e-3)


def test_calibrated_peak_replaces_the_theoretical_link_maximum(install_fake, clock):
    install_fake([gpu()], clock=clock)
    source = open_source(clock, pcie_peak_bytes_per_second=52e9)
    uuid = source.devices()[0].uuid
    assert source.read([uuid])[uuid].io.pcie_link_max_bytes_per_second == 52e9


@pytest.mark.parametrize(("missing", "way"), [
    (frozenset(), "field"),
    (frozenset({"nvmlDeviceGetFieldValues"}), "call"),  # a driver without field values
])
def test_pcie_replay_counter_is_read_from_the_field_or_else_the_call(install_fake, clock,
                                                                     missing, way):
    install_fake([gpu(replays_per_second=3.0)], clock=clock, missing=missing)
    source = open_source(clock)
    uuid = source.devices()[0].uuid
    assert source.capabilities(uuid)["replay"] == way
    fake = pynvml.nvmlLib.fake
    for _ in range(3):
        clock.advance(10.0)
        r = source.read([uuid])[uuid]
        assert r.io.pcie_replay_errors == int(3.0 * fake.now())
        assert r.io.pcie_replay_errors > 0


def test_old_driver_falls_back_and_reports_what_is_absent(install_fake, clock):
    old = gpu(architecture=pynvml.NVML_DEVICE_ARCH_AMPERE, has_gpm=False, has_pcie_counters=False,
              nvlink_links=0, link_generation=4, pcie_rx=Signal(8e9))
    install_fake([old], clock=clock, missing=OLD_DRIVER_MISSING)
    source = open_source(clock)
    uuid = source.devices()[0].uuid
    caps = source.capabilities(uuid)
    assert caps["memory"] == "v1" and caps["gpm"] is False and caps["pcie"] == "throughput"
    absent = source.absent(uuid)
    assert "FunctionNotFound" in absent["gpu_sm_occupancy_ratio"]
    assert "gpu_memory_reserved_bytes" in absent
    assert "gpu_nvlink_tx_bytes_per_second" in absent
    r = source.read([uuid])[uuid]
    assert r.compute.sm_occupancy_ratio is None and r.memory.bandwidth_util_ratio is None
    assert r.memory.reserved_bytes is None
    # v1 "used" includes the driver's reservation
    assert r.memory.used_bytes == 10 * GiB + 512 * 1024**2
    # throughput is KB/s over a 20 ms window: 8e9 B/s -> 7812500 KiB/s
    assert r.io.pcie_rx_bytes_per_second == pytest.approx(8e9, rel=1e-6)
    assert r.io.pcie_link_max_bytes_per_second == pytest.approx(GEN5_X16 / 2)


def test_blocking_throughput_calls_run_concurrently_across_gpus(install_fake, monkeypatch):
    monkeypatch.setattr(fake_nvml, "THROUGHPUT_WINDOW_S", 0.3)  # long enough to overlap on a busy box
    fake = install_fake([gpu(i, has_pcie_counters=False, has_gpm=False) for i in range(8)],
                        throughput_blocking=True)
    source = open_source(fake_nvml.time.monotonic)
    uuids = [d.uuid for d in source.devices()]
    readings = source.read(uuids)
    assert all(r is not None and r.io.pcie_rx_bytes_per_second for r in readings.values())
    # 8 GPUs, one call each this cycle (RX first, TX in 10 s): all 8 in flight at once, never
    # serial
    assert fake.max_concurrent_throughput == 8
    source.close()


def test_lost_gpu_is_set_aside_retried_later_and_never_stops_the_others(install_fake, clock):
    gpus = [gpu(i) for i in range(4)]
    gpus[2] = replace(gpus[2], lost_between=(2.0, 8.0))
    fake = install_fake(gpus, clock=clock, record_calls=True)
    source = open_source(clock, lost_retry_s=3.0)
    uuids = [d.uuid for d in source.devices()]
    assert all(source.read(uuids).values())
    clock.advance(5.0)  # t=5: lost
    r = source.read(uuids)
    assert r[uuids[2]] is None
    assert all(r[u] is not None and r[u].io.pcie_rx_bytes_per_second for u in uuids if u != uuids[2])
    assert source.errors["gpu_lost"] == 1
    before = fake.calls["nvmlDeviceGetHandleByUUID"]
    clock.advance(1.0)  # t=6: not yet time to retry
    assert source.read(uuids)[uuids[2]] is None
    assert fake.calls["nvmlDeviceGetHandleByUUID"] == before
    clock.advance(2.5)  # t=8.5: retry due, and the GPU is back
    back = source.read(uuids)
    assert back[uuids[2]] is not None
    assert source.errors["gpu_lost"] == 1
    assert not source.is_lost(uuids[2])


def test_transient_error_drops_only_that_figure_for_that_cycle(install_fake, clock):
    fake = install_fake([gpu()], clock=clock, record_calls=True)
    source = open_source(clock)
    uuid = source.devices()[0].uuid
    real = fake._fns["nvmlDeviceGetUtilizationRates"]._impl
    fake._fns["nvmlDeviceGetUtilizationRates"]._impl = lambda h, ref: pynvml.NVML_ERROR_UNKNOWN
    r = source.read([uuid])[uuid]
    assert r.compute.utilization_ratio is None
    assert r.memory.used_bytes == 10 * GiB  # everything else still read
    assert source.errors["nvml_error"] == 1
    fake._fns["nvmlDeviceGetUtilizationRates"]._impl = real
    assert source.read([uuid])[uuid].compute.utilization_ratio == 0.97


def test_the_power_limit_is_asked_for_with_the_rare_figures_and_carried_between(install_fake,
                                                                               clock):
    """An operator's new limit reaches the reading at the next rare read (docs/metrics.md,
    *Cadence*); a refused ask is asked again the next cycle, and meanwhile the limit is absent."""
    fake = install_fake([gpu()], clock=clock, record_calls=True)
    source = open_source(clock, rare_read_s=10.0)
    uuid = source.devices()[0].uuid
    call = fake._fns["nvmlDeviceGetEnforcedPowerLimit"]
    real, asked = call._impl, fake.calls["nvmlDeviceGetEnforcedPowerLimit"]

    def limit_w(answer: object = None) -> float | None:
        if answer is not None:
            call._impl = answer
        clock.advance(1.0)
        return source.read([uuid])[uuid].health.power_limit_watts

    def set_to(mw: int) -> object:
        def impl(handle: object, ref: object) -> int:
            ref._obj.value = mw
            return pynvml.NVML_SUCCESS
        return impl

    first = [limit_w() for _ in range(9)]  # t = 1..9: the ask at t = 1, carried
    assert first == [700.0] * 9
    assert fake.calls["nvmlDeviceGetEnforcedPowerLimit"] - asked == 1
    assert limit_w(set_to(450_000)) == 700.0  # t = 10: the new limit is not asked for yet
    assert limit_w() == 450.0  # t = 11: ten seconds after the last ask
    assert limit_w(lambda h, ref: pynvml.NVML_ERROR_UNKNOWN) == 450.0
    later = [limit_w() for _ in range(9)]  # t = 13..21: the ask at t = 21 is refused
    assert later[-1] is None and later[:-1] == [450.0] * 8
    call._impl = real
    assert limit_w() == 700.0  # asked again the very next cycle, not ten seconds later
    assert fake.calls["nvmlDeviceGetEnforcedPowerLimit"] - asked == 4


def test_mig_instances_have_their_own_uuid_memory_and_gpm_and_the_parents_link(install_fake, clock):
    migs = (FakeMig(1, "MIG-11111111-2222-3333-4444-555555555555", "Simulated H200 MIG 3g.71gb",
                    71 * GiB, memory_used=Signal(5 * GiB), sm_occupancy=Signal(33)),
            FakeMig(2, "MIG-66666666-7777-8888-9999-000000000000", "Simulated H200 MIG 3g.71gb",
                    71 * GiB, memory_used=Signal(7 * GiB), sm_occupancy=Signal(66)))
    install_fake([gpu(mig=migs)], clock=clock)
    source = open_source(clock)
    ids = {d.uuid: d for d in source.devices()}
    assert set(ids) == {gpu().uuid, migs[0].uuid, migs[1].uuid}
    m1 = ids[migs[0].uuid]
    assert m1.parent_uuid == gpu().uuid and m1.index == "0/0"
    uuids = list(ids)
    source.read(uuids)
    clock.advance(2.0)
    r = source.read(uuids)
    assert r[migs[0].uuid].memory.used_bytes == 5 * GiB
    assert r[migs[1].uuid].memory.total_bytes == 71 * GiB
    assert r[migs[0].uuid].compute.sm_occupancy_ratio == pytest.approx(0.33)
    assert r[migs[1].uuid].compute.sm_occupancy_ratio == pytest.approx(0.66)
    assert r[migs[0].uuid].io.pcie_link_max_bytes_per_second == pytest.approx(GEN5_X16)
    assert r[migs[0].uuid].compute.utilization_ratio is None
    assert r[migs[0].uuid].io.pcie_rx_bytes_per_second is None
    assert "MIG" in source.absent(migs[0].uuid)["gpu_pcie_rx_bytes_per_second"]
    # nothing was asked of a MIG handle that the real library answers only for the parent
    assert pynvml.nvmlLib.fake.mig_handle_refused == {}


def test_a_lost_mig_instance_is_reopened_through_its_parent(install_fake, clock):
    mig = FakeMig(1, "MIG-11111111-2222-3333-4444-555555555555", "Simulated H200 MIG 3g.71gb",
                  71 * GiB, memory_used=Signal(5 * GiB), sm_occupancy=Signal(33))
    fake = install_fake([gpu(mig=(mig,))], clock=clock)
    source = open_source(clock, lost_retry_s=2.0)
    assert source.read([mig.uuid])[mig.uuid] is not None
    start = fake.now()
    for key, (index, g, m) in list(fake._devices.items()):  # the GPU falls off the bus
        fake._devices[key] = (index, replace(g, lost_between=(start, start + 5.0)), m)
    fake.gpus[0] = replace(fake.gpus[0], lost_between=(start, start + 5.0))
    clock.advance(1.0)
    assert source.read([mig.uuid])[mig.uuid] is None and source.is_lost(mig.uuid)
    clock.advance(2.5)  # retried, the GPU still lost
    assert source.read([mig.uuid])[mig.uuid] is None
    clock.advance(2.5)  # back
    first = source.read([mig.uuid])[mig.uuid]
    assert first is not None and first.memory.used_bytes == 5 * GiB
    clock.advance(1.0)
    again = source.read([mig.uuid])[mig.uuid]
    assert again.compute.sm_occupancy_ratio == pytest.approx(0.33)  # GPM through the parent
    assert not source.is_lost(mig.uuid) and fake.mig_handle_refused == {}
    # lost again, and back after a reset in another slot: found by its UUID
    other = FakeMig(2, "MIG-99999999-2222-3333-4444-555555555555", "Simulated H200 MIG 1g.18gb",
                    18 * GiB)
    now = fake.now()
    fake.gpus[0] = replace(fake.gpus[0], mig=(other, mig), lost_between=(now, now + 1.0))
    fake._devices.clear()  # handles resolve afresh: slot 0 is now the other instance
    clock.advance(0.5)
    assert source.read([mig.uuid])[mig.uuid] is None
    clock.advance(2.5)
    back = source.read([mig.uuid])[mig.uuid]
    assert back is not None and back.memory.used_bytes == 5 * GiB  # ours, not slot 0's


@pytest.mark.parametrize("name", ["healthy", "pcie-saturated", "fragmented", "low-occupancy",
                                  "gpu-lost", "old-driver"])
def test_every_scenario_runs_through_pynvml(name, clock):
    scenario = build(name)
    fake_nvml.install(scenario.nvml(clock=clock, throughput_blocking=False))
    try:
        source = open_source(clock)
        uuids = [d.uuid for d in source.devices()]
        assert len(uuids) == len(scenario.gpus)
        assert all("Simulated" in d.name for d in source.devices())
        source.read(uuids)
        clock.advance(5.0)
        readings = source.read(uuids)
        alive = [r for r in readings.values() if r is not None]
        assert len(alive) == len(uuids) - (1 if name == "gpu-lost" else 0)
        for r in alive:
            assert r.memory.used_bytes and r.io.pcie_rx_bytes_per_second
        source.close()
    finally:
        fake_nvml.uninstall()


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None,
                    reason="this machine has a real NVML library")
def test_missing_nvml_library_is_a_clear_error_that_says_what_to_set():
    fake_nvml.uninstall()
    with pytest.raises(NvmlUnavailable) as err:
        NvmlSource().open()
    text = str(err.value)
    assert "libnvidia-ml.so.1" in text
    assert "NVIDIA_VISIBLE_DEVICES" in text and "NVIDIA_DRIVER_CAPABILITIES=utility" in text
    assert "--no-nvml" in text


def test_fake_answers_unknown_functions_like_an_old_library():
    fake = FakeNvml([gpu()], missing={"nvmlDeviceGetMemoryInfo_v2"})
    with pytest.raises(AttributeError):
        fake.library.nvmlDeviceGetMemoryInfo_v2  # noqa: B018
    assert fake.library.nvmlDeviceGetMemoryInfo(None, None) == pynvml.NVML_ERROR_INVALID_ARGUMENT


def test_nvml_disappearing_mid_run_makes_gpus_unavailable_then_they_come_back(install_fake, clock):
    fake = install_fake([gpu(0), gpu(1)], clock=clock, record_calls=True)
    source = open_source(clock, lost_retry_s=2.0)
    uuids = [d.uuid for d in source.devices()]
    assert all(source.read(uuids).values())
    saved = {name: fn._impl for name, fn in fake._fns.items() if hasattr(fn, "_impl")}
    for fn in fake._fns.values():  # the driver was unloaded under us
        if hasattr(fn, "_impl"):
            fn._impl = lambda *args: pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    clock.advance(1.0)
    assert source.read(uuids) == {uuids[0]: None, uuids[1]: None}  # unavailable, not zeros
    assert source.errors["gpu_lost"] == 2
    clock.advance(3.0)
    assert source.read(uuids) == {uuids[0]: None, uuids[1]: None}  # retried, still gone
    for name, impl in saved.items():
        fake._fns[name]._impl = impl
    clock.advance(3.0)
    back = source.read(uuids)
    assert all(r is not None and r.memory.used_bytes for r in back.values())


def test_a_later_stand_in_without_a_symbol_answers_function_not_found(install_fake, clock):
    # pynvml caches each symbol it looks up; the cached symbol follows the installed stand-in,
    # so one without the symbol (an old driver) is FunctionNotFound however the last one was
    install_fake([gpu()], clock=clock)
    source = open_source(clock)
    assert source.capabilities(source.devices()[0].uuid)["memory"] == "v2"
    source.close()
    install_fake([gpu()], clock=clock, missing=OLD_DRIVER_MISSING)
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlGpmSampleAlloc()
    assert pynvml.nvmlDeviceGetMemoryInfo(handle).total == 141 * GiB


def test_the_stand_in_refuses_gpm_structures_of_another_version(install_fake):
    install_fake([gpu()])
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    support = pynvml.c_nvmlGpmSupport_t()
    support.version = pynvml.NVML_GPM_SUPPORT_VERSION + 1
    assert pynvml.nvmlLib.nvmlGpmQueryDeviceSupport(handle, ctypes.byref(support)) == \
        pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = pynvml.NVML_GPM_METRICS_GET_VERSION + 1
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        pynvml.nvmlGpmMetricsGet(request)
