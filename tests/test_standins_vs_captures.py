"""The simulated GPUs are the real ones, as far as what the hardware *is* goes: each stand-in
(H100 SXM, H200, GH200) is read through pynvml's public functions (so pynvml's own code runs
against the stand-in at ``pynvml.nvmlLib``) and every static property is compared with what the
real GPU's ``nvidia-smi -q`` printed (tests/realworld/, third-party captures kept verbatim):
name, memory total and driver reservation, maximum clocks, enforced power limit, PCIe generation
and width (maximum and current), C2C mode and ECC mode.

The scenarios' GPUs are held to the same captures: a share computed on a simulated GH200 is a
share of the Gen4 x1 link a real GH200 reports, not of a Gen5 x16 one it does not have."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pynvml
import pytest

from sidecar.simulate import fake_nvml
from sidecar.simulate.fake_nvml import FakeGpu, FakeNvml
from sidecar.simulate.scenarios import BOARDS, build, standin

CAPTURES = Path(__file__).parent / "realworld"
MiB = 1024**2
_LINE = re.compile(r"^(?P<indent> *)(?P<key>\S.*?)\s+:\s?(?P<value>.*)$")


def nvidia_smi_q(path: Path) -> dict[str, str]:
    """The first GPU section of an ``nvidia-smi -q`` text as ``{"Section/Sub/Key": value}``;
    nesting is by indentation, as nvidia-smi prints it (the file's ``#`` header and any
    ``nvidia-smi`` table above the log are skipped)."""
    text = path.read_text()
    start = text.index("==============NVSMI LOG==============")
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    gpus = 0
    for line in text[start:].splitlines()[1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        if indent == 0 and line.startswith("GPU "):
            gpus += 1
            if gpus > 1:
                break
            stack = []
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        match = _LINE.match(line)
        names = [name for _, name in stack]
        if match:
            out["/".join([*names, match["key"].strip()])] = match["value"].strip()
        else:
            stack.append((indent, line.strip()))
    return out


@dataclass(frozen=True)
class Case:
    capture: str
    board: str
    gpu: Callable[[], FakeGpu]  # the stand-in to hold against the capture


CASES = [
    Case("nvidia_smi_q_H100_SXM_driver565_gpu0.txt", "H100 SXM",
         lambda: standin(BOARDS["H100 SXM"], "capture", 0)),
    Case("nvidia_smi_q_H200_driver550_excerpt.txt", "H200",
         lambda: standin(BOARDS["H200"], "capture", 0)),
    Case("nvidia_smi_q_GH200_480GB_driver550.txt", "GH200",
         lambda: standin(BOARDS["GH200"], "capture", 0)),
    # the scenarios' GPUs: their load is the scenario's, their hardware the capture's
    Case("nvidia_smi_q_H200_driver550_excerpt.txt", "H200", lambda: build("healthy").gpus[0]),
    Case("nvidia_smi_q_H200_driver550_excerpt.txt", "H200",
         lambda: build("pcie-saturated").gpus[1]),
    Case("nvidia_smi_q_GH200_480GB_driver550.txt", "GH200",
         lambda: build("grace-hopper").gpus[0]),
]
IDS = ["H100 SXM", "H200", "GH200", "healthy H200", "pcie-saturated H200", "grace-hopper GH200"]


def mhz(value: str) -> int:
    return int(value.removesuffix(" MHz"))


def expected(capture: dict[str, str]) -> dict[str, object]:
    """What pynvml must return on the stand-in, from the capture's own lines; a section the
    capture lacks (the H200 file is an excerpt without ECC Mode) is left out, never guessed."""
    link = "PCI/GPU Link Info"
    want: dict[str, object] = {
        "name": capture["Product Name"],
        "memory_total_mib": int(capture["FB Memory Usage/Total"].removesuffix(" MiB")),
        "memory_reserved_mib": int(capture["FB Memory Usage/Reserved"].removesuffix(" MiB")),
        "sm_clock_max": mhz(capture["Max Clocks/SM"]),
        "memory_clock_max": mhz(capture["Max Clocks/Memory"]),
        "video_clock_max": mhz(capture["Max Clocks/Video"]),
        "power_limit_w": float(capture["GPU Power Readings/Current Power Limit"].removesuffix(" W")),
        "link_generation_max": int(capture[f"{link}/PCIe Generation/Max"]),
        "link_generation_now": int(capture[f"{link}/PCIe Generation/Current"]),
        "link_width_max": int(capture[f"{link}/Link Width/Max"].removesuffix("x")),
        "link_width_now": int(capture[f"{link}/Link Width/Current"].removesuffix("x")),
        "c2c_enabled": {"Enabled": 1, "Disabled": 0}[capture["GPU C2C Mode"]],
    }
    if "ECC Mode/Current" in capture:
        want["ecc_mode"] = [int(capture[f"ECC Mode/{k}"] == "Enabled") for k in ("Current",
                                                                                "Pending")]
    return want


def read_through_pynvml(fake: FakeNvml, wanted: set[str]) -> dict[str, object]:
    """The same properties, asked of the installed stand-in with pynvml's public functions."""
    fake_nvml.install(fake)
    try:
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        memory = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        got: dict[str, object] = {
            "name": pynvml.nvmlDeviceGetName(h).removeprefix("Simulated "),
            "memory_total_mib": memory.total / MiB,
            "memory_reserved_mib": memory.reserved / MiB,
            "sm_clock_max": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM),
            "memory_clock_max": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM),
            "video_clock_max": pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_VIDEO),
            "power_limit_w": pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000,
            "link_generation_max": pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h),
            "link_generation_now": pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h),
            "link_width_max": pynvml.nvmlDeviceGetMaxPcieLinkWidth(h),
            "link_width_now": pynvml.nvmlDeviceGetCurrPcieLinkWidth(h),
            "c2c_enabled": pynvml.nvmlDeviceGetC2cModeInfoV(h).isC2cEnabled,
        }
        if "ecc_mode" in wanted:
            got["ecc_mode"] = list(pynvml.nvmlDeviceGetEccMode(h))
        pynvml.nvmlShutdown()
        return got
    finally:
        fake_nvml.uninstall()


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_each_stand_in_reports_what_the_real_gpu_s_nvidia_smi_printed(case: Case) -> None:
    capture = nvidia_smi_q(CAPTURES / case.capture)
    want = expected(capture)
    got = read_through_pynvml(FakeNvml([case.gpu()], throughput_blocking=False), set(want))
    assert got == want


