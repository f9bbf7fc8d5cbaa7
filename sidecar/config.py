"""All configuration in one place: every option is a flag and a ``GPU_SIDECAR_*`` variable.

The table ``OPTIONS`` drives the argument parser, the environment lookup and ``--help``; the
result is one frozen ``Config`` validated before anything starts, with errors that name the flag,
the variable and the fix.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from sidecar import __version__, protocol
from sidecar.option_values import (
    HEADER_NAME,
    LABEL_NAME,
    basic_auth_user,
    boolean,
    choice,
    completion_index,
    engine_urls,
    gpu_count,
    gpus,
    hidden,
    instant_text,
    job_name,
    label,
    listen_address,
    pairs,
    positive_float,
    positive_int,
    readable_file,
    seconds,
    secret_file,
    selectors,
    shown_one_url,
    shown_pairs,
    shown_secret_path,
    shown_urls,
    socket_path,
    socket_path_like,
    url,
    urls,
)
from sidecar.urls import redact_url

ENV_PREFIX = protocol.ENV_PREFIX
RESERVED_LABELS = frozenset({"gpu_uuid", "gpu_name", "gpu_index", "namespace", "pod", "container",
                             "node", "pid", "le", "sink", "reason", "job", "instance", "version",
                             "mode", "job_name", "job_index", "figure", "condition", "engine",
                             "endpoint", "model"})


# The names an option takes where their list lives above this module: the scenarios of
# --simulate are declared by sidecar.simulate.scenarios, which the configuration may not import
# (tests/test_layout.py). The command line, which may, passes them (option name -> names) to
# add_arguments (its help's "{choices}") and to build (the same check and error as choice's).
Choices = Mapping[str, Sequence[str]]

RETRY_AFTER_CAP_S = 300.0  # Retry-After is honoured up to this (sidecar.sinks.answers.Policy)


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Config:
    interval: float = 5.0
    gpus: str = "announced"
    socket: str = protocol.DEFAULT_SOCKET_PATH
    inject: bool = True
    inject_dir: str = ""  # "": python/ beside the socket (sidecar.inject.placement.inject_dir)
    app_stale_after: float = 30.0
    app_max_processes: int = 256
    app_max_gpus: int = 64
    app_max_buckets: int = protocol.MAX_BUCKETS
    app_max_message_bytes: int = protocol.MAX_MESSAGE_BYTES
    app_process_series: bool = False
    pcie_peak_bytes_per_second: float | None = None
    gpu_retry_interval: float = 30.0
    no_nvml: bool = False
    output: str = "auto"
    stdout: bool = False
    once: bool = False
    duration: float = 30.0
    simulate: str | None = None
    simulate_gpus: int | None = None
    no_simulated_app: bool = False
    log_format: str = "auto"
    log_level: str = "info"
    pod_namespace: str = ""
    pod_name: str = ""
    pod_container: str = ""
    node_name: str = ""
    remote_write_url: tuple[str, ...] = ()
    otlp_url: tuple[str, ...] = ()
    pushgateway_url: str | None = None
    pushgateway_job: str = "gpu-sidecar"
    pushgateway_delete_on_exit: bool = False
    batch_job: str = ""
    batch_job_index: str = ""
    push_interval: float = 15.0
    batch_max_samples: int = 20_000
    spool_dir: str = "/var/lib/gpu-sidecar/spool"
    spool_max_bytes: int = 256 * 1024 * 1024
    spool_memory_max_bytes: int = 16 * 1024 * 1024  # what a refusing volume's batches may hold in memory
    shutdown_timeout: float = 5.0
    push_timeout: float = 10.0
    retry_max_backoff: float = 30.0
    bearer_token_file: str | None = None
    basic_auth_user: str | None = None
    basic_auth_password_file: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    insecure_skip_verify: bool = False
    header: tuple[tuple[str, str], ...] = ()
    extra_label: tuple[tuple[str, str], ...] = ()
    engine_metrics_url: tuple[str, ...] = ()
    engine_metrics_timeout: float = 2.0
    engine_metrics_max_bytes: int = 4 * 1024 * 1024
    alive: bool = False
    fresh: bool = False
    dry_run: bool = False
    metrics_listen: str = ""
    query_url: str | None = None  # diagnose and fleet from long-term storage (sidecar.store)
    select: tuple[tuple[str, str, str], ...] = ()  # (label, operator, value)
    at: str = "now"
    query_timeout: float = 30.0

    @property
    def has_receivers(self) -> bool:
        return bool(self.remote_write_url or self.otlp_url or self.pushgateway_url)

    def gpu_list(self) -> tuple[str, ...]:
        """Explicit UUIDs, or () for the ``announced`` and ``visible`` modes."""
        if self.gpus in ("announced", "visible"):
            return ()
        return tuple(u.strip() for u in self.gpus.split(",") if u.strip())

    def pod_labels(self) -> dict[str, str]:
        """Labels on every series: pod identity, then --extra-label."""
        pairs = {"namespace": self.pod_namespace, "pod": self.pod_name,
                 "container": self.pod_container, "node": self.node_name}
        out = {k: v for k, v in pairs.items() if v}
        out.update(self.extra_label)
        return out


@dataclass(frozen=True)
class Option:
    name: str
    help: str  # "{default}" (and "{default_mib}") stand for the Config default, "{env}" the variable
    parse: Callable[[str], Any] = str
    flag_only: bool = False  # boolean switch
    commands: tuple[str, ...] = ("run", "probe")
    repeatable: bool = False  # the flag may be given several times; the variable is comma-separated
    # how a refused value is quoted in the error: repr for most, masked where it may hold a
    # secret, None to name only the option
    show: Callable[[str], str | None] = repr

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


# the receivers' HTTP options also reach the store of --query-url (diagnose, fleet)
_STORE_TOO = ("run", "resend-rejected", "diagnose", "fleet")


OPTIONS: tuple[Option, ...] = (
    Option("interval", "Seconds between samples (0.1..3600; default {default}). GPM figures are averages "
           "over this interval.", seconds(0.1, 3600), commands=("run", "diagnose")),
    Option("gpus", "Which GPUs to sample (run exports them, diagnose judges them; probe reports "
           "every visible GPU and only checks that the UUIDs named are visible; default "
           "{default}): 'announced' (the GPUs the app announced over the socket), 'visible' "
           "(every GPU NVML shows this container) or a comma-separated list of GPU/MIG UUIDs.", gpus,
           commands=("run", "probe", "diagnose")),
    Option("socket", "Path of the app's Unix datagram socket (default {default}; the client "
           "reads {env} too). With --simulate and no path given, a private temporary one. The "
           "agent writes its status (gpu-sidecar status) beside it, as status.json.",
           socket_path,
           commands=("run", "probe", "diagnose", "status")),
    Option("inject", "Place the injected publisher at start, before the socket is bound: a "
           "standard-library copy of the app-side publisher and a sitecustomize.py in "
           "--inject-dir, so that an app container with that directory on its PYTHONPATH "
           "publishes the allocator figures of the CUDA devices each of its Python processes "
           "uses, with no code change (default {default}). 'false' places nothing and removes "
           "what an earlier start placed; {env}=false in the app container switches the placed "
           "publisher off there.", boolean, commands=("run",)),
    Option("inject_dir", "Directory where --inject places the publisher: one of the socket "
           "volume, which the app container mounts (default: 'python' beside the socket, e.g. "
           "/run/gpu-sidecar/python). Its files are read-only and replaced in one rename; a "
           "directory holding other files is left alone.", socket_path_like, commands=("run",)),
    Option("app_stale_after", "Seconds after which an app's silent allocator and latency figures "
           "stop being exported, and a GPU it no longer announces is forgotten (default {default}).",
           seconds(1, 86400), commands=("run",)),
    Option("app_max_processes", "Most publishing processes tracked per GPU (default {default}); "
           "beyond it, once no tracked process is silent past --app-stale-after, messages are "
           "refused (reason too_many_processes).", positive_int(1, 4096), commands=("run",)),
    Option("app_max_gpus", "Most GPUs the app may announce (default {default}); with NVML only its "
           "visible GPUs are accepted anyway (reasons too_many_gpus, unknown_gpu).",
           positive_int(1, 1024), commands=("run",)),
    Option("app_max_buckets", "Most latency buckets per histogram (default {default}); "
           "a histogram with more is refused (reason too_many_buckets).", positive_int(1, 1024),
           commands=("run",)),
    Option("app_max_message_bytes", "Largest datagram accepted from the app, in bytes (default "
           "{default}, the size sidecar.client splits at; 1024..65536); a "
           "larger one is refused (reason too_large).", positive_int(1024, 65536),
           commands=("run",)),
    Option("app_process_series", "Also export per-process allocator series "
           "(gpu_app_process_*, labelled pid): one set per live process, at most "
           "--app-max-processes per GPU. Every worker restart makes new series; off by default.",
           boolean, flag_only=True, commands=("run",)),
    Option("pcie_peak_bytes_per_second", "Calibrated per-direction PCIe peak in bytes/s to divide "
           "by instead of the link's theoretical maximum (default: from max link gen x width).",
           positive_float, commands=("run", "probe", "diagnose")),
    Option("gpu_retry_interval", "Seconds between attempts to re-open a lost GPU (default {default}).",
           seconds(1, 3600), commands=("run",)),
    Option("no_nvml", "Run without NVML: export (diagnose: judge) only the app's allocator and "
           "latency figures.", boolean, flag_only=True, commands=("run", "probe", "diagnose")),
    Option("output", "stdout format (default {default}): 'auto' ('table' when stdout is a "
           "terminal, 'prometheus' otherwise), 'table' (one row per GPU with the three layers, the app's "
           "p50/p99 and a verdict, redrawn in place every --interval on a terminal; on a dumb "
           "terminal (TERM=dumb or unset) 'auto' gives 'prometheus' and 'table' prints plain "
           "frames one after another, without escape codes), "
           "'prometheus' (text exposition with millisecond timestamps) or 'json' (one series per "
           "line); diagnose and fleet: 'json' prints one JSON document (docs/diagnose.md), anything "
           "else the text.", choice("auto", "table", "prometheus", "json"),
           commands=("run", "diagnose", "fleet")),
    Option("stdout", "Also write every series to stdout (in --output format) when receivers are "
           "configured, e.g. to watch what is pushed.", boolean, flag_only=True, commands=("run",)),
    Option("once", "Take one sample cycle, print it and exit.", boolean, flag_only=True,
           commands=("run",)),
    Option("dry_run", "Check the configuration, NVML, the socket path, the spool volume, each "
           "receiver (one request that stores nothing: an empty remote-write or OTLP request, "
           "a Pushgateway status read) and each engine endpoint, print what was found and exit: "
           "0 all good, 1 a check failed, 2 configuration error.", boolean, flag_only=True,
           commands=("run",)),
    Option("metrics_listen", "Also serve the last cycle's series on http://ADDR/metrics in the "
           "Prometheus text format, for a Prometheus that scrapes (HOST:PORT, e.g. "
           "0.0.0.0:9400 or 127.0.0.1:9400; off by default: no port is opened unless given).",
           listen_address, commands=("run",)),
    Option("duration", "Seconds diagnose judges (1..3600; default {default}): the last ones of the "
           "running agent's window (it holds 15 minutes), or, with --fresh or no agent beside, "
           "sampled from now. The shipped alerts wait 3 to 10 minutes before firing; a longer "
           "window is steadier.", seconds(1, 3600), commands=("diagnose", "fleet")),
    Option("fresh", "diagnose: sample afresh for --duration seconds instead of asking the agent "
           "running beside it for its window (a second NVML session; the app's figures are not "
           "judged while that agent holds the app socket).", boolean, flag_only=True,
           commands=("diagnose",)),
    Option("simulate", "Use a built-in simulated GPU node instead of NVML: {choices}. Every "
           "series says 'Simulated' in gpu_name.", commands=("run", "probe", "diagnose")),
    Option("simulate_gpus", "Number of simulated GPUs (1..16; default per scenario).", gpu_count,
           commands=("run", "probe", "diagnose")),
    Option("no_simulated_app", "With --simulate: do not start the simulated model server (nor "
           "its simulated engine endpoint), so that a real app (sidecar.client) is the only "
           "publisher on the socket.", boolean, flag_only=True, commands=("run", "diagnose")),
    Option("log_format", "Log format on stderr (default {default}): 'auto' (JSON unless stderr "
           "is a terminal), 'json' or 'console'.", choice("auto", "json", "console"),
           commands=("run", "probe", "diagnose", "resend-rejected", "status", "fleet")),
    Option("log_level", "Log level: debug, info, warning or error (default {default} for run; "
           "warning for probe, diagnose, resend-rejected and status, whose printed report says "
           "what info would).",
           choice("debug", "info", "warning", "error"),
           commands=("run", "probe", "diagnose", "resend-rejected", "status", "fleet")),
    Option("alive", "Only say whether the agent's cycles run: exit 0 while its status file is "
           "younger than three intervals (at least 30 s), 1 otherwise; for a liveness probe.",
           boolean, flag_only=True, commands=("status",)),
    Option("pod_namespace", "Label 'namespace' on every series (downward API: "
           "metadata.namespace).", label, commands=("run",)),
    Option("pod_name", "Label 'pod' on every series (downward API: metadata.name).", label,
           commands=("run",)),
    Option("pod_container", "Label 'container': the app container whose GPUs these are.", label,
           commands=("run",)),
    Option("node_name", "Label 'node' on every series (downward API: spec.nodeName).", label,
           commands=("run",)),
    Option("remote_write_url", "Prometheus remote-write receiver URL (VictoriaMetrics, vmagent, "
           "Prometheus with --web.enable-remote-write-receiver, Mimir, Thanos); repeat the flag "
           "or separate with commas for several. Without any receiver: stdout.", urls,
           commands=("run", "resend-rejected"), repeatable=True, show=shown_urls),
    Option("otlp_url", "OpenTelemetry OTLP/HTTP metrics URL, the full path (an OpenTelemetry "
           "Collector: http://HOST:4318/v1/metrics; Prometheus 3: /api/v1/otlp/v1/metrics; "
           "VictoriaMetrics: /opentelemetry/v1/metrics); protobuf, gzip, with the same spool, "
           "credentials and TLS options as remote-write; repeat the flag or separate with commas "
           "for several.", urls, commands=("run", "resend-rejected"), repeatable=True, show=shown_urls),
    Option("engine_metrics_url", "The serving engine's Prometheus metrics endpoint in the pod "
           "(vLLM http://127.0.0.1:8000/metrics, SGLang :30000 with --enable-metrics, TGI :80, "
           "Triton :8002), read once per --interval by a thread of its own: its latency, queue "
           "and KV-cache figures become the engine_* series and join the verdict. Repeat the "
           "flag or separate with commas for several engines. With --simulate kv-cache-full or "
           "queueing and none given, the simulated engine's.", engine_urls,
           commands=("run", "diagnose"), repeatable=True, show=shown_urls),
    Option("engine_metrics_timeout", "Seconds one read of an engine endpoint may take, "
           "connecting and reading the whole answer (0.1..60; default {default}); it never "
           "delays a cycle, which takes the last figures read.", seconds(0.1, 60),
           commands=("run", "diagnose")),
    Option("engine_metrics_max_bytes", "Largest engine metrics answer read, in bytes (default "
           "{default} = {default_mib}); a larger one is not parsed (reason too_large).",
           positive_int(64 * 1024, 256 << 20), commands=("run", "diagnose")),
    Option("pushgateway_url", "Pushgateway base URL. Latest values only, no timestamps and no "
           "history: prefer remote-write.", url, commands=("run",), show=shown_one_url),
    Option("pushgateway_job", "Pushgateway 'job' of the grouping key (default {default}); the "
           "key adds namespace and pod (or instance=hostname).", label, commands=("run",)),
    Option("pushgateway_delete_on_exit", "Delete this pod's Pushgateway group at shutdown.",
           boolean, flag_only=True, commands=("run",)),
    Option("batch_job", "Name of the batch Job this pod runs (downward API: the label "
           "batch.kubernetes.io/job-name). Adds a run summary, pushed with the last sample to "
           "every sink and labelled job_name; the Pushgateway group becomes job + namespace + "
           "job_name, so a rerun replaces its group. Leave empty for Deployments.", job_name,
           commands=("run",)),
    Option("batch_job_index", "Completion index of this pod in an Indexed Job (downward API: "
           "the label batch.kubernetes.io/job-completion-index); with --batch-job, labels the "
           "summary job_index and joins the Pushgateway grouping key, so parallel pods of one "
           "Job keep one group each. Empty for other Jobs.", completion_index,
           commands=("run",)),
    Option("push_interval", "Seconds between pushes; samples are batched in between "
           "(default {default}).", seconds(0.1, 3600), commands=("run",)),
    Option("batch_max_samples", "A batch is flushed early when it holds this many samples "
           "(default {default}).", positive_int(100, 10_000_000), commands=("run",)),
    Option("spool_dir", "Directory of the disk spool (an emptyDir in Kubernetes; default "
           "{default}; with --simulate and no path, a temporary one).",
           socket_path_like, commands=("run", "resend-rejected")),
    Option("spool_max_bytes", "Bound of the spool in bytes per remote-write or OTLP receiver; beyond it "
           "the oldest batches are dropped and counted (default {default} = {default_mib}).",
           positive_int(4096, 1 << 40), commands=("run",)),
    Option("spool_memory_max_bytes", "Bytes per remote-write or OTLP receiver held in memory "
           "while the spool volume refuses writes (full, read-only): those batches are still "
           "sent, and written to the spool once it takes writes again; beyond this bound, or "
           "still in memory when the agent stops, they are lost and counted (default {default} "
           "= {default_mib}; 0 keeps nothing in memory).", positive_int(0, 1 << 34),
           commands=("run",)),
    Option("shutdown_timeout", "Seconds allowed at SIGTERM for the last sample and flush "
           "(default {default}); what is not sent stays in the spool.", seconds(0, 600),
           commands=("run",)),
    Option("push_timeout", "Seconds before one push request times out (default {default}).",
           seconds(0.1, 600), commands=("run", "resend-rejected")),
    Option("retry_max_backoff", "Cap in seconds of the exponential backoff between retries "
           "(default {default}); Retry-After from the receiver is honoured up to "
           f"{RETRY_AFTER_CAP_S:g}.",
           seconds(0.1, 3600), commands=("run",)),
    Option("bearer_token_file", "File holding a bearer token for the receivers; re-read when "
           "it changes (rotated Secrets).", secret_file, commands=_STORE_TOO,
           show=shown_secret_path),
    Option("basic_auth_user", "Basic-auth user name for the receivers.", basic_auth_user,
           commands=_STORE_TOO, show=hidden),
    Option("basic_auth_password_file", "File holding the basic-auth password.", secret_file,
           commands=_STORE_TOO, show=shown_secret_path),
    Option("ca_file", "PEM file of the CA that signed the receivers' certificates.",
           readable_file, commands=_STORE_TOO),
    Option("cert_file", "Client certificate (PEM) for mutual TLS.", readable_file,
           commands=_STORE_TOO),
    Option("key_file", "Private key (PEM) of the client certificate.", secret_file,
           commands=_STORE_TOO, show=shown_secret_path),
    Option("insecure_skip_verify", "Do not verify the receivers' TLS certificates (testing "
           "only).", boolean, flag_only=True, commands=_STORE_TOO),
    Option("header", "Extra HTTP header NAME=VALUE on every push (e.g. X-Scope-OrgID=tenant for "
           "Mimir); repeatable, or comma-separated.",
           pairs("header", "X-Scope-OrgID=tenant", "letters, digits and !#$%&'*+.^_`|~-",
                 lambda k: bool(HEADER_NAME.match(k))),
           commands=_STORE_TOO, repeatable=True, show=shown_pairs),
    Option("extra_label", "Extra label NAME=VALUE on every pushed series (e.g. cluster=prod); "
           "repeatable, or comma-separated.",
           pairs("label", "cluster=prod", "letters, digits and '_'; not starting with a digit or '__'",
                 lambda k: bool(LABEL_NAME.match(k)) and not k.startswith("__")),
           commands=("run",), repeatable=True, show=shown_pairs),
    Option("query_url", "diagnose and fleet: judge from long-term storage instead of this pod: "
           "the base URL of a Prometheus HTTP query API (Prometheus and VictoriaMetrics "
           "http://HOST:PORT, the VictoriaMetrics cluster http://vmselect:8481/select/TENANT/"
           "prometheus, Mimir http://HOST/prometheus, Thanos Query http://HOST:10902); "
           "/api/v1/query is added. The receivers' credentials and TLS options apply "
           "(--bearer-token-file, --basic-auth-user, --header X-Scope-OrgID=TENANT, --ca-file).",
           url, commands=("diagnose", "fleet"), show=shown_one_url),
    Option("select", "With --query-url: which GPUs, as LABEL=VALUE (also LABEL!=VALUE, "
           "LABEL=~REGEX, LABEL!~REGEX) on the agents' labels: namespace, pod, node, container, "
           "gpu_uuid, gpu_index, job_name (a batch Job), or an extra label such as cluster; "
           "repeat the flag (all must match) or separate with commas (a value cannot hold one). "
           "Default: every GPU the store holds.", selectors, commands=("diagnose", "fleet"),
           repeatable=True),
    Option("at", "With --query-url: when the window ends (default {default}): an RFC 3339 time "
           "with its zone (2025-01-31T03:00:00Z, 2025-01-31T04:00:00+01:00), Unix seconds, or "
           "relative to now (now-6h, now-90m, or --at=-30s: a bare -6h would read as a "
           "flag); the window is the --duration seconds before it.", instant_text,
           commands=("diagnose", "fleet")),
    Option("query_timeout", "With --query-url: seconds one query to the store may take, "
           "connecting and reading the whole answer (1..600; default {default}).",
           seconds(1, 600), commands=("diagnose", "fleet")),
)
OPTION_BY_NAME = {o.name: o for o in OPTIONS}
assert set(OPTION_BY_NAME) == {f.name for f in fields(Config)}
DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(Config)}


def shown_default(value: Any) -> str:
    """A default as one would write it on the command line: 5, not 5.0."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def help_text(opt: Option, choices: Choices | None = None) -> str:
    """The --help text of ``opt``: its default is the one of ``Config``, written nowhere else;
    the names it takes, where they live above this module, from ``choices``."""
    default = DEFAULTS[opt.name]
    text = opt.help.replace("{default}", shown_default(default)).replace("{env}", opt.env)
    if "{choices}" in text:
        names = (choices or {}).get(opt.name)
        text = text.replace("{choices}", ", ".join(names) if names else opt.name.upper())
    if "{default_mib}" in text:
        text = text.replace("{default_mib}", f"{shown_default(default / (1 << 20))} MiB")
    return f"{text} [env {opt.env}]"


