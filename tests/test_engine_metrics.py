"""The serving engine's metrics endpoint (DESIGN.md "What we build" 3; issue #26), seen from
outside: ``gpu-sidecar run`` reading real HTTP servers on 127.0.0.1 that serve each engine's own
exposition (``tests/engine_texts.py``: vLLM in its current and its previous naming, SGLang, TGI,
Triton, built from their sources) and pushing to a real VictoriaMetrics.

- What the agent forwards is what the served text says, computed here independently of the
  agent's code: KV-cache usage (the fullest engine core), requests running and waiting and
  preemptions (summed over engine cores and data-parallel ranks), each latency histogram bucket by
  bucket (summed over the labels beyond the model), Triton's cumulative microseconds as seconds;
  ``histogram_quantile`` over the stored buckets is the quantile of the served text (Prometheus'
  linear interpolation); no other family of the engine, nor its runtime's, is forwarded.
- ``gpu-sidecar diagnose`` names ``kv-cache`` and ``queueing`` for the simulated engine's
  scenarios and for real engine texts, and leaves the seed's verdicts as they were.
- An endpoint that hangs, trickles, answers 50 MB, garbage, a redirect, a 401, another program's
  metrics or an error, or disappears, never delays a cycle: cycles keep their interval, GPU series
  keep coming, the failure is counted under its reason, ``gpu_sidecar_engine_up`` is 0, the log
  says ``engine_metrics_failing`` once when it starts and ``engine_metrics_recovered`` once when
  it ends; a 50 MB answer does not grow the agent's memory beyond a bound.
"""

from __future__ import annotations

import contextlib
import http.server
import itertools
import math
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests import engine_texts as texts
from tests.conftest import run_cli
from tests.receivers import LOCAL, VM_REL, Agent, VictoriaMetrics, running
from tests.waiting import until

INTERVAL = 0.5
READ_TIMEOUT = 1.0  # --engine-metrics-timeout: twice the interval, so a read that held a cycle
#                     would show as a skipped slot
REASONS = ("unreachable", "timeout", "too_large", "malformed", "not_an_engine", "redirect",
           "credentials", "http_status")


# -- an engine's metrics endpoint ----------------------------------------------------------------


def _huge(size: int = 50 * 1024 * 1024) -> bytes:
    """50 MB of vLLM exposition (a LoRA-info gauge per adapter): well-formed, just too large."""
    line = ('vllm:lora_requests_info{max_lora="4096",running_lora_adapters="adapter-%08d",'
            'waiting_lora_adapters=""} 1.7672256e+09\n')
    head = texts.vllm_current()
    n = (size - len(head)) // len(line % 0) + 1
    return head + "".join(line % i for i in range(n)).encode()


HUGE: list[bytes] = []  # built once, by the test that needs it


class EngineServer:
    """A serving engine's /metrics on 127.0.0.1 (real HTTP, a thread per request). ``mode`` says
    how it answers and may change while the agent reads it: ``text`` (the engine's ``body``, or
    ``answer``),
    ``hang`` (accepts, reads the request, never answers), ``trickle`` (headers, then a byte every
    0.1 s), ``huge`` (50 MB), ``garbage`` (bytes that are no text format at all), ``corrupted``
    (the engine's text, mangled), ``redirect`` (302), ``credentials`` (401), ``other`` (another
    program's metrics), ``unavailable`` (503). Records every request's headers."""

    def __init__(self, body: bytes, port: int = 0) -> None:
        self.body = body
        # when set, what ``text`` answers instead of ``body``: a body and headers of its own (a
        # Content-Encoding, say), swapped whole while the agent reads
        self.answer: tuple[bytes, dict[str, str]] | None = None
        self.mode = "text"
        self.port = port
        self.requests: list[dict[str, str]] = []
        self.redirected_to = "http://127.0.0.1:9/metrics"
        self._closing = threading.Event()
        self._server: http.server.ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://{LOCAL}:{self.port}/metrics"

    @property
    def endpoint(self) -> str:
        return f"{LOCAL}:{self.port}"

    def start(self) -> EngineServer:
        self._closing.clear()
        server = http.server.ThreadingHTTPServer((LOCAL, self.port), self._handler())
        server.daemon_threads = True
        self.port = server.server_address[1]  # the same port when restarted
        threading.Thread(target=server.serve_forever, daemon=True).start()
        self._server = server
        return self

    def stop(self) -> None:
        """The engine gone: the port closed, nothing listening on it."""
        self._closing.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                engine.requests.append(dict(self.headers.items()))
                with contextlib.suppress(OSError):  # the agent gave up on it: its right
                    self._answer()

            def _answer(self) -> None:
                while engine.mode == "hang" and not engine._closing.wait(0.02):
                    pass  # then answers as the engine does by now, if it still listens
                mode = engine.mode
                if mode == "hang":
                    return
                if mode == "trickle":
                    self._head(200, len(engine.body))
                    for i in range(len(engine.body)):
                        if engine.mode != "trickle" or engine._closing.wait(0.1):
                            return
                        self.wfile.write(engine.body[i:i + 1])
                        self.wfile.flush()
                    return
                if mode == "huge":
                    body = HUGE[0]
                    self._head(200, len(body))
                    for at in range(0, len(body), 1 << 20):
                        self.wfile.write(body[at:at + (1 << 20)])
                    return
                text, text_headers = engine.answer or (engine.body, {})
                status, headers, body = {
                    "text": (200, text_headers, text),
                    "garbage": (200, {}, random.Random(7).randbytes(64 * 1024)),
                    "corrupted": (200, {}, texts.corrupted(engine.body)),
                    "other": (200, {}, texts.node_exporter()),
                    "redirect": (302, {"Location": engine.redirected_to}, b""),
                    "credentials": (401, {"WWW-Authenticate": 'Basic realm="metrics"'},
                                    b"401 Unauthorized"),
                    "unavailable": (503, {}, b"upstream not ready"),
                }[mode]
                self._head(status, len(body), headers)
                self.wfile.write(body)

            def _head(self, status: int, length: int, headers: dict | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(length))
                self.end_headers()

            def do_POST(self) -> None:  # a remote-write receiver's answer, for test_faults
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        return Handler


