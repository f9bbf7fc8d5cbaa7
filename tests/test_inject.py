"""The injected publisher end to end (docs/client.md, "Injected"): a real agent places it and
listens on the real socket; real Python interpreters start app code that imports nothing of
ours, with only the documented environment (PYTHONPATH=<the placed directory>, the socket path)
and the stand-in torch (tests/standins/) on their path; what the agent prints is compared with
what ``torch.cuda.memory_stats()`` said in the app, for the right GPU UUIDs and pids."""

from __future__ import annotations

import ctypes
import glob
import json
import os
import subprocess
import sys
import textwrap
import threading
from functools import cache
from pathlib import Path

import pytest

from sidecar.simulate.scenarios import simulated_uuid
from tests.conftest import ROOT, send_datagram
from tests.receivers import Agent
from tests.waiting import until

STANDINS = ROOT / "tests" / "standins"
GPUS = [simulated_uuid("healthy", i) for i in range(2)]
INTERVAL = 0.5  # the agent's, and so the injected publisher's (min(interval, 5 s))
# the injected publisher's first figures come at most one publish interval after CUDA is
# initialised (then every interval, +-10 %); the agent prints what it holds once a cycle
WITHIN_S = 2 * INTERVAL + INTERVAL + 0.5  # two publish intervals, one agent cycle, scheduling
# the interpreter the venv was made from: the app's Python has nothing of ours installed
BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)
MIB = 1 << 20


@cache
def python(minor: int) -> str | None:
    """A CPython 3.<minor> interpreter on this machine (pyenv's, or one on PATH), or None."""
    candidates = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/3.{minor}.*/bin/python3")))
    candidates += [f"/usr/bin/python3.{minor}", f"/usr/local/bin/python3.{minor}"]
    if sys.version_info[:2] == (3, minor):
        candidates.insert(0, BASE_PYTHON)
    for exe in candidates:
        try:
            out = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out == f"(3, {minor})":
            return exe
    return None


class Pod:
    """An agent with a socket volume, as the k8s component sets one up."""

    def __init__(self, tmp: Path, *extra: str, preexec_fn=None) -> None:
        self.sock = tmp / "run" / "app.sock"
        self.inject_dir = self.sock.parent / "python"
        self.agent = Agent(["--simulate", "healthy", "--simulate-gpus", "2", "--no-simulated-app",
                            "--socket", str(self.sock), "--interval", str(INTERVAL),
                            "--app-process-series", *extra], preexec_fn=preexec_fn)

    def __enter__(self) -> Pod:
        self.agent.start()
        until(lambda: self.sock.exists() or self.agent.proc.poll() is not None,
              what="the agent's socket")
        assert self.agent.proc.poll() is None, "".join(self.agent.err)[-3000:]
        return self

    def __exit__(self, *exc: object) -> None:
        self.agent.stop()

    def env(self, **extra: str) -> dict[str, str]:
        """Only the documented environment, and the stand-in's GPUs."""
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
               "PYTHONPATH": f"{self.inject_dir}{os.pathsep}{STANDINS}",
               "GPU_SIDECAR_SOCKET": str(self.sock), "TORCH_STANDIN_GPUS": ",".join(GPUS)}
        env.update(extra)
        return env

    def first_seen(self, name: str, value: float, **labels: str) -> float | None:
        """When (epoch seconds) a cycle first printed ``name`` = ``value`` with ``labels``."""
        found = [ts for n, lab, ts, v in self.agent.sampled()
                 if n == name and v == value and all(dict(lab).get(k) == x for k, x in labels.items())]
        return min(found) / 1000 if found else None

    def pids(self) -> set[str]:
        return {dict(lab)["pid"] for _, lab, _, _ in self.agent.sampled() if "pid" in dict(lab)}


