"""The rarely sent figures (error and ECC counters, Xids, link and clock maxima, row remapping:
``sidecar.metrics.RARE``, sent when they change and every ``RESEND_S``) through what a pod's life
brings: a receiver outage (both stores stopped, then started: the spool replayed), a SIGKILL
(the journal replayed by the restart) and a restart (whose first cycle sends every rare series).
Against a real VictoriaMetrics and a real Prometheus at once: every value the agents printed of a
rare series is stored, every counter increase with it; at every cycle either agent printed, each
rare series of that cycle is current in both stores (none stale within the look-back); and
``diagnose --query-url`` over the whole window judges each GPU as the agents' own cycles judge.
A kill sends no staleness markers; the clean stop at the end does."""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path

import requests

from sidecar.commands.from_store import Window, fetch, judge_stored
from sidecar.config import Config
from sidecar.judge.series import figures_of
from sidecar.judge.verdict import judge
from sidecar.judge.window import Summary
from sidecar.metrics import RARE, RARE_READ_S
from sidecar.samples import Series
from sidecar.store import Store
from tests.conftest import run_cli
from tests.receivers import VM_REL, Agent, Prometheus, VictoriaMetrics, running
from tests.test_diagnose import verdicts as report_verdicts
from tests.waiting import until

INTERVAL = 0.5
# cycles for one more reading of the counters NVML gives as field values (every RARE_READ_S)
READ_CYCLES = int(RARE_READ_S / INTERVAL) + 4
SCENARIO = "hardware-fault"  # ECC counters climb, Xid 79 counted: rare figures that move
NAMESPACE = "rare"
RARE_MATCH = "{__name__=~\"" + "|".join(sorted(RARE)) + "\"}"


def agent_for(vm: VictoriaMetrics, prom: Prometheus, spool: Path) -> Agent:
    return Agent(["--simulate", SCENARIO, "--interval", str(INTERVAL), "--push-interval", "1",
                  "--remote-write-url", vm.write_url, "--remote-write-url", prom.write_url,
                  "--spool-dir", str(spool), "--retry-max-backoff", "0.5",
                  "--pod-namespace", NAMESPACE, "--pod-name", SCENARIO, "--node-name", "node-a",
                  "--shutdown-timeout", "8"])


def rare_rows(agent: Agent, *, every_cycle: bool) -> list[tuple[str, tuple, int, float]]:
    rows = agent.recorded() if every_cycle else agent.sampled()
    return [r for r in rows if r[0] in RARE]


def current(store: VictoriaMetrics | Prometheus, at_ms: int) -> set[tuple[str, tuple]]:
    """The rare series an instant query at ``at_ms`` finds: what a dashboard or a rule sees."""
    r = requests.get(f"{store.base}/api/v1/query",
                     params={"query": RARE_MATCH, "time": at_ms / 1000, "nocache": "1"},
                     timeout=30)
    r.raise_for_status()
    out = set()
    for row in r.json()["data"]["result"]:
        labels = dict(row["metric"])
        out.add((labels.pop("__name__"), tuple(sorted(labels.items()))))
    return out


def stored_rare(store: VictoriaMetrics | Prometheus) -> dict[tuple[str, tuple, int], float]:
    rows = (store.samples(RARE_MATCH) if isinstance(store, VictoriaMetrics)
            else store.samples(RARE_MATCH, at=time.time() + 1))
    return {(n, labels, ts): v for n, labels, ts, v in rows}


