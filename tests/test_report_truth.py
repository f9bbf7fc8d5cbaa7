"""What a report says must be true (issue #33): each figure from one source and one window,
saying which. Three lies a newcomer found, each produced on the simulated node as an operator
would run it (the default interval) and pinned."""

from __future__ import annotations

import re

from sidecar.simulate.scenarios import FAULT_XID_INDEX, GPU_LOST_INDEX
from tests.conftest import run_cli


def block(report: str, index: int) -> str:
    """GPU ``index``'s block of a diagnose report, its wrapped lines joined."""
    found = re.search(rf"^GPU {index} .*?(?=^GPU \d+ |^result: )", report, re.M | re.S)
    assert found, report
    return " ".join(found[0].split())


def test_the_kv_cache_why_line_sets_the_engines_queue_against_the_engines_p99():
    proc = run_cli("diagnose", "--simulate", "kv-cache-full", "--duration", "6", timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    text = block(proc.stdout, 0)
    engine_p99 = re.search(r"engine: vllm: .*?p99 request (\d+ ms)", text)[1]
    why = re.search(r"why: engine: .*?the engine's p99 request (\d+ ms), of it queue", text)
    assert why and why[1] == engine_p99, text


def test_a_gpu_lost_to_xid_79_shows_the_xid_in_its_window():
    proc = run_cli("diagnose", "--simulate", "hardware-fault", "--duration", "10", timeout=60)
    text = block(proc.stdout, FAULT_XID_INDEX)
    assert "verdict: gpu-lost" in text
    assert "Xids in the window: 79 x2" in text, text


def test_a_lost_gpus_figures_say_they_are_from_before_it_was_lost_and_no_latency_since_start():
    proc = run_cli("diagnose", "--simulate", "gpu-lost", "--duration", "10", timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lost = block(proc.stdout, GPU_LOST_INDEX)
    assert re.search(r"figures: from the \d+ reading\(s\) before it was lost", lost), lost
    assert "since the app started" not in lost, lost
    requests = {int(n) for i in (0, 1) for n in re.findall(r"over (\d+) requests in the window",
                                                           block(proc.stdout, i))}
    assert requests and max(requests) < 5000, proc.stdout  # the others' window, not since start
