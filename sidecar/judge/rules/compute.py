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
         doc_when="SM occupancy < %(occupancy_percent)s %% **and** p99 > %(p99_latency_s)s s",
         doc_todo="batching, CUDA graphs, kernel fusion",
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
""",
         alert_tests="""\
  - name: low occupancy fires only with degraded p99 latency
    interval: 1m
    input_series:
      # slow: every request between 0.3 and 0.5 s; occupancy 18 %
      - series: 'gpu_sm_occupancy_ratio{namespace="ml",pod="slow-0",gpu_uuid="GPU-s",gpu_name="H200",gpu_index="0"}'
        values: '0.18x30'
      - series: 'inference_request_duration_seconds_bucket{namespace="ml",pod="slow-0",gpu_uuid="GPU-s",gpu_name="H200",gpu_index="0",le="0.1"}'
        values: '0x30'
      - series: 'inference_request_duration_seconds_bucket{namespace="ml",pod="slow-0",gpu_uuid="GPU-s",gpu_name="H200",gpu_index="0",le="0.3"}'
        values: '0x30'
      - series: 'inference_request_duration_seconds_bucket{namespace="ml",pod="slow-0",gpu_uuid="GPU-s",gpu_name="H200",gpu_index="0",le="0.5"}'
        values: '0+600x30'
      - series: 'inference_request_duration_seconds_bucket{namespace="ml",pod="slow-0",gpu_uuid="GPU-s",gpu_name="H200",gpu_index="0",le="+Inf"}'
        values: '0+600x30'
      # fast: the same low occupancy, but every request under 0.1 s: a small model, no alert
      - series: 'gpu_sm_occupancy_ratio{namespace="ml",pod="fast-0",gpu_uuid="GPU-f",gpu_name="H200",gpu_index="0"}'
        values: '0.18x30'
      - series: 'inference_request_duration_seconds_bucket{namespace="ml",pod="fast-0",gpu_uuid="GPU-f",gpu_name="H200",gpu_index="0",le="0.1"}'
        values: '0+600x30'
      - series: 'inference_request_duration_seconds_bucket{namespace="ml",pod="fast-0",gpu_uuid="GPU-f",gpu_name="H200",gpu_index="0",le="0.3"}'
        values: '0+600x30'
      - series: 'inference_request_duration_seconds_bucket{namespace="ml",pod="fast-0",gpu_uuid="GPU-f",gpu_name="H200",gpu_index="0",le="0.5"}'
        values: '0+600x30'
      - series: 'inference_request_duration_seconds_bucket{namespace="ml",pod="fast-0",gpu_uuid="GPU-f",gpu_name="H200",gpu_index="0",le="+Inf"}'
        values: '0+600x30'
      # slow but busy SMs (occupancy 70 %): not this alert's business
      - series: 'gpu_sm_occupancy_ratio{namespace="ml",pod="busy-0",gpu_uuid="GPU-b",gpu_name="H200",gpu_index="0"}'
        values: '0.7x30'
      - series: 'inference_request_duration_seconds_bucket{namespace="ml",pod="busy-0",gpu_uuid="GPU-b",gpu_name="H200",gpu_index="0",le="0.5"}'
        values: '0+600x30'
      - series: 'inference_request_duration_seconds_bucket{namespace="ml",pod="busy-0",gpu_uuid="GPU-b",gpu_name="H200",gpu_index="0",le="+Inf"}'
        values: '0+600x30'
    alert_rule_test:
      - eval_time: 8m
        alertname: GPULowOccupancyAndSlowRequests
        exp_alerts: []   # pending: the condition holds from 1m on, and must for 10m
      - eval_time: 20m
        alertname: GPULowOccupancyAndSlowRequests
        exp_alerts:
          - exp_labels: {severity: warning, namespace: ml, pod: slow-0, gpu_uuid: GPU-s}
            exp_annotations:
              summary: "Low SM occupancy with slow requests on slow-0"
              description: "GPU GPU-s keeps its SMs mostly empty while p99 latency is above the objective: small, fragmented kernels; consider batching, CUDA graphs or fusion."

  - name: low occupancy with the engine's latency, where the app publishes none
    interval: 1m
    input_series:
      # eng-0: the app publishes no latency; the engine's p99 is about 5 s
      - series: 'gpu_sm_occupancy_ratio{namespace="ml",pod="eng-0",gpu_uuid="GPU-e",gpu_name="H200",gpu_index="0"}'
        values: '0.18x30'
      - series: 'engine_request_duration_seconds_bucket{namespace="ml",pod="eng-0",engine="vllm",endpoint="127.0.0.1:8000",model="m",le="0.3"}'
        values: '0x30'
      - series: 'engine_request_duration_seconds_bucket{namespace="ml",pod="eng-0",engine="vllm",endpoint="127.0.0.1:8000",model="m",le="5.0"}'
        values: '0+600x30'
      - series: 'engine_request_duration_seconds_bucket{namespace="ml",pod="eng-0",engine="vllm",endpoint="127.0.0.1:8000",model="m",le="+Inf"}'
        values: '0+600x30'
      # app-0: the app's own latency is fast: it is the one judged, the engine's slow one is not
      - series: 'gpu_sm_occupancy_ratio{namespace="ml",pod="app-0",gpu_uuid="GPU-p",gpu_name="H200",gpu_index="0"}'
        values: '0.18x30'
      - series: 'inference_request_duration_seconds_bucket{namespace="ml",pod="app-0",gpu_uuid="GPU-p",gpu_name="H200",gpu_index="0",le="0.1"}'
        values: '0+600x30'
      - series: 'inference_request_duration_seconds_bucket{namespace="ml",pod="app-0",gpu_uuid="GPU-p",gpu_name="H200",gpu_index="0",le="+Inf"}'
        values: '0+600x30'
      - series: 'inference_request_duration_seconds_count{namespace="ml",pod="app-0",gpu_uuid="GPU-p",gpu_name="H200",gpu_index="0"}'
        values: '0+600x30'
      - series: 'engine_request_duration_seconds_bucket{namespace="ml",pod="app-0",engine="vllm",endpoint="127.0.0.1:8000",model="m",le="0.3"}'
        values: '0x30'
      - series: 'engine_request_duration_seconds_bucket{namespace="ml",pod="app-0",engine="vllm",endpoint="127.0.0.1:8000",model="m",le="5.0"}'
        values: '0+600x30'
      - series: 'engine_request_duration_seconds_bucket{namespace="ml",pod="app-0",engine="vllm",endpoint="127.0.0.1:8000",model="m",le="+Inf"}'
        values: '0+600x30'
    alert_rule_test:
      - eval_time: 8m
        alertname: GPULowOccupancyAndSlowRequests
        exp_alerts: []   # pending
      - eval_time: 20m
        alertname: GPULowOccupancyAndSlowRequests
        exp_alerts:
          - exp_labels: {severity: warning, namespace: ml, pod: eng-0, gpu_uuid: GPU-e}
            exp_annotations:
              summary: "Low SM occupancy with slow requests on eng-0"
              description: "GPU GPU-e keeps its SMs mostly empty while p99 latency is above the objective: small, fragmented kernels; consider batching, CUDA graphs or fusion."
""")  # noqa: E501
)
