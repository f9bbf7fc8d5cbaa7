"""The metric table of Contract 1: one place that declares every series the agent produces.

Each entry of ``TABLE`` is the whole declaration of one figure: its name, type, unit, layer,
where it comes from, what it means, its OpenTelemetry name (and fixed attributes), its
dcgm-exporter counterpart, and, for a figure NVML gives per GPU, the field it fills in the
sample's layer (``field``), the field the verdict reads it as (``figure``) or, for a share, the
two series it divides (``ratio_of``). Everything else that names a figure is built from here:
the sample layers (``sidecar.samples``), the verdict's ``Figures`` (``sidecar.judge.figures``),
the OTLP names (``OTEL``), ``DCGM_FIELDS`` and ``docs/metrics.md`` (rendered by
``sidecar.views.reference``; a test fails when the committed file differs).

The serving engine's series are declared here too (``ENGINE_SERIES``; which of each engine's own
families become them is ``sidecar.sources.engine.families``'s); ``METRICS``, ``BY_NAME`` and
``OTEL`` include them. This module imports nothing of the package: it is the foundation every
part that names a figure stands on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["gauge", "counter", "histogram"]
Instrument = Literal["gauge", "counter", "updowncounter", "histogram"]
Attributes = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One series (or histogram) and everything that names it."""

    name: str
    kind: Kind
    unit: str
    layer: str
    source: str
    help: str
    otel: str  # the OpenTelemetry name
    otel_attributes: Attributes = ()  # fixed attributes that tell two series of one OTel name apart
    instrument: Instrument | None = None  # the OTLP instrument, where not the Prometheus kind's
    dcgm: str = ""  # dcgm-exporter's field of the same quantity, its unit where it differs
    field: str = ""  # the sample layer's field NVML's reading fills (compute, memory, io, health)
    figure: str = ""  # the verdict's ``Figures`` field it is read back into, where judged
    ratio_of: tuple[str, str] | None = None  # a share: numerator and denominator series
    # on a link's maximum (the series its shares divide by): the link's name as probe and the
    # report write it and the live table's short name for its columns, ("NVLink", "NVL")
    link: tuple[str, str] | None = None
    # how often a pushing sink sends it: every cycle, or ("rare") when it changes and again every
    # minute (sidecar/sinks/cadence.py): maxima, the link's trained maximum, error counters
    cadence: Literal["cycle", "rare"] = "cycle"


def _m(name: str, kind: Kind, unit: str, layer: str, source: str, help: str,
       **declared: Any) -> MetricSpec:
    return MetricSpec(name, kind, unit, layer, source, help, **declared)


_TX, _RX = (("network.io.direction", "transmit"),), (("network.io.direction", "receive"),)


def _errors(kind: str) -> dict[str, Any]:
    """The OTel conventions' ``hw.errors``, told apart by ``error.type``."""
    return {"otel": "hw.errors", "otel_attributes": (("error.type", kind),)}


def _limited(reason: str) -> dict[str, Any]:
    return {"otel": "gpu.clock.limited", "otel_attributes": (("gpu.clock.reason", reason),)}