def run_args(spool: Path, *extra: str) -> list[str]:
    return ["--simulate", "healthy", "--interval", str(INTERVAL), "--push-interval",
            str(INTERVAL), "--spool-dir", str(spool), "--engine-metrics-timeout",
            str(READ_TIMEOUT), "--shutdown-timeout", "3", *extra]


def latest(agent: Agent, name: str, **labels: str) -> float | None:
    return agent.last(name, **labels)


# -- what the served text says, computed without the agent's code ---------------------------------


@dataclass(frozen=True)
class Mapping:
    """How an engine's families become our series: the label naming the model (None: the engine
    names none), the numbers (our name -> its sample name and how the values of one model
    combine), the histograms (our name -> its family, and the factor to seconds) and Triton's
    cumulative durations (our name -> the duration counter and the count counter)."""

    engine: str
    model: str | None
    numbers: dict[str, tuple[str, Callable]]
    histograms: dict[str, tuple[str, float]]
    means: dict[str, tuple[str, str]] = field(default_factory=dict)
    # gauges whose model label is the model as the engine registered it: every other series'
    # model that equals one of them but for case is expected under that spelling (Dynamo)
    spellings: tuple[str, ...] = ()

    def model_of(self, labels: dict[str, str], samples: dict) -> str:
        """The model a sample's labels name, spelled as the engine registered it."""
        model = labels.get(self.model, "") if self.model else ""
        for name in self.spellings:
            for other, _ in samples.get(name, ()):
                if other.get(self.model, "").casefold() == model.casefold():
                    return other[self.model]
        return model


VLLM_NUMBERS = {
    # the fullest engine core's KV cache: each core has a cache of its own
    "engine_requests_running": ("vllm:num_requests_running", sum),
    "engine_requests_waiting": ("vllm:num_requests_waiting", sum),
    "engine_preemptions_total": ("vllm:num_preemptions_total", sum),
}
MAPPINGS = {
    "vllm_current": Mapping(
        "vllm", "model_name",
        {"engine_kv_cache_usage_ratio": ("vllm:kv_cache_usage_perc", max), **VLLM_NUMBERS,
         # V1's request phases: their histograms' _sum only
         "engine_request_prefill_seconds_total": ("vllm:request_prefill_time_seconds_sum", sum),
         "engine_request_decode_seconds_total": ("vllm:request_decode_time_seconds_sum", sum)},
        {"engine_request_duration_seconds": ("vllm:e2e_request_latency_seconds", 1.0),
         "engine_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds", 1.0),
         "engine_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", 1.0),
         "engine_request_queue_duration_seconds": ("vllm:request_queue_time_seconds", 1.0)}),
    "vllm_previous": Mapping(
        "vllm", "model_name",
        {"engine_kv_cache_usage_ratio": ("vllm:gpu_cache_usage_perc", max), **VLLM_NUMBERS},
        {"engine_request_duration_seconds": ("vllm:e2e_request_latency_seconds", 1.0),
         "engine_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds", 1.0),
         "engine_inter_token_latency_seconds": ("vllm:time_per_output_token_seconds", 1.0),
         "engine_request_queue_duration_seconds": ("vllm:request_queue_time_seconds", 1.0)}),
    "sglang": Mapping(
        "sglang", "model_name",
        {"engine_kv_cache_usage_ratio": ("sglang:token_usage", max),
         "engine_requests_running": ("sglang:num_running_reqs", sum),
         "engine_requests_waiting": ("sglang:num_queue_reqs", sum),
         "engine_preemptions_total": ("sglang:num_retracted_requests_total", sum)},
        {"engine_request_duration_seconds": ("sglang:e2e_request_latency_seconds", 1.0),
         "engine_time_to_first_token_seconds": ("sglang:time_to_first_token_seconds", 1.0),
         "engine_inter_token_latency_seconds": ("sglang:inter_token_latency_seconds", 1.0),
         "engine_request_queue_duration_seconds": ("sglang:queue_time_seconds", 1.0)}),
    "tgi": Mapping(
        "tgi", None,
        {"engine_requests_running": ("tgi_batch_current_size", sum),
         "engine_requests_waiting": ("tgi_queue_size", sum)},
        {"engine_request_duration_seconds": ("tgi_request_duration", 1.0),
         "engine_inter_token_latency_seconds": ("tgi_request_mean_time_per_token_duration", 1.0),
         "engine_request_queue_duration_seconds": ("tgi_request_queue_duration", 1.0)}),
    "triton": Mapping(
        "triton", "model",
        {"engine_requests_waiting": ("nv_inference_pending_request_count", sum)},
        {"engine_time_to_first_token_seconds": ("nv_inference_first_response_histogram_ms",
                                                1e-3)},
        {"engine_request_duration_seconds": ("nv_inference_request_duration_us",
                                             "nv_inference_request_success"),
         "engine_request_queue_duration_seconds": ("nv_inference_queue_duration_us",
                                                   "nv_inference_request_success")}),
}
TEXTS: dict[str, Callable[[], bytes]] = {
    "vllm_current": texts.vllm_current, "vllm_previous": texts.vllm_previous,
    "sglang": texts.sglang, "tgi": texts.tgi, "triton": texts.triton,
}