def test_rare_figures_through_an_outage_a_kill_and_a_restart(tmp_path):
    vm, prom = VictoriaMetrics(tmp_path), Prometheus(tmp_path)
    spool = tmp_path / "spool"
    vm.start()
    prom.start()
    with running(vm, prom):
        first = agent_for(vm, prom, spool).start()
        with running(first):
            first.more_cycles(READ_CYCLES, "before the outage")
            vm.stop()
            prom.stop()
            until(lambda: len(first.logged("push_failing")) >= 2, what="both outages noticed")
            during = first.more_cycles(READ_CYCLES, "while both stores are down")
            vm.start()
            prom.start()
            until(lambda: len(first.logged("receiver_recovered")) >= 2, interval=0.2,
                  what="both spools replayed")
            first.more_cycles(2, "after the recovery")
            first.signal(signal.SIGKILL)
            first.wait()
        assert not first.logged("series_ended"), "a kill sent staleness markers"
        second = agent_for(vm, prom, spool).start()
        with running(second):
            second.more_cycles(READ_CYCLES, "after the restart")
            assert second.stop() == 0, "".join(second.err)[-3000:]
        assert second.logged("journal_replayed"), "the kill left no journal to replay"
        assert second.logged("series_ended")

        # the restart's first cycle sends every rare series it has, whatever the last run sent
        begun = min(ts for *_, ts, _ in rare_rows(second, every_cycle=True))
        assert {r[:2] for r in rare_rows(second, every_cycle=False) if r[2] == begun} == \
            {r[:2] for r in rare_rows(second, every_cycle=True) if r[2] == begun}

        # the rare counters moved while the stores were down: the outage had something to keep
        first_ts = sorted({ts for *_, ts, _ in rare_rows(first, every_cycle=True)})
        outage = first_ts[-during:]
        moved = {(n, labels) for n, labels, ts, v in rare_rows(first, every_cycle=False)
                 if ts in outage and n.endswith("_total")}
        assert moved, "no rare counter changed during the outage"

        sent = [*rare_rows(first, every_cycle=False), *rare_rows(second, every_cycle=False)]
        want = {(n, labels, ts): v for n, labels, ts, v in sent}
        for store in (vm, prom):
            # every value printed of a rare series is stored, at the cycle that saw it
            def missing(store=store) -> str:
                gone = sorted(want.keys() - stored_rare(store).keys())
                return f"every rare sample in {type(store).__name__}: {len(gone)} missing, " \
                       f"e.g. {gone[:2]}"

            until(lambda store=store: want.keys() <= stored_rare(store).keys(), 30,
                  interval=0.5, what=missing)
            stored = stored_rare(store)
            rel = VM_REL if store is vm else 0.0
            for key, value in want.items():
                assert math.isclose(stored[key], value, rel_tol=rel), (store.base, key)
            # and at every cycle printed, each rare series of that cycle is current
            for agent in (first, second):
                by_ts: dict[int, set[tuple[str, tuple]]] = {}
                for n, labels, ts, _ in rare_rows(agent, every_cycle=True):
                    by_ts.setdefault(ts, set()).add((n, labels))
                for ts, series in sorted(by_ts.items()):
                    stale = series - current(store, ts)
                    assert not stale, (store.base, ts, sorted(stale)[:3])

        # diagnose from each store over both runs judges every GPU as the agents' cycles do
        cycles = cycles_of([first, second])
        w = Window(cycles[0][0].timestamp_ms / 1000 - 0.25, cycles[-1][0].timestamp_ms / 1000
                   + 0.001)
        summary = Summary()
        for c in cycles:
            summary.add(figures_of(c))
        own = {uuid: judge(win).key for uuid, win in summary.windows().items()}
        assert "hardware-fault" in own.values()
        index = {dict(s.labels)["gpu_uuid"]: int(dict(s.labels)["gpu_index"])
                 for c in cycles for s in c if "gpu_uuid" in dict(s.labels)}
        for store in (vm, prom):
            cfg = Config(query_url=store.base, select=(("namespace", "=", NAMESPACE),),
                         at=f"{w.end:.3f}", duration=w.end - w.start)
            client = Store(cfg)
            try:
                judged = judge_stored(fetch(client, cfg.select, w), w)
            finally:
                client.close()
            assert {uuid: v.key for uuid, v in judged.verdicts.items()} == own, store.base
            proc = run_cli("diagnose", "--query-url", store.base, "--select",
                           f"namespace={NAMESPACE}", f"--at={w.end:.3f}",
                           "--duration", f"{w.end - w.start:.3f}")
            assert proc.returncode == 1, proc.stdout + proc.stderr
            assert report_verdicts(proc.stdout) == {index[uuid]: key for uuid, key in own.items()}, \
                proc.stdout


def cycles_of(agents: list[Agent]) -> list[list[Series]]:
    """The cycles the agents judged, whole, as printed, oldest first."""
    by_ts: dict[int, list[Series]] = {}
    for agent in agents:
        for name, labels, ts, value in agent.recorded():
            by_ts.setdefault(ts, []).append(Series(name, labels, value, ts))
    return [by_ts[ts] for ts in sorted(by_ts)]
