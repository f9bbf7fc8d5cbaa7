"""The stdout sink for a person at a terminal (the live table) and for everything else (today's
exposition, unchanged). The table tests run the real command line in a pseudo-terminal."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import subprocess
import sys

import pytest

from sidecar import protocol
from sidecar import samples as sm
from sidecar.metrics import BY_NAME
from sidecar.samples import Series
from sidecar.simulate.scenarios import build
from sidecar.sinks.stdout import StdoutSink, json_lines, prometheus_text
from sidecar.views.table import ALT_SCREEN, CLEAR_BELOW, HIDE_CURSOR, HOME, MAIN_SCREEN, SHOW_CURSOR, Table
from tests.conftest import ROOT, run_cli

_spec = importlib.util.spec_from_file_location("readme_table", ROOT / "scripts" / "readme_table.py")
readme_table = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(readme_table)  # type: ignore[union-attr]

GOLDEN = ROOT / "tests" / "golden"
ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
ROW = re.compile(r"^\s*\d+ \|")


def fixed_series() -> list[Series]:
    """Two GPUs with every figure, a histogram, odd label values and non-finite numbers: the
    input the golden files were rendered from by the stdout sink before the table existed."""
    ts = 1_767_225_600_123
    out: list[Series] = []
    for i in range(2):
        ident = sm.GpuIdentity(uuid=f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd",
                               name='Sim "H200"\\x', index=str(i))
        sample = sm.GpuSample(
            identity=ident, timestamp_ms=ts,
            compute=sm.ComputeLayer(sm_occupancy_ratio=0.55 + i / 100, tensor_core_util_ratio=0.42,
                                    sm_active_ratio=0.7, utilization_ratio=0.62),
            memory=sm.MemoryLayer(bandwidth_util_ratio=0.45, controller_busy_ratio=0.35,
                                  used_bytes=70 * 2**30, total_bytes=141 * 2**30,
                                  reserved_bytes=71 * 2**30),
            io=sm.IoLayer(pcie_tx_bytes_per_second=2.0e9, pcie_rx_bytes_per_second=6.0e9 + i,
                          pcie_link_max_bytes_per_second=63.015384615e9, pcie_link_generation=5,
                          pcie_link_width=16, pcie_replay_errors=3,
                          nvlink_tx_bytes_per_second=20e9, nvlink_rx_bytes_per_second=2.5e10),
            app=sm.AppFigures(
                allocators=(protocol.Allocator(
                    pid=41, gpu=ident.uuid, reserved_bytes=60 * 2**30, allocated_bytes=52 * 2**30,
                    active_bytes=52 * 2**30, inactive_split_bytes=2**30, alloc_retries=7, ooms=0,
                    largest_free_block_bytes=3 * 2**30, private_pool_bytes=None),),
                latency=sm.LatencyHistogram(bounds=(0.05, 0.1, 0.25), counts=(10, 90, 99, 100),
                                            sum_seconds=6.25),
                alloc_retries=7, ooms=0))
        out += sm.sample_series(sample, {"namespace": "ml", "pod": "llm-0"})
    out.append(Series("gpu_sidecar_up", (("pod", "llm-0"),), 1.0, ts))
    out.append(Series("gpu_sidecar_cycle_duration_seconds", (), 0.000123, ts))
    out.append(Series("gpu_sidecar_samples_dropped_total", (("reason", "x"),), float("nan"), ts))
    out.append(Series("some_unknown_metric", (), float("inf"), ts))
    return out


def golden_prometheus() -> str:
    """The exposition as the sink wrote it before the table; HELP texts are metrics.py's (a
    placeholder in the file, so an edited help text does not read as a changed format)."""
    text = (GOLDEN / "stdout.prom").read_text()
    return re.sub(r"^# HELP (\S+) @HELP@$", lambda m: f"# HELP {m[1]} {BY_NAME[m[1]].help}", text,
                  flags=re.M)


# -- not a terminal: today's output ------------------------------------------------------------

def test_renderers_write_todays_format_byte_for_byte():
    series = fixed_series()
    assert prometheus_text(series) == golden_prometheus()
    assert json_lines(series) == (GOLDEN / "stdout.jsonl").read_text()


@pytest.mark.parametrize(("fmt", "expected"), [("auto", "prom"), ("prometheus", "prom"),
                                               ("json", "jsonl")])
def test_the_sink_into_a_pipe_writes_exactly_the_renderers_output(fmt, expected):
    stream = io.StringIO()  # not a terminal, as a pipe or a container's log
    sink = StdoutSink(fmt, stream)
    sink.emit(fixed_series())
    assert sink.close(0.0)
    want = golden_prometheus() if expected == "prom" else (GOLDEN / "stdout.jsonl").read_text()
    assert stream.getvalue() == want


def test_piped_run_prints_exposition_not_the_table():
    proc = run_cli("run", "--simulate", "healthy", "--once")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# HELP gpu_sm_occupancy_ratio ")
    assert "\x1b" not in proc.stdout and "| verdict" not in proc.stdout  # no table header
    rows = run_cli("run", "--simulate", "healthy", "--once", "--output", "json").stdout
    assert all(json.loads(line)["name"] for line in rows.splitlines())


def test_the_table_module_is_not_loaded_on_the_push_or_pipe_path():
    code = ("import sys, contextlib, io\n"
            "from sidecar.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    rc = main(['run', '--simulate', 'healthy', '--once'])\n"
            "print(rc, 'sidecar.views.table' in sys.modules, 'sidecar.views.report' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=60, env={k: v for k, v in os.environ.items()
                                           if not k.startswith("GPU_SIDECAR_")})
    assert proc.stdout.split() == ["0", "False", "False"], proc.stderr


def test_explicit_table_into_a_pipe_gives_plain_frames():
    proc = run_cli("run", "--simulate", "fragmented", "--once", "--output", "table")
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout
    lines = proc.stdout.splitlines()
    assert sum(1 for line in lines if ROW.match(line)) == 2
    assert all(line.rstrip().endswith("mem: frag") for line in lines if ROW.match(line))


# -- a terminal: the live table ----------------------------------------------------------------

def pty_run(*args: str, frames: int = 0, **kwargs) -> tuple[str, int]:
    return readme_table.run_in_pty(args, frames=frames, **kwargs)


def frames_drawn(out: str) -> list[list[str]]:
    """Each frame drawn on the alternate screen, as the lines a person sees; a frame the test's
    own Ctrl-C cut (the terminal echoes ``^C`` into it) is left out: the last frame, drawn after
    it, replaces it on the screen and is checked on its own."""
    start = out.index(ALT_SCREEN + HIDE_CURSOR)
    end = out.index(MAIN_SCREEN + SHOW_CURSOR, start)
    frames = [[line for line in ESCAPE.sub("", frame.split(CLEAR_BELOW)[0]).replace("\r", "")
               .split("\n") if line] for frame in out[start:end].split(HOME)[1:]]
    return [lines for lines in frames if "^C" not in lines]


VALUE = re.compile(r"^(-|\d+%|\d+(\.\d)?|\d+/\d+|-/-|\d+ms|\d+\.\ds)$")


def test_on_a_terminal_the_table_refreshes_in_place_fits_120_columns_and_ctrl_c_restores():
    out, code = pty_run("run", "--simulate", "healthy", "--simulate-gpus", "8", "--gpus", "visible",
                        "--interval", "0.3", "--log-level", "warning", frames=4)
    assert code == 0, out[-2000:]
    assert "# HELP" not in out  # the table, not the exposition
    start = out.index(ALT_SCREEN + HIDE_CURSOR)  # its own screen, cursor hidden while drawing
    end = out.index(MAIN_SCREEN + SHOW_CURSOR, start)  # given back on Ctrl-C
    # a frame the test's own Ctrl-C cut (the terminal echoes ^C into it) is not checked: the
    # last frame, drawn after it, replaces it and is checked below
    drawn = [frame for frame in out[start:end].split(HOME)[1:] if "^C" not in frame]
    assert len(drawn) >= 4
    for frame in drawn:  # each frame redraws from the top-left corner and clears what is left
        assert frame.rstrip("\r\n").endswith(CLEAR_BELOW) or CLEAR_BELOW in frame
        lines = ESCAPE.sub("", frame).replace("\r", "").split("\n")
        assert sum(1 for line in lines if line.startswith("GPU | util")) == 1
        titles = next(line for line in lines if line.startswith("GPU | util"))
        assert all(t in titles for t in ("tensor", "NVL%", "p50", "RX GB/s", "verdict"))
        assert [int(line.split("|")[0]) for line in lines if ROW.match(line)] == list(range(8))
        assert max(len(line) for line in lines) <= 120
    assert out.count(ALT_SCREEN) == 1  # one screen redrawn, not pages appended
    last = ESCAPE.sub("", out[end:]).replace("\r", "").split("\n")
    assert sum(1 for line in last if ROW.match(line)) == 8  # the last frame stays after exit
    frame = last[:last.index(next(line for line in last if line.startswith("legend: "))) + 1]
    assert max(len(line) for line in frame) <= 120  # as drawn, not cut to the terminal
    assert out.rindex(SHOW_CURSOR) > out.rindex(HIDE_CURSOR)


def test_on_a_terminal_an_explicit_format_wins_over_the_table():
    out, code = pty_run("run", "--simulate", "healthy", "--once", "--output", "prometheus",
                        "--log-level", "warning")
    assert code == 0, out[-2000:]
    assert "# HELP gpu_sm_occupancy_ratio" in out and ALT_SCREEN not in out


def test_verdict_column_names_the_layer_and_says_when_compute_cannot_be_judged():
    for scenario, verdict in (("pcie-saturated", "IO: PCIe"), ("old-driver", "ok? no GPM"),
                              ("low-occupancy", "compute: occ")):
        proc = run_cli("run", "--simulate", scenario, "--once", "--output", "table")
        assert proc.returncode == 0, proc.stderr
        rows = [line for line in proc.stdout.splitlines() if ROW.match(line)]
        assert rows and all(line.rstrip().endswith(verdict) for line in rows), proc.stdout


def test_the_nvlink_share_is_shown_as_pcie_s_per_direction_of_its_maximum():
    """On the node whose all-reduce fills NVLink, each row says how full NVLink is, RX/TX in
    percent of the active links' maximum, beside PCIe's RX% and TX%, and the verdict names it."""
    gpu = build("nvlink-saturated").gpus[0]
    proc = run_cli("run", "--simulate", "nvlink-saturated", "--once", "--output", "table")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    titles = next(line for line in lines if line.startswith("GPU |")).split("|")
    io = titles.index(next(t for t in titles if "NVL%" in t))
    assert titles[io].split() == ["RX%", "TX%", "RX", "GB/s", "TX", "GB/s", "NVL%", "NVL", "GB/s"]
    assert "NVL%: NVLink RX/TX share of its maximum" in proc.stdout
    rows = [line for line in lines if ROW.match(line)]
    assert len(rows) == len(build("nvlink-saturated").gpus)
    top = gpu.nvlink_links * gpu.nvlink_speed_mbps * 1e6
    for line in rows:
        cells = line.split("|")[io].split()
        shares = [float(v) for v in cells[4].split("/")]
        rates = [float(v) * 1e9 for v in cells[5].split("/")]
        for load, share, rate in zip((gpu.nvlink_rx, gpu.nvlink_tx), shares, rates, strict=True):
            assert abs(share / (100 * load.base / top) - 1) <= load.amplitude + 0.02, line
            assert share == pytest.approx(100 * rate / top, abs=1.5), line  # whole GB/s and %
        assert line.rsplit("|", 1)[1].strip() == "IO: NVLink"


def io_titles(stdout: str) -> list[str]:
    """The IO group's column titles of a frame's header."""
    titles = next(line for line in stdout.splitlines() if line.startswith("GPU |")).split("|")
    return titles[next(i for i, t in enumerate(titles) if "RX%" in t)].split()


def test_a_grace_hopper_node_shows_its_c2c_link_beside_pcie_and_nvlink():
    """NVLink-C2C is the host link of a GH200: the table gives its RX/TX share of the links'
    maximum and its rates, as NVLink's, and the verdict names it."""
    gpu = build("grace-hopper").gpus[0]
    proc = run_cli("run", "--simulate", "grace-hopper", "--once", "--output", "table")
    assert proc.returncode == 0, proc.stderr
    assert io_titles(proc.stdout) == ["RX%", "TX%", "RX", "GB/s", "TX", "GB/s", "NVL%", "NVL",
                                      "GB/s", "C2C%", "C2C", "GB/s"]
    assert "C2C%: C2C RX/TX share of its maximum; C2C GB/s: C2C RX/TX" in proc.stdout
    (line,) = [line for line in proc.stdout.splitlines() if ROW.match(line)]
    cells = line.split("|")[3].split()
    rx_share = float(cells[6].split("/")[0])
    total = gpu.c2c_rx.base * (1 + gpu.c2c_protocol_overhead)  # GPM's C2C TOTAL: with overhead
    top = gpu.c2c_links * gpu.c2c_link_max_mb_per_second * 1e6
    assert abs(rx_share / (100 * total / top) - 1) <= gpu.c2c_rx.amplitude + 0.02, line
    assert line.rsplit("|", 1)[1].strip() == "IO: C2C"


