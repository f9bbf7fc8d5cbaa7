"""The command line as a user runs it: a subprocess whose output is parsed and checked."""

from __future__ import annotations

import argparse
import ctypes.util
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sidecar import protocol
from sidecar.config import OPTIONS, Config
from sidecar.simulate.scenarios import GH200_C2C, GPU_LOST_INDEX, OLD_DRIVER_VERSION, build
from tests.conftest import ROOT, run_cli, send_datagram
from tests.waiting import until


def series_of(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


def _pump(stream, lines: list[str]) -> None:
    for line in stream:
        lines.append(line)


def values(rows: list[dict], name: str) -> dict[str, float]:
    return {r["labels"]["gpu_uuid"]: r["value"] for r in rows if r["name"] == name}


def once(scenario: str, *extra: str) -> list[dict]:
    proc = run_cli("run", "--simulate", scenario, "--once", "--output", "json", *extra)
    assert proc.returncode == 0, proc.stderr
    return series_of(proc.stdout)


def gpu_rows(rows):
    return [r for r in rows if "gpu_uuid" in r["labels"]]


@pytest.mark.parametrize("scenario", ["healthy", "pcie-saturated", "fragmented", "low-occupancy",
                                      "old-driver"])
def test_every_series_of_a_simulated_gpu_says_simulated(scenario):
    rows = gpu_rows(once(scenario))
    assert rows
    assert all("Simulated" in r["labels"]["gpu_name"] for r in rows)
    uuids = {r["labels"]["gpu_uuid"] for r in rows}
    assert uuids == {g.uuid for g in build(scenario).gpus}


def test_healthy_gives_all_three_layers_and_the_app_figures():
    rows = once("healthy")
    names = {r["name"] for r in rows}
    for name in ("gpu_sm_occupancy_ratio", "gpu_tensor_core_util_ratio", "gpu_utilization_ratio",
                 "gpu_mem_bandwidth_util_ratio", "gpu_memory_used_bytes",
                 "gpu_memory_fragmentation_ratio", "gpu_pcie_rx_bandwidth_util_ratio",
                 "gpu_nvlink_tx_bytes_per_second", "inference_request_duration_seconds_bucket",
                 "gpu_sidecar_app_messages_accepted_total"):
        assert name in names, name
    frag = values(rows, "gpu_memory_fragmentation_ratio")
    assert all(v < 0.2 for v in frag.values())


def test_pcie_saturated_rx_ratio_is_rate_over_link_maximum_and_above_80_percent():
    rows = once("pcie-saturated")
    rate = values(rows, "gpu_pcie_rx_bytes_per_second")
    link = values(rows, "gpu_pcie_link_max_bytes_per_second")
    ratio = values(rows, "gpu_pcie_rx_bandwidth_util_ratio")
    assert len(ratio) == 2
    for uuid, r in ratio.items():
        assert r == pytest.approx(rate[uuid] / link[uuid], rel=1e-12)
        assert r > 0.8
        assert link[uuid] == pytest.approx(32e9 * 128 / 130 / 8 * 16)


def test_fragmented_scenario_shows_fragmentation_above_half_and_retries():
    rows = once("fragmented")
    assert all(v == pytest.approx(0.65, abs=1e-9)
               for v in values(rows, "gpu_memory_fragmentation_ratio").values())
    assert all(v > 0 for v in values(rows, "gpu_allocator_alloc_retries_total").values())


def test_low_occupancy_hides_behind_high_utilization():
    rows = once("low-occupancy")
    occ = values(rows, "gpu_sm_occupancy_ratio")
    util = values(rows, "gpu_utilization_ratio")
    assert occ and all(v < 0.3 for v in occ.values())
    assert all(v > 0.9 for v in util.values())


def test_old_driver_leaves_gpm_and_reserved_memory_absent_but_keeps_pcie():
    rows = once("old-driver")
    names = {r["name"] for r in rows}
    assert "gpu_sm_occupancy_ratio" not in names
    assert "gpu_memory_reserved_bytes" not in names
    assert "gpu_nvlink_tx_bytes_per_second" not in names
    assert len(values(rows, "gpu_pcie_rx_bytes_per_second")) == 2
    assert len(values(rows, "gpu_pcie_rx_bandwidth_util_ratio")) == 2


def stop_after(proc: subprocess.Popen, seconds: float) -> tuple[str, str]:
    """SIGTERM after ``seconds`` while reading its output (a full pipe would stall the agent)."""
    timer = threading.Timer(seconds, proc.send_signal, args=(signal.SIGTERM,))
    timer.start()
    try:
        return proc.communicate(timeout=seconds + 15)
    finally:
        timer.cancel()


def test_gpu_lost_mid_run_the_other_gpus_keep_reporting():
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "run", "--simulate", "gpu-lost", "--interval", "0.2",
         "--output", "json", "--gpu-retry-interval", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out, err = stop_after(proc, 3.0)
    assert proc.returncode == 0, err
    rows = series_of(out)
    gpus = [g.uuid for g in build("gpu-lost").gpus]
    lost = gpus[GPU_LOST_INDEX]
    by_cycle: dict[int, set[str]] = {}
    avail: dict[int, float] = {}
    for r in rows:
        if r["name"] == "gpu_memory_used_bytes":
            by_cycle.setdefault(r["timestamp_ms"], set()).add(r["labels"]["gpu_uuid"])
        if r["name"] == "gpu_sidecar_gpu_available" and r["labels"]["gpu_uuid"] == lost:
            avail[r["timestamp_ms"]] = r["value"]
    cycles = [by_cycle[t] for t in sorted(by_cycle)]
    assert len(cycles) >= 8
    assert lost in cycles[0]  # read before it fell off
    after = [i for i, c in enumerate(cycles) if lost not in c]
    assert after and after == list(range(after[0], len(cycles)))  # gone for good once lost
    for c in cycles:
        assert set(gpus) - {lost} <= c  # the others, every single cycle
    assert list(avail.values())[-1] == 0.0
    assert '"gpu_lost"' in err and err.count('"gpu_lost"') == 1  # logged once, not per cycle


def test_prometheus_text_output_parses_with_timestamps():
    proc = run_cli("run", "--simulate", "healthy", "--once")
    assert proc.returncode == 0, proc.stderr
    families = {f.name: f for f in text_string_to_metric_families(proc.stdout)}
    assert families["gpu_sm_occupancy_ratio"].type == "gauge"
    hist = families["inference_request_duration_seconds"]
    assert hist.type == "histogram"
    sample = families["gpu_pcie_rx_bytes_per_second"].samples[0]
    assert sample.timestamp is not None and abs(sample.timestamp - time.time()) < 60


def test_probe_reports_supported_and_absent_metrics_with_reasons():
    proc = run_cli("probe", "--simulate", "old-driver")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "SIMULATED" in out and "Simulated NVIDIA A100" in out
    # the old driver is said as the scenario's: no current version beside "driver too old?"
    assert f"NVML driver {OLD_DRIVER_VERSION}," in out
    assert "gpu_sm_occupancy_ratio: GPM unavailable: FunctionNotFound" in out
    assert "PCIe rate from throughput" in out
    assert "compute:" in out and "memory:" in out and "io:" in out
    healthy = run_cli("probe", "--simulate", "healthy").stdout
    absent = [line.strip() for line in healthy.splitlines() if line.startswith("    gpu_")]
    # an H200 on a current driver gives everything but NVLink-C2C, which only Grace GPUs have
    assert absent and all(line.startswith("gpu_c2c_") and "no NVLink-C2C" in line
                          for line in absent), absent
    assert "host traffic: over PCIe" in healthy
    grace = run_cli("probe", "--simulate", "grace-hopper").stdout
    assert "absent metrics: none" in grace and "host traffic: over NVLink-C2C" in grace
    seen = next(line for line in healthy.splitlines() if line.startswith("this container sees: "))
    assert all(f"{g.uuid} ({g.name})" in seen for g in build("healthy").gpus)
    assert "PCIe gen 5 x16, 63.02 GB/s per direction" in healthy


def test_help_documents_every_option_with_its_environment_variable():
    out = run_cli("run", "--help").stdout
    for opt in OPTIONS:
        if "run" in opt.commands:
            assert opt.flag in out and opt.env in out


@pytest.mark.parametrize(("args", "env", "needle"), [
    (["--interval", "0"], {}, "--interval='0': must be between 0.1 and 3600 seconds"),
    ([], {"GPU_SIDECAR_INTERVAL": "soon"}, "GPU_SIDECAR_INTERVAL='soon'"),
    ([], {"GPU_SIDECAR_INTERVL": "5"}, "unknown environment variable(s) GPU_SIDECAR_INTERVL"),
    (["--gpus", "0,1"], {}, "'0' is not a GPU UUID"),
    (["--socket", "relative.sock"], {}, "must be an absolute path"),
    (["--simulate", "meltdown"], {}, "must be one of healthy"),
    (["--no-nvml", "--simulate", "healthy"], {}, "exclude each other"),
    # a byte that is not UTF-8 (here Latin-1 'é') reaches Python as a lone surrogate
    ([], {"GPU_SIDECAR_EXTRA_LABEL": "team=caf\udce9"},
     "GPU_SIDECAR_EXTRA_LABEL=[team=***]: is not valid UTF-8"),
    (["--pod-name", "llm-\udce9"], {}, "--pod-name='llm-\ufffd': is not valid UTF-8"),
])
def test_bad_configuration_is_refused_at_start_naming_the_option_and_the_fix(args, env, needle):
    proc = run_cli("run", "--once", *args, env=env)
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("command", ["run", "probe"])
def test_a_named_gpu_nvml_does_not_show_stops_the_agent_with_the_visible_uuids(command):
    visible = [g.uuid for g in build("healthy").gpus]
    bogus = "GPU-00000000-dead-beef-0000-000000000000"
    proc = run_cli(command, "--simulate", "healthy", "--gpus", f"{visible[0]},{bogus}",
                   *(["--once"] if command == "run" else []))
    assert proc.returncode == 2, proc.stderr
    assert f"--gpus names {bogus}, which NVML does not show" in proc.stderr
    assert all(uuid in proc.stderr for uuid in visible)
    assert proc.stdout == ""
    ok = run_cli(command, "--simulate", "healthy", "--gpus", visible[0],
                 *(["--once"] if command == "run" else []))
    assert ok.returncode == 0, ok.stderr


def test_environment_variables_configure_like_flags():
    proc = run_cli("run", "--once", env={"GPU_SIDECAR_SIMULATE": "healthy",
                                         "GPU_SIDECAR_OUTPUT": "json",
                                         "GPU_SIDECAR_POD_NAMESPACE": "ml",
                                         "GPU_SIDECAR_POD_NAME": "llm-0",
                                         "GPU_SIDECAR_NODE_NAME": "node-a"})
    assert proc.returncode == 0, proc.stderr
    rows = series_of(proc.stdout)
    assert all(r["labels"]["namespace"] == "ml" and r["labels"]["pod"] == "llm-0" and
               r["labels"]["node"] == "node-a" for r in rows)


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None,
                    reason="this machine has a real NVML library")
