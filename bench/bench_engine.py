"""As deployed: what a serving-engine metrics endpoint costs the agent, healthy and hostile.

    .venv/bin/python bench/bench_engine.py [--window 12] [--warmup 4] [--rounds 3]
        [--bound-mib 24] [--results bench/RESULTS.md] [--save runs.json | --load runs.json]

The agent runs as deployed, one fresh OS process per run: ``.venv/bin/gpu-sidecar run
--simulate healthy --interval 1 --output json --socket <tmp>/app.sock --spool-dir <tmp>/spool``
(scenario "healthy", its 2 simulated GPUs and its in-process simulated app, the same in every
case), its JSON stdout written to a file that this bench reads afterwards (one series per line,
``sidecar/sinks/stdout.py``'s ``json_lines``), and for cases b..f ``--engine-metrics-url`` (the
defaults otherwise: ``--engine-metrics-timeout`` 2 s, ``--engine-metrics-max-bytes`` 4 MiB). The
endpoint is a separate process started by this file (``--role``), on a free port of 127.0.0.1:

a. **baseline**: no ``--engine-metrics-url``.
b. **healthy vLLM**: ``sidecar.simulate.engine.SimulatedEngine`` with scenario "kv-cache-full"'s
   engine profile, plus the other families a real vLLM ``/metrics`` carries, which the agent
   does not read (``ExtraVllm``: prometheus_client's process_* and python_* collectors, the
   http_* families of vLLM's FastAPI instrumentator for its routes, vLLM's token, request-size,
   phase-time, prefix-cache and config families), for 4 engine cores; the body's size and line
   count are measured and reported.
c. **50 MB**: HTTP 200, ``Content-Length`` 50 MiB, a body of Prometheus text lines (an unknown
   family, valid syntax) streamed until the agent hangs up; the agent must stop at 4 MiB.
d. **garbage**: HTTP 200, ``text/plain``, 1 MiB of random bytes (the same bytes every answer).
e. **hang**: accepts the connection, reads the request, never answers; the agent's read must end
   at its 2 s timeout.
f. **disappears**: b's server, killed (SIGKILL) a third of the way into the window; the agent then
   meets a refused connection every read.
g. **the largest answer it parses** (beyond the brief's a..f: what the bound must also cover):
   HTTP 200, 4 MiB less 1 KiB of vLLM text made only of the families the agent reads (the four
   latency histograms, the three gauges and the preemption counter) for as many models
   (``lora-0000``...) as fit: everything is kept by the line filter and parsed by
   prometheus_client, then all but 16 models are left out. No outcome is expected of it: what
   happened is shown.
h. **gzip bomb** (issue #32): HTTP 200, ``Content-Encoding: gzip`` (although the agent asks for
   identity), about 2 MB on the wire inflating to 2 GiB of blank lines (32 gzip members of 64 MiB
   each); the agent must stop inflating at 4 MiB: ``too_large``.
i. **4 MiB of random bytes**: as d, four times as much: ``malformed``.
j. **4 MiB of ``ab\n``**: 1.4 million lines of a metric name with no value: ``malformed``.
k. **4 MiB of ``\xff\n``**: 2.1 million lines that are no UTF-8: ``malformed``.

Runs are interleaved a, b, ..., k, a, b, ... (``--rounds``), each with fresh processes: the
agent's first cycle on its stdout, ``--warmup`` s, then a window of ``--window`` s. Measured for the
agent process only (the endpoint's CPU is shown, not counted): CPU = utime + stime of
/proc/<pid>/stat (all threads, ended ones included: the per-request watchdog timers) over the
window, as % of one core; the main thread's share from schedstat; VmRSS every second through the
window (start, end, largest) and VmHWM at its end (the peak since the process started, warm-up
included). From the agent's stdout, the cycles whose timestamp falls inside the window: their
number against window / interval, ``gpu_sidecar_cycle_duration_seconds`` (median, max), the
largest gap between two cycles' timestamps, the growth of ``gpu_sidecar_cycle_overruns_total``
and ``gpu_sidecar_paused_seconds_total``, and the engine's own series (``gpu_sidecar_engine_up``,
``..._read_duration_seconds``, the growth of ``..._read_failures_total`` by reason), which show
that each case did what it was meant to. Medians of the runs, every run in brackets; nothing is
subtracted or scaled.

Verdicts (the exit code): per case b..k, **cycles not delayed**: every cycle of the window there
(at least window / interval - 1 of them, no gap between two of 1.5 intervals or more, no overrun or
pause counted, the longest cycle under the interval); **memory within the bound**: in every run,
VmHWM and the largest VmRSS of the window at most ``--bound-mib`` MiB above the median VmHWM of the
baseline runs; and the case's expected outcome (b: figures read, engine up; c and h:
``too_large``; d: ``malformed`` or ``not_an_engine``; e: ``timeout``, reads of at most the
timeout plus 0.5 s; f: up, then ``unreachable``; i, j, k: ``malformed``). A missed verdict is
reported as missed.

``--save FILE`` keeps every run's figures as JSON; ``--load FILE`` writes the report from such a
file instead of measuring (to show the same runs against another ``--bound-mib``).

``--results FILE`` appends the report to FILE (bench/RESULTS.md) as a new last section, or, if the
section is there already, replaces its generated part (from its heading to its "Checks:" line and
the verdict line after it), leaving the prose after it as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import math
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from _report import cpu_seconds, heading, replace_section, section, status_mib, stop, wait_until  # noqa: E402

AGENT = ROOT / ".venv" / "bin" / "gpu-sidecar"
SCENARIO = "healthy"
ENGINE_SCENARIO = "kv-cache-full"
INTERVAL_S = 1.0
TIMEOUT_S = 2.0  # the agent's --engine-metrics-timeout default, which the bench leaves as is
MAX_BYTES = 4 << 20  # the agent's --engine-metrics-max-bytes default
LOCAL = "127.0.0.1"
HUGE_BYTES = 50 << 20
GARBAGE_BYTES = 1 << 20
EXTRA_ENGINES = 4  # engine cores of the simulated vLLM's other families (data parallel 4)
KILL_AT = 1 / 3  # f: the server is killed this far into the window
STALE_S = 2 * INTERVAL_S + TIMEOUT_S  # the agent stops exporting figures older than this
LARGE_BYTES = MAX_BYTES - 1024  # g: just under --engine-metrics-max-bytes
BOMB_BYTES = 2 << 30  # h: what the gzip answer inflates to
BOUND_MIB = 24.0  # the proposed bound: at most this much above the agent without an endpoint
TITLE = "Serving-engine endpoint: healthy and hostile, whole processes"

CASES = {  # name: (what, server role or None, kill the server mid-window)
    "a": ("baseline: no --engine-metrics-url", None, False),
    "b": ("healthy vLLM endpoint", "vllm", False),
    "c": ("answers 50 MiB (valid-looking text, streamed)", "huge", False),
    "d": ("answers 1 MiB of random bytes", "garbage", False),
    "e": ("accepts, never answers", "hang", False),
    "f": ("healthy vLLM endpoint, killed 1/3 into the window", "vllm", True),
    "g": ("answers 4 MiB less 1 KiB of vLLM text it reads, 400+ models (the largest answer "
          "it parses)", "large", False),
    "h": ("answers gzip, 2 MB inflating to 2 GiB", "bomb", False),
    "i": ("answers 4 MiB of random bytes", "random4", False),
    "j": ("answers 4 MiB of 'ab\\n'", "ab", False),
    "k": ("answers 4 MiB of '\\xff\\n'", "ff", False),
}


# -- the endpoints, run as child processes of this file ----------------------------------------

def ready(path: str, port: int, **extra: object) -> None:
    """Tell the bench where this server listens (written whole, then renamed)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"url": f"http://{LOCAL}:{port}/metrics", **extra}, f)
    os.replace(tmp, path)


