"""``gpu-sidecar diagnose``: the seed's question ("utilization 98 %, why is p99 up?") as a command.

It samples with the agent itself (NVML or the simulated node, and the app socket, built by
``sidecar.wiring``) for a window, reads each cycle back from the series a sink would get, and
judges every GPU with ``sidecar.views.verdict`` on the thresholds of the shipped alert rules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import textwrap
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import structlog

from sidecar import thresholds
from sidecar.thresholds import Thresholds
from sidecar.views.verdict import (
    Summary,
    Verdict,
    celsius,
    figures_of,
    gbps,
    ghz,
    gib,
    judge,
    link,
    ms,
    pct,
    ratio_of,
    reasons,
    watts,
)

if TYPE_CHECKING:
    from sidecar.agent import Agent
    from sidecar.config import Config

log = structlog.get_logger("sidecar.diagnose")


def report(verdicts: Mapping[str, Verdict], *, seconds: float, samples: int, label: str,
           t: Thresholds | None = None, held: str = "") -> str:
    """What diagnose prints: a block per GPU, then one line of result."""
    t = t or thresholds.THRESHOLDS
    out = [f"gpu-sidecar diagnose: {len(verdicts)} GPU(s), {samples} samples over "
           f"{seconds:.1f} s{label}",
           *textwrap.wrap(f"NOTE: {held}" if held else "", 100, subsequent_indent="  "),
           *textwrap.wrap(
               f"thresholds (sidecar/thresholds.py, as in the shipped alert rules): PCIe above "
               f"{t.pcie_util_ratio:.0%} of the link; fragmentation above "
               f"{t.fragmentation_ratio:.0%} of a cache over "
               f"{gib(t.fragmentation_min_reserved_bytes)}; any allocator retry or OOM; SM "
               f"occupancy below {t.occupancy_ratio:.0%} with p99 above {ms(t.p99_latency_s)}; "
               f"a critical Xid ({', '.join(map(str, t.critical_xids))}), an uncorrected ECC "
               f"error or a failed row remap; a clock limit for over {t.throttle_ratio:.0%} of "
               f"the window with the SM clock below {t.throttle_clock_ratio:.0%} of its maximum "
               f"and utilization above {t.busy_utilization_ratio:.0%}; a PCIe link below its "
               f"maximum carrying over {t.pcie_degraded_traffic_ratio:.0%} of the link as "
               f"trained; NVLink-C2C above {t.pcie_util_ratio:.0%} of its maximum; an engine's KV "
               f"cache at {t.kv_cache_full_ratio:.0%} with preemptions or waiting requests; an "
               f"engine's queue time at {t.queue_share_ratio:.0%} of p99 above "
               f"{ms(t.p99_latency_s)}",
               100, subsequent_indent="  ")]
    for uuid, v in verdicts.items():
        out += ["", *_block(uuid, v)]
    bad = [f"GPU {v.window.mean.index} {v.key}" for v in verdicts.values() if v.findings]
    out += ["", f"result: a bottleneck on {len(bad)} of {len(verdicts)} GPU(s): {', '.join(bad)}"
            if bad else f"result: nothing found on {len(verdicts)} GPU(s)"]
    return "\n".join(out) + "\n"


def _block(uuid: str, v: Verdict) -> list[str]:
    w, m = v.window, v.window.mean
    head = f"GPU {m.index}  {m.name}  {uuid}"
    if v.findings:
        verdict = f"  verdict: {v.key} ({v.findings[0].layer}: {v.findings[0].title})"
    else:
        verdict = "  verdict: none" + ("" if v.compute_judged else " (compute not judged)")
    lines = [head, verdict]
    if w.samples:
        since = " since the app started" if w.latency_since_start else " in the window"
        lines += [
            f"  compute: utilization {pct(m.utilization)}, SM occupancy {pct(m.occupancy)}, "
            f"tensor {pct(m.tensor)}, SM active {pct(m.sm_active)}",
            f"  memory:  device {gib(m.mem_used)} of {gib(m.mem_total)}, DRAM bandwidth "
            f"{pct(m.dram_bw)}, fragmentation {pct(m.fragmentation)}"
            + ("" if m.alloc_reserved is None else f" of {gib(m.alloc_reserved)}")
            + f", retries {_count(w.retries)}, OOMs {_count(w.ooms)}",
            f"  IO:      PCIe RX {pct(m.pcie_rx_ratio)} ({gbps(m.pcie_rx)}), TX "
            f"{pct(m.pcie_tx_ratio)} ({gbps(m.pcie_tx)}) of {gbps(m.link_max)}"
            + _link(v) + f"; NVLink TX {gbps(m.nvlink_tx)}, RX {gbps(m.nvlink_rx)}"
            + ("" if m.c2c_max is None and m.c2c_rx is None and m.c2c_tx is None else
               f"; C2C RX {pct(m.c2c_rx_ratio)} ({gbps(m.c2c_rx)}), TX {pct(m.c2c_tx_ratio)} "
               f"({gbps(m.c2c_tx)}) of {gbps(m.c2c_max)}"),
            *_health(v),
            (f"  app:     p50 {ms(w.p50)}, p99 {ms(w.p99)} over {w.requests:.0f} requests{since}"
             + (" (the engine's latency: the app publishes none)"
                if m.latency_source == "engine" else ""))
            if w.p99 is not None else "  app:     no request latency",
            *_engine(v),
        ]
    for n, f in enumerate(v.findings, 1):
        tag = f"{n}. " if len(v.findings) > 1 else ""
        lines += [*_wrapped("why:", f"{tag}{f.layer}: {f.evidence}"), *_wrapped("do:", f.remedy)]
    for note in v.notes:
        lines += _wrapped("note:", note)
    return lines


def _engine(v: Verdict) -> list[str]:
    """The serving engine's figures (--engine-metrics-url), where there is one."""
    w, m = v.window, v.window.mean
    if not m.engine:
        return []
    return _wrapped("engine:", (
        f"{m.engine}: KV cache {pct(m.kv_usage)}, requests running {_num(m.running)}, waiting "
        f"{_num(m.waiting)}, preemptions {_count(w.increases.get('preemptions'))}; p99 request "
        f"{ms(w.engine_p99)}, queue {ms(w.queue_p99)}, time to first token {ms(w.ttft_p99)}, "
        f"inter-token {ms(w.itl_p99)}"))


