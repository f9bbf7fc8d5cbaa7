"""Serving engines' /metrics texts as each engine renders them, for the engine source's tests.

Every family name, type, label name and bucket bound below is the engine's own, from its source
(the releases are named per text), and so is every help text but the few marked "help not
quoted" (paraphrased: nothing reads them). The values are made up but realistic, and fixed (a
seeded generator), so a test can compute from the served text what the agent must forward.

- vLLM renders with ``prometheus_client`` (``vllm/v1/metrics/loggers.py``), and so do these texts:
  ``prometheus_client.core``'s metric families rendered by ``generate_latest``, with the process
  and Python collectors a real vLLM registry also holds (``python_gc_*``, ``process_*``).
  ``vllm_current`` is vllm 0.33.0 (``kv_cache_usage_perc``, ``inter_token_latency_seconds``, two
  engine cores of one data-parallel server); ``vllm_previous`` is vLLM V1 of about 0.8
  (vllm-project/vllm @ a6f0308cfe80: ``gpu_cache_usage_perc`` the only KV gauge,
  ``time_per_output_token_seconds`` the only inter-token histogram, counters declared with their
  ``_total``), which the current naming replaced.
- SGLang 0.5.23 renders with ``prometheus_client`` too (``sglang/srt/observability/
  metrics_collector.py``): scheduler families carry ``model_name, engine_type, tp_rank, pp_rank,
  moe_ep_rank`` and ``dp_rank`` (two data-parallel schedulers here), tokenizer families
  ``model_name, engine_type`` and, where the source adds it, ``is_streaming``.
- TGI (router/src/server.rs @ db931fcf42da, 3.3.x) renders with the Rust crate
  ``metrics-exporter-prometheus`` 0.15: written literally here as that crate writes it (no labels
  on the mapped families, names without a unit suffix, counters without ``_total``, histograms of
  the 35 ``duration`` buckets 0.0001 * 1.5^k in seconds, bucket-less histograms as summaries).
- Triton (triton-inference-server/core @ 73aad7c3348d, src/metrics.cc) renders with
  ``prometheus-cpp``: written literally (counters without ``_total``, cumulative microsecond
  durations, labels ``gpu_uuid``, ``model``, ``version`` sorted as prometheus-cpp keeps them, a
  histogram's ``_count`` and ``_sum`` before its buckets), with the first-response histogram in
  milliseconds of ``--metrics-config histogram_latencies=true``.
"""

from __future__ import annotations

import bisect
import gzip
import math
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

# -- vLLM ----------------------------------------------------------------------------------------

# vllm 0.33.0, vllm/v1/metrics/buckets.py (the same lists as loggers.py of 0.8 and 0.10)
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                                40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
VLLM_REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
VLLM_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
VLLM_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
VLLM_LABELS = ["model_name", "engine"]

# SGLang 0.5.23 (metrics_collector.py), default buckets
SGLANG_QUEUE_TIME_BUCKETS = (0.000, 0.001, 0.005, 0.010, 0.050, 0.100, 0.200, 0.500, 1, 2, 3, 4,
                             5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300, 400, 500,
                             600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000)
SGLANG_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
SGLANG_ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
                      0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000,
                      8.000)
SGLANG_E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400,
                      600, 1200, 1800, 2400)
SGLANG_PER_STAGE_BUCKETS = tuple(0.001 * 1.62 ** i for i in range(30))  # exponential_buckets


def _tgi_duration_buckets() -> tuple[float, ...]:
    """router/src/server.rs: ``value = 0.0001; loop { value *= 1.5; push(value) }``, 35 times,
    in f64 as Rust computes them (0.00015000000000000001, ..., 145.61096060497135)."""
    out, value = [], 0.0001
    for _ in range(35):
        value *= 1.5
        out.append(value)
    return tuple(out)


TGI_DURATION_BUCKETS = _tgi_duration_buckets()
TRITON_FIRST_RESPONSE_BUCKETS_MS = (100, 500, 2000, 5000)  # metrics.cc histogram_options_


# -- observations into histograms --------------------------------------------------------------


def observed(bounds: Sequence[float], values: Iterable[float]) -> tuple[list[float], float]:
    """The cumulative bucket counts (+Inf last) and the sum of ``values``, as a client library's
    histogram holds them after observing each value (a value equal to a bound counts in it)."""
    bounds = list(bounds)
    per = [0] * (len(bounds) + 1)
    total = 0.0
    for v in values:
        per[bisect.bisect_left(bounds, v)] += 1
        total += v
    cumulative, running = [], 0
    for n in per:
        running += n
        cumulative.append(float(running))
    return cumulative, total


def lognormal(rng: random.Random, n: int, median: float, p99: float) -> list[float]:
    """``n`` latencies of a log-normal law with this median and p99."""
    sigma = math.log(p99 / median) / 2.3263478740408408
    return [rng.lognormvariate(math.log(median), sigma) for _ in range(n)]


