"""The GPU's CUDA processes, read by the NVML source at a cadence of their own, and told this
pod's or others' through a /proc tree (``proc_root``): right under each driver PID behaviour
where the agent can tell, said (0, figures absent) where it cannot, never counted as others'."""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

import pytest

from sidecar.simulate.fake_nvml import FakeGpu, FakeMig, FakeProcess
from sidecar.sources.nvml import NvmlSource
from sidecar.sources.nvml.processes import (
    PROCESS_READ_S,
    GpuProcess,
    Own,
    ProcessAnswer,
    ProcessFigures,
    ProcessShare,
    attribute,
    own_processes,
    shares_of,
)

GiB = 1024**3
APP = FakeProcess(pid=4101, ns_pid=12, used_memory=20 * GiB, sm_util=30, mem_util=10)
NEIGHBOUR = FakeProcess(pid=5202, used_memory=60 * GiB, sm_util=55, mem_util=40)
POD_CGROUP = "/kubepods.slice/kubepods-pod1111.slice"
OTHER_POD = "/kubepods.slice/kubepods-pod2222.slice"


def write_proc(root: Path, pid: int | str, cgroup: str, nspid: tuple[int, ...] = (),
               tgid: int | None = None) -> None:
    """One /proc/<pid> of the fake tree: its status (Tgid, NSpid) and cgroup files."""
    d = root / str(pid)
    d.mkdir(parents=True)
    first = nspid[0] if nspid else pid
    (d / "status").write_text(f"Name:\tpython\nTgid:\t{tgid if tgid is not None else first}\n"
                              f"Pid:\t{first}\nNSpid:\t{' '.join(map(str, nspid or (pid,)))}\n")
    (d / "cgroup").write_text(f"0::{cgroup}\n")


def pod_proc(tmp_path: Path) -> Path:
    """The pod's own PID namespace, shared (shareProcessNamespace): the agent is PID 20 in
    its container's cgroup, the app's process PID 12 in its own; the cgroup namespace is the
    container's, so the app's path is relative to the agent's."""
    root = tmp_path / "proc"
    write_proc(root, "self", "/", nspid=(20,))
    write_proc(root, 20, "/")
    write_proc(root, 12, "/../cri-containerd-app.scope")
    return root


def host_proc(tmp_path: Path) -> Path:
    """The host's /proc (an agent with hostPID): absolute cgroups, NSpid host PID first."""
    root = tmp_path / "hostproc"
    write_proc(root, "self", f"{POD_CGROUP}/cri-containerd-agent.scope", nspid=(3000,))
    write_proc(root, 4101, f"{POD_CGROUP}/cri-containerd-app.scope", nspid=(4101, 12))
    write_proc(root, 5202, f"{OTHER_POD}/cri-containerd-x.scope", nspid=(5202, 1))
    return root


class Publishers:
    def __init__(self, *pids: int) -> None:
        self.pids = pids

    def processes(self) -> list[dict[str, object]]:
        return [{"pid": pid, "gpus": ["GPU-x"], "last_message_s_ago": 0.5} for pid in self.pids]


def gpu(**kw) -> FakeGpu:
    base = FakeGpu(uuid="GPU-0000proc-aaaa-bbbb-cccc-dddddddddddd", name="Simulated H200",
                   pci_bus_id="00000000:10:00.0")
    return replace(base, **kw)


def compute_figures(reading) -> ProcessFigures:
    return ProcessFigures(**{f.name: getattr(reading.compute, f.name)
                             for f in fields(ProcessFigures)})


def read_once(install_fake, clock, proc_root: Path, app: Publishers | None, **kw):
    fake = install_fake([gpu(**kw)], clock=clock, record_calls=True)
    source = NvmlSource(clock=clock, sleep=clock.advance, proc_root=str(proc_root))
    source.open()
    try:
        uuid = source.devices()[0].uuid
        clock.advance(5)
        return fake, compute_figures(source.read([uuid], app=app)[uuid])
    finally:
        source.close()


# -- pure parts --------------------------------------------------------------------------------

def test_shares_are_means_over_the_sample_periods_the_answer_holds():
    samples = [(1, 100, 40, 10), (2, 100, 20, 0), (1, 200, 60, 30)]  # 2 is idle at t = 200
    assert shares_of(samples) == (ProcessShare(1, 0.5, 0.2), ProcessShare(2, 0.1, 0.0))
    assert shares_of([]) == ()


