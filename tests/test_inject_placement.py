"""The injected publisher's parts one by one: where and how the agent places it (atomic,
idempotent, read-only, never over files that are not its own), the options, the hello's
``publisher`` in the protocol, the payload's Python 3.9 and standard-library bounds, the helpers
it shares with sidecar.client (one file, placed as it is), and the stand-in torch against
PyTorch's documented shapes."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import structlog

from sidecar import __version__, client, config, protocol
from sidecar.inject import FILES, PUBLISHER, SHARED, placement
from sidecar.inject.versions import PublisherAwareAppState
from tests.conftest import ROOT
from tests.test_inject import BASE_PYTHON, python
from tests.waiting import until

PAYLOAD = ROOT / "sidecar" / "inject" / "payload"
STANDINS = ROOT / "tests" / "standins"
GPU = "GPU-0c4b24ac-fb68-413f-6f0c-54be2b5a94c7"


def cfg(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> config.Config:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, "run")
    return config.build("run", parser.parse_args(["--socket", str(tmp_path / "run" / "app.sock"),
                                                  *argv]), env or {})


def rendered(tmp_path: Path) -> Path:
    """The payload's files as the agent renders them, in a plain directory (no links)."""
    directory = tmp_path / "rendered"
    directory.mkdir()
    for name, data in placement.render(cfg(tmp_path)).items():
        (directory / name).write_bytes(data)
    return directory


def payload_module(directory: Path):
    spec = importlib.util.spec_from_file_location("payload_under_test", directory / PUBLISHER)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


# -- placement ---------------------------------------------------------------------------------

def test_the_files_are_placed_read_only_with_the_agent_s_release_in_them(tmp_path):
    c = cfg(tmp_path, "--interval", "2")
    placed = placement.apply(c)
    directory = tmp_path / "run" / "python"
    assert placed is not None and placed.directory == directory and placed.changed
    assert sorted(os.listdir(directory)) == sorted([*FILES, "__pycache__", "..data", "..gpu-sidecar",
                                                    placed.version_dir.name])
    assert os.readlink(directory / "..gpu-sidecar") == "gpu-sidecar-inject:created"
    assert os.readlink(placed.version_dir / "..gpu-sidecar") == "gpu-sidecar-inject:version"
    tag = sys.implementation.cache_tag
    pycs = [f"{n[:-3]}.{tag}.pyc" for n in FILES]
    for name in [*FILES, *(f"__pycache__/{p}" for p in pycs)]:
        st = os.stat(directory / name)
        assert stat.S_IMODE(st.st_mode) == 0o444 and stat.S_ISREG(st.st_mode), name
    for name in (*FILES, "__pycache__"):
        assert os.readlink(directory / name) == f"..data/{name}"
    for pyc in pycs:  # PEP 552 flags: hash-based, checked against the source
        assert (directory / "__pycache__" / pyc).read_bytes()[4:8] == b"\x03\x00\x00\x00"
    assert stat.S_IMODE(os.stat(placed.version_dir).st_mode) == 0o555
    assert stat.S_IMODE(os.stat(directory / "__pycache__").st_mode) == 0o555
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o555
    text = (directory / FILES[1]).read_text()
    assert f"AGENT_VERSION = {__version__!r}\n" in text
    assert f"PROTOCOL_VERSION = {protocol.VERSION!r}\n" in text
    assert "INTERVAL_S = 2.0\n" in text  # each agent interval, at most the default 5 s
    assert f"SOCKET_PATH = {str(tmp_path / 'run' / 'app.sock')!r}\n" in text
    assert "SOCKET_NAME = 'app.sock'\n" in text
    for key in ("SOCKET_ENV", "MAX_MESSAGE_BYTES", "MAX_GPUS", "MAX_BYTES"):  # the protocol's
        assert f"{key} = {getattr(protocol, key)!r}\n" in text
    assert __version__ in placed.version_dir.name


