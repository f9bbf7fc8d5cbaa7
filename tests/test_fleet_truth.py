"""``gpu-sidecar fleet`` says what it knows about each pod's GPU, from real agents in a real
VictoriaMetrics and a real Prometheus (issue #44):

- one line per pod and GPU: two pods reporting one GPU UUID in the window (a rollout's old and
  new pod, a time-sliced GPU) are two lines, each marked as shared with the other;
- an agent that stopped cleanly, or fell silent, is told apart with the time it was last seen:
  its last verdict is listed as its last, never as a finding now, and the exit code says so.
"""

from __future__ import annotations

import http.server
import json
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import parse_qs

import pytest
import requests

from sidecar.commands.fleet import SILENT_FLOOR_S
from sidecar.recent import CURRENT_S
from sidecar.simulate.scenarios import simulated_uuid
from sidecar.units import pct
from tests.conftest import run_cli
from tests.receivers import (
    Agent,
    LocalServer,
    Prometheus,
    VictoriaMetrics,
    answer_with,
    running,
)
from tests.stored import fleet_series, push
from tests.waiting import until


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real VictoriaMetrics and a real Prometheus, each taking every agent's pushes."""
    vm = VictoriaMetrics(tmp_path_factory.mktemp("vm"))
    prom = Prometheus(tmp_path_factory.mktemp("prom"))
    with running(vm, prom):
        vm.start()
        prom.start()
        yield {"victoria-metrics": vm.base, "prometheus": prom.base,
               "vm-write": vm.write_url, "prom-write": prom.write_url}


def agent(stores: dict[str, str], spool: Path, scenario: str, namespace: str, pod: str,
          node: str = "gpu-node-1") -> Agent:
    return Agent(["--simulate", scenario, "--interval", "0.5", "--push-interval", "1",
                  "--remote-write-url", stores["vm-write"],
                  "--remote-write-url", stores["prom-write"], "--spool-dir", str(spool),
                  "--retry-max-backoff", "0.5", "--shutdown-timeout", "5",
                  "--pod-namespace", namespace, "--pod-name", pod, "--node-name", node])


def fleet(url: str, namespace: str, *extra: str) -> tuple[int, dict, str]:
    out = run_cli("fleet", "--query-url", url, "--select", f"namespace={namespace}",
                  "--duration", "300", "--output", "json", *extra)
    return out.returncode, json.loads(out.stdout) if out.stdout else {}, out.stderr


def lines(doc: dict) -> dict[tuple[str, str], dict]:
    """(pod, GPU UUID) -> its line, with its group."""
    return {(g["pod"], g["uuid"]): {**g, "group": group["verdict"]}
            for group in doc.get("groups", []) for g in group["gpus"]}


@pytest.mark.parametrize("store", ["victoria-metrics", "prometheus"])
def test_two_pods_reporting_one_gpu_are_two_lines_each_marked_shared(stores, tmp_path, store):
    """A rollout: the old pod and the new one run side by side on the same two GPUs (the same
    simulated UUIDs). Keyed by UUID alone the fleet folded them into two lines named after one
    pod; each pod's GPU is its own line, saying the other pod has it too."""
    ns = f"shared-{store}"
    old = agent(stores, tmp_path / "old", "fragmented", ns, "web-old", "gpu-node-1")
    new = agent(stores, tmp_path / "new", "fragmented", ns, "web-new", "gpu-node-2")
    uuids = {simulated_uuid("fragmented", i) for i in range(2)}
    with running(old, new):
        old.start()
        new.start()
        old.more_cycles(6)
        new.more_cycles(6)
        code, doc, err = until(lambda: (r := fleet(stores[store], ns)) and r[1].get("gpus") == 4
                               and r, 30, interval=0.5, what=f"both pods' GPUs in {store}")
    assert code == 1, err
    assert doc["distinct_gpus"] == 2 and doc["found"] == 4
    seen = lines(doc)
    assert set(seen) == {(pod, u) for pod in ("web-old", "web-new") for u in uuids}
    for (pod, _), g in seen.items():
        assert g["group"] == "fragmentation" and g["state"] == "current"
        assert g["node"] == ("gpu-node-1" if pod == "web-old" else "gpu-node-2")
        other = "web-new" if pod == "web-old" else "web-old"
        assert g["shared_with"] == [f"{ns}/{other}"]
        assert g["figure"].startswith("fragmentation ") and "absent" not in g["figure"]
    text = run_cli("fleet", "--query-url", stores[store], "--select", f"namespace={ns}",
                   "--duration", "300")
    assert f"{ns}/web-old  node gpu-node-1" in text.stdout
    assert f"shared: also in pod {ns}/web-new" in text.stdout
    assert "4 GPU(s) with data" in text.stdout and "(2 distinct, 2 reported by more than one" \
        in text.stdout


