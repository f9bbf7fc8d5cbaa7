"""``docs/metrics.md``, rendered from the declarations: the metric table (``sidecar.metrics``)
and which of each engine's families become the engine's series
(``sidecar.sources.engine.families``). Run ``python -m sidecar.views.reference >
docs/metrics.md``; a test fails when the committed file differs.

A renderer beside the others, so that the table itself imports nothing of the sources.
"""

from __future__ import annotations

from sidecar.metrics import (
    DCGM_EXPORTER_CHECKED,
    DCGM_FIELDS,
    ENGINE_SERIES,
    GPU_ATTRIBUTES,
    GPU_IO,
    GPU_IO_SOURCES,
    METRICS,
    OTEL,
    POINT_LABELS,
    RARE_READ_S,
    RESOURCE_LABELS,
    TABLE,
)
from sidecar.sources.engine.families import ENGINES


def _nvml_series() -> int:
    """How many series NVML can give one GPU in a cycle: every figure of the compute, memory,
    IO and health layers, and the ratios derived from them (Xid counts aside)."""
    return sum(1 for m in TABLE if m.layer in ("compute", "memory", "io", "health")
               and not m.source.startswith("app") and m.name != "gpu_xid_errors_total")


def render_markdown() -> str:
    """The text of ``docs/metrics.md``."""
    lines = [
        "# Metrics reference",
        "",
        "Generated from `sidecar/metrics.py` by `python -m sidecar.views.reference > docs/metrics.md`;",
        "a test fails when this file is out of date.",
        "",
        "Every GPU series carries `gpu_uuid`, `gpu_name`, `gpu_index` and, when configured, `namespace`,",
        "`pod`, `container`, `node` (see docs/configuration.md, *Pod identity*). Series from the app",
        "are one set per GPU whatever the number of processes on it: bytes summed over the GPU's",
        "live processes, ratios computed from those sums, the largest free block of any one",
        "process, retries and OOMs as counters that survive process restarts, and",
        "`gpu_app_processes`; no `pid` label.",
        "Only `--app-process-series` adds the `gpu_app_process_*` series, one set per live process",
        "labelled `pid` (at most `--app-max-processes` per GPU; a restarted worker is a new series).",
        f"Series per cycle with app figures, per GPU: {_nvml_series()} NVML series at most (one",
        "more per Xid code seen), 9 allocator series,",
        "and the latency histogram's buckets + 3 (18 with the client's default buckets), plus 3 per",
        "live process with `--app-process-series`.",
        "A figure a GPU cannot give is absent, never zero.",
        "Histograms are sent as `_bucket{le=...}`, `_sum` and `_count` series.",
        "",
        "**Cadence.** Every figure is judged every cycle, and read every cycle but the rare",
        "counters that NVML gives as field values (PCIe error and replay counters, ECC, row",
        "remapping) and the power limit: the running agent asks for those every",
        f"{RARE_READ_S:g} s and carries their last answer between two asks, so an increase (or a",
        f"new limit) reaches its series and its verdict within {RARE_READ_S:g} s (`diagnose`'s own",
        "sampling asks every cycle). Remote-write and OTLP",
        "receivers get every figure every cycle but those marked *rare* below (maxima, the link's trained",
        "maximum, error and ECC counters, row remapping, Xid counts: they change a few times a",
        "year): a rare figure is sent in the cycle it changes, and again every minute when it",
        "does not, well within Prometheus' 5-minute look-back, so that nothing goes stale and a",
        "counter's increase arrives at once; an agent's first cycle sends them all. `/metrics`,",
        "the Pushgateway (which replaces its group at each push), stdout and the agent's own",
        "window take every figure every cycle.",
        "",
    ]
    lines += ["The dcgm-exporter column names DCGM's field for the same quantity (its unit where it",
              "differs; * marks dcgm-exporter's default set), for dashboards and alerts that move",
              "over; `-` where DCGM has none. The names and the default set are those of",
              f"dcgm-exporter {DCGM_EXPORTER_CHECKED} (its `etc/default-counters.csv`, the newest",
              "release checked; 4.9 and 4.10 report renamed fields and units, not checked here).", ""]
    for layer in ("compute", "memory", "io", "health", "app", "engine", "verdict", "self", "run"):
        lines += [f"## {layer}", "", "| name | type | unit | source | meaning | dcgm-exporter |",
                  "|---|---|---|---|---|---|"]
        for m in METRICS:
            if m.layer == layer:
                dcgm = f"`{DCGM_FIELDS[m.name]}`" if m.name in DCGM_FIELDS else "-"
                rare = " *rare*" if m.cadence == "rare" else ""
                lines.append(f"| `{m.name}`{rare} | {m.kind} | {m.unit} | {m.source} | {m.help} "
                             f"| {dcgm} |")
        lines.append("")
        if layer == "engine":
            lines += _render_engines()
    lines += _render_otel()
    return "\n".join(lines)


