"""A clean stop ends every series the agent sent, as Prometheus ends the series of a target that
vanished: after the last sample, a staleness marker (``STALE_NAN``) for each series sent in the
run, 1 ms after that sample, through the journal and the spool like any cycle. Real Prometheus
(its remote-write receiver) and real VictoriaMetrics then answer an instant query after the stop
with nothing (``gpu_verdict`` and the alert built on it end within the last push), and one before
the stop with what was stored, nothing lost; a receiver down at the stop gets the markers from the
next start. A kill sends none (nothing runs then): its series stay current for the look-back."""

from __future__ import annotations

import signal
import struct
import time
from pathlib import Path

import pytest
import requests
import yaml

from sidecar.samples import Series
from sidecar.sinks.spooled import STALE_NAN, STALE_NAN_BITS
from sidecar.wire.remote_write import Encoder
from tests.prompb import WriteRequest
from tests.receivers import (
    VM_REL,
    Agent,
    OtlpReceiver,
    Prometheus,
    Pushgateway,
    VictoriaMetrics,
    running,
)
from tests.test_otlp import otlp_args
from tests.test_push import as_map, assert_same, push_args
from tests.waiting import until

RULES = Path(__file__).resolve().parents[1] / "deploy" / "alerts" / "gpu-sidecar.rules.yml"
SCENARIO = "pcie-saturated"  # every GPU's verdict is a finding: gpu_verdict{verdict="pcie"} 1
EVERYTHING = '{__name__=~".+"}'


def alert_expr(name: str) -> str:
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == name:
                return rule["expr"]
    raise AssertionError(f"no alert {name} in {RULES}")


def instant(store: VictoriaMetrics | Prometheus, expr: str, at_ms: float) -> list[dict]:
    """An instant query at ``at_ms``, as a dashboard or a rule evaluation asks it."""
    r = requests.get(f"{store.base}/api/v1/query",
                     params={"query": expr, "time": at_ms / 1000, "nocache": "1"}, timeout=30)
    r.raise_for_status()
    return r.json()["data"]["result"]


def verdicts(agent: Agent, at_ms: int) -> set[tuple[str, str]]:
    """The (GPU, kind) the agent sent at 1 in its cycle at ``at_ms``."""
    return {(dict(labels)["gpu_uuid"], dict(labels)["verdict"])
            for n, labels, ts, v in agent.sampled() if n == "gpu_verdict" and ts == at_ms and v == 1}


def stored(store: VictoriaMetrics | Prometheus) -> list[tuple[str, tuple, int, float]]:
    if isinstance(store, VictoriaMetrics):
        return store.settled()
    return store.samples(EVERYTHING, at=time.time() + 1)


def store_of(kind: str, tmp_path: Path) -> VictoriaMetrics | Prometheus:
    return VictoriaMetrics(tmp_path) if kind == "victoriametrics" else Prometheus(tmp_path)


def judging(agent: Agent) -> bool:
    """The agent named its finding on some GPU (a kind, not none) and pushed something."""
    newest = max((ts for n, _, ts, _ in agent.sampled() if n == "gpu_verdict"), default=None)
    return (newest is not None and any(kind != "none" for _, kind in verdicts(agent, newest))
            and agent.total("gpu_sidecar_samples_pushed_total") > 0)


@pytest.mark.parametrize("kind", ["victoriametrics", "prometheus"])
def test_a_clean_stop_ends_every_series_and_the_verdict_alert_and_keeps_what_was_stored(
        tmp_path, kind):
    store = store_of(kind, tmp_path).start()
    with running(store):
        agent = Agent(push_args(store.write_url, tmp_path / "spool",
                                "--simulate", SCENARIO)).start()
        until(lambda: judging(agent) or agent.proc.poll() is not None, interval=0.1,
              what="a finding judged and a push")
        assert agent.stop() == 0, "".join(agent.err)[-3000:]
        sampled = as_map(agent.sampled())
        last = max(ts for _, _, ts in sampled)
        sent = {(n, labels) for n, labels, _ in sampled}
        ended = agent.logged("series_ended")
        assert [(e["series"], e["timestamp_ms"]) for e in ended] == [(len(sent), last + 1)]

        # after the stop, within the look-back: nothing is current, the verdict alert is empty
        until(lambda: not instant(store, EVERYTHING, last + 1), timeout=20,
              what=lambda: f"every series ended 1 ms after the stop; "
                           f"{len(instant(store, EVERYTHING, last + 1))} still current")
        for after_s in (1, 60, 240):
            assert instant(store, EVERYTHING, last + after_s * 1000) == [], after_s
            assert instant(store, alert_expr("GPUVerdictSustained"),
                           last + after_s * 1000) == [], after_s
        # before it, the last cycle is what a query finds: the finding, its alert expression
        def found_at_stop() -> set[tuple[str, str]]:
            return {(r["metric"]["gpu_uuid"], r["metric"]["verdict"])
                    for r in instant(store, "gpu_verdict == 1", last)}

        at_stop = until(lambda: found_at_stop() == verdicts(agent, last) and found_at_stop(),
                        timeout=20, what="the last cycle's verdicts found at the stop")
        firing = {r["metric"]["gpu_uuid"]
                  for r in instant(store, alert_expr("GPUVerdictSustained"), last)}
        assert firing == {uuid for uuid, kind in at_stop if kind != "none"}, (at_stop, firing)
        # and nothing sampled is lost, nothing stored twice; the markers are no samples
        assert_same(as_map(stored(store)), sampled, VM_REL if kind == "victoriametrics" else 0.0)