def add_arguments(parser: argparse.ArgumentParser, command: str,
                  choices: Choices | None = None) -> None:
    for opt in OPTIONS:
        if command not in opt.commands:
            continue
        text = help_text(opt, choices)
        if opt.repeatable:
            parser.add_argument(opt.flag, dest=opt.name, action="append", default=None,
                                metavar=opt.name.upper(), help=text)
        elif opt.flag_only:
            parser.add_argument(opt.flag, dest=opt.name, action="store_const", const="true",
                                default=None, help=text)
        else:
            parser.add_argument(opt.flag, dest=opt.name, default=None, metavar=opt.name.upper(),
                                help=text)


def build(command: str, args: argparse.Namespace, env: Mapping[str, str] = os.environ,
          choices: Choices | None = None) -> Config:
    """Flags over environment over defaults, every value validated; an option named in
    ``choices`` takes only the names given there (refused as ``choice`` refuses)."""
    values = _given_values(command, args, env, choices or {})
    _refuse_unknown_env(command, env)
    config = Config(**values)
    _check_flag_pairs(config)
    _check_command_fit(command, config)
    return config


def _given_values(command: str, args: argparse.Namespace, env: Mapping[str, str],
                  choices: Choices) -> dict[str, Any]:
    """Each option of ``command`` that a flag or (failing that) the environment gives, parsed;
    the first value refused stops the start, naming where it came from."""
    values: dict[str, Any] = {}
    for opt in OPTIONS:
        if command not in opt.commands:
            continue
        raw = getattr(args, opt.name, None)
        if isinstance(raw, list):
            raw = ",".join(raw)
        origin = opt.flag
        if raw is None and opt.env in env:
            raw, origin = env[opt.env], opt.env
        if raw is None:
            continue
        try:
            _utf8(raw)
            values[opt.name] = opt.parse(raw)
            if opt.name in choices:
                choice(*choices[opt.name])(raw)
        except ValueError as exc:
            raise ConfigError(_refused(opt, origin, raw, exc, command)) from None
    return values


