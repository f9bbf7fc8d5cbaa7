"""Placing the injected publisher in the socket volume, before the agent binds its socket (the
socket is what the pod's startupProbe waits for, so an app container never starts before the
files are there).

The layout is the one Kubernetes' own atomic writer gives ConfigMap volumes, so one rename
replaces every file at once and the directory itself may be a volume's mount point::

    python/                               (0555 where the agent made it; a directory it found
                                           keeps its mode: the agent never chmods it)
      ..gpu-sidecar           -> gpu-sidecar-inject:created (or :found): the agent's mark
      sitecustomize.py        -> ..data/sitecustomize.py
      _gpu_sidecar_inject.py  -> ..data/_gpu_sidecar_inject.py
      _gpu_sidecar_shared.py  -> ..data/_gpu_sidecar_shared.py   (sidecar/app_shared.py)
      __pycache__             -> ..data/__pycache__
      ..data                  -> ..0.1.0-<digest of the contents>
      ..0.1.0-<digest>/                   (0555, its files 0444; __pycache__: the bytecode of
        ..gpu-sidecar -> gpu-sidecar-inject:version   the agent's own Python, hash-checked,
                                                       PEP 552)

A start that finds the same contents changes nothing (idempotent across restarts); other
contents are written into a temporary directory, renamed to their own name, and ``..data`` is
switched to it with one ``rename`` of a symbolic link. The previous version stays until the next
change (a process may be opening it right now), older ones are removed.

The agent removes, renames and chmods only what it placed itself, recognised by its marks, never
by a name alone: a link of its own is a symbolic link with the exact target it writes; a
directory of its own (a version, or a temporary one) has the name it gives them and holds the
``..gpu-sidecar`` link it creates first (a temporary directory a crash left before that link
was made is empty, and only ever ``rmdir``-ed). Nothing is followed through a symbolic link
when removing. A directory that holds anything else is not ours and is left alone, whole. The
directory's own mode is changed only where the agent made it (the top mark says so), and
``--inject false`` leaves the directory as the agent found it: its entries gone, the directory
itself too where the agent made it. A start that fails after placing (``Start``) takes back
what it placed. Nothing here stops the agent: a read-only or absent volume is one warning, and
the agent runs on without the injection.
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
from types import TracebackType

import structlog

from sidecar import __version__, config, protocol
from sidecar.inject import FILES, INJECT_NAME, PUBLISHER, SHARED, SITECUSTOMIZE

log = structlog.get_logger("sidecar.inject")

PAYLOAD = Path(__file__).with_name("payload")
# where each placed file comes from: the shared helpers are sidecar.client's own module, placed
# as they are (never a copy kept in payload/)
SOURCES: Mapping[str, Path] = {
    SITECUSTOMIZE: PAYLOAD / SITECUSTOMIZE,
    PUBLISHER: PAYLOAD / PUBLISHER,
    SHARED: Path(__file__).parent.parent / "app_shared.py",
}
FILE_MODE = 0o444
DIR_MODE = 0o555
DATA = "..data"
CACHE = "__pycache__"  # the agent's own Python's bytecode, checked against the source's hash
MARK = "..gpu-sidecar"  # a symbolic link (made in one system call): its target is the mark
MARK_CREATED = "gpu-sidecar-inject:created"  # the agent made the directory: its mode is ours
MARK_FOUND = "gpu-sidecar-inject:found"  # the directory was there: its mode is never changed
MARK_VERSION = "gpu-sidecar-inject:version"  # inside each version (and temporary) directory
LINKS = (*FILES, CACHE)
_VERSION = re.compile(r"\A\.\.[0-9A-Za-z.+_-]+-[0-9a-f]{16}\Z")
_TMP_DIR = re.compile(r"\A\.\.tmp-[0-9a-f]{12}\Z")
_TMP_LINK = re.compile(r"\A\.\.data-tmp-[0-9a-f]{12}\Z")
# what a version directory's __pycache__ holds: each file's bytecode for some Python (the
# agent's Python may change between releases), or py_compile's own temporary of one
_STEMS = "|".join(re.escape(n[:-3]) for n in FILES if n.endswith(".py"))
_PYC = re.compile(rf"\A({_STEMS})\.[0-9A-Za-z_-]+\.pyc(\.[0-9]+)?\Z")
PUBLISHER_MODULE = PUBLISHER


class NotOurs(OSError):
    """The directory holds files the agent did not place: it is left alone."""


@dataclass(frozen=True)
class Placed:
    directory: Path  # what the app's PYTHONPATH names
    version_dir: Path  # where ..data points now
    changed: bool  # False: a restart found the same files and wrote nothing
    fresh: bool = False  # nothing of the agent's was there before: a failed start removes it all
    made: tuple[Path, ...] = ()  # directories above it this start created, outermost first


@dataclass(frozen=True)
class Inventory:
    """A directory's entries, sorted by whether the agent placed them (by their marks)."""

    ours: tuple[str, ...]
    foreign: tuple[str, ...]
    created: bool | None  # the top mark: the agent made the directory; None: no mark