def _hist(name: str, doc: str, labelnames: list[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, labels=labelnames)


def _add(family: HistogramMetricFamily, labels: list[str], bounds: Sequence[float],
         values: Iterable[float]) -> None:
    counts, total = observed(bounds, values)
    le = [*(repr(float(b)) for b in bounds), "+Inf"]  # prometheus_client's floatToGoString
    family.add_metric(labels, list(zip(le, counts, strict=True)), sum_value=total)


class _Families:
    """A collector of fixed metric families, for ``generate_latest``."""

    def __init__(self, families: list) -> None:
        self.families = families

    def collect(self):
        return iter(self.families)


def _render(families: list, *, runtime: bool = True) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    if runtime:  # what a real engine's default registry adds: never engine figures
        GCCollector(registry=registry)
        PlatformCollector(registry=registry)
        ProcessCollector(registry=registry)
    return generate_latest(registry)


# -- vLLM 0.33 -----------------------------------------------------------------------------------

VLLM_CURRENT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def vllm_current(model: str = VLLM_CURRENT_MODEL, *, kv: Sequence[float] = (0.62, 0.71),
                 running: Sequence[int] = (24, 19), waiting: Sequence[int] = (3, 5),
                 preemptions: Sequence[int] = (17, 4), queue_p99: float = 0.9,
                 seed: int = 33) -> bytes:
    """vllm 0.33.0's /metrics of a server with two engine cores (``--data-parallel-size 2``):
    every family per engine index, as ``PrometheusStatLogger`` registers them."""
    rng = random.Random(seed)
    fams: list = []
    created = 1767225600.0

    def gauge(name: str, doc: str, values: Sequence[float]) -> None:
        g = GaugeMetricFamily(name, doc, labels=VLLM_LABELS)
        for i, v in enumerate(values):
            g.add_metric([model, str(i)], float(v))
        fams.append(g)

    def counter(name: str, doc: str, values: Sequence[float]) -> None:
        c = CounterMetricFamily(name, doc, labels=VLLM_LABELS)  # exposed with _total
        for i, v in enumerate(values):
            c.add_metric([model, str(i)], float(v), created=created)
        fams.append(c)

    gauge("vllm:num_requests_running", "Number of requests in model execution batches.", running)
    gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting)
    by_reason = GaugeMetricFamily("vllm:num_requests_waiting_by_reason",  # help not quoted
                                  "Number of requests waiting to be processed.",
                                  labels=[*VLLM_LABELS, "reason"])
    for i, w in enumerate(waiting):
        by_reason.add_metric([model, str(i), "capacity"], float(w))
        by_reason.add_metric([model, str(i), "deferred"], 0.0)
    fams.append(by_reason)
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv)
    counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
            preemptions)
    counter("vllm:prompt_tokens", "Number of prefill tokens processed.", (4812345, 4701234))
    counter("vllm:generation_tokens", "Number of generation tokens processed.", (912345, 899876))
    counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
            "tokens.", (4812345, 4701234))  # help not quoted
    counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
            (1234567, 1198765))  # help not quoted
    success = CounterMetricFamily("vllm:request_success",
                                  "Count of successfully processed requests.",
                                  labels=[*VLLM_LABELS, "finished_reason"])
    for i in range(len(kv)):
        for reason, n in zip(VLLM_FINISH_REASONS, (2900, 310, 12, 0, 1), strict=True):
            success.add_metric([model, str(i), reason], float(n + i), created=created)
    fams.append(success)

    n_requests = (3223, 2871)
    hists = (
        ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
         VLLM_TTFT_BUCKETS, lambda n: lognormal(rng, n, 0.18, 1.9)),
        ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
         VLLM_ITL_BUCKETS, lambda n: lognormal(rng, 20 * n, 0.032, 0.21)),
        ("vllm:request_time_per_output_token_seconds",
         "Histogram of time_per_output_token_seconds per request.", VLLM_ITL_BUCKETS,
         lambda n: lognormal(rng, n, 0.045, 0.4)),  # not ours: a mean per request
        ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
         VLLM_REQUEST_LATENCY_BUCKETS, lambda n: lognormal(rng, n, 3.1, 19.0)),
        ("vllm:request_queue_time_seconds",
         "Histogram of time spent in WAITING phase for request.", VLLM_REQUEST_LATENCY_BUCKETS,
         lambda n: lognormal(rng, n, 0.09, queue_p99)),
        ("vllm:request_inference_time_seconds",
         "Histogram of time spent in RUNNING phase for request.", VLLM_REQUEST_LATENCY_BUCKETS,
         lambda n: lognormal(rng, n, 2.9, 17.0)),
        ("vllm:request_prefill_time_seconds",
         "Histogram of time spent in PREFILL phase for request.", VLLM_REQUEST_LATENCY_BUCKETS,
         lambda n: lognormal(rng, n, 0.08, 1.1)),
        ("vllm:request_decode_time_seconds",
         "Histogram of time spent in DECODE phase for request.", VLLM_REQUEST_LATENCY_BUCKETS,
         lambda n: lognormal(rng, n, 2.8, 16.0)),
        ("vllm:request_num_preemptions",
         "Histogram of the number of times a request was preempted.",
         VLLM_NUM_PREEMPTIONS_BUCKETS, lambda n: [0.0] * (n - 20) + [1.0] * 20),
        ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
         VLLM_ITERATION_TOKENS_BUCKETS, lambda n: lognormal(rng, n, 300, 4000)),
        ("vllm:request_params_n", "Histogram of the n request parameter.",
         VLLM_REQUEST_PARAMS_N_BUCKETS, lambda n: [1.0] * n),
    )
    for name, doc, bounds, draw in hists:
        h = _hist(name, doc, VLLM_LABELS)
        for i, n in enumerate(n_requests):
            _add(h, [model, str(i)], bounds, draw(n))
        fams.append(h)
    info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                             labels=["block_size", "cache_dtype", "gpu_memory_utilization",
                                     "num_gpu_blocks", "enable_prefix_caching", "engine"])
    for i in range(len(kv)):
        info.add_metric(["16", "auto", "0.9", "27318", "True", str(i)], 1.0)
    fams.append(info)
    return _render(fams)


# -- vLLM V1 of about 0.8 (the previous naming) ---------------------------------------------------

VLLM_PREVIOUS_MODEL = "Qwen/Qwen2.5-7B-Instruct"


