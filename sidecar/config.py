"""All configuration in one place: every option is a flag and a ``GPU_SIDECAR_*`` variable.

The table ``OPTIONS`` drives the argument parser, the environment lookup and ``--help``; the
result is one frozen ``Config`` validated before anything starts, with errors that name the flag,
the variable and the fix.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import SplitResult, urlsplit

from sidecar import __version__, protocol
from sidecar.urls import effective_port, redact_url

ENV_PREFIX = protocol.ENV_PREFIX
RESERVED_LABELS = frozenset({"gpu_uuid", "gpu_name", "gpu_index", "namespace", "pod", "container",
                             "node", "pid", "le", "sink", "reason", "job", "instance", "version",
                             "mode", "job_name", "job_index", "figure", "condition", "engine",
                             "endpoint", "model"})


# The names an option takes where their list lives above this module: the scenarios of
# --simulate are declared by sidecar.simulate.scenarios, which the configuration may not import
# (tests/test_layout.py). The command line, which may, passes them (option name -> names) to
# add_arguments (its help's "{choices}") and to build (the same check and error as _choice's).
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


def _seconds(low: float, high: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or not low <= value <= high:
            raise ValueError(f"must be between {low} and {high} seconds")
        return value

    return parse


def _positive_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError("must be a positive number")
    return value


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}")
        return text

    return parse


def _gpus(text: str) -> str:
    text = text.strip()
    if text in ("announced", "visible"):
        return text
    uuids = [u.strip() for u in text.split(",") if u.strip()]
    if not uuids:
        raise ValueError("give 'announced', 'visible' or a comma-separated list of GPU UUIDs")
    for u in uuids:
        if not protocol.UUID_RE.match(u):
            raise ValueError(f"{u!r} is not a GPU UUID (GPU-... or MIG-..., see nvidia-smi -L)")
    return ",".join(uuids)


_SUN_PATH_MAX = 107  # bytes of a Unix socket path (sockaddr_un.sun_path, less its NUL)


def _socket_path(text: str) -> str:
    if not text.startswith("/"):
        raise ValueError("must be an absolute path")
    if len(text.encode()) > _SUN_PATH_MAX:
        raise ValueError(f"is longer than the {_SUN_PATH_MAX} bytes a Unix socket path may have")
    return text


def _socket_path_like(text: str) -> str:
    if not text.startswith("/"):
        raise ValueError("must be an absolute path")
    return text


def _gpu_count(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 16:
        raise ValueError("must be between 1 and 16")
    return value


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("must be true or false")


def _urls(text: str) -> tuple[str, ...]:
    """Comma-separated receiver URLs, each valid, no receiver twice."""
    urls = tuple(u.strip() for u in text.split(",") if u.strip())
    if not urls:
        raise ValueError("give at least one URL")
    for n, u in enumerate(urls, 1):
        try:
            _url(u)
        except ValueError as exc:
            raise ValueError(f"URL {n} of {len(urls)} {exc}" if len(urls) > 1 else str(exc)) from None
    _refuse_repeats(urls)
    return urls


def _engine_urls(text: str) -> tuple[str, ...]:
    """Engine endpoints: URLs like the receivers', but with no credentials (none is ever sent to
    an engine, and a URL's user-info would be)."""
    try:
        urls = _urls(text)
    except ValueError as exc:
        if "names the receiver of URL" not in str(exc):
            raise
        raise ValueError(str(exc).split(" (", 1)[0].replace("receiver", "endpoint")
                         + ": the engine would be read, and its requests counted, twice; give "
                         "each endpoint once") from None
    for n, u in enumerate(urls, 1):
        if "@" in urlsplit(u).netloc:
            raise ValueError(f"URL {n} of {len(urls)} holds credentials (user@): the agent sends "
                             "none to an engine; expose its metrics without authentication on "
                             "localhost" if len(urls) > 1 else "holds credentials (user@): the "
                             "agent sends none to an engine; expose its metrics without "
                             "authentication on localhost")
    return urls


