"""A batch Job's run summary meets a Pushgateway that is out while the Job shuts down.

The summary is pushed once, with the Job's last cycle, and nothing comes after it: a Pushgateway
that is restarting or unreachable during those few seconds must not swallow it without a word.
The final push is retried until the shutdown deadline; delivered after retries, the log says so;
still out at the deadline, one error line names the Job and says the summary is lost for that
sink, the exit line's ``all_delivered`` is false, and the other configured sinks have it anyway.

Real processes only: the agent (``gpu-sidecar run --simulate``), prometheus-pushgateway, a
FaultProxy in front of it that drops connections, and VictoriaMetrics as a second sink. All on
127.0.0.1; every wait is for a condition, bounded.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tests.receivers import Agent, FaultProxy, Pushgateway, VictoriaMetrics, running
from tests.test_batch_job import assert_summary, printed_summary
from tests.waiting import until

JOB = "train-7"
POD = "train-7-abcde"
OUTAGE_S = 2.0  # how long the Pushgateway is out once the Job's shutdown began, at the least


def job_agent(pgw_url: str, shutdown_s: float, *extra: str) -> Agent:
    """The agent of a batch Job pushing to ``pgw_url``, with the stdout sink the Agent helper
    always adds (the second sink)."""
    return Agent(["--simulate", "healthy", "--interval", "0.2", "--push-interval", "0.5",
                  "--batch-job", JOB, "--pod-namespace", "ml", "--pod-name", POD,
                  "--shutdown-timeout", f"{shutdown_s:g}", "--pushgateway-url", pgw_url, *extra])


def running_until(agent: Agent, pushed: Callable[[], bool], what: str) -> None:
    """Wait until the Job's agent sampled 3 cycles and ``pushed`` holds; it must still run."""
    until(lambda: (agent.cycles() >= 3 and pushed()) or agent.proc.poll() is not None,
          what=f"3 cycles and {what}")
    assert agent.proc.poll() is None, "the agent exited:\n" + "".join(agent.err)[-2000:]


def stopped(agent: Agent) -> dict:
    found = agent.logged("stopped")
    assert len(found) == 1, "".join(agent.err)[-2000:]
    return found[0]


def summary_stored(pgw: Pushgateway) -> dict:
    """The run summary series the Pushgateway holds for the Job's group."""
    groups = [g for g in pgw.groups() if g["labels"].get("job_name") == JOB]
    assert len(groups) <= 1, groups
    if not groups:
        return {}
    return {k: v for k, v in Pushgateway.values(groups[0]).items() if k[0].startswith("gpu_run_")}


class Outage:
    """A FaultProxy plan: from ``begin()`` on, every connection is dropped without an answer (as
    a Pushgateway that is restarting does) until ``OUTAGE_S`` passed *and* the run summary met
    the outage in at least two attempts, so that on a slow machine too the Job's final push has
    to be retried; then requests reach the Pushgateway again."""

    def __init__(self) -> None:
        self.began: float | None = None
        self.ended: float | None = None
        self.dropped: list[tuple[float, bool]] = []  # (when, carried the summary)
        self.lock = threading.Lock()

    def begin(self) -> None:
        self.began = time.monotonic()

    def __call__(self, n: int, body: bytes) -> None:
        now = time.monotonic()
        with self.lock:
            if self.began is None or self.ended is not None:
                return None  # forwarded
            summaries = sum(1 for _, summary in self.dropped if summary)
            # 3 drops: one attempt may be two connections (a closed one is tried once more)
            if now - self.began >= OUTAGE_S and summaries >= 3:
                self.ended = now
                return None
            self.dropped.append((now, b"gpu_run_" in body))
        raise ConnectionAbortedError("the test's outage drops this connection")


