"""Delivery to real receivers, compared sample by sample with what the agent sampled.

The agent runs as a subprocess with ``--stdout --output json``: its stdout is the record of every
series it produced, and what VictoriaMetrics, Prometheus or the Pushgateway stored is read back
and compared with it: same series, labels, values and timestamps, nothing missing, nothing twice.
"""

from __future__ import annotations

import itertools
import math
import signal
import time
from collections import Counter
from pathlib import Path

import pytest

from sidecar.wire.remote_write import decompress
from tests.prompb import WriteRequest
from tests.receivers import (
    VM_REL,
    Agent,
    FaultProxy,
    Prometheus,
    Pushgateway,
    VictoriaMetrics,
    VmAgent,
    running,
)
from tests.waiting import until

Key = tuple[str, tuple, int]


def push_args(url: str, spool: Path, *extra: str) -> list[str]:
    return ["--simulate", "healthy", "--interval", "0.2", "--push-interval", "0.5",
            "--remote-write-url", url, "--spool-dir", str(spool), "--retry-max-backoff", "0.5",
            "--shutdown-timeout", "8", *extra]


def as_map(rows: list[tuple[str, tuple, int, float]]) -> dict[Key, float]:
    counts = Counter((n, labels, ts) for n, labels, ts, _ in rows)
    twice = [k for k, c in counts.items() if c > 1]
    assert not twice, f"{len(twice)} samples stored more than once, e.g. {twice[:2]}"
    return {(n, labels, ts): v for n, labels, ts, v in rows}


def assert_same(stored: dict[Key, float], sampled: dict[Key, float], rel: float = 0.0) -> None:
    missing = set(sampled) - set(stored)
    extra = set(stored) - set(sampled)
    assert not missing, f"{len(missing)} sampled but not stored, e.g. {sorted(missing)[:3]}"
    assert not extra, f"{len(extra)} stored but never sampled, e.g. {sorted(extra)[:3]}"
    for key, value in sampled.items():
        assert math.isclose(stored[key], value, rel_tol=rel, abs_tol=0.0), (key, stored[key], value)


def pushed(agent: Agent) -> float:
    """Samples the agent says it delivered, as of its newest cycle."""
    return agent.total("gpu_sidecar_samples_pushed_total")


def run_until(agent: Agent, condition, what: str) -> None:
    """Start the agent, wait for ``condition``, stop it (SIGTERM: a last sample and a flush)."""
    agent.start()
    until(lambda: condition() or agent.proc.poll() is not None, what=what, interval=0.1)
    assert agent.proc.poll() is None, "".join(agent.err)[-3000:]
    assert agent.stop() == 0, "".join(agent.err)[-3000:]


def pushed_to_pgw(agent: Agent) -> bool:
    """The Pushgateway sink says it pushed (it counts no samples, it stamps its last success)."""
    return agent.last("gpu_sidecar_last_push_success_timestamp_seconds") is not None


def delivering(agent: Agent, cycles: int) -> bool:
    """The agent sampled ``cycles`` cycles and pushed some before any shutdown flush."""
    return agent.cycles() >= cycles and pushed(agent) > 0


def sampled_some(agent: Agent) -> dict[Key, float]:
    """What the agent sampled, which must be at least one cycle: comparing two empty maps proves
    nothing."""
    sampled = as_map(agent.sampled())
    assert sampled and agent.cycles() >= 1, "the agent sampled nothing"
    return sampled



