"""Faults a real fleet meets, produced for real (DESIGN.md, "Reliability promises"; issue #23):

- a wrong remote-write path that VictoriaMetrics answers with 400 "unsupported path" keeps every
  batch (an empty request is refused as well: the URL is wrong, not the data); after the URL is
  fixed, the agent restarted on the same volume adopts the old spool and delivers all of it;
- batches set aside in this run make the exit line say so, and ``gpu-sidecar resend-rejected``
  sends them once the receiver takes them;
- a process stopped and continued (SIGSTOP, SIGCONT) is said to have been paused, not to have
  overrun its cycles;
- a clean stop pushes ``gpu_sidecar_up 0`` last (the alert GPUSidecarSilent then stays quiet,
  deploy/alerts/gpu-sidecar.tests.yml), a killed agent's last value stays 1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cramjam
import pytest

from tests.receivers import ROOT, Agent, FaultProxy, VictoriaMetrics, running
from tests.waiting import until

VM_REL = 1e-12  # VictoriaMetrics stores float64 exactly for these values


def args(url: str, spool: Path, *extra: str) -> list[str]:
    return ["--simulate", "healthy", "--interval", "0.2", "--push-interval", "0.4",
            "--remote-write-url", url, "--spool-dir", str(spool), "--retry-max-backoff", "0.5",
            "--shutdown-timeout", "3", *extra]


def keyed(rows: list[tuple[str, tuple, int, float]]) -> dict[tuple[str, tuple, int], float]:
    return {(n, labels, ts): v for n, labels, ts, v in rows}


def missing_from(vm: VictoriaMetrics, *agents: Agent) -> set:
    """What the agents sampled and VictoriaMetrics does not hold; everything it holds matches."""
    sampled = keyed([row for agent in agents for row in agent.sampled()])
    stored = keyed(vm.settled(len(sampled)))
    for key in set(sampled) & set(stored):
        assert stored[key] == pytest.approx(sampled[key], rel=VM_REL), key
    assert not set(stored) - set(sampled), "stored what was never sampled"
    return set(sampled) - set(stored)


def stopped(agent: Agent) -> dict:
    found = agent.logged("stopped")
    assert len(found) == 1, "".join(agent.err)[-2000:]
    return found[0]


def batch_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*.batch") if p.is_file())


# -- a wrong URL -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/api/v1/wirte", "/api/v1/push"])  # a typo; Mimir's path
def test_a_wrong_path_loses_nothing_and_the_fixed_url_delivers_everything(tmp_path, path):
    vm = VictoriaMetrics(tmp_path).start()
    spool = tmp_path / "spool"
    with running(vm):
        wrong = Agent(args(vm.base + path, spool)).start()
        refused = until(lambda: wrong.logged("push_refused"), 60,
                        what=lambda: "push_refused\n" + "".join(wrong.err)[-2000:])
        wrong.more_cycles(10, "while the URL is wrong")
        assert wrong.stop() == 0, "".join(wrong.err)[-2000:]
        assert vm.settled() == [], "the wrong path stored something"

        assert len(refused) == 1, "one line for the condition, not one per attempt"
        assert refused[0]["status"] == 400
        assert "unsupported path" in refused[0]["receiver_said"]
        assert "URL, not the data" in refused[0]["hint"] and "/api/v1/write" in refused[0]["hint"]
        assert not wrong.logged("batch_refused"), "a wrong URL set batches aside as bad data"
        assert not list(spool.rglob("rejected/*.batch"))
        assert stopped(wrong)["all_delivered"] is False
        assert wrong.logged("shutdown_left_in_spool")
        assert wrong.total("gpu_sidecar_samples_dropped_total") == 0

        fixed = Agent(args(vm.write_url, spool)).start()
        until(lambda: fixed.logged("spool_adopted"), 60, what="the old spool adopted")
        fixed.more_cycles(3, "after the fix")
        assert fixed.stop() == 0, "".join(fixed.err)[-2000:]
        assert missing_from(vm, wrong, fixed) == set(), "samples of the wrong-URL run were lost"
    adopted = fixed.logged("spool_adopted")
    assert len(adopted) == 1 and adopted[0]["batches"] > 0 and adopted[0]["samples"] > 0
    assert stopped(fixed)["all_delivered"] is True
    assert batch_files(spool) == []
    assert sorted(p.name for p in spool.iterdir()) == [Path(adopted[0]["new"]).name], \
        "the old spool directory was left behind"


def test_a_400_about_the_data_still_sets_the_batch_aside_when_nothing_was_accepted_yet(tmp_path):
    """The first request of the run refused for its data: the empty request that follows is
    accepted, so the URL is right and only that batch goes to rejected/."""
    vm = VictoriaMetrics(tmp_path).start()
    proxy = FaultProxy(vm.write_url, lambda n, body: (400, {}, b"bad data") if n == 0 else None)
    spool = tmp_path / "spool"
    with running(vm, proxy):
        agent = Agent(args(proxy.url, spool)).start()
        until(lambda: agent.logged("batch_refused"), 60, what="batch_refused")
        until(lambda: agent.total("gpu_sidecar_samples_pushed_total") > 0, 60,
              what="later batches delivered")
        assert agent.stop() == 0
        rejected = batch_files(spool / next(spool.iterdir()).name / "rejected")
        assert len(rejected) == 1
        assert not agent.logged("push_refused")
        assert stopped(agent)["all_delivered"] is False
        aside = agent.logged("shutdown_with_batches_set_aside")
        assert len(aside) == 1 and aside[0]["batches"] == 1
        assert "resend-rejected" in aside[0]["hint"]
    statuses = [status for _, status, _ in proxy.log]
    assert statuses[:2] == [400, 204], "the empty request did not follow the first 400"


# -- rejected batches sent again ---------------------------------------------------------------


def resend(*extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
    return subprocess.run([sys.executable, "-m", "sidecar", "resend-rejected", *extra],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)


def test_rejected_batches_are_sent_again_by_resend_rejected_beside_the_running_agent(tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    refusing = {"on": True}
    refused: set[bytes] = set()

    def plan(n: int, body: bytes) -> tuple[int, dict, bytes] | None:
        if refusing["on"] and (n in (1, 2) or body in refused):  # the same batches, again
            refused.add(body)
            return 400, {}, b"sample limit exceeded"
        return None

    proxy = FaultProxy(vm.write_url, plan)
    spool = tmp_path / "spool"
    with running(vm, proxy):
        agent = Agent(args(proxy.url, spool)).start()
        until(lambda: len(list(spool.rglob("rejected/*.batch"))) == 2, 60,
              what="two batches set aside")
        agent.more_cycles(3, "after the refusals")

        still = resend("--remote-write-url", proxy.url, "--spool-dir", str(spool))
        assert still.returncode == 1, still.stdout + still.stderr
        assert "0 batches (0 samples) sent again, 2 refused again" in still.stdout
        assert len(list(spool.rglob("rejected/*.batch"))) == 2, "a refused batch was deleted"

        refusing["on"] = False  # the receiver's limit raised
        done = resend("--remote-write-url", proxy.url, "--spool-dir", str(spool))
        assert done.returncode == 0, done.stdout + done.stderr
        assert "2 batches" in done.stdout and "0 refused again" in done.stdout
        assert list(spool.rglob("rejected/*.batch")) == []
        agent.more_cycles(2, "after the resend")
        assert agent.stop() == 0
        assert missing_from(vm, agent) == set(), "a resent batch did not arrive whole"


def test_resend_rejected_stops_at_an_unreachable_receiver_and_keeps_everything(tmp_path):
    spool = tmp_path / "spool"
    vm = VictoriaMetrics(tmp_path).start()
    proxy = FaultProxy(vm.write_url, lambda n, body: (400, {}, b"bad") if n == 1 else None)
    with running(vm, proxy):
        agent = Agent(args(proxy.url, spool)).start()
        until(lambda: list(spool.rglob("rejected/*.batch")), 60, what="a batch set aside")
        assert agent.stop() == 0
    unreachable = resend("--remote-write-url", proxy.url, "--spool-dir", str(spool),
                         "--push-timeout", "2")
    assert unreachable.returncode == 1
    assert "0 batches" in unreachable.stdout and "1 not tried" in unreachable.stdout
    assert "stopped:" in unreachable.stdout
    assert len(list(spool.rglob("rejected/*.batch"))) == 1


def test_resend_rejected_without_a_receiver_says_which_option_is_missing():
    refused = resend()
    assert refused.returncode == 2
    assert "--remote-write-url or --otlp-url" in refused.stderr


# -- a paused process; a clean stop ------------------------------------------------------------


def test_a_stopped_and_continued_agent_says_it_was_paused_not_that_its_cycles_overran(tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    with running(vm):
        agent = Agent(args(vm.write_url, tmp_path / "spool")).start()
        agent.more_cycles(3, "before the pause")
        agent.signal(signal.SIGSTOP)
        try:
            paused_at = time.monotonic()
            while time.monotonic() - paused_at < 3.0:  # the pause itself: nothing to wait for
                time.sleep(0.1)
        finally:
            agent.signal(signal.SIGCONT)
        [paused] = until(lambda: agent.logged("process_paused"), 30, what="process_paused")
        until(lambda: (agent.last("gpu_sidecar_paused_seconds_total") or 0) >= 2.5, 30,
              what="the pause counted")
        agent.more_cycles(3, "after the pause")
        assert agent.stop() == 0
    assert paused["cause"].startswith("stopped and continued")
    assert 2.5 <= paused["paused_about_s"] <= 10
    assert paused["cycle_s"] < 0.2
    assert not agent.logged("cycle_overrun"), "a pause was reported as an overrun"
    assert agent.last("gpu_sidecar_cycle_overruns_total") == 0
    assert stopped(agent)["pauses"] == 1


def test_a_clean_stop_pushes_gpu_sidecar_up_0_last_and_a_killed_agent_leaves_1(tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    with running(vm):
        clean = Agent(args(vm.write_url, tmp_path / "clean", "--pod-name", "ended-0")).start()
        killed = Agent(args(vm.write_url, tmp_path / "killed", "--pod-name", "gone-0")).start()
        clean.more_cycles(4)
        until(lambda: killed.total("gpu_sidecar_samples_pushed_total") > 0, 60,
              what="the second agent delivering")
        assert clean.stop() == 0
        killed.signal(signal.SIGKILL)
        killed.wait()
        vm.settled(len(clean.sampled()) + len(killed.sampled()) // 2)

        def up(pod: str) -> list[float]:
            return [v for _, _, _, v in sorted(
                vm.samples(f'{{__name__="gpu_sidecar_up",pod="{pod}"}}'), key=lambda r: r[2])]

        # every gpu_sidecar_up the clean agent printed, its last one included, is searchable
        printed = sum(1 for n, _, _, _ in clean.sampled() if n == "gpu_sidecar_up")
        until(lambda: len(up("ended-0")) >= printed,
              what=lambda: f"{printed} gpu_sidecar_up of the stopped agent stored "
                           f"(at {len(up('ended-0'))})")
        values = {pod: up(pod) for pod in ("ended-0", "gone-0")}
    assert values["ended-0"][-1] == 0.0 and set(values["ended-0"][:-1]) == {1.0}
    assert values["gone-0"] and set(values["gone-0"]) == {1.0}


def test_once_a_url_took_a_request_a_400_after_a_restart_is_about_the_data_at_once(tmp_path):
    """The spool remembers that its URL took a request: a bad first batch after a restart is
    set aside at once, never held, and no empty request is sent to check the URL."""
    vm = VictoriaMetrics(tmp_path).start()
    empty = cramjam.snappy.compress_raw(b"")
    refusing = {"on": False}
    proxy = FaultProxy(vm.write_url, lambda n, body: (400, {}, b"bad data")
                       if refusing["on"] and (body == bytes(empty) or not refused_once(body))
                       else None)
    seen: list[bytes] = []

    def refused_once(body: bytes) -> bool:
        seen.append(body)
        return len(seen) > 1

    spool = tmp_path / "spool"
    with running(vm, proxy):
        first = Agent(args(proxy.url, spool)).start()
        until(lambda: first.total("gpu_sidecar_samples_pushed_total") > 0, 60, what="a push")
        assert first.stop() == 0
        refusing["on"] = True
        second = Agent(args(proxy.url, spool)).start()
        until(lambda: second.logged("batch_refused"), 60, what="the bad batch set aside")
        second.more_cycles(3)
        assert second.stop() == 0
    assert not second.logged("push_refused"), "the batch was held as if the URL were wrong"
    assert bytes(empty) not in [body for _, _, body in proxy.log], "the URL was checked again"


def test_the_spool_of_a_replica_removed_on_purpose_is_left_not_sent_to_the_other(tmp_path):
    """Two receivers ran side by side (two replicas); one is removed from the configuration.
    Its backlog holds what the other already has: it is left where it is and said, not sent
    to the remaining receiver as if the URL had been fixed."""
    from sidecar.durability.spool import Spool
    from sidecar.durability.spool import spool_dir_name as _spool_dir
    from sidecar.sinks.remote_write import sink_name

    vm = VictoriaMetrics(tmp_path).start()
    spool = tmp_path / "spool"
    kept_url, removed_url = vm.write_url, vm.base + "/replica-b/api/v1/write"
    for url in (kept_url, removed_url):
        Spool(spool / _spool_dir(sink_name(url), url), max_bytes=1 << 20).close()
    removed = spool / _spool_dir(sink_name(removed_url), removed_url)
    held = Spool(removed, max_bytes=1 << 20)
    held.put(b"a batch of replica b", samples=1)
    held.close()
    with running(vm):
        agent = Agent(args(kept_url, spool)).start()
        [orphaned] = until(lambda: agent.logged("spool_orphaned"), 60, what="spool_orphaned")
        agent.more_cycles(2)
        assert agent.stop() == 0
    assert orphaned["directory"] == str(removed)
    assert not agent.logged("spool_adopted")
    assert len(batch_files(removed)) == 1, "the removed replica's backlog was touched"
