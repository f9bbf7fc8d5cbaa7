"""The health and the newer IO verdicts (``hardware-fault``, ``throttled``, ``pcie-degraded``,
``c2c``, ``nvlink``):
each on synthetic series with its figures and remedy, the documented order of precedence among
all the kinds, what must never be a finding (an idle GPU at a low link speed, clocks down while
idle, sync boost alone), a figure exactly on a new threshold judged as the shipped rule judges it
(promtool), and, once the simulated health source is in, each new scenario through the command."""

from __future__ import annotations

import dataclasses
import itertools
import re
import shutil
import subprocess
import tracemalloc
from dataclasses import dataclass, replace

import pytest
import yaml

from sidecar import alert_rules
from sidecar.judge import rules as verdict_module
from sidecar.judge.figures import Figures
from sidecar.judge.rules import ALL_KINDS, LAYERS, PRECEDENCE, kinds_of
from sidecar.judge.series import figures_of
from sidecar.judge.verdict import judge
from sidecar.judge.window import Summary, summarize
from sidecar.simulate import scenarios
from sidecar.sources.pcie import link_max_bytes_per_second
from sidecar.thresholds import THRESHOLDS
from sidecar.views.report import report
from sidecar.views.table import cells, render
from tests.conftest import ROOT, run_cli

RULES = ROOT / "deploy" / "alerts" / "gpu-sidecar.rules.yml"
GiB = 1024**3
UUID = "GPU-5d7e1f3a-2c4b-4e8d-9a61-0b7c3e5f8a21"
INF = float("inf")
QUIET = ((0.1, 0.5, INF), (0.0, 0.0, 0.0))
SLOW = ((0.1, 0.5, INF), (0.0, 100.0, 100.0))
GEN5_X16 = link_max_bytes_per_second(5, 16) or 0.0
GEN4_X8 = link_max_bytes_per_second(4, 8) or 0.0
GEN3_X8 = link_max_bytes_per_second(3, 8) or 0.0
GEN1_X16 = link_max_bytes_per_second(1, 16) or 0.0
SM_MAX = 1.98e9
C2C_MAX = 447.12e9
NVLINK4 = 18 * 26562e6  # 18 active links at the speed NVML reports for NVLink 4


def healthy(**figures: object) -> Figures:
    """A busy, healthy H200: every health figure present and nothing wrong."""
    base = dict(uuid=UUID, name="Simulated NVIDIA H200", index="0", utilization=0.9,
                occupancy=0.6, tensor=0.5, pcie_tx_ratio=0.05, pcie_rx_ratio=0.1,
                pcie_tx=0.05 * GEN5_X16, pcie_rx=0.1 * GEN5_X16, link_max=GEN5_X16,
                fragmentation=0.1, alloc_reserved=8 * GiB, retries=0.0, ooms=0.0, latency=QUIET,
                link_gen=5.0, link_width=16.0, link_gen_now=5.0, link_width_now=16.0,
                link_now=GEN5_X16, pcie_tx_now_ratio=0.05, pcie_rx_now_ratio=0.1,
                replays=0.0, l0_recovery=0.0,
                sm_clock=SM_MAX, sm_clock_max=SM_MAX, mem_clock=3.201e9, mem_clock_max=3.201e9,
                power_cap=0.0, hw_slowdown=0.0, hw_thermal=0.0, hw_power_brake=0.0,
                sw_thermal=0.0, sync_boost=0.0, power=450.0, power_limit=700.0,
                temperature=52.0, mem_temperature=58.0, ecc_uncorrected=0.0,
                ecc_corrected=0.0, remapped_uncorrectable=0.0, remapped_correctable=0.0,
                remap_pending=0.0, remap_failed=0.0)
    base.update(figures)
    return Figures(**base)  # type: ignore[arg-type]


def on_link(gen: int, width: int, rx_share_now: float, tx_share_now: float = 0.0,
            **figures: object) -> Figures:
    """A Gen5 x16 GPU whose link trained at ``gen`` x ``width``, carrying these shares of it."""
    now = link_max_bytes_per_second(gen, width) or 0.0
    rx, tx = rx_share_now * now, tx_share_now * now
    return healthy(link_gen_now=float(gen), link_width_now=float(width), link_now=now,
                   pcie_rx=rx, pcie_tx=tx, pcie_rx_now_ratio=rx_share_now,
                   pcie_tx_now_ratio=tx_share_now, pcie_rx_ratio=rx / GEN5_X16,
                   pcie_tx_ratio=tx / GEN5_X16, **figures)


def window_of(*cycles: Figures):
    return summarize([{UUID: f} for f in cycles])[UUID]


def verdict_of(*cycles: Figures):
    return judge(window_of(*cycles))


def judged(cycles):
    """What the agent hands the table: its verdict on each GPU (the table judges nothing)."""
    return {uuid: judge(w) for uuid, w in summarize(cycles).items()}