@pytest.mark.parametrize("store", ["victoria-metrics", "prometheus"])
def test_a_stopped_or_silent_agent_s_last_verdict_is_its_last_never_a_finding_now(
        stores, tmp_path, store):
    """Three agents in one namespace: one with a finding stops cleanly (SIGTERM), one with a
    finding is killed (SIGKILL), one healthy runs on. The stopped agent's last gpu_verdict 1 is
    the store's last value for its whole look-back: the fleet lists it as stopped with the time
    of its last cycle, the killed one as silent once nothing came for the silence bound, and
    only the running agent is judged now (exit 0: nothing found on what was seen)."""
    ns = f"ended-{store}"
    stopped = agent(stores, tmp_path / "stopped", "fragmented", ns, "batch-0")
    killed = agent(stores, tmp_path / "killed", "pcie-saturated", ns, "web-0")
    live = agent(stores, tmp_path / "live", "healthy", ns, "serve-0")
    with running(stopped, killed, live):
        for a in (stopped, killed, live):
            a.start()
        for a in (stopped, killed, live):
            a.more_cycles(int(CURRENT_S / 0.5 / 4))
        # all three current, two findings
        code, doc, err = until(lambda: (r := fleet(stores[store], ns)) and r[1].get("found") == 4
                               and r[1].get("current") == 6 and r, 40, interval=0.5,
                               what=f"the three agents current in {store}")
        assert code == 1, err
        assert stopped.stop() == 0, "".join(stopped.err)[-2000:]
        killed.signal(signal.SIGKILL)
        killed.wait()
        last_cycle = max(ts for n, _, ts, _ in stopped.sampled() if n == "gpu_sidecar_up") / 1000
        assert stopped.last("gpu_sidecar_up") == 0.0
        killed_last = max(ts for n, _, ts, _ in killed.sampled() if n == "gpu_sidecar_up") / 1000

        def settled() -> tuple[int, dict, str] | None:
            r = fleet(stores[store], ns)
            groups = {g["verdict"]: g["count"] for g in r[1].get("groups", [])}
            return r if groups == {"none": 2, "stopped": 2, "silent": 2} else None

        code, doc, err = until(settled, 30 + SILENT_FLOOR_S, interval=0.5,
                               what=f"the stopped and the killed agent told apart in {store}")
        assert code == 0, err  # nothing found on the GPUs seen now; the others not judged
        assert doc["found"] == 0 and doc["current"] == 2 and doc["gpus"] == 6
        assert [g["verdict"] for g in doc["groups"]] == ["none", "stopped", "silent"]
        seen = lines(doc)
        for (pod, _), g in seen.items():
            if pod == "batch-0":
                assert (g["group"], g["state"], g["last_verdict"]) == (
                    "stopped", "stopped", "fragmentation")
                # its last cycle, the clean stop's gpu_sidecar_up 0 (Prometheus answers nothing
                # from its staleness markers on, 1 ms later: the cycle a subquery's step saw)
                assert last_cycle - 2 * 0.5 - 0.1 <= g["last_seen"] <= last_cycle + 0.001
            elif pod == "web-0":
                assert (g["group"], g["state"], g["last_verdict"]) == ("silent", "silent", "pcie")
                assert g["last_seen"] <= killed_last + 0.001
                assert g["last_seen"] >= killed_last - 2, "not its last stored cycle"
            else:
                assert (g["group"], g["state"]) == ("none", "current")
        text = run_cli("fleet", "--query-url", stores[store], "--select", f"namespace={ns}",
                       "--duration", "300")
        assert text.returncode == 0
        out = text.stdout
        assert "stopped (2): their agents stopped cleanly" in out
        assert "last verdict fragmentation: fragmentation " in out and "last seen " in out
        assert "silent (2): their agents fell silent" in out and "last verdict pcie: PCIe " in out
        assert out.rstrip().splitlines()[-1] == (
            "result: nothing found on 2 GPU(s); not judged now: 2 of stopped agents, "
            "2 of silent agents")
        assert "pcie (" not in out and "fragmentation (" not in out
        # the stopped pod alone: no agent seen at the window's end, said, exit 2
        alone = run_cli("fleet", "--query-url", stores[store], "--select", f"namespace={ns}",
                        "--select", "pod=batch-0", "--duration", "300")
        assert alone.returncode == 2, alone.stderr
        assert "no agent was seen at the window's end" in alone.stderr
        assert alone.stdout.rstrip().splitlines()[-1].startswith(
            "result: no agent seen at the window's end")
        # the window while it ran: its verdict current then, a finding
        during = run_cli("fleet", "--query-url", stores[store], "--select", f"namespace={ns}",
                         "--select", "pod=batch-0", f"--at={last_cycle - 1:.3f}", "--duration",
                         "60", "--output", "json")
        assert during.returncode == 1, during.stderr
        assert [g["verdict"] for g in json.loads(during.stdout)["groups"]] == ["fragmentation"]