def test_markers_of_a_stop_while_the_receiver_is_down_arrive_with_the_next_start(tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    spool = tmp_path / "spool"
    with running(vm):
        first = Agent(push_args(vm.write_url, spool, "--simulate", SCENARIO,
                                "--shutdown-timeout", "1")).start()
        until(lambda: judging(first) or first.proc.poll() is not None, interval=0.1,
              what="a finding judged and a push")
        vm.stop()
        until(lambda: first.logged("push_failing"), what="the outage noticed")
        assert first.stop() == 0
        assert first.logged("series_ended") and first.logged("shutdown_left_in_spool")
        last = max(ts for _, _, ts, _ in first.sampled())
        vm.start()
        second = Agent(push_args(vm.write_url, spool, "--simulate", SCENARIO)).start()
        before = as_map(first.sampled())
        until(lambda: set(before) <= set(as_map(vm.samples())) or second.proc.poll() is not None,
              interval=0.2, what="the first run's spool sent by the second")
        assert second.stop() == 0
        begun = min(ts for _, _, ts, _ in second.sampled())
        assert begun > last + 1000, "the second run began too soon to see the gap"
        # between the runs nothing is current: the first run's markers were delivered
        until(lambda: not instant(vm, EVERYTHING, last + 1), timeout=20,
              what="the first run's series ended at its stop")
        assert instant(vm, alert_expr("GPUVerdictSustained"), (last + begun) / 2) == []
        until(lambda: {r["metric"]["gpu_uuid"] for r in instant(vm, "gpu_verdict == 1", last)}
              == {uuid for uuid, _ in verdicts(first, last)}, timeout=20,
              what="the first run's last verdicts found at its stop")
        assert_same({k: v for k, v in as_map(vm.settled()).items() if k[2] <= last},
                    before, VM_REL)


def test_a_kill_sends_no_markers_its_series_stay_current_for_the_look_back(tmp_path):
    prom = Prometheus(tmp_path).start()
    with running(prom):
        agent = Agent(push_args(prom.write_url, tmp_path / "spool", "--simulate", SCENARIO,
                                "--push-interval", "0.2")).start()
        until(lambda: judging(agent) or agent.proc.poll() is not None, interval=0.1,
              what="a finding judged and a push")
        agent.signal(signal.SIGKILL)
        agent.wait()
        assert not agent.logged("series_ended")
        pushed = max(int(float(r["value"][1]) * 1000) for r in prom.query(
            "timestamp(gpu_verdict)"))  # the newest cycle the receiver has
        assert instant(prom, "gpu_verdict == 1", pushed + 60_000), \
            "a killed agent's verdict ended: only a clean stop sends markers"


def test_the_marker_is_prometheus_stale_nan_bit_for_bit():
    assert STALE_NAN_BITS == 0x7FF0000000000002  # prometheus/model/value.StaleNaN
    request = WriteRequest()
    request.ParseFromString(Encoder().cycle([Series("gpu_verdict", (("gpu_uuid", "A"),),
                                                     STALE_NAN, 1_000)]))
    (value,) = [s.value for ts in request.timeseries for s in ts.samples]
    assert struct.unpack("<Q", struct.pack("<d", value))[0] == STALE_NAN_BITS


def test_a_batch_jobs_run_summary_outlives_the_stop_for_the_look_back(tmp_path):
    prom = Prometheus(tmp_path).start()
    with running(prom):
        agent = Agent(push_args(prom.write_url, tmp_path / "spool", "--simulate", SCENARIO,
                                "--batch-job", "train-42", "--pod-namespace", "ml",
                                "--pod-name", "train-42-pod")).start()
        until(lambda: judging(agent) or agent.proc.poll() is not None, interval=0.1,
              what="a finding judged and a push")
        assert agent.stop() == 0, "".join(agent.err)[-3000:]
        last = max(ts for _, _, ts, _ in agent.sampled())
        summary = {(n, labels) for n, labels, ts, _ in agent.sampled()
                   if n.startswith("gpu_run_") and ts == last}
        assert summary, "the last cycle carried no run summary"
        until(lambda: not instant(prom, "gpu_verdict", last + 1), timeout=20,
              what="the Job's verdicts ended at its stop")
        # read after the run (GPUJobRunBottleneck): current for the look-back, as before
        after = {(r["metric"]["__name__"], tuple(sorted(
                 (k, v) for k, v in r["metric"].items() if k != "__name__")))
                 for r in instant(prom, '{__name__=~"gpu_run_.+"}', last + 240_000)}
        assert after == summary


def otlp_points(requests: list) -> list[tuple[tuple, int, object, str]]:
    """Every decoded OTLP point as (its series: metric, resource and point attributes; its time
    in ms; the point; its kind)."""
    out = []
    for request in requests:
        for rm in request.resource_metrics:
            resource = tuple(sorted((kv.key, str(kv.value)) for kv in rm.resource.attributes))
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    kind = metric.WhichOneof("data")
                    for p in getattr(metric, kind).data_points:
                        attrs = tuple(sorted((kv.key, str(kv.value)) for kv in p.attributes))
                        out.append(((metric.name, resource, attrs), p.time_unix_nano // 1_000_000,
                                    p, kind))
    return out


def test_otlp_a_clean_stop_flags_every_series_no_recorded_value(tmp_path):
    receiver = OtlpReceiver()
    with running(receiver):
        agent = Agent(otlp_args(receiver.url, tmp_path / "spool", "--app-process-series")).start()
        until(lambda: agent.cycles() >= 5 and agent.total("gpu_sidecar_samples_pushed_total"),
              interval=0.1, what="5 cycles and a push")
        assert agent.stop() == 0, "".join(agent.err)[-3000:]
    last = max(ts for _, _, ts, _ in agent.sampled())
    points = otlp_points(receiver.stored)
    flagged = [(series, ts, p, kind) for series, ts, p, kind in points if p.flags & 1]
    # every series sent (hw.gpu.io and each histogram included) ends once, 1 ms after the stop
    assert {series for series, *_ in points} == {series for series, *_ in flagged}
    assert len(flagged) == len({series for series, *_ in flagged})
    assert {ts for _, ts, _, _ in flagged} == {last + 1}
    assert max(ts for _, ts, p, _ in points if not p.flags & 1) == last
    for series, _, p, kind in flagged:
        if kind == "histogram":  # counts zero, buckets kept: VictoriaMetrics needs them
            assert p.count == 0 and sum(p.bucket_counts) == 0
            assert len(p.bucket_counts) == len(p.explicit_bounds) + 1 > 1, series
        else:
            assert p.WhichOneof("value") is None, series  # no value recorded
        if kind != "gauge":  # the series' own start, not the marker's time
            assert 0 < p.start_time_unix_nano <= last * 1_000_000, series


def test_pushgateway_a_group_deleted_at_the_stop_ends_its_series_at_prometheus_next_scrape(
        tmp_path):
    pgw = Pushgateway(tmp_path).start()
    prom = Prometheus(tmp_path, scrape=pgw.base.removeprefix("http://")).start()
    with running(pgw, prom):
        agent = Agent(["--simulate", SCENARIO, "--interval", "0.2", "--push-interval", "0.2",
                       "--pushgateway-url", pgw.base, "--pod-namespace", "ml",
                       "--pod-name", "llm-0", "--shutdown-timeout", "5",
                       "--pushgateway-delete-on-exit"]).start()
        until(lambda: prom.query('gpu_verdict{verdict="pcie"} == 1')
              or agent.proc.poll() is not None, interval=0.2,
              what="Prometheus scraping the verdict from the Pushgateway")
        assert agent.stop() == 0, "".join(agent.err)[-3000:]
        assert pgw.groups() == []
        stopped = time.time()
        # the group gone, Prometheus' next scrape (every second) ends what it had scraped
        until(lambda: not prom.query('{__name__=~"gpu_.+"}'), timeout=20, interval=0.5,
              what="the scraped series ended once the group was deleted")
        assert time.time() - stopped < 10
