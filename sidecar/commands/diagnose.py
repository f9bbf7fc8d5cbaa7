"""``gpu-sidecar diagnose``: the seed's question ("utilization 98 %, why is p99 up?") as a command.

Beside a running agent it asks the agent for its recent window (``sidecar.window_socket``):
every layer at once, app and engine included, no second NVML session, no wait. With ``--fresh``
or no agent beside, it samples with the agent's own parts (NVML or the simulated node, and the
app socket, built by ``sidecar.wiring``) for ``--duration`` seconds, folded into the agent's own
window as the running agent folds them, and judges the same way: ``sidecar.judge`` on the
thresholds of the shipped alert rules, printed by ``sidecar.views.report``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import threading
import time
from typing import TYPE_CHECKING

import structlog

from sidecar.judge.verdict import judge
from sidecar.judge.window import Summary
from sidecar.thresholds import Thresholds
from sidecar.views.document import document, dumps
from sidecar.views.report import report

if TYPE_CHECKING:
    from sidecar.agent import Agent
    from sidecar.config import Config

log = structlog.get_logger("sidecar.diagnose")


def sample_window(agent: Agent, duration_s: float, interval_s: float,
                  stop: threading.Event) -> tuple[Summary, float]:
    """Cycles of ``agent`` every ``interval_s`` for ``duration_s`` (or until ``stop``), folded
    by the agent into its own window as they come (``sidecar.recent``: no cycle is kept), and
    the seconds the window lasted. The agent must have a window (``recent=``)."""
    from sidecar.agent import PRIME_WINDOW_S

    assert agent.recent is not None
    agent.prime()
    stop.wait(PRIME_WINDOW_S)
    start = time.monotonic()
    end = start + duration_s
    while True:
        agent.cycle()
        left = end - time.monotonic()
        if left <= 0 or stop.wait(min(interval_s, left)):
            break
    summary, _ = agent.recent.summary(math.inf, agent.clock())
    return summary, time.monotonic() - start


HELD = ("the app socket {socket} is held by a running agent: the app layer (allocator, "
        "fragmentation, request latency) is NOT judged here, only what NVML gives")


def diagnose(cfg: Config, *, t: Thresholds | None = None) -> int:
    """The command: 0 nothing found, 1 a bottleneck (or a lost GPU), 2 no GPU to judge, 128 +
    the signal (130 SIGINT, 143 SIGTERM) when interrupted before the window ended, after the
    partial report; NVML missing raises NvmlUnavailable (exit 3 in the command line)."""
    if cfg.query_url:  # after the fact, from long-term storage (issue #34)
        from sidecar.commands.from_store import from_store

        return from_store(cfg, t=t)
    why_fresh = "asked for with --fresh"
    if not cfg.fresh:
        answered, why_fresh = _ask_the_agent(cfg)
        if answered is not None:
            return answered
    return _sample_afresh(cfg, t, why_fresh)


def _ask_the_agent(cfg: Config) -> tuple[int | None, str]:
    """The agent beside's answer, printed, and its exit code; or None and why this command
    samples afresh instead (no agent, or one that did not answer)."""
    from sidecar.window_socket import NoAgent, ask, path_of

    try:
        answer = ask(path_of(cfg.socket), cfg.duration)
    except NoAgent as exc:
        return None, str(exc)
    except (OSError, ValueError) as exc:
        log.warning("agent_window_unanswered", socket=str(path_of(cfg.socket)),
                    error=str(exc), effect="sampling afresh instead")
        return None, f"the agent beside did not answer ({exc})"
    if "error" in answer or not isinstance(answer.get("report"), str):
        print(f"gpu-sidecar diagnose: the agent refused: {answer.get('error')}", file=sys.stderr)
        return 2, ""
    code = answer.get("code")
    code = code if isinstance(code, int) and not isinstance(code, bool) \
        and code in (0, 1, 2) else 2
    doc = answer.get("document")
    if cfg.output != "json":
        sys.stdout.write(str(answer["report"]))
    elif isinstance(doc, dict):
        sys.stdout.write(dumps(doc))
    elif code == 2:  # no GPU to judge: said, as the text says it, on stderr
        sys.stderr.write(str(answer["report"]))
    else:  # an agent of an older release answers with the text only
        print("gpu-sidecar diagnose: the agent beside is of an older release and answers "
              "with the text report only: drop --output json, or ask with --fresh",
              file=sys.stderr)
        return 2, ""
    return code, ""


def _sample(cfg: Config, stack: contextlib.ExitStack) -> tuple[Agent, str, Config]:
    """The agent's parts for this command, and what it cannot judge: beside a running agent,
    which holds the socket, no app can announce its GPUs to this process, so every visible
    GPU's NVML layers are judged (as --gpus visible would)."""
    from sidecar import wiring
    from sidecar.agent import Agent
    from sidecar.recent import BUCKET_S, Recent
    from sidecar.sources.app_socket import SocketInUse

    held = ""
    try:
        source, scenario, state = stack.enter_context(wiring.sampling(cfg, rare_read_s=0))
    except SocketInUse as exc:
        held = HELD.format(socket=cfg.socket)
        if cfg.gpus == "announced" and not cfg.no_nvml:
            cfg = dataclasses.replace(cfg, gpus="visible")
            held += "; judging every visible GPU (--gpus visible)"
        log.warning("app_socket_in_use", error=str(exc),
                    effect="app figures (fragmentation, retries, latency) are not judged")
        source, scenario, state = stack.enter_context(wiring.sampling(cfg, listen=False,
                                                                 rare_read_s=0))
    mode = "simulated" if scenario is not None else ("nvml" if source else "app-only")
    engine = stack.enter_context(wiring.engines(cfg, scenario))
    # the agent's own window, long enough for the whole --duration
    recent = Recent(window_s=cfg.duration + 2 * BUCKET_S)
    agent = Agent(cfg, source=source, app=state, sinks=[], mode=mode, engine=engine,
                  recent=recent)
    return agent, held, cfg


