"""The app side installs alone: ``client/`` builds the distribution gpu-sidecar-client, which
holds sidecar/__init__.py, client.py, protocol.py and app_shared.py (the agent's own files) and
depends on nothing. Installed into a fresh venv, ``from sidecar import client`` works there without any of
the agent's dependencies, and what it publishes reaches a real agent's output."""

from __future__ import annotations

import ast
import base64
import hashlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest

from sidecar.simulate.scenarios import simulated_uuid
from tests.conftest import ROOT
from tests.waiting import until

CLIENT_DIR = ROOT / "client"
CLIENT_FILES = ("sidecar/__init__.py", "sidecar/client.py", "sidecar/protocol.py",
                "sidecar/app_shared.py")
# what ``python -m venv`` puts into a venv by itself (setuptools up to Python 3.11)
VENV_OWN = {"pip", "setuptools", "wheel"}


def _backend():
    """client/backend.py, the PEP 517 backend of client/pyproject.toml, under a name of its own."""
    spec = importlib.util.spec_from_file_location("gpu_sidecar_client_backend",
                                                  CLIENT_DIR / "backend.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function, relative ones resolved
    within ``sidecar``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "sidecar" + (f".{node.module}" if node.module else "") if node.level else \
                node.module or ""
            found.update(f"{base}.{a.name}" if base == "sidecar" else base for a in node.names)
    return found


def _agent_dependencies() -> set[str]:
    block = re.search(r"^dependencies = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(),
                      re.MULTILINE | re.DOTALL)
    assert block is not None
    return {_normal(re.match(r"[A-Za-z0-9._-]+", d).group())  # type: ignore[union-attr]
            for d in re.findall(r'"([^"]+)"', block.group(1))}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.parametrize("path", CLIENT_FILES)
def test_the_client_files_import_only_the_standard_library_and_each_other(path):
    allowed = {"sidecar", "sidecar.client", "sidecar.protocol", "sidecar.app_shared"}
    outside = {m for m in _imports(ROOT / path)
               if m not in allowed and m.partition(".")[0] not in sys.stdlib_module_names}
    assert outside == set(), f"{path} imports {sorted(outside)}: the client must install alone"
    if path != "sidecar/client.py":  # __init__, protocol, app_shared: not even each other
        assert not {m for m in _imports(ROOT / path) if m.startswith("sidecar")}


def test_protocol_is_importable_alone(tmp_path):
    """protocol.py alone in a directory, with nothing else importable (-I -S: no cwd, no
    site-packages): it needs only the standard library."""
    (tmp_path / "protocol.py").write_bytes((ROOT / "sidecar" / "protocol.py").read_bytes())
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import protocol as m\n"
            "assert m.decode(m.encode(m.Hello(1, ('GPU-0123abcd',)))) == m.Hello(1, ('GPU-0123abcd',))\n"
            "print(sorted(n for n in sys.modules if n.partition('.')[0] not in sys.stdlib_module_names))")
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['__main__', 'protocol']"