def test_the_gh200_stand_in_has_the_real_gen4_x1_host_side_pcie_link_and_c2c_enabled() -> None:
    """The issue's case in words: the real GH200 prints Gen4 x1 (maximum and current) with C2C
    enabled; the simulated one claimed Gen5 x16, which made every PCIe share 32 times too small."""
    capture = nvidia_smi_q(CAPTURES / "nvidia_smi_q_GH200_480GB_driver550.txt")
    assert capture["PCI/GPU Link Info/Link Width/Max"] == "1x"
    assert capture["PCI/GPU Link Info/PCIe Generation/Max"] == "4"
    assert capture["GPU C2C Mode"] == "Enabled"
    got = read_through_pynvml(FakeNvml(build("grace-hopper").gpus, throughput_blocking=False),
                              set())
    assert (got["link_generation_max"], got["link_width_max"]) == (4, 1)
    assert (got["link_generation_now"], got["link_width_now"]) == (4, 1)
    assert got["c2c_enabled"] == 1


def test_the_parser_reads_nesting_by_indentation_and_only_the_first_gpu() -> None:
    """The fields above are read at the right nesting: "Max" under PCIe Generation is not the
    Max under Link Width, and Max Clocks' SM is not Clocks' SM (345 MHz at idle)."""
    capture = nvidia_smi_q(CAPTURES / "nvidia_smi_q_H100_SXM_driver565_gpu0.txt")
    assert capture["Clocks/SM"] == "345 MHz" and capture["Max Clocks/SM"] == "1980 MHz"
    assert capture["PCI/GPU Link Info/PCIe Generation/Max"] == "5"
    assert capture["PCI/GPU Link Info/Link Width/Max"] == "16x"
    assert capture["Remapped Rows/Bank Remap Availability Histogram/Max"] == "2560 bank(s)"
    assert capture["GPU UUID"] == "GPU-b42dd28e-ffdd-8720-1df0-98bd8cdc05b1"


# -- the DCGM-compatible names the agent offers, against dcgm-exporter's own counter list -------

DCGM_CSV = CAPTURES / "dcgm_exporter_default_counters_4.5.3-4.8.2.csv"


def dcgm_default_counters(path: Path) -> set[str]:
    """The fields of a dcgm-exporter ``default-counters.csv`` that it collects: its lines that
    are not comments (``#``), first column (``DCGM FIELD, Prometheus metric type, help``)."""
    return {line.split(",", 1)[0].strip() for line in path.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")}


def test_each_dcgm_name_offered_is_in_the_checked_dcgm_exporters_default_set_where_said_so():
    """Every ``dcgm=`` name of the metric table that docs/metrics.md marks with * (in
    dcgm-exporter's default set) is one the checked release collects by default, and every name
    it does not mark is not: the column says which, against the release it names."""
    from sidecar.metrics import DCGM_EXPORTER_CHECKED, DCGM_FIELDS

    assert f"tag: {DCGM_EXPORTER_CHECKED} " in DCGM_CSV.read_text().splitlines()[0]
    default = dcgm_default_counters(DCGM_CSV)
    assert len(default) > 20 and "DCGM_FI_DEV_GPU_UTIL" in default
    wrong = []
    for series, text in DCGM_FIELDS.items():
        names = re.findall(r"DCGM_FI_[A-Z0-9_]+", text)
        assert names, (series, text)
        marked = "*" in text
        if any((name in default) != marked for name in names):
            wrong.append((series, text, [name in default for name in names]))
    assert not wrong, wrong
    docs = (Path(__file__).parent.parent / "docs" / "metrics.md").read_text()
    assert f"dcgm-exporter {DCGM_EXPORTER_CHECKED}" in docs
