"""``gpu-sidecar probe``: a one-shot report of the visible GPUs, what each supports (and why the
rest is absent) and one reading of every layer."""

from __future__ import annotations

import time
from typing import Any

from sidecar import __version__, config, protocol, wiring
from sidecar.agent import PRIME_WINDOW_S
from sidecar.samples import GpuIdentity, ratio
from sidecar.sources.nvml import NvmlReading, NvmlSource, timed
from sidecar.views import links
from sidecar.views.links import Link


def probe(cfg: config.Config) -> int:
    with wiring.nvml(cfg) as (source, scenario):
        if source is None:
            print("NVML disabled (--no-nvml): only app figures would be exported.")
            return 0
        devices = source.devices()
        uuids = [d.uuid for d in devices]
        source.read(uuids)
        time.sleep(PRIME_WINDOW_S)
        before = timed.totals()
        readings = source.read(uuids)
        cycle = timed.since(before)
        sim = f"  [SIMULATED: scenario {cfg.simulate}]" if scenario is not None else ""
        print(f"gpu-sidecar {__version__} probe: NVML driver {source.driver_version}, "
              f"{len(devices)} GPU(s){sim}")
        # one line to check what a DRA claim or NVIDIA_VISIBLE_DEVICES gave this container
        print("this container sees: " + (", ".join(
            f"{d.uuid} ({d.name})" for d in devices) or "no GPU"))
        print(_nvml_cost(source, devices, cycle))
        for identity in devices:
            print()
            print(_probe_block(source, identity, readings.get(identity.uuid)))
        print()
        print("app layer (fragmentation, allocator, latency): published by the model server over "
              f"the app socket at run time ({_socket_at_run_time(cfg)}); probe reads none.")
        if _held(cfg.socket):
            print(f"a running agent holds {cfg.socket}: `gpu-sidecar status --socket "
                  f"{cfg.socket}` says what it receives (processes, rejections by reason), "
                  "pushes and exports")
    return 0


COSTLIEST_SHOWN = 5


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _nvml_cost(source: NvmlSource, devices: list[GpuIdentity],
               cycle: dict[str, timed.CallTime]) -> str:
    """What one cycle's reading of every GPU cost in NVML (the driver's time, which the model
    server waits on): in all, per GPU, and the costliest calls."""
    seconds = sum(c.seconds for c in cycle.values())
    calls = sum(c.calls for c in cycle.values())
    per_gpu = source.last_read_nvml
    gpus = ", ".join(f"GPU {d.index} {_ms(m.seconds)} ({m.calls} calls)" for d in devices
                     if (m := per_gpu.get(d.uuid)) is not None)
    costliest = ", ".join(f"{name} {_ms(c.seconds)} x{c.calls}"
                          for name, c in list(cycle.items())[:COSTLIEST_SHOWN])
    return (f"NVML time in one cycle: {_ms(seconds)} in {calls} calls; per GPU: {gpus or 'none'}"
            f"\n  costliest calls: {costliest or 'none'}")


def _held(path: str) -> bool:
    """Whether an agent listens on the socket (a datagram socket that takes a connect)."""
    import socket

    probe_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        probe_sock.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe_sock.close()


def _socket_at_run_time(cfg: config.Config) -> str:
    """The socket ``run`` and ``diagnose`` would bind: in simulated mode with the default path,
    a private temporary one (simulated_paths), not the default that probe was given."""
    if cfg.simulate and cfg.socket == protocol.DEFAULT_SOCKET_PATH:
        return ("--simulate: a private temporary path, named in the run's 'starting' and "
                "'app_socket_listening' log lines; --socket PATH chooses it")
    return cfg.socket


def _pct(value: float | None) -> str:
    return "absent" if value is None else f"{value * 100:.1f} %"


def _gb(value: float | None, unit: str = "GB/s") -> str:
    return "absent" if value is None else f"{value / 1e9:.2f} {unit}"


