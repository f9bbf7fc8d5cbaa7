"""The injected publisher under the real PyTorch (a CPU build, 2.13.0, installed by scripts/test
where pip takes it from this machine's disk; skipped with the reason said where it is not).

- A real app process that imports torch and asks about CUDA, with the placed publisher on its
  PYTHONPATH and the agent's socket bound, prints nothing more than the same process without it,
  starts no thread, opens no socket and no file, and sends nothing: it only queues its start with
  torch, which a process without CUDA never runs.
- The private torch names the publisher relies on (read in sidecar/inject/payload/) exist in the
  installed torch with the shapes it assumes, and the stand-in torch of the other injection tests
  (tests/standins/torch/) has the same names with the same signatures.

The real-CUDA step (the queued call run by a real CUDA initialisation) is bench/gpu_check.py's,
for a machine with a GPU."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar import config
from sidecar.inject import PUBLISHER, SHARED, placement
from tests.conftest import ROOT

WANTED = "2.13.0"
torch = pytest.importorskip(
    "torch", reason=f"torch {WANTED} is not installed in this venv: scripts/test installs the CPU "
                    "build only where pip takes it from this machine's disk (no download)")
STANDINS = ROOT / "tests" / "standins"
# what runs in the app: the placed publisher and the helpers it shares with sidecar.client
PAYLOAD = (placement.SOURCES[PUBLISHER], placement.SOURCES[SHARED])

# What the app does: import torch, ask about CUDA as a server does at start, try to initialise it
# (which fails on a CPU build, before torch runs its queued calls), then report on itself to a
# file, so stdout and stderr are torch's and the interpreter's alone.
APP = r'''
import json, os, re, sys, threading
import torch
available = torch.cuda.is_available()
count = torch.cuda.device_count()
stats = torch.cuda.memory_stats(0)
try:
    torch.cuda.init()
except Exception:
    pass
queued = [getattr(c, "__name__", "") for c, _ in torch.cuda._queued_calls]
fds = sorted(re.sub(r"\[\d+\]$", "", os.readlink(f"/proc/self/fd/{fd}"))  # pipe:[inode]
             for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}"))
with open(sys.argv[1], "w") as out:
    json.dump({"threads": sorted(t.name for t in threading.enumerate()), "fds": fds,
               "available": available, "count": count, "stats": dict(stats), "queued": queued,
               "loaded": "_gpu_sidecar_inject" in sys.modules,
               "initialized": torch.cuda.is_initialized()}, out)
'''


def placed_payload(tmp_path: Path, sock: Path) -> Path:
    """The payload as the agent places it for ``--socket sock``."""
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, "run")
    cfg = config.build("run", parser.parse_args(["--socket", str(sock)]), {})
    placed = placement.place(placement.inject_dir(cfg), placement.render(cfg))
    return placed.directory


def run_app(tmp_path: Path, name: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess,
                                                                         dict]:
    report = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, "-c", APP, str(report)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(report.read_text())


@pytest.fixture
def agent_socket(tmp_path: Path):
    """The agent's datagram socket, bound where the placed payload looks for it."""
    path = tmp_path / "run" / "app.sock"
    path.parent.mkdir()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.setblocking(False)
    try:
        yield path, sock
    finally:
        sock.close()


def test_the_installed_torch_is_the_one_the_tests_pin():
    assert torch.__version__.split("+")[0] == WANTED, torch.__version__


