"""The health layer's kinds: a hardware fault, clocks held below their maximum."""

from __future__ import annotations

from collections.abc import Iterable

from sidecar.judge.figures import Figures
from sidecar.judge.rule import Deciding, Rule, at, stored
from sidecar.judge.window import Window
from sidecar.thresholds import Thresholds
from sidecar.units import celsius, ghz, pct, ratio_of, watts

_REASON_OF = {
    "power_cap": ("power cap", "clk: power"),
    "hw_slowdown": ("HW slowdown", "clk: HW slow"),
    "hw_thermal": ("HW thermal", "clk: thermal"),
    "hw_power_brake": ("HW power brake", "clk: brake"),
    "sw_thermal": ("SW thermal", "clk: thermal"),
}
_THROTTLE_REMEDY = {
    "power": (
        "power cap: check the power limit against the board's default and maximum (`nvidia-smi "
        "-q -d POWER`; one set low by an operator or a capping policy is restored with "
        "`nvidia-smi -pl`) and the workload's power ({power} of {limit}): a workload at its "
        "limit is power-bound, so lower precision (BF16, FP8), less redundant work (recomputation, "
        "busy-waiting kernels) or a GPU with a higher limit help"),
    "thermal": (
        "thermal: check the airflow: fans and the chassis's fan profile, the inlet temperature, "
        "blocked or recirculating air, a failed fan or a heatsink losing contact (GPU "
        "{temperature}, HBM {mem_temperature}; `nvidia-smi -q -d TEMPERATURE` gives the "
        "slowdown temperature)"),
    "board": (
        "HW slowdown or power brake: the board: the signal comes from the board or its power "
        "supply, not from the workload: check the PSU and the GPU's power cables, the board's "
        "and the BMC's event logs (`ipmitool sel list`) and, with the node drained, `nvidia-smi "
        "-q -d PERFORMANCE`; if it stays, the board needs service"),
}
_REMEDY_OF_REASON = {"power_cap": "power", "hw_thermal": "thermal", "sw_thermal": "thermal",
                     "hw_slowdown": "board", "hw_power_brake": "board"}
XID_MEANING = {  # NVIDIA's Xid catalogue, in a few words
    13: "graphics engine exception", 31: "memory page fault", 43: "GPU stopped processing",
    45: "preemptive cleanup", 48: "double-bit ECC error", 63: "row remap recorded",
    64: "row remap failed", 74: "NVLink error", 79: "fallen off the bus",
    92: "high single-bit ECC rate", 94: "contained ECC error", 95: "uncontained ECC error",
    119: "GSP RPC timeout", 120: "GSP error",
}



def reasons(m: Figures) -> list[tuple[str, float]]:
    """The limiting reasons present, by share of the window, largest first (sync boost apart)."""
    out = [(name, getattr(m, name)) for name in _REASON_OF if getattr(m, name) is not None]
    return sorted(out, key=lambda r: -r[1])


def reason_share(m: Figures) -> float | None:
    found = reasons(m)
    return found[0][1] if found else None


def xids_in_window(w: Window, t: Thresholds, *, critical: bool) -> list[tuple[int, float]]:
    return sorted((c, n) for c, n in w.xids.items() if n > 0 and t.critical_xid(c) == critical)


def xid_list(found: Iterable[tuple[int, float]]) -> str:
    return ", ".join(f"Xid {c} ({XID_MEANING.get(c, 'see the catalogue')}) x{n:.0f}"
                     for c, n in found)


def _hardware_evidence(w: Window, t: Thresholds) -> str:
    m = w.mean
    parts = []
    if critical := xids_in_window(w, t, critical=True):
        parts.append(xid_list(critical) + " during the window")
    ecc = w.increases.get("ecc_uncorrected")
    if ecc:
        parts.append(f"uncorrected ECC errors +{ecc:.0f} during the window "
                     f"({m.ecc_uncorrected or 0:.0f} since the driver loaded)")
    if m.remap_failed:
        parts.append(f"a row remap failed (remapped rows: {m.remapped_uncorrectable or 0:.0f} "
                     f"for uncorrectable, {m.remapped_correctable or 0:.0f} for correctable "
                     "errors)")
    return "; ".join(parts) + " (alert GPUHardwareFault)"