def keys(v) -> list[str]:
    return [f.key for f in v.findings]


def finding(v, key: str):
    return next(f for f in v.findings if f.key == key)


THROTTLED = dict(utilization=0.97, sm_clock=1.3e9, power_cap=0.8, power=697.0)


# -- hardware-fault -----------------------------------------------------------------------------

def test_a_critical_xid_during_the_window_is_a_hardware_fault_with_its_code_and_drain():
    before = healthy()
    after = healthy(xids=((79, 2.0),), last_xid=79.0)
    v = verdict_of(before, after, after)
    assert keys(v) == ["hardware-fault"]
    f = v.findings[0]
    assert (f.layer, f.short) == ("health", "HW FAULT")
    assert "Xid 79 (fallen off the bus) x2" in f.evidence and "GPUHardwareFault" in f.evidence
    assert "drain" in f.remedy and "cordon" in f.remedy and "nvidia-smi -r" in f.remedy
    assert "dcgmi diag" in f.remedy and "RMA" in f.remedy
    assert cells(v.window, v)["verdict"] == "HW FAULT"


@pytest.mark.parametrize("code", THRESHOLDS.critical_xids)
def test_every_critical_xid_counts_from_zero_when_its_series_appears_in_the_window(code):
    v = verdict_of(healthy(), healthy(xids=((code, 1.0),)))
    assert keys(v) == ["hardware-fault"] and f"Xid {code} " in v.findings[0].evidence


def test_an_xid_counted_before_the_window_is_a_note_not_a_finding():
    old = healthy(xids=((79, 1.0), (13, 4.0)))
    v = verdict_of(old, old, old)
    assert keys(v) == []
    assert any("before the window" in n and "Xid 79" in n for n in v.notes), v.notes


@pytest.mark.parametrize(("code", "why"), [(13, "the app's kernels"), (31, "the app's"),
                                           (43, "the app's"), (63, "row remap recorded"),
                                           (92, "corrected errors to watch")])
def test_an_xid_that_is_not_the_hardwares_is_a_note(code, why):
    v = verdict_of(healthy(), healthy(xids=((code, 3.0),)))
    assert keys(v) == []
    assert any(f"Xid {code}" in n and why in n for n in v.notes), v.notes


def test_an_uncorrected_ecc_error_during_the_window_is_a_hardware_fault():
    v = verdict_of(healthy(ecc_uncorrected=1.0), healthy(ecc_uncorrected=3.0))
    assert keys(v) == ["hardware-fault"]
    assert "uncorrected ECC errors +2 during the window (3 since the driver loaded)" in \
        v.findings[0].evidence


def test_uncorrected_ecc_errors_from_before_the_window_are_a_note_and_corrected_ones_nothing():
    v = verdict_of(healthy(ecc_uncorrected=3.0, ecc_corrected=10.0),
                   healthy(ecc_uncorrected=3.0, ecc_corrected=250.0))
    assert keys(v) == []
    assert any("3 uncorrected ECC errors since the driver loaded, none during the window" in n
               for n in v.notes)


def test_a_failed_row_remap_is_a_hardware_fault_a_pending_one_a_note_to_reset():
    failed = verdict_of(healthy(remap_failed=1.0, remapped_uncorrectable=2.0))
    assert keys(failed) == ["hardware-fault"]
    assert "a row remap failed (remapped rows: 2 for uncorrectable" in failed.findings[0].evidence
    pending = verdict_of(healthy(remap_pending=1.0, remapped_correctable=1.0))
    assert keys(pending) == []
    assert any("waits for the GPU's next reset" in n and "GPURowRemapPending" in n
               for n in pending.notes)


def test_a_counter_reset_counts_from_zero_like_prometheus_increase():
    v = verdict_of(healthy(ecc_uncorrected=5.0), healthy(ecc_uncorrected=1.0))
    assert v.window.increases["ecc_uncorrected"] == 1.0 and keys(v) == ["hardware-fault"]


# -- throttled ----------------------------------------------------------------------------------

def test_a_busy_gpu_held_by_its_power_cap_is_throttled_with_the_reason_clock_and_power():
    v = verdict_of(healthy(**THROTTLED))
    assert keys(v) == ["throttled"]
    f = v.findings[0]
    assert (f.layer, f.short) == ("health", "clk: power")
    assert "SM clock 1.30 GHz of its 1.98 GHz maximum (65.7 %, below 85%)" in f.evidence
    assert "utilization is 97.0 %" in f.evidence and "power cap 80.0 %" in f.evidence
    assert "power 697 W of 700 W" in f.evidence and "GPUClocksThrottled" in f.evidence
    assert "power limit" in f.remedy and "697 W of 700 W" in f.remedy
    assert "airflow" not in f.remedy