def _num(value: float | None) -> str:
    return "absent" if value is None else f"{value:.1f}"


def _link(v: Verdict) -> str:
    """The link's maximum, and as trained when it ran below it (the trained state of those
    samples, not a mean of generations)."""
    w, m = v.window, v.window.mean
    if m.link_gen is None and m.link_width is None:
        return ""
    out = f" ({link(m.link_gen, m.link_width)})"
    b = w.below_max
    if b is not None:
        out += (f", trained at {link(b.link_gen_now, b.link_width_now)} in "
                f"{w.below_max_samples} of {w.link_samples} samples: RX "
                f"{pct(b.pcie_rx_now_ratio)}, TX {pct(b.pcie_tx_now_ratio)} of it")
    return out


def _health(v: Verdict) -> list[str]:
    """The health line (clocks, what limited them, power, heat, memory errors, Xids), wrapped;
    none on a GPU that gives no health figure."""
    w, m = v.window, v.window.mean
    if all(x is None for x in (m.sm_clock, m.power, m.temperature, m.ecc_uncorrected,
                               m.remap_pending, m.xids)) and not reasons(m):
        return []
    limited = ", ".join(f"{name.replace('_', ' ')} {pct(share)}" for name, share in reasons(m)
                        if share > 0) or "nothing"
    if m.sync_boost:
        limited += f" (sync boost {pct(m.sync_boost)})"
    ecc = w.increases.get("ecc_uncorrected")
    xids = ", ".join(f"{code} x{n:.0f}" for code, n in sorted(w.xids.items()) if n > 0) or "none"
    text = (f"SM clock {ghz(m.sm_clock)} of {ghz(m.sm_clock_max)} "
            f"({pct(ratio_of(m.sm_clock, m.sm_clock_max))}), limited by {limited}; power "
            f"{watts(m.power)} of {watts(m.power_limit)}; GPU {celsius(m.temperature)}, HBM "
            f"{celsius(m.mem_temperature)}; uncorrected ECC "
            + ("absent" if ecc is None else f"+{ecc:.0f}")
            + f", remap pending {_flag(m.remap_pending)}, failed {_flag(m.remap_failed)}; "
            f"Xids in the window: {xids}")
    return textwrap.wrap(text, 100, initial_indent="  health:  ", subsequent_indent=" " * 11,
                         break_on_hyphens=False)


def _flag(value: float | None) -> str:
    return "absent" if value is None else ("yes" if value > 0 else "no")


def _wrapped(tag: str, text: str) -> list[str]:
    """Prose lines wrapped for a terminal, continued under the text."""
    return textwrap.wrap(text, 100, initial_indent=f"  {tag:<9}", subsequent_indent=" " * 11,
                         break_on_hyphens=False)


def _count(value: float | None) -> str:
    return "absent" if value is None else f"+{value:.0f}"


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

    with wiring.simulated_paths(cfg) as cfg, contextlib.ExitStack() as stack:
        held = ""
        try:
            source, scenario, state = stack.enter_context(wiring.sampling(cfg))
        except SocketInUse as exc:
            # beside a running agent, which holds the socket: no app can announce its GPUs to
            # this process, so judge every visible GPU's NVML layers (as --gpus visible would)
            held = HELD.format(socket=cfg.socket)
            if cfg.gpus == "announced" and not cfg.no_nvml:
                cfg = dataclasses.replace(cfg, gpus="visible")
                held += "; judging every visible GPU (--gpus visible)"
            log.warning("app_socket_in_use", error=str(exc),
                        effect="app figures (fragmentation, retries, latency) are not judged")
            source, scenario, state = stack.enter_context(wiring.sampling(cfg, listen=False))
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
    sys.stdout.write(report(verdicts, seconds=seconds, samples=summary.cycles, label=label, t=t,
                            held=held))
    if interrupted:
        return code_interrupted
    return 1 if any(v.findings for v in verdicts.values()) else 0
