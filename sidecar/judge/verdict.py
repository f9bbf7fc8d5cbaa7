"""The judgement of a window: each rule of ``RULES`` in precedence order (``judge``), its findings
and what could not be judged (``Verdict``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sidecar import thresholds
from sidecar.judge.figures import Figures
from sidecar.judge.rules import RULES
from sidecar.judge.rules.health import reason_share, xid_list, xids_in_window
from sidecar.judge.window import Window
from sidecar.thresholds import Thresholds
from sidecar.units import ghz, link, ms, pct


@dataclass(frozen=True)
class Finding:
    """A layer that explains latency on one GPU: its figures, the rule and the remedy."""

    key: str  # one of PRECEDENCE
    layer: str  # GPU, health, IO, memory, compute
    short: str  # for the table's verdict column
    title: str
    evidence: str
    remedy: str


@dataclass(frozen=True)
class Verdict:
    window: Window
    findings: tuple[Finding, ...]
    notes: tuple[str, ...]

    @property
    def key(self) -> str:
        return self.findings[0].key if self.findings else "none"

    @property
    def compute_judged(self) -> bool:
        return self.window.mean.occupancy is not None

    def short(self) -> str:
        """The table's verdict cell: the first finding (and how many more), or ok."""
        if self.findings:
            more = f" +{len(self.findings) - 1}" if len(self.findings) > 1 else ""
            return self.findings[0].short + more
        return ok_cell(self.window.mean)


def ok_cell(mean: Figures) -> str:
    """The table's cell of a GPU without a finding: ok, or what could not be judged (no SM
    occupancy without GPM; nothing without NVML)."""
    if mean.occupancy is not None:
        return "ok"
    return "ok? no GPM" if mean.utilization is not None else "ok? no NVML"


def threshold_prose(t: Thresholds) -> str:
    """Every rule's threshold in words, in precedence order: the head of diagnose's report."""
    return "; ".join(r.threshold(t) for r in RULES if r.threshold is not None)


def judge(w: Window, t: Thresholds | None = None) -> Verdict:
    """The findings on one GPU, in ``PRECEDENCE`` order, and what could not be judged.

    ``t`` defaults to ``sidecar.thresholds.THRESHOLDS`` as it is at call time (one place to
    change a threshold, for the rules and for this)."""
    t = t or thresholds.THRESHOLDS
    found: list[Finding] = []
    for rule in RULES:
        if (rule.alone and found) or not rule.found(w, t):
            continue
        cell, said, remedy = rule.cell, rule.evidence(w, t), rule.remedy
        if isinstance(said, tuple):  # the cell and the remedy follow the figures
            cell, said, remedy = said
        found.append(Finding(rule.kind, rule.layer, cell, rule.title, said, remedy))
    notes: list[str] = []
    if not w.lost:
        notes.extend(_unjudged(w, t, found))
    notes.extend(_health_notes(w, t, found))
    return Verdict(w, tuple(found), tuple(notes))