def inject_dir(cfg: config.Config) -> Path:
    """``--inject-dir``, or ``python`` beside the socket."""
    return Path(cfg.inject_dir) if cfg.inject_dir else Path(cfg.socket).parent / "python"


def _set_constant(text: str, key: str, value: object) -> tuple[str, int]:
    """``text`` with its first line ``KEY = ...`` made ``KEY = repr(value)``, and how many lines
    that was (0 or 1). The line is returned by a function, not given as a template, so that a
    backslash in the value is never read as a group reference."""
    line = f"{key} = {value!r}"
    return re.subn(rf"^{key} = .*$", lambda _m: line, text, count=1, flags=re.M)


def render(cfg: config.Config) -> dict[str, bytes]:
    """The payload's files, the publisher's with this agent's constants: its release, the
    protocol's version and bounds, the publish interval (each agent interval, at least as often
    as the default one) and where the socket is (its name beside the directory too, when the
    directory is in the socket's). The shared helpers are ``sidecar/app_shared.py``'s bytes."""
    directory = inject_dir(cfg)
    beside = os.path.basename(cfg.socket) if directory.parent == Path(cfg.socket).parent else ""
    values: dict[str, object] = {
        "AGENT_VERSION": __version__,
        "PROTOCOL_VERSION": protocol.VERSION,
        "INTERVAL_S": float(min(cfg.interval, config.Config.interval)),
        "SOCKET_PATH": cfg.socket,
        "SOCKET_NAME": beside,
        "SOCKET_ENV": protocol.SOCKET_ENV,
        "MAX_MESSAGE_BYTES": protocol.MAX_MESSAGE_BYTES,
        "MAX_GPUS": protocol.MAX_GPUS,
        "MAX_BYTES": protocol.MAX_BYTES,
    }
    out = {}
    for name in FILES:
        data = SOURCES[name].read_bytes()
        if name == PUBLISHER_MODULE:
            text = data.decode("utf-8")
            for key, value in values.items():
                text, n = _set_constant(text, key, value)
                if n != 1:
                    raise RuntimeError(f"payload {name} has no line '{key} = ...' to set")
            data = text.encode()
        out[name] = data
    return out


def apply(cfg: config.Config) -> Placed | None:
    """What ``run`` does at start: place the files (or, with ``--inject false``, remove those an
    earlier start placed). Failing to is logged once and never stops the agent."""
    directory = inject_dir(cfg)
    if not cfg.inject:
        try:
            if remove(directory):
                log.info("inject_removed", directory=str(directory),
                         note="--inject false: the injected publisher an earlier start placed is "
                              "gone; processes already running keep theirs until they exit")
        except NotOurs as exc:
            log.warning("inject_not_removed", directory=str(directory), error=str(exc),
                        effect="left as it is: the agent removes only what it placed itself")
        except OSError as exc:
            log.warning("inject_not_removed", directory=str(directory),
                        error=exc.strerror or str(exc),
                        effect="what an earlier start placed stays; the agent runs on")
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


class Start:
    """The placement of one start of the agent, as a context around the start: ``place`` once
    the parts that may refuse the start are open (NVML first) and before the socket is bound;
    ``started`` once the agent runs. A start that fails in between takes back what it placed
    (``withdraw``), so that an agent that exits with an error at start-up leaves nothing behind
    (issue #32); after ``started`` nothing is taken back (app processes may be using it)."""

    def __init__(self, cfg: config.Config) -> None:
        self._cfg = cfg
        self._placed: Placed | None = None
        self._running = False

    def place(self) -> None:
        self._placed = apply(self._cfg)

    def started(self) -> None:
        self._running = True

    def __enter__(self) -> Start:
        return self

    def __exit__(self, kind: type[BaseException] | None, _exc: BaseException | None,
                 _tb: TracebackType | None) -> None:
        if kind is not None and not self._running:
            withdraw(self._placed)


