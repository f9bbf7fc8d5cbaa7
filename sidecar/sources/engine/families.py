"""Which of a serving engine's own Prometheus families become which engine series of ours.

One table per engine (vLLM, SGLang, TGI, Triton, TensorRT-LLM's ``trtllm-serve``, llama.cpp's
``llama-server``, NVIDIA Dynamo's frontend): for each figure of ours, the engine's families that
carry it, newest name first (vLLM renamed two between releases; both names in use in 2026 are
here), with the factor to our unit. Only these families are read; every other family the
engine exposes is dropped before parsing, so what is forwarded stays a fixed, small set of
series whatever the engine adds. A figure an engine has no family for stays absent, never
zero, and ``absent`` says why (logged once when the engine is found, as ``not_exposed``).
``docs/metrics.md`` renders this table, with each source family, the versions that expose it,
and what each engine's names were checked against (``Engine.checked``).

The names were checked in the engines' sources (vLLM's and SGLang's metrics modules,
TensorRT-LLM's ``tensorrt_llm/metrics/collector.py``, llama.cpp's ``tools/server`` metrics
handler, Dynamo's ``lib/llm/src/http/service/metrics.rs``) and are pinned by the real captures
in ``tests/realworld/`` (``tests/test_engine_captures.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# histogram_sum: only the _sum of an engine's histogram (the seconds of all its requests), where
# what a figure needs is the total, not the buckets: two series per model, not two dozen
SourceKind = Literal["histogram", "gauge", "counter", "microsecond_counter", "histogram_sum"]

@dataclass(frozen=True, slots=True)
class Family:
    """One family of an engine's exposition that carries one of our figures."""

    name: str  # as exposed; a counter without its _total
    kind: SourceKind
    versions: str  # which releases expose it, for the reference
    scale: float = 1.0  # to our unit
    count: tuple[str, ...] = ()  # microsecond_counter: the counters whose sum is the count


@dataclass(frozen=True, slots=True)
class Engine:
    name: str
    prefix: str  # every family of the engine starts with it: how the engine is recognised
    model_label: str | None  # the label that names the served model, if the engine has one
    figures: dict[str, tuple[Family, ...]]  # our figure -> its families, preferred first
    default_url: str  # the engine's metrics endpoint on localhost with its default port
    # the labels that tell replicas apart (each serves its own requests): gauges and counters are
    # summed over them, and the largest taken over any other label (an SGLang tensor-parallel
    # rank reports the same requests as its peers); None: summed over every label
    replicas: tuple[str, ...] | None = None
    title: str = ""  # as a person names it, in hints and the docs
    # our figures the engine exposes under no family, and why (said once when it is found)
    absent: dict[str, str] | None = None
    # the releases (or source commits) and captures the names were checked against, for the docs
    checked: str = ""
    # families whose model label is the model as registered: another series' model that equals
    # one of these case-insensitively is forwarded with its spelling, so the engine's series of
    # one model join (Dynamo labels requests with the model lower-cased, its model_* gauges not)
    model_spellings: tuple[str, ...] = ()


def _f(name: str, kind: SourceKind, versions: str, **kw: object) -> Family:
    return Family(name=name, kind=kind, versions=versions, **kw)  # type: ignore[arg-type]


VLLM = Engine(
    name="vllm", title="vLLM", prefix="vllm:", model_label="model_name", replicas=("engine",),
    default_url="http://127.0.0.1:8000/metrics",
    checked="vllm/v1/metrics/loggers.py of 0.8 to 0.33; the captures of 0.x with V0 and V1 names "
            "mixed and of vllm/vllm-openai:latest of March 2026 (`engine=\"0\"` on every series, "
            "`*_created` samples)",
    figures={
        "engine_request_duration_seconds": (
            _f("vllm:e2e_request_latency_seconds", "histogram", "all"),),
        "engine_time_to_first_token_seconds": (
            _f("vllm:time_to_first_token_seconds", "histogram", "all"),),
        "engine_inter_token_latency_seconds": (
            _f("vllm:inter_token_latency_seconds", "histogram", "0.10.2 and later"),
            _f("vllm:time_per_output_token_seconds", "histogram",
               "V0, and V1 before 0.15 (hidden from 0.12)")),
        "engine_request_queue_duration_seconds": (
            _f("vllm:request_queue_time_seconds", "histogram", "all"),),
        "engine_kv_cache_usage_ratio": (
            _f("vllm:kv_cache_usage_perc", "gauge", "V1, 0.10 and later (a fraction 0..1)"),
            _f("vllm:gpu_cache_usage_perc", "gauge",
               "V0, and V1 before 0.12 (hidden in 0.11; a fraction 0..1)")),
        "engine_requests_running": (_f("vllm:num_requests_running", "gauge", "all"),),
        "engine_requests_waiting": (_f("vllm:num_requests_waiting", "gauge", "all"),),
        "engine_preemptions_total": (_f("vllm:num_preemptions", "counter", "all"),),
        # V1's request phases (queued -> scheduled -> first token -> last token, one clock)
        "engine_request_prefill_seconds_total": (
            _f("vllm:request_prefill_time_seconds", "histogram_sum", "V1 (its _sum)"),),
        "engine_request_decode_seconds_total": (
            _f("vllm:request_decode_time_seconds", "histogram_sum", "V1 (its _sum)"),),
    },
)

