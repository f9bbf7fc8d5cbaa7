"""The running agent judges what it exports: the figures it folds into its window straight from
its samples (``sidecar.judge.cycle``) equal, cycle by cycle and in every scenario, the figures
the store path decodes from the series the same cycle exported (``sidecar.judge.series``)."""

from __future__ import annotations

import threading

import pytest

from sidecar import config, wiring
from sidecar.agent import PRIME_WINDOW_S, Agent
from sidecar.judge.series import figures_of
from sidecar.recent import Recent
from sidecar.simulate.scenarios import SCENARIOS


class _Seen(Recent):
    """The agent's own window, keeping each cycle it was given for the comparison."""

    def __init__(self) -> None:
        super().__init__()
        self.cycles: list[dict] = []

    def add(self, cycle, now):
        self.cycles.append(dict(cycle))
        return super().add(cycle, now)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_the_agent_feeds_its_window_the_figures_its_series_say(scenario):
    cfg = config.Config(simulate=scenario, simulate_gpus=2, interval=0.2)
    paced = threading.Event()  # never set: waits out the sampling interval, as the agent does
    seen = _Seen()
    exported = []
    with wiring.simulated_paths(cfg) as cfg, wiring.sampling(cfg) as (source, scene, state), \
            wiring.engines(cfg, scene) as engine:
        agent = Agent(cfg, source=source, app=state, sinks=[], engine=engine, recent=seen)
        agent.prime()
        paced.wait(PRIME_WINDOW_S)
        for _ in range(3):
            exported.append(figures_of(agent.cycle()))
            paced.wait(cfg.interval)
    assert len(seen.cycles) == 3
    for fed, decoded in zip(seen.cycles, exported, strict=True):
        assert list(fed) == list(decoded)  # the same GPUs, in the same order
        assert fed == decoded
    # not a comparison of empty cycles: the scenario's figures are there
    last = seen.cycles[-1]
    assert any(f.utilization is not None or not f.available for f in last.values())


def test_a_figure_the_series_carry_and_the_fed_cycle_lacks_is_found():
    """The comparison above can fail: a cycle whose app figures were dropped differs."""
    import dataclasses

    cfg = config.Config(simulate="fragmented", simulate_gpus=1, interval=0.5)
    seen = _Seen()
    with wiring.simulated_paths(cfg) as cfg, wiring.sampling(cfg) as (source, _, state):
        agent = Agent(cfg, source=source, app=state, sinks=[], recent=seen)
        agent.prime()
        threading.Event().wait(PRIME_WINDOW_S)
        decoded = {}
        for _ in range(20):  # until the simulated app has published
            decoded = figures_of(agent.cycle())
            if any(f.fragmentation is not None for f in decoded.values()):
                break
            threading.Event().wait(cfg.interval)
    fed = seen.cycles[-1]
    assert fed == decoded
    stripped = {u: dataclasses.replace(f, fragmentation=None) for u, f in fed.items()}
    assert stripped != decoded
