"""No deprecated NVML call where a successor exists: nvml.h 13 marks ``DEPRECATED(13.0)``
``nvmlDeviceGetTemperature`` and ``nvmlDeviceGet{Current,Supported}ClocksThrottleReasons``. The
agent asks the successor first, the old call only on a driver without the successor, and a
driver that answers the old one ``NVML_ERROR_DEPRECATED`` (26) costs it nothing but that figure,
absent and said once. The stand-in has that driver as a mode; every scenario's verdict and exit
code are the same in it."""

from __future__ import annotations

import pynvml
import pytest
import structlog

from sidecar.simulate.fake_nvml import (
    DEPRECATED_13,
    DRIVER_MODE_ENV,
    OLD_DRIVER_MISSING,
    TEMPERATURE_V1,
    FakeGpu,
    Signal,
)
from sidecar.simulate.scenarios import OLD_DRIVER_VERSION, SCENARIOS
from sidecar.sources.nvml import NvmlSource
from sidecar.sources.nvml.errors import NVML_ERROR_DEPRECATED
from sidecar.sources.nvml.health import CLOCK_EVENT_REASONS, reason_names
from tests.conftest import run_cli
from tests.test_diagnose import WINDOW, verdicts

GiB = 1024**3
USED = {"nvmlDeviceGetTemperature", "nvmlDeviceGetCurrentClocksThrottleReasons",
        "nvmlDeviceGetSupportedClocksThrottleReasons"}  # the deprecated calls the agent knows


def h200(**load: object) -> FakeGpu:
    base: dict[str, object] = {"uuid": "GPU-dep00000-0000-0000-0000-000000000000",
                               "name": "Simulated NVIDIA H200", "pci_bus_id": "00000000:18:00.0",
                               "memory_used": Signal(10 * GiB), "utilization": Signal(60),
                               "temperature": Signal(63.0),
                               "has_clock_event_counters": False}  # the bitmask is read
    return FakeGpu(**{**base, **load})  # type: ignore[arg-type]


def reading(install_fake, clock, gpu: FakeGpu, **fake: object):
    nvml = install_fake([gpu], clock=clock, record_calls=True, **fake)
    source = NvmlSource(clock=clock, sleep=clock.advance)
    with structlog.testing.capture_logs() as logs:
        source.open()
        try:
            uuid = source.devices()[0].uuid
            source.read([uuid])
            clock.advance(1.0)
            got = source.read([uuid])[uuid]
            clock.advance(1.0)
            source.read([uuid])
            absent = source.absent(uuid)
            caps = source.capabilities(uuid)
        finally:
            source.close()
    return got, absent, caps, nvml, logs


def test_pynvml_knows_the_error_and_the_agent_reads_it_as_nvml_h_numbers_it():
    assert NVML_ERROR_DEPRECATED == 26 == pynvml.NVML_ERROR_DEPRECATED


def test_the_header_lists_the_deprecated_calls_the_agent_knows_of():
    assert USED <= DEPRECATED_13


@pytest.mark.parametrize("deprecated", [False, True])
def test_a_current_driver_is_never_asked_a_deprecated_call(install_fake, clock, deprecated):
    got, absent, caps, nvml, _ = reading(install_fake, clock, h200(), deprecated=deprecated)
    assert not set(nvml.calls) & DEPRECATED_13, sorted(set(nvml.calls) & DEPRECATED_13)
    assert nvml.calls["nvmlDeviceGetTemperatureV"] >= 3  # at open and every cycle
    assert got.health.temperature_celsius == 63
    assert got.health.power_cap_ratio == 0.0  # read from the clock-events bitmask
    assert "gpu_temperature_celsius" not in absent and "gpu_clocks_event_power_cap_ratio" not in absent
    assert caps["temperature_call"] == "nvmlDeviceGetTemperatureV"


def test_a_driver_without_the_successors_is_asked_the_old_calls(install_fake, clock):
    got, absent, caps, nvml, _ = reading(install_fake, clock, h200(), missing=OLD_DRIVER_MISSING,
                                         driver_version=OLD_DRIVER_VERSION)
    assert got.health.temperature_celsius == 63 and got.health.power_cap_ratio == 0.0
    assert "gpu_temperature_celsius" not in absent
    assert nvml.calls["nvmlDeviceGetTemperature"] >= 3
    assert nvml.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] >= 2
    assert caps["temperature_call"] == "nvmlDeviceGetTemperature"