def withdraw(placed: Placed | None) -> None:
    """Take back what one start placed where nothing of the agent's was there before: its
    entries, the directory where the agent made it, and the directories above it the start
    made (each only if empty). A placement that replaced an earlier one stays: it is whole."""
    if placed is None or not placed.fresh:
        return
    with contextlib.suppress(OSError):
        remove(placed.directory)
    for made in reversed(placed.made):
        with contextlib.suppress(OSError):
            os.rmdir(made)


def place(directory: Path, files: Mapping[str, bytes]) -> Placed:
    """Place ``files`` in ``directory`` atomically (see the module's text); raises OSError."""
    for above in (directory.parent, *directory.parent.parents):  # the first that exists
        if os.path.lexists(above):
            if not above.is_dir():
                raise OSError(errno.ENOTDIR, f"{above} is not a directory")
            break
    made = _make_parents(directory.parent)
    try:
        os.mkdir(directory, 0o755)
        created = True
    except FileExistsError:
        created = False
    if not directory.is_dir():
        raise NotOurs(errno.ENOTDIR, f"{directory} is not a directory")
    found = inventory(directory)
    if found.foreign:
        raise NotOurs(errno.EEXIST, f"{directory} holds files the agent did not place "
                                    f"({_shown(found.foreign)})")
    fresh = set(found.ours) <= {MARK}
    ours_dir = found.created if found.created is not None else created
    digest = hashlib.sha256(b"".join(name.encode() + b"\0" + files[name] + b"\0"
                                     for name in sorted(files))).hexdigest()[:16]
    version = f"..{re.sub(r'[^0-9A-Za-z.+_-]', '_', __version__)}-{digest}"
    previous = _readlink(directory / DATA)
    links_ok = all(_readlink(directory / name) == f"{DATA}/{name}" for name in LINKS)
    if found.created is not None and previous == version and links_ok \
            and _intact(directory / version, files):
        return Placed(directory, directory / version, changed=False, made=made)
    with _writable(directory, ours_dir):
        if found.created is None:
            os.symlink(MARK_CREATED if created else MARK_FOUND, directory / MARK)
        if not _intact(directory / version, files):
            if version in found.ours:
                _remove_placed(directory / version)
            _write_version(directory, version, files)
        if previous != version:
            _replace_link(directory, DATA, version)
        for name in LINKS:
            if _readlink(directory / name) != f"{DATA}/{name}":
                _replace_link(directory, name, f"{DATA}/{name}")
        keep = {DATA, MARK, version, previous, *LINKS}
        for entry in found.ours:  # older versions, and what a crash left behind
            if entry not in keep:
                try:
                    _remove_placed(directory / entry)
                except NotOurs as exc:  # placed all the same: only the old one stays
                    log.warning("inject_old_version_kept", error=str(exc),
                                effect="the new version is placed; the old one stays, with "
                                       "what appeared in it",
                                hint="remove what the agent did not place from it")
    return Placed(directory, directory / version, changed=True, fresh=fresh, made=made)


def remove(directory: Path) -> bool:
    """Remove what ``place`` put in ``directory`` (nothing if it holds anything else), and the
    directory itself where the agent made it: the directory as the agent found it."""
    if not directory.is_dir():
        return False
    found = inventory(directory)
    if found.foreign:
        raise NotOurs(errno.EEXIST, f"{directory} holds files the agent did not place "
                                    f"({_shown(found.foreign)})")
    if not found.ours:
        return False
    with _writable(directory, bool(found.created)):
        # the links the app reads first, the mark last: an interrupted removal stays recognised
        for entry in sorted(found.ours, key=lambda e: (e == MARK, e not in LINKS)):
            _remove_placed(directory / entry)
    if found.created:
        os.rmdir(directory)
    return True


