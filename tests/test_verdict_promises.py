"""What the verdict promises (``sidecar.judge``, ``sidecar.views.table``): which finding the table
shows when a GPU has several, that a figure exactly on a threshold is judged as the shipped alert
rule judges it (promtool on the same value), how a window averages a figure some cycles lack, and
that the table's verdict column is the agent's verdict, never its own."""

from __future__ import annotations

import io
import itertools
import re
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import yaml

from sidecar.judge.figures import Figures
from sidecar.judge.rules import ALL_KINDS as KINDS
from sidecar.judge.rules import PRECEDENCE as ALL_PRECEDENCE
from sidecar.judge.verdict import judge
from sidecar.judge.window import summarize
from sidecar.thresholds import THRESHOLDS
from sidecar.views.table import HISTORY, Table, cells, render

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "alerts" / "gpu-sidecar.rules.yml"
GiB = 1024**3
UUID = "GPU-0c4b24ac-fb68-413f-6f0c-54be2b5a94c7"
INF = float("inf")
# no requests yet, then 100 requests between 0.1 and 0.5 s: a p99 of about 0.5 s, above 0.25 s
QUIET = ((0.1, 0.5, INF), (0.0, 0.0, 0.0))
SLOW = ((0.1, 0.5, INF), (0.0, 100.0, 100.0))

# the order the module documents ("most fundamental first") and the table shows first
PRECEDENCE = ("gpu-lost", "pcie", "fragmentation", "allocator-retries", "low-occupancy")


def healthy(**figures: object) -> Figures:
    base = dict(uuid=UUID, name="Simulated H200", index="0", utilization=0.9, occupancy=0.6,
                tensor=0.5, pcie_tx_ratio=0.1, pcie_rx_ratio=0.1, fragmentation=0.1,
                alloc_reserved=8 * GiB, retries=0.0, ooms=0.0)
    base.update(figures)
    return Figures(**base)  # type: ignore[arg-type]


def cycles_with(kinds: set[str]) -> list[dict[str, Figures]]:
    """Three cycles of one GPU showing exactly the findings ``kinds``."""
    bad: dict[str, object] = {}
    if "pcie" in kinds:
        bad["pcie_rx_ratio"] = 0.95
    if "fragmentation" in kinds:
        bad.update(fragmentation=0.7, alloc_reserved=16 * GiB)
    if "low-occupancy" in kinds:
        bad["occupancy"] = 0.1
    first = healthy(latency=QUIET, **bad)
    later = replace(first, latency=SLOW if "low-occupancy" in kinds else QUIET,
                    retries=4.0 if "allocator-retries" in kinds else 0.0)
    last = replace(later, available=False) if "gpu-lost" in kinds else later
    return [{UUID: first}, {UUID: later}, {UUID: last}]


def verdict_of(cycles):
    return judge(summarize(cycles)[UUID])


def agent_verdicts(cycles):
    """What the agent hands the table: its verdict on each GPU (the table judges nothing)."""
    return {uuid: judge(w) for uuid, w in summarize(cycles).items()}


def test_the_seeds_kinds_keep_their_order_in_the_precedence():
    assert [k for k in ALL_PRECEDENCE if k in PRECEDENCE] == list(PRECEDENCE)


@pytest.mark.parametrize(("first", "second"), list(itertools.combinations(PRECEDENCE, 2)))
def test_of_two_findings_the_table_shows_the_more_fundamental_one(first, second):
    v = verdict_of(cycles_with({first, second}))
    assert [f.key for f in v.findings] == [first, second]
    assert cells(v.window, v)["verdict"] == f"{KINDS[first][1]} +1"


def test_a_gpu_with_every_finding_shows_the_first_and_how_many_more_in_the_table():
    cycles = cycles_with(set(PRECEDENCE))
    assert [f.key for f in verdict_of(cycles).findings] == list(PRECEDENCE)
    frame = render(cycles, "title", verdicts=agent_verdicts(cycles))
    assert f"{KINDS['gpu-lost'][1]} +4" in frame
    readable = cycles_with(set(PRECEDENCE) - {"gpu-lost"})
    assert re.search(rf"\| {re.escape(KINDS['pcie'][1])} \+3$",
                     render(readable, "t", verdicts=agent_verdicts(readable)), re.M)