# The dcgm-exporter fields (``dcgm=``) are those of DCGM 4.x's dcgm_fields.h and dcgm-exporter's
# default-counters.csv; their units differ (MiB for memory, MHz for clocks, percent for
# utilization, ns for violation counters); * marks a field in dcgm-exporter's default set.
TABLE: tuple[MetricSpec, ...] = (
    # compute
    _m("gpu_sm_occupancy_ratio", "gauge", "ratio", "compute", "GPM SM_OCCUPANCY / 100",
       "Resident warps over the maximum, averaged over the sample interval (Hopper and newer).",
       otel="gpu.sm.occupancy", dcgm="DCGM_FI_PROF_SM_OCCUPANCY", field="sm_occupancy_ratio",
       figure="occupancy"),
    _m("gpu_tensor_core_util_ratio", "gauge", "ratio", "compute", "GPM ANY_TENSOR_UTIL / 100",
       "Share of cycles in which any tensor pipe was active (Hopper and newer).",
       otel="gpu.tensor_core.utilization", dcgm="DCGM_FI_PROF_PIPE_TENSOR_ACTIVE*",
       field="tensor_core_util_ratio", figure="tensor"),
    _m("gpu_sm_active_ratio", "gauge", "ratio", "compute", "GPM SM_UTIL / 100",
       "Share of cycles in which an SM had work (Hopper and newer).",
       otel="gpu.sm.utilization", dcgm="DCGM_FI_PROF_SM_ACTIVE", field="sm_active_ratio", figure="sm_active"),
    _m("gpu_utilization_ratio", "gauge", "ratio", "compute", "nvmlDeviceGetUtilizationRates().gpu / 100",
       "Share of time any kernel ran: the classic figure, kept for contrast with occupancy.",
       otel="hw.gpu.utilization", otel_attributes=(("hw.gpu.task", "general"),),
       dcgm="DCGM_FI_DEV_GPU_UTIL* (percent)", field="utilization_ratio", figure="utilization"),
    # compute: the GPU's CUDA processes, this pod's and the others' (every PROCESS_READ_S)
    _m("gpu_processes_attributed", "gauge", "boolean", "compute",
       "nvmlDeviceGet{,MPS}ComputeRunningProcesses_v3 + /proc",
       "1 when the running processes could be told this pod's or others' (the agent sees the "
       "pod's processes: shareProcessNamespace), 0 when not: the pod and other figures are "
       "then absent.",
       otel="gpu.processes.attributed", field="processes_attributed",
       figure="processes_attributed"),
    _m("gpu_process_utilization_attributed", "gauge", "boolean", "compute",
       "nvmlDeviceGetProcessUtilization + /proc",
       "1 when the per-process utilization samples could be told this pod's or others', 0 when "
       "not (a driver that gives them in host PIDs the pod's /proc cannot map).",
       otel="gpu.process_utilization.attributed", field="process_utilization_attributed",
       figure="process_utilization_attributed"),
    _m("gpu_pod_processes", "gauge", "processes", "compute",
       "nvmlDeviceGet{,MPS}ComputeRunningProcesses_v3",
       "CUDA processes on this GPU that are this pod's.",
       otel="gpu.processes", otel_attributes=(("gpu.process.owner", "pod"),),
       field="pod_processes",
       figure="pod_processes"),
    _m("gpu_other_processes", "gauge", "processes", "compute",
       "nvmlDeviceGet{,MPS}ComputeRunningProcesses_v3",
       "CUDA processes on this GPU that are not this pod's (those the driver shows the agent).",
       otel="gpu.processes", otel_attributes=(("gpu.process.owner", "other"),),
       field="other_processes",
       figure="other_processes"),
    _m("gpu_pod_process_memory_bytes", "gauge", "bytes", "compute",
       "nvmlDeviceGet{,MPS}ComputeRunningProcesses_v3 usedGpuMemory",
       "GPU memory of this pod's processes on this GPU.",
       otel="gpu.process.memory.usage", otel_attributes=(("gpu.process.owner", "pod"),),
       field="pod_process_memory_bytes",
       figure="pod_process_memory"),
    _m("gpu_other_process_memory_bytes", "gauge", "bytes", "compute",
       "nvmlDeviceGet{,MPS}ComputeRunningProcesses_v3 usedGpuMemory",
       "GPU memory of the other processes on this GPU.",
       otel="gpu.process.memory.usage", otel_attributes=(("gpu.process.owner", "other"),),
       field="other_process_memory_bytes",
       figure="other_process_memory"),
    _m("gpu_pod_sm_share_ratio", "gauge", "ratio", "compute",
       "nvmlDeviceGetProcessUtilization smUtil / 100",
       "This pod's processes' share of SM time since the previous process read (the sum over "
       "its processes of each one's mean over the sample periods).",
       otel="gpu.process.sm.utilization", otel_attributes=(("gpu.process.owner", "pod"),),
       field="pod_sm_share_ratio",
       figure="pod_sm_share"),
    _m("gpu_other_sm_share_ratio", "gauge", "ratio", "compute",
       "nvmlDeviceGetProcessUtilization smUtil / 100",
       "The other processes' share of SM time since the previous process read.",
       otel="gpu.process.sm.utilization", otel_attributes=(("gpu.process.owner", "other"),),
       field="other_sm_share_ratio",
       figure="other_sm_share"),
    _m("gpu_pod_mem_bandwidth_share_ratio", "gauge", "ratio", "compute",
       "nvmlDeviceGetProcessUtilization memUtil / 100",
       "This pod's processes' share of memory bandwidth since the previous process read.",
       otel="gpu.process.memory.bandwidth.utilization",
       otel_attributes=(("gpu.process.owner", "pod"),), field="pod_mem_bandwidth_share_ratio",
       figure="pod_mem_bw_share"),
    _m("gpu_other_mem_bandwidth_share_ratio", "gauge", "ratio", "compute",
       "nvmlDeviceGetProcessUtilization memUtil / 100",
       "The other processes' share of memory bandwidth since the previous process read.",
       otel="gpu.process.memory.bandwidth.utilization",
       otel_attributes=(("gpu.process.owner", "other"),), field="other_mem_bandwidth_share_ratio",
       figure="other_mem_bw_share"),
    # memory
    _m("gpu_mem_bandwidth_util_ratio", "gauge", "ratio", "memory", "GPM DRAM_BW_UTIL / 100",
       "DRAM bandwidth used over the theoretical maximum (Hopper and newer).",
       otel="gpu.memory.bandwidth.utilization", dcgm="DCGM_FI_PROF_DRAM_ACTIVE*",
       field="bandwidth_util_ratio", figure="dram_bw"),
    _m("gpu_memory_controller_busy_ratio", "gauge", "ratio", "memory",
       "nvmlDeviceGetUtilizationRates().memory / 100",
       "Share of time device memory was read or written.",
       otel="gpu.memory.controller.utilization", dcgm="DCGM_FI_DEV_MEM_COPY_UTIL* (percent)",
       field="controller_busy_ratio"),
    _m("gpu_memory_used_bytes", "gauge", "bytes", "memory", "nvmlDeviceGetMemoryInfo (v2, else v1)",
       "Device memory in use.",
       otel="hw.gpu.memory.usage", instrument="updowncounter", dcgm="DCGM_FI_DEV_FB_USED* (MiB)",
       field="used_bytes", figure="mem_used"),
    _m("gpu_memory_total_bytes", "gauge", "bytes", "memory", "nvmlDeviceGetMemoryInfo (v2, else v1)",
       "Device memory in total.",
       otel="hw.gpu.memory.limit", instrument="updowncounter", dcgm="DCGM_FI_DEV_FB_TOTAL (MiB)",
       field="total_bytes", figure="mem_total", cadence="rare"),
    _m("gpu_memory_reserved_bytes", "gauge", "bytes", "memory", "nvmlDeviceGetMemoryInfo_v2",
       "Device memory reserved by the driver and firmware (v2 only).",
       otel="gpu.memory.reserved", dcgm="DCGM_FI_DEV_FB_RESERVED* (MiB)", field="reserved_bytes",
       cadence="rare"),
    _m("gpu_memory_fragmentation_ratio", "gauge", "ratio", "memory", "app: (reserved - allocated) / reserved",
       "Share of the allocator's cache that holds no tensor.",
       otel="gpu.memory.fragmentation", figure="fragmentation"),
    _m("gpu_allocator_nonreleasable_ratio", "gauge", "ratio", "memory",
       "app: inactive_split_bytes / reserved",
       "Free slivers inside live segments that empty_cache() cannot return.",
       otel="gpu.allocator.nonreleasable", figure="nonreleasable"),
    _m("gpu_allocator_largest_free_block_bytes", "gauge", "bytes", "memory",
       "app: memory_snapshot(), inactive blocks",
       "Largest request the allocator cache can serve without cudaMalloc.",
       otel="gpu.allocator.largest_free_block", figure="largest_free"),
    _m("gpu_allocator_reserved_bytes", "gauge", "bytes", "memory", "app: reserved_bytes.all.current",
       "Memory the caching allocator holds from CUDA.",
       otel="gpu.allocator.reserved", figure="alloc_reserved"),
    _m("gpu_allocator_allocated_bytes", "gauge", "bytes", "memory", "app: allocated_bytes.all.current",
       "Memory occupied by live tensors.",
       otel="gpu.allocator.allocated"),
    _m("gpu_allocator_private_pool_bytes", "gauge", "bytes", "memory", "app: private pools (CUDA graphs)",
       "Memory held by private pools, when the app reports it.",
       otel="gpu.allocator.private_pool"),
    _m("gpu_allocator_alloc_retries_total", "counter", "retries", "memory", "app: num_alloc_retries",
       "cudaMalloc failed, the cache was flushed and the allocation retried.",
       otel="gpu.allocator.alloc_retries", figure="retries"),
    _m("gpu_allocator_ooms_total", "counter", "errors", "memory", "app: num_ooms",
       "Out-of-memory errors raised by the allocator.",
       otel="gpu.allocator.ooms", figure="ooms"),
    _m("gpu_app_processes", "gauge", "processes", "memory", "app",
       "Processes publishing allocator figures for this GPU; the allocator series are their sum (ratios "
       "from the sums, retries and OOMs kept across process restarts).",
       otel="gpu.app.processes"),
    _m("gpu_app_process_reserved_bytes", "gauge", "bytes", "memory",
       "app: reserved_bytes.all.current, one process",
       "Per process, label `pid`; only with --app-process-series.",
       otel="gpu.app.process.reserved"),
    _m("gpu_app_process_allocated_bytes", "gauge", "bytes", "memory",
       "app: allocated_bytes.all.current, one process",
       "Per process, label `pid`; only with --app-process-series.",
       otel="gpu.app.process.allocated"),
    _m("gpu_app_process_fragmentation_ratio", "gauge", "ratio", "memory",
       "app: (reserved - allocated) / reserved, one process",
       "Per process, label `pid`; only with --app-process-series.",
       otel="gpu.app.process.fragmentation"),
    # io
    _m("gpu_pcie_tx_bytes_per_second", "gauge", "bytes/s", "io",
       "NVML field 197 deltas, else GPM PCIE_TX, else nvmlDeviceGetPcieThroughput(TX): a 20 ms "
       "sample every 20 s (one call per GPU every 10 s, RX and TX in turn), carried between",
       "PCIe traffic from the device to the host.",
       otel="gpu.pcie.throughput", otel_attributes=_TX, dcgm="DCGM_FI_PROF_PCIE_TX_BYTES*",
       field="pcie_tx_bytes_per_second", figure="pcie_tx"),
    _m("gpu_pcie_rx_bytes_per_second", "gauge", "bytes/s", "io",
       "NVML field 198 deltas, else GPM PCIE_RX, else nvmlDeviceGetPcieThroughput(RX): a 20 ms "
       "sample every 20 s (one call per GPU every 10 s, RX and TX in turn), carried between",
       "PCIe traffic from the host to the device.",
       otel="gpu.pcie.throughput", otel_attributes=_RX, dcgm="DCGM_FI_PROF_PCIE_RX_BYTES*",
       field="pcie_rx_bytes_per_second", figure="pcie_rx"),
    _m("gpu_pcie_tx_bandwidth_util_ratio", "gauge", "ratio", "io",
       "gpu_pcie_tx_bytes_per_second / gpu_pcie_link_max_bytes_per_second",
       "Device-to-host rate over the link maximum.",
       otel="gpu.pcie.utilization", otel_attributes=_TX, figure="pcie_tx_ratio",
       ratio_of=("gpu_pcie_tx_bytes_per_second", "gpu_pcie_link_max_bytes_per_second")),
    _m("gpu_pcie_rx_bandwidth_util_ratio", "gauge", "ratio", "io",
       "gpu_pcie_rx_bytes_per_second / gpu_pcie_link_max_bytes_per_second",
       "Host-to-device rate over the link maximum.",
       otel="gpu.pcie.utilization", otel_attributes=_RX, figure="pcie_rx_ratio",
       ratio_of=("gpu_pcie_rx_bytes_per_second", "gpu_pcie_link_max_bytes_per_second")),
    _m("gpu_pcie_link_max_bytes_per_second", "gauge", "bytes/s", "io",
       "max link generation x max width (per direction), or --pcie-peak-bytes-per-second",
       "Per-direction link maximum the ratios divide by.",
       otel="gpu.pcie.link.max_throughput", field="pcie_link_max_bytes_per_second", figure="link_max",
       link=("PCIe", "PCIe"), cadence="rare"),
    _m("gpu_pcie_link_generation", "gauge", "generation", "io", "nvmlDeviceGetMaxPcieLinkGeneration",
       "Maximum PCIe generation of device and system.",
       otel="gpu.pcie.link.generation", dcgm="DCGM_FI_DEV_PCIE_MAX_LINK_GEN", field="pcie_link_generation",
       figure="link_gen", cadence="rare"),
    _m("gpu_pcie_link_width", "gauge", "lanes", "io", "nvmlDeviceGetMaxPcieLinkWidth",
       "Maximum PCIe link width.",
       otel="gpu.pcie.link.width", dcgm="DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH", field="pcie_link_width",
       figure="link_width", cadence="rare"),
    _m("gpu_pcie_replay_errors_total", "counter", "errors", "io",
       "NVML field 94, else nvmlDeviceGetPcieReplayCounter",
       "PCIe replays: link errors that also cost bandwidth.",
       **_errors("pcie_replay"), dcgm="DCGM_FI_DEV_PCIE_REPLAY_COUNTER*", field="pcie_replay_errors",
       figure="replays", cadence="rare"),
    _m("gpu_pcie_link_current_generation", "gauge", "generation", "io", "nvmlDeviceGetCurrPcieLinkGeneration",
       "PCIe generation the link runs at now (idle links train down to save power).",
       otel="gpu.pcie.link.current_generation", dcgm="DCGM_FI_DEV_PCIE_LINK_GEN",
       field="pcie_link_current_generation", figure="link_gen_now"),
    _m("gpu_pcie_link_current_width", "gauge", "lanes", "io", "nvmlDeviceGetCurrPcieLinkWidth",
       "PCIe link width now.",
       otel="gpu.pcie.link.current_width", dcgm="DCGM_FI_DEV_PCIE_LINK_WIDTH",
       field="pcie_link_current_width", figure="link_width_now"),
    _m("gpu_pcie_link_current_bytes_per_second", "gauge", "bytes/s", "io",
       "current link generation x current width (per direction)",
       "Per-direction maximum of the link as trained now.",
       otel="gpu.pcie.link.current_max", field="pcie_link_current_bytes_per_second", figure="link_now"),
    _m("gpu_nvlink_tx_bytes_per_second", "gauge", "bytes/s", "io",
       "GPM NVLINK_TOTAL_TX, else NVML field 138 (KiB, per link) deltas summed",
       "NVLink data sent, summed over links.",
       otel="gpu.nvlink.throughput", otel_attributes=_TX, dcgm="DCGM_FI_PROF_NVLINK_TX_BYTES",
       field="nvlink_tx_bytes_per_second", figure="nvlink_tx"),
    _m("gpu_nvlink_rx_bytes_per_second", "gauge", "bytes/s", "io",
       "GPM NVLINK_TOTAL_RX, else NVML field 139 (KiB, per link) deltas summed",
       "NVLink data received, summed over links.",
       otel="gpu.nvlink.throughput", otel_attributes=_RX, dcgm="DCGM_FI_PROF_NVLINK_RX_BYTES",
       field="nvlink_rx_bytes_per_second", figure="nvlink_rx"),
    _m("gpu_nvlink_link_max_bytes_per_second", "gauge", "bytes/s", "io",
       "active links (nvmlDeviceGetNvLinkState) x NVML field 90 (MBps per link)",
       "Per-direction maximum of the GPU's active NVLink links together; absent where NVML cannot "
       "say (no NVLink, speed unsupported).",
       otel="gpu.nvlink.link.max", field="nvlink_link_max_bytes_per_second", figure="nvlink_max",
       link=("NVLink", "NVL"), cadence="rare"),
    _m("gpu_nvlink_tx_bandwidth_util_ratio", "gauge", "ratio", "io",
       "gpu_nvlink_tx_bytes_per_second / gpu_nvlink_link_max_bytes_per_second",
       "NVLink send rate over the active links' maximum.",
       otel="gpu.nvlink.utilization", otel_attributes=_TX, figure="nvlink_tx_ratio",
       ratio_of=("gpu_nvlink_tx_bytes_per_second", "gpu_nvlink_link_max_bytes_per_second")),
    _m("gpu_nvlink_rx_bandwidth_util_ratio", "gauge", "ratio", "io",
       "gpu_nvlink_rx_bytes_per_second / gpu_nvlink_link_max_bytes_per_second",
       "NVLink receive rate over the active links' maximum.",
       otel="gpu.nvlink.utilization", otel_attributes=_RX, figure="nvlink_rx_ratio",
       ratio_of=("gpu_nvlink_rx_bytes_per_second", "gpu_nvlink_link_max_bytes_per_second")),
    _m("gpu_pcie_tx_current_link_util_ratio", "gauge", "ratio", "io",
       "gpu_pcie_tx_bytes_per_second / gpu_pcie_link_current_bytes_per_second",
       "Device-to-host rate over the link as trained now: near 1 on a saturated link that trained below "
       "its maximum, where the maximum-link ratio reads low.",
       otel="gpu.pcie.current_link.utilization", otel_attributes=_TX, figure="pcie_tx_now_ratio",
       ratio_of=("gpu_pcie_tx_bytes_per_second", "gpu_pcie_link_current_bytes_per_second")),
    _m("gpu_pcie_rx_current_link_util_ratio", "gauge", "ratio", "io",
       "gpu_pcie_rx_bytes_per_second / gpu_pcie_link_current_bytes_per_second",
       "Host-to-device rate over the link as trained now.",
       otel="gpu.pcie.current_link.utilization", otel_attributes=_RX, figure="pcie_rx_now_ratio",
       ratio_of=("gpu_pcie_rx_bytes_per_second", "gpu_pcie_link_current_bytes_per_second")),
    _m("gpu_c2c_tx_bytes_per_second", "gauge", "bytes/s", "io", "GPM C2C_TOTAL_TX_PER_SEC",
       "NVLink-C2C traffic from the GPU to the Grace CPU (Grace Hopper, Grace Blackwell).",
       otel="gpu.c2c.throughput", otel_attributes=_TX, dcgm="DCGM_FI_PROF_C2C_TX_ALL_BYTES",
       field="c2c_tx_bytes_per_second", figure="c2c_tx"),
    _m("gpu_c2c_rx_bytes_per_second", "gauge", "bytes/s", "io", "GPM C2C_TOTAL_RX_PER_SEC",
       "NVLink-C2C traffic from the Grace CPU to the GPU.",
       otel="gpu.c2c.throughput", otel_attributes=_RX, dcgm="DCGM_FI_PROF_C2C_RX_ALL_BYTES",
       field="c2c_rx_bytes_per_second", figure="c2c_rx"),
    _m("gpu_c2c_link_max_bytes_per_second", "gauge", "bytes/s", "io",
       "NVML fields 170 (links) x 172 (per-link maximum)",
       "Per-direction maximum of the GPU's C2C links together.",
       otel="gpu.c2c.link.max", dcgm="DCGM_FI_DEV_C2C_LINK_COUNT x DCGM_FI_DEV_C2C_MAX_BANDWIDTH (MB/s)",
       field="c2c_link_max_bytes_per_second", figure="c2c_max", link=("C2C", "C2C"),
       cadence="rare"),
    _m("gpu_c2c_tx_bandwidth_util_ratio", "gauge", "ratio", "io",
       "gpu_c2c_tx_bytes_per_second / gpu_c2c_link_max_bytes_per_second",
       "GPU-to-CPU C2C rate over the links' maximum.",
       otel="gpu.c2c.utilization", otel_attributes=_TX, figure="c2c_tx_ratio",
       ratio_of=("gpu_c2c_tx_bytes_per_second", "gpu_c2c_link_max_bytes_per_second")),
    _m("gpu_c2c_rx_bandwidth_util_ratio", "gauge", "ratio", "io",
       "gpu_c2c_rx_bytes_per_second / gpu_c2c_link_max_bytes_per_second",
       "CPU-to-GPU C2C rate over the links' maximum.",
       otel="gpu.c2c.utilization", otel_attributes=_RX, figure="c2c_rx_ratio",
       ratio_of=("gpu_c2c_rx_bytes_per_second", "gpu_c2c_link_max_bytes_per_second")),
    # health
    _m("gpu_sm_clock_hertz", "gauge", "hertz", "health", "nvmlDeviceGetClockInfo(SM) x 1e6",
       "SM clock now.",
       otel="gpu.clock.frequency", otel_attributes=(("gpu.clock", "sm"),), dcgm="DCGM_FI_DEV_SM_CLOCK* (MHz)",
       field="sm_clock_hertz", figure="sm_clock"),
    _m("gpu_sm_clock_max_hertz", "gauge", "hertz", "health", "nvmlDeviceGetMaxClockInfo(SM) x 1e6",
       "Highest SM clock the GPU runs at.",
       otel="gpu.clock.frequency.max", otel_attributes=(("gpu.clock", "sm"),),
       dcgm="DCGM_FI_DEV_MAX_SM_CLOCK (MHz)", field="sm_clock_max_hertz", figure="sm_clock_max",
       cadence="rare"),
    _m("gpu_memory_clock_hertz", "gauge", "hertz", "health", "nvmlDeviceGetClockInfo(MEM) x 1e6",
       "Memory clock now.",
       otel="gpu.clock.frequency", otel_attributes=(("gpu.clock", "memory"),),
       dcgm="DCGM_FI_DEV_MEM_CLOCK* (MHz)", field="memory_clock_hertz", figure="mem_clock"),
    _m("gpu_memory_clock_max_hertz", "gauge", "hertz", "health", "nvmlDeviceGetMaxClockInfo(MEM) x 1e6",
       "Highest memory clock.",
       otel="gpu.clock.frequency.max", otel_attributes=(("gpu.clock", "memory"),),
       dcgm="DCGM_FI_DEV_MAX_MEM_CLOCK (MHz)", field="memory_clock_max_hertz", figure="mem_clock_max",
       cadence="rare"),
    _m("gpu_clocks_event_power_cap_ratio", "gauge", "ratio", "health",
       "NVML field 74 (ns) deltas / interval, else bit SwPowerCap of nvmlDeviceGetCurrentClocksEventReasons",
       "Share of the interval the clocks were held down to stay within the power limit.",
       **_limited("power_cap"), dcgm="DCGM_FI_DEV_POWER_VIOLATION (ns, cumulative)", field="power_cap_ratio",
       figure="power_cap"),
    _m("gpu_clocks_event_hw_slowdown_ratio", "gauge", "ratio", "health",
       "bit HwSlowdown of nvmlDeviceGetCurrentClocksEventReasons (no counter exists)",
       "1 when the hardware slowed the clocks at the reading (heat, a power-supply signal, a power "
       "brake), else 0.",
       **_limited("hw_slowdown"), dcgm="DCGM_FI_DEV_CLOCKS_EVENT_REASONS (bitmask)",
       field="hw_slowdown_ratio", figure="hw_slowdown"),
    _m("gpu_clocks_event_hw_thermal_ratio", "gauge", "ratio", "health",
       "NVML field 270 (ns) deltas / interval, else bit HwThermalSlowdown",
       "Share of the interval the hardware held the clocks down for heat.",
       **_limited("hw_thermal"), field="hw_thermal_ratio", figure="hw_thermal"),
    _m("gpu_clocks_event_hw_power_brake_ratio", "gauge", "ratio", "health",
       "NVML field 271 (ns) deltas / interval, else bit HwPowerBrakeSlowdown",
       "Share of the interval an external power brake (the board, the PSU) held the clocks down.",
       **_limited("hw_power_brake"), field="hw_power_brake_ratio", figure="hw_power_brake"),
    _m("gpu_clocks_event_sw_thermal_ratio", "gauge", "ratio", "health",
       "NVML field 269 (ns) deltas / interval, else bit SwThermalSlowdown",
       "Share of the interval the driver held the clocks down for heat.",
       **_limited("sw_thermal"), field="sw_thermal_ratio", figure="sw_thermal"),
    _m("gpu_clocks_event_sync_boost_ratio", "gauge", "ratio", "health",
       "NVML field 76 (ns) deltas / interval, else bit SyncBoost",
       "Share of the interval the clocks were held to those of the GPUs in its sync-boost group.",
       **_limited("sync_boost"), dcgm="DCGM_FI_DEV_SYNC_BOOST_VIOLATION (ns, cumulative)",
       field="sync_boost_ratio", figure="sync_boost"),
    _m("gpu_power_usage_watts", "gauge", "watts", "health",
       "NVML field 186 (mW), else nvmlDeviceGetPowerUsage (mW) / 1000",
       "Power drawn by the board now.",
       otel="hw.power", dcgm="DCGM_FI_DEV_POWER_USAGE*", field="power_watts", figure="power"),
    _m("gpu_energy_joules_total", "counter", "joules", "health", "NVML field 83 (mJ) / 1000",
       "Energy the board used since the driver loaded (Volta and newer). Its rate() is the mean power "
       "over the window, every moment counted, where gpu_power_usage_watts is one reading a cycle.",
       otel="hw.energy", dcgm="DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION* (mJ)", field="energy_joules"),
    _m("gpu_power_limit_watts", "gauge", "watts", "health", "nvmlDeviceGetEnforcedPowerLimit (mW) / 1000",
       "Power limit the GPU is held to.",
       otel="gpu.power.limit", dcgm="DCGM_FI_DEV_ENFORCED_POWER_LIMIT", field="power_limit_watts",
       figure="power_limit", cadence="rare"),
    _m("gpu_temperature_celsius", "gauge", "celsius", "health", "nvmlDeviceGetTemperature(GPU)",
       "GPU die temperature.",
       otel="hw.temperature", otel_attributes=(("hw.sensor_location", "gpu"),), dcgm="DCGM_FI_DEV_GPU_TEMP*",
       field="temperature_celsius", figure="temperature"),
    _m("gpu_memory_temperature_celsius", "gauge", "celsius", "health", "NVML field 82",
       "HBM temperature.",
       otel="hw.temperature", otel_attributes=(("hw.sensor_location", "memory"),),
       dcgm="DCGM_FI_DEV_MEMORY_TEMP*", field="memory_temperature_celsius", figure="mem_temperature"),
    _m("gpu_pcie_l0_to_recovery_total", "counter", "errors", "health", "NVML field 169",
       "Times the PCIe link left L0 for recovery: a link that keeps retraining.",
       **_errors("pcie_l0_to_recovery"), field="pcie_l0_to_recovery", figure="l0_recovery", cadence="rare"),
    _m("gpu_pcie_correctable_errors_total", "counter", "errors", "health", "NVML field 173",
       "PCIe correctable errors.",
       **_errors("pcie_correctable"), dcgm="DCGM_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS",
       field="pcie_correctable_errors", figure="pcie_correctable", cadence="rare"),
    _m("gpu_pcie_nonfatal_errors_total", "counter", "errors", "health", "NVML field 179",
       "PCIe non-fatal errors.",
       **_errors("pcie_nonfatal"), field="pcie_nonfatal_errors", cadence="rare"),
    _m("gpu_pcie_fatal_errors_total", "counter", "errors", "health", "NVML field 180",
       "PCIe fatal errors.",
       **_errors("pcie_fatal"), field="pcie_fatal_errors", cadence="rare"),
    _m("gpu_pcie_naks_received_total", "counter", "errors", "health", "NVML field 174",
       "PCIe NAKs received.",
       **_errors("pcie_nak_received"), field="pcie_naks_received", cadence="rare"),
    _m("gpu_pcie_naks_sent_total", "counter", "errors", "health", "NVML field 177",
       "PCIe NAKs sent.",
       **_errors("pcie_nak_sent"), field="pcie_naks_sent", cadence="rare"),
    _m("gpu_pcie_receiver_errors_total", "counter", "errors", "health", "NVML field 175",
       "PCIe receiver errors.",
       **_errors("pcie_receiver"), field="pcie_receiver_errors", cadence="rare"),
    _m("gpu_pcie_bad_tlp_total", "counter", "errors", "health", "NVML field 176",
       "PCIe transaction-layer packets received bad.",
       **_errors("pcie_bad_tlp"), field="pcie_bad_tlp", cadence="rare"),
    _m("gpu_pcie_bad_dllp_total", "counter", "errors", "health", "NVML field 178",
       "PCIe data-link-layer packets received bad.",
       **_errors("pcie_bad_dllp"), field="pcie_bad_dllp", cadence="rare"),
    _m("gpu_pcie_lcrc_errors_total", "counter", "errors", "health", "NVML field 182",
       "PCIe link CRC errors.",
       **_errors("pcie_lcrc"), field="pcie_lcrc_errors", cadence="rare"),
    _m("gpu_pcie_unsupported_requests_total", "counter", "errors", "health", "NVML field 181",
       "PCIe unsupported requests.",
       **_errors("pcie_unsupported_request"), field="pcie_unsupported_requests", cadence="rare"),
    _m("gpu_pcie_lane_errors_total", "counter", "errors", "health", "NVML field 183",
       "PCIe lane errors.",
       **_errors("pcie_lane"), field="pcie_lane_errors", cadence="rare"),
    _m("gpu_ecc_corrected_volatile_total", "counter", "errors", "health", "NVML field 3",
       "Corrected (single-bit) ECC errors since the driver loaded.",
       **_errors("ecc_corrected_volatile"), dcgm="DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
       field="ecc_corrected_volatile", figure="ecc_corrected", cadence="rare"),
    _m("gpu_ecc_uncorrected_volatile_total", "counter", "errors", "health", "NVML field 4",
       "Uncorrected (double-bit) ECC errors since the driver loaded: the app's data may be wrong; drain "
       "the node.",
       **_errors("ecc_uncorrected_volatile"), dcgm="DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
       field="ecc_uncorrected_volatile", figure="ecc_uncorrected", cadence="rare"),
    _m("gpu_ecc_corrected_aggregate_total", "counter", "errors", "health", "NVML field 5",
       "Corrected ECC errors over the GPU's life.",
       **_errors("ecc_corrected_aggregate"), dcgm="DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
       field="ecc_corrected_aggregate", cadence="rare"),
    _m("gpu_ecc_uncorrected_aggregate_total", "counter", "errors", "health", "NVML field 6",
       "Uncorrected ECC errors over the GPU's life.",
       **_errors("ecc_uncorrected_aggregate"), dcgm="DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
       field="ecc_uncorrected_aggregate", cadence="rare"),
    _m("gpu_remapped_rows_correctable", "gauge", "rows", "health", "NVML field 142",
       "Memory rows remapped for correctable errors.",
       otel="gpu.memory.remapped_rows", otel_attributes=(("gpu.remap.cause", "correctable"),),
       dcgm="DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS*", field="remapped_rows_correctable",
       figure="remapped_correctable", cadence="rare"),
    _m("gpu_remapped_rows_uncorrectable", "gauge", "rows", "health", "NVML field 143",
       "Memory rows remapped for uncorrectable errors.",
       otel="gpu.memory.remapped_rows", otel_attributes=(("gpu.remap.cause", "uncorrectable"),),
       dcgm="DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS*", field="remapped_rows_uncorrectable",
       figure="remapped_uncorrectable", cadence="rare"),
    _m("gpu_row_remap_pending", "gauge", "boolean", "health", "NVML field 144",
       "1 when a row remap waits for the GPU's next reset.",
       otel="gpu.memory.remap.pending", dcgm="DCGM_FI_DEV_ROW_REMAP_PENDING", field="row_remap_pending",
       figure="remap_pending", cadence="rare"),
    _m("gpu_row_remap_failed", "gauge", "boolean", "health", "NVML field 145",
       "1 when a row remap failed: the GPU should be replaced.",
       otel="gpu.memory.remap.failed", dcgm="DCGM_FI_DEV_ROW_REMAP_FAILURE*", field="row_remap_failed",
       figure="remap_failed", cadence="rare"),
    _m("gpu_xid_errors_total", "counter", "errors", "health",
       "Xid events (nvmlEventSetWait, a thread of its own), by label xid",
       "Xid errors the driver reported since the agent started, one series per code (label xid): 79 "
       "fallen off the bus, 48/63/64/94/95 ECC and row remapping, 13/31/43 the app's faults.",
       **_errors("xid"), cadence="rare"),
    _m("gpu_last_xid", "gauge", "code", "health", "Xid events",
       "Code of the last Xid the agent saw on the GPU (absent until one).",
       otel="gpu.xid.last", dcgm="DCGM_FI_DEV_XID_ERRORS* (last code)", field="last_xid", figure="last_xid",
       cadence="rare"),
    # app
    _m("inference_request_duration_seconds", "histogram", "seconds", "app", "app: sidecar.client observe()",
       "Request latency histogram, merged over the processes using the GPU; a process that uses "
       "several GPUs (tensor parallelism) counts each request on each of them, so a sum over a "
       "process's GPUs counts its requests once per GPU.",
       otel="gpu.app.request.duration"),
    # verdict
    _m("gpu_verdict", "gauge", "boolean", "verdict", "agent: the recent window",
       "Per GPU, label `verdict`: the kind that explains latency over the agent's last 30 s (one of "
       "the kinds of docs/diagnose.md's precedence, or `none`), value 1; a kind that was the verdict "
       "in the last 5 minutes and is no longer is sent at 0, so `gpu_verdict == 1` ends when the "
       "cause does. What `gpu-sidecar status`, the live table and `diagnose` beside the agent say.",
       otel="gpu.verdict"),
    # self
    _m("gpu_sidecar_up", "gauge", "boolean", "self", "agent",
       "1 while the agent runs, 0 in the last cycle of a run stopped by a signal (the pod ended): a "
       "receiver tells a clean stop from a killed agent; pushed with every batch.",
       otel="gpu.sidecar.up"),
    _m("gpu_sidecar_info", "gauge", "info", "self", "agent",
       "Version and mode of the agent in labels (version, mode); value 1.",
       otel="gpu.sidecar.info", cadence="rare"),
    _m("gpu_sidecar_nvml_available", "gauge", "boolean", "self", "agent",
       "1 when NVML initialised, 0 when the agent runs on app figures only.",
       otel="gpu.sidecar.nvml.available"),
    _m("gpu_sidecar_gpu_available", "gauge", "boolean", "self", "agent",
       "Per selected GPU: 1 when the last cycle read it, 0 while it is lost or failing.",
       otel="gpu.sidecar.gpu.available"),
    _m("gpu_sidecar_samples_collected_total", "counter", "samples", "self", "agent",
       "GPU samples taken (one per GPU per cycle).",
       otel="gpu.sidecar.samples.collected"),
    _m("gpu_sidecar_samples_dropped_total", "counter", "samples", "self", "agent",
       "Samples lost, by reason (gpu_unavailable; sink_error, a cycle a sink failed to take, which the "
       "log sink_emit_failed explains; per sink: spool_full, spool_write_failed (the spool volume "
       "refused the batch and it overflowed --spool-memory-max-bytes or was still in memory at exit), "
       "rejected, corrupt, unreadable; per OTLP sink also partial_success, the data points the receiver "
       "said it rejected, and unencodable, series OTLP cannot carry, such as a histogram whose count is "
       "NaN, infinite, negative or above 64 bits). Every sink reason exists at 0 from the first push.",
       otel="gpu.sidecar.samples.dropped"),
    _m("gpu_sidecar_collection_errors_total", "counter", "errors", "self", "agent",
       "NVML reads that failed, by reason (gpu_lost, nvml_error).",
       otel="gpu.sidecar.collection.errors"),
    _m("gpu_sidecar_cycle_overruns_total", "counter", "cycles", "self", "agent",
       "Cycles that started late because the previous one ran past its slot.",
       otel="gpu.sidecar.cycle.overruns"),
    _m("gpu_sidecar_engine_up", "gauge", "boolean", "self", "agent",
       "Per --engine-metrics-url (label endpoint; engine once recognised): 1 while its last read is "
       "current, 0 while it fails or its figures are older than two intervals and a timeout.",
       otel="gpu.sidecar.engine.up"),
    _m("gpu_sidecar_engine_read_failures_total", "counter", "errors", "self", "agent",
       "Reads of an engine endpoint that gave no figures, by reason (unreachable, timeout, too_large, "
       "malformed, not_an_engine, redirect, credentials, http_status); every reason exists at 0 from the"
       " start.",
       otel="gpu.sidecar.engine.read.failures"),
    _m("gpu_sidecar_engine_read_duration_seconds", "gauge", "seconds", "self", "agent",
       "How long the last read of an engine endpoint took, fetch and parse (its reader thread's time, "
       "never the cycle's).",
       otel="gpu.sidecar.engine.read.duration"),
    _m("gpu_sidecar_paused_seconds_total", "counter", "seconds", "self", "agent",
       "Time the agent's schedule missed although its cycles were short: the process was stopped "
       "(SIGSTOP) or not scheduled (a frozen cgroup, a suspended VM, CPU throttling); each pause is "
       "logged as process_paused, never as cycle_overrun.",
       otel="gpu.sidecar.paused.time"),
    _m("gpu_sidecar_cycle_duration_seconds", "gauge", "seconds", "self", "agent",
       "Wall time of the last sampling cycle.",
       otel="gpu.sidecar.cycle.duration"),
    _m("gpu_sidecar_nvml_call_seconds_total", "counter", "seconds", "self", "agent: pynvml calls",
       "Wall time the agent spent inside NVML since it started, per pynvml function (label `call`, "
       "e.g. nvmlDeviceGetFieldValues): NVML calls serialise in the driver, so this is the time the "
       "agent held it. The Xid watcher's nvmlEventSetWait_v2, a wait for an event, is not counted. "
       "A call made only at open (identity, capabilities) is sent when it changes and every minute.",
       otel="gpu.sidecar.nvml.call.duration", cadence="rare"),
    _m("gpu_sidecar_nvml_calls_total", "counter", "calls", "self", "agent: pynvml calls",
       "NVML calls the agent made since it started, per pynvml function (label `call`), failed "
       "ones included; sent like the seconds.",
       otel="gpu.sidecar.nvml.calls", cadence="rare"),
    _m("gpu_sidecar_app_messages_accepted_total", "counter", "messages", "self", "agent",
       "App socket messages accepted.",
       otel="gpu.sidecar.app.messages.accepted"),
    _m("gpu_sidecar_app_messages_rejected_total", "counter", "messages", "self", "agent",
       "App socket messages rejected, by reason.",
       otel="gpu.sidecar.app.messages.rejected"),
    _m("gpu_sidecar_samples_pushed_total", "counter", "samples", "self", "agent",
       "Samples a receiver accepted, per sink.",
       otel="gpu.sidecar.samples.pushed"),
    _m("gpu_sidecar_push_failures_total", "counter", "requests", "self", "agent",
       "Failed push attempts, per sink and reason (network, tls, credentials, redirect, http_429, "
       "http_5xx, http_400, ..., internal). Known reasons exist at 0 from the start.",
       otel="gpu.sidecar.push.failures"),
    _m("gpu_sidecar_push_duration_seconds", "gauge", "seconds", "self", "agent",
       "Duration of the last push request, per sink.",
       otel="gpu.sidecar.push.duration"),
    _m("gpu_sidecar_last_push_success_timestamp_seconds", "gauge", "seconds", "self", "agent",
       "Unix time of the last accepted push, per sink.",
       otel="gpu.sidecar.push.last_success.time"),
    _m("gpu_sidecar_spool_bytes", "gauge", "bytes", "self", "agent",
       "Bytes of the spool, per remote-write or OTLP sink and state: pending (waiting on disk), memory "
       "(waiting in memory because the spool volume refused them, within --spool-memory-max-bytes), "
       "rejected and corrupt (kept on disk for inspection); all four count against --spool-max-bytes.",
       otel="gpu.sidecar.spool.usage"),
    _m("gpu_sidecar_spool_write_failing", "gauge", "boolean", "self", "agent",
       "Per remote-write or OTLP sink: 1 while the spool volume refuses writes (full, read-only), so "
       "batches wait in memory and a crash or a receiver outage now loses them; 0 once a write succeeds "
       "again.",
       otel="gpu.sidecar.spool.write_failing"),
    _m("gpu_sidecar_spool_batches", "gauge", "batches", "self", "agent",
       "Batches waiting to be sent (on disk or in memory), per remote-write or OTLP sink.",
       otel="gpu.sidecar.spool.batches"),
    _m("gpu_sidecar_journal_records_damaged_total", "counter", "records", "self", "agent",
       "Crash-journal records that failed their check at start-up and were skipped, per remote-write or "
       "OTLP sink: each is one cycle lost (the intact records after it are replayed; a record cut short "
       "at the end by the crash is not counted). Logged as journal_record_damaged.",
       otel="gpu.sidecar.journal.records_damaged"),
    # run
    _m("gpu_run_start_timestamp_seconds", "gauge", "seconds", "run", "agent: first cycle",
       "Unix time of the run's first sample (no GPU labels).",
       otel="gpu.run.start"),
    _m("gpu_run_end_timestamp_seconds", "gauge", "seconds", "run", "agent: last cycle",
       "Unix time of the run's last sample, taken at shutdown (no GPU labels).",
       otel="gpu.run.end"),
    _m("gpu_run_duration_seconds", "gauge", "seconds", "run", "agent",
       "End minus start of the sampled run (no GPU labels).",
       otel="gpu.run.duration"),
    _m("gpu_run_samples", "gauge", "samples", "run", "agent",
       "Cycles in which the GPU was sampled: the denominator of the means and shares.",
       otel="gpu.run.samples"),
    _m("gpu_run_unreadable_samples", "gauge", "samples", "run", "agent",
       "Cycles in which the GPU was selected but could not be read (lost, or NVML failing): not part of "
       "the means and shares, so a GPU lost mid-run shows here, not as a healthy mean.",
       otel="gpu.run.unreadable_samples"),
    _m("gpu_run_max_ratio", "gauge", "ratio", "run", "agent: the cycles' series",
       "Peak over the run of the ratio named by label figure (gpu_sm_occupancy_ratio, "
       "gpu_tensor_core_util_ratio, gpu_mem_bandwidth_util_ratio, gpu_pcie_{tx,rx}_bandwidth_util_ratio,"
       " gpu_memory_fragmentation_ratio).",
       otel="gpu.run.max"),
    _m("gpu_run_mean_ratio", "gauge", "ratio", "run", "agent: the cycles' series",
       "Mean over the run's samples of the ratio named by label figure.",
       otel="gpu.run.mean"),
    _m("gpu_run_above_threshold_ratio", "gauge", "ratio", "run", "agent: its gpu_verdict",
       "Share of the run's samples in which each verdict kind (label condition: every kind of "
       "the verdict's precedence, and none) was the agent's verdict on the GPU, as its "
       "gpu_verdict series said it; 0 for a kind judged and never found.",
       otel="gpu.run.above_threshold"),
    _m("gpu_run_alloc_retries", "gauge", "retries", "run", "app",
       "Allocator retries the app's counters show at the end of the run, a restart of the counter "
       "counted as a new start: from the app's start, which in a Job (the agent a native sidecar, "
       "started first) is the run's; an agent started after the app counts the app's earlier retries "
       "too.",
       otel="gpu.run.allocator.alloc_retries"),
    _m("gpu_run_ooms", "gauge", "errors", "run", "app",
       "CUDA out-of-memory errors, counted as gpu_run_alloc_retries.",
       otel="gpu.run.allocator.ooms"),
    _m("gpu_run_request_duration_p99_seconds", "gauge", "seconds", "run", "app",
       "p99 request latency from the app's latency histogram, counted as gpu_run_alloc_retries (from the"
       " app's start, or from the last change of its buckets), interpolated as histogram_quantile does.",
       otel="gpu.run.request.duration.p99"),

)



