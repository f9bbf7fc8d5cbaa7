"""Built-in scenarios: the seed's story on a simulated node.

Each scenario is a set of simulated GPUs (hardware and load) plus the figures a simulated model
server publishes through the real app socket. Names say "Simulated" so that no series from here
can pass for a real GPU.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import pynvml

from sidecar.simulate.fake_nvml import OLD_DRIVER_MISSING, FakeGpu, FakeNvml, Signal
from sidecar.sources.pcie import link_max_bytes_per_second

GiB = 1024**3
H200_LINK = link_max_bytes_per_second(5, 16) or 0.0
A100_LINK = link_max_bytes_per_second(4, 16) or 0.0


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


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    gpus: tuple[FakeGpu, ...]
    app: AppProfile
    missing: frozenset[str] = frozenset()

    def nvml(self, **kwargs: object) -> FakeNvml:
        return FakeNvml(self.gpus, missing=self.missing, **kwargs)  # type: ignore[arg-type]


def simulated_uuid(scenario: str, index: int) -> str:
    h = hashlib.sha256(f"gpu-sidecar/{scenario}/{index}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _h200(scenario: str, index: int, **load: object) -> FakeGpu:
    base = FakeGpu(
        uuid=simulated_uuid(scenario, index),
        name="Simulated NVIDIA H200",
        pci_bus_id=f"00000000:{0x18 + 0x10 * index:02X}:00.0",
        architecture=pynvml.NVML_DEVICE_ARCH_HOPPER,
        memory_total=141 * GiB,
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
    )
    return replace(base, **load)  # type: ignore[arg-type]


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
    )


DEFAULT_GPUS = {"healthy": 2, "pcie-saturated": 2, "fragmented": 2, "low-occupancy": 2,
                "gpu-lost": 4, "old-driver": 2}
GPU_LOST_AT_S = 1.0
GPU_LOST_INDEX = 2


def build(name: str, gpus: int | None = None) -> Scenario:
    n = gpus or DEFAULT_GPUS[name]
    if name == "healthy":
        return Scenario(name, "Balanced load: occupancy, PCIe and allocator all comfortable.",
                        tuple(_h200(name, i) for i in range(n)), AppProfile())
    if name == "pcie-saturated":
        return Scenario(
            name, "Host-to-device copies fill about 90 % of the PCIe link; latency 80 -> 260 ms.",
            tuple(_h200(name, i, utilization=Signal(96, 0.02, 29), sm_occupancy=Signal(35, 0.05, 37),
                        pcie_rx=Signal(0.90 * H200_LINK, 0.03, 19),
                        pcie_tx=Signal(0.30 * H200_LINK, 0.05, 23)) for i in range(n)),
            AppProfile(latency_median_s=0.18, latency_p99_s=0.26),
        )
    if name == "fragmented":
        return Scenario(
            name, "Allocator cache 65 % empty and split into slivers; alloc retries climb.",
            tuple(_h200(name, i, utilization=Signal(90, 0.03, 29)) for i in range(n)),
            AppProfile(reserved_bytes=120 * GiB, fragmentation=0.65, nonreleasable=0.40,
                       largest_free_fraction=0.02, retries_per_minute=3.0,
                       latency_median_s=0.15, latency_p99_s=0.26),
        )
    if name == "low-occupancy":
        return Scenario(
            name, "Utilization reads 97 % while warps fill 18 % of the SMs; p99 latency degraded.",
            tuple(_h200(name, i, utilization=Signal(97, 0.02, 29), sm_occupancy=Signal(18, 0.1, 37),
                        tensor=Signal(8, 0.1, 41), sm_active=Signal(95, 0.02, 43))
                  for i in range(n)),
            AppProfile(latency_median_s=0.14, latency_p99_s=0.26),
        )
    if name == "gpu-lost":
        gpus_ = [_h200(name, i) for i in range(n)]
        lost = min(GPU_LOST_INDEX, n - 1)
        gpus_[lost] = replace(gpus_[lost], lost_between=(GPU_LOST_AT_S, None))
        return Scenario(name, f"GPU {lost} falls off the bus {GPU_LOST_AT_S:g} s after start; "
                        "the others keep reporting.", tuple(gpus_), AppProfile())
    if name == "old-driver":
        return Scenario(name, "Ampere on an old driver: no GPM, no memory v2, no PCIe byte "
                        "counters (falls back to the 20 ms throughput call).",
                        tuple(_a100_old(name, i) for i in range(n)),
                        AppProfile(reserved_bytes=20 * GiB),  # within the A100's 40 GiB
                        missing=OLD_DRIVER_MISSING)
    raise KeyError(name)