def test_a_summary_met_by_a_pushgateway_outage_at_shutdown_is_retried_and_arrives(tmp_path):
    pgw = Pushgateway(tmp_path).start()
    # the proxy forwards every request to one URL: the Job's group (grouping key known here)
    outage = Outage()
    proxy = FaultProxy(f"{pgw.base}/metrics/job/gpu-sidecar/namespace/ml/job_name/{JOB}", outage)
    proxy.server.handle_error = lambda request, address: None  # a dropped connection, no trace
    url = proxy.url.removesuffix("/api/v1/write")
    with running(pgw, proxy):
        agent = job_agent(url, 10).start()
        with running(agent):
            running_until(agent, lambda: any(s < 300 for _, s, _ in proxy.log),
                          "a push through the proxy")
            outage.begin()
            agent.signal(signal.SIGTERM)
            assert agent.wait() == 0, "".join(agent.err)[-2000:]
        assert outage.ended is not None, f"the outage never ended: {outage.dropped}"
        summary = printed_summary(agent)
        assert summary, "the last cycle printed no run summary"
        stored = until(lambda: summary_stored(pgw), timeout=10,
                       what="the run summary at the Pushgateway")
        assert_summary(stored, summary)
    # it arrived after the outage, by retries of the final push, and the log says so
    assert any(t >= outage.ended and status < 300 and b"gpu_run_" in body
               for t, status, body in proxy.log), proxy.log
    assert sum(1 for _, summary in outage.dropped if summary) >= 3
    delivered = agent.logged("run_summary_delivered")
    assert len(delivered) == 1, "".join(agent.err)[-3000:]
    line = delivered[0]
    assert line["level"] == "info" and line["attempts"] >= 2
    assert line["job_name"] == JOB and line["url"] == url
    assert line["grouping"] == {"namespace": "ml", "job_name": JOB}
    assert agent.logged("pushgateway_failing"), "the outage was not logged"
    assert not agent.logged("run_summary_lost")
    assert stopped(agent)["all_delivered"] is True


def test_a_summary_the_pushgateway_never_takes_is_an_error_naming_the_job_and_other_sinks_have_it(
        tmp_path: Path) -> None:
    shutdown_s = 3.0
    pgw = Pushgateway(tmp_path).start()
    vm = VictoriaMetrics(tmp_path).start()
    password = "pgw-s3cret"
    # credentials in the URL: the error line must name the Pushgateway without them
    url = f"http://bob:{password}@127.0.0.1:{pgw.port}"
    with running(vm, pgw):
        agent = job_agent(url, shutdown_s, "--batch-job-index", "3",
                          "--remote-write-url", vm.write_url,
                          "--spool-dir", str(tmp_path / "spool")).start()
        with running(agent):
            running_until(agent, lambda: any(g["labels"].get("job_name") == JOB
                                             for g in pgw.groups()),
                          "a push to the Pushgateway")
            pgw.stop()  # down for the whole shutdown: connections refused
            agent.signal(signal.SIGTERM)
            signalled = time.monotonic()
            assert agent.wait() == 0, "".join(agent.err)[-2000:]
            took = time.monotonic() - signalled
        summary = printed_summary(agent)
        assert summary, "the last cycle printed no run summary"
        # the second sink, remote-write, stored the same summary
        until(lambda: len(vm.samples('{__name__=~"gpu_run_.+"}')) >= len(summary),
              interval=0.5, what=f"the {len(summary)} summary series in VictoriaMetrics")
        stored = {(n, labels): v for n, labels, _, v in vm.samples('{__name__=~"gpu_run_.+"}')}
        assert_summary(stored, summary)

    end = stopped(agent)
    assert end["all_delivered"] is False
    # retried until the deadline, and no longer (the last cycle and the exit add a little)
    assert shutdown_s - 0.5 <= end["shutdown_s"] <= shutdown_s + 0.5, end
    assert took < shutdown_s + 2.0
    lost = agent.logged("run_summary_lost")
    assert len(lost) == 1, "".join(agent.err)[-3000:]
    line = lost[0]
    assert line["level"] == "error"
    assert line["job_name"] == JOB and line["job_index"] == "3"
    assert line["grouping"] == {"namespace": "ml", "job_name": JOB, "job_index": "3"}
    assert line["url"] == f"http://127.0.0.1:{pgw.port}"
    assert line["reason"] == "network" and line["detail"]
    assert line["attempts"] >= 2
    assert "lost" in line["effect"] and "other configured sink" in line["effect"]
    assert not agent.logged("run_summary_delivered")
    assert password not in "".join(agent.err)
