"""A newcomer's first hour (issue #27), each promise produced for real: real agents on
127.0.0.1, real receivers, a real app process, real signals and real time.

- ``gpu-sidecar status`` beside a running agent says what it pushed, who publishes, what it
  exports and why, what it rejected and how its receiver fails; ``--alive`` turns 1 only when
  the agent's cycles stop, and 0 again when they resume;
- ``first_push_delivered`` once per sink per run, whatever outages follow;
- ``no_app_announced`` once, 30 s after a start that heard no app; ``app_quiet`` and
  ``app_publishing_again`` when the announced GPUs' app goes and comes back;
- ``run --dry-run`` checks each part with requests that store nothing;
- ``--metrics-listen`` is scraped by a real Prometheus, and is the only port the agent opens;
- the small lies fixed: ``--once`` with a receiver, ``diagnose --no-simulated-app``, what a
  temporary spool's leftovers become, the table on a small terminal.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from sidecar.agent import NO_APP_AFTER_S
from sidecar.simulate.engine import SimulatedEngine
from sidecar.simulate.scenarios import EngineProfile, simulated_uuid
from sidecar.sinks.remote_write import sink_name
from sidecar.status_file import ALIVE_MIN_S, FILE_NAME
from sidecar.views.table import ALT_SCREEN, CLEAR_BELOW, HIDE_CURSOR, HOME, MAIN_SCREEN, SHOW_CURSOR
from tests.conftest import ROOT, run_cli, send_datagram
from tests.promise_tools import Agent as PlainAgent
from tests.receivers import (
    LOCAL,
    Agent,
    Prometheus,
    Pushgateway,
    VictoriaMetrics,
    free_port,
    listener_pid_owns,
    running,
)
from tests.waiting import until

GPU0, GPU1 = simulated_uuid("healthy", 0), simulated_uuid("healthy", 1)
SIMULATED_NAME = "Simulated NVIDIA H200"


def status(sock: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli("status", "--socket", str(sock), *extra)


def sink_line(report: str, sink: str) -> dict[str, str] | None:
    """The figures of one sink's line in ``gpu-sidecar status``, or None when absent."""
    found = re.search(
        rf"^  {re.escape(sink)}: last success (?P<ago>never|\d+ s ago), (?P<pushed>\d+) "
        r"samples pushed; backlog (?P<batches>\d+) batches, (?P<pending>\d+) bytes pending, "
        r"(?P<aside>\d+) set aside; failures: (?P<failures>.*)$", report, re.M)
    return found.groupdict() if found else None


def when(record: dict) -> float:
    """A log line's wall-clock time, in seconds since the epoch."""
    return datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()


def series_of(agent: Agent, name: str, gpu: str, after_ms: float = 0) -> list[int]:
    """The timestamps at which the agent printed ``name`` for ``gpu`` after ``after_ms``."""
    return [ts for n, labels, ts, _ in agent.sampled()
            if n == name and dict(labels).get("gpu_uuid") == gpu and ts > after_ms]


def cycles_after(agent: Agent, after_ms: float) -> int:
    return len({ts for _, _, ts, _ in agent.sampled() if ts > after_ms})


