"""The shipped alert rules and their promtool cases, rendered from the verdict rules and
``sidecar.thresholds``, and the verdict table of docs/diagnose.md.

    python -m sidecar.alert_rules .   # writes deploy/alerts/, k8s/monitoring/, docs/diagnose.md

A verdict's alert rules and their promtool cases are part of its rule
(``sidecar.judge.rules.RULES``, ``alerts`` and ``alert_tests``), as is its row in the docs
(``doc_when``, ``doc_todo``: ``sidecar.views.verdict_docs``); the alerts that are no verdict's
(the agent's health, a Job's summary, the sustained verdict) and their cases are templates here.
None is a file read back, so that a threshold exists in one place; ``tests/test_deploy.py`` and
``tests/test_docs.py`` fail when the files in the repository differ from what this renders, and
``promtool`` runs the cases. ``%%(name)s`` is a threshold, ``%%%%`` a literal percent sign (the
cases are literal: no threshold is substituted in them).
"""

from __future__ import annotations

import dataclasses
import sys
import textwrap
from pathlib import Path

from sidecar.judge.rules import RULES
from sidecar.thresholds import THRESHOLDS, Thresholds
from sidecar.views import verdict_docs

_HEADER = """\
# Alert rules for gpu-sidecar. The seed's three alerts, corrected (fragmentation is the
# allocator's, not device memory usage; PCIe against the device's real link maximum; occupancy
# only together with degraded latency), plus the allocator's direct symptom, the GPU's health
# (hardware faults, a pending row remap, throttled clocks, a PCIe link trained down under
# traffic, NVLink-C2C saturated on Grace), the serving engine's (a full KV cache, queueing) and
# the agent's own health. Tested with
# `promtool test rules deploy/alerts/gpu-sidecar.tests.yml`.
# Generated from sidecar/judge/rules/ (RULES) and sidecar/thresholds.py by
# `python -m sidecar.alert_rules`: edit there, not here.
# The same groups, as a PrometheusRule for the Prometheus Operator: k8s/monitoring/.
"""

_OPERATOR_HEADER = """\
# The rules of deploy/alerts/gpu-sidecar.rules.yml for the Prometheus Operator, generated with
# them from sidecar/judge/rules/ and sidecar/thresholds.py by
# `python -m sidecar.alert_rules`. Select it with your
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

# The alerts that are no verdict's: a row remap waiting for a reset (a note of diagnose), the
# agent's own verdict sustained, a batch Job's run summary, and the agent's health.
_REMAP_PENDING = """\
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
"""

_OTHER_GROUPS = """\
  - name: gpu-sidecar.verdict
    rules:
      - alert: GPUVerdictSustained
        # the agent's own verdict (gpu_verdict: the kind its judge names over its last 30 s,
        # with the thresholds above) has named a finding on a GPU, whatever its kind, for 10
        # minutes: one alert per GPU that says why, beside the per-layer ones. The kind is not
        # one of the alert's labels, so a finding whose kind alternates (PCIe, fragmentation,
        # PCIe...) is one alert whose `for` holds across the changes; its annotations name the
        # kind at 1 now. "none" never fires, a verdict that ends is sent at 0, and a stopped
        # agent's series end, so the alert resolves when the cause (or the agent) does
        expr: |
          max by (namespace, pod, node, gpu_uuid, gpu_index) (
            gpu_verdict{verdict!="none"}
          ) == 1
        for: 10m
        labels:
          severity: warning
        annotations:
          summary: >-
            GPU {{ $labels.gpu_index }} of {{ $labels.pod }} in trouble for 10 minutes, now:
            %(verdict_kinds_now)s
          description: >-
            gpu-sidecar has named a finding (the summary says which now) as what explains the
            latency on this GPU for 10 minutes;
            `kubectl exec {{ $labels.pod }} -c gpu-sidecar -- gpu-sidecar diagnose` gives the
            figures behind it and what to do.

  - name: gpu-sidecar.batch
    rules:
      - alert: GPUJobRunBottleneck
        # from the run summary a Job's agent sends at its end (--batch-job): the agent's verdict
        # on a GPU was one bottleneck for most of the Job's last run. It stays while that summary
        # is the newest (the Pushgateway keeps it; remote-write makes it stale after 5 minutes)
        expr: |
          max by (namespace, job_name, gpu_uuid, condition) (
            gpu_run_above_threshold_ratio{condition!="none"}
          ) > %(job_saturated_share)s
        for: 0m
        labels:
          severity: info
        annotations:
          summary: >-
            Job {{ $labels.job_name }}: {{ $labels.condition }} for
            {{ $value | humanizePercentage }} of its run
          description: >-
            For most of the last run of Job {{ $labels.job_name }} ({{ $labels.namespace }}) the
            agent's verdict on GPU {{ $labels.gpu_uuid }} was {{ $labels.condition }}: that layer,
            not the work, set the run's duration. `gpu-sidecar diagnose --query-url` over the
            run's time range gives the figures and the remedy.

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