def extra_vllm(engines: int):
    """The families a real vLLM /metrics has besides the ones the agent reads: its API server's
    http_* (prometheus-fastapi-instrumentator) and vLLM's other families, per engine core."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        SummaryMetricFamily,
    )
    from prometheus_client.registry import Collector

    routes = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/models",
              "/health", "/metrics", "/tokenize", "/detokenize", "/version", "/ping",
              "/v1/responses", "/pooling", "/score", "/rerank", "/invocations", "/load")
    duration_bounds = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0,
                       3.5, 4.0, 4.5, 5.0, 7.5, 10.0, 30.0, 60.0)
    token_bounds = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                    100000)
    iteration_bounds = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
    phase_bounds = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
    model = "meta-llama/Llama-3.1-70B-Instruct (Simulated)"

    def histogram(name: str, doc: str, labels: list[str], values: list[str],
                  bounds: tuple[float, ...], total: float) -> HistogramMetricFamily:
        h = HistogramMetricFamily(name, doc, labels=labels)
        h.add_metric(values, [(repr(float(b)), float(round(total * (1 - math.exp(-i / 4)))))
                              for i, b in enumerate(bounds)] + [("+Inf", float(total))],
                     sum_value=total * 1.7)
        return h

    class ExtraVllm(Collector):
        def __init__(self) -> None:
            self.start = time.monotonic() - 600.0

        def collect(self):
            t = time.monotonic() - self.start
            n = float(int(40 * t))
            status = (("2xx", 0.97), ("4xx", 0.02), ("5xx", 0.01))
            c = CounterMetricFamily("http_requests", "Total number of requests by method, "
                                    "status and handler.", labels=["handler", "method", "status"])
            for r in routes:
                for s, share in status:
                    c.add_metric([r, "POST" if r.startswith("/v1") else "GET", s], n * share)
            yield c
            for name, doc in (("http_request_size_bytes", "Content length of incoming requests "
                               "by handler. Only value of header is respected. Otherwise ignored."),
                              ("http_response_size_bytes", "Content length of outgoing responses "
                               "by handler. Only value of header is respected. Otherwise "
                               "ignored.")):
                s = SummaryMetricFamily(name, doc, labels=["handler"])
                for r in routes:
                    s.add_metric([r], count_value=n, sum_value=n * 2048)
                yield s
            yield histogram("http_request_duration_highr_seconds", "Latency with many buckets "
                            "but no API specific labels. Made for more accurate percentile "
                            "calculations.", [], [], duration_bounds, n)
            h = HistogramMetricFamily("http_request_duration_seconds", "Latency with only few "
                                      "buckets by handler. Made to be only used if aggregation "
                                      "by handler is important.", labels=["handler", "method"])
            for r in routes:
                h.add_metric([r, "POST" if r.startswith("/v1") else "GET"],
                             [("0.1", n * 0.2), ("0.5", n * 0.6), ("1.0", n * 0.9),
                              ("+Inf", n)], sum_value=n * 0.7)
            yield h
            labels = ["model_name", "engine"]
            for e in range(engines):
                values = [model, str(e)]
                for name, doc, value in (
                        ("vllm:prompt_tokens", "Number of prefill tokens processed.", n * 900),
                        ("vllm:generation_tokens", "Number of generation tokens processed.",
                         n * 300),
                        ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number "
                         "of queried tokens.", n * 900),
                        ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of "
                         "cached tokens.", n * 400),
                        ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", 0.0),
                        ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                         0.0)):
                    cf = CounterMetricFamily(name, doc, labels=labels)
                    cf.add_metric(values, value)
                    yield cf
                rs = CounterMetricFamily("vllm:request_success", "Count of successfully "
                                         "processed requests.",
                                         labels=[*labels, "finished_reason"])
                for reason in ("stop", "length", "abort"):
                    rs.add_metric([*values, reason], n / 3)
                yield rs
                for name, doc, bounds in (
                        ("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                         token_bounds),
                        ("vllm:request_generation_tokens", "Number of generation tokens "
                         "processed.", token_bounds),
                        ("vllm:request_max_num_generation_tokens", "Histogram of maximum number "
                         "of requested generation tokens.", token_bounds),
                        ("vllm:request_params_max_tokens", "Histogram of the max_tokens request "
                         "parameter.", token_bounds),
                        ("vllm:iteration_tokens_total", "Histogram of number of tokens per "
                         "engine_step.", iteration_bounds),
                        ("vllm:request_params_n", "Histogram of the n request parameter.",
                         (1, 2, 5, 10, 20)),
                        ("vllm:request_inference_time_seconds", "Histogram of time spent in "
                         "RUNNING phase for request.", phase_bounds),
                        ("vllm:request_prefill_time_seconds", "Histogram of time spent in "
                         "PREFILL phase for request.", phase_bounds),
                        ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE "
                         "phase for request.", phase_bounds)):
                    yield histogram(name, doc, labels, values, bounds, n)
            lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                     labels=["max_lora", "waiting_lora_adapters",
                                             "running_lora_adapters"])
            lora.add_metric(["0", "", ""], time.time())
            yield lora
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine "
                                     "CacheConfig", labels=["block_size", "cache_dtype",
                                                            "gpu_memory_utilization",
                                                            "num_cpu_blocks", "num_gpu_blocks",
                                                            "enable_prefix_caching"])
            info.add_metric(["16", "auto", "0.9", "0", "65536", "True"], 1.0)
            yield info

    return ExtraVllm()


def role_vllm(ready_path: str) -> None:
    """b and f: SimulatedEngine for kv-cache-full's engine profile, with vLLM's other families
    (process_*, python_*, http_*, the rest of vllm:*) in the same registry."""
    from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, generate_latest

    from sidecar.simulate.engine import SimulatedEngine
    from sidecar.simulate.scenarios import build

    sim = SimulatedEngine(build(ENGINE_SCENARIO).engine)
    # the default registry's collectors, as vLLM's /metrics shows them (its own process's)
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        with contextlib.suppress(ValueError):
            sim.registry.register(collector)
    sim.registry.register(extra_vllm(EXTRA_ENGINES))
    body = generate_latest(sim.registry)
    sim.start()
    port = int(sim.url.rsplit(":", 1)[1].split("/", 1)[0])
    ready(ready_path, port, bytes=len(body), lines=body.count(b"\n"))
    while True:
        signal.pause()


def serve_http(ready_path: str, answer, **extra: object) -> None:
    """A threading HTTP server on a free port whose GET answers by ``answer(handler)``."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                answer(self)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((LOCAL, 0), Handler)
    server.daemon_threads = True
    ready(ready_path, server.server_address[1], **extra)
    server.serve_forever()


