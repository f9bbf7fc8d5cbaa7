"""What the agent may touch (docs/reliability.md): a real agent with every part on (the app
socket and its simulated app, the injected publisher, the status file, the diagnose socket, a
spool for a real receiver, a batch Job's checkpoint), asked by ``status`` and ``diagnose`` beside
it, then stopped. Every path that appeared under the test's root while it ran (watched all along,
so short-lived files count too) must be one the list names; its home, working directory and
temporary directory stay empty."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

from tests.conftest import ROOT
from tests.receivers import VictoriaMetrics, running
from tests.waiting import until

_HEX = r"[0-9a-f]+"
ALLOWED = [re.compile(p) for p in (
    r"run",
    r"run/(app|diagnose)\.sock",
    r"run/status\.json", r"run/\.status\.json\.[^/]+\.tmp",
    r"run/python", r"run/python/\.\.gpu-sidecar", r"run/python/\.\.data",
    r"run/python/\.\.data-tmp-[^/]+",
    r"run/python/(sitecustomize|_gpu_sidecar_inject|_gpu_sidecar_shared)\.py",
    r"run/python/__pycache__",
    rf"run/python/\.\.(tmp-{_HEX}|[0-9][^/]*-{_HEX})(/.*)?",
    r"spool", r"spool/run-summary\.json(\.tmp)?",
    r"spool/(remote_write|otlp)_[^/]+",
    r"spool/(remote_write|otlp)_[^/]+/(\d{20}\.(batch|tmp)|\d+\.journal|\.lock|\.memory-ledger"
    r"|\.url-confirmed|\.write-test|rejected|corrupt)",
    r"spool/(remote_write|otlp)_[^/]+/(rejected|corrupt)/\d{20}\.batch",
    r"(home|cwd|tmp)",
)]


def _walk(root: Path) -> set[str]:
    found = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            found.add(os.path.relpath(os.path.join(dirpath, name), root))
    return found


def test_the_agent_touches_only_the_paths_the_docs_list(tmp_path):
    root = tmp_path / "root"
    for d in ("home", "cwd", "tmp"):
        (root / d).mkdir(parents=True)
    vm = VictoriaMetrics(tmp_path).start()
    seen: set[str] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.update(_walk(root))
            stop.wait(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(root / "home"),
           "TMPDIR": str(root / "tmp"), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
           "GPU_SIDECAR_SOCKET": str(root / "run" / "app.sock"),
           "GPU_SIDECAR_SPOOL_DIR": str(root / "spool"), "GPU_SIDECAR_SIMULATE": "healthy",
           "GPU_SIDECAR_INTERVAL": "0.5"}
    with running(vm):
        agent = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "run", "--remote-write-url", vm.write_url,
             "--push-interval", "1", "--batch-job", "nightly", "--log-format", "json"],
            cwd=root / "cwd", env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True)
        try:
            until(lambda: "run/diagnose.sock" in seen and "run/status.json" in seen
                  and any(p.endswith(".batch") or p.endswith(".journal") for p in seen),
                  what=lambda: f"the agent's parts running; seen {sorted(seen)}")
            for command in (["status"], ["diagnose", "--duration", "5"]):
                done = subprocess.run([sys.executable, "-m", "sidecar", *command], env=env,
                                      cwd=root / "cwd", capture_output=True, text=True,
                                      timeout=60)
                assert done.returncode in (0, 1), done.stdout + done.stderr
        finally:
            agent.terminate()
            _, err = agent.communicate(timeout=30)
            stop.set()
            watcher.join(timeout=5)
    assert agent.returncode == 0, err[-2000:]
    seen.update(_walk(root))
    outside = sorted(p for p in seen if not any(a.fullmatch(p) for a in ALLOWED))
    assert outside == [], "paths the docs do not list"
    for d in ("home", "cwd", "tmp"):
        assert list((root / d).iterdir()) == [], d
    # what stays after a clean stop: no socket of the agent's, the status file, its publisher
    left = _walk(root / "run")
    assert "app.sock" not in left and "diagnose.sock" not in left and "status.json" in left