Key = tuple[str, tuple[tuple[str, str], ...]]


def served_samples(body: bytes) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def served_histograms(body: bytes, mapping: Mapping, family: str, scale: float
                      ) -> dict[str, tuple[list[tuple[float, float]], float]]:
    """Per model: the cumulative buckets [(bound in seconds, count)], +Inf last, summed over
    every label but the model's, and the sum in seconds."""
    samples = served_samples(body)
    buckets: dict[str, dict[float, float]] = {}
    sums: dict[str, float] = {}
    for labels, value in samples[f"{family}_bucket"]:
        model = mapping.model_of(labels, samples)
        le = float(labels["le"])
        bound = le if math.isinf(le) else le * scale
        per = buckets.setdefault(model, {})
        per[bound] = per.get(bound, 0.0) + value
    for labels, value in samples[f"{family}_sum"]:
        model = mapping.model_of(labels, samples)
        sums[model] = sums.get(model, 0.0) + value * scale
    return {m: (sorted(per.items()), sums[m]) for m, per in buckets.items()}


def expected_series(name: str | Mapping, body: bytes, endpoint: str) -> dict[Key, float]:
    """Every engine_* series the agent must forward for this served text, with its value
    (``name``: a text of ``MAPPINGS``, or the mapping itself)."""
    mapping = name if isinstance(name, Mapping) else MAPPINGS[name]
    samples = served_samples(body)
    out: dict[Key, float] = {}

    def key(series: str, model: str, **extra: str) -> Key:
        labels = {"engine": mapping.engine, "endpoint": endpoint, **extra}
        if mapping.model:
            labels["model"] = model
        return series, tuple(sorted(labels.items()))

    def by_model(sample: str) -> dict[str, list[float]]:
        per: dict[str, list[float]] = {}
        # prometheus_client's parser names a counter's samples with _total, as written or not
        for labels, value in samples.get(sample) or samples[f"{sample}_total"]:
            per.setdefault(mapping.model_of(labels, samples), []).append(value)
        return per

    for ours, (sample, combine) in mapping.numbers.items():
        for model, values in by_model(sample).items():
            out[key(ours, model)] = float(combine(values))
    for ours, (family, scale) in mapping.histograms.items():
        for model, (buckets, total) in served_histograms(body, mapping, family, scale).items():
            for bound, count in buckets:
                le = "+Inf" if math.isinf(bound) else repr(bound)
                out[key(f"{ours}_bucket", model, le=le)] = count
            out[key(f"{ours}_sum", model)] = total
            out[key(f"{ours}_count", model)] = buckets[-1][1]
    for ours, (duration, count) in mapping.means.items():
        counts = {m: sum(v) for m, v in by_model(count).items()}
        for model, values in by_model(duration).items():
            out[key(f"{ours}_bucket", model, le="+Inf")] = counts[model]
            out[key(f"{ours}_sum", model)] = sum(values) * 1e-6  # microseconds to seconds
            out[key(f"{ours}_count", model)] = counts[model]
    return out