def stored_mean(url: str, name: str, g: dict, at: float, span: int) -> float:
    """The store's own mean of one pod's GPU's series over the window."""
    match = f'namespace="{g["namespace"]}",pod="{g["pod"]}",gpu_uuid="{g["uuid"]}"'
    r = requests.post(f"{url}/api/v1/query", data={
        "query": f"avg_over_time({name}{{{match}}}[{span}s])",
        "time": f"{at:.3f}"}, timeout=30)
    r.raise_for_status()
    [row] = r.json()["data"]["result"]
    return float(row["value"][1])


@pytest.mark.parametrize("store", ["victoria-metrics", "prometheus"])
def test_the_deciding_figure_printed_is_the_stored_one_on_nvlink_c2c_and_a_hardware_fault(
        stores, tmp_path, store):
    """NVLink saturated with TX above RX (the all-reduce's 90 % and 88 %), NVLink-C2C with RX
    saturated, a hardware fault without a critical Xid: the figure beside each GPU is the
    larger direction's mean as the store computes it, and a GPU with no critical Xid counter
    says none was seen (not 'absent'). The header says what gpu_verdict covers: the last
    CURRENT_S seconds."""
    ns = f"links-{store}"
    agents = [agent(stores, tmp_path / s, s, ns, f"{s}-0")
              for s in ("nvlink-saturated", "grace-hopper", "hardware-fault")]
    with running(*agents):
        for a in agents:
            a.start()
        for a in agents:
            a.more_cycles(8)

        span = 60

        def judged() -> tuple[float, tuple[int, dict, str]] | None:
            """A window ending a second before the newest cycle printed, all three judged."""
            at = max(ts for a in agents for n, _, ts, _ in a.sampled()) / 1000 - 1
            r = fleet(stores[store], ns, f"--at={at:.3f}", "--duration", str(span))
            groups = {g["verdict"]: g["count"] for g in r[1].get("groups", [])}
            wanted = {"nvlink": 8, "c2c": 1, "hardware-fault": 1}
            return (at, r) if wanted.items() <= groups.items() else None

        at, (code, doc, err) = until(judged, 40, interval=0.5,
                                     what=f"the three agents' verdicts in {store}")
        text = run_cli("fleet", "--query-url", stores[store], "--select", f"namespace={ns}",
                       f"--at={at:.3f}", "--duration", str(span))
    assert code == 1, err
    groups = {g["verdict"]: g["gpus"] for g in doc["groups"]}
    url = stores[store]
    for g in groups["nvlink"]:
        tx, rx = (stored_mean(url, f"gpu_nvlink_{d}_bandwidth_util_ratio", g, at, span) for d in ("tx", "rx"))
        assert tx > rx, "the scenario's TX is the saturated direction"
        assert g["figure"].startswith(f"NVLink {pct(tx)} of its maximum"), (g["figure"], tx, rx)
        assert pct(rx) != pct(tx)
    [c2c] = groups["c2c"]
    tx, rx = (stored_mean(url, f"gpu_c2c_{d}_bandwidth_util_ratio", c2c, at, span) for d in ("tx", "rx"))
    assert rx > tx and c2c["figure"].startswith(f"NVLink-C2C {pct(rx)} of its maximum")
    [fault] = groups["hardware-fault"]
    assert fault["figure"].startswith("no critical Xid seen, uncorrected ECC ")
    assert "absent" not in fault["figure"] and "not stored" not in fault["figure"]
    assert f"gpu_verdict, its judgement over its last {CURRENT_S:g} s" in text.stdout
    assert "minute" not in text.stdout


# -- a store's answers of the wrong shape, and odd but valid ones ------------------------------


class Mangler(LocalServer):
    """A proxy in front of a real store's query API that rewrites each 200 JSON answer with
    ``mangle(query, answer)``: a broken gateway, a merging proxy, a store of another kind."""

    def __init__(self, target: str, mangle: Callable[[str, dict], object]) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                r = requests.post(target + self.path, data=body, timeout=30, headers={
                    "Content-Type": self.headers.get("Content-Type", "")})
                out = r.content
                if r.status_code == 200:
                    query = parse_qs(body.decode()).get("query", [""])[0]
                    out = json.dumps(mangle(query, r.json())).encode()
                answer_with(self, r.status_code, {"Content-Type": "application/json"}, out)

            def log_message(self, *args: object) -> None:
                pass

        self.base = self.serve(Handler, "")


def _rows(change: Callable[[dict], object]) -> Callable[[str, dict], object]:
    def apply(query: str, doc: dict) -> object:
        for r in doc["data"]["result"]:
            change(r)
        return doc
    return apply