def _unjudged(w: Window, t: Thresholds, found: list[Finding]) -> Iterable[str]:
    """What the findings cannot say: a layer without figures, and latency nothing explains."""
    m = w.mean
    if m.occupancy is None:
        yield ("compute not judged: no SM occupancy or tensor activity on this GPU (GPM needs "
               f"Hopper or newer and a recent driver); utilization {pct(m.utilization)} only "
               "says that some kernel ran")
    if m.pcie_tx_ratio is None and m.pcie_rx_ratio is None and m.c2c_tx_ratio is None \
            and m.c2c_rx_ratio is None and m.nvlink_tx_ratio is None and m.nvlink_rx_ratio is None:
        yield "IO not judged: no PCIe rate or link maximum on this GPU"
    if m.utilization is not None and m.sm_clock is None and reason_share(m) is None:
        yield "clocks not judged: no SM clock or clock-event reasons on this GPU"
    if m.fragmentation is None and m.latency is None:
        yield ("memory (allocator) and latency not judged: no app figures arrived during the "
               "window (is sidecar.client started in the model server, on this --socket?), and "
               "no engine latency (--engine-metrics-url)")
    elif w.p99 is None:
        yield "latency not judged: no request was counted"
    elif m.fragmentation is None:
        yield ("memory (allocator) not judged: no app figures arrived during the window (is "
               "the injected publisher or sidecar.client running in the model server?)")
    if m.latency_source == "engine":
        yield (f"latency from the engine ({m.engine}'s request latency histogram): the app "
               "publishes none")
    elif m.latency_source == "app" and m.engine_latency is not None:
        yield (f"latency from the app (sidecar.client); the engine ({m.engine}) says p99 "
               f"{ms(w.engine_p99)}")
    if t.low_occupancy(m.occupancy) and not t.slow(w.p99) and w.p99 is not None:
        yield (f"SM occupancy {pct(m.occupancy)} is low but p99 {ms(w.p99)} meets the "
               f"{ms(t.p99_latency_s)} objective: normal for a small model, not a bottleneck")
    if t.slow(w.p99) and not found:
        # "outside the GPU" only as far as the GPU was judged: a layer without figures may
        # hold the cause
        unread = [name for name, gone in (
            ("SM occupancy", m.occupancy is None),
            ("PCIe", m.pcie_tx_ratio is None and m.pcie_rx_ratio is None),
            ("the allocator", m.fragmentation is None)) if gone]
        also = (f", or in what was not judged ({', '.join(unread)})" if unread else "")
        if m.engine:
            yield (f"p99 {ms(w.p99)} is above the {ms(t.p99_latency_s)} objective, yet no GPU or "
                   f"engine layer judged explains it (queue {pct(w.queue_share)} of it, KV cache "
                   f"{pct(m.kv_usage)}, time to first token p99 {ms(w.ttft_p99)}, inter-token "
                   f"p99 {ms(w.itl_p99)}): look outside the GPU and the engine (CPU pre/post-"
                   f"processing, the network, the client){also}")
        else:
            yield (f"p99 {ms(w.p99)} is above the {ms(t.p99_latency_s)} objective, yet no GPU "
                   "layer judged crossed its threshold: look outside the GPU (CPU pre/post-"
                   f"processing, queueing, network){also}")


def _health_notes(w: Window, t: Thresholds, found: list[Finding]) -> Iterable[str]:
    """What the health figures say that is no finding: a remap waiting for a reset, faults
    counted before the window, the app's Xids, sync boost, an idle link trained down."""
    m = w.mean
    keys = {f.key for f in found}
    if m.remap_pending:
        yield (f"a row remap waits for the GPU's next reset (remapped rows: "
               f"{m.remapped_uncorrectable or 0:.0f} for uncorrectable, "
               f"{m.remapped_correctable or 0:.0f} for correctable errors): reset the GPU once "
               "drained (`nvidia-smi -r`) to activate it (alert GPURowRemapPending)")
    if m.ecc_uncorrected and not w.increases.get("ecc_uncorrected"):
        yield (f"{m.ecc_uncorrected:.0f} uncorrected ECC errors since the driver loaded, none "
               "during the window: the GPU has not been reset since; reset it once drained")
    earlier = sorted((c, n) for c, n in (m.xids or ()) if t.critical_xid(c)
                     and not w.xids.get(c))
    if earlier:
        yield ("before the window, since the agent started: "
               + xid_list(earlier) + "; see `dmesg | grep -i xid`")
    if other := xids_in_window(w, t, critical=False):
        yield (xid_list(other) + " during the window: not the hardware's fault by itself (13, "
               "31, 43: the app's kernels; 63: a row remap recorded; 92: corrected errors to "
               "watch)")
    if "throttled" not in keys and m.sync_boost is not None and m.sync_boost > t.throttle_ratio \
            and t.throttled(m.sync_boost, m.utilization, m.sm_clock, m.sm_clock_max):
        yield (f"clocks held by sync boost for {pct(m.sync_boost)} of the window (SM clock "
               f"{ghz(m.sm_clock)} of {ghz(m.sm_clock_max)}): this GPU follows the slowest GPU "
               "of its sync-boost group; look at the group's other GPUs")
    b = w.below_max
    if b is not None and "pcie-degraded" not in keys:
        yield (f"the PCIe link ran at {link(b.link_gen_now, b.link_width_now)} of its "
               f"{link(m.link_gen, m.link_width)} maximum in {w.below_max_samples} of "
               f"{w.link_samples} samples, carrying RX {pct(b.pcie_rx_now_ratio)}, TX "
               f"{pct(b.pcie_tx_now_ratio)} of it: an idle link trains down to save power, so it "
               "is a finding only while it stays below its maximum under traffic (above "
               f"{t.pcie_degraded_traffic_ratio:.0%} of the trained link) for most of the window")

