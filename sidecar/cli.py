"""Command line (Contract 3): ``gpu-sidecar run`` and ``gpu-sidecar probe``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import os
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import structlog

from sidecar import __version__, config, protocol, signals
from sidecar.agent import PRIME_WINDOW_S, Agent
from sidecar.app_socket import AppSocket, AppState, SocketInUse
from sidecar.log import configure
from sidecar.nvml_source import NvmlReading, NvmlSource, NvmlUnavailable
from sidecar.samples import GpuIdentity, ratio
from sidecar.sinks import Sink
from sidecar.spool import SpoolError
from sidecar.summary import Checkpoint

if TYPE_CHECKING:
    from sidecar.simulate.scenarios import Scenario

log = structlog.get_logger("sidecar.cli")

OPTIONS_NOTE = """\
Every option can also be set by the environment variable shown in brackets; a flag wins over
its variable. Units: seconds for times, bytes and bytes/s for sizes and rates.
"""
EPILOG = OPTIONS_NOTE + """
Pod identity: set --pod-namespace, --pod-name and --node-name from the downward API
(metadata.namespace, metadata.name, spec.nodeName) and --pod-container to the app container's
name; they become the labels namespace, pod, node and container on every series.
"""


DIAGNOSE_EPILOG = """\
Exit codes: 0 nothing found, 1 a bottleneck found on at least one GPU (or a GPU lost), 2
configuration error (also: no GPU to judge), 3 NVML unavailable, 130 interrupted by SIGINT
(Ctrl-C) and 143 by SIGTERM before the window ended (the report then printed is marked PARTIAL).
Beside a running agent (the app socket held) the app layer is not judged and, with --gpus
announced, every visible GPU is judged on its NVML layers. Without NVML, --no-nvml judges the
app layer only.

""" + OPTIONS_NOTE


class _Parser(argparse.ArgumentParser):
    """argparse quotes what it could not parse, values included (``--heder X-Api-Key=secret``):
    its errors keep the option names and mask every value."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {_mask_arguments(message)}\n")


def _mask_arguments(message: str) -> str:
    head, colon, tail = message.partition(": ")
    if head == "unrecognized arguments":
        shown = [t.partition("=")[0] if t.startswith("-") else "***" for t in tail.split(" ")]
        return f"{head}{colon}{' '.join(shown)} (values not shown)"
    return re.sub(r"(--?[\w-]+)=\S+", r"\1=***", message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gpu-sidecar",
        description="Samples what GPU utilization hides (compute, memory, IO) for the GPUs of "
        "this pod and writes timestamped series. With nothing configured: stdout.",
    )
    parser.add_argument("--version", action="version", version=config.version_line())
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,diagnose,probe}",
                                parser_class=_Parser)
    run = sub.add_parser("run", help="run the agent", epilog=EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         description="Sample every --interval seconds and write the series.")
    config.add_arguments(run, "run")
    probe = sub.add_parser("probe", help="report the GPUs, what each supports, one reading",
                           epilog=OPTIONS_NOTE, formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="One-shot report of the visible GPUs, the metrics each "
                           "supports (and why others are absent) and one reading of every layer.")
    config.add_arguments(probe, "probe")
    diagnose = sub.add_parser(
        "diagnose", help="sample for a window and say which layer explains the latency",
        epilog=DIAGNOSE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Sample every --interval seconds for --duration seconds, then name per GPU "
        "the layer (compute, memory, IO) that explains the latency, with the figures behind the "
        "verdict and what to do. Thresholds: those of the shipped alert rules "
        "(sidecar/thresholds.py).")
    config.add_arguments(diagnose, "diagnose")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = config.build(args.command, args)
    except config.ConfigError as exc:
        print(f"gpu-sidecar: configuration error: {exc}", file=sys.stderr)
        return 2
    configure(cfg.log_format, _log_level(args, cfg))
    try:
        if args.command == "probe":
            signals.restore_defaults()
            return probe(cfg)
        if args.command == "diagnose":
            from sidecar.diagnose import diagnose

            return diagnose(cfg)
        return run(cfg)
    except config.ConfigError as exc:  # found once NVML was open
        return _fail(args.command, "configuration_error", f"configuration error: {exc}", 2)
    except NvmlUnavailable as exc:
        return _fail(args.command, "nvml_unavailable", str(exc), 3)
    except SocketInUse as exc:
        return _fail(args.command, "app_socket_unavailable", str(exc), 4)
    except SpoolError as exc:
        return _fail(args.command, "spool_unavailable", str(exc), 5)