def _twice(query: str, doc: dict) -> dict:
    doc["data"]["result"] += [{**r, "value": [r["value"][0], "0.5"]}
                              for r in doc["data"]["result"]]
    return doc


# each wrong shape of a vector answer, and the words of its exit-6 message
WRONG = {
    "a value that is a word": (_rows(lambda r: r.update(value=[r["value"][0], "fast"])),
                               'the value "fast", not a number'),
    "a value that is an object": (_rows(lambda r: r.update(value=[r["value"][0], {"v": 1}])),
                                  "not a number"),
    "a time as a string": (_rows(lambda r: r.update(value=[str(r["value"][0]), "1"])),
                           "not a number of seconds"),
    "metric: null": (_rows(lambda r: r.update(metric=None)), "not an object of label strings"),
    "result: null": (lambda q, d: {**d, "data": {**d["data"], "result": None}},
                     "result is null, not a list"),
    "the answer a bare list": (lambda q, d: [d], "no 'data' object"),
    "every series twice, different values": (_twice, "the same series twice"),
}


@pytest.fixture(scope="module")
def backfilled(stores) -> float:
    """A synthetic fleet of 10 GPUs (a pcie one among them) in the real VictoriaMetrics,
    ending an hour ago; the window's end, once stored."""
    end_ms = (int(time.time()) - 3600) * 1000
    series, _ = fleet_series(10, end_ms - 600_000, end_ms, 15_000, namespace="garbage")
    push(stores["vm-write"], series)
    end = end_ms / 1000
    until(lambda: garbage_fleet(stores["victoria-metrics"], end).returncode == 1, 30,
          interval=0.5, what="the synthetic fleet stored")
    return end


def garbage_fleet(url: str, end: float, *extra: str) -> subprocess.CompletedProcess:
    return run_cli("fleet", "--query-url", url, "--select", "namespace=garbage", f"--at={end}",
                   "--duration", "600", *extra)


@pytest.mark.parametrize("how", WRONG)
def test_a_store_answer_of_the_wrong_shape_is_exit_6_never_a_traceback(how, stores, backfilled):
    mangle, said = WRONG[how]
    proxy = Mangler(stores["victoria-metrics"], mangle)
    with running(proxy):
        out = garbage_fleet(proxy.base, backfilled)
    assert out.returncode == 6, (how, out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert said in out.stderr and "no Prometheus query API answer" in out.stderr, out.stderr


def _nan_aggregates(query: str, doc: dict) -> dict:
    """Every aggregate over the window (the deciding figures, the last-seen query) answered
    NaN; the agents' verdicts as stored."""
    if "_over_time(" in query and "gpu_verdict" not in query:
        for r in doc["data"]["result"]:
            r["value"] = [r["value"][0], "NaN"]
    return doc


def test_nan_in_the_aggregates_is_never_printed_as_a_figure_nor_makes_a_gpu_healthy(
        stores, backfilled):
    proxy = Mangler(stores["victoria-metrics"], _nan_aggregates)
    with running(proxy):
        text = garbage_fleet(proxy.base, backfilled)
        doc = garbage_fleet(proxy.base, backfilled, "--output", "json")
    assert text.returncode == doc.returncode == 1, text.stderr  # the agents' own findings stand
    assert "Traceback" not in text.stderr + doc.stderr
    said = "not a number in the store's answer (NaN or an infinity)"
    assert said in text.stdout
    assert not re.search(r"nan\b", text.stdout.replace(said, ""), re.IGNORECASE), text.stdout
    parsed = json.loads(doc.stdout)  # strict JSON: no NaN in it
    groups = {g["verdict"]: g for g in parsed["groups"]}
    assert groups["pcie"]["count"] == 1 and parsed["found"] == 5
    [pcie] = groups["pcie"]["gpus"]
    assert pcie["figure"].startswith("its deciding figure is not a number")
    assert pcie["state"] == "current" and pcie["last_seen"] is None


def _labels_dropped(query: str, doc: dict) -> dict:
    """Answers whose series lack the pod's and the GPU's labels (a store or a relabelling that
    drops them): valid, if odd."""
    for r in doc["data"]["result"]:
        for k in ("pod", "node", "gpu_index", "gpu_name"):
            r["metric"].pop(k, None)
    return doc


def test_series_without_the_pod_s_labels_are_listed_as_such_never_a_traceback(
        stores, backfilled):
    proxy = Mangler(stores["victoria-metrics"], _labels_dropped)
    with running(proxy):
        out = garbage_fleet(proxy.base, backfilled)
    assert "Traceback" not in out.stderr
    assert out.returncode in (1, 6), (out.returncode, out.stderr)
    if out.returncode == 1:
        assert "garbage/-  node -  GPU ?" in out.stdout
