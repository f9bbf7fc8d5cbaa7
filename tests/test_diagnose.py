"""``gpu-sidecar diagnose``: each scenario's verdict through the real command line, and the
thresholds shared with the shipped alert rules (one change moves both)."""

from __future__ import annotations

import argparse
import contextlib
import ctypes.util
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc

import pytest

from sidecar import alert_rules, config, protocol, thresholds
from sidecar.commands.diagnose import diagnose
from sidecar.judge.figures import Figures
from sidecar.judge.verdict import judge
from sidecar.judge.window import Summary, quantile, summarize
from sidecar.simulate.scenarios import GPU_LOST_INDEX, build
from sidecar.thresholds import THRESHOLDS
from tests.conftest import ROOT, run_cli, send_datagram

NO_NVML = ctypes.util.find_library("nvidia-ml") is None

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


def test_a_tensor_parallel_server_whose_all_reduce_fills_nvlink_is_named_on_all_eight_gpus():
    proc = run_cli("diagnose", "--simulate", "nvlink-saturated", "--duration", "5", timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert verdicts(proc.stdout) == dict.fromkeys(range(8), "nvlink"), proc.stdout
    flat = " ".join(proc.stdout.split())
    assert "of the active links' 478.1 GB/s, above 80%" in flat  # 18 links x 26,562 MBps
    assert "tensor-parallel degree" in flat and "nvidia-smi topo -m" in flat
    assert "NVLink above 80% of its maximum on a busy GPU or with p99 above the objective" in flat


IO_LINK = re.compile(r"^(?:  IO:)?\s+(PCIe|NVLink|C2C) RX ([\d.]+) % \(([\d.]+) GB/s\), TX "
                     r"([\d.]+) % \(([\d.]+) GB/s\) of ([\d.]+) GB/s", re.M)


def test_the_report_s_io_lines_give_nvlink_s_share_of_its_maximum_as_pcie_s():
    """Each GPU's IO figures, whatever its verdict: NVLink's RX and TX with their shares of the
    active links' maximum, on a line of its own below PCIe's, as the saturated node loads it."""
    gpu = build("nvlink-saturated").gpus[0]
    proc = run_cli("diagnose", "--simulate", "nvlink-saturated", *WINDOW)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    blocks = proc.stdout.split("\nGPU ")[1:]
    assert len(blocks) == len(build("nvlink-saturated").gpus)
    top = gpu.nvlink_links * gpu.nvlink_speed_mbps * 1e6
    for block in blocks:
        io = block.split("  IO:", 1)[1].split("  health:", 1)[0]
        links = {m[1]: [float(x) for x in m.groups()[1:]] for m in IO_LINK.finditer("  IO:" + io)}
        assert list(links) == ["PCIe", "NVLink"], io
        rx_pct, rx, tx_pct, tx, maximum = links["NVLink"]
        assert maximum == pytest.approx(top / 1e9, abs=0.05)
        for load, share, rate in ((gpu.nvlink_rx, rx_pct, rx), (gpu.nvlink_tx, tx_pct, tx)):
            assert share == pytest.approx(100 * rate / maximum, abs=0.1)
            assert abs(share / (100 * load.base / top) - 1) <= load.amplitude + 0.01, io


@pytest.mark.parametrize(("scenario", "shown"), [("grace-hopper", ["PCIe", "NVLink", "C2C"]),
                                                ("old-driver", ["PCIe"])])
def test_the_report_has_an_io_line_for_each_link_the_gpu_has(scenario, shown):
    """PCIe always; NVLink and NVLink-C2C (the host link of a GH200) where the GPU has them: an
    A100 PCIe card gets no line for links it lacks."""
    proc = run_cli("diagnose", "--simulate", scenario, *WINDOW)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    for block in proc.stdout.split("\nGPU ")[1:]:
        io = "  IO:" + block.split("  IO:", 1)[1].split("  health:", 1)[0]
        assert [m[1] for m in IO_LINK.finditer(io)] == shown, io


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
    from sidecar import wiring
    from sidecar.agent import Agent
    from sidecar.commands.diagnose import sample_window
    from sidecar.recent import Recent
    from sidecar.signals import STOP

    out = {}
    for scenario in ("pcie-saturated", "fragmented", "low-occupancy"):
        cfg = config.Config(simulate=scenario, interval=0.5)
        with wiring.simulated_paths(cfg) as cfg, wiring.sampling(cfg) as (source, _, state):
            agent = Agent(cfg, source=source, app=state, sinks=[], recent=Recent())
            out[scenario] = sample_window(agent, 1.0, 0.5, STOP)[0].windows()
    return out


@pytest.mark.slow
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


@pytest.mark.slow
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


# -- beside a running agent, without NVML, interrupted ---------------------------------------------

def test_beside_an_agent_holding_the_socket_every_visible_gpu_is_judged_on_nvml(tmp_path):
    path = str(tmp_path / "app.sock")
    held = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # a running agent's socket
    held.bind(path)
    try:
        proc = run_cli("diagnose", "--simulate", "pcie-saturated", "--socket", path, *WINDOW)
        assert proc.returncode == 1, proc.stdout + proc.stderr  # not 2 after the whole window
        assert set(verdicts(proc.stdout).values()) == {"pcie"} and len(verdicts(proc.stdout)) == 2
        head = " ".join(proc.stdout.split("\n\n")[0].split())
        assert f"the app socket {path} is held by a running agent" in head
        assert "app layer (allocator, fragmentation, request latency) is NOT judged" in head
        # with nothing NVML could give, there is truly no GPU to judge: 2
        if NO_NVML:
            proc = run_cli("diagnose", "--no-nvml", "--socket", path, "--duration", "1")
            assert proc.returncode == 2 and "held by a running agent" in proc.stderr
    finally:
        held.close()


@pytest.mark.skipif(not NO_NVML, reason="this machine has a real NVML library")
def test_following_the_no_nvml_advice_judges_the_app_layer(tmp_path):
    path = str(tmp_path / "app.sock")
    advice = run_cli("diagnose", "--duration", "1", "--socket", path).stderr
    assert "--no-nvml" in advice  # the advice printed when NVML is missing, followed below
    gpu = "GPU-0c4b24ac-fb68-413f-6f0c-54be2b5a94c7"
    message = protocol.encode(protocol.Allocator(
        pid=4242, gpu=gpu, reserved_bytes=4 << 30, allocated_bytes=1 << 30,
        active_bytes=1 << 30, inactive_split_bytes=3 << 30, alloc_retries=2, ooms=0))
    done = threading.Event()

    def app() -> None:  # a model server publishing its allocator figures
        while not done.wait(0.2):
            if os.path.exists(path):
                with contextlib.suppress(OSError):  # between the command's runs
                    send_datagram(path, message)

    thread = threading.Thread(target=app, daemon=True)
    thread.start()
    try:
        proc = run_cli("diagnose", "--no-nvml", "--socket", path, *WINDOW)
    finally:
        done.set()
        thread.join()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[--no-nvml: app layer only]" in proc.stdout
    assert gpu in proc.stdout and "verdict: fragmentation" in proc.stdout
    assert "IO not judged" in proc.stdout and "compute not judged" in proc.stdout


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_diagnose_prints_a_partial_report_and_exits_128_plus_the_signal(sig, code):
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "diagnose", "--simulate", "pcie-saturated",
         "--duration", "60", "--interval", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR")},
             "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # the simulated_gpus warning: sampling has begun
        assert "simulated_gpus" in line, line
        # a few cycles (0.5 s each) into the window. A time, not a condition: diagnose shows
        # nothing of its window from outside until the report, the very thing judged here
        time.sleep(1.5)
        start = time.monotonic()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert time.monotonic() - start < 10  # not the whole window
    assert proc.returncode == code, out + err
    assert "PARTIAL: interrupted after" in out.splitlines()[0]
    assert set(verdicts(out).values()) == {"pcie"}
    assert str(code) in run_cli("diagnose", "--help").stdout


@pytest.mark.slow
def test_the_window_is_kept_as_running_aggregates_not_as_cycles():
    def cycle(n: int) -> dict[str, Figures]:
        return {f"GPU-{g}": Figures(uuid=f"GPU-{g}", index=str(g), utilization=n % 7 / 7,
                                    occupancy=0.5, retries=float(n), mem_used=float(n))
                for g in range(16)}

    def held_after(cycles: int) -> int:
        tracemalloc.start()
        try:
            summary = Summary()
            base = tracemalloc.get_traced_memory()[0]
            for n in range(cycles):
                summary.add(cycle(n))
            return tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()

    assert held_after(3000) - held_after(300) < 16_000  # a list of cycles: megabytes
    windows = summarize([cycle(n) for n in range(10)])
    w = windows["GPU-3"]
    assert w.samples == 10 and w.retries == 9 and w.mean.mem_used == pytest.approx(4.5)
    assert w.mean.utilization == pytest.approx(sum(n % 7 / 7 for n in range(10)) / 10)
