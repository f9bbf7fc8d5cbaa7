"""The OTLP/HTTP sink against a receiver that decodes every request with the official
``opentelemetry-proto`` classes (no OTLP receiver is installable here: Debian's Prometheus and
VictoriaMetrics predate OTLP ingestion).

The agent runs as a process with ``--stdout --output json``: its stdout is the record of every
series it produced, and the points the receiver decoded are mapped back through the table of
``sidecar.metrics`` and compared with it, figure, unit, attributes and timestamp. Then the
receiver fails, refuses, answers partial_success and hangs, and nothing spooled is lost."""

from __future__ import annotations

import gzip
import math
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsPartialSuccess,
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from sidecar import metrics, otlp
from sidecar.samples import Series
from sidecar.spool import HEADER
from tests.conftest import ROOT, run_cli
from tests.receivers import Agent, OtlpReceiver, otlp_rows, running
from tests.test_faults import events, last

PROTOBUF = {"Content-Type": "application/x-protobuf"}


def otlp_args(url: str, spool: Path, *extra: str) -> list[str]:
    return ["--simulate", "healthy", "--interval", "0.2", "--push-interval", "0.5",
            "--otlp-url", url, "--spool-dir", str(spool), "--retry-max-backoff", "0.5",
            "--shutdown-timeout", "5", *extra]


def keyed(rows: list[tuple[str, tuple, int, float]]) -> dict[tuple[str, tuple, int], float]:
    counts = Counter((n, labels, ts) for n, labels, ts, _ in rows)
    twice = [k for k, c in counts.items() if c > 1]
    assert not twice, f"{len(twice)} points delivered more than once, e.g. {twice[:2]}"
    return {(n, labels, ts): v for n, labels, ts, v in rows}


def assert_delivered_exactly(receiver: OtlpReceiver, agent: Agent,
                             also: list | None = None) -> None:
    """Every series the agent printed was stored once, bit for bit, and nothing else."""
    sampled = keyed(agent.sampled())
    stored = keyed(otlp_rows([*receiver.stored, *(also or [])]))
    missing, extra = set(sampled) - set(stored), set(stored) - set(sampled)
    assert not missing, f"{len(missing)} sampled but not delivered, e.g. {sorted(missing)[:3]}"
    assert not extra, f"{len(extra)} delivered but never sampled, e.g. {sorted(extra)[:3]}"
    for key, value in sampled.items():
        assert stored[key] == value or (math.isnan(value) and math.isnan(stored[key])), key


def run_for(agent: Agent, seconds: float) -> Agent:
    agent.start()
    time.sleep(seconds)
    assert agent.stop() == 0, "".join(agent.err)[-3000:]
    return agent


def spooled(directory: Path, where: str = "") -> list:
    """The requests kept in a spool (or its rejected/ copies), decoded."""
    out = []
    for path in sorted(directory.rglob("*.batch")):
        if where and path.parent.name != where:
            continue
        body = path.read_bytes()[HEADER.size:]
        out.append(ExportMetricsServiceRequest.FromString(gzip.decompress(body)))
    return out


# -- what is sent ------------------------------------------------------------------------------