def prometheus_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """``histogram_quantile`` as Prometheus computes it (promql/quantile.go, bucketQuantile):
    the bucket holding the rank, linear interpolation within it, 0 the lower bound of the first,
    the highest finite bound when the rank falls into +Inf."""
    rank = q * buckets[-1][1]
    b = next((i for i, (_, c) in enumerate(buckets[:-1]) if c >= rank), len(buckets) - 1)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    if b == 0 and buckets[0][0] <= 0:
        return buckets[0][0]
    start, below = (0.0, 0.0) if b == 0 else buckets[b - 1]
    end, count = buckets[b]
    return start + (end - start) * (rank - below) / (count - below)


def test_the_quantile_of_this_file_is_prometheus_own():
    """The reference is checked against numbers worked by hand from Prometheus' rules."""
    buckets = [(0.1, 10.0), (0.5, 60.0), (1.0, 100.0), (math.inf, 100.0)]
    assert prometheus_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (50 - 10) / 50)
    assert prometheus_quantile(0.05, buckets) == pytest.approx(0.05)  # 0 is the first's lower
    assert prometheus_quantile(0.99, [(1.0, 10.0), (2.0, 20.0), (math.inf, 30.0)]) == 2.0
    assert prometheus_quantile(0.1, [(0.0, 5.0), (1.0, 10.0), (math.inf, 10.0)]) == 0.0


# -- forwarded to VictoriaMetrics ----------------------------------------------------------------


@dataclass
class Forwarded:
    vm: VictoriaMetrics
    engines: dict[str, EngineServer]
    agent: Agent
    rows: list[tuple[str, tuple, int, float]]  # the engine_* samples VictoriaMetrics holds

    def stored(self, name: str) -> dict[int, dict[Key, float]]:
        """The stored engine_* samples of one served text, per timestamp."""
        endpoint = self.engines[name].endpoint
        out: dict[int, dict[Key, float]] = {}
        for series, labels, ts, value in self.rows:
            if dict(labels).get("endpoint") == endpoint:
                out.setdefault(ts, {})[(series, labels)] = value
        return out

    def query(self, expr: str, at_ms: int) -> list[dict]:
        r = requests.get(f"{self.vm.base}/api/v1/query",
                         params={"query": expr, "time": f"{at_ms / 1000:.3f}", "nocache": "1"},
                         timeout=30)
        r.raise_for_status()
        return r.json()["data"]["result"]


@pytest.fixture(scope="module")
def forwarded(tmp_path_factory) -> Iterator[Forwarded]:
    """Every engine's text served at once to one agent (a pod with several engines: each
    endpoint stays apart by its ``endpoint`` label), pushed to VictoriaMetrics; the agent is
    stopped cleanly once every endpoint's figures went out in three cycles."""
    tmp = tmp_path_factory.mktemp("forwarded")
    vm = VictoriaMetrics(tmp)
    engines = {name: EngineServer(make()) for name, make in TEXTS.items()}
    with running(vm, *engines.values()):
        vm.start()
        for e in engines.values():
            e.start()
        urls = [a for e in engines.values() for a in ("--engine-metrics-url", e.url)]
        agent = Agent(run_args(tmp / "spool", "--remote-write-url", vm.write_url, *urls)).start()
        with running(agent):
            def cycles_with_every_engine() -> int:
                seen: dict[str, set[int]] = {}
                for series, labels, ts, _ in agent.sampled():
                    if series.startswith("engine_"):
                        seen.setdefault(dict(labels)["endpoint"], set()).add(ts)
                return len(seen) == len(engines) and min(len(v) for v in seen.values()) >= 3

            until(cycles_with_every_engine, 60, what=lambda: "three cycles of every engine\n"
                  + "".join(agent.err)[-3000:])
            assert agent.stop() == 0, "".join(agent.err)[-3000:]
        printed = len([r for r in agent.sampled() if r[0].startswith("engine_")])

        def stored() -> list | None:
            rows = vm.samples('{__name__=~"engine_.+"}')
            return rows if len(rows) >= printed else None

        rows = until(stored, 30, interval=0.5, what="every printed engine sample stored")
        yield Forwarded(vm, engines, agent, rows)


@pytest.mark.parametrize("name", list(TEXTS))
def test_the_engine_figures_stored_are_those_of_the_served_text(forwarded, name):
    """Each cycle's engine_* series in VictoriaMetrics are exactly those the served text maps to
    (no more, no fewer, the engine's bucket bounds as ``le``), with the values computed from it:
    KV usage the fullest core's, requests and preemptions summed over cores and ranks, buckets
    summed over every label but the model's."""
    engine = forwarded.engines[name]
    expected = expected_series(name, engine.body, engine.endpoint)
    stored = forwarded.stored(name)
    assert len(stored) >= 3, f"{len(stored)} cycles of {name} stored"
    for ts, got in sorted(stored.items()):
        assert set(got) == set(expected), (
            f"{name} at {ts}: missing {sorted(set(expected) - set(got))[:5]}, "
            f"unexpected {sorted(set(got) - set(expected))[:5]}")
        for k, v in expected.items():
            assert got[k] == pytest.approx(v, rel=VM_REL), (name, k)