def text_answer(body: bytes):
    """A 200 text/plain answer of ``body`` for ``serve_http``."""
    def answer(h) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    return answer


def role_huge(ready_path: str) -> None:
    """c: 50 MiB of Prometheus text lines (syntax valid, a family the agent does not read),
    written 1 MiB at a time until the agent hangs up."""
    lines = []
    size, i = 0, 0
    while size < (1 << 20):
        line = (f'vllm:request_padding_bucket{{engine="{i % 8}",le="{i}.0",'
                f'model_name="meta-llama/Llama-3.1-70B-Instruct"}} {i * 7}\n')
        lines.append(line)
        size += len(line)
        i += 1
    chunk = "".join(lines).encode()[: 1 << 20]
    chunk = chunk[: chunk.rindex(b"\n") + 1]
    chunk += b"#" * ((1 << 20) - len(chunk) - 1) + b"\n"  # a comment line pads it to 1 MiB
    assert len(chunk) == 1 << 20

    def answer(h) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        h.send_header("Content-Length", str(HUGE_BYTES))
        h.end_headers()
        for _ in range(HUGE_BYTES // len(chunk)):
            h.wfile.write(chunk)

    serve_http(ready_path, answer)


def role_garbage(ready_path: str) -> None:
    """d: 1 MiB of random bytes as a 200 text/plain answer."""
    body = random.Random(20261201).randbytes(GARBAGE_BYTES)

    answer = text_answer(body)

    serve_http(ready_path, answer)


def role_hang(ready_path: str) -> None:
    """e: accepts, reads what comes, never writes; closes when the agent does."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((LOCAL, 0))
    server.listen(64)

    def hold(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while conn.recv(65536):
                pass

    ready(ready_path, server.getsockname()[1])
    while True:
        conn, _ = server.accept()
        threading.Thread(target=hold, args=(conn,), daemon=True).start()


def large_text(size: int) -> bytes:
    """vLLM's exposition of the families the agent reads, for as many models (LoRA adapters,
    ``lora-0000``...) as fit in ``size`` bytes, padded to ``size`` with a comment line."""
    from sidecar.simulate.engine import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS

    histograms = (("vllm:e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS),
                  ("vllm:request_queue_time_seconds", REQUEST_LATENCY_BUCKETS),
                  ("vllm:time_to_first_token_seconds", TTFT_BUCKETS),
                  ("vllm:inter_token_latency_seconds", ITL_BUCKETS))
    gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:kv_cache_usage_perc")

    def render(models: int) -> bytes:
        out: list[str] = []
        for name in gauges:
            out.append(f"# HELP {name} A gauge.\n# TYPE {name} gauge\n")
            out += [f'{name}{{engine="0",model_name="lora-{m:04d}"}} {m % 7}.0\n'
                    for m in range(models)]
        out.append("# HELP vllm:num_preemptions_total Preemptions.\n"
                   "# TYPE vllm:num_preemptions_total counter\n")
        out += [f'vllm:num_preemptions_total{{engine="0",model_name="lora-{m:04d}"}} {m}.0\n'
                for m in range(models)]
        for name, bounds in histograms:
            out.append(f"# HELP {name} A histogram.\n# TYPE {name} histogram\n")
            for m in range(models):
                labels = f'engine="0",model_name="lora-{m:04d}"'
                out += [f'{name}_bucket{{{labels},le="{b!r}"}} {i * 10 + m}.0\n'
                        for i, b in enumerate(bounds)]
                n = len(bounds) * 10 + m
                out.append(f'{name}_bucket{{{labels},le="+Inf"}} {n}.0\n')
                out.append(f"{name}_count{{{labels}}} {n}.0\n{name}_sum{{{labels}}} {n * 0.7}\n")
        return "".join(out).encode()

    models = 1
    while len(render(models * 2)) < size:
        models *= 2
    low, high = models, models * 2  # the most models that fit
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if len(render(mid)) < size else (low, mid)
    body = render(low)
    return body + b"#" * (size - len(body) - 1) + b"\n"


def role_large(ready_path: str) -> None:
    """g: the largest answer the agent parses (``large_text``), HTTP 200."""
    body = large_text(LARGE_BYTES)
    assert len(body) == LARGE_BYTES

    answer = text_answer(body)

    serve_http(ready_path, answer, bytes=len(body), lines=body.count(b"\n"),
               models=body.count(b"vllm:num_requests_running{"))


def role_bomb(ready_path: str) -> None:
    """h: a gzip answer of about 2 MB that inflates to 2 GiB of blank lines (valid text: only a
    bound on the inflated size stops a reader), as gzip members of 64 MiB one after the other."""
    import gzip

    body = gzip.compress(b"\n" * (64 << 20), 9) * (BOMB_BYTES // (64 << 20))

    def answer(h) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        h.send_header("Content-Encoding", "gzip")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    serve_http(ready_path, answer, bytes=len(body))


def role_random4(ready_path: str) -> None:
    """i: 4 MiB of random bytes as a 200 text/plain answer."""
    serve_http(ready_path, text_answer(random.Random(20261202).randbytes(MAX_BYTES)))


def role_ab(ready_path: str) -> None:
    """j: 4 MiB of ``ab\\n``."""
    serve_http(ready_path, text_answer(b"ab\n" * (MAX_BYTES // 3)))


def role_ff(ready_path: str) -> None:
    """k: 4 MiB of ``\\xff\\n``."""
    serve_http(ready_path, text_answer(b"\xff\n" * (MAX_BYTES // 2)))


ROLES = {"vllm": role_vllm, "huge": role_huge, "garbage": role_garbage, "hang": role_hang,
         "large": role_large, "bomb": role_bomb, "random4": role_random4, "ab": role_ab,
         "ff": role_ff}


# -- processes ---------------------------------------------------------------------------------

def child_env(tree: Path) -> dict[str, str]:
    """This environment without ``GPU_SIDECAR_*``, importing ``sidecar`` from ``tree`` (its
    ``PYTHONPATH`` comes before the editable install's finder)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
    env.pop("PYTHONSAFEPATH", None)
    env["PYTHONPATH"] = str(tree)
    return env


def snapshot() -> tuple[Path, dict]:
    """This checkout's ``sidecar/`` as it is now, copied into a fresh temporary directory and
    compiled there (every run alike, none paying the compilation): the agents of all rounds
    run the same code while the working tree goes on changing. Returns the directory (the
    caller removes it) and what identifies the code measured."""
    tree = Path(tempfile.mkdtemp(prefix="bench-engine-tree-")).resolve()
    shutil.copytree(ROOT / "sidecar", tree / "sidecar",
                    ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "sidecar")], check=True)
    digest = hashlib.sha256()
    for path in sorted((tree / "sidecar").rglob("*.py")):
        digest.update(path.relative_to(tree).as_posix().encode() + b"\0" + path.read_bytes())
    # started as the entry point is (a script in another directory: sys.path[0] is that
    # directory, then PYTHONPATH), a probe must import sidecar from the copy
    probe = tree / "probe" / "probe.py"
    probe.parent.mkdir()
    probe.write_text("import sidecar\nprint(sidecar.__file__)\n")
    where = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True,
                           check=True, cwd=tree, env=child_env(tree)).stdout.strip()
    if not Path(where).resolve().is_relative_to(tree / "sidecar"):
        raise RuntimeError(f"the agent would import sidecar from {where}, not from {tree}")

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              check=True).stdout.rstrip("\n")  # porcelain lines begin with a blank

    dirty = git("status", "--porcelain", "--", "sidecar")
    return tree, {"head": git("rev-parse", "--short", "HEAD"),
                  "dirty": [line[3:] for line in dirty.splitlines()],
                  "sha256": digest.hexdigest()[:16], "imports": where}


