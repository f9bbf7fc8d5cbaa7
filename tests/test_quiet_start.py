"""A person at a terminal sees the live table, not the start-up log (issue #35, "the newcomer's
first hour"): the configuration goes to debug and one short ``starting`` line stays; absences
that only describe the hardware (no NVLink-C2C on a GPU that is not a Grace one, no NVLink on a
PCIe card) go to debug; an unexpected absence (an old driver without GPM) is still said once per
GPU. A pod's log (stdout not a terminal) keeps the whole configuration in ``starting``."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

from sidecar.sources.nvml.devices import EXPECTED_ABSENCES
from tests.conftest import ROOT


def run_at_a_terminal(*args: str) -> list[dict]:
    """``gpu-sidecar run ARGS --once`` with stdout a real pseudo-terminal (the table) and the
    JSON log on a pipe; the log's events."""
    main, side = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
    env["TERM"] = "xterm-256color"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "sidecar", "run", "--once", "--log-format", "json", *args],
            stdout=side, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env, timeout=60)
    finally:
        os.close(side)
        os.close(main)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]


def events(logs: list[dict], name: str) -> list[dict]:
    return [e for e in logs if e["event"] == name]


def test_a_terminal_run_starts_with_one_short_line_and_no_expected_absence():
    logs = run_at_a_terminal("--simulate", "healthy")  # two H200s: no C2C, by design
    [starting] = events(logs, "starting")
    # the version, and how to reach the simulated agent's private socket: nothing more
    assert set(starting) == {"version", "status", "diagnose", "event", "level", "timestamp"}
    assert events(logs, "gpu_metrics_absent") == [], "an H200 without C2C is not news"
    assert events(logs, "configuration") == []  # at debug


def test_debug_still_shows_the_configuration_and_the_expected_absences():
    logs = run_at_a_terminal("--simulate", "healthy", "--log-level", "debug")
    [configuration] = events(logs, "configuration")
    assert configuration["config"]["interval"] == 5.0
    by_design = events(logs, "gpu_metrics_absent_by_design")
    assert len(by_design) == 2 and all(
        set(e["absent"].values()) <= EXPECTED_ABSENCES for e in by_design)


def test_an_unexpected_absence_is_said_once_per_gpu_at_a_terminal():
    logs = run_at_a_terminal("--simulate", "old-driver")
    said = events(logs, "gpu_metrics_absent")
    assert len(said) == 2, "once per GPU"
    for e in said:
        reasons = set(e["absent"].values())
        assert any("GPM unavailable" in why for why in reasons)
        assert not reasons & EXPECTED_ABSENCES, "the expected ones went to debug"


def test_a_piped_run_logs_the_whole_configuration_once():
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
    proc = subprocess.run([sys.executable, "-m", "sidecar", "run", "--simulate", "healthy",
                           "--once", "--log-format", "json"], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    logs = [json.loads(line) for line in proc.stderr.splitlines() if line.startswith("{")]
    [starting] = events(logs, "starting")
    assert starting["config"]["interval"] == 5.0