def _throttled(w: Window, t: Thresholds) -> tuple[str, str, str]:
    """The finding's table cell, evidence and remedy: by the reasons that held the clocks."""
    m = w.mean
    held = [(name, share) for name, share in reasons(m) if share > t.throttle_ratio]
    cell = _REASON_OF[held[0][0]][1]
    limited = ", ".join(f"{_REASON_OF[name][0]} {pct(share)}" for name, share in held)
    evidence = (
        f"SM clock {ghz(m.sm_clock)} of its {ghz(m.sm_clock_max)} maximum "
        f"({pct(ratio_of(m.sm_clock, m.sm_clock_max))}, below {t.throttle_clock_ratio:.0%}) "
        f"while utilization is {pct(m.utilization)} (above {t.busy_utilization_ratio:.0%}); "
        f"clocks limited by {limited} of the window (more than {t.throttle_ratio:.0%}); memory "
        f"clock {ghz(m.mem_clock)} of {ghz(m.mem_clock_max)}; power {watts(m.power)} of "
        f"{watts(m.power_limit)}; GPU {celsius(m.temperature)}, HBM "
        f"{celsius(m.mem_temperature)} (alert GPUClocksThrottled)")
    remedies: list[str] = []
    for name, _ in held:
        text = _THROTTLE_REMEDY[_REMEDY_OF_REASON[name]].format(
            power=watts(m.power), limit=watts(m.power_limit), temperature=celsius(m.temperature),
            mem_temperature=celsius(m.mem_temperature))
        if text not in remedies:
            remedies.append(text)
    return cell, evidence, "; ".join(remedies)




