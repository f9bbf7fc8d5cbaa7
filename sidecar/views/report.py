"""The report ``gpu-sidecar diagnose`` prints: a block per GPU with every layer's figures, the
verdict, why and what to do, then one line of result. A pure renderer of ``Verdict``s, whatever
the window came from (sampled afresh, or the running agent's window).
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Mapping

from sidecar import thresholds
from sidecar.judge.rules.health import reasons
from sidecar.judge.verdict import Verdict, threshold_prose
from sidecar.thresholds import Thresholds
from sidecar.units import celsius, gbps, ghz, gib, link, ms, pct, ratio_of, watts
from sidecar.views import links


def report(verdicts: Mapping[str, Verdict], *, seconds: float, samples: int, label: str,
           t: Thresholds | None = None, held: str = "", source: str = "",
           unjudged: str = "") -> str:
    """What diagnose prints: where the window came from, a block per GPU, then one line of
    result; ``unjudged`` names GPUs without a finding that were not judged whole (never
    "nothing found" for them)."""
    t = t or thresholds.THRESHOLDS
    out = [f"gpu-sidecar diagnose: {len(verdicts)} GPU(s), {samples} samples over "
           f"{seconds:.1f} s{label}",
           *textwrap.wrap(f"window: {source}" if source else "", 100, subsequent_indent="  "),
           *textwrap.wrap(f"NOTE: {held}" if held else "", 100, subsequent_indent="  "),
           *textwrap.wrap(
               "thresholds (sidecar/thresholds.py, as in the shipped alert rules): "
               + threshold_prose(t),
               100, subsequent_indent="  ")]
    for uuid, v in verdicts.items():
        out += ["", *_block(uuid, v)]
    # a GPU keyed by more than its UUID (two pods report it: "UUID (pod ...)") says which
    bad = [f"GPU {v.window.mean.index}{shared_of(key, v)} {v.key}"
           for key, v in verdicts.items() if v.findings]
    if bad:
        result = f"a bottleneck on {len(bad)} of {len(verdicts)} GPU(s): {', '.join(bad)}"
    elif unjudged:
        result = f"no finding in the figures read of {len(verdicts)} GPU(s), but {unjudged}"
    else:
        result = f"nothing found on {len(verdicts)} GPU(s)"
    out += ["", f"result: {result}" + (f"; {unjudged}" if bad and unjudged else "")]
    return "\n".join(out) + "\n"


def shared_of(key: str, v: Verdict) -> str:
    """What a key says beyond the GPU's UUID: ' (pod NS/POD, node N)' where two pods report
    the GPU, else nothing."""
    uuid = v.window.mean.uuid
    return key[len(uuid):] if uuid and key != uuid and key.startswith(uuid) else ""


def _block(uuid: str, v: Verdict) -> list[str]:
    w, m = v.window, v.window.mean
    head = f"GPU {m.index}  {m.name}  {uuid}"
    if v.findings:
        verdict = f"  verdict: {v.key} ({v.findings[0].layer}: {v.findings[0].title})"
    else:
        verdict = "  verdict: none" + ("" if v.compute_judged else " (compute not judged)")
    lines = [head, verdict]
    if w.lost and w.samples:
        lines += _wrapped("figures:", f"from the {w.samples} reading(s) before it was lost; "
                          f"{w.unreadable} cycle(s) could not read it since")
    if w.samples:
        since = " since the app started" if w.latency_since_start else " in the window"
        lines += [
            f"  compute: utilization {pct(m.utilization)}, SM occupancy {pct(m.occupancy)}, "
            f"tensor {pct(m.tensor)}, SM active {pct(m.sm_active)}",
            f"  memory:  device {gib(m.mem_used)} of {gib(m.mem_total)}, DRAM bandwidth "
            f"{pct(m.dram_bw)}, fragmentation {pct(m.fragmentation)}"
            + ("" if m.alloc_reserved is None else f" of {gib(m.alloc_reserved)}")
            + f", retries {_count(w.retries)}, OOMs {_count(w.ooms)}",
            *_io(v),
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


def _io(v: Verdict) -> list[str]:
    """A line per link: its RX and TX with their shares of its maximum; PCIe (and its link as
    trained) always, every other link of the metric table (``links``) where the GPU has
    it."""
    m = v.window.mean
    lines = ["  IO:      " + _directions("PCIe", (("RX", m.pcie_rx_ratio, m.pcie_rx),
                                                  ("TX", m.pcie_tx_ratio, m.pcie_tx)), m.link_max)
             + _link(v)]
    for lk in links.beside_pcie():
        if lk.present(m):
            lines.append(" " * 11 + _directions(lk.name, (
                (r.direction, getattr(m, r.share), getattr(m, r.figure))
                for r in lk.received_first), getattr(m, lk.maximum_figure)))
    return lines


def _directions(name: str, rates: Iterable[tuple[str, float | None, float | None]],
                top: float | None) -> str:
    """``name RX share (rate), TX share (rate) of maximum``."""
    return (f"{name} " + ", ".join(f"{d} {pct(share)} ({gbps(rate)})" for d, share, rate in rates)
            + f" of {gbps(top)}")


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