def test_the_figures_named_in_the_issue_have_the_values_the_engines_report(forwarded):
    """The same, spelled out for a reader: the figures an SRE looks at first."""
    def value(name: str, series: str, **labels: str) -> float:
        found = {v for s, lab, _, v in forwarded.rows if s == series
                 and dict(lab).get("endpoint") == forwarded.engines[name].endpoint
                 and all(dict(lab).get(k) == x for k, x in labels.items())}
        assert len(found) == 1, (name, series, found)
        return found.pop()

    llama, qwen = texts.VLLM_CURRENT_MODEL, texts.VLLM_PREVIOUS_MODEL
    # vLLM 0.33, two engine cores: KV (0.62, 0.71), running (24, 19), waiting (3, 5), preempted
    # (17, 4)
    assert value("vllm_current", "engine_kv_cache_usage_ratio", model=llama) == 0.71
    assert value("vllm_current", "engine_requests_running", model=llama) == 43
    assert value("vllm_current", "engine_requests_waiting", model=llama) == 8
    assert value("vllm_current", "engine_preemptions_total", model=llama) == 21
    # the previous naming: gpu_cache_usage_perc 0.384, time_per_output_token_seconds
    assert value("vllm_previous", "engine_kv_cache_usage_ratio", model=qwen) == 0.384
    assert value("vllm_previous", "engine_inter_token_latency_seconds_count", model=qwen) \
        == 15 * 1481
    # SGLang, two data-parallel schedulers: token usage (0.81, 0.77), running (37, 41),
    # queued (6, 2), retracted (9, 5)
    ds = texts.SGLANG_MODEL
    assert value("sglang", "engine_kv_cache_usage_ratio", model=ds) == 0.81
    assert value("sglang", "engine_requests_running", model=ds) == 78
    assert value("sglang", "engine_requests_waiting", model=ds) == 8
    assert value("sglang", "engine_preemptions_total", model=ds) == 14
    # TGI: no labels at all
    assert value("tgi", "engine_requests_running") == 12
    assert value("tgi", "engine_requests_waiting") == 7
    # Triton: pending per model, summed over GPUs and versions
    assert value("triton", "engine_requests_waiting", model="resnet50") == 4
    assert value("triton", "engine_requests_waiting", model="bert_onnx") == 7


def _histogram_cases() -> list:
    cases = []
    for name, mapping in MAPPINGS.items():
        for ours, (family, scale) in mapping.histograms.items():
            cases.append(pytest.param(name, ours, family, scale, id=f"{name}-{ours}"))
    return cases


@pytest.mark.parametrize(("name", "ours", "family", "scale"), _histogram_cases())
def test_histogram_quantile_of_the_stored_buckets_is_the_served_texts(
        forwarded, name, ours, family, scale):
    """``histogram_quantile`` asked of VictoriaMetrics over the stored engine latency equals the
    quantile computed from the served text by Prometheus' interpolation (the text's buckets
    summed over engine cores, ranks, versions and streaming flags)."""
    engine = forwarded.engines[name]
    mapping = MAPPINGS[name]
    at = max(forwarded.stored(name))
    for model, (buckets, _) in served_histograms(engine.body, mapping, family, scale).items():
        selector = f'endpoint="{engine.endpoint}"' + (f',model="{model}"' if model else "")
        for q in (0.5, 0.9, 0.99):
            want = prometheus_quantile(q, buckets)
            assert want < buckets[-2][0], "the text's quantile must fall inside a finite bucket"
            got = forwarded.query(f"histogram_quantile({q}, {ours}_bucket{{{selector}}})", at)
            assert len(got) == 1, got
            assert float(got[0]["value"][1]) == pytest.approx(want, rel=1e-9), (model, q)


def test_triton_cumulative_microseconds_are_stored_as_seconds_whose_mean_is_sum_over_count(
        forwarded):
    """Triton's ``nv_inference_request_duration_us`` and ``nv_inference_queue_duration_us`` are
    cumulative microseconds with no buckets: stored as a histogram of one +Inf bucket whose
    ``_sum`` is seconds and ``_count`` the successful requests, so that sum / count is the mean
    latency in seconds."""
    engine = forwarded.engines["triton"]
    at = max(forwarded.stored("triton"))
    for model in ("resnet50", "bert_onnx"):
        rows = [r for r in texts.TRITON_MODELS if r[1] == model]
        requests_ = sum(r[3] for r in rows)
        for ours, per_request_us in (("engine_request_duration_seconds", 4),
                                     ("engine_request_queue_duration_seconds", 5)):
            mean_s = sum(round(r[3] * r[per_request_us]) for r in rows) / requests_ * 1e-6
            sel = f'{{endpoint="{engine.endpoint}",model="{model}"}}'
            got = forwarded.query(f"{ours}_sum{sel} / {ours}_count{sel}", at)
            assert float(got[0]["value"][1]) == pytest.approx(mean_s, rel=1e-9), (model, ours)
            assert 0.001 < mean_s < 0.05, "a mean of milliseconds, in seconds"
            count = forwarded.query(f"{ours}_count{sel}", at)
            assert float(count[0]["value"][1]) == requests_