HARDWARE_FAULT = (
    Rule("hardware-fault", "health", "HW FAULT", "the GPU reported a hardware fault",
         "drain the node (`kubectl cordon NODE`, then `kubectl drain NODE --ignore-daemonsets`) "
         "so no new work lands on this GPU, and treat what ran on it since the fault as suspect "
         "(an uncorrected error may have changed results: rerun or check them); then reset the "
         "GPU (`nvidia-smi -r -i INDEX`, or reboot the node) and run `dcgmi diag -r 3`; replace "
         "it (RMA, with `nvidia-bug-report.sh`) if a row remap failed or the fault comes back; "
         "`dmesg | grep -i xid` has the driver's own record",
         found=lambda w, t: t.hardware_fault(dict(xids_in_window(w, t, critical=True)),
                                             w.increases.get("ecc_uncorrected"),
                                             w.mean.remap_failed),
         evidence=lambda w, t: _hardware_evidence(w, t),
         threshold=lambda t: f"a critical Xid ({', '.join(map(str, t.critical_xids))}), an "
                             "uncorrected ECC error or a failed row remap",
         deciding=Deciding(
             # a code's first Xid arrives as a new series at 1, which increase() reads as 0:
             # counted whole where the series was not there before the window (as the alert)
             (f"sum by (gpu_uuid) ((increase({stored('gpu_xid_errors_total', 'CRITICAL')}) > 0) or "
              f"(last_over_time({stored('gpu_xid_errors_total', 'CRITICAL')}) unless "
              f"last_over_time({stored('gpu_xid_errors_total', 'CRITICAL', before=True)})))",
              f"sum by (gpu_uuid) (increase({stored('gpu_ecc_uncorrected_volatile_total')}))"),
             ("gpu_uuid",),
             # no series is no count: no critical Xid's counter was stored (none seen), no
             # ECC counter was (a GPU without ECC)
             lambda v, t: ("no critical Xid seen" if at(v) is None else
                           f"critical Xids {at(v):.0f}") + ", " + (
                 "uncorrected ECC not stored" if at(v, 1) is None else
                 f"uncorrected ECC {at(v, 1):.0f}") + " in the window"),
         doc_when=("a critical Xid (%(critical_xids_list)s), an uncorrected ECC error or a failed "
                   "row remap in the window"),
         doc_todo="drain the node, reset the GPU, `dcgmi diag`, RMA if it recurs",
         alerts="""\
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
""",
         alert_tests="""\
  - name: a hardware fault fires at once on a critical Xid, an uncorrected ECC error or a failed remap
    interval: 1m
    input_series:
      # as the agent sends an Xid count: absent until the GPU's first Xid of the code, then 1
      - series: 'gpu_xid_errors_total{namespace="ml",pod="llm-0",gpu_uuid="GPU-a",xid="79"}'
        values: '_x3 1x20'
      # the app's fault (a graphics engine exception), however many: not the hardware's
      - series: 'gpu_xid_errors_total{namespace="ml",pod="llm-0",gpu_uuid="GPU-b",xid="13"}'
        values: '_x2 1 2 3x20'
      # a row remap recorded (63): a pending remap, which GPURowRemapPending reports
      - series: 'gpu_xid_errors_total{namespace="ml",pod="llm-0",gpu_uuid="GPU-f",xid="63"}'
        values: '_x3 1x20'
      - series: 'gpu_ecc_uncorrected_volatile_total{namespace="ml",pod="llm-0",gpu_uuid="GPU-c"}'
        values: '0x5 2x20'
      # corrected errors climbing: the hardware did its job, no fault
      - series: 'gpu_ecc_corrected_volatile_total{namespace="ml",pod="llm-0",gpu_uuid="GPU-d"}'
        values: '0+5x25'
      - series: 'gpu_ecc_uncorrected_volatile_total{namespace="ml",pod="llm-0",gpu_uuid="GPU-d"}'
        values: '3x25'   # from before the agent started: no increase, no alert
      - series: 'gpu_row_remap_failed{namespace="ml",pod="llm-0",gpu_uuid="GPU-e"}'
        values: '0x3 1x25'
      - series: 'gpu_row_remap_pending{namespace="ml",pod="llm-0",gpu_uuid="GPU-f"}'
        values: '0x3 1x25'
      - series: 'gpu_row_remap_failed{namespace="ml",pod="llm-0",gpu_uuid="GPU-f"}'
        values: '0x28'
    alert_rule_test:
      - eval_time: 2m
        alertname: GPUHardwareFault
        exp_alerts: []
      - eval_time: 7m
        alertname: GPUHardwareFault
        exp_alerts:
          - exp_labels: {severity: critical, namespace: ml, pod: llm-0, gpu_uuid: GPU-a, xid: "79", cause: "Xid 79"}
            exp_annotations:
              summary: "Hardware fault on GPU GPU-a of llm-0: Xid 79"
              description: "GPU GPU-a (llm-0, ml) reported Xid 79: its results may be wrong and it needs a reset or a replacement. Drain the node, reset the GPU (nvidia-smi -r) and run dcgmi diag; replace it if a row remap failed or the fault comes back. dmesg | grep -i xid has the driver's record."
          - exp_labels: {severity: critical, namespace: ml, pod: llm-0, gpu_uuid: GPU-c, cause: "uncorrected ECC errors"}
            exp_annotations:
              summary: "Hardware fault on GPU GPU-c of llm-0: uncorrected ECC errors"
              description: "GPU GPU-c (llm-0, ml) reported uncorrected ECC errors: its results may be wrong and it needs a reset or a replacement. Drain the node, reset the GPU (nvidia-smi -r) and run dcgmi diag; replace it if a row remap failed or the fault comes back. dmesg | grep -i xid has the driver's record."
          - exp_labels: {severity: critical, namespace: ml, pod: llm-0, gpu_uuid: GPU-e, cause: "a failed row remap"}
            exp_annotations:
              summary: "Hardware fault on GPU GPU-e of llm-0: a failed row remap"
              description: "GPU GPU-e (llm-0, ml) reported a failed row remap: its results may be wrong and it needs a reset or a replacement. Drain the node, reset the GPU (nvidia-smi -r) and run dcgmi diag; replace it if a row remap failed or the fault comes back. dmesg | grep -i xid has the driver's record."
      - eval_time: 20m
        alertname: GPUHardwareFault
        exp_alerts:   # no new Xid nor ECC error for 10 minutes; the failed remap stays
          - exp_labels: {severity: critical, namespace: ml, pod: llm-0, gpu_uuid: GPU-e, cause: "a failed row remap"}
            exp_annotations:
              summary: "Hardware fault on GPU GPU-e of llm-0: a failed row remap"
              description: "GPU GPU-e (llm-0, ml) reported a failed row remap: its results may be wrong and it needs a reset or a replacement. Drain the node, reset the GPU (nvidia-smi -r) and run dcgmi diag; replace it if a row remap failed or the fault comes back. dmesg | grep -i xid has the driver's record."
      - eval_time: 2m
        alertname: GPURowRemapPending
        exp_alerts: []
      - eval_time: 5m
        alertname: GPURowRemapPending
        exp_alerts:
          - exp_labels: {severity: warning, namespace: ml, pod: llm-0, gpu_uuid: GPU-f}
            exp_annotations:
              summary: "GPU GPU-f of llm-0 waits for a reset to remap a memory row"
              description: "A row remap of GPU GPU-f is pending: reset the GPU (nvidia-smi -r) once its work is drained to activate it. gpu_remapped_rows_uncorrectable and gpu_remapped_rows_correctable count the rows remapped so far."
""")  # noqa: E501
)


