"""Command line (Contract 3): ``gpu-sidecar run``, ``probe``, ``diagnose``, ``status`` and
``resend-rejected``."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

import structlog

from sidecar import config, signals, wiring
from sidecar.durability.spool import SpoolError
from sidecar.log import configure
from sidecar.simulate.scenarios import SCENARIOS
from sidecar.sources.app_socket import SocketUnavailable
from sidecar.sources.nvml import NvmlUnavailable

if TYPE_CHECKING:
    pass

log = structlog.get_logger("sidecar.cli")

# names whose list lives above the configuration (config.Choices): --simulate's scenarios are
# the simulator's own, so a new scenario is named in sidecar/simulate/scenarios.py alone
CHOICES: config.Choices = {"simulate": SCENARIOS}

OPTIONS_NOTE = """\
Every option can also be set by the environment variable shown in brackets; a flag wins over
its variable. Units: seconds for times, bytes and bytes/s for sizes and rates.
"""
EPILOG = OPTIONS_NOTE + """
Pod identity: set --pod-namespace, --pod-name and --node-name from the downward API
(metadata.namespace, metadata.name, spec.nodeName) and --pod-container to the app container's
name; they become the labels namespace, pod, node and container on every series.
"""


STORE_EXITS = """\
With --query-url (the long-term storage): 6 the store did not answer within --query-timeout,
7 it refused the credentials (401, 403), 8 it refused the query (too many series, too long a
range); 2 also when no GPU matches --select in the window or --at is not a time.
"""


DIAGNOSE_EPILOG = """\
Exit codes: 0 nothing found, 1 a bottleneck found on at least one GPU (or a GPU lost), 2
configuration error (also: no GPU to judge), 3 NVML unavailable, 130 interrupted by SIGINT
(Ctrl-C) and 143 by SIGTERM before the window ended (the report then printed is marked PARTIAL).
Beside a running agent (its diagnose.sock next to the app socket) the answer comes from the
agent's window (the last 15 minutes, every layer); --fresh samples from now instead, and then,
the app socket being held, the app layer is not judged and, with --gpus announced, every visible
GPU is judged on its NVML layers. Without NVML, --no-nvml judges the app layer only.
""" + STORE_EXITS + "\n" + OPTIONS_NOTE


FLEET_EPILOG = """\
Exit codes: 0 nothing found, 1 a finding on at least one GPU, 2 configuration error (also: no
GPU with data in the window).
""" + STORE_EXITS + "\n" + OPTIONS_NOTE


RESEND_EPILOG = """\
Exit codes: 0 every kept batch was taken (or none was kept), 1 some were refused again, could
not be read or were not tried (the receiver unreachable: they stay for the next round), 2
configuration error.