def _declared_once(table: tuple[MetricSpec, ...]) -> None:
    """No two entries name the same series, sample field or verdict figure, and a share divides
    series of the table: checked at import, so a slip fails at once rather than overwriting a
    figure."""
    for what in ("name", "field", "figure"):
        seen = [getattr(m, what) for m in table if getattr(m, what)]
        if twice := sorted({x for x in seen if seen.count(x) > 1}):
            raise TypeError(f"metrics.TABLE names {what} {twice} twice: one entry each")
    names = {m.name for m in table}
    for m in table:
        if m.ratio_of and not set(m.ratio_of) <= names:
            raise TypeError(f"{m.name} divides {m.ratio_of}, not both in metrics.TABLE")


_declared_once(TABLE)
LAYERS = ("compute", "memory", "io", "health")  # the sample's layers NVML fills, in their order
# the shares the sample model computes from two series of the table (``ratio_of``)
RATIOS: tuple[MetricSpec, ...] = tuple(m for m in TABLE if m.ratio_of)
DCGM_FIELDS: dict[str, str] = {m.name: m.dcgm for m in TABLE if m.dcgm}
# the dcgm-exporter release whose default-counters.csv the * marks were checked against
# (tests/realworld/dcgm_exporter_default_counters_4.5.3-4.8.2.csv)
DCGM_EXPORTER_CHECKED = "4.5.3-4.8.2"
# the figures a pushing sink sends when they change and every minute (sidecar/sinks/cadence.py)
RARE: frozenset[str] = frozenset(m.name for m in TABLE if m.cadence == "rare")
# the rare figures that NVML gives as field values (error, ECC and remapping counters), and the
# power limit, are asked for this often by the running agent (sidecar/sources/nvml/reading.py),
# their last answer carried between; diagnose's own sampling asks every cycle
RARE_READ_S = 10.0