def vllm_previous(model: str = VLLM_PREVIOUS_MODEL, *, kv: float = 0.384, running: int = 11,
                  waiting: int = 2, preemptions: int = 6, seed: int = 8) -> bytes:
    """vLLM V1 of about 0.8 (a6f0308cfe80): one engine core; ``gpu_cache_usage_perc`` and
    ``time_per_output_token_seconds``, names a current vLLM no longer exposes."""
    rng = random.Random(seed)
    labels = [model, "0"]
    fams: list = []
    for name, doc, value in (
        ("vllm:num_requests_running", "Number of requests in model execution batches.", running),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting),
        ("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", kv),
    ):
        g = GaugeMetricFamily(name, doc, labels=VLLM_LABELS)
        g.add_metric(labels, float(value))
        fams.append(g)
    # declared as "vllm:num_preemptions_total" etc.: prometheus_client exposes the same names
    for name, doc, value in (
        ("vllm:gpu_prefix_cache_queries",
         "GPU prefix cache queries, in terms of number of queried blocks.", 51234),
        ("vllm:gpu_prefix_cache_hits", "GPU prefix cache hits, in terms of number of cached "
         "blocks.", 20345),
        ("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.",
         preemptions),
        ("vllm:prompt_tokens_total", "Number of prefill tokens processed.", 812345),
        ("vllm:generation_tokens_total", "Number of generation tokens processed.", 190876),
    ):
        c = CounterMetricFamily(name, doc, labels=VLLM_LABELS)
        c.add_metric(labels, float(value))
        fams.append(c)
    success = CounterMetricFamily("vllm:request_success_total",
                                  "Count of successfully processed requests.",
                                  labels=[*VLLM_LABELS, "finished_reason"])
    for reason, n in (("stop", 1401), ("length", 77), ("abort", 3)):
        success.add_metric([*labels, reason], float(n))
    fams.append(success)
    n = 1481
    for name, doc, bounds, values in (
        ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
         VLLM_TTFT_BUCKETS, lognormal(rng, n, 0.11, 0.8)),
        ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
         VLLM_ITL_BUCKETS, lognormal(rng, 15 * n, 0.027, 0.16)),
        ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
         VLLM_REQUEST_LATENCY_BUCKETS, lognormal(rng, n, 2.2, 12.0)),
        ("vllm:request_queue_time_seconds",
         "Histogram of time spent in WAITING phase for request.", VLLM_REQUEST_LATENCY_BUCKETS,
         lognormal(rng, n, 0.05, 0.6)),
        ("vllm:request_params_n", "Histogram of the n request parameter.",
         VLLM_REQUEST_PARAMS_N_BUCKETS, [1.0] * n),
    ):
        h = _hist(name, doc, VLLM_LABELS)
        _add(h, labels, bounds, values)
        fams.append(h)
    return _render(fams)


# -- SGLang 0.5.23 -------------------------------------------------------------------------------

SGLANG_MODEL = "deepseek-ai/DeepSeek-V3"
SGLANG_SCHEDULER_LABELS = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank",
                           "dp_rank"]
SGLANG_TOKENIZER_LABELS = ["model_name", "engine_type"]


def sglang(model: str = SGLANG_MODEL, *, token_usage: Sequence[float] = (0.81, 0.77),
           running: Sequence[int] = (37, 41), queued: Sequence[int] = (6, 2),
           retracted: Sequence[int] = (9, 5), seed: int = 523) -> bytes:
    """SGLang 0.5.23 with ``--enable-metrics --dp-size 2``: two schedulers (dp_rank 0 and 1),
    one tokenizer manager."""
    rng = random.Random(seed)
    fams: list = []
    sched = [[model, "unified", "0", "0", "0", str(dp)] for dp in range(len(running))]
    tok = [model, "unified"]

    def gauge(name: str, doc: str, values: Sequence[float]) -> None:
        g = GaugeMetricFamily(name, doc, labels=SGLANG_SCHEDULER_LABELS)
        for labels, v in zip(sched, values, strict=True):
            g.add_metric(labels, float(v))
        fams.append(g)

    gauge("sglang:num_running_reqs", "The number of running requests.", running)
    gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", queued)
    gauge("sglang:token_usage", "The token usage.", token_usage)
    gauge("sglang:num_used_tokens", "The number of used tokens.",
          [round(u * 163840) for u in token_usage])
    gauge("sglang:gen_throughput", "The generation throughput (token/s).", (1520.5, 1611.25))
    gauge("sglang:num_retracted_reqs", "The number of retracted requests.", (0, 1))
    retr = CounterMetricFamily("sglang:num_retracted_requests_total",
                               "Total number of retracted requests.",
                               labels=SGLANG_SCHEDULER_LABELS)
    for labels, v in zip(sched, retracted, strict=True):
        retr.add_metric(labels, float(v))
    fams.append(retr)
    for name in ("sglang:num_retracted_input_tokens_total",
                 "sglang:num_retracted_output_tokens_total"):
        c = CounterMetricFamily(name, "Total number of retracted tokens.",  # help not quoted
                                labels=SGLANG_SCHEDULER_LABELS)
        for labels in sched:
            c.add_metric(labels, 10240.0)
        fams.append(c)
    q = _hist("sglang:queue_time_seconds", "Histogram of queueing time in seconds.",
              SGLANG_SCHEDULER_LABELS)
    for labels, n in zip(sched, (2100, 1900), strict=True):
        _add(q, labels, SGLANG_QUEUE_TIME_BUCKETS, lognormal(rng, n, 0.04, 2.5))
    fams.append(q)
    stage = _hist("sglang:per_stage_req_latency_seconds", "The latency of each stage of requests.",
                  [*SGLANG_SCHEDULER_LABELS, "stage"])  # help not quoted in the facts
    for labels in sched:
        for s in ("prefill_forward", "decode_forward"):
            _add(stage, [*labels, s], SGLANG_PER_STAGE_BUCKETS, lognormal(rng, 500, 0.02, 0.3))
    fams.append(stage)

    streaming = (("true", 3100), ("false", 900))
    ttft = _hist("sglang:time_to_first_token_seconds",
                 "Histogram of time to first token in seconds.",
                 [*SGLANG_TOKENIZER_LABELS, "is_streaming"])
    e2e = _hist("sglang:e2e_request_latency_seconds",
                "Histogram of End-to-end request latency in seconds",
                [*SGLANG_TOKENIZER_LABELS, "is_streaming"])
    tpot = _hist("sglang:request_time_per_output_token_seconds",
                 "Per-request TPOT in seconds: (finished_time - first_token_time) / "
                 "(completion_tokens - 1).", [*SGLANG_TOKENIZER_LABELS, "is_streaming"])
    for flag, n in streaming:
        _add(ttft, [*tok, flag], SGLANG_TTFT_BUCKETS, lognormal(rng, n, 0.35, 4.5))
        _add(e2e, [*tok, flag], SGLANG_E2E_BUCKETS, lognormal(rng, n, 6.0, 45.0))
        _add(tpot, [*tok, flag], SGLANG_ITL_BUCKETS, lognormal(rng, n, 0.03, 0.2))
    itl = _hist("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in "
                "seconds.", SGLANG_TOKENIZER_LABELS)
    _add(itl, tok, SGLANG_ITL_BUCKETS, lognormal(rng, 60000, 0.021, 0.12))
    fams.extend((ttft, e2e, tpot, itl))
    for name, value in (("sglang:prompt_tokens", 9876543), ("sglang:generation_tokens", 2345678)):
        c = CounterMetricFamily(name, "Number of tokens processed.",  # help not quoted
                                labels=SGLANG_TOKENIZER_LABELS)
        c.add_metric(tok, float(value))
        fams.append(c)
    reqs = CounterMetricFamily("sglang:num_requests", "Number of requests processed.",  # help not quoted
                               labels=[*SGLANG_TOKENIZER_LABELS, "is_streaming"])
    for flag, n in streaming:
        reqs.add_metric([*tok, flag], float(n))
    fams.append(reqs)
    return _render(fams)


