"""The IO layer's kinds: PCIe trained down or saturated, NVLink-C2C, NVLink."""

from __future__ import annotations

from sidecar.judge.rule import Deciding, Rule, at, either, stored, whole
from sidecar.judge.window import Window
from sidecar.thresholds import Thresholds
from sidecar.units import gbps, link, ms, pct


def _degraded_evidence(w: Window, t: Thresholds) -> str:
    b, m = w.below_max, w.mean
    assert b is not None
    saturated = max(b.pcie_tx_now_ratio or 0.0, b.pcie_rx_now_ratio or 0.0) > t.pcie_util_ratio
    errors = ""
    if any(w.increases.get(k) for k in ("l0_recovery", "replays", "pcie_correctable")):
        errors = (f"; during the window the link left L0 for recovery "
                  f"{w.increases.get('l0_recovery', 0):.0f} times, replayed "
                  f"{w.increases.get('replays', 0):.0f} packets and corrected "
                  f"{w.increases.get('pcie_correctable', 0):.0f} errors")
    return (
        f"the link ran at {link(b.link_gen_now, b.link_width_now)} ({gbps(b.link_now)} per "
        f"direction) of its {link(m.link_gen, m.link_width)} maximum ({gbps(m.link_max)}) in "
        f"{w.below_max_samples} of {w.link_samples} samples, carrying RX "
        f"{pct(b.pcie_rx_now_ratio)} ({gbps(b.pcie_rx)}), TX {pct(b.pcie_tx_now_ratio)} "
        f"({gbps(b.pcie_tx)}) of the link as trained (above {t.pcie_degraded_traffic_ratio:.0%}"
        + ("; saturated" if saturated else "")
        + f"), which is RX {pct(b.pcie_rx_ratio)}, TX {pct(b.pcie_tx_ratio)} of the maximum "
        f"link{errors} (alert GPUPcieLinkDegraded)")


def _degraded(w: Window, t: Thresholds) -> bool:
    b = w.below_max
    return (b is not None and 2 * w.below_max_samples > w.link_samples
            and t.pcie_degraded(True, b.pcie_tx_now_ratio, b.pcie_rx_now_ratio))



PCIE_DEGRADED = (
    Rule("pcie-degraded", "IO", "IO: PCIe link", "the PCIe link trained below its maximum",
         "reseat the GPU (and its riser or cable), check the slot (its electrical width, a "
         "bifurcation of x16 into x8x8) and the BIOS's PCIe settings (a generation forced low, "
         "ASPM); compare LnkCap with LnkSta in `lspci -vv -s BUS_ID` and `nvidia-smi -q -d PCIE`; "
         "a link that keeps leaving L0 for recovery or replaying "
         "(gpu_pcie_l0_to_recovery_total, gpu_pcie_replay_errors_total) is a failing slot, "
         "riser or card: move the GPU to another slot to tell which; until then the copy "
         "remedies of `pcie` apply to the slower link",
         found=lambda w, t: _degraded(w, t),
         evidence=lambda w, t: _degraded_evidence(w, t),
         threshold=lambda t: f"a PCIe link below its maximum carrying over "
                             f"{t.pcie_degraded_traffic_ratio:.0%} of the link as trained",
         deciding=Deciding(
             (f"min by (gpu_uuid) (min_over_time({stored('gpu_pcie_link_current_generation')}))",
              f"max by (gpu_uuid) (max_over_time({stored('gpu_pcie_link_generation')}))"),
             ("gpu_uuid",),
             lambda v, t: f"link trained at Gen{whole(at(v))} of its Gen{whole(at(v, 1))} "
                          "maximum"),
         alerts="""\
      - alert: GPUPcieLinkDegraded
        # the link trained below its maximum generation or width while either direction carries
        # more than %(pcie_degraded_percent)s %% of the link as trained: an idle link trains down to save
        # power and is never this alert
        expr: |
          max by (namespace, pod, gpu_uuid, gpu_name, gpu_index) (
            {__name__=~"gpu_pcie_(tx|rx)_current_link_util_ratio"}
          ) > %(pcie_degraded_traffic_ratio)s
          and on (namespace, pod, gpu_uuid)
          (
            gpu_pcie_link_current_generation < gpu_pcie_link_generation
            or
            gpu_pcie_link_current_width < gpu_pcie_link_width
          )
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: >-
            PCIe link of GPU {{ $labels.gpu_uuid }} below its maximum, at
            {{ $value | humanizePercentage }} of the link as trained
          description: >-
            The PCIe link of GPU {{ $labels.gpu_uuid }} ({{ $labels.pod }}) carries traffic
            while trained below its maximum: compare gpu_pcie_link_current_generation/width
            with gpu_pcie_link_generation/width. Reseat the GPU, check the slot, the riser and
            the BIOS's PCIe settings.
""")
)


