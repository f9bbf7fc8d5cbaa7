"""``gpu-sidecar fleet`` and the store's failures, against real stores: every GPU with data,
grouped by the agents' own verdicts, worst first, in a fixed number of queries; behind a real
vmauth with a bearer token and a tenant gateway; and each way a store can fail, with its exit
code and message, bounded in time."""

from __future__ import annotations

import contextlib
import http.server
import json
import time
from collections.abc import Iterator

import pytest

from sidecar.commands.fleet import DECIDING, FIXED_QUERIES, MAX_QUERIES, fleet_of, per_line
from sidecar.commands.from_store import Window
from sidecar.config import Config
from sidecar.judge.rules import PRECEDENCE, RULES
from sidecar.store import EXIT_DENIED, EXIT_REFUSED, EXIT_UNREACHABLE, Store
from tests.conftest import run_cli
from tests.receivers import (
    LOCAL,
    Agent,
    FaultProxy,
    LocalServer,
    Process,
    Prometheus,
    VictoriaMetrics,
    free_port,
    need,
    running,
)
from tests.stored import add_gpu, fleet_series, gpu_labels, push
from tests.waiting import until

TOKEN = "s3cret-query-token"
TENANT = "team-a"


@pytest.fixture(scope="module")
def vm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VictoriaMetrics]:
    store = VictoriaMetrics(tmp_path_factory.mktemp("vm"))
    with running(store):
        yield store.start()


def backfill(vm: VictoriaMetrics, n: int, namespace: str, *, verdicts: bool = True
             ) -> tuple[dict[str, str], float]:
    """``n`` synthetic GPUs over the ten minutes before an hour ago; their verdicts and the
    window's end, once the store serves them all."""
    end_ms = (int(time.time()) - 3600) * 1000
    series, expected = fleet_series(n, end_ms - 600_000, end_ms, 15_000, namespace=namespace,
                                    verdicts=verdicts)
    push(vm.write_url, series)
    end = end_ms / 1000

    def stored() -> bool:
        out = run_cli("fleet", "--query-url", vm.base, "--select", f"namespace={namespace}",
                      f"--at={end}", "--duration", "600", "--output", "json")
        return out.returncode in (0, 1) and json.loads(out.stdout)["gpus"] == n

    until(stored, 30, interval=0.5, what=f"{n} GPUs of {namespace} in VictoriaMetrics")
    return expected, end


def fleet_json(vm_url: str, namespace: str, end: float, *extra: str) -> tuple[int, dict]:
    out = run_cli("fleet", "--query-url", vm_url, "--select", f"namespace={namespace}",
                  f"--at={end}", "--duration", "600", "--output", "json", *extra)
    return out.returncode, json.loads(out.stdout) if out.stdout else {}


def test_the_fleet_is_grouped_by_verdict_worst_first_with_counts_and_deciding_figures(vm):
    expected, end = backfill(vm, 40, "fleet")
    code, doc = fleet_json(vm.base, "fleet", end)
    assert code == 1
    kinds = [g["verdict"] for g in doc["groups"]]
    assert kinds == sorted(kinds, key=lambda k: PRECEDENCE.index(k) if k in PRECEDENCE else 99)
    assert kinds[-1] == "none"
    for group in doc["groups"]:
        assert group["count"] == len(group["gpus"]) == sum(
            1 for v in expected.values() if v == group["verdict"])
        for gpu in group["gpus"]:
            assert expected[gpu["uuid"]] == group["verdict"]
            assert gpu["namespace"] == "fleet" and gpu["pod"].startswith("fleet-pod-")
            assert gpu["node"].startswith("node-")
    figure = {g["verdict"]: g["gpus"][0]["figure"] for g in doc["groups"]}
    assert figure["pcie"].startswith("PCIe 93.0 %")
    assert figure["fragmentation"].startswith("fragmentation 72.0 % of a 30.0 GiB cache")
    assert figure["kv-cache"].startswith("KV cache 97.0 %")
    assert figure["throttled"].startswith("SM clock 55.6 % of its maximum")
    assert "SM occupancy 12.0 %" in figure["low-occupancy"]
    assert "p99 " in figure["low-occupancy"] and "p99 absent" not in figure["low-occupancy"]
    text = run_cli("fleet", "--query-url", vm.base, "--select", "namespace=fleet",
                   f"--at={end}", "--duration", "600")
    assert text.returncode == 1
    assert "pcie (4): the PCIe link is saturated" in text.stdout
    assert text.stdout.rstrip().splitlines()[-1].startswith("result: a finding on 20 of 40")


