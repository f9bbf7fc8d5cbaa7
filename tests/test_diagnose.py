"""``gpu-sidecar diagnose``: each scenario's verdict through the real command line, and the
thresholds shared with the shipped alert rules (one change moves both)."""

from __future__ import annotations

import argparse
import ctypes.util
import dataclasses
import re

import pytest

from sidecar import alert_rules, config, thresholds
from sidecar.diagnose import diagnose, judge, quantile, summarize
from sidecar.simulate.scenarios import GPU_LOST_INDEX
from sidecar.thresholds import THRESHOLDS
from tests.conftest import run_cli

WINDOW = ("--duration", "2", "--interval", "0.5")
VERDICT = {"pcie-saturated": "pcie", "fragmented": "fragmentation",
           "low-occupancy": "low-occupancy"}


def verdicts(stdout: str) -> dict[int, str]:
    """GPU index -> verdict key, from the report's ``GPU n`` and ``verdict:`` lines."""
    out: dict[int, str] = {}
    gpu = None
    for line in stdout.splitlines():
        if m := re.match(r"^GPU (\d+) ", line):
            gpu = int(m[1])
        elif m := re.match(r"^  verdict: (\S+)", line):
            assert gpu is not None
            out[gpu] = m[1]
    return out


@pytest.mark.parametrize(("scenario", "expected", "code"), [
    ("healthy", "none", 0),
    ("pcie-saturated", "pcie", 1),
    ("fragmented", "fragmentation", 1),
    ("low-occupancy", "low-occupancy", 1),
    ("old-driver", "none", 0),
])
def test_each_scenario_gets_its_verdict_and_exit_code(scenario, expected, code):
    proc = run_cli("diagnose", "--simulate", scenario, *WINDOW)
    assert proc.returncode == code, proc.stdout + proc.stderr
    found = verdicts(proc.stdout)
    assert found and set(found.values()) == {expected}, proc.stdout
    if code:  # the figures behind it and what to do
        assert "  why:" in proc.stdout and "  do:" in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1].startswith("result: ")


def test_remedies_are_the_seeds():
    out = {s: run_cli("diagnose", "--simulate", s, *WINDOW).stdout
           for s in ("pcie-saturated", "fragmented", "low-occupancy")}
    assert "pin_memory" in out["pcie-saturated"] and "prefetch" in out["pcie-saturated"]
    assert "expandable_segments" in out["fragmented"] and "empty_cache" in out["fragmented"]
    assert "batch" in out["fragmented"]
    assert "batch" in out["low-occupancy"] and "CUDA graphs" in out["low-occupancy"]
    assert "fuse" in out["low-occupancy"]


def test_a_lost_gpu_is_a_finding_and_the_others_are_judged():
    proc = run_cli("diagnose", "--simulate", "gpu-lost", *WINDOW)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    found = verdicts(proc.stdout)
    assert found.pop(GPU_LOST_INDEX) == "gpu-lost"
    assert set(found.values()) == {"none"} and len(found) == 3
    assert "dmesg" in proc.stdout


def test_old_driver_says_compute_was_not_judged_rather_than_healthy():
    proc = run_cli("diagnose", "--simulate", "old-driver", *WINDOW)
    assert proc.returncode == 0
    assert proc.stdout.count("verdict: none (compute not judged)") == 2
    assert "compute not judged: no SM occupancy" in proc.stdout


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None,
                    reason="this machine has a real NVML library")
def test_without_nvml_diagnose_exits_3_and_says_why_once(tmp_path):
    proc = run_cli("diagnose", "--duration", "1", "--socket", str(tmp_path / "app.sock"))
    assert proc.returncode == 3
    assert proc.stderr.count("NVIDIA_DRIVER_CAPABILITIES=utility") == 1
    assert proc.stdout == ""


def test_quantile_matches_prometheus_histogram_quantile():
    bounds, counts = (0.1, 0.2, 0.3, float("inf")), (50, 90, 100, 100)
    assert quantile(0.5, bounds, counts) == pytest.approx(0.1)
    assert quantile(0.99, bounds, counts) == pytest.approx(0.29)
    assert quantile(0.99, (0.1, float("inf")), (0, 10)) == pytest.approx(0.1)  # rank in +Inf
    assert quantile(0.99, bounds, (0, 0, 0, 0)) is None


# -- one place for the thresholds ----------------------------------------------------------------

@pytest.fixture(scope="module")
def windows():
    """A short window of every judged scenario, sampled in-process by the command's own code."""
    from sidecar import cli
    from sidecar.agent import Agent
    from sidecar.diagnose import sample_window
    from sidecar.signals import STOP

    out = {}
    for scenario in ("pcie-saturated", "fragmented", "low-occupancy"):
        cfg = config.Config(simulate=scenario, interval=0.5)
        with cli.simulated_paths(cfg) as cfg, cli.sampling(cfg) as (source, _, state):
            agent = Agent(cfg, source=source, app=state, sinks=[])
            out[scenario] = summarize(sample_window(agent, 1.0, 0.5, STOP)[0])
    return out


@pytest.mark.parametrize(("scenario", "change", "in_rules"), [
    ("pcie-saturated", {"pcie_util_ratio": 0.95}, "> 0.95"),
    ("fragmented", {"fragmentation_ratio": 0.7}, "gpu_memory_fragmentation_ratio > 0.7"),
    ("fragmented", {"fragmentation_min_reserved_bytes": 200 << 30}, "> 214748364800"),
    ("low-occupancy", {"occupancy_ratio": 0.1}, "(gpu_sm_occupancy_ratio) < 0.1"),
    ("low-occupancy", {"p99_latency_s": 0.5}, "0.5 s is the p99 objective"),
])
def test_a_threshold_changed_in_one_place_moves_the_rules_and_the_verdicts(
        windows, scenario, change, in_rules):
    changed = dataclasses.replace(THRESHOLDS, **change)
    assert in_rules not in alert_rules.rules(THRESHOLDS)
    assert in_rules in alert_rules.rules(changed)
    assert in_rules.replace("  ", " ") in alert_rules.prometheus_rule(changed).replace("  ", " ")
    before = {judge(w).key for w in windows[scenario].values()}
    after = {judge(w, changed).key for w in windows[scenario].values()}
    assert before == {VERDICT[scenario]} and after == {"none"}


def test_the_command_reads_the_thresholds_at_run_time(monkeypatch, capsys):
    """The hook: ``sidecar.thresholds.THRESHOLDS`` is read when diagnose judges, not copied at
    import, so what renders the rules (python -m sidecar.alert_rules) and diagnose agree."""
    args = argparse.Namespace(simulate="pcie-saturated", duration="1", interval="0.5")
    cfg = config.build("diagnose", args, env={})
    assert diagnose(cfg) == 1
    monkeypatch.setattr(thresholds, "THRESHOLDS", dataclasses.replace(THRESHOLDS,
                                                                      pcie_util_ratio=0.95))
    assert diagnose(cfg) == 0
    out = capsys.readouterr().out
    assert "PCIe above 80% of the link" in out and "PCIe above 95% of the link" in out
