"""Every supported engine's real /metrics text (``tests/realworld/``, issue #35), served on
127.0.0.1 by a real HTTP server and read by a real ``gpu-sidecar run --engine-metrics-url``.

- Each real capture (vLLM with V0 and V1 names mixed, vLLM V1 as served in 2026 with ``engine``
  on every series and ``*_created`` samples, SGLang 0.5.10, TGI's router, Triton, llama.cpp's
  current server, NVIDIA Dynamo's frontend) is served byte for byte, its header comments
  included. Where a
  capture is only a list of names (trtllm-serve's MetricsCollector, LLMKube's inventories of live
  llama.cpp, vLLM and SGLang servers) the smallest valid text is built from those names
  (``engine_texts.text_from_names``: one series per name, types from the engine's source) and
  said so in the case's id.
- The ``engine_*`` series the agent prints for each endpoint are exactly those the text maps to,
  with the text's values, computed here with ``prometheus_client``'s parser
  (``test_engine_metrics.expected_series``), not with the agent's code.
- What a text does not hold stays absent and is said once, with why (``not_exposed`` of
  ``engine_metrics_found``): llama.cpp's removed KV-cache gauge, SGLang's retraction counter that
  appears only at the first retraction, TGI's latency histograms the excerpt cut.
- TGI's ``tgi_batch_next_size`` with its 1,000 buckets forwards nothing: the series stay the
  excerpt's.
- Dynamo's frontend lower-cases the model on its request series and keeps it as registered on
  its ``model_*`` gauges: its series are forwarded under one model, the registered spelling.
- The ``queueing`` verdict fires on a served trtllm-serve text whose requests wait (its queue
  time histogram against its request latency histogram), and on the 2026 vLLM capture's shape
  whose requests wait; a vLLM queue of milliseconds, whose p99 within the first 0.3 s bucket
  is an interpolation, is judged by vLLM's own split of its requests' time (queue, prefill,
  decode) and is no queueing; Dynamo's frontend has no queue time, so it is not judged there;
  llama.cpp's server gives deferred requests but no latency and no queue time, so the verdict
  cannot be judged from its figures:
  ``diagnose`` shows the waiting requests and says the queue is absent, and names no queueing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from tests import engine_texts as texts
from tests.conftest import run_cli
from tests.receivers import Agent, running
from tests.test_engine_metrics import (
    EngineServer,
    Key,
    Mapping,
    expected_series,
    prometheus_quantile,
    run_args,
    served_samples,
)
from tests.waiting import until

E2E, TTFT, ITL, QUEUE = ("engine_request_duration_seconds", "engine_time_to_first_token_seconds",
                         "engine_inter_token_latency_seconds",
                         "engine_request_queue_duration_seconds")
KV, RUNNING, WAITING, PREEMPTED = ("engine_kv_cache_usage_ratio", "engine_requests_running",
                                   "engine_requests_waiting", "engine_preemptions_total")
PREFILL, DECODE = ("engine_request_prefill_seconds_total", "engine_request_decode_seconds_total")
PHASES = frozenset({PREFILL, DECODE})  # the request's phases: vLLM V1's and trtllm-serve's
ALL = (E2E, TTFT, ITL, QUEUE, KV, RUNNING, WAITING, PREEMPTED, PREFILL, DECODE)


@dataclass(frozen=True)
class Capture:
    """A served text: how it is made, how its families map to our series (what the engine's
    source says), and our figures it holds none of."""

    name: str
    text: Callable[[], bytes]
    mapping: Mapping
    absent: frozenset[str]


def _vllm(text: Callable[[], bytes], name: str) -> Capture:
    return Capture(name, text, Mapping(
        "vllm", "model_name",
        {KV: ("vllm:kv_cache_usage_perc", max), RUNNING: ("vllm:num_requests_running", sum),
         WAITING: ("vllm:num_requests_waiting", sum),
         PREEMPTED: ("vllm:num_preemptions_total", sum),
         PREFILL: ("vllm:request_prefill_time_seconds_sum", sum),
         DECODE: ("vllm:request_decode_time_seconds_sum", sum)},
        {E2E: ("vllm:e2e_request_latency_seconds", 1.0),
         TTFT: ("vllm:time_to_first_token_seconds", 1.0),
         ITL: ("vllm:inter_token_latency_seconds", 1.0),  # V1's, preferred over V0's
         QUEUE: ("vllm:request_queue_time_seconds", 1.0)}), frozenset())


def _sglang(text: Callable[[], bytes], name: str) -> Capture:
    # sglang:num_retracted_reqs (a gauge of the last batch) is in both: never the preemptions
    return Capture(name, text, Mapping(
        "sglang", "model_name",
        {KV: ("sglang:token_usage", max), RUNNING: ("sglang:num_running_reqs", sum),
         WAITING: ("sglang:num_queue_reqs", sum)},
        {E2E: ("sglang:e2e_request_latency_seconds", 1.0),
         TTFT: ("sglang:time_to_first_token_seconds", 1.0),
         ITL: ("sglang:inter_token_latency_seconds", 1.0),
         QUEUE: ("sglang:queue_time_seconds", 1.0)}), frozenset({PREEMPTED}) | PHASES)


def _llamacpp(text: Callable[[], bytes], name: str) -> Capture:
    return Capture(name, text, Mapping(
        "llamacpp", None,
        {RUNNING: ("llamacpp:requests_processing", sum),
         WAITING: ("llamacpp:requests_deferred", sum)}, {}),
        frozenset(ALL) - {RUNNING, WAITING})


def _dynamo(text: Callable[[], bytes], name: str) -> Capture:
    return Capture(name, text, Mapping(
        "dynamo", "model", {WAITING: ("dynamo_frontend_queued_requests", sum)},
        {E2E: ("dynamo_frontend_request_duration_seconds", 1.0),
         TTFT: ("dynamo_frontend_time_to_first_token_seconds", 1.0),
         ITL: ("dynamo_frontend_inter_token_latency_seconds", 1.0)},
        spellings=("dynamo_frontend_model_context_length",)),
        frozenset({QUEUE, KV, RUNNING, PREEMPTED}) | PHASES)


VLLM_2026 = "vllm_v1_metrics_kops_conformance_qwen05b_idle.prom"
DYNAMO = "dynamo_frontend_metrics_example_qwen3_06b.prom"

TGI = Mapping("tgi", None, {RUNNING: ("tgi_batch_current_size", sum),
                            WAITING: ("tgi_queue_size", sum)},
              {ITL: ("tgi_request_mean_time_per_token_duration", 1.0)})
# the excerpt cut tgi_request_duration and tgi_request_queue_duration (its editor's note)
TGI_ABSENT = frozenset({E2E, QUEUE, TTFT, KV, PREEMPTED}) | PHASES

CAPTURES = (
    _vllm(lambda: texts.capture("vllm_metrics_datadog_fixture_mixed_v0_v1.prom"), "vllm"),
    _vllm(lambda: texts.capture(VLLM_2026), "vllm-2026"),
    _dynamo(lambda: texts.capture(DYNAMO), "dynamo-frontend"),
    _sglang(lambda: texts.capture("sglang_metrics_datadog_fixture_v0.5.10.prom"), "sglang"),
    Capture("tgi", lambda: texts.capture("tgi_metrics_datadog_fixture_excerpt.prom"), TGI,
            TGI_ABSENT),
    Capture("tgi-1000-buckets", texts.tgi_with_batch_next_size, TGI, TGI_ABSENT),
    Capture("triton", lambda: texts.capture("triton_metrics_datadog_fixture.prom"), Mapping(
        "triton", "model", {WAITING: ("nv_inference_pending_request_count", sum)}, {},
        {E2E: ("nv_inference_request_duration_us", "nv_inference_request_success"),
         QUEUE: ("nv_inference_queue_duration_us", "nv_inference_request_success")}),
        frozenset({TTFT, ITL, KV, RUNNING, PREEMPTED}) | PHASES),
    _llamacpp(lambda: texts.capture("llamacpp_metrics_current_build_sample.prom"), "llamacpp"),
    Capture("trtllm-serve-built-from-names", texts.trtllm_serve, Mapping(
        "trtllm", "model_name",
        {KV: ("trtllm_kv_cache_utilization", max), RUNNING: ("trtllm_num_requests_running", sum),
         WAITING: ("trtllm_num_requests_waiting", sum),
         PREFILL: ("trtllm_request_prefill_time_seconds_sum", sum),
         DECODE: ("trtllm_request_decode_time_seconds_sum", sum)},
        {E2E: ("trtllm_e2e_request_latency_seconds", 1.0),
         TTFT: ("trtllm_time_to_first_token_seconds", 1.0),
         ITL: ("trtllm_time_per_output_token_seconds", 1.0),
         QUEUE: ("trtllm_request_queue_time_seconds", 1.0)}), frozenset({PREEMPTED})),
    _llamacpp(lambda: texts.text_from_names(texts.inventory("llamacpp-metrics.txt")),
              "llamacpp-llmkube-built-from-names"),
    _vllm(lambda: texts.text_from_names(texts.inventory("vllm-metrics.txt"),
                                        labels={"model_name": "m"}),
          "vllm-llmkube-built-from-names"),
    _sglang(lambda: texts.text_from_names(texts.inventory("sglang-metrics.txt"),
                                          labels={"model_name": "m"}),
            "sglang-llmkube-built-from-names"),
)


@dataclass
class Read:
    agent: Agent
    servers: dict[str, EngineServer]
    bodies: dict[str, bytes]

    def cycles(self, name: str) -> dict[int, dict[Key, float]]:
        """The engine_* series the agent printed for one capture's endpoint, per cycle."""
        endpoint = self.servers[name].endpoint
        out: dict[int, dict[Key, float]] = {}
        for series, labels, ts, value in self.agent.sampled():
            if series.startswith("engine_") and dict(labels).get("endpoint") == endpoint:
                out.setdefault(ts, {})[(series, labels)] = value
        return out


