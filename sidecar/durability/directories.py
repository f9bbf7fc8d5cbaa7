"""Where each receiver's spool lives: a directory per receiver under a private root, named so
that two URLs never share one, and the names earlier releases used (``open_spools`` adopts
those)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from sidecar.durability.layout import SpoolError
from sidecar.urls import host_port, redact_url


def safe_dir(name: str) -> str:
    """A name made safe for a path: anything but letters, digits, '-' and '.' becomes '_'."""
    return "".join(c if c.isalnum() or c in "-." else "_" for c in name)


def spool_dir_name(name: str, url: str) -> str:
    """The sink's name made safe for a path, plus a short digest of its URL (credentials left
    out): two URLs whose names read alike on disk still get two directories."""
    digest = hashlib.sha256(redact_url(url).encode()).hexdigest()[:8]
    return f"{safe_dir(name)}-{digest}"


def old_dir_name(kind: str, url: str) -> str:
    """Where earlier releases kept a URL's spool: one directory per host and port."""
    return safe_dir(f"{kind}:{host_port(url)}")


def spool_dirs(root: str, kind: str) -> list[Path]:
    """The spool directories of one kind of sink under ``root``, by name (never a link)."""
    prefix = safe_dir(f"{kind}:")
    try:
        with os.scandir(root) as entries:
            return sorted(Path(e.path) for e in entries
                          if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False))
    except OSError:
        return []


def private_root(root: str) -> None:
    """The spool root, created 0700: batches carry pod names and figures. A root that already
    exists keeps its mode (the agent changes nothing it did not make; a Kubernetes emptyDir
    belongs to root): the per-URL directories inside it are 0700 anyway."""
    try:
        created = not os.path.isdir(root)
        os.makedirs(root, mode=0o700, exist_ok=True)
        if created:
            os.chmod(root, 0o700)  # the umask may have narrowed makedirs' mode, never widened
    except OSError as exc:
        raise SpoolError(
            f"spool directory {root} is not writable ({exc.strerror}); mount a writable "
            "emptyDir there or set --spool-dir / GPU_SIDECAR_SPOOL_DIR") from exc