def listening_tcp_sockets(pid: int) -> set[str]:
    """The TCP sockets in state LISTEN (0A) that process ``pid`` holds, as inodes, IPv4 and
    IPv6 (/proc/PID/net/tcp* lists the namespace's; /proc/PID/fd says which are its own)."""
    listening = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A":
                    listening.add(cols[9])
    own = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:["):
                own.add(link[8:-1])
    return listening & own


# -- gpu-sidecar status ------------------------------------------------------------------------


def test_status_beside_a_running_agent_says_what_it_pushed_who_publishes_rejections_and_outage(
        tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    sock = tmp_path / "run" / "app.sock"
    sink = sink_name(vm.write_url)
    agent = Agent(["--simulate", "healthy", "--socket", str(sock), "--interval", "0.2",
                   "--push-interval", "0.4", "--retry-max-backoff", "0.5",
                   "--remote-write-url", vm.write_url, "--spool-dir", str(tmp_path / "spool")])
    with running(vm, agent):
        agent.start()
        until(lambda: (sock.parent / FILE_NAME).exists(), what="the agent's first status")

        def report_where(condition) -> str:  # a status read while the agent runs: always 0
            def read() -> str | None:
                got = status(sock)
                assert got.returncode == 0, got.stdout + got.stderr
                return got.stdout if condition(got.stdout) else None
            return until(read, what=lambda: "a status report where "
                                            + (status(sock).stdout or "no status yet"))

        def delivered(report: str) -> bool:
            line = sink_line(report, sink)
            return bool(line) and line["ago"] != "never" and int(line["pushed"]) > 0

        report = report_where(delivered)
        line = sink_line(report, sink)
        assert line is not None and line["failures"] == "none"
        pushed = {v for n, _, _, v in agent.sampled() if n == "gpu_sidecar_samples_pushed_total"}
        until(lambda: float(line["pushed"]) in {
                  v for n, _, _, v in agent.sampled() if n == "gpu_sidecar_samples_pushed_total"},
              what=f"the count status shows ({line['pushed']}) among the agent's own {pushed}")
        # the simulated model server is a thread of the agent: its pid, both GPUs
        assert re.search(rf"^  process {agent.proc.pid}: last message \d+ s ago, GPUs "
                         rf"{GPU0}, {GPU1}$", report, re.M), report
        assert f"  exported GPU 0 {SIMULATED_NAME} {GPU0}: announced by the app; verdict " in report
        assert f"  exported GPU 1 {SIMULATED_NAME} {GPU1}: announced by the app; verdict " in report
        assert "GPUs (--gpus announced):" in report
        accepted_before = int(re.search(r"(\d+) messages accepted", report)[1])

        # hostile datagrams on the real socket: counted by reason, the last one of each said
        send_datagram(str(sock), b"garbage")
        send_datagram(str(sock), b"\x00" * 70_000)
        report = report_where(lambda r: "rejected: not_json 1, too_large 1" in r)
        assert re.search(r"^  last not_json: \d+ s ago: not a UTF-8 JSON document", report,
                         re.M), report
        assert re.search(r"^  last too_large: \d+ s ago: datagram of 70000 bytes exceeds 8192",
                         report, re.M), report
        report = report_where(lambda r: int(re.search(r"(\d+) messages accepted", r)[1])
                              > accepted_before + 2)  # the valid messages around them go on

        # the receiver goes away: failures by reason, and a backlog that grows
        vm.stop()

        def backlog(report: str) -> int:
            line = sink_line(report, sink)
            failing = line is not None and re.fullmatch(r"network [1-9]\d*", line["failures"])
            return int(line["batches"]) if failing else 0

        first = backlog(report_where(lambda r: backlog(r) >= 1))
        report = report_where(lambda r: backlog(r) > first)
        line = sink_line(report, sink)
        assert line["ago"] != "never", "the last success is still said during the outage"
        assert int(line["pending"]) > 0
        # a receiver outage leaves the cycles running: the liveness probe does not restart it
        assert status(sock, "--alive").returncode == 0
        assert agent.stop() == 0


def test_status_of_a_socket_no_agent_ever_used_exits_2_and_alive_exits_1(tmp_path):
    sock = tmp_path / "nobody" / "app.sock"
    got = status(sock)
    assert got.returncode == 2, got.stdout + got.stderr
    assert f"no {sock.parent / FILE_NAME}" in got.stderr and str(sock) in got.stderr
    alive = status(sock, "--alive")
    assert alive.returncode == 1, alive.stdout + alive.stderr


@pytest.fixture(scope="module")
def quiet_agents(tmp_path_factory):
    """Agents started together, so that the tests that wait for 30 s to pass wait once:
    ``lonely`` has no app (--no-simulated-app), ``served`` has the simulated app publishing,
    ``frozen`` is the one a test stops with SIGSTOP."""
    agents = {}
    for name, extra in (("lonely", ["--no-simulated-app"]), ("served", []),
                        ("frozen", ["--no-simulated-app"])):
        directory = tmp_path_factory.mktemp(name)
        agents[name] = Agent(["--simulate", "healthy", *extra, "--interval", "0.2",
                              "--socket", str(directory / "app.sock")]).start()
    try:
        yield agents
    finally:
        for agent in agents.values():
            with contextlib.suppress(Exception):
                agent.signal(signal.SIGCONT)  # a stopped process would not take SIGTERM
            with contextlib.suppress(Exception):
                agent.stop()


def socket_of(agent: Agent) -> Path:
    return Path(agent.args[agent.args.index("--socket") + 1])


def test_alive_exits_1_only_once_the_cycles_have_stopped_for_30_s_and_0_once_they_resume(
        quiet_agents):
    agent = quiet_agents["frozen"]
    sock = socket_of(agent)
    agent.more_cycles(3, "before the stop")
    until(lambda: status(sock, "--alive").returncode == 0, what="--alive 0 while it cycles")
    path = sock.parent / FILE_NAME

    def age() -> float:
        return time.time() - json.loads(path.read_text())["written_at"]

    agent.signal(signal.SIGSTOP)
    try:
        # the fault is the passage of time: poll the status file's age
        until(lambda: age() > ALIVE_MIN_S + 0.5, ALIVE_MIN_S + 30, interval=0.5,
              what=lambda: f"the status file older than {ALIVE_MIN_S} s (now {age():.1f} s)")
        stuck = status(sock, "--alive")
        assert stuck.returncode == 1, stuck.stdout + stuck.stderr
        assert re.search(rf"the agent \(pid {agent.proc.pid}\) has written no status for \d+ s "
                         r"\(more than 30 s\): its cycles have stopped", stuck.stderr), \
            stuck.stderr
        report = status(sock)
        assert report.returncode == 1 and "(STALE: its cycles have stopped)" in report.stdout
    finally:
        agent.signal(signal.SIGCONT)
    until(lambda: status(sock, "--alive").returncode == 0, 30,
          what="--alive 0 again once the cycles resume")
    assert agent.proc.poll() is None


def test_no_app_announced_is_said_once_30_s_after_a_start_no_app_published_to(quiet_agents):
    lonely, served = quiet_agents["lonely"], quiet_agents["served"]
    said = until(lambda: lonely.logged("no_app_announced"), NO_APP_AFTER_S + 30,
                 interval=0.2, what="no_app_announced")
    lonely.more_cycles(5, "after no_app_announced")
    said = lonely.logged("no_app_announced")
    assert len(said) == 1, "said once, not every cycle"
    assert said[0]["socket"] == str(socket_of(lonely))
    assert said[0]["waited_s"] == NO_APP_AFTER_S
    assert "no GPU is exported" in said[0]["effect"]
    assert "gpu-sidecar status" in said[0]["hint"]
    [started] = lonely.logged("starting")
    assert when(said[0]) - when(started) >= NO_APP_AFTER_S, "said before 30 s had passed"

    # an agent its app publishes to says nothing of the kind, 30 s after its start and beyond
    [started] = served.logged("starting")
    until(lambda: time.time() - when(started) > NO_APP_AFTER_S + 0.5, NO_APP_AFTER_S + 30,
          interval=0.2, what="30 s since the served agent's start")
    served.more_cycles(3, "past 30 s")
    assert served.logged("app_message_rejected") == []
    assert served.logged("no_app_announced") == []


# -- first delivery ----------------------------------------------------------------------------


def test_first_push_delivered_is_logged_once_per_sink_even_after_an_outage_and_recovery(
        tmp_path):
    vm, pg = VictoriaMetrics(tmp_path).start(), Pushgateway(tmp_path).start()
    sock = tmp_path / "app.sock"
    agent = Agent(["--simulate", "healthy", "--socket", str(sock),
                   "--interval", "0.2", "--push-interval", "0.4", "--retry-max-backoff", "0.5",
                   "--remote-write-url", vm.write_url, "--pushgateway-url", pg.base,
                   "--spool-dir", str(tmp_path / "spool")])
    with running(vm, pg, agent):
        agent.start()
        until(lambda: len(agent.logged("first_push_delivered")) == 2,
              what=lambda: "first_push_delivered of both sinks\n" + "".join(agent.err)[-2000:])
        # status tells each sink as it is: the Pushgateway's counts no samples, and says none
        report = until(lambda: (got := status(sock).stdout) and sink_line(got, sink_name(
            vm.write_url)) and re.search(r"^  pushgateway: last success \d+ s ago; failures: "
                                         r"none$", got, re.M) and got,
                       what=lambda: "both sinks in the status\n" + status(sock).stdout)
        assert int(sink_line(report, sink_name(vm.write_url))["pushed"]) > 0

        vm.stop()
        pg.stop()
        until(lambda: agent.logged("push_failing") and agent.logged("pushgateway_failing"),
              what="both sinks failing")
        agent.more_cycles(5, "during the outage")
        vm.start()
        pg.start()
        until(lambda: agent.logged("receiver_recovered") and agent.logged("pushgateway_recovered"),
              what="both sinks recovered")
        # the cycles after the recovery stored: delivery goes on, logged as a recovery only
        back = when(agent.logged("receiver_recovered")[0])
        until(lambda: any(ts > back * 1000 for *_, ts, _ in vm.samples("gpu_sidecar_up")),
              what="VictoriaMetrics storing the cycles after the recovery")
        back = when(agent.logged("pushgateway_recovered")[0])
        until(lambda: any(float(g["push_time_seconds"]["metrics"][0]["value"]) > back
                          for g in pg.groups()), what="a push to the Pushgateway after it returned")
        agent.more_cycles(5, "after the recovery")
        assert agent.stop() == 0
    first = agent.logged("first_push_delivered")
    assert sorted(e["sink"] for e in first) == sorted([sink_name(vm.write_url), "pushgateway"])
    [rw] = [e for e in first if e["sink"] != "pushgateway"]
    assert rw["samples"] > 0 and rw["url"] == vm.write_url
    assert len(agent.logged("receiver_recovered")) == 1
    assert len(agent.logged("pushgateway_recovered")) == 1


# -- the app goes quiet ------------------------------------------------------------------------

APP = """
import sys, time
from sidecar import client
client.start(gpus=[sys.argv[1]], use_torch=False, interval_s=0.2)
while True:  # a model server's life: serving until it is killed
    client.observe(0.05)
    time.sleep(0.1)
"""


def test_app_quiet_when_the_announced_gpus_app_goes_and_publishing_again_when_it_returns(
        tmp_path):
    sock = tmp_path / "app.sock"
    agent = Agent(["--simulate", "healthy", "--no-simulated-app", "--app-stale-after", "1",
                   "--socket", str(sock), "--interval", "0.2"])

    def app() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", APP, GPU0], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "GPU_SIDECAR_SOCKET": str(sock)})

    apps: list[subprocess.Popen] = []
    try:
        with running(agent):
            agent.start()
            until(sock.exists, what="the agent's socket")
            apps.append(app())
            until(lambda: series_of(agent, "gpu_sm_occupancy_ratio", GPU0),
                  what="the announced GPU's NVML series")
            assert not series_of(agent, "gpu_sm_occupancy_ratio", GPU1), "never announced"

            apps[0].kill()
            apps[0].wait(timeout=10)
            [quiet] = until(lambda: agent.logged("app_quiet"), 30, what="app_quiet")
            assert quiet["silent_for_s"] == 1.0 and "--gpus visible" in quiet["hint"]
            quiet_ms = when(quiet) * 1000 + 1  # the cycle that said it, and every later one
            until(lambda: cycles_after(agent, quiet_ms) >= 5, what="cycles after app_quiet")
            assert series_of(agent, "gpu_sm_occupancy_ratio", GPU0, quiet_ms) == [], \
                "the GPU's series went on after the app went quiet"
            assert agent.logged("app_publishing_again") == []

            apps.append(app())
            [again] = until(lambda: agent.logged("app_publishing_again"), 30,
                            what="app_publishing_again")
            assert again["gpus"] == [GPU0]
            until(lambda: series_of(agent, "gpu_sm_occupancy_ratio", GPU0, when(again) * 1000),
                  what="the GPU's series back")
            agent.more_cycles(3, "after the app returned")
            assert len(agent.logged("app_quiet")) == 1
            assert len(agent.logged("app_publishing_again")) == 1
            assert agent.stop() == 0
    finally:
        for proc in apps:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


# -- run --dry-run -----------------------------------------------------------------------------


def dry_run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli("run", "--dry-run", "--simulate", "healthy",
                   "--socket", str(tmp_path / "run" / "app.sock"), *extra)


def check_line(out: str, name: str) -> str:
    """The line of one check (``ok`` or ``FAILED``) in a dry run's output."""
    found = [line for line in out.splitlines() if re.match(rf"^(ok    |FAILED) {name}", line)]
    assert len(found) == 1, out
    return found[0]


def test_dry_run_checks_every_part_with_requests_that_store_nothing(tmp_path):
    vm, pg = VictoriaMetrics(tmp_path).start(), Pushgateway(tmp_path).start()
    engine = SimulatedEngine(EngineProfile())
    engine.start()
    spool = str(tmp_path / "spool")
    with running(vm, pg, engine):
        good = dry_run(tmp_path, "--remote-write-url", vm.write_url, "--pushgateway-url",
                       pg.base, "--engine-metrics-url", engine.url, "--spool-dir", spool)
        assert good.returncode == 0, good.stdout + good.stderr
        out = good.stdout
        assert check_line(out, "NVML").startswith("ok     NVML: 2 GPU(s)")
        assert check_line(out, "app socket").startswith("ok ")
        # a spool that does not exist yet (a first start): said creatable, nothing created
        assert check_line(out, "spool").startswith(f"ok     spool: the spool directory {spool} "
                                                   "does not exist yet")
        assert "HTTP 204" in check_line(out, f"receiver {vm.write_url}")
        assert "the Pushgateway answers" in check_line(out, f"receiver {pg.base}")
        assert check_line(out, f"engine {engine.url}").startswith(f"ok     engine {engine.url}: "
                                                                 "vllm: ")
        assert "nothing was kept or sent" in out
        assert vm.settled() == [], "the dry run stored something in VictoriaMetrics"
        assert pg.groups() == [], "the dry run created a Pushgateway group"
        assert not Path(spool).exists(), "the dry run created the spool"

        typo = vm.base + "/api/v1/wirte"
        wrong = dry_run(tmp_path, "--remote-write-url", typo, "--spool-dir", spool)
        assert wrong.returncode == 1, wrong.stdout + wrong.stderr
        assert check_line(wrong.stdout, f"receiver {typo}").startswith(
            f"FAILED receiver {typo}: refused")
        assert f"failed: receiver {typo}" in wrong.stdout

    closed = f"http://{LOCAL}:{free_port()}/api/v1/write"
    nobody = dry_run(tmp_path, "--remote-write-url", closed, "--spool-dir", spool,
                     "--push-timeout", "2")
    assert nobody.returncode == 1, nobody.stdout + nobody.stderr
    assert check_line(nobody.stdout, f"receiver {closed}").startswith(
        f"FAILED receiver {closed}: no answer")

    blocker = tmp_path / "a-file"  # root may write anywhere, but not below a regular file
    blocker.write_text("")
    unwritable = dry_run(tmp_path, "--remote-write-url", closed, "--spool-dir",
                         str(blocker / "spool"), "--push-timeout", "2")
    assert unwritable.returncode == 1
    assert check_line(unwritable.stdout, "spool").startswith(
        f"FAILED spool: the spool directory {blocker / 'spool'} is not writable")

    bad = dry_run(tmp_path, "--once")
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "configuration error" in bad.stderr and bad.stdout == ""


# -- --metrics-listen --------------------------------------------------------------------------


def test_metrics_listen_is_scraped_by_prometheus_and_is_the_only_port_the_agent_opens(tmp_path):
    port = free_port()
    address = f"{LOCAL}:{port}"
    scraped = PlainAgent(["--simulate", "healthy", "--socket", str(tmp_path / "a" / "app.sock"),
                          "--interval", "0.2", "--metrics-listen", address])
    plain = Agent(["--simulate", "healthy", "--socket", str(tmp_path / "b" / "app.sock"),
                   "--interval", "0.2"])
    prometheus = Prometheus(tmp_path, scrape=address)
    with scraped, running(plain, prometheus):
        plain.start()
        until(lambda: listener_pid_owns(scraped.proc.pid, port),
              what=lambda: f"the agent listening on {address}\n{scraped.stderr_tail()}")
        prometheus.start()
        found = until(lambda: len(prometheus.query("gpu_sm_occupancy_ratio")) == 2
                      and prometheus.query("gpu_sm_occupancy_ratio"),
                      what="Prometheus holding the scraped GPUs")
        assert {r["metric"]["gpu_uuid"] for r in found} == {GPU0, GPU1}
        assert all("Simulated" in r["metric"]["gpu_name"] for r in found)
        assert all(0 < float(r["value"][1]) < 1 for r in found)

        page = requests.get(f"http://{address}/metrics", timeout=10)
        assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/plain")
        samples = [s for f in text_string_to_metric_families(page.text) for s in f.samples]
        assert any(s.name == "gpu_sm_occupancy_ratio" for s in samples)
        assert all(s.timestamp is None for s in samples), "the scraper stamps scraped samples"
        for path in ("/", "/metricsx", "/api/v1/write"):
            assert requests.get(f"http://{address}{path}", timeout=10).status_code == 404, path

        plain.more_cycles(3)
        assert listening_tcp_sockets(plain.proc.pid) == set(), \
            "an agent without --metrics-listen listens on a TCP port"
        assert len(listening_tcp_sockets(scraped.proc.pid)) == 1
        assert scraped.stop() == 0
    assert scraped.out == [], "with --metrics-listen and no receiver, stdout stays empty"
    assert scraped.logged("metrics_listening")[0]["address"] == address


# -- the small lies ----------------------------------------------------------------------------


def test_once_with_a_receiver_names_its_variable_and_what_to_do():
    url = f"http://{LOCAL}:9/api/v1/write"
    for got in (run_cli("run", "--simulate", "healthy", "--once", "--remote-write-url", url),
                run_cli("run", "--simulate", "healthy", "--once",
                        env={"GPU_SIDECAR_REMOTE_WRITE_URL": url})):
        assert got.returncode == 2, got.stdout + got.stderr
        assert "GPU_SIDECAR_REMOTE_WRITE_URL" in got.stderr
        assert "drop --once to push, or unset the receiver" in got.stderr
        assert got.stdout == ""


def test_diagnose_takes_no_simulated_app_and_says_the_app_layer_was_not_judged():
    announced = run_cli("diagnose", "--simulate", "healthy", "--no-simulated-app",
                        "--duration", "1", "--interval", "0.5")
    assert "unrecognized arguments" not in announced.stderr
    assert announced.returncode == 2, announced.stdout + announced.stderr  # no app: no GPU
    assert "no GPU to judge" in announced.stdout + announced.stderr
    visible = run_cli("diagnose", "--simulate", "healthy", "--no-simulated-app", "--gpus",
                      "visible", "--duration", "1", "--interval", "0.5")
    assert visible.returncode == 0, visible.stdout + visible.stderr
    notes = re.sub(r"\s+", " ", visible.stdout)
    assert notes.count("memory (allocator) and latency not judged: no app figures arrived") == 2


def test_batches_left_at_exit_are_said_lost_with_a_temporary_spool_and_kept_with_spool_dir(
        tmp_path):
    closed = f"http://{LOCAL}:{free_port()}/api/v1/write"
    common = ["--simulate", "healthy", "--interval", "0.2", "--push-interval", "0.4",
              "--retry-max-backoff", "0.5", "--shutdown-timeout", "1", "--remote-write-url",
              closed]
    spool = tmp_path / "spool"
    temporary = Agent(common)
    kept = Agent([*common, "--spool-dir", str(spool), "--socket", str(tmp_path / "app.sock")])
    with running(temporary, kept):
        temporary.start()
        kept.start()
        for agent in (temporary, kept):
            until(lambda agent=agent: agent.logged("push_failing"), what="push_failing")
            agent.more_cycles(3)
        until(lambda: list(spool.rglob("*.batch")), what="a batch in the spool")
        assert temporary.stop() == 0 and kept.stop() == 0
    [lost] = temporary.logged("shutdown_left_in_spool")
    assert lost["batches"] > 0
    assert lost["effect"].startswith("LOST at exit") and "--spool-dir" in lost["effect"]
    [left] = kept.logged("shutdown_left_in_spool")
    assert left["batches"] > 0 and left["effect"] == "sent by the next start on this spool"
    assert len(list(spool.rglob("*.batch"))) >= left["batches"], "what it says is kept is there"


_spec = importlib.util.spec_from_file_location("readme_table", ROOT / "scripts" / "readme_table.py")
readme_table = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(readme_table)  # type: ignore[union-attr]
ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_a_60_by_8_terminal_shows_at_least_one_gpu_row_and_how_many_are_not_shown():
    out, code = readme_table.run_in_pty(
        ("run", "--simulate", "healthy", "--simulate-gpus", "4", "--gpus", "visible",
         "--interval", "0.3", "--log-level", "error"), frames=3, cols=60, rows=8)
    assert code == 0, out[-2000:]
    start = out.index(ALT_SCREEN + HIDE_CURSOR)
    end = out.index(MAIN_SCREEN + SHOW_CURSOR, start)
    frames = [[line for line in ESCAPE.sub("", frame.split(CLEAR_BELOW)[0]).replace("\r", "")
               .split("\n") if line] for frame in out[start:end].split(HOME)[1:]]
    # the frame the test's own Ctrl-C cut (the terminal echoes ^C into it) is left out
    frames = [lines for lines in frames if not any("^C" in line for line in lines)]
    assert len(frames) >= 3
    for lines in frames:
        assert len(lines) <= 7, lines  # the last line of the terminal stays free
        rows = [line for line in lines if re.match(r"^\s*\d+ \|", line)]
        assert rows and rows[0].startswith("  0 |"), lines
        more = [line for line in lines if line.startswith("… ")]
        assert len(more) == 1 and more[0].startswith(f"… {4 - len(rows)} more GPUs not shown")
        assert all(len(line) <= 60 for line in lines)