def _render_engines() -> list[str]:
    """The engine families each engine series is read from, per engine and release."""

    lines = [
        "### Engine families",
        "",
        "With `--engine-metrics-url` the agent reads the engine's own Prometheus endpoint once",
        "per interval, recognises the engine by its families, and forwards only these, mapped to",
        "the series above (every other family is dropped before parsing, so the series stay",
        "these few whatever the engine adds). Labels the engine adds beyond the model are summed",
        "over: histograms and Triton's figures over all of them; gauges and counters over the",
        "labels that tell replicas apart (vLLM's `engine` core index, SGLang's `dp_rank`), taking",
        "the largest over the others (SGLang's tensor-parallel ranks report the same requests);",
        "the KV-cache usage takes the fullest core. At most 16 models per endpoint (a model name",
        "cut to 128 characters), 64 buckets per histogram; a histogram whose buckets are no",
        "cumulative count (a bound not a number, a count falling) and a KV-cache share outside",
        "0..1 are left out. Where the engine has two names for a figure (vLLM renamed two), the first",
        "present is read. Triton's durations are cumulative microsecond counters: they become",
        "histograms with the `+Inf` bucket only, whose `_sum` over `_count` is the mean (no",
        "quantile). Engine series carry the pod's labels, not a GPU's: the verdict applies them",
        "to every GPU of the pod.",
        "",
        "| series | engine | family | its type | releases | scale |",
        "|---|---|---|---|---|---|",
    ]
    for name in ENGINE_SERIES:
        for engine in ENGINES:
            for fam in engine.figures.get(name, ()):
                count = f" over {' + '.join(f'`{c}`' for c in fam.count)}" if fam.count else ""
                lines.append(f"| `{name}` | {engine.name} | `{fam.name}`{count} | "
                             f"{fam.kind.replace('_', ' ')} | {fam.versions} | "
                             f"{'-' if fam.scale == 1 else f'x {fam.scale:g}'} |")
    lines += ["", "Checked against (each engine's names, in its source and real captures):", ""]
    lines += [f"- {e.name} ({e.title or e.name}): {e.checked}" for e in ENGINES if e.checked]
    lines += ["", "Default endpoints: " + ", ".join(f"{e.name} `{e.default_url}`" for e in ENGINES)
              + ".", ""]
    return lines


def _render_otel() -> list[str]:
    lines = [
        "## OpenTelemetry (OTLP) names",
        "",
        "With `--otlp-url` the same figures are sent as OTLP metrics, cumulative temporality:",
        "gauges as Gauge, counters as monotonic Sum, the semantic conventions' UpDownCounters as",
        "non-monotonic Sum, the latency histogram as an explicit-bucket Histogram (its `le`",
        "buckets become bounds and per-bucket counts). Names and units (UCUM) follow the OpenTelemetry",
        "semantic conventions where they define the figure, ours under `gpu.` otherwise.",
        "The PCIe and NVLink rates go as `gpu.pcie.throughput` and `gpu.nvlink.throughput` with",
        "the conventions' `network.io.direction`. The conventions' `hw.gpu.io` (the GPU's I/O, a",
        "byte counter) has no Prometheus series: the OTLP sink sends it as a monotonic Sum in `By`",
        "per GPU and direction, the integral of `gpu_pcie_tx_bytes_per_second` and",
        "`gpu_pcie_rx_bytes_per_second`: each point adds its rate times the time since the",
        "series' previous point. That is the NVML byte counters' delta when the rate came from",
        "them (fields 197/198) over the same interval, as close when it came from GPM (an",
        "average between two GPM samples), and an estimate from `nvmlDeviceGetPcieThroughput`",
        "(a 20 ms window every 20 s per direction, carried between). The first point is 0 and starts the",
        "total (its start time). A gap adds nothing and restarts nothing: a rate absent from a",
        "cycle, or not a finite non-negative number, adds nothing for its interval, nor does a",
        "point that comes more than 3 times the series' previous interval after its last point",
        "(a stalled agent). PCIe only: NVLink traffic is between GPUs, not the GPU's I/O. A",
        "restarted agent starts again from 0 with a new start time.",
        "",
        "Resource attributes: `service.name` (gpu-sidecar), `service.version`, `host.name`, and "
        + ", ".join(f"`{o}` (from `{p}`)" for p, o in RESOURCE_LABELS.items())
        + "; every `--extra-label` goes on the resource under its own name.",
        "Point attributes: " + ", ".join(f"`{p}` becomes `{o}`" for p, o in POINT_LABELS.items())
        + "; every point of a GPU also has " + ", ".join(f"`{k}={v}`" for k, v in GPU_ATTRIBUTES)
        + ".",
        "",
        "| Prometheus name | OTel name | OTLP type | unit | fixed attributes |",
        "|---|---|---|---|---|",
    ]
    kinds = {"gauge": "Gauge", "counter": "Sum (monotonic)", "updowncounter": "Sum (non-monotonic)",
             "histogram": "Histogram"}
    otel = OTEL
    for m in METRICS:
        o = otel[m.name]
        fixed = ", ".join(f"`{k}={v}`" for k, v in o.attributes) or "-"
        lines.append(f"| `{m.name}` | `{o.name}` | {kinds[o.instrument]} | `{o.unit}` | {fixed} |")
    directions = ", ".join(f"`{k}={v}`" for s in GPU_IO_SOURCES for k, v in otel[s].attributes)
    lines += [f"| (integral of {' and '.join(f'`{s}`' for s in GPU_IO_SOURCES)}) | "
              f"`{GPU_IO.name}` | {kinds[GPU_IO.instrument]} | `{GPU_IO.unit}` | {directions} |", ""]
    return lines


if __name__ == "__main__":
    print(render_markdown(), end="")
