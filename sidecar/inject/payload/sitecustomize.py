"""gpu-sidecar's injected publisher, started by Python itself: this directory is on PYTHONPATH,
so every interpreter of the app container runs this file at start-up (``site`` imports
``sitecustomize``). Placed read-only by the gpu-sidecar agent, replaced at each of its starts; do
not edit it here (the source is sidecar/inject/payload/ of gpu-sidecar).

At start-up it only adds an import watcher that finds nothing: no thread, no socket, no file
read. Once the process has imported torch.cuda, the watcher asks torch to call the publisher
when CUDA is initialised (torch's own hook for work deferred to that moment), so a process that
never initialises CUDA (a tokenizer worker, a shell, pip) costs nothing more. Then it runs the
``sitecustomize`` the image had before ours, as Python would have without us.

GPU_SIDECAR_INJECT=false in the environment switches it off. Python 3.9+, standard library only;
it never raises into the app and never prints.
"""

import os
import sys

_OFF = ("0", "false", "no", "off")


class GpuSidecarWatch:
    """A ``sys.meta_path`` entry that finds no module: it only watches imports go by until
    torch.cuda is there, then hands over to ``_gpu_sidecar_inject.watch`` (loaded only then)."""

    def __init__(self, here):
        self.here = here
        self.done = False

    def find_spec(self, name, path=None, target=None):
        if not self.done and "torch.cuda" in sys.modules:
            self.done = True  # first: the imports below come through here too
            try:
                _publisher(self.here).watch(self)  # may set done back to False: try again later
            except Exception:
                pass
        return None


def _publisher(here):
    module = sys.modules.get("_gpu_sidecar_inject")
    if module is None:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "_gpu_sidecar_inject", os.path.join(here, "_gpu_sidecar_inject.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["_gpu_sidecar_inject"] = module
    return module


def _install(here):
    if os.environ.get("GPU_SIDECAR_INJECT", "").strip().lower() in _OFF:
        return
    for finder in sys.meta_path:
        if type(finder).__name__ == "GpuSidecarWatch":
            return  # ours again (the directory twice on sys.path): one watcher per process
    watch = GpuSidecarWatch(here)
    sys.meta_path.insert(0, watch)
    if "torch.cuda" in sys.modules:  # imported before site ran (a .pth file)
        watch.find_spec("torch.cuda")


def _chain(here):
    """Import the next ``sitecustomize`` on sys.path, the image's own, as ``site`` would have:
    it ends up as ``sys.modules["sitecustomize"]`` and its errors are reported by ``site``."""
    ours = sys.modules.get("sitecustomize")
    removed = [(i, p) for i, p in enumerate(sys.path)
               if isinstance(p, str) and os.path.abspath(p or os.curdir) == here]
    for i, _ in reversed(removed):
        del sys.path[i]
    sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401  (the next one: ours is off sys.path)
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours  # there was none: we stay
    finally:
        for i, p in removed:
            sys.path.insert(i, p)


def _no_empty_entry(here):
    """PYTHONPATH set to '<this directory>:' (by hand, or by an earlier k8s component where the
    container set none; it now writes the directory alone): Python reads the empty entry as
    the working directory. Only that exact value is read back as meant: the
    working directory off sys.path, and PYTHONPATH without the empty entry for the processes
    this one starts."""
    value = os.environ.get("PYTHONPATH", "")
    if not value.endswith(os.pathsep) or os.path.abspath(value[:-1]) != here \
            or os.pathsep in value[:-1]:
        return
    os.environ["PYTHONPATH"] = value[:-1]
    cwd = os.getcwd()
    for i in range(1, len(sys.path)):
        if sys.path[i] == cwd and isinstance(sys.path[i - 1], str) \
                and os.path.abspath(sys.path[i - 1]) == here:
            del sys.path[i]
            return


def _main():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        _no_empty_entry(here)
    except Exception:
        pass
    try:
        _install(here)
    except Exception:
        pass
    _chain(here)


_main()
