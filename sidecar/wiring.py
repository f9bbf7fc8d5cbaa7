"""Wiring: from a validated Config to running parts. The sources (NVML, real or simulated, and
the app socket), the sinks with their spools, and the agent between them; ``run`` is the agent's
life from start to flush. The command line only parses and dispatches here, so ``diagnose`` and
``probe`` build the same parts the agent uses without importing the command line."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from sidecar import __version__, config, protocol, signals
from sidecar.agent import PRIME_WINDOW_S, Agent
from sidecar.durability.spool import Spool, open_spools, private_root, spool_dir_name
from sidecar.inject import placement as inject_placement
from sidecar.inject.versions import PublisherAwareAppState
from sidecar.metrics import RARE, RARE_READ_S
from sidecar.recent import Recent
from sidecar.sinks import Sink
from sidecar.sinks.cadence import Cadence
from sidecar.sources.app_socket import AppSocket, AppState, SocketUnavailable
from sidecar.sources.nvml import NvmlSource
from sidecar.summary import Checkpoint
from sidecar.window_socket import WindowSocket
from sidecar.window_socket import path_of as window_path

if TYPE_CHECKING:
    from sidecar.simulate.scenarios import Scenario
    from sidecar.sources.engine import EngineSource, Fetched

log = structlog.get_logger("sidecar.wiring")


@contextlib.contextmanager
def nvml(cfg: config.Config, *, rare_read_s: float = RARE_READ_S
         ) -> Iterator[tuple[NvmlSource | None, Scenario | None]]:
    """The NVML source (real or simulated) and the scenario, if any; closed on exit.
    ``rare_read_s``: how often the rare figures' counters are asked for (``reading.py``)."""
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
                        lost_retry_s=cfg.gpu_retry_interval, interval_s=cfg.interval,
                        rare_read_s=rare_read_s)
    source.open()
    try:
        _check_named_gpus(cfg, source)
        yield source, scenario
    finally:
        source.close()
        if scenario is not None:
            from sidecar.simulate import fake_nvml

            fake_nvml.uninstall()


def build_sinks(cfg: config.Config, spool_root: str) -> list[Sink]:
    """The configured receivers, or stdout when there are none."""
    from sidecar.sinks.stdout import StdoutSink

    sinks: list[Sink] = []
    if cfg.metrics_listen:  # an output of its own: with no receiver, nothing goes to stdout
        from sidecar.sinks.scrape import ListenError, ScrapeSink

        try:
            sinks.append(ScrapeSink(cfg.metrics_listen))
        except ListenError as exc:
            raise config.ConfigError(str(exc.strerror)) from None
    if not cfg.has_receivers:
        return sinks if sinks and not cfg.stdout else [*sinks, StdoutSink(cfg.output,
                                                                          socket=cfg.socket)]
    # each sink reads the receivers' options (credentials, headers, TLS, timeout) off cfg
    if cfg.remote_write_url:
        from sidecar.sinks.remote_write import RemoteWriteSink, sink_name

        for url, name, spool in _spools(spool_root, "remote_write", cfg.remote_write_url,
                                        sink_name, cfg):
            sinks.append(RemoteWriteSink(url, spool, cfg,
                                         name=name, push_interval_s=cfg.push_interval,
                                         max_batch_samples=cfg.batch_max_samples,
                                         cadence=Cadence(RARE)))
    if cfg.otlp_url:
        from sidecar.sinks.otlp import otlp_sink
        from sidecar.sinks.otlp import sink_name as otlp_name

        for url, name, spool in _spools(spool_root, "otlp", cfg.otlp_url, otlp_name, cfg):
            sinks.append(otlp_sink(url, spool, cfg, name=name,
                                   extra_labels=tuple(k for k, _ in cfg.extra_label),
                                   push_interval_s=cfg.push_interval,
                                   max_batch_samples=cfg.batch_max_samples,
                                   cadence=Cadence(RARE)))
    if cfg.pushgateway_url:
        from sidecar.sinks.pushgateway import PushgatewaySink

        # a Job's group is the Job's (an Indexed Job's pod: the Job's and its index), so that a
        # rerun replaces it; a Deployment's is the pod's
        pairs = (("namespace", cfg.pod_namespace),
                 ("job_name", cfg.batch_job) if cfg.batch_job else ("pod", cfg.pod_name),
                 ("job_index", cfg.batch_job_index))
        grouping = {k: v for k, v in pairs if v}
        sinks.append(PushgatewaySink(cfg.pushgateway_url, cfg, job=cfg.pushgateway_job,
                                     grouping=grouping, push_interval_s=cfg.push_interval,
                                     delete_on_exit=cfg.pushgateway_delete_on_exit,
                                     summary_at_exit=bool(cfg.batch_job)))
    if cfg.stdout:
        sinks.append(StdoutSink(cfg.output, socket=cfg.socket))
    return sinks


