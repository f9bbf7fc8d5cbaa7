"""The shipped alert rules, rendered from ``sidecar.thresholds``.

    python -m sidecar.alert_rules            # writes deploy/alerts/ and k8s/monitoring/

The rules are a template here, not a file read back, so that a threshold exists in one place;
``tests/test_deploy.py`` fails when the files in the repository differ from what this renders,
and runs ``promtool`` on them. ``%%(name)s`` is a threshold, ``%%%%`` a literal percent sign.
"""

from __future__ import annotations

import dataclasses
import sys
import textwrap
from pathlib import Path

from sidecar.thresholds import THRESHOLDS, Thresholds

_HEADER = """\
# Alert rules for gpu-sidecar. The seed's three alerts, corrected (fragmentation is the
# allocator's, not device memory usage; PCIe against the device's real link maximum; occupancy
# only together with degraded latency), plus the allocator's direct symptom, the GPU's health
# (hardware faults, a pending row remap, throttled clocks, a PCIe link trained down under
# traffic, NVLink-C2C saturated on Grace), the serving engine's (a full KV cache, queueing) and
# the agent's own health. Tested with
# `promtool test rules deploy/alerts/gpu-sidecar.tests.yml`.
# Generated from sidecar/thresholds.py by `python -m sidecar.alert_rules`: edit there, not here.
# The same groups, as a PrometheusRule for the Prometheus Operator: k8s/monitoring/.
"""

_OPERATOR_HEADER = """\
# The rules of deploy/alerts/gpu-sidecar.rules.yml for the Prometheus Operator, generated with
# them from sidecar/thresholds.py by `python -m sidecar.alert_rules`. Select it with your
# Prometheus's ruleSelector (label role: alert-rules).
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: gpu-sidecar
  labels:
    app.kubernetes.io/name: gpu-sidecar
    role: alert-rules
spec:
"""