def test_every_point_decoded_matches_what_the_agent_printed(tmp_path):
    receiver = OtlpReceiver()
    with running(receiver):
        agent = run_for(Agent(otlp_args(
            receiver.url, tmp_path / "spool", "--pod-namespace", "ml", "--pod-name", "llm-0",
            "--pod-container", "server", "--node-name", "gpu-node-3", "--extra-label",
            "cluster=prod", "--app-process-series")), 3.0)
    assert_delivered_exactly(receiver, agent)
    assert len({ts for _, _, ts, _ in agent.sampled()}) >= 10  # cycles
    headers = receiver.headers[0]
    assert headers["Content-Type"] == "application/x-protobuf"
    assert headers["Content-Encoding"] == "gzip"
    resource = {kv.key: kv.value.string_value
                for kv in receiver.stored[0].resource_metrics[0].resource.attributes}
    assert {k: resource[k] for k in ("k8s.namespace.name", "k8s.pod.name", "k8s.container.name",
                                     "k8s.node.name", "service.name", "cluster")} == {
        "k8s.namespace.name": "ml", "k8s.pod.name": "llm-0", "k8s.container.name": "server",
        "k8s.node.name": "gpu-node-3", "service.name": "gpu-sidecar", "cluster": "prod"}
    names = {m.name for r in receiver.stored for rm in r.resource_metrics
             for sm in rm.scope_metrics for m in sm.metrics}
    assert {"hw.gpu.memory.usage", "hw.gpu.memory.limit", "hw.gpu.utilization",
            "gpu.pcie.throughput", "gpu.app.request.duration", "gpu.sm.occupancy"} <= names
    points = [(m, p) for r in receiver.stored for rm in r.resource_metrics
              for sm in rm.scope_metrics for m in sm.metrics
              for p in getattr(m, m.WhichOneof("data")).data_points]
    usage = next(p for m, p in points if m.name == "hw.gpu.memory.usage")
    attrs = {kv.key: kv.value.string_value for kv in usage.attributes}
    assert attrs["hw.type"] == "gpu" and attrs["hw.vendor"] == "NVIDIA"
    assert attrs["hw.id"].startswith("GPU-") and "Simulated" in attrs["hw.model"]
    pid = next(p for m, p in points if m.name == "gpu.app.process.reserved")
    assert any(kv.key == "process.pid" and kv.value.int_value > 0 for kv in pid.attributes)
    starts = {p.start_time_unix_nano for m, p in points if m.WhichOneof("data") != "gauge"}
    assert len(starts) == 1  # the agent's start, the origin of every cumulative figure
    assert not list((tmp_path / "spool").rglob("*.batch"))


def test_cycles_joined_are_one_request_with_every_cycle_in_order():
    """A batch, a merged backlog and a replayed journal are cycles joined: the joined bytes
    decode as one request holding each cycle's resource in turn."""
    encoder = otlp.Encoder((("service.name", "gpu-sidecar"),), metrics.RESOURCE_LABELS, 1000, "t")
    labels = (("gpu_uuid", "GPU-1"), ("gpu_name", "H200"), ("gpu_index", "0"), ("pod", "p"))
    cycles = [encoder.cycle([Series("gpu_memory_used_bytes", labels, float(i), 2000 + i)])
              for i in range(3)]
    request = ExportMetricsServiceRequest.FromString(b"".join(cycles))
    assert [rm.scope_metrics[0].metrics[0].sum.data_points[0].as_double
            for rm in request.resource_metrics] == [0.0, 1.0, 2.0]
    again = ExportMetricsServiceRequest.FromString(otlp.decompress(otlp.compress(b"".join(cycles))))
    assert again == request


def test_the_mapping_names_the_semantic_conventions_figures_with_their_units():
    otel = metrics.OTEL
    assert (otel["gpu_memory_used_bytes"].name, otel["gpu_memory_used_bytes"].unit,
            otel["gpu_memory_used_bytes"].instrument) == ("hw.gpu.memory.usage", "By",
                                                          "updowncounter")
    assert otel["gpu_memory_total_bytes"].name == "hw.gpu.memory.limit"
    assert (otel["gpu_utilization_ratio"].name, otel["gpu_utilization_ratio"].unit) == \
        ("hw.gpu.utilization", "1")
    assert otel["gpu_pcie_tx_bytes_per_second"].attributes == (("network.io.direction", "transmit"),)
    assert otel["gpu_pcie_rx_bytes_per_second"].attributes == (("network.io.direction", "receive"),)
    assert otel["inference_request_duration_seconds"].instrument == "histogram"
    assert {m.name for m in metrics.METRICS} <= set(metrics._OTEL_NAMES), "name it deliberately"
    for m in metrics.METRICS:
        o = otel[m.name]
        assert o.name.startswith(("hw.", "gpu.")), o.name
        assert o.instrument == m.kind or (m.kind == "gauge" and o.instrument == "updowncounter")
    # no two Prometheus names land on the same OTel metric and attributes
    assert len({(o.name, o.attributes) for o in otel.values()}) == len(otel)


