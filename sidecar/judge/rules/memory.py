"""The memory layer's kinds: a fragmented allocator cache, allocator retries."""

from __future__ import annotations

from sidecar.judge.rule import Deciding, Rule, at, count, stored
from sidecar.units import gib, pct

FRAGMENTATION = (
    Rule("fragmentation", "memory", "mem: frag", "the allocator's cache is fragmented",
         "set PYTORCH_ALLOC_CONF=expandable_segments:True (PyTorch 2.8 and newer; before 2.8 "
         "the older name PYTORCH_CUDA_ALLOC_CONF, which later releases still read); bucket or "
         "pad batch shapes (fixed sequence-length buckets) so freed blocks fit the next request; "
         "call torch.cuda.empty_cache() between phases (after loading, after a shape change), "
         "not per request; warm up with the largest batch at start-up",
         found=lambda w, t: t.fragmented(w.mean.fragmentation, w.mean.alloc_reserved),
         evidence=lambda w, t: (
             f"{pct(w.mean.fragmentation)} of the allocator's {gib(w.mean.alloc_reserved)} cache "
             f"holds no tensor, above {t.fragmentation_ratio:.0%} on a cache over "
             f"{gib(t.fragmentation_min_reserved_bytes)}; {pct(w.mean.nonreleasable)} cannot be "
             f"released; largest free block {gib(w.mean.largest_free)} (alert "
             "GPUMemoryFragmentationHigh)"),
         threshold=lambda t: f"fragmentation above {t.fragmentation_ratio:.0%} of a cache over "
                             f"{gib(t.fragmentation_min_reserved_bytes)}",
         deciding=Deciding(
             (f"avg by (gpu_uuid) (avg_over_time({stored('gpu_memory_fragmentation_ratio')}))",
              f"avg by (gpu_uuid) (avg_over_time({stored('gpu_allocator_reserved_bytes')}))"),
             ("gpu_uuid",),
             lambda v, t: f"fragmentation {pct(at(v))} of a {gib(at(v, 1))} cache (above "
                          f"{t.fragmentation_ratio:.0%})"),
         doc_when=("fragmentation > %(fragmentation_percent)s %% of an allocator cache > "
                   "%(fragmentation_min_reserved_gib)s GiB"),
         doc_todo=("`PYTORCH_ALLOC_CONF=expandable_segments:True` (`PYTORCH_CUDA_ALLOC_CONF` "
                   "before PyTorch 2.8), bucketed batch shapes, `empty_cache()` between phases"),
         alerts="""\
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
""",
         alert_tests="""\
  - name: fragmentation fires after 5 minutes, not for a small cache
    interval: 1m
    input_series:
      - series: 'gpu_memory_fragmentation_ratio{namespace="ml",pod="llm-0",gpu_uuid="GPU-a",gpu_name="H200"}'
        values: '0.65x15'
      - series: 'gpu_allocator_reserved_bytes{namespace="ml",pod="llm-0",gpu_uuid="GPU-a",gpu_name="H200"}'
        values: '68719476736x15'
      - series: 'gpu_memory_fragmentation_ratio{namespace="ml",pod="tiny-0",gpu_uuid="GPU-b",gpu_name="H200"}'
        values: '0.9x15'
      - series: 'gpu_allocator_reserved_bytes{namespace="ml",pod="tiny-0",gpu_uuid="GPU-b",gpu_name="H200"}'
        values: '536870912x15'
    alert_rule_test:
      - eval_time: 4m
        alertname: GPUMemoryFragmentationHigh
        exp_alerts: []   # pending
      - eval_time: 6m
        alertname: GPUMemoryFragmentationHigh
        exp_alerts:
          - exp_labels: {severity: warning, namespace: ml, pod: llm-0, gpu_uuid: GPU-a, gpu_name: H200}
            exp_annotations:
              summary: "GPU allocator cache 65% empty on llm-0"
              description: "The caching allocator of llm-0 (ml) on GPU GPU-a holds memory that no tensor uses: large requests may need cudaMalloc, flushes and retries. Look at gpu_allocator_nonreleasable_ratio and gpu_allocator_largest_free_block_bytes; consider PYTORCH_ALLOC_CONF=expandable_segments:True (PYTORCH_CUDA_ALLOC_CONF before PyTorch 2.8)."

  - name: fragmentation below half does not fire
    interval: 1m
    input_series:
      - series: 'gpu_memory_fragmentation_ratio{namespace="ml",pod="llm-1",gpu_uuid="GPU-c"}'
        values: '0.45x20'
      - series: 'gpu_allocator_reserved_bytes{namespace="ml",pod="llm-1",gpu_uuid="GPU-c"}'
        values: '68719476736x20'
    alert_rule_test:
      - eval_time: 15m
        alertname: GPUMemoryFragmentationHigh
        exp_alerts: []
""")  # noqa: E501
)