_GROUPS = """\
groups:
  - name: gpu-sidecar.gpu
    rules:
      - alert: GPUMemoryFragmentationHigh
        # more than %(fragmentation_percent)s %% of the allocator's cache holds no tensor, on a
        # cache worth looking at
        expr: |
          gpu_memory_fragmentation_ratio > %(fragmentation_ratio)s
          and on (namespace, pod, gpu_uuid)
          gpu_allocator_reserved_bytes > %(fragmentation_min_reserved_bytes)s
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: "GPU allocator cache {{ $value | humanizePercentage }} empty on {{ $labels.pod }}"
          description: >-
            The caching allocator of {{ $labels.pod }} ({{ $labels.namespace }}) on GPU
            {{ $labels.gpu_uuid }} holds memory that no tensor uses: large requests may need
            cudaMalloc, flushes and retries. Look at gpu_allocator_nonreleasable_ratio and
            gpu_allocator_largest_free_block_bytes; consider
            PYTORCH_ALLOC_CONF=expandable_segments:True (PYTORCH_CUDA_ALLOC_CONF before
            PyTorch 2.8).

      - alert: GPUAllocatorRetrying
        # the direct symptom: cudaMalloc failed, the cache was flushed and the call retried
        expr: increase(gpu_allocator_alloc_retries_total[5m]) > 0
        for: 0m
        labels:
          severity: warning
        annotations:
          summary: "GPU allocator retries on {{ $labels.pod }}"
          description: >-
            {{ $labels.pod }} needed {{ $value }} allocation retries on GPU {{ $labels.gpu_uuid }}
            in 5 minutes: each one synchronises the device and stalls requests.

      - alert: GPUOutOfMemory
        expr: increase(gpu_allocator_ooms_total[5m]) > 0
        for: 0m
        labels:
          severity: critical
        annotations:
          summary: "CUDA out-of-memory errors on {{ $labels.pod }}"
          description: "{{ $labels.pod }} raised {{ $value }} OOM errors on GPU {{ $labels.gpu_uuid }}."

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

      - alert: GPULowOccupancyAndSlowRequests
        # low occupancy alone is normal for small models; it matters when latency suffers too.
        # %(p99_latency_s)s s is the p99 objective used here: set your own.
        # The latency is the app's (per GPU) or, on a GPU whose app publishes none, the
        # serving engine's (--engine-metrics-url: the pod's, for each of its GPUs).
        expr: |
          (
            avg by (namespace, pod, gpu_uuid) (gpu_sm_occupancy_ratio) < %(occupancy_ratio)s
            and on (namespace, pod, gpu_uuid)
            histogram_quantile(0.99,
              sum by (namespace, pod, gpu_uuid, le) (
                rate(inference_request_duration_seconds_bucket[5m]))
            ) > %(p99_latency_s)s
          )
          or
          (
            avg by (namespace, pod, gpu_uuid) (gpu_sm_occupancy_ratio) < %(occupancy_ratio)s
            unless on (namespace, pod, gpu_uuid) inference_request_duration_seconds_count
            and on (namespace, pod)
            histogram_quantile(0.99,
              sum by (namespace, pod, le) (rate(engine_request_duration_seconds_bucket[5m]))
            ) > %(p99_latency_s)s
          )
        for: 10m
        labels:
          severity: warning
        annotations:
          summary: "Low SM occupancy with slow requests on {{ $labels.pod }}"
          description: >-
            GPU {{ $labels.gpu_uuid }} keeps its SMs mostly empty while p99 latency is above the
            objective: small, fragmented kernels; consider batching, CUDA graphs or fusion.

      - alert: GPUHardwareFault
        # the GPU itself failed: a critical Xid (%(critical_xids_list)s; the first
        # of a code arrives as a new series at 1, which increase() alone would read as 0, hence
        # the second arm), an uncorrected ECC error, or a failed row remap. Each is a reason to
        # drain the node
        expr: |
          label_replace(
            increase(gpu_xid_errors_total{xid=~"%(critical_xids_regex)s"}[10m]) > 0
            or
            (gpu_xid_errors_total{xid=~"%(critical_xids_regex)s"} > 0
              unless gpu_xid_errors_total{xid=~"%(critical_xids_regex)s"} offset 10m),
            "cause", "Xid $1", "xid", "(.+)")
          or
          label_replace(increase(gpu_ecc_uncorrected_volatile_total[10m]) > 0,
            "cause", "uncorrected ECC errors", "", "")
          or
          label_replace(gpu_row_remap_failed == 1, "cause", "a failed row remap", "", "")
        for: 0m
        labels:
          severity: critical
        annotations:
          summary: "Hardware fault on GPU {{ $labels.gpu_uuid }} of {{ $labels.pod }}: {{ $labels.cause }}"
          description: >-
            GPU {{ $labels.gpu_uuid }} ({{ $labels.pod }}, {{ $labels.namespace }}) reported
            {{ $labels.cause }}: its results may be wrong and it needs a reset or a replacement.
            Drain the node, reset the GPU (nvidia-smi -r) and run dcgmi diag; replace it if a
            row remap failed or the fault comes back. dmesg | grep -i xid has the driver's record.

      - alert: GPURowRemapPending
        # a memory row is marked for remapping; the remap takes effect at the GPU's next reset
        # (error containment protects the work meanwhile)
        expr: gpu_row_remap_pending == 1
        for: 0m
        labels:
          severity: warning
        annotations:
          summary: "GPU {{ $labels.gpu_uuid }} of {{ $labels.pod }} waits for a reset to remap a memory row"
          description: >-
            A row remap of GPU {{ $labels.gpu_uuid }} is pending: reset the GPU (nvidia-smi -r)
            once its work is drained to activate it. gpu_remapped_rows_uncorrectable and
            gpu_remapped_rows_correctable count the rows remapped so far.

      - alert: GPUClocksThrottled
        # a limiting reason for more than %(throttle_percent)s %% of 5 minutes on a busy GPU (utilization
        # above %(busy_percent)s %%) whose SM clock averaged below %(throttle_clock_percent)s %% of its
        # maximum; sync boost is not a reason here (it follows the slowest GPU of its group,
        # whose own reason fires there)
        expr: |
          (
%(throttle_reasons_expr)s
          )
          and on (namespace, pod, gpu_uuid)
          avg_over_time(gpu_utilization_ratio[5m]) > %(busy_utilization_ratio)s
          and on (namespace, pod, gpu_uuid)
          avg_over_time(gpu_sm_clock_hertz[5m])
            < %(throttle_clock_ratio)s * avg_over_time(gpu_sm_clock_max_hertz[5m])
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: >-
            GPU {{ $labels.gpu_uuid }} clocks limited by {{ $labels.reason }}
            {{ $value | humanizePercentage }} of the time
          description: >-
            The clocks of GPU {{ $labels.gpu_uuid }} ({{ $labels.pod }}) are held below
            %(throttle_clock_percent)s %% of their maximum while it is busy: every kernel runs slower. Power
            cap: check the power limit (gpu_power_limit_watts) and the workload's power;
            thermal: the airflow (gpu_temperature_celsius); HW slowdown or power brake: the
            board and its power supply.

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

  - name: gpu-sidecar.engine
    rules:
      - alert: GPUEngineKVCacheFull
        # the serving engine's KV cache (--engine-metrics-url) at %(kv_cache_percent)s %% or more
        # while requests are preempted or wait for room: a full cache alone is normal
        expr: |
          max by (namespace, pod, engine, endpoint, model) (
            avg_over_time(engine_kv_cache_usage_ratio[5m])
          ) >= %(kv_cache_full_ratio)s
          and on (namespace, pod, engine, endpoint, model)
          (
            max by (namespace, pod, engine, endpoint, model) (
              increase(engine_preemptions_total[5m])) > 0
            or
            max by (namespace, pod, engine, endpoint, model) (
              avg_over_time(engine_requests_waiting[5m])) >= %(kv_cache_waiting_requests)s
          )
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: "KV cache of {{ $labels.model }} on {{ $labels.pod }} at {{ $value | humanizePercentage }}"
          description: >-
            The {{ $labels.engine }} engine of {{ $labels.pod }} has no KV-cache room left and
            preempts or queues requests: raise gpu_memory_utilization, shorten max_model_len,
            lower the number of concurrent sequences, or add replicas.

      - alert: GPUEngineQueueing
        # requests spend at least %(queue_share_percent)s %% of the p99 latency waiting in the
        # engine's queue, p99 above the %(p99_latency_s)s s objective, and the KV cache is not
        # the reason (GPUEngineKVCacheFull). diagnose also checks that no GPU layer explains it;
        # an engine without queue buckets (Triton: cumulative durations only) is not judged here
        expr: |
          (
            histogram_quantile(0.99, sum by (namespace, pod, engine, endpoint, model, le) (
              rate(engine_request_queue_duration_seconds_bucket[5m])))
            / on (namespace, pod, engine, endpoint, model)
            histogram_quantile(0.99, sum by (namespace, pod, engine, endpoint, model, le) (
              rate(engine_request_duration_seconds_bucket[5m])))
          ) >= %(queue_share_ratio)s
          and on (namespace, pod, engine, endpoint, model)
          histogram_quantile(0.99, sum by (namespace, pod, engine, endpoint, model, le) (
            rate(engine_request_duration_seconds_bucket[5m]))) > %(p99_latency_s)s
          unless on (namespace, pod, engine, endpoint, model)
          avg_over_time(engine_kv_cache_usage_ratio[5m]) >= %(kv_cache_full_ratio)s
        for: 10m
        labels:
          severity: warning
        annotations:
          summary: "{{ $labels.model }} on {{ $labels.pod }}: {{ $value | humanizePercentage }} of p99 queued"
          description: >-
            The {{ $labels.engine }} engine of {{ $labels.pod }} admits requests too slowly for
            the traffic: raise the batch budget (max_num_seqs, max_num_batched_tokens) if the
            GPU has room, or add replicas.

  - name: gpu-sidecar.batch
    rules:
      - alert: GPUJobRunPCIeBound
        # from the run summary a Job's agent sends at its end (--batch-job): the Job's last run
        # kept a GPU's PCIe link saturated for most of its time. It stays while that summary is
        # the newest (the Pushgateway keeps it; remote-write makes it stale after 5 minutes)
        expr: |
          max by (namespace, job_name, gpu_uuid) (
            gpu_run_above_threshold_ratio{condition="pcie_saturated"}
          ) > %(job_saturated_share)s
        for: 0m
        labels:
          severity: info
        annotations:
          summary: "Job {{ $labels.job_name }} PCIe-bound for {{ $value | humanizePercentage }} of its run"
          description: >-
            The last run of Job {{ $labels.job_name }} ({{ $labels.namespace }}) kept GPU
            {{ $labels.gpu_uuid }} above %(pcie_percent)s %% of its PCIe link for most of the run:
            the copies, not the kernels, set its duration. Pinned host memory, prefetching the
            next batch, or fewer host-device round trips shorten it.

  - name: gpu-sidecar.agent
    rules:
      - alert: GPUSidecarPushFailures
        # reported by the agent once a push succeeds again (or through another receiver). Every
        # known reason starts at 0 at the agent's first push; the second arm catches a reason
        # whose series first appears at 1 or more, which increase() alone would read as 0
        expr: |
          increase(gpu_sidecar_push_failures_total[10m]) > 0
          or
          (gpu_sidecar_push_failures_total > 0 unless gpu_sidecar_push_failures_total offset 10m)
        for: 0m
        labels:
          severity: warning
        annotations:
          summary: "gpu-sidecar on {{ $labels.pod }} failed pushes to {{ $labels.sink }}"
          description: "{{ $value }} failed pushes ({{ $labels.reason }}) in 10 minutes."

      - alert: GPUSidecarSilent
        # was reporting within the hour, nothing for 5 minutes: pushes failing, or the agent
        # killed; an agent that stopped cleanly (its pod ended or was deleted) said so with a
        # last gpu_sidecar_up of 0, and is not silent
        expr: |
          group by (namespace, pod) (max_over_time(gpu_sidecar_up[1h]))
          unless
          group by (namespace, pod) (max_over_time(gpu_sidecar_up[5m]))
          unless
          group by (namespace, pod) (last_over_time(gpu_sidecar_up[1h]) == 0)
        for: 0m
        labels:
          severity: warning
        annotations:
          summary: "No data from gpu-sidecar on {{ $labels.pod }} for 5 minutes"

      - alert: GPUSidecarSpoolGrowing
        expr: gpu_sidecar_spool_bytes{state="pending"} > 33554432
        for: 10m
        labels:
          severity: warning
        annotations:
          summary: "gpu-sidecar spool of {{ $labels.pod }} holds {{ $value | humanize1024 }}B"
          description: "The receiver {{ $labels.sink }} is not keeping up; data waits on disk."

      - alert: GPUSidecarSpoolVolumeRefusing
        # the spool volume refuses writes (full, read-only): batches wait in memory, delivered
        # while the receiver takes them, lost if the agent dies or the receiver is out too; a
        # nearly full volume takes one write and refuses the next, hence half of a window, which
        # a single refused write does not reach
        expr: avg_over_time(gpu_sidecar_spool_write_failing[10m]) >= 0.5
        for: 5m
        labels:
          severity: warning
        annotations:
          summary: "gpu-sidecar on {{ $labels.pod }} cannot write its spool volume"
          description: "Batches for {{ $labels.sink }} wait in memory: free the spool volume."

      - alert: GPUSidecarSamplesDropped
        expr: |
          increase(gpu_sidecar_samples_dropped_total{reason=~
            "spool_full|spool_write_failed|rejected|corrupt|unreadable|partial_success|unencodable"
          }[15m]) > 0
          or
          (gpu_sidecar_samples_dropped_total{reason=~
            "spool_full|spool_write_failed|rejected|corrupt|unreadable|partial_success|unencodable"
          } > 0
            unless gpu_sidecar_samples_dropped_total offset 15m)
        for: 0m
        labels:
          severity: warning
        annotations:
          summary: "gpu-sidecar on {{ $labels.pod }} lost samples ({{ $labels.reason }})"

      - alert: GPUSidecarAppFiguresStale
        # the agent runs, but the model server stopped publishing (or never started)
        expr: |
          increase(gpu_sidecar_app_messages_accepted_total[10m]) == 0
          and on (namespace, pod) gpu_sidecar_up == 1
        for: 5m
        labels:
          severity: info
        annotations:
          summary: "No app figures from {{ $labels.pod }} for 15 minutes"
          description: "Allocator and latency series are missing: is sidecar.client started?"

      - alert: GPUSidecarGPUUnavailable
        expr: gpu_sidecar_gpu_available == 0
        for: 2m
        labels:
          severity: critical
        annotations:
          summary: "GPU {{ $labels.gpu_uuid }} of {{ $labels.pod }} cannot be read"
          description: "Lost (fallen off the bus) or not visible to the agent; see its log."
"""

