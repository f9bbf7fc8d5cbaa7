"""The rare figures' read (docs/metrics.md, *Cadence*): the error counters (ECC, PCIe replays
and PCIe errors) are asked for every ``rare_read_s``, and again at once whenever the last
answer is no base: a refused field-values call on a rare cycle, and a GPU lost and back. Against
the NVML stand-in, with pynvml's own code; each count held against what the stand-in holds at
that instant (they climb, so a carried or stale count is told from a fresh one)."""

from __future__ import annotations

from dataclasses import replace

import pynvml

from sidecar.simulate.fake_nvml import FakeGpu, FakeNvml, Signal
from sidecar.sources.nvml import NvmlSource

GiB = 1024**3
RARE_READ_S = 10.0


def climbing_gpu(**kw: object) -> FakeGpu:
    """A GPU whose ECC, PCIe replay and PCIe correctable error counts climb every second."""
    base = FakeGpu(uuid="GPU-00000000-aaaa-bbbb-cccc-dddddddddddd", name="Simulated H200",
                   pci_bus_id="00000000:10:00.0", memory_used=Signal(10 * GiB),
                   utilization=Signal(97), pcie_tx=Signal(1e9), pcie_rx=Signal(5e9),
                   ecc_uncorrected_per_second=1.0, ecc_corrected_per_second=3.0,
                   replays_per_second=2.0, pcie_correctable_errors_per_second=5.0)
    return replace(base, **kw)  # type: ignore[arg-type]


def counts(reading) -> tuple[int | None, ...]:
    return (reading.health.ecc_uncorrected_volatile, reading.health.ecc_corrected_volatile,
            reading.io.pcie_replay_errors, reading.health.pcie_correctable_errors)


def held(fake: FakeNvml) -> tuple[int, ...]:
    """What the stand-in holds now: the counts a fresh ask returns."""
    gpu, t = fake.gpus[0], fake.now()
    return (fake.ecc_count(gpu, False, True, t), fake.ecc_count(gpu, True, True, t),
            int(gpu.replays_per_second * t), int(gpu.pcie_correctable_errors_per_second * t))


def test_a_refused_field_values_call_on_a_rare_cycle_asks_every_rare_field_the_next_cycle(
        install_fake, clock):
    fake = install_fake([climbing_gpu()], clock=clock, record_calls=True)
    source = NvmlSource(clock=clock, rare_read_s=RARE_READ_S)
    source.open()
    uuid = source.devices()[0].uuid
    try:
        first = counts(source.read([uuid])[uuid])
        assert first == held(fake)  # t = 0: asked
        clock.advance(RARE_READ_S - 1)
        assert counts(source.read([uuid])[uuid]) == first  # carried until the next rare read
        call = fake._fns["nvmlDeviceGetFieldValues"]
        real = call._impl
        call._impl = lambda *args: pynvml.NVML_ERROR_UNKNOWN
        clock.advance(1)  # the rare read is due and refused: no count this cycle
        assert counts(source.read([uuid])[uuid]) == (None,) * 4
        call._impl = real
        clock.advance(1)  # the very next cycle asks every rare field again, not 10 s later
        again = counts(source.read([uuid])[uuid])
        assert again == held(fake) and all(a > b for a, b in zip(again, first, strict=True))
    finally:
        source.close()


def test_a_gpu_lost_and_back_has_its_current_error_counts_in_its_first_reading(install_fake,
                                                                               clock):
    """Lost for less than the rare period: the counts from before the loss are no base, so
    the first reading after it asks for them, as the first reading of a run does."""
    fake = install_fake([climbing_gpu(lost_between=(2.0, 4.0))], clock=clock)
    source = NvmlSource(clock=clock, rare_read_s=RARE_READ_S, lost_retry_s=1.0)
    source.open()
    uuid = source.devices()[0].uuid
    try:
        before = counts(source.read([uuid])[uuid])  # t = 0: the rare read
        assert before == held(fake)
        clock.advance(3.0)  # t = 3: lost
        assert source.read([uuid])[uuid] is None and source.is_lost(uuid)
        clock.advance(1.5)  # t = 4.5: back, 4.5 s after the last rare read
        back = source.read([uuid])[uuid]
        assert back is not None and not source.is_lost(uuid)
        assert counts(back) == held(fake)
        assert all(b > a for a, b in zip(before, counts(back), strict=True))
    finally:
        source.close()
