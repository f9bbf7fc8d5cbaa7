"""``gpu-sidecar run --dry-run``: check what a start would need, say what was found, exit.

Nothing is spooled or stored: NVML is opened, every GPU read once (the NVML check says how long
that reading held NVML, per GPU and its costliest calls, measured by the agent's own wrapper) and
closed, the socket's and the spool's
directories are checked for writing with a file created and removed (the socket is not bound,
but a live process listening on it fails the check, and so does another agent holding a
receiver's spool: the tests by which ``run`` stops with exit 4 and 5), each receiver gets one
request that stores nothing (an empty remote-write or OTLP request, which the spooled sinks also
use to tell a wrong URL from bad data; the Pushgateway's status page), and each engine endpoint
one read. Exit 0 when every check passed, 1 when one failed (each said with what to do), 2 for a
configuration error (before any check, like ``run``).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from sidecar.urls import redact_url

if TYPE_CHECKING:
    from sidecar.config import Config
    from sidecar.samples import GpuIdentity
    from sidecar.sources.nvml.timed import CallTime, Meter

Check = tuple[bool, str]  # passed, what was found


def dry_run(cfg: Config, *, out: Callable[[str], object] = sys.stdout.write) -> int:
    from sidecar import wiring

    # with --simulate and the default paths the run uses a private temporary socket and spool:
    # those are checked, not /run/gpu-sidecar and /var/lib/gpu-sidecar, which it never touches
    with wiring.simulated_paths(cfg) as cfg:
        return _dry_run(cfg, out)


def _dry_run(cfg: Config, out: Callable[[str], object]) -> int:
    checks: list[tuple[str, Check]] = [
        ("configuration", (True, _configuration(cfg))),
        ("NVML", _nvml(cfg)),
        ("app socket", _app_socket(cfg)),
        ("spool", _spool(cfg)),
    ]
    if cfg.metrics_listen:
        checks.append(("--metrics-listen", _listen(cfg.metrics_listen)))
    checks += [(f"receiver {redact_url(url)}", _receiver(cfg, kind, url))
               for kind, url in _receivers(cfg)]
    checks += [(f"engine {redact_url(url)}", _engine(cfg, url)) for url in cfg.engine_metrics_url]
    failed = [name for name, (ok, _) in checks if not ok]
    for name, (ok, found) in checks:
        out(f"{'ok    ' if ok else 'FAILED'} {name}: {found}\n")
    out(f"dry run: {len(checks) - len(failed)} of {len(checks)} checks passed"
        + (f"; failed: {', '.join(failed)}\n" if failed
           else "; nothing was kept or sent (one reading of each GPU, timed only)\n"))
    return 1 if failed else 0


def _configuration(cfg: Config) -> str:
    receivers = [redact_url(u) for _, u in _receivers(cfg)]
    return (f"--interval {cfg.interval:g} s, --gpus {cfg.gpus}, "
            + (f"receivers: {', '.join(receivers)}" if receivers else
               "no receiver" + ("" if cfg.metrics_listen and not cfg.stdout else ": stdout"))
            + (f", /metrics on {cfg.metrics_listen}" if cfg.metrics_listen else ""))


def _listen(address: str) -> Check:
    from sidecar.sinks.scrape import ListenError, ScrapeSink

    try:
        ScrapeSink(address).close(0.0)
    except ListenError as exc:
        return False, str(exc.strerror)
    return True, f"{address} can be listened on (/metrics)"


def _receivers(cfg: Config) -> list[tuple[str, str]]:
    return ([("remote_write", u) for u in cfg.remote_write_url]
            + [("otlp", u) for u in cfg.otlp_url]
            + ([("pushgateway", cfg.pushgateway_url)] if cfg.pushgateway_url else []))


def _nvml(cfg: Config) -> Check:
    if cfg.no_nvml:
        return True, "not used (--no-nvml): the app's figures only"
    from sidecar import wiring
    from sidecar.sources.nvml import NvmlUnavailable, timed

    try:
        with wiring.nvml(cfg) as (source, _):
            assert source is not None
            devices = source.devices()
            before = timed.totals()
            source.read([d.uuid for d in devices])
            spent = timed.since(before)
            per_gpu = source.last_read_nvml
    except NvmlUnavailable as exc:
        return False, str(exc)
    except Exception as exc:  # a named GPU not visible, and the like: said as the run would
        return False, str(exc)
    names = ", ".join(f"GPU {d.index} {d.name}" for d in devices) or "no GPU visible"
    if not devices:
        return False, (f"0 GPU(s): {names} (check NVIDIA_VISIBLE_DEVICES and the container "
                       "runtime)")
    return True, f"{len(devices)} GPU(s): {names}; " + _nvml_time(devices, spent, per_gpu)


NVML_CALLS_SHOWN = 5  # the costliest calls the check names


def _nvml_time(devices: list[GpuIdentity], spent: dict[str, CallTime],
               per_gpu: dict[str, Meter]) -> str:
    """What the one reading of every GPU cost in NVML, measured by the agent's own wrapper: the
    driver's time the model server would wait on, per GPU and the costliest calls. It is the
    first reading (counters and GPM take their first sample, the throughput fallback its first
    20 ms window), so it shows each call the run makes every cycle and the slow ones it makes
    every few seconds."""
    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.3f} ms"

    gpus = ", ".join(f"GPU {d.index} {ms(m.seconds)} ({m.calls} calls)" for d in devices
                     if (m := per_gpu.get(d.uuid)) is not None)
    top = ", ".join(f"{name} {ms(c.seconds)} x{c.calls}"
                    for name, c in list(spent.items())[:NVML_CALLS_SHOWN])
    return (f"one reading held NVML {ms(sum(c.seconds for c in spent.values()))} in "
            f"{sum(c.calls for c in spent.values())} calls (per GPU: {gpus or 'none'}; "
            f"costliest: {top or 'none'})")


def _writable_dir(path: Path, what: str) -> Check:
    """Writable if it exists (a file created and removed), or creatable: its nearest existing
    parent writable (nothing is created then)."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(20, "not a directory")
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".gpu-sidecar-dry-run-"):
            pass
    except OSError as exc:
        return False, (f"{what} {path} is not writable ({existing}: {exc.strerror}); it must be "
                       "a volume the agent's user can write (an emptyDir in Kubernetes)")
    if existing != path:
        return True, f"{what} {path} does not exist yet; the agent can create it in {existing}"
    return True, f"{what} {path} is writable"