def _refuse_unknown_env(command: str, env: Mapping[str, str]) -> None:
    """A GPU_SIDECAR_ variable that names no option is a typo: refused, not silently ignored."""
    unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and
                     k.removeprefix(ENV_PREFIX).lower() not in OPTION_BY_NAME)
    if unknown:
        raise ConfigError(
            f"unknown environment variable(s) {', '.join(unknown)}: check the spelling against "
            f"gpu-sidecar {command} --help"
        )


def _check_flag_pairs(config: Config) -> None:
    """Options that exclude each other, or need another beside them: each valid alone, refused
    together (or apart), in the order a person reading --help meets them."""
    if config.no_nvml and config.simulate:
        raise ConfigError("--no-nvml and --simulate exclude each other: pick one")
    if config.no_nvml and config.gpus == "visible":
        raise ConfigError("--gpus visible needs NVML; with --no-nvml use 'announced' or UUIDs")
    if config.no_simulated_app and not config.simulate:
        raise ConfigError("--no-simulated-app only applies with --simulate SCENARIO")
    if config.simulate_gpus is not None and not config.simulate:
        raise ConfigError("--simulate-gpus only applies with --simulate SCENARIO")
    if config.key_file and not config.cert_file:
        raise ConfigError("--key-file needs --cert-file (the client certificate it belongs to)")
    if config.insecure_skip_verify and config.ca_file:
        raise ConfigError("--insecure-skip-verify and --ca-file contradict each other: pick one")
    if config.basic_auth_password_file and not config.basic_auth_user:
        raise ConfigError("--basic-auth-password-file needs --basic-auth-user")
    if config.bearer_token_file and config.basic_auth_user:
        raise ConfigError("give either a bearer token or basic auth, not both")
    if config.pushgateway_delete_on_exit and not config.pushgateway_url:
        raise ConfigError("--pushgateway-delete-on-exit needs --pushgateway-url")
    if config.batch_job_index and not config.batch_job:
        raise ConfigError("--batch-job-index needs --batch-job (the Job it is an index of)")
    if config.pushgateway_delete_on_exit and config.batch_job:
        raise ConfigError("--pushgateway-delete-on-exit would delete the group that keeps the run "
                          "summary of --batch-job: leave it off for Jobs (it is for Deployments)")
    if config.once and config.metrics_listen:
        raise ConfigError("--once exits after one cycle, which leaves nothing to scrape: drop "
                          "--metrics-listen (GPU_SIDECAR_METRICS_LISTEN) or --once")
    if config.once and config.dry_run:
        raise ConfigError("--once and --dry-run exclude each other: --dry-run takes no sample")
    clash = sorted({k for k, _ in config.extra_label} & RESERVED_LABELS)
    if clash:
        raise ConfigError(f"--extra-label may not set {', '.join(clash)}: the agent sets those")


