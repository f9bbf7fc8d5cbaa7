from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sidecar.simulate import fake_nvml
from sidecar.simulate.fake_nvml import FakeGpu, FakeNvml, ManualClock

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def install_fake() -> Iterator[Callable[..., FakeNvml]]:
    """Install a FakeNvml at pynvml.nvmlLib for the test, and remove it afterwards."""

    def install(gpus: list[FakeGpu], **kwargs: object) -> FakeNvml:
        kwargs.setdefault("throughput_blocking", False)
        return fake_nvml.install(FakeNvml(gpus, **kwargs))  # type: ignore[arg-type]

    yield install
    fake_nvml.uninstall()


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 30,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=ROOT, input=input)


def send_datagram(path: str, data: bytes) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.sendto(data, path)
    finally:
        s.close()