def test_without_nvml_the_agent_stops_with_advice(tmp_path):
    proc = run_cli("run", "--once", "--socket", str(tmp_path / "app.sock"))
    assert proc.returncode == 3
    assert "NVIDIA_DRIVER_CAPABILITIES=utility" in proc.stderr
    assert "--no-nvml" in proc.stderr


def _created_under(paths: list[Path]) -> list[str]:
    return sorted(str(p) for p in paths if os.path.lexists(p))


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None,
                    reason="this machine has a real NVML library")
@pytest.mark.parametrize("log_format", ["json", "console"])
def test_an_agent_that_nvml_refuses_creates_nothing_and_says_so_once(tmp_path, log_format):
    """Socket, injected publisher and spool configured in a directory that does not exist yet:
    exit 3 (NVML unavailable), nothing created, the reason said once (one log line)."""
    absent = tmp_path / "absent"
    proc = run_cli("run", "--once", env={
        "GPU_SIDECAR_SOCKET": str(absent / "run" / "app.sock"),
        "GPU_SIDECAR_INJECT_DIR": str(absent / "run" / "python"),
        "GPU_SIDECAR_SPOOL_DIR": str(absent / "spool"),
        "GPU_SIDECAR_LOG_FORMAT": log_format})
    assert proc.returncode == 3, proc.stderr
    assert os.listdir(tmp_path) == []
    assert proc.stderr.count("Give the container its GPUs") == 1, proc.stderr
    assert proc.stderr.count("nvml_unavailable") == 1 and "Traceback" not in proc.stderr
    assert proc.stdout == ""


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None,
                    reason="this machine has a real NVML library")