SGLANG = Engine(
    name="sglang", title="SGLang", prefix="sglang:", model_label="model_name",
    replicas=("dp_rank",),
    default_url="http://127.0.0.1:30000/metrics",
    checked="sglang/srt/observability/metrics_collector.py of 0.5.23; the 0.5.10 capture",
    figures={
        "engine_request_duration_seconds": (
            _f("sglang:e2e_request_latency_seconds", "histogram", "all"),),
        "engine_time_to_first_token_seconds": (
            _f("sglang:time_to_first_token_seconds", "histogram", "all"),),
        "engine_inter_token_latency_seconds": (
            _f("sglang:inter_token_latency_seconds", "histogram", "all"),),
        "engine_request_queue_duration_seconds": (
            _f("sglang:queue_time_seconds", "histogram", "all"),),
        "engine_kv_cache_usage_ratio": (
            _f("sglang:token_usage", "gauge", "all (tokens in use over capacity)"),),
        "engine_requests_running": (_f("sglang:num_running_reqs", "gauge", "all"),),
        "engine_requests_waiting": (_f("sglang:num_queue_reqs", "gauge", "all"),),
        # the counter, created at the first retraction (absent before it: said, not zero);
        # never sglang:num_retracted_reqs, a gauge of the last batch's retractions
        "engine_preemptions_total": (
            _f("sglang:num_retracted_requests", "counter",
               "0.5.x (retracted requests; from the first retraction)"),),
    },
    absent={
        "engine_request_prefill_seconds_total": "SGLang has no per-request prefill time "
                                                "(its per-stage histograms are the scheduler's)",
        "engine_request_decode_seconds_total": "SGLang has no per-request decode time",
    },
)

TGI = Engine(
    name="tgi", title="TGI (archived March 2026)", prefix="tgi_", model_label=None,
    default_url="http://127.0.0.1:80/metrics",  # the image's PORT; 3000 outside it
    checked="router/src/server.rs of 3.3.x; the router capture (histograms cut)",
    figures={
        "engine_request_duration_seconds": (_f("tgi_request_duration", "histogram", "all"),),
        "engine_inter_token_latency_seconds": (
            _f("tgi_request_mean_time_per_token_duration", "histogram",
               "all (a request's mean, not each gap)"),),
        "engine_request_queue_duration_seconds": (
            _f("tgi_request_queue_duration", "histogram", "all"),),
        "engine_requests_running": (_f("tgi_batch_current_size", "gauge", "all"),),
        "engine_requests_waiting": (_f("tgi_queue_size", "gauge", "all"),),
    },
    absent={
        "engine_time_to_first_token_seconds": "TGI has no time-to-first-token histogram",
        "engine_kv_cache_usage_ratio": "TGI exposes no KV-cache usage",
        "engine_preemptions_total": "TGI exposes no preemption count",
        **dict.fromkeys(("engine_request_prefill_seconds_total",
                         "engine_request_decode_seconds_total"),
                        "TGI's request phases are not read (its inference histogram is the "
                        "router's, not the engine's prefill and decode)"),
    },
)

