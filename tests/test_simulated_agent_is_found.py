"""A simulated agent's socket is private (a temporary directory, so that two demos never
collide), and ``status`` and ``diagnose`` look beside the default socket: the agent's start-up
line says, once, the exact command lines that reach it (issue #35, "the newcomer's first
hour"). Run as printed, against a real simulated agent, they answer from it."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from sidecar import protocol
from tests.conftest import ROOT
from tests.receivers import Agent, running
from tests.waiting import until


def as_printed(command_line: str) -> subprocess.CompletedProcess:
    """The command line the agent printed, run as a person would paste it."""
    words = shlex.split(command_line)
    assert words[0] == "gpu-sidecar"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
    return subprocess.run([sys.executable, "-m", "sidecar", *words[1:]], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=60)


def test_the_start_up_line_names_the_commands_that_reach_a_simulated_agent():
    agent = Agent(["--simulate", "healthy", "--interval", "0.2"]).start()
    with running(agent):
        [starting] = until(lambda: agent.logged("starting"), 30, what="starting")
        socket = starting["config"]["socket"]
        assert socket != protocol.DEFAULT_SOCKET_PATH and "gpu-sidecar-" in socket  # private
        assert starting["status"] == f"gpu-sidecar status --socket {shlex.quote(socket)}"
        assert starting["diagnose"] == f"gpu-sidecar diagnose --socket {shlex.quote(socket)}"
        agent.more_cycles(5, "before asking it")

        status = as_printed(starting["status"])
        assert status.returncode == 0, status.stdout + status.stderr
        assert "(pid" in status.stdout and "simulated" in status.stdout, status.stdout
        diagnose = as_printed(starting["diagnose"])
        assert diagnose.returncode == 0, diagnose.stdout + diagnose.stderr  # healthy: exit 0
        assert "the agent's window" in diagnose.stdout, diagnose.stdout
        assert agent.stop() == 0
    assert len(agent.logged("starting")) == 1, "said once, at start"


def test_an_agent_that_is_not_simulated_adds_nothing(tmp_path):
    """Its socket is the one configured (the pod's), which the commands find by default."""
    agent = Agent(["--no-nvml", "--interval", "0.2", "--socket", str(tmp_path / "app.sock"),
                   "--spool-dir", str(tmp_path / "spool")]).start()
    with running(agent):
        [starting] = until(lambda: agent.logged("starting"), 30, what="starting")
        assert agent.stop() == 0
    assert "status" not in starting and "diagnose" not in starting
