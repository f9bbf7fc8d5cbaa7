"""An engine endpoint that answers hostile texts never hurts the pod, and a figure is right or
absent (issue #32, items 5 and 6), seen from outside: ``gpu-sidecar run`` reading a real HTTP
server on 127.0.0.1 (``test_engine_metrics.EngineServer``) that answers a valid vLLM text, then
a hostile answer, then the valid text again.

- Each hostile answer (a gzip body of 2 MB inflating to 2 GiB, 4 MiB of random bytes, 4 MiB of
  ``ab\\n``, 4 MiB of ``\\xff\\n``) is refused under its reason, counted there only, logged once,
  while ``gpu_sidecar_engine_up`` is 0 and no engine figure is exported; the valid figures before
  and after it are exported with the served values; the agent's peak memory (VmHWM) stays within
  a bound that the unbounded reader broke by 190 MiB.
- A series given twice in one text (a histogram's, a gauge's or a counter's lines repeated, as
  a misbehaving exporter does, or two scrapes joined, as a proxy does) refuses the whole text as
  ``malformed``, naming the series, logged once: the figure is absent, never the sum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from sidecar.sources.engine import parse
from tests import engine_texts as texts
from tests.receivers import Agent, running
from tests.test_engine_metrics import REASONS, EngineServer, memory, run_args
from tests.waiting import until

VALID = texts.vllm_current()  # one text, served before and after every hostile answer
RUNNING = 24 + 19  # its requests running, summed over its two engine cores
PREEMPTIONS = 17 + 4
REQUESTS = 3223 + 2871  # its e2e latency histogram's count, summed over the cores
# the answer is read up to --engine-metrics-max-bytes (4 MiB) and held twice while it is read
# (its chunks and their join): 8 MiB, and room for the allocator; the reader that decoded the
# whole text and split it into lines grew 190 MiB on 4 MiB of "\xff\n"
MEMORY_BOUND = 16 << 20


@dataclass(frozen=True)
class Answer:
    what: str
    make: Callable[[], tuple[bytes, dict[str, str]]]  # the body and its headers
    reason: str  # the failure counted
    said: str  # a part of the detail logged


HOSTILE = (
    Answer("a gzip answer of 2 MB inflating to 2 GiB",
           lambda: (texts.gzip_bomb(), {"Content-Encoding": "gzip"}), "too_large",
           "inflates beyond 4194304 bytes"),
    Answer("4 MiB of random bytes", lambda: (texts.random_bytes(), {}), "malformed",
           "is not a sample of the text format"),
    Answer("4 MiB of 'ab\\n'", lambda: (texts.repeated_line(b"ab\n"), {}), "malformed",
           "line 1 is not a sample of the text format"),
    Answer("4 MiB of '\\xff\\n'", lambda: (texts.repeated_line(b"\xff\n"), {}), "malformed",
           "line 1 is not a sample of the text format"),
)

DUPLICATED = (
    Answer("a histogram's lines given twice",
           lambda: (texts.with_family_repeated(VALID, "vllm:e2e_request_latency_seconds"), {}),
           "malformed", 'vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3"'),
    Answer("a gauge's lines given twice",
           lambda: (texts.with_family_repeated(VALID, "vllm:num_requests_running"), {}),
           "malformed", "vllm:num_requests_running{engine=\"0\""),
    Answer("a counter's lines given twice",
           lambda: (texts.with_family_repeated(VALID, "vllm:num_preemptions"), {}),
           "malformed", "vllm:num_preemptions_total{engine=\"0\""),
    Answer("two scrapes joined", lambda: (VALID + VALID, {}), "malformed", "given twice"),
)


@dataclass
class Read:
    """What an agent did around one answer: the agent (stopped), the failures counted while the
    answer was served, by reason, and its memory before the answer and after it."""

    agent: Agent
    grown: dict[str, float]
    before: dict[str, int]
    after: dict[str, int]


def _around(answer: Answer, tmp_path) -> Read:
    """An agent reading the valid text, then ``answer`` until two reads of it are refused, then
    the valid text again."""
    engine = EngineServer(VALID).start()
    agent = Agent(run_args(tmp_path / "spool", "--engine-metrics-url", engine.url))
    ep = engine.endpoint

    def up() -> float | None:
        return agent.last("gpu_sidecar_engine_up", endpoint=ep)

    def counted() -> dict[str, float]:
        return {r: agent.last("gpu_sidecar_engine_read_failures_total", endpoint=ep,
                              reason=r) or 0.0 for r in REASONS}

    def log() -> str:
        return "".join(agent.err)[-3000:]

    body, headers = answer.make()
    with running(engine, agent):
        agent.start()
        until(lambda: up() == 1 and agent.last("engine_requests_running") == RUNNING, 60,
              what=lambda: "the valid text read\n" + log())
        agent.more_cycles(2, "with the valid text")
        before = memory(agent.proc.pid)
        engine.answer = (body, headers)
        until(lambda: counted()[answer.reason] >= 2 and up() == 0, 60,
              what=lambda: f"two reads of {answer.what} refused ({counted()})\n" + log())
        engine.answer = None
        until(lambda: up() == 1 and agent.logged("engine_metrics_recovered"), 60,
              what=lambda: f"the valid text read again after {answer.what}\n" + log())
        agent.more_cycles(1, "after the answer")
        after = memory(agent.proc.pid)
        grown = {r: v for r, v in counted().items() if v}
        assert agent.stop() == 0, log()
    return Read(agent, grown, before, after)


def _said_once(read: Read, answer: Answer) -> None:
    """Counted under its reason only, logged once when it started (with what was wrong) and
    once when it ended, no bug of the reader."""
    assert set(read.grown) == {answer.reason}, read.grown
    failing = read.agent.logged("engine_metrics_failing")
    assert len(failing) == 1 and failing[0]["reason"] == answer.reason, failing
    assert answer.said in failing[0]["detail"], failing[0]["detail"]
    assert len(read.agent.logged("engine_metrics_recovered")) == 1
    assert not read.agent.logged("engine_metrics_bug")


def _figures_right_or_absent(agent: Agent) -> None:
    """In every cycle, the engine's figures are the valid text's where the engine is up, and
    absent where it is not: never another value."""
    rows = agent.sampled()
    down = {ts for n, _, ts, v in rows if n == "gpu_sidecar_engine_up" and v == 0}
    upt = {ts for n, _, ts, v in rows if n == "gpu_sidecar_engine_up" and v == 1}
    assert down and upt
    assert not [n for n, _, ts, _ in rows if n.startswith("engine_") and ts in down]
    for name, served in (("engine_requests_running", RUNNING),
                         ("engine_preemptions_total", PREEMPTIONS),
                         ("engine_request_duration_seconds_count", REQUESTS)):
        exported = {ts: v for n, _, ts, v in rows if n == name}
        assert set(exported) == upt, f"{name} is missing from a cycle where the engine is up"
        assert set(exported.values()) == {served}, (name, set(exported.values()))


@pytest.mark.parametrize("answer", [pytest.param(a, id=a.what) for a in HOSTILE])
def test_each_hostile_answer_is_refused_within_the_memory_bound_and_the_figures_around_it_kept(
        tmp_path, answer):
    read = _around(answer, tmp_path)
    _said_once(read, answer)
    _figures_right_or_absent(read.agent)
    peak = read.after["VmHWM"] - read.before["VmHWM"]
    assert peak < MEMORY_BOUND, f"the peak memory grew {peak / 2**20:.1f} MiB"


@pytest.mark.parametrize("answer", [pytest.param(a, id=a.what) for a in DUPLICATED])
def test_a_series_given_twice_makes_the_text_malformed_and_its_figures_absent_never_summed(
        tmp_path, answer):
    read = _around(answer, tmp_path)
    _said_once(read, answer)
    assert "given twice" in read.agent.logged("engine_metrics_failing")[0]["detail"]
    _figures_right_or_absent(read.agent)


# -- the issue's own text, parsed: buckets 1/4/10 and sum 5, never 2/8/20 and 10 ----------------

HISTOGRAM = """\
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.5",model_name="m"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="m"} 4.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 10.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 10.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 5.0
"""


def _figures(text: str) -> parse.EngineFigures | None:
    return parse.figures_of(parse.decoded(text.encode()))[0]


def test_the_histogram_the_issue_quotes_is_read_as_served_once_and_refused_twice():
    once = _figures(HISTOGRAM)
    assert once is not None
    hist = once.figures["engine_request_duration_seconds"]["m"]
    assert (hist.counts, hist.sum_seconds) == ((1.0, 4.0, 10.0), 5.0)

    with pytest.raises(parse.Malformed, match=r"e2e_request_latency_seconds_bucket\{engine=\"0\","
                                              r"le=\"0.5\",model_name=\"m\"\} is given twice"):
        _figures(HISTOGRAM + HISTOGRAM.split("\n", 2)[2])  # its samples again, as one family


def test_models_cut_to_the_same_name_are_one_series_given_twice():
    """Two model names that differ only beyond ``MAX_MODEL_CHARS`` would be forwarded as one
    series: their figures cannot be told apart, so the text is refused, not summed."""
    a, b = "m" * parse.MAX_MODEL_CHARS + "-a", "m" * parse.MAX_MODEL_CHARS + "-b"
    text = "".join(f'vllm:num_requests_running{{engine="0",model_name="{m}"}} 3.0\n'
                   for m in (a, b))
    with pytest.raises(parse.Malformed, match="given twice"):
        _figures(text)
    assert _figures(text.replace(b, "other"))  # two models: read