def _app_socket(cfg: Config) -> Check:
    """The socket's directory writable, and no live process listening on the socket: the test
    ``run`` makes before it binds (``app_socket.bind_unix``: a connect that is answered), where
    it stops with exit 4 (a second agent beside the first)."""
    import errno
    import socket

    path = cfg.socket
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError as exc:
        # ENOENT: no socket; ECONNREFUSED: a stale one, which run replaces; anything else
        # (not a socket, no permission) is run's to say, as it binds
        if exc.errno not in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK):
            return False, f"cannot probe {path}: {exc.strerror}"
    else:
        return False, (f"another process is listening on {path} (a gpu-sidecar already running "
                       "with this socket?): `run` would stop with exit 4; stop it or choose "
                       "another --socket path")
    finally:
        probe.close()
    return _writable_dir(Path(path).parent, "the socket's directory")


def _spool_holder(directory: Path) -> str | None:
    """The pid (as written) of another agent holding ``directory``'s lock, or None: the lock
    ``run`` takes (``Spool``: flock on ``.lock``), tried without blocking and let go at once;
    a spool never used has no ``.lock`` and none is made."""
    import fcntl
    import os

    try:
        fd = os.open(directory / ".lock", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.read(fd, 32).decode(errors="replace").strip() or "unknown"
    except OSError:
        return None
    finally:
        os.close(fd)  # the lock, if taken, goes with it
    return None


def _spool_dirs(cfg: Config) -> list[Path]:
    """The directories ``run`` would lock, one per URL, named as its sinks are."""
    from sidecar import wiring
    from sidecar.durability.spool import spool_dir_name
    from sidecar.sinks.otlp import sink_name as otlp_name
    from sidecar.sinks.remote_write import sink_name

    named = (wiring._named(cfg.remote_write_url, sink_name)
             + wiring._named(cfg.otlp_url, otlp_name))
    return [Path(cfg.spool_dir) / spool_dir_name(name, url) for url, name in named]


def _spool(cfg: Config) -> Check:
    if not (cfg.remote_write_url or cfg.otlp_url):
        return True, "not used (no remote-write or OTLP receiver)"
    for directory in _spool_dirs(cfg):
        holder = _spool_holder(directory)
        if holder is not None:
            return False, (f"spool directory {directory} is in use by another gpu-sidecar (pid "
                           f"{holder}): `run` would stop with exit 5; give each agent its own "
                           "--spool-dir / GPU_SIDECAR_SPOOL_DIR")
    ok, found = _writable_dir(Path(cfg.spool_dir), "the spool directory")
    if not ok:
        return ok, found
    # the spool may not exist yet (a first start creates it): the volume it will be made on
    free = shutil.disk_usage(next(p for p in (Path(cfg.spool_dir), *Path(cfg.spool_dir).parents)
                                  if p.exists())).free
    need = cfg.spool_max_bytes * (len(cfg.remote_write_url) + len(cfg.otlp_url))
    if free < need:
        return True, (f"{found}; NOTE: {free} bytes free, less than the {need} bytes the spool "
                      "may use (--spool-max-bytes per receiver): a long outage fills the volume "
                      "first")
    return True, f"{found}, {free} bytes free"


def _receiver(cfg: Config, kind: str, url: str) -> Check:
    from sidecar.sinks.answers import REMOTE_WRITE, Refused, Retryable
    from sidecar.sinks.http import Http

    http = Http(cfg)
    try:
        if kind == "pushgateway":
            status = url.rstrip("/") + "/api/v1/status"
            response = http.request("GET", status)
            http.check(response, REMOTE_WRITE)  # the policy its pushes use
            return True, f"the Pushgateway answers (GET {redact_url(status)}: {response.status_code})"
        codec = _codec(kind)
        response = http.request("POST", url, data=codec.compress(b""), headers=codec.headers)
        http.check(response, codec.policy)
        return True, (f"takes an empty {kind.replace('_', '-')} request (HTTP "
                      f"{response.status_code}): the URL and credentials are right")
    except Refused as exc:
        said = " ".join(str(exc).split())  # one line per check, whatever the receiver's body
        if kind == "pushgateway":
            hint = ("is this a Pushgateway? give its base URL (e.g. http://pushgateway:9091), "
                    "without a path")
        elif exc.about_data:  # an empty request holds no data: it is the URL that is refused
            hint = ("even an empty request is refused, so the receiver objects to the URL, not "
                    f"the data: {_codec(kind).policy.url_hint(url)}")
        else:
            hint = exc.hint
        return False, f"refused: {said}" + (f" ({hint})" if hint else "")
    except Retryable as exc:
        return False, f"no answer: {exc}"
    finally:
        http.close()


def _codec(kind: str):  # type: ignore[no-untyped-def]
    if kind == "remote_write":
        from sidecar.sinks.remote_write import RemoteWriteCodec

        return RemoteWriteCodec()
    from sidecar.sinks.otlp import OtlpCodec, default_resource

    return OtlpCodec(default_resource())


def _engine(cfg: Config, url: str) -> Check:
    from sidecar import wiring
    from sidecar.sources.engine import EngineEndpoint
    from sidecar.sources.engine.endpoint import HINTS

    endpoint = EngineEndpoint(url, wiring.engine_fetch(cfg), interval_s=cfg.interval,
                              timeout_s=cfg.engine_metrics_timeout)
    endpoint.read_once()
    figures = endpoint.current()
    if figures is None:
        reason = next((r for r, n in endpoint.failures.items() if n), "unknown")
        return False, f"{reason}: {HINTS.get(reason, '')}"
    return True, (f"{figures.engine}: {', '.join(sorted(figures.figures))}"
                  + (f"; models {', '.join(figures.models)}" if figures.models else ""))

