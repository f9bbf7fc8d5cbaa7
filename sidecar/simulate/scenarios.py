"""Built-in scenarios: the seed's story on a simulated node.

Each scenario is a set of simulated GPUs (hardware and load) plus the figures a simulated model
server publishes through the real app socket. Names say "Simulated" so that no series from here
can pass for a real GPU.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import pynvml

from sidecar.simulate.fake_nvml import (
    OLD_DRIVER_MISSING,
    REASON_SW_POWER_CAP,
    DutyCycle,
    FakeGpu,
    FakeNvml,
    Signal,
)
from sidecar.sources.pcie import link_max_bytes_per_second

GiB = 1024**3
H200_LINK = link_max_bytes_per_second(5, 16) or 0.0
A100_LINK = link_max_bytes_per_second(4, 16) or 0.0
GEN3_X8_LINK = link_max_bytes_per_second(3, 8) or 0.0
OLD_DRIVER_VERSION = "515.105.01"  # R515: before GPM, the clock-event names and C2C fields
GH200_C2C_LINKS = 10  # nvidia-smi c2c -s on a GH200 480GB: links 0-9 at 44.712 GB/s each
GH200_C2C_LINK_MB_PER_SECOND = 44712  # NVML_FI_DEV_C2C_LINK_GET_MAX_BW, MB/s per link
GH200_C2C = GH200_C2C_LINKS * GH200_C2C_LINK_MB_PER_SECOND * 1e6  # 447 GB/s per direction
# NVLink 4 (H100, H200 SXM): 18 links at the 26,562 MBps NVML reports per link and direction
# (the stand-in's default, fake_nvml.FakeGpu.nvlink_speed_mbps): 478 GB/s per direction
NVLINK4 = 18 * 26562 * 1e6
TP_DEGREE = 8  # nvlink-saturated: one tensor-parallel group over the node's 8 GPUs


@dataclass(frozen=True)
class AppProfile:
    """What the simulated model server's allocator and request latency look like."""

    reserved_bytes: int = 60 * GiB
    fragmentation: float = 0.12
    nonreleasable: float = 0.03
    largest_free_fraction: float = 0.6
    retries_per_minute: float = 0.0
    latency_median_s: float = 0.060
    latency_p99_s: float = 0.090
    requests_per_second: float = 40.0
    publishes_latency: bool = True  # False: a server whose latency only its engine reports


DEGRADED_APP = AppProfile(latency_median_s=0.14, latency_p99_s=0.26)  # frozen: shared by scenarios


@dataclass(frozen=True)
class EngineProfile:
    """What the simulated serving engine's metrics endpoint (vLLM's format) says."""

    model_name: str = "Simulated/Llama-3.1-8B-Instruct"
    requests_per_second: float = 12.0
    tokens_per_request: float = 200.0
    running: float = 48.0
    waiting: float = 0.0
    kv_cache_usage: float = 0.6
    preemptions_per_second: float = 0.0
    latency_median_s: float = 1.8
    latency_p99_s: float = 4.0
    queue_median_s: float = 0.02
    queue_p99_s: float = 0.15
    ttft_median_s: float = 0.12
    ttft_p99_s: float = 0.45
    itl_median_s: float = 0.018
    itl_p99_s: float = 0.040


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    gpus: tuple[FakeGpu, ...]
    app: AppProfile
    missing: frozenset[str] = frozenset()
    driver_version: str | None = None  # None: the stand-in's default (a current driver)
    engine: EngineProfile | None = None  # a serving engine's metrics endpoint, simulated

    def nvml(self, **kwargs: object) -> FakeNvml:
        if self.driver_version is not None:
            kwargs.setdefault("driver_version", self.driver_version)
        return FakeNvml(self.gpus, missing=self.missing, **kwargs)  # type: ignore[arg-type]