def resend_rejected(cfg: config.Config) -> int:
    """``gpu-sidecar resend-rejected``: each configured remote-write and OTLP receiver is sent
    the batches of its spool's ``rejected/`` once more (``sidecar.sinks.resend``). One line per
    receiver on stdout; 0 when every batch was taken (or none was kept), 1 otherwise."""
    from sidecar.sinks import otlp, remote_write
    from sidecar.sinks.resend import resend_rejected as resend

    if not (cfg.remote_write_url or cfg.otlp_url):
        raise config.ConfigError("resend-rejected needs the receivers the batches were meant for: "
                                 "--remote-write-url or --otlp-url (GPU_SIDECAR_REMOTE_WRITE_URL, "
                                 "GPU_SIDECAR_OTLP_URL), as the agent was started with")
    complete = True
    for urls, codec, sink_name in ((cfg.remote_write_url, remote_write.RemoteWriteCodec,
                                    remote_write.sink_name),
                                   (cfg.otlp_url, otlp.OtlpCodec, otlp.sink_name)):
        for url, name in _named(urls, sink_name):
            directory = Path(cfg.spool_dir) / spool_dir_name(name, url) / "rejected"
            outcome = resend(url, directory, cfg, sink=name, headers=codec.headers,
                             policy=codec.policy)
            complete = complete and outcome.complete
            line = (f"{name}: {outcome.sent} batches ({outcome.samples} samples) sent again, "
                    f"{outcome.refused} refused again, {outcome.left} not tried, "
                    f"{outcome.unreadable} unreadable ({directory})")
            if outcome.stopped_by:
                line += f"; stopped: {outcome.stopped_by}"
            print(line, flush=True)
    return 0 if complete else 1


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


