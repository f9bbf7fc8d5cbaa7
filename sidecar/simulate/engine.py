"""A simulated vLLM metrics endpoint: real HTTP on 127.0.0.1, vLLM's exposition.

The families, their types, label names (``model_name``, ``engine``) and bucket bounds are vLLM's
own (``vllm/v1/metrics/loggers.py`` of its current release), rendered by ``prometheus_client``,
the library vLLM renders them with. The values follow the scenario's ``EngineProfile`` as if the
server had been up for a while: cumulative histograms of log-normal latencies, a KV cache as full
as the profile says, preemptions at its rate. The served model's name says "Simulated".
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from sidecar.simulate.app import lognormal_cdf
from sidecar.simulate.scenarios import EngineProfile

_HOST = "127.0.0.1"  # the demo's endpoint is for this machine's agent only
_Z99 = 2.3263478740408408
# vLLM's default bucket bounds (vllm/v1/metrics/loggers.py and buckets.py, 0.33)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
LABELS = ["model_name", "engine"]


def _histogram(name: str, doc: str, bounds: tuple[float, ...], total: float, median: float,
               p99: float, labels: list[str]) -> HistogramMetricFamily:
    sigma = math.log(p99 / median) / _Z99
    buckets = [(repr(b), float(round(total * lognormal_cdf(b, median, sigma)))) for b in bounds]
    buckets.append(("+Inf", float(total)))
    mean = median * math.exp(sigma * sigma / 2)
    family = HistogramMetricFamily(name, doc, labels=LABELS)
    family.add_metric(labels, buckets, sum_value=total * mean)
    return family


class _VllmCollector(Collector):
    def __init__(self, profile: EngineProfile, elapsed: Callable[[], float]) -> None:
        self.profile = profile
        self.elapsed = elapsed

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        p = self.profile
        t = self.elapsed()
        labels = [p.model_name, "0"]
        requests = float(int(p.requests_per_second * t))
        wiggle = 1 + 0.02 * math.sin(t / 7)
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             p.running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             round(p.waiting * wiggle)),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             min(1.0, p.kv_cache_usage * wiggle)),
        ):
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(labels, float(value))
            yield g
        c = CounterMetricFamily("vllm:num_preemptions",
                                "Cumulative number of preemption from the engine.", labels=LABELS)
        c.add_metric(labels, float(int(p.preemptions_per_second * t)))
        yield c
        yield _histogram("vllm:e2e_request_latency_seconds",
                         "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS,
                         requests, p.latency_median_s, p.latency_p99_s, labels)
        yield _histogram("vllm:request_queue_time_seconds",
                         "Histogram of time spent in WAITING phase for request.",
                         REQUEST_LATENCY_BUCKETS, requests, p.queue_median_s, p.queue_p99_s,
                         labels)
        yield _histogram("vllm:time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", TTFT_BUCKETS, requests,
                         p.ttft_median_s, p.ttft_p99_s, labels)
        yield _histogram("vllm:inter_token_latency_seconds",
                         "Histogram of inter-token latency in seconds.", ITL_BUCKETS,
                         requests * p.tokens_per_request, p.itl_median_s, p.itl_p99_s, labels)


class SimulatedEngine:
    """vLLM's /metrics for a scenario, on a free port of 127.0.0.1 until ``stop``."""

    def __init__(self, profile: EngineProfile, *, warm_up_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        start = clock() - warm_up_s
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_VllmCollector(profile, lambda: clock() - start))
        registry = self.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404)
                    return
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # the agent's log is structured; the demo's requests are not news

        self._server = ThreadingHTTPServer((_HOST, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="simulated-engine",
                                        daemon=True)

    @property
    def url(self) -> str:
        return f"http://{_HOST}:{self._server.server_port}/metrics"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=2)