def test_an_agent_that_nvml_refuses_leaves_the_default_paths_as_they_were():
    """With nothing configured the agent uses /run/gpu-sidecar and /var/lib/gpu-sidecar: what
    of them did not exist before a refused start does not exist after it (as root, the agent
    could create them: the case of the report)."""
    defaults = [Path(protocol.DEFAULT_SOCKET_PATH).parent, Path(Config.spool_dir)]
    watched = [p for d in defaults for p in (d / "python", d, *d.parents) if p != Path("/")]
    before = _created_under(watched)
    proc = run_cli("run", "--once")
    assert proc.returncode == 3, proc.stderr
    assert _created_under(watched) == before


def test_a_start_that_fails_after_placing_the_publisher_takes_it_back(tmp_path):
    """The socket path is held by a file: exit 4 once NVML (simulated) is open and the
    publisher placed; the directory is left as it was, the file kept."""
    volume = tmp_path / "run"
    volume.mkdir()
    (volume / "app.sock").write_text("not ours")
    proc = run_cli("run", "--simulate", "healthy", "--once", "--log-format", "json",
                   "--socket", str(volume / "app.sock"), timeout=60)
    assert proc.returncode == 4, proc.stderr
    events = [json.loads(line)["event"] for line in proc.stderr.splitlines()]
    assert "inject_placed" in events and events.count("app_socket_unavailable") == 1
    assert os.listdir(volume) == ["app.sock"] and (volume / "app.sock").read_text() == "not ours"


