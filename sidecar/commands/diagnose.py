"""``gpu-sidecar diagnose``: the seed's question ("utilization 98 %, why is p99 up?") as a command.

Beside a running agent it asks the agent for its recent window (``sidecar.window_socket``):
every layer at once, app and engine included, no second NVML session, no wait. With ``--fresh``
or no agent beside, it samples with the agent's own parts (NVML or the simulated node, and the
app socket, built by ``sidecar.wiring``) for ``--duration`` seconds, reads each cycle back from
the series a sink would get, and judges the same way: ``sidecar.views.verdict`` on the
thresholds of the shipped alert rules, printed by ``sidecar.views.report``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import time
from typing import TYPE_CHECKING

import structlog

from sidecar.judge.series import figures_of
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
    into running aggregates as they come (no cycle is kept), and the seconds the window lasted."""
    from sidecar.agent import PRIME_WINDOW_S

    agent.prime()
    stop.wait(PRIME_WINDOW_S)
    start = time.monotonic()
    end = start + duration_s
    summary = Summary()
    while True:
        summary.add(figures_of(agent.cycle()))
        left = end - time.monotonic()
        if left <= 0 or stop.wait(min(interval_s, left)):
            break
    return summary, time.monotonic() - start


HELD = ("the app socket {socket} is held by a running agent: the app layer (allocator, "
        "fragmentation, request latency) is NOT judged here, only what NVML gives")


def diagnose(cfg: Config, *, t: Thresholds | None = None) -> int:
    """The command: 0 nothing found, 1 a bottleneck (or a lost GPU), 2 no GPU to judge, 128 +
    the signal (130 SIGINT, 143 SIGTERM) when interrupted before the window ended, after the
    partial report; NVML missing raises NvmlUnavailable (exit 3 in the command line)."""
    from sidecar import signals, wiring
    from sidecar.agent import Agent
    from sidecar.sources.app_socket import SocketInUse
    from sidecar.window_socket import NoAgent, ask, path_of

    if cfg.query_url:  # after the fact, from long-term storage (issue #34)
        from sidecar.commands.from_store import from_store

        return from_store(cfg, t=t)
    why_fresh = "asked for with --fresh"
    if not cfg.fresh:
        try:
            answer = ask(path_of(cfg.socket), cfg.duration)
        except NoAgent as exc:
            why_fresh = str(exc)
        except (OSError, ValueError) as exc:
            why_fresh = f"the agent beside did not answer ({exc})"
            log.warning("agent_window_unanswered", socket=str(path_of(cfg.socket)),
                        error=str(exc), effect="sampling afresh instead")
        else:
            if "error" in answer or not isinstance(answer.get("report"), str):
                print(f"gpu-sidecar diagnose: the agent refused: {answer.get('error')}",
                      file=sys.stderr)
                return 2
            code = answer.get("code")
            code = code if isinstance(code, int) and not isinstance(code, bool) \
                and code in (0, 1, 2) else 2
            if cfg.output != "json":
                sys.stdout.write(str(answer["report"]))
            elif isinstance(answer.get("document"), dict):
                sys.stdout.write(dumps(answer["document"]))
            elif code == 2:  # no GPU to judge: said, as the text says it, on stderr
                sys.stderr.write(str(answer["report"]))
            else:  # an agent of an older release answers with the text only
                print("gpu-sidecar diagnose: the agent beside is of an older release and answers "
                      "with the text report only: drop --output json, or ask with --fresh",
                      file=sys.stderr)
                return 2
            return code
    with wiring.simulated_paths(cfg) as cfg, contextlib.ExitStack() as stack:
        held = ""
        try:
            source, scenario, state = stack.enter_context(wiring.sampling(cfg, rare_read_s=0))
        except SocketInUse as exc:
            # beside a running agent, which holds the socket: no app can announce its GPUs to
            # this process, so judge every visible GPU's NVML layers (as --gpus visible would)
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
        agent = Agent(cfg, source=source, app=state, sinks=[], mode=mode, engine=engine)
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
