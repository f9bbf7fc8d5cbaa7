"""``gpu-sidecar diagnose --query-url``: the verdicts, figures and remedies of the live paths, from
what real agents stored in a real VictoriaMetrics and a real Prometheus.

Equivalence is checked twice per scenario: the verdict per GPU against ``diagnose --fresh``
sampling the same simulated scenario at the same time, and every figure of the judged window
against the agent's own cycles (what it printed with --stdout, judged as the live diagnose
judges its cycles) within FIGURE_REL: VictoriaMetrics keeps 12 significant digits, Prometheus
every bit."""

from __future__ import annotations

import dataclasses
import datetime
import http.server
import json
import math
import re
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar import cli, config
from sidecar.commands.from_store import Refused, Window, clock, fetch, judge_stored, window_of
from sidecar.config import Config
from sidecar.judge.series import figures_of
from sidecar.judge.verdict import judge
from sidecar.judge.window import Summary
from sidecar.metrics import RARE_READ_S
from sidecar.samples import Series
from sidecar.simulate.scenarios import SCENARIOS
from sidecar.store import Store
from tests.conftest import ROOT, run_cli
from tests.receivers import (
    Agent,
    LocalServer,
    Prometheus,
    VictoriaMetrics,
    answer_with,
    running,
)
from tests.stored import SeriesKey, add_gpu, gpu_labels, push
from tests.test_diagnose import verdicts as report_verdicts
from tests.waiting import until

FIGURE_REL = 1e-9
CYCLES = 12


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VictoriaMetrics,
                                                                       Prometheus]]:
    vm_dir, prom_dir = (tmp_path_factory.mktemp(n) for n in ("vm", "prom"))
    vm, prom = VictoriaMetrics(vm_dir), Prometheus(prom_dir)
    with running(vm, prom):
        vm.start()
        prom.start()
        yield vm, prom


def agent_for(scenario: str, stores: tuple[VictoriaMetrics, Prometheus], spool: Path,
              namespace: str = "eq") -> Agent:
    vm, prom = stores
    return Agent(["--simulate", scenario, "--interval", "0.5", "--push-interval", "1",
                  "--remote-write-url", vm.write_url, "--remote-write-url", prom.write_url,
                  "--spool-dir", str(spool), "--pod-namespace", namespace,
                  "--pod-name", scenario, "--node-name", "node-a"])


def cycles_of(agents: list[Agent]) -> list[list[Series]]:
    """The cycles the agents judged, whole, as printed (a pushing sink sends the rare figures
    only when they change and every minute), oldest first."""
    by_ts: dict[int, list[Series]] = {}
    for agent in agents:
        for name, labels, ts, value in agent.recorded():
            by_ts.setdefault(ts, []).append(Series(name, labels, value, ts))
    return [by_ts[ts] for ts in sorted(by_ts)]


def window_around(cycles: list[list[Series]]) -> Window:
    first, last = cycles[0][0].timestamp_ms / 1000, cycles[-1][0].timestamp_ms / 1000
    return Window(first - 0.25, last + 0.001)


def requests_of(agent: Agent) -> tuple[float, float]:
    """GPU 0's request count as the agent printed it, at its first and its last cycle."""
    inf = sorted((ts, v) for n, lab, ts, v in agent.sampled()
                 if n == "inference_request_duration_seconds_bucket"
                 and dict(lab).get("le") == "+Inf" and dict(lab).get("gpu_index") == "0")
    return inf[0][1], inf[-1][1]


def judged_once_stored(cfg: Config, w: Window, cycles: int, what: str):
    """The store's window judged, once it holds ``cycles`` cycles."""

    def settled():
        store = Store(cfg)
        try:
            judged = judge_stored(fetch(store, cfg.select, w), w)
        finally:
            store.close()
        return judged if judged.cycles >= cycles else None

    return until(settled, 30, interval=0.5, what=what)


def store_cfg(url: str, scenario: str, w: Window, namespace: str = "eq") -> Config:
    return Config(query_url=url, select=(("namespace", "=", namespace), ("pod", "=", scenario)),
                  at=f"{w.end:.3f}", duration=w.end - w.start)


def judged_from(url: str, scenario: str, w: Window, want_cycles: int):
    """The store's judgement, once it serves every cycle pushed (ingestion settles in ~1 s)."""
    def ready():
        store = Store(store_cfg(url, scenario, w))
        try:
            judged = judge_stored(fetch(store, store_cfg(url, scenario, w).select, w), w)
        finally:
            store.close()
        return judged if judged.cycles >= want_cycles else None
    return until(ready, 30, interval=0.5, what=f"{want_cycles} cycles of {scenario} in {url}")


