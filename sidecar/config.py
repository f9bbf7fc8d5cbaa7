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

from sidecar import __version__, protocol

ENV_PREFIX = "GPU_SIDECAR_"
SCENARIOS = ("healthy", "pcie-saturated", "fragmented", "low-occupancy", "gpu-lost", "old-driver")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Config:
    interval: float = 5.0
    gpus: str = "announced"
    socket: str = protocol.DEFAULT_SOCKET_PATH
    app_stale_after: float = 30.0
    pcie_peak_bytes_per_second: float | None = None
    gpu_retry_interval: float = 30.0
    no_nvml: bool = False
    output: str = "prometheus"
    once: bool = False
    simulate: str | None = None
    simulate_gpus: int | None = None
    log_format: str = "auto"
    log_level: str = "info"
    pod_namespace: str = ""
    pod_name: str = ""
    pod_container: str = ""
    node_name: str = ""

    def gpu_list(self) -> tuple[str, ...]:
        """Explicit UUIDs, or () for the ``announced`` and ``visible`` modes."""
        if self.gpus in ("announced", "visible"):
            return ()
        return tuple(u.strip() for u in self.gpus.split(",") if u.strip())

    def pod_labels(self) -> dict[str, str]:
        pairs = {"namespace": self.pod_namespace, "pod": self.pod_name,
                 "container": self.pod_container, "node": self.node_name}
        return {k: v for k, v in pairs.items() if v}


@dataclass(frozen=True)
class Option:
    name: str
    help: str
    parse: Callable[[str], Any] = str
    flag_only: bool = False  # boolean switch
    commands: tuple[str, ...] = ("run", "probe")

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


def _socket_path(text: str) -> str:
    if not text.startswith("/"):
        raise ValueError("must be an absolute path")
    if len(text.encode()) > 107:
        raise ValueError("is longer than the 107 bytes a Unix socket path may have")
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


def _label(text: str) -> str:
    if len(text) > 253 or not re.fullmatch(r"[A-Za-z0-9._\-]*", text):
        raise ValueError("must be a Kubernetes name (letters, digits, '.', '-', '_')")
    return text


OPTIONS: tuple[Option, ...] = (
    Option("interval", "Seconds between samples (0.1..3600; default 5). GPM figures are averages "
           "over this interval.", _seconds(0.1, 3600)),
    Option("gpus", "Which GPUs to export: 'announced' (default: the GPUs the app announced over "
           "the socket), 'visible' (every GPU NVML shows this container) or a comma-separated "
           "list of GPU/MIG UUIDs.", _gpus),
    Option("socket", "Path of the app's Unix datagram socket (default "
           f"{protocol.DEFAULT_SOCKET_PATH}; the client reads {protocol.SOCKET_ENV} too). With "
           "--simulate and no path given, a private temporary one.", _socket_path),
    Option("app_stale_after", "Seconds after which an app's silent allocator and latency figures "
           "stop being exported (default 30).", _seconds(1, 86400)),
    Option("pcie_peak_bytes_per_second", "Calibrated per-direction PCIe peak in bytes/s to divide "
           "by instead of the link's theoretical maximum (default: from max link gen x width).",
           _positive_float),
    Option("gpu_retry_interval", "Seconds between attempts to re-open a lost GPU (default 30).",
           _seconds(1, 3600)),
    Option("no_nvml", "Run without NVML: export only the app's allocator and latency figures.",
           _bool, flag_only=True),
    Option("output", "stdout format: 'prometheus' (text exposition with timestamps, default) or "
           "'json' (one series per line).", _choice("prometheus", "json"), commands=("run",)),
    Option("once", "Take one sample cycle, print it and exit.", _bool, flag_only=True,
           commands=("run",)),
    Option("simulate", "Use a built-in simulated GPU node instead of NVML: "
           + ", ".join(SCENARIOS) + ". Every series says 'Simulated' in gpu_name.",
           _choice(*SCENARIOS)),
    Option("simulate_gpus", "Number of simulated GPUs (1..16; default per scenario).", _gpu_count),
    Option("log_format", "Log format on stderr: 'auto' (JSON unless stderr is a terminal), "
           "'json' or 'console'.", _choice("auto", "json", "console")),
    Option("log_level", "Log level: debug, info, warning or error (default info).",
           _choice("debug", "info", "warning", "error")),
    Option("pod_namespace", "Label 'namespace' on every series (downward API: "
           "metadata.namespace).", _label),
    Option("pod_name", "Label 'pod' on every series (downward API: metadata.name).", _label),
    Option("pod_container", "Label 'container': the app container whose GPUs these are.", _label),
    Option("node_name", "Label 'node' on every series (downward API: spec.nodeName).", _label),
)
OPTION_BY_NAME = {o.name: o for o in OPTIONS}
assert set(OPTION_BY_NAME) == {f.name for f in fields(Config)}


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    for opt in OPTIONS:
        if command not in opt.commands:
            continue
        text = f"{opt.help} [env {opt.env}]"
        if opt.flag_only:
            parser.add_argument(opt.flag, dest=opt.name, action="store_const", const="true",
                                default=None, help=text)
        else:
            parser.add_argument(opt.flag, dest=opt.name, default=None, metavar=opt.name.upper(),
                                help=text)


def build(command: str, args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> Config:
    """Flags over environment over defaults, every value validated."""
    values: dict[str, Any] = {}
    for opt in OPTIONS:
        if command not in opt.commands:
            continue
        raw = getattr(args, opt.name, None)
        origin = opt.flag
        if raw is None and opt.env in env:
            raw, origin = env[opt.env], opt.env
        if raw is None:
            continue
        try:
            values[opt.name] = opt.parse(raw)
        except ValueError as exc:
            raise ConfigError(
                f"{origin}={raw!r}: {exc}. Fix the value of {opt.flag} / {opt.env} "
                f"(see gpu-sidecar {command} --help)."
            ) from None
    unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and
                     k.removeprefix(ENV_PREFIX).lower() not in OPTION_BY_NAME and
                     k != protocol.SOCKET_ENV)
    if unknown:
        raise ConfigError(
            f"unknown environment variable(s) {', '.join(unknown)}: check the spelling against "
            f"gpu-sidecar {command} --help"
        )
    config = Config(**values)
    if config.no_nvml and config.simulate:
        raise ConfigError("--no-nvml and --simulate exclude each other: pick one")
    if config.no_nvml and config.gpus == "visible":
        raise ConfigError("--gpus visible needs NVML; with --no-nvml use 'announced' or UUIDs")
    if config.simulate_gpus is not None and not config.simulate:
        raise ConfigError("--simulate-gpus only applies with --simulate SCENARIO")
    return config


def describe(config: Config) -> dict[str, Any]:
    """The effective configuration for the start-up log line."""
    return {f.name: getattr(config, f.name) for f in fields(config)}


def version_line() -> str:
    return f"gpu-sidecar {__version__}"


def env_names(options: Sequence[Option] = OPTIONS) -> list[str]:
    return [o.env for o in options]