# -- exactly on a threshold: diagnose and the shipped rule agree ---------------------------------

@dataclass(frozen=True)
class Case:
    name: str
    alert: str
    key: str  # the verdict's finding
    figures: dict  # for judge()
    series: dict  # name -> promtool values, on the labels below
    latency: bool = False


def cases() -> list[Case]:
    t = THRESHOLDS
    big, edge = 64 * GiB, t.fragmentation_min_reserved_bytes
    out = []
    for label, pcie in (("at", t.pcie_util_ratio), ("above", t.pcie_util_ratio + 0.01)):
        for direction in ("tx", "rx"):
            out.append(Case(f"pcie {direction} {label} the threshold", "GPUPCIeSaturated", "pcie",
                            {f"pcie_{direction}_ratio": pcie},
                            {f"gpu_pcie_{direction}_bandwidth_util_ratio": pcie}))
    for label, ratio, reserved in (("ratio at", t.fragmentation_ratio, big),
                                   ("ratio above", t.fragmentation_ratio + 0.01, big),
                                   ("cache at", 0.9, edge), ("cache above", 0.9, edge + 1)):
        out.append(Case(f"fragmentation {label} the threshold", "GPUMemoryFragmentationHigh",
                        "fragmentation", {"fragmentation": ratio, "alloc_reserved": reserved},
                        {"gpu_memory_fragmentation_ratio": ratio,
                         "gpu_allocator_reserved_bytes": reserved}))
    for label, occupancy in (("at", t.occupancy_ratio), ("below", t.occupancy_ratio - 0.01)):
        out.append(Case(f"occupancy {label} the threshold with slow requests",
                        "GPULowOccupancyAndSlowRequests", "low-occupancy",
                        {"occupancy": occupancy}, {"gpu_sm_occupancy_ratio": occupancy},
                        latency=True))
    return out


LABELS = {"namespace": "ml", "pod": "llm-0", "gpu_uuid": UUID, "gpu_name": "H200"}


def series_text(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def judged(case: Case) -> bool:
    base = healthy(**{"latency": QUIET, **case.figures})
    later = replace(base, latency=SLOW if case.latency else QUIET)
    return case.key in {f.key for f in verdict_of([{UUID: base}] + [{UUID: later}] * 4).findings}


def test_a_figure_exactly_on_a_threshold_is_no_finding_for_diagnose_nor_for_the_alert(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian's prometheus) is not installed")
    tests = []
    expected = {}
    for case in cases():
        fires = judged(case)
        expected[case.name] = fires
        inputs = [{"series": series_text(name, LABELS), "values": f"{value!r}x20"}
                  for name, value in case.series.items()]
        if case.latency:  # 10 requests a minute, all between 0.1 and 0.5 s: p99 about 0.5 s
            for le, step in (("0.1", 0), ("0.5", 10), ("+Inf", 10)):
                inputs.append({"series": series_text("inference_request_duration_seconds_bucket",
                                                     {**LABELS, "le": le}),
                               "values": f"0+{step}x20"})
        tests.append({
            "name": case.name, "interval": "1m", "input_series": inputs,
            # well past every rule's for: (10m at most), as judge() has none
            "promql_expr_test": [{
                "expr": f'count(ALERTS{{alertname="{case.alert}",alertstate="firing"}}) or vector(0)',
                "eval_time": "15m", "exp_samples": [{"labels": "{}", "value": int(fires)}]}]})
    # the boundary itself: at a threshold nothing is found, just past it something is
    for case in cases():
        past = " at " not in case.name
        assert expected[case.name] == past, (case.name, "judge() says", expected[case.name])
    spec = tmp_path / "boundary.tests.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(RULES)], "evaluation_interval": "1m",
                                    "tests": tests}, sort_keys=False))
    done = subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, ("the shipped rule and diagnose disagree:\n"
                                  + done.stdout[-4000:] + done.stderr[-2000:])


# -- a window's means ---------------------------------------------------------------------------

