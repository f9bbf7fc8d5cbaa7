"""The fast tier (`bash scripts/test --fast`, issue #45) is every test that needs no process of
its own: a test that starts one (a subprocess, a fork, a pseudo-terminal), in a fixture or in its
body, is skipped there, as is one marked ``slow`` (it waits on real time), and the rest runs as
in the full suite. A pytest run of its own over a small test file shows both."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import FAST_SKIP, ROOT, SLOW_SKIP

SPEC = '''
import os
import subprocess

import pytest


@pytest.fixture
def a_server():
    subprocess.run(["true"], check=True)
    yield


def test_in_process():
    assert sum(range(4)) == 6


def test_starting_a_process():
    subprocess.run(["true"], check=True)


def test_forking():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def test_behind_a_fixture_that_starts_one(a_server):
    pass


def test_on_a_pseudo_terminal():
    pid, _ = os.forkpty()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


@pytest.mark.slow
def test_waiting_on_real_time():
    pass


def test_failing_in_process():
    assert False, "still judged"
'''


def run(tmp_path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "tests" / "test_spec.py").write_text(SPEC)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs",
                           "tests/test_spec.py", *args], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})


def test_with_fast_a_test_that_starts_a_process_is_skipped_and_the_rest_judged(tmp_path):
    proc = run(tmp_path, "--fast")
    out = proc.stdout
    assert "1 failed, 1 passed, 5 skipped" in out, out + proc.stderr
    assert out.count(FAST_SKIP) == 4, out
    assert out.count(SLOW_SKIP) == 1, out
    assert "still judged" in out


def test_without_it_every_test_runs(tmp_path):
    proc = run(tmp_path)
    assert "1 failed, 6 passed" in proc.stdout and FAST_SKIP not in proc.stdout, proc.stdout
