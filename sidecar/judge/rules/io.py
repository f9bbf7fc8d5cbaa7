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
         doc_when=("the link below its maximum generation or width in most samples while carrying "
                   "> %(pcie_degraded_percent)s %% of the link as trained (both shares shown)"),
         doc_todo="reseat the GPU, check the slot, riser and BIOS",
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
""",
         alert_tests="""\
  - name: a PCIe link below its maximum fires only while traffic flows
    interval: 1m
    input_series:
      # a Gen5 x16 GPU whose link trained at Gen3 x8, host-to-device copies at 95 % of it
      - series: 'gpu_pcie_link_generation{namespace="ml",pod="llm-0",gpu_uuid="GPU-g",gpu_name="H200",gpu_index="0"}'
        values: '5x20'
      - series: 'gpu_pcie_link_width{namespace="ml",pod="llm-0",gpu_uuid="GPU-g",gpu_name="H200",gpu_index="0"}'
        values: '16x20'
      - series: 'gpu_pcie_link_current_generation{namespace="ml",pod="llm-0",gpu_uuid="GPU-g",gpu_name="H200",gpu_index="0"}'
        values: '3x20'
      - series: 'gpu_pcie_link_current_width{namespace="ml",pod="llm-0",gpu_uuid="GPU-g",gpu_name="H200",gpu_index="0"}'
        values: '8x20'
      - series: 'gpu_pcie_rx_current_link_util_ratio{namespace="ml",pod="llm-0",gpu_uuid="GPU-g",gpu_name="H200",gpu_index="0"}'
        values: '0.95x20'
      - series: 'gpu_pcie_tx_current_link_util_ratio{namespace="ml",pod="llm-0",gpu_uuid="GPU-g",gpu_name="H200",gpu_index="0"}'
        values: '0.1x20'
      # the full generation on half the lanes, half of that link in use
      - series: 'gpu_pcie_link_generation{namespace="ml",pod="llm-0",gpu_uuid="GPU-w",gpu_name="H200",gpu_index="1"}'
        values: '5x20'
      - series: 'gpu_pcie_link_width{namespace="ml",pod="llm-0",gpu_uuid="GPU-w",gpu_name="H200",gpu_index="1"}'
        values: '16x20'
      - series: 'gpu_pcie_link_current_generation{namespace="ml",pod="llm-0",gpu_uuid="GPU-w",gpu_name="H200",gpu_index="1"}'
        values: '5x20'
      - series: 'gpu_pcie_link_current_width{namespace="ml",pod="llm-0",gpu_uuid="GPU-w",gpu_name="H200",gpu_index="1"}'
        values: '8x20'
      - series: 'gpu_pcie_rx_current_link_util_ratio{namespace="ml",pod="llm-0",gpu_uuid="GPU-w",gpu_name="H200",gpu_index="1"}'
        values: '0.5x20'
      - series: 'gpu_pcie_tx_current_link_util_ratio{namespace="ml",pod="llm-0",gpu_uuid="GPU-w",gpu_name="H200",gpu_index="1"}'
        values: '0.1x20'
      # idle, trained down to Gen1 x16 to save power: never this alert
      - series: 'gpu_pcie_link_generation{namespace="ml",pod="llm-0",gpu_uuid="GPU-i",gpu_name="H200",gpu_index="2"}'
        values: '5x20'
      - series: 'gpu_pcie_link_width{namespace="ml",pod="llm-0",gpu_uuid="GPU-i",gpu_name="H200",gpu_index="2"}'
        values: '16x20'
      - series: 'gpu_pcie_link_current_generation{namespace="ml",pod="llm-0",gpu_uuid="GPU-i",gpu_name="H200",gpu_index="2"}'
        values: '1x20'
      - series: 'gpu_pcie_link_current_width{namespace="ml",pod="llm-0",gpu_uuid="GPU-i",gpu_name="H200",gpu_index="2"}'
        values: '16x20'
      - series: 'gpu_pcie_rx_current_link_util_ratio{namespace="ml",pod="llm-0",gpu_uuid="GPU-i",gpu_name="H200",gpu_index="2"}'
        values: '0.01x20'
      - series: 'gpu_pcie_tx_current_link_util_ratio{namespace="ml",pod="llm-0",gpu_uuid="GPU-i",gpu_name="H200",gpu_index="2"}'
        values: '0.002x20'
      # at its maximum and busy (90 %): GPUPCIeSaturated's business, not a degraded link
      - series: 'gpu_pcie_link_generation{namespace="ml",pod="llm-0",gpu_uuid="GPU-h",gpu_name="H200",gpu_index="3"}'
        values: '5x20'
      - series: 'gpu_pcie_link_width{namespace="ml",pod="llm-0",gpu_uuid="GPU-h",gpu_name="H200",gpu_index="3"}'
        values: '16x20'
      - series: 'gpu_pcie_link_current_generation{namespace="ml",pod="llm-0",gpu_uuid="GPU-h",gpu_name="H200",gpu_index="3"}'
        values: '5x20'
      - series: 'gpu_pcie_link_current_width{namespace="ml",pod="llm-0",gpu_uuid="GPU-h",gpu_name="H200",gpu_index="3"}'
        values: '16x20'
      - series: 'gpu_pcie_rx_current_link_util_ratio{namespace="ml",pod="llm-0",gpu_uuid="GPU-h",gpu_name="H200",gpu_index="3"}'
        values: '0.9x20'
    alert_rule_test:
      - eval_time: 3m
        alertname: GPUPcieLinkDegraded
        exp_alerts: []   # pending
      - eval_time: 7m
        alertname: GPUPcieLinkDegraded
        exp_alerts:
          - exp_labels: {severity: warning, namespace: ml, pod: llm-0, gpu_uuid: GPU-g, gpu_name: H200, gpu_index: "0"}
            exp_annotations:
              summary: "PCIe link of GPU GPU-g below its maximum, at 95% of the link as trained"
              description: "The PCIe link of GPU GPU-g (llm-0) carries traffic while trained below its maximum: compare gpu_pcie_link_current_generation/width with gpu_pcie_link_generation/width. Reseat the GPU, check the slot, the riser and the BIOS's PCIe settings."
          - exp_labels: {severity: warning, namespace: ml, pod: llm-0, gpu_uuid: GPU-w, gpu_name: H200, gpu_index: "1"}
            exp_annotations:
              summary: "PCIe link of GPU GPU-w below its maximum, at 50% of the link as trained"
              description: "The PCIe link of GPU GPU-w (llm-0) carries traffic while trained below its maximum: compare gpu_pcie_link_current_generation/width with gpu_pcie_link_generation/width. Reseat the GPU, check the slot, the riser and the BIOS's PCIe settings."