_TESTS_HEADER = """\
# promtool test rules deploy/alerts/gpu-sidecar.tests.yml
# Cases that fire, that stay pending (no alert yet at an earlier time), and that must not fire.
# Generated by `python -m sidecar.alert_rules .`: each verdict's cases from its rule's
# alert_tests (sidecar/judge/rules/, in precedence order), then those of the alerts that are no
# verdict's (_OTHER_TESTS in sidecar/alert_rules.py): edit there, not here.
rule_files:
  - gpu-sidecar.rules.yml

evaluation_interval: 1m

tests:
"""

# the promtool cases of the alerts above that are no verdict's (a pending row remap is checked
# with the hardware fault's, in its rule)
_OTHER_TESTS = """\
  - name: agent health
    interval: 1m
    input_series:
      - series: 'gpu_sidecar_up{namespace="ml",pod="llm-0"}'
        values: '1x20'
      - series: 'gpu_sidecar_up{namespace="ml",pod="gone-0"}'
        values: '1x5 _x20'   # killed: its last push said 1
      - series: 'gpu_sidecar_up{namespace="ml",pod="ended-0"}'
        values: '1x4 0 _x20'   # stopped cleanly: its last push said 0
      # as the agent sends them: absent before its first push, every known reason at 0 from
      # the first push on, then the count
      - series: 'gpu_sidecar_push_failures_total{namespace="ml",pod="llm-0",sink="remote_write:vm:8428",reason="http_5xx"}'
        values: '_ 0 3 5 5 5 5 5 5 5 5 5 5 5 5 5 5 5 5 5'
      - series: 'gpu_sidecar_push_failures_total{namespace="ml",pod="llm-0",sink="remote_write:vm:8428",reason="network"}'
        values: '_ 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0'
      # a reason the agent does not know in advance (a 418 from the receiver): absent, then 1
      - series: 'gpu_sidecar_push_failures_total{namespace="ml",pod="new-0",sink="remote_write:vm:8428",reason="http_418"}'
        values: '_ _ _ 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1'
      - series: 'gpu_sidecar_spool_bytes{namespace="ml",pod="llm-0",sink="remote_write:vm:8428",state="pending"}'
        values: '_ 1e6 5e7 6e7 7e7 8e7 8e7 8e7 8e7 8e7 8e7 8e7 8e7 8e7 8e7 8e7'
      - series: 'gpu_sidecar_spool_bytes{namespace="ml",pod="llm-0",sink="remote_write:vm:8428",state="rejected"}'
        values: '_ 9e7x15'
      # the volume refuses writes from 2m on, but for one write taken at 5m (nearly full)
      - series: 'gpu_sidecar_spool_write_failing{namespace="ml",pod="llm-0",sink="remote_write:vm:8428"}'
        values: '0 0 1 1 1 0 1 1 1 1 1 1 1 1 1 1'
      - series: 'gpu_sidecar_spool_write_failing{namespace="ml",pod="ok-0",sink="remote_write:vm:8428"}'
        values: '0 0 0 1 0x12'   # one refused write: a blip, no alert
      - series: 'gpu_sidecar_samples_dropped_total{namespace="ml",pod="llm-0",sink="remote_write:vm:8428",reason="spool_full"}'
        values: '_ 0 0 0 0 0 0 0 0 0 120 120 120'
      - series: 'gpu_sidecar_samples_dropped_total{namespace="ml",pod="new-0",sink="remote_write:vm:8428",reason="corrupt"}'
        values: '_ _ _ _ _ 40 40 40 40'
      - series: 'gpu_sidecar_samples_dropped_total{namespace="ml",pod="llm-0",reason="gpu_unavailable"}'
        values: '0 5 10 15 20 25 30'
      - series: 'gpu_sidecar_app_messages_accepted_total{namespace="ml",pod="llm-0"}'
        values: '0+10x5 50x15'
      - series: 'gpu_sidecar_gpu_available{namespace="ml",pod="llm-0",gpu_uuid="GPU-a",gpu_name="H200",gpu_index="0"}'
        values: '1 1 0 0 0 0 0'
    alert_rule_test:
      - eval_time: 3m
        alertname: GPUSidecarPushFailures
        exp_alerts:
          - exp_labels: {severity: warning, namespace: ml, pod: llm-0, sink: "remote_write:vm:8428", reason: http_5xx}
            exp_annotations:
              summary: "gpu-sidecar on llm-0 failed pushes to remote_write:vm:8428"
              description: "5 failed pushes (http_5xx) in 10 minutes."
          - exp_labels: {severity: warning, namespace: ml, pod: new-0, sink: "remote_write:vm:8428", reason: http_418}
            exp_annotations:
              summary: "gpu-sidecar on new-0 failed pushes to remote_write:vm:8428"
              description: "1 failed pushes (http_418) in 10 minutes."
      - eval_time: 1m
        alertname: GPUSidecarPushFailures
        exp_alerts: []   # the first push: every known reason at 0
      - eval_time: 12m
        alertname: GPUSidecarSilent
        exp_alerts:   # the killed agent only: ended-0 stopped cleanly
          - exp_labels: {severity: warning, namespace: ml, pod: gone-0}
            exp_annotations:
              summary: "No data from gpu-sidecar on gone-0 for 5 minutes"
      - eval_time: 4m
        alertname: GPUSidecarSilent
        exp_alerts: []
      - eval_time: 8m
        alertname: GPUSidecarSpoolGrowing
        exp_alerts: []   # pending since 2m
      - eval_time: 13m
        alertname: GPUSidecarSpoolGrowing
        exp_alerts:
          - exp_labels: {severity: warning, namespace: ml, pod: llm-0, sink: "remote_write:vm:8428", state: pending}
            exp_annotations:
              summary: "gpu-sidecar spool of llm-0 holds 76.29MiB"
              description: "The receiver remote_write:vm:8428 is not keeping up; data waits on disk."
      - eval_time: 6m
        alertname: GPUSidecarSpoolVolumeRefusing
        exp_alerts: []   # refusing since 2m, half the window since 3m
      - eval_time: 9m
        alertname: GPUSidecarSpoolVolumeRefusing
        exp_alerts:   # the write taken at 5m does not reset it
          - exp_labels: {severity: warning, namespace: ml, pod: llm-0, sink: "remote_write:vm:8428"}
            exp_annotations:
              summary: "gpu-sidecar on llm-0 cannot write its spool volume"
              description: "Batches for remote_write:vm:8428 wait in memory: free the spool volume."
      - eval_time: 11m
        alertname: GPUSidecarSamplesDropped
        exp_alerts:
          - exp_labels: {severity: warning, namespace: ml, pod: llm-0, sink: "remote_write:vm:8428", reason: spool_full}
            exp_annotations:
              summary: "gpu-sidecar on llm-0 lost samples (spool_full)"
          - exp_labels: {severity: warning, namespace: ml, pod: new-0, sink: "remote_write:vm:8428", reason: corrupt}
            exp_annotations:
              summary: "gpu-sidecar on new-0 lost samples (corrupt)"
      - eval_time: 4m
        alertname: GPUSidecarSamplesDropped
        exp_alerts: []   # gpu_unavailable drops are the GPU alert's business
      - eval_time: 6m
        alertname: GPUSidecarSamplesDropped
        exp_alerts:   # a reason whose series first appears at 40
          - exp_labels: {severity: warning, namespace: ml, pod: new-0, sink: "remote_write:vm:8428", reason: corrupt}
            exp_annotations:
              summary: "gpu-sidecar on new-0 lost samples (corrupt)"
      - eval_time: 20m
        alertname: GPUSidecarAppFiguresStale
        exp_alerts:
          - exp_labels: {severity: info, namespace: ml, pod: llm-0}
            exp_annotations:
              summary: "No app figures from llm-0 for 15 minutes"
              description: "Allocator and latency series are missing: is sidecar.client started?"
      - eval_time: 12m
        alertname: GPUSidecarAppFiguresStale
        exp_alerts: []   # quiet for less than 10 + 5 minutes
      - eval_time: 5m
        alertname: GPUSidecarGPUUnavailable
        exp_alerts:
          - exp_labels: {severity: critical, namespace: ml, pod: llm-0, gpu_uuid: GPU-a, gpu_name: H200, gpu_index: "0"}
            exp_annotations:
              summary: "GPU GPU-a of llm-0 cannot be read"
              description: "Lost (fallen off the bus) or not visible to the agent; see its log."

  - name: a Job's run summary with one verdict for most of the run fires, per kind; half or less, or none, does not
    interval: 1m
    input_series:
      - series: 'gpu_run_above_threshold_ratio{namespace="ml",job_name="embed",pod="embed-a",gpu_uuid="GPU-a",condition="pcie"}'
        values: '0.7x5'
      - series: 'gpu_run_above_threshold_ratio{namespace="ml",job_name="embed",pod="embed-a",gpu_uuid="GPU-a",condition="none"}'
        values: '0.3x5'
      - series: 'gpu_run_above_threshold_ratio{namespace="ml",job_name="eval",pod="eval-a",gpu_uuid="GPU-b",condition="pcie"}'
        values: '0.5x5'
      - series: 'gpu_run_above_threshold_ratio{namespace="ml",job_name="eval",pod="eval-a",gpu_uuid="GPU-b",condition="nvlink"}'
        values: '0.5x5'
      - series: 'gpu_run_above_threshold_ratio{namespace="ml",job_name="train",pod="train-a",gpu_uuid="GPU-c",condition="throttled"}'
        values: '0.9x5'
      - series: 'gpu_run_above_threshold_ratio{namespace="ml",job_name="idle",pod="idle-a",gpu_uuid="GPU-d",condition="none"}'
        values: '1x5'
    alert_rule_test:
      - eval_time: 2m
        alertname: GPUJobRunBottleneck
        exp_alerts:
          - exp_labels: {severity: info, namespace: ml, job_name: embed, gpu_uuid: GPU-a, condition: pcie}
            exp_annotations:
              summary: "Job embed: pcie for 70% of its run"
              description: "For most of the last run of Job embed (ml) the agent's verdict on GPU GPU-a was pcie: that layer, not the work, set the run's duration. `gpu-sidecar diagnose --query-url` over the run's time range gives the figures and the remedy."
          - exp_labels: {severity: info, namespace: ml, job_name: train, gpu_uuid: GPU-c, condition: throttled}
            exp_annotations:
              summary: "Job train: throttled for 90% of its run"
              description: "For most of the last run of Job train (ml) the agent's verdict on GPU GPU-c was throttled: that layer, not the work, set the run's duration. `gpu-sidecar diagnose --query-url` over the run's time range gives the figures and the remedy."

  - name: an OTLP receiver's partial_success and unencodable series are losses too
    interval: 1m
    input_series:
      # at 0 from the first push, then the receiver rejects points in accepted requests
      - series: 'gpu_sidecar_samples_dropped_total{namespace="ml",pod="llm-0",sink="otlp:otel:4318/v1/metrics",reason="partial_success"}'
        values: '_ 0 0 0 2 4 4 4'
      # absent, then first seen at 3: a histogram the encoder could not carry
      - series: 'gpu_sidecar_samples_dropped_total{namespace="ml",pod="new-0",sink="otlp:otel:4318/v1/metrics",reason="unencodable"}'
        values: '_ _ _ _ _ 3 3 3'
    alert_rule_test:
      - eval_time: 3m
        alertname: GPUSidecarSamplesDropped
        exp_alerts: []   # counted at 0: nothing lost yet
      - eval_time: 5m
        alertname: GPUSidecarSamplesDropped
        exp_alerts:
          - exp_labels: {severity: warning, namespace: ml, pod: llm-0, sink: "otlp:otel:4318/v1/metrics", reason: partial_success}
            exp_annotations:
              summary: "gpu-sidecar on llm-0 lost samples (partial_success)"
          - exp_labels: {severity: warning, namespace: ml, pod: new-0, sink: "otlp:otel:4318/v1/metrics", reason: unencodable}
            exp_annotations:
              summary: "gpu-sidecar on new-0 lost samples (unencodable)"

  - name: a sustained finding fires after 10 minutes whatever its kind; a short, ended, healthy or stopped one does not
    interval: 1m
    input_series:
      # fragmentation named for 20 minutes
      - series: 'gpu_verdict{namespace="ml",pod="llm-0",node="n1",gpu_uuid="GPU-a",gpu_index="0",gpu_name="H200",verdict="fragmentation"}'
        values: '1x20'
      # the verdict alternates between pcie and fragmentation every 2 minutes for 20 minutes (the kind that ends is sent at 0): one finding all along
      - series: 'gpu_verdict{namespace="ml",pod="alt-0",node="n1",gpu_uuid="GPU-f",gpu_index="0",gpu_name="H200",verdict="pcie"}'
        values: '1 1 0 0 1 1 0 0 1 1 0 0 1 1 0 0 1 1 0 0 1'
      - series: 'gpu_verdict{namespace="ml",pod="alt-0",node="n1",gpu_uuid="GPU-f",gpu_index="0",gpu_name="H200",verdict="fragmentation"}'
        values: '0 0 1 1 0 0 1 1 0 0 1 1 0 0 1 1 0 0 1 1 0'
      # pcie named for 9 minutes, shorter than the alert's 10, then the cause ended: sent at 0
      - series: 'gpu_verdict{namespace="ml",pod="llm-1",node="n1",gpu_uuid="GPU-b",gpu_index="0",gpu_name="H200",verdict="pcie"}'
        values: '1x8 0x12'
      - series: 'gpu_verdict{namespace="ml",pod="llm-1",node="n1",gpu_uuid="GPU-b",gpu_index="0",gpu_name="H200",verdict="none"}'
        values: '_x8 1x12'
      # healthy all along
      - series: 'gpu_verdict{namespace="ml",pod="llm-2",node="n1",gpu_uuid="GPU-c",gpu_index="0",gpu_name="H200",verdict="none"}'
        values: '1x20'
      # a finding for 13 minutes, then the agent stopped cleanly: its series end (staleness markers)
      - series: 'gpu_verdict{namespace="ml",pod="stop-0",node="n1",gpu_uuid="GPU-d",gpu_index="0",gpu_name="H200",verdict="kv-cache"}'
        values: '1x12 stale'
      # a finding for 13 minutes, then the agent was killed: its last sample stands for the store's 5-minute look-back, no longer
      - series: 'gpu_verdict{namespace="ml",pod="kill-0",node="n1",gpu_uuid="GPU-e",gpu_index="0",gpu_name="H200",verdict="kv-cache"}'
        values: '1x12'
    alert_rule_test:
      - eval_time: 9m
        alertname: GPUVerdictSustained
        exp_alerts: []   # all pending; llm-1 ends before its 10 minutes
      - eval_time: 12m
        alertname: GPUVerdictSustained
        exp_alerts:
          - exp_labels: {severity: warning, namespace: ml, pod: alt-0, node: n1, gpu_uuid: GPU-f, gpu_index: "0"}
            exp_annotations:
              summary: "GPU 0 of alt-0 in trouble for 10 minutes, now: pcie"
              description: "gpu-sidecar has named a finding (the summary says which now) as what explains the latency on this GPU for 10 minutes; `kubectl exec alt-0 -c gpu-sidecar -- gpu-sidecar diagnose` gives the figures behind it and what to do."
          - exp_labels: {severity: warning, namespace: ml, pod: kill-0, node: n1, gpu_uuid: GPU-e, gpu_index: "0"}
            exp_annotations:
              summary: "GPU 0 of kill-0 in trouble for 10 minutes, now: kv-cache"
              description: "gpu-sidecar has named a finding (the summary says which now) as what explains the latency on this GPU for 10 minutes; `kubectl exec kill-0 -c gpu-sidecar -- gpu-sidecar diagnose` gives the figures behind it and what to do."
          - exp_labels: {severity: warning, namespace: ml, pod: llm-0, node: n1, gpu_uuid: GPU-a, gpu_index: "0"}
            exp_annotations:
              summary: "GPU 0 of llm-0 in trouble for 10 minutes, now: fragmentation"
              description: "gpu-sidecar has named a finding (the summary says which now) as what explains the latency on this GPU for 10 minutes; `kubectl exec llm-0 -c gpu-sidecar -- gpu-sidecar diagnose` gives the figures behind it and what to do."
          - exp_labels: {severity: warning, namespace: ml, pod: stop-0, node: n1, gpu_uuid: GPU-d, gpu_index: "0"}
            exp_annotations:
              summary: "GPU 0 of stop-0 in trouble for 10 minutes, now: kv-cache"
              description: "gpu-sidecar has named a finding (the summary says which now) as what explains the latency on this GPU for 10 minutes; `kubectl exec stop-0 -c gpu-sidecar -- gpu-sidecar diagnose` gives the figures behind it and what to do."
      - eval_time: 14m   # the stopped agent's alert resolved; the alternating one names its kind now
        alertname: GPUVerdictSustained
        exp_alerts:
          - exp_labels: {severity: warning, namespace: ml, pod: alt-0, node: n1, gpu_uuid: GPU-f, gpu_index: "0"}
            exp_annotations:
              summary: "GPU 0 of alt-0 in trouble for 10 minutes, now: fragmentation"
              description: "gpu-sidecar has named a finding (the summary says which now) as what explains the latency on this GPU for 10 minutes; `kubectl exec alt-0 -c gpu-sidecar -- gpu-sidecar diagnose` gives the figures behind it and what to do."
          - exp_labels: {severity: warning, namespace: ml, pod: kill-0, node: n1, gpu_uuid: GPU-e, gpu_index: "0"}
            exp_annotations:
              summary: "GPU 0 of kill-0 in trouble for 10 minutes, now: kv-cache"
              description: "gpu-sidecar has named a finding (the summary says which now) as what explains the latency on this GPU for 10 minutes; `kubectl exec kill-0 -c gpu-sidecar -- gpu-sidecar diagnose` gives the figures behind it and what to do."
          - exp_labels: {severity: warning, namespace: ml, pod: llm-0, node: n1, gpu_uuid: GPU-a, gpu_index: "0"}
            exp_annotations:
              summary: "GPU 0 of llm-0 in trouble for 10 minutes, now: fragmentation"
              description: "gpu-sidecar has named a finding (the summary says which now) as what explains the latency on this GPU for 10 minutes; `kubectl exec llm-0 -c gpu-sidecar -- gpu-sidecar diagnose` gives the figures behind it and what to do."
      - eval_time: 18m   # the killed agent's last sample is older than the look-back
        alertname: GPUVerdictSustained
        exp_alerts:
          - exp_labels: {severity: warning, namespace: ml, pod: alt-0, node: n1, gpu_uuid: GPU-f, gpu_index: "0"}
            exp_annotations:
              summary: "GPU 0 of alt-0 in trouble for 10 minutes, now: fragmentation"
              description: "gpu-sidecar has named a finding (the summary says which now) as what explains the latency on this GPU for 10 minutes; `kubectl exec alt-0 -c gpu-sidecar -- gpu-sidecar diagnose` gives the figures behind it and what to do."
          - exp_labels: {severity: warning, namespace: ml, pod: llm-0, node: n1, gpu_uuid: GPU-a, gpu_index: "0"}
            exp_annotations:
              summary: "GPU 0 of llm-0 in trouble for 10 minutes, now: fragmentation"
              description: "gpu-sidecar has named a finding (the summary says which now) as what explains the latency on this GPU for 10 minutes; `kubectl exec llm-0 -c gpu-sidecar -- gpu-sidecar diagnose` gives the figures behind it and what to do."
"""  # noqa: E501