def layer_specs(layer: str) -> tuple[MetricSpec, ...]:
    """The figures NVML's reading fills in one layer of a sample (``field``), in table order."""
    return tuple(m for m in TABLE if m.layer == layer and m.field)


# the OpenTelemetry names of the engine's series (declared in sources/engine/families.py)
_ENGINE_OTEL: dict[str, dict[str, Any]] = {
    "engine_request_duration_seconds": {"otel": "gen_ai.server.request.duration"},
    "engine_time_to_first_token_seconds": {"otel": "gen_ai.server.time_to_first_token"},
    "engine_inter_token_latency_seconds": {"otel": "gen_ai.server.time_per_output_token"},
    "engine_request_queue_duration_seconds": {"otel": "gpu.engine.request.queue.duration"},
    "engine_kv_cache_usage_ratio": {"otel": "gpu.engine.kv_cache.usage"},
    "engine_requests_running": {"otel": "gpu.engine.requests", "instrument": "updowncounter",
                                "otel_attributes": (("gpu.engine.request.state", "running"),)},
    "engine_requests_waiting": {"otel": "gpu.engine.requests", "instrument": "updowncounter",
                                "otel_attributes": (("gpu.engine.request.state", "waiting"),)},
    "engine_preemptions_total": {"otel": "gpu.engine.preemptions"},
    "engine_request_prefill_seconds_total": {"otel": "gpu.engine.request.prefill.time"},
    "engine_request_decode_seconds_total": {"otel": "gpu.engine.request.decode.time"},
}