def simulated_uuid(scenario: str, index: int) -> str:
    h = hashlib.sha256(f"gpu-sidecar/{scenario}/{index}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


@dataclass(frozen=True)
class Board:
    """A GPU model's static properties as a real one of that model reports them: each line is
    read off its ``nvidia-smi -q`` kept in tests/realworld/ (tests/test_standins_vs_captures.py
    holds the stand-ins built from it against that capture through pynvml). The load (what the
    GPU is doing) is the scenario's; what the hardware *is* comes from here, so a share computed
    on a stand-in is a share of the real link, clock or limit."""

    name: str  # Product Name
    memory_total: int  # FB Memory Usage: Total (MiB there), bytes here
    memory_reserved: int  # FB Memory Usage: Reserved (the driver's, nvmlMemory_v2.reserved)
    sm_clock_max: int  # Max Clocks, MHz
    memory_clock_max: int
    video_clock_max: int
    power_limit: float  # GPU Power Readings: Current Power Limit (the enforced one), W
    link_generation: int  # GPU Link Info: PCIe Generation Max / Current, Link Width Max / Current
    link_width: int
    current_link_generation: int
    current_link_width: int
    c2c: bool  # GPU C2C Mode: Enabled (NVLink-C2C to a Grace CPU is the host link)
    ecc: bool  # ECC Mode: Enabled

    def static(self) -> dict[str, object]:
        """The ``FakeGpu`` fields this board fixes."""
        return {"name": f"Simulated {self.name}", "memory_total": self.memory_total,
                "memory_driver_reserved": self.memory_reserved,
                "sm_clock_max": self.sm_clock_max, "memory_clock_max": self.memory_clock_max,
                "video_clock_max": self.video_clock_max, "power_limit": self.power_limit,
                "link_generation": self.link_generation, "link_width": self.link_width,
                "current_link_generation": self.current_link_generation,
                "current_link_width": self.current_link_width, "has_c2c": self.c2c,
                "has_ecc": self.ecc}


MiB = 1024**2
# tests/realworld/nvidia_smi_q_H100_SXM_driver565_gpu0.txt
H100_SXM = Board(name="NVIDIA H100 80GB HBM3", memory_total=81559 * MiB,
                 memory_reserved=454 * MiB, sm_clock_max=1980, memory_clock_max=2619,
                 video_clock_max=1545, power_limit=700.0, link_generation=5, link_width=16,
                 current_link_generation=5, current_link_width=16, c2c=False, ecc=True)
# tests/realworld/nvidia_smi_q_H200_driver550_excerpt.txt (its excerpt has no ECC section: an
# H200's HBM3e has ECC on, as the H100's)
H200 = Board(name="NVIDIA H200", memory_total=143771 * MiB, memory_reserved=700 * MiB,
             sm_clock_max=1980, memory_clock_max=3201, video_clock_max=1545, power_limit=700.0,
             link_generation=5, link_width=16, current_link_generation=5, current_link_width=16,
             c2c=False, ecc=True)
# tests/realworld/nvidia_smi_q_GH200_480GB_driver550.txt: PCIe Gen4 x1, maximum and current (the
# host link is NVLink-C2C; the PCIe link is a narrow side channel), the enforced limit 700 W of
# its default 900 W
GH200 = Board(name="NVIDIA GH200 480GB", memory_total=97871 * MiB, memory_reserved=1103 * MiB,
              sm_clock_max=1980, memory_clock_max=2619, video_clock_max=1545, power_limit=700.0,
              link_generation=4, link_width=1, current_link_generation=4, current_link_width=1,
              c2c=True, ecc=True)
BOARDS = {"H100 SXM": H100_SXM, "H200": H200, "GH200": GH200}


def standin(board: Board, scenario: str, index: int, **load: object) -> FakeGpu:
    """A simulated GPU of ``board`` under the healthy default load; ``load`` changes any field
    (a scenario's load, or a fault)."""
    base = FakeGpu(
        uuid=simulated_uuid(scenario, index),
        pci_bus_id=f"00000000:{0x18 + 0x10 * index:02X}:00.0",
        architecture=pynvml.NVML_DEVICE_ARCH_HOPPER,
        memory_used=Signal(70 * GiB, 0.02, 45),
        utilization=Signal(62, 0.05, 29),
        memory_busy=Signal(35, 0.08, 31),
        sm_occupancy=Signal(55, 0.05, 37),
        tensor=Signal(42, 0.06, 41),
        sm_active=Signal(70, 0.04, 43),
        dram_bw=Signal(45, 0.05, 47),
        pcie_tx=Signal(2.0e9, 0.1, 23),
        pcie_rx=Signal(6.0e9, 0.1, 19),
        nvlink_links=18,
        nvlink_tx=Signal(20e9, 0.1, 53),
        nvlink_rx=Signal(20e9, 0.1, 59),
        replays_per_second=0.0,
        sm_clock=Signal(float(board.sm_clock_max)),
        memory_clock=Signal(float(board.memory_clock_max)),
        power=Signal(450.0, 0.05, 17),
        temperature=Signal(52.0, 0.03, 61),
        memory_temperature=Signal(58.0, 0.03, 67),
        **board.static(),  # type: ignore[arg-type]
    )
    return replace(base, **load)  # type: ignore[arg-type]


def _h200(scenario: str, index: int, **load: object) -> FakeGpu:
    return standin(H200, scenario, index, **load)


def _a100_old(scenario: str, index: int) -> FakeGpu:
    return FakeGpu(
        uuid=simulated_uuid(scenario, index),
        name="Simulated NVIDIA A100-PCIE-40GB",
        pci_bus_id=f"00000000:{0x3B + index:02X}:00.0",
        architecture=pynvml.NVML_DEVICE_ARCH_AMPERE,
        memory_total=40 * GiB,
        memory_used=Signal(22 * GiB, 0.02, 45),
        utilization=Signal(71, 0.05, 29),
        memory_busy=Signal(30, 0.08, 31),
        pcie_tx=Signal(1.5e9, 0.1, 23),
        pcie_rx=Signal(4.0e9, 0.1, 19),
        link_generation=4,
        current_link_generation=4,
        nvlink_links=0,
        has_gpm=False,
        has_pcie_counters=False,
        replays_per_second=0.01,
        sm_clock=Signal(1410.0),
        sm_clock_max=1410,
        memory_clock=Signal(1215.0),
        memory_clock_max=1215,
        video_clock=Signal(1290.0),
        video_clock_max=1290,
        power=Signal(180.0, 0.05, 17),
        power_limit=250.0,
        power_usage_averaged=False,  # GA100: the instantaneous draw
        temperature=Signal(48.0, 0.03, 61),
        memory_temperature=Signal(55.0, 0.03, 67),
    )


def _gh200(scenario: str, index: int, **load: object) -> FakeGpu:
    """A GH200 480GB superchip's GPU (96 GB HBM3): the host link is NVLink-C2C to Grace, and its
    PCIe link is Gen4 x1 (as the real one reports), carrying almost nothing."""
    base = standin(GH200, scenario, index,
                   pci_bus_id=f"00000009:{0x01 + index:02X}:00.0",
                   memory_used=Signal(64 * GiB, 0.02, 45),  # above the app's 60 GiB cache
                   pcie_tx=Signal(1.0e6, 0.1, 23),  # host traffic goes over C2C, not PCIe
                   pcie_rx=Signal(2.0e6, 0.1, 19),
                   nvlink_tx=Signal(0.0),
                   nvlink_rx=Signal(0.0),
                   c2c_links=GH200_C2C_LINKS,
                   c2c_link_max_mb_per_second=GH200_C2C_LINK_MB_PER_SECOND,
                   c2c_tx=Signal(0.25 * GH200_C2C, 0.05, 23),
                   c2c_rx=Signal(0.30 * GH200_C2C, 0.05, 19))
    return replace(base, **load)  # type: ignore[arg-type]


DEFAULT_GPUS = {"healthy": 2, "pcie-saturated": 2, "fragmented": 2, "low-occupancy": 2,
                "gpu-lost": 4, "old-driver": 2, "throttled": 2, "pcie-degraded": 2,
                "hardware-fault": 4, "grace-hopper": 1, "nvlink-saturated": TP_DEGREE,
               "kv-cache-full": 1, "queueing": 1}
SCENARIOS = tuple(DEFAULT_GPUS)  # the names --simulate takes
GPU_LOST_AT_S = 1.0
GPU_LOST_INDEX = 2
POWER_CAP_SHARE = 0.8  # throttled: the SW power cap holds the clocks 80 % of the time
FRAGMENTED_CACHE = 120 * GiB  # fragmented: the allocator's cache, 65 % of it empty
FAULT_XIDS = ((1.0, 79), (1.2, 79))  # hardware-fault: GPU 1 reports it fell off the bus ...
FAULT_LOST_AT_S = 1.5  # ... and is lost from here on
FAULT_XID_INDEX = 1
FAULT_ECC_INDEX = 2


def build(name: str, gpus: int | None = None) -> Scenario:
    """The scenario ``name`` on ``gpus`` GPUs (its own default number when not given)."""
    n = gpus or DEFAULT_GPUS[name]
    return _BUILDERS[name](name, n)


def _healthy(name: str, n: int) -> Scenario:
    """The baseline: nothing for the judge to find."""
    return Scenario(name, "Balanced load: occupancy, PCIe and allocator all comfortable.",
                    tuple(_h200(name, i) for i in range(n)), AppProfile())


def _pcie_saturated(name: str, n: int) -> Scenario:
    """The copies, not the kernels, hold the app back: the PCIe link near full."""
    return Scenario(
        name, "Host-to-device copies fill about 90 % of the PCIe link; p99 near 300 ms.",
        tuple(_h200(name, i, utilization=Signal(96, 0.02, 29), sm_occupancy=Signal(35, 0.05, 37),
                    pcie_rx=Signal(0.90 * H200_LINK, 0.03, 19),
                    pcie_tx=Signal(0.30 * H200_LINK, 0.05, 23)) for i in range(n)),
        AppProfile(latency_median_s=0.18, latency_p99_s=0.26),
    )


def _fragmented(name: str, n: int) -> Scenario:
    """The allocator's cache, not the GPU, holds the app back: empty but in slivers."""
    return Scenario(
        name, "Allocator cache 65 % empty and split into slivers; alloc retries climb.",
        # the device memory holds the allocator's cache (the app's 120 GiB) and the CUDA
        # context beside it: a cache cannot be larger than the memory in use
        tuple(_h200(name, i, utilization=Signal(90, 0.03, 29),
                    memory_used=Signal(FRAGMENTED_CACHE + 4 * GiB, 0.01, 45))
              for i in range(n)),
        AppProfile(reserved_bytes=FRAGMENTED_CACHE, fragmentation=0.65, nonreleasable=0.40,
                   largest_free_fraction=0.02, retries_per_minute=3.0,
                   latency_median_s=0.15, latency_p99_s=0.26),
    )


def _low_occupancy(name: str, n: int) -> Scenario:
    """A busy-looking GPU whose SMs are mostly idle: utilization alone misleads."""
    return Scenario(
        name, "Utilization reads 97 % while warps fill 18 % of the SMs; p99 latency degraded.",
        tuple(_h200(name, i, utilization=Signal(97, 0.02, 29), sm_occupancy=Signal(18, 0.1, 37),
                    tensor=Signal(8, 0.1, 41), sm_active=Signal(95, 0.02, 43))
              for i in range(n)),
        AppProfile(latency_median_s=0.14, latency_p99_s=0.26),
    )


def _gpu_lost(name: str, n: int) -> Scenario:
    """One GPU gone mid-run: the others must go on being read and reported."""
    gpus_ = [_h200(name, i) for i in range(n)]
    lost = min(GPU_LOST_INDEX, n - 1)
    gpus_[lost] = replace(gpus_[lost], lost_between=(GPU_LOST_AT_S, None))
    return Scenario(name, f"GPU {lost} falls off the bus {GPU_LOST_AT_S:g} s after start; "
                    "the others keep reporting.", tuple(gpus_), AppProfile())


def _old_driver(name: str, n: int) -> Scenario:
    """An old driver without GPM, memory v2 or PCIe counters: the fallbacks' case."""
    return Scenario(name, "Ampere on an old driver: no GPM, no memory v2, no PCIe byte "
                    "counters (falls back to the 20 ms throughput call).",
                    tuple(_a100_old(name, i) for i in range(n)),
                    AppProfile(reserved_bytes=20 * GiB),  # within the A100's 40 GiB
                    missing=OLD_DRIVER_MISSING, driver_version=OLD_DRIVER_VERSION)


def _throttled(name: str, n: int) -> Scenario:
    """Clocks held down by the power cap: the SW power cap's share of the time shows it."""
    return Scenario(
        name, "Held at the 700 W power cap: SM clock 1300 of 1980 MHz, SW power cap 80 % of "
        "the time; p99 latency degraded.",
        tuple(_h200(name, i, utilization=Signal(97, 0.01, 29), sm_active=Signal(93, 0.02, 43),
                    sm_clock=Signal(1300.0, 0.03, 11), power=Signal(697.0, 0.004, 13),
                    temperature=Signal(66.0, 0.02, 61),
                    memory_temperature=Signal(72.0, 0.02, 67),
                    clock_events=((REASON_SW_POWER_CAP, DutyCycle(POWER_CAP_SHARE, 5.0)),))
              for i in range(n)),
        DEGRADED_APP,
    )


def _pcie_degraded(name: str, n: int) -> Scenario:
    """A link trained below its width and generation: full at an eighth of its speed."""
    return Scenario(
        name, "Gen5 x16 GPUs trained at Gen3 x8 (an eighth of the bandwidth); copies fill 95 "
        "% of the trained link; p99 latency degraded.",
        tuple(_h200(name, i, current_link_generation=3, current_link_width=8,
                    utilization=Signal(88, 0.03, 29), sm_occupancy=Signal(30, 0.05, 37),
                    pcie_rx=Signal(0.95 * GEN3_X8_LINK, 0.02, 19),
                    pcie_tx=Signal(0.20 * GEN3_X8_LINK, 0.05, 23),
                    pcie_correctable_errors_per_second=2.0,
                    pcie_l0_recovery_per_second=0.05)
              for i in range(n)),
        DEGRADED_APP,
    )


def _hardware_fault(name: str, n: int) -> Scenario:
    """Xid 79 then loss on one GPU, climbing uncorrected ECC on another."""
    gpus_ = [_h200(name, i) for i in range(n)]
    xid, ecc = min(FAULT_XID_INDEX, n - 1), min(FAULT_ECC_INDEX, n - 1)
    gpus_[xid] = replace(gpus_[xid], xid_events=FAULT_XIDS,
                         lost_between=(FAULT_LOST_AT_S, None))
    gpus_[ecc] = replace(gpus_[ecc], ecc_uncorrected_per_second=0.5,
                         ecc_corrected_per_second=3.0, ecc_corrected_aggregate_base=120,
                         ecc_uncorrected_aggregate_base=2, remapped_rows_correctable=1,
                         remapped_rows_uncorrectable=1, row_remap_pending=True)
    return Scenario(
        name, f"GPU {xid} reports Xid 79 twice and falls off the bus at {FAULT_LOST_AT_S:g} "
        f"s; GPU {ecc}'s uncorrected ECC errors climb with a row remap pending.",
        tuple(gpus_), DEGRADED_APP)


def _grace_hopper(name: str, n: int) -> Scenario:
    """GH200: the host copies go over NVLink-C2C, not PCIe."""
    return Scenario(
        name, "GH200: host copies over NVLink-C2C (10 links, 447 GB/s each way) fill 90 % "
        "of it, PCIe idle; p99 latency degraded.",
        tuple(_gh200(name, i, utilization=Signal(94, 0.02, 29),
                     c2c_rx=Signal(0.90 * GH200_C2C, 0.02, 19)) for i in range(n)),
        DEGRADED_APP,
    )


def _nvlink_saturated(name: str, n: int) -> Scenario:
    """Tensor parallel: the all-reduce fills NVLink both ways."""
    # the all-reduce of each layer sends and receives as much on every GPU of the group (a
    # ring or NVSwitch's in-network reduction): both directions near the links' maximum
    return Scenario(
        name, f"Tensor parallel over {n} GPUs: the all-reduce fills about 90 % of NVLink (18 "
        "links, 478 GB/s each way) while the GPUs are busy; p99 latency degraded.",
        tuple(_h200(name, i, utilization=Signal(95, 0.02, 29), sm_occupancy=Signal(48, 0.05, 37),
                    nvlink_tx=Signal(0.90 * NVLINK4, 0.02, 53),
                    nvlink_rx=Signal(0.88 * NVLINK4, 0.02, 59)) for i in range(n)),
        DEGRADED_APP,
    )


def _kv_cache_full(name: str, n: int) -> Scenario:
    """The engine's KV cache, not the GPU, holds requests back."""
    return Scenario(
        name, "vLLM's KV cache 98 % full: requests wait and are preempted; p99 near 10 s while the "
        "GPU layers are comfortable.",
        tuple(_h200(name, i, utilization=Signal(93, 0.02, 29), sm_occupancy=Signal(52, 0.05, 37),
                    memory_used=Signal(131 * GiB, 0.005, 45)) for i in range(n)),
        AppProfile(reserved_bytes=120 * GiB, publishes_latency=False),
        engine=EngineProfile(kv_cache_usage=0.98, running=61, waiting=23,
                             preemptions_per_second=0.8, latency_median_s=3.5,
                             latency_p99_s=9.0, queue_median_s=0.6, queue_p99_s=2.5,
                             ttft_median_s=0.9, ttft_p99_s=3.0))


def _queueing(name: str, n: int) -> Scenario:
    """Requests wait in the engine's queue while the GPU and the KV cache have room."""
    return Scenario(
        name, "Requests wait in vLLM's queue for most of their p99 (about 9 of 10 s) while the GPU "
        "runs half full and the KV cache has room.",
        tuple(_h200(name, i, utilization=Signal(58, 0.04, 29), sm_occupancy=Signal(41, 0.05, 37))
              for i in range(n)),
        AppProfile(publishes_latency=False),
        engine=EngineProfile(kv_cache_usage=0.45, running=16, waiting=40,
                             latency_median_s=2.8, latency_p99_s=8.0, queue_median_s=2.0,
                             queue_p99_s=7.0, ttft_median_s=2.1, ttft_p99_s=7.2))


_BUILDERS: dict[str, Callable[[str, int], Scenario]] = {
    "healthy": _healthy,
    "pcie-saturated": _pcie_saturated,
    "fragmented": _fragmented,
    "low-occupancy": _low_occupancy,
    "gpu-lost": _gpu_lost,
    "old-driver": _old_driver,
    "throttled": _throttled,
    "pcie-degraded": _pcie_degraded,
    "hardware-fault": _hardware_fault,
    "grace-hopper": _grace_hopper,
    "nvlink-saturated": _nvlink_saturated,
    "kv-cache-full": _kv_cache_full,
    "queueing": _queueing,
}
