from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sidecar.simulate import fake_nvml
from sidecar.simulate.fake_nvml import FakeGpu, FakeNvml
from tests.manual_clock import ManualClock

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def install_fake() -> Iterator[Callable[..., FakeNvml]]:
    """Install a FakeNvml at pynvml.nvmlLib for the test, and remove it afterwards."""

    def install(gpus: list[FakeGpu], **kwargs: object) -> FakeNvml:
        kwargs.setdefault("throughput_blocking", False)
        return fake_nvml.install(FakeNvml(gpus, **kwargs))  # type: ignore[arg-type]

    yield install
    fake_nvml.uninstall()


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 30,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=ROOT, input=input)


def send_datagram(path: str, data: bytes) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.sendto(data, path)
    finally:
        s.close()


def _descendants(pid: int) -> dict[int, str]:
    """Live (not zombie) descendants of ``pid`` with their command lines, from /proc."""
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                try:
                    fields = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
                    cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
                except OSError:
                    continue
                if fields[0] != "Z":
                    found[child] = cmd.decode(errors="replace").strip()[:200]
                todo.append(child)
    return found


@pytest.fixture(autouse=True)
def no_process_left_behind() -> Iterator[None]:
    """A test stops every process it started, pass or fail: whatever is still running when the
    test and its fixtures are done is killed here, and the test fails naming it (a leaked agent
    keeps writing into a reader thread of pytest and skews the tests after it)."""
    before = set(_descendants(os.getpid()))
    yield
    left = {pid: cmd for pid, cmd in _descendants(os.getpid()).items() if pid not in before}
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if left:
        pytest.fail(f"the test left {len(left)} process(es) running (now killed): "
                    + "; ".join(f"{pid} {cmd}" for pid, cmd in sorted(left.items())))


@pytest.fixture(autouse=True, scope="session")
def logs_through_pytest_capture() -> Iterator[None]:
    """Why: with structlog's default set-up, a part running in-process (a sink's sender, an
    engine reader, a watcher thread) prints its lines to whatever ``sys.stdout`` is when it
    logs; a thread that logs while pytest writes its progress or summary (capture suspended or
    over) prints into the test run's output. Here the lines go, rendered as the agent renders
    them, through the standard ``logging`` module: pytest captures them per test and shows them
    under a failing test ("Captured log"); outside a test they are dropped. Agents run as
    subprocesses configure their own logging and are not affected; ``capture_logs`` still
    works (it swaps the processors and restores these)."""
    import logging

    import structlog

    sidecar_log = logging.getLogger("sidecar")
    sidecar_log.setLevel(logging.DEBUG)  # the filtering below decides, as in the agent
    null = logging.NullHandler()  # no "last resort" printing to stderr outside a test
    sidecar_log.addHandler(null)
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False)
    yield  # kept to the end of the process: a thread may still log after the last test


# -- the fast tier: `bash scripts/test --fast` ---------------------------------------------------
#
# Why a guard and not a list: the tier is every test that runs in this process alone (no real
# receiver, no agent subprocess, no image build, no tool), and a list of such tests goes stale the
# day one of them starts a process. With --fast, starting a process (subprocess, fork) skips the
# test at that moment, in a fixture or in the test: what is left is in-process by construction,
# and a test that gains a process leaves the tier by itself. A test marked ``slow`` runs in this
# process but waits seconds of real time (sampling intervals, deadlines, trickled answers): it is
# left to the full suite too, so the tier stays within a couple of minutes.

FAST_SKIP = "not in the fast tier: it starts a process"
SLOW_SKIP = "not in the fast tier: marked slow (it waits on real time)"
_in_a_test = [False]  # collection may start a process (ctypes' find_library runs ldconfig)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true", default=False,
                     help="the fast tier: run only what needs no process of its own (a test that "
                          "starts one is skipped when it does)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: waits seconds of real time; left out of --fast")
    if not config.getoption("--fast"):
        return
    real_init, real_fork, real_forkpty = subprocess.Popen.__init__, os.fork, os.forkpty

    def guarded_popen(self: subprocess.Popen, *args: object, **kw: object) -> None:
        if _in_a_test[0]:
            raise pytest.skip.Exception(FAST_SKIP, _use_item_location=True)
        real_init(self, *args, **kw)  # type: ignore[arg-type]

    def guarded_fork() -> int:
        if _in_a_test[0]:
            raise pytest.skip.Exception(FAST_SKIP, _use_item_location=True)
        return real_fork()

    def guarded_forkpty() -> tuple[int, int]:  # pty.fork: a process on a pseudo-terminal
        if _in_a_test[0]:
            raise pytest.skip.Exception(FAST_SKIP, _use_item_location=True)
        return real_forkpty()

    subprocess.Popen.__init__ = guarded_popen  # type: ignore[method-assign]
    os.fork = guarded_fork
    os.forkpty = guarded_forkpty

    def restore() -> None:
        subprocess.Popen.__init__ = real_init  # type: ignore[method-assign]
        os.fork, os.forkpty = real_fork, real_forkpty

    config.add_cleanup(restore)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--fast"):
        for item in items:
            if item.get_closest_marker("slow") is not None:
                item.add_marker(pytest.mark.skip(reason=SLOW_SKIP))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _in_a_test[0] = True
    try:
        yield
    finally:
        _in_a_test[0] = False