def test_app_only_mode_exports_what_the_app_sends_over_the_socket(tmp_path):
    path = str(tmp_path / "app.sock")
    gpu = "GPU-0c4b24ac-fb68-413f-6f0c-54be2b5a94c7"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "run", "--no-nvml", "--socket", path, "--interval",
         "0.2", "--output", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR")},
             "PYTHONUNBUFFERED": "1"})
    out: list[str] = []
    err: list[str] = []
    pumps = [threading.Thread(target=_pump, args=(stream, lines), daemon=True)
             for stream, lines in ((proc.stdout, out), (proc.stderr, err))]
    for pump in pumps:
        pump.start()

    def exported() -> bool:
        rows = series_of("".join(out[:]))
        return (any(r["name"] == "gpu_memory_fragmentation_ratio" and r["value"] == 0.7
                    and r["labels"]["gpu_uuid"] == gpu for r in rows)
                and any(r["name"] == "gpu_sidecar_app_messages_rejected_total"
                        and r["labels"]["reason"] == "not_json" and r["value"] == 1
                        for r in rows))

    try:
        until(lambda: os.path.exists(path) or proc.poll() is not None, interval=0.02,
              what="the agent's socket")
        message = protocol.Allocator(pid=4242, gpu=gpu, reserved_bytes=1000, allocated_bytes=300,
                                     active_bytes=300, inactive_split_bytes=100, alloc_retries=2,
                                     ooms=0)
        send_datagram(path, b"not json at all")
        send_datagram(path, protocol.encode(message))
        until(lambda: exported() or proc.poll() is not None,
              what="a cycle exporting the app's fragmentation and the rejected message")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        for pump in pumps:
            pump.join(timeout=5)
    assert proc.returncode == 0, "".join(err)
    rows = series_of("".join(out))
    frag = [r for r in rows if r["name"] == "gpu_memory_fragmentation_ratio"]
    assert frag and frag[-1]["value"] == 0.7 and frag[-1]["labels"]["gpu_uuid"] == gpu
    rejected = [r for r in rows if r["name"] == "gpu_sidecar_app_messages_rejected_total"]
    assert rejected[-1]["labels"]["reason"] == "not_json" and rejected[-1]["value"] == 1
    assert not os.path.exists(path)  # removed on exit


