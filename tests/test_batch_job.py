"""A batch Job's run: keyed by the Job at the Pushgateway, and summarised at the end.

The summary is checked against what the same run printed on stdout, recomputed here without the
agent's code: peaks, means, the share of samples beyond the alert thresholds, the allocator's
counters and the p99 over the run.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path

import pytest

from sidecar.judge.rules import PRECEDENCE
from sidecar.samples import Series
from sidecar.summary import Checkpoint, RunSummary, quantile
from tests.conftest import ROOT
from tests.receivers import Agent, Prometheus, Pushgateway, VictoriaMetrics, running
from tests.waiting import until

RATIOS = ("gpu_sm_occupancy_ratio", "gpu_tensor_core_util_ratio", "gpu_mem_bandwidth_util_ratio",
          "gpu_pcie_tx_bandwidth_util_ratio", "gpu_pcie_rx_bandwidth_util_ratio",
          "gpu_memory_fragmentation_ratio")

# the model server of the Job, in its own process: publishes until its stdin closes (the test
# decides when its work is done), then exits before the agent stops
APP = """
import sys
from sidecar.simulate.app import SimulatedApp
from sidecar.simulate.scenarios import build
scenario = build(sys.argv[2])
app = SimulatedApp(sys.argv[1], [g.uuid for g in scenario.gpus], scenario.app, interval_s=0.2)
app.start()
sys.stdin.read()
app.stop()
"""


def start_app(sock: Path, scenario: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", APP, str(sock), scenario], cwd=ROOT,
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def end_app(app: subprocess.Popen) -> None:
    """The Job's main container ends: its work done, it exits 0."""
    _, err = app.communicate(timeout=30)
    assert app.returncode == 0, err


def app_cycles(agent: Agent) -> int:
    """Cycles the agent printed with figures from the app (its allocator's)."""
    return len({ts for n, _, ts, _ in agent.sampled() if n == "gpu_allocator_reserved_bytes"})


def job_run(tmp: Path, scenario: str, job: str, pod: str, *sink: str, cycles: int = 10) -> Agent:
    """Agent and app start; the app works until the agent sampled its figures ``cycles`` times,
    and exits; then the agent gets SIGTERM, as Kubernetes sends it to a native sidecar once the
    Job's main container has ended."""
    tmp.mkdir(parents=True, exist_ok=True)
    sock = tmp / "app.sock"
    agent = Agent(["--simulate", scenario, "--no-simulated-app", "--socket", str(sock),
                   "--interval", "0.2", "--push-interval", "0.5", "--batch-job", job,
                   "--pod-namespace", "ml", "--pod-name", pod, "--shutdown-timeout", "5", *sink])
    agent.start()
    until(sock.exists, what="the agent's socket")
    app = start_app(sock, scenario)
    try:
        until(lambda: app_cycles(agent) >= cycles, interval=0.1,
              what=lambda: f"{cycles} cycles with the app's figures (at {app_cycles(agent)})")
    finally:
        end_app(app)
    agent.signal(signal.SIGTERM)
    assert agent.wait() == 0, "".join(agent.err)[-2000:]
    return agent


def hist_quantile(q: float, buckets: dict[str, float]) -> float:
    """histogram_quantile, written out again for the test."""
    pairs = sorted((math.inf if le == "+Inf" else float(le), c) for le, c in buckets.items())
    rank = q * pairs[-1][1]
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in pairs:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    raise AssertionError("unreachable")


