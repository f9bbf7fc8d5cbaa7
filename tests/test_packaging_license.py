"""Building the package says nothing about its own metadata (issue #35): setuptools deprecated
``project.license`` as a TOML table (unusable from 2027-02-18); the project gives an SPDX
expression, which needs setuptools 77 or later, so that is the build's lower bound."""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
import zipfile

from tests.conftest import ROOT


def test_the_wheel_builds_without_a_license_warning_and_carries_the_spdx_expression(tmp_path):
    text = (ROOT / "pyproject.toml").read_text()
    assert 'requires = ["setuptools>=77"]' in text  # the first release taking the expression
    # a copy: the build writes build/ and *.egg-info beside its sources
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "sidecar", source / "sidecar",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # the test environment's setuptools, no download (it is at least the lower bound)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
         str(tmp_path), str(source)], capture_output=True, text=True, timeout=300,
        cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout + proc.stderr
    assert "project.license" not in said and "2027" not in said, said[-3000:]
    [wheel] = tmp_path.glob("gpu_sidecar-*.whl")
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.message_from_bytes(z.read(name))
    assert metadata["License-Expression"] == "Apache-2.0"