ANSWER = ProcessAnswer(
    processes=(GpuProcess(12, 20 * GiB), GpuProcess(40, 60 * GiB), GpuProcess(41, GiB, mps=True)),
    shares=(ProcessShare(12, 0.3, 0.1), ProcessShare(40, 0.55, 0.4)))


def test_attribute_splits_the_pods_processes_from_the_others():
    got = attribute(ANSWER, own=Own(visible=True, pids=frozenset({12})))
    assert got == ProcessFigures(
        processes_attributed=1, process_utilization_attributed=1,
        pod_processes=1.0, other_processes=2.0,
        pod_process_memory_bytes=20 * GiB, other_process_memory_bytes=61 * GiB,
        pod_sm_share_ratio=0.3, other_sm_share_ratio=0.55,
        pod_mem_bandwidth_share_ratio=0.1, other_mem_bandwidth_share_ratio=0.4)


@pytest.mark.parametrize("own", [Own(visible=False, pids=frozenset({12})),  # no shared namespace
                                 Own(visible=True)])  # none of the PIDs is the pod's
def test_what_cannot_be_told_apart_is_said_and_not_counted_as_others(own):
    got = attribute(ANSWER, own=own)
    assert got == ProcessFigures(processes_attributed=0, process_utilization_attributed=0)


def test_an_empty_answer_is_nobodys_load():
    got = attribute(ProcessAnswer(processes=(GpuProcess(12, GiB),), shares=()),
                    own=Own(visible=True, pids=frozenset({12})))
    assert (got.process_utilization_attributed, got.pod_sm_share_ratio,
            got.other_sm_share_ratio) == (1, 0, 0)


def test_own_processes_in_the_pods_shared_namespace(tmp_path):
    root = pod_proc(tmp_path)
    write_proc(root, 13, "/../cri-containerd-app.scope", nspid=(12,), tgid=12)  # a thread of 12
    assert own_processes([12, 13, 4101], [12], proc_root=str(root)) == \
        Own(visible=True, pids=frozenset({12}))


def test_without_a_shared_namespace_the_agent_sees_only_its_own_container(tmp_path):
    root = tmp_path / "proc"
    write_proc(root, "self", "/", nspid=(1,))
    write_proc(root, 1, "/")
    write_proc(root, 12, "/")  # the agent container's PID 12, not the app's
    assert own_processes([12], [12], proc_root=str(root)).visible is False
    assert own_processes([12], [12], proc_root=str(tmp_path / "none")).visible is False


def test_own_processes_in_the_hosts_proc(tmp_path):
    root = host_proc(tmp_path)
    assert own_processes([4101, 5202], [4101], proc_root=str(root)) == \
        Own(visible=True, pids=frozenset({4101}))


# -- through the source and the stand-in -------------------------------------------------------

BOTH = (APP, NEIGHBOUR)
ATTRIBUTED_LIST = {"processes_attributed": 1, "pod_processes": 1.0, "other_processes": 0.0,
                   "pod_process_memory_bytes": 20 * GiB, "other_process_memory_bytes": 0}


@pytest.mark.parametrize(("view", "expected"), [
    # both calls in the pod's namespace: the neighbour is left out of both answers
    ("namespace", ProcessFigures(**ATTRIBUTED_LIST, process_utilization_attributed=1,
                                 pod_sm_share_ratio=0.3, other_sm_share_ratio=0.0,
                                 pod_mem_bandwidth_share_ratio=0.1,
                                 other_mem_bandwidth_share_ratio=0.0)),
    # 560.35: the list translated, the samples in host PIDs the pod's /proc cannot map
    ("mixed", ProcessFigures(**ATTRIBUTED_LIST, process_utilization_attributed=0)),
    # host PIDs in both: nothing the pod's /proc can map, nothing counted as others'
    ("host", ProcessFigures(processes_attributed=0, process_utilization_attributed=0)),
])
def test_each_pid_view_in_the_pods_shared_namespace(install_fake, clock, tmp_path, view,
                                                    expected):
    _, got = read_once(install_fake, clock, pod_proc(tmp_path), Publishers(12),
                       processes=BOTH, pid_view=view)
    assert got == expected


def test_host_pids_with_the_hosts_proc_attribute_every_process(install_fake, clock, tmp_path):
    """An agent with the host's PID namespace: NVML's PIDs are /proc's, the cgroups tell the
    pod's process from the neighbour's; figures equal the stand-in's processes."""
    _, got = read_once(install_fake, clock, host_proc(tmp_path), Publishers(4101),
                       processes=BOTH, pid_view="host")
    assert got == ProcessFigures(
        processes_attributed=1, process_utilization_attributed=1,
        pod_processes=1.0, other_processes=1.0,
        pod_process_memory_bytes=20 * GiB, other_process_memory_bytes=60 * GiB,
        pod_sm_share_ratio=0.3, other_sm_share_ratio=0.55,
        pod_mem_bandwidth_share_ratio=0.1, other_mem_bandwidth_share_ratio=0.4)


