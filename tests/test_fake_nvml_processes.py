"""The NVML stand-in's process calls, through pynvml's public functions only: the compute and
MPS running-process lists (pynvml's size query, then the filled array), per-process utilization
samples since a timestamp (NOT_FOUND when none is newer, refused on MIG), and which PIDs each
call gives under the three driver behaviours of NVML-FACTS.md §7."""

from __future__ import annotations

from dataclasses import replace

import pynvml
import pytest

from sidecar.simulate.fake_nvml import (
    NO_INSTANCE,
    PROCESS_EPOCH_US,
    PROCESS_SAMPLE_BUFFER,
    FakeGpu,
    FakeMig,
    FakeProcess,
)

GiB = 1024**3
APP = FakeProcess(pid=4101, ns_pid=12, used_memory=20 * GiB, sm_util=30, mem_util=10)
NEIGHBOUR = FakeProcess(pid=5202, used_memory=60 * GiB, sm_util=55, mem_util=40)
MPS_CLIENT = FakeProcess(pid=6303, ns_pid=14, used_memory=GiB, sm_util=5, mem_util=2, mps=True)
IDLE = FakeProcess(pid=7404, ns_pid=15, used_memory=GiB)


def gpu(**kw) -> FakeGpu:
    base = FakeGpu(uuid="GPU-00000000-aaaa-bbbb-cccc-dddddddddddd", name="Simulated H200",
                   pci_bus_id="00000000:10:00.0")
    return replace(base, **kw)


def start(install_fake, clock, gpus):
    fake = install_fake(gpus, clock=clock)
    pynvml.nvmlInit()
    return fake, pynvml.nvmlDeviceGetHandleByIndex(0)


def listed(procs) -> list[tuple[int, int, int, int]]:
    return [(p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId) for p in procs]


def test_no_process_answers_an_empty_list_and_not_found(install_fake, clock):
    _, h = start(install_fake, clock, [gpu()])
    clock.advance(5)
    assert pynvml.nvmlDeviceGetComputeRunningProcesses_v3(h) == []
    assert pynvml.nvmlDeviceGetMPSComputeRunningProcesses_v3(h) == []
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetProcessUtilization(h, 0)


@pytest.mark.parametrize(("view", "compute", "utilization"), [
    ("host", [4101, 5202, 7404], {4101, 5202}),
    ("namespace", [12, 15], {12}),
    ("mixed", [12, 15], {4101, 5202}),
])
def test_each_pid_view_gives_its_pids(install_fake, clock, view, compute, utilization):
    _, h = start(install_fake, clock, [gpu(processes=(APP, NEIGHBOUR, IDLE), pid_view=view)])
    clock.advance(3)
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses_v3(h)
    assert [p.pid for p in procs] == compute
    memory = {4101: 20 * GiB, 12: 20 * GiB, 5202: 60 * GiB, 7404: GiB, 15: GiB}
    assert listed(procs) == [(pid, memory[pid], NO_INSTANCE, NO_INSTANCE) for pid in compute]
    samples = pynvml.nvmlDeviceGetProcessUtilization(h, 0)
    assert {s.pid for s in samples} == utilization  # the idle process has no sample


def test_mps_clients_are_in_the_mps_list_only(install_fake, clock):
    _, h = start(install_fake, clock, [gpu(processes=(APP, MPS_CLIENT), pid_view="host")])
    assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses_v3(h)] == [4101]
    assert listed(pynvml.nvmlDeviceGetMPSComputeRunningProcesses_v3(h)) == [
        (6303, GiB, NO_INSTANCE, NO_INSTANCE)]


def test_samples_since_a_timestamp_in_cpu_microseconds(install_fake, clock):
    _, h = start(install_fake, clock, [gpu(processes=(APP, NEIGHBOUR), pid_view="host")])
    clock.advance(3.5)  # samples at t = 1, 2, 3 s
    samples = pynvml.nvmlDeviceGetProcessUtilization(h, 0)
    stamps = sorted({s.timeStamp for s in samples})
    assert stamps == [PROCESS_EPOCH_US + k * 1_000_000 for k in (1, 2, 3)]
    by_pid = {s.pid: (s.smUtil, s.memUtil, s.encUtil, s.decUtil) for s in samples}
    assert by_pid == {4101: (30, 10, 0, 0), 5202: (55, 40, 0, 0)}
    assert len(samples) == 6
    # only what is newer than the last timestamp seen; nothing newer: NOT_FOUND
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetProcessUtilization(h, stamps[-1])
    clock.advance(2)
    newer = pynvml.nvmlDeviceGetProcessUtilization(h, stamps[-1])
    assert sorted({s.timeStamp for s in newer}) == [stamps[-1] + 1_000_000, stamps[-1] + 2_000_000]


def test_the_driver_keeps_a_bounded_buffer(install_fake, clock):
    _, h = start(install_fake, clock, [gpu(processes=(NEIGHBOUR,), pid_view="host")])
    clock.advance(PROCESS_SAMPLE_BUFFER * 3)
    assert len(pynvml.nvmlDeviceGetProcessUtilization(h, 0)) == PROCESS_SAMPLE_BUFFER


def test_a_too_small_array_is_refused_with_the_size_needed(install_fake, clock):
    """The C protocol under pynvml: a NULL array (count 0) is the size query, answered
    INSUFFICIENT_SIZE with the count needed; room enough fills the array."""
    fake, h = start(install_fake, clock, [gpu(processes=(APP, NEIGHBOUR), pid_view="host")])
    clock.advance(2)
    count = pynvml.c_uint(0)
    assert fake.nvmlDeviceGetComputeRunningProcesses_v3(h, pynvml.byref(count), None) == \
        pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == 2
    count.value = 1
    small = (pynvml.c_nvmlProcessInfo_v3_t * 1)()
    assert fake.nvmlDeviceGetComputeRunningProcesses_v3(h, pynvml.byref(count), small) == \
        pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    count.value = 0
    stamp = pynvml.c_ulonglong(0)
    assert fake.nvmlDeviceGetProcessUtilization(h, None, pynvml.byref(count), stamp) == \
        pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == 4  # two periods, two processes
    room = (pynvml.c_nvmlProcessUtilizationSample_t * 4)()
    assert fake.nvmlDeviceGetProcessUtilization(h, room, pynvml.byref(count), stamp) == \
        pynvml.NVML_SUCCESS


def test_utilization_is_refused_on_mig(install_fake, clock):
    mig = FakeMig(1, "MIG-11111111-2222-3333-4444-555555555555", "Simulated H200 MIG 3g",
                  71 * GiB)
    _, h = start(install_fake, clock, [gpu(processes=(NEIGHBOUR,), mig=(mig,))])
    clock.advance(2)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetProcessUtilization(h, 0)
    instance = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetProcessUtilization(instance, 0)
    assert pynvml.nvmlDeviceGetComputeRunningProcesses_v3(instance) == []
