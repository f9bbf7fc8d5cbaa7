"""gpu-sidecar's injected publisher: the caching allocator's figures of the CUDA devices this
process uses, sent to the gpu-sidecar agent over its Unix datagram socket (Contract 2).

Loaded by the ``sitecustomize`` beside it once the process has imported torch.cuda, never
before. It never imports torch and never initialises CUDA: it puts ``_on_cuda_init`` on the
list of calls torch makes when CUDA is initialised in this process (``torch.cuda._queued_calls``,
the list ``torch.cuda._lazy_call`` fills), and only then starts its one daemon thread. A process
that never initialises CUDA never gets the thread. Each process publishes for itself, under its
own pid: spawned workers run this from their own start-up; forked ones inherit the queued call
(a parent that initialised CUDA cannot have CUDA children, and torch says so).

An app that runs ``sidecar.client`` itself (``client.start()``) publishes its own figures: this
one then stands down, so nothing is sent twice. It never raises into the app and never prints.

Placed by the agent, which sets the constants below to its own release; Python 3.9+, standard
library only. The figures read from torch, the UUIDs and the socket are ``sidecar.client``'s own:
the agent places ``sidecar/app_shared.py`` beside this file, byte for byte, as
``_gpu_sidecar_shared.py``, and this loads it by its path from its own version directory. Do not
edit it here: the source is sidecar/inject/payload/ of gpu-sidecar.
"""

import os
import sys
import threading
import time

# -- set by the agent when it places this file (sidecar/inject/placement.py) ---------------
AGENT_VERSION = "0+unplaced"
PROTOCOL_VERSION = 1  # what its datagrams say (the shared file, the same agent's, encodes them)
INTERVAL_S = 5.0
SOCKET_PATH = "/run/gpu-sidecar/app.sock"
SOCKET_NAME = "app.sock"
SOCKET_ENV = "GPU_SIDECAR_SOCKET"
MAX_MESSAGE_BYTES = 8192
MAX_GPUS = 64
MAX_BYTES = 1 << 50
# ------------------------------------------------------------------------------------------

SHARED = "_gpu_sidecar_shared"  # sidecar/app_shared.py, placed beside this file
PUBLISHER = "gpu-sidecar-inject/" + AGENT_VERSION
SWITCH = "GPU_SIDECAR_INJECT"  # =false: this process publishes nothing
# memory_snapshot() walks every block of the cache: at most every 12 publish intervals (60 s
# at the default 5 s), sooner when the cache's segments or its retries change
SNAPSHOT_EVERY_S = min(60.0, 12 * INTERVAL_S)
HELLO_EVERY_S = 60.0
READY_POLL_S = 0.02  # after the queued call: until torch says CUDA is initialised
POLL_S = 1.0  # only where torch has no queued calls: how often to look
SOON_S = 0.25  # CUDA up, nothing allocated yet: how often to look again, for FIRST_FIGURES_S
FIRST_FIGURES_S = 30.0
MAX_ERRORS = 100  # consecutive failed rounds before the thread gives up
THREAD_NAME = "gpu-sidecar-inject"
_OFF = ("0", "false", "no", "off")