def assert_same_figures(stored, live, where: str) -> None:
    for f in dataclasses.fields(stored.mean):
        a, b = getattr(stored.mean, f.name), getattr(live.mean, f.name)
        if isinstance(a, float) and isinstance(b, float):
            assert math.isclose(a, b, rel_tol=FIGURE_REL, abs_tol=1e-12), (where, f.name, a, b)
        else:
            assert a == b or (a is not None and b is not None and str(a) == str(b)), \
                (where, f.name, a, b)
    for name in ("samples", "p50", "p99", "requests", "retries", "ooms", "engine_p99",
                 "queue_p99", "queue_share"):
        a, b = getattr(stored, name), getattr(live, name)
        assert (a == b) or (a is not None and b is not None
                            and math.isclose(a, b, rel_tol=FIGURE_REL, abs_tol=1e-12)), \
            (where, name, a, b)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_scenario_stored_by_a_real_agent_gets_the_live_verdict_and_figures(
        scenario, stores, tmp_path):
    vm, prom = stores
    live = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "diagnose", "--simulate", scenario, "--fresh",
         "--duration", "4", "--interval", "0.5"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=ROOT)
    agent = agent_for(scenario, stores, tmp_path / "spool")
    try:
        with running(agent):
            agent.start()
            # the agent asks for the error counters every RARE_READ_S (the live diagnose every
            # cycle): the hardware fault's climbing ECC count needs a window that long
            agent.more_cycles(CYCLES + (int(RARE_READ_S / 0.5) if scenario == "hardware-fault"
                                        else 0), "pushing")
        live_out, _ = live.communicate(timeout=60)
    finally:
        if live.poll() is None:
            live.kill()
            live.communicate()
    cycles = cycles_of([agent])
    w = window_around(cycles)
    summary = Summary()
    for c in cycles:
        summary.add(figures_of(c))
    own = {u: judge(win) for u, win in summary.windows().items()}
    live_verdicts = report_verdicts(live_out)
    for store in (vm, prom):
        judged = judged_from(store.base, scenario, w, len(cycles))
        assert set(judged.verdicts) == set(own), store.base
        for uuid, v in judged.verdicts.items():
            assert v.key == own[uuid].key, (store.base, uuid)
            assert_same_figures(v.window, own[uuid].window, f"{store.base} {uuid}")
            assert [f.evidence for f in v.findings] == [f.evidence for f in own[uuid].findings]
        proc = run_cli("diagnose", "--query-url", store.base, "--select", "namespace=eq",
                       "--select", f"pod={scenario}", f"--at={w.end:.3f}",
                       "--duration", f"{w.end - w.start:.3f}")
        assert report_verdicts(proc.stdout) == live_verdicts, (store.base, proc.stdout,
                                                               live_out)
        assert proc.returncode == (1 if any(k != "none" for k in live_verdicts.values()) else 0)
        assert "long-term storage" in proc.stdout and "result: " in proc.stdout


def test_an_agent_restart_inside_the_window_is_counted_across_and_said(stores, tmp_path):
    """Two agents in turn for one pod, 3 s apart: the histogram's increase is the two runs'
    together (the second counted from 0, as increase() counts a reset), the restart and the gap
    are said, and the verdict is the scenario's."""
    vm, _ = stores
    first = agent_for("pcie-saturated", stores, tmp_path / "spool", namespace="restart")
    with running(first):
        first.start()
        first.more_cycles(8)
    # the pod stays down for 3 s, six intervals: a gap the report must say
    stopped = max(ts for _, _, ts, _ in first.sampled()) / 1000
    until(lambda: time.time() >= stopped + 3, 10, what="3 s without the agent")
    second = agent_for("pcie-saturated", stores, tmp_path / "spool", namespace="restart")
    with running(second):
        second.start()
        second.more_cycles(8)
    cycles = cycles_of([first, second])
    w = window_around(cycles)
    cfg = store_cfg(vm.base, "pcie-saturated", w, namespace="restart")

    (a0, a1), (_, b1) = requests_of(first), requests_of(second)

    judged = judged_once_stored(cfg, w, len(cycles), "both agents' cycles in VictoriaMetrics")
    gpu0 = next(v for v in judged.verdicts.values() if v.window.mean.index == "0")
    assert gpu0.key == "pcie"
    assert gpu0.window.requests == pytest.approx((a1 - a0) + b1)
    said = " ".join(gpu0.notes)
    assert "the agent restarted inside the window" in said
    assert "no cycle stored from" in said