# the serving engine's series (--engine-metrics-url): name -> (type, unit, meaning); which of each
# engine's own families become them is sources/engine/families.py's
ENGINE_SERIES: dict[str, tuple[str, str, str]] = {
    "engine_request_duration_seconds": (
        "histogram", "seconds", "End-to-end request latency, arrival to last token, as the engine "
        "measured it: the latency the verdict joins when the app publishes none."),
    "engine_time_to_first_token_seconds": (
        "histogram", "seconds", "Time to the first output token (queue and prefill)."),
    "engine_inter_token_latency_seconds": (
        "histogram", "seconds", "Time between two output tokens of a request (decode)."),
    "engine_request_queue_duration_seconds": (
        "histogram", "seconds", "Time a request waited in the engine's queue before it was "
        "scheduled."),
    "engine_kv_cache_usage_ratio": (
        "gauge", "ratio", "Share of the KV cache's blocks in use (1 is full); the fullest engine "
        "core's where the engine runs several."),
    "engine_requests_running": ("gauge", "requests", "Requests being executed now."),
    "engine_requests_waiting": ("gauge", "requests", "Requests waiting to be scheduled."),
    "engine_preemptions_total": (
        "counter", "requests", "Requests preempted (their KV cache freed, recomputed or swapped "
        "later) because the KV cache ran out; SGLang's retracted requests."),
    "engine_request_prefill_seconds_total": (
        "counter", "seconds", "Seconds the engine's requests spent in prefill (scheduled to first "
        "token), all requests together: with the queue's and decode's, the engine's own split of "
        "its time per request, which the queueing verdict takes where the queue's buckets cannot "
        "resolve its p99."),
    "engine_request_decode_seconds_total": (
        "counter", "seconds", "Seconds the engine's requests spent in decode (first token to "
        "last), all requests together."),
}


