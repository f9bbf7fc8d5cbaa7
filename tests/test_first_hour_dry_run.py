"""What --dry-run and a temporary spool say about a wrong URL, a simulated run's paths, a taken
port and batches set aside (issue #27): the words match what happens."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.receivers import LOCAL, Agent, FaultProxy, Pushgateway, VictoriaMetrics, free_port, running
from tests.waiting import until


def dry_run(tmp_path: Path, *extra: str):
    return run_cli("run", "--dry-run", "--simulate", "healthy",
                   "--socket", str(tmp_path / "run" / "app.sock"), *extra)


def check_line(out: str, name: str) -> str:
    [line] = [line for line in out.splitlines() if line[7:].startswith(name)]
    return line


def test_dry_run_says_a_refused_empty_request_is_about_the_url_not_the_data(tmp_path):
    vm, pg = VictoriaMetrics(tmp_path).start(), Pushgateway(tmp_path).start()
    with running(vm, pg):
        typo = vm.base + "/api/v1/wirte"
        got = dry_run(tmp_path, "--remote-write-url", typo, "--spool-dir", str(tmp_path / "sp"))
        wrong_pg = pg.base + "/metrics"
        pgw = dry_run(tmp_path, "--pushgateway-url", wrong_pg)
    assert got.returncode == 1 and pgw.returncode == 1
    line = check_line(got.stdout, f"receiver {typo}")
    # nothing was sent but an empty request, and nothing is set aside: the URL is wrong
    assert "set aside" not in line, line
    assert "the URL, not the data" in line and "/api/v1/write" in line, line
    line = check_line(pgw.stdout, f"receiver {wrong_pg}")
    assert "remote-write" not in line and "Pushgateway" in line, line


def test_dry_run_with_simulate_checks_the_paths_the_simulated_run_uses():
    got = run_cli("run", "--dry-run", "--simulate", "healthy", "--remote-write-url",
                  f"http://{LOCAL}:{free_port()}/api/v1/write", "--push-timeout", "1")
    # `run --simulate healthy` binds a private temporary socket and spools in a temporary
    # directory: a non-root demo user must not be told /run is not writable
    assert "/run/gpu-sidecar" not in check_line(got.stdout, "app socket"), got.stdout
    assert "/var/lib/gpu-sidecar" not in check_line(got.stdout, "spool"), got.stdout


def test_dry_run_checks_that_metrics_listen_can_be_listened_on(tmp_path):
    taker = VictoriaMetrics(tmp_path).start()  # any listener holds the port
    with running(taker):
        address = f"{LOCAL}:{taker.port}"
        got = dry_run(tmp_path, "--metrics-listen", address)
        run = run_cli("run", "--simulate", "healthy", "--metrics-listen", address,
                      "--socket", str(tmp_path / "r" / "app.sock"))
    assert run.returncode == 2  # the run refuses to start...
    assert got.returncode == 1, got.stdout  # ...so the dry run must not say all is well
    assert "Address already in use" in check_line(got.stdout, "--metrics-listen")


def test_batches_set_aside_in_a_temporary_spool_are_said_lost_at_exit(tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    proxy = FaultProxy(vm.write_url, lambda n, body: (400, {}, b"bad data") if n == 0 else None)
    with running(vm, proxy):
        agent = Agent(["--simulate", "healthy", "--interval", "0.2", "--push-interval", "0.4",
                       "--retry-max-backoff", "0.5", "--remote-write-url", proxy.url]).start()
        until(lambda: agent.logged("batch_refused"), what="a batch set aside")
        assert agent.stop() == 0
    [aside] = agent.logged("shutdown_with_batches_set_aside")
    assert not os.path.exists(aside["directory"]), "the temporary spool went with the run"
    assert "LOST" in aside["effect"] and "--spool-dir" in aside["hint"], aside


def test_dry_run_beside_a_running_agent_fails_where_the_real_run_would_exit_4(tmp_path):
    """Item 11 of issue #44: a second agent's dry run said the socket and the spool were
    writable, and the real second run then stopped with exit 4."""
    vm = VictoriaMetrics(tmp_path).start()
    sock, spool = tmp_path / "run" / "app.sock", tmp_path / "spool"
    same = ["--socket", str(sock), "--spool-dir", str(spool), "--remote-write-url", vm.write_url]
    with running(vm):
        agent = Agent(["--simulate", "healthy", "--interval", "0.5", *same]).start()
        try:
            until(lambda: agent.logged("app_socket_listening") and any(
                (d / ".lock").exists() for d in spool.glob("*")), what="the agent running")
            got = run_cli("run", "--dry-run", "--simulate", "healthy", *same)
            second = run_cli("run", "--simulate", "healthy", *same)
        finally:
            assert agent.stop() == 0
        after = run_cli("run", "--dry-run", "--simulate", "healthy", *same)
    assert second.returncode == 4, second.stderr  # what the dry run must foresee
    assert got.returncode == 1, got.stdout
    line = check_line(got.stdout, "app socket")
    assert line.startswith("FAILED") and f"another process is listening on {sock}" in line \
        and "exit 4" in line, line
    line = check_line(got.stdout, "spool")
    assert line.startswith("FAILED") and f"in use by another gpu-sidecar (pid {agent.proc.pid})" \
        in line and "exit 5" in line, line
    assert "failed: app socket, spool" in got.stdout, got.stdout
    # the agent gone (its socket removed, its lock let go), the same dry run passes
    assert after.returncode == 0, after.stdout
    assert check_line(after.stdout, "app socket").startswith("ok")
    assert check_line(after.stdout, "spool").startswith("ok")


NVML_LINE = re.compile(r"one reading held NVML ([0-9.]+) ms in (\d+) calls \(per GPU: "
                       r"GPU 0 ([0-9.]+) ms \((\d+) calls\), GPU 1 ([0-9.]+) ms \((\d+) calls\); "
                       r"costliest: (.*)\)$")


def test_the_dry_run_says_how_long_its_reading_held_nvml_per_gpu_and_call(tmp_path):
    """Issue #47: the NVML check reads every GPU once through the agent's own wrapper and says
    the time it held NVML, per GPU and the costliest calls; on the old driver (no byte counters,
    no GPM) the 20 ms throughput sample the stand-in blocks for, once per GPU, leads."""
    healthy = dry_run(tmp_path)
    old = run_cli("run", "--dry-run", "--simulate", "old-driver",
                  "--socket", str(tmp_path / "old" / "app.sock"))
    assert healthy.returncode == 0 and old.returncode == 0, healthy.stdout + old.stdout
    got = {}
    for name, out in (("healthy", healthy.stdout), ("old", old.stdout)):
        line = check_line(out, "NVML")
        found = NVML_LINE.search(line)
        assert found, line
        total, calls, gpu0, calls0, gpu1, calls1 = map(float, found.groups()[:6])
        assert calls == calls0 + calls1 > 0, line
        assert total == pytest.approx(gpu0 + gpu1, abs=0.01), line  # each call on some GPU
        got[name] = total, found[7].split(", ")
    total, top = got["old"]
    assert top[0].startswith("nvmlDeviceGetPcieThroughput ") and top[0].endswith(" x2"), top
    assert float(top[0].split()[1]) >= 2 * 20, top  # the stand-in sleeps its 20 ms window
    total, top = got["healthy"]
    assert total < 20 and not any("PcieThroughput" in c for c in top), top  # byte counters
    assert len(top) == 5 and all(re.fullmatch(r"nvml\w+ [0-9.]+ ms x\d+", c) for c in top), top