def _log_level(args: argparse.Namespace, cfg: config.Config) -> str:
    """probe and diagnose print a report for a person: their info lines (GPUs opened, metrics
    absent) would say it a second time, so they log warnings and errors unless a level is given."""
    given = args.log_level is not None or config.OPTION_BY_NAME["log_level"].env in os.environ
    return cfg.log_level if args.command == "run" or given else "warning"


def _fail(command: str, event: str, message: str, code: int) -> int:
    """Say why the command stops, once: on stderr for a person, and, for the agent, also as a
    log line (its pod's log is where an operator looks)."""
    if command == "run":
        log.error(event, error=message)
    print(f"gpu-sidecar: {message}", file=sys.stderr)
    return code


@contextlib.contextmanager
def _nvml(cfg: config.Config) -> Iterator[tuple[NvmlSource | None, Scenario | None]]:
    """The NVML source (real or simulated) and the scenario, if any; closed on exit."""
    scenario = None
    if cfg.simulate:
        from sidecar.simulate import fake_nvml, scenarios

        scenario = scenarios.build(cfg.simulate, cfg.simulate_gpus)
        fake_nvml.install(scenario.nvml())
        log.warning("simulated_gpus", scenario=scenario.name, description=scenario.description,
                    gpus=len(scenario.gpus), note="no real GPU is read; gpu_name says Simulated")
    if cfg.no_nvml:
        yield None, None
        return
    source = NvmlSource(pcie_peak_bytes_per_second=cfg.pcie_peak_bytes_per_second,
                        lost_retry_s=cfg.gpu_retry_interval, interval_s=cfg.interval)
    source.open()
    try:
        _check_named_gpus(cfg, source)
        yield source, scenario
    finally:
        source.close()
        if scenario is not None:
            from sidecar.simulate import fake_nvml

            fake_nvml.uninstall()