def _joined() -> tuple[MetricSpec, ...]:
    """The table with the engine's series after the app's (see the module's docstring)."""
    engine = tuple(
        _m(name, kind, unit, "engine", "engine endpoint: see *Engine families* below",  # type: ignore[arg-type]
           f"{help} Labels engine, endpoint and, where the engine names it, model.",
           **_ENGINE_OTEL.get(name, {"otel": name.removesuffix("_total").replace("_", ".")}))
        for name, (kind, unit, help) in ENGINE_SERIES.items())
    at = max(i for i, m in enumerate(TABLE) if m.layer == "app") + 1
    return (*TABLE[:at], *engine, *TABLE[at:])


METRICS: tuple[MetricSpec, ...] = _joined()  # every series: the table and the engine's
BY_NAME: dict[str, MetricSpec] = {m.name: m for m in METRICS}


def histogram_of(name: str) -> tuple[str, str] | None:
    """(histogram, part) when ``name`` is the ``_bucket``, ``_sum`` or ``_count`` series of a
    histogram of the table: each exposition format regroups the three under their histogram."""
    for part in ("_bucket", "_sum", "_count"):
        stem = name.removesuffix(part)
        spec = BY_NAME.get(stem)
        if stem != name and spec is not None and spec.kind == "histogram":
            return stem, part
    return None