@pytest.mark.parametrize(("reason", "cell", "remedy"), [
    ("hw_thermal", "clk: thermal", "airflow"), ("sw_thermal", "clk: thermal", "airflow"),
    ("hw_slowdown", "clk: HW slow", "the board"), ("hw_power_brake", "clk: brake", "the board"),
])
def test_each_limiting_reason_names_itself_and_its_remedy(reason, cell, remedy):
    v = verdict_of(healthy(utilization=0.95, sm_clock=1.0e9, temperature=88.0, **{reason: 0.6}))
    assert keys(v) == ["throttled"]
    assert v.findings[0].short == cell and remedy in v.findings[0].remedy
    if "thermal" in reason:
        assert "GPU 88 °C" in v.findings[0].remedy


def test_two_reasons_give_the_larger_first_and_both_remedies():
    v = verdict_of(healthy(utilization=0.95, sm_clock=1.0e9, hw_thermal=0.4, power_cap=0.9))
    f = v.findings[0]
    assert f.short == "clk: power"
    assert f.evidence.index("power cap") < f.evidence.index("HW thermal")
    assert f.remedy.index("power limit") < f.remedy.index("airflow")


def test_an_idle_gpu_with_its_clocks_down_and_a_reason_set_is_not_throttled():
    v = verdict_of(healthy(utilization=0.02, sm_clock=0.345e9, hw_slowdown=1.0, power=80.0))
    assert keys(v) == []


def test_sync_boost_alone_is_a_note_not_a_finding():
    v = verdict_of(healthy(utilization=0.95, sm_clock=1.2e9, sync_boost=1.0))
    assert keys(v) == []
    assert any("sync boost" in n and "other GPUs" in n for n in v.notes), v.notes


def test_a_power_capped_gpu_within_its_boost_range_is_not_throttled():
    v = verdict_of(healthy(utilization=0.97, sm_clock=0.96 * SM_MAX, power_cap=1.0))
    assert keys(v) == []


def test_throttled_is_judged_on_the_window_share_of_the_reason():
    held = healthy(**{**THROTTLED, "power_cap": 1.0})
    free = healthy(**{**THROTTLED, "power_cap": 0.0})
    assert keys(verdict_of(held, free, free)) == ["throttled"]  # a third of the window: > 25 %
    assert keys(verdict_of(held, free, free, free, free)) == []  # a fifth: below


# -- pcie-degraded ------------------------------------------------------------------------------

def test_a_saturated_gen3_x8_link_on_a_gen5_x16_gpu_is_degraded_with_both_shares():
    degraded = on_link(3, 8, 0.95, 0.2)
    v = verdict_of(degraded, degraded, degraded)
    assert keys(v) == ["pcie-degraded"]  # 12 % of the maximum link: not `pcie`
    f = v.findings[0]
    assert (f.layer, f.short) == ("IO", "IO: PCIe link")
    assert "ran at Gen3 x8 (7.9 GB/s per direction) of its Gen5 x16 maximum (63.0 GB/s)" in \
        f.evidence
    assert "in 3 of 3 samples" in f.evidence
    assert "RX 95.0 % (7.5 GB/s), TX 20.0 % (1.6 GB/s) of the link as trained" in f.evidence
    assert "saturated" in f.evidence
    assert "RX 11.9 %, TX 2.5 % of the maximum link" in f.evidence  # 0.95 x 1/8
    assert "GPUPcieLinkDegraded" in f.evidence
    assert "reseat" in f.remedy and "BIOS" in f.remedy and "slot" in f.remedy


def test_a_saturated_link_at_a_quarter_of_its_maximum_shows_about_24_percent_of_it():
    v = verdict_of(*[on_link(4, 8, 0.95)] * 3)  # Gen4 x8 (or Gen3 x16): a quarter of Gen5 x16
    assert keys(v) == ["pcie-degraded"]
    assert "RX 95.0 %" in v.findings[0].evidence
    assert "RX 23.7 %, TX 0.0 % of the maximum link" in v.findings[0].evidence
    assert v.window.below_max is not None
    assert v.window.below_max.pcie_rx_ratio == pytest.approx(0.2375, abs=0.001)


def test_an_idle_gpu_at_gen1_x16_is_no_pcie_degraded_but_a_note():
    idle = on_link(1, 16, 0.01, 0.002, utilization=0.0)
    v = verdict_of(idle, idle, idle)
    assert keys(v) == []
    assert any("Gen1 x16 of its Gen5 x16 maximum" in n and "trains down" in n for n in v.notes)


def test_a_degraded_width_at_the_full_generation_is_degraded_too():
    v = verdict_of(*[on_link(5, 8, 0.5)] * 2)
    assert keys(v) == ["pcie-degraded"] and "Gen5 x8" in v.findings[0].evidence