def alive(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is not None:
            raise RuntimeError(f"{p.args[:4]} exited with {p.returncode} during the run")


def main_thread_cpu(pid: int) -> float:
    """CPU seconds of the process's main thread (schedstat, ns)."""
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0]) / 1e9


IMPORTS = """
import json, sys
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
import sidecar.cli, sidecar.wiring, sidecar.agent, sidecar.sinks.stdout
before, had = rss(), "requests" in sys.modules
import sidecar.sinks.http, sidecar.sources.engine
print(json.dumps({"before": before, "after": rss(), "had_requests": had}))
"""


def import_cost(tree: Path) -> dict:
    """VmRSS of a fresh interpreter (the copy's sidecar) after the modules of the agent's run
    path, and after also the HTTP layer and the engine source (which the agent imports only
    with an engine endpoint or an HTTP sink): median of 5."""
    runs = [json.loads(subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True,
                                      text=True, check=True, cwd=tree,
                                      env=child_env(tree)).stdout) for _ in range(5)]
    return {"before": med([r["before"] for r in runs]), "after": med([r["after"] for r in runs]),
            "had_requests": any(r["had_requests"] for r in runs)}


def start_server(role: str, tmp: Path, tree: Path) -> tuple[subprocess.Popen, dict]:
    where = tmp / "server.json"
    with (tmp / "server.log").open("wb") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--role", role,
                                 "--ready", str(where), "--tree", str(tree)], stdout=log,
                                stderr=subprocess.STDOUT, cwd=tree, env=child_env(tree))
    wait_until(lambda: where.exists() or proc.poll() is not None, 30, f"{role} server")
    alive(proc)
    return proc, json.loads(where.read_text())


