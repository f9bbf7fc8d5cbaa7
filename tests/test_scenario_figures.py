"""The figures the docs quote for each simulated scenario are the ones the scenario really prints
(issue #35): every scenario of the table in docs/configuration.md, *Simulated GPUs*, is run
through ``gpu-sidecar diagnose --simulate`` and each figure its row quotes is held against the
report's, within the rounding the row admits (the simulation draws its requests and samples,
so a run differs from the next by a few percent)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tests.conftest import ROOT

DOC = ROOT / "docs" / "configuration.md"
REL = 0.10  # a quoted "~90 %" or "p99 ~300 ms" is a rounded figure, not a measurement


@dataclass(frozen=True)
class Figure:
    """One figure of a scenario's row: where the row quotes it, where the report prints it, and
    the unit factor from the report's to the row's."""

    quoted: str  # a regex over the scenario's row, one group: the number
    printed: str  # a regex over the report's first GPU, one group: the number
    factor: float = 1.0


NUMBER = r"(\d+(?:\.\d+)?)"
FIGURES = {
    "healthy": [Figure(rf"occupancy {NUMBER} %", rf"SM occupancy {NUMBER} %"),
                Figure(rf"PCIe ~{NUMBER} %", rf"PCIe RX {NUMBER} %"),
                Figure(rf"fragmentation {NUMBER} %", rf"fragmentation {NUMBER} %"),
                Figure(rf"p99 ~{NUMBER} ms", rf"p99 {NUMBER} ms")],
    "pcie-saturated": [Figure(rf"at ~{NUMBER} % of the", rf"PCIe RX {NUMBER} %"),
                       Figure(rf"p99 ~?{NUMBER} ms", rf"p99 {NUMBER} ms")],
    "fragmented": [Figure(rf"cache {NUMBER} % empty", rf"fragmentation {NUMBER} %")],
    "low-occupancy": [Figure(rf"utilization {NUMBER} %", rf"utilization {NUMBER} %"),
                      Figure(rf"occupancy is {NUMBER} %", rf"SM occupancy {NUMBER} %")],
    "throttled": [Figure(rf"SM clock ~{NUMBER} of", rf"SM clock {NUMBER} GHz", 1000),
                  Figure(rf"the power cap {NUMBER} %", rf"power cap {NUMBER} %"),
                  Figure(rf"utilization {NUMBER} %", rf"utilization {NUMBER} %")],
    "pcie-degraded": [Figure(rf"at {NUMBER} % of the trained link",
                             rf"RX {NUMBER} %, TX [\d.]+ % of it")],
    "grace-hopper": [Figure(rf"at {NUMBER} %", rf"C2C RX {NUMBER} %"),
                     Figure(rf"{NUMBER} GB/s per direction", rf"C2C RX [^;]*? of {NUMBER} GB/s")],
    "kv-cache-full": [Figure(rf"KV cache {NUMBER} % full", rf"KV cache {NUMBER} %"),
                      Figure(rf"p99 ~?{NUMBER} s", rf"p99 request {NUMBER} ms", 0.001)],
    "queueing": [Figure(rf"p99 \(~?{NUMBER} of", rf"queue {NUMBER} ms", 0.001),
                 Figure(rf"of ~?{NUMBER} s\)", rf"p99 request {NUMBER} ms", 0.001)],
}


def rows() -> dict[str, str]:
    """The scenario table's rows of docs/configuration.md, by scenario."""
    return {m[1]: m[0] for m in re.finditer(r"^\| `([a-z-]+)` \|.*$", DOC.read_text(), re.M)}


@pytest.fixture(scope="module")
def reports() -> dict[str, str]:
    """Each scenario's diagnose report, the scenarios run side by side (a 5 s window each)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
    procs = {name: subprocess.Popen(
        [sys.executable, "-m", "sidecar", "diagnose", "--simulate", name, "--duration", "5",
         "--interval", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=ROOT, env=env) for name in FIGURES}
    out = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=120)
            assert "GPU 0" in stdout, f"{name}: {stderr[-2000:]}"
            first_gpu = stdout.split("GPU 0", 1)[1].split("\nGPU 1", 1)[0]
            out[name] = " ".join(first_gpu.split())  # one line: a figure may wrap
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    return out


def test_every_scenario_row_quotes_at_least_one_checked_figure():
    assert set(FIGURES) <= set(rows()), set(FIGURES) - set(rows())


@pytest.mark.parametrize("name", list(FIGURES))
def test_the_docs_figures_are_what_the_scenario_prints(name, reports):
    row, report = rows()[name], reports[name]
    for figure in FIGURES[name]:
        quoted = re.search(figure.quoted, row)
        assert quoted, f"{name}: the row no longer quotes /{figure.quoted}/: {row}"
        printed = re.search(figure.printed, report, re.M)
        assert printed, f"{name}: the report prints no /{figure.printed}/:\n{report}"
        doc, real = float(quoted[1]), float(printed[1]) * figure.factor
        assert doc == pytest.approx(real, rel=REL), (
            f"{name}: the docs say {quoted[0]!r}, the scenario prints {printed[0]!r}")