def test_a_node_without_nvlink_or_c2c_shows_pcie_alone():
    """An A100 PCIe card has neither NVLink nor C2C: no empty columns for them."""
    assert all(gpu.nvlink_links == 0 and not gpu.has_c2c for gpu in build("old-driver").gpus)
    proc = run_cli("run", "--simulate", "old-driver", "--once", "--output", "table")
    assert proc.returncode == 0, proc.stderr
    assert io_titles(proc.stdout) == ["RX%", "TX%", "RX", "GB/s", "TX", "GB/s"]
    assert "NVL" not in proc.stdout and "C2C" not in proc.stdout


def test_a_plain_stream_gets_frames_one_after_the_other_without_escapes():
    stream = io.StringIO()
    table = Table(stream, live=False)
    first, second = table.frame(fixed_series()), table.frame(fixed_series())
    assert "\x1b" not in first + second and table.restore() == ""
    assert first.count("GPU | util") == 1 and first.endswith("\n\n")


@pytest.mark.parametrize("cols", [80, 60])
def test_a_narrow_terminal_drops_whole_columns_and_keeps_the_verdict_and_p99(cols):
    out, code = pty_run("run", "--simulate", "pcie-saturated", "--interval", "0.3",
                        "--log-level", "warning", frames=3, cols=cols)
    assert code == 0, out[-2000:]
    for lines in frames_drawn(out):
        assert max(len(line) for line in lines) <= cols
        titles = next(line for line in lines if line.startswith("GPU |"))
        assert "p99" in titles and titles.rstrip().endswith("verdict")
        assert "NVL GB/s" not in titles  # the first to go
        bars = [i for i, c in enumerate(titles) if c == "|"]
        rows = [line for line in lines if ROW.match(line)]
        assert len(rows) == 2
        for line in rows:  # every value whole, under its column, and the verdict in full
            assert [i for i, c in enumerate(line) if c == "|"] == bars
            assert line.rsplit("|", 1)[1].strip() == "IO: PCIe"
            cells = " ".join(line.split("|")[:-1]).split()
            assert cells and all(VALUE.match(cell) for cell in cells), line
        assert any(line.startswith("legend: ") for line in lines)
    last = ESCAPE.sub("", out[out.rindex(MAIN_SCREEN):]).replace("\r", "").split("\n")
    assert all(len(line) <= cols for line in last)
    assert sum(1 for line in last if ROW.match(line) and line.endswith("IO: PCIe")) == 2


