"""Where a layer stops being healthy: one set of lines for the shipped alert rules, the
``diagnose`` command and a batch Job's run summary.

An alert that fires while ``diagnose`` says "nothing found" (or a Job summary that counts time
"above the threshold" by another threshold) would teach operators to trust neither, so the
numbers live here only: ``deploy/alerts`` and ``k8s/monitoring`` are generated from them by
``python -m sidecar.alert_rules`` and a test keeps the files current.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    # a batch Job whose run summary shows one verdict kind for more than this share of the run
    # was bound by that layer (the "batch" alert, GPUJobRunBottleneck)
    job_saturated_share: float = 0.5
    # -- health and link (the ``hardware-fault``, ``throttled``, ``pcie-degraded`` and ``c2c``
    # verdicts and their alerts; see the methods below for why each line is where it is)
    # a GPU is busy above this utilization: below it, low clocks only mean there is little to do
    busy_utilization_ratio: float = 0.5
    # a limiting reason (power cap, HW slowdown, HW thermal, HW power brake, SW thermal) held the
    # clocks for more than this share of the window...
    throttle_ratio: float = 0.25
    # ...and the SM clock averaged below this share of its maximum
    throttle_clock_ratio: float = 0.85
    # a link trained below its maximum is degraded only while either direction carries more
    # than this share of the link as trained now
    pcie_degraded_traffic_ratio: float = 0.25
    # NVLink-C2C (Grace Hopper, Grace Blackwell) is saturated above ``pcie_util_ratio`` of its
    # maximum: the host link's line, whichever the link
    # -- NVLink between the GPUs (the ``nvlink`` verdict): either direction above this share of
    # the active links' maximum, while the GPU is busy or p99 is above its objective
    nvlink_util_ratio: float = 0.8
    # Xids that are the hardware's (or its firmware's) fault, each one a reason to drain the node
    # (NVIDIA's Xid catalogue): 48 double-bit ECC error, 64 row remap (or page retirement)
    # failure, 74 NVLink error, 79 fallen off the bus, 94 contained and 95 uncontained ECC
    # error, 119 GSP RPC timeout, 120 GSP error. Not here: 63 (a row remap recorded, which
    # gpu_row_remap_pending reports until the reset that activates it), 92 (a high rate of
    # corrected single-bit errors: a trend to watch, nothing failed), 13/31/43/45 (the app's
    # faults: an exception or illegal access in its kernels, its channel torn down)
    critical_xids: tuple[int, ...] = (48, 64, 74, 79, 94, 95, 119, 120)
    # -- the serving engine (``kv-cache`` and ``queueing``, from --engine-metrics-url)
    # the KV cache is full at this share of its blocks in use...
    kv_cache_full_ratio: float = 0.9
    # ...while requests are preempted or wait (on average at least this many waiting)
    kv_cache_waiting_requests: float = 1.0
    # the queue takes at least this share of the request latency's p99 (queueing)
    queue_share_ratio: float = 0.5

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

    def busy(self, utilization: float | None) -> bool:
        return utilization is not None and utilization > self.busy_utilization_ratio

    def throttled(self, reason_share: float | None, utilization: float | None,
                  clock_hz: float | None, clock_max_hz: float | None) -> bool:
        """Clocks held down while it matters (GPUClocksThrottled): a limiting reason for more than
        ``throttle_ratio`` of the window, on a busy GPU, with the SM clock below
        ``throttle_clock_ratio`` of its maximum.

        ``reason_share`` is the largest share among power cap, HW slowdown, HW thermal, HW power
        brake and SW thermal. Sync boost is left out: it holds this GPU to the clocks of the
        slowest GPU of its group, whose own reason is the finding there. An idle GPU drops its
        clocks (and may report a reason) because there is nothing to run: not throttled. Within
        15 % of the maximum is the boost range a power-limited GPU normally works in; below it
        every kernel takes at least 18 % longer than at the maximum clock."""
        return (reason_share is not None and reason_share > self.throttle_ratio
                and self.busy(utilization)
                and clock_hz is not None and bool(clock_max_hz)
                and clock_hz < self.throttle_clock_ratio * clock_max_hz)  # type: ignore[operator]

    def pcie_degraded(self, below_max: bool, tx_current_ratio: float | None,
                      rx_current_ratio: float | None) -> bool:
        """A link trained below its maximum generation or width while traffic flows
        (GPUPcieLinkDegraded): either direction above ``pcie_degraded_traffic_ratio`` of the link
        as trained now.

        An idle link trains down to save power (Gen1 at rest is normal), and the driver trains it
        back up within milliseconds of load; a quarter of the trained link, sustained, is far
        above an idle GPU's trickle (well under 1 %), so a link still below its maximum then did
        not come back up: a slot, a riser, a BIOS setting. Below that traffic a slower link costs
        nothing yet."""
        return below_max and max(tx_current_ratio or 0.0, rx_current_ratio or 0.0) \
            > self.pcie_degraded_traffic_ratio

    def c2c_saturated(self, tx_ratio: float | None, rx_ratio: float | None) -> bool:
        """NVLink-C2C, the host link of Grace Hopper and Grace Blackwell (GPUC2CSaturated), by the
        PCIe line: above it, host-device traffic waits for the link whichever the link is."""
        return max(tx_ratio or 0.0, rx_ratio or 0.0) > self.pcie_util_ratio

    def nvlink_saturated(self, tx_ratio: float | None, rx_ratio: float | None,
                         utilization: float | None, p99_s: float | None) -> bool:
        """NVLink between the GPUs is the limit (GPUNVLinkSaturated): either direction above
        ``nvlink_util_ratio`` of the active links' maximum while the GPU is busy or p99 is above
        the objective. A full link on an idle GPU with fast requests (a checkpoint copied
        between GPUs, a weight reshard) costs the requests nothing yet; with tensor
        parallelism every layer waits for its all-reduce, so a full link under load is the
        latency."""
        return (max(tx_ratio or 0.0, rx_ratio or 0.0) > self.nvlink_util_ratio
                and (self.busy(utilization) or self.slow(p99_s)))

    def critical_xid(self, code: int) -> bool:
        return code in self.critical_xids

    def hardware_fault(self, xids_in_window: Mapping[int, float],
                       ecc_uncorrected_increase: float | None,
                       remap_failed: float | None) -> bool:
        """The GPU itself failed (GPUHardwareFault): a critical Xid during the window, any increase
        of the uncorrected (volatile) ECC count, or a failed row remap. Each is a reason to drain
        the node: the GPU's results may be wrong, and it needs a reset or a replacement. A pending
        row remap is not: it waits for the next reset (GPURowRemapPending, a warning)."""
        return (any(n > 0 and self.critical_xid(c) for c, n in xids_in_window.items())
                or (ecc_uncorrected_increase or 0) > 0 or (remap_failed or 0) > 0)

    def kv_cache_full(self, usage: float | None, preemptions: float | None,
                      waiting: float | None) -> bool:
        """The engine's KV cache is the limit (GPUEngineKVCacheFull): nearly every block in use
        while requests are preempted (their cache freed, to be recomputed) or wait for room. A
        full cache alone is not: vLLM fills it by design when there is work."""
        return (usage is not None and usage >= self.kv_cache_full_ratio
                and ((preemptions or 0) > 0 or (waiting or 0) >= self.kv_cache_waiting_requests))

    def queueing(self, queue_share: float | None, p99_s: float | None) -> bool:
        """Requests are slow because they wait (GPUEngineQueueing): p99 above the objective and
        the engine's queue time at least ``queue_share_ratio`` of it. Judged only where no GPU
        layer explains the latency: then the GPU is not the limit, the engine's admission is."""
        return self.slow(p99_s) and queue_share is not None \
            and queue_share >= self.queue_share_ratio


THRESHOLDS = Thresholds()
