"""p99 above the objective that no judged layer explains points outside the GPU only as far as
the GPU was judged (issue #44: "what could not be judged is said"): a layer without figures may
hold the cause, and the note names it instead of clearing it."""

from __future__ import annotations

from sidecar.judge.figures import Figures
from sidecar.judge.verdict import judge
from sidecar.judge.window import Summary

SLOW = ((0.1, 0.5, float("inf")), (0.0, 0.0, 100.0))  # every request above 0.5 s


def verdict_of(**figures: object):
    summary = Summary()
    for n in range(2):
        latency = (SLOW[0], tuple(c * (n + 1) for c in SLOW[1]))
        summary.add({"GPU-0": Figures(uuid="GPU-0", index="0", utilization=0.9,
                                      latency=latency, **figures)})  # type: ignore[arg-type]
    return judge(summary.windows()["GPU-0"])


def outside(v) -> str:
    return next(n for n in v.notes if "look outside the GPU" in n)


def test_every_layer_judged_and_none_explaining_points_outside_the_gpu_alone():
    v = verdict_of(occupancy=0.6, pcie_rx_ratio=0.1, pcie_tx_ratio=0.1, fragmentation=0.1,
                   alloc_reserved=4 * 2**30)
    assert v.key == "none"
    assert "not judged" not in outside(v)


def test_a_layer_without_figures_is_named_beside_outside_the_gpu():
    v = verdict_of(occupancy=0.6, fragmentation=0.1, alloc_reserved=4 * 2**30)  # no PCIe
    assert v.key == "none"
    assert outside(v).endswith("or in what was not judged (PCIe)")
    v = verdict_of()
    assert "(SM occupancy, PCIe, the allocator)" in outside(v)
