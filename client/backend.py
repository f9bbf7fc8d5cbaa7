"""PEP 517 build backend of gpu-sidecar-client: the wheel holds sidecar/__init__.py, client.py,
protocol.py and app_shared.py, taken from the repository's own sidecar/ (no copy to drift), and
declares no dependencies. Standard library only, so a build needs nothing from an index.

A wheel is a zip of the files plus ``*.dist-info/{METADATA,WHEEL,RECORD}``; a sdist is a tar of
the sources plus ``PKG-INFO``, from which this same backend builds the same wheel.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import tarfile
import time
import zipfile
from pathlib import Path

NAME = "gpu-sidecar-client"
DIST = NAME.replace("-", "_")
FILES = ("sidecar/__init__.py", "sidecar/client.py", "sidecar/protocol.py", "sidecar/app_shared.py")
HERE = Path(__file__).resolve().parent
# in the repository the sources are ../sidecar; unpacked from the sdist, ./sidecar
ROOT = HERE if (HERE / FILES[0]).is_file() else HERE.parent


def _version() -> str:
    text = (ROOT / "sidecar" / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__ = "([^"]+)"$', text, re.MULTILINE)
    if match is None:
        raise RuntimeError("no __version__ = \"...\" line in sidecar/__init__.py")
    return match.group(1)


def _metadata(version: str) -> bytes:
    return (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {version}\n"
            "Summary: App-side publisher of gpu-sidecar (sidecar.client): allocator figures and "
            "request latency to the agent over its Unix socket; standard library only\n"
            "License: Apache-2.0\nRequires-Python: >=3.10\n").encode()


def _epoch() -> int:
    """SOURCE_DATE_EPOCH when set (reproducible builds), else 1980-01-01, the zip epoch."""
    return max(int(os.environ.get("SOURCE_DATE_EPOCH", "315532800")), 315532800)


def build_wheel(wheel_directory: str, config_settings: dict | None = None,
                metadata_directory: str | None = None) -> str:
    version = _version()
    info = f"{DIST}-{version}.dist-info"
    entries = [(f, (ROOT / f).read_bytes()) for f in FILES]
    entries.append((f"{info}/METADATA", _metadata(version)))
    entries.append((f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: gpu-sidecar-client backend"
                                     b"\nRoot-Is-Purelib: true\nTag: py3-none-any\n"))
    record = "".join(
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()}"
        f",{len(data)}\n" for path, data in entries) + f"{info}/RECORD,,\n"
    entries.append((f"{info}/RECORD", record.encode()))
    filename = f"{DIST}-{version}-py3-none-any.whl"
    when = time.gmtime(_epoch())[:6]
    with zipfile.ZipFile(Path(wheel_directory) / filename, "w", zipfile.ZIP_DEFLATED) as whl:
        for path, data in entries:
            item = zipfile.ZipInfo(path, date_time=when)
            item.external_attr = 0o644 << 16
            item.compress_type = zipfile.ZIP_DEFLATED
            whl.writestr(item, data)
    return filename


def build_sdist(sdist_directory: str, config_settings: dict | None = None) -> str:
    version = _version()
    base = f"{DIST}-{version}"
    entries = [("pyproject.toml", (HERE / "pyproject.toml").read_bytes()),
               ("backend.py", (HERE / "backend.py").read_bytes()),
               ("PKG-INFO", _metadata(version)),
               *((f, (ROOT / f).read_bytes()) for f in FILES)]
    filename = f"{base}.tar.gz"
    with tarfile.open(Path(sdist_directory) / filename, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for path, data in entries:
            item = tarfile.TarInfo(f"{base}/{path}")
            item.size, item.mode, item.mtime = len(data), 0o644, _epoch()
            tar.addfile(item, io.BytesIO(data))
    return filename


def get_requires_for_build_wheel(config_settings: dict | None = None) -> list[str]:
    return []


def get_requires_for_build_sdist(config_settings: dict | None = None) -> list[str]:
    return []