ALLOCATOR_RETRIES = (
    Rule("allocator-retries", "memory", "mem: retries", "the allocator had to retry cudaMalloc",
         "each retry flushed the allocator cache and synchronised the device: lower the peak (a "
         "smaller maximum batch or sequence length), apply the fragmentation remedies "
         "(expandable_segments), and leave headroom beside other processes on the GPU",
         found=lambda w, t: t.allocator_retrying(w.retries, w.ooms),
         evidence=lambda w, t: f"{w.retries or 0:.0f} allocation retries and {w.ooms or 0:.0f} "
                               "OOMs during the window (alerts GPUAllocatorRetrying, "
                               "GPUOutOfMemory)",
         threshold=lambda t: "any allocator retry or OOM",
         deciding=Deciding(
             (f"sum by (gpu_uuid) (increase({stored('gpu_allocator_alloc_retries_total')}))",
              f"sum by (gpu_uuid) (increase({stored('gpu_allocator_ooms_total')}))"),
             ("gpu_uuid",),
             lambda v, t: f"{count(at(v))} allocator retries, {count(at(v, 1))} OOMs in the "
                          "window"),
         doc_when="any allocator retry or OOM",
         doc_todo="lower the peak batch, the fragmentation remedies",
         alerts="""\
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
""",
         alert_tests="""\
  - name: allocator retries and OOMs fire at once
    interval: 1m
    input_series:
      - series: 'gpu_allocator_alloc_retries_total{namespace="ml",pod="llm-0",gpu_uuid="GPU-a"}'
        values: '0 0 0 2 4 4 4 4 4 4 4 4'
      - series: 'gpu_allocator_ooms_total{namespace="ml",pod="llm-0",gpu_uuid="GPU-a"}'
        values: '0 0 0 0 0 1 1 1 1 1 1 1 1 1 1'
    alert_rule_test:
      - eval_time: 2m
        alertname: GPUAllocatorRetrying
        exp_alerts: []
      - eval_time: 4m
        alertname: GPUAllocatorRetrying
        exp_alerts:
          - exp_labels: {severity: warning, namespace: ml, pod: llm-0, gpu_uuid: GPU-a}
            exp_annotations:
              summary: "GPU allocator retries on llm-0"
              description: "llm-0 needed 4 allocation retries on GPU GPU-a in 5 minutes: each one synchronises the device and stalls requests."
      - eval_time: 11m
        alertname: GPUAllocatorRetrying
        exp_alerts: []   # no new retries for 5 minutes
      - eval_time: 6m
        alertname: GPUOutOfMemory
        exp_alerts:
          - exp_labels: {severity: critical, namespace: ml, pod: llm-0, gpu_uuid: GPU-a}
            exp_annotations:
              summary: "CUDA out-of-memory errors on llm-0"
              description: "llm-0 raised 1 OOM errors on GPU GPU-a."
""")  # noqa: E501
)