def _url(text: str) -> str:
    """An http(s) URL with a host and a valid port, if any.

    The messages never quote ``text``: it may hold a password (build() shows it masked). urlsplit's
    own errors quote parts of it, so they are replaced."""
    try:
        parts = urlsplit(text)
        host = parts.hostname
    except ValueError:
        raise ValueError("cannot be read as a URL: write http[s]://HOST[:PORT]/PATH (percent-encode "
                         "'@', '/', '?', '#', '[' and ']' inside a user name or password)") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError("does not start with http:// or https://")
    port = _port(parts)
    if not host:
        raise ValueError("has no host: write http[s]://HOST[:PORT]/PATH")
    if not parts.netloc.rpartition("@")[2].startswith("[") and not _HOST.fullmatch(host):
        raise ValueError("has a host with characters a host name cannot hold (letters, digits, "
                         "'.', '-', '_'; an IPv6 address goes in [brackets])")
    if port == 0:
        raise ValueError("has port 0: give a port from 1 to 65535, or none for the default")
    if "@" in parts.path + parts.query + parts.fragment:
        raise ValueError("has an '@' after the host, which a password with an unencoded '/', '?' or "
                         "'#' leaves behind: percent-encode those (%2F, %3F, %23), or better, give "
                         "the password with --basic-auth-password-file")
    return text


def _port(parts: SplitResult) -> int | None:
    """urlsplit's port, which raises for a port that is not a number from 0 to 65535."""
    try:
        return parts.port
    except ValueError:
        raise ValueError("has a port that is not a number from 1 to 65535") from None


def _receiver(url: str) -> tuple[str, str, int, str, str]:
    """What identifies a receiver: credentials, case of scheme and host, a default port and an
    empty path make no difference."""
    parts = urlsplit(url)
    return parts.scheme, parts.hostname or "", effective_port(parts), parts.path or "/", parts.query


def _refuse_repeats(urls: tuple[str, ...]) -> None:
    """The same receiver twice would get every sample twice (two sinks, one spool directory)."""
    first: dict[tuple[str, str, int, str, str], int] = {}
    for n, url in enumerate(urls, 1):
        m = first.setdefault(_receiver(url), n)
        if m != n:
            raise ValueError(f"URL {n} names the receiver of URL {m} again ({shown_url(url)}; URLs "
                             "that differ only in credentials, letter case or a default port are "
                             "the same receiver): every sample would be pushed to it twice; give "
                             "each receiver once")


def shown_url(text: str) -> str:
    """``text`` fit for an error message: no user-info, query values and fragment masked, a port
    that is not a number masked.

    Done by hand, not with urlsplit: the URL is shown because it is broken, and a broken one is
    where urlsplit raises (a bad port) or files part of an unencoded password under host, port or
    path. Cutting at the last '@' anywhere removes user-info however it was mangled."""
    scheme, sep, rest = text.strip().partition("://")
    if not sep:
        scheme, rest = "", text.strip()
    userinfo = ""
    if "@" in rest:
        userinfo, rest = "***@", rest.rpartition("@")[2]
    rest, hash_sign, _ = rest.partition("#")
    rest, question, query = rest.partition("?")
    authority, slash, path = rest.partition("/")
    shown = f"{scheme}{sep}{userinfo}{_masked_port(authority)}{slash}{path}"
    if question:
        shown += "?" + "&".join(f"{k}=***" if eq else "***"
                                for k, eq, _ in (p.partition("=") for p in query.split("&")))
    return shown + ("#***" if hash_sign else "")


def _masked_port(authority: str) -> str:
    """``host:port`` with a port that is not digits masked: it may be the start of a password
    whose '@' was lost (an unencoded ',' splits the URL list there)."""
    host, colon, port = authority.rpartition(":")
    if not colon or "]" in port or port.isdigit() or not port:
        return authority
    return f"{host}:***"