def _check_command_fit(command: str, config: Config) -> None:
    """Options that depend on the command: what asks the store needs its URL and samples
    nothing here; --once prints, so it pushes nowhere."""
    if not config.query_url:
        given = [o.flag for o in (OPTION_BY_NAME["select"], OPTION_BY_NAME["at"])
                 if getattr(config, o.name) != DEFAULTS[o.name]]
        if command == "fleet":
            raise ConfigError("fleet asks the long-term storage the agents push to: give its "
                              "query URL with --query-url (GPU_SIDECAR_QUERY_URL), e.g. "
                              "http://victoria-metrics:8428")
        if given:
            raise ConfigError(f"{' and '.join(given)} only apply with --query-url (the store "
                              "to ask): give it, or drop them")
    elif config.fresh or config.simulate:
        raise ConfigError("--query-url judges what the store holds: it does not combine with "
                          f"{'--fresh' if config.fresh else '--simulate'} (sampling here)")
    if command in ("fleet", "diagnose") and config.output == "prometheus":
        raise ConfigError(f"{command} --output takes auto, table (the text report) or json")
    if config.once and config.has_receivers:
        raise ConfigError("--once prints one cycle to stdout and exits: it does not combine with "
                          "receivers (--remote-write-url / GPU_SIDECAR_REMOTE_WRITE_URL, "
                          "--otlp-url / GPU_SIDECAR_OTLP_URL, --pushgateway-url / "
                          "GPU_SIDECAR_PUSHGATEWAY_URL); drop --once to push, or unset the "
                          "receiver to print; --dry-run checks the receivers without pushing")