def test_a_short_terminal_says_how_many_gpus_are_not_shown_and_shows_the_lost_one_first():
    # every GPU from the first frame: announced ones arrive in parts, so a first frame may be
    # drawn before all 16 are known
    out, code = pty_run("run", "--simulate", "gpu-lost", "--simulate-gpus", "16", "--gpus",
                        "visible", "--interval", "0.5", "--log-level", "error", frames=6, rows=20)
    assert code == 0, out[-2000:]
    drawn = frames_drawn(out)
    assert len(drawn) >= 6
    for lines in drawn:
        assert len(lines) <= 19  # the last line of the terminal stays free
        rows = [line for line in lines if ROW.match(line)]
        more = [line for line in lines if line.startswith("… ")]
        assert more == [f"… {16 - len(rows)} more GPUs not shown (enlarge the terminal or use "
                        "--output prometheus)"]
        assert 10 <= len(rows) < 16
    lost = [lines for lines in drawn if any(line.endswith("LOST") for line in lines)]
    assert lost, "the GPU was lost within the run"
    for lines in lost:
        rows = [line for line in lines if ROW.match(line)]
        assert rows[0].endswith("LOST") and int(rows[0].split("|")[0]) == 2
    last = ESCAPE.sub("", out[out.rindex(MAIN_SCREEN):]).replace("\r", "").split("\n")
    assert sum(1 for line in last if ROW.match(line)) == 16  # all of them stay in the scrollback