# -- OpenTelemetry (the OTLP sink) ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OtelSpec:
    """How one Prometheus series becomes an OTLP metric. Names and units are the semantic
    conventions' where they define the figure (``hw.gpu.*``, ``hw.errors``), ours under ``gpu.``
    otherwise; units are UCUM. Two Prometheus names may become one OTel metric told apart by a
    fixed attribute (PCIe transmit and receive: ``network.io.direction``)."""

    name: str
    unit: str
    instrument: Instrument
    attributes: tuple[tuple[str, str], ...] = ()


_UCUM = {"ratio": "1", "bytes": "By", "bytes/s": "By/s", "seconds": "s", "boolean": "1",
         "info": "1", "retries": "{retry}", "errors": "{error}", "processes": "{process}",
         "generation": "{generation}", "lanes": "{lane}", "samples": "{sample}",
         "cycles": "{cycle}", "messages": "{message}", "requests": "{request}",
         "batches": "{batch}", "records": "{record}", "hertz": "Hz", "watts": "W",
         "celsius": "Cel", "events": "{event}", "rows": "{row}", "code": "1", "joules": "J"}



OTEL: dict[str, OtelSpec] = {  # name -> how it is sent over OTLP
    m.name: OtelSpec(m.otel, _UCUM.get(m.unit, f"{{{m.unit}}}"), m.instrument or m.kind,
                     m.otel_attributes) for m in METRICS}