def _sinks(cfg: config.Config, spool_root: str) -> list[Sink]:
    """The configured receivers, or stdout when there are none."""
    from sidecar.sinks.stdout import StdoutSink

    if not cfg.has_receivers:
        return [StdoutSink(cfg.output)]
    from sidecar.sinks.delivery import HttpOptions

    http = HttpOptions(
        timeout_s=cfg.push_timeout, bearer_token_file=cfg.bearer_token_file,
        basic_auth_user=cfg.basic_auth_user, basic_auth_password_file=cfg.basic_auth_password_file,
        ca_file=cfg.ca_file, cert_file=cfg.cert_file, key_file=cfg.key_file,
        insecure_skip_verify=cfg.insecure_skip_verify, headers=cfg.header,
        max_backoff_s=cfg.retry_max_backoff)
    sinks: list[Sink] = []
    if cfg.remote_write_url:
        from sidecar.sinks.remote_write import RemoteWriteSink, sink_name
        from sidecar.spool import Spool

        _private_root(spool_root)
        per_host = Counter(_old_spool_dir(u) for u in cfg.remote_write_url)
        for url, name in _named(cfg.remote_write_url, sink_name):
            directory = os.path.join(spool_root, _spool_dir(name, url))
            if per_host[_old_spool_dir(url)] == 1:
                _adopt_old_spool(os.path.join(spool_root, _old_spool_dir(url)), directory)
            spool = Spool(directory, cfg.spool_max_bytes, cfg.spool_memory_max_bytes)
            sinks.append(RemoteWriteSink(url, spool, http,
                                         name=name, push_interval_s=cfg.push_interval,
                                         max_batch_samples=cfg.batch_max_samples))
    if cfg.otlp_url:
        from sidecar.sinks.otlp import otlp_sink
        from sidecar.sinks.otlp import sink_name as otlp_name
        from sidecar.spool import Spool

        _private_root(spool_root)
        for url, name in _named(cfg.otlp_url, otlp_name):
            spool = Spool(os.path.join(spool_root, _spool_dir(name, url)), cfg.spool_max_bytes,
                          cfg.spool_memory_max_bytes)
            sinks.append(otlp_sink(url, spool, http, name=name,
                                   extra_labels=tuple(k for k, _ in cfg.extra_label),
                                   push_interval_s=cfg.push_interval,
                                   max_batch_samples=cfg.batch_max_samples))
    if cfg.pushgateway_url:
        from sidecar.sinks.pushgateway import PushgatewaySink

        # a Job's group is the Job's (an Indexed Job's pod: the Job's and its index), so that a
        # rerun replaces it; a Deployment's is the pod's
        pairs = (("namespace", cfg.pod_namespace),
                 ("job_name", cfg.batch_job) if cfg.batch_job else ("pod", cfg.pod_name),
                 ("job_index", cfg.batch_job_index))
        grouping = {k: v for k, v in pairs if v}
        sinks.append(PushgatewaySink(cfg.pushgateway_url, http, job=cfg.pushgateway_job,
                                     grouping=grouping, push_interval_s=cfg.push_interval,
                                     delete_on_exit=cfg.pushgateway_delete_on_exit,
                                     summary_at_exit=bool(cfg.batch_job)))
    if cfg.stdout:
        sinks.append(StdoutSink(cfg.output))
    return sinks


def _safe_dir(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in name)


def _spool_dir(name: str, url: str) -> str:
    """The sink's name made safe for a path, plus a short digest of its URL (credentials left
    out): two URLs whose names read alike on disk still get two directories."""
    from sidecar.sinks import redact_url

    digest = hashlib.sha256(redact_url(url).encode()).hexdigest()[:8]
    return f"{_safe_dir(name)}-{digest}"


def _old_spool_dir(url: str) -> str:
    """Where earlier releases kept a URL's spool: one directory per host and port."""
    from sidecar.sinks.remote_write import host_port

    return _safe_dir(f"remote_write:{host_port(url)}")


def _named(urls: Sequence[str], sink_name: Callable[[str], str]) -> list[tuple[str, str]]:
    """Each URL with its sink's name: one spool and one ``sink`` label per URL, even for two URLs
    on one host:port (the second gets ``#2``)."""
    seen: Counter[str] = Counter()
    out = []
    for url in urls:
        name = sink_name(url)
        seen[name] += 1
        out.append((url, name if seen[name] == 1 else f"{name}#{seen[name]}"))
    return out


def _adopt_old_spool(old: str, new: str) -> None:
    """An upgrade must not orphan a backlog: the old directory becomes the URL's new one."""
    if os.path.isdir(old) and not os.path.exists(new):
        try:
            os.rename(old, new)
        except OSError as exc:
            log.error("spool_not_adopted", old=old, new=new, error=exc.strerror,
                      effect="batches of the earlier release stay unsent in the old directory")
            return
        log.info("spool_adopted", old=old, new=new, note="spool of an earlier release")


def _private_root(root: str) -> None:
    """The spool root, created 0700: batches carry pod names and figures. A root the agent does
    not own (a Kubernetes emptyDir belongs to root) keeps its mode: the per-URL directories
    inside it are 0700 anyway, and only the owner may chmod."""
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        if os.stat(root).st_uid == os.getuid():
            os.chmod(root, 0o700)
    except OSError as exc:
        raise SpoolError(
            f"spool directory {root} is not writable ({exc.strerror}); mount a writable "
            "emptyDir there or set --spool-dir / GPU_SIDECAR_SPOOL_DIR") from exc