@pytest.mark.parametrize("term", ["dumb", None])
def test_a_dumb_terminal_gets_the_exposition_and_table_gets_plain_frames(term):
    out, code = pty_run("run", "--simulate", "healthy", "--once", "--log-level", "error",
                        term=term)
    assert code == 0, out[-2000:]
    assert "# HELP gpu_sm_occupancy_ratio" in out and "\x1b" not in out
    out, code = pty_run("run", "--simulate", "healthy", "--interval", "0.3", "--output", "table",
                        "--log-level", "error", term=term, interrupt_after=2.5)
    assert code == 0, out[-2000:]
    assert "\x1b" not in out  # no alternate screen, no cursor moves
    assert out.count("GPU | util") >= 2  # frames one after the other
    assert "TERM=dumb" in run_cli("run", "--help").stdout


# -- the README shows a captured table ------------------------------------------------------------

def structure(lines: list[str]) -> list[object]:
    """What a capture must keep from run to run: the title without its clock, the header and
    legend to the letter, and per row its GPU, where the column separators fall and the verdict."""
    out: list[object] = [re.sub(r"\d\d:\d\d:\d\d$", "HH:MM:SS", lines[0])]
    for line in lines[1:]:
        if ROW.match(line):
            out.append((line.split("|")[0].strip(), [i for i, c in enumerate(line) if c == "|"],
                        line.rsplit("|", 1)[1].strip()))
        else:  # a simulated agent's private socket, named in the legend, differs each run
            out.append(re.sub(r"/\S*?gpu-sidecar-\w+/app\.sock", "PRIVATE/app.sock", line))
    return out


