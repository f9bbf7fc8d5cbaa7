"""End to end: a model-server process using sidecar.client, a running agent on a simulated GPU,
and a real VictoriaMetrics: what is stored equals what the client sent, on the right GPU."""

from __future__ import annotations

import os
import subprocess
import sys

from sidecar import protocol
from sidecar.simulate.scenarios import simulated_uuid
from tests.conftest import ROOT
from tests.receivers import Agent, VictoriaMetrics, running
from tests.waiting import until

CLIENT = """
import sys, time
from sidecar import client
gpu = sys.argv[1]
pub = client.start(gpus=[gpu], use_torch=False, interval_s=0.2)
for latency in (0.004, 0.03, 0.08, 0.08, 0.12, 0.26, 0.9, 3.0, 12.0):
    client.observe(latency)
sends = 0
deadline = time.monotonic() + 30
# a non-torch app sends its allocator figures itself, periodically, while its thread publishes
# rounds: at least 5 of each
while (sends < 5 or pub.sent + pub.dropped < 8) and time.monotonic() < deadline:
    pub.send_allocator(gpu, reserved_bytes=64 << 30, allocated_bytes=22 << 30,
                       active_bytes=23 << 30, inactive_split_bytes=9 << 30, alloc_retries=4,
                       ooms=1, largest_free_block_bytes=1 << 28, private_pool_bytes=2 << 30)
    sends += 1
    time.sleep(0.2)  # the app's own period, not a wait for anything
client.stop()
print(pub.sent, pub.dropped)
"""


def test_client_figures_arrive_in_victoriametrics_labelled_with_the_gpu(tmp_path):
    gpu = simulated_uuid("healthy", 1)
    sock = tmp_path / "run" / "app.sock"
    vm = VictoriaMetrics(tmp_path).start()
    with running(vm):
        agent = Agent(["--simulate", "healthy", "--no-simulated-app", "--gpus", "announced",
                       "--socket", str(sock), "--interval", "0.2", "--push-interval", "0.4",
                       "--remote-write-url", vm.write_url, "--spool-dir", str(tmp_path / "sp")])
        agent.start()
        until(sock.exists, what="the agent's socket")
        proc = subprocess.run([sys.executable, "-c", CLIENT, gpu], capture_output=True,
                              text=True, cwd=ROOT, timeout=30,
                              env={**os.environ, "GPU_SIDECAR_SOCKET": str(sock)})
        assert proc.returncode == 0, proc.stderr
        sent, dropped = map(int, proc.stdout.split())
        assert sent > 0 and sent + dropped >= 8

        def sampled_the_client() -> bool:  # a cycle that holds its figures and all 9 requests
            rows = agent.sampled()
            return any(n == "gpu_allocator_reserved_bytes" and dict(lab).get("gpu_uuid") == gpu
                       for n, lab, _, _ in rows) and any(
                n == "inference_request_duration_seconds_count" and v == 9
                and dict(lab).get("gpu_uuid") == gpu for n, lab, _, v in rows)
        until(sampled_the_client, what="a cycle with the client's figures", interval=0.1)
        assert agent.stop() == 0
        stored: dict[tuple[str, tuple], float] = {}
        rows = vm.settled(len(agent.sampled()))
        for name, labels, _ts, value in rows:
            d = dict(labels)
            if d.get("gpu_uuid") == gpu:
                stored[(name, tuple((k, v) for k, v in labels if k not in ("gpu_name",
                                                                           "gpu_index")))] = value
        key = (("gpu_uuid", gpu),)
        assert stored[("gpu_allocator_reserved_bytes", key)] == 64 << 30
        assert stored[("gpu_allocator_allocated_bytes", key)] == 22 << 30
        assert stored[("gpu_allocator_alloc_retries_total", key)] == 4
        assert stored[("gpu_allocator_ooms_total", key)] == 1
        assert stored[("gpu_allocator_largest_free_block_bytes", key)] == 1 << 28
        assert stored[("gpu_allocator_private_pool_bytes", key)] == 2 << 30
        assert stored[("gpu_memory_fragmentation_ratio", key)] == (64 - 22) / 64
        assert stored[("gpu_allocator_nonreleasable_ratio", key)] == 9 / 64
        buckets = {dict(k[1])["le"]: v for k, v in stored.items()
                   if k[0] == "inference_request_duration_seconds_bucket"}
        expected = {}
        for bound in protocol.DEFAULT_LATENCY_BOUNDS:
            expected[repr(bound)] = sum(1 for x in (0.004, 0.03, 0.08, 0.08, 0.12, 0.26, 0.9,
                                                    3.0, 12.0) if x <= bound)
        expected["+Inf"] = 9
        assert buckets == expected
        assert stored[("inference_request_duration_seconds_count", key)] == 9
        assert abs(stored[("inference_request_duration_seconds_sum", key)] - 16.474) < 1e-9
        assert stored[("gpu_app_processes", key)] == 1
        # only the client's GPU: the other simulated GPU was never announced
        assert not any(dict(labels).get("gpu_uuid") == simulated_uuid("healthy", 0)
                       for _, labels, _, _ in rows)
        # one process on the GPU: no pid label on any series
        assert not any("pid" in dict(labels) for _, labels, _, _ in rows)