def expected_summary(rows: list[tuple[str, tuple, int, float]], job: str, pod: str) -> dict:
    """The summary the stdout record implies, keyed like the agent's series."""
    by_cycle: dict[tuple, dict[int, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    last_buckets: dict[tuple, dict[str, float]] = defaultdict(dict)
    unreadable: dict[tuple, int] = defaultdict(int)
    bucket_ts: dict[tuple, int] = {}
    verdicts: dict[tuple, list[str]] = defaultdict(list)
    last_ts = max(ts for name, _, ts, _ in rows)
    first_ts = min(ts for name, _, ts, _ in rows)
    for name, labels, ts, value in rows:
        if name.startswith("gpu_run_"):
            continue
        if name == "inference_request_duration_seconds_bucket":  # the GPU's last cycle's
            gpu = tuple(p for p in labels if p[0] != "le")
            if ts > bucket_ts.get(gpu, -1):
                bucket_ts[gpu], last_buckets[gpu] = ts, {}
            if ts == bucket_ts[gpu]:
                last_buckets[gpu][dict(labels)["le"]] = value
        elif name == "gpu_sidecar_gpu_available":
            unreadable[labels] += value == 0
        elif name == "gpu_verdict":  # the agent's verdict this cycle: the one at 1
            if value == 1:
                gpu = tuple(p for p in labels if p[0] != "verdict")
                verdicts[gpu].append(dict(labels)["verdict"])
        elif "gpu_uuid" in dict(labels) and "pid" not in dict(labels):
            by_cycle[labels][ts][name] = value

    def key(name: str, labels: tuple, *extra: tuple[str, str]) -> tuple:
        return name, tuple(sorted((*labels, ("job_name", job), *extra)))

    run = (("namespace", "ml"), ("pod", pod))
    out = {key("gpu_run_start_timestamp_seconds", run): first_ts / 1000,
           key("gpu_run_end_timestamp_seconds", run): last_ts / 1000,
           key("gpu_run_duration_seconds", run): (last_ts - first_ts) / 1000}
    for gpu, cycles in by_cycle.items():
        if "gpu_utilization_ratio" not in next(iter(cycles.values())):
            continue  # a label set that is not a GPU's (none expected)
        out[key("gpu_run_samples", gpu)] = len(cycles)
        out[key("gpu_run_unreadable_samples", gpu)] = unreadable[gpu]
        for name in RATIOS:
            values = [c[name] for c in cycles.values() if name in c]
            if values:
                out[key("gpu_run_max_ratio", gpu, ("figure", name))] = max(values)
                out[key("gpu_run_mean_ratio", gpu, ("figure", name))] = sum(values) / len(values)
        # the share of the cycles each kind was the agent's verdict, every kind named
        said = verdicts[gpu]
        for kind in (*PRECEDENCE, "none"):
            out[key("gpu_run_above_threshold_ratio", gpu, ("condition", kind))] = \
                said.count(kind) / len(said)
        final = cycles[max(cycles)]
        out[key("gpu_run_alloc_retries", gpu)] = final["gpu_allocator_alloc_retries_total"]
        out[key("gpu_run_ooms", gpu)] = final["gpu_allocator_ooms_total"]
        out[key("gpu_run_request_duration_p99_seconds", gpu)] = hist_quantile(0.99, last_buckets[gpu])
    return out


def printed_summary(agent: Agent) -> dict:
    return {(name, labels): value for name, labels, _, value in agent.sampled()
            if name.startswith("gpu_run_")}


def assert_summary(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


def run_verdict(printed: dict) -> str:
    """The kind that was the agent's verdict for the largest share of the run (of one GPU)."""
    shares = {dict(labels)["condition"]: v for (n, labels), v in printed.items()
              if n == "gpu_run_above_threshold_ratio"}
    assert set(shares) == {*PRECEDENCE, "none"}  # every kind named, found or not
    return max(shares, key=shares.__getitem__)


@pytest.mark.parametrize(("scenario", "kind"), [("nvlink-saturated", "nvlink"),
                                                ("throttled", "throttled")])
def test_a_jobs_summary_names_the_verdict_its_gpu_had_for_most_of_the_run(tmp_path, scenario,
                                                                          kind):
    """Any kind, not three the summary knows: the agent's own verdict each cycle."""
    run = job_run(tmp_path, scenario, "train-3", "train-3-a")
    printed = printed_summary(run)
    assert_summary(printed, expected_summary(run.sampled(), "train-3", "train-3-a"))
    assert run_verdict(printed) == kind


def summary_groups(pgw: Pushgateway) -> list[dict]:
    return [g for g in pgw.groups() if "job_name" in g["labels"]]


def test_a_job_leaves_one_group_with_its_summary_and_a_rerun_replaces_it(tmp_path):
    pgw = Pushgateway(tmp_path).start()
    prom = Prometheus(tmp_path, scrape=f"127.0.0.1:{pgw.port}").start()
    with running(pgw, prom):
        first = job_run(tmp_path / "1", "pcie-saturated", "embed-2026-11-30", "embed-abcde",
                        "--pushgateway-url", pgw.base)
        printed = printed_summary(first)
        want = expected_summary(first.sampled(), "embed-2026-11-30", "embed-abcde")
        assert_summary(printed, want)
        assert run_verdict(printed) == "pcie"

        groups = pgw.groups()
        assert [g["labels"] for g in groups] == [
            {"job": "gpu-sidecar", "namespace": "ml", "job_name": "embed-2026-11-30"}]
        # kept at exit (no delete for a Job), holding the summary alone: the run's last live
        # values would read as current at every scrape and keep alerts on them firing
        assert_summary(Pushgateway.values(groups[0]), want)

        # Prometheus scraped it, with the Job's labels honoured
        scraped = until(
            lambda: prom.query('gpu_run_duration_seconds{job_name="embed-2026-11-30"}'),
            interval=0.5, what="Prometheus to scrape the summary")
        assert scraped and float(scraped[0]["value"][1]) == pytest.approx(
            want[("gpu_run_duration_seconds",
                  (("job_name", "embed-2026-11-30"), ("namespace", "ml"), ("pod", "embed-abcde")))])
        assert scraped[0]["metric"]["namespace"] == "ml"

        rerun = job_run(tmp_path / "2", "pcie-saturated", "embed-2026-11-30", "embed-fghij",
                        "--pushgateway-url", pgw.base)
        groups = summary_groups(pgw)
        assert len(groups) == 1  # replaced, not added
        stored = {k: v for k, v in Pushgateway.values(groups[0]).items() if k[0].startswith("gpu_run_")}
        assert_summary(stored, expected_summary(rerun.sampled(), "embed-2026-11-30", "embed-fghij"))
        pods = {dict(k[1]).get("pod") for k in Pushgateway.values(groups[0])}
        assert "embed-fghij" in pods and "embed-abcde" not in pods

        other = job_run(tmp_path / "3", "fragmented", "eval-7", "eval-7-xyz",
                        "--pushgateway-url", pgw.base)
        assert sorted(g["labels"]["job_name"] for g in summary_groups(pgw)) == [
            "embed-2026-11-30", "eval-7"]
        printed = printed_summary(other)
        assert_summary(printed, expected_summary(other.sampled(), "eval-7", "eval-7-xyz"))
        assert run_verdict(printed) == "fragmentation"


def test_parallel_pods_of_an_indexed_job_keep_a_group_each(tmp_path):
    pgw = Pushgateway(tmp_path).start()
    with running(pgw):
        runs: dict[str, Agent] = {}

        def pod(index: str) -> None:
            runs[index] = job_run(tmp_path / index, "healthy", "shard", f"shard-{index}-x",
                                  "--pushgateway-url", pgw.base, "--batch-job-index", index)

        threads = [threading.Thread(target=pod, args=(i,)) for i in "01"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        groups = {g["labels"]["job_index"]: g for g in summary_groups(pgw)}
        assert sorted(groups) == ["0", "1"]
        for index, agent in runs.items():
            stored = Pushgateway.values(groups[index])
            assert {dict(k[1])["pod"] for k in stored} == {f"shard-{index}-x"}
            assert all(dict(k[1])["job_index"] == index for k in stored)
            assert {k[0] for k in stored} == {k[0] for k in printed_summary(agent)}


def test_the_summary_arrives_by_remote_write_at_the_runs_end_time(tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    with running(vm):
        agent = job_run(tmp_path / "run", "fragmented", "train-42", "train-42-pod",
                        "--remote-write-url", vm.write_url, "--spool-dir", str(tmp_path / "spool"))
        want = expected_summary(agent.sampled(), "train-42", "train-42-pod")
        assert_summary(printed_summary(agent), want)
        end_ms = max(ts for _, _, ts, _ in agent.sampled())
        until(lambda: len(vm.samples('{__name__=~"gpu_run_.+"}')) >= len(want), interval=0.5,
              what=f"the {len(want)} summary series in VictoriaMetrics")
        rows = vm.samples('{__name__=~"gpu_run_.+"}')
        assert {ts for _, _, ts, _ in rows} == {end_ms}
        assert_summary({(n, labels): v for n, labels, _, v in rows}, want)


def test_a_gpu_lost_mid_run_shows_in_the_summary_not_as_a_healthy_mean(tmp_path):
    agent = Agent(["--simulate", "gpu-lost", "--interval", "0.2", "--batch-job", "train-3",
                   "--pod-namespace", "ml", "--pod-name", "train-3-p"])
    agent.start()
    until(lambda: any(n == "gpu_sidecar_gpu_available" and v == 0 and dict(lab).get("gpu_index")
                      == "2" for n, lab, _, v in agent.sampled()), interval=0.1,
          what="GPU 2 to be lost")
    agent.more_cycles(3, "after the loss")
    assert agent.stop() == 0
    printed = printed_summary(agent)
    assert_summary(printed, expected_summary(agent.sampled(), "train-3", "train-3-p"))
    unreadable = {dict(labels)["gpu_index"]: v for (n, labels), v in printed.items()
                  if n == "gpu_run_unreadable_samples"}
    assert unreadable["2"] > 0 and {unreadable[i] for i in "013"} == {0}


@pytest.mark.parametrize("name", [".", "..", "Train", "a_b", "a-", "a" * 64])
def test_a_job_name_the_grouping_url_cannot_carry_is_refused(name):
    agent = Agent(["--simulate", "healthy", "--once", "--batch-job", name]).start()
    assert agent.wait() == 2
    assert "must be a Kubernetes Job name" in "".join(agent.err)


def test_a_completion_index_needs_its_job_and_must_be_a_number():
    alone = Agent(["--simulate", "healthy", "--once", "--batch-job-index", "3"]).start()
    assert alone.wait() == 2 and "needs --batch-job" in "".join(alone.err)
    bad = Agent(["--simulate", "healthy", "--once", "--batch-job", "j", "--batch-job-index", "x1"])
    assert bad.start().wait() == 2 and "completion index" in "".join(bad.err)


def test_delete_on_exit_is_refused_for_a_job():
    agent = Agent(["--simulate", "healthy", "--batch-job", "j", "--pushgateway-url",
                   "http://127.0.0.1:9", "--pushgateway-delete-on-exit"]).start()
    assert agent.wait() == 2
    assert "leave it off for Jobs" in "".join(agent.err)


# -- the summary's arithmetic -----------------------------------------------------------------


def test_quantile_interpolates_like_histogram_quantile():
    cumulative = {0.1: 10.0, 0.25: 60.0, 0.5: 90.0, 1.0: 100.0, math.inf: 100.0}
    assert quantile(0.5, cumulative) == pytest.approx(0.1 + 0.15 * (50 - 10) / 50)
    assert quantile(0.99, cumulative) == pytest.approx(0.5 + 0.5 * (99 - 90) / 10)
    assert quantile(0.99, {0.1: 0.0, 1.0: 5.0, math.inf: 10.0}) == 1.0  # in +Inf: highest bound
    assert quantile(0.99, {0.1: 0.0, math.inf: 0.0}) is None  # no requests
    assert quantile(0.99, {0.1: 3.0}) is None  # no +Inf bucket: not a histogram


def test_counters_that_restart_are_added_up_not_subtracted():
    from sidecar.samples import Series

    gpu = (("gpu_uuid", "GPU-a"),)
    summary = RunSummary("j", ())
    for ts, retries in enumerate([0, 3, 5, 1, 2]):  # the worker restarted after 5
        summary.add([Series("gpu_allocator_alloc_retries_total", gpu, float(retries), ts)])
    got = {s.name: s.value for s in summary.series()}
    assert got["gpu_run_alloc_retries"] == 5 + 2
    assert got["gpu_run_duration_seconds"] == 0.004


def test_new_buckets_restart_the_runs_p99_and_the_table_holds_one_layout():
    gpu = (("gpu_uuid", "GPU-a"),)

    def histogram(bounds: list[str], counts: list[float], ts: int) -> list[Series]:
        return [Series("inference_request_duration_seconds_bucket", (*gpu, ("le", le)), c, ts)
                for le, c in zip(bounds, counts, strict=True)]

    summary = RunSummary("j", ())
    summary.add(histogram(["0.1", "+Inf"], [90.0, 100.0], 1))  # slow layout: p99 above 0.1
    for ts in range(2, 50):  # an app that changes its buckets every cycle
        bounds = [str(ts / 1000), str(ts / 100), "+Inf"]
        summary.add(histogram(bounds, [0.0, 10.0 * ts, 10.0 * ts], ts))
    got = {s.name: s.value for s in summary.series()}
    # the last layout alone: every request in (0.049, 0.49]
    assert got["gpu_run_request_duration_p99_seconds"] == pytest.approx(
        0.049 + (0.49 - 0.049) * 0.99)
    assert len(next(iter(summary._gpus.values())).buckets) == 3


def test_a_killed_job_agent_restarted_in_its_pod_goes_on_with_the_run_summary(tmp_path):
    """SIGKILL mid-run: every printed cycle is stored (the journal), and the restarted agent's
    summary covers the whole run but for the cycles after the last checkpoint (rewritten every
    push interval beside the spool); the clean end of the run removes the checkpoint."""
    sock, spool = tmp_path / "app.sock", tmp_path / "spool"
    vm = VictoriaMetrics(tmp_path).start()
    with running(vm):
        args = ["--simulate", "healthy", "--no-simulated-app", "--socket", str(sock),
                "--interval", "0.2", "--push-interval", "0.6", "--batch-job", "train-9",
                "--pod-namespace", "ml", "--pod-name", "train-9-p",
                "--remote-write-url", vm.write_url, "--spool-dir", str(spool)]
        killed = Agent(args).start()
        until(sock.exists, what="the agent's socket")
        app = start_app(sock, "healthy")
        try:
            # mid-run: the app's figures sampled a while, and a checkpoint written
            until(lambda: app_cycles(killed) >= 8 and (spool / "run-summary.json").exists(),
                  interval=0.1, what="8 cycles with the app's figures and a checkpoint")
            killed.signal(signal.SIGKILL)
            killed.wait()
            assert not printed_summary(killed)
            checkpointed = json.loads((spool / "run-summary.json").read_text())["end_ms"]
            restarted = Agent(args).start()
            until(lambda: restarted.logged("run_summary_resumed") and app_cycles(restarted) >= 5,
                  interval=0.1, what="the restarted agent to resume and sample the app")
            end_app(app)  # the Job's main container ends
        finally:
            app.kill()
        assert restarted.stop() == 0, "".join(restarted.err)[-2000:]
        assert [e for e in restarted.events() if e.get("event") == "run_summary_resumed"]
        assert not (spool / "run-summary.json").exists(), "the run ended: nothing to resume"
        stored = {(n, labels, ts): v for n, labels, ts, v in vm.settled()}
        printed = {(n, labels, ts) for n, labels, ts, _ in killed.sampled()}
        assert printed and printed <= set(stored)  # the journal kept every printed cycle
    # what the summary lost: the killed agent's cycles after its last checkpoint
    lost = [r for r in killed.sampled() if r[2] > checkpointed]
    assert len({r[2] for r in lost}) <= 0.6 / 0.2 + 1
    kept = [r for r in killed.sampled() if r[2] <= checkpointed]
    assert_summary(printed_summary(restarted),
                   expected_summary(kept + restarted.sampled(), "train-9", "train-9-p"))
    starts = [v for (n, _, _), v in stored.items() if n == "gpu_run_start_timestamp_seconds"]
    assert starts == [min(ts for _, _, ts, _ in killed.sampled()) / 1000]


def test_a_checkpoint_of_another_pod_or_an_earlier_run_is_not_resumed(tmp_path):
    now = [1_800_000_000.0]
    path = tmp_path / "run-summary.json"
    before = RunSummary("train-9", (("namespace", "ml"), ("pod", "train-9-a")))
    before.add([Series("gpu_sm_occupancy_ratio", (("gpu_uuid", "GPU-1"),), 0.5, 1_799_999_990_000)])
    Checkpoint(path, wall=lambda: now[0]).save(before)

    def resumed(pod: str) -> bool:
        summary = RunSummary("train-9", (("namespace", "ml"), ("pod", pod)))
        Checkpoint(path, wall=lambda: now[0]).resume(summary)
        return summary.start_ms is not None

    assert resumed("train-9-a")
    assert not resumed("train-9-b")  # a rerun of the Job: another pod
    now[0] += Checkpoint.RESUME_WITHIN_S + 11  # the same name, long after: an earlier run
    assert not resumed("train-9-a")
    path.write_text("{not json")
    assert not resumed("train-9-a")
    cut_short = tmp_path / "run-summary.json.4242.tmp"  # a save a kill interrupted
    cut_short.write_text('{"vers')
    assert not resumed("train-9-a") and not cut_short.exists()


@pytest.mark.parametrize("damage", [
    lambda state: [state],  # another shape altogether
    lambda state: {**state, "end_ms": float("inf")},
    lambda state: {**state, "gpus": [[g, {**run, "peak": []}] for g, run in state["gpus"]]},
    lambda state: {**state, "gpus": [[g, {**run, "peak": {}}] for g, run in state["gpus"]]},
    lambda state: {**state, "version": 99},
    lambda state: "[" * 100_000,  # nested beyond the parser
])
def test_a_damaged_checkpoint_never_stops_the_agent_nor_half_resumes(tmp_path, damage):
    labels = (("namespace", "ml"), ("pod", "train-9-a"))
    before = RunSummary("train-9", labels)
    before.add([Series("gpu_sm_occupancy_ratio", (("gpu_uuid", "GPU-1"),), 0.5, 1_800_000_000_000)])
    damaged = damage(before.state())
    path = tmp_path / "run-summary.json"
    path.write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
    summary = RunSummary("train-9", labels)
    Checkpoint(path, wall=lambda: 1_800_000_001.0).resume(summary)
    assert summary.start_ms is None and summary.series() == []