def test_a_successor_that_refuses_for_another_reason_is_not_replaced_by_the_old_call(
        install_fake, clock):
    """The old call only where the driver lacks the successor: a GPU whose new call says
    GPU_IS_LOST or anything but FUNCTION_NOT_FOUND / NOT_SUPPORTED is not asked the old one."""
    from sidecar.sources.nvml.health import _successor_first

    asked = []

    def failing(code):
        def call(*args):
            asked.append(code)
            raise pynvml.NVMLError(code)
        call.__name__ = f"call{code}"
        return call

    fn, value, why = _successor_first((failing(pynvml.NVML_ERROR_UNKNOWN),
                                       failing(pynvml.NVML_ERROR_NOT_SUPPORTED)))
    assert fn is None and value is None and asked == [pynvml.NVML_ERROR_UNKNOWN], why
    asked.clear()
    _successor_first((failing(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND),
                      failing(pynvml.NVML_ERROR_NOT_SUPPORTED)))
    assert asked == [pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, pynvml.NVML_ERROR_NOT_SUPPORTED]


def test_a_driver_that_retired_the_old_calls_leaves_their_figures_absent_said_once(
        install_fake, clock):
    """A driver without the successors that answers the old calls DEPRECATED: temperature and
    the clock-event bits are absent with the reason, said once at open, never per cycle;
    every other figure is there."""
    got, absent, _, nvml, logs = reading(install_fake, clock, h200(), missing=OLD_DRIVER_MISSING,
                                         driver_version=OLD_DRIVER_VERSION, deprecated=True)
    assert got is not None and got.memory.used_bytes and got.health.power_watts
    assert got.health.temperature_celsius is None and got.health.power_cap_ratio is None
    for series in ("gpu_temperature_celsius", "gpu_clocks_event_power_cap_ratio"):
        assert "NVML_ERROR_DEPRECATED" in absent[series], absent[series]
    said = [e for e in logs if "NVML_ERROR_DEPRECATED" in str(e)]
    assert [e["event"] for e in said] == ["gpu_metrics_absent"]
    assert not [e for e in logs if e["event"] == "nvml_read_failed"]
    # asked once each, at open: never again
    assert nvml.calls["nvmlDeviceGetTemperature"] == 1


def test_the_stand_ins_successor_takes_nvmls_struct_version_and_answers_celsius(install_fake,
                                                                                  clock):
    install_fake([h200()], clock=clock)
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert TEMPERATURE_V1 == 0x100000C == pynvml.nvmlTemperature_v1  # 12 bytes, version 1
        assert pynvml.nvmlDeviceGetTemperatureV(handle, pynvml.NVML_TEMPERATURE_GPU) == 63
        with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
            pynvml.nvmlDeviceGetTemperatureV(handle, pynvml.NVML_TEMPERATURE_GPU, version=2)
    finally:
        pynvml.nvmlShutdown()


def test_every_clock_event_reason_bit_of_the_header_is_named():
    header_bits = {getattr(pynvml, n) for n in dir(pynvml)
                   if n.startswith("nvmlClocksEventReason") and n not in (
                       "nvmlClocksEventReasonAll", "nvmlClocksEventReasonNone")}
    named = {bit for bit, _ in CLOCK_EVENT_REASONS}
    assert header_bits <= named | {pynvml.nvmlClocksEventReasonUserDefinedClocks}
    assert named == {1 << i for i in range(9)}  # 0x1 .. 0x100, nvml.h 13.3
    assert len(reason_names(pynvml.nvmlClocksEventReasonAll)) == 9
    assert reason_names(0x4 | 0x80) == ("sw_power_cap", "hw_power_brake_slowdown")
    assert reason_names(0x800) == ("0x800",)  # a reason a later driver adds: its bit, not lost


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_scenario_judges_the_same_on_a_driver_that_retired_the_deprecated_calls(scenario):
    normal = run_cli("diagnose", "--simulate", scenario, *WINDOW, env={DRIVER_MODE_ENV: ""})
    retired = run_cli("diagnose", "--simulate", scenario, *WINDOW,
                      env={DRIVER_MODE_ENV: "deprecated"})
    assert normal.returncode in (0, 1), normal.stdout + normal.stderr
    assert retired.returncode == normal.returncode, retired.stdout + retired.stderr
    assert verdicts(retired.stdout) == verdicts(normal.stdout) != {}, retired.stdout
    assert "Traceback" not in retired.stderr


def test_the_deprecated_driver_mode_reaches_a_simulated_run_through_the_environment():
    """The mode the scenarios ran in above is the one asked for: on the old driver (no
    successors) probe says the old calls were answered DEPRECATED, and only in that mode."""
    retired = run_cli("probe", "--simulate", "old-driver", env={DRIVER_MODE_ENV: "deprecated"})
    normal = run_cli("probe", "--simulate", "old-driver", env={DRIVER_MODE_ENV: ""})
    assert retired.returncode == normal.returncode == 0, retired.stderr
    assert "gpu_temperature_celsius: temperature: nvmlDeviceGetTemperature is deprecated" \
        in retired.stdout
    assert "NVML_ERROR_DEPRECATED" not in normal.stdout