PCIE = (
    Rule("pcie", "IO", "IO: PCIe", "the PCIe link is saturated",
         "pin host buffers (DataLoader(pin_memory=True), tensor.pin_memory()) and copy with "
         "non_blocking=True; prefetch the next batch on a side CUDA stream so copies overlap "
         "compute; keep weights and reused inputs resident on the GPU instead of re-uploading; "
         "send smaller dtypes or pre-processed tensors; return only what the client needs "
         "(top-k on the GPU) for TX; check gpu_pcie_link_generation/width for a link trained "
         "down, or give --pcie-peak-bytes-per-second a measured peak",
         found=lambda w, t: t.pcie_saturated(w.mean.pcie_tx_ratio, w.mean.pcie_rx_ratio),
         evidence=lambda w, t: (
             f"PCIe RX {pct(w.mean.pcie_rx_ratio)} ({gbps(w.mean.pcie_rx)}), TX "
             f"{pct(w.mean.pcie_tx_ratio)} ({gbps(w.mean.pcie_tx)}) of the link's "
             f"{gbps(w.mean.link_max)}, above {t.pcie_util_ratio:.0%} (alert GPUPCIeSaturated)"),
         threshold=lambda t: f"PCIe above {t.pcie_util_ratio:.0%} of the link",
         deciding=Deciding(
             (either("gpu_pcie_rx_bandwidth_util_ratio", "gpu_pcie_tx_bandwidth_util_ratio"),),
             ("gpu_uuid",),
             lambda v, t: f"PCIe {pct(at(v))} of the link (above {t.pcie_util_ratio:.0%})"),
         alerts="""\
      - alert: GPUPCIeSaturated
        # either direction above %(pcie_percent)s %% of the link maximum (the device's max generation x width,
        # or the calibrated peak given to the agent)
        expr: |
          max by (namespace, pod, gpu_uuid, gpu_name) (
            {__name__=~"gpu_pcie_(tx|rx)_bandwidth_util_ratio"}
          ) > %(pcie_util_ratio)s
        for: 3m
        labels:
          severity: warning
        annotations:
          summary: "PCIe link of GPU {{ $labels.gpu_uuid }} at {{ $value | humanizePercentage }}"
          description: >-
            Host-device copies on {{ $labels.pod }} use more than %(pcie_percent)s %% of the PCIe link: model
            loads, large batches or pageable copies. gpu_pcie_link_max_bytes_per_second shows the
            maximum used.
""")
)


C2C = (
    Rule("c2c", "IO", "IO: C2C", "the NVLink-C2C link to the Grace CPU is saturated",
         "the GPU streams host (Grace) memory at the link's limit: keep what kernels reuse in "
         "HBM (weights, the KV cache: no CPU offload of hot tensors), place managed memory on "
         "the GPU before use (cudaMemPrefetchAsync, cudaMemAdvise with SetPreferredLocation) "
         "instead of faulting pages across the link, do not oversubscribe HBM with unified "
         "memory, and batch host copies into large ones that overlap compute on a side stream",
         found=lambda w, t: t.c2c_saturated(w.mean.c2c_tx_ratio, w.mean.c2c_rx_ratio),
         evidence=lambda w, t: (
             f"NVLink-C2C RX {pct(w.mean.c2c_rx_ratio)} ({gbps(w.mean.c2c_rx)}), TX "
             f"{pct(w.mean.c2c_tx_ratio)} ({gbps(w.mean.c2c_tx)}) of the links' "
             f"{gbps(w.mean.c2c_max)}, above {t.pcie_util_ratio:.0%} (alert GPUC2CSaturated)"),
         threshold=lambda t: f"NVLink-C2C above {t.pcie_util_ratio:.0%} of its maximum",
         deciding=Deciding(
             (either("gpu_c2c_rx_bandwidth_util_ratio", "gpu_c2c_tx_bandwidth_util_ratio"),),
             ("gpu_uuid",),
             lambda v, t: f"NVLink-C2C {pct(at(v))} of its maximum (above "
                          f"{t.pcie_util_ratio:.0%})"),
         alerts="""\
      - alert: GPUC2CSaturated
        # Grace Hopper / Grace Blackwell: either direction of NVLink-C2C, the host link there,
        # above %(pcie_percent)s %% of its maximum
        expr: |
          max by (namespace, pod, gpu_uuid, gpu_name) (
            {__name__=~"gpu_c2c_(tx|rx)_bandwidth_util_ratio"}
          ) > %(pcie_util_ratio)s
        for: 3m
        labels:
          severity: warning
        annotations:
          summary: "NVLink-C2C of GPU {{ $labels.gpu_uuid }} at {{ $value | humanizePercentage }}"
          description: >-
            Host memory traffic of {{ $labels.pod }} uses more than %(pcie_percent)s %% of the C2C link to
            the Grace CPU: keep reused data in HBM, prefetch managed memory to the GPU, avoid
            oversubscribing HBM.
""")
)


