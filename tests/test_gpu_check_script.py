"""bench/gpu_check.py's steps that need no GPU of their own (issue #47): the NVML time per call
(step 9) measured on the simulated driver by the same wrapper the agent exports, and the check
of GPM beside DCGM profiling (step 10): skipped, saying why, where neither ``dcgmi`` nor a
dcgm-exporter runs, judged from what ``dcgmi dmon`` prints where one does. The rest of the
script needs a real GPU and torch: it runs only where one is lent (docs/gpu-check.md)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from sidecar.simulate import fake_nvml, scenarios
from sidecar.sources.nvml import NvmlSource
from tests.conftest import ROOT

SCRIPT = ROOT / "bench" / "gpu_check.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _script()


@pytest.fixture
def simulated() -> Iterator[NvmlSource]:
    """The agent's NVML source over the simulated H200s (GPM, byte counters)."""
    fake_nvml.install(scenarios.build("healthy", 2).nvml())
    source = NvmlSource()
    source.open()
    try:
        yield source
    finally:
        source.close()
        fake_nvml.uninstall()


@pytest.mark.slow
def test_step_9_records_the_time_per_nvml_call_the_agent_exports(simulated):
    got = gpu_check.step_nvml_time(simulated)
    json.dumps(got)  # recorded as gpu_check.json
    per_call = got["per_call"]
    readings = gpu_check.NVML_TIME_READINGS
    # every reading of the 2 GPUs asks each of them for its field values and its GPM metrics
    assert per_call["nvmlDeviceGetFieldValues"]["calls"] >= 2 * readings
    assert per_call["nvmlGpmMetricsGet"]["calls"] == 2 * readings
    for name, row in per_call.items():
        assert row["seconds"] > 0 and row["mean_us"] == pytest.approx(
            row["seconds"] / row["calls"] * 1e6), name
    assert got["calls_per_reading"] * readings == sum(r["calls"] for r in per_call.values())
    assert 0 < got["reading_seconds_median"] <= got["reading_seconds_max"]
    assert sorted(got["per_gpu_seconds_median"]) == sorted(d.uuid for d in simulated.devices())
    rows = dict(gpu_check.nvml_time_rows({"nvml_time": got}))
    assert rows["NVML costliest calls, mean us"].count("nvml") == 3


def test_step_10_is_skipped_saying_why_where_no_dcgm_runs(simulated, tmp_path):
    uuid = simulated.devices()[0].uuid
    nothing = gpu_check.dcgm_present(which=lambda _: None, proc=tmp_path)
    assert nothing == {"dcgmi": None, "dcgm_exporter_pids": []}
    got = gpu_check.step_dcgm_coexist(simulated, uuid, nothing)
    assert got["skipped"].startswith("neither dcgmi on PATH nor a dcgm-exporter process")
    # a dcgm-exporter process is found by its program's name, not by an argument naming it
    for pid, argv in ((123, b"/usr/bin/dcgm-exporter\0-f\0/etc/dcgm.csv\0"),
                      (124, b"python3\0dcgm-exporter\0")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(argv)
    assert gpu_check.dcgm_present(which=lambda _: None, proc=tmp_path)["dcgm_exporter_pids"] \
        == [123]
    done = subprocess.run([sys.executable, str(SCRIPT), "--dcgm-only"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0 and set(json.loads(done.stdout)) == {"dcgmi",
                                                                     "dcgm_exporter_pids"}


# what `dcgmi dmon -e 1002,1003,1004` prints (DCGM 3.x/4.x), and what it answers while a
# profiler holds the perfmon subsystem
DMON = """#Entity   SMACT  SMOCC  TENSO
ID
GPU 0     0.000  0.000  0.000
GPU 0     0.412  0.201  0.118
"""
PERFMON_HELD = ("Error setting watches. Result: The third-party Profiling module returned an "
                "unrecoverable error\n")


@pytest.mark.parametrize(("printed", "code", "ok"), [(DMON, 0, True), (PERFMON_HELD, 255, False)])
def test_step_10_judges_gpm_and_dcgm_profiling_read_together(simulated, tmp_path, printed, code,
                                                             ok):
    """A stand-in dcgmi (this machine has no DCGM) printing what the real one prints: the
    agent's GPM readings, taken meanwhile, succeed, and both_ok follows DCGM's answer."""
    dcgmi = tmp_path / "dcgmi"
    (tmp_path / "printed").write_text(printed)
    dcgmi.write_text(f"#!/bin/sh\nsleep 1\ncat {tmp_path / 'printed'}\nexit {code}\n")
    dcgmi.chmod(0o755)
    got = gpu_check.step_dcgm_coexist(simulated, simulated.devices()[0].uuid,
                                      {"dcgmi": str(dcgmi), "dcgm_exporter_pids": []})
    json.dumps(got)
    assert got["gpm_ok"] and got["gpm_readings"] >= 2, got
    assert got["dcgm_ok"] is ok and got["both_ok"] is ok, got
    assert got["dcgm"]["dcgmi"]["exit_code"] == code
