"""The NVML budget of the PCIe throughput fallback: where only ``nvmlDeviceGetPcieThroughput``
gives PCIe rates (no byte counters, no GPM: an Ampere on an old driver), each GPU makes at most
one such call (a 20 ms sample, blocking in the driver) per 10 s, RX and TX in turn, and the
rates between are carried: still within 5 % of what the stand-in's counters say moved."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from itertools import pairwise

import pynvml
import pytest

from sidecar.simulate import fake_nvml
from sidecar.simulate.fake_nvml import Signal
from sidecar.simulate.scenarios import build
from sidecar.sources.nvml import NvmlSource
from sidecar.sources.nvml.source import THROUGHPUT_CALL_S

GPUS = 8
RUN_S = 95  # simulated seconds at a 1 s interval: ten calls per GPU at most
# a steady copy load, as a model server's host-to-device traffic is between batches: 5 % per
# 20 s at most would need a period under about 250 s at this amplitude
RX = Signal(8e9, 0.1, 1200.0)
TX = Signal(2e9, 0.1, 900.0)


@pytest.fixture
def fallback_node(clock):
    """Eight A100s on an old driver (the old-driver scenario, steady loads), every throughput
    call recorded as (GPU handle, simulated time, direction)."""
    scenario = build("old-driver", GPUS)
    gpus = tuple(replace(g, pcie_rx=RX, pcie_tx=TX) for g in scenario.gpus)
    fake = fake_nvml.install(replace(scenario, gpus=gpus).nvml(clock=clock,
                                                               throughput_blocking=False))
    calls: list[tuple[int, float, int]] = []
    answer = fake.library.__dict__["nvmlDeviceGetPcieThroughput"]

    def recorded(handle, counter, ref):
        calls.append((fake_nvml._pointer_value(handle), fake.now(), counter.value))
        return answer(handle, counter, ref)

    fake.library.__dict__["nvmlDeviceGetPcieThroughput"] = recorded
    source = NvmlSource(clock=clock, sleep=clock.advance)
    source.open()
    try:
        yield fake, source, calls
    finally:
        source.close()
        fake_nvml.uninstall()


def run(source: NvmlSource, clock, seconds: int) -> list[tuple[float, dict]]:
    uuids = [d.uuid for d in source.devices()]
    out = []
    for _ in range(seconds):
        out.append((clock(), source.read(uuids)))
        clock.advance(1.0)
    return out


def test_at_most_one_throughput_call_per_gpu_per_10_s_the_directions_in_turn(fallback_node, clock):
    _, source, calls = fallback_node
    assert all(source.capabilities(d.uuid)["pcie"] == "throughput" for d in source.devices())
    run(source, clock, RUN_S)
    by_gpu: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for handle, t, counter in calls:
        by_gpu[handle].append((t, counter))
    assert len(by_gpu) == GPUS
    for made in by_gpu.values():
        times = [t for t, _ in made]
        assert all(b - a >= THROUGHPUT_CALL_S for a, b in pairwise(times)), times
        assert len(made) == RUN_S // THROUGHPUT_CALL_S + 1  # and no fewer: each one when due
        directions = [c for _, c in made]
        assert directions[0] == pynvml.NVML_PCIE_UTIL_RX_BYTES  # host-to-device copies first
        assert all(a != b for a, b in pairwise(directions))  # in turn
    assert len(calls) <= GPUS * (RUN_S // THROUGHPUT_CALL_S + 1)  # was 2 x 8 every cycle


def test_the_carried_rates_stay_within_5_percent_of_the_stand_ins_counters(fallback_node, clock):
    fake, source, _ = fallback_node
    readings = run(source, clock, RUN_S)
    checked = 0
    for t, cycle in readings:
        now = t - fake.t0
        for reading in cycle.values():
            assert reading is not None
            for rate, signal in ((reading.io.pcie_rx_bytes_per_second, RX),
                                 (reading.io.pcie_tx_bytes_per_second, TX)):
                if rate is None:  # TX before its first call, 10 s in
                    assert signal is TX and now < THROUGHPUT_CALL_S
                    continue
                moved = signal.mean(now - 1.0, now)  # what the counters say the last second
                assert rate == pytest.approx(moved, rel=0.05), (now, rate, moved)
                checked += 1
    assert checked > GPUS * (2 * RUN_S - THROUGHPUT_CALL_S) * 0.9


def test_a_failed_throughput_call_leaves_its_direction_absent_not_stale(fallback_node, clock):
    fake, source, _ = fallback_node
    uuid = source.devices()[0].uuid
    run(source, clock, 11)  # RX at 0, TX at 10
    fake.library.__dict__["nvmlDeviceGetPcieThroughput"] = \
        lambda *args: pynvml.NVML_ERROR_UNKNOWN
    clock.advance(THROUGHPUT_CALL_S - 1)  # t=20: RX is due, and fails
    r = source.read([uuid])[uuid]
    assert r.io.pcie_rx_bytes_per_second is None
    assert r.io.pcie_tx_bytes_per_second == pytest.approx(TX.value(10.0), rel=0.05)
    assert source.errors["nvml_error"] == 1


def test_a_gpu_with_byte_counters_never_calls_the_throughput_fallback(install_fake, clock):
    fake = install_fake([replace(g, has_pcie_counters=True) for g in build("old-driver").gpus],
                        clock=clock, record_calls=True)
    source = NvmlSource(clock=clock, sleep=clock.advance)
    source.open()
    try:
        run(source, clock, 3)
    finally:
        source.close()
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0
