"""The quick start works as given (issue #35, "the newcomer's first hour"): its three steps apply
no image that cannot be pulled. The example workloads run a stand-in app from the agent's own
image (the one step 1 pushes and step 2 names), and that stand-in really announces its GPUs and
publishes request latency over the app socket."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sidecar import protocol
from tests.conftest import ROOT
from tests.test_deploy import K8S, copy_of_k8s, edited, render, workloads

AGENT_IMAGE = "ghcr.io/gpu-sidecar/gpu-sidecar"


def images(docs: list[dict]) -> list[str]:
    return [c["image"] for d in workloads(docs)
            for c in [*d["spec"]["template"]["spec"].get("initContainers", []),
                      *d["spec"]["template"]["spec"]["containers"]]]


def test_the_quick_start_applies_only_the_image_its_step_two_names(tmp_path):
    copy = copy_of_k8s(tmp_path)
    edited(copy / "overlays/quickstart/kustomization.yaml",
           f"newName: {AGENT_IMAGE}", "newName: registry.example.net/gs")
    found = images(render(copy / "overlays/quickstart"))
    assert found and set(found) == {"registry.example.net/gs:0.1.0"}, found


@pytest.mark.parametrize("kind", ["Deployment", "Job"])
def test_the_example_stand_in_announces_its_gpu_and_publishes_latency(tmp_path, kind):
    """The stand-in's own script, run for real: NVML is the simulated one (installed before the
    script runs), the socket a real datagram socket where the sidecar would bind it."""
    doc = next(d for d in workloads(render(K8S / "base")) if d["kind"] == kind)
    app = doc["spec"]["template"]["spec"]["containers"][0]
    assert app["command"] == ["python", "-c"]
    script = app["args"][0]
    prelude = ("from sidecar.simulate import fake_nvml\n"
               "from sidecar.simulate.scenarios import build\n"
               "fake_nvml.install(build('healthy').nvml())\n")
    path = tmp_path / "app.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(0.5)
        env = {**os.environ, protocol.SOCKET_ENV: str(path)}
        proc = subprocess.Popen([sys.executable, "-c", prelude + script], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            messages, deadline = [], time.monotonic() + 30
            while time.monotonic() < deadline and not any(
                    isinstance(m, protocol.Latency) for m in messages):
                assert proc.poll() is None, proc.communicate()[1][-2000:]
                try:
                    messages.extend(_decoded(sock.recv(65536)))
                except TimeoutError:
                    continue
        finally:
            proc.kill()
            proc.wait(timeout=10)
    from sidecar.simulate.scenarios import build

    uuids = {g.uuid for g in build("healthy").gpus}
    announced = {g for m in messages if isinstance(m, protocol.Hello | protocol.Round)
                 for g in m.gpus}
    assert announced == uuids, messages[:3]
    latency = [m for m in messages if isinstance(m, protocol.Latency)]
    assert latency and latency[0].gpu in uuids and sum(latency[0].counts) > 0


def _decoded(data: bytes) -> list[object]:
    """A datagram's messages, a Round's latency histograms among them."""
    message = protocol.decode(data)
    return [message, *message.latency] if isinstance(message, protocol.Round) else [message]


def test_the_readme_says_what_the_example_app_is():
    text = (ROOT / "README.md").read_text()
    assert "stand-in" in text and "ghcr.io/example" not in text
    assert not list(Path(K8S / "base").glob("*example*"))