""")  # noqa: E501
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
         doc_when="TX or RX > %(pcie_percent)s %% of the link maximum",
         doc_todo=("pinned memory and `non_blocking` copies, prefetch on a side stream, keep data "
                   "resident"),
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
""",
         alert_tests="""\
  - name: PCIe saturation in either direction fires after 3 minutes
    interval: 1m
    input_series:
      - series: 'gpu_pcie_rx_bandwidth_util_ratio{namespace="ml",pod="llm-0",gpu_uuid="GPU-a",gpu_name="H200",gpu_index="0"}'
        values: '0.3 0.3 0.91 0.92 0.9 0.9 0.9 0.9 0.9 0.9'
      - series: 'gpu_pcie_tx_bandwidth_util_ratio{namespace="ml",pod="llm-0",gpu_uuid="GPU-a",gpu_name="H200",gpu_index="0"}'
        values: '0.1x10'
      - series: 'gpu_pcie_rx_bandwidth_util_ratio{namespace="ml",pod="llm-2",gpu_uuid="GPU-d",gpu_name="H200",gpu_index="0"}'
        values: '0.79x10'
      - series: 'gpu_pcie_tx_bandwidth_util_ratio{namespace="ml",pod="llm-2",gpu_uuid="GPU-d",gpu_name="H200",gpu_index="0"}'
        values: '0.5x10'
    alert_rule_test:
      - eval_time: 4m
        alertname: GPUPCIeSaturated
        exp_alerts: []   # pending since 2m
      - eval_time: 6m
        alertname: GPUPCIeSaturated
        exp_alerts:
          - exp_labels: {severity: warning, namespace: ml, pod: llm-0, gpu_uuid: GPU-a, gpu_name: H200}
            exp_annotations:
              summary: "PCIe link of GPU GPU-a at 90%"
              description: "Host-device copies on llm-0 use more than 80 % of the PCIe link: model loads, large batches or pageable copies. gpu_pcie_link_max_bytes_per_second shows the maximum used."
""")  # noqa: E501
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
         doc_when=("NVLink-C2C (Grace Hopper / Blackwell) TX or RX > %(pcie_percent)s %% of its "
                   "maximum"),
         doc_todo="keep data in HBM, prefetch managed memory",
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
""",
         alert_tests="""\
  - name: NVLink-C2C saturation on Grace fires after 3 minutes
    interval: 1m
    input_series:
      - series: 'gpu_c2c_rx_bandwidth_util_ratio{namespace="ml",pod="llm-0",gpu_uuid="GPU-gh",gpu_name="GH200",gpu_index="0"}'
        values: '0.2 0.9x12'
      - series: 'gpu_c2c_tx_bandwidth_util_ratio{namespace="ml",pod="llm-0",gpu_uuid="GPU-gh",gpu_name="GH200",gpu_index="0"}'
        values: '0.1x12'
      - series: 'gpu_c2c_rx_bandwidth_util_ratio{namespace="ml",pod="llm-1",gpu_uuid="GPU-gk",gpu_name="GH200",gpu_index="0"}'
        values: '0.6x12'
      - series: 'gpu_c2c_tx_bandwidth_util_ratio{namespace="ml",pod="llm-1",gpu_uuid="GPU-gk",gpu_name="GH200",gpu_index="0"}'
        values: '0.79x12'
    alert_rule_test:
      - eval_time: 3m
        alertname: GPUC2CSaturated
        exp_alerts: []   # pending since 1m
      - eval_time: 5m
        alertname: GPUC2CSaturated
        exp_alerts:
          - exp_labels: {severity: warning, namespace: ml, pod: llm-0, gpu_uuid: GPU-gh, gpu_name: GH200}
            exp_annotations:
              summary: "NVLink-C2C of GPU GPU-gh at 90%"
              description: "Host memory traffic of llm-0 uses more than 80 % of the C2C link to the Grace CPU: keep reused data in HBM, prefetch managed memory to the GPU, avoid oversubscribing HBM."