TRITON = Engine(
    name="triton", title="Triton", prefix="nv_inference_", model_label="model",
    default_url="http://127.0.0.1:8002/metrics",
    checked="triton-inference-server/core src/metrics.cc; the :8002 capture",
    figures={
        "engine_request_duration_seconds": (
            _f("nv_inference_request_duration_us", "microsecond_counter",
               "all (cumulative microseconds: a mean, no buckets)", scale=1e-6,
               count=("nv_inference_request_success",)),),
        "engine_request_queue_duration_seconds": (
            _f("nv_inference_queue_duration_us", "microsecond_counter",
               "all (cumulative microseconds: a mean, no buckets)", scale=1e-6,
               count=("nv_inference_request_success",)),),
        "engine_time_to_first_token_seconds": (
            _f("nv_inference_first_response_histogram_ms", "histogram",
               "with --metrics-config histogram_latencies=true (milliseconds; 100, 500, "
               "2000, 5000 by default)", scale=1e-3),),
        "engine_requests_waiting": (
            _f("nv_inference_pending_request_count", "gauge", "all"),),
    },
    absent={
        "engine_inter_token_latency_seconds": "Triton has no inter-token latency",
        "engine_kv_cache_usage_ratio": "Triton's own families hold no KV cache (its TensorRT-LLM "
                                       "backend's nv_trt_llm_* families are not read)",
        "engine_requests_running": "Triton exposes no count of requests executing",
        "engine_preemptions_total": "Triton exposes no preemption count",
        **dict.fromkeys(("engine_request_prefill_seconds_total",
                         "engine_request_decode_seconds_total"),
                        "Triton has no prefill or decode time (its compute counters are per "
                        "inference, not per request phase)"),
    },
)

# trtllm-serve: prometheus_client's MetricsCollector (tensorrt_llm/metrics/collector.py),
# labelled model_name and engine_type (both "undefined" under trtllm-serve), served on
# /prometheus/metrics of the API port only with return_perf_metrics: true (its /metrics answers
# JSON iteration statistics); the iteration gauges need enable_iter_perf_stats: true too. In
# prometheus_client's multiprocess mode a gauge carries a pid label: summed over (one writer)
TRTLLM = Engine(
    name="trtllm", title="TensorRT-LLM (trtllm-serve)", prefix="trtllm_",
    model_label="model_name", default_url="http://127.0.0.1:8000/prometheus/metrics",
    checked="tensorrt_llm/metrics/collector.py of 1.1 and 2026; a list of its names (no "
            "exposition captured)",
    figures={
        "engine_request_duration_seconds": (
            _f("trtllm_e2e_request_latency_seconds", "histogram",
               "1.1 and later (return_perf_metrics)"),),
        "engine_time_to_first_token_seconds": (
            _f("trtllm_time_to_first_token_seconds", "histogram",
               "1.1 and later (return_perf_metrics)"),),
        "engine_inter_token_latency_seconds": (
            _f("trtllm_time_per_output_token_seconds", "histogram",
               "1.1 and later (a request's mean, not each gap)"),),
        "engine_request_queue_duration_seconds": (
            _f("trtllm_request_queue_time_seconds", "histogram",
               "1.1 and later (return_perf_metrics)"),),
        "engine_kv_cache_usage_ratio": (
            _f("trtllm_kv_cache_utilization", "gauge",
               "2026 releases, not 1.1 (enable_iter_perf_stats; used / max blocks, 0..1)"),),
        "engine_requests_running": (
            _f("trtllm_num_requests_running", "gauge",
               "2026 releases, not 1.1 (enable_iter_perf_stats)"),),
        "engine_requests_waiting": (
            _f("trtllm_num_requests_waiting", "gauge",
               "2026 releases, not 1.1 (enable_iter_perf_stats)"),),
        "engine_request_prefill_seconds_total": (
            _f("trtllm_request_prefill_time_seconds", "histogram_sum",
               "1.1 and later (its _sum)"),),
        "engine_request_decode_seconds_total": (
            _f("trtllm_request_decode_time_seconds", "histogram_sum",
               "1.1 and later (its _sum)"),),
    },
    absent={
        "engine_preemptions_total": "trtllm-serve counts no preemptions "
                                    "(trtllm_num_paused_requests is a gauge of paused requests)",
    },
)

# llama-server with --metrics: a handful of unlabelled gauges and counters written by hand
# (tools/server), no histogram at all; its KV-cache gauges were dropped when the cache was unified
LLAMACPP = Engine(
    name="llamacpp", title="llama.cpp (llama-server)", prefix="llamacpp:", model_label=None,
    default_url="http://127.0.0.1:8080/metrics",  # with --metrics
    checked="tools/server of 2026 builds; the current build's capture",
    figures={
        "engine_kv_cache_usage_ratio": (
            _f("llamacpp:kv_cache_usage_ratio", "gauge",
               "older builds only (removed upstream when the KV cache was unified)"),),
        "engine_requests_running": (_f("llamacpp:requests_processing", "gauge", "all"),),
        "engine_requests_waiting": (_f("llamacpp:requests_deferred", "gauge", "all"),),
    },
    absent={
        "engine_request_duration_seconds": "llama.cpp has no latency histogram (only "
                                           "cumulative prompt and generation seconds)",
        "engine_time_to_first_token_seconds": "llama.cpp has no time-to-first-token histogram",
        "engine_inter_token_latency_seconds": "llama.cpp has no inter-token latency histogram",
        "engine_request_queue_duration_seconds": "llama.cpp has no queue time",
        "engine_kv_cache_usage_ratio": "current llama.cpp exposes no KV-cache usage: "
                                       "llamacpp:kv_cache_usage_ratio was removed upstream",
        "engine_preemptions_total": "llama.cpp exposes no preemption count",
        "engine_request_prefill_seconds_total": "llama.cpp has no per-request prefill time (only "
                                                "cumulative prompt seconds)",
        "engine_request_decode_seconds_total": "llama.cpp has no per-request decode time (only "
                                               "cumulative generation seconds)",
    },
)

