"""Samples become series named and labelled as Contract 1 says; absent stays absent."""

from sidecar.metrics import BY_NAME
from sidecar.samples import (
    AllocatorFigures,
    AppFigures,
    ComputeLayer,
    GpuIdentity,
    GpuSample,
    IoLayer,
    LatencyHistogram,
    MemoryLayer,
    sample_series,
)

ID = GpuIdentity("GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee", "Simulated NVIDIA H200", "3")
POD = {"namespace": "ml", "pod": "llm-0", "node": "gpu-node-7"}


def by_name(series):
    out = {}
    for s in series:
        out.setdefault(s.name, []).append(s)
    return out


def test_every_series_carries_gpu_and_pod_identity_and_the_sample_time():
    sample = GpuSample(ID, 1_700_000_000_123, ComputeLayer(utilization_ratio=0.97),
                       MemoryLayer(used_bytes=5), IoLayer(pcie_rx_bytes_per_second=1.0))
    series = list(sample_series(sample, POD))
    assert series
    for s in series:
        labels = dict(s.labels)
        assert labels["gpu_uuid"] == ID.uuid and labels["gpu_name"] == ID.name
        assert labels["gpu_index"] == "3"
        assert labels["namespace"] == "ml" and labels["pod"] == "llm-0"
        assert labels["node"] == "gpu-node-7"
        assert s.timestamp_ms == 1_700_000_000_123
        assert list(s.labels) == sorted(s.labels)


def test_what_a_gpu_cannot_give_is_absent_not_zero():
    series = by_name(sample_series(GpuSample(ID, 1, ComputeLayer(utilization_ratio=0.5)), {}))
    assert set(series) == {"gpu_utilization_ratio"}
    # no link maximum: no ratio, even with a rate
    io = IoLayer(pcie_tx_bytes_per_second=5e9)
    series = by_name(sample_series(GpuSample(ID, 1, io=io), {}))
    assert "gpu_pcie_tx_bandwidth_util_ratio" not in series


def test_pcie_ratio_is_rate_over_link_maximum():
    io = IoLayer(pcie_tx_bytes_per_second=6.3e9, pcie_rx_bytes_per_second=56.7e9,
                 pcie_link_max_bytes_per_second=63e9)
    series = by_name(sample_series(GpuSample(ID, 1, io=io), {}))
    assert series["gpu_pcie_tx_bandwidth_util_ratio"][0].value == 0.1
    assert series["gpu_pcie_rx_bandwidth_util_ratio"][0].value == 0.9


def test_fragmentation_is_the_empty_share_of_the_cache_not_memory_usage():
    a = AllocatorFigures(pid=10, reserved_bytes=100, allocated_bytes=35, active_bytes=35,
                         inactive_split_bytes=20, alloc_retries=4, ooms=1,
                         largest_free_block_bytes=8)
    # the seed's fault: used/total of the device would say 0.9 here; fragmentation is 0.65
    mem = MemoryLayer(used_bytes=90, total_bytes=100)
    series = by_name(sample_series(GpuSample(ID, 1, memory=mem, app=AppFigures((a,))), {}))
    assert series["gpu_memory_fragmentation_ratio"][0].value == 0.65
    assert series["gpu_allocator_nonreleasable_ratio"][0].value == 0.2
    assert series["gpu_allocator_largest_free_block_bytes"][0].value == 8
    assert series["gpu_allocator_alloc_retries_total"][0].value == 4
    assert "pid" not in dict(series["gpu_memory_fragmentation_ratio"][0].labels)


def test_several_processes_on_a_gpu_make_one_set_of_series_from_their_sums():
    figs = (AllocatorFigures(11, 100, 50, 50, 10, 2, 0, 30, None),
            AllocatorFigures(22, 300, 250, 250, 30, 1, 1, 20, 64))
    series = by_name(sample_series(GpuSample(ID, 1, app=AppFigures(figs)), {}))
    assert all(len(v) == 1 and "pid" not in dict(v[0].labels) for v in series.values())
    value = {name: v[0].value for name, v in series.items()}
    assert value["gpu_allocator_reserved_bytes"] == 400
    assert value["gpu_allocator_allocated_bytes"] == 300
    assert value["gpu_memory_fragmentation_ratio"] == 100 / 400  # from the sums, not a mean
    assert value["gpu_allocator_nonreleasable_ratio"] == 40 / 400
    assert value["gpu_allocator_largest_free_block_bytes"] == 30  # one process's cache serves
    assert value["gpu_allocator_private_pool_bytes"] == 64
    assert value["gpu_allocator_alloc_retries_total"] == 3
    assert value["gpu_app_processes"] == 2


def test_per_process_series_only_when_asked_one_set_per_live_process():
    figs = (AllocatorFigures(11, 100, 50, 50, 10, 2, 0, 30, None),
            AllocatorFigures(22, 300, 250, 250, 30, 1, 1, 20, 64))
    sample = GpuSample(ID, 1, app=AppFigures(figs))
    assert not [s for s in sample_series(sample, {}) if s.name.startswith("gpu_app_process_")]
    series = by_name(sample_series(sample, {}, per_process=True))
    frag = {dict(s.labels)["pid"]: s.value for s in series["gpu_app_process_fragmentation_ratio"]}
    assert frag == {"11": 0.5, "22": 50 / 300}
    reserved = {dict(s.labels)["pid"]: s.value for s in series["gpu_app_process_reserved_bytes"]}
    assert reserved == {"11": 100, "22": 300}
    assert len(series["gpu_app_process_allocated_bytes"]) == 2
    assert series["gpu_allocator_reserved_bytes"][0].value == 400  # the sums stay as they were


def test_latency_histogram_series_are_cumulative_with_inf_bucket():
    h = LatencyHistogram((0.1, 0.25), (3, 8, 10), 1.5)
    series = by_name(sample_series(GpuSample(ID, 1, app=AppFigures((), h)), {}))
    buckets = {dict(s.labels)["le"]: s.value for s in series["inference_request_duration_seconds_bucket"]}
    assert buckets == {"0.1": 3, "0.25": 8, "+Inf": 10}
    assert series["inference_request_duration_seconds_count"][0].value == 10
    assert series["inference_request_duration_seconds_sum"][0].value == 1.5


def test_every_name_produced_is_in_the_metric_table():
    a = AllocatorFigures(1, 100, 50, 50, 10, 1, 0, 5, 7)
    sample = GpuSample(
        ID, 1,
        ComputeLayer(0.1, 0.2, 0.3, 0.4), MemoryLayer(0.1, 0.2, 1, 2, 3),
        IoLayer(1.0, 2.0, 10.0, 5, 16, 0, 3.0, 4.0),
        AppFigures((a,), LatencyHistogram((0.1,), (1, 2), 0.3)),
    )
    for s in sample_series(sample, {}, per_process=True):
        base = s.name
        for suffix in ("_bucket", "_sum", "_count"):
            if base.startswith("inference_") and base.endswith(suffix):
                base = base.removesuffix(suffix)
        assert base in BY_NAME, s.name