# the limiting reasons of GPUClocksThrottled (series gpu_clocks_event_<reason>_ratio) and the
# name its alert carries in the label "reason"; sync boost is not one (see thresholds.throttled)
THROTTLE_REASONS = (("power_cap", "power cap"), ("hw_slowdown", "HW slowdown"),
                    ("hw_thermal", "HW thermal"), ("hw_power_brake", "HW power brake"),
                    ("sw_thermal", "SW thermal"))
# the kinds at 1 now of the GPU of an alert keyed by GPU (GPUVerdictSustained), for its
# annotations: a template asking the store, since the kind is not one of the alert's labels
VERDICT_KINDS_NOW = (
    '{{ range $i, $k := query (printf `max by (verdict) (gpu_verdict{namespace=%q, pod=%q,'
    ' node=%q, gpu_uuid=%q, verdict!="none"} == 1)` $labels.namespace $labels.pod'
    ' $labels.node $labels.gpu_uuid) }}{{ if $i }}, {{ end }}{{ $k.Labels.verdict }}{{ end }}')
RULES_FILE = Path("deploy/alerts/gpu-sidecar.rules.yml")
OPERATOR_FILE = Path("k8s/monitoring/prometheusrule.yaml")
TESTS_FILE = Path("deploy/alerts/gpu-sidecar.tests.yml")


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
    values["queue_share_part"] = ("half" if t.queue_share_ratio == 0.5
                                  else f"{100 * t.queue_share_ratio:g} %")
    values["nvlink_percent"] = f"{100 * t.nvlink_util_ratio:g}"
    values["occupancy_percent"] = f"{100 * t.occupancy_ratio:g}"
    values["fragmentation_min_reserved_gib"] = f"{t.fragmentation_min_reserved_bytes / 2**30:g}"
    values["verdict_kinds_now"] = VERDICT_KINDS_NOW
    values["throttle_reasons_expr"] = "\n            or\n            ".join(
        f'label_replace(avg_over_time(gpu_clocks_event_{reason}_ratio[5m])'
        f' > {t.throttle_ratio:g},\n              "reason", "{name}", "", "")'
        for reason, name in THROTTLE_REASONS)
    return values


