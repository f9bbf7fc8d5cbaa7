"""The agent's schedule and selection, with the stand-in NVML and a hand-moved clock."""

from __future__ import annotations

from sidecar.agent import Agent
from sidecar.config import Config
from sidecar.simulate.scenarios import build
from sidecar.sources.app_socket import AppState
from sidecar.sources.nvml import NvmlSource
from tests.manual_clock import ManualClock
from tests.test_app_socket import alloc, raw


class ListSink:
    def __init__(self, clock: ManualClock | None = None, cost: list[float] | None = None):
        self.batches: list[list] = []
        self.clock, self.cost = clock, list(cost or [])
        self.started: list[float] = []

    def emit(self, series):
        if self.clock is not None:
            self.started.append(self.clock())
            if self.cost:
                self.clock.advance(self.cost.pop(0))  # this cycle "took" that long
        self.batches.append(series)

    name = "list"

    def start(self):
        pass

    def close(self, deadline):
        return True

    def telemetry(self, ts, labels):
        return []


class ClockStop:
    """A stop event whose wait moves the manual clock; stops after ``cycles`` emits."""

    def __init__(self, clock: ManualClock, sink: ListSink, cycles: int):
        self.clock, self.sink, self.cycles = clock, sink, cycles

    def is_set(self) -> bool:
        return len(self.sink.batches) >= self.cycles

    def wait(self, seconds: float) -> bool:
        self.clock.advance(max(0.0, seconds))
        return self.is_set()


def make_agent(clock, sink, config=None, scenario="healthy", install_fake=None):
    install_fake(list(build(scenario).gpus), clock=clock)
    source = NvmlSource(clock=clock)
    source.open()
    app = AppState(clock=clock, known_gpu={d.uuid for d in source.devices()}.__contains__)
    cfg = config or Config(interval=5.0, gpus="visible")
    return Agent(cfg, source=source, app=app, sinks=sink, clock=clock,
                 wall=lambda: clock() + 1.7e9), source, app


def test_cycles_stay_on_a_fixed_grid_even_when_some_run_slow(clock, install_fake):
    sink = ListSink(clock, cost=[0.1, 3.0, 0.2, 4.9, 0.0])
    agent, _, _ = make_agent(clock, sink, install_fake=install_fake)
    agent.run(ClockStop(clock, sink, cycles=5))
    start = sink.started[0]
    offsets = [round(t - start, 6) for t in sink.started]
    # the cost of a cycle never shifts the next slot (no drift)
    assert offsets == [0.0, 5.0, 10.0, 15.0, 20.0]
    assert agent.overruns == 0


def test_an_overrun_skips_missed_slots_and_is_counted(clock, install_fake):
    sink = ListSink(clock, cost=[0.0, 12.0, 0.0, 0.0])
    agent, _, _ = make_agent(clock, sink, install_fake=install_fake)
    agent.run(ClockStop(clock, sink, cycles=4))
    offsets = [round(t - sink.started[0], 6) for t in sink.started]
    # slot 2 (10 s) and 3 (15 s) were missed while cycle 2 ran until 17 s: next is 20 s
    assert offsets == [0.0, 5.0, 20.0, 25.0]
    assert agent.overruns == 1
    last = {s.name: s.value for s in sink.batches[-1]}
    assert last["gpu_sidecar_cycle_overruns_total"] == 1


def test_announced_mode_exports_only_the_gpus_the_app_named(clock, install_fake):
    sink = ListSink()
    agent, source, app = make_agent(clock, sink, Config(gpus="announced"),
                                    install_fake=install_fake)
    uuids = [d.uuid for d in source.devices()]
    agent.cycle()
    assert {dict(s.labels).get("gpu_uuid") for s in sink.batches[-1]} == {None}
    app.feed(raw(alloc(pid=9, gpu=uuids[1])))
    agent.cycle()
    gpus = {dict(s.labels).get("gpu_uuid") for s in sink.batches[-1]} - {None}
    assert gpus == {uuids[1]}


def test_explicit_gpu_list_wins_and_an_invisible_uuid_is_reported_unavailable(clock, install_fake):
    missing = "GPU-99999999-9999-9999-9999-999999999999"
    sink = ListSink()
    install_fake(list(build("healthy").gpus), clock=clock)
    source = NvmlSource(clock=clock)
    source.open()
    first = source.devices()[0].uuid
    agent = Agent(Config(gpus=f"{first},{missing}"), source=source, app=AppState(clock=clock),
                  sinks=sink, clock=clock)
    series = agent.cycle()
    avail = {dict(s.labels)["gpu_uuid"]: s.value for s in series
             if s.name == "gpu_sidecar_gpu_available"}
    assert avail == {first: 1.0, missing: 0.0}


def test_app_only_mode_exports_allocator_figures_without_nvml(clock):
    sink = ListSink()
    app = AppState(clock=clock)
    agent = Agent(Config(no_nvml=True), source=None, app=app, sinks=sink, clock=clock,
                  mode="app-only")
    app.feed(raw(alloc(pid=9)))
    series = agent.cycle()
    names = {s.name for s in series}
    assert "gpu_memory_fragmentation_ratio" in names
    assert "gpu_utilization_ratio" not in names
    nvml = [s for s in series if s.name == "gpu_sidecar_nvml_available"]
    assert nvml[0].value == 0


def test_with_gpus_visible_the_agent_exports_exactly_the_gpus_nvml_shows_it(clock, install_fake):
    # a DRA claim (or NVIDIA_VISIBLE_DEVICES) gives the container two of the node's eight GPUs:
    # NVML numbers them 0 and 1 in the container, their UUIDs stay the node's
    node = list(build("healthy", 8).gpus)
    claimed = [node[2], node[5]]
    install_fake(claimed, clock=clock)
    source = NvmlSource(clock=clock)
    source.open()
    sink = ListSink()
    agent = Agent(Config(interval=5.0, gpus="visible"), source=source, app=AppState(clock=clock),
                  sinks=sink, clock=clock, wall=lambda: clock() + 1.7e9)
    agent.prime()
    clock.advance(5.0)
    series = agent.cycle()
    gpu_series = [s for s in series if "gpu_uuid" in dict(s.labels)]
    assert {dict(s.labels)["gpu_uuid"] for s in gpu_series} == {g.uuid for g in claimed}
    assert {dict(s.labels)["gpu_index"] for s in gpu_series} == {"0", "1"}
    assert any(s.name == "gpu_sm_occupancy_ratio" for s in gpu_series)  # all layers, not a stub
    others = {g.uuid for g in node} - {g.uuid for g in claimed}
    assert not any(dict(s.labels).get("gpu_uuid") in others for s in series)


class BrokenSink(ListSink):
    name = "broken"

    def emit(self, series):
        raise ValueError("cannot encode")


def test_a_sink_that_raises_loses_its_cycle_only(install_fake):
    clock = ManualClock()
    good = ListSink()
    agent, _, _ = make_agent(clock, [BrokenSink(), good], install_fake=install_fake)
    agent.prime()
    clock.advance(1.0)
    for _ in range(3):
        agent.cycle()
        clock.advance(5.0)
    assert len(good.batches) == 3  # the sink after the broken one got every cycle
    dropped = [s for s in good.batches[-1] if s.name == "gpu_sidecar_samples_dropped_total"
               and ("reason", "sink_error") in s.labels]
    assert dropped and dropped[0].value == len(good.batches[0]) + len(good.batches[1])