@pytest.fixture(scope="module")
def read(tmp_path_factory) -> Iterator[Read]:
    """One agent reading every capture's endpoint at once until each gave three cycles."""
    tmp = tmp_path_factory.mktemp("captures")
    bodies = {c.name: c.text() for c in CAPTURES}
    servers = {name: EngineServer(body) for name, body in bodies.items()}
    agent = Agent([])
    with running(*servers.values(), agent):
        for s in servers.values():
            s.start()
        urls = [a for s in servers.values() for a in ("--engine-metrics-url", s.url)]
        agent.args = run_args(tmp / "spool", *urls)
        agent.start()
        got = Read(agent, servers, bodies)

        def every_capture_thrice() -> bool:
            assert agent.proc is not None and agent.proc.poll() is None, "".join(agent.err)
            return all(len(got.cycles(c.name)) >= 3 for c in CAPTURES)

        until(every_capture_thrice, 60,
              what=lambda: "three cycles of every capture\n" + "".join(agent.err)[-3000:])
        assert agent.stop() == 0, "".join(agent.err)[-3000:]
        yield got


@pytest.mark.slow
@pytest.mark.parametrize("capture", CAPTURES, ids=[c.name for c in CAPTURES])
def test_the_forwarded_engine_figures_are_the_captures_values(read, capture):
    expected = expected_series(capture.mapping, read.bodies[capture.name],
                               read.servers[capture.name].endpoint)
    assert expected, "the text maps to no series at all"
    cycles = read.cycles(capture.name)
    for ts, got in sorted(cycles.items()):
        assert set(got) == set(expected), (
            f"{capture.name} at {ts}: missing {sorted(set(expected) - set(got))[:5]}, "
            f"unexpected {sorted(set(got) - set(expected))[:5]}")
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-12, abs=0), (capture.name, key)
    names = {series.removesuffix(part) for series, _ in expected
             for part in ("_bucket", "_sum", "_count") if series.endswith(part)} | \
            {series for series, _ in expected if not series.endswith(("_bucket", "_sum",
                                                                       "_count"))}
    assert names == set(ALL) - capture.absent