def run_case(case: str, tmp: Path, warmup: float, window: float, tree: Path) -> dict:
    _, role, kill = CASES[case]
    server = agent = None
    info: dict = {}
    try:
        if role is not None:
            server, info = start_server(role, tmp, tree)
        command = [str(AGENT), "run", "--simulate", SCENARIO, "--interval", str(INTERVAL_S),
                   "--output", "json", "--socket", str(tmp / "app.sock"),
                   "--spool-dir", str(tmp / "spool")]
        if role is not None:
            command += ["--engine-metrics-url", info["url"]]
        out = tmp / "out.json"
        with out.open("wb") as stdout, (tmp / "agent.log").open("wb") as stderr:
            agent = subprocess.Popen(command, stdout=stdout, stderr=stderr, cwd=tree,
                                     env=child_env(tree))
        wait_until(lambda: b"gpu_sidecar_cycle_duration_seconds" in out.read_bytes()
                   or agent.poll() is not None, 30, "the agent's first cycle")
        alive(agent)
        time.sleep(warmup)
        alive(agent)
        if server is not None:
            alive(server)

        pid = agent.pid
        c0, m0 = cpu_seconds(pid), main_thread_cpu(pid)
        s0 = cpu_seconds(server.pid) if server is not None else 0.0
        rss = [status_mib(pid, "VmRSS")]
        t0, w0 = time.monotonic(), time.time()
        kill_at = t0 + window * KILL_AT if kill else None
        server_cpu = None
        killed_wall = None
        end = t0 + window
        while True:
            now = time.monotonic()
            if now >= end:
                break
            step = min(1.0, end - now)
            if kill_at is not None and now < kill_at <= now + step:
                time.sleep(max(0.0, kill_at - now))
                server_cpu = cpu_seconds(server.pid) - s0
                server.kill()
                server.wait()
                killed_wall = time.time()
                kill_at = None
                continue
            time.sleep(step)
            rss.append(status_mib(pid, "VmRSS"))
        c1, m1 = cpu_seconds(pid), main_thread_cpu(pid)
        t1, w1 = time.monotonic(), time.time()
        hwm = status_mib(pid, "VmHWM")
        rss.append(status_mib(pid, "VmRSS"))
        if server is not None and server_cpu is None:
            server_cpu = cpu_seconds(server.pid) - s0
        alive(agent)
        threads = len(os.listdir(f"/proc/{pid}/task"))
        stop(agent)
        stop(server)
        log = (tmp / "agent.log").read_text(errors="replace")
        result = {
            "cpu_pct": (c1 - c0) / (t1 - t0) * 100, "main_pct": (m1 - m0) / (t1 - t0) * 100,
            "rss_start": rss[0], "rss_end": rss[-1], "rss_max": max(rss), "hwm": hwm,
            "threads": threads,
            "server_pct": None if server_cpu is None else server_cpu / (t1 - t0) * 100,
            "body_bytes": info.get("bytes"), "body_lines": info.get("lines"),
            "body_models": info.get("models"), "left_out_models": "too_many_models" in log,
            **cycles_of(out, w0 * 1000, w1 * 1000, killed_wall),
        }
        return result
    finally:
        stop(agent)
        if server is not None and server.poll() is None:
            server.kill()
            server.wait()