def test_a_real_torch_app_without_cuda_gets_no_thread_socket_file_or_output_from_us(
        tmp_path, agent_socket):
    sock_path, sock = agent_socket
    directory = placed_payload(tmp_path, sock_path)
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)}
    plain, without = run_app(tmp_path, "without", base)
    ours, within = run_app(tmp_path, "with", {**base, "PYTHONPATH": str(directory),
                                              "GPU_SIDECAR_SOCKET": str(sock_path)})
    # the publisher is there, its start queued with torch behind torch's own calls...
    assert within["loaded"] and not without["loaded"]
    # (queued while torch.cuda was still executing its import: among torch's own calls, which
    # torch's _lazy_init runs in order once CUDA is up)
    assert within["queued"].count("_on_cuda_init") == 1
    assert [c for c in within["queued"] if c != "_on_cuda_init"] == without["queued"]
    # ...and nothing else changed: no output, no thread, no descriptor, no datagram
    assert (ours.stdout, ours.stderr) == (plain.stdout, plain.stderr)
    assert within["threads"] == without["threads"] == ["MainThread"]
    assert within["fds"] == without["fds"]
    assert (within["available"], within["count"], within["stats"], within["initialized"]) == \
        (False, 0, {}, False)
    with pytest.raises(BlockingIOError):
        sock.recv(65536)


# -- the names the payload relies on ------------------------------------------------------------

def payload_source() -> str:
    return "".join(path.read_text() for path in PAYLOAD)


def shape(fn) -> list[tuple[str, str, object]]:
    """A signature as (name, kind, default): what a caller's arguments depend on."""
    return [(p.name, p.kind.name, p.default if p.default is not inspect.Parameter.empty else "-")
            for p in inspect.signature(fn).parameters.values()]


# torch.cuda functions the payload calls, with the arguments it passes
CUDA_FUNCTIONS = ("is_initialized", "_is_in_bad_fork", "device_count", "memory_stats",
                  "memory_snapshot", "get_device_properties", "_lazy_call", "_lazy_init")


@pytest.mark.parametrize("name", CUDA_FUNCTIONS)
def test_each_torch_cuda_function_the_payload_uses_exists_and_takes_its_arguments(name):
    fn = getattr(torch.cuda, name)
    assert callable(fn)
    params = shape(fn)
    if name == "memory_snapshot":  # called with include_traces=False, or bare on older torch
        assert ("include_traces", "POSITIONAL_OR_KEYWORD", True) in params
    elif name in ("memory_stats", "get_device_properties"):  # called with a device index
        assert params[0][0] == "device" and params[0][2] is None
    elif name == "_lazy_call":
        assert params[0][:2] == ("callable", "POSITIONAL_OR_KEYWORD")
    else:
        assert params == [], params
    # the payload still uses it (torch's own _lazy_init and _lazy_call run its queued start)
    assert name in ("_lazy_init", "_lazy_call") or f"{name}(" in payload_source() \
        or f'"{name}"' in payload_source(), f"the payload no longer uses torch.cuda.{name}"


def test_queued_calls_is_the_list_of_callable_and_traceback_pairs_that_lazy_init_runs():
    queued = torch.cuda._queued_calls
    assert isinstance(queued, list) and queued, "torch queues its own calls at import"
    for entry in queued:
        assert isinstance(entry, tuple) and len(entry) == 2 and callable(entry[0])
        assert isinstance(entry[1], list) and all(isinstance(x, str) for x in entry[1])
    lazy_init = inspect.getsource(torch.cuda._lazy_init)
    assert "for queued_call, orig_traceback in _queued_calls:" in lazy_init
    assert "_tls.is_initializing" in lazy_init  # is_initialized() is False while they run
    # what the payload appends has that shape
    assert '_QUEUED = ["' in payload_source() and "queued.append((_on_cuda_init, _QUEUED))" in \
        payload_source()


def test_cuda_has_primary_context_is_torch_s_and_the_payload_does_without_it_on_a_cpu_build():
    """A CUDA build's torch._C has it (torch's own registry of its C functions names it); a CPU
    build's has not, and the payload reads it with getattr(..., None), never by name."""
    from torch._dynamo import trace_rules

    assert "torch._C._cuda_hasPrimaryContext" in inspect.getsource(trace_rules)
    if torch.backends.cuda.is_built():
        assert callable(torch._C._cuda_hasPrimaryContext)
    else:
        assert not hasattr(torch._C, "_cuda_hasPrimaryContext")
    assert 'getattr(getattr(torch, "_C", None), "_cuda_hasPrimaryContext", None)' in \
        payload_source()