# -- TGI (metrics-exporter-prometheus 0.15) ------------------------------------------------------


def rust_f64(x: float) -> str:
    """An f64 as Rust's ``Display`` writes it: the shortest round-trip digits, never an exponent,
    no ``.0`` on a whole number."""
    if x == int(x) and abs(x) < 1e16:
        return str(int(x))
    text = repr(float(x))
    if "e" in text:
        text = format(x, ".20f").rstrip("0")
    return text


def _tgi_histogram(name: str, doc: str, bounds: Sequence[float], values: list[float],
                   labels: str = "") -> list[str]:
    counts, total = observed(bounds, values)
    sep = "," if labels else ""
    lines = [f"# HELP {name} {doc}", f"# TYPE {name} histogram"]
    for b, c in zip([*bounds, math.inf], counts, strict=True):
        le = "+Inf" if b == math.inf else rust_f64(b)
        lines.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {int(c)}')
    tail = f"{{{labels}}}" if labels else ""
    lines += [f"{name}_sum{tail} {rust_f64(total)}", f"{name}_count{tail} {len(values)}"]
    return lines


def tgi(*, batch: int = 12, queue: int = 7, seed: int = 3) -> bytes:
    """TGI 3.3's /metrics (max_input_tokens 4096, max_total_tokens 8192): the families of
    router/src/server.rs and backends/v3, as metrics-exporter-prometheus renders them."""
    rng = random.Random(seed)
    n = 1520
    blocks: list[list[str]] = []
    # counters: written as named, no _total (help not quoted for tgi_request_failure,
    # tgi_batch_inference_count, tgi_batch_current_max_tokens, the token-count histograms,
    # tgi_batch_next_size, tgi_batch_forward_duration and tgi_request_skipped_tokens)
    blocks.append(["# HELP tgi_request_count Total number of requests",
                   "# TYPE tgi_request_count counter", f"tgi_request_count {n + 31}"])
    blocks.append(["# HELP tgi_request_failure Total number of failed requests",
                   "# TYPE tgi_request_failure counter",
                   'tgi_request_failure{err="validation"} 27',
                   'tgi_request_failure{err="overloaded"} 4'])
    blocks.append(["# HELP tgi_request_success Number of successful requests",
                   "# TYPE tgi_request_success counter", f"tgi_request_success {n}"])
    blocks.append(["# HELP tgi_batch_inference_count Inference calls per method",
                   "# TYPE tgi_batch_inference_count counter",
                   'tgi_batch_inference_count{method="decode"} 98123',
                   'tgi_batch_inference_count{method="prefill"} 1612'])
    # gauges
    blocks.append(["# HELP tgi_batch_current_max_tokens Maximum tokens for the current batch",
                   "# TYPE tgi_batch_current_max_tokens gauge",
                   "tgi_batch_current_max_tokens 41230"])
    blocks.append(["# HELP tgi_batch_current_size Current batch size",
                   "# TYPE tgi_batch_current_size gauge", f"tgi_batch_current_size {batch}"])
    blocks.append(["# HELP tgi_batch_total_tokens Maximum amount of tokens in total.",
                   "# TYPE tgi_batch_total_tokens gauge", "tgi_batch_total_tokens 129024"])
    blocks.append(["# HELP tgi_queue_size Current queue size", "# TYPE tgi_queue_size gauge",
                   f"tgi_queue_size {queue}"])
    # histograms: every name ending in "duration" gets the 35 buckets, in seconds
    durations = (
        ("tgi_request_duration", "Total time spent processing the request",
         lognormal(rng, n, 2.4, 14.0)),
        ("tgi_request_validation_duration", "Time spent validating the request",
         lognormal(rng, n, 0.0004, 0.003)),
        ("tgi_request_queue_duration", "Time spent in the queue per request",
         lognormal(rng, n, 0.06, 1.2)),
        ("tgi_request_inference_duration", "Request inference duration",
         lognormal(rng, n, 2.3, 13.0)),
        ("tgi_request_mean_time_per_token_duration", "Mean time per token per request",
         lognormal(rng, n, 0.028, 0.09)),
    )
    for name, doc, values in durations:
        blocks.append(_tgi_histogram(name, doc, TGI_DURATION_BUCKETS, values))
    for method in ("decode", "prefill"):
        blocks.append(_tgi_histogram("tgi_batch_forward_duration", "Batch forward duration",
                                     TGI_DURATION_BUCKETS, lognormal(rng, 300, 0.02, 0.2),
                                     f'method="{method}"'))
    tokens_bounds = [(8192 / 100) * (x + 1) for x in range(100)]
    blocks.append(_tgi_histogram("tgi_request_generated_tokens", "Generated tokens per request",
                                 tokens_bounds, lognormal(rng, n, 180, 1800)))
    input_bounds = [(4096 / 100) * (x + 1) for x in range(100)]
    blocks.append(_tgi_histogram("tgi_request_input_length", "Input tokens per request",
                                 input_bounds, lognormal(rng, n, 700, 3500)))
    blocks.append(_tgi_histogram("tgi_batch_next_size", "Batch size of the next batch",
                                 list(range(1, 1025)), [float(rng.randint(1, 64))
                                                        for _ in range(400)]))
    # a histogram without buckets is rendered as a summary
    blocks.append(["# HELP tgi_request_skipped_tokens Speculated tokens per request",
                   "# TYPE tgi_request_skipped_tokens summary",
                   *(f'tgi_request_skipped_tokens{{quantile="{q}"}} 0'
                     for q in ("0", "0.5", "0.9", "0.95", "0.99", "0.999", "1")),
                   "tgi_request_skipped_tokens_sum 0", f"tgi_request_skipped_tokens_count {n}"])
    return ("\n\n".join("\n".join(b) for b in blocks) + "\n").encode()