# NVIDIA Dynamo's HTTP frontend (python -m dynamo.frontend; lib/llm/src/http/service/metrics.rs,
# Rust's prometheus crate): the entry point in front of vLLM, SGLang or TensorRT-LLM workers,
# which serve their own engine's families on their own port. Request series are labelled with the
# request's model (lower-cased in the capture), the model_* gauges with the model card's display
# name: the model is joined case-insensitively and forwarded as registered. Its queued_requests
# count requests from the handler's start to their first token (prefill included), and
# inflight_requests (active_requests from 2026) the queued ones too: waiting, yes; running, no
DYNAMO = Engine(
    name="dynamo", title="NVIDIA Dynamo (frontend)", prefix="dynamo_frontend_",
    model_label="model", default_url="http://127.0.0.1:8000/metrics",
    checked="lib/llm/src/http/service/metrics.rs and lib/runtime/src/metrics/prometheus_names.rs "
            "of 2026; the frontend's example capture (ai-dynamo/dynamo @ ce30a76, one request)",
    model_spellings=("dynamo_frontend_model_context_length",
                     "dynamo_frontend_model_total_kv_blocks",
                     "dynamo_frontend_model_max_num_seqs"),
    figures={
        "engine_request_duration_seconds": (
            _f("dynamo_frontend_request_duration_seconds", "histogram",
               "all (handler start to the response's end; 1 to 512 s, 10 buckets by default)"),),
        "engine_time_to_first_token_seconds": (
            _f("dynamo_frontend_time_to_first_token_seconds", "histogram", "all"),),
        "engine_inter_token_latency_seconds": (
            _f("dynamo_frontend_inter_token_latency_seconds", "histogram", "all"),),
        "engine_requests_waiting": (
            _f("dynamo_frontend_queued_requests", "gauge",
               "all (requests not yet given their first token: prefill included)"),),
    },
    absent={
        "engine_request_queue_duration_seconds": "Dynamo's frontend has no queue-time histogram "
                                                 "(its workers' engine endpoints have theirs)",
        "engine_kv_cache_usage_ratio": "Dynamo's frontend gives a worker's KV blocks "
                                       "(dynamo_frontend_model_total_kv_blocks), not those in use",
        "engine_requests_running": "Dynamo's frontend counts requests in flight with the queued "
                                   "ones (dynamo_frontend_inflight_requests), not those executing",
        "engine_preemptions_total": "Dynamo's frontend counts no preemptions",
        **dict.fromkeys(("engine_request_prefill_seconds_total",
                         "engine_request_decode_seconds_total"),
                        "Dynamo's frontend times no request phase (its workers' engines do)"),
    },
)

ENGINES: tuple[Engine, ...] = (VLLM, SGLANG, TGI, TRITON, TRTLLM, LLAMACPP, DYNAMO)


def absent_reason(engine: Engine, figure: str) -> str:
    """Why ``figure`` came with no value from ``engine``: what the table knows it lacks, or,
    where it has a family, that this text held none of it (a family created at its first event,
    a feature switched off, an older release)."""
    known = (engine.absent or {}).get(figure)
    if known and figure not in engine.figures:
        return known
    names = ", ".join(f.name for f in engine.figures.get(figure, ()))
    why = f"not in the text (the engine's family: {names})" if names else "not exposed"
    return f"{why}; {known}" if known else why


def source_names() -> frozenset[str]:
    """Every family name the tables read, as it appears at the start of a sample line or after
    ``# TYPE``: counters with and without ``_total``, histograms with their parts."""
    names: set[str] = set()
    for engine in ENGINES:
        for families in engine.figures.values():
            for fam in families:
                # a histogram's _sum alone: its buckets' lines are dropped unparsed
                names.add(f"{fam.name}_sum" if fam.kind == "histogram_sum" else fam.name)
                names.update(fam.count)
        names.update(engine.model_spellings)
    return frozenset(names)