def _sample_afresh(cfg: Config, t: Thresholds | None, why_fresh: str) -> int:
    from sidecar import signals, wiring

    with wiring.simulated_paths(cfg) as cfg, contextlib.ExitStack() as stack:
        agent, held, cfg = _sample(cfg, stack)
        summary, seconds = sample_window(agent, cfg.duration, cfg.interval, signals.STOP)
    interrupted = signals.STOP.is_set()
    code_interrupted = 128 + (signals.received[0] if signals.received else 2)
    windows = summary.windows()
    if not windows:
        why = f" ({held})" if held else ""
        print(f"gpu-sidecar diagnose: no GPU to judge: with --gpus {cfg.gpus} the app announced "
              f"none over {cfg.socket}{why} in {seconds:.0f} s; start sidecar.client in the "
              "model server, or name GPUs with --gpus (UUIDs from `gpu-sidecar probe`, or "
              "'visible')", file=sys.stderr)
        return code_interrupted if interrupted else 2
    order = sorted(windows, key=lambda u: (len(windows[u].mean.index), windows[u].mean.index))
    verdicts = {uuid: judge(windows[uuid], t) for uuid in order}
    label = f"  [SIMULATED: scenario {cfg.simulate}]" if cfg.simulate else ""
    if cfg.no_nvml:
        label += "  [--no-nvml: app layer only]"
    if interrupted:
        label += (f"  PARTIAL: interrupted after {seconds:.1f} of {cfg.duration:.0f} s, judged "
                  "on what was sampled")
    where = f"sampled afresh by this command, from now ({why_fresh})"
    if cfg.output == "json":
        sys.stdout.write(dumps(document(verdicts, seconds=seconds, samples=summary.cycles,
                                        source=where, origin="fresh", t=t, held=held,
                                        partial=interrupted)))
    else:
        sys.stdout.write(report(verdicts, seconds=seconds, samples=summary.cycles, label=label,
                                t=t, held=held, source=where))
    if interrupted:
        return code_interrupted
    return 1 if any(v.findings for v in verdicts.values()) else 0