@pytest.mark.parametrize("capture", CAPTURES, ids=[c.name for c in CAPTURES])
def test_each_capture_is_found_once_and_what_it_lacks_is_said_absent_with_why(read, capture):
    endpoint = read.servers[capture.name].endpoint
    found = [e for e in read.agent.logged("engine_metrics_found") if e["endpoint"] == endpoint]
    assert len(found) == 1, found
    assert found[0]["engine"] == capture.mapping.engine
    assert set(found[0]["figures"]) == set(ALL) - capture.absent
    assert set(found[0]["not_exposed"]) == capture.absent
    assert all(why for why in found[0]["not_exposed"].values())
    assert read.agent.last("gpu_sidecar_engine_up", endpoint=endpoint) == 1
    if capture.mapping.engine == "llamacpp":
        assert "removed upstream" in found[0]["not_exposed"][KV]
        assert "no queue time" in found[0]["not_exposed"][QUEUE]
    if capture.mapping.engine == "sglang":  # the counter only appears at the first retraction
        assert "sglang:num_retracted_requests" in found[0]["not_exposed"][PREEMPTED]
    if capture.mapping.engine == "dynamo":
        assert "no queue-time histogram" in found[0]["not_exposed"][QUEUE]
        assert "inflight_requests" in found[0]["not_exposed"][RUNNING]