def test_a_link_that_trains_down_between_readings_is_no_degraded_link():
    """Busy at Gen5 x16, then idle at Gen1: the interval's bytes over the link as trained at the
    reading (Gen1) exceed it, a reading of no degraded link; idle readings carry nothing."""
    busy = on_link(5, 16, 0.6)
    dropped = on_link(1, 16, 3.0)  # 3 x Gen1 x16: the traffic flowed at Gen5
    idle = on_link(1, 16, 0.0)
    assert keys(verdict_of(busy, dropped, idle, idle)) == []


def test_a_link_below_its_maximum_in_a_minority_of_samples_is_no_degraded_link():
    assert keys(verdict_of(on_link(5, 16, 0.5), on_link(5, 16, 0.5), on_link(3, 8, 0.9))) == []


def test_degraded_links_retraining_and_replaying_are_counted_in_the_evidence():
    v = verdict_of(on_link(3, 8, 0.9, l0_recovery=10.0, replays=2.0, pcie_correctable=1.0),
                   on_link(3, 8, 0.9, l0_recovery=13.0, replays=7.0, pcie_correctable=41.0))
    assert "left L0 for recovery 3 times, replayed 5 packets and corrected 40 errors" in \
        v.findings[0].evidence


# -- c2c ----------------------------------------------------------------------------------------

def grace(c2c_rx_share: float) -> Figures:
    """A GH200's GPU: host traffic on NVLink-C2C, PCIe idle."""
    return healthy(name="Simulated NVIDIA GH200 480GB", c2c_max=C2C_MAX,
                   c2c_rx=c2c_rx_share * C2C_MAX, c2c_tx=0.25 * C2C_MAX,
                   c2c_rx_ratio=c2c_rx_share, c2c_tx_ratio=0.25, pcie_rx=2e6, pcie_tx=1e6,
                   pcie_rx_ratio=2e6 / GEN5_X16, pcie_tx_ratio=1e6 / GEN5_X16)


def test_c2c_saturated_on_a_grace_gpu_is_the_io_verdict():
    v = verdict_of(grace(0.9), grace(0.9))
    assert keys(v) == ["c2c"]
    f = v.findings[0]
    assert (f.layer, f.short) == ("IO", "IO: C2C")
    assert "NVLink-C2C RX 90.0 % (402.4 GB/s), TX 25.0 % (111.8 GB/s) of the links' 447.1 GB/s" \
        in f.evidence and "GPUC2CSaturated" in f.evidence
    assert "HBM" in f.remedy and "cudaMemPrefetchAsync" in f.remedy


def test_c2c_below_the_line_is_nothing_and_io_counts_as_judged_without_pcie():
    assert keys(verdict_of(grace(0.79))) == []
    only_c2c = replace(grace(0.5), pcie_rx_ratio=None, pcie_tx_ratio=None)
    assert not any("IO not judged" in n for n in verdict_of(only_c2c).notes)


# -- nvlink -------------------------------------------------------------------------------------

def tensor_parallel(share: float, **figures: object) -> Figures:
    """One GPU of a tensor-parallel group: the all-reduce sends and receives ``share`` of the
    active links' maximum."""
    return healthy(nvlink_max=NVLINK4, nvlink_rx=share * NVLINK4, nvlink_tx=share * NVLINK4,
                   nvlink_rx_ratio=share, nvlink_tx_ratio=share, **figures)


def test_a_full_nvlink_on_a_busy_gpu_is_the_io_verdict_with_its_figures_and_remedies():
    v = verdict_of(tensor_parallel(0.9), tensor_parallel(0.9))
    assert keys(v) == ["nvlink"]
    f = v.findings[0]
    assert (f.layer, f.short) == ("IO", "IO: NVLink")
    assert "NVLink RX 90.0 % (430.3 GB/s), TX 90.0 % (430.3 GB/s) of the active links' 478.1 " \
        "GB/s, above 80%, while utilization is 90.0 % (busy above 50%)" in f.evidence
    assert "GPUNVLinkSaturated" in f.evidence
    assert "tensor-parallel degree" in f.remedy and "pipeline parallelism" in f.remedy
    assert "overlap communication with compute" in f.remedy
    assert "NVSwitch domain" in f.remedy and "nvidia-smi topo -m" in f.remedy


def test_a_full_nvlink_with_slow_requests_is_a_finding_even_on_a_gpu_that_reads_idle():
    idle = dict(utilization=0.3)
    assert keys(verdict_of(tensor_parallel(0.9, **idle), tensor_parallel(0.9, **idle,
                                                                         latency=SLOW))) \
        == ["nvlink"]


def test_a_full_nvlink_on_a_quiet_gpu_with_fast_requests_is_nothing():
    """A weight reshard or a checkpoint copied between GPUs fills the links and costs the
    requests nothing."""
    assert keys(verdict_of(*[tensor_parallel(0.95, utilization=0.2)] * 2)) == []


def test_a_busy_nvlink_below_the_line_and_an_idle_one_are_nothing():
    assert keys(verdict_of(*[tensor_parallel(0.79)] * 2)) == []
    assert keys(verdict_of(*[tensor_parallel(0.0)] * 2)) == []