def test_victoriametrics_stores_exactly_what_was_sampled(tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    with running(vm):
        agent = Agent(push_args(vm.write_url, tmp_path / "spool"))
        run_until(agent, lambda: delivering(agent, 10), "10 cycles and a push")
        sampled = sampled_some(agent)
        assert len({k[2] for k in sampled}) >= 10  # cycles
        assert_same(as_map(vm.settled(len(sampled))), sampled, VM_REL)
        names = {k[0] for k in sampled}
        assert {"gpu_sm_occupancy_ratio", "gpu_memory_fragmentation_ratio",
                "inference_request_duration_seconds_bucket", "gpu_sidecar_samples_pushed_total",
                "gpu_sidecar_spool_bytes"} <= names
    assert not list((tmp_path / "spool").rglob("*.batch"))


def test_vmagent_relay_to_victoriametrics(tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    relay = VmAgent(tmp_path, vm.write_url).start()
    with running(vm, relay):
        agent = Agent(push_args(relay.write_url, tmp_path / "spool"))
        run_until(agent, lambda: delivering(agent, 5), "5 cycles and a push to vmagent")
        sampled = sampled_some(agent)
        assert_same(as_map(vm.settled(len(sampled))), sampled, VM_REL)


def test_prometheus_remote_write_receiver_stores_exactly_what_was_sampled(tmp_path):
    prom = Prometheus(tmp_path).start()
    with running(prom):
        agent = Agent(push_args(prom.write_url, tmp_path / "spool"))
        run_until(agent, lambda: delivering(agent, 5), "5 cycles and a push to Prometheus")
        sampled = sampled_some(agent)
        stored = as_map(prom.samples('{__name__=~".+"}', at=time.time() + 1))
        assert_same(stored, sampled)  # Prometheus keeps float64 bit for bit


def test_pushgateway_holds_the_latest_values_and_the_group_is_deleted_when_asked(tmp_path):
    pgw = Pushgateway(tmp_path).start()
    with running(pgw):
        base = ["--simulate", "healthy", "--interval", "0.2", "--push-interval", "0.2",
                "--pushgateway-url", pgw.base, "--pod-namespace", "ml", "--pod-name", "llm-0",
                "--shutdown-timeout", "5"]
        agent = Agent(base)
        run_until(agent, lambda: agent.cycles() >= 5 and pushed_to_pgw(agent),
                  "5 cycles and a push to the Pushgateway")
        rows = agent.recorded()  # the Pushgateway takes every figure of every push
        assert rows
        last_ts = max(ts for _, _, ts, _ in rows)
        latest = {(n, labels): v for n, labels, ts, v in rows if ts == last_ts}
        groups = pgw.groups()
        assert len(groups) == 1
        group = groups[0]
        assert group["labels"] == {"job": "gpu-sidecar", "namespace": "ml", "pod": "llm-0"}
        stored = Pushgateway.values(group)
        assert set(stored) == set(latest)
        for key, value in latest.items():
            assert stored[key] == pytest.approx(value, rel=1e-12), key

        agent = Agent([*base, "--pushgateway-delete-on-exit"])
        run_until(agent, lambda: agent.cycles() >= 2 and pushed_to_pgw(agent),
                  "2 cycles and a push to the Pushgateway")
        assert pgw.groups() == []
        assert any(e.get("event") == "pushgateway_group_deleted" for e in agent.events())


def test_receiver_down_for_a_while_then_back_nothing_is_lost(tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    with running(vm):
        agent = Agent(push_args(vm.write_url, tmp_path / "spool"))
        agent.start()
        until(lambda: delivering(agent, 3), what="3 cycles and a push")
        vm.stop()
        until(lambda: agent.logged("push_failing"), what="the outage to be noticed")
        agent.more_cycles(10, "while the receiver is down")  # 4 push intervals spooled
        vm.start()
        until(lambda: agent.logged("receiver_recovered"), what="the receiver to be back")
        agent.more_cycles(5, "after the recovery")  # a second episode would show
        assert agent.stop() == 0
        sampled = sampled_some(agent)
        assert_same(as_map(vm.settled(len(sampled))), sampled, VM_REL)
        events = [e["event"] for e in agent.events()]
        assert events.count("push_failing") == 1 and events.count("receiver_recovered") == 1


def decoded_span(body: bytes) -> tuple[int, int]:
    wr = WriteRequest()
    wr.ParseFromString(decompress(body))
    stamps = [s.timestamp for ts in wr.timeseries for s in ts.samples]
    return min(stamps), max(stamps)


def test_remote_write_requests_carry_the_headers_the_protocol_requires(tmp_path):
    """Checked on the wire in front of a real receiver: VictoriaMetrics and Prometheus 2.42
    accept requests without the version header, a newer receiver may not."""
    vm = VictoriaMetrics(tmp_path).start()
    proxy = FaultProxy(vm.write_url, lambda n, body: None)
    with running(vm, proxy):
        agent = Agent(push_args(proxy.url, tmp_path / "spool"))
        run_until(agent, lambda: len(proxy.log) >= 2, "2 requests at the receiver")
        assert proxy.headers, "no request reached the receiver"
        info = next(r for r in agent.sampled() if r[0] == "gpu_sidecar_info")
        version = dict(info[1])["version"]
        for headers in proxy.headers:
            got = {k.lower(): v for k, v in headers.items()}
            assert got["content-type"] == "application/x-protobuf"
            assert got["content-encoding"] == "snappy"
            assert got["x-prometheus-remote-write-version"] == "0.1.0"
            assert got["user-agent"] == f"gpu-sidecar/{version}"
        assert {status for _, status, _ in proxy.log} == {204}  # and the receiver took them


def test_500s_are_retried_and_batches_arrive_in_order(tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    proxy = FaultProxy(vm.write_url,
                       lambda n, body: (500, {}, b"overloaded") if n in (1, 2, 3) else None)
    with running(vm, proxy):
        agent = Agent(push_args(proxy.url, tmp_path / "spool"))
        run_until(agent, lambda: len(proxy.log) >= 6, "3 refusals and 2 requests after them")
        sampled = sampled_some(agent)
        assert_same(as_map(vm.settled(len(sampled))), sampled, VM_REL)
        statuses = [status for _, status, _ in proxy.log]
        assert statuses[1:4] == [500, 500, 500] and statuses[4] == 204
        assert proxy.log[1][2] == proxy.log[4][2]  # the same batch, retried
        accepted = [decoded_span(body) for _, status, body in proxy.log if status < 300]
        assert all(a[1] < b[0] for a, b in itertools.pairwise(accepted)), \
            "batches must arrive oldest first"
        final = {n: v for n, labels, _, v in agent.sampled()
                 if n == "gpu_sidecar_push_failures_total" and ("reason", "http_5xx") in labels}
        assert final["gpu_sidecar_push_failures_total"] == 3


def test_429_retry_after_is_honoured(tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    proxy = FaultProxy(vm.write_url, lambda n, body: (429, {"Retry-After": "2"}, b"slow down")
                       if n == 1 else None)
    with running(vm, proxy):
        agent = Agent(push_args(proxy.url, tmp_path / "spool"))
        run_until(agent, lambda: len(proxy.log) >= 4, "the request after the 429, and one more")
        sampled = sampled_some(agent)
        assert_same(as_map(vm.settled(len(sampled))), sampled, VM_REL)
        (t429, s429, _), (t_next, _, _) = proxy.log[1], proxy.log[2]
        assert s429 == 429
        assert t_next - t429 >= 1.9  # waited as told, not the 0.5 s backoff cap


def samples_in(body: bytes) -> set[tuple[str, tuple, int]]:
    wr = WriteRequest()
    wr.ParseFromString(decompress(body))
    return {(dict((lab.name, lab.value) for lab in ts.labels)["__name__"],
             tuple(sorted((lab.name, lab.value) for lab in ts.labels if lab.name != "__name__")),
             s.timestamp)
            for ts in wr.timeseries for s in ts.samples}


def test_400_sets_one_batch_aside_and_later_batches_flow(tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    poison: set[int] = set()  # the receiver objects to one cycle, in whatever request it comes

    def plan(n: int, body: bytes) -> tuple[int, dict, bytes] | None:
        stamps = {ts for _, _, ts in samples_in(body)}
        if n == 2:
            poison.add(min(stamps))
        return (400, {}, b"bad label set") if poison & stamps else None

    proxy = FaultProxy(vm.write_url, plan)
    with running(vm, proxy):
        agent = Agent(push_args(proxy.url, tmp_path / "spool"))

        def flowing_after_the_refusal() -> bool:  # two requests taken after the last 400
            statuses = [status for _, status, _ in proxy.log]
            return (bool(agent.logged("batch_refused")) and 400 in statuses
                    and statuses[::-1].index(400) >= 2 and len(statuses) > 4)
        run_until(agent, flowing_after_the_refusal, "a batch set aside and later ones taken")
        # a merged request is retried batch by batch: the last refusal is the batch set aside
        refused = samples_in([body for _, status, body in proxy.log if status == 400][-1])
        sampled = sampled_some(agent)
        expected = {k: v for k, v in sampled.items() if k not in refused}
        assert_same(as_map(vm.settled(len(expected))), expected, VM_REL)
        aside = list((tmp_path / "spool").rglob("rejected/*.batch"))
        assert len(aside) == 1
        refused_events = [e for e in agent.events() if e.get("event") == "batch_refused"]
        assert len(refused_events) == 1 and "bad label set" in refused_events[0]["receiver_said"]
        dropped = [v for n, labels, _, v in agent.sampled()
                   if n == "gpu_sidecar_samples_dropped_total" and ("reason", "rejected") in labels]
        assert dropped[-1] == len(refused)
        assert len(proxy.log) > 4  # later batches kept flowing


@pytest.mark.parametrize("push_interval", ["0.6", "15"])
def test_sigkill_then_restart_on_the_same_spool_loses_at_most_the_cycle_in_progress(
        tmp_path, push_interval):
    vm = VictoriaMetrics(tmp_path)  # not started: the first agent can only spool
    spool = tmp_path / "spool"
    first = Agent(push_args(vm.write_url, spool, "--push-interval", push_interval))
    first.start()
    # killed once it has sampled for a while, however slowly it started on a loaded machine
    until(lambda: first.cycles() >= 12, what="12 cycles of the first agent")
    first.signal(signal.SIGKILL)
    first.wait()
    assert list(spool.rglob("*.batch")) or list(spool.rglob("*.journal"))
    vm.start()
    with running(vm):
        second = Agent(push_args(vm.write_url, spool))
        before_keys = set(as_map(first.sampled()))
        run_until(second, lambda: delivering(second, 3) and before_keys <= set(
            (n, labels, ts) for n, labels, ts, _ in vm.samples()),
                  "the first agent's spool and journal sent by the second")
        stored = as_map(vm.settled())  # raises on any duplicate
        before = as_map(first.sampled())
        after = sampled_some(second)
        assert_same({k: v for k, v in stored.items() if k in after}, after, VM_REL)
        # every cycle the first agent printed had reached its journal before it was printed
        # (sinks are fed in order, stdout last): only a cycle in progress at the kill may be lost
        lost = set(before) - set(stored)
        assert not lost, sorted({k[2] for k in lost})
        assert len({k[2] for k in before}) >= 10
        for key in before:
            assert math.isclose(stored[key], before[key], rel_tol=VM_REL)
        replayed = [e for e in second.events() if e.get("event") == "journal_replayed"]
        # at 15 s the open batch is all there is; at 0.6 s the kill may land just after a seal
        assert len(replayed) == (1 if push_interval == "15" else len(replayed[:1]))


def test_sigterm_takes_a_last_sample_and_flushes_within_the_timeout(tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    with running(vm):
        agent = Agent(push_args(vm.write_url, tmp_path / "spool", "--push-interval", "60",
                                "--shutdown-timeout", "3"))
        agent.start()
        # several cycles (GPM figures need two readings), none pushed at this push interval
        until(lambda: agent.cycles() >= 5, what="5 cycles", interval=0.1)
        signalled = time.time()
        agent.signal(signal.SIGTERM)
        started = time.monotonic()
        assert agent.wait() == 0
        assert time.monotonic() - started < 3.0
        sampled = sampled_some(agent)
        last = max(k[2] for k in sampled)
        assert last >= signalled * 1000 - 50  # the last sample
        # which keeps its GPM figures even when it lands within 100 ms of the cycle before
        # (half the time at --interval 0.2), and says nothing about it
        gpus = {dict(k[1])["gpu_uuid"] for k in sampled if "gpu_uuid" in dict(k[1])}
        occupancy = {dict(k[1])["gpu_uuid"] for k in sampled
                     if k[0] == "gpu_sm_occupancy_ratio" and k[2] == last}
        assert occupancy == gpus
        assert not [e for e in agent.events() if e.get("event") == "gpm_interval_too_short"]
        # nothing was pushed before SIGTERM: all of it went in the shutdown flush
        assert_same(as_map(vm.settled(len(sampled))), sampled, VM_REL)


def test_spool_full_drops_the_oldest_counts_them_and_keeps_running(tmp_path):
    vm = VictoriaMetrics(tmp_path)  # down at first
    agent = Agent(push_args(vm.write_url, tmp_path / "spool", "--push-interval", "0.4",
                            "--spool-max-bytes", "12000"))
    agent.start()
    try:
        # the bound is reached and the oldest go, several times over (logged at 1, then 10)
        until(lambda: (agent.last("gpu_sidecar_samples_dropped_total", reason="spool_full") or 0)
              > 0 and agent.logged("spool_full_dropped_oldest"),
              what="the spool to drop its oldest batch", interval=0.1)
        agent.more_cycles(5, "with a full spool")
        assert agent.proc.poll() is None  # still running
        vm.start()
        with running(vm):
            until(lambda: pushed(agent) > 0, what="deliveries once the receiver is up")
            agent.more_cycles(3, "delivering")
            assert agent.stop() == 0
            events = [e for e in agent.events() if e.get("event") == "spool_full_dropped_oldest"]
            assert events and events[0]["count"] == 1  # logged when it starts, not per batch
            assert [e["count"] for e in events] == [10 ** i for i in range(len(events))]
            dropped = [v for n, labels, _, v in agent.sampled()
                       if n == "gpu_sidecar_samples_dropped_total"
                       and ("reason", "spool_full") in labels]
            assert dropped and dropped[-1] > 0
            sampled = sampled_some(agent)
            stored = as_map(vm.settled())
            first_ts = min(k[2] for k in sampled)
            last_ts = max(k[2] for k in sampled)
            assert not any(k[2] == first_ts for k in stored)  # the oldest went
            assert any(k[2] == last_ts for k in stored)  # the newest arrived
            lost = len(set(sampled) - set(stored))
            assert lost == dropped[-1]  # every lost sample is counted
    finally:
        agent.stop()
