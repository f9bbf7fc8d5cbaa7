"""Placing the injected publisher in the socket volume, before the agent binds its socket (the
socket is what the pod's startupProbe waits for, so an app container never starts before the
files are there).

The layout is the one Kubernetes' own atomic writer gives ConfigMap volumes, so one rename
replaces every file at once and the directory itself may be a volume's mount point::

    python/                               (0555 where the agent owns it)
      sitecustomize.py        -> ..data/sitecustomize.py
      _gpu_sidecar_inject.py  -> ..data/_gpu_sidecar_inject.py
      __pycache__             -> ..data/__pycache__
      ..data                  -> ..0.1.0-<digest of the contents>
      ..0.1.0-<digest>/                   (0555, its files 0444; __pycache__: the bytecode of
                                           the agent's own Python, hash-checked, PEP 552)

A start that finds the same contents changes nothing (idempotent across restarts); other
contents are written into a temporary directory, renamed to their own name, and ``..data`` is
switched to it with one ``rename`` of a symbolic link. The previous version stays until the next
change (a process may be opening it right now), older ones are removed. A directory that holds
anything else is not ours and is left alone. Nothing here stops the agent: a read-only or absent
volume is one warning, and the agent runs on without the injection.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import py_compile
import re
import secrets
import stat
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from sidecar import __version__, config, protocol
from sidecar.inject import FILES, INJECT_NAME

log = structlog.get_logger("sidecar.inject")

PAYLOAD = Path(__file__).with_name("payload")
FILE_MODE = 0o444
DIR_MODE = 0o555
DATA = "..data"
CACHE = "__pycache__"  # the agent's own Python's bytecode, checked against the source's hash
_OURS = re.compile(r"\A\.\.(data|data-tmp-[0-9a-f]+|tmp-[0-9a-f]+|[0-9A-Za-z.+_-]+-[0-9a-f]{16})\Z")
PUBLISHER_MODULE = FILES[1]


class NotOurs(OSError):
    """The directory holds files the agent did not place: it is left alone."""


@dataclass(frozen=True)
class Placed:
    directory: Path  # what the app's PYTHONPATH names
    version_dir: Path  # where ..data points now
    changed: bool  # False: a restart found the same files and wrote nothing


def inject_dir(cfg: config.Config) -> Path:
    """``--inject-dir``, or ``python`` beside the socket."""
    return Path(cfg.inject_dir) if cfg.inject_dir else Path(cfg.socket).parent / "python"


def render(cfg: config.Config) -> dict[str, bytes]:
    """The payload's files with this agent's constants: its release, the protocol version, the
    publish interval (each agent interval, at least as often as the default one) and where the
    socket is (its name beside the directory too, when the directory is in the socket's)."""
    directory = inject_dir(cfg)
    beside = os.path.basename(cfg.socket) if directory.parent == Path(cfg.socket).parent else ""
    values: dict[str, object] = {
        "AGENT_VERSION": __version__,
        "PROTOCOL_VERSION": protocol.VERSION,
        "INTERVAL_S": float(min(cfg.interval, config.Config.interval)),
        "SOCKET_PATH": cfg.socket,
        "SOCKET_NAME": beside,
    }
    out = {}
    for name in FILES:
        text = (PAYLOAD / name).read_text(encoding="utf-8")
        if name == PUBLISHER_MODULE:
            for key, value in values.items():
                text, n = re.subn(rf"^{key} = .*$", lambda _m, k=key, v=value: f"{k} = {v!r}",
                                  text, count=1, flags=re.M)
                if n != 1:
                    raise RuntimeError(f"payload {name} has no line '{key} = ...' to set")
        out[name] = text.encode()
    return out


def apply(cfg: config.Config) -> Placed | None:
    """What ``run`` does at start: place the files (or, with ``--inject false``, remove those an
    earlier start placed). Failing to is logged once and never stops the agent."""
    directory = inject_dir(cfg)
    if not cfg.inject:
        with contextlib.suppress(OSError):
            if remove(directory):
                log.info("inject_removed", directory=str(directory),
                         note="--inject false: the injected publisher an earlier start placed is "
                              "gone; processes already running keep theirs until they exit")
        return None
    try:
        placed = place(directory, render(cfg))
    except NotOurs as exc:
        log.warning("inject_not_placed", directory=str(directory), reason="not_ours",
                    error=str(exc),
                    effect="no injected publisher: an app without client.start() publishes no "
                           "allocator figures; the agent runs on",
                    hint="give --inject-dir (GPU_SIDECAR_INJECT_DIR) an empty directory of the "
                         "socket volume, or --inject false")
        return None
    except OSError as exc:
        log.warning("inject_not_placed", directory=str(directory),
                    reason=errno.errorcode.get(exc.errno or 0, "error"),
                    error=exc.strerror or str(exc),
                    effect="no injected publisher: an app without client.start() publishes no "
                           "allocator figures; the agent runs on",
                    hint="mount the socket volume writable for the agent (an emptyDir), or point "
                         "--inject-dir (GPU_SIDECAR_INJECT_DIR) at a writable directory the app "
                         "container mounts; --inject false silences this")
        return None
    log.info("inject_placed", directory=str(directory), version=__version__,
             protocol=protocol.VERSION, publisher=f"{INJECT_NAME}/{__version__}",
             changed=placed.changed, files=list(FILES),
             note=f"an app container with PYTHONPATH={directory} publishes its CUDA devices' "
                  "allocator figures with no code change")
    return placed


def place(directory: Path, files: Mapping[str, bytes]) -> Placed:
    """Place ``files`` in ``directory`` atomically (see the module's text); raises OSError."""
    for above in (directory.parent, *directory.parent.parents):  # the first that exists
        if os.path.lexists(above):
            if not above.is_dir():
                raise OSError(errno.ENOTDIR, f"{above} is not a directory")
            break
    os.makedirs(directory.parent, mode=0o770, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o755)
    if not directory.is_dir():
        raise NotOurs(errno.ENOTDIR, f"{directory} is not a directory")
    _check_ours(directory)
    digest = hashlib.sha256(b"".join(name.encode() + b"\0" + files[name] + b"\0"
                                     for name in sorted(files))).hexdigest()[:16]
    version = f"..{re.sub(r'[^0-9A-Za-z.+_-]', '_', __version__)}-{digest}"
    previous = _readlink(directory / DATA)
    links = [*files, CACHE]
    links_ok = all(_readlink(directory / name) == f"{DATA}/{name}" for name in links)
    if previous == version and links_ok and _intact(directory / version, files):
        return Placed(directory, directory / version, changed=False)
    with _writable(directory):
        if not _intact(directory / version, files):
            _remove_tree(directory / version)
            _write_version(directory, version, files)
        if previous != version:
            _replace_link(directory, DATA, version)
        for name in links:
            if _readlink(directory / name) != f"{DATA}/{name}":
                if name == CACHE:  # one a root process of the app wrote: not ours to keep
                    _remove_tree(directory / CACHE)
                _replace_link(directory, name, f"{DATA}/{name}")
        for entry in os.listdir(directory):  # older versions, and what a crash left behind
            if _OURS.match(entry) and entry not in (DATA, version, previous):
                _remove_tree(directory / entry)
    return Placed(directory, directory / version, changed=True)


def remove(directory: Path) -> bool:
    """Remove what ``place`` put in ``directory`` (nothing if it holds anything else)."""
    if not directory.is_dir():
        return False
    _check_ours(directory)
    entries = os.listdir(directory)
    if not entries:
        return False
    with _writable(directory):
        for entry in entries:
            if entry == "__pycache__" or entry in FILES or _OURS.match(entry):
                _remove_tree(directory / entry)
    return True


def _check_ours(directory: Path) -> None:
    foreign = []
    for entry in os.listdir(directory):
        path = directory / entry
        if entry in FILES:
            if _readlink(path) != f"{DATA}/{entry}":
                foreign.append(entry)
        elif entry != "__pycache__" and not _OURS.match(entry):
            foreign.append(entry)
    if foreign:
        shown = ", ".join(sorted(foreign)[:5]) + (", ..." if len(foreign) > 5 else "")
        raise NotOurs(errno.EEXIST, f"{directory} holds files the agent did not place ({shown})")


def _pyc_names(files: Mapping[str, bytes]) -> list[str]:
    tag = sys.implementation.cache_tag
    return sorted(f"{name[:-3]}.{tag}.pyc" for name in files if name.endswith(".py"))


def _write_version(directory: Path, version: str, files: Mapping[str, bytes]) -> None:
    """The files, and their bytecode for the agent's own Python: an app on the same minor
    version loads it instead of compiling (the app cannot write bytecode to a read-only
    directory), after checking it against the source's hash (PEP 552), wherever it is mounted."""
    tmp = directory / f"..tmp-{secrets.token_hex(6)}"
    os.mkdir(tmp, 0o700)
    try:
        for name, data in files.items():
            fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        os.mkdir(tmp / CACHE, 0o700)
        for name in files:
            if name.endswith(".py"):
                py_compile.compile(str(tmp / name), cfile=str(tmp / CACHE / _pyc_names({name: b""})[0]),
                                   dfile=str(directory / name), doraise=True,
                                   invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
        for pyc in _pyc_names(files):
            os.chmod(tmp / CACHE / pyc, FILE_MODE)
        os.chmod(tmp / CACHE, DIR_MODE)
        for name in files:
            os.chmod(tmp / name, FILE_MODE)
        os.chmod(tmp, DIR_MODE)
        os.rename(tmp, directory / version)
    except BaseException:
        _remove_tree(tmp)
        raise


def _replace_link(directory: Path, name: str, target: str) -> None:
    tmp = directory / f"..data-tmp-{secrets.token_hex(6)}"
    os.symlink(target, tmp)
    try:
        os.replace(tmp, directory / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _intact(version_dir: Path, files: Mapping[str, bytes]) -> bool:
    """The version directory holds exactly ``files``, read-only."""
    try:
        if sorted(os.listdir(version_dir)) != sorted([*files, CACHE]):
            return False
        if sorted(os.listdir(version_dir / CACHE)) != _pyc_names(files):
            return False  # the agent's Python changed: bytecode of another version
        for d in (version_dir, version_dir / CACHE):
            if stat.S_IMODE(os.lstat(d).st_mode) != DIR_MODE:
                return False
        for name, data in files.items():
            st = os.lstat(version_dir / name)
            if not stat.S_ISREG(st.st_mode) or stat.S_IMODE(st.st_mode) != FILE_MODE:
                return False
            if (version_dir / name).read_bytes() != data:
                return False
    except OSError:
        return False
    return True


def _readlink(path: Path) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


@contextlib.contextmanager
def _writable(directory: Path) -> Iterator[None]:
    """The directory writable by the agent for the change, 0555 again after it (only a
    directory the agent owns: a volume's root it does not own keeps its mode)."""
    st = os.stat(directory)
    owned = st.st_uid == os.getuid()
    if owned:
        os.chmod(directory, 0o755)
    try:
        yield
    finally:
        if owned:
            with contextlib.suppress(OSError):
                os.chmod(directory, DIR_MODE)


def _remove_tree(path: Path) -> None:
    """Remove a file, link or directory of ours, read-only or not."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    with contextlib.suppress(OSError):
        os.chmod(path, 0o700)
    for entry in os.listdir(path):
        _remove_tree(path / entry)
    os.rmdir(path)

