"""Receivers as they are (issue #35): a receiver too old for a protocol refuses its path, and the
agent's advice must not send the operator back to the URL that was just refused.

Debian's VictoriaMetrics 1.79 predates OTLP (VictoriaMetrics takes it from v1.92.0): it answers
400 "unsupported path" to ``/opentelemetry/v1/metrics``, the path newer releases take OTLP at.
The agent says so once, keeps every batch, and its hint asks for the receiver's version instead
of suggesting that same URL.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.sinks.answers import OTLP, REMOTE_WRITE, Policy
from tests.receivers import Agent, VictoriaMetrics, running
from tests.waiting import until


def otlp_args(url: str, spool: Path) -> list[str]:
    return ["--simulate", "healthy", "--interval", "0.2", "--push-interval", "0.4",
            "--otlp-url", url, "--spool-dir", str(spool), "--retry-max-backoff", "0.5",
            "--shutdown-timeout", "3"]


def test_victoriametrics_1_79_refuses_otlp_once_and_the_hint_asks_for_its_version(tmp_path):
    vm = VictoriaMetrics(tmp_path).start()
    url = f"{vm.base}/opentelemetry/v1/metrics"
    spool = tmp_path / "spool"
    with running(vm):
        agent = Agent(otlp_args(url, spool)).start()
        with running(agent):
            refused = until(lambda: agent.logged("push_refused"), 60,
                            what=lambda: "push_refused\n" + "".join(agent.err)[-2000:])
            agent.more_cycles(10, "while the receiver refuses OTLP")
            assert agent.stop() == 0, "".join(agent.err)[-2000:]

        assert len(refused) == 1, "one line for the condition, not one per attempt"
        said = refused[0]
        assert said["status"] == 400 and "unsupported path" in said["receiver_said"]
        hint = said["hint"]
        assert url not in hint and "/opentelemetry/v1/metrics" not in hint.replace(
            "/opentelemetry/api/v1/push", ""), f"the hint suggests the refused URL: {hint}"
        assert "version" in hint and "v1.92.0" in hint, hint  # what to check, with the minimum
        assert not agent.logged("batch_refused"), "a refused path set batches aside as bad data"
        assert not list(spool.rglob("rejected/*.batch"))
        assert vm.settled() == [], "the refused path stored something"


@pytest.mark.parametrize("policy", [REMOTE_WRITE, OTLP], ids=["remote-write", "otlp"])
def test_no_hint_about_a_refused_url_names_that_url(policy: Policy):
    """Whatever known path (or typo) was refused, the hint never suggests it again, and names
    a minimum release for every receiver it lists."""
    for path in [*(e.path for e in policy.endpoints), "/api/v1/wirte", "/metrics"]:
        url = f"http://receiver.example:8428{path}"
        hint = policy.url_hint(url)
        assert url not in hint
        suggested = [e.path for e in policy.endpoints if f" {e.path} (" in hint]
        assert path not in suggested, f"{path} refused, yet suggested: {hint}"
        for endpoint in policy.endpoints:
            if f" {endpoint.path} (" in hint:
                assert endpoint.requires in hint


def test_a_404_from_prometheus_without_the_flag_names_the_flag_not_the_url():
    from tests.test_delivery import response

    with pytest.raises(Exception) as err:
        REMOTE_WRITE.check(response(404, "404 page not found"))
    hint = err.value.hint  # type: ignore[attr-defined]
    assert "--web.enable-remote-write-receiver" in hint and "2.33.0" in hint
    assert "http://127.0.0.1:9/api/v1/write" not in hint