def cycles_of(out: Path, t0_ms: float, t1_ms: float, killed_wall: float | None) -> dict:
    """What the agent's stdout says of the cycles whose timestamp lies in [t0, t1]."""
    durations: dict[int, float] = {}
    counters: dict[str, dict[int, float]] = {}
    engine_up: dict[int, float] = {}
    read_s: dict[int, float] = {}
    engine_figures: dict[int, int] = {}
    for line in out.read_text().splitlines():
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        name, ts, value = r["name"], r["timestamp_ms"], r["value"]
        if name == "gpu_sidecar_cycle_duration_seconds":
            durations[ts] = value
        elif name in ("gpu_sidecar_cycle_overruns_total", "gpu_sidecar_paused_seconds_total"):
            counters.setdefault(name, {})[ts] = value
        elif name == "gpu_sidecar_engine_read_failures_total":
            counters.setdefault(f"failures:{r['labels']['reason']}", {})[ts] = value
        elif name == "gpu_sidecar_engine_up":
            engine_up[ts] = value
        elif name == "gpu_sidecar_engine_read_duration_seconds":
            read_s[ts] = value
        elif name.startswith("engine_"):
            engine_figures[ts] = engine_figures.get(ts, 0) + 1
    every = sorted(durations)
    inside = [ts for ts in every if t0_ms <= ts < t1_ms]
    before = [ts for ts in every if ts < t0_ms]
    edges = ([before[-1]] if before else []) + inside
    gaps = [(b - a) / 1000 for a, b in itertools.pairwise(edges)]

    def growth(name: str) -> float:
        values = counters.get(name, {})
        ins = [values[ts] for ts in inside if ts in values]
        pre = [values[ts] for ts in before if ts in values]
        if not ins:
            return 0.0
        return ins[-1] - (pre[-1] if pre else ins[0])

    failures = {k.split(":", 1)[1]: growth(k) for k in counters if k.startswith("failures:")}
    up = [engine_up[ts] for ts in inside if ts in engine_up]
    reads = [read_s[ts] for ts in inside if ts in read_s]
    kill_ms = killed_wall * 1000 if killed_wall is not None else None
    return {
        "cycles": len(inside),
        "dur_median": statistics.median(durations[ts] for ts in inside) if inside else math.nan,
        "dur_max": max(durations[ts] for ts in inside) if inside else math.nan,
        "gap_max": max(gaps) if gaps else math.nan,
        "overruns": growth("gpu_sidecar_cycle_overruns_total"),
        "paused_s": growth("gpu_sidecar_paused_seconds_total"),
        "failures": {k: v for k, v in failures.items() if v},
        "up_share": sum(up) / len(up) if up else None,
        "up_before_kill": ([engine_up[ts] for ts in inside if ts in engine_up
                            and ts < kill_ms] if kill_ms else None),
        "up_after_kill": ([engine_up[ts] for ts in inside if ts in engine_up
                           and ts > kill_ms + 1000 * (STALE_S + 2 * INTERVAL_S)]
                          if kill_ms else None),
        "read_max": max(reads) if reads else None,
        "read_median": statistics.median(reads) if reads else None,
        "engine_figures": max(engine_figures.get(ts, 0) for ts in inside) if inside else 0,
    }


# -- report ------------------------------------------------------------------------------------

def med(values: list[float]) -> float:
    return statistics.median(values)


def fmt(values: list[float], digits: int = 1) -> str:
    return f"**{med(values):.{digits}f}** ({', '.join(f'{v:.{digits}f}' for v in values)})"


def expected_outcome(case: str, runs: list[dict]) -> tuple[bool, str]:
    """Whether every run of ``case`` did what the case is for, and what they did."""
    def said(r: dict) -> str:
        f = ", ".join(f"{k} +{v:.0f}" for k, v in sorted(r["failures"].items())) or "none"
        up = "-" if r["up_share"] is None else f"{r['up_share']:.2f}"
        return f"{up} / {f}"

    def each(ok) -> bool:
        return all(ok(r) for r in runs)

    if case == "a":
        ok = each(lambda r: r["up_share"] is None)
    elif case == "b":
        ok = each(lambda r: r["up_share"] == 1.0 and not r["failures"] and r["engine_figures"] > 0)
    elif case in ("c", "h"):
        ok = each(lambda r: set(r["failures"]) == {"too_large"} and r["up_share"] == 0.0)
    elif case in ("i", "j", "k"):
        ok = each(lambda r: set(r["failures"]) == {"malformed"} and r["up_share"] == 0.0)
    elif case == "d":
        ok = each(lambda r: set(r["failures"]) <= {"malformed", "not_an_engine"}
                  and r["failures"] and r["up_share"] == 0.0)
    elif case == "e":
        ok = each(lambda r: set(r["failures"]) == {"timeout"} and r["up_share"] == 0.0
                  and r["read_max"] is not None and r["read_max"] <= TIMEOUT_S + 0.5)
    elif case == "g":
        return True, "; ".join(said(r) for r in runs)  # shown: no outcome is expected of it
    else:  # f
        ok = each(lambda r: r["up_before_kill"] and all(v == 1.0 for v in r["up_before_kill"])
                  and r["up_after_kill"] and all(v == 0.0 for v in r["up_after_kill"])
                  and set(r["failures"]) == {"unreachable"})
    return ok, "; ".join(said(r) for r in runs)