def test_without_a_shared_namespace_nothing_is_attributed(install_fake, clock, tmp_path):
    root = tmp_path / "proc"
    write_proc(root, "self", "/", nspid=(1,))
    write_proc(root, 1, "/")
    _, got = read_once(install_fake, clock, root, Publishers(1),
                       processes=(replace(APP, ns_pid=None), NEIGHBOUR), pid_view="host")
    assert got == ProcessFigures(processes_attributed=0, process_utilization_attributed=0)


def test_an_idle_gpu_answers_not_found_read_as_no_share(install_fake, clock, tmp_path):
    idle = replace(APP, sm_util=0, mem_util=0)
    _, got = read_once(install_fake, clock, pod_proc(tmp_path), Publishers(12),
                       processes=(idle,), pid_view="namespace")
    assert (got.process_utilization_attributed, got.pod_sm_share_ratio,
            got.other_sm_share_ratio, got.pod_processes) == (1, 0, 0, 1.0)


def test_no_process_no_figure(install_fake, clock, tmp_path):
    fake, got = read_once(install_fake, clock, pod_proc(tmp_path), Publishers(12))
    assert got == ProcessFigures()
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 1
    assert fake.calls["nvmlDeviceGetProcessUtilization"] == 0  # nothing to sample


def test_two_hundred_processes_keep_the_series_per_gpu_bounded(install_fake, clock, tmp_path):
    """No PID label: 200 neighbours are counts and sums, the same ten figures."""
    root = host_proc(tmp_path)
    crowd = tuple(FakeProcess(pid=10_000 + i, used_memory=GiB, sm_util=0.4, mem_util=0.4)
                  for i in range(200))
    for proc in crowd:
        write_proc(root, proc.pid, f"{OTHER_POD}/cri-containerd-{proc.pid}.scope")
    _, got = read_once(install_fake, clock, root, Publishers(4101),
                       processes=(APP, *crowd), pid_view="host")
    assert (got.pod_processes, got.other_processes, got.other_process_memory_bytes) == \
        (1.0, 200.0, 200 * GiB)
    assert got.pod_sm_share_ratio == pytest.approx(0.3)


def test_mig_gives_no_utilization_shares(install_fake, clock, tmp_path):
    mig = FakeMig(1, "MIG-11111111-2222-3333-4444-555555555555", "Simulated H200 MIG 3g",
                  71 * GiB)
    fake = install_fake([gpu(processes=BOTH, pid_view="namespace", mig=(mig,))], clock=clock)
    source = NvmlSource(clock=clock, sleep=clock.advance, proc_root=str(pod_proc(tmp_path)))
    source.open()
    try:
        uuids = [d.uuid for d in source.devices()]
        clock.advance(5)
        readings = source.read(uuids, app=Publishers(12))
    finally:
        source.close()
    assert fake.mig_handle_refused == {}
    for reading in readings.values():
        assert reading is not None
        assert reading.compute.process_utilization_attributed is None
        assert reading.compute.pod_sm_share_ratio is None


def test_the_process_calls_have_a_cadence_of_their_own(install_fake, clock, tmp_path):
    """Three calls every PROCESS_READ_S, never every cycle; the last figures carried."""
    fake = install_fake([gpu(processes=BOTH, pid_view="namespace")], clock=clock,
                        record_calls=True)
    source = NvmlSource(clock=clock, sleep=clock.advance, proc_root=str(pod_proc(tmp_path)))
    source.open()
    cycles = 25
    try:
        uuid = source.devices()[0].uuid
        seen = []
        for _ in range(cycles):
            clock.advance(1.0)
            seen.append(source.read([uuid], app=Publishers(12))[uuid].compute.pod_processes)
    finally:
        source.close()
    reads = -(-cycles // int(PROCESS_READ_S))  # t = 1, 11, 21
    for call in ("nvmlDeviceGetComputeRunningProcesses_v3",
                 "nvmlDeviceGetMPSComputeRunningProcesses_v3", "nvmlDeviceGetProcessUtilization"):
        assert fake.calls[call] == (2 * reads if call != "nvmlDeviceGetMPSComputeRunningProcesses_v3"
                                    else reads), call  # two C calls each where a list is there
    assert seen == [1.0] * cycles