def test_the_report_says_which_layer_moved_first(stores, tmp_path):
    """A GPU whose fragmentation was high all along, whose PCIe RX crossed 80 % at +30 s and whose
    p99 crossed the objective at +120 s (stored with past timestamps through the write path):
    the onsets come in that order, with their times."""
    vm, _ = stores
    start_ms = (int(time.time()) - 3600) * 1000
    times = list(range(start_ms, start_ms + 180_000, 1000))
    pcie_at, slow_at = start_ms + 30_000, start_ms + 120_000
    labels = gpu_labels("GPU-0a5e7000-0000-4000-8000-000000000001", 0, "onset", "web-1", "n1")
    series: dict = {}
    add_gpu(series, labels, times, {
        "gpu_sidecar_gpu_available": 1, "gpu_utilization_ratio": 0.97,
        "gpu_sm_occupancy_ratio": 0.6,
        "gpu_pcie_rx_bandwidth_util_ratio": lambda ts: 0.95 if ts >= pcie_at else 0.3,
        "gpu_pcie_tx_bandwidth_util_ratio": 0.1,
        "gpu_pcie_link_max_bytes_per_second": 63e9,
        "gpu_memory_fragmentation_ratio": 0.7, "gpu_allocator_reserved_bytes": 40 * 2**30,
        "latency": lambda ts: (50.0, 0.2 if ts >= slow_at else 0.0)})
    push(vm.write_url, series)
    end = (times[-1] + 1) / 1000
    proc = until(lambda: (p := run_cli(
        "diagnose", "--query-url", vm.base, "--select", "namespace=onset", f"--at={end:.3f}",
        "--duration", "180")) and "when it started" in p.stdout and p,
        30, interval=0.5, what="the backfilled GPU in VictoriaMetrics")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    text = " ".join(proc.stdout.split())
    text = text[text.index("when it started"):]
    frag = text.index("fragmentation (")
    pcie = text.index("pcie (")
    p99 = text.index("p99 above 250 ms from")
    assert frag < pcie < p99, text
    assert "fragmentation (the allocator" in text or "already at the window's start" in \
        text[frag:pcie]
    # each onset within one trailing window (18 s here: a tenth of 180 s) after the change
    found_pcie = text[pcie:].split(" from ", 1)[1][:8]
    found_p99 = text[p99:].split(" from ", 1)[1][:8]
    for found, at in ((found_pcie, pcie_at), (found_p99, slow_at)):
        t = time.strptime(found, "%H:%M:%S")
        seconds = (t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec)
        expected = int(at / 1000) % 86400
        assert 0 <= (seconds - expected) % 86400 <= 18, (found, clock(at / 1000))


class QueryProxy(LocalServer):
    """A proxy in front of a real store's query API that rewrites each JSON answer with
    ``mangle`` (the parsed answer in, the answer to send out), as a broken gateway, a
    merging proxy or a store of another kind would answer."""

    def __init__(self, target: str, mangle: Callable[[dict], object]) -> None:
        proxy = self
        self.asked = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                r = requests.post(target + self.path, data=body, timeout=30, headers={
                    "Content-Type": self.headers.get("Content-Type", "")})
                proxy.asked += 1
                out = r.content
                if r.status_code == 200:
                    out = json.dumps(mangle(r.json())).encode()
                answer_with(self, r.status_code, {"Content-Type": "application/json"}, out)

            def log_message(self, *args: object) -> None:
                pass

        self.base = self.serve(Handler, "")


def _each_series(mangle: Callable[[dict], None]) -> Callable[[dict], object]:
    def apply(doc: dict) -> object:
        for r in doc["data"]["result"]:
            mangle(r)
        return doc
    return apply


def _merged(doc: dict) -> dict:
    """Two stores' answers merged: every series twice, the second with other values."""
    twins = [{**r, "values": [[t, str(float(v) * 0.5 + 0.25)] for t, v in r["values"]]}
             for r in doc["data"]["result"]]
    doc["data"]["result"] += twins
    return doc


def _merged_samples(doc: dict) -> dict:
    """Two stores' samples merged into one series: each time twice, with different values."""
    for r in doc["data"]["result"]:
        r["values"] = sorted([*r["values"], *([t, "0"] for t, _ in r["values"])],
                             key=lambda p: p[0])
    return doc


def _first(key: str, change: Callable[[list], object]) -> Callable[[dict], None]:
    def apply(r: dict) -> None:
        r["values"][0] = change(r["values"][0])
    return apply


# each wrong shape of answer, and the words its exit-6 message must carry
MANGLED = {
    "a value that is a word": (_each_series(_first("values", lambda p: [p[0], "fast"])),
                               'the value "fast", not a number'),
    "a value that is an object": (_each_series(_first("values", lambda p: [p[0], {"v": 1}])),
                                  'the value {"v": 1}, not a number'),
    "a timestamp as a string": (_each_series(_first("values", lambda p: [str(p[0]), p[1]])),
                                "not a number of seconds"),
    "a sample of one element": (_each_series(_first("values", lambda p: [p[0]])),
                                "not a [time, value] pair"),
    "a sample of three elements": (_each_series(_first("values", lambda p: [*p, p[1]])),
                                   "not a [time, value] pair"),
    "metric: null": (_each_series(lambda r: r.update(metric=None)),
                     "metric is null, not an object of label strings"),
    "a label value that is a number": (
        _each_series(lambda r: r["metric"].update(gpu_index=0)),
        "not an object of label strings"),
    "values: null": (_each_series(lambda r: r.update(values=None)), "not a list of samples"),
    "result: null": (lambda d: {**d, "data": {**d["data"], "result": None}},
                     "result is null, not a list"),
    "data: a list": (lambda d: {**d, "data": [d["data"]]}, "no 'data' object"),
    "the answer a bare list": (lambda d: [d], "no 'data' object"),
    "every series twice, different values": (_merged, "the same series twice"),
    "every sample twice in its series": (_merged_samples, "out of order or twice"),
}


@pytest.fixture(scope="module")
def stored_agent(stores, tmp_path_factory) -> Window:
    """Twelve cycles of a pcie-saturated agent in the real VictoriaMetrics (namespace
    ``mangle``): the window around them."""
    agent = agent_for("pcie-saturated", stores, tmp_path_factory.mktemp("spool"),
                      namespace="mangle")
    with running(agent):
        agent.start()
        agent.more_cycles(CYCLES, "pushing")
    cycles = cycles_of([agent])
    w = window_around(cycles)
    judged_from_ns(stores[0].base, "mangle", w, len(cycles))
    return w