THROTTLED = (
    Rule("throttled", "health", "clocks", "the clocks are held below their maximum",
         "",  # by reason: _THROTTLE_REMEDY
         found=lambda w, t: t.throttled(reason_share(w.mean), w.mean.utilization,
                                        w.mean.sm_clock, w.mean.sm_clock_max),
         evidence=lambda w, t: _throttled(w, t),
         threshold=lambda t: f"a clock limit for over {t.throttle_ratio:.0%} of the window with "
                             f"the SM clock below {t.throttle_clock_ratio:.0%} of its maximum "
                             f"and utilization above {t.busy_utilization_ratio:.0%}",
         deciding=Deciding(
             (f"avg by (gpu_uuid) (avg_over_time({stored('gpu_sm_clock_hertz')})) / avg by "
              f"(gpu_uuid) (avg_over_time({stored('gpu_sm_clock_max_hertz')}))",),
             ("gpu_uuid",),
             lambda v, t: f"SM clock {pct(at(v))} of its maximum (below "
                          f"{t.throttle_clock_ratio:.0%})"),
         doc_when=("a power-cap, thermal, HW-slowdown or power-brake limit for > "
                   "%(throttle_percent)s %% of the window, utilization > %(busy_percent)s %%, SM "
                   "clock < %(throttle_clock_percent)s %% of its maximum"),
         doc_todo=("power cap: the power limit and the workload's power; thermal: airflow; HW "
                   "slowdown: the board"),
         alerts="""\
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
""",
         alert_tests="""\
  - name: throttled clocks fire on a busy GPU held below its maximum, not idle, not sync boost alone
    interval: 1m
    input_series:
      # busy, power-capped 90 % of the time, SM clock at 61 % of its maximum
      - series: 'gpu_utilization_ratio{namespace="ml",pod="llm-0",gpu_uuid="GPU-t",gpu_name="H200",gpu_index="0"}'
        values: '0.95x20'
      - series: 'gpu_clocks_event_power_cap_ratio{namespace="ml",pod="llm-0",gpu_uuid="GPU-t",gpu_name="H200",gpu_index="0"}'
        values: '0.9x20'
      - series: 'gpu_clocks_event_sync_boost_ratio{namespace="ml",pod="llm-0",gpu_uuid="GPU-t",gpu_name="H200",gpu_index="0"}'
        values: '0x20'
      - series: 'gpu_sm_clock_hertz{namespace="ml",pod="llm-0",gpu_uuid="GPU-t",gpu_name="H200",gpu_index="0"}'
        values: '1.2e9x20'
      - series: 'gpu_sm_clock_max_hertz{namespace="ml",pod="llm-0",gpu_uuid="GPU-t",gpu_name="H200",gpu_index="0"}'
        values: '1.98e9x20'
      # idle with a HW slowdown reported and its clocks down: nothing to run, not throttled
      - series: 'gpu_utilization_ratio{namespace="ml",pod="llm-0",gpu_uuid="GPU-i",gpu_name="H200",gpu_index="1"}'
        values: '0.02x20'
      - series: 'gpu_clocks_event_hw_slowdown_ratio{namespace="ml",pod="llm-0",gpu_uuid="GPU-i",gpu_name="H200",gpu_index="1"}'
        values: '1x20'
      - series: 'gpu_sm_clock_hertz{namespace="ml",pod="llm-0",gpu_uuid="GPU-i",gpu_name="H200",gpu_index="1"}'
        values: '0.345e9x20'
      - series: 'gpu_sm_clock_max_hertz{namespace="ml",pod="llm-0",gpu_uuid="GPU-i",gpu_name="H200",gpu_index="1"}'
        values: '1.98e9x20'
      # busy and slow, but held by sync boost alone: its group's slowest GPU is the one to look at
      - series: 'gpu_utilization_ratio{namespace="ml",pod="llm-0",gpu_uuid="GPU-s",gpu_name="H200",gpu_index="2"}'
        values: '0.95x20'
      - series: 'gpu_clocks_event_sync_boost_ratio{namespace="ml",pod="llm-0",gpu_uuid="GPU-s",gpu_name="H200",gpu_index="2"}'
        values: '1x20'
      - series: 'gpu_clocks_event_power_cap_ratio{namespace="ml",pod="llm-0",gpu_uuid="GPU-s",gpu_name="H200",gpu_index="2"}'
        values: '0x20'
      - series: 'gpu_sm_clock_hertz{namespace="ml",pod="llm-0",gpu_uuid="GPU-s",gpu_name="H200",gpu_index="2"}'
        values: '1.2e9x20'
      - series: 'gpu_sm_clock_max_hertz{namespace="ml",pod="llm-0",gpu_uuid="GPU-s",gpu_name="H200",gpu_index="2"}'
        values: '1.98e9x20'
      # busy, at its power cap all the time, but within the boost range (96 % of the maximum)
      - series: 'gpu_utilization_ratio{namespace="ml",pod="llm-0",gpu_uuid="GPU-n",gpu_name="H200",gpu_index="3"}'
        values: '0.95x20'
      - series: 'gpu_clocks_event_power_cap_ratio{namespace="ml",pod="llm-0",gpu_uuid="GPU-n",gpu_name="H200",gpu_index="3"}'
        values: '1x20'
      - series: 'gpu_sm_clock_hertz{namespace="ml",pod="llm-0",gpu_uuid="GPU-n",gpu_name="H200",gpu_index="3"}'
        values: '1.9e9x20'
      - series: 'gpu_sm_clock_max_hertz{namespace="ml",pod="llm-0",gpu_uuid="GPU-n",gpu_name="H200",gpu_index="3"}'
        values: '1.98e9x20'
    alert_rule_test:
      - eval_time: 4m
        alertname: GPUClocksThrottled
        exp_alerts: []   # pending
      - eval_time: 8m
        alertname: GPUClocksThrottled
        exp_alerts:
          - exp_labels: {severity: warning, namespace: ml, pod: llm-0, gpu_uuid: GPU-t, gpu_name: H200, gpu_index: "0", reason: "power cap"}
            exp_annotations:
              summary: "GPU GPU-t clocks limited by power cap 90% of the time"
              description: "The clocks of GPU GPU-t (llm-0) are held below 85 % of their maximum while it is busy: every kernel runs slower. Power cap: check the power limit (gpu_power_limit_watts) and the workload's power; thermal: the airflow (gpu_temperature_celsius); HW slowdown or power brake: the board and its power supply."
""")  # noqa: E501
)
