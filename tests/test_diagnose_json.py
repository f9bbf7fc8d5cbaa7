"""``gpu-sidecar diagnose --output json``: the report as one document for scripts (issue #44).

The same verdicts, figures, notes and remedies as the text, from every source of a window: the
running agent's window, sampled afresh, long-term storage (tests/test_store_diagnose.py). Real
agents and real ``diagnose`` processes; the text of the same window is the oracle.
"""

from __future__ import annotations

import json
import re

from sidecar.views.document import SCHEMA
from sidecar.window_socket import ask, path_of
from tests.conftest import run_cli
from tests.test_agent_window import agent_beside, diagnose_beside
from tests.test_diagnose import verdicts
from tests.waiting import until


def parsed(stdout: str) -> dict:
    """The one document: a single line of strict JSON (no NaN, no trailing text)."""
    lines = stdout.splitlines()
    assert len(lines) == 1, stdout
    return json.loads(lines[0], parse_constant=lambda c: pytest_fail(f"non-JSON constant {c}"))


def pytest_fail(why: str) -> None:
    raise AssertionError(why)


def flat(text: str) -> str:
    return " ".join(text.split())


def assert_same_as_the_text(doc: dict, text: str, *, figures: bool = True) -> None:
    """Every GPU's verdict as the text names it, and every finding's evidence and remedy, and
    every note, in the text's words (with ``figures=False``, each number as any number)."""
    assert doc["schema"] == SCHEMA
    assert {int(g["index"]): g["verdict"] for g in doc["gpus"]} == verdicts(text)
    mask = (lambda x: x) if figures else (lambda x: re.sub(r"\d+(\.\d+)?", "#", x))
    words = mask(flat(text))
    for gpu in doc["gpus"]:
        for f in gpu["findings"]:
            assert mask(flat(f["evidence"])) in words and flat(f["remedy"]) in flat(text), f
        for note in gpu["notes"]:
            assert mask(flat(note)) in words, note
    code = 1 if any(g["findings"] for g in doc["gpus"]) else 0
    assert doc["result"]["code"] == code


def test_beside_the_agent_the_document_says_what_the_text_says(tmp_path):
    with agent_beside(tmp_path, "pcie-saturated") as (agent, env):
        until(lambda: agent.cycles() >= 10, what="10 cycles in the agent's window")
        # one answer of the agent carries both, judged on the same window: equal to the digit
        answer = ask(path_of(env["GPU_SIDECAR_SOCKET"]), 30)
        as_json = diagnose_beside(env, "--output", "json", "--duration", "30")
    assert_same_as_the_text(answer["document"], answer["report"])
    assert as_json.returncode == 1, as_json.stdout + as_json.stderr
    doc = parsed(as_json.stdout)
    assert doc["origin"] == "agent-window"
    assert doc["source"].startswith("the agent's window")
    assert {g["verdict"] for g in doc["gpus"]} == {"pcie"}
    # the deciding figure is there, as a number (the text prints it as a percentage)
    text = flat(answer["report"])
    for gpu in answer["document"]["gpus"]:
        shares = gpu["figures"]["pcie_rx_ratio"], gpu["figures"]["pcie_tx_ratio"]
        assert max(shares) > answer["document"]["thresholds"]["pcie_util_ratio"]
        assert f"PCIe RX {shares[0] * 100:.1f} %" in text, (shares, text)


def test_sampled_afresh_the_document_carries_the_same_verdicts_and_remedies(tmp_path):
    args = ("diagnose", "--simulate", "fragmented", "--duration", "2", "--interval", "0.5",
            "--socket", str(tmp_path / "app.sock"))
    as_json = run_cli(*args, "--output", "json")
    as_text = run_cli(*args)
    assert as_json.returncode == as_text.returncode == 1, as_json.stdout + as_json.stderr
    doc = parsed(as_json.stdout)
    assert doc["origin"] == "fresh" and doc["partial"] is False
    # two windows sampled one after the other: the same verdicts, notes and remedies, the
    # evidence's figures of its own window
    assert_same_as_the_text(doc, as_text.stdout, figures=False)
    assert {g["verdict"] for g in doc["gpus"]} == {"fragmentation"}


def test_a_healthy_window_is_exit_0_and_says_none_with_its_figures(tmp_path):
    as_json = run_cli("diagnose", "--simulate", "healthy", "--duration", "2", "--interval",
                      "0.5", "--socket", str(tmp_path / "app.sock"), "--output", "json")
    assert as_json.returncode == 0, as_json.stdout + as_json.stderr
    doc = parsed(as_json.stdout)
    assert doc["result"] == {"code": 0, "findings": []}
    for gpu in doc["gpus"]:
        assert gpu["verdict"] == "none" and gpu["compute_judged"] is True
        assert 0 <= gpu["figures"]["occupancy"] <= 1
        assert gpu["window"]["p99_seconds"] is not None


def test_prometheus_text_is_no_output_of_diagnose():
    proc = run_cli("diagnose", "--simulate", "healthy", "--output", "prometheus")
    assert proc.returncode == 2
    assert "diagnose --output takes auto, table (the text report) or json" in proc.stderr