def test_a_window_mean_is_over_the_cycles_that_had_the_figure_not_diluted_by_the_others():
    had = healthy(fragmentation=0.6, alloc_reserved=8 * GiB, pcie_tx_ratio=0.9, retries=2.0)
    lacked = replace(had, fragmentation=None, alloc_reserved=None, pcie_tx_ratio=None,
                     retries=None)
    cycles = [{UUID: had}, {UUID: lacked}, {UUID: lacked},
              {UUID: replace(had, fragmentation=0.8, pcie_tx_ratio=0.95, retries=5.0)},
              {UUID: lacked}]
    w = summarize(cycles)[UUID]
    assert w.samples == 5
    assert w.mean.fragmentation == pytest.approx(0.7)
    assert w.mean.pcie_tx_ratio == pytest.approx(0.925)
    assert w.mean.occupancy == pytest.approx(0.6)  # present in every cycle
    assert w.mean.retries == 5.0  # a counter: its last value, not a mean
    assert {f.key for f in judge(w).findings} == {"pcie", "fragmentation"}


def test_cycles_in_which_the_gpu_could_not_be_read_do_not_dilute_its_means():
    read = healthy(pcie_rx_ratio=0.9)
    cycles = [{UUID: read}, {UUID: replace(read, available=False, pcie_rx_ratio=None)},
              {UUID: read}]
    w = summarize(cycles)[UUID]
    assert (w.samples, w.unreadable, w.lost) == (2, 1, False)
    assert w.mean.pcie_rx_ratio == pytest.approx(0.9)
    assert judge(w).key == "pcie"


# -- the table shows the agent's verdict, and judges nothing ------------------------------------

@dataclass(frozen=True)
class S:
    """A series as the stdout sink hands it to the table."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float
    timestamp_ms: int


GPU_LABELS = (("gpu_index", "0"), ("gpu_name", "Simulated H200"), ("gpu_uuid", UUID))


def cycle(ts: int, pcie: float, verdict: str | None = None) -> list[S]:
    """One cycle's series; ``verdict``: the agent's, as its ``gpu_verdict`` series says it."""
    out = [S("gpu_sm_occupancy_ratio", GPU_LABELS, 0.6, ts),
           S("gpu_pcie_rx_bandwidth_util_ratio", GPU_LABELS, pcie, ts)]
    if verdict is not None:
        out.append(S("gpu_verdict", (*GPU_LABELS, ("verdict", verdict)), 1.0, ts))
    return out


def verdict_cell(frame: str) -> str:
    rows = [line for line in frame.splitlines() if re.match(r"^\s*0 \|", line)]
    assert len(rows) == 1, frame
    return rows[0].rsplit("|", 1)[1].strip()


@pytest.mark.parametrize(("pcie", "agent", "cell"), [
    (1.0, "none", "ok"),  # the table's cycles cross the threshold: the agent's window did not
    (0.1, "pcie", KINDS["pcie"][1]),  # and the other way round
    (0.1, "throttled", KINDS["throttled"][1]),
])
def test_the_table_shows_the_verdict_the_agent_exported_whatever_its_own_cycles_say(
        pcie, agent, cell):
    sink = Table(io.StringIO(), live=False)
    frame = ""
    for n in range(HISTORY + 1):
        frame = sink.frame(cycle(1_767_225_600_000 + 1000 * n, pcie, agent))
    assert verdict_cell(frame) == cell


def test_the_table_shows_the_agents_verdict_whole_when_it_has_it():
    """Beside the agent the table reads its ``Verdict``: the first finding's cell (the clock's
    reason) and how many more, as ``diagnose`` lists them."""
    v = verdict_of(cycles_with({"pcie", "fragmentation"}))
    sink = Table(io.StringIO(), live=False, verdicts=lambda: {UUID: v})
    frame = sink.frame(cycle(1_767_225_600_000, 0.1, "pcie"))
    assert verdict_cell(frame) == f"{KINDS['pcie'][1]} +1"


def test_a_gpu_the_agent_has_not_judged_yet_shows_no_verdict():
    sink = Table(io.StringIO(), live=False)
    assert verdict_cell(sink.frame(cycle(1_767_225_600_000, 1.0))) == "-"


