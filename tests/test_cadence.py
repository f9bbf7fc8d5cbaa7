"""The rare figures' cadence (docs/metrics.md, *Cadence*; issue #37): a pushing sink sends a
figure that changes a few times a year when it changes and again every minute, every other
figure every cycle; nothing an alert or a verdict needs is lost, nothing goes stale.

The rule on its own, then a real agent pushing to a real VictoriaMetrics on the hardware-fault
scenario (a GPU whose uncorrected ECC count climbs) and restarted."""

from __future__ import annotations

from sidecar.metrics import BY_NAME, RARE, RARE_READ_S
from sidecar.samples import Series
from sidecar.simulate import fake_nvml
from sidecar.simulate.scenarios import FAULT_ECC_INDEX, build
from sidecar.sinks.cadence import RESEND_S, Cadence
from sidecar.sources.nvml import NvmlSource
from tests.manual_clock import ManualClock
from tests.receivers import Agent, VictoriaMetrics, running

GPU = (("gpu_uuid", "GPU-1"),)
ECC = "gpu_ecc_uncorrected_volatile_total"
MAX = "gpu_sm_clock_max_hertz"


def sent(cadence: Cadence, at_s: float, **values: float) -> set[str]:
    cycle = [Series(name, GPU, value, int(at_s * 1000)) for name, value in values.items()]
    return {s.name for s in cadence.due(cycle)}


def test_the_rare_figures_are_the_ones_that_change_a_few_times_a_year():
    assert {ECC, MAX, "gpu_power_limit_watts", "gpu_pcie_link_generation",
            "gpu_row_remap_pending", "gpu_xid_errors_total"} <= RARE
    # what a verdict reads every cycle never thins: rates, shares, clocks, the trained link
    assert not RARE & {"gpu_pcie_rx_bandwidth_util_ratio", "gpu_sm_clock_hertz",
                       "gpu_pcie_link_current_generation", "gpu_utilization_ratio",
                       "gpu_verdict", "gpu_sidecar_up"}
    assert all(BY_NAME[name].cadence == "rare" for name in RARE)


def test_a_changed_counter_is_sent_in_the_same_cycle_and_an_unchanged_one_within_its_period():
    cadence = Cadence(RARE)
    util = "gpu_utilization_ratio"
    assert sent(cadence, 0, **{ECC: 0, MAX: 2e9, util: 0.5}) == {ECC, MAX, util}  # first cycle
    assert sent(cadence, 1, **{ECC: 0, MAX: 2e9, util: 0.5}) == {util}
    assert sent(cadence, 2, **{ECC: 3, MAX: 2e9, util: 0.5}) == {ECC, util}  # changed: at once
    assert sent(cadence, RESEND_S - 1, **{ECC: 3, MAX: 2e9, util: 0.5}) == {util}
    assert sent(cadence, RESEND_S, **{ECC: 3, MAX: 2e9, util: 0.5}) == {MAX, util}
    assert sent(cadence, RESEND_S + 2, **{ECC: 3, MAX: 2e9, util: 0.5}) == {ECC, util}
    assert RESEND_S * 4 < 300  # re-sent well within Prometheus' 5-minute look-back
    # a restart: a new sink's memory is empty, so it sends every figure again
    assert sent(Cadence(RARE), RESEND_S + 3, **{ECC: 3, MAX: 2e9}) == {ECC, MAX}


def test_a_rare_figure_is_sent_again_when_the_wall_clock_steps_back():
    """Samples carry the wall clock's time. Stepped back (an NTP correction, a VM restored),
    the next cycle's time is before the last send: the rare figures go out again at once and
    count their period from there, rather than wait until the clock is past the last send
    again (a stepped-back hour would leave them unsent, stale in every receiver, for an hour)."""
    cadence = Cadence(RARE)
    at = 10_000.0
    assert sent(cadence, at, **{ECC: 3, MAX: 2e9}) == {ECC, MAX}
    assert sent(cadence, at + 1, **{ECC: 3, MAX: 2e9}) == set()
    back = at - 3600  # the clock steps back an hour
    assert sent(cadence, back, **{ECC: 3, MAX: 2e9}) == {ECC, MAX}
    assert sent(cadence, back + 1, **{ECC: 3, MAX: 2e9}) == set()
    assert sent(cadence, back + RESEND_S, **{ECC: 3, MAX: 2e9}) == {ECC, MAX}