def test_no_other_family_of_an_engine_or_its_runtime_is_forwarded(forwarded):
    """What is stored of the engines is our engine_* series and nothing else: not vLLM's token
    counters or its other histograms, not SGLang's, TGI's or Triton's GPU figures, not the
    Python or process collectors of the engines' registries."""
    r = requests.get(f"{forwarded.vm.base}/api/v1/label/__name__/values", timeout=30)
    names = set(r.json()["data"])
    assert "engine_kv_cache_usage_ratio" in names
    for prefix in ("vllm", "sglang", "tgi_", "nv_", "python_", "process_", "go_", "node_"):
        assert not [n for n in names if n.startswith(prefix)], prefix
    ours = {f"{f}{part}" if f.endswith("seconds") else f
            for f in ("engine_request_duration_seconds", "engine_time_to_first_token_seconds",
                      "engine_inter_token_latency_seconds",
                      "engine_request_queue_duration_seconds", "engine_kv_cache_usage_ratio",
                      "engine_requests_running", "engine_requests_waiting",
                      "engine_preemptions_total", "engine_request_prefill_seconds_total",
                      "engine_request_decode_seconds_total")
            for part in ("_bucket", "_sum", "_count")}
    assert {n for n in names if n.startswith("engine_")} == ours
    # vLLM's request_time_per_output_token_seconds is a per-request mean, not the inter-token
    # latency: its buckets (the same bounds) must not have been added to it
    current = forwarded.engines["vllm_current"]
    itl_count = [v for s, lab, _, v in forwarded.rows
                 if s == "engine_inter_token_latency_seconds_count"
                 and dict(lab)["endpoint"] == current.endpoint]
    assert set(itl_count) == {20 * (3223 + 2871)}


def test_every_endpoint_is_up_and_logged_once_as_found_with_its_engine_and_models(forwarded):
    agent = forwarded.agent
    found = {e["endpoint"]: e for e in agent.logged("engine_metrics_found")}
    assert len(agent.logged("engine_metrics_found")) == len(forwarded.engines)
    for name, engine in forwarded.engines.items():
        e = found[engine.endpoint]
        assert e["engine"] == MAPPINGS[name].engine
        assert latest(agent, "gpu_sidecar_engine_up", endpoint=engine.endpoint) == 1
        for reason in REASONS:
            assert latest(agent, "gpu_sidecar_engine_read_failures_total",
                          endpoint=engine.endpoint, reason=reason) == 0
    assert found[forwarded.engines["triton"].endpoint]["models"] == ["bert_onnx", "resnet50"]
    assert not agent.logged("engine_metrics_failing")


# -- diagnose --------------------------------------------------------------------------------------


def verdicts(stdout: str) -> set[str]:
    return set(re.findall(r"^  verdict: (\S+)", stdout, re.M))


@pytest.mark.parametrize(("scenario", "verdict"), [
    ("kv-cache-full", "kv-cache"),
    ("queueing", "queueing"),
    ("low-occupancy", "low-occupancy"),  # the seed's: unchanged by the engine layer
])
def test_diagnose_names_the_engine_verdicts_of_the_simulated_engine(scenario, verdict):
    proc = run_cli("diagnose", "--simulate", scenario, "--duration", "3", "--interval", "0.5")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert verdicts(proc.stdout) == {verdict}, proc.stdout
    if verdict in ("kv-cache", "queueing"):
        assert "  engine:  vllm:" in proc.stdout, proc.stdout


@pytest.mark.parametrize(("text", "verdict", "code"), [
    # vLLM 0.33 with room in its caches and a short queue: a healthy GPU stays healthy
    (lambda: texts.vllm_current(), "none", 0),
    # SGLang whose token pool is full with requests queued: the cache is the bottleneck
    (lambda: texts.sglang(token_usage=(0.97, 0.95), queued=(30, 26)), "kv-cache", 1),
    # vLLM whose requests spend most of their latency in its queue
    (lambda: texts.vllm_current(kv=(0.4, 0.42), queue_p99=19.0), "queueing", 1),
], ids=["vllm-healthy", "sglang-kv-full", "vllm-queueing"])
def test_diagnose_judges_a_real_engine_text_beside_a_healthy_gpu(tmp_path, text, verdict, code):
    engine = EngineServer(text()).start()
    with running(engine):
        proc = run_cli("diagnose", "--simulate", "healthy", "--no-simulated-app", "--gpus", "visible",
                       "--engine-metrics-url", engine.url, "--duration", "3",
                       "--interval", "0.5")
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert verdicts(proc.stdout) == {verdict}, proc.stdout
    assert engine.requests, "the engine endpoint was never read"


