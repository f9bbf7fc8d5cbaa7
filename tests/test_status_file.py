"""The status file and the liveness probe never hurt the pod (issue #32, items 4 and 8), each
produced for real:

- a full socket volume (a real tmpfs, kept full by a neighbour) leaves a cycling agent alive for
  longer than the staleness limit, its status saying the content is stale and the volume full,
  while an agent stopped with SIGSTOP on the same kind of volume is judged dead; an agent started
  on a volume already full is alive too;
- ``gpu-sidecar status`` trusts nothing of the file it reads: a FIFO, a symbolic link to
  ``/dev/zero`` and a sparse 1 GiB file are each refused at once with what they are (exit 2, and
  1 with ``--alive``), in bounded memory; a time in the future is no proof of life.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sidecar.status_file import ALIVE_MIN_S, FILE_NAME, FUTURE_SKEW_S, MAX_BYTES
from tests.conftest import ROOT, run_cli
from tests.receivers import Agent
from tests.test_faults import kept_full
from tests.waiting import until

CLI_TIMEOUT_S = 30  # a status that blocks (a FIFO) or reads without end fails here


def status(sock: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli("status", "--socket", str(sock), *extra, timeout=CLI_TIMEOUT_S)


def agent_on(sock: Path, *extra: str) -> Agent:
    return Agent(["--simulate", "healthy", "--interval", "0.5", "--socket", str(sock), *extra])


@pytest.fixture
def small_volume(tmp_path: Path):
    """Mounts real small tmpfs volumes (``mount -t tmpfs``) on request, unmounted at the end;
    skipped, saying why, where this machine refuses the mount."""
    mounted: list[Path] = []

    def mount(name: str) -> Path:
        volume = tmp_path / name
        volume.mkdir()
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root (the CI runs as root)")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs",
                               str(volume)], capture_output=True, text=True, timeout=10)
        if done.returncode != 0:
            pytest.skip(f"this machine refuses to mount a tmpfs: {done.stderr.strip()}")
        mounted.append(volume)
        return volume

    yield mount
    for volume in mounted:
        subprocess.run(["umount", "-l", str(volume)], timeout=10)


def stopped_agents(*agents: Agent) -> None:
    for agent in agents:
        if agent.proc is None:
            continue
        with contextlib.suppress(Exception):
            agent.signal(signal.SIGCONT)  # a stopped process would not take SIGTERM
        with contextlib.suppress(Exception):
            agent.stop()
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait(timeout=10)


# -- a full socket volume (item 4) -------------------------------------------------------------


def test_a_full_socket_volume_never_fails_the_probe_of_a_cycling_agent_but_fails_a_stopped_one(
        small_volume):
    live_volume, frozen_volume, late_volume = (small_volume(n) for n in ("live", "frozen", "late"))
    live, frozen = agent_on(live_volume / "app.sock"), agent_on(frozen_volume / "app.sock")
    late = agent_on(late_volume / "app.sock", "--inject", "false")
    try:
        live.start()
        frozen.start()
        until(lambda: (live_volume / FILE_NAME).exists() and (frozen_volume / FILE_NAME).exists(),
              what="both agents' first status")
        with kept_full(live_volume), kept_full(frozen_volume), kept_full(late_volume):
            late.start()  # on a volume full from its start: not even a first status fits
            until(lambda: live.logged("status_write_failed")
                  and frozen.logged("status_write_failed") and late.logged("status_write_failed"),
                  what=lambda: "each agent saying its status cannot be written\n"
                  + "".join(live.err[-5:] + frozen.err[-5:] + late.err[-5:]))
            frozen.signal(signal.SIGSTOP)
            full_since = time.monotonic()
            cycles_then = live.cycles()
            # the kubelet's probe, every second, for longer than the staleness limit: it passes
            probes = 0
            while time.monotonic() - full_since < ALIVE_MIN_S + 5:
                for agent in (live, late):
                    probe = status(Path(agent.args[agent.args.index("--socket") + 1]), "--alive")
                    assert probe.returncode == 0, (probe.stderr, "".join(agent.err)[-2000:])
                probes += 1
                time.sleep(1)
            assert probes >= ALIVE_MIN_S / 3, "too few probes to tell"
            written_at = json.loads((live_volume / FILE_NAME).read_text())["written_at"]
            assert time.time() - written_at > ALIVE_MIN_S, \
                "the content was rewritten: the volume was not full"
            assert live.more_cycles(2) > cycles_then + ALIVE_MIN_S  # cycles went on (0.5 s each)

            dead = status(frozen_volume / "app.sock", "--alive")
            assert dead.returncode == 1, dead.stderr
            assert re.search(rf"the agent \(pid {frozen.proc.pid}\) has written no status for "
                             r"\d+ s \(more than 30 s\): its cycles have stopped", dead.stderr)

            report = status(live_volume / "app.sock")
            assert report.returncode == 0, report.stderr
            first = report.stdout.splitlines()[0]
            assert re.search(r"the content below is \d+ s older than the agent's last heartbeat: "
                             rf"it could not be rewritten since \(the volume of {live_volume} is "
                             r"full \(\d+ bytes free\)\)", first), first
            assert "STALE" not in first
            fresh = status(late_volume / "app.sock")
            assert fresh.returncode == 0 and re.search(
                r"the agent beat \d+ s ago but could not write any status yet: the volume of "
                rf"{late_volume} is full", fresh.stderr), fresh.stderr
        # room again: the status is whole and current, and each episode was said once
        until(lambda: live.logged("status_write_recovered"), what="the status written again")
        assert "older than the agent's last heartbeat" not in status(live_volume / "app.sock").stdout
        assert len(live.logged("status_write_failed")) == 1
        said = live.logged("status_write_failed")[0]
        assert said["error"] == "No space left on device" and "liveness probe still passes" in \
            said["effect"], said
    finally:
        stopped_agents(live, frozen, late)


# -- the heartbeat never follows a symbolic link (issue #44) -----------------------------------


def _victim(tmp_path: Path) -> tuple[Path, float]:
    """A file outside the socket's volume, with an old time, that a link planted at the status's
    path points at: what another container would have the agent touch."""
    victim = tmp_path / "outside" / "victim"
    victim.parent.mkdir()
    victim.write_text("not the agent's")
    old = time.time() - 86400
    os.utime(victim, (old, old))
    return victim, old


def test_the_heartbeat_sets_a_planted_links_own_time_never_its_targets(tmp_path):
    from sidecar.status_file import _beat

    victim, old = _victim(tmp_path)
    link = tmp_path / FILE_NAME
    link.symlink_to(victim)
    before = time.time()
    assert _beat(link)
    assert os.lstat(link).st_mtime >= before - 1  # the link's own time beat
    assert victim.stat().st_mtime == old and victim.read_text() == "not the agent's"
    # a link to nothing: the beat makes nothing where it points
    link.unlink()
    link.symlink_to(tmp_path / "outside" / "made")
    _beat(link)
    assert not (tmp_path / "outside" / "made").exists()


def test_an_agent_on_a_full_volume_beats_on_a_planted_link_without_touching_its_target(
        small_volume, tmp_path):
    """A real agent whose status cannot be rewritten (a full tmpfs) keeps its heartbeat with
    ``utime``; a symbolic link planted at the status's path then has its own time set, never
    its target's, and the status and --alive refuse it as a link."""
    from sidecar.status_file import WRITE_EVERY_S

    volume = small_volume("vol")
    victim, old = _victim(tmp_path)
    agent = agent_on(volume / "app.sock", "--inject", "false")
    path = volume / FILE_NAME
    try:
        agent.start()
        until(lambda: path.exists(), what="the agent's first status")
        with kept_full(volume):
            until(lambda: agent.logged("status_write_failed"),
                  what="the agent saying its status cannot be written")
            path.unlink()
            path.symlink_to(victim)
            planted_at = os.lstat(path).st_mtime
            until(lambda: os.lstat(path).st_mtime > planted_at, timeout=3 * WRITE_EVERY_S + 30,
                  what="the agent's heartbeat on the planted link")
            assert path.is_symlink()
            assert victim.stat().st_mtime == old, "the heartbeat followed the link"
            assert victim.read_text() == "not the agent's"
            alive = status(volume / "app.sock", "--alive")
            assert alive.returncode == 1 and "is a symbolic link" in alive.stderr, alive.stderr
        # room again: the next status replaces the link itself (one rename), the target as it was
        until(lambda: not path.is_symlink() and path.is_file(), timeout=3 * WRITE_EVERY_S + 30,
              what="the status written over the link")
        assert victim.stat().st_mtime == old and victim.read_text() == "not the agent's"
    finally:
        stopped_agents(agent)