# hw.gpu.io has no Prometheus series of its own: the OTLP encoder integrates the PCIe rates
# (each direction's attribute is its source's, above) into a byte total per GPU and direction
GPU_IO = OtelSpec("hw.gpu.io", "By", "counter")
GPU_IO_SOURCES = ("gpu_pcie_tx_bytes_per_second", "gpu_pcie_rx_bytes_per_second")
GPU_IO_HELP = ("Bytes moved over PCIe, per direction: the integral of the measured PCIe rate "
               "since the start time.")

# Prometheus label -> OTel attribute; the pod's identity goes on the resource, the rest on points
RESOURCE_LABELS: dict[str, str] = {"namespace": "k8s.namespace.name", "pod": "k8s.pod.name",
                                   "node": "k8s.node.name", "container": "k8s.container.name"}
POINT_LABELS: dict[str, str] = {"gpu_uuid": "hw.id", "gpu_name": "hw.model", "gpu_index": "gpu.index",
                                "pid": "process.pid", "sink": "gpu.sidecar.sink",
                                "reason": "gpu.sidecar.reason", "state": "gpu.sidecar.state",
                                "version": "gpu.sidecar.version", "mode": "gpu.sidecar.mode",
                                "job_name": "k8s.job.name", "job_index": "gpu.job.index",
                                "figure": "gpu.run.figure", "xid": "gpu.xid.code",
                                "condition": "gpu.run.condition",
                                "model": "gen_ai.request.model", "engine": "gpu.engine.name",
                                "endpoint": "gpu.engine.endpoint"}
# added to every point of a GPU (one with a gpu_uuid label): the hardware conventions require
# hw.type, and every GPU the agent reads is NVIDIA's (NVML)
GPU_ATTRIBUTES: tuple[tuple[str, str], ...] = (("hw.type", "gpu"), ("hw.vendor", "NVIDIA"))
