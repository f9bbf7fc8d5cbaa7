"""The NVML stand-in's health calls, through pynvml's public functions only: clocks, clock-event
reasons and their nanosecond counters, power, temperature, ECC and row remapping, PCIe link and
error counters, NVLink-C2C (fields, mode, GPM) and Xid events. Each figure is checked against a
value worked out by hand, in the unit nvml.h gives it."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import replace

import pynvml
import pytest

from sidecar.simulate import fake_nvml
from sidecar.simulate.fake_nvml import (
    NO_INSTANCE,
    OLD_DRIVER_MISSING,
    REASON_HW_THERMAL,
    REASON_SW_POWER_CAP,
    DutyCycle,
    FakeGpu,
    FakeMig,
    Signal,
)
from sidecar.simulate.scenarios import (
    DEFAULT_GPUS,
    GEN3_X8_LINK,
    GH200_C2C,
    SCENARIOS,
    build,
)

GiB = 1024**3
MiB = 1024**2
XID = pynvml.nvmlEventTypeXidCriticalError
FI_SW_THERM = pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN
FI_HW_THERM = pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN
FI_POWER_BRAKE = pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN
FI_POWER_CAP = pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP
FI_SYNC_BOOST = pynvml.NVML_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST
COUNTER_FIELDS = (FI_POWER_CAP, FI_SYNC_BOOST, FI_SW_THERM, FI_HW_THERM, FI_POWER_BRAKE)


def gpu(i: int = 0, **kw) -> FakeGpu:
    base = FakeGpu(uuid=f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd", name="Simulated H200",
                   pci_bus_id=f"00000000:1{i}:00.0", utilization=Signal(90),
                   sm_clock=Signal(1234.4), memory_clock=Signal(3100.0), power=Signal(612.3456),
                   temperature=Signal(61.6), memory_temperature=Signal(70.2))
    return replace(base, **kw)


def mig(gi: int = 1) -> FakeMig:
    return FakeMig(gi, f"MIG-{gi}1111111-2222-3333-4444-555555555555", "Simulated H200 MIG 3g",
                   71 * GiB)


def start(install_fake, clock, gpus, **kw):
    """Install the stand-in, put its simulated time at exactly 0, and open NVML."""
    fake = install_fake(gpus, clock=clock, **kw)
    clock.advance(-fake.now())
    pynvml.nvmlInit()
    return fake


def at(clock, fake, t: float) -> None:
    clock.advance(t - fake.now())


def fields(handle, *ids) -> dict:
    """field id (or (id, scope)) -> (nvmlReturn, valueType, value read by that type)."""
    out = {}
    for key, fv in zip(ids, pynvml.nvmlDeviceGetFieldValues(handle, list(ids)), strict=True):
        value = {pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: fv.value.uiVal,
                 pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: fv.value.ullVal}.get(fv.valueType)
        out[key] = (fv.nvmlReturn, fv.valueType, value if fv.nvmlReturn == 0 else None)
    return out


def ok(value, vtype=pynvml.NVML_VALUE_TYPE_UNSIGNED_INT):
    return (pynvml.NVML_SUCCESS, vtype, value)


def refused(answer) -> bool:
    return answer[0] == pynvml.NVML_ERROR_NOT_SUPPORTED


# -- clocks, power, temperature ----------------------------------------------------------------

def test_clocks_are_mhz_now_and_at_most(install_fake, clock):
    start(install_fake, clock, [gpu()])
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) == 1234
    assert pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_GRAPHICS) == 1234
    assert pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM) == 3100
    # a real H200's maxima are the defaults
    assert pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM) == 1980
    assert pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM) == 3201
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_COUNT)


def test_power_is_milliwatts_the_call_a_one_second_mean_the_field_the_instant(install_fake, clock):
    # 600 W * (1 + 0.5 sin(2 pi t / 4)); over [2, 3]: 600 * (1 + 0.5 (cos pi - cos 1.5pi) / (pi/2))
    # = 600 (1 - 1/pi) = 409.014 W; at t = 3 the instant is 600 * (1 - 0.5) = 300 W
    fake = start(install_fake, clock, [gpu(power=Signal(600, 0.5, 4)),
                                       gpu(1, power=Signal(600, 0.5, 4),
                                           power_usage_averaged=False)])  # a GA100
    at(clock, fake, 3.0)
    h, ga100 = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(1)
    assert pynvml.nvmlDeviceGetPowerUsage(h) == round(600_000 * (1 - 1 / math.pi))
    assert pynvml.nvmlDeviceGetPowerUsage(ga100) == 300_000
    assert fields(h, pynvml.NVML_FI_DEV_POWER_INSTANT)[pynvml.NVML_FI_DEV_POWER_INSTANT] == \
        ok(300_000)
    assert pynvml.nvmlDeviceGetEnforcedPowerLimit(h) == 700_000
    # scope 1 is the module (CPU + GPU): not simulated, refused
    assert refused(fields(h, (pynvml.NVML_FI_DEV_POWER_INSTANT, 1))[
        (pynvml.NVML_FI_DEV_POWER_INSTANT, 1)])


def test_temperatures_are_whole_degrees_celsius(install_fake, clock):
    start(install_fake, clock, [gpu(), gpu(1, memory_temperature=None)])
    h, gddr = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(1)
    assert pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) == 62
    assert fields(h, pynvml.NVML_FI_DEV_MEMORY_TEMP)[pynvml.NVML_FI_DEV_MEMORY_TEMP] == ok(70)
    assert refused(fields(gddr, pynvml.NVML_FI_DEV_MEMORY_TEMP)[pynvml.NVML_FI_DEV_MEMORY_TEMP])
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetTemperature(h, 7)


# -- clock-event reasons -----------------------------------------------------------------------

EVENTS = ((REASON_SW_POWER_CAP, DutyCycle(0.8, 5.0)), (REASON_HW_THERMAL, DutyCycle(0.1, 20, 2)))


def test_clock_event_counters_are_the_exact_nanoseconds_of_each_reason(install_fake, clock):
    fake = start(install_fake, clock, [gpu(clock_events=EVENTS)])
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    ull = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    # t = 7.5: power cap on 4 s of [0, 5) and 2.5 s of [5, 7.5) = 6.5 s; HW thermal from t = 2
    # for 2 s of each 20: 2 s; sync boost, SW thermal and power brake never
    at(clock, fake, 7.5)
    assert fields(h, *COUNTER_FIELDS) == {
        FI_POWER_CAP: ok(6_500_000_000, ull), FI_SYNC_BOOST: ok(0, ull),
        FI_SW_THERM: ok(0, ull), FI_HW_THERM: ok(2_000_000_000, ull), FI_POWER_BRAKE: ok(0, ull)}
    # and the bitmask at 7.5: power cap on (2.5 s into its period), HW thermal off
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(h) == REASON_SW_POWER_CAP
    # t = 9.2: the cap went off at 9.0: 4 + 4 = 8 s, so 1.5 s more over the 1.7 s interval
    at(clock, fake, 9.2)
    assert fields(h, FI_POWER_CAP)[FI_POWER_CAP] == ok(8_000_000_000, ull)
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(h) == 0
    assert pynvml.nvmlDeviceGetSupportedClocksEventReasons(h) == \
        pynvml.nvmlClocksEventReasonAll & ~pynvml.nvmlClocksEventReasonDisplayClockSetting
    # pynvml 13's ids are the R590 ones
    assert (FI_POWER_CAP, FI_SYNC_BOOST, FI_SW_THERM, FI_HW_THERM, FI_POWER_BRAKE) == \
        (74, 76, 269, 270, 271)


def test_the_bitmask_is_set_exactly_while_the_counter_runs(install_fake, clock):
    fake = start(install_fake, clock, [gpu(clock_events=EVENTS)])
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    step = 0.013  # not a divisor of any period, so no sample lands on an edge
    for k in range(1, 400):
        at(clock, fake, k * step)
        before = fields(h, FI_POWER_CAP, FI_HW_THERM)
        mask = pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)
        at(clock, fake, k * step + 1e-6)
        after = fields(h, FI_POWER_CAP, FI_HW_THERM)
        for fid, bit in ((FI_POWER_CAP, REASON_SW_POWER_CAP), (FI_HW_THERM, REASON_HW_THERMAL)):
            ran = after[fid][2] - before[fid][2]  # 1000 ns, give or take the clock's rounding
            assert (999 <= ran <= 1001) if mask & bit else ran == 0


def test_an_idle_gpu_reports_gpu_idle(install_fake, clock):
    start(install_fake, clock, [gpu(utilization=Signal(0))])
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(h) == pynvml.nvmlClocksEventReasonGpuIdle


@pytest.mark.parametrize(("driver", "answered"), [
    ("515.105.01", ()), ("550.54.15", ()),
    ("575.57.08", (74, 76, 251, 252, 253)), ("580.65.06", (74, 76, 251, 252, 253)),
    ("590.44.01", (74, 76, 269, 270, 271)),
])
def test_the_counters_exist_from_r575_and_moved_to_269_271(install_fake, clock, driver,
                                                           answered):
    start(install_fake, clock, [gpu(clock_events=EVENTS)], driver_version=driver)
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    got = fields(h, 74, 76, 251, 252, 253, 269, 270, 271)
    assert tuple(fid for fid, answer in got.items() if answer[0] == pynvml.NVML_SUCCESS) == \
        answered
    assert all(refused(answer) for fid, answer in got.items() if fid not in answered)


def test_a_gpu_without_the_counters_refuses_them_and_keeps_the_bitmask(install_fake, clock):
    start(install_fake, clock, [gpu(clock_events=EVENTS, has_clock_event_counters=False)])
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert all(refused(a) for a in fields(h, *COUNTER_FIELDS).values())
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(h) == REASON_SW_POWER_CAP  # at t = 0


def test_an_old_driver_lacks_the_event_reason_names_and_the_newer_fields(install_fake, clock):
    start(install_fake, clock, [gpu(clock_events=EVENTS)], driver_version="515.105.01",
          missing=OLD_DRIVER_MISSING)
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetC2cModeInfoV1(h)
    # the deprecated names answer the same bitmask
    assert pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h) == REASON_SW_POWER_CAP
    got = fields(h, pynvml.NVML_FI_DEV_POWER_INSTANT, pynvml.NVML_FI_DEV_PCIE_COUNT_BAD_TLP,
                 pynvml.NVML_FI_DEV_C2C_LINK_COUNT, pynvml.NVML_FI_DEV_PCIE_L0_TO_RECOVERY_COUNTER,
                 pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL, pynvml.NVML_FI_DEV_MEMORY_TEMP)
    assert [refused(a) for a in got.values()] == [True, True, True, True, False, False]
    assert pynvml.nvmlDeviceGetPowerUsage(h) == 612_346  # the call is as old as Fermi


# -- ECC and row remapping ---------------------------------------------------------------------

FAULTY = {"ecc_corrected_per_second": 3.0, "ecc_uncorrected_per_second": 0.5,
          "ecc_corrected_aggregate_base": 120, "ecc_uncorrected_aggregate_base": 2,
          "remapped_rows_correctable": 4, "remapped_rows_uncorrectable": 1,
          "row_remap_pending": True}


def test_ecc_totals_volatile_since_load_and_aggregate_for_life(install_fake, clock):
    fake = start(install_fake, clock, [gpu(**FAULTY)])
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    at(clock, fake, 10.0)
    ecc = pynvml.nvmlDeviceGetTotalEccErrors
    corr, unc = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    vol, agg = pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC
    assert (ecc(h, corr, vol), ecc(h, unc, vol), ecc(h, corr, agg), ecc(h, unc, agg)) == \
        (30, 5, 150, 7)
    ull = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    assert fields(h, 3, 4, 5, 6) == {3: ok(30, ull), 4: ok(5, ull), 5: ok(150, ull),
                                     6: ok(7, ull)}
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        ecc(h, pynvml.NVML_MEMORY_ERROR_TYPE_COUNT, vol)
    at(clock, fake, 20.0)
    assert ecc(h, unc, vol) == 10  # rising


def test_remapped_rows_from_the_call_and_the_fields(install_fake, clock):
    start(install_fake, clock, [gpu(**FAULTY)])
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetRemappedRows(h) == (4, 1, 1, 0)
    assert fields(h, 142, 143, 144, 145) == {142: ok(4), 143: ok(1), 144: ok(1), 145: ok(0)}


def test_a_gpu_without_ecc_or_remapping_refuses_them(install_fake, clock):
    start(install_fake, clock, [gpu(has_ecc=False, has_row_remapping=False)])
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetTotalEccErrors(h, 0, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetRemappedRows(h)
    assert all(refused(a) for a in fields(h, 3, 4, 5, 6, 142, 143, 144, 145).values())


# -- MIG ---------------------------------------------------------------------------------------

def test_a_mig_handle_is_refused_the_board_figures_and_the_parent_answers(install_fake, clock):
    fake = start(install_fake, clock, [gpu(mig=(mig(1), mig(2)), **FAULTY)])
    parent = pynvml.nvmlDeviceGetHandleByIndex(0)
    instance = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0)
    calls = [
        lambda h: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
        lambda h: pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM),
        pynvml.nvmlDeviceGetCurrentClocksEventReasons, pynvml.nvmlDeviceGetSupportedClocksEventReasons,
        pynvml.nvmlDeviceGetPowerUsage, pynvml.nvmlDeviceGetEnforcedPowerLimit,
        lambda h: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
        lambda h: pynvml.nvmlDeviceGetTotalEccErrors(h, 1, pynvml.NVML_AGGREGATE_ECC),
        pynvml.nvmlDeviceGetRemappedRows, pynvml.nvmlDeviceGetSupportedEventTypes,
    ]
    for call in calls:
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call(instance)
    assert all(refused(a) for a in fields(instance, 74, 82, 186, 3, 142).values())
    # the parent answers the board figures; with MIG on, not the remapped rows nor the
    # volatile ECC counts (nvml.h), but the aggregate ones
    assert pynvml.nvmlDeviceGetPowerUsage(parent) == 612_346
    assert pynvml.nvmlDeviceGetTotalEccErrors(parent, 1, pynvml.NVML_AGGREGATE_ECC) == 2
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetRemappedRows(parent)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetTotalEccErrors(parent, 1, pynvml.NVML_VOLATILE_ECC)
    got = fields(parent, 4, 6, 143)
    assert refused(got[4]) and refused(got[143]) and got[6][2] == 2
    assert fake.mig_handle_refused == {}  # NOT_SUPPORTED answers are not misuse


def test_events_cannot_be_registered_on_a_mig_handle(install_fake, clock):
    start(install_fake, clock, [gpu(mig=(mig(),))])
    parent = pynvml.nvmlDeviceGetHandleByIndex(0)
    instance = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0)
    event_set = pynvml.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceRegisterEvents(instance, XID, event_set)
    pynvml.nvmlDeviceRegisterEvents(parent, XID, event_set)
    pynvml.nvmlEventSetFree(event_set)


# -- PCIe --------------------------------------------------------------------------------------

def test_the_current_link_may_be_trained_below_the_maximum(install_fake, clock):
    start(install_fake, clock, [gpu(current_link_generation=3, current_link_width=8)])
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert (pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h), pynvml.nvmlDeviceGetMaxPcieLinkWidth(h),
            pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h),
            pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)) == (5, 16, 3, 8)


def test_pcie_error_counters(install_fake, clock):
    fake = start(install_fake, clock, [gpu(pcie_correctable_errors_per_second=2.0,
                                           pcie_l0_recovery_per_second=0.25,
                                           pcie_error_counts=((176, 3),))])
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    at(clock, fake, 10.0)
    lane = pynvml.NVML_FI_DEV_PCIE_COUNT_LANE_ERROR
    got = fields(h, 169, *range(173, 183), (lane, 0), (lane, 15), (lane, 16))
    assert got[169] == ok(2) and got[173] == ok(20) and got[176] == ok(3)
    assert all(got[fid] == ok(0) for fid in (174, 175, *range(177, 183)))
    assert got[(lane, 0)] == ok(0) and got[(lane, 15)] == ok(0)
    assert refused(got[(lane, 16)])  # the link has 16 lanes


# -- NVLink-C2C --------------------------------------------------------------------------------

def test_grace_hopper_answers_the_c2c_mode_and_link_fields(clock):
    fake_nvml.install(build("grace-hopper").nvml(clock=clock, throughput_blocking=False))
    try:
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert "GH200" in pynvml.nvmlDeviceGetName(h)
        assert pynvml.nvmlDeviceGetC2cModeInfoV1(h).isC2cEnabled == 1
        c2c = (pynvml.NVML_FI_DEV_C2C_LINK_COUNT, pynvml.NVML_FI_DEV_C2C_LINK_GET_STATUS,
               pynvml.NVML_FI_DEV_C2C_LINK_GET_MAX_BW)
        got = fields(h, c2c[0], *((fid, link) for link in (0, 9, 10) for fid in c2c[1:]))
        assert got[c2c[0]] == ok(10)
        assert got[(c2c[1], 0)] == ok(1) and got[(c2c[1], 9)] == ok(1)
        assert got[(c2c[2], 0)] == ok(44712) and got[(c2c[2], 9)] == ok(44712)  # MB/s per link
        assert refused(got[(c2c[1], 10)]) and refused(got[(c2c[2], 10)])
        # 10 links x 44712 MB/s: 447 GB/s per direction
        assert round(GH200_C2C) == 447_120_000_000
    finally:
        fake_nvml.uninstall()


def test_a_gpu_without_c2c_says_the_mode_disabled_and_refuses_the_fields_and_metrics(
        install_fake, clock):
    fake = start(install_fake, clock, [gpu(), gpu(1, architecture=pynvml.NVML_DEVICE_ARCH_AMPERE)])
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    # a Hopper without C2C answers "disabled", as nvidia-smi -q of an H100 SXM and an H200
    # prints it (tests/realworld/); before Hopper the call is not supported
    assert pynvml.nvmlDeviceGetC2cModeInfoV1(h).isC2cEnabled == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetC2cModeInfoV1(pynvml.nvmlDeviceGetHandleByIndex(1))
    assert all(refused(a) for a in fields(h, 170, (171, 0), (172, 0)).values())
    got = gpm(clock, fake, h, 100, 101, 102, 103, pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC)
    assert [ret for ret, _ in got] == [pynvml.NVML_ERROR_NOT_SUPPORTED] * 4 + [0]


def gpm(clock, fake, handle, *metric_ids, span: float = 2.0) -> list[tuple[int, float]]:
    """(nvmlReturn, value) of each GPM metric over ``span`` seconds from now."""
    samples = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
    pynvml.nvmlGpmSampleGet(handle, samples[0])
    clock.advance(span)
    pynvml.nvmlGpmSampleGet(handle, samples[1])
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    request.numMetrics = len(metric_ids)
    request.sample1, request.sample2 = samples
    for i, metric in enumerate(metric_ids):
        request.metrics[i].metricId = metric
    pynvml.nvmlGpmMetricsGet(request)
    for sample in samples:
        pynvml.nvmlGpmSampleFree(sample)
    return [(request.metrics[i].nvmlReturn, request.metrics[i].value)
            for i in range(len(metric_ids))]


def test_c2c_gpm_metrics_are_mib_per_second_total_above_data(install_fake, clock):
    grace = gpu(has_c2c=True, c2c_tx=Signal(100e9), c2c_rx=Signal(400e9, 0.5, 8))
    fake = start(install_fake, clock, [grace])
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    # RX over [0, 2]: 400e9 (1 + 0.5 (1 - cos(pi/2)) / (pi/4) / 2) = 400e9 (1 + 1/pi)
    rx = 400e9 * (1 + 1 / math.pi) / MiB
    got = gpm(clock, fake, h, pynvml.NVML_GPM_METRIC_C2C_TOTAL_TX_PER_SEC,
              pynvml.NVML_GPM_METRIC_C2C_TOTAL_RX_PER_SEC,
              pynvml.NVML_GPM_METRIC_C2C_DATA_TX_PER_SEC,
              pynvml.NVML_GPM_METRIC_C2C_DATA_RX_PER_SEC)
    assert all(ret == pynvml.NVML_SUCCESS for ret, _ in got)
    total_tx, total_rx, data_tx, data_rx = (value for _, value in got)
    assert data_tx == pytest.approx(100e9 / MiB, rel=1e-12)
    assert data_rx == pytest.approx(rx, rel=1e-12)
    assert total_tx == pytest.approx(data_tx * 1.05, rel=1e-12)  # with protocol overhead
    assert total_rx == pytest.approx(data_rx * 1.05, rel=1e-12)


def test_c2c_gpm_metrics_need_r575(install_fake, clock):
    fake = start(install_fake, clock, [gpu(has_c2c=True, c2c_rx=Signal(1e9))],
                 driver_version="570.124.06")
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert gpm(clock, fake, h, 101)[0][0] == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert fields(h, 170)[170] == ok(10)  # the fields are older (R525)


# -- Xid events --------------------------------------------------------------------------------

def listen(handle, types=XID):
    event_set = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(handle, types, event_set)
    return event_set


def timed_wait(event_set, timeout_ms: int):
    began = time.monotonic()
    try:
        return pynvml.nvmlEventSetWait_v2(event_set, timeout_ms), time.monotonic() - began
    except pynvml.NVMLError as exc:
        return exc, time.monotonic() - began


def test_xids_arrive_in_order_then_the_wait_times_out(install_fake, clock):
    xids = ((0.2, 13), (1.0, 79), (1.2, 79), (3.0, 48))
    fake = start(install_fake, clock, [gpu(xid_events=xids), gpu(1)])
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetSupportedEventTypes(h) & XID
    at(clock, fake, 0.5)
    event_set = listen(h)  # Xid 13 at 0.2 came before: not recorded
    listen_other = pynvml.nvmlDeviceGetHandleByIndex(1)
    pynvml.nvmlDeviceRegisterEvents(listen_other, XID, event_set)
    at(clock, fake, 1.3)
    codes = []
    for _ in range(2):
        data, took = timed_wait(event_set, 5000)
        assert took < 0.5, "due events are delivered at once"
        assert data.eventType == XID
        assert pynvml.nvmlDeviceGetIndex(data.device) == 0
        assert (data.gpuInstanceId, data.computeInstanceId) == (NO_INSTANCE, NO_INSTANCE)
        codes.append(data.eventData)
    assert codes == [79, 79]
    err, took = timed_wait(event_set, 200)
    assert isinstance(err, pynvml.NVMLError_Timeout)
    assert 0.19 <= took < 1.5
    at(clock, fake, 3.5)
    data, _ = timed_wait(event_set, 1000)
    assert data.eventData == 48
    pynvml.nvmlEventSetFree(event_set)


def test_a_blocked_wait_wakes_when_the_clock_reaches_an_event(install_fake, clock):
    fake = start(install_fake, clock, [gpu(xid_events=((2.0, 94),))])
    event_set = listen(pynvml.nvmlDeviceGetHandleByIndex(0))
    result: list = []
    waiter = threading.Thread(target=lambda: result.append(timed_wait(event_set, 10_000)))
    waiter.start()
    time.sleep(0.2)
    assert not result, "nothing is due: the wait must block"
    at(clock, fake, 2.5)
    waiter.join(timeout=5)
    assert result, "the wait did not wake"
    data, took = result[0]
    assert data.eventData == 94 and took < 5


def test_with_a_real_clock_the_wait_sleeps_until_the_event_is_due(install_fake):
    fake = install_fake([gpu()], clock=time.monotonic)
    due = fake.now() + 0.3
    fake.gpus[0] = replace(fake.gpus[0], xid_events=((due, 31),))
    pynvml.nvmlInit()
    event_set = listen(pynvml.nvmlDeviceGetHandleByIndex(0))
    data, took = timed_wait(event_set, 5000)
    assert data.eventData == 31
    assert 0.2 <= took < 2.0


def test_a_lost_gpu_delivers_its_xid_79s_and_then_answers_gpu_is_lost(clock):
    scenario = build("hardware-fault")
    fake = fake_nvml.install(scenario.nvml(clock=clock, throughput_blocking=False))
    try:
        clock.advance(-fake.now())
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(4)]
        event_set = pynvml.nvmlEventSetCreate()
        for h in handles:
            pynvml.nvmlDeviceRegisterEvents(h, XID, event_set)
        at(clock, fake, 2.0)  # lost from 1.5
        codes = [timed_wait(event_set, 1000)[0].eventData for _ in range(2)]
        assert codes == [79, 79]
        err, took = timed_wait(event_set, 1000)
        assert isinstance(err, pynvml.NVMLError_GpuIsLost) and took < 0.5
        for call in (pynvml.nvmlDeviceGetPowerUsage, pynvml.nvmlDeviceGetSupportedEventTypes,
                     lambda h: pynvml.nvmlDeviceRegisterEvents(h, XID, event_set),
                     lambda h: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)):
            with pytest.raises(pynvml.NVMLError_GpuIsLost):
                call(handles[1])
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlDeviceGetHandleByIndex(1)
        # GPU 2: uncorrected volatile ECC rising, a row remap pending; the others healthy
        assert pynvml.nvmlDeviceGetTotalEccErrors(handles[2], 1, 0) == 1  # 0.5/s at t = 2
        assert pynvml.nvmlDeviceGetRemappedRows(handles[2])[2] == 1
        assert pynvml.nvmlDeviceGetTotalEccErrors(handles[0], 1, 0) == 0
        assert pynvml.nvmlDeviceGetRemappedRows(handles[3]) == (0, 0, 0, 0)
        pynvml.nvmlEventSetFree(event_set)
    finally:
        fake_nvml.uninstall()


def test_event_types_the_gpu_lacks_register_nothing(install_fake, clock):
    start(install_fake, clock, [gpu()])
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    event_set = pynvml.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventMigConfigChange, event_set)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceRegisterEvents(h, 1 << 40, event_set)
    pynvml.nvmlEventSetFree(event_set)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlEventSetWait_v2(event_set, 10)


# -- the scenarios -----------------------------------------------------------------------------

def test_every_scenario_is_listed_with_its_gpu_count():
    assert {"throttled", "pcie-degraded", "hardware-fault", "grace-hopper"} <= set(SCENARIOS)
    for name in SCENARIOS:
        scenario = build(name)
        assert len(scenario.gpus) == DEFAULT_GPUS[name] and scenario.description
        assert all("Simulated" in g.name for g in scenario.gpus)


def test_throttled_gpus_sit_at_the_power_cap_with_its_counter_at_80_percent(clock):
    scenario = build("throttled")
    fake = fake_nvml.install(scenario.nvml(clock=clock, throughput_blocking=False))
    try:
        clock.advance(-fake.now())
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(len(scenario.gpus))]
        assert [fields(h, FI_POWER_CAP)[FI_POWER_CAP][2] for h in handles] == [0, 0]
        at(clock, fake, 10.0)  # two whole 5 s periods: 80 % of 10 s exactly
        for h in handles:
            assert fields(h, FI_POWER_CAP)[FI_POWER_CAP][2] == 8_000_000_000
            assert pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) < 1400
            assert pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM) == 1980
            power, limit = (pynvml.nvmlDeviceGetPowerUsage(h),
                            pynvml.nvmlDeviceGetEnforcedPowerLimit(h))
            assert limit == 700_000 and 0.99 * limit <= power <= limit
            assert pynvml.nvmlDeviceGetUtilizationRates(h).gpu >= 95
        assert scenario.app.latency_p99_s == 0.26 and scenario.app.latency_median_s == 0.14
    finally:
        fake_nvml.uninstall()


def test_pcie_degraded_gpus_fill_95_percent_of_their_gen3_x8_link(clock):
    scenario = build("pcie-degraded")
    fake = fake_nvml.install(scenario.nvml(clock=clock, throughput_blocking=False))
    try:
        clock.advance(-fake.now())
        pynvml.nvmlInit()
        rx = pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert (pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h),
                pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)) == (3, 8)
        assert pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h) == 5
        first = fields(h, rx)[rx][2]
        at(clock, fake, 19.0)  # one whole period of the RX signal: its mean is its base
        rate = (fields(h, rx)[rx][2] - first) / 19.0
        assert rate == pytest.approx(0.95 * GEN3_X8_LINK, rel=1e-9)
    finally:
        fake_nvml.uninstall()


def test_grace_hopper_fills_90_percent_of_c2c_and_leaves_pcie_idle(clock):
    scenario = build("grace-hopper")
    fake = fake_nvml.install(scenario.nvml(clock=clock, throughput_blocking=False))
    try:
        clock.advance(-fake.now())
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        (_, rx), (_, pcie) = gpm(clock, fake, h, pynvml.NVML_GPM_METRIC_C2C_DATA_RX_PER_SEC,
                                 pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC, span=19.0)
        assert rx * MiB == pytest.approx(0.90 * GH200_C2C, rel=1e-9)
        assert pcie * MiB < 1e7  # a few MB/s
    finally:
        fake_nvml.uninstall()