""" + OPTIONS_NOTE


STATUS_EPILOG = """\
Exit codes: 0 the agent's status, current; 1 its heartbeat is older than three intervals (at
least 30 s: the agent's cycles have stopped) or in the future, or, with --alive, no status; 2 no
status to read (no agent runs on this socket's directory, or the file is not one the agent
writes) or a configuration error.

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
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser,
                                metavar="{run,diagnose,fleet,probe,status,resend-rejected}")
    run = sub.add_parser("run", help="run the agent", epilog=EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         description="Sample every --interval seconds and write the series.")
    config.add_arguments(run, "run", CHOICES)
    probe = sub.add_parser("probe", help="report the GPUs, what each supports, one reading",
                           epilog=OPTIONS_NOTE, formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="One-shot report of the visible GPUs, the metrics each "
                           "supports (and why others are absent) and one reading of every layer.")
    config.add_arguments(probe, "probe", CHOICES)
    diagnose = sub.add_parser(
        "diagnose", help="say which layer explains the latency over a window",
        epilog=DIAGNOSE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Judge the last --duration seconds (the running agent's window, or sampled "
        "every --interval seconds from now), then name per GPU the layer (compute, memory, IO, "
        "health, engine) that explains the latency, with the figures behind the verdict and "
        "what to do. Thresholds: those of the shipped alert rules "
        "(sidecar/thresholds.py).")
    config.add_arguments(diagnose, "diagnose", CHOICES)
    fleet = sub.add_parser(
        "fleet", help="every GPU in long-term storage, grouped by verdict, worst first",
        epilog=FLEET_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Ask the long-term storage the agents push to (--query-url) for every GPU "
        "with data in the window (--at, --duration, --select): grouped by the agents' own "
        "verdicts, worst first, one line per GPU with namespace, pod, node and the figure that "
        "decided. A fixed number of aggregate queries, whatever the fleet's size.")
    config.add_arguments(fleet, "fleet", CHOICES)
    resend = sub.add_parser(
        "resend-rejected", help="send again the batches a receiver refused for their data",
        epilog=RESEND_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Send every batch kept in the spool's rejected/ (refused by a receiver for "
        "its data: 400, 413, 422) to its receiver once more, oldest first; each is deleted only "
        "once accepted. Give the configuration the agent runs with (in a pod: kubectl exec into "
        "the sidecar container, whose environment has it). Runs beside a running agent.")
    config.add_arguments(resend, "resend-rejected", CHOICES)
    status = sub.add_parser(
        "status", help="what the running agent knows: sinks, app processes, GPUs, engines",
        epilog=STATUS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Read the status the running agent writes beside its socket (status.json) "
        "and print it: per sink the last success, backlog and failures; per app process the "
        "last message, and the app's rejected messages by reason; the GPUs exported and why; "
        "per engine endpoint whether it is read. Give the agent's --socket (in a pod: kubectl "
        "exec into the sidecar container, whose environment has it).")
    config.add_arguments(status, "status", CHOICES)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = config.build(args.command, args, choices=CHOICES)
    except config.ConfigError as exc:
        print(f"gpu-sidecar: configuration error: {exc}", file=sys.stderr)
        return 2
    configure(cfg.log_format, _log_level(args, cfg))
    try:
        if args.command == "probe":
            signals.restore_defaults()
            from sidecar.commands.probe import probe

            return probe(cfg)
        if args.command == "diagnose":
            from sidecar.commands.diagnose import diagnose

            return diagnose(cfg)
        if args.command == "fleet":
            from sidecar.commands.fleet import fleet

            return fleet(cfg)
        if args.command == "status":
            from sidecar.commands.status import status

            return status(cfg, alive=cfg.alive)
        if args.command == "resend-rejected":
            signals.restore_defaults()
            return wiring.resend_rejected(cfg)
        if cfg.dry_run:
            from sidecar.commands.dry_run import dry_run

            return dry_run(cfg)
        return wiring.run(cfg)
    except config.ConfigError as exc:  # found once NVML was open
        return _fail(args.command, "configuration_error", f"configuration error: {exc}", 2)
    except NvmlUnavailable as exc:
        return _fail(args.command, "nvml_unavailable", str(exc), 3)
    except SocketUnavailable as exc:
        return _fail(args.command, "app_socket_unavailable", str(exc), 4)
    except SpoolError as exc:
        return _fail(args.command, "spool_unavailable", str(exc), 5)


def _log_level(args: argparse.Namespace, cfg: config.Config) -> str:
    """probe and diagnose print a report for a person: their info lines (GPUs opened, metrics
    absent) would say it a second time, so they log warnings and errors unless a level is given."""
    given = args.log_level is not None or config.OPTION_BY_NAME["log_level"].env in os.environ
    return cfg.log_level if args.command == "run" or given else "warning"


def _fail(command: str, event: str, message: str, code: int) -> int:
    """Say why the command stops, once: the agent as a log line (its pod's log is where an
    operator looks; on a terminal the line is readable text), the other commands, which print
    a report for a person, as one line of text on stderr."""
    if command == "run":
        log.error(event, error=message)
    else:
        print(f"gpu-sidecar: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
