"""What the encoders and the metric table promise: an OTLP non-monotonic Sum (an UpDownCounter
such as ``hw.gpu.memory.usage``) that goes down is sent as it is, never as a counter restart; and
every ``*_total`` series is a counter, in the table and in the exposition's ``# TYPE`` line."""

from __future__ import annotations

from typing import NamedTuple

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from sidecar import metrics
from sidecar.wire import otlp
from tests.promise_tools import cli

GPU = (("gpu_index", "0"), ("gpu_name", "Simulated H200"),
       ("gpu_uuid", "GPU-0c4b24ac-fb68-413f-6f0c-54be2b5a94c7"))
GiB = 1024**3


class S(NamedTuple):
    """A series as the sinks hand it to an encoder."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float
    timestamp_ms: int


def updowncounters() -> list[str]:
    return [name for name, spec in metrics.OTEL.items() if spec.instrument == "updowncounter"]


def test_the_table_maps_device_memory_to_updowncounters():
    assert "gpu_memory_used_bytes" in updowncounters()


@pytest.mark.parametrize("name", updowncounters())
def test_an_otlp_non_monotonic_sum_that_goes_down_is_sent_as_is_and_keeps_its_start(name):
    encoder = otlp.Encoder((("service.name", "gpu-sidecar"), ("host.name", "node-a")),
                           metrics.RESOURCE_LABELS, 1000, "test")
    values = [(5000, 40 * GiB), (6000, 70 * GiB), (7000, 12 * GiB), (8000, 3 * GiB)]
    points = []
    for ts, value in values:
        request = ExportMetricsServiceRequest.FromString(encoder.cycle([S(name, GPU, value, ts)]))
        found = [m for rm in request.resource_metrics for sm in rm.scope_metrics
                 for m in sm.metrics if m.name == metrics.OTEL[name].name]
        assert len(found) == 1, request
        metric = found[0]
        assert metric.WhichOneof("data") == "sum"
        assert not metric.sum.is_monotonic
        assert metric.sum.aggregation_temporality == otlp.CUMULATIVE
        (point,) = metric.sum.data_points
        points.append((point.start_time_unix_nano // 1_000_000, point.time_unix_nano // 1_000_000,
                       point.as_double))
    # the values as sampled, down as well as up; one start time throughout: no reset
    assert points == [(5000, ts, float(v)) for ts, v in values]


def test_a_monotonic_sum_that_goes_down_is_a_reset_by_contrast():
    """The counterpart, so that the test above is about the instrument and not about start
    times in general."""
    encoder = otlp.Encoder((("service.name", "gpu-sidecar"),), metrics.RESOURCE_LABELS, 1000, "t")
    starts = []
    for ts, value in ((5000, 7.0), (6000, 9.0), (7000, 2.0)):
        request = ExportMetricsServiceRequest.FromString(
            encoder.cycle([S("gpu_pcie_replay_errors_total", GPU, value, ts)]))
        (metric,) = [m for rm in request.resource_metrics for sm in rm.scope_metrics
                     for m in sm.metrics]
        assert metric.sum.is_monotonic
        starts.append(metric.sum.data_points[0].start_time_unix_nano // 1_000_000)
    assert starts == [5000, 5000, 7000]


# -- counters are counters ----------------------------------------------------------------------

def totals() -> list[metrics.MetricSpec]:
    return [m for m in metrics.METRICS if m.name.endswith("_total")]


def test_the_metric_table_has_counters():
    assert len(totals()) >= 10


@pytest.mark.parametrize("spec", totals(), ids=lambda m: m.name)
def test_every_total_metric_is_declared_a_counter(spec):
    assert spec.kind == "counter", f"{spec.name} ends in _total but is declared a {spec.kind}"
    assert metrics.OTEL[spec.name].instrument == "counter"


def test_every_counter_is_named_total():
    assert all(m.name.endswith("_total") for m in metrics.METRICS if m.kind == "counter")


def test_the_exposition_on_stdout_types_every_total_series_a_counter():
    done = cli("run", "--once", "--simulate", "fragmented", "--output", "prometheus")
    assert done.returncode == 0, done.stderr[-2000:]
    types = {}
    for line in done.stdout.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split()
            types[family] = kind
    printed = {m.name for m in totals()} & types.keys()
    assert len(printed) >= 5, types  # the agent's own counters and the app's at least
    wrong = {f: k for f, k in types.items() if f.endswith("_total") and k != "counter"}
    assert not wrong, f"counters typed otherwise in the exposition: {wrong}"
    for family in printed:
        assert types[family] == metrics.BY_NAME[family].kind