def test_nvlink_comes_after_the_host_links_and_before_the_engine():
    order = list(PRECEDENCE)
    assert order.index("pcie") < order.index("c2c") < order.index("nvlink") \
        < order.index("kv-cache")
    assert "nvlink" in kinds_of("IO")


# -- precedence ---------------------------------------------------------------------------------

def test_the_precedence_is_documented_and_keeps_the_seeds_order():
    assert tuple(ALL_KINDS) == PRECEDENCE == tuple(r.kind for r in verdict_module.RULES)
    assert sorted(PRECEDENCE) == sorted(k for layer in LAYERS for k in kinds_of(layer))
    seed = ("gpu-lost", "pcie", "fragmentation", "allocator-retries", "low-occupancy")
    assert [k for k in PRECEDENCE if k in seed] == list(seed)  # the seed's, unchanged
    doc = verdict_module.__doc__ or ""
    at = [doc.index(f"- ``{key}``") for key in PRECEDENCE]
    assert at == sorted(at), "the module docstring lists the kinds in PRECEDENCE order"


def cycles_with(kinds: set[str]) -> list[Figures]:
    """Three cycles of one GPU showing exactly the findings ``kinds`` (figures set directly:
    a degraded link and a saturated maximum link together cannot happen, the verdict does not
    care)."""
    bad: dict[str, object] = {}
    if "throttled" in kinds:
        bad.update(THROTTLED)
    if "pcie-degraded" in kinds:
        bad.update(link_gen_now=3.0, link_width_now=8.0, link_now=GEN3_X8,
                   pcie_rx_now_ratio=0.95)
    if "pcie" in kinds:
        bad["pcie_rx_ratio"] = 0.95
    if "c2c" in kinds:
        bad.update(c2c_rx_ratio=0.9, c2c_max=C2C_MAX)
    if "nvlink" in kinds:
        bad.update(nvlink_rx_ratio=0.9, nvlink_max=NVLINK4)
    if "fragmentation" in kinds:
        bad.update(fragmentation=0.7, alloc_reserved=16 * GiB)
    if "low-occupancy" in kinds:
        bad["occupancy"] = 0.1
    if "kv-cache" in kinds:
        bad.update(kv_usage=0.95, waiting=3.0, preemptions=0.0, engine="vllm")
    slow = kinds & {"low-occupancy", "queueing"}
    first = healthy(**bad)
    later = replace(first, latency=SLOW if slow else QUIET,
                    retries=4.0 if "allocator-retries" in kinds else 0.0,
                    xids=((48, 1.0),) if "hardware-fault" in kinds else None,
                    preemptions=5.0 if "kv-cache" in kinds else first.preemptions,
                    **({"engine_latency": SLOW, "queue": SLOW, "engine": "vllm"}
                       if "queueing" in kinds else {}))
    last = replace(later, available=False) if "gpu-lost" in kinds else later
    return [first, later, last]


# queueing is said only where nothing else is found: it takes part in no pair
FOUND_TOGETHER = tuple(k for k in PRECEDENCE if k != "queueing")


@pytest.mark.parametrize(("first", "second"), list(itertools.combinations(FOUND_TOGETHER, 2)))
def test_of_two_findings_the_more_fundamental_comes_first_and_shows_in_the_table(first, second):
    v = verdict_of(*cycles_with({first, second}))
    assert keys(v) == [first, second]
    assert cells(v.window, v)["verdict"] == f"{v.findings[0].short} +1"


@pytest.mark.parametrize("other", FOUND_TOGETHER)
def test_queueing_is_said_only_where_nothing_else_explains_the_latency(other):
    assert keys(verdict_of(*cycles_with({"queueing"}))) == ["queueing"]
    assert keys(verdict_of(*cycles_with({other, "queueing"}))) == [other]


def test_a_gpu_with_every_finding_lists_them_in_precedence_order():
    cycles = cycles_with(set(FOUND_TOGETHER))
    assert keys(verdict_of(*cycles)) == list(FOUND_TOGETHER)
    cycles = [{UUID: c} for c in cycles]
    assert f"LOST +{len(FOUND_TOGETHER) - 1}" in render(cycles, "title", verdicts=judged(cycles))
    readable = [{UUID: c} for c in cycles_with(set(FOUND_TOGETHER) - {"gpu-lost"})]
    assert re.search(rf"\| HW FAULT \+{len(FOUND_TOGETHER) - 2}$",
                     render(readable, "t", verdicts=judged(readable)), re.M)


# -- read back from the series; the window stays small ------------------------------------------

@dataclass(frozen=True)
class S:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float
    timestamp_ms: int = 0