@pytest.mark.parametrize("command", ["probe", "diagnose"])
def test_help_lists_exactly_the_options_that_apply(command):
    out = run_cli(command, "--help").stdout
    for opt in OPTIONS:
        assert (opt.flag in out) == (command in opt.commands), opt.flag
        if command in opt.commands:
            assert opt.env in out
    if command == "probe":  # run-only options are not offered
        for flag in ("--interval", "--pod-name", "--app-stale-after", "--output", "--once",
                     "--gpu-retry-interval", "--duration"):
            assert flag not in out


def test_probe_option_variables_of_the_pod_do_not_stop_probe():
    """`kubectl exec ... gpu-sidecar probe` inherits the agent's GPU_SIDECAR_* environment."""
    proc = run_cli("probe", "--simulate", "healthy", env={"GPU_SIDECAR_INTERVAL": "2",
                                                          "GPU_SIDECAR_POD_NAME": "llm-0"})
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None,
                    reason="this machine has a real NVML library")
def test_probe_says_its_result_once(tmp_path):
    proc = run_cli("probe")
    assert proc.returncode == 3
    assert proc.stderr.count("NVIDIA_DRIVER_CAPABILITIES=utility") == 1
    assert "nvml_unavailable" not in proc.stderr  # no log line repeating the advice


def test_probe_prints_its_report_once_without_info_log_lines():
    proc = run_cli("probe", "--simulate", "old-driver")
    assert proc.returncode == 0
    assert "gpu_metrics_absent" not in proc.stderr and "nvml_opened" not in proc.stderr
    assert proc.stdout.count("gpu_sm_occupancy_ratio: GPM unavailable") == 2  # once per GPU
    verbose = run_cli("probe", "--simulate", "old-driver", "--log-level", "info")
    assert "gpu_metrics_absent" in verbose.stderr  # a level given is a level kept


def test_simulated_mode_names_the_socket_actually_used():
    proc = run_cli("run", "--simulate", "healthy", "--once")
    assert proc.returncode == 0, proc.stderr
    logs = [json.loads(line) for line in proc.stderr.splitlines()]
    starting = next(e for e in logs if e["event"] == "starting")
    listening = next(e for e in logs if e["event"] == "app_socket_listening")
    assert starting["config"]["socket"] == listening["path"] != protocol.DEFAULT_SOCKET_PATH
    assert not os.path.exists(listening["path"])  # private, and removed on exit
    probe_out = run_cli("probe", "--simulate", "healthy").stdout
    assert protocol.DEFAULT_SOCKET_PATH not in probe_out
    assert "--simulate: a private temporary path" in probe_out
    named = run_cli("probe", "--simulate", "healthy", "--socket", "/tmp/x/app.sock").stdout
    assert "(/tmp/x/app.sock)" in named


def test_gpus_help_says_what_each_command_does_with_them():
    probe_help = " ".join(run_cli("probe", "--help").stdout.split())
    assert "Which GPUs to export" not in probe_help
    assert "probe reports every visible GPU" in probe_help
    diagnose_help = " ".join(run_cli("diagnose", "--help").stdout.split())
    assert "diagnose judges them" in diagnose_help and "--no-nvml" in diagnose_help


# -- the scenarios are the simulator's; probe's links are the metric table's ------------------------