def _shown_urls(text: str) -> str:
    """A comma-separated list as the URL parser splits it, each URL masked."""
    return repr(", ".join(shown_url(u) for u in text.split(",") if u.strip()))


def _shown_one_url(text: str) -> str:
    return repr(shown_url(text))


def _readable_file(text: str) -> str:
    if not os.path.isfile(text) or not os.access(text, os.R_OK):
        raise ValueError("is not a readable file")
    return text


def _secret_file(text: str) -> str:
    """A file holding a secret. A value that is not an absolute path is often the secret itself,
    pasted where its file belongs; the error says so instead of quoting it."""
    try:
        return _readable_file(text)
    except ValueError:
        if text.startswith("/"):
            raise
        raise ValueError("is not a readable file; give the absolute path of a file holding the "
                         "secret (e.g. a mounted Kubernetes Secret), not the secret itself (the "
                         "value is not shown: it is not an absolute path, so it may be the secret)") from None


def _shown_secret_path(text: str) -> str | None:
    """Absolute paths are shown; anything else may be the secret itself (see _secret_file)."""
    return repr(text) if text.startswith("/") else None


def _basic_auth_user(text: str) -> str:
    """RFC 7617 ends the user name at the first ':', so one in it is a password given here."""
    if ":" in text:
        raise ValueError("contains ':', which basic auth does not allow in a user name (it is not "
                         "shown: the rest may be a password); give the password with "
                         "--basic-auth-password-file")
    return text


def _hidden(text: str) -> None:
    """For options whose refused value is not quoted at all."""
    return None


def _pairs(kind: str, example: str, rule: str,
           check_key: Callable[[str], bool]) -> Callable[[str], tuple[tuple[str, str], ...]]:
    """Comma-separated NAME=VALUE items. Errors name the item by position, never by text: a
    malformed item is often a header with its value (``Authorization: Bearer ...``)."""

    def parse(text: str) -> tuple[tuple[str, str], ...]:
        out = []
        items = [i.strip() for i in text.split(",") if i.strip()]
        for n, item in enumerate(items, 1):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"item {n} has no '=': write NAME=VALUE, e.g. {example}, not "
                                 "NAME: VALUE (the item is not shown: it may hold a secret)")
            if not check_key(key.strip()):
                raise ValueError(f"item {n} has no valid {kind} name before its '=' ({rule}; "
                                 "the item is not shown: it may hold a secret)")
            out.append((key.strip(), value.strip()))
        return tuple(out)

    return parse


def _shown_pairs(text: str) -> str:
    """NAME=*** for the items that have a name, ``<item N>`` for the others; values never."""
    shown = []
    for n, item in enumerate((i.strip() for i in text.split(",") if i.strip()), 1):
        key, sep, _ = item.partition("=")
        shown.append(f"{key.strip()}=***" if sep and _HEADER_NAME.match(key.strip()) else f"<item {n}>")
    return "[" + ", ".join(shown) + "]"