""")  # noqa: E501
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
         doc_when=("NVLink between the GPUs: TX or RX > %(nvlink_percent)s %% of the active "
                   "links' maximum while utilization > %(busy_percent)s %% or p99 > "
                   "%(p99_latency_s)s s"),
         doc_todo=("a smaller tensor-parallel degree (more replicas, or pipeline parallelism "
                   "across nodes) for a model that fits, overlap communication with compute, keep "
                   "the TP group within one NVSwitch domain (`nvidia-smi topo -m`)"),
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
""",
         alert_tests="""\
  - name: NVLink saturation fires after 3 minutes on a busy GPU or with p99 up, not on an idle or a quiet link
    interval: 1m
    input_series:
      # tensor parallel, busy: RX at 90 % of the links' maximum, utilization 95 %
      - series: 'gpu_nvlink_rx_bandwidth_util_ratio{namespace="ml",pod="tp-0",gpu_uuid="GPU-t0",gpu_name="H200",gpu_index="0"}'
        values: '0.2 0.9x12'
      - series: 'gpu_nvlink_tx_bandwidth_util_ratio{namespace="ml",pod="tp-0",gpu_uuid="GPU-t0",gpu_name="H200",gpu_index="0"}'
        values: '0.1 0.85x11'
      - series: 'gpu_utilization_ratio{namespace="ml",pod="tp-0",gpu_uuid="GPU-t0",gpu_name="H200",gpu_index="0"}'
        values: '0.95x12'
      # the same link on a GPU that reads 30 % busy, but p99 is ~0.5 s: the latency arm
      - series: 'gpu_nvlink_rx_bandwidth_util_ratio{namespace="ml",pod="tp-1",gpu_uuid="GPU-t1",gpu_name="H200",gpu_index="0"}'
        values: '0.9x12'
      - series: 'gpu_nvlink_tx_bandwidth_util_ratio{namespace="ml",pod="tp-1",gpu_uuid="GPU-t1",gpu_name="H200",gpu_index="0"}'
        values: '0.9x12'
      - series: 'gpu_utilization_ratio{namespace="ml",pod="tp-1",gpu_uuid="GPU-t1",gpu_name="H200",gpu_index="0"}'
        values: '0.3x12'
      - series: 'inference_request_duration_seconds_bucket{namespace="ml",pod="tp-1",gpu_uuid="GPU-t1",gpu_name="H200",gpu_index="0",le="0.1"}'
        values: '0x12'
      - series: 'inference_request_duration_seconds_bucket{namespace="ml",pod="tp-1",gpu_uuid="GPU-t1",gpu_name="H200",gpu_index="0",le="0.3"}'
        values: '0x12'
      - series: 'inference_request_duration_seconds_bucket{namespace="ml",pod="tp-1",gpu_uuid="GPU-t1",gpu_name="H200",gpu_index="0",le="0.5"}'
        values: '0+600x12'
      - series: 'inference_request_duration_seconds_bucket{namespace="ml",pod="tp-1",gpu_uuid="GPU-t1",gpu_name="H200",gpu_index="0",le="+Inf"}'
        values: '0+600x12'
      # an idle link on a busy GPU: not this alert's business
      - series: 'gpu_nvlink_rx_bandwidth_util_ratio{namespace="ml",pod="idle-0",gpu_uuid="GPU-i",gpu_name="H200",gpu_index="0"}'
        values: '0x12'
      - series: 'gpu_nvlink_tx_bandwidth_util_ratio{namespace="ml",pod="idle-0",gpu_uuid="GPU-i",gpu_name="H200",gpu_index="0"}'
        values: '0x12'
      - series: 'gpu_utilization_ratio{namespace="ml",pod="idle-0",gpu_uuid="GPU-i",gpu_name="H200",gpu_index="0"}'
        values: '0.95x12'
      # a busy link below the line (79 %)
      - series: 'gpu_nvlink_rx_bandwidth_util_ratio{namespace="ml",pod="below-0",gpu_uuid="GPU-l",gpu_name="H200",gpu_index="0"}'
        values: '0.79x12'
      - series: 'gpu_nvlink_tx_bandwidth_util_ratio{namespace="ml",pod="below-0",gpu_uuid="GPU-l",gpu_name="H200",gpu_index="0"}'
        values: '0.7x12'
      - series: 'gpu_utilization_ratio{namespace="ml",pod="below-0",gpu_uuid="GPU-l",gpu_name="H200",gpu_index="0"}'
        values: '0.95x12'
      # a full link on a quiet GPU with fast requests (a weight reshard): costs nothing yet
      - series: 'gpu_nvlink_rx_bandwidth_util_ratio{namespace="ml",pod="quiet-0",gpu_uuid="GPU-q",gpu_name="H200",gpu_index="0"}'
        values: '0.95x12'
      - series: 'gpu_nvlink_tx_bandwidth_util_ratio{namespace="ml",pod="quiet-0",gpu_uuid="GPU-q",gpu_name="H200",gpu_index="0"}'
        values: '0.95x12'
      - series: 'gpu_utilization_ratio{namespace="ml",pod="quiet-0",gpu_uuid="GPU-q",gpu_name="H200",gpu_index="0"}'
        values: '0.2x12'
      - series: 'inference_request_duration_seconds_bucket{namespace="ml",pod="quiet-0",gpu_uuid="GPU-q",gpu_name="H200",gpu_index="0",le="0.1"}'
        values: '0+600x12'
      - series: 'inference_request_duration_seconds_bucket{namespace="ml",pod="quiet-0",gpu_uuid="GPU-q",gpu_name="H200",gpu_index="0",le="0.3"}'
        values: '0+600x12'
      - series: 'inference_request_duration_seconds_bucket{namespace="ml",pod="quiet-0",gpu_uuid="GPU-q",gpu_name="H200",gpu_index="0",le="0.5"}'
        values: '0+600x12'
      - series: 'inference_request_duration_seconds_bucket{namespace="ml",pod="quiet-0",gpu_uuid="GPU-q",gpu_name="H200",gpu_index="0",le="+Inf"}'
        values: '0+600x12'
    alert_rule_test:
      - eval_time: 3m
        alertname: GPUNVLinkSaturated
        exp_alerts: []   # pending since 1m (tp-1: its p99 needs two points of the histogram)
      - eval_time: 5m
        alertname: GPUNVLinkSaturated
        exp_alerts:
          - exp_labels: {severity: warning, namespace: ml, pod: tp-0, gpu_uuid: GPU-t0, gpu_name: H200}
            exp_annotations:
              summary: "NVLink of GPU GPU-t0 at 90%"
              description: "The GPUs of tp-0 exchange more over NVLink than its links carry: with tensor parallelism every layer waits for its all-reduce. Check the tensor-parallel degree against the model size, overlap communication with compute, and keep the group on NVLink-connected GPUs (nvidia-smi topo -m). gpu_nvlink_link_max_bytes_per_second shows the maximum used."
          - exp_labels: {severity: warning, namespace: ml, pod: tp-1, gpu_uuid: GPU-t1, gpu_name: H200}
            exp_annotations:
              summary: "NVLink of GPU GPU-t1 at 90%"
              description: "The GPUs of tp-1 exchange more over NVLink than its links carry: with tensor parallelism every layer waits for its all-reduce. Check the tensor-parallel degree against the model size, overlap communication with compute, and keep the group on NVLink-connected GPUs (nvidia-smi topo -m). gpu_nvlink_link_max_bytes_per_second shows the maximum used."
""")  # noqa: E501
)