# the limiting reasons of GPUClocksThrottled (series gpu_clocks_event_<reason>_ratio) and the
# name its alert carries in the label "reason"; sync boost is not one (see thresholds.throttled)
THROTTLE_REASONS = (("power_cap", "power cap"), ("hw_slowdown", "HW slowdown"),
                    ("hw_thermal", "HW thermal"), ("hw_power_brake", "HW power brake"),
                    ("sw_thermal", "SW thermal"))
RULES_FILE = Path("deploy/alerts/gpu-sidecar.rules.yml")
OPERATOR_FILE = Path("k8s/monitoring/prometheusrule.yaml")


def _values(t: Thresholds) -> dict[str, object]:
    values: dict[str, object] = {k: f"{v:g}" if isinstance(v, float) else v
                                 for k, v in dataclasses.asdict(t).items()}
    values["fragmentation_percent"] = f"{100 * t.fragmentation_ratio:g}"
    values["pcie_percent"] = f"{100 * t.pcie_util_ratio:g}"
    values["critical_xids_regex"] = "|".join(str(c) for c in t.critical_xids)
    values["critical_xids_list"] = ", ".join(str(c) for c in t.critical_xids)
    values["throttle_percent"] = f"{100 * t.throttle_ratio:g}"
    values["throttle_clock_percent"] = f"{100 * t.throttle_clock_ratio:g}"
    values["busy_percent"] = f"{100 * t.busy_utilization_ratio:g}"
    values["pcie_degraded_percent"] = f"{100 * t.pcie_degraded_traffic_ratio:g}"
    values["kv_cache_percent"] = f"{100 * t.kv_cache_full_ratio:g}"
    values["queue_share_percent"] = f"{100 * t.queue_share_ratio:g}"
    values["throttle_reasons_expr"] = "\n            or\n".join(
        f'            label_replace(avg_over_time(gpu_clocks_event_{reason}_ratio[5m])'
        f' > {t.throttle_ratio:g},\n              "reason", "{name}", "", "")'
        for reason, name in THROTTLE_REASONS)
    return values


def rules(t: Thresholds = THRESHOLDS) -> str:
    """The Prometheus rule file."""
    return _HEADER + _GROUPS % _values(t)


def prometheus_rule(t: Thresholds = THRESHOLDS) -> str:
    """The same groups as a ``PrometheusRule`` object."""
    return _OPERATOR_HEADER + textwrap.indent(_GROUPS % _values(t), "  ")


def write(root: Path, t: Thresholds = THRESHOLDS) -> None:
    (root / RULES_FILE).write_text(rules(t))
    (root / OPERATOR_FILE).write_text(prometheus_rule(t))


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else Path.cwd())