def ecc_readings(rare_read_s: float, steps: list[float]) -> tuple[list[float], list[float]]:
    """The fault GPU's uncorrected ECC count as the source read it, and as the stand-in held it,
    at each step of a simulated clock (``hardware-fault``: it climbs 0.5 a second)."""
    clock = ManualClock()
    loaded = clock()  # the stand-in's driver loads now: its volatile counts start at 0
    fake_nvml.install(build("hardware-fault").nvml(clock=clock, throughput_blocking=False))
    source = NvmlSource(clock=clock, sleep=clock.advance, rare_read_s=rare_read_s)
    source.open()
    try:
        uuid = [d.uuid for d in source.devices()][FAULT_ECC_INDEX]
        read, held = [], []
        for dt in steps:
            clock.advance(dt)
            reading = source.read([uuid])[uuid]
            read.append(reading.health.ecc_uncorrected_volatile)
            held.append(float(int(0.5 * (clock() - loaded))))
        return read, held
    finally:
        source.close()
        fake_nvml.uninstall()


def test_the_error_counters_are_asked_for_every_rare_read_period_and_carried_between():
    steps = [0.0] + [1.0] * int(2 * RARE_READ_S + 1)
    read, held = ecc_readings(RARE_READ_S, steps)
    assert held[-1] > held[0] + 2, "the stand-in's ECC count did not climb"
    asked = [i for i in range(1, len(read)) if read[i] != read[i - 1]]
    # a climb reaches the reading at the next ask, RARE_READ_S after the last, not before
    assert asked == [int(RARE_READ_S), int(2 * RARE_READ_S)]
    assert all(read[i] == held[i] for i in (0, *asked))  # what NVML said when asked
    # the moving figures are read every cycle meanwhile (tests/test_health_source.py), and the
    # count is never absent between two asks: the last answer is carried
    assert None not in read


def test_diagnose_asks_for_the_error_counters_every_cycle():
    read, held = ecc_readings(0.0, [0.0, 2.0, 2.0, 2.0])  # what diagnose's sampling passes
    assert read == held and len(set(read)) == 4


def test_a_receiver_gets_every_change_of_a_climbing_ecc_count_and_a_restart_resends_all(tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    args = ["--simulate", "hardware-fault", "--interval", "0.5", "--push-interval", "1",
            "--remote-write-url", vm.write_url, "--spool-dir", str(tmp_path / "spool"),
            "--socket", str(tmp_path / "run" / "app.sock")]
    with running(vm):
        first = Agent(args).start()
        try:
            # past RARE_READ_S: the error counters are asked for again, and have climbed
            first.more_cycles(int(RARE_READ_S / 0.5) + 4, "on the first run")
        finally:
            assert first.stop() == 0
        second = Agent(args).start()
        try:
            second.more_cycles(2, "after the restart")
        finally:
            assert second.stop() == 0
        stored = vm.settled(len(first.sampled()) + len(second.sampled()))
    keyed = {(n, lab, ts): v for n, lab, ts, v in stored}
    for agent in (first, second):
        recorded = agent.recorded()
        cycles = sorted({ts for _, _, ts, _ in recorded})
        # every change of the fault GPU's ECC count is stored at the cycle that saw it
        ecc = [(ts, v) for n, lab, ts, v in recorded
               if n == ECC and dict(lab)["gpu_index"] == str(FAULT_ECC_INDEX)]
        changes = [(ts, v) for (ts, v), (_, before) in zip(ecc[1:], ecc, strict=False)
                   if v != before]
        assert changes or agent is second, "the scenario's ECC count did not climb"
        changes.append(ecc[0])  # and the first cycle of each run sends it
        for ts, v in changes:
            (key,) = [k for k in keyed if k[0] == ECC and k[2] == ts
                      and dict(k[1])["gpu_index"] == str(FAULT_ECC_INDEX)]
            assert keyed[key] == v
        # an unchanged maximum: stored in the agent's first cycle, not in every cycle after
        maxima = sorted(ts for n, lab, ts, _ in stored
                        if n == MAX and dict(lab)["gpu_index"] == "0" and ts in cycles)
        assert maxima and maxima[0] == cycles[0]
        assert len(maxima) < len(cycles) or len(cycles) <= 2
        # what moves every cycle is stored every cycle
        util = {ts for n, lab, ts, _ in stored
                if n == "gpu_utilization_ratio" and dict(lab)["gpu_index"] == "0"}
        assert set(cycles) <= util
