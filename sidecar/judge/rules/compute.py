"""The compute layer's kind: small kernels that leave the SMs idle."""

from __future__ import annotations

from sidecar.judge.rule import Deciding, Rule, at, stored
from sidecar.units import ms, pct

LOW_OCCUPANCY = (
    Rule("low-occupancy", "compute", "compute: occ", "small kernels leave the SMs idle",
         "give the SMs more work per launch: batch requests (dynamic batching, a larger maximum "
         "batch), capture the steady path with CUDA graphs "
         "(torch.compile(mode='reduce-overhead')) to remove launch gaps, and fuse small kernels "
         "(torch.compile, fused attention, TensorRT)",
         found=lambda w, t: t.occupancy_explains_latency(w.mean.occupancy, w.p99),
         evidence=lambda w, t: (
             f"SM occupancy {pct(w.mean.occupancy)} (below {t.occupancy_ratio:.0%}) while p99 "
             f"{ms(w.p99)} is above the {ms(t.p99_latency_s)} objective; utilization reads "
             f"{pct(w.mean.utilization)}, tensor {pct(w.mean.tensor)} (alert "
             "GPULowOccupancyAndSlowRequests)"),
         threshold=lambda t: f"SM occupancy below {t.occupancy_ratio:.0%} with p99 above "
                             f"{ms(t.p99_latency_s)}",
         deciding=Deciding(
             (f"avg by (gpu_uuid) (avg_over_time({stored('gpu_sm_occupancy_ratio')}))",
              "histogram_quantile(0.99, sum by (gpu_uuid, le) (increase("
              f"{stored('inference_request_duration_seconds_bucket')})))"),
             ("gpu_uuid",),
             lambda v, t: f"SM occupancy {pct(at(v))} (below {t.occupancy_ratio:.0%}), p99 "
                          f"{ms(at(v, 1))} (above {ms(t.p99_latency_s)})"),
         alerts="""\
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
""")
)