def _positive_int(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise ValueError(f"must be between {low} and {high}")
        return value

    return parse


_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")
_HOST = re.compile(r"[\w.-]+")  # \w: internationalised names too


def _label(text: str) -> str:
    if len(text) > 253 or not re.fullmatch(r"[A-Za-z0-9._\-]*", text):
        raise ValueError("must be a Kubernetes name (letters, digits, '.', '-', '_')")
    return text


def _listen_address(text: str) -> str:
    """HOST:PORT to listen on: an IPv4 address, [IPv6], a host name, or empty for every
    address; the port 1..65535."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError("must be HOST:PORT with a port from 1 to 65535, e.g. 0.0.0.0:9400")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if bare and not (_HOST.fullmatch(bare) or (":" in bare and host.startswith("["))):
        raise ValueError("has a host that is no address or host name (an IPv6 address goes "
                         "in [brackets])")
    return text


def _job_name(text: str) -> str:
    """A Job's name as the label batch.kubernetes.io/job-name carries it: it becomes a path
    segment of the Pushgateway's grouping URL, where '.' or '..' would be normalised away."""
    if text and (len(text) > 63 or not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", text)):
        raise ValueError("must be a Kubernetes Job name: at most 63 lowercase letters, digits, "
                         "'-' or '.', starting and ending with a letter or digit")
    return text


def _completion_index(text: str) -> str:
    if text and not re.fullmatch(r"0|[1-9][0-9]{0,8}", text):
        raise ValueError("must be a Job completion index: a whole number from 0, or empty")
    return text


_SELECT = re.compile(r"^([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)(.*)$")


def _selectors(text: str) -> tuple[tuple[str, str, str], ...]:
    """Comma-separated label matchers, PromQL's four operators; a regex must compile."""
    out = []
    for n, item in enumerate((i.strip() for i in text.split(",") if i.strip()), 1):
        m = _SELECT.match(item)
        if m is None or m.group(1).startswith("__"):
            raise ValueError(f"item {n} is not LABEL=VALUE (or LABEL!=VALUE, LABEL=~REGEX, "
                             "LABEL!~REGEX; a label name is letters, digits and '_', not "
                             "starting with a digit or '__'), e.g. namespace=prod")
        label, op, value = m.group(1), m.group(2), m.group(3).strip()
        if "~" in op:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"item {n} has a regular expression that does not compile "
                                 f"({exc})") from None
        out.append((label, op, value))
    return tuple(out)


_RELATIVE = re.compile(r"^(?:now)?\s*-\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def instant(text: str, now: float) -> float:
    """Unix seconds of an --at value: 'now', relative to ``now`` (-6h), Unix seconds, or an
    RFC 3339 time with its zone (a time without one would depend on the machine's zone)."""
    import datetime

    text = text.strip()
    if text == "now":
        return now
    if m := _RELATIVE.match(text):
        return now - float(m.group(1)) * _UNIT_S[m.group(2)]
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError("is neither 'now', a relative time (-6h, -90m, -30s, -2d), Unix seconds "
                         "nor an RFC 3339 time (2025-01-31T03:00:00Z)") from None
    if when.tzinfo is None:
        raise ValueError("has no time zone: add one (Z for UTC, or +02:00), the machine's own "
                         "zone is not assumed")
    return when.timestamp()


def _instant_text(text: str) -> str:
    instant(text, 0.0)
    return text.strip()


# the receivers' HTTP options also reach the store of --query-url (diagnose, fleet)
_STORE_TOO = ("run", "resend-rejected", "diagnose", "fleet")


OPTIONS: tuple[Option, ...] = (
    Option("interval", "Seconds between samples (0.1..3600; default {default}). GPM figures are averages "
           "over this interval.", _seconds(0.1, 3600), commands=("run", "diagnose")),
    Option("gpus", "Which GPUs to sample (run exports them, diagnose judges them; probe reports "
           "every visible GPU and only checks that the UUIDs named are visible; default "
           "{default}): 'announced' (the GPUs the app announced over the socket), 'visible' "
           "(every GPU NVML shows this container) or a comma-separated list of GPU/MIG UUIDs.", _gpus,
           commands=("run", "probe", "diagnose")),
    Option("socket", "Path of the app's Unix datagram socket (default {default}; the client "
           "reads {env} too). With --simulate and no path given, a private temporary one. The "
           "agent writes its status (gpu-sidecar status) beside it, as status.json.",
           _socket_path,
           commands=("run", "probe", "diagnose", "status")),
    Option("inject", "Place the injected publisher at start, before the socket is bound: a "
           "standard-library copy of the app-side publisher and a sitecustomize.py in "
           "--inject-dir, so that an app container with that directory on its PYTHONPATH "
           "publishes the allocator figures of the CUDA devices each of its Python processes "
           "uses, with no code change (default {default}). 'false' places nothing and removes "
           "what an earlier start placed; {env}=false in the app container switches the placed "
           "publisher off there.", _bool, commands=("run",)),
    Option("inject_dir", "Directory where --inject places the publisher: one of the socket "
           "volume, which the app container mounts (default: 'python' beside the socket, e.g. "
           "/run/gpu-sidecar/python). Its files are read-only and replaced in one rename; a "
           "directory holding other files is left alone.", _socket_path_like, commands=("run",)),
    Option("app_stale_after", "Seconds after which an app's silent allocator and latency figures "
           "stop being exported, and a GPU it no longer announces is forgotten (default {default}).",
           _seconds(1, 86400), commands=("run",)),
    Option("app_max_processes", "Most publishing processes tracked per GPU (default {default}); "
           "beyond it, once no tracked process is silent past --app-stale-after, messages are "
           "refused (reason too_many_processes).", _positive_int(1, 4096), commands=("run",)),
    Option("app_max_gpus", "Most GPUs the app may announce (default {default}); with NVML only its "
           "visible GPUs are accepted anyway (reasons too_many_gpus, unknown_gpu).",
           _positive_int(1, 1024), commands=("run",)),
    Option("app_max_buckets", "Most latency buckets per histogram (default {default}); "
           "a histogram with more is refused (reason too_many_buckets).", _positive_int(1, 1024),
           commands=("run",)),
    Option("app_max_message_bytes", "Largest datagram accepted from the app, in bytes (default "
           "{default}, the size sidecar.client splits at; 1024..65536); a "
           "larger one is refused (reason too_large).", _positive_int(1024, 65536),
           commands=("run",)),
    Option("app_process_series", "Also export per-process allocator series "
           "(gpu_app_process_*, labelled pid): one set per live process, at most "
           "--app-max-processes per GPU. Every worker restart makes new series; off by default.",
           _bool, flag_only=True, commands=("run",)),
    Option("pcie_peak_bytes_per_second", "Calibrated per-direction PCIe peak in bytes/s to divide "
           "by instead of the link's theoretical maximum (default: from max link gen x width).",
           _positive_float, commands=("run", "probe", "diagnose")),
    Option("gpu_retry_interval", "Seconds between attempts to re-open a lost GPU (default {default}).",
           _seconds(1, 3600), commands=("run",)),
    Option("no_nvml", "Run without NVML: export (diagnose: judge) only the app's allocator and "
           "latency figures.", _bool, flag_only=True, commands=("run", "probe", "diagnose")),
    Option("output", "stdout format (default {default}): 'auto' ('table' when stdout is a "
           "terminal, 'prometheus' otherwise), 'table' (one row per GPU with the three layers, the app's "
           "p50/p99 and a verdict, redrawn in place every --interval on a terminal; on a dumb "
           "terminal (TERM=dumb or unset) 'auto' gives 'prometheus' and 'table' prints plain "
           "frames one after another, without escape codes), "
           "'prometheus' (text exposition with millisecond timestamps) or 'json' (one series per "
           "line); diagnose and fleet: 'json' prints one JSON document (docs/diagnose.md), anything "
           "else the text.", _choice("auto", "table", "prometheus", "json"),
           commands=("run", "diagnose", "fleet")),
    Option("stdout", "Also write every series to stdout (in --output format) when receivers are "
           "configured, e.g. to watch what is pushed.", _bool, flag_only=True, commands=("run",)),
    Option("once", "Take one sample cycle, print it and exit.", _bool, flag_only=True,
           commands=("run",)),
    Option("dry_run", "Check the configuration, NVML, the socket path, the spool volume, each "
           "receiver (one request that stores nothing: an empty remote-write or OTLP request, "
           "a Pushgateway status read) and each engine endpoint, print what was found and exit: "
           "0 all good, 1 a check failed, 2 configuration error.", _bool, flag_only=True,
           commands=("run",)),
    Option("metrics_listen", "Also serve the last cycle's series on http://ADDR/metrics in the "
           "Prometheus text format, for a Prometheus that scrapes (HOST:PORT, e.g. "
           "0.0.0.0:9400 or 127.0.0.1:9400; off by default: no port is opened unless given).",
           _listen_address, commands=("run",)),
    Option("duration", "Seconds diagnose judges (1..3600; default {default}): the last ones of the "
           "running agent's window (it holds 15 minutes), or, with --fresh or no agent beside, "
           "sampled from now. The shipped alerts wait 3 to 10 minutes before firing; a longer "
           "window is steadier.", _seconds(1, 3600), commands=("diagnose", "fleet")),
    Option("fresh", "diagnose: sample afresh for --duration seconds instead of asking the agent "
           "running beside it for its window (a second NVML session; the app's figures are not "
           "judged while that agent holds the app socket).", _bool, flag_only=True,
           commands=("diagnose",)),
    Option("simulate", "Use a built-in simulated GPU node instead of NVML: {choices}. Every "
           "series says 'Simulated' in gpu_name.", commands=("run", "probe", "diagnose")),
    Option("simulate_gpus", "Number of simulated GPUs (1..16; default per scenario).", _gpu_count,
           commands=("run", "probe", "diagnose")),
    Option("no_simulated_app", "With --simulate: do not start the simulated model server (nor "
           "its simulated engine endpoint), so that a real app (sidecar.client) is the only "
           "publisher on the socket.", _bool, flag_only=True, commands=("run", "diagnose")),
    Option("log_format", "Log format on stderr (default {default}): 'auto' (JSON unless stderr "
           "is a terminal), 'json' or 'console'.", _choice("auto", "json", "console"),
           commands=("run", "probe", "diagnose", "resend-rejected", "status", "fleet")),
    Option("log_level", "Log level: debug, info, warning or error (default {default} for run; "
           "warning for probe, diagnose, resend-rejected and status, whose printed report says "
           "what info would).",
           _choice("debug", "info", "warning", "error"),
           commands=("run", "probe", "diagnose", "resend-rejected", "status", "fleet")),
    Option("alive", "Only say whether the agent's cycles run: exit 0 while its status file is "
           "younger than three intervals (at least 30 s), 1 otherwise; for a liveness probe.",
           _bool, flag_only=True, commands=("status",)),
    Option("pod_namespace", "Label 'namespace' on every series (downward API: "
           "metadata.namespace).", _label, commands=("run",)),
    Option("pod_name", "Label 'pod' on every series (downward API: metadata.name).", _label,
           commands=("run",)),
    Option("pod_container", "Label 'container': the app container whose GPUs these are.", _label,
           commands=("run",)),
    Option("node_name", "Label 'node' on every series (downward API: spec.nodeName).", _label,
           commands=("run",)),
    Option("remote_write_url", "Prometheus remote-write receiver URL (VictoriaMetrics, vmagent, "
           "Prometheus with --web.enable-remote-write-receiver, Mimir, Thanos); repeat the flag "
           "or separate with commas for several. Without any receiver: stdout.", _urls,
           commands=("run", "resend-rejected"), repeatable=True, show=_shown_urls),
    Option("otlp_url", "OpenTelemetry OTLP/HTTP metrics URL, the full path (an OpenTelemetry "
           "Collector: http://HOST:4318/v1/metrics; Prometheus 3: /api/v1/otlp/v1/metrics; "
           "VictoriaMetrics: /opentelemetry/v1/metrics); protobuf, gzip, with the same spool, "
           "credentials and TLS options as remote-write; repeat the flag or separate with commas "
           "for several.", _urls, commands=("run", "resend-rejected"), repeatable=True, show=_shown_urls),
    Option("engine_metrics_url", "The serving engine's Prometheus metrics endpoint in the pod "
           "(vLLM http://127.0.0.1:8000/metrics, SGLang :30000 with --enable-metrics, TGI :80, "
           "Triton :8002), read once per --interval by a thread of its own: its latency, queue "
           "and KV-cache figures become the engine_* series and join the verdict. Repeat the "
           "flag or separate with commas for several engines. With --simulate kv-cache-full or "
           "queueing and none given, the simulated engine's.", _engine_urls,
           commands=("run", "diagnose"), repeatable=True, show=_shown_urls),
    Option("engine_metrics_timeout", "Seconds one read of an engine endpoint may take, "
           "connecting and reading the whole answer (0.1..60; default {default}); it never "
           "delays a cycle, which takes the last figures read.", _seconds(0.1, 60),
           commands=("run", "diagnose")),
    Option("engine_metrics_max_bytes", "Largest engine metrics answer read, in bytes (default "
           "{default} = {default_mib}); a larger one is not parsed (reason too_large).",
           _positive_int(64 * 1024, 256 << 20), commands=("run", "diagnose")),
    Option("pushgateway_url", "Pushgateway base URL. Latest values only, no timestamps and no "
           "history: prefer remote-write.", _url, commands=("run",), show=_shown_one_url),
    Option("pushgateway_job", "Pushgateway 'job' of the grouping key (default {default}); the "
           "key adds namespace and pod (or instance=hostname).", _label, commands=("run",)),
    Option("pushgateway_delete_on_exit", "Delete this pod's Pushgateway group at shutdown.",
           _bool, flag_only=True, commands=("run",)),
    Option("batch_job", "Name of the batch Job this pod runs (downward API: the label "
           "batch.kubernetes.io/job-name). Adds a run summary, pushed with the last sample to "
           "every sink and labelled job_name; the Pushgateway group becomes job + namespace + "
           "job_name, so a rerun replaces its group. Leave empty for Deployments.", _job_name,
           commands=("run",)),
    Option("batch_job_index", "Completion index of this pod in an Indexed Job (downward API: "
           "the label batch.kubernetes.io/job-completion-index); with --batch-job, labels the "
           "summary job_index and joins the Pushgateway grouping key, so parallel pods of one "
           "Job keep one group each. Empty for other Jobs.", _completion_index,
           commands=("run",)),
    Option("push_interval", "Seconds between pushes; samples are batched in between "
           "(default {default}).", _seconds(0.1, 3600), commands=("run",)),
    Option("batch_max_samples", "A batch is flushed early when it holds this many samples "
           "(default {default}).", _positive_int(100, 10_000_000), commands=("run",)),
    Option("spool_dir", "Directory of the disk spool (an emptyDir in Kubernetes; default "
           "{default}; with --simulate and no path, a temporary one).",
           _socket_path_like, commands=("run", "resend-rejected")),
    Option("spool_max_bytes", "Bound of the spool in bytes per remote-write or OTLP receiver; beyond it "
           "the oldest batches are dropped and counted (default {default} = {default_mib}).",
           _positive_int(4096, 1 << 40), commands=("run",)),
    Option("spool_memory_max_bytes", "Bytes per remote-write or OTLP receiver held in memory "
           "while the spool volume refuses writes (full, read-only): those batches are still "
           "sent, and written to the spool once it takes writes again; beyond this bound, or "
           "still in memory when the agent stops, they are lost and counted (default {default} "
           "= {default_mib}; 0 keeps nothing in memory).", _positive_int(0, 1 << 34),
           commands=("run",)),
    Option("shutdown_timeout", "Seconds allowed at SIGTERM for the last sample and flush "
           "(default {default}); what is not sent stays in the spool.", _seconds(0, 600),
           commands=("run",)),
    Option("push_timeout", "Seconds before one push request times out (default {default}).",
           _seconds(0.1, 600), commands=("run", "resend-rejected")),
    Option("retry_max_backoff", "Cap in seconds of the exponential backoff between retries "
           "(default {default}); Retry-After from the receiver is honoured up to "
           f"{RETRY_AFTER_CAP_S:g}.",
           _seconds(0.1, 3600), commands=("run",)),
    Option("bearer_token_file", "File holding a bearer token for the receivers; re-read when "
           "it changes (rotated Secrets).", _secret_file, commands=_STORE_TOO,
           show=_shown_secret_path),
    Option("basic_auth_user", "Basic-auth user name for the receivers.", _basic_auth_user,
           commands=_STORE_TOO, show=_hidden),
    Option("basic_auth_password_file", "File holding the basic-auth password.", _secret_file,
           commands=_STORE_TOO, show=_shown_secret_path),
    Option("ca_file", "PEM file of the CA that signed the receivers' certificates.",
           _readable_file, commands=_STORE_TOO),
    Option("cert_file", "Client certificate (PEM) for mutual TLS.", _readable_file,
           commands=_STORE_TOO),
    Option("key_file", "Private key (PEM) of the client certificate.", _secret_file,
           commands=_STORE_TOO, show=_shown_secret_path),
    Option("insecure_skip_verify", "Do not verify the receivers' TLS certificates (testing "
           "only).", _bool, flag_only=True, commands=_STORE_TOO),
    Option("header", "Extra HTTP header NAME=VALUE on every push (e.g. X-Scope-OrgID=tenant for "
           "Mimir); repeatable, or comma-separated.",
           _pairs("header", "X-Scope-OrgID=tenant", "letters, digits and !#$%&'*+.^_`|~-",
                  lambda k: bool(_HEADER_NAME.match(k))),
           commands=_STORE_TOO, repeatable=True, show=_shown_pairs),
    Option("extra_label", "Extra label NAME=VALUE on every pushed series (e.g. cluster=prod); "
           "repeatable, or comma-separated.",
           _pairs("label", "cluster=prod", "letters, digits and '_'; not starting with a digit or '__'",
                  lambda k: bool(_LABEL_NAME.match(k)) and not k.startswith("__")),
           commands=("run",), repeatable=True, show=_shown_pairs),
    Option("query_url", "diagnose and fleet: judge from long-term storage instead of this pod: "
           "the base URL of a Prometheus HTTP query API (Prometheus and VictoriaMetrics "
           "http://HOST:PORT, the VictoriaMetrics cluster http://vmselect:8481/select/TENANT/"
           "prometheus, Mimir http://HOST/prometheus, Thanos Query http://HOST:10902); "
           "/api/v1/query is added. The receivers' credentials and TLS options apply "
           "(--bearer-token-file, --basic-auth-user, --header X-Scope-OrgID=TENANT, --ca-file).",
           _url, commands=("diagnose", "fleet"), show=_shown_one_url),
    Option("select", "With --query-url: which GPUs, as LABEL=VALUE (also LABEL!=VALUE, "
           "LABEL=~REGEX, LABEL!~REGEX) on the agents' labels: namespace, pod, node, container, "
           "gpu_uuid, gpu_index, job_name (a batch Job), or an extra label such as cluster; "
           "repeat the flag (all must match) or separate with commas (a value cannot hold one). "
           "Default: every GPU the store holds.", _selectors, commands=("diagnose", "fleet"),
           repeatable=True),
    Option("at", "With --query-url: when the window ends (default {default}): an RFC 3339 time "
           "with its zone (2025-01-31T03:00:00Z, 2025-01-31T04:00:00+01:00), Unix seconds, or "
           "relative to now (now-6h, now-90m, or --at=-30s: a bare -6h would read as a "
           "flag); the window is the --duration seconds before it.", _instant_text,
           commands=("diagnose", "fleet")),
    Option("query_timeout", "With --query-url: seconds one query to the store may take, "
           "connecting and reading the whole answer (1..600; default {default}).",
           _seconds(1, 600), commands=("diagnose", "fleet")),
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
    ``choices`` takes only the names given there (refused as ``_choice`` refuses)."""
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
                _choice(*choices[opt.name])(raw)
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