def test_the_number_of_queries_does_not_grow_with_the_fleet(vm):
    _, end_small = backfill(vm, 10, "small")
    _, end_large = backfill(vm, 200, "large")
    counts = []
    for namespace, end in (("small", end_small), ("large", end_large)):
        store = Store(Config(query_url=vm.base, select=(("namespace", "=", namespace),)))
        try:
            gpus = fleet_of(store, store_select(namespace), Window(end - 600, end))
        finally:
            store.close()
        counts.append(store.queries)
        assert len(gpus) == (10 if namespace == "small" else 200)
    assert counts[0] == counts[1] <= MAX_QUERIES


def test_each_verdict_s_deciding_figure_is_declared_by_its_rule():
    """What the fleet prints beside a GPU is its verdict's rule's ``deciding`` figure: every kind
    has one, read from RULES (none kept apart in the command), and the bound on the number of
    queries counts each."""
    assert [r.kind for r in RULES if r.deciding is None] == []
    assert {r.kind: r.deciding for r in RULES} == DECIDING
    assert FIXED_QUERIES + sum(len(r.deciding.queries) for r in RULES if r.deciding) \
        == MAX_QUERIES
    # and each per-GPU figure is asked per pod and GPU: its grouping is the one per_line widens
    for r in RULES:
        if r.deciding is not None and r.deciding.by == ("gpu_uuid",):
            for q in r.deciding.queries:
                assert "by (namespace, pod, node, container, gpu_uuid" in per_line(q), r.kind


def store_select(namespace: str) -> tuple[tuple[str, str, str], ...]:
    return (("namespace", "=", namespace),)


def test_gpus_of_an_older_agent_release_are_listed_as_not_judged_never_as_healthy(vm):
    _, end = backfill(vm, 4, "older", verdicts=False)
    code, doc = fleet_json(vm.base, "older", end)
    assert code == 0  # nothing found: but nothing passed off as healthy either
    assert [g["verdict"] for g in doc["groups"]] == ["older-agent"]
    assert "older release" in doc["groups"][0]["gpus"][0]["figure"]
    # diagnose judges them from their raw series, saying what it could not judge
    out = run_cli("diagnose", "--query-url", vm.base, "--select", "namespace=older",
                  f"--at={end}", "--duration", "600")
    assert out.returncode == 1 and "verdict:" in out.stdout, out.stderr


def test_a_real_agent_s_verdict_reaches_the_fleet_view_from_vm_and_prometheus(vm, tmp_path):
    prom = Prometheus(tmp_path)
    agent = Agent(["--simulate", "fragmented", "--interval", "0.5", "--push-interval", "1",
                   "--remote-write-url", vm.write_url, "--remote-write-url", prom.write_url,
                   "--spool-dir", str(tmp_path / "spool"), "--pod-namespace", "live",
                   "--pod-name", "web-0", "--node-name", "gpu-node-1"])
    with running(prom, agent):
        prom.start()
        agent.start()
        agent.more_cycles(8)
        for url in (vm.base, prom.base):
            out = until(lambda u=url: (p := run_cli(
                "fleet", "--query-url", u, "--select", "namespace=live", "--duration", "60",
                "--output", "json")) and p.returncode == 1 and p, 30, interval=0.5,
                what=f"the agent's verdict in {url}")
            doc = json.loads(out.stdout)
            assert [g["verdict"] for g in doc["groups"]] == ["fragmentation"], doc
            gpu = doc["groups"][0]["gpus"][0]
            assert (gpu["pod"], gpu["node"]) == ("web-0", "gpu-node-1")
            assert gpu["figure"].startswith("fragmentation ") and "absent" not in gpu["figure"]