# -- configuration -----------------------------------------------------------------------------


def test_the_url_comes_from_the_environment_too_and_a_bad_one_is_refused_without_its_secret():
    done = run_cli("run", "--otlp-url", "ftp://user:hunter2@collector:4318/v1/metrics")
    assert done.returncode == 2 and "--otlp-url" in done.stderr
    assert "hunter2" not in done.stderr
    done = run_cli("run", "--once", env={"GPU_SIDECAR_OTLP_URL": "http://127.0.0.1:9/v1/metrics"})
    assert done.returncode == 2 and "--once" in done.stderr  # taken as a receiver
    assert "GPU_SIDECAR_OTLP_URL" in run_cli("run", "--help").stdout


@pytest.mark.parametrize("otlp_on", [False, True])
def test_nothing_otlp_is_imported_unless_asked_and_no_protobuf_ever(tmp_path, otlp_on):
    """The RSS budget: an agent without --otlp-url loads nothing of the sink; with it, neither
    protobuf nor (for OTLP alone) snappy."""
    flag = ["--otlp-url", "http://127.0.0.1:9/v1/metrics"] if otlp_on else \
        ["--remote-write-url", "http://127.0.0.1:9/api/v1/write"]
    code = ("import sys; from sidecar import cli, config; "
            f"args = cli._parser().parse_args(['run', *{flag!r}]); "
            "cfg = config.build('run', args, {}); "
            f"cli._sinks(cfg, {str(tmp_path / 'spool')!r}); "
            "print(' '.join(sorted({m.split('.')[0] if not m.startswith('sidecar') else m "
            "for m in sys.modules if m.startswith(('sidecar.otlp', 'sidecar.sinks.otlp', "
            "'google', 'opentelemetry', 'cramjam'))})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=30, check=True).stdout.split()
    assert out == (["sidecar.otlp", "sidecar.sinks.otlp"] if otlp_on else ["cramjam"])


# -- faults ------------------------------------------------------------------------------------


def test_503_and_429_are_retried_honouring_retry_after_and_nothing_is_lost(tmp_path):
    def plan(n, request):
        if n < 3:
            return 503, {}, b"collector overloaded"
        if n < 5:
            return 429, {"Retry-After": "1"}, b"slow down"
        return None

    receiver = OtlpReceiver(plan)
    with running(receiver):
        agent = run_for(Agent(otlp_args(receiver.url, tmp_path / "spool")), 4.5)
    assert_delivered_exactly(receiver, agent)
    times = [t for t, _, _ in receiver.log]
    assert times[4] - times[3] >= 0.95 and times[5] - times[4] >= 0.95, "Retry-After ignored"
    assert last(agent, "gpu_sidecar_push_failures_total", reason="http_5xx") == 3
    assert last(agent, "gpu_sidecar_push_failures_total", reason="http_429") == 2
    assert len(events(agent, "push_failing")) == 1
    assert len(events(agent, "receiver_recovered")) == 1


@pytest.mark.parametrize("status", [400, 500])
def test_a_refused_batch_is_sent_once_set_aside_and_the_rest_flows(tmp_path, status):
    """OTLP says: never retry a 400 or a 500 (only 429, 502, 503, 504). The batch goes to the
    spool's rejected/, counted; it is not lost from sight, and later batches keep flowing."""
    message = b"metric name is invalid"
    # google.rpc.Status{code: 3, message} (googleapis-common-protos is not installed here)
    answer = b"\x08\x03\x12" + bytes((len(message),)) + message
    receiver = OtlpReceiver(lambda n, request: (status, PROTOBUF, answer) if n == 1 else None)
    spool = tmp_path / "spool"
    with running(receiver):
        agent = run_for(Agent(otlp_args(receiver.url, spool)), 3.0)
    refused = receiver.log[1][2]
    assert sum(1 for _, _, r in receiver.log if r == refused) == 1, "a refused request was retried"
    kept = spooled(spool, "rejected")
    assert len(kept) == 1 and kept[0] == refused
    assert_delivered_exactly(receiver, agent, also=kept)  # delivered + set aside = sampled
    assert last(agent, "gpu_sidecar_push_failures_total", reason=f"http_{status}") == 1
    assert last(agent, "gpu_sidecar_samples_dropped_total", reason="rejected") > 0
    logged = events(agent, "batch_refused")
    assert len(logged) == 1 and logged[0]["receiver_said"].endswith("metric name is invalid")


def test_partial_success_is_delivered_counted_and_logged_once(tmp_path):
    partial = ExportMetricsServiceResponse(partial_success=ExportMetricsPartialSuccess(
        rejected_data_points=2, error_message="2 points out of order")).SerializeToString()
    receiver = OtlpReceiver(lambda n, request: (200, PROTOBUF, partial))
    with running(receiver):
        agent = run_for(Agent(otlp_args(receiver.url, tmp_path / "spool", "--push-interval",
                                        "0.2")), 4.0)
    assert_delivered_exactly(receiver, agent)  # not sent again: the receiver has the rest
    answered = len(receiver.log)
    counted = last(agent, "gpu_sidecar_samples_dropped_total", reason="partial_success")
    assert counted is not None and 0 < counted <= 2 * answered and counted % 2 == 0
    logged = events(agent, "partial_success")
    assert answered >= 10 and [e["count"] for e in logged] == [1, 10]  # not one line per batch
    assert logged[0]["points_rejected"] == 2 and logged[0]["receiver_said"] == "2 points out of order"


def test_a_hanging_receiver_holds_neither_sampling_nor_shutdown_and_the_next_start_sends_all(
        tmp_path):
    spool = tmp_path / "spool"
    receiver = OtlpReceiver(delay=60)  # takes every request and never answers
    with running(receiver):
        first = Agent(otlp_args(receiver.url, spool, "--push-timeout", "0.5",
                                "--shutdown-timeout", "1")).start()
        time.sleep(2.5)
        first.signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert first.wait() == 0
        assert time.monotonic() - signalled < 2.0
        assert len({ts for _, _, ts, _ in first.sampled()}) >= 10, "sampling waited on the network"
        assert events(first, "stopped")[0]["all_delivered"] is False
        assert last(first, "gpu_sidecar_push_failures_total", reason="network") > 0
        assert list(spool.rglob("*.batch")), "what was not acknowledged stays in the spool"
        receiver.delay = 0  # it answers again: the next start sends the backlog
        second = run_for(Agent(otlp_args(receiver.url, spool)), 2.0)
    sampled = keyed([*first.sampled(), *second.sampled()])
    assert keyed(otlp_rows(receiver.stored)) == sampled
    assert not list(spool.rglob("*.batch"))


def test_a_killed_agent_loses_nothing_its_journal_held(tmp_path):
    spool = tmp_path / "spool"
    receiver = OtlpReceiver()
    with running(receiver):
        first = Agent(otlp_args(receiver.url, spool, "--push-interval", "60")).start()
        time.sleep(1.5)
        first.signal(signal.SIGKILL)
        first.wait()
        assert list(spool.rglob("*.journal")) and not receiver.log
        second = run_for(Agent(otlp_args(receiver.url, spool)), 1.5)
    printed = keyed([*first.sampled(), *second.sampled()])
    assert keyed(otlp_rows(receiver.stored)) == printed
    assert len(events(second, "journal_replayed")) == 1