def inventory(directory: Path) -> Inventory:
    """Which of the directory's entries the agent placed, by their marks (never by a name
    alone, never following a link)."""
    ours: list[str] = []
    foreign: list[str] = []
    created: bool | None = None
    uid = os.geteuid()
    for entry in sorted(os.listdir(directory)):
        path = directory / entry
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        target = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
        if st.st_uid != uid:
            mine = False
        elif entry == MARK:
            mine = target in (MARK_CREATED, MARK_FOUND)
            if mine:
                created = target == MARK_CREATED
        elif entry in LINKS:
            mine = target == f"{DATA}/{entry}"
        elif entry == DATA:
            mine = target is not None and bool(_VERSION.match(target))
        elif _TMP_LINK.match(entry):
            mine = target is not None and (target in (f"{DATA}/{n}" for n in LINKS)
                                           or bool(_VERSION.match(target)))
        elif _VERSION.match(entry) or _TMP_DIR.match(entry):
            mine = stat.S_ISDIR(st.st_mode) and (
                _readlink(path / MARK) == MARK_VERSION
                or (bool(_TMP_DIR.match(entry)) and not os.listdir(path)))
        else:
            mine = False
        (ours if mine else foreign).append(entry)
    return Inventory(tuple(ours), tuple(foreign), created)


def _shown(names: tuple[str, ...]) -> str:
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def _make_parents(path: Path) -> tuple[Path, ...]:
    """``os.makedirs(path, 0o770)``, saying which directories it made (outermost first)."""
    missing = []
    for above in (path, *path.parents):
        if os.path.lexists(above):
            break
        missing.append(above)
    os.makedirs(path, mode=0o770, exist_ok=True)
    return tuple(reversed(missing))


def _pyc_names(files: Mapping[str, bytes]) -> list[str]:
    tag = sys.implementation.cache_tag
    return sorted(f"{name[:-3]}.{tag}.pyc" for name in files if name.endswith(".py"))


def _write_version(directory: Path, version: str, files: Mapping[str, bytes]) -> None:
    """The files, and their bytecode for the agent's own Python: an app on the same minor
    version loads it instead of compiling (the app cannot write bytecode to a read-only
    directory), after checking it against the source's hash (PEP 552), wherever it is mounted.
    The mark is the first thing in the temporary directory: what a crash leaves is recognised."""
    tmp = directory / f"..tmp-{secrets.token_hex(6)}"
    os.mkdir(tmp, 0o700)
    try:
        os.symlink(MARK_VERSION, tmp / MARK)
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
        with contextlib.suppress(OSError):
            _remove_placed(tmp)
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
    """The version directory holds exactly ``files`` (and its mark), read-only."""
    try:
        if sorted(os.listdir(version_dir)) != sorted([*files, CACHE, MARK]):
            return False
        if _readlink(version_dir / MARK) != MARK_VERSION:
            return False
        if sorted(os.listdir(version_dir / CACHE)) != _pyc_names(files):
            return False  # the agent's Python changed: bytecode of another version
        for d in (version_dir, version_dir / CACHE):
            st = os.lstat(d)
            if not stat.S_ISDIR(st.st_mode) or stat.S_IMODE(st.st_mode) != DIR_MODE:
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
def _writable(directory: Path, ours: bool) -> Iterator[None]:
    """The directory writable by the agent for the change, 0555 again after it: only a
    directory the agent made (and owns). One it found keeps its mode, whatever it is."""
    ours = ours and os.stat(directory).st_uid == os.geteuid()
    if ours:
        os.chmod(directory, 0o755)
    try:
        yield
    finally:
        if ours:
            with contextlib.suppress(OSError):
                os.chmod(directory, DIR_MODE)


def _remove_placed(path: Path) -> None:
    """Remove one entry the agent placed (``inventory`` said so): a link is unlinked, never
    followed; a version or temporary directory loses only what the agent writes in one (its
    files, their bytecode, its mark, last) and is then removed. Anything else found inside is
    left, with the directory and its mark: NotOurs."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    os.chmod(path, 0o700)  # a directory of ours (its mark was checked): 0555 until now
    cache = path / CACHE
    with contextlib.suppress(FileNotFoundError):
        cst = os.lstat(cache)
        if stat.S_ISDIR(cst.st_mode):
            os.chmod(cache, 0o700)
            for entry in os.listdir(cache):
                if _PYC.match(entry) and not stat.S_ISDIR(os.lstat(cache / entry).st_mode):
                    os.unlink(cache / entry)
            os.rmdir(cache)  # fails if anything else is in it: left, with the directory
    for entry in os.listdir(path):
        if entry in FILES and not stat.S_ISDIR(os.lstat(path / entry).st_mode):
            os.unlink(path / entry)
    left = [e for e in os.listdir(path) if e != MARK]
    if left:
        raise NotOurs(errno.ENOTEMPTY, f"{path} holds files the agent did not place "
                                       f"({_shown(tuple(sorted(left)))}): left as it is")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path / MARK)
    os.rmdir(path)
