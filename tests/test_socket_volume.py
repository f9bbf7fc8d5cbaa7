"""The app socket's volume refuses: the agent stops with exit 4 and one message that names the
path and the fix, never a traceback, and leaves nothing behind (docs/configuration.md, exit
codes). Real refusals: a read-only tmpfs, and a directory this process may not write (root
without CAP_DAC_OVERRIDE, through util-linux's setpriv)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.mounts import tmpfs


def _refused_start(socket_dir: Path, *prefix: str) -> tuple[int, list[dict], str]:
    args = [*prefix, sys.executable, "-m", "sidecar", "run", "--simulate", "healthy", "--once",
            "--log-format", "json", "--socket", str(socket_dir / "app.sock")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env,
                          cwd=Path(__file__).resolve().parent.parent)
    events = [json.loads(line) for line in done.stdout.splitlines() + done.stderr.splitlines()
              if line.startswith("{")]
    return done.returncode, events, done.stderr


def _assert_one_clear_refusal(code: int, events: list[dict], stderr: str, path: Path) -> None:
    assert code == 4, stderr
    assert "Traceback" not in stderr
    refusals = [e for e in events if e["event"] == "app_socket_unavailable"]
    assert len(refusals) == 1, events
    assert str(path) in refusals[0]["error"] and "writable" in refusals[0]["error"]


def test_a_read_only_socket_volume_stops_the_agent_with_exit_4_and_one_message(tmp_path):
    with tmpfs(tmp_path / "ro", read_only=True) as volume:
        code, events, stderr = _refused_start(volume)
        _assert_one_clear_refusal(code, events, stderr, volume / "app.sock")
        assert "Read-only file system" in stderr
        assert list(volume.iterdir()) == []


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="util-linux's setpriv is absent")
def test_a_socket_directory_this_user_may_not_write_stops_the_agent_with_exit_4(tmp_path):
    if os.getuid() != 0:
        pytest.skip("the test makes the refusal as root without CAP_DAC_OVERRIDE")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 1000, 1000)  # another user's directory, not writable by group or others
    code, events, stderr = _refused_start(
        theirs, "setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner,-chown")
    _assert_one_clear_refusal(code, events, stderr, theirs / "app.sock")
    assert "Permission denied" in stderr
    assert list(theirs.iterdir()) == []


def test_a_socket_path_held_by_a_file_is_refused_with_exit_4_and_the_file_kept(tmp_path):
    placed = tmp_path / "app.sock"
    placed.write_text("not ours")
    done = run_cli("run", "--simulate", "healthy", "--once", "--log-format", "json",
                   "--socket", str(placed), "--inject", "false", timeout=60)
    assert done.returncode == 4, done.stderr
    assert "is not a socket" in done.stderr and "Traceback" not in done.stderr
    assert placed.read_text() == "not ours"