def _probe_block(source: NvmlSource, ident: GpuIdentity, reading: NvmlReading | None) -> str:
    caps = source.capabilities(ident.uuid)
    absent = source.absent(ident.uuid)
    lines = [f"GPU {ident.index}  {ident.name}  {ident.uuid}"
             f"  bus {ident.pci_bus_id or '?'}  {ident.architecture}"]
    if ident.parent_uuid:
        lines.append(f"  MIG instance of {ident.parent_uuid}")
    link = (f"PCIe gen {caps['link_generation']} x{caps['link_width']}, "
            f"{_gb(caps['link_max_bytes_per_second'])} per direction"
            if caps["link_max_bytes_per_second"] else "PCIe link unknown")
    lines.append(f"  sources: memory {caps['memory'] or 'none'}, GPM {'yes' if caps['gpm'] else 'no'}"
                 + "".join(_link_source(lk, caps) for lk in links.LINKS)
                 + f", replays from {caps['replay'] or 'none'}")
    lines.append(f"  link: {link}")
    if caps.get("host_link") == "c2c":
        lines.append(f"  host traffic: over NVLink-C2C ({_gb(caps['c2c_link_max_bytes_per_second'])}"
                     " per direction, all links), not PCIe: the IO verdict reads C2C")
    else:
        lines.append("  host traffic: over PCIe")
    reasons = caps.get("clock_event_reasons")
    if caps.get("clock_events") or reasons is not None:
        lines.append(f"  clock-limit reasons from: {caps['clock_events'] or 'none'}"
                     + ("" if reasons is None else f"; the GPU reports {', '.join(reasons) or 'none'}"))
    if caps.get("pcie_note"):
        lines.append(f"  PCIe: {caps['pcie_note']}")
    if absent:
        lines.append("  absent metrics:")
        lines += [f"    {name}: {why}" for name, why in sorted(absent.items())]
    else:
        lines.append("  absent metrics: none")
    if reading is None:
        lines.append("  reading: failed (GPU lost?)")
        return "\n".join(lines)
    c, m, io = reading.compute, reading.memory, reading.io
    lines.append(f"  compute: SM occupancy {_pct(c.sm_occupancy_ratio)}, tensor "
                 f"{_pct(c.tensor_core_util_ratio)}, SM active {_pct(c.sm_active_ratio)}, "
                 f"utilization {_pct(c.utilization_ratio)}")
    used = "absent" if m.used_bytes is None else f"{m.used_bytes / 2**30:.1f} GiB"
    total = "absent" if m.total_bytes is None else f"{m.total_bytes / 2**30:.1f} GiB"
    lines.append(f"  memory:  DRAM bandwidth {_pct(m.bandwidth_util_ratio)}, controller busy "
                 f"{_pct(m.controller_busy_ratio)}, used {used} of {total}")
    rates = [text for lk in links.LINKS if (text := _link_rates(lk, reading))]
    lines.append("  io:      " + ("\n           ".join(rates) or "no link rate read (see the absent "
                                                        "metrics)"))
    replays = io.pcie_replay_errors if io.pcie_replay_errors is not None else "absent"
    now = ""
    if io.pcie_link_current_generation is not None:
        now = (f"; link now gen {io.pcie_link_current_generation} x{io.pcie_link_current_width} "
               f"({_gb(io.pcie_link_current_bytes_per_second)} per direction; idle links train "
               "down)")
    lines.append(f"           PCIe replays {replays}{now}")
    lines.append(_health_line(reading))
    return "\n".join(lines)


def _link_source(lk: Link, caps: dict[str, Any]) -> str:
    """Where a link's rate comes from, as the capabilities say (and its links, where counted);
    nothing for a link the capabilities do not name."""
    if lk.key not in caps:
        return ""
    count = caps.get(f"{lk.key}_links")
    return (f", {lk.name} rate from {caps[lk.key] or 'none'}"
            + ("" if count is None else f" ({count} links)"))


def _link_rates(lk: Link, reading: NvmlReading) -> str:
    """A link's rates, each with its share of the link's maximum, and the maximum; empty for a
    link of which nothing was read (the absent metrics say why)."""
    maximum = getattr(getattr(reading, lk.maximum[0]), lk.maximum[1])
    rates = [(r.direction, getattr(getattr(reading, r.layer), r.field)) for r in lk.rates]
    if maximum is None and all(v is None for _, v in rates):
        return ""
    return (f"{lk.name} " + ", ".join(f"{d} {_gb(v)} ({_pct(ratio(v, maximum))})" for d, v in rates)
            + (f" of {_gb(maximum)} per direction" if maximum else ", maximum absent"))


def _health_line(reading: NvmlReading) -> str:
    h = reading.health

    def show(value: float | None, unit: str, scale: float = 1.0, digits: int = 0) -> str:
        return "absent" if value is None else f"{value / scale:.{digits}f} {unit}"

    limits = {name: value for name, value in (
        ("power cap", h.power_cap_ratio), ("HW slowdown", h.hw_slowdown_ratio),
        ("HW thermal", h.hw_thermal_ratio), ("power brake", h.hw_power_brake_ratio),
        ("SW thermal", h.sw_thermal_ratio), ("sync boost", h.sync_boost_ratio))
        if value}
    limited = ", ".join(f"{k} {v * 100:.0f} %" for k, v in limits.items()) or "none"
    ecc = ("absent" if h.ecc_uncorrected_volatile is None else
           f"{h.ecc_corrected_volatile} corrected / {h.ecc_uncorrected_volatile} uncorrected")
    return (f"  health:  SM clock {show(h.sm_clock_hertz, 'MHz', 1e6)} of "
            f"{show(h.sm_clock_max_hertz, 'MHz', 1e6)}, limited by {limited}, power "
            f"{show(h.power_watts, 'W', digits=1)} of {show(h.power_limit_watts, 'W')}, "
            f"{show(h.temperature_celsius, 'C')} (memory {show(h.memory_temperature_celsius, 'C')})"
            f", ECC {ecc}, remap pending {show(h.row_remap_pending, '')}".rstrip() + ", Xids "
            + (", ".join(f"{code} x{n}" for code, n in reading.xids) or "none"))