@pytest.mark.parametrize("command", ["run", "probe", "diagnose"])
def test_the_scenario_names_come_from_the_simulator_for_help_and_for_refusal(command):
    """sidecar/simulate/scenarios.py alone names the scenarios: --help lists them in its order,
    and a name it lacks is refused at start, from a flag or its variable, with the list."""
    from sidecar import config
    from sidecar.simulate.scenarios import SCENARIOS

    assert not hasattr(config, "SCENARIOS")
    shown = " ".join(run_cli(command, "--help", env={"COLUMNS": "2000"}).stdout.split())
    assert f"instead of NVML: {', '.join(SCENARIOS)}. Every series" in shown
    refused = run_cli(command, *(["--once"] if command == "run" else []),
                      env={"GPU_SIDECAR_SIMULATE": "meltdown"})
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.startswith("gpu-sidecar: configuration error: "
                                     "GPU_SIDECAR_SIMULATE='meltdown': must be one of "
                                     f"{', '.join(SCENARIOS)}. Fix the value of --simulate")


def test_a_choice_the_command_line_passes_is_checked_like_a_configured_one():
    from sidecar import config

    choices = {"simulate": ("calm", "storm")}
    args = argparse.Namespace(simulate="storm")
    assert config.build("run", args, {}, choices).simulate == "storm"
    with pytest.raises(config.ConfigError, match=r"^--simulate='drizzle': must be one of calm, "
                                                 r"storm\. Fix the value of --simulate"):
        config.build("run", argparse.Namespace(simulate="drizzle"), {}, choices)


LINK_LINE = re.compile(r"^\s+(?:io:\s+)?(\S+) TX ([\d.]+) GB/s \(([\d.]+) %\), RX ([\d.]+) GB/s "
                       r"\(([\d.]+) %\) of ([\d.]+) GB/s per direction$", re.M)


def link_lines(block: str) -> dict[str, tuple[float, ...]]:
    return {m[1]: tuple(float(x) for x in m.groups()[1:]) for m in LINK_LINE.finditer(block)}


def first_gpu(stdout: str) -> str:
    return stdout.split("\nGPU 0 ", 1)[1].split("\nGPU 1 ", 1)[0]


def test_probe_prints_each_link_with_its_shares_of_its_maximum():
    """NVLink as PCIe: each direction's rate and its share of the link's maximum; the share is
    the simulated load over the 18 links' maximum, and agrees with the rate printed."""
    gpu = build("nvlink-saturated").gpus[0]
    proc = run_cli("probe", "--simulate", "nvlink-saturated")
    assert proc.returncode == 0, proc.stderr
    links = link_lines(first_gpu(proc.stdout))
    assert set(links) == {"PCIe", "NVLink"}, proc.stdout  # no C2C on an H200
    tx, tx_pct, rx, rx_pct, top = links["NVLink"]
    assert top == pytest.approx(gpu.nvlink_links * gpu.nvlink_speed_mbps / 1e3, abs=0.01)
    for load, rate, share in ((gpu.nvlink_tx, tx, tx_pct), (gpu.nvlink_rx, rx, rx_pct)):
        assert share == pytest.approx(100 * rate / top, abs=0.1)
        assert abs(share / (100 * load.base / (top * 1e9)) - 1) <= load.amplitude + 0.01
    grace = link_lines(first_gpu(run_cli("probe", "--simulate", "grace-hopper").stdout))
    assert list(grace) == ["PCIe", "NVLink", "C2C"]
    gh200 = build("grace-hopper").gpus[0]
    c2c_rx_pct, c2c_top = grace["C2C"][3:]
    assert c2c_top == pytest.approx(GH200_C2C / 1e9, abs=0.01)
    total = gh200.c2c_rx.base * (1 + gh200.c2c_protocol_overhead)  # GPM's C2C TOTAL: with overhead
    assert abs(c2c_rx_pct / (100 * total / GH200_C2C) - 1) <= gh200.c2c_rx.amplitude + 0.01