def test_figures_are_read_back_from_the_exported_series_xids_by_code():
    gpu = (("gpu_index", "0"), ("gpu_name", "H200"), ("gpu_uuid", UUID))
    series = [S("gpu_sm_clock_hertz", gpu, 1.3e9), S("gpu_sm_clock_max_hertz", gpu, SM_MAX),
              S("gpu_clocks_event_power_cap_ratio", gpu, 0.8),
              S("gpu_pcie_link_current_generation", gpu, 3.0),
              S("gpu_pcie_rx_current_link_util_ratio", gpu, 0.95),
              S("gpu_c2c_rx_bandwidth_util_ratio", gpu, 0.9),
              S("gpu_ecc_uncorrected_volatile_total", gpu, 2.0),
              S("gpu_xid_errors_total", (*gpu, ("xid", "79")), 2.0),
              S("gpu_xid_errors_total", (*gpu, ("xid", "13")), 1.0),
              S("gpu_last_xid", gpu, 79.0)]
    f = figures_of(series)[UUID]
    assert (f.sm_clock, f.sm_clock_max, f.power_cap) == (1.3e9, SM_MAX, 0.8)
    assert (f.link_gen_now, f.pcie_rx_now_ratio, f.c2c_rx_ratio) == (3.0, 0.95, 0.9)
    assert f.ecc_uncorrected == 2.0 and f.last_xid == 79.0
    assert f.xids == ((13, 1.0), (79, 2.0))