# -- behind an authenticating proxy --------------------------------------------------------------


def test_behind_vmauth_with_a_bearer_token_and_a_tenant_header(vm, tmp_path):
    """vmauth (VictoriaMetrics' own proxy) checks the bearer token; in front of it a gateway
    checks X-Scope-OrgID as Mimir's does (this vmauth release routes on no header)."""
    _, end = backfill(vm, 10, "authed")
    config = tmp_path / "auth.yml"
    config.write_text(f"users:\n  - bearer_token: {TOKEN!r}\n    url_prefix: {vm.base!r}\n")
    vmauth = Process(lambda port: [need("vmauth"), f"-httpListenAddr={LOCAL}:{port}",
                                   f"-auth.config={config}", "-loggerLevel=WARN"],
                     tmp_path / "vmauth.log", "/health")
    with running(vmauth):
        vmauth.start()
        gateway = FaultProxy(f"{vmauth.base}/api/v1/query", lambda n, body: None,
                             require={"X-Scope-OrgID": TENANT})
        try:
            url = gateway.url.removesuffix("/api/v1/write")
            token = tmp_path / "token"
            token.write_text(TOKEN + "\n")
            common = ("fleet", "--query-url", url, "--select", "namespace=authed", f"--at={end}",
                      "--duration", "600", "--output", "json")
            ok = run_cli(*common, "--bearer-token-file", str(token),
                         "--header", f"X-Scope-OrgID={TENANT}")
            assert ok.returncode == 1 and json.loads(ok.stdout)["gpus"] == 10, ok.stderr
            no_tenant = run_cli(*common, "--bearer-token-file", str(token))
            assert no_tenant.returncode == EXIT_DENIED
            assert "refused the credentials (401" in no_tenant.stderr
            assert "--header X-Scope-OrgID=TENANT" in no_tenant.stderr
            no_token = run_cli(*common, "--header", f"X-Scope-OrgID={TENANT}")
            assert no_token.returncode == EXIT_DENIED and "--bearer-token-file" in no_token.stderr
            assert TOKEN not in no_token.stderr + no_tenant.stderr + ok.stderr
            # what got through carried both, as sent by the command
            passed = [h for (_, status, _), h in zip(gateway.log, gateway.headers, strict=True)
                      if status == 200]
            assert passed and all(h.get("Authorization") == f"Bearer {TOKEN}"
                                  and h.get("X-Scope-OrgID") == TENANT for h in passed)
        finally:
            gateway.stop()


# -- a store that fails ----------------------------------------------------------------------------


def test_an_unreachable_store_is_said_at_once_with_its_exit_code():
    port = free_port()
    started = time.monotonic()
    out = run_cli("diagnose", "--query-url", f"http://{LOCAL}:{port}", "--query-timeout", "5")
    assert out.returncode == EXIT_UNREACHABLE, out.stderr
    assert "ConnectionRefusedError" in out.stderr and f"{LOCAL}:{port}" in out.stderr
    assert time.monotonic() - started < 15