# -- Triton (prometheus-cpp) ---------------------------------------------------------------------

TRITON_MODELS = (  # (gpu_uuid, model, version, successes, mean request us, mean queue us, pending)
    ("GPU-6a1b2c3d-0000-4000-8000-000000000001", "resnet50", "1", 18211, 8210.5, 1320.0, 3),
    ("GPU-6a1b2c3d-0000-4000-8000-000000000002", "resnet50", "1", 17977, 8390.25, 1410.0, 1),
    ("GPU-6a1b2c3d-0000-4000-8000-000000000001", "bert_onnx", "1", 4402, 23120.0, 5100.0, 0),
    ("GPU-6a1b2c3d-0000-4000-8000-000000000001", "bert_onnx", "2", 9150, 21870.0, 4020.0, 7),
)


def _cpp(x: float) -> str:
    """A double as prometheus-cpp writes it (std::to_chars: shortest round-trip)."""
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    return repr(float(x))


def triton(models: Sequence[tuple] = TRITON_MODELS, *, seed: int = 2) -> bytes:
    """Triton 2.x's /metrics on :8002 (``--metrics-config histogram_latencies=true``), two GPUs,
    two models, one of them with two versions loaded."""
    rng = random.Random(seed)
    lines: list[str] = []

    def family(name: str, kind: str, doc: str, rows: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP {name} {doc}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{{{labels}}} {_cpp(v)}" for labels, v in rows)

    def lab(gpu: str, model: str, version: str, **extra: str) -> str:
        pairs = {"gpu_uuid": gpu, "model": model, "version": version, **extra}
        return ",".join(f'{k}="{v}"' for k, v in sorted(pairs.items()))

    family("nv_inference_request_success", "counter",
           "Number of successful inference requests, all batch sizes",
           [(lab(g, m, v), n) for g, m, v, n, *_ in models])
    family("nv_inference_request_failure", "counter",
           "Number of failed inference requests, all batch sizes",
           [(lab(g, m, v, reason=r), k) for g, m, v, *_ in models
            for r, k in (("REJECTED", 2), ("CANCELED", 0), ("BACKEND", 1), ("OTHER", 0))])
    family("nv_inference_count", "counter",
           "Number of inferences performed (does not include cached requests)",
           [(lab(g, m, v), 8 * n) for g, m, v, n, *_ in models])
    family("nv_inference_exec_count", "counter",
           "Number of model executions performed (does not include cached requests)",
           [(lab(g, m, v), n // 2) for g, m, v, n, *_ in models])
    family("nv_inference_request_duration_us", "counter",
           "Cumulative inference request duration in microseconds (includes cached requests)",
           [(lab(g, m, v), round(n * req)) for g, m, v, n, req, *_ in models])
    family("nv_inference_queue_duration_us", "counter",
           "Cumulative inference queuing duration in microseconds (includes cached requests)",
           [(lab(g, m, v), round(n * queue)) for g, m, v, n, _, queue, _ in models])
    for part, share in (("input", 0.04), ("infer", 0.7), ("output", 0.03)):
        what = {"input": "compute input duration", "infer": "compute inference duration",
                "output": "inference compute output duration"}[part]
        family(f"nv_inference_compute_{part}_duration_us", "counter",
               f"Cumulative {what} in microseconds (does not include cached requests)",
               [(lab(g, m, v), round(n * req * share)) for g, m, v, n, req, *_ in models])
    family("nv_inference_pending_request_count", "gauge",
           "Instantaneous number of pending requests awaiting execution per-model.",
           [(lab(g, m, v), p) for g, m, v, *_, p in models])
    name = "nv_inference_first_response_histogram_ms"
    lines.extend([f"# HELP {name} Duration from request to first response in milliseconds",
                  f"# TYPE {name} histogram"])
    for g, m, v, n, req, *_ in models:
        counts, total = observed(TRITON_FIRST_RESPONSE_BUCKETS_MS,
                                 lognormal(rng, n, req / 100, req / 100 * 15))
        base = lab(g, m, v)
        lines.append(f"{name}_count{{{base}}} {n}")  # prometheus-cpp: count, sum, buckets
        lines.append(f"{name}_sum{{{base}}} {_cpp(total)}")
        for b, c in zip([*TRITON_FIRST_RESPONSE_BUCKETS_MS, "+Inf"], counts, strict=True):
            lines.append(f'{name}_bucket{{{base},le="{_cpp(b) if b != "+Inf" else b}"}} '
                         f"{int(c)}")
    gpus = sorted({g for g, *_ in models})  # the GPU and CPU families: help not quoted
    family("nv_gpu_utilization", "gauge", "GPU utilization rate [0.0 - 1.0)",
           [(f'gpu_uuid="{g}"', 0.93) for g in gpus])
    family("nv_gpu_memory_used_bytes", "gauge", "GPU used memory, in bytes",
           [(f'gpu_uuid="{g}"', 61203283968) for g in gpus])
    family("nv_energy_consumption", "counter",
           "GPU energy consumption in joules since the Triton Server started",
           [(f'gpu_uuid="{g}"', 8812345.125) for g in gpus])
    lines.extend(["# HELP nv_cpu_utilization CPU utilization rate [0.0 - 1.0]",
                  "# TYPE nv_cpu_utilization gauge", "nv_cpu_utilization 0.125"])
    return ("\n".join(lines) + "\n").encode()


# -- other programs' texts and no text at all -----------------------------------------------------

def node_exporter() -> bytes:
    """A /metrics of another program (a Go exporter): valid Prometheus text, no engine in it."""
    return (b"# HELP go_gc_duration_seconds A summary of the pause duration of garbage "
            b"collection cycles.\n# TYPE go_gc_duration_seconds summary\n"
            b'go_gc_duration_seconds{quantile="0"} 2.1e-05\n'
            b'go_gc_duration_seconds{quantile="1"} 0.000412\n'
            b"go_gc_duration_seconds_sum 0.0123\ngo_gc_duration_seconds_count 311\n"
            b"# HELP node_load1 1m load average.\n# TYPE node_load1 gauge\nnode_load1 0.42\n"
            b"# HELP promhttp_metric_handler_requests_total Total number of scrapes by HTTP "
            b"status code.\n# TYPE promhttp_metric_handler_requests_total counter\n"
            b'promhttp_metric_handler_requests_total{code="200"} 1021\n')


def corrupted(text: bytes) -> bytes:
    """An engine's text whose lines were cut and mangled (a proxy that garbles the answer)."""
    lines = text.decode().splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.startswith("#") and i % 3 == 0:
            line = line[: len(line) // 2] + "\x00\x7f}{ 1.2.3"
        out.append(line)
    return ("\n".join(out) + "\n").encode()


# -- hostile answers (issue #32): what a broken exporter, a proxy or an attacker sends -----------

HOSTILE_BYTES = 4 << 20  # the agent's --engine-metrics-max-bytes default: read whole, every byte


def gzip_bomb(inflated: int = 2 << 30) -> bytes:
    """A gzip body of about 2 MB that inflates to ``inflated`` bytes of blank lines (which the
    text format allows, so only a bound on the decoded size stops a reader): gzip members of
    64 MiB each, one after the other, as RFC 1952 lets a gzip file be."""
    member = gzip.compress(b"\n" * (64 << 20), 9)
    return member * (inflated // (64 << 20))


def random_bytes(size: int = HOSTILE_BYTES) -> bytes:
    return random.Random(32).randbytes(size)


def repeated_line(line: bytes, size: int = HOSTILE_BYTES) -> bytes:
    """``line`` again and again, ``size`` bytes: millions of tiny lines (``ab\\n``: a metric name
    and no value; ``\\xff\\n``: no UTF-8)."""
    return line * (size // len(line))


def with_family_repeated(text: bytes, family: str) -> bytes:
    """``text`` with every line of one family (its HELP, TYPE and samples) given once more at
    its end, as a misbehaving exporter does: each of its series appears twice."""
    names = {family + part for part in ("", "_bucket", "_sum", "_count", "_total", "_created")}
    lines = text.decode().splitlines()
    own = [line for line in lines if line.split("{", 1)[0].split(" ", 1)[0] in names
           or line.startswith((f"# HELP {family} ", f"# TYPE {family} "))]
    assert own, f"no line of {family}"
    return ("\n".join(lines + own) + "\n").encode()


# -- the real captures (issue #35): tests/realworld/, and texts built from names-only captures ---

REALWORLD = Path(__file__).resolve().parent / "realworld"


def capture(name: str) -> bytes:
    """A real capture, byte for byte as kept (its ``# SOURCE``/``# NOTE`` header is comments)."""
    return (REALWORLD / name).read_bytes()


def inventory(section: str) -> list[str]:
    """The series names one section (``## llamacpp-metrics.txt`` ...) of the LLMKube inventory
    lists: names a live engine exposed, without types, labels or values."""
    names, inside = [], False
    for line in capture("engine_series_name_inventories_llmkube.txt").decode().splitlines():
        if line.startswith("## "):
            inside = line == f"## {section}"
        elif inside and line.strip() and not line.startswith("#"):
            names.append(line.strip())
    assert names, f"no section {section}"
    return names


def trtllm_serve_names() -> list[str]:
    """The ``trtllm_*`` names trtllm-serve's MetricsCollector declares, as listed in PART 2 of
    the TensorRT-LLM capture (a list of names, no exposition)."""
    text = capture("tensorrt_llm_triton_backend_and_trtllm_serve_metrics.txt").decode()
    part2 = text.split("# PART 2", 1)[1]
    names = []
    for word in part2.replace(":", " ").split():
        if word.startswith("trtllm_") and word not in names and word != "trtllm_":
            names.append(word)
    return names


# tensorrt_llm/metrics/collector.py: its Histogram families and their default buckets (the
# request-latency lists are vLLM's, which the collector adapted); every other name of the list
# is a Counter (ending _total) or a Gauge
TRTLLM_HISTOGRAMS: dict[str, Sequence[float]] = {
    "trtllm_e2e_request_latency_seconds": VLLM_REQUEST_LATENCY_BUCKETS,
    "trtllm_time_to_first_token_seconds": VLLM_TTFT_BUCKETS,
    "trtllm_time_per_output_token_seconds": VLLM_ITL_BUCKETS,
    "trtllm_request_queue_time_seconds": VLLM_REQUEST_LATENCY_BUCKETS,
    "trtllm_request_prefill_time_seconds": (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                                            2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
                                            2560.0),
    "trtllm_request_decode_time_seconds": VLLM_REQUEST_LATENCY_BUCKETS,
    "trtllm_request_inference_time_seconds": VLLM_REQUEST_LATENCY_BUCKETS,
    "trtllm_prompt_cached_tokens_per_request": (0, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
    "trtllm_prefill_perplexity": (1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 500.0, 1000.0),
    "trtllm_generation_perplexity": (1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 500.0, 1000.0),
    "trtllm_prefill_batch_tokens": (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768),
}
TRTLLM_LABELS = {"model_name": "undefined", "engine_type": "undefined"}  # trtllm-serve's


def _fraction_like(name: str) -> bool:
    return any(w in name for w in ("usage", "perc", "utilization", "rate", "ratio", "occupancy"))


def text_from_names(names: Iterable[str], *, labels: dict[str, str] | None = None,
                    histograms: dict[str, Sequence[float]] | None = None,
                    values: dict[str, float] | None = None,
                    observations: dict[str, list[float]] | None = None,
                    seed: int = 35) -> bytes:
    """The smallest valid exposition of a names-only capture, rendered by ``prometheus_client``:
    one series per name (``labels`` on each), a histogram where the names give its
    ``_bucket``/``_count``/``_sum`` or ``histograms`` names it (with its bounds), a counter where
    the name ends in ``_total``, a gauge otherwise (a fraction where the name says usage, rate
    or ratio). ``values`` and ``observations`` set a name's value or a histogram's observed
    latencies; the rest come from a seeded generator."""
    rng = random.Random(seed)
    labels, values, observations = labels or {}, values or {}, observations or {}
    bounds = dict(histograms or {})
    order: list[str] = []
    for name in names:
        base = name
        for part in ("_bucket", "_count", "_sum"):
            if name.endswith(part):
                base = name.removesuffix(part)
                bounds.setdefault(base, (0.1, 0.5, 1.0, 5.0, 10.0))
        if base not in order:
            order.append(base)
    keys, vals = list(labels), list(labels.values())
    families: list = []
    for base in order:
        if base in bounds:
            family = _hist(base, f"{base} (help not quoted)", keys)
            seen = observations.get(base) or lognormal(rng, 200, 0.4, 3.0)
            _add(family, vals, bounds[base], seen)
        elif base.endswith("_total"):
            family = CounterMetricFamily(base.removesuffix("_total"), "help not quoted",
                                         labels=keys)
            family.add_metric(vals, values.get(base, float(rng.randrange(100, 100000))))
        else:
            family = GaugeMetricFamily(base, "help not quoted", labels=keys)
            default = round(rng.random(), 3) if _fraction_like(base) else rng.randrange(0, 40)
            family.add_metric(vals, values.get(base, float(default)))
        families.append(family)
    return _render(families, runtime=False)


def trtllm_serve(*, waiting: int = 5, running: int = 24, kv: float = 0.58,
                 e2e: tuple[float, float] = (2.0, 9.0), queue: tuple[float, float] = (0.2, 1.5),
                 requests: int = 400, seed: int = 35) -> bytes:
    """trtllm-serve's /prometheus/metrics with every family its MetricsCollector declares (the
    capture's list of names), labelled as trtllm-serve labels them; ``e2e`` and ``queue`` are
    the (median, p99) of the request latency and of its queue time (each request's queue time
    bounded by its latency)."""
    rng = random.Random(seed)
    latencies = lognormal(rng, requests, *e2e)
    queued = [min(q, lat * 0.95) for q, lat in zip(lognormal(rng, requests, *queue), latencies,
                                                     strict=True)]
    return text_from_names(
        trtllm_serve_names(), labels=TRTLLM_LABELS, histograms=TRTLLM_HISTOGRAMS, seed=seed,
        values={"trtllm_num_requests_waiting": waiting, "trtllm_num_requests_running": running,
                "trtllm_kv_cache_utilization": kv},
        observations={"trtllm_e2e_request_latency_seconds": latencies,
                      "trtllm_request_queue_time_seconds": queued,
                      "trtllm_time_to_first_token_seconds": [q + 0.05 for q in queued],
                      "trtllm_time_per_output_token_seconds":
                          lognormal(rng, requests, 0.03, 0.12)})


def llamacpp_capture(*, processing: int | None = None, deferred: int | None = None) -> bytes:
    """The real llama.cpp capture, with its two request gauges set where given (a server whose
    slots are all busy and whose requests wait): every other line as captured."""
    out = []
    for line in capture("llamacpp_metrics_current_build_sample.prom").decode().splitlines():
        if line.startswith("llamacpp:requests_processing ") and processing is not None:
            line = f"llamacpp:requests_processing {processing}"
        if line.startswith("llamacpp:requests_deferred ") and deferred is not None:
            line = f"llamacpp:requests_deferred {deferred}"
        out.append(line)
    return ("\n".join(out) + "\n").encode()


def tgi_with_batch_next_size(buckets: int = 1000) -> bytes:
    """The TGI capture with the family its editor cut back in full shape: ``tgi_batch_next_size``
    with one bucket per integer batch size, 1 to ``buckets`` (the full file has about 1,000;
    counts rebuilt, cumulative, ending at the capture's 16 prefill batches)."""
    lines = [f'tgi_batch_next_size_bucket{{le="{i}"}} {min(16, i // 40)}'
             for i in range(1, buckets + 1)]
    lines += ['tgi_batch_next_size_bucket{le="+Inf"} 16', "tgi_batch_next_size_sum 5530",
              "tgi_batch_next_size_count 16"]
    text = capture("tgi_metrics_datadog_fixture_excerpt.prom").decode()
    cut = [line for line in text.splitlines() if not line.startswith("tgi_batch_next_size")]
    return ("\n".join([*cut, "# TYPE tgi_batch_next_size histogram", *lines]) + "\n").encode()


def rewritten_capture(name: str, *, observations: dict[str, list[float]] | None = None,
                      values: dict[str, float] | None = None) -> bytes:
    """A real capture with some of its families' values set, every line else as captured (its
    header, labels, bucket bounds, ``*_created`` samples): the histograms of ``observations``
    (family -> observed seconds) get the counts, sum and count of those observations within
    the capture's own bounds, the samples named in ``values`` that value. The shape is the
    engine's, the load is the test's."""
    observations, values = observations or {}, values or {}
    out = []
    for line in capture(name).decode().splitlines():
        if line.startswith("#") or not line.strip():
            out.append(line)
            continue
        head, _ = line.rsplit(" ", 1)
        sample = head.split("{", 1)[0]
        family = next((f for f in observations if sample in (f"{f}_bucket", f"{f}_sum",
                                                              f"{f}_count")), None)
        if family is not None:
            seen = observations[family]
            if sample.endswith("_bucket"):
                le = head.split('le="', 1)[1].split('"', 1)[0]
                bound = math.inf if le == "+Inf" else float(le)
                value = float(sum(1 for v in seen if v <= bound))
            else:
                value = float(sum(seen)) if sample.endswith("_sum") else float(len(seen))
            line = f"{head} {value!r}"
        elif sample in values:
            line = f"{head} {float(values[sample])!r}"
        out.append(line)
    return ("\n".join(out) + "\n").encode()


def vllm_2026(*, queue: tuple[float, float], prefill: tuple[float, float],
              decode: tuple[float, float], waiting: int, running: int = 4, kv: float = 0.3,
              requests: int = 400, seed: int = 47) -> bytes:
    """The 2026 vLLM V1 capture under load: each request's queue, prefill and decode times
    drawn as (median, p99), its time to first token their first two, its end-to-end latency all
    three and a few milliseconds of the API server's; the request gauges set."""
    rng = random.Random(seed)
    queued, prefilled, decoded = (lognormal(rng, requests, *q) for q in (queue, prefill, decode))
    e2e = [q + p + d + 0.004 for q, p, d in zip(queued, prefilled, decoded, strict=True)]
    return rewritten_capture(
        "vllm_v1_metrics_kops_conformance_qwen05b_idle.prom",
        observations={"vllm:request_queue_time_seconds": queued,
                      "vllm:request_prefill_time_seconds": prefilled,
                      "vllm:request_decode_time_seconds": decoded,
                      "vllm:request_inference_time_seconds":
                          [p + d for p, d in zip(prefilled, decoded, strict=True)],
                      "vllm:time_to_first_token_seconds":
                          [q + p for q, p in zip(queued, prefilled, strict=True)],
                      "vllm:e2e_request_latency_seconds": e2e},
        values={"vllm:num_requests_waiting": waiting, "vllm:num_requests_running": running,
                "vllm:kv_cache_usage_perc": kv})


def dynamo_frontend(*, e2e: tuple[float, float], queued: int, inflight: int,
                    requests: int = 400, seed: int = 47) -> bytes:
    """Dynamo's frontend capture under load: request durations drawn as (median, p99), the
    time to first token a tenth of each, the queue and in-flight gauges set."""
    rng = random.Random(seed)
    durations = lognormal(rng, requests, *e2e)
    return rewritten_capture(
        "dynamo_frontend_metrics_example_qwen3_06b.prom",
        observations={"dynamo_frontend_request_duration_seconds": durations,
                      "dynamo_frontend_time_to_first_token_seconds": [d / 10 for d in durations]},
        values={"dynamo_frontend_queued_requests": queued,
                "dynamo_frontend_inflight_requests": inflight})
