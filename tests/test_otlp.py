"""The OTLP/HTTP sink against a receiver that decodes every request with the official
``opentelemetry-proto`` classes (no OTLP receiver is installable here: Debian's Prometheus and
VictoriaMetrics predate OTLP ingestion).

The agent runs as a process with ``--stdout --output json``: its stdout is the record of every
series it produced, and the points the receiver decoded are mapped back through the table of
``sidecar.metrics`` and compared with it, figure, unit, attributes and timestamp. Then the
receiver fails, refuses, answers partial_success and hangs, and nothing spooled is lost."""

from __future__ import annotations

import contextlib
import gzip
import itertools
import math
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsPartialSuccess,
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from sidecar import metrics
from sidecar.durability.journal import read as read_journal
from sidecar.durability.spool import HEADER
from sidecar.samples import Series
from sidecar.wire import otlp
from tests.conftest import ROOT, run_cli
from tests.receivers import Agent, OtlpReceiver, otlp_io, otlp_rows, running
from tests.test_faults import events, last
from tests.waiting import until

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


def integral_of_rates(sampled: list) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """hw.gpu.io as issue #14 defines it, from what the agent printed: per GPU and direction,
    (time ms, bytes so far), each cycle adding its PCIe rate times the time since the previous
    cycle; nothing for a step after a cycle without the rate or longer than 3 times the last."""
    cycles = sorted({ts for _, _, ts, _ in sampled})
    next_cycle = dict(itertools.pairwise(cycles))
    direction = {"gpu_pcie_tx_bytes_per_second": "transmit",
                 "gpu_pcie_rx_bytes_per_second": "receive"}
    rates: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for name, labels, ts, value in sampled:
        if name in direction:
            rates.setdefault((dict(labels)["gpu_uuid"], direction[name]), []).append((ts, value))
    out = {}
    for key, points in rates.items():
        points.sort()
        total, last_step, totals = 0.0, 0, [(points[0][0], 0.0)]
        for (before, _), (ts, rate) in itertools.pairwise(points):
            step = ts - before
            if next_cycle[before] == ts and (not last_step or step <= 3 * last_step):
                total += rate * step / 1000
                last_step = step
            totals.append((ts, total))
        out[key] = totals
    return out