# -- an endpoint that fails ----------------------------------------------------------------------


@dataclass
class Fault:
    mode: str  # EngineServer's, or "gone": the server stopped
    reason: str


FAULTS = [
    pytest.param(Fault("hang", "timeout"), id="hangs-after-accepting"),
    pytest.param(Fault("trickle", "timeout"), id="trickles-after-the-headers"),
    pytest.param(Fault("huge", "too_large"), id="answers-50-MB"),
    pytest.param(Fault("corrupted", "malformed"), id="answers-a-mangled-text"),
    pytest.param(Fault("garbage", "malformed"), id="answers-bytes-that-are-no-text-format"),
    pytest.param(Fault("redirect", "redirect"), id="redirects"),
    pytest.param(Fault("credentials", "credentials"), id="asks-for-credentials"),
    pytest.param(Fault("other", "not_an_engine"), id="serves-another-programs-metrics"),
    pytest.param(Fault("unavailable", "http_status"), id="answers-503"),
    pytest.param(Fault("gone", "unreachable"), id="disappears-mid-run"),
]

def test_a_json_answer_is_a_failed_read_not_an_error_of_the_reader():
    """An endpoint pointed at the engine's API instead of /metrics (vLLM's /v1/models on the
    same port answers 200 with JSON): one failed read counted, no exception out of the read (which
    the reader thread would log as a bug on every interval, counting nothing)."""
    from sidecar import config, wiring
    from sidecar.sources.engine import EngineEndpoint

    engine = EngineServer(b'{"object":"list","data":[{"id":"meta-llama/Llama-3.1-8B-Instruct",'
                          b'"object":"model","owned_by":"vllm"}]}').start()
    with running(engine):
        endpoint = EngineEndpoint(engine.url, wiring.engine_fetch(config.Config()),
                                  interval_s=INTERVAL, timeout_s=READ_TIMEOUT)
        endpoint.read_once()
    assert engine.requests
    assert sum(endpoint.failures.values()) == 1, endpoint.failures
    assert endpoint.current() is None