def _spools(root: str, kind: str, urls: Sequence[str], sink_name: Callable[[str], str],
            cfg: config.Config) -> list[tuple[str, str, Spool]]:
    """Each URL of one kind with its sink's name and its spool, opened under the private root
    (the spools no configured URL uses any more adopted: ``durability.spool.open_spools``)."""
    private_root(root)
    return open_spools(root, kind, _named(urls, sink_name), cfg.spool_max_bytes,
                       cfg.spool_memory_max_bytes)


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
        if cfg.simulate and (cfg.socket == protocol.DEFAULT_SOCKET_PATH
                             or cfg.spool_dir == config.Config.spool_dir):
            try:
                tempfile.gettempdir()
                tempfile.TemporaryDirectory(prefix="gpu-sidecar-check-").cleanup()
            except OSError:
                raise config.ConfigError(
                    "--simulate makes a private temporary socket and spool in the temporary "
                    "directory (TMPDIR, /tmp), and none is writable here (a read-only root "
                    "file system?): give --socket and --spool-dir on writable volumes, or mount "
                    "a tmpfs on /tmp (docker run --tmpfs /tmp)") from None
        if cfg.simulate and cfg.socket == protocol.DEFAULT_SOCKET_PATH:
            cfg = dataclasses.replace(cfg, socket=os.path.join(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-sidecar-")), "app.sock"))
        if cfg.simulate and cfg.spool_dir == config.Config.spool_dir:
            cfg = dataclasses.replace(cfg, spool_dir=stack.enter_context(
                tempfile.TemporaryDirectory(prefix="gpu-sidecar-spool-")))
        yield cfg


@contextlib.contextmanager
def sampling(cfg: config.Config, *, listen: bool = True,
             before_listen: Callable[[], None] | None = None, rare_read_s: float = RARE_READ_S
             ) -> Iterator[tuple[NvmlSource | None, Scenario | None, AppState]]:
    """What ``run`` and ``diagnose`` sample: NVML (real or simulated) and the app's figures from
    the socket, where in simulated mode the simulated model server publishes. ``listen=False``
    leaves the socket to an agent that already holds it: the app's figures are then absent.
    ``before_listen`` runs once NVML is open and before the socket is bound (``run`` places the
    injected publisher there: an agent that NVML refuses writes nothing). ``diagnose``, which
    samples for seconds, asks for the rare counters every cycle (``rare_read_s=0``): an increase
    within its window is seen, whatever its length."""
    with contextlib.ExitStack() as stack, nvml(cfg, rare_read_s=rare_read_s) as (source,
                                                                                  scenario):
        known = None
        if source is not None:
            visible = {i.uuid for i in source.devices()}
            known = visible.__contains__
        state = PublisherAwareAppState(stale_after_s=cfg.app_stale_after, known_gpu=known,
                                       max_processes=cfg.app_max_processes,
                                       max_gpus=cfg.app_max_gpus, max_buckets=cfg.app_max_buckets,
                                       max_message_bytes=cfg.app_max_message_bytes)
        if before_listen is not None:
            before_listen()
        if listen:
            app_socket = AppSocket(cfg.socket, state)
            app_socket.start()
            stack.callback(app_socket.stop)
        if listen and scenario is not None and source is not None and not cfg.no_simulated_app:
            from sidecar.simulate.app import SimulatedApp

            # publishes every sampling interval, and at least as often as the default one
            sim = SimulatedApp(cfg.socket, [g.uuid for g in scenario.gpus], scenario.app,
                               interval_s=min(cfg.interval, config.Config.interval))
            sim.start()
            stack.callback(sim.stop)
            _wait_for(lambda: bool(state.announced()), 2.0)
        yield source, scenario, state


@contextlib.contextmanager
def engines(cfg: config.Config, scenario: Scenario | None) -> Iterator[EngineSource | None]:
    """The serving engines' metrics endpoints, read by threads of their own while in the block;
    with a scenario that has a serving engine and no --engine-metrics-url, the simulated one."""
    from sidecar.sources.engine import EngineEndpoint, EngineSource

    with contextlib.ExitStack() as stack:
        urls = list(cfg.engine_metrics_url)
        if not urls and scenario is not None and scenario.engine is not None \
                and not cfg.no_simulated_app:
            from sidecar.simulate.engine import SimulatedEngine

            sim = SimulatedEngine(scenario.engine)
            sim.start()
            stack.callback(sim.stop)
            urls = [sim.url]
        if not urls:
            yield None
            return
        source = EngineSource([
            EngineEndpoint(url, engine_fetch(cfg), interval_s=cfg.interval,
                           timeout_s=cfg.engine_metrics_timeout) for url in urls])
        source.start()
        stack.callback(source.stop)
        if scenario is not None:  # a demo's first cycle already shows the engine
            _wait_for(lambda: len(source.current()) == len(urls), 2.0)
        yield source


def engine_fetch(cfg: config.Config) -> Callable[[str], Fetched]:
    """A GET of an engine endpoint through ``sinks.http`` (its own session, no redirect
    followed, the timeout over the whole request, the answer read as sent up to the bound), as
    the engine source's ``Fetched``. No credentials or headers of the receivers go to an engine."""
    from sidecar.sinks.answers import Retryable
    from sidecar.sinks.http import Http
    from sidecar.sources.engine import Fetched

    limit, timeout = cfg.engine_metrics_max_bytes, cfg.engine_metrics_timeout
    # a bare Config: none of the receivers' credentials, headers or TLS files
    http = Http(config.Config(), timeout_s=timeout, max_answer_bytes=limit)
    # identity: the bound is on what the engine sends, and a gzip bomb is not read
    headers = {"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "identity"}

    def fetch(url: str) -> Fetched:
        began = time.monotonic()
        try:
            got = http.request("GET", url, headers=headers)
        except Retryable as exc:
            if time.monotonic() - began >= 0.95 * timeout:
                return Fetched(problem=("timeout", f"no answer within {timeout:g} s "
                                        "(--engine-metrics-timeout)"))
            return Fetched(problem=("unreachable", str(exc)))
        if len(got.content) > limit:
            return Fetched(problem=("too_large", f"the answer is longer than {limit} bytes "
                                    "(--engine-metrics-max-bytes): not parsed"))
        if got.unread is not None:  # too slow, or cut on the way (said in the detail)
            return Fetched(problem=("timeout", f"the answer was not read whole within "
                                    f"{timeout:g} s (--engine-metrics-timeout): {got.unread}"))
        # a compressed answer (sent although identity was asked) is inflated by the engine
        # source as it parses, never beyond the same bound decoded
        return Fetched(status=got.status_code, body=got.content,
                       location=got.headers.get("Location") or "",
                       encoding=got.headers.get("Content-Encoding") or "", max_bytes=limit)

    return fetch


def run(cfg: config.Config) -> int:
    temporary_spool = bool(cfg.simulate) and cfg.spool_dir == config.Config.spool_dir
    with simulated_paths(cfg) as cfg:
        return _run(cfg, temporary_spool=temporary_spool)


TEMPORARY_SPOOL_EFFECT = ("LOST at exit: with --simulate and no --spool-dir the spool is a "
                          "temporary directory, removed with this run; give --spool-dir to keep "
                          "what a receiver did not take")


TEMPORARY_SET_ASIDE_EFFECT = ("refused by the receiver for their data in this run, and LOST at "
                              "exit: with --simulate and no --spool-dir the spool, rejected/ "
                              "with it, is a temporary directory removed with this run")
TEMPORARY_SET_ASIDE_HINT = ("give --spool-dir to keep what a receiver refuses, for "
                            "`gpu-sidecar resend-rejected`")


def _run(cfg: config.Config, *, temporary_spool: bool = False) -> int:
    import gc

    _log_start(cfg)
    stop = signals.STOP
    signals.install()  # already done by the entry point; again for callers of main()
    # the injected publisher: placed once NVML is open, before the socket is bound (the socket
    # is what the app's start waits for), taken back if the start then fails
    with inject_placement.Start(cfg) as inject, \
            sampling(cfg, before_listen=inject.place) as (source, scenario, state), \
            engines(cfg, scenario) as engine, contextlib.ExitStack() as stack:
        sinks = build_sinks(cfg, cfg.spool_dir)
        if temporary_spool:
            _spool_goes_with_the_run(sinks)
        mode = "simulated" if scenario is not None else ("nvml" if source else "app-only")
        # a Job's run summary so far, beside the spool: an agent restarted mid-run goes on with it
        checkpoint = (Checkpoint(Path(cfg.spool_dir) / "run-summary.json", cfg.push_interval)
                      if cfg.batch_job else None)
        recent = Recent()
        agent = Agent(cfg, source=source, app=state, sinks=sinks, mode=mode, checkpoint=checkpoint,
                      engine=engine, recent=recent)
        from sidecar.sinks.stdout import StdoutSink

        for sink in sinks:  # the live table shows the agent's verdicts whole
            if isinstance(sink, StdoutSink):
                sink.follow(lambda: agent.verdicts)
        from sidecar.status_file import StatusWriter, status_path

        agent.on_cycle = StatusWriter(status_path(cfg.socket), agent)
        stack.callback(_answer_diagnose(cfg, recent).stop)
        for sink in sinks:
            sink.start()
        inject.started()
        if stop.is_set():
            log.info("stop_signal_during_start", signal=_signal_names())
        if cfg.once:
            agent.prime()
            time.sleep(PRIME_WINDOW_S)
            agent.cycle(last=True)
        else:
            # what start-up built (modules, configuration, NVML handles) lives as long as the
            # agent: frozen out of the collector's way, its full collections walk only what
            # the cycles made
            gc.collect()
            gc.freeze()
            agent.run(stop)
        # a stop signal: a last sample, then flush what the shutdown timeout allows
        deadline = time.monotonic() + cfg.shutdown_timeout
        if not cfg.once:
            log.info("stopping", signals=_signal_names(), shutdown_timeout_s=cfg.shutdown_timeout)
            _last_cycle(agent, sinks)
        for sink in sinks:
            sink.begin_close(deadline)
        delivered = all([sink.close(deadline) for sink in sinks])
        log.info("stopped", signals=_signal_names(), samples_collected=agent.collected,
                 overruns=agent.overruns, pauses=agent.pauses,
                 all_delivered=delivered, shutdown_s=round(time.monotonic() - deadline
                                                           + cfg.shutdown_timeout, 3))
    return 0


def _log_start(cfg: config.Config) -> None:
    """The start-up lines: the configuration (whole in a pod's log, at debug beside the live
    table), how to ask a simulated agent, and a warning when TLS is not verified."""
    import shlex
    import sys

    from sidecar.sinks.stdout import resolve

    # a simulated agent's socket is private (a temporary directory): how to ask it, once
    ask = {command: f"gpu-sidecar {command} --socket {shlex.quote(cfg.socket)}"
           for command in ("status", "diagnose")} if cfg.simulate else {}
    if resolve(cfg.output, sys.stdout) == "table":  # a person at a terminal: the table speaks
        log.info("starting", version=__version__, **ask)
        log.debug("configuration", config=config.describe(cfg))
    else:  # a pod's log: the whole configuration, once
        log.info("starting", version=__version__, config=config.describe(cfg), **ask)
    if cfg.insecure_skip_verify:
        log.warning("tls_verification_disabled",
                    effect="receivers' certificates are not checked: anyone on the path can read "
                           "and change what is pushed",
                    hint="give the receiver's CA with --ca-file instead of --insecure-skip-verify")


def _spool_goes_with_the_run(sinks: Sequence[Sink]) -> None:
    """A temporary spool (a demo's) goes with this run: the spooled sinks say so at exit."""
    for sink in sinks:
        if hasattr(sink, "left_in_spool_effect"):
            sink.left_in_spool_effect = TEMPORARY_SPOOL_EFFECT  # type: ignore[attr-defined]
            sink.set_aside_effect = TEMPORARY_SET_ASIDE_EFFECT  # type: ignore[attr-defined]
            sink.set_aside_hint = TEMPORARY_SET_ASIDE_HINT  # type: ignore[attr-defined]


def _last_cycle(agent: Agent, sinks: Sequence[Sink]) -> None:
    """A clean stop's last cycle (its gpu_sidecar_up 0 tells a clean stop from a kill), then
    every series it sent ends at the receivers that take staleness markers (remote-write), so a
    verdict at 1 and its alerts end now, not 5 minutes later."""
    agent.stopping = True
    agent.cycle(last=True)
    for sink in sinks:
        end_series = getattr(sink, "end_series", None)
        try:
            if end_series is not None:
                end_series()
        except Exception:  # never costs the flush after it: the series go stale as before
            log.exception("series_end_failed", sink=sink.name,
                          effect="its series stay current until the receiver's "
                                 "look-back runs out (5 minutes in Prometheus)")


class _NotAnswering:
    def stop(self) -> None:
        pass


def _answer_diagnose(cfg: config.Config, recent: Recent) -> WindowSocket | _NotAnswering:
    """``diagnose`` beside the agent asks its window on a socket beside the app's; a volume
    that refuses it costs that answer only (diagnose then samples afresh), never the agent."""
    label = f"  [SIMULATED: scenario {cfg.simulate}]" if cfg.simulate else ""
    try:
        return WindowSocket(window_path(cfg.socket), recent, label=label).start()
    except SocketUnavailable as exc:
        log.warning("diagnose_socket_unavailable", error=str(exc),
                    effect="gpu-sidecar diagnose beside this agent samples afresh (no app "
                           "figures) instead of reading the agent's window")
        return _NotAnswering()


def _signal_names() -> list[str]:
    return [signal.Signals(n).name for n in signals.received]


def _wait_for(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not condition():
        time.sleep(0.01)