def _groups() -> str:
    """The rule groups as a template: each verdict rule's alerts (``judge.rules.RULES``, in
    precedence order) in its layer's group (the engine's apart, every other one in
    ``gpu-sidecar.gpu``), then the alerts that are no verdict's."""
    gpu = [r.alerts for r in RULES if r.alerts and r.layer != "engine"]
    engine = [r.alerts for r in RULES if r.alerts and r.layer == "engine"]
    return ("groups:\n  - name: gpu-sidecar.gpu\n    rules:\n"
            + "\n".join([*gpu, _REMAP_PENDING])
            + "\n  - name: gpu-sidecar.engine\n    rules:\n" + "\n".join(engine) + "\n"
            + _OTHER_GROUPS)


def rules(t: Thresholds = THRESHOLDS) -> str:
    """The Prometheus rule file."""
    return _HEADER + _groups() % _values(t)


def prometheus_rule(t: Thresholds = THRESHOLDS) -> str:
    """The same groups as a ``PrometheusRule`` object."""
    return _OPERATOR_HEADER + textwrap.indent(_groups() % _values(t), "  ")


def tests() -> str:
    """The promtool cases of the rule file: each verdict rule's (``alert_tests``), in precedence
    order, then those of the alerts that are no verdict's."""
    return _TESTS_HEADER + "\n".join([*(r.alert_tests for r in RULES if r.alert_tests),
                                       _OTHER_TESTS])


def diagnose_doc(text: str, t: Thresholds = THRESHOLDS) -> str:
    """docs/diagnose.md (``text``) with its verdict table and precedence rendered afresh."""
    return verdict_docs.updated(text, _values(t))


def write(root: Path, t: Thresholds = THRESHOLDS) -> None:
    """Every file rendered here, under ``root``; the docs page only where it is there (a
    threshold tried out in a scratch folder renders the rules and their cases alone)."""
    (root / RULES_FILE).write_text(rules(t))
    (root / OPERATOR_FILE).write_text(prometheus_rule(t))
    (root / TESTS_FILE).write_text(tests())
    doc = root / verdict_docs.DOC
    if doc.exists():
        doc.write_text(diagnose_doc(doc.read_text(), t))


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else Path.cwd())
