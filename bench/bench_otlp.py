"""Resident memory of the agent with the OTLP sink: hand encoder vs the official generated classes.

    .venv/bin/python bench/bench_otlp.py [--rounds 3] [--seconds 8] [--gpus 8]

Whole processes, as deployed: ``gpu-sidecar run --simulate healthy`` pushing every second to a
local receiver that answers 200 (remote-write or OTLP). Variants, interleaved round by round,
fresh processes each time:

- ``head``: the committed agent (``git archive HEAD``), remote-write: the agent before this change;
- ``rw``: this tree, remote-write only (the OTLP sink off);
- ``otlp-hand``: this tree, ``--otlp-url``, the hand encoder of ``sidecar/wire/otlp.py``;
- ``otlp-official``: this tree, ``--otlp-url``, each cycle built with the generated classes of
  ``opentelemetry-proto`` instead (same points and attributes, histogram parts as number points)
  and serialized: what depending on protobuf would cost.

VmRSS at the end of the window and VmHWM (peak) come from /proc/<pid>/status; medians, every run
in brackets. Prints a markdown section for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import http.server
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# run in the agent's process for the otlp-official variant: the codec's cycle() replaced by one
# that builds the request with the generated classes
OFFICIAL = r'''
import sys
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from sidecar import metrics
from sidecar.sinks import otlp as sink

def cycle(self, series):
    request = ExportMetricsServiceRequest()
    rm = request.resource_metrics.add()
    for k, v in self.encoder.resource:
        rm.resource.attributes.add(key=k).value.string_value = v
    sm = rm.scope_metrics.add()
    sm.scope.name = "gpu-sidecar"
    by_name = {}
    start = int.from_bytes(self.encoder.start_ns, "little")
    for s in series:
        metric = by_name.get(s.name)
        spec = metrics.OTEL.get(s.name)
        if metric is None:
            metric = by_name[s.name] = sm.metrics.add(name=spec.name if spec else s.name)
            if spec is not None:
                metric.unit = spec.unit
        if spec is not None and spec.instrument in ("counter", "updowncounter"):
            metric.sum.aggregation_temporality = 2
            metric.sum.is_monotonic = spec.instrument == "counter"
            point = metric.sum.data_points.add(start_time_unix_nano=start)
        else:
            point = metric.gauge.data_points.add()
        point.time_unix_nano = s.timestamp_ms * 1_000_000
        point.as_double = s.value
        for k, v in s.labels:
            if k not in metrics.RESOURCE_LABELS:
                point.attributes.add(key=metrics.POINT_LABELS.get(k, k)).value.string_value = v
    return request.SerializeToString()

sink.OtlpCodec.cycle = cycle
from sidecar.cli import main
sys.exit(main(sys.argv[1:]))
'''


class Ok(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def status(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def run(variant: str, base: str, head: Path, seconds: float, gpus: int) -> dict[str, float]:
    common = ["run", "--simulate", "healthy", "--simulate-gpus", str(gpus), "--interval", "0.2",
              "--push-interval", "1", "--log-level", "warning"]
    with tempfile.TemporaryDirectory() as spool:
        common += ["--spool-dir", spool]
        if variant == "head":
            argv, cwd = [sys.executable, "-m", "sidecar", *common,
                         "--remote-write-url", f"{base}/api/v1/write"], head
        elif variant == "rw":
            argv, cwd = [sys.executable, "-m", "sidecar", *common,
                         "--remote-write-url", f"{base}/api/v1/write"], ROOT
        elif variant == "otlp-hand":
            argv, cwd = [sys.executable, "-m", "sidecar", *common,
                         "--otlp-url", f"{base}/v1/metrics"], ROOT
        else:
            argv, cwd = [sys.executable, "-c", OFFICIAL, *common,
                         "--otlp-url", f"{base}/v1/metrics"], ROOT
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
        env["PYTHONPATH"] = str(cwd)
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(seconds)
        figures = status(proc.pid)
        proc.terminate()
        _, err = proc.communicate(timeout=30)
        if proc.returncode != 0:
            raise SystemExit(f"{variant} exited {proc.returncode}: {err[-2000:]}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--gpus", type=int, default=8)
    args = parser.parse_args()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    variants = ("head", "rw", "otlp-hand", "otlp-official")
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as head:
        archive = subprocess.run(["git", "archive", "HEAD", "sidecar"], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", head], input=archive, check=True)
        for _ in range(args.rounds):
            for v in variants:
                results[v].append(run(v, base, Path(head), args.seconds, args.gpus))
    server.shutdown()
    med = {v: {k: statistics.median(r[k] for r in runs) for k in ("VmRSS", "VmHWM")}
           for v, runs in results.items()}
    print(f"| variant | VmRSS at {args.seconds:.0f} s, MiB: median (runs) | VmHWM, MiB: median (runs) "
          "| vs rw (OTLP off), RSS |")
    print("|---|---|---|---|")
    for v, runs in results.items():
        rss = ", ".join(f"{r['VmRSS']:.1f}" for r in runs)
        hwm = ", ".join(f"{r['VmHWM']:.1f}" for r in runs)
        delta = med[v]["VmRSS"] - med["rw"]["VmRSS"]
        print(f"| {v} | **{med[v]['VmRSS']:.1f}** ({rss}) | **{med[v]['VmHWM']:.1f}** ({hwm}) "
              f"| {delta:+.1f} |")
    print()
    print(f"OTLP off vs before (rw - head): {med['rw']['VmRSS'] - med['head']['VmRSS']:+.2f} MiB "
          f"RSS (budget +1); hand encoder on (otlp-hand - rw): "
          f"{med['otlp-hand']['VmRSS'] - med['rw']['VmRSS']:+.2f} MiB (budget +3); official "
          f"classes on (otlp-official - rw): "
          f"{med['otlp-official']['VmRSS'] - med['rw']['VmRSS']:+.2f} MiB.")


if __name__ == "__main__":
    main()
