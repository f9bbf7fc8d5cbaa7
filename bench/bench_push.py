"""Push benchmark: remote-write encoding against protobuf, and draining an hour of backlog.

    .venv/bin/python bench/bench_push.py          # prints a Markdown report

1. Encoding + snappy (block) compression of one batch of 160 series x 60 samples: the agent's
   direct wire-format encoder against building the same ``WriteRequest`` with the protobuf
   runtime and serialising it, both compressed with cramjam. Target: at least the baseline.
2. A one-hour backlog of 8 simulated GPUs (3600 cycles at 1 s, batched every 15 s) sits in the
   spool while the receiver is down; a local VictoriaMetrics starts and the sender drains it.
   Target: drained (every batch accepted) in under 10 s.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from sidecar import protocol
from sidecar.agent import Agent
from sidecar.config import Config
from sidecar.durability.spool import Spool
from sidecar.log import configure
from sidecar.samples import Series
from sidecar.simulate import fake_nvml
from sidecar.simulate.app import profile_messages
from sidecar.simulate.scenarios import build
from sidecar.sinks.remote_write import RemoteWriteSink
from sidecar.sources.app_socket import AppState
from sidecar.sources.nvml import NvmlSource
from sidecar.wire.remote_write import compress
from tests.manual_clock import ManualClock
from tests.prompb import WriteRequest
from tests.write_requests import Batch, GroupedEncoder

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _report import finish, heading

from tests.receivers import VictoriaMetrics


def make_batch(series: int = 160, samples: int = 60) -> list[Series]:
    out = []
    t0 = 1_790_000_000_000
    for k in range(samples):
        for i in range(series):
            labels = (("gpu_index", str(i % 8)), ("gpu_name", "Simulated NVIDIA H200"),
                      ("gpu_uuid", f"GPU-{i % 8:08d}-aaaa-bbbb-cccc-dddddddddddd"),
                      ("namespace", "ml"), ("pod", "llm-0"))
            out.append(Series(f"gpu_metric_{i // 8}_ratio", labels, (i * 7 + k) / 1000.0,
                              t0 + k * 1000))
    return out


def protobuf_body(items: list[Series]) -> bytes:
    grouped: dict = {}
    for s in items:
        grouped.setdefault((s.name, s.labels), []).append(s)
    wr = WriteRequest()
    for (name, labels), points in grouped.items():
        ts = wr.timeseries.add()
        for k, v in sorted((("__name__", name), *labels)):
            ts.labels.add(name=k, value=v)
        for p in points:
            ts.samples.add(value=p.value, timestamp=p.timestamp_ms)
    return compress(wr.SerializeToString())


def ours_body(items: list[Series], encoder: GroupedEncoder) -> bytes:
    batch = Batch()
    batch.add(items)
    return compress(encoder.write_request(batch.series))


def rate(fn, n_samples: int, repeat: int = 15) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return n_samples / statistics.median(times)


def encoding_benchmark() -> dict:
    items = make_batch()
    warm = GroupedEncoder()
    ours_body(items, warm)
    assert WriteRequest.FromString  # decode check below
    from sidecar.wire.remote_write import decompress

    a, b = WriteRequest(), WriteRequest()
    a.ParseFromString(decompress(ours_body(items, GroupedEncoder())))
    b.ParseFromString(decompress(protobuf_body(items)))
    assert a == b, "the two encoders must produce the same message"
    return {
        "samples": len(items),
        "protobuf": rate(lambda: protobuf_body(items), len(items)),
        "ours_cold": rate(lambda: ours_body(items, GroupedEncoder()), len(items)),
        "ours_warm": rate(lambda: ours_body(items, warm), len(items)),
    }


class _Null:
    name = "null"

    def start(self) -> None: ...
    def emit(self, series) -> None: ...
    def close(self, deadline: float) -> bool: return True
    def telemetry(self, ts, labels) -> list: return []


def drain_benchmark() -> dict:
    configure("json", "error")
    tmp = Path(tempfile.mkdtemp(prefix="gpu-sidecar-bench-"))
    vm = VictoriaMetrics(tmp)
    clock = ManualClock()
    sc = build("healthy", 8)
    fake_nvml.install(sc.nvml(clock=clock, throughput_blocking=False))
    source = NvmlSource(clock=clock)
    source.open()
    spool = Spool(tmp / "spool", max_bytes=1 << 30)
    sink = RemoteWriteSink(vm.write_url, spool, Config(retry_max_backoff=0.2),
                           push_interval_s=15.0, max_batch_samples=1_000_000, clock=clock)
    wall0 = 1_790_000_000.0
    agent = Agent(Config(gpus="visible", interval=1.0), source=source, app=AppState(clock=clock),
                  sinks=[sink], clock=clock, wall=lambda: wall0 + clock() - 1000.0)
    app = agent.app
    for i in range(3600):  # one hour at 1 s, the receiver down: everything goes to the spool
        clock.advance(1.0)
        for gpu in sc.gpus:  # the model server's allocator and latency figures, every cycle
            for message in profile_messages(sc.app, gpu.uuid, 4242, float(i)):
                app.feed(protocol.encode(message))
        agent.cycle()
    sink.flush()
    batches, backlog_bytes = len(spool), spool.bytes()
    samples = sum(b[2] for b in spool._index.values())
    vm.start()
    try:
        started = time.monotonic()
        sink.start()
        while len(spool):
            time.sleep(0.01)
        drained = time.monotonic() - started
        sink.close(time.monotonic() + 5)
        stored = 0
        for row in vm.export('{__name__=~"gpu_.*|inference_.*"}'):
            stored += len(row["values"])
    finally:
        vm.stop()
    return {"batches": batches, "bytes": backlog_bytes, "samples": samples, "seconds": drained,
            "stored": stored}


def main() -> int:
    enc = encoding_benchmark()
    drain = drain_benchmark()
    ok = enc["ours_cold"] >= enc["protobuf"] and drain["seconds"] < 10 and \
        drain["stored"] == drain["samples"]
    lines = [
        heading("Push"),
        "",
        "| measure | agent | baseline | ratio / limit |",
        "|---|---|---|---|",
        f"| encode + snappy, {enc['samples']} samples (160 series x 60) | "
        f"{enc['ours_cold'] / 1e6:.2f} M samples/s (new encoder), {enc['ours_warm'] / 1e6:.2f} M/s "
        f"(label blocks cached) | protobuf build + serialise: {enc['protobuf'] / 1e6:.2f} M/s | "
        f"{enc['ours_cold'] / enc['protobuf']:.1f}x / {enc['ours_warm'] / enc['protobuf']:.1f}x "
        f"(target >= 1x) |",
        f"| drain a 1 h backlog, 8 GPUs ({drain['batches']} batches, {drain['samples']} samples, "
        f"{drain['bytes'] / 2**20:.1f} MiB) into VictoriaMetrics | {drain['seconds']:.2f} s, "
        f"{drain['samples'] / drain['seconds'] / 1e6:.2f} M samples/s | - | limit 10 s; stored "
        f"{drain['stored']} of {drain['samples']} |",
    ]
    return finish(lines, ok)


if __name__ == "__main__":
    raise SystemExit(main())