def test_dynamos_series_join_by_model_under_the_spelling_it_registered(read):
    """The capture's request series say ``qwen/qwen3-0.6b``, its model gauges
    ``Qwen/Qwen3-0.6B``: every forwarded series names the model once, as registered."""
    body = read.bodies["dynamo-frontend"]
    assert b'model="qwen/qwen3-0.6b"' in body and b'model="Qwen/Qwen3-0.6B"' in body
    for got in read.cycles("dynamo-frontend").values():
        assert {dict(labels).get("model") for _, labels in got} == {"Qwen/Qwen3-0.6B"}


def test_the_2026_vllm_capture_is_read_with_its_engine_label_and_created_samples(read):
    """``engine="0"`` on every series and a ``*_created`` sample beside every counter and
    histogram: the series forwarded are the figures', one per model, none of them a
    ``_created``."""
    body = read.bodies["vllm-2026"]
    assert b'engine="0"' in body and b"vllm:e2e_request_latency_seconds_created{" in body
    for got in read.cycles("vllm-2026").values():
        assert not any(series.endswith("_created") for series, _ in got)
        assert {dict(labels)["model"] for _, labels in got} == {"Qwen/Qwen2.5-0.5B-Instruct"}
        assert {dict(labels)["engine"] for _, labels in got} == {"vllm"}


def test_tgis_thousand_bucket_histogram_forwards_nothing(read):
    """``tgi_batch_next_size`` with a bucket per integer batch size up to 1,000 adds no series:
    each cycle forwards as many as the excerpt without it, a few dozen."""
    excerpt = {len(c) for c in read.cycles("tgi").values()}
    full = {len(c) for c in read.cycles("tgi-1000-buckets").values()}
    assert full == excerpt and max(full) < 60, (excerpt, full)
    assert b'tgi_batch_next_size_bucket{le="1000"}' in read.bodies["tgi-1000-buckets"]


# -- the queueing verdict ------------------------------------------------------------------------


def _diagnose(body: bytes) -> tuple[int, str]:
    engine = EngineServer(body).start()
    with running(engine):
        proc = run_cli("diagnose", "--simulate", "healthy", "--no-simulated-app",
                       "--gpus", "visible", "--engine-metrics-url", engine.url,
                       "--duration", "3", "--interval", "0.5")
        assert engine.requests, "the engine endpoint was never read"
    return proc.returncode, proc.stdout + proc.stderr


def _verdicts(out: str) -> set[str]:
    return set(re.findall(r"^  verdict: (\S+)", out, re.M))