def test_an_app_on_the_agent_s_python_loads_the_placed_bytecode_instead_of_compiling(tmp_path):
    placed = placement.apply(cfg(tmp_path))
    exe = getattr(sys, "_base_executable", sys.executable)  # same minor version as the agent's
    proc = subprocess.run([exe, "-v", "-c", "pass"], capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ["PATH"], "PYTHONPATH": str(placed.directory),
                               "PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 0
    pyc = placed.directory / "__pycache__" / f"sitecustomize.{sys.implementation.cache_tag}.pyc"
    assert f"code object from '{pyc}'" in proc.stderr


def test_the_publish_interval_is_at_most_the_default_one(tmp_path):
    text = placement.render(cfg(tmp_path, "--interval", "60"))[FILES[1]].decode()
    assert f"INTERVAL_S = {config.Config.interval!r}\n" in text


def test_a_restart_with_the_same_files_writes_nothing(tmp_path):
    c = cfg(tmp_path)
    first = placement.apply(c)
    before = {p: os.lstat(p) for p in [*first.directory.iterdir(), *first.version_dir.iterdir()]}
    again = placement.apply(c)
    assert again is not None and not again.changed and again.version_dir == first.version_dir
    after = {p: os.lstat(p) for p in [*first.directory.iterdir(), *first.version_dir.iterdir()]}
    assert {p: (s.st_ino, s.st_mtime_ns) for p, s in before.items()} == \
        {p: (s.st_ino, s.st_mtime_ns) for p, s in after.items()}


def test_other_files_replace_the_old_in_one_rename_and_readers_never_miss_a_file(tmp_path):
    directory = tmp_path / "python"
    versions = [{name: f"# version {n}: {name}\n".encode() * 50 for name in FILES}
                for n in range(4)]
    placement.place(directory, versions[0])
    seen: set[bytes] = set()
    failures: list[BaseException] = []
    stop = threading.Event()

    def read() -> None:  # an app process starting while the agent places
        while not stop.is_set():
            for name in FILES:
                try:
                    seen.add((directory / name).read_bytes())
                except OSError as exc:
                    failures.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for n in range(40):
            placement.place(directory, versions[n % 4])
    finally:
        stop.set()
        reader.join()
    assert failures == []
    assert seen <= {v[name] for v in versions for name in FILES}  # never a partial file
    placed = placement.place(directory, versions[3])
    kept = sorted(e for e in os.listdir(directory)
                  if e.startswith("..") and e not in ("..data", "..gpu-sidecar"))
    assert len(kept) == 2 and placed.version_dir.name in kept  # this one and the previous one


def test_a_directory_holding_other_files_is_left_alone(tmp_path):
    directory = tmp_path / "run" / "python"
    directory.mkdir(parents=True)
    (directory / "app.py").write_text("print('mine')\n")
    (directory / "sitecustomize.py").write_text("# the image's\n")
    with structlog.testing.capture_logs() as logs:
        assert placement.apply(cfg(tmp_path)) is None
    (warning,) = [e for e in logs if e["event"] == "inject_not_placed"]
    assert warning["reason"] == "not_ours" and "app.py" in warning["error"]
    assert sorted(os.listdir(directory)) == ["app.py", "sitecustomize.py"]
    assert (directory / "sitecustomize.py").read_text() == "# the image's\n"


def test_inject_false_places_nothing_and_removes_what_an_earlier_start_placed(tmp_path):
    placement.apply(cfg(tmp_path))
    with structlog.testing.capture_logs() as logs:
        assert placement.apply(cfg(tmp_path, env={"GPU_SIDECAR_INJECT": "false"})) is None
    assert [e["event"] for e in logs] == ["inject_removed"]
    assert os.listdir(tmp_path / "run") == []  # the directory the agent made is gone too


def test_a_crash_s_leftovers_are_cleared_by_the_next_change(tmp_path):
    """What a start killed mid-change leaves: a temporary directory before its mark (empty), one
    with its mark and part of the files, a temporary link; each is the agent's own."""
    directory = tmp_path / "python"
    placement.place(directory, {name: b"# a\n" for name in FILES})
    os.chmod(directory, 0o755)
    (directory / "..tmp-0123456789ab").mkdir()
    partial = directory / "..tmp-ba9876543210"
    partial.mkdir()
    os.symlink("gpu-sidecar-inject:version", partial / "..gpu-sidecar")
    (partial / FILES[0]).write_bytes(b"# half")
    os.symlink("..data/sitecustomize.py", directory / "..data-tmp-0123456789ab")
    os.chmod(directory, 0o555)
    placement.place(directory, {name: b"# b\n" for name in FILES})
    assert not [e for e in os.listdir(directory) if "tmp" in e]


# -- placement never touches what it did not place ------------------------------------------------

@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside the inject directory, holding a file that must survive everything."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "sentinel.txt").write_text("keep me\n")
    return elsewhere


def _tree(directory: Path) -> dict[str, tuple[int, str | None]]:
    """Each entry under ``directory`` (links not followed) with its mode and link target."""
    out = {}
    for root, dirs, files in os.walk(directory):
        for name in [*dirs, *files]:
            path = Path(root) / name
            st = os.lstat(path)
            out[str(path.relative_to(directory))] = (
                st.st_mode, os.readlink(path) if stat.S_ISLNK(st.st_mode) else None)
    return out


FOREIGN = {  # what the app, an image or a person may have put in the directory beforehand
    "pycache_directory": lambda d, out: ((d / "__pycache__").mkdir(),
                                        (d / "__pycache__" / "app.cpython-311.pyc").write_bytes(b"x")),
    "pycache_link": lambda d, out: os.symlink(out, d / "__pycache__"),
    "tmp_directory": lambda d, out: ((d / "..tmp-0123456789ab").mkdir(),
                                    (d / "..tmp-0123456789ab" / "work").write_text("theirs")),
    "tmp_link": lambda d, out: os.symlink(out, d / "..tmp-0123456789ab"),
    "data_link": lambda d, out: os.symlink(out, d / "..data"),
    "tmp_data_link": lambda d, out: os.symlink(out, d / "..data-tmp-0123456789ab"),
    "unmarked_version": lambda d, out: ((d / "..0.1.0-0123456789abcdef").mkdir(),
                                       (d / "..0.1.0-0123456789abcdef" / "x").write_text("y")),
    "marker_link_elsewhere": lambda d, out: os.symlink(out, d / "..gpu-sidecar"),
}


@pytest.mark.parametrize("what", sorted(FOREIGN))
def test_entries_it_did_not_place_are_left_alone_with_the_directory_s_mode(tmp_path, outside, what):
    directory = tmp_path / "run" / "python"
    directory.mkdir(parents=True)
    FOREIGN[what](directory, outside)
    os.chmod(directory, 0o750)
    before = _tree(directory)
    with structlog.testing.capture_logs() as logs:
        assert placement.apply(cfg(tmp_path)) is None
        assert placement.apply(cfg(tmp_path, env={"GPU_SIDECAR_INJECT": "false"})) is None
    assert [(e["event"], e.get("reason")) for e in logs] == [("inject_not_placed", "not_ours"),
                                                              ("inject_not_removed", None)]
    assert _tree(directory) == before
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o750
    assert os.listdir(outside) == ["sentinel.txt"]
    assert (outside / "sentinel.txt").read_text() == "keep me\n"


def test_a_directory_it_found_keeps_its_mode_and_is_left_as_found_after_inject_false(tmp_path):
    directory = tmp_path / "run" / "python"  # a volume's mount point, say: not the agent's
    directory.mkdir(parents=True)
    os.chmod(directory, 0o750)
    placed = placement.apply(cfg(tmp_path))
    assert placed is not None and (directory / "sitecustomize.py").is_file()
    assert os.readlink(directory / "..gpu-sidecar") == "gpu-sidecar-inject:found"
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o750
    again = placement.place(directory, {name: b"# other\n" for name in FILES})  # a new release
    assert again.changed and stat.S_IMODE(os.stat(directory).st_mode) == 0o750
    assert placement.apply(cfg(tmp_path, env={"GPU_SIDECAR_INJECT": "false"})) is None
    assert os.listdir(directory) == []
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o750


def test_something_that_appeared_inside_a_version_of_its_own_is_kept_with_that_version(
        tmp_path, outside):
    directory = tmp_path / "python"
    first = placement.place(directory, {name: b"# a\n" for name in FILES})
    os.chmod(first.version_dir, 0o755)
    os.symlink(outside, first.version_dir / "theirs")  # root in the volume, not the agent
    placement.place(directory, {name: b"# b\n" for name in FILES})
    with structlog.testing.capture_logs() as logs:  # the first would go now: it cannot, whole
        third = placement.place(directory, {name: b"# c\n" for name in FILES})
    assert (directory / FILES[0]).read_bytes() == b"# c\n" and third.changed
    (kept,) = [e for e in logs if e["event"] == "inject_old_version_kept"]
    assert "theirs" in kept["error"]
    assert os.readlink(first.version_dir / "theirs") == str(outside)
    # its own files went; what it did not place stays, and its mark with it
    assert sorted(os.listdir(first.version_dir)) == ["..gpu-sidecar", "theirs"]
    assert os.listdir(outside) == ["sentinel.txt"]


def test_a_failed_start_takes_back_what_it_placed_and_the_directories_it_made(tmp_path):
    c = cfg(tmp_path)
    with pytest.raises(RuntimeError), placement.Start(c) as start:
        start.place()
        assert (tmp_path / "run" / "python" / "sitecustomize.py").is_file()
        raise RuntimeError("the socket could not be bound")
    assert os.listdir(tmp_path) == []
    with placement.Start(c) as start:  # a start that gets going keeps its files
        start.place()
        start.started()
    assert (tmp_path / "run" / "python" / "sitecustomize.py").is_file()
    with pytest.raises(RuntimeError), placement.Start(c) as start:  # a restart that fails
        start.place()
        raise RuntimeError("the socket could not be bound")
    assert (tmp_path / "run" / "python" / "sitecustomize.py").is_file()  # the earlier start's


# -- options -----------------------------------------------------------------------------------

def test_the_options_are_flags_and_variables_with_their_defaults(tmp_path):
    c = cfg(tmp_path)
    assert c.inject is True and c.inject_dir == ""
    assert placement.inject_dir(c) == tmp_path / "run" / "python"
    c = cfg(tmp_path, "--inject", "false", "--inject-dir", "/opt/inject")
    assert c.inject is False and placement.inject_dir(c) == Path("/opt/inject")
    c = cfg(tmp_path, env={"GPU_SIDECAR_INJECT_DIR": "/srv/x", "GPU_SIDECAR_INJECT": "0"})
    assert c.inject_dir == "/srv/x" and not c.inject
    with pytest.raises(config.ConfigError, match=r"GPU_SIDECAR_INJECT_DIR.*absolute path"):
        cfg(tmp_path, env={"GPU_SIDECAR_INJECT_DIR": "python"})
    text = placement.render(cfg(tmp_path, "--inject-dir", "/elsewhere/python"))[FILES[1]]
    assert b"SOCKET_NAME = ''\n" in text  # not beside the socket: the agent's path is used


# -- protocol: the hello's publisher -----------------------------------------------------------

def test_a_hello_may_name_its_publisher_and_old_hellos_are_unchanged():
    hello = protocol.Hello(7, (GPU,), "gpu-sidecar-inject/0.1.0")
    data = protocol.encode(hello)
    assert json.loads(data)["publisher"] == "gpu-sidecar-inject/0.1.0"
    assert protocol.decode(data) == hello
    old = protocol.encode(protocol.Hello(7, (GPU,)))
    assert old == b'{"v":1,"kind":"hello","pid":7,"gpus":["%s"]}' % GPU.encode()
    assert protocol.decode(old).publisher is None


@pytest.mark.parametrize("publisher", ["", "a b", "x" * 65, 7, None, "bad\n", "/lead"])
def test_a_publisher_that_cannot_be_logged_safely_is_refused(publisher):
    body = {"v": 1, "kind": "hello", "pid": 1, "gpus": [GPU], "publisher": publisher}
    with pytest.raises(protocol.Rejected) as err:
        protocol.decode(json.dumps(body).encode())
    assert err.value.reason == "bad_type"


def test_the_agent_says_once_per_release_and_protocol():
    state = PublisherAwareAppState()
    hello = {"v": 1, "kind": "hello", "gpus": [GPU]}
    with structlog.testing.capture_logs() as logs:
        for pid in (1, 2, 3):
            state.feed(json.dumps({**hello, "pid": pid,
                                   "publisher": f"gpu-sidecar-inject/{__version__}"}).encode())
            state.feed(json.dumps({**hello, "pid": pid,
                                   "publisher": "gpu-sidecar-inject/0.0.1"}).encode())
            state.feed(json.dumps({**hello, "v": 3, "pid": pid,
                                   "publisher": "gpu-sidecar-inject/7.0.0"}).encode())
            state.feed(json.dumps({**hello, "pid": pid}).encode())
    events = [(e["event"], e["log_level"]) for e in logs if e["event"] != "app_message_rejected"]
    assert events == [("app_publisher", "info"), ("app_publisher_version_differs", "warning"),
                      ("app_publisher_protocol_differs", "warning")]
    assert state.rejected["bad_version"] == 3 and state.accepted == 9


# -- the payload: Python 3.9, standard library, never raising ----------------------------------

PY39_FILES = [*sorted(PAYLOAD.glob("*.py")), ROOT / "sidecar" / "app_shared.py",
              *sorted(STANDINS.rglob("*.py"))]


@pytest.mark.parametrize("path", PY39_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_what_runs_in_the_app_is_python_3_9_syntax(path):
    ast.parse(path.read_text(), feature_version=(3, 9))


@pytest.mark.parametrize("name", FILES)
def test_the_payload_imports_only_the_standard_library_and_sitecustomize_only_os_and_sys(name):
    tree = ast.parse(placement.SOURCES[name].read_text())
    imported = {a.name.partition(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names}
    imported |= {(n.module or "").partition(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom)}
    assert imported <= set(sys.stdlib_module_names) | {"sitecustomize"}, imported
    if name == "sitecustomize.py":  # at interpreter start-up: what site has already imported
        top = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
        assert top == {"os", "sys"}


def _defined(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text()).body
            if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def test_the_placed_shared_helpers_are_the_client_s_own_module_byte_for_byte(tmp_path):
    placed = placement.apply(cfg(tmp_path))
    assert placed is not None
    used_by_the_client = Path(client.app_shared.__file__)
    assert (placed.directory / SHARED).read_bytes() == used_by_the_client.read_bytes()
    assert (placed.version_dir / SHARED).read_bytes() == used_by_the_client.read_bytes()
    assert os.readlink(placed.directory / SHARED) == f"..data/{SHARED}"
    # and nowhere a second copy: neither publisher defines again what the shared module does
    shared = _defined(used_by_the_client)
    for path in (*PAYLOAD.glob("*.py"), ROOT / "sidecar" / "client.py"):
        again = {name.lstrip("_") for name in _defined(path)} & {n.lstrip("_") for n in shared}
        assert again == set(), f"{path.name} defines {sorted(again)} again"


PLACED_APP = r"""
import importlib.util, json, os, sys, time
import sitecustomize  # what site does at start-up (the interpreter runs with -S: no site at all)
import torch
torch.cuda.set_device(0)
held = [torch.empty(n << 20, dtype=torch.uint8, device="cuda:0") for n in (3, 9, 3, 5)]
del held[1]
stats = torch.cuda.memory_stats(0)
publisher = sys.modules["_gpu_sidecar_inject"]
print(json.dumps({
    "version": list(sys.version_info[:2]),
    "sidecar": importlib.util.find_spec("sidecar") is not None,
    "ours": sorted(m for m in sys.modules if "sidecar" in m),
    "shared": os.path.dirname(publisher.shared.__file__),
    "reserved": stats["reserved_bytes.all.current"],
    "allocated": stats["allocated_bytes.all.current"],
    "inactive_split": stats["inactive_split_bytes.all.current"]}), flush=True)
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.02)
"""


@pytest.mark.parametrize("minor", [None, 9], ids=["agent-python", "python3.9"])
def test_the_injected_publisher_runs_from_the_placed_directory_alone(tmp_path, minor):
    """An app interpreter with no site-packages (-S) and only the placed directory and the
    stand-in torch on its path: no sidecar package to import anything from. The placed
    publisher and its shared helpers load from the placed version, and what reaches the
    socket is the allocator's figures in the agent's format."""
    exe = BASE_PYTHON if minor is None else python(minor)
    if exe is None:
        pytest.skip(f"no CPython 3.{minor} on this machine (pyenv's versions are looked for)")
    placed = placement.apply(cfg(tmp_path, "--interval", "0.5"))
    assert placed is not None
    sock_path = tmp_path / "run" / "app.sock"
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    agent.bind(str(sock_path))
    agent.setblocking(False)
    app_dir = tmp_path / "app"
    app_dir.mkdir()
    (app_dir / "app.py").write_text(PLACED_APP)
    release = app_dir / "release"
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": f"{placed.directory}{os.pathsep}{STANDINS}",
           "GPU_SIDECAR_SOCKET": str(sock_path), "TORCH_STANDIN_GPUS": GPU}
    app = subprocess.Popen([exe, "-S", str(app_dir / "app.py"), str(release)], cwd=app_dir,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    received: list[protocol.Message] = []

    def figures_arrived() -> protocol.Allocator | None:
        while True:
            try:
                received.append(protocol.decode(agent.recv(protocol.MAX_MESSAGE_BYTES + 1)))
            except BlockingIOError:
                break
        assert app.poll() is None, app.stderr.read() if app.stderr else ""
        return next((a for m in received if isinstance(m, protocol.Round)
                     for a in m.allocators if a.reserved_bytes > 0), None)

    try:
        allocator = until(figures_arrived, 60, interval=0.02,
                          what=lambda: f"the placed publisher's figures (so far: {received})")
        release.touch()
        out, err = app.communicate(timeout=60)
    finally:
        if app.poll() is None:
            app.kill()
            app.communicate()
        agent.close()
    assert app.returncode == 0 and err == "", err
    said = json.loads(out)
    if minor is not None:
        assert said["version"] == [3, minor]
    assert not said["sidecar"]  # nothing of the agent's package to import in this app
    assert said["ours"] == ["_gpu_sidecar_inject"]  # the shared helpers: loaded by path only
    assert said["shared"] == str(placed.version_dir)  # from the same placement as the publisher
    assert (allocator.pid, allocator.gpu) == (app.pid, GPU)
    assert (allocator.reserved_bytes, allocator.allocated_bytes,
            allocator.inactive_split_bytes) == (said["reserved"], said["allocated"],
                                                said["inactive_split"])
    hellos = [m for m in received if isinstance(m, protocol.Hello)]
    assert hellos and hellos[0].publisher == f"gpu-sidecar-inject/{__version__}"


def test_a_round_of_many_gpus_is_split_into_datagrams_the_agent_takes(tmp_path):
    m = payload_module(rendered(tmp_path))
    gpus = [f"GPU-{i:08x}-fb68-413f-6f0c-54be2b5a94c7" for i in range(64)]
    allocators = [{"gpu": g, "reserved_bytes": 1 << 40, "allocated_bytes": 1 << 39,
                   "active_bytes": 1 << 39, "inactive_split_bytes": 1 << 30,
                   "alloc_retries": 1 << 20, "ooms": 1 << 10, "largest_free_block_bytes": 1 << 30,
                   "private_pool_bytes": 1 << 33} for g in gpus]
    datagrams = m._rounds(4194304, allocators)
    assert len(datagrams) > 1
    decoded = [protocol.decode(d) for d in datagrams]
    assert all(len(d) <= protocol.MAX_MESSAGE_BYTES for d in datagrams)
    assert [a.gpu for r in decoded for a in r.allocators] == gpus
    assert all(set(r.gpus) == {a.gpu for a in r.allocators} for r in decoded)


def test_a_broken_torch_never_reaches_the_app(tmp_path):
    """The queued call and the thread swallow anything torch raises; nothing is printed."""
    code = (
        "import sys, types, threading, time\n"
        f"sys.path.insert(0, {str(rendered(tmp_path))!r})\n"
        "cuda = types.ModuleType('torch.cuda'); torch = types.ModuleType('torch')\n"
        "cuda._queued_calls = []\n"
        "state = {'up': False}\n"
        "cuda.is_initialized = lambda: state['up']\n"
        "def boom(*a, **k): raise RuntimeError('broken torch')\n"
        "cuda.device_count = boom; cuda.memory_stats = boom\n"
        "torch.cuda = cuda; sys.modules['torch'] = torch; sys.modules['torch.cuda'] = cuda\n"
        "import _gpu_sidecar_inject as m\n"
        "m.INTERVAL_S = 0.01\n"
        "class F: done = True\n"
        "m.watch(F())\n"
        "state['up'] = True\n"
        "for call, _ in cuda._queued_calls: call()\n"
        "deadline = time.monotonic() + 30\n"
        "while m._INJECTED.errors == 0 and time.monotonic() < deadline: time.sleep(0.01)\n"
        "print(m._INJECTED.errors > 0, [t.name for t in threading.enumerate()])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ["PATH"]})
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.split()[0] == "True"  # it tried, counted, and kept quiet


# -- the stand-in torch against PyTorch's documented shapes -------------------------------------

STANDIN_CHECK = r'''
import json, os
import torch
out = {"before": dict(torch.cuda.memory_stats(0)), "initialised": torch.cuda.is_initialized()}
out["count"] = torch.cuda.device_count()
out["driver_before"] = torch._C.driver_calls()
x = torch.empty(3 << 20, dtype=torch.uint8, device="cuda:1")
out["current"] = torch.cuda.current_device()
stats = torch.cuda.memory_stats(1)
out["keys"] = sorted(stats)
out["sorted"] = list(stats) == sorted(stats)
out["uuid"] = str(torch.cuda.get_device_properties(1).uuid)
out["uuid_bytes"] = len(torch.cuda.get_device_properties(1).uuid.bytes)
seg = torch.cuda.memory_snapshot()
out["segment_keys"] = sorted(seg[0])
out["block_keys"] = sorted(seg[0]["blocks"][0])
out["context"] = [torch._C._cuda_hasPrimaryContext(i) for i in range(2)]
pid = os.fork()
if pid == 0:
    try:
        torch.cuda.init()
        print("child could initialise")
    except RuntimeError as exc:
        os.write(1, (json.dumps({"child_initialised": torch.cuda.is_initialized(),
                                 "error": str(exc)}) + "\n").encode())
    os._exit(0)
os.waitpid(pid, 0)
print(json.dumps(out))
'''


def test_the_stand_in_has_pytorch_s_semantics_and_shapes():
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(STANDINS),
           "TORCH_STANDIN_GPUS": f"{GPU},GPU-18f9fd34-4f90-8419-eed6-00c6bc203962"}
    proc = subprocess.run([sys.executable, "-c", STANDIN_CHECK], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    child, out = (json.loads(line) for line in proc.stdout.splitlines())
    assert out["before"] == {} and not out["initialised"]  # memory_stats() before init: {}
    assert out["driver_before"] == [["_cuda_getDeviceCount", "MainThread"]]  # count: no init
    assert out["count"] == 2 and out["current"] == 0  # the current device is per thread
    documented = {f"{s}.{p}.{m}" for s in ("allocation", "segment", "active", "inactive_split",
                                          "allocated_bytes", "reserved_bytes", "active_bytes",
                                          "inactive_split_bytes", "requested_bytes")
                  for p in ("all", "large_pool", "small_pool")
                  for m in ("current", "peak", "allocated", "freed")}
    documented |= {"num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                   "num_device_free", "max_split_size"}
    documented |= {f"oversize_{k}.{m}" for k in ("allocations", "segments")
                   for m in ("current", "peak", "allocated", "freed")}
    assert set(out["keys"]) == documented and out["sorted"]
    assert out["uuid"] == "18f9fd34-4f90-8419-eed6-00c6bc203962" and out["uuid_bytes"] == 16
    assert out["segment_keys"] == sorted(["device", "address", "total_size", "allocated_size",
                                          "active_size", "requested_size", "stream",
                                          "segment_type", "segment_pool_id", "is_expandable",
                                          "frames", "blocks"])
    assert out["block_keys"] == ["address", "frames", "requested_size", "size", "state"]
    assert out["context"] == [False, True]
    assert child == {"child_initialised": False,
                     "error": "Cannot re-initialize CUDA in forked subprocess. To use CUDA with "
                              "multiprocessing, you must use the 'spawn' start method"}
