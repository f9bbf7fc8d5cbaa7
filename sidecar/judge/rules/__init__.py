"""The verdict model: what one cycle's series say per GPU (``Figures``), a window of cycles folded
into means and increases (``Window``), and the judgement of a window against
``sidecar.thresholds`` (``Verdict``, ``Finding``). Pure functions and frozen records, shared by
``diagnose`` and the live table, so that the two (and the shipped alert rules, which take the
same thresholds) never disagree about where a layer stops being healthy.

What a verdict needs and what it yields, in the order of precedence (``PRECEDENCE``: a GPU's
findings are listed, and the table shows the first, in this order):

- ``gpu-lost``: the GPU could not be read at the end of the window (a finding: exit 1);
- ``hardware-fault`` (health): a critical Xid during the window (``critical_xids``: 48, 64, 74,
  79, 94, 95, 119, 120), an increase of the uncorrected volatile ECC count, or a failed row
  remap. First after a lost GPU because nothing else is worth tuning on a GPU whose results may
  be wrong: drain the node. A pending row remap is a note (reset to activate it), not a finding;
- ``throttled`` (health): a limiting reason (power cap, HW slowdown, HW thermal, HW power brake,
  SW thermal; not sync boost, which follows another GPU) for more than ``throttle_ratio`` of the
  window, on a busy GPU (utilization above ``busy_utilization_ratio``) whose SM clock averaged
  below ``throttle_clock_ratio`` of its maximum. Before the IO and memory layers because slow
  clocks slow every kernel and copy engine, whatever else is found;
- ``pcie-degraded`` (IO): the PCIe link ran below its maximum generation or width in most of
  the window's samples while carrying more than ``pcie_degraded_traffic_ratio`` of the link as
  trained (its share of the trained link and of the maximum link both shown). An idle link
  trains down to save power: without traffic it is a note, never a finding. Before ``pcie``
  because the fix is the slot, not the copies (a link trained down cannot reach ``pcie`` on the
  maximum link anyway: it carries at most half of it);
- ``pcie`` (IO): either direction above ``pcie_util_ratio`` of the link, averaged over the window;
- ``c2c`` (IO): on Grace Hopper and Grace Blackwell, NVLink-C2C (the host link there) above
  ``pcie_util_ratio`` of its maximum in either direction;
- ``nvlink`` (IO): NVLink between the GPUs above ``nvlink_util_ratio`` of the active links'
  maximum in either direction while the GPU is busy (utilization above
  ``busy_utilization_ratio``) or p99 is above ``p99_latency_s``: with tensor parallelism every
  layer waits for its all-reduce. After the host links (a copy from the host feeds what the
  GPUs then exchange), before the engine's and the allocator's figures;
- ``kv-cache`` (engine): the serving engine's KV cache at ``kv_cache_full_ratio`` or more
  (the window's mean) while requests were preempted during the window or waited (on average at
  least ``kv_cache_waiting_requests``). After the GPU's own faults and links (a throttled GPU or
  a saturated link slows the engine too), before the allocator's figures: an engine that
  preempts recomputes work, whatever the allocator says;
- ``fragmentation`` (memory): ``fragmented()`` on the window's mean ratio and allocator cache;
- ``allocator-retries`` (memory): any allocator retry or OOM during the window;
- ``low-occupancy`` (compute): mean SM occupancy below ``occupancy_ratio`` *and* the window's
  p99 above ``p99_latency_s``;
- ``queueing`` (engine): p99 above ``p99_latency_s`` with the engine's queue time at least
  ``queue_share_ratio`` of it (p99 over p99; where the queue's p99 is within its first bucket,
  an interpolation, the engine's own split of its requests' time into queue, prefill and
  decode, vLLM V1's and trtllm-serve's, where it has one; mean over mean for an engine without
  buckets; the alert GPUEngineQueueing and fleet's figure take the share the same way, in
  PromQL: ``queue_share_promql``), and nothing above found: the GPU layers are unsaturated, so
  the engine's admission is the limit. Last because any other finding explains why requests
  wait;
- ``none``: nothing crossed a threshold. A layer that could not be judged (no GPM before Hopper
  or on an old driver, no app figures) is said in a note, never passed off as healthy; it does
  not change the exit code, which says whether a bottleneck was found.

Each kind is one ``Rule`` of ``RULES`` (in that order): its condition, evidence, remedy, table
cell, title, threshold in words, alert rules and their promtool cases, and its row in
docs/diagnose.md; its threshold is a line of ``sidecar.thresholds``. ``PRECEDENCE``,
``ALL_KINDS``, the threshold prose of diagnose's report (``threshold_prose``), the shipped alert
rules and their cases, and docs/diagnose.md's verdict table (``sidecar.alert_rules``) are read
from ``RULES``; ``kinds_of(layer)`` gives a layer's kinds.

The latency the seed's rule joins is the app's histogram (``sidecar.client``, per GPU) or, when
the app publishes none, the engine's request latency (the pod's, applied to each of its GPUs);
``Figures.latency_source`` says which, and a note says it.
"""

from __future__ import annotations

from sidecar.judge.rule import Rule
from sidecar.judge.rules import compute, engine, gpu, health, io, memory

RULES: tuple[Rule, ...] = (
    gpu.LOST, health.HARDWARE_FAULT, health.THROTTLED, io.PCIE_DEGRADED, io.PCIE, io.C2C,
    io.NVLINK, engine.KV_CACHE, memory.FRAGMENTATION, memory.ALLOCATOR_RETRIES,
    compute.LOW_OCCUPANCY, engine.QUEUEING)
PRECEDENCE = tuple(r.kind for r in RULES)
RULE_OF: dict[str, Rule] = {r.kind: r for r in RULES}
LAYERS = ("GPU", "health", "IO", "engine", "memory", "compute")  # of the kinds, as RULES name them
# kind -> (layer, table cell, title, what to do), in PRECEDENCE order: what the views and the
# store's commands read of a kind
ALL_KINDS: dict[str, tuple[str, str, str, str]] = {
    r.kind: (r.layer, r.cell, r.title, r.remedy) for r in RULES}


def kinds_of(layer: str) -> tuple[str, ...]:
    """The kinds of one layer (``GPU``, ``health``, ``IO``, ``engine``, ``memory``,
    ``compute``), in precedence order."""
    return tuple(r.kind for r in RULES if r.layer == layer)



def cell_of(kind: str) -> str:
    """The table's cell for a verdict kind (``none``: ok)."""
    return ALL_KINDS[kind][1] if kind in ALL_KINDS else "ok"
