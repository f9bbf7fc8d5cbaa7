"""Samples become series named and labelled as Contract 1 says; absent stays absent."""

import dataclasses

import pytest

from sidecar.metrics import BY_NAME
from sidecar.protocol import Allocator
from sidecar.samples import (
    LAYER_METRICS,
    LAYERS,
    AppFigures,
    ComputeLayer,
    GpuIdentity,
    GpuSample,
    HealthLayer,
    IoLayer,
    LatencyHistogram,
    MemoryLayer,
    sample_series,
)

ID = GpuIdentity(uuid="GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee", name="Simulated NVIDIA H200",
                 index="3")
POD = {"namespace": "ml", "pod": "llm-0", "node": "gpu-node-7"}


TWO_PROCESSES = (
    Allocator(pid=11, gpu=ID.uuid, reserved_bytes=100, allocated_bytes=50, active_bytes=50,
              inactive_split_bytes=10, alloc_retries=2, ooms=0, largest_free_block_bytes=30),
    Allocator(pid=22, gpu=ID.uuid, reserved_bytes=300, allocated_bytes=250, active_bytes=250,
              inactive_split_bytes=30, alloc_retries=1, ooms=1, largest_free_block_bytes=20,
              private_pool_bytes=64),
)


def by_name(series):
    out = {}
    for s in series:
        out.setdefault(s.name, []).append(s)
    return out


def test_every_series_carries_gpu_and_pod_identity_and_the_sample_time():
    sample = GpuSample(identity=ID, timestamp_ms=1_700_000_000_123,
                       compute=ComputeLayer(utilization_ratio=0.97),
                       memory=MemoryLayer(used_bytes=5), io=IoLayer(pcie_rx_bytes_per_second=1.0))
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
    series = by_name(sample_series(GpuSample(identity=ID, timestamp_ms=1,
                                                 compute=ComputeLayer(utilization_ratio=0.5)), {}))
    assert set(series) == {"gpu_utilization_ratio"}
    # no link maximum: no ratio, even with a rate
    io = IoLayer(pcie_tx_bytes_per_second=5e9)
    series = by_name(sample_series(GpuSample(identity=ID, timestamp_ms=1, io=io), {}))
    assert "gpu_pcie_tx_bandwidth_util_ratio" not in series


def test_pcie_ratio_is_rate_over_link_maximum():
    io = IoLayer(pcie_tx_bytes_per_second=6.3e9, pcie_rx_bytes_per_second=56.7e9,
                 pcie_link_max_bytes_per_second=63e9)
    series = by_name(sample_series(GpuSample(identity=ID, timestamp_ms=1, io=io), {}))
    assert series["gpu_pcie_tx_bandwidth_util_ratio"][0].value == 0.1
    assert series["gpu_pcie_rx_bandwidth_util_ratio"][0].value == 0.9


def test_fragmentation_is_the_empty_share_of_the_cache_not_memory_usage():
    a = Allocator(pid=10, gpu=ID.uuid, reserved_bytes=100, allocated_bytes=35, active_bytes=35,
                  inactive_split_bytes=20, alloc_retries=4, ooms=1, largest_free_block_bytes=8)
    # the seed's fault: used/total of the device would say 0.9 here; fragmentation is 0.65
    mem = MemoryLayer(used_bytes=90, total_bytes=100)
    series = by_name(sample_series(GpuSample(identity=ID, timestamp_ms=1, memory=mem,
                                                 app=AppFigures(allocators=(a,))), {}))
    assert series["gpu_memory_fragmentation_ratio"][0].value == 0.65
    assert series["gpu_allocator_nonreleasable_ratio"][0].value == 0.2
    assert series["gpu_allocator_largest_free_block_bytes"][0].value == 8
    assert series["gpu_allocator_alloc_retries_total"][0].value == 4
    assert "pid" not in dict(series["gpu_memory_fragmentation_ratio"][0].labels)


def test_several_processes_on_a_gpu_make_one_set_of_series_from_their_sums():
    sample = GpuSample(identity=ID, timestamp_ms=1, app=AppFigures(allocators=TWO_PROCESSES))
    series = by_name(sample_series(sample, {}))
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
    sample = GpuSample(identity=ID, timestamp_ms=1, app=AppFigures(allocators=TWO_PROCESSES))
    assert not [s for s in sample_series(sample, {}) if s.name.startswith("gpu_app_process_")]
    series = by_name(sample_series(sample, {}, per_process=True))
    frag = {dict(s.labels)["pid"]: s.value for s in series["gpu_app_process_fragmentation_ratio"]}
    assert frag == {"11": 0.5, "22": 50 / 300}
    reserved = {dict(s.labels)["pid"]: s.value for s in series["gpu_app_process_reserved_bytes"]}
    assert reserved == {"11": 100, "22": 300}
    assert len(series["gpu_app_process_allocated_bytes"]) == 2
    assert series["gpu_allocator_reserved_bytes"][0].value == 400  # the sums stay as they were


