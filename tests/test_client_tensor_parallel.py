"""A tensor-parallel model server: one process that times the requests of several GPUs
(``client.start(gpus=[A, B])``). Each request runs on every GPU of the group, so its latency is
each GPU's: both GPUs' latency is judged (``diagnose`` beside the agent names "low occupancy and
high p99" on both), ``status`` lists the process on both, and a client of an earlier release
(its latency sent for its first GPU only) is still taken as it was.

A real agent on the simulated ``low-occupancy`` node without its simulated model server, and the
real ``sidecar.client`` in a subprocess on the real app socket."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from sidecar.simulate.scenarios import simulated_uuid
from sidecar.sources.app_socket import AppState
from tests.conftest import ROOT, run_cli
from tests.receivers import Agent
from tests.test_diagnose import verdicts
from tests.waiting import until

SCENARIO = "low-occupancy"
GPUS = [simulated_uuid(SCENARIO, 0), simulated_uuid(SCENARIO, 1)]

# times slow requests (0.4 s, above the 0.25 s p99 objective) for both GPUs until stdin closes
SERVER = """
import sys, threading, time
from sidecar import client
pub = client.start(gpus=sys.argv[1:], use_torch=False, interval_s=0.2)
closed = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), closed.set()), daemon=True).start()
print("started", flush=True)
while not closed.wait(0.05):
    for _ in range(5):
        client.observe(0.4)
client.stop()
"""


def test_a_process_timing_two_gpus_has_its_latency_judged_and_listed_on_both(tmp_path):
    sock = tmp_path / "run" / "app.sock"
    env = {"GPU_SIDECAR_SOCKET": str(sock), "GPU_SIDECAR_SIMULATE": SCENARIO,
           "GPU_SIDECAR_INTERVAL": "0.5", "GPU_SIDECAR_SPOOL_DIR": str(tmp_path / "spool")}
    agent = Agent(["--simulate", SCENARIO, "--no-simulated-app", "--interval", "0.5",
                   "--socket", str(sock), "--spool-dir", env["GPU_SIDECAR_SPOOL_DIR"]]).start()
    server = None
    try:
        until(sock.exists, 30, what="the agent's socket")
        server = subprocess.Popen([sys.executable, "-c", SERVER, *GPUS], cwd=ROOT, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE,
                                  env={**os.environ, "GPU_SIDECAR_SOCKET": str(sock)})
        assert server.stdout is not None and server.stdout.readline() == "started\n"

        def counted_on(gpu: str) -> float:
            return agent.last("inference_request_duration_seconds_count", gpu_uuid=gpu) or 0

        until(lambda: all(counted_on(g) > 0 for g in GPUS), 60, interval=0.1,
              what="the server's requests counted on both GPUs")
        agent.more_cycles(8, "with the server's requests on both GPUs")
        proc = run_cli("diagnose", env=env, timeout=60)
        status: list[subprocess.CompletedProcess[str]] = []

        def status_lists_the_server() -> bool:  # the status file is rewritten every 5 s
            status.append(run_cli("status", env=env))
            return f"process {server.pid}:" in status[-1].stdout

        until(status_lists_the_server, 30, interval=1.0, what="status listing the server")
        shown = status[-1]
    finally:
        if server is not None:
            server.communicate(input="", timeout=30)  # stdin closed: it stops its publisher
        assert agent.stop() == 0, "".join(agent.err)[-2000:]
    assert server.returncode == 0, server.stderr
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "window: the agent's window:" in proc.stdout, proc.stdout
    # both GPUs judged on the process's latency, not "latency not judged" on the second
    assert verdicts(proc.stdout) == {0: "low-occupancy", 1: "low-occupancy"}, proc.stdout
    assert "latency not judged" not in proc.stdout, proc.stdout
    # the same requests on each GPU: one round carries the process's histogram for both
    assert counted_on(GPUS[0]) == counted_on(GPUS[1]) > 0
    assert shown.returncode == 0, shown.stdout + shown.stderr
    listed = re.findall(rf"process {server.pid}: last message \d+ s ago, GPUs (.*)", shown.stdout)
    assert listed == [", ".join(sorted(GPUS))], shown.stdout


def test_an_earlier_clients_round_with_latency_for_its_first_gpu_only_is_still_taken():
    """A sidecar.client of an earlier release sends its histogram for its first GPU only: the
    agent takes the round whole, as it did (the histogram on that GPU, the others named)."""
    state = AppState()
    earlier = {"v": 1, "kind": "round", "pid": 7, "gpus": GPUS, "allocators": [],
               "latency": [{"gpu": GPUS[0], "bounds": [0.1, 0.5], "counts": [0, 9, 9],
                            "sum": 3.6}]}
    assert state.feed(json.dumps(earlier).encode()) is not None and not state.rejected
    assert state.figures(GPUS[0]).latency is not None
    assert state.figures(GPUS[0]).latency.counts == (0, 9, 9)
    assert sorted(state.announced()) == sorted(GPUS)