def _check_named_gpus(cfg: config.Config, source: NvmlSource) -> None:
    """GPUs named with --gpus must be among those NVML shows: a typo or a GPU the container
    cannot see would otherwise leave the agent exporting nothing while looking healthy."""
    visible = [i.uuid for i in source.devices()]
    missing = [u for u in cfg.gpu_list() if u not in visible]
    if missing and source.unreadable_at_start:
        # maybe one of the GPUs that failed to open: not surely a configuration error, and
        # exiting would crash-loop the pod on what may be a transient fault
        log.error("named_gpus_not_open", gpus=missing,
                  unreadable_indexes=source.unreadable_at_start, visible=visible,
                  effect="their series are absent; the others are exported",
                  hint="check `nvidia-smi`; restart the agent once it shows them")
    elif missing:
        raise config.ConfigError(
            f"--gpus names {', '.join(missing)}, which NVML does not show this container; "
            f"visible: {', '.join(visible) or 'none'}. Name visible GPUs, or use --gpus visible "
            "(every GPU shown) or --gpus announced (the app's)")


@contextlib.contextmanager
def simulated_paths(cfg: config.Config) -> Iterator[config.Config]:
    """``cfg`` with, in simulated mode and where the defaults stand, a private temporary socket
    and spool (a demo needs no /run or /var/lib, and two demos do not collide), removed on exit.
    Chosen before anything is logged, so the start-up line names the paths actually used."""
    with contextlib.ExitStack() as stack:
        paths: dict[str, str] = {}
        if cfg.simulate and cfg.socket == protocol.DEFAULT_SOCKET_PATH:
            paths["socket"] = os.path.join(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-sidecar-")), "app.sock")
        if cfg.simulate and cfg.spool_dir == config.Config.spool_dir:
            paths["spool_dir"] = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="gpu-sidecar-spool-"))
        yield dataclasses.replace(cfg, **paths)


@contextlib.contextmanager
def sampling(cfg: config.Config, *, listen: bool = True
             ) -> Iterator[tuple[NvmlSource | None, Scenario | None, AppState]]:
    """What ``run`` and ``diagnose`` sample: NVML (real or simulated) and the app's figures from
    the socket, where in simulated mode the simulated model server publishes. ``listen=False``
    leaves the socket to an agent that already holds it: the app's figures are then absent."""
    with contextlib.ExitStack() as stack, _nvml(cfg) as (source, scenario):
        known = None
        if source is not None:
            visible = {i.uuid for i in source.devices()}
            known = visible.__contains__
        state = AppState(stale_after_s=cfg.app_stale_after, known_gpu=known,
                         max_processes=cfg.app_max_processes, max_gpus=cfg.app_max_gpus,
                         max_buckets=cfg.app_max_buckets,
                         max_message_bytes=cfg.app_max_message_bytes)
        if listen:
            app_socket = AppSocket(cfg.socket, state)
            app_socket.start()
            stack.callback(app_socket.stop)
        if listen and scenario is not None and source is not None and not cfg.no_simulated_app:
            from sidecar.simulate.app import SimulatedApp

            sim = SimulatedApp(cfg.socket, [g.uuid for g in scenario.gpus], scenario.app,
                               interval_s=min(cfg.interval, 5.0))
            sim.start()
            stack.callback(sim.stop)
            _wait_for(lambda: bool(state.announced()), 2.0)
        yield source, scenario, state


def run(cfg: config.Config) -> int:
    with simulated_paths(cfg) as cfg:
        return _run(cfg)