CYCLE_BOUND_S = 0.4  # a cycle that waited for a read would take the read's 1 s
MEMORY_BOUND = 32 << 20  # the answer is read up to --engine-metrics-max-bytes (4 MiB) and no
#                          further: reading the 50 MB would cost at least 50 MiB more


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the peak) of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def cycle_times(agent: Agent) -> list[int]:
    return sorted({ts for _, _, ts, _ in agent.sampled()})


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS)
def test_a_failing_endpoint_never_delays_a_cycle_and_is_said_once_when_it_starts_and_ends(
        tmp_path, fault):
    if fault.mode == "huge" and not HUGE:
        HUGE.append(_huge())
    engine = EngineServer(texts.vllm_current()).start()
    elsewhere = EngineServer(texts.vllm_current()).start()  # where a redirect points
    engine.redirected_to = elsewhere.url
    token = tmp_path / "token"
    token.write_text("s3cr3t-token\n")
    # a receiver with credentials and a header of its own: none of them may go to an engine
    receiver = EngineServer(b"").start()
    agent = Agent(run_args(tmp_path / "spool", "--engine-metrics-url", engine.url,
                           "--remote-write-url", receiver.url.replace("/metrics", "/api/v1/write"),
                           "--bearer-token-file", str(token), "--header", "X-Scope-OrgID=team-a"))
    with running(engine, elsewhere, receiver, agent):
        agent.start()
        ep = engine.endpoint

        def up() -> float | None:
            return latest(agent, "gpu_sidecar_engine_up", endpoint=ep)

        until(lambda: up() == 1 and agent.logged("engine_metrics_found"), 60,
              what=lambda: "the healthy engine read\n" + "".join(agent.err)[-2000:])
        agent.more_cycles(2, "with the engine healthy")
        before = memory(agent.proc.pid)
        overruns = latest(agent, "gpu_sidecar_cycle_overruns_total")

        # the fault
        fault_at = time.time()
        if fault.mode == "gone":
            engine.stop()
        else:
            engine.mode = fault.mode

        def failures() -> float | None:
            return latest(agent, "gpu_sidecar_engine_read_failures_total", endpoint=ep,
                          reason=fault.reason)

        def counted() -> dict[str, float]:
            return {r: latest(agent, "gpu_sidecar_engine_read_failures_total", endpoint=ep,
                              reason=r) or 0.0 for r in REASONS}

        until(lambda: sum(counted().values()) >= 2 and up() == 0, 60,
              what=lambda: f"two failed reads and engine_up 0 (failures {counted()}, up "
                           f"{up()})\n" + "".join(agent.err)[-2000:])
        assert {r for r, n in counted().items() if n} == {fault.reason}, counted()
        agent.more_cycles(4, "while the endpoint fails")
        during = memory(agent.proc.pid)
        failing_cycles = [ts for ts in cycle_times(agent) if ts >= fault_at * 1000]
        # the agent's own count of cycles longer than their slot, over the failing ones only
        overruns_while_failing = latest(agent, "gpu_sidecar_cycle_overruns_total")

        # the recovery: the same engine, the same port
        if fault.mode == "gone":
            engine.start()
        else:
            engine.mode = "text"
        until(lambda: up() == 1 and agent.logged("engine_metrics_recovered"), 60,
              what=lambda: "the recovery\n" + "".join(agent.err)[-2000:])
        agent.more_cycles(1, "after the recovery")
        assert agent.stop() == 0, "".join(agent.err)[-3000:]

    # cycles kept their interval while the endpoint failed: none waited for a read, none
    # skipped a slot, and each had the GPUs' series
    gaps = [(b - a) / 1000 for a, b in itertools.pairwise(failing_cycles)]
    span = (failing_cycles[-1] - failing_cycles[0]) / 1000
    assert len(failing_cycles) >= 6, failing_cycles
    assert max(gaps) < 1.6 * INTERVAL, f"a cycle came {max(gaps):.2f} s after the one before"
    assert abs(len(failing_cycles) - 1 - span / INTERVAL) <= 1, (len(failing_cycles), span)
    rows = agent.sampled()
    durations = [v for n, _, ts, v in rows
                 if n == "gpu_sidecar_cycle_duration_seconds" and ts in set(failing_cycles)]
    assert len(durations) == len(failing_cycles)
    assert max(durations) < CYCLE_BOUND_S, f"a cycle took {max(durations):.3f} s"
    assert overruns_while_failing == overruns
    gpus = {dict(lab)["gpu_uuid"] for n, lab, _, _ in rows if n == "gpu_utilization_ratio"}
    assert len(gpus) == 2
    for ts in failing_cycles:
        got = {dict(lab)["gpu_uuid"] for n, lab, t, _ in rows
               if n == "gpu_utilization_ratio" and t == ts}
        assert got == gpus, f"the GPU series of the cycle at {ts} are missing"

    # counted under its reason, and only there; no engine series while it failed
    assert failures() >= 2
    assert {r for r, n in counted().items() if n} == {fault.reason}, counted()
    down = [ts for n, lab, ts, v in rows if n == "gpu_sidecar_engine_up" and v == 0]
    assert down and not [1 for n, lab, ts, _ in rows
                         if n == "engine_requests_running" and ts in set(down)]

    # said once when it started and once when it ended
    failing = agent.logged("engine_metrics_failing")
    assert len(failing) == 1, failing
    assert failing[0]["endpoint"] == ep and failing[0]["reason"] == fault.reason
    assert failing[0]["hint"] and "GPU sampling goes on" in failing[0]["effect"]
    recovered = agent.logged("engine_metrics_recovered")
    assert len(recovered) == 1 and recovered[0]["endpoint"] == ep, recovered
    assert recovered[0]["engine"] == "vllm"
    assert len(agent.logged("engine_metrics_found")) == 1, "the same engine found again"

    # what the agent sent the engine: a plain GET, nothing of the receiver's
    for headers in engine.requests:
        lowered = {k.lower(): v for k, v in headers.items()}
        assert "authorization" not in lowered and "x-scope-orgid" not in lowered, headers
    assert "s3cr3t" not in "".join(agent.err) + "".join(agent.out)
    if fault.mode == "redirect":
        assert not elsewhere.requests, "the redirect was followed"
        assert elsewhere.endpoint in failing[0]["detail"], failing[0]
    if fault.mode == "huge":
        grown = during["VmHWM"] - before["VmHWM"]
        assert grown < MEMORY_BOUND, f"peak memory grew {grown >> 20} MiB with 50 MB answers"
        assert during["VmRSS"] - before["VmRSS"] < MEMORY_BOUND


def test_an_engine_url_given_twice_or_with_credentials_is_refused_saying_what_to_do():
    url = "http://127.0.0.1:8000/metrics"
    twice = run_cli("run", "--once", "--engine-metrics-url", f"{url},{url}")
    assert twice.returncode == 2
    assert "names the endpoint of URL 1 again" in twice.stderr and "read" in twice.stderr
    secret = run_cli("run", "--once", "--engine-metrics-url", "http://user:hunter2@127.0.0.1:8000/metrics")
    assert secret.returncode == 2
    assert "sends none to an engine" in secret.stderr and "hunter2" not in secret.stderr