class Trickle(http.server.BaseHTTPRequestHandler):
    """A store that answers 200 and then one byte every half second, for ever."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "100000")
        self.end_headers()
        try:
            for _ in range(120):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.5)
        except OSError:
            pass

    def log_message(self, *args: object) -> None:
        pass


def test_a_trickling_store_cannot_hold_the_command_past_its_query_timeout():
    server = LocalServer()
    url = server.serve(Trickle, "")
    try:
        started = time.monotonic()
        out = run_cli("fleet", "--query-url", url, "--query-timeout", "2", timeout=30)
        took = time.monotonic() - started
    finally:
        server.stop()
    assert out.returncode == EXIT_UNREACHABLE, out.stderr
    assert "--query-timeout" in out.stderr
    assert took < 12, took  # 2 s of query, plus an interpreter's start


class Forbidden(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = b'{"status":"error","error":"tenant team-b may not read team-a"}'
        self.send_response(403)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_403_is_said_with_the_store_s_reason():
    server = LocalServer()
    url = server.serve(Forbidden, "")
    try:
        out = run_cli("diagnose", "--query-url", url)
    finally:
        server.stop()
    assert out.returncode == EXIT_DENIED
    assert "403: tenant team-b may not read team-a" in out.stderr


def test_a_query_the_store_refuses_is_said_with_its_reason(tmp_path):
    """A VictoriaMetrics that lets a query scan at most 100 samples, asked about 12 GPUs."""
    strict = VictoriaMetrics(tmp_path)
    strict.process.command = (lambda port, base=strict.process.command:
                              [*base(port), "-search.maxSamplesPerQuery=100"])
    with running(strict):
        strict.start()
        end_ms = (int(time.time()) - 600) * 1000
        series, _ = fleet_series(12, end_ms - 120_000, end_ms, 15_000, namespace="strict")
        push(strict.write_url, series)
        out = until(lambda: (p := run_cli(
            "diagnose", "--query-url", strict.base, f"--at={end_ms / 1000}", "--duration",
            "120")) and p.returncode != 2 and p, 30, interval=0.5, what="the refusal")
    assert out.returncode == EXIT_REFUSED, out.stdout + out.stderr
    assert "refused the query (422" in out.stderr and "maxSamplesPerQuery" in out.stderr


def test_a_window_outside_what_the_store_holds_says_so(vm):
    backfill(vm, 2, "retained")
    out = run_cli("diagnose", "--query-url", vm.base, "--select", "namespace=retained",
                  "--at=now-30d", "--duration", "600")
    assert out.returncode == 2
    assert "2 GPU(s) match it in the last 7 days" in out.stderr and "retention" in out.stderr


def test_a_selector_that_matches_nothing_says_so(vm):
    out = run_cli("fleet", "--query-url", vm.base, "--select", "namespace=no-such-namespace")
    assert out.returncode == 2
    assert "no GPU matches --select namespace=no-such-namespace" in out.stderr


@pytest.mark.parametrize(("at", "said"), [
    ("yesterday", "is neither 'now', a relative time"),
    ("2025-01-31T03:00:00", "has no time zone"),
    ("2999-01-01T00:00:00Z", "in the future"),
])
def test_a_bad_time_is_refused_naming_the_option(vm, at, said):
    out = run_cli("diagnose", "--query-url", vm.base, f"--at={at}")
    assert out.returncode == 2 and said in out.stderr and "--at" in out.stderr


def test_store_options_without_a_store_are_refused():
    out = run_cli("diagnose", "--select", "namespace=prod")
    assert out.returncode == 2 and "--select" in out.stderr and "--query-url" in out.stderr
    out = run_cli("fleet")
    assert out.returncode == 2 and "--query-url" in out.stderr


# -- pinned orders -----------------------------------------------------------------------------


def test_a_gpu_with_two_kinds_at_1_is_listed_under_the_worse_whichever_the_store_gives_first(vm):
    """Two kinds at 1 in one GPU's last samples (a restart between two verdicts): the GPU is
    listed once, under the kind earlier in the precedence, the other named as also in the
    window. One GPU's worse kind sorts after its other by name, the other's before it, so
    neither 'the first row wins' nor 'the last row wins' passes."""
    end_ms = (int(time.time()) - 3000) * 1000
    times = range(end_ms - 300_000, end_ms, 15_000)
    series: dict = {}
    pairs = {"GPU-two-kinds-0": ("pcie", "fragmentation"),
             "GPU-two-kinds-1": ("hardware-fault", "pcie")}
    for i, (uuid, kinds) in enumerate(pairs.items()):
        labels = gpu_labels(uuid, i, "twokinds", f"twokinds-{i}", "node-0")
        add_gpu(series, labels, times, {"gpu_sidecar_gpu_available": 1})
        for kind in kinds:
            series[("gpu_verdict", tuple(sorted((*labels, ("verdict", kind)))))] = [
                (ts, 1.0) for ts in times]
    push(vm.write_url, series)
    end = end_ms / 1000
    code, doc = until(lambda: (r := fleet_json(vm.base, "twokinds", end)) and r[1].get(
        "gpus") == 2 and r, 30, interval=0.5, what="the two GPUs stored")
    assert code == 1
    listed = {g["uuid"]: (group["verdict"], g["during"])
              for group in doc["groups"] for g in group["gpus"]}
    assert listed == {"GPU-two-kinds-0": ("pcie", ["fragmentation"]),
                      "GPU-two-kinds-1": ("hardware-fault", ["pcie"])}


def test_older_agents_are_listed_after_the_findings_and_before_the_healthy(vm):
    """The groups' order: findings worst first, then the GPUs not judged (agents of an older
    release), then those with nothing found: a GPU nobody judged never sits among the
    healthy ones nor after them."""
    end_ms = (int(time.time()) - 2400) * 1000
    judged, _ = fleet_series(4, end_ms - 600_000, end_ms, 15_000, namespace="order")
    older, _ = fleet_series(2, end_ms - 600_000, end_ms, 15_000, namespace="order",
                            verdicts=False, first=10)
    push(vm.write_url, {**judged, **older})
    end = end_ms / 1000
    code, doc = until(lambda: (r := fleet_json(vm.base, "order", end)) and r[1].get(
        "gpus") == 6 and r, 30, interval=0.5, what="the six GPUs stored")
    assert code == 1
    assert [(g["verdict"], g["count"]) for g in doc["groups"]] == [
        ("pcie", 1), ("older-agent", 2), ("none", 3)]
    text = run_cli("fleet", "--query-url", vm.base, "--select", "namespace=order",
                   f"--at={end}", "--duration", "600").stdout
    heads = [line.split(" (")[0] for line in text.splitlines() if line and line[0] != " "
             and "(" in line and not line.startswith(("gpu-sidecar", "verdicts", "result"))]
    assert heads == ["pcie", "older-agent", "none"]


@pytest.mark.parametrize("store", ["victoria-metrics", "prometheus"])
def test_a_critical_xid_first_seen_in_the_window_counts_in_the_fleets_figure(vm, tmp_path, store):
    """A code's first Xid arrives as a new series at 1, which Prometheus' increase() reads as 0:
    the fleet counts it whole where the series was not there before the window (as the agent's
    window and GPUHardwareFault do), and only its increase where it was."""
    end_ms = (int(time.time()) - 60) * 1000
    start_ms, mid_ms = end_ms - 1_200_000, end_ms - 300_000  # the window: its last 600 s
    times = range(start_ms, end_ms, 15_000)
    series: dict = {}
    cases = {"born": lambda ts: 1.0 if ts >= mid_ms else None,  # first Xid 79 in the window
             "rose": lambda ts: 1.0 if ts < mid_ms else 3.0}  # one before, two more in it
    namespace = f"xids-{store[:4]}"
    for i, name in enumerate(cases):
        labels = gpu_labels(f"GPU-78696400-0000-4000-8000-{i:012d}", 0, namespace,
                            f"xids-{name}", "node-x")
        add_gpu(series, labels, times, {"gpu_sidecar_gpu_available": 1,
                                        "gpu_utilization_ratio": 0.5})
        verdict = tuple(sorted((*labels, ("verdict", "hardware-fault"))))
        xid = tuple(sorted((*labels, ("xid", "79"))))
        for ts in times:
            series.setdefault(("gpu_verdict", verdict), []).append((ts, 1.0))
            if (value := cases[name](ts)) is not None:
                series.setdefault(("gpu_xid_errors_total", xid), []).append((ts, value))
    with contextlib.ExitStack() as stack:
        if store == "prometheus":
            prom = Prometheus(tmp_path)
            stack.enter_context(running(prom))
            prom.start()
            base, write = prom.base, prom.write_url
        else:
            base, write = vm.base, vm.write_url
        push(write, series)
        end = end_ms / 1000

        def figures():
            _, doc = fleet_json(base, namespace, end)
            gpus = {g["pod"]: g["figure"] for group in doc.get("groups", ())
                    for g in group["gpus"]}
            return gpus if len(gpus) == 2 else None

        gpus = until(figures, 30, interval=0.5, what=f"the two GPUs in {store}")
    assert gpus["xids-born"].startswith("critical Xids 1,"), gpus
    assert gpus["xids-rose"].startswith("critical Xids 2,"), gpus