class App:
    """An app process: its code imports nothing of ours; it prints JSON lines and waits for
    ``release()`` (the file ``release`` appears) before it ends."""

    def __init__(self, tmp: Path, code: str, env: dict[str, str], exe: str = BASE_PYTHON,
                 name: str = "app") -> None:
        self.dir = tmp / name
        self.dir.mkdir()
        script = self.dir / "app.py"
        script.write_text(PRELUDE + textwrap.dedent(code))
        self.proc = subprocess.Popen([exe, str(script), str(self.dir)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=self.dir)
        self.lines: list[str] = []
        self.errors: list[str] = []
        self._readers = [threading.Thread(target=lambda s=stream, k=sink: k.extend(s), daemon=True)
                         for stream, sink in ((self.proc.stdout, self.lines),
                                              (self.proc.stderr, self.errors))]
        for reader in self._readers:
            reader.start()

    def reports(self) -> list[dict]:
        return [json.loads(line) for line in list(self.lines)]

    def report(self, kind: str, n: int = 1) -> list[dict]:
        """The first ``n`` reports of ``kind``, once the app has printed them."""
        def found() -> list[dict] | None:
            of_kind = [r for r in self.reports() if r.get("kind") == kind]
            assert len(of_kind) >= n or self.proc.poll() is None, \
                f"the app ended; stderr: {''.join(self.errors)[-3000:]}"
            return of_kind[:n] if len(of_kind) >= n else None

        return until(found, what=lambda: f"{n} '{kind}' report(s) of the app; stderr: "
                                         f"{''.join(self.errors)[-2000:]}")

    def release(self, name: str = "release") -> None:
        (self.dir / name).touch()

    def finish(self, timeout: float = 60) -> list[dict]:
        self.release()
        rc = self.proc.wait(timeout=timeout)
        for reader in self._readers:
            reader.join(timeout=10)
        assert rc == 0, "".join(self.errors)[-3000:]
        assert "".join(self.errors) == "", "a line on the app's stderr: " + "".join(self.errors)
        return self.reports()  # every stdout line parsed as the app's JSON: none of ours


# Helpers of the app scripts: the app's own code, standard library and torch only.
PRELUDE = '''\
import json, os, sys, threading, time
HERE = sys.argv[1]

def say(kind, **fields):
    print(json.dumps({"kind": kind, "pid": os.getpid(), **fields}), flush=True)

def wait_for(name="release", limit=120):
    deadline = time.monotonic() + limit
    while not os.path.exists(os.path.join(HERE, name)) and time.monotonic() < deadline:
        time.sleep(0.02)

def threads():
    return sorted(t.name for t in threading.enumerate())

def fragment(torch, device, mib):
    """Allocate in a fragmenting pattern: many blocks, every other one freed."""
    held = [torch.empty(mib * (1 << 20), dtype=torch.uint8, device=f"cuda:{device}")
            for mib in mib]
    del held[::2]
    return held

def figures(torch, device):
    s = torch.cuda.memory_stats(device)
    largest = max([b["size"] for seg in torch.cuda.memory_snapshot() if seg["device"] == device
                   for b in seg["blocks"] if b["state"] == "inactive"] or [0])
    return {"reserved": s["reserved_bytes.all.current"],
            "allocated": s["allocated_bytes.all.current"],
            "inactive_split": s["inactive_split_bytes.all.current"],
            "largest_free": largest}
'''


def assert_published(pod: Pod, report: dict, uuid: str, *, alone_on_gpu: bool = True) -> None:
    """The agent prints the app's figures of ``report`` for ``uuid`` and its pid, first within
    two publish intervals of CUDA being initialised in that process."""
    pid, fig = str(report["pid"]), report["figures"]
    until(lambda: pod.agent.last("gpu_app_process_reserved_bytes", gpu_uuid=uuid, pid=pid)
          == fig["reserved"] and pod.agent.last("gpu_app_process_allocated_bytes", gpu_uuid=uuid,
                                                pid=pid) == fig["allocated"],
          what=lambda: f"pid {pid}'s figures on {uuid} in the agent's output ({fig}); "
                       f"agent: {''.join(pod.agent.err)[-1500:]}")
    first = pod.first_seen("gpu_app_process_reserved_bytes", fig["reserved"], gpu_uuid=uuid, pid=pid)
    assert first is not None and first - report["cuda_init"] <= WITHIN_S, (
        f"first figures {first - report['cuda_init']:.2f} s after CUDA init (bound {WITHIN_S} s)")
    if alone_on_gpu:  # the GPU's series are that process's: the snapshot's figures too
        until(lambda: pod.agent.last("gpu_allocator_largest_free_block_bytes", gpu_uuid=uuid)
              == fig["largest_free"], what=f"the largest free block on {uuid}")
        assert pod.agent.last("gpu_memory_fragmentation_ratio", gpu_uuid=uuid) == pytest.approx(
            (fig["reserved"] - fig["allocated"]) / fig["reserved"])
        assert pod.agent.last("gpu_app_processes", gpu_uuid=uuid) == 1


SPAWN_SERVER = '''
import multiprocessing as mp
import torch  # the server imports torch, and never initialises CUDA itself

def worker(rank, queue, here):
    t0 = time.time()
    torch.cuda.set_device(rank)  # initialises CUDA, on this worker's GPU
    held = fragment(torch, rank, [3, 7, 3, 12, 3, 5, 2] if rank == 0 else [25, 4, 4, 30, 4])
    queue.put({"kind": "worker", "pid": os.getpid(), "rank": rank, "cuda_init": t0,
               "figures": figures(torch, rank), "threads": threads()})
    while not os.path.exists(os.path.join(here, "release")):
        time.sleep(0.02)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, queue, HERE)) for r in (0, 1)]
    for p in procs:
        p.start()
    for _ in procs:
        print(json.dumps(queue.get()), flush=True)
    say("server", cuda=torch.cuda.is_initialized(), threads=threads())
    wait_for()
    for p in procs:
        p.join()
    say("done", exitcodes=[p.exitcode for p in procs])
'''


def test_spawned_workers_of_a_server_each_publish_their_own_gpu(tmp_path):
    with Pod(tmp_path) as pod:
        app = App(tmp_path, SPAWN_SERVER, pod.env())
        workers = sorted(app.report("worker", 2), key=lambda r: r["rank"])
        server = app.report("server")[0]
        for w in workers:
            assert_published(pod, w, GPUS[w["rank"]])
            assert w["threads"].count("gpu-sidecar-inject") == 1  # one thread per process
        pod.agent.more_cycles(2)
        assert pod.pids() == {str(w["pid"]) for w in workers}  # the server sent nothing
        assert not server["cuda"] and "gpu-sidecar-inject" not in server["threads"]
        reports = app.finish()
        assert reports[-1]["exitcodes"] == [0, 0]
        said = pod.agent.logged("app_publisher")
        assert {e["pid"] for e in said} <= {w["pid"] for w in workers}
        assert all(e["publisher"] == "gpu-sidecar-inject/" + e["agent_version"] for e in said)


PREFORK_SERVER = '''
import torch  # preloaded before the fork, as gunicorn --preload does; no CUDA in the parent

children = []
for k in (0, 1):
    pid = os.fork()
    if pid == 0:
        t0 = time.time()
        torch.cuda.set_device(k)
        held = fragment(torch, k, [6, 2, 6, 2, 6] if k == 0 else [40, 1, 1, 40])
        say("worker", rank=k, cuda_init=t0, figures=figures(torch, k), threads=threads())
        wait_for()
        os._exit(0)
    children.append(pid)
say("server", cuda=torch.cuda.is_initialized(), threads=threads())
wait_for()
say("done", status=[os.waitpid(p, 0)[1] for p in children])
'''


def test_a_pre_fork_server_s_workers_each_publish_under_their_own_pid(tmp_path):
    with Pod(tmp_path) as pod:
        app = App(tmp_path, PREFORK_SERVER, pod.env())
        workers = sorted(app.report("worker", 2), key=lambda r: r["rank"])
        for w in workers:
            assert_published(pod, w, GPUS[w["rank"]])
            assert w["threads"] == ["MainThread", "gpu-sidecar-inject"]
        server = app.report("server")[0]
        assert not server["cuda"] and server["threads"] == ["MainThread"]
        pod.agent.more_cycles(2)
        assert pod.pids() == {str(w["pid"]) for w in workers}
        assert app.finish()[-1]["status"] == [0, 0]


def test_a_child_forked_after_cuda_is_up_cannot_use_it_and_publishes_nothing(tmp_path):
    code = '''
    import torch
    torch.cuda.set_device(0)
    held = fragment(torch, 0, [4, 4, 4])
    say("parent", cuda_init=time.time(), figures=figures(torch, 0))
    pid = os.fork()
    if pid == 0:
        try:
            torch.cuda.init()
            ok = True
        except RuntimeError:
            ok = False
        time.sleep(4 * 0.5)
        say("child", reinit=ok, threads=threads(), cuda=torch.cuda.is_initialized())
        os._exit(0)
    os.waitpid(pid, 0)
    wait_for()
    '''
    with Pod(tmp_path) as pod:
        app = App(tmp_path, code, pod.env())
        child = app.report("child")[0]
        assert child == {**child, "reinit": False, "threads": ["MainThread"], "cuda": False}
        parent = app.report("parent")[0]
        until(lambda: pod.agent.last("gpu_app_process_reserved_bytes", gpu_uuid=GPUS[0],
                                     pid=str(parent["pid"])) == parent["figures"]["reserved"])
        assert str(child["pid"]) not in pod.pids()
        app.finish()


def test_a_process_that_never_initialises_cuda_sends_nothing_and_imports_no_torch(tmp_path):
    plain = '''
    import subprocess
    say("plain", modules=sorted(m for m in sys.modules if "torch" in m or "sidecar" in m),
        threads=threads(), watcher=type(sys.meta_path[0]).__name__)
    wait_for()
    '''
    tokenizer = '''
    import torch  # a tokenizer worker: torch imported, CUDA never
    time.sleep(6 * 0.5)
    say("tokenizer", cuda=torch.cuda.is_initialized(), threads=threads(),
        driver=torch._C.driver_calls(), loaded="_gpu_sidecar_inject" in sys.modules)
    wait_for()
    '''
    with Pod(tmp_path) as pod:
        a = App(tmp_path, plain, pod.env(), name="plain")
        b = App(tmp_path, tokenizer, pod.env(), name="tokenizer")
        p, t = a.report("plain")[0], b.report("tokenizer")[0]
        assert p["modules"] == [] and p["threads"] == ["MainThread"]
        assert p["watcher"] == "GpuSidecarWatch"  # all it costs: an import watcher
        # the publisher module is loaded, its start queued with torch; no thread, no CUDA call
        assert t["loaded"] and not t["cuda"] and t["threads"] == ["MainThread"]
        assert t["driver"] == []
        pod.agent.more_cycles(2)
        assert pod.agent.total("gpu_sidecar_app_messages_accepted_total") == 0
        assert not pod.agent.logged("app_publisher")
        a.finish()
        b.finish()


IMAGE_SITECUSTOMIZE = '''\
import os
os.environ["IMAGE_SITECUSTOMIZE_RAN"] = __file__
'''


def test_the_image_s_own_sitecustomize_still_runs(tmp_path):
    image = tmp_path / "image-site"
    image.mkdir()
    (image / "sitecustomize.py").write_text(IMAGE_SITECUSTOMIZE)
    code = '''
    import sitecustomize
    t0 = time.time()
    import torch
    torch.cuda.set_device(1)
    held = fragment(torch, 1, [5, 5, 9, 5])
    say("app", cuda_init=t0, figures=figures(torch, 1), ran=os.environ.get("IMAGE_SITECUSTOMIZE_RAN"),
        module=sitecustomize.__file__, path=[p for p in sys.path if "python" in p or "site" in p])
    wait_for()
    '''
    with Pod(tmp_path) as pod:
        env = pod.env(PYTHONPATH=os.pathsep.join([str(pod.inject_dir), str(image), str(STANDINS)]))
        app = App(tmp_path, code, env)
        report = app.report("app")[0]
        assert report["ran"] == report["module"] == str(image / "sitecustomize.py")
        assert str(pod.inject_dir) in report["path"]  # ours stays on sys.path
        assert_published(pod, report, GPUS[1])
        app.finish()


def test_gpu_sidecar_inject_false_switches_it_off_in_the_app(tmp_path):
    code = '''
    import torch
    torch.cuda.set_device(0)
    held = fragment(torch, 0, [8, 8, 8])
    time.sleep(6 * 0.5)
    say("app", threads=threads(), loaded="_gpu_sidecar_inject" in sys.modules,
        watchers=[type(f).__name__ for f in sys.meta_path])
    wait_for()
    '''
    with Pod(tmp_path) as pod:
        app = App(tmp_path, code, pod.env(GPU_SIDECAR_INJECT="false"))
        report = app.report("app")[0]
        assert report["threads"] == ["MainThread"] and not report["loaded"]
        assert "GpuSidecarWatch" not in report["watchers"]
        pod.agent.more_cycles(2)
        assert pod.agent.total("gpu_sidecar_app_messages_accepted_total") == 0
        app.finish()


CLIENT_APP = '''
from sidecar import client  # this app publishes itself (gpu-sidecar-client)
import torch
if sys.argv[2] == "before":
    client.start(interval_s=0.5)
torch.cuda.set_device(0)
held = fragment(torch, 0, [10, 3, 10])
say("app", cuda_init=time.time(), figures=figures(torch, 0))
wait_for("start-client")
if sys.argv[2] == "after":
    client.start(interval_s=0.5)
for _ in range(9):
    client.observe(0.05)
time.sleep(4 * 0.5)
say("threads", threads=threads())
wait_for()
'''


@pytest.mark.parametrize("when", ["before", "after"])
def test_an_app_that_starts_sidecar_client_itself_is_published_once(tmp_path, when):
    with Pod(tmp_path) as pod:
        env = pod.env()
        app = App(tmp_path, CLIENT_APP.replace('sys.argv[2]', repr(when)), env, exe=sys.executable)
        report = app.report("app")[0]
        pid = report["pid"]
        if when == "after":  # the injected publisher is publishing: then the app's own starts
            until(lambda: any(e["pid"] == pid for e in pod.agent.logged("app_publisher")),
                  what="the injected publisher's hello")
        app.release("start-client")
        threads = app.report("threads")[0]["threads"]
        assert "gpu-sidecar-publisher" in threads and "gpu-sidecar-inject" not in threads
        until(lambda: pod.agent.last("inference_request_duration_seconds_count",
                                     gpu_uuid=GPUS[0]) == 9, what="the client's latency")
        assert pod.agent.last("gpu_app_process_reserved_bytes", gpu_uuid=GPUS[0],
                              pid=str(pid)) == report["figures"]["reserved"]
        assert pod.agent.last("gpu_app_processes", gpu_uuid=GPUS[0]) == 1
        if when == "before":  # the injected one never sent a datagram
            assert not pod.agent.logged("app_publisher")
        app.finish()


def _read_only_tmpfs(path: Path):
    """preexec_fn: the agent alone sees ``path`` as a read-only tmpfs (a private mount namespace)."""
    def pre() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(0x20000) != 0:  # CLONE_NEWNS
            raise OSError(ctypes.get_errno(), "unshare")
        if libc.mount(b"none", b"/", None, 0x4000 | (1 << 18), None) != 0:  # MS_REC|MS_PRIVATE
            raise OSError(ctypes.get_errno(), "mount --make-rprivate /")
        if libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", 1, None) != 0:  # MS_RDONLY
            raise OSError(ctypes.get_errno(), "mount -o ro")
    return pre


APP_ALONE = '''
import torch
torch.cuda.set_device(0)
held = fragment(torch, 0, [2, 2])
say("app", threads=threads())
'''


@pytest.mark.parametrize("volume", ["read-only", "missing"])
def test_a_volume_the_agent_cannot_place_in_is_one_warning_and_the_app_starts_normally(
        tmp_path, volume):
    if volume == "read-only":
        target = tmp_path / "ro"
        target.mkdir()
        inject_dir, pre = target / "python", _read_only_tmpfs(target)
    else:  # a path through a regular file: no volume where the option says
        (tmp_path / "not-a-volume").write_text("")
        inject_dir, pre = tmp_path / "not-a-volume" / "python", None
    with Pod(tmp_path, "--inject-dir", str(inject_dir), preexec_fn=pre) as pod:
        pod.agent.more_cycles(2)  # the agent runs on
        warned = pod.agent.logged("inject_not_placed")
        assert len(warned) == 1 and warned[0]["level"] == "warning"
        assert warned[0]["reason"] == ("EROFS" if volume == "read-only" else "ENOTDIR")
        assert warned[0]["directory"] == str(inject_dir)
        assert "the agent runs on" in warned[0]["effect"]
        proc = subprocess.run([BASE_PYTHON, "-c", PRELUDE + textwrap.dedent(APP_ALONE), "."],
                              capture_output=True, text=True, timeout=60,
                              env=pod.env(PYTHONPATH=f"{inject_dir}{os.pathsep}{STANDINS}"))
        assert proc.returncode == 0 and proc.stderr == ""
        (line,) = proc.stdout.splitlines()
        assert json.loads(line)["threads"] == ["MainThread"]
        assert pod.agent.total("gpu_sidecar_app_messages_accepted_total") == 0


@pytest.mark.parametrize("minor", [9, 10, 11, 12, 13])
def test_it_runs_on_every_python_the_serving_images_use(tmp_path, minor):
    exe = python(minor)
    if exe is None:
        pytest.skip(f"no CPython 3.{minor} on this machine (pyenv's versions are looked for)")
    code = '''
    t0 = time.time()
    import torch
    held = fragment(torch, 0, [3, 9, 3, 9, 3])  # device 0 of CUDA_VISIBLE_DEVICES=1
    say("app", cuda_init=t0, figures=figures(torch, 0), version=list(sys.version_info[:2]))
    wait_for()
    '''
    with Pod(tmp_path) as pod:
        app = App(tmp_path, code, pod.env(CUDA_VISIBLE_DEVICES="1"), exe=exe)
        report = app.report("app")[0]
        assert report["version"] == [3, minor]
        assert_published(pod, report, GPUS[1])  # the UUID of the device the process sees
        assert not any(dict(lab).get("gpu_uuid") == GPUS[0] for _, lab, _, _ in pod.agent.sampled()
                       if "pid" in dict(lab))
        app.finish()


def test_the_component_s_pythonpath_without_one_of_the_container_s_adds_no_working_directory(
        tmp_path):
    """The k8s component writes PYTHONPATH='<dir>:' where the container sets none; the placed
    sitecustomize reads it back as '<dir>', for the process and its children."""
    work, scripts = tmp_path / "work", tmp_path / "scripts"
    work.mkdir()
    scripts.mkdir()
    (work / "json.py").write_text("raise SystemExit('the working directory was on sys.path')\n")
    script = scripts / "check.py"  # a script: sys.path[0] is its directory, not the working one
    script.write_text(
        "import os, subprocess, sys, json\n"
        "print(json.dumps([os.environ['PYTHONPATH'], os.getcwd() in sys.path]))\n"
        "print(subprocess.run([sys.executable, '-c', 'import os; print(os.environ[\"PYTHONPATH\"])'],"
        " capture_output=True, text=True).stdout.strip())\n")
    with Pod(tmp_path) as pod:
        proc = subprocess.run([BASE_PYTHON, str(script)], capture_output=True, text=True, cwd=work,
                              timeout=60, env=pod.env(PYTHONPATH=f"{pod.inject_dir}{os.pathsep}"))
    assert proc.returncode == 0, proc.stderr
    first, child = proc.stdout.splitlines()
    assert json.loads(first) == [str(pod.inject_dir), False]
    assert child == str(pod.inject_dir)


def test_a_publisher_of_another_release_is_said_once(tmp_path):
    def hello(v: int, publisher: str, pid: int) -> bytes:
        return json.dumps({"v": v, "kind": "hello", "pid": pid, "gpus": [GPUS[0]],
                           "publisher": publisher}).encode()

    with Pod(tmp_path) as pod:
        for pid in (11, 12):
            send_datagram(str(pod.sock), hello(1, "gpu-sidecar-inject/0.0.9", pid))
            send_datagram(str(pod.sock), hello(2, "gpu-sidecar-inject/9.0.0", pid))
        until(lambda: pod.agent.logged("app_publisher_protocol_differs")
              and pod.agent.logged("app_publisher_version_differs"), what="the two warnings")
        pod.agent.more_cycles(2)
        (differs,) = pod.agent.logged("app_publisher_version_differs")
        assert differs["publisher"] == "gpu-sidecar-inject/0.0.9" and differs["pid"] == 11
        assert "accepted" in differs["effect"]
        (refused,) = pod.agent.logged("app_publisher_protocol_differs")
        assert refused["protocol"] == 2 and "refused" in refused["effect"]
        assert pod.agent.total("gpu_sidecar_app_messages_rejected_total", reason="bad_version") == 2
        assert GPUS[0] in {dict(lab).get("gpu_uuid") for _, lab, _, _ in pod.agent.sampled()}