def assert_io_is_the_integral_of_the_printed_rates(receiver: OtlpReceiver, agent: Agent) -> None:
    sent = otlp_io(receiver.stored)
    expected = integral_of_rates(agent.sampled())
    assert sent.keys() == expected.keys() and len(sent) >= 2  # both directions of each GPU
    for key, points in sent.items():
        points.sort(key=lambda p: p[1])
        assert [ns // 1_000_000 for _, ns, _ in points] == [ts for ts, _ in expected[key]], key
        assert {start for start, _, _ in points} == {points[0][1]}, "starts at its first point"
        for (_, ns, value), (_, total) in zip(points, expected[key], strict=True):
            assert math.isclose(value, total, rel_tol=1e-12), (key, ns, value, total)
        assert points[0][2] == 0.0 and points[-1][2] > 0


def run_for(agent: Agent, done: Callable[[], object], what: str) -> Agent:
    """Run the agent until ``done`` holds (the state the test then judges; ``what`` names it),
    then two cycles more, so that the self-metrics it printed caught up with that state, and
    stop it (a stop delivers the rest)."""
    agent.start()
    until(lambda: done() or agent.proc.poll() is not None, interval=0.2, what=what)
    agent.more_cycles(2, f"after {what}")  # fails if the agent exited
    assert agent.stop() == 0, "".join(agent.err)[-3000:]
    return agent


def keys(rows: list[tuple[str, tuple, int, float]]) -> set[tuple[str, tuple, int]]:
    return {(n, labels, ts) for n, labels, ts, _ in rows}


def stored_all_of(receiver: OtlpReceiver, agent: Agent) -> bool:
    """Whether the receiver stored every point the agent printed so far."""
    return keys(agent.sampled()) <= keys(otlp_rows(list(receiver.stored)))


def journaled(spool: Path) -> int:
    """Cycles held in the spool's journals (intact records)."""
    held = 0
    for path in spool.rglob("*.journal"):
        with contextlib.suppress(FileNotFoundError):  # sealed meanwhile
            held += sum(1 for _ in read_journal(path).records)
    return held


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
        agent = Agent(otlp_args(
            receiver.url, tmp_path / "spool", "--pod-namespace", "ml", "--pod-name", "llm-0",
            "--pod-container", "server", "--node-name", "gpu-node-3", "--extra-label",
            "cluster=prod", "--app-process-series"))
        run_for(agent, lambda: agent.cycles() >= 10, "10 cycles printed")
    assert_delivered_exactly(receiver, agent)
    assert len({ts for _, _, ts, _ in agent.sampled()}) >= 10  # cycles
    assert_io_is_the_integral_of_the_printed_rates(receiver, agent)
    headers = receiver.headers[0]
    assert headers["Content-Type"] == "application/x-protobuf"
    assert headers["Content-Encoding"] == "gzip"
    resource = {kv.key: kv.value.string_value
                for kv in receiver.stored[0].resource_metrics[0].resource.attributes}
    assert {k: resource[k] for k in ("k8s.namespace.name", "k8s.pod.name", "k8s.container.name",
                                     "k8s.node.name", "service.name", "service.instance.id",
                                     "cluster")} == {
        "k8s.namespace.name": "ml", "k8s.pod.name": "llm-0", "k8s.container.name": "server",
        "k8s.node.name": "gpu-node-3", "service.name": "gpu-sidecar",
        "service.instance.id": "ml/llm-0", "cluster": "prod"}
    names = {m.name for r in receiver.stored for rm in r.resource_metrics
             for sm in rm.scope_metrics for m in sm.metrics}
    assert {"hw.gpu.memory.usage", "hw.gpu.memory.limit", "hw.gpu.utilization", "hw.gpu.io",
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
    # every cumulative point starts when its series was first seen (none was reset here)
    first_seen: dict = {}
    cumulative = [(str(rm.resource), m, p) for r in receiver.stored for rm in r.resource_metrics
                  for sm in rm.scope_metrics for m in sm.metrics if m.WhichOneof("data") != "gauge"
                  for p in getattr(m, m.WhichOneof("data")).data_points]
    for resource, m, p in sorted(cumulative, key=lambda rmp: rmp[2].time_unix_nano):
        key = (resource, m.name, tuple(sorted((kv.key, str(kv.value)) for kv in p.attributes)))
        first_seen.setdefault(key, p.time_unix_nano)
        assert p.start_time_unix_nano == first_seen[key], m.name
    assert len(first_seen) > 10
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
    # the GenAI conventions' server metrics, histograms in seconds
    for ours, theirs in (("engine_request_duration_seconds", "gen_ai.server.request.duration"),
                         ("engine_time_to_first_token_seconds",
                          "gen_ai.server.time_to_first_token"),
                         ("engine_inter_token_latency_seconds",
                          "gen_ai.server.time_per_output_token")):
        assert (otel[ours].name, otel[ours].unit, otel[ours].instrument) == \
            (theirs, "s", "histogram")
    assert metrics.POINT_LABELS["model"] == "gen_ai.request.model"
    # every figure is named deliberately: in its entry of the table, the engine's in _ENGINE_OTEL
    assert set(metrics.ENGINE_SERIES) <= set(metrics._ENGINE_OTEL), "name it deliberately"
    for m in metrics.METRICS:
        o = otel[m.name]
        assert o.name.startswith(("hw.", "gpu.", "gen_ai.server.")), o.name
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
    code = ("import sys; from sidecar import cli, config, wiring; "
            f"args = cli._parser().parse_args(['run', *{flag!r}]); "
            "cfg = config.build('run', args, {}); "
            f"wiring.build_sinks(cfg, {str(tmp_path / 'spool')!r}); "
            "print(' '.join(sorted({m.split('.')[0] if not m.startswith('sidecar') else m "
            "for m in sys.modules if m.startswith(('sidecar.wire.otlp', 'sidecar.sinks.otlp', "
            "'google', 'opentelemetry', 'cramjam'))})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=30, check=True).stdout.split()
    assert out == (["sidecar.sinks.otlp", "sidecar.wire.otlp"] if otlp_on else ["cramjam"])


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
        agent = Agent(otlp_args(receiver.url, tmp_path / "spool"))
        run_for(agent, lambda: len(receiver.log) >= 6 and events(agent, "receiver_recovered"),
                "the 6th request, accepted, and receiver_recovered logged")
    assert_delivered_exactly(receiver, agent)
    times = [t for t, _, _ in receiver.log]
    assert times[4] - times[3] >= 0.95 and times[5] - times[4] >= 0.95, "Retry-After ignored"
    assert last(agent, "gpu_sidecar_push_failures_total", reason="http_5xx") == 3
    assert last(agent, "gpu_sidecar_push_failures_total", reason="http_429") == 2
    assert len(events(agent, "push_failing")) == 1
    assert len(events(agent, "receiver_recovered")) == 1


@pytest.mark.parametrize("status", [400, 422])
def test_a_refused_batch_is_sent_once_set_aside_and_the_rest_flows(tmp_path, status):
    """An answer about the data itself (400, 413, 422) is never retried: the batch goes to the
    spool's rejected/, counted; it is not lost from sight, and later batches keep flowing."""
    message = b"metric name is invalid"
    # google.rpc.Status{code: 3, message} (googleapis-common-protos is not installed here)
    answer = b"\x08\x03\x12" + bytes((len(message),)) + message
    receiver = OtlpReceiver(lambda n, request: (status, PROTOBUF, answer) if n == 1 else None)
    spool = tmp_path / "spool"
    with running(receiver):
        agent = Agent(otlp_args(receiver.url, spool))
        # three requests after the refused one: a retry of it would have come first
        run_for(agent, lambda: len(receiver.log) >= 5 and events(agent, "batch_refused"),
                "batch_refused logged and 3 requests after the refused one")
    refused = receiver.log[1][2]
    assert sum(1 for _, _, r in receiver.log if r == refused) == 1, "a refused request was retried"
    kept = spooled(spool, "rejected")
    assert len(kept) == 1 and kept[0] == refused
    assert_delivered_exactly(receiver, agent, also=kept)  # delivered + set aside = sampled
    assert last(agent, "gpu_sidecar_push_failures_total", reason=f"http_{status}") == 1
    assert last(agent, "gpu_sidecar_samples_dropped_total", reason="rejected") > 0
    logged = events(agent, "batch_refused")
    assert len(logged) == 1 and logged[0]["receiver_said"].endswith("metric name is invalid")


def partial_answer(rejected: int, message: str) -> bytes:
    return ExportMetricsServiceResponse(partial_success=ExportMetricsPartialSuccess(
        rejected_data_points=rejected, error_message=message)).SerializeToString()


def test_partial_success_is_delivered_counted_and_each_condition_logged_once(tmp_path):
    """Points rejected (an error), then a warning only (rejected 0, a message), then points
    rejected again: three conditions, three log lines, whatever the number of answers. The same
    body with a JSON Content-Type is not read as protobuf."""
    rejected, warning = partial_answer(2, "2 points out of order"), partial_answer(0, "slow down")

    def plan(n, request):
        if n < 4:
            return 200, PROTOBUF, rejected
        if n < 8:
            return 200, PROTOBUF, warning
        if n < 10:  # the same bytes, said to be JSON: not ours to decode as protobuf
            return 200, {"Content-Type": "application/json"}, partial_answer(5, "json says")
        return 200, PROTOBUF, rejected

    receiver = OtlpReceiver(plan)
    with running(receiver):
        agent = Agent(otlp_args(receiver.url, tmp_path / "spool", "--push-interval", "0.2"))
        run_for(agent, lambda: len(receiver.log) >= 12, "12 requests answered")
    assert_delivered_exactly(receiver, agent)  # not sent again: the receiver has the rest
    answered = len(receiver.log)
    assert answered >= 12
    counted = last(agent, "gpu_sidecar_samples_dropped_total", reason="partial_success")
    assert counted is not None and 0 < counted <= 2 * (answered - 6) and counted % 2 == 0
    assert "json says" not in "".join(agent.err)
    logged = [(e["level"], e["points_rejected"], e["receiver_said"])
              for e in events(agent, "partial_success")]
    assert logged == [("error", 2, "2 points out of order"), ("warning", 0, "slow down"),
                      ("error", 2, "2 points out of order")]


def test_a_hanging_receiver_holds_neither_sampling_nor_shutdown_and_the_next_start_sends_all(
        tmp_path):
    spool = tmp_path / "spool"
    receiver = OtlpReceiver(delay=60)  # takes every request and never answers
    with running(receiver):
        first = Agent(otlp_args(receiver.url, spool, "--push-timeout", "0.5",
                                "--shutdown-timeout", "1")).start()
        # four pushes hung to their 0.5 s timeout (at least 2.5 s of a hanging network, with the
        # first push interval), and what they carried still spooled
        until(lambda: ((last(first, "gpu_sidecar_push_failures_total", reason="network") or 0)
                       >= 4 and list(spool.rglob("*.batch"))) or first.proc.poll() is not None,
              what=lambda: f"4 network failures printed and a batch spooled (failures "
                           f"{last(first, 'gpu_sidecar_push_failures_total', reason='network')}, "
                           f"cycles {first.cycles()})")
        assert first.proc.poll() is None, "".join(first.err)[-3000:]
        first.signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert first.wait() == 0
        assert time.monotonic() - signalled < 2.0
        assert len({ts for _, _, ts, _ in first.sampled()}) >= 10, "sampling waited on the network"
        assert events(first, "stopped")[0]["all_delivered"] is False
        assert last(first, "gpu_sidecar_push_failures_total", reason="network") > 0
        assert list(spool.rglob("*.batch")), "what was not acknowledged stays in the spool"
        receiver.delay = 0  # it answers again: the next start sends the backlog
        second = run_for(Agent(otlp_args(receiver.url, spool)),
                         lambda: stored_all_of(receiver, first), "the backlog delivered")
    sampled = keyed([*first.sampled(), *second.sampled()])
    assert keyed(otlp_rows(receiver.stored)) == sampled
    assert not list(spool.rglob("*.batch"))


def test_a_killed_agent_loses_nothing_its_journal_held(tmp_path):
    """SIGKILL at any moment of a cycle: what the journal held is delivered once, bit for bit,
    by the next start. The journal holds every cycle the agent printed (stdout is fed last), and
    at most one more: the cycle the kill cut short while it was being printed."""
    spool = tmp_path / "spool"
    receiver = OtlpReceiver()
    with running(receiver):
        first = Agent(otlp_args(receiver.url, spool, "--push-interval", "60")).start()
        until(lambda: journaled(spool) >= 5 or first.proc.poll() is not None,
              what=lambda: f"5 cycles journaled (at {journaled(spool)})")
        assert first.proc.poll() is None, "".join(first.err)[-3000:]
        first.signal(signal.SIGKILL)
        first.wait()
        assert list(spool.rglob("*.journal")) and not receiver.log
        held = keyed(otlp_rows([ExportMetricsServiceRequest.FromString(body)
                                for path in spool.rglob("*.journal")
                                for body, _ in read_journal(path).records] + spooled(spool)))
        second = run_for(Agent(otlp_args(receiver.url, spool)),
                         lambda: stored_all_of(receiver, first), "the journal's cycles delivered")
    printed = keyed(first.sampled())
    assert printed.items() <= held.items(), "a printed cycle missing from the journal"
    unprinted = {ts for _, _, ts in held.keys() - printed.keys()}
    assert len(unprinted) <= 1 and all(ts >= max(t for _, _, t in printed) for ts in unprinted)
    assert len({ts for _, _, ts in held}) >= 5
    assert keyed(otlp_rows(receiver.stored)) == held | keyed(second.sampled())
    assert len(events(second, "journal_replayed")) == 1


# -- in process: a backlog spooled before the sender starts ------------------------------------


def _status(code: int) -> bytes:
    """google.rpc.Status{code} with no message, and a fixed32 field this agent does not know
    (a newer receiver's): the answer must be read all the same, and never printed as text."""
    return b"\x08" + bytes((code,)) + b"\x1d\x01\x02\x03\x04"


def _backlog(url: str, spool_dir: Path, batches: int = 30):
    from sidecar.config import Config
    from sidecar.durability.spool import Spool
    from sidecar.sinks.otlp import otlp_sink

    spool = Spool(spool_dir, max_bytes=64 << 20)
    sink = otlp_sink(url, spool, Config(push_timeout=5, retry_max_backoff=0.1),
                     push_interval_s=0.0, max_batch_samples=1000, initial_backoff_s=0.05)
    labels = (("gpu_uuid", "GPU-1"), ("namespace", "ml"), ("pod", "llm-0"))
    for i in range(batches):  # each emit seals a batch: 30 batches wait in the spool
        sink.emit([Series("gpu_sm_occupancy_ratio", labels, i / 100, 1_700_000_000_000 + i)])
    assert len(spool) == batches
    return sink, spool


@pytest.mark.parametrize("status", [500, 404, 501])
def test_a_backlog_that_meets_500s_or_a_wrong_url_stays_in_the_spool_and_is_all_delivered(
        tmp_path, status):
    """30 spooled batches, merged into one request; the receiver answers ``status`` for 2 s,
    then accepts. A 500 is retried with backoff (Prometheus 3 answers 500 for transient append
    errors); a 404 or 501 (wrong URL, no OTLP there) keeps every batch and retries at the
    longest backoff. Nothing may reach rejected/: everything is delivered once it accepts."""
    import structlog

    refuse_until = [float("inf")]

    def plan(n, request):
        if time.monotonic() < refuse_until[0]:
            return status, PROTOBUF, _status(5)
        return None

    receiver = OtlpReceiver(plan)
    with running(receiver), structlog.testing.capture_logs() as logs:
        sink, spool = _backlog(receiver.url, tmp_path / "spool")
        refuse_until[0] = time.monotonic() + 2.0
        sink.start()
        until(lambda: len(spool) == 0, interval=0.02,
              what=lambda: f"the backlog delivered ({len(spool)} batches left)")
        assert sink.close(time.monotonic() + 2)
    assert not list((tmp_path / "spool").rglob("rejected/*")), "a batch was set aside"
    assert spool.dropped_samples["rejected"] == 0
    values = sorted(p.as_double for r in receiver.stored for rm in r.resource_metrics
                    for sm in rm.scope_metrics for m in sm.metrics for p in m.gauge.data_points)
    assert values == [i / 100 for i in range(30)]  # all of it, once
    refusals = sum(1 for _, answered, _ in receiver.log if answered == status)
    assert refusals >= 5  # it did refuse for a while
    if status == 500:
        assert sink.failures["http_5xx"] == refusals
        assert [e["event"] for e in logs if e["event"].startswith("push_")] == ["push_failing"]
        assert len([e for e in logs if e["event"] == "receiver_recovered"]) == 1
        return
    assert sink.failures[f"http_{status}"] == refusals  # per attempt
    began = [e for e in logs if e["event"] == "push_refused"]
    ended = [e for e in logs if e["event"] == "push_refused_ended"]
    assert len(began) == 1 and len(ended) == 1 and ended[0]["attempts"] == refusals
    assert began[0]["receiver_said"] == f"HTTP {status}: google.rpc.Status code 5, no message"
    assert began[0]["hint"] and began[0]["backlog_batches"] == 30
    times = [t for t, answered, _ in receiver.log if answered == status]
    assert min(b - a for a, b in itertools.pairwise(times)) >= 0.09  # the longest wait


def test_an_answer_that_cannot_be_read_after_a_2xx_never_sends_the_batch_again(tmp_path):
    receiver = OtlpReceiver()
    with running(receiver):
        import structlog

        sink, spool = _backlog(receiver.url, tmp_path / "spool", batches=3)

        def unreadable(response):
            raise RuntimeError("decoder bug")

        readable, sink.codec.partial = sink.codec.partial, unreadable
        with structlog.testing.capture_logs() as logs:
            sink.start()
            until(lambda: len(spool) == 0, interval=0.02,
                  what=lambda: f"the backlog delivered ({len(spool)} batches left)")
            # a later batch delivered: the sender went past the first one, so a resend of it
            # would have come before this one
            sink.codec.partial = readable
            labels = (("gpu_uuid", "GPU-1"), ("namespace", "ml"), ("pod", "llm-0"))
            sink.emit([Series("gpu_sm_occupancy_ratio", labels, 0.5, 1_700_000_001_000)])
            until(lambda: len(receiver.stored) >= 2 and len(spool) == 0, interval=0.02,
                  what=lambda: f"a later batch delivered (requests {len(receiver.log)}, "
                               f"{len(spool)} batches left)")
            assert sink.close(time.monotonic() + 2)
    sent = [sorted(p.as_double for rm in r.resource_metrics for sm in rm.scope_metrics
                   for m in sm.metrics for p in m.gauge.data_points) for _, _, r in receiver.log]
    assert sent == [[0.0, 0.01, 0.02], [0.5]], "an accepted batch was sent again"
    assert sink.failures["internal"] == 1 and sink.samples_pushed == 3 + 1
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["answer_unreadable"]


# -- the encoder: what any figure does on the wire ---------------------------------------------


def _points(encoder: otlp.Encoder, series: list[Series]) -> list:
    request = ExportMetricsServiceRequest.FromString(encoder.cycle(series))
    return [(m.name, p) for rm in request.resource_metrics for sm in rm.scope_metrics
            for m in sm.metrics for p in getattr(m, m.WhichOneof("data")).data_points]


def test_a_counter_that_goes_down_gets_a_new_start_and_a_new_series_starts_when_first_seen():
    encoder = otlp.Encoder((("service.name", "gpu-sidecar"), ("host.name", "node-a")),
                           metrics.RESOURCE_LABELS, 1000, "t")
    gpu = (("gpu_uuid", "GPU-1"),)
    name, hist = "gpu_pcie_replay_errors_total", "inference_request_duration_seconds"

    def cycle(ts: int, errors: float, count: float, other: bool = False) -> dict:
        series = [Series(name, gpu, errors, ts),
                  Series(f"{hist}_bucket", (*gpu, ("le", "+Inf")), count, ts),
                  Series(f"{hist}_sum", gpu, count / 10, ts), Series(f"{hist}_count", gpu, count, ts)]
        if other:
            series.append(Series(name, (("gpu_uuid", "GPU-2"),), 1.0, ts))
        return {(n, dict((kv.key, kv.value.string_value) for kv in p.attributes)["hw.id"]):
                p.start_time_unix_nano // 1_000_000 for n, p in _points(encoder, series)}

    first = cycle(5000, 3.0, 10.0)
    assert set(first.values()) == {5000}  # first seen, not the encoder's start (1000)
    assert set(cycle(6000, 4.0, 12.0).values()) == {5000}  # growing: the same start
    later = cycle(7000, 1.0, 12.0, other=True)  # the counter went down: reset; GPU-2 is new
    assert later == {("hw.errors", "GPU-1"): 7000, ("gpu.app.request.duration", "GPU-1"): 5000,
                     ("hw.errors", "GPU-2"): 7000}
    assert set(cycle(8000, 2.0, 2.0, other=True).values()) == {7000, 8000}
    assert cycle(9000, 2.0, 3.0)[("gpu.app.request.duration", "GPU-1")] == 8000  # count reset
    resource = ExportMetricsServiceRequest.FromString(encoder.cycle(
        [Series(name, gpu, 2.0, 9000)])).resource_metrics[0].resource
    assert {kv.key: kv.value.string_value for kv in resource.attributes}[
        "service.instance.id"] == "node-a"  # no pod: the host name


def test_hw_gpu_io_starts_at_0_and_a_gap_or_a_missing_rate_adds_nothing_for_its_interval():
    encoder = otlp.Encoder((("service.name", "gpu-sidecar"),), metrics.RESOURCE_LABELS, 1000, "t",
                           max_cached_series=4)
    gpu = (("gpu_uuid", "GPU-1"),)
    tx, rx = "gpu_pcie_tx_bytes_per_second", "gpu_pcie_rx_bytes_per_second"

    def cycle(ts: int, rate: float | None) -> tuple:
        series = [Series("gpu_utilization_ratio", gpu, 0.5, ts), Series(rx, gpu, 1000.0, ts)]
        if rate is not None:
            series.append(Series(tx, gpu, rate, ts))
        io = {dict((kv.key, kv.value.string_value) for kv in p.attributes)[
            "network.io.direction"]: p for n, p in _points(encoder, series) if n == "hw.gpu.io"}
        assert io["receive"].start_time_unix_nano == 5000 * 1_000_000
        if rate is None:
            assert "transmit" not in io
            return ()
        p = io["transmit"]
        assert p.time_unix_nano == ts * 1_000_000
        return p.start_time_unix_nano // 1_000_000, p.as_double

    assert cycle(5000, 100.0) == (5000, 0.0)  # the first point starts the integral
    assert cycle(5200, 50.0) == (5000, 10.0)  # + 50 B/s x 0.2 s
    assert cycle(5400, float("nan")) == (5000, 10.0)  # no rate for this interval
    assert cycle(5600, 10.0) == (5000, 12.0)
    assert cycle(5800, None) == ()  # absent from a cycle ...
    assert cycle(6000, 100.0) == (5000, 12.0)  # ... the gap it leaves adds nothing
    assert cycle(6200, 100.0) == (5000, 32.0)
    assert cycle(6900, 100.0) == (5000, 32.0)  # 700 ms > 3 x 200 ms: a stall, nothing added
    assert cycle(7100, 100.0) == (5000, 52.0)  # and nothing restarted
    assert cycle(7700, 100.0) == (5000, 112.0)  # 3 x 200 ms exactly: still counted
    request = ExportMetricsServiceRequest.FromString(encoder.cycle([Series(tx, gpu, 1.0, 9000)]))
    metric = request.resource_metrics[0].scope_metrics[0].metrics[-1]
    assert (metric.name, metric.unit, metric.sum.is_monotonic) == ("hw.gpu.io", "By", True)
    assert metric.description == metrics.GPU_IO_HELP
    for i in range(10):  # the totals are bounded like the start times
        encoder.cycle([Series(tx, (("gpu_uuid", f"GPU-{i + 2}"),), 1.0, 10_000)])
    assert len(encoder._io) <= 5


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 2.0 ** 64, 1e300])
def test_a_histogram_the_wire_cannot_carry_is_left_out_and_counted_never_raised(tmp_path, bad):
    from sidecar.sinks.otlp import OtlpCodec

    codec = OtlpCodec({"service.name": "gpu-sidecar", "host.name": "h"})
    gpu = (("gpu_uuid", "GPU-1"),)
    hist = "inference_request_duration_seconds"
    series = [Series(f"{hist}_bucket", (*gpu, ("le", "0.1")), 1.0, 2000),
              Series(f"{hist}_bucket", (*gpu, ("le", "+Inf")), bad, 2000),
              Series(f"{hist}_sum", gpu, 1.0, 2000), Series(f"{hist}_count", gpu, bad, 2000),
              Series("gpu_utilization_ratio", gpu, bad, 2000),  # a double carries any of them
              Series("gpu_app_process_reserved_bytes", (*gpu, ("pid", "²")), 1.0, 2000),
              Series("gpu_app_process_reserved_bytes", (*gpu, ("pid", str(1 << 63))), 2.0, 2000),
              Series("gpu_app_process_reserved_bytes", (*gpu, ("pid", "4242")), 3.0, 2000)]
    points = _points(codec.encoder, series)
    assert [n for n, _ in points].count("gpu.app.request.duration") == 0
    assert codec.dropped == {"unencodable": 4}
    util = next(p for n, p in points if n == "hw.gpu.utilization")
    assert util.as_double == bad or (math.isnan(bad) and math.isnan(util.as_double))
    pids = [next(kv.value for kv in p.attributes if kv.key == "process.pid")
            for n, p in points if n == "gpu.app.process.reserved"]
    assert [v.WhichOneof("value") for v in pids] == ["string_value", "string_value", "int_value"]
    assert pids[1].string_value == str(1 << 63) and pids[2].int_value == 4242


def test_varint_encodes_int64_as_twos_complement_and_refuses_what_fits_no_64_bits():
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue

    for n in (-1, -(1 << 63), (1 << 63) - 1, 0, 300):
        assert AnyValue.FromString(b"\x18" + otlp.varint(n)).int_value == n
    assert len(otlp.varint(-1)) == 10
    for n in (1 << 64, -(1 << 63) - 1):
        with pytest.raises(ValueError):
            otlp.varint(n)


def test_answers_with_fields_this_agent_does_not_know_are_still_read():
    partial = partial_answer(3, "3 points too old")
    # an unknown fixed64 field before, a fixed32 field after (a newer receiver's additions)
    answer = b"\x11" + bytes(8) + partial + b"\x1d" + bytes(4)
    assert otlp.partial_success(answer) == otlp.PartialSuccess(3, "3 points too old")
    assert otlp.status_message(b"\x08\x07") == "google.rpc.Status code 7, no message"
    assert otlp.status_message(b"\x08\x03\x12\x03bad\x1d" + bytes(4)) == "bad"
    assert otlp.status_message(b"\xff\xff").startswith("(2 bytes of protobuf")
