"""Where a layer stops being healthy: one set of lines for the shipped alert rules, the
``diagnose`` command and a batch Job's run summary.

An alert that fires while ``diagnose`` says "nothing found" (or a Job summary that counts time
"above the threshold" by another threshold) would teach operators to trust neither, so the
numbers live here only: ``deploy/alerts`` and ``k8s/monitoring`` are generated from them by
``python -m sidecar.alert_rules`` and a test keeps the files current.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Thresholds:
    # the allocator's cache is mostly empty (reserved, no tensor in it)...
    fragmentation_ratio: float = 0.5
    # ...on a cache large enough to matter: a small model's half-empty 300 MiB is not a problem
    fragmentation_min_reserved_bytes: int = 1 << 30
    # either PCIe direction above this share of the link's real maximum
    pcie_util_ratio: float = 0.8
    # low SM occupancy is normal for small models; it is a finding only together with...
    occupancy_ratio: float = 0.3
    # ...a p99 request latency above this objective (seconds; set your own)
    p99_latency_s: float = 0.25
    # a batch Job whose run summary shows PCIe beyond its threshold for more than this share
    # of the run was IO-bound (the "batch" alert on gpu_run_above_threshold_ratio)
    job_saturated_share: float = 0.5

    def pcie_saturated(self, tx_ratio: float | None, rx_ratio: float | None) -> bool:
        return max(tx_ratio or 0.0, rx_ratio or 0.0) > self.pcie_util_ratio

    def fragmented(self, ratio: float | None, reserved_bytes: float | None) -> bool:
        return (ratio is not None and reserved_bytes is not None
                and ratio > self.fragmentation_ratio
                and reserved_bytes > self.fragmentation_min_reserved_bytes)

    def low_occupancy(self, occupancy: float | None) -> bool:
        return occupancy is not None and occupancy < self.occupancy_ratio

    def slow(self, p99_s: float | None) -> bool:
        return p99_s is not None and p99_s > self.p99_latency_s

    def allocator_retrying(self, retries: float | None, ooms: float | None) -> bool:
        """The shipped GPUAllocatorRetrying and GPUOutOfMemory alerts fire on any increase: each
        retry flushed the cache and synchronised the device, so there is no harmless count."""
        return (retries or 0) > 0 or (ooms or 0) > 0

    def occupancy_explains_latency(self, occupancy: float | None, p99_s: float | None) -> bool:
        """Low occupancy is a finding only with degraded latency (GPULowOccupancyAndSlowRequests):
        a small model leaves SMs empty and is still fast."""
        return self.low_occupancy(occupancy) and self.slow(p99_s)


THRESHOLDS = Thresholds()