def test_queueing_fires_on_a_trtllm_serve_text_whose_requests_wait():
    """Requests waiting (40) with a p99 of ~30 s of which the queue holds more than half: the
    GPU beside it is healthy, the verdict is queueing, judged on trtllm-serve's histograms."""
    code, out = _diagnose(texts.trtllm_serve(waiting=40, e2e=(12.0, 30.0), queue=(9.0, 25.0)))
    assert code == 1, out
    assert _verdicts(out) == {"queueing"}, out
    assert "engine:  trtllm:" in out and "waiting 40.0" in out, out


def test_a_trtllm_serve_text_with_a_short_queue_is_no_queueing():
    code, out = _diagnose(texts.trtllm_serve(waiting=2, e2e=(2.0, 9.0), queue=(0.05, 0.4)))
    assert code == 0, out
    assert _verdicts(out) == {"none"}, out


def test_llama_cpp_gives_deferred_requests_but_no_queue_time_so_queueing_is_not_judged():
    """All 4 slots busy and 46 requests deferred (the capture's gauges set so): the waiting
    requests are shown, the queue and the request latency are absent (llama.cpp has neither),
    and no queueing verdict is invented from the count alone."""
    code, out = _diagnose(texts.llamacpp_capture(processing=4, deferred=46))
    assert "engine:  llamacpp:" in out and "running 4.0, waiting 46.0" in out, out
    assert "queue absent" in out and "KV cache absent" in out, out
    assert "queueing" not in _verdicts(out), out
    assert code == 0, out


def _p99(body: bytes, family: str) -> float:
    buckets = sorted((float(labels["le"]), value)
                     for labels, value in served_samples(body)[f"{family}_bucket"])
    return prometheus_quantile(0.99, buckets)


def test_queueing_fires_on_the_2026_vllm_capture_whose_requests_wait():
    """The 2026 capture's families with requests that wait ~9 s (p99 ~25 s) before a prefill
    of ~50 ms and a decode of ~2 s: the GPU beside it is healthy, the verdict is queueing."""
    body = texts.vllm_2026(queue=(9.0, 25.0), prefill=(0.05, 0.3), decode=(2.0, 6.0),
                           waiting=40)
    code, out = _diagnose(body)
    assert code == 1, out
    assert _verdicts(out) == {"queueing"}, out
    assert "engine:  vllm:" in out and "waiting 40.0" in out, out


def test_a_queue_within_vllms_first_bucket_is_judged_by_its_phases_not_its_p99():
    """Requests queue ~4 ms, prefill ~20 ms and decode ~300 ms (p99 ~0.5 s, above the 0.25 s
    objective). vLLM's queue buckets start at 0.3 s, so the queue's p99 interpolates to 0.297 s,
    60 % of the request p99: the p99s alone would say queueing. The engine's own split of its
    requests' time (queue, prefill, decode) says the queue holds about 1 %: no queueing."""
    body = texts.vllm_2026(queue=(0.004, 0.02), prefill=(0.02, 0.08), decode=(0.3, 0.45),
                           waiting=0)
    queue_p99 = _p99(body, "vllm:request_queue_time_seconds")
    e2e_p99 = _p99(body, "vllm:e2e_request_latency_seconds")
    assert queue_p99 < 0.3, queue_p99  # within the first bucket: an interpolation
    assert queue_p99 / e2e_p99 >= 0.5 and e2e_p99 > 0.25, (queue_p99, e2e_p99)
    code, out = _diagnose(body)
    assert "queueing" not in _verdicts(out), out
    assert code == 0, out


def test_dynamos_frontend_has_no_queue_time_so_queueing_is_not_judged_from_it():
    """Dynamo's frontend with 40 requests queued and a request p99 of ~30 s: the waiting
    requests and the latency are shown, the queue time is absent (the frontend has none; its
    workers' engines do), and no queueing verdict is invented from the count alone."""
    _, out = _diagnose(texts.dynamo_frontend(e2e=(12.0, 30.0), queued=40, inflight=60))
    assert "engine:  dynamo:" in out and "waiting 40.0" in out, out
    assert "queue absent" in out, out
    assert "queueing" not in _verdicts(out), out