def _run(cfg: config.Config) -> int:
    log.info("starting", version=__version__, config=config.describe(cfg))
    if cfg.insecure_skip_verify:
        log.warning("tls_verification_disabled",
                    effect="receivers' certificates are not checked: anyone on the path can read "
                           "and change what is pushed",
                    hint="give the receiver's CA with --ca-file instead of --insecure-skip-verify")
    stop = signals.STOP
    signals.install()  # already done by the entry point; again for callers of main()
    with sampling(cfg) as (source, scenario, state):
        sinks = _sinks(cfg, cfg.spool_dir)
        mode = "simulated" if scenario is not None else ("nvml" if source else "app-only")
        # a Job's run summary so far, beside the spool: an agent restarted mid-run goes on with it
        checkpoint = (Checkpoint(Path(cfg.spool_dir) / "run-summary.json", cfg.push_interval)
                      if cfg.batch_job else None)
        agent = Agent(cfg, source=source, app=state, sinks=sinks, mode=mode, checkpoint=checkpoint)
        for sink in sinks:
            sink.start()
        if stop.is_set():
            log.info("stop_signal_during_start", signal=_signal_names())
        if cfg.once:
            agent.prime()
            time.sleep(PRIME_WINDOW_S)
            agent.cycle(last=True)
        else:
            agent.run(stop)
        # a stop signal: a last sample, then flush what the shutdown timeout allows
        deadline = time.monotonic() + cfg.shutdown_timeout
        if not cfg.once:
            log.info("stopping", signals=_signal_names(), shutdown_timeout_s=cfg.shutdown_timeout)
        if not cfg.once:
            agent.cycle(last=True)
        for sink in sinks:
            sink.begin_close(deadline)
        delivered = all([sink.close(deadline) for sink in sinks])
        log.info("stopped", signals=_signal_names(), samples_collected=agent.collected,
                 overruns=agent.overruns,
                 all_delivered=delivered, shutdown_s=round(time.monotonic() - deadline
                                                           + cfg.shutdown_timeout, 3))
    return 0


def _signal_names() -> list[str]:
    return [signal.Signals(n).name for n in signals.received]


def _wait_for(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not condition():
        time.sleep(0.01)


def probe(cfg: config.Config) -> int:
    with _nvml(cfg) as (source, scenario):
        if source is None:
            print("NVML disabled (--no-nvml): only app figures would be exported.")
            return 0
        devices = source.devices()
        uuids = [d.uuid for d in devices]
        source.read(uuids)
        time.sleep(PRIME_WINDOW_S)
        readings = source.read(uuids)
        sim = f"  [SIMULATED: scenario {cfg.simulate}]" if scenario is not None else ""
        print(f"gpu-sidecar {__version__} probe: NVML driver {source.driver_version}, "
              f"{len(devices)} GPU(s){sim}")
        # one line to check what a DRA claim or NVIDIA_VISIBLE_DEVICES gave this container
        print("this container sees: " + (", ".join(
            f"{d.uuid} ({d.name})" for d in devices) or "no GPU"))
        for identity in devices:
            print()
            print(_probe_block(source, identity, readings.get(identity.uuid)))
        print()
        print("app layer (fragmentation, allocator, latency): published by the model server over "
              f"the app socket at run time ({_socket_at_run_time(cfg)}); probe reads none.")
    return 0


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
                 f", PCIe rate from {caps['pcie'] or 'none'}, NVLink from {caps['nvlink'] or 'none'}"
                 f" ({caps['nvlink_links']} links), replays from {caps['replay'] or 'none'}")
    lines.append(f"  link: {link}")
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
    lines.append(
        f"  io:      PCIe TX {_gb(io.pcie_tx_bytes_per_second)} "
        f"({_pct(ratio(io.pcie_tx_bytes_per_second, io.pcie_link_max_bytes_per_second))}), RX "
        f"{_gb(io.pcie_rx_bytes_per_second)} "
        f"({_pct(ratio(io.pcie_rx_bytes_per_second, io.pcie_link_max_bytes_per_second))}), NVLink "
        f"TX {_gb(io.nvlink_tx_bytes_per_second)} RX {_gb(io.nvlink_rx_bytes_per_second)}, "
        f"replays {io.pcie_replay_errors if io.pcie_replay_errors is not None else 'absent'}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