def xlink_table():
    """The metric table with a copy of NVLink's entries under another link's name: its rates, its
    maximum (named XLink, XL in the live table) and the shares dividing them; each copy fills
    and reads NVLink's own fields, so XLink's figures are NVLink's."""
    from sidecar import metrics

    def renamed(spec: metrics.MetricSpec) -> metrics.MetricSpec:
        return dataclasses.replace(
            spec, name=spec.name.replace("nvlink", "xlink"),
            link=None if spec.link is None else ("XLink", "XL"),
            ratio_of=(None if spec.ratio_of is None else
                      tuple(n.replace("nvlink", "xlink") for n in spec.ratio_of)))

    return metrics.TABLE + tuple(renamed(m) for m in metrics.TABLE
                                 if m.name.startswith("gpu_nvlink_"))


def sampled_cycles(scenario: str, cycles: int = 3) -> list[dict]:
    """A few cycles of the simulated node, sampled in-process by the agent's own parts, each read
    back as the table and diagnose read it (``figures_of``)."""
    from sidecar import config, wiring
    from sidecar.agent import PRIME_WINDOW_S, Agent
    from sidecar.judge.series import figures_of

    cfg = config.Config(simulate=scenario, simulate_gpus=1, interval=0.5)
    paced = threading.Event()  # never set: waits out the sampling interval, as the agent does
    with wiring.simulated_paths(cfg) as cfg, wiring.sampling(cfg) as (source, _, state):
        agent = Agent(cfg, source=source, app=state, sinks=[])
        agent.prime()
        paced.wait(PRIME_WINDOW_S)
        out = []
        for _ in range(cycles):
            out.append(figures_of(agent.cycle()))
            paced.wait(cfg.interval)
    return out


REPORT_LINK = re.compile(r"^(?:  IO:)?\s+(\S+) RX ([\d.]+) % \(([\d.]+) GB/s\), TX "
                         r"([\d.]+) % \(([\d.]+) GB/s\) of ([\d.]+) GB/s", re.M)


@pytest.mark.slow
def test_a_link_the_metric_table_gains_reaches_probe_the_table_and_the_report_as_it_stands(
        monkeypatch, capsys):
    """A link is its table entries (rates, a maximum naming it, the shares dividing them): a copy
    of NVLink's under another name reaches probe's link lines, the live table's columns and the
    report's IO lines with no change to probe, the table or the report."""
    from sidecar import config
    from sidecar.commands import probe
    from sidecar.judge.verdict import judge
    from sidecar.judge.window import summarize
    from sidecar.views import links, report, table

    monkeypatch.setattr(links, "LINKS", links.links_of(xlink_table()))
    assert probe.probe(config.Config(simulate="nvlink-saturated", simulate_gpus=1)) == 0
    found = link_lines(first_gpu(capsys.readouterr().out))
    assert list(found) == ["PCIe", "NVLink", "XLink"]
    assert found["XLink"] == found["NVLink"]  # the same fields, read once

    cycles = sampled_cycles("nvlink-saturated")
    frame = table.render(cycles, "title").splitlines()
    titles = next(line for line in frame if line.startswith("GPU |")).split("|")
    io = titles.index(next(t for t in titles if "NVL%" in t))
    assert titles[io].split() == ["RX%", "TX%", "RX", "GB/s", "TX", "GB/s", "NVL%", "NVL", "GB/s",
                                  "XL%", "XL", "GB/s"]
    assert "XL%: XLink RX/TX share of its maximum; XL GB/s: XLink RX/TX" in " ".join(frame)
    row = next(line for line in frame if line.startswith("  0 |")).split("|")[io].split()
    assert row[6:8] == row[4:6] and row[4] != "-"  # XL's cells are NVL's, read
    narrow = table.render(cycles, "title", width=60).splitlines()
    assert not {"NVL", "XL"} & set(next(line for line in narrow if line.startswith("GPU |"))
                                   .replace("%", " ").split())  # dropped whole, as NVLink's

    verdicts = {u: judge(w) for u, w in summarize(cycles).items()}
    text = report.report(verdicts, seconds=1.0, samples=len(cycles), label="")
    lines = {m[1]: m.groups()[1:] for m in REPORT_LINK.finditer(text)}
    assert list(lines) == ["PCIe", "NVLink", "XLink"], text
    assert lines["XLink"] == lines["NVLink"]