@pytest.mark.slow
def test_the_window_with_health_figures_is_still_constant_in_size():
    def cycle(n: int) -> dict[str, Figures]:
        return {f"GPU-{g}": on_link(3 if n % 2 else 5, 8 if n % 2 else 16, n % 5 / 5,
                                    uuid=f"GPU-{g}", index=str(g), ecc_corrected=float(n),
                                    xids=((13, float(n // 10)), (79, 1.0)))
                for g in range(4)}

    def held_after(cycles: int) -> int:
        tracemalloc.start()
        try:
            summary = Summary()
            base = tracemalloc.get_traced_memory()[0]
            for n in range(cycles):
                summary.add(cycle(n))
            return tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()

    assert held_after(4000) - held_after(1000) < 16_000  # a list of cycles: megabytes


# -- the report ---------------------------------------------------------------------------------

def test_the_report_shows_the_health_line_the_trained_link_and_the_remedies():
    throttled = judge(window_of(healthy(**THROTTLED)))
    degraded = judge(window_of(*[on_link(3, 8, 0.95)] * 2))
    text = report({"GPU-a": throttled, "GPU-b": degraded}, seconds=10, samples=2, label="")
    flat = " ".join(text.split())
    assert "verdict: throttled (health: the clocks are held below their maximum)" in text
    assert "health: SM clock 1.30 GHz of 1.98 GHz (65.7 %), limited by power cap 80.0 %" in flat
    assert "verdict: pcie-degraded (IO: the PCIe link trained below its maximum)" in text
    assert "(Gen5 x16), trained at Gen3 x8 in 2 of 2 samples: RX 95.0 %" in flat
    assert "do: power cap: check the power limit" in flat and "do: reseat the GPU" in flat
    assert "result: a bottleneck on 2 of 2 GPU(s): GPU 0 throttled, GPU 0 pcie-degraded" in text
    t = THRESHOLDS
    assert f"a critical Xid ({', '.join(map(str, t.critical_xids))})" in flat
    assert "PCIe above 80% of the link" in flat  # the seed's line, unchanged


# -- exactly on a threshold: diagnose and the shipped rule agree ---------------------------------

@dataclass(frozen=True)
class Case:
    name: str
    alert: str
    key: str
    figures: dict  # for judge()
    series: dict  # name -> value for promtool, constant over the test


def cases() -> list[Case]:
    t = THRESHOLDS
    out = []
    busy = {"utilization": 0.95, "sm_clock": 1.2e9}
    busy_series = {"gpu_utilization_ratio": 0.95, "gpu_sm_clock_hertz": 1.2e9,
                   "gpu_sm_clock_max_hertz": SM_MAX}
    for label, share in (("at", t.throttle_ratio), ("above", t.throttle_ratio + 0.01)):
        out.append(Case(f"power cap {label} the share", "GPUClocksThrottled", "throttled",
                        {**busy, "power_cap": share},
                        {**busy_series, "gpu_clocks_event_power_cap_ratio": share}))
    for label, util in (("at", t.busy_utilization_ratio), ("above", t.busy_utilization_ratio + 0.01)):
        out.append(Case(f"utilization {label} busy", "GPUClocksThrottled", "throttled",
                        {**busy, "utilization": util, "hw_thermal": 0.9},
                        {**busy_series, "gpu_utilization_ratio": util,
                         "gpu_clocks_event_hw_thermal_ratio": 0.9}))
    for label, clock in (("at", t.throttle_clock_ratio * 2e9),
                         ("below", (t.throttle_clock_ratio - 0.01) * 2e9)):
        out.append(Case(f"SM clock {label} its line", "GPUClocksThrottled", "throttled",
                        {**busy, "sm_clock": clock, "sm_clock_max": 2e9, "power_cap": 0.9},
                        {**busy_series, "gpu_sm_clock_hertz": clock,
                         "gpu_sm_clock_max_hertz": 2e9,
                         "gpu_clocks_event_power_cap_ratio": 0.9}))
    link = {"gpu_pcie_link_generation": 5, "gpu_pcie_link_width": 16,
            "gpu_pcie_link_current_generation": 3, "gpu_pcie_link_current_width": 8}
    for label, share in (("at", t.pcie_degraded_traffic_ratio),
                         ("above", t.pcie_degraded_traffic_ratio + 0.01)):
        out.append(Case(f"traffic {label} the share of a degraded link", "GPUPcieLinkDegraded",
                        "pcie-degraded",
                        {"link_gen_now": 3.0, "link_width_now": 8.0, "pcie_rx_now_ratio": share},
                        {**link, "gpu_pcie_rx_current_link_util_ratio": share}))
    for label, share in (("at", t.pcie_util_ratio), ("above", t.pcie_util_ratio + 0.01)):
        out.append(Case(f"C2C {label} the line", "GPUC2CSaturated", "c2c",
                        {"c2c_tx_ratio": share}, {"gpu_c2c_tx_bandwidth_util_ratio": share}))
    for label, share in (("at", t.nvlink_util_ratio), ("above", t.nvlink_util_ratio + 0.01)):
        out.append(Case(f"NVLink {label} the line on a busy GPU", "GPUNVLinkSaturated", "nvlink",
                        {"utilization": 0.95, "nvlink_rx_ratio": share},
                        {"gpu_utilization_ratio": 0.95,
                         "gpu_nvlink_rx_bandwidth_util_ratio": share}))
    for label, util in (("at", t.busy_utilization_ratio),
                        ("above", t.busy_utilization_ratio + 0.01)):
        out.append(Case(f"utilization {label} busy with a full NVLink", "GPUNVLinkSaturated",
                        "nvlink", {"utilization": util, "nvlink_tx_ratio": 0.95},
                        {"gpu_utilization_ratio": util,
                         "gpu_nvlink_tx_bandwidth_util_ratio": 0.95}))
    return out


LABELS = {"namespace": "ml", "pod": "llm-0", "gpu_uuid": UUID, "gpu_name": "H200",
          "gpu_index": "0"}


def series_text(name: str) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in LABELS.items()) + "}"


def test_a_figure_exactly_on_a_new_threshold_is_no_finding_for_diagnose_nor_for_the_alert(
        tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian's prometheus) is not installed")
    tests = []
    for case in cases():
        v = verdict_of(*[healthy(**case.figures)] * 5)
        fires = case.key in keys(v)
        past = " at " not in case.name
        assert fires == past, (case.name, "judge() says", fires, keys(v))
        tests.append({
            "name": case.name, "interval": "1m",
            "input_series": [{"series": series_text(name), "values": f"{value!r}x30"}
                             for name, value in case.series.items()],
            "promql_expr_test": [{
                "expr": f'count(ALERTS{{alertname="{case.alert}",alertstate="firing"}}) '
                        "or vector(0)",
                "eval_time": "20m", "exp_samples": [{"labels": "{}", "value": int(fires)}]}]})
    spec = tmp_path / "boundary.tests.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(RULES)], "evaluation_interval": "1m",
                                    "tests": tests}, sort_keys=False))
    done = subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, ("the shipped rule and diagnose disagree:\n"
                                  + done.stdout[-4000:] + done.stderr[-2000:])


def expr_of(rules: str, alert: str) -> str:
    return next(r["expr"] for g in yaml.safe_load(rules)["groups"] for r in g["rules"]
                if r.get("alert") == alert)


@pytest.mark.parametrize(("change", "alert", "in_rules", "figures", "key"), [
    ({"throttle_ratio": 0.9}, "GPUClocksThrottled", "[5m]) > 0.9,", THROTTLED, "throttled"),
    ({"throttle_clock_ratio": 0.6}, "GPUClocksThrottled",
     "< 0.6 * avg_over_time(gpu_sm_clock_max_hertz", THROTTLED, "throttled"),
    ({"busy_utilization_ratio": 0.98}, "GPUClocksThrottled",
     "avg_over_time(gpu_utilization_ratio[5m]) > 0.98", THROTTLED, "throttled"),
    ({"pcie_degraded_traffic_ratio": 0.97}, "GPUPcieLinkDegraded", ") > 0.97",
     {"link_gen_now": 3.0, "pcie_rx_now_ratio": 0.95}, "pcie-degraded"),
    ({"nvlink_util_ratio": 0.97}, "GPUNVLinkSaturated", ") > 0.97",
     {"nvlink_rx_ratio": 0.95}, "nvlink"),
    ({"critical_xids": (48,)}, "GPUHardwareFault", 'xid=~"48"}', {"xids": ((79, 1.0),)},
     "hardware-fault"),
])
def test_a_new_threshold_changed_in_one_place_moves_the_rules_and_the_verdicts(
        change, alert, in_rules, figures, key):
    changed = dataclasses.replace(THRESHOLDS, **change)
    assert in_rules not in expr_of(alert_rules.rules(THRESHOLDS), alert)
    assert in_rules in expr_of(alert_rules.rules(changed), alert)
    assert expr_of(alert_rules.prometheus_rule(changed).replace("\n  ", "\n"), alert) == \
        expr_of(alert_rules.rules(changed), alert)
    base = healthy() if key == "hardware-fault" else healthy(**figures)
    w = window_of(base, healthy(**figures))
    assert key in keys(judge(w)) and key not in keys(judge(w, changed))


# -- end to end, once the simulated health source is in ------------------------------------------

needs_source = pytest.mark.skipif(
    not {"throttled", "pcie-degraded", "hardware-fault", "grace-hopper"}
    <= set(getattr(scenarios, "DEFAULT_GPUS", {})),
    reason="the simulated health scenarios are not in yet")
WINDOW = ("--duration", "2", "--interval", "0.5")


def verdicts(stdout: str) -> dict[int, str]:
    out: dict[int, str] = {}
    gpu = None
    for line in stdout.splitlines():
        if m := re.match(r"^GPU (\d+) ", line):
            gpu = int(m[1])
        elif m := re.match(r"^  verdict: (\S+)", line):
            assert gpu is not None
            out[gpu] = m[1]
    return out


@needs_source
@pytest.mark.parametrize(("scenario", "expected", "words"), [
    ("throttled", {"throttled"}, ("power cap", "power limit")),
    ("pcie-degraded", {"pcie-degraded"}, ("Gen3 x8", "reseat")),
    ("grace-hopper", {"c2c"}, ("NVLink-C2C", "HBM")),
    ("nvlink-saturated", {"nvlink"}, ("active links", "tensor-parallel degree")),
])
def test_each_health_scenario_names_its_verdict_and_exits_1(scenario, expected, words):
    proc = run_cli("diagnose", "--simulate", scenario, *WINDOW)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert set(verdicts(proc.stdout).values()) == expected, proc.stdout
    assert "  why:" in proc.stdout and "  do:" in proc.stdout
    assert all(w in proc.stdout for w in words), proc.stdout


@needs_source
def test_the_hardware_fault_scenario_names_the_fault_and_the_lost_gpu():
    from sidecar.simulate.scenarios import FAULT_ECC_INDEX, FAULT_XID_INDEX

    proc = run_cli("diagnose", "--simulate", "hardware-fault", *WINDOW)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    found = verdicts(proc.stdout)
    assert found.pop(FAULT_XID_INDEX) == "gpu-lost"  # Xid 79, then fallen off the bus
    assert found.pop(FAULT_ECC_INDEX) == "hardware-fault"
    assert set(found.values()) == {"none"}
    assert "uncorrected ECC errors +" in proc.stdout and "drain" in proc.stdout
    assert "waits for the GPU's next reset" in proc.stdout  # its pending remap


@needs_source
@pytest.mark.parametrize("scenario", ["throttled", "pcie-degraded", "hardware-fault",
                                      "grace-hopper"])
def test_the_default_interval_over_ten_seconds_names_it_too(scenario):
    proc = run_cli("diagnose", "--simulate", scenario, "--duration", "10", timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    named = set(verdicts(proc.stdout).values())
    assert named & {"gpu-lost", *kinds_of("health"), "pcie-degraded", "c2c"}, proc.stdout


@needs_source
@pytest.mark.parametrize(("scenario", "cell"), [("throttled", "clk: power"),
                                                ("pcie-degraded", "IO: PCIe link"),
                                                ("grace-hopper", "IO: C2C"),
                                                ("nvlink-saturated", "IO: NVLink")])
def test_the_table_names_the_new_causes(scenario, cell):
    proc = run_cli("run", "--simulate", scenario, "--once", "--output", "table")
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if re.match(r"^\s*\d+ \|", line)]
    assert rows and all(line.rstrip().endswith(cell) for line in rows), proc.stdout


@needs_source
@pytest.mark.parametrize(("scenario", "expected"), [("healthy", "none"), ("old-driver", "none"),
                                                    ("pcie-saturated", "pcie"),
                                                    ("fragmented", "fragmentation"),
                                                    ("low-occupancy", "low-occupancy")])
def test_the_seeds_scenarios_keep_their_verdicts_with_the_health_figures(scenario, expected):
    proc = run_cli("diagnose", "--simulate", scenario, *WINDOW)
    assert set(verdicts(proc.stdout).values()) == {expected}, proc.stdout
