"""The shipped alert rules, rendered from the verdict rules and ``sidecar.thresholds``.

    python -m sidecar.alert_rules            # writes deploy/alerts/ and k8s/monitoring/

A verdict's alert rules are part of its rule (``sidecar.judge.rules.RULES``, ``alerts``); the
alerts that are no verdict's (the agent's health, a Job's summary) are a template here. Neither
is a file read back, so that a threshold exists in one place;
``tests/test_deploy.py`` fails when the files in the repository differ from what this renders,
and runs ``promtool`` on them. ``%%(name)s`` is a threshold, ``%%%%`` a literal percent sign.
"""

from __future__ import annotations

import dataclasses
import sys
import textwrap
from pathlib import Path

from sidecar.judge.rules import RULES
from sidecar.thresholds import THRESHOLDS, Thresholds

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


def write(root: Path, t: Thresholds = THRESHOLDS) -> None:
    (root / RULES_FILE).write_text(rules(t))
    (root / OPERATOR_FILE).write_text(prometheus_rule(t))


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else Path.cwd())