def test_latency_histogram_series_are_cumulative_with_inf_bucket():
    h = LatencyHistogram(bounds=(0.1, 0.25), counts=(3, 8, 10), sum_seconds=1.5)
    series = by_name(sample_series(GpuSample(identity=ID, timestamp_ms=1, app=AppFigures(latency=h)), {}))
    buckets = {dict(s.labels)["le"]: s.value for s in series["inference_request_duration_seconds_bucket"]}
    assert buckets == {"0.1": 3, "0.25": 8, "+Inf": 10}
    assert series["inference_request_duration_seconds_count"][0].value == 10
    assert series["inference_request_duration_seconds_sum"][0].value == 1.5


def _full_layers() -> dict[type, object]:
    """Every layer with every field set, each to a value of its own (1.0, 2.0, ...)."""
    out, n = {}, 0
    for layer in LAYERS:
        values = {}
        for f in dataclasses.fields(layer):
            n += 1
            values[f.name] = float(n)
        out[layer] = layer(**values)
    return out


def test_every_name_produced_is_in_the_metric_table():
    a = Allocator(pid=1, gpu=ID.uuid, reserved_bytes=100, allocated_bytes=50, active_bytes=50,
                  inactive_split_bytes=10, alloc_retries=1, ooms=0, largest_free_block_bytes=5,
                  private_pool_bytes=7)
    layers = _full_layers()
    sample = GpuSample(
        identity=ID, timestamp_ms=1, compute=layers[ComputeLayer], memory=layers[MemoryLayer],
        io=layers[IoLayer],
        app=AppFigures(allocators=(a,), latency=LatencyHistogram(bounds=(0.1,), counts=(1, 2),
                                                                 sum_seconds=0.3)),
    )
    for s in sample_series(sample, {}, per_process=True):
        base = s.name
        for suffix in ("_bucket", "_sum", "_count"):
            if base.startswith("inference_") and base.endswith(suffix):
                base = base.removesuffix(suffix)
        assert base in BY_NAME, s.name


def test_every_layer_field_names_its_own_series_and_no_two_share_one():
    for layer in LAYERS:
        assert [attr for attr, _ in LAYER_METRICS[layer]] == \
            [f.name for f in dataclasses.fields(layer)]
    names = [name for pairs in LAYER_METRICS.values() for _, name in pairs]
    assert len(names) == len(set(names))
    assert all(name in BY_NAME for name in names)


@pytest.mark.parametrize("layer", LAYERS)
def test_each_series_carries_the_value_of_the_field_it_is_named_by(layer):
    # each field holds a value of its own: the series named for a field must carry that
    # field's value, so a reordered or inserted field cannot shift values onto other names
    layers = _full_layers()
    sample = GpuSample(identity=ID, timestamp_ms=1, compute=layers[ComputeLayer],
                       memory=layers[MemoryLayer], io=layers[IoLayer],
                       health=layers[HealthLayer])
    value = {s.name: s.value for s in sample_series(sample, {})}
    for attr, name in LAYER_METRICS[layer]:
        assert value[name] == getattr(layers[layer], attr), (attr, name)


def test_the_series_names_follow_the_fields_not_their_order():
    # the same layer built with its fields in another order labels every value alike
    forward = IoLayer(pcie_tx_bytes_per_second=1.0, pcie_rx_bytes_per_second=2.0,
                      pcie_replay_errors=3, nvlink_rx_bytes_per_second=4.0)
    backward = IoLayer(nvlink_rx_bytes_per_second=4.0, pcie_replay_errors=3,
                       pcie_rx_bytes_per_second=2.0, pcie_tx_bytes_per_second=1.0)
    series = [sample_series(GpuSample(identity=ID, timestamp_ms=1, io=io), {})
              for io in (forward, backward)]
    assert series[0] == series[1]
    assert {s.name: s.value for s in series[0]} == {
        "gpu_pcie_tx_bytes_per_second": 1.0, "gpu_pcie_rx_bytes_per_second": 2.0,
        "gpu_pcie_replay_errors_total": 3.0, "gpu_nvlink_rx_bytes_per_second": 4.0}


def test_a_figure_named_twice_or_a_share_of_an_undeclared_series_is_refused_at_import():
    from sidecar import metrics

    occupancy = metrics.BY_NAME["gpu_sm_occupancy_ratio"]
    again = dataclasses.replace(occupancy, name="gpu_sm_occupancy_again_ratio")
    with pytest.raises(TypeError, match=r"names field \['sm_occupancy_ratio'\] twice"):
        metrics._declared_once((occupancy, again))
    share = dataclasses.replace(metrics.BY_NAME["gpu_pcie_tx_bandwidth_util_ratio"],
                                ratio_of=("gpu_pcie_tx_bytes_per_second", "gpu_no_such_maximum"))
    with pytest.raises(TypeError, match=r"not both in metrics\.TABLE"):
        metrics._declared_once((metrics.BY_NAME["gpu_pcie_tx_bytes_per_second"], share))


def test_every_layer_field_is_an_entry_of_the_metric_table_and_every_entry_with_a_field_is_one():
    from sidecar import metrics

    declared = {(m.layer, m.field, m.name) for m in metrics.TABLE if m.field}
    built = {(metrics.LAYERS[i], f.name, dict(LAYER_METRICS[layer])[f.name])
             for i, layer in enumerate(LAYERS) for f in dataclasses.fields(layer)}
    assert built == declared
