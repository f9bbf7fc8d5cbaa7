"""Every simulated scenario is a GPU that could exist: the allocator cache its simulated model
server reports on a GPU fits within the device memory that GPU reports in use (the cache is
device memory; the `fragmented` scenario once showed a 120 GiB cache on a GPU using 70.8 GiB),
and the device memory in use within the GPU's total. Checked on the scenarios' declarations
and, for `fragmented`, on what `diagnose --simulate` prints."""

from __future__ import annotations

import re

import pytest

from sidecar.simulate import scenarios
from tests.conftest import run_cli

GIB = 1 << 30


@pytest.mark.parametrize("name", scenarios.SCENARIOS)
def test_each_scenarios_allocator_cache_fits_in_the_memory_its_gpus_use(name):
    scenario = scenarios.build(name)
    for gpu in scenario.gpus:
        used = gpu.memory_used
        lowest, highest = used.base * (1 - abs(used.amplitude)), used.base * (1 + abs(used.amplitude))
        assert scenario.app.reserved_bytes <= lowest, (name, gpu.uuid)
        assert highest <= gpu.memory_total, (name, gpu.uuid)


def test_fragmented_prints_a_cache_within_the_device_memory_in_use(tmp_path):
    proc = run_cli("diagnose", "--simulate", "fragmented", "--duration", "2", "--interval", "0.5",
                   "--socket", str(tmp_path / "app.sock"), timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = re.findall(r"device ([\d.]+) GiB of [\d.]+ GiB, .*fragmentation [\d.]+ % of "
                       r"([\d.]+) GiB", proc.stdout)
    assert len(lines) == scenarios.DEFAULT_GPUS["fragmented"], proc.stdout
    for used, cache in lines:
        assert float(cache) <= float(used), proc.stdout
    assert {v for v in re.findall(r"verdict: (\S+)", proc.stdout)} == {"fragmentation"}