NVLINK = (
    Rule("nvlink", "IO", "IO: NVLink", "NVLink between the GPUs is saturated",
         "the tensor-parallel all-reduce fills the links: check the tensor-parallel degree against "
         "the model's size (a model that fits on fewer GPUs runs faster with a smaller TP degree "
         "and more replicas, or with pipeline parallelism across nodes instead of a wider TP "
         "group); overlap communication with compute (the engine's async or fused all-reduce, "
         "NCCL on a side stream); keep each TP group within one NVSwitch domain, on GPUs "
         "connected by NVLink (`nvidia-smi topo -m`: NV# between each pair, not PIX/PHB/SYS), "
         "and check `nvidia-smi nvlink -s` for a link down or running slow",
         found=lambda w, t: t.nvlink_saturated(w.mean.nvlink_tx_ratio, w.mean.nvlink_rx_ratio,
                                               w.mean.utilization, w.p99),
         evidence=lambda w, t: (
             f"NVLink RX {pct(w.mean.nvlink_rx_ratio)} ({gbps(w.mean.nvlink_rx)}), TX "
             f"{pct(w.mean.nvlink_tx_ratio)} ({gbps(w.mean.nvlink_tx)}) of the active links' "
             f"{gbps(w.mean.nvlink_max)}, above {t.nvlink_util_ratio:.0%}, while utilization is "
             f"{pct(w.mean.utilization)} (busy above {t.busy_utilization_ratio:.0%}) and p99 "
             f"{ms(w.p99)} (objective {ms(t.p99_latency_s)}); SM occupancy "
             f"{pct(w.mean.occupancy)} (alert GPUNVLinkSaturated)"),
         threshold=lambda t: f"NVLink above {t.nvlink_util_ratio:.0%} of its maximum on a busy "
                             "GPU or with p99 above the objective",
         deciding=Deciding(
             (either("gpu_nvlink_rx_bandwidth_util_ratio",
                      "gpu_nvlink_tx_bandwidth_util_ratio"),),
             ("gpu_uuid",),
             lambda v, t: f"NVLink {pct(at(v))} of its maximum (above "
                          f"{t.nvlink_util_ratio:.0%})"),
         alerts="""\
      - alert: GPUNVLinkSaturated
        # either direction of NVLink between the GPUs above %(nvlink_util_ratio)s of the active
        # links' maximum while the GPU is busy (utilization above %(busy_utilization_ratio)s) or the
        # app's p99 is above the %(p99_latency_s)s s objective: a full link on an idle GPU with
        # fast requests costs nothing yet
        expr: |
          max by (namespace, pod, gpu_uuid, gpu_name) (
            {__name__=~"gpu_nvlink_(tx|rx)_bandwidth_util_ratio"}
          ) > %(nvlink_util_ratio)s
          and on (namespace, pod, gpu_uuid)
          (
            max by (namespace, pod, gpu_uuid) (
              avg_over_time(gpu_utilization_ratio[5m])
            ) > %(busy_utilization_ratio)s
            or
            histogram_quantile(0.99,
              sum by (namespace, pod, gpu_uuid, le) (
                rate(inference_request_duration_seconds_bucket[5m]))
            ) > %(p99_latency_s)s
          )
        for: 3m
        labels:
          severity: warning
        annotations:
          summary: "NVLink of GPU {{ $labels.gpu_uuid }} at {{ $value | humanizePercentage }}"
          description: >-
            The GPUs of {{ $labels.pod }} exchange more over NVLink than its links carry: with
            tensor parallelism every layer waits for its all-reduce. Check the tensor-parallel
            degree against the model size, overlap communication with compute, and keep the
            group on NVLink-connected GPUs (nvidia-smi topo -m). gpu_nvlink_link_max_bytes_per_second
            shows the maximum used.
""")
)