# -- a status file planted in the shared volume (item 8) ---------------------------------------


@pytest.fixture(scope="module")
def written_status(tmp_path_factory) -> dict:
    """A status as a real agent writes it."""
    sock = tmp_path_factory.mktemp("real") / "app.sock"
    agent = agent_on(sock).start()
    try:
        path = sock.parent / FILE_NAME
        until(lambda: path.exists(), what="the agent's first status")
        return json.loads(path.read_text())
    finally:
        stopped_agents(agent)


def planted(tmp_path: Path, data: dict, *, mtime: float | None = None) -> Path:
    sock = tmp_path / "app.sock"
    path = sock.parent / FILE_NAME
    path.write_text(json.dumps(data))
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return sock


# a small parent between the test and the CLI: a child forked from pytest itself starts with
# pytest's resident pages counted in its peak (hundreds of MiB late in a full run)
_MEASURE = """
import os, subprocess, sys
child = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
_, status, usage = os.wait4(child.pid, 0)
print(usage.ru_maxrss * 1024)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_measured(*args: str) -> tuple[int, str, int]:
    """The CLI as a child of a small parent of its own: exit code, stderr and its peak RSS in
    bytes, killed (with that parent) after CLI_TIMEOUT_S."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
    proc = subprocess.Popen([sys.executable, "-c", _MEASURE, sys.executable, "-m", "sidecar",
                             *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=CLI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"{args} still runs after {CLI_TIMEOUT_S} s") from None
    return proc.returncode, err, int(out.strip().splitlines()[-1])


def test_a_fifo_in_place_of_the_status_is_refused_at_once_and_never_blocks(tmp_path):
    sock = tmp_path / "app.sock"
    os.mkfifo(sock.parent / FILE_NAME)
    started = time.monotonic()
    got = status(sock)
    assert got.returncode == 2, got.stderr
    assert f"{sock.parent / FILE_NAME} is a FIFO, not the regular file the agent writes; " \
           "remove it" in got.stderr
    alive = status(sock, "--alive")
    assert alive.returncode == 1 and "is a FIFO" in alive.stderr
    assert time.monotonic() - started < CLI_TIMEOUT_S


def test_a_symbolic_link_to_dev_zero_is_refused_without_reading_it(tmp_path):
    sock = tmp_path / "app.sock"
    (sock.parent / FILE_NAME).symlink_to("/dev/zero")
    code, err, rss = run_measured("status", "--socket", str(sock))
    assert code == 2, err
    assert f"{sock.parent / FILE_NAME} is a symbolic link: the agent writes a regular file " \
           "there" in err
    assert rss < 16 * MAX_BYTES + (100 << 20), f"peak RSS {rss >> 20} MiB"
    alive = status(sock, "--alive")
    assert alive.returncode == 1 and "is a symbolic link" in alive.stderr


def test_a_sparse_1_gib_status_is_refused_for_its_size_in_bounded_memory(tmp_path):
    sock = tmp_path / "app.sock"
    path = sock.parent / FILE_NAME
    with open(path, "wb") as f:
        f.truncate(1 << 30)
    code, err, rss = run_measured("status", "--socket", str(sock))
    assert code == 2, err
    assert f"{path} holds {1 << 30} bytes, more than the {MAX_BYTES} a status can take: it is " \
           "not the agent's; remove it" in err
    assert rss < (1 << 30) // 8, f"peak RSS {rss >> 20} MiB for a 1 GiB file"
    code, err, _ = run_measured("status", "--socket", str(sock), "--alive")
    assert code == 1 and "more than the" in err


def test_a_status_at_the_bound_is_read_and_one_byte_more_is_refused(tmp_path, written_status):
    sock = tmp_path / "app.sock"
    path = sock.parent / FILE_NAME
    text = json.dumps({**written_status, "written_at": time.time()})
    padded = text[:-1] + " " * (MAX_BYTES - len(text)) + "}"
    path.write_text(padded)
    assert path.stat().st_size == MAX_BYTES
    assert status(sock, "--alive").returncode == 0
    path.write_text(padded + " ")
    got = status(sock, "--alive")
    assert got.returncode == 1 and f"holds {MAX_BYTES + 1} bytes" in got.stderr


@pytest.mark.parametrize("where", ["written_at", "mtime"])
def test_a_time_in_the_future_is_no_proof_of_life(tmp_path, written_status, where):
    now = time.time()
    future = now + 3600
    sock = planted(tmp_path, {**written_status, "written_at": future if where == "written_at"
                              else now}, mtime=future if where == "mtime" else now)
    alive = status(sock, "--alive")
    assert alive.returncode == 1, alive.stderr
    what = "its written_at" if where == "written_at" else "the file's modification time"
    assert re.search(rf"{what} lies 360\d s in the future: the agent \(pid "
                     rf"{written_status['pid']}\) never writes one, so it proves no cycle; judged "
                     r"not alive", alive.stderr), alive.stderr
    report = status(sock)
    assert report.returncode == 1 and "(NOT ALIVE: " in report.stdout.splitlines()[0]


def test_a_time_ahead_within_the_skew_is_alive_and_one_beyond_it_is_not(tmp_path,
                                                                           written_status):
    ahead = FUTURE_SKEW_S / 2
    sock = planted(tmp_path, {**written_status, "written_at": time.time() + ahead})
    assert status(sock, "--alive").returncode == 0
    sock = planted(tmp_path, {**written_status, "written_at": time.time() + 2 * FUTURE_SKEW_S})
    assert status(sock, "--alive").returncode == 1


def test_a_current_status_is_alive_and_printed(tmp_path, written_status):
    sock = planted(tmp_path, {**written_status, "written_at": time.time()})
    assert status(sock, "--alive").returncode == 0
    report = status(sock)
    assert report.returncode == 0 and f"(pid {written_status['pid']}, simulated)" in report.stdout


@pytest.mark.parametrize("content", ["[1, 2]", '{"pid": 1}', '{"written_at": "now"}', "not json",
                                     '{"written_at": 1.0, "sinks": 3}'])
def test_a_file_that_is_not_a_status_is_said_so(tmp_path, content):
    sock = tmp_path / "app.sock"
    (sock.parent / FILE_NAME).write_text(content)
    got = status(sock)
    assert got.returncode == 2 and "Traceback" not in got.stderr, got.stderr
    assert f"{sock.parent / FILE_NAME} is not the agent's status (" in got.stderr
    # --alive judges the heartbeat (the file's time) once the file has a status's written_at
    alive = status(sock, "--alive")
    assert alive.returncode == (0 if '"written_at": 1.0' in content else 1), alive.stderr


# -- the agent's time in NVML (issue #47, item 1) ----------------------------------------------


def _per_cycle(rows: list, name: str) -> dict[int, dict[str, float]]:
    """Per printed cycle (its timestamp), a per-call series' value by call."""
    out: dict[int, dict[str, float]] = {}
    for n, labels, ts, value in rows:
        if n == name and value == value:  # a staleness marker (NaN) is no figure
            out.setdefault(ts, {})[dict(labels)["call"]] = value
    return out


def test_status_shows_the_nvml_time_the_agent_exports(tmp_path):
    """status names the last cycle's NVML time, in all and per GPU, its costliest calls and the
    costliest since the start; each agrees with the series the agent exported for that cycle."""
    sock = tmp_path / "app.sock"
    agent = agent_on(sock).start()
    try:
        agent.more_cycles(6, "before its status is read")
        assert agent.stop() == 0
    finally:
        stopped_agents(agent)
    data = json.loads((sock.parent / FILE_NAME).read_text())  # written at the stop
    nvml = data["nvml"]
    seconds = _per_cycle(agent.recorded(), "gpu_sidecar_nvml_call_seconds_total")
    calls = _per_cycle(agent.recorded(), "gpu_sidecar_nvml_calls_total")
    last, before = sorted(seconds)[-1], sorted(seconds)[-2]
    # since the start: what the last cycle exported, call by call
    assert len(nvml["total_costliest"]) == 5
    for name, spent, n in nvml["total_costliest"]:
        assert n == calls[last][name] and spent == pytest.approx(seconds[last][name], rel=0.01)
    assert nvml["total_calls"] == sum(calls[last].values())
    # the last cycle: the exported totals' growth over it
    grown = {c: calls[last][c] - calls[before].get(c, 0) for c in calls[last]}
    assert nvml["cycle_calls"] == sum(grown.values()) > 0
    assert nvml["cycle_seconds"] == pytest.approx(
        sum(seconds[last].values()) - sum(seconds[before].values()), rel=0.01)
    assert [row[0] for row in nvml["cycle_costliest"]] == sorted(
        (c for c in grown if grown[c]), key=lambda c: -(seconds[last][c]
                                                        - seconds[before].get(c, 0)))[:5]
    # per GPU: each simulated GPU's reading, together at most the cycle's
    assert len(nvml["gpus"]) == 2 and all(g["calls"] > 0 for g in nvml["gpus"])
    assert sum(g["seconds"] for g in nvml["gpus"]) <= nvml["cycle_seconds"] * 1.0001
    got = status(sock)
    assert got.returncode == 0, got.stderr
    said = re.search(r"^NVML time in the last cycle: ([0-9.]+) ms in (\d+) calls; per GPU: "
                     r"GPU 0 [0-9.]+ ms \(\d+ calls\), GPU 1 [0-9.]+ ms \(\d+ calls\)$",
                     got.stdout, re.M)
    assert said, got.stdout
    assert float(said[1]) == pytest.approx(nvml["cycle_seconds"] * 1e3, abs=0.001)
    assert int(said[2]) == nvml["cycle_calls"]
    top, spent, n = nvml["total_costliest"][0]
    assert f"since the start: {sum(seconds[last].values()) * 1e3:.3f}"[:-1] in got.stdout
    assert f"costliest: {top} {spent * 1e3:.3f} ms x{n}," in got.stdout


@pytest.mark.parametrize("nvml", [
    3, {"gpus": "all"}, {"gpus": [], "cycle_seconds": "1"},
    {"gpus": [], "cycle_seconds": float("inf"), "cycle_calls": 1},
    {"gpus": [{"index": "0\x1b[2J", "seconds": 1, "calls": 1}]},
    {"gpus": [], "cycle_seconds": 0.1, "cycle_calls": 1,
     "cycle_costliest": [["\x1b]0;owned\x07", 0.1, 1]]},
    {"gpus": [], "cycle_seconds": 0.1, "cycle_calls": 1,
     "cycle_costliest": [["nvmlInit", 0.1, 1]] * 6}])
def test_nvml_figures_that_are_not_the_agents_are_said_so(tmp_path, written_status, nvml):
    sock = planted(tmp_path, {**written_status, "written_at": time.time(), "nvml": nvml})
    got = status(sock)
    assert got.returncode == 2 and "Traceback" not in got.stderr, got.stderr
    assert "is not the agent's status (ValueError: nvml " in got.stderr
    assert "\x1b" not in got.stdout + got.stderr  # a planted escape is quoted, never printed