def _load_shared():
    """The helpers sidecar.client has too, from the file the agent placed beside this one: read
    from this file's own version directory (the links resolved), so both come from the same
    placement even while the agent switches ``..data`` to another; by its path, never through
    sys.path or sys.modules, where a module of that name may be another's."""
    import importlib.util

    here = os.path.dirname(os.path.realpath(__file__))
    spec = importlib.util.spec_from_file_location(SHARED, os.path.join(here, SHARED + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


shared = _load_shared()


def _off():
    return os.environ.get(SWITCH, "").strip().lower() in _OFF


def _initializing(module):
    """A module still executing its import (``sys.modules`` has it before its end)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _app_publishes():
    """The app runs sidecar.client itself (client.start(), or a Publisher of its own)."""
    client = sys.modules.get("sidecar.client")
    default = getattr(client, "_default", None)
    if default is not None and getattr(default, "_running", True):
        return True
    return any(t.name == shared.PUBLISHER_THREAD for t in threading.enumerate())


def socket_path():
    """The variable, else the socket beside the directory this file was placed in (the volume
    may be mounted elsewhere in the app container than in the agent's), else the agent's path."""
    path = os.environ.get(SOCKET_ENV)
    if path:
        return path
    if SOCKET_NAME:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        beside = os.path.join(here, SOCKET_NAME)
        if os.path.exists(beside):
            return beside
    return SOCKET_PATH


class _Injected:
    """The process's one publisher: its thread, its socket, what it knows of the devices."""

    def __init__(self):
        self._reset()
        self.stood_down = False

    def _reset(self):
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = None
        self.pid = os.getpid()
        self.mode = None  # "queued": started by torch at CUDA initialisation; "poll": looks itself
        self.sender = None
        self.uuids = {}
        self.last_hello = -1e18
        self.hello_connection = 0
        self.hello_gpus = ()
        self.last_snapshot = -1e18
        self.last_retries = {}
        self.snap = {}
        self.errors = 0
        self.rounds = 0

    def start(self, mode):
        with self.lock:
            if self.thread is not None or self.stood_down or _off():
                return
            if mode == "poll" and self.mode == "queued":
                return
            self.mode = mode
            self.thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self.thread.start()

    def after_fork_in_child(self):
        """A forked child: its own pid, socket and state. A child of a parent that initialised
        CUDA cannot initialise it (torch marks it a bad fork): nothing to start there. A child
        of one that did not gets the queued call from its parent's list, so only the polling
        mode is restarted here."""
        mode, running = self.mode, self.thread is not None
        if self.sender is not None:
            self.sender.close()
        self._reset()
        if running and mode == "poll" and not self.stood_down and not _bad_fork():
            self.start("poll")

    # -- the thread -------------------------------------------------------------------------

    def _run(self):
        try:
            self.sender = shared.Sender(socket_path())
            deadline = time.monotonic() + 10.0
            while not self.stop.is_set():
                cuda = sys.modules.get("torch.cuda")
                if cuda is not None and not _initializing(cuda) and cuda.is_initialized():
                    break
                if self.mode == "queued" and time.monotonic() < deadline:
                    self.stop.wait(READY_POLL_S)  # torch is finishing its initialisation
                else:
                    self.stop.wait(POLL_S if self.mode == "poll" else INTERVAL_S)
            soon_until = time.monotonic() + FIRST_FIGURES_S
            while not self.stop.is_set():
                if _app_publishes() or _off():
                    self.stood_down = True
                    break
                try:
                    self.publish(cuda)
                    self.errors = 0
                except Exception:
                    self.errors += 1
                    if self.errors >= MAX_ERRORS:
                        break
                if self.rounds == 0 and time.monotonic() < soon_until:
                    # CUDA is up but nothing allocated yet: look again soon, not an interval later
                    self.stop.wait(min(SOON_S, INTERVAL_S))
                    continue
                self.stop.wait(shared.jittered(INTERVAL_S))
        except Exception:
            pass
        finally:
            if self.sender is not None:
                self.sender.close()

    def publish(self, cuda):
        devices = self.devices(cuda)
        if not devices:
            return
        now = time.monotonic()
        moved = {i: (fig["alloc_retries"], fig["reserved_bytes"]) for i, _, fig in devices}
        if moved != self.last_retries or now - self.last_snapshot >= SNAPSHOT_EVERY_S:
            self.snap = shared.snapshot_figures(shared.memory_snapshot(cuda))
            self.last_snapshot = now
        self.last_retries = moved
        gpus = tuple(uuid for _, uuid, _ in devices)
        # the hello names the publisher's release: at each new connection (a new agent,
        # maybe), when the GPUs change, and once a minute
        due = (self.sender.connected != self.hello_connection or gpus != self.hello_gpus
               or now - self.last_hello >= HELLO_EVERY_S or self.sender.sock is None)
        if due and self.send(shared.hello_datagram(self.pid, gpus, PUBLISHER)):
            self.last_hello, self.hello_gpus = now, gpus
            self.hello_connection = self.sender.connected
        allocators = []
        for index, uuid, fig in devices:
            reserved = min(fig["reserved_bytes"], MAX_BYTES)
            entry = {"gpu": uuid, "reserved_bytes": reserved}
            for name in ("allocated_bytes", "active_bytes", "inactive_split_bytes"):
                entry[name] = max(0, min(fig[name], reserved))
            entry["alloc_retries"] = max(0, min(fig["alloc_retries"], MAX_BYTES))
            entry["ooms"] = max(0, min(fig["ooms"], MAX_BYTES))
            for name, value in sorted(self.snap.get(index, {}).items()):
                entry[name] = max(0, min(value, reserved))  # a snapshot may be older than this
            allocators.append(entry)
        for data in _rounds(self.pid, allocators):
            self.send(data)
        self.rounds += 1

    def send(self, data):
        return self.sender.send(data, shared.SEND_PATIENCE)

    def devices(self, cuda):
        """(index, UUID, figures) of each device this process uses: the allocator holds memory
        there, or the process has a CUDA context on it (torch.cuda.set_device made it)."""
        torch = sys.modules.get("torch")
        has_context = getattr(getattr(torch, "_C", None), "_cuda_hasPrimaryContext", None)
        visible = ",".join(os.environ.get(v, "") for v in shared.VISIBLE_VARIABLES)
        out = []
        for index in range(min(int(cuda.device_count()), MAX_GPUS)):
            fig = shared.allocator_figures(cuda.memory_stats(index))
            if fig["reserved_bytes"] <= 0:
                try:
                    if has_context is None or not has_context(index):
                        continue
                except Exception:
                    continue
            uuid = self.uuids.get(index)
            if uuid is None:
                uuid = shared.uuid_text(cuda.get_device_properties(index).uuid, visible)
                if uuid is None:
                    continue
                self.uuids[index] = uuid
            out.append((index, uuid, fig))
        return out


def _rounds(pid, allocators):
    """The round in one datagram, or in as few as fit (whole GPUs each, naming only theirs),
    encoded as sidecar.client encodes its own (the shared file's encoder); no latency list:
    this publisher times no requests."""
    gpus = [a["gpu"] for a in allocators]
    return shared.round_datagrams(pid, gpus, allocators, None, max_bytes=MAX_MESSAGE_BYTES)


def _bad_fork():
    cuda = sys.modules.get("torch.cuda")
    try:
        return bool(getattr(cuda, "_is_in_bad_fork", lambda: False)())
    except Exception:
        return True


_INJECTED = _Injected()
_QUEUED = ["gpu-sidecar: the injected publisher's start, queued by its sitecustomize\n"]


def _on_cuda_init():
    """Called by torch while it initialises CUDA in this process (from its queued calls)."""
    try:
        _INJECTED.start("queued")
    except Exception:
        pass


def watch(finder):
    """Called by the sitecustomize's import watcher at an import once torch.cuda is in
    sys.modules. Queues ``_on_cuda_init`` with torch, or, where torch has no such list, starts
    the thread in polling mode once torch is imported whole; else asks to be called again at a
    later import (torch.cuda is still executing)."""
    cuda = sys.modules.get("torch.cuda")
    queued = getattr(cuda, "_queued_calls", None)
    if isinstance(queued, list) and callable(getattr(cuda, "is_initialized", None)):
        queued.append((_on_cuda_init, _QUEUED))
        try:
            ready = cuda.is_initialized()
        except Exception:  # torch.cuda still executing: its list will be read at initialisation
            ready = False
        if ready:  # already (or just) initialised: the list is not read again
            _on_cuda_init()
        return
    torch = sys.modules.get("torch")
    if cuda is not None and torch is not None and not _initializing(torch) \
            and not _initializing(cuda):
        if callable(getattr(cuda, "is_initialized", None)):
            _INJECTED.start("poll")
        return
    finder.done = False


def _stop_at_exit():
    _INJECTED.stop.set()


def _after_fork_in_child():
    try:
        _INJECTED.after_fork_in_child()
    except Exception:
        pass


def _register():
    import atexit

    atexit.register(_stop_at_exit)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)


_register()