def report(runs: dict[str, list[dict]], window: float, warmup: float, rounds: int,
           bound: float, code: dict) -> tuple[list[str], bool]:
    def col(case: str, key: str) -> list[float]:
        return [r[key] for r in runs[case]]

    base_hwm = med(col("a", "hwm"))
    base_rss = med(col("a", "rss_end"))
    base_cpu = med(col("a", "cpu_pct"))
    expected = window / INTERVAL_S
    verdicts: dict[str, dict[str, bool]] = {}
    for case in CASES:
        rs = runs[case]
        on_time = all(r["cycles"] >= expected - 1 and r["gap_max"] < 1.5 * INTERVAL_S
                      and r["overruns"] == 0 and r["paused_s"] == 0
                      and r["dur_max"] < INTERVAL_S for r in rs)
        excess = max(max(r["hwm"], r["rss_max"]) - base_hwm for r in rs)
        verdicts[case] = {"on_time": on_time, "memory": excess <= bound,
                          "outcome": expected_outcome(case, rs)[0]}

    def v(ok: bool) -> str:
        return "yes" if ok else "**NO (missed)**"

    body, large = runs["b"][0], runs["g"][0]
    imp = code["imports_mib"]
    lines = [
        heading(TITLE, f"scenario {SCENARIO} ({2} simulated GPUs), 1 s sampling, "
                f"{rounds} interleaved rounds of {warmup:.0f} s warm-up + {window:.0f} s window"),
        "",
        "| case | agent CPU, % of one core: median (runs) | vs baseline | main thread, % | "
        "VmRSS at end of window, MiB | largest VmRSS in window, MiB | VmHWM, MiB: median (runs) "
        "| VmHWM - baseline VmHWM (median), MiB: largest run | endpoint's CPU, % (not counted) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case, (what, _, _) in CASES.items():
        cpu = col(case, "cpu_pct")
        excess = max(max(r["hwm"], r["rss_max"]) - base_hwm for r in runs[case])
        server = [r["server_pct"] for r in runs[case] if r["server_pct"] is not None]
        lines.append(
            f"| {case}. {what} | {fmt(cpu, 2)} | {med(cpu) - base_cpu:+.2f} | "
            f"{fmt(col(case, 'main_pct'), 2)} | {fmt(col(case, 'rss_end'))} | "
            f"{fmt(col(case, 'rss_max'))} | {fmt(col(case, 'hwm'))} | "
            f"{'-' if case == 'a' else f'{excess:+.1f}'} | "
            f"{fmt(server, 2) if server else '-'} |")
    lines += [
        "",
        f"| case | cycles in window (expected {expected:.0f}) | cycle duration, ms: median | "
        "cycle duration, ms: max | largest gap between cycles, s | overruns, paused s | "
        "engine read duration, s: median / max | engine_up share of the window / failures "
        "counted in it, by reason (per run) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in CASES:
        rs = runs[case]
        reads = [r["read_max"] for r in rs if r["read_max"] is not None]
        read_med = [r["read_median"] for r in rs if r["read_median"] is not None]
        pauses = [f"{r['overruns']:.0f}/{r['paused_s']:.0f}" for r in rs]
        lines.append(
            f"| {case}. | {', '.join(str(r['cycles']) for r in rs)} | "
            f"{fmt([r['dur_median'] * 1000 for r in rs], 2)} | "
            f"{fmt([r['dur_max'] * 1000 for r in rs], 2)} | {fmt(col(case, 'gap_max'), 3)} | "
            f"{', '.join(pauses)} | "
            f"{f'{med(read_med):.3f} / {max(reads):.3f}' if reads else '-'} | "
            f"{expected_outcome(case, rs)[1]} |")
    lines += [
        "",
        "| target (per case, every run) | " + " | ".join(f"{c}." for c in CASES if c != "a")
        + " |",
        "|---|" + "---|" * (len(CASES) - 1),
        "| cycles not delayed (all cycles of the window there, no gap >= 1.5 intervals, no "
        "overrun or pause, longest cycle < interval) | "
        + " | ".join(v(verdicts[c]["on_time"]) for c in CASES if c != "a") + " |",
        f"| memory within the bound: VmHWM and every VmRSS of the window <= baseline VmHWM "
        f"({base_hwm:.1f} MiB) + {bound:g} MiB | "
        + " | ".join(v(verdicts[c]["memory"]) for c in CASES if c != "a") + " |",
        "| the case's expected outcome (engine series) | "
        + " | ".join(v(verdicts[c]["outcome"]) for c in CASES if c != "a") + " |",
        "",
        f"Code measured: `sidecar/` of this checkout at {code['head']}"
        + (f" with uncommitted changes in {', '.join(code['dirty'])}" if code["dirty"] else "")
        + f", copied once before the rounds (sha256 of its .py files {code['sha256']}); every "
        f"agent started from it (a probe started as the entry point imported "
        f"`{code['imports']}`). Load average (1 min) before the rounds and after "
        f"each run: {min(code['load']):.2f} to {max(code['load']):.2f}.",
        "",
        f"Of the memory: a fresh interpreter importing the agent's run path (`sidecar.cli`, "
        f"`.wiring`, `.agent`, `.sinks.stdout`) holds {imp['before']:.1f} MiB, "
        f"{imp['after']:.1f} MiB after also importing `sidecar.sinks.http` and "
        f"`sidecar.sources.engine` (+{imp['after'] - imp['before']:.1f} MiB: `requests`, urllib3 "
        f"and what they import; `requests` loaded before: "
        f"{'yes' if imp['had_requests'] else 'no'}), a cost that an "
        f"agent with an HTTP sink (remote-write, OTLP, Pushgateway) pays already; median of 5.",
        "",
        f"Checks: b's body {body['body_bytes'] / 1024:.0f} KiB, {body['body_lines']} lines; "
        f"g's body {large['body_bytes']} bytes, {large['body_lines']} lines, "
        f"{large['body_models']} models (the agent logged too_many_models: "
        f"{[r['left_out_models'] for r in runs['g']]}); "
        f"baseline cycles {[r['cycles'] for r in runs['a']]} (on time: "
        f"{'yes' if verdicts['a']['on_time'] else 'NO'}); agent threads at the end of the "
        f"window per case: "
        + ", ".join(f"{c} {[r['threads'] for r in runs[c]]}" for c in CASES)
        + f"; baseline VmRSS at end {base_rss:.1f} MiB; VmRSS start -> end of window per run: "
        + ", ".join(f"{c} " + " ".join(f"{r['rss_start']:.1f}->{r['rss_end']:.1f}"
                                       for r in runs[c]) for c in CASES) + ".",
    ]
    ok = all(all(vs.values()) for c, vs in verdicts.items() if c != "a") \
        and verdicts["a"]["on_time"] and verdicts["a"]["outcome"]
    return lines, ok


def write_results(path: Path, text: str) -> None:
    """Replace this section's generated part if it is there, else append it as the last one."""
    if any(line.startswith(f"## {TITLE}") for line in path.read_text().split("\n")):
        replace_section(path, text, TITLE, last="Checks:")
        return
    old = path.read_text().rstrip("\n")
    path.write_text(old + "\n\n\n" + text.rstrip("\n") + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--role", choices=tuple(ROLES), help=argparse.SUPPRESS)
    parser.add_argument("--ready", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--window", type=float, default=12.0, help="seconds measured per run")
    parser.add_argument("--warmup", type=float, default=4.0,
                        help="seconds after the agent's first cycle, before the window")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of a..k")
    parser.add_argument("--bound-mib", type=float, default=BOUND_MIB,
                        help=f"memory bound above the baseline's VmHWM (default {BOUND_MIB:g})")
    parser.add_argument("--cases", default="".join(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--save", type=Path, metavar="FILE", help="keep the runs as JSON")
    parser.add_argument("--load", type=Path, metavar="FILE",
                        help="report the runs of a --save file instead of measuring")
    parser.add_argument("--results", type=Path, metavar="FILE",
                        help="also write the report into FILE (bench/RESULTS.md)")
    args = parser.parse_args()
    if args.role:
        sys.path.insert(0, args.tree)  # the measured copy's sidecar, before this checkout's
        ROLES[args.role](args.ready)
        return 0
    if args.load is not None:
        saved = json.loads(args.load.read_text())
        runs, args.window, args.warmup, args.rounds = (saved["runs"], saved["window"],
                                                       saved["warmup"], saved["rounds"])
        return render(runs, args, saved["code"])
    runs: dict[str, list[dict]] = {c: [] for c in CASES if c in args.cases}
    tree, code = snapshot()
    print(f"measuring {code}", file=sys.stderr, flush=True)
    load = [os.getloadavg()[0]]
    try:
        for n in range(args.rounds):
            for case in runs:
                tmp = Path(tempfile.mkdtemp(prefix=f"bench-engine-{case}-"))
                try:
                    r = run_case(case, tmp, args.warmup, args.window, tree)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
                runs[case].append(r)
                load.append(os.getloadavg()[0])
                print(f"round {n + 1} {case}: CPU {r['cpu_pct']:.2f} % RSS {r['rss_end']:.1f} "
                      f"(max {r['rss_max']:.1f}) HWM {r['hwm']:.1f} MiB; cycles {r['cycles']}, "
                      f"dur max {r['dur_max'] * 1000:.1f} ms, gap max {r['gap_max']:.3f} s; "
                      f"up {r['up_share']} failures {r['failures']} read max {r['read_max']}",
                      file=sys.stderr, flush=True)
        import_cost_result = import_cost(tree)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    code["load"] = load
    code["imports_mib"] = import_cost_result
    if args.save is not None:
        args.save.write_text(json.dumps({"runs": runs, "window": args.window,
                                         "warmup": args.warmup, "rounds": args.rounds,
                                         "code": code}, indent=1))
    if set(runs) != set(CASES):
        print(json.dumps(runs, indent=1, default=str))
        return 0
    return render(runs, args, code)


def render(runs: dict[str, list[dict]], args: argparse.Namespace, code: dict) -> int:
    lines, ok = report(runs, args.window, args.warmup, args.rounds, args.bound_mib, code)
    text = section(lines, ok)
    print(text)
    if args.results is not None:
        write_results(args.results, text)
        print(f"wrote the section '{TITLE}' into {args.results}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