def test_readme_first_command_shows_the_table_captured_by_the_script():
    readme = (ROOT / "README.md").read_text()
    first = re.search(r"```sh\n(.*?)\n```", readme, re.S)
    assert first and first[1].endswith(".venv/bin/gpu-sidecar " + " ".join(readme_table.COMMAND))
    shown = readme_table.readme_block(readme)
    assert readme.index(readme_table.BEGIN) < readme.index("```sh", first.end())  # right below
    fresh = readme_table.capture()
    assert len(shown) == len(fresh) and sum(1 for line in shown if ROW.match(line)) == 2
    assert structure(shown) == structure(fresh), (
        "README.md's table is stale: run `.venv/bin/python scripts/readme_table.py`")


# -- the README's demo can be asked why from a second terminal (issue #44, item 13) ---------------


def test_the_demos_legend_names_the_command_that_asks_it_why_and_it_answers():
    """``run --simulate healthy`` on a terminal binds a private socket (two demos never collide),
    which a second terminal's plain ``diagnose`` cannot find, and its start-up line naming it is
    hidden behind the table: the legend's ``why:`` is the exact command, socket included, and a
    second process running it as printed gets the agent's own answer while the table draws."""
    import contextlib
    import fcntl
    import pty
    import select
    import signal
    import struct
    import termios
    import time

    from tests.test_simulated_agent_is_found import as_printed

    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
    env.update(PYTHONUNBUFFERED="1", TERM="xterm")
    pid, fd = pty.fork()
    if pid == 0:  # the child: the README's first command on a 120 x 40 terminal
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        os.chdir(ROOT)
        os.execve(sys.executable, [sys.executable, "-m", "sidecar",
                                   *readme_table.COMMAND, "--interval", "0.5"], env)
    out, asked = b"", None
    try:
        deadline = time.monotonic() + 60
        while asked is None and time.monotonic() < deadline:
            if select.select([fd], [], [], 0.1)[0]:
                out += os.read(fd, 65536)
            frames = out.decode(errors="replace").split(HOME)
            if len(frames) < 4:  # a few cycles in the agent's window first
                continue
            screen = [line.strip() for line in ESCAPE.sub("", frames[-2]).replace("\r", "")
                      .split("\n")]
            start = next((i for i, line in enumerate(screen) if line.startswith("legend: ")), None)
            if start is None:
                continue
            said = " ".join(screen[start:start + 4])
            found = re.search(r"why: (gpu-sidecar diagnose[^;]*?)\s*$", said.split(" GPU |")[0])
            asked = found[1] if found else None
        assert asked, ESCAPE.sub("", out.decode(errors="replace"))[-3000:]
        assert "--socket" in asked and "gpu-sidecar-" in asked, asked  # its private socket
        answer = as_printed(asked)  # a second terminal, the command as the legend says it
        assert answer.returncode == 0, answer.stdout + answer.stderr  # healthy: exit 0
        assert "window: the agent's window:" in answer.stdout, answer.stdout
        status = as_printed(asked.replace("diagnose", "status", 1))
        assert status.returncode == 0 and "simulated" in status.stdout, status.stdout
        # status on another socket finds no agent, and says where a demo's socket is named
        elsewhere = run_cli("status", "--socket", str(ROOT / "no-such-dir" / "app.sock"))
        assert elsewhere.returncode == 2 and "the `why:` of its table's legend" in " ".join(
            elsewhere.stderr.split()), elsewhere.stderr
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # drain its terminal until it is gone
            if select.select([fd], [], [], 0.1)[0]:
                try:
                    if not os.read(fd, 65536):
                        break
                except OSError:
                    break
        while time.monotonic() < deadline and not os.waitpid(pid, os.WNOHANG)[0]:
            time.sleep(0.05)
        else:
            if time.monotonic() >= deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        os.close(fd)