def judged_from_ns(url: str, namespace: str, w: Window, want_cycles: int):
    def ready():
        cfg = store_cfg(url, "pcie-saturated", w, namespace)
        store = Store(cfg)
        try:
            judged = judge_stored(fetch(store, cfg.select, w), w)
        finally:
            store.close()
        return judged if judged.cycles >= want_cycles else None
    return until(ready, 30, interval=0.5, what=f"{want_cycles} cycles of {namespace} in {url}")


def diagnose_at(url: str, w: Window, *more: str) -> subprocess.CompletedProcess[str]:
    return run_cli("diagnose", "--query-url", url, "--select", "namespace=mangle",
                   f"--at={w.end:.3f}", "--duration", f"{w.end - w.start:.3f}", *more)


def test_the_real_answer_through_the_proxy_is_the_finding(stores, stored_agent):
    """The proxy itself changes nothing when it mangles nothing: the pcie finding, exit 1."""
    proxy = QueryProxy(stores[0].base, lambda d: d)
    with running(proxy):
        proc = diagnose_at(proxy.base, stored_agent)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "verdict: pcie" in proc.stdout


@pytest.mark.parametrize("how", MANGLED)
def test_an_answer_of_the_wrong_shape_is_exit_6_saying_what_was_wrong(how, stores,
                                                                      stored_agent):
    mangle, said = MANGLED[how]
    proxy = QueryProxy(stores[0].base, mangle)
    with running(proxy):
        proc = diagnose_at(proxy.base, stored_agent)
    assert proc.returncode == 6, (how, proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "no Prometheus query API answer" in lines[0] and said in lines[0], lines[0]
    assert proxy.base.split("//")[1] in lines[0]  # which store, by its URL


def _restored(agent: Agent, namespace: str, change: Callable[[str, float], float]
              ) -> dict[SeriesKey, list[tuple[int, float]]]:
    """What ``agent`` sent, as another pod's (``namespace``), each value through ``change``
    (name, value): the agent's real series, written again with some values as a store might
    hold them."""
    series: dict[SeriesKey, list[tuple[int, float]]] = {}
    for name, labels, ts, value in agent.sampled():
        moved = tuple(sorted({**dict(labels), "namespace": namespace}.items()))
        series.setdefault((name, moved), []).append((ts, change(name, value)))
    return series


# Prometheus stores NaN as sent; VictoriaMetrics drops NaN at ingestion (it is then absent) and
# keeps the infinities: each store gets the non-finite value it holds
NOT_A_NUMBER = {"prometheus": math.nan, "victoria-metrics": math.inf}


@pytest.mark.parametrize("kind", NOT_A_NUMBER)
def test_pcie_figures_stored_as_not_a_number_are_not_judged_never_healthy(kind, stores,
                                                                          tmp_path):
    """A pcie-saturated agent's real series, written to a real store again with every PCIe ratio
    not a number: PCIe is not judged (said, per GPU), never 'none' with exit 0 (exit 6: the
    store held what no agent sends), and no figure is printed as 'nan %'."""
    vm, prom = stores
    store = prom if kind == "prometheus" else vm
    agent = agent_for("pcie-saturated", stores, tmp_path / "spool", namespace="nan-src")
    with running(agent):
        agent.start()
        agent.more_cycles(CYCLES, "pushing")
    pcie_ratio = re.compile(r"gpu_pcie_.*_ratio")
    bad = NOT_A_NUMBER[kind]
    push(store.write_url, _restored(agent, "nan", lambda name, v: bad
                                    if pcie_ratio.fullmatch(name) else v))
    w = window_around(cycles_of([agent]))

    def stored():
        proc = run_cli("diagnose", "--query-url", store.base, "--select", "namespace=nan",
                       f"--at={w.end:.3f}", "--duration", f"{w.end - w.start:.3f}")
        return proc if f"{len(cycles_of([agent]))} samples" in proc.stdout else None

    proc = until(stored, 30, interval=0.5, what=f"the {bad} copy in {store.base}")
    assert "nan %" not in proc.stdout.lower() and "inf %" not in proc.stdout.lower(), proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 6, proc.stdout + proc.stderr
    text = " ".join(proc.stdout.split())
    assert text.count("not judged where these figures feed it") == 2, text  # on each GPU
    assert "gpu_pcie_rx_bandwidth_util_ratio" in text, text
    assert "result: no finding in the figures read of 2 GPU(s), but GPU 0, 1 not judged " \
        "whole" in text, text
    assert "verdict: none" in text and "nothing found" not in text, text
    assert "not a number" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    as_json = run_cli("diagnose", "--query-url", store.base, "--select", "namespace=nan",
                      f"--at={w.end:.3f}", "--duration", f"{w.end - w.start:.3f}",
                      "--output", "json")
    doc = json.loads(as_json.stdout, parse_constant=pytest.fail)  # strict JSON: no NaN in it
    assert as_json.returncode == 6 == doc["result"]["code"], as_json.stdout
    assert "not judged whole" in doc["note"], doc["note"]


@pytest.mark.parametrize("kind", ("victoria-metrics", "prometheus"))
def test_a_window_after_the_agent_stopped_is_exit_2_saying_why(kind, stores, stored_agent):
    """A window just after the agent's last cycle: the cycles fetched from before it (for the
    rare figures) make no GPU of the window; no GPU matched (exit 2), and the message says the
    selector matches GPUs lately, never 'nothing found on 0 GPU(s)'."""
    vm, prom = stores
    store = prom if kind == "prometheus" else vm
    after = stored_agent.end + 3
    until(lambda: time.time() > after + 0.5, 10, what="the window after the agent stopped")
    proc = run_cli("diagnose", "--query-url", store.base, "--select", "namespace=mangle",
                   f"--at={after:.3f}", "--duration", "2")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert "no GPU series in the window" in proc.stderr, proc.stderr
    assert "2 GPU(s) match it in the last 7 days" in proc.stderr, proc.stderr


@pytest.mark.parametrize("label", ("gpu_uuid", "__name__"))
def test_series_without_a_gpu_label_or_a_name_are_exit_2_saying_why(label, stores,
                                                                    stored_agent):
    """Every series answered without its GPU label (or its name: then series of one GPU differ
    by nothing, a shape no query API answers): never 'nothing found on 0 GPU(s)', exit 0."""
    proxy = QueryProxy(stores[0].base, _each_series(lambda r: r["metric"].pop(label, None)))
    with running(proxy):
        proc = diagnose_at(proxy.base, stored_agent)
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stdout + proc.stderr
    if label == "gpu_uuid":
        assert proc.returncode == 2, proc.stderr
        assert "none that is a GPU's figure" in proc.stderr, proc.stderr
    else:
        assert proc.returncode == 6, proc.stderr
        assert "the same series twice" in proc.stderr, proc.stderr


def test_a_window_longer_than_the_data_is_said_and_its_onsets_are_from_the_first_cycle(
        stores, stored_agent):
    """--duration 120 over an agent that ran a few seconds: the window line says how much of it
    holds cycles, and the pcie finding held 'from the first stored cycle', never 'already at the
    window's start' (the window's start held nothing)."""
    proc = run_cli("diagnose", "--query-url", stores[0].base, "--select", "namespace=mangle",
                   f"--at={stored_agent.end:.3f}", "--duration", "120")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    text = " ".join(proc.stdout.split())
    held = re.search(r"the window holds only (\d+) s of stored cycles, from (\S+) to (\S+) "
                     r"\(the agents' first cycle came after its start\)", text)
    assert held, text
    assert int(held[1]) <= stored_agent.end - stored_agent.start + 2, held[0]
    assert "already at the window's start" not in text, text
    assert re.search(r"pcie \([^)]*\) from the first stored cycle, at " + held[2], text), text


def test_a_window_within_the_data_says_nothing_of_what_it_holds(stores, stored_agent):
    """The window around the agent's cycles: no 'holds only' (the pin of the other side)."""
    proc = diagnose_at(stores[0].base, stored_agent)
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 1 and "holds only" not in text, text
    assert "already at the window's start" in text, text


def test_two_pods_reporting_one_gpu_uuid_get_a_verdict_each(stores, tmp_path):
    """A rollout's old and new pod (or a time-sliced GPU): two real agents with different pod
    labels and the same simulated GPUs, in one window of the real VictoriaMetrics: a verdict per
    pod and GPU (4), each block naming its pod, neither replacing the other."""
    vm, _ = stores
    agents = [agent_for("pcie-saturated", stores, tmp_path / pod, namespace="twopods")
              for pod in ("old", "new")]
    for agent, pod in zip(agents, ("web-old", "web-new"), strict=True):
        agent.args[agent.args.index("--pod-name") + 1] = pod
    with running(*agents):
        for agent in agents:
            agent.start()
        for agent in agents:
            agent.more_cycles(8, "pushing")
    cycles = cycles_of(agents)
    w = window_around(cycles)
    gpus = {(dict(lab)["gpu_index"], dict(lab)["gpu_uuid"]) for a in agents
            for n, lab, _, _ in a.sampled() if n == "gpu_utilization_ratio"}
    assert len(gpus) == 2  # the same two simulated GPUs in both pods

    def both():
        p = run_cli("diagnose", "--query-url", vm.base, "--select", "namespace=twopods",
                    f"--at={w.end:.3f}", "--duration", f"{w.end - w.start:.3f}")
        return p if p.stdout.count("verdict: pcie") == 4 else None

    proc = until(both, 30, interval=0.5, what="both pods' cycles in VictoriaMetrics")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    heads = [line for line in proc.stdout.splitlines() if line.startswith("GPU ")]
    assert sorted(heads) == sorted(
        f"GPU {i}  Simulated NVIDIA H200  {u} (pod twopods/{pod}, node node-a)"
        for pod in ("web-old", "web-new") for i, u in gpus), heads
    assert "a bottleneck on 4 of 4 GPU(s)" in proc.stdout, proc.stdout
    result = proc.stdout.strip().splitlines()[-1]
    for pod in ("web-old", "web-new"):
        for i, _ in gpus:
            assert f"GPU {i} (pod twopods/{pod}, node node-a) pcie" in result, result
    # the document for scripts names them as the text does
    doc = json.loads(run_cli("diagnose", "--query-url", vm.base, "--select", "namespace=twopods",
                             f"--at={w.end:.3f}", "--duration", f"{w.end - w.start:.3f}",
                             "--output", "json").stdout)
    assert sorted(doc["result"]["findings"]) == sorted(
        f"GPU {i} (pod twopods/{pod}, node node-a) pcie"
        for pod in ("web-old", "web-new") for i, _ in gpus)
    assert len({g["key"] for g in doc["gpus"]}) == 4


@pytest.mark.parametrize("at", ("0001-01-01T00:00:00Z", "0001-01-01T00:00:00+14:00",
                                "now-99999999999d", "now-" + "9" * 400 + "d", "9" * 400))
def test_an_at_no_store_can_hold_is_exit_2_saying_so(at, stores):
    """Times before the Unix epoch, or beyond any calendar: refused as a bad option (exit 2),
    one line, no traceback, whatever the store holds."""
    proc = run_cli("diagnose", "--query-url", stores[0].base, f"--at={at}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "--at" in proc.stderr, proc.stderr


_OFFSETS = st.builds(datetime.timezone, st.timedeltas(
    min_value=-datetime.timedelta(hours=23, minutes=59),
    max_value=datetime.timedelta(hours=23, minutes=59)))
AT_TEXTS = st.one_of(
    st.text(max_size=40),
    st.datetimes(timezones=_OFFSETS).map(datetime.datetime.isoformat),
    st.datetimes().map(datetime.datetime.isoformat),
    st.builds(lambda n, u: f"now-{n}{u}", st.integers(min_value=0, max_value=10**30),
              st.sampled_from("smhdw")),
    st.builds(lambda n, u: f"-{n}{u}", st.floats(min_value=0, allow_nan=False).map(repr),
              st.sampled_from("smhdw")),
    st.integers(min_value=0).map(str), st.floats(allow_nan=True).map(repr),
    st.sampled_from(["now", "0", "-0s", "1970-01-01T00:00:00Z"]))


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(at=AT_TEXTS, seconds=st.sampled_from(["1", "600", "3600"]))
def test_any_at_is_a_bad_option_or_a_window_a_store_can_be_asked_for(at, seconds):
    """Property: whatever --at says, the command line refuses it (exit 2: a configuration error,
    or window_of's Refused) or gives a window from Unix time 0 on, not in the future, whose
    ends the report can print; never another exception (a traceback, exit 1)."""
    args = cli._parser().parse_args(["diagnose", "--query-url", "http://127.0.0.1:9",
                                     f"--at={at}", f"--duration={seconds}"])
    try:
        cfg = config.build("diagnose", args, env={}, choices=cli.CHOICES)
        w = window_of(cfg, now=1.8e9)
    except (config.ConfigError, Refused):
        return
    assert 0 <= w.start <= w.end <= 1.8e9 + 60, (at, w)
    assert w.shown() and clock(w.start) and clock(w.end)


@pytest.mark.parametrize("kind", ("victoria-metrics", "prometheus"))
def test_the_write_url_given_as_the_query_url_is_exit_6_naming_the_write_path(kind, stores):
    """VictoriaMetrics answers 400 'unsupported path', Prometheus 404: neither is a refusal of the
    query (exit 8, with advice to raise a limit) but no query API at that URL (exit 6)."""
    vm, prom = stores
    store = prom if kind == "prometheus" else vm
    proc = run_cli("diagnose", "--query-url", store.write_url)
    assert proc.returncode == 6, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "is a write path" in proc.stderr and "maxUniqueTimeseries" not in proc.stderr, \
        proc.stderr


def _answering(status: int, body: bytes) -> tuple[LocalServer, str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            answer_with(self, status, {"Content-Type": "text/plain"}, body)

        def log_message(self, *args: object) -> None:
            pass

    server = LocalServer()
    return server, server.serve(Handler, "")


def test_a_503_with_the_store_s_reason_is_a_refusal_exit_8():
    """Pinned: a store (or its gateway) that answers 503 is refusing the query (overloaded,
    too many concurrent queries), exit 8 with its reason, not 'unreachable' (6)."""
    server, url = _answering(503, b"too many concurrent requests: -search.maxConcurrentRequests")
    with running(server):
        proc = run_cli("diagnose", "--query-url", url)
    assert proc.returncode == 8, proc.stdout + proc.stderr
    assert "refused the query (503: too many concurrent requests" in proc.stderr, proc.stderr


def test_two_agent_restarts_in_one_window_count_the_histogram_over_all_three_runs(
        stores, tmp_path):
    """Pinned: three agents in turn for one pod (two restarts, each after a gap): the
    histogram's increase is the three runs' together, each later run counted from 0 on top of
    everything before it (as increase() counts two resets), and both restarts are said."""
    vm, _ = stores
    runs: list[Agent] = []
    for _ in range(3):
        if runs:  # down for 3 s (six intervals) between runs
            stopped = max(ts for _, _, ts, _ in runs[-1].sampled()) / 1000
            until(lambda s=stopped: time.time() >= s + 3, 10, what="3 s without the agent")
        agent = agent_for("pcie-saturated", stores, tmp_path / "spool", namespace="restart2")
        with running(agent):
            agent.start()
            agent.more_cycles(6)
        runs.append(agent)
    cycles = cycles_of(runs)
    w = window_around(cycles)
    cfg = store_cfg(vm.base, "pcie-saturated", w, namespace="restart2")

    (a0, a1), (_, b1), (_, c1) = (requests_of(a) for a in runs)

    judged = judged_once_stored(cfg, w, len(cycles), "the three runs' cycles in VictoriaMetrics")
    gpu0 = next(v for v in judged.verdicts.values() if v.window.mean.index == "0")
    assert gpu0.window.requests == pytest.approx((a1 - a0) + b1 + c1)
    said = next(n for n in gpu0.notes if "the agent restarted inside the window" in n)
    at = said.split("(at ", 1)[1].split(")", 1)[0]
    assert len(re.findall(r"\d\d:\d\d:\d\d", at)) == 2, said  # both restarts' times


def _backfilled(namespace: str, start_ms: int, seconds: int, figures: dict
                ) -> tuple[float, list[int], dict, tuple[tuple[str, str], ...]]:
    """One GPU's series every second for ``seconds`` from ``start_ms``: the window's end, the
    times, the series and the GPU's labels."""
    times = list(range(start_ms, start_ms + seconds * 1000, 1000))
    labels = gpu_labels(f"GPU-{namespace.encode().hex()[:8]}-0000-4000-8000-000000000001", 0,
                        namespace, "web-1", "n1")
    series: dict = {}
    add_gpu(series, labels, times, figures)
    return (times[-1] + 1) / 1000, times, series, labels


def _pushed_and_stored(vm: VictoriaMetrics, namespace: str, series: dict) -> None:
    """Every sample of ``series`` written and searchable (VictoriaMetrics makes rows searchable
    up to a second after it acknowledged them): no test judges half a backfill."""
    sent = push(vm.write_url, series)
    until(lambda: len(vm.samples(f'{{namespace="{namespace}"}}')) >= sent, 30, interval=0.5,
          what=f"{sent} samples of {namespace} searchable")


def _an_hour_ago_ms() -> int:
    return (int(time.time()) - 3600) * 1000


HEALTHY_FIGURES = {
    "gpu_sidecar_gpu_available": 1, "gpu_utilization_ratio": 0.9, "gpu_sm_occupancy_ratio": 0.6,
    "gpu_pcie_tx_bandwidth_util_ratio": 0.1, "gpu_pcie_link_max_bytes_per_second": 63e9,
    "gpu_memory_fragmentation_ratio": 0.1, "gpu_allocator_reserved_bytes": 40 * 2**30,
    "latency": (50.0, 0.0)}


def test_cycles_fetched_from_before_the_window_are_never_judged(stores):
    """Pinned: the 60 s before the window (fetched for the rare figures) had PCIe RX at 100 %,
    the window's 50 s at 70 %: judged on the window's 50 cycles alone, none (70 % < 80 %); the
    110 cycles together would be pcie (86 %)."""
    vm, _ = stores
    start = _an_hour_ago_ms()
    end, _, series, _ = _backfilled("before", start, 110, {
        **HEALTHY_FIGURES,
        "gpu_pcie_rx_bandwidth_util_ratio": lambda ts: 1.0 if ts < start + 60_000 else 0.7})
    _pushed_and_stored(vm, "before", series)
    proc = until(lambda: (p := run_cli(
        "diagnose", "--query-url", vm.base, "--select", "namespace=before", f"--at={end:.3f}",
        "--duration", "50")) and "samples" in p.stdout and p, 30, interval=0.5,
        what="the backfilled GPU in VictoriaMetrics")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "50 samples over 50.0 s" in proc.stdout and "PCIe RX 70.0 %" in proc.stdout, \
        proc.stdout
    assert "verdict: none" in proc.stdout


def test_a_rare_figure_sent_before_the_window_stands_in_its_first_cycles(stores):
    """Pinned: a failed row remap sent once, 30 s before the window (the rare figures are sent
    on change and every minute), and never again within it: it stands in the window's cycles as
    the store's look-back would, and the GPU is a hardware fault, exit 1."""
    vm, _ = stores
    end, times, series, labels = _backfilled("rare", _an_hour_ago_ms(), 90, {
        **HEALTHY_FIGURES, "gpu_pcie_rx_bandwidth_util_ratio": 0.2})
    series[("gpu_row_remap_failed", labels)] = [(times[30], 1.0)]  # 60 s before the end
    _pushed_and_stored(vm, "rare", series)
    proc = until(lambda: (p := run_cli(
        "diagnose", "--query-url", vm.base, "--select", "namespace=rare", f"--at={end:.3f}",
        "--duration", "30")) and "samples" in p.stdout and p, 30, interval=0.5,
        what="the backfilled GPU in VictoriaMetrics")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "verdict: hardware-fault" in proc.stdout, proc.stdout


# Prometheus' staleness marker: the NaN whose bits end a series (as a clean stop sends it)
STALE_NAN = struct.unpack("<d", struct.pack("<Q", 0x7FF0000000000002))[0]


def test_a_clean_stop_s_staleness_markers_inside_the_window_are_no_unreadable_figure(
        stores, tmp_path):
    """A real agent's series ended by staleness markers (a clean stop sends one per series;
    VictoriaMetrics answers them as NaN in a raw range, Prometheus leaves them out), then the
    agent started again: the markers end the series, never 'not a number' (exit 6); the
    verdict is the scenario's, exit 1."""
    vm, prom = stores
    runs = []
    for _ in range(2):
        agent = agent_for("pcie-saturated", stores, tmp_path / "spool", namespace="stale")
        with running(agent):
            agent.start()
            agent.more_cycles(6, "pushing")
        runs.append(agent)
        stopped = max(ts for _, _, ts, _ in agent.sampled())
        if not _ended_in(vm, "stale", stopped):  # an agent that sends no markers: as it would
            ended = {(n, lab) for n, lab, _, _ in agent.sampled()}
            for store in (vm, prom):
                push(store.write_url, {key: [(stopped + 200, STALE_NAN)] for key in ended})
    w = window_around(cycles_of(runs))
    w = Window(w.start, w.end + 1)  # the second run's markers too
    for store in (vm, prom):
        proc = until(lambda s=store: (p := run_cli(
            "diagnose", "--query-url", s.base, "--select", "namespace=stale",
            f"--at={w.end:.3f}", "--duration", f"{w.end - w.start:.3f}"))
            and f"{len(cycles_of(runs))} samples" in p.stdout and p, 30, interval=0.5,
            what=f"both runs in {store.base}")
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "not a number" not in proc.stdout and proc.stderr == "", proc.stdout
        assert proc.stdout.count("verdict: pcie") == 2
    assert _ended_in(vm, "stale", max(ts for _, _, ts, _ in runs[0].sampled()))  # as NaN


def _ended_in(vm: VictoriaMetrics, namespace: str, after_ms: int, wait_s: float = 5.0) -> bool:
    """Whether VictoriaMetrics answers a NaN (a staleness marker) after ``after_ms`` for the
    namespace's GPU utilization, within ``wait_s`` (it makes rows searchable up to a second
    after their write)."""
    def found() -> bool:
        raw = requests.post(f"{vm.base}/api/v1/query", data={
            "query": f'{{__name__="gpu_utilization_ratio",namespace="{namespace}"}}[1h]'},
            timeout=10).json()["data"]["result"]
        return any(v == "NaN" and t * 1000 > after_ms for r in raw for t, v in r["values"])
    deadline = time.monotonic() + wait_s
    while not found():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True


def test_a_window_ending_long_after_the_data_says_so_and_a_push_s_lag_does_not(stores):
    """30 s of cycles an hour ago: a window ending 100 s after them says both ends; one ending
    30 s after (a push interval and ingestion behind, as any --at now is) says only its start."""
    vm, _ = stores
    end, _, series, _ = _backfilled("lateend", _an_hour_ago_ms(), 30, {
        **HEALTHY_FIGURES, "gpu_pcie_rx_bandwidth_util_ratio": 0.2})
    _pushed_and_stored(vm, "lateend", series)

    def said(after: float, seconds: float) -> str:
        proc = run_cli("diagnose", "--query-url", vm.base, "--select", "namespace=lateend",
                       f"--at={end + after:.3f}", "--duration", f"{seconds:g}")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return " ".join(proc.stdout.split())

    both = said(100, 200)
    assert "the window holds only 30 s of stored cycles" in both, both
    assert "(the agents' first cycle came after its start and their last before its end)" in \
        both, both
    lag = said(30, 100)
    assert "(the agents' first cycle came after its start)" in lag, lag


def test_output_json_from_the_store_is_the_report_as_one_document(stores, stored_agent):
    """--output json with --query-url: one document (origin 'store') with the text's verdicts
    and window line, its result code the exit code."""
    text = diagnose_at(stores[0].base, stored_agent)
    proc = diagnose_at(stores[0].base, stored_agent, "--output", "json")
    assert proc.returncode == 1 == text.returncode, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["schema"] == "gpu-sidecar/diagnose/v1" and doc["origin"] == "store"
    assert [g["verdict"] for g in doc["gpus"]] == ["pcie", "pcie"]
    assert doc["result"]["code"] == 1 and "long-term storage" in doc["source"]
    assert " ".join(doc["source"].split()) in " ".join(text.stdout.split())


def test_a_native_histogram_s_series_is_passed_over_not_a_wrong_shape(stores, stored_agent):
    """Prometheus answers a native histogram's samples as 'histograms', no 'values': no float
    figure of ours, passed over (the rest judged), not exit 6."""
    def native(r: dict) -> None:
        if r["metric"].get("__name__") == "gpu_utilization_ratio":
            r["histograms"] = [[t, {"count": "1", "sum": v, "buckets": []}]
                               for t, v in r.pop("values")]
    proxy = QueryProxy(stores[0].base, _each_series(native))
    with running(proxy):
        proc = diagnose_at(proxy.base, stored_agent)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "verdict: pcie" in proc.stdout and "utilization absent" in proc.stdout, proc.stdout