def test_the_memory_stats_keys_the_payload_reads_are_in_real_memory_stats_dumps():
    """torch.cuda.memory_stats() on a CPU build is {}; the keys are held against the dumps of
    real CUDA runs kept in tests/realworld/."""
    text = (ROOT / "tests" / "realworld"
            / "torch_cuda_memory_stats_and_summary_from_issues.txt").read_text()
    dumps = text.replace("\n", "")  # the pasted OrderedDicts are wrapped mid-key
    for key in ("reserved_bytes.all.current", "allocated_bytes.all.current",
                "active_bytes.all.current", "inactive_split_bytes.all.current",
                "num_alloc_retries", "num_ooms"):
        assert f'"{key}"' in payload_source()
        # whole, or (where the excerpt is cut) its statistic in the same name.pool.metric form
        stat = key.split(".")[0]
        assert f"'{key}'" in dumps or (f"'{stat}." in dumps and ".all.current'" in dumps), key
    assert "'reserved_bytes.all.current'" in dumps and "'num_alloc_retries'" in dumps


STANDIN_REPORT = r'''
import inspect, json, sys
import torch, torch.cuda
names = json.loads(sys.argv[1])
out = {}
for name in names:
    fn = getattr(torch.cuda, name, None)
    out[name] = None if fn is None else [
        (p.name, p.kind.name, repr(p.default) if p.default is not inspect.Parameter.empty else "-")
        for p in inspect.signature(fn).parameters.values()]
out["_queued_calls"] = type(torch.cuda._queued_calls).__name__
out["_C._cuda_hasPrimaryContext"] = callable(getattr(torch._C, "_cuda_hasPrimaryContext", None))
print(json.dumps(out))
'''


def test_the_stand_in_torch_has_the_real_names_with_the_real_signatures():
    proc = subprocess.run([sys.executable, "-c", STANDIN_REPORT, json.dumps(CUDA_FUNCTIONS)],
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(STANDINS)})
    assert proc.returncode == 0, proc.stderr
    standin = json.loads(proc.stdout)
    for name in CUDA_FUNCTIONS:
        real = [[n, kind, repr(default) if default != "-" else "-"]
                for n, kind, default in shape(getattr(torch.cuda, name))]
        assert standin[name] == real, f"torch.cuda.{name}: stand-in {standin[name]}, real {real}"
    assert standin["_queued_calls"] == type(torch.cuda._queued_calls).__name__ == "list"
    # the stand-in plays a CUDA build, which has it (see the test above)
    assert standin["_C._cuda_hasPrimaryContext"]


def test_the_installed_torch_reads_the_allocator_setting_under_both_names():
    """PYTORCH_ALLOC_CONF since 2.8, PYTORCH_CUDA_ALLOC_CONF still read as the older name: the
    fragmentation remedy names both (sidecar/judge/rules/memory.py)."""
    lib = Path(torch.__file__).parent / "lib"
    c10 = next(lib.glob("libc10.so*"), None)
    assert c10 is not None, f"no libc10 in {lib}"
    data = c10.read_bytes()
    assert b"PYTORCH_ALLOC_CONF\x00" in data and b"PYTORCH_CUDA_ALLOC_CONF\x00" in data
    from sidecar.judge.rules import ALL_KINDS

    remedy = ALL_KINDS["fragmentation"][3]
    assert "PYTORCH_ALLOC_CONF=expandable_segments:True" in remedy
    assert "PYTORCH_CUDA_ALLOC_CONF" in remedy and "2.8" in remedy


def test_importlib_finds_the_real_torch_not_the_stand_in():
    """The real-torch tests above are about the real package: the stand-in is only ever on the
    PYTHONPATH of the stand-in's own child processes."""
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin is not None
    assert not Path(spec.origin).is_relative_to(STANDINS)
