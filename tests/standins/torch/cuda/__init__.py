"""The stand-in's ``torch.cuda``, laid out as PyTorch's torch/cuda/__init__.py: CUDA is
initialised lazily (``_lazy_init``, on the first call that needs it), and the calls queued for
that moment (``_lazy_call`` fills ``_queued_calls``) run then, before ``is_initialized()`` turns
True; a process forked after initialisation is in a "bad fork" and cannot initialise again."""

import threading
import traceback

import torch
import torch._C

_initialized = False
_tls = threading.local()
_initialization_lock = threading.Lock()
_queued_calls = []  # don't invoke these until initialization occurs
_is_in_bad_fork = getattr(torch._C, "_cuda_isInBadFork", lambda: False)
OutOfMemoryError = torch._C.OutOfMemoryError


class DeferredCudaCallError(Exception):
    pass


def is_available():
    if not torch._C._cuda_isDriverSufficient():
        return False
    return torch._C._cuda_getDeviceCount() > 0


def is_initialized():
    r"""Return whether PyTorch's CUDA state has been initialized."""
    return _initialized and not _is_in_bad_fork()


def _lazy_call(callable, **kwargs):
    if is_initialized():
        callable()
    else:
        _queued_calls.append((callable, traceback.format_stack()))


def init():
    _lazy_init()


def _lazy_init():
    global _initialized
    if is_initialized() or hasattr(_tls, "is_initializing"):
        return
    with _initialization_lock:
        if is_initialized():
            return
        if _is_in_bad_fork():
            raise RuntimeError(
                "Cannot re-initialize CUDA in forked subprocess. To use CUDA with "
                "multiprocessing, you must use the 'spawn' start method")
        torch._C._cuda_init()
        _tls.is_initializing = True
        try:
            for queued_call, orig_traceback in _queued_calls:
                try:
                    queued_call()
                except Exception as e:
                    msg = (f"CUDA call failed lazily at initialization with error: {e}\n\n"
                           f"CUDA call was originally invoked at:\n\n{''.join(orig_traceback)}")
                    raise DeferredCudaCallError(msg) from e
        finally:
            delattr(_tls, "is_initializing")
        _initialized = True


def _get_device_index(device, optional=False):
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        device = device.index
    if device is None:
        if not optional:
            raise ValueError("Expected a torch.device with a specified index or an integer")
        return current_device()
    return int(device)


def device_count():
    return torch._C._cuda_getDeviceCount() if torch._C._cuda_isDriverSufficient() else 0


def current_device():
    _lazy_init()
    return torch._C._cuda_getDevice()


def set_device(device):
    device = _get_device_index(device)
    if device >= 0:
        torch._C._cuda_setDevice(device)


def get_device_properties(device=None):
    _lazy_init()
    device = _get_device_index(device, optional=True)
    if device < 0 or device >= device_count():
        raise AssertionError("Invalid device id")
    return torch._C._get_device_properties(device)


def get_device_name(device=None):
    return get_device_properties(device).name


def synchronize(device=None):
    _lazy_init()


from .memory import *  # noqa: E402, F403  (as in PyTorch: after the initialisation machinery)