def test_the_wheel_holds_the_four_files_as_they_are_and_no_dependency(tmp_path):
    backend = _backend()
    name = backend.build_wheel(str(tmp_path))
    with zipfile.ZipFile(tmp_path / name) as whl:
        names = whl.namelist()
        info = next(n.partition("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        assert sorted(names) == sorted([*CLIENT_FILES, f"{info}/METADATA", f"{info}/WHEEL",
                                        f"{info}/RECORD"])
        for f in CLIENT_FILES:
            assert whl.read(f) == (ROOT / f).read_bytes()
        metadata = whl.read(f"{info}/METADATA").decode()
        record = whl.read(f"{info}/RECORD").decode().splitlines()
        for line in record:
            path, digest, size = line.rsplit(",", 2)
            if path.endswith("/RECORD"):
                assert digest == size == ""
                continue
            data = whl.read(path)
            assert digest == "sha256=" + base64.urlsafe_b64encode(
                hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert int(size) == len(data)
        assert len(record) == len(names)
    from sidecar import __version__
    assert name == f"gpu_sidecar_client-{__version__}-py3-none-any.whl"
    assert "Name: gpu-sidecar-client\n" in metadata and f"Version: {__version__}\n" in metadata
    assert "Requires-Dist" not in metadata


def test_the_sdist_builds_the_same_wheel(tmp_path):
    """pip builds the sdist's wheel outside the repository, where ../sidecar is not there."""
    backend = _backend()
    sdist = tmp_path / backend.build_sdist(str(tmp_path))
    with tarfile.open(sdist) as tar:
        assert sorted(m.name.partition("/")[2] for m in tar.getmembers()) == sorted(
            ["PKG-INFO", "pyproject.toml", "backend.py", *CLIENT_FILES])
    (tmp_path / "a").mkdir()
    from_tree = tmp_path / "a" / backend.build_wheel(str(tmp_path / "a"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-index", "--no-deps", "-q",
                           "-w", str(tmp_path / "b"), str(sdist)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "b" / from_tree.name).read_bytes() == from_tree.read_bytes()


CLIENT = """
import sys, threading, time
before = set(sys.modules)
from sidecar import client
loaded = sorted(m for m in set(sys.modules) - before
                if m.partition(".")[0] not in sys.stdlib_module_names | {"sidecar"})
gpu, sock = sys.argv[1], sys.argv[2]
pub = client.start(sock, gpus=[gpu], use_torch=False, interval_s=0.2)
for latency in (0.004, 0.03, 0.08, 0.12, 0.26, 0.9, 3.0, 12.0, 0.05):
    client.observe(latency)
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
deadline = time.monotonic() + 120
while not done.is_set() and time.monotonic() < deadline:  # until the test closes stdin
    pub.send_allocator(gpu, reserved_bytes=64 << 30, allocated_bytes=22 << 30, alloc_retries=4)
    done.wait(0.2)  # the app's own period
client.stop()
print(client.__file__, pub.sent, pub.dropped, ",".join(loaded) or "-")
"""

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\} (\S+)')


def _venv_run(venv: Path, *args: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("GPU_SIDECAR_")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return subprocess.run([str(venv / "bin" / "python"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=venv.parent, **kwargs)


def test_the_client_installs_into_a_fresh_venv_alone_and_publishes_to_a_real_agent(tmp_path):
    venv = tmp_path / "app-venv"
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    # --no-index: the build (client/backend.py) and the install need nothing from any index
    installed = _venv_run(venv, "-m", "pip", "install", "--no-index", "-q", str(CLIENT_DIR))
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert not (CLIENT_DIR / "build").exists() and not list(CLIENT_DIR.glob("*.egg-info"))

    listed = _venv_run(venv, "-m", "pip", "list", "--format=json")
    assert listed.returncode == 0, listed.stderr
    names = {_normal(p["name"]) for p in json.loads(listed.stdout)}
    assert names & _agent_dependencies() == set()
    assert names - VENV_OWN == {"gpu-sidecar-client"}
    files = _venv_run(venv, "-c", "from importlib.metadata import files; "
                      "print('\\n'.join(sorted(str(f) for f in files('gpu-sidecar-client') "
                      "if not f.name.endswith('.pyc') and '.dist-info' not in str(f))))")
    assert files.stdout.split() == sorted(CLIENT_FILES), files.stderr
    for module in ("structlog", "pynvml", "sidecar.config"):
        absent = _venv_run(venv, "-c", f"import {module}")
        assert absent.returncode != 0 and "ModuleNotFoundError" in absent.stderr, module

    gpu = simulated_uuid("healthy", 1)
    sock = tmp_path / "run" / "app.sock"
    lines: list[str] = []
    log = (tmp_path / "agent.log").open("w")  # a file: a full stderr pipe would stall the agent
    agent = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "run", "--simulate", "healthy", "--no-simulated-app",
         "--gpus", "announced", "--socket", str(sock), "--interval", "0.2",
         "--output", "prometheus"],
        stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")},
             "PYTHONUNBUFFERED": "1"})
    log.close()
    reader = threading.Thread(target=lambda: lines.extend(agent.stdout), daemon=True)
    reader.start()
    app = None
    try:
        until(lambda: sock.exists() or agent.poll() is not None, what="the agent's socket")
        assert agent.poll() is None, (tmp_path / "agent.log").read_text()
        app = subprocess.Popen([str(venv / "bin" / "python"), "-c", CLIENT, gpu, str(sock)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                               env={k: v for k, v in os.environ.items()
                                    if k not in ("PYTHONPATH", "VIRTUAL_ENV")})

        def exported() -> dict[str, float]:
            seen: dict[str, float] = {}
            for line in list(lines):
                m = SAMPLE.match(line)
                if m and f'gpu_uuid="{gpu}"' in m.group(2):
                    seen[m.group(1)] = float(m.group(3))
            want = {"gpu_allocator_reserved_bytes": float(64 << 30), "gpu_app_processes": 1.0,
                    "inference_request_duration_seconds_count": 9.0}
            return seen if all(seen.get(k) == v for k, v in want.items()) else {}

        seen = until(exported, interval=0.1, what=lambda: "the app's figures in the agent's "
                     f"output (app alive: {app.poll() is None}; last lines: {lines[-3:]})")
        assert seen["gpu_allocator_allocated_bytes"] == 22 << 30
        assert seen["gpu_allocator_alloc_retries_total"] == 4
        out, err = app.communicate("", timeout=60)  # stdin closed: the app stops
        assert app.returncode == 0, err
        path, sent, _dropped, loaded = out.split()
        assert Path(path).is_relative_to(venv)  # the installed client, not the repository's
        assert int(sent) > 0
        assert loaded == "-"  # importing the client loaded nothing outside the standard library
        assert err == ""  # it prints nothing
    finally:
        if app is not None and app.poll() is None:
            app.kill()
            app.communicate()
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
        reader.join(timeout=10)
        agent.stdout.close()
    assert agent.returncode == 0, (tmp_path / "agent.log").read_text()
    assert not sock.exists()