def _utf8(raw: str) -> None:
    """Bytes the locale could not decode reach Python as lone surrogates; as a label or a path
    they would fail later, on every cycle, far from their cause."""
    try:
        raw.encode()
    except UnicodeEncodeError:
        raise ValueError("is not valid UTF-8 text (bytes that do not decode, e.g. Latin-1 from "
                         "a file or a shell with another locale)") from None


def _refused(opt: Option, origin: str, raw: str, exc: ValueError, command: str) -> str:
    """The error for a value ``opt`` refused: quoted as ``opt.show`` allows, which for values that
    may hold a secret is masked or not at all (the message goes to terminals and pod logs)."""
    shown = opt.show(raw.encode(errors="surrogateescape").decode(errors="replace"))
    where = origin if shown is None else f"{origin}={shown}"
    return (f"{where}: {exc}. Fix the value of {opt.flag} / {opt.env} "
            f"(see gpu-sidecar {command} --help).")


def describe(config: Config) -> dict[str, Any]:
    """The effective configuration for the start-up log line: file paths, never their content;
    URLs without user-info; header values hidden (they may carry tenants or keys)."""
    out = {f.name: getattr(config, f.name) for f in fields(config)}
    out["remote_write_url"] = [redact_url(u) for u in config.remote_write_url]
    out["otlp_url"] = [redact_url(u) for u in config.otlp_url]
    out["engine_metrics_url"] = [redact_url(u) for u in config.engine_metrics_url]
    if config.pushgateway_url:
        out["pushgateway_url"] = redact_url(config.pushgateway_url)
    out["header"] = [k for k, _ in config.header]
    return out


def version_line() -> str:
    return f"gpu-sidecar {__version__}"

