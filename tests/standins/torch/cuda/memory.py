"""The stand-in's ``torch.cuda.memory``: PyTorch's functions over the stand-in allocator, with
their shapes: ``memory_stats`` flattens the nested dictionary to sorted ``name.pool.metric``
keys; both return ``{}`` before CUDA is initialised; ``memory_snapshot`` returns the segments."""

import collections

import torch
from torch import _C

from . import _get_device_index, _lazy_init, is_initialized

__all__ = ["empty_cache", "max_memory_allocated", "memory_allocated", "memory_reserved",
           "memory_snapshot", "memory_stats", "memory_stats_as_nested_dict"]


def memory_stats(device=None):
    result = []

    def _recurse_add_to_result(prefix, obj):
        if isinstance(obj, dict):
            if len(prefix) > 0:
                prefix += "."
            for k, v in obj.items():
                _recurse_add_to_result(prefix + k, v)
        else:
            result.append((prefix, obj))

    stats = memory_stats_as_nested_dict(device=device)
    _recurse_add_to_result("", stats)
    result.sort()
    return collections.OrderedDict(result)


def memory_stats_as_nested_dict(device=None):
    if not is_initialized():
        return {}
    device = _get_device_index(device, optional=True)
    return _C._cuda_memoryStats(device)


def memory_snapshot(mempool_id=None, include_traces=True):
    return _C._cuda_memorySnapshot((0, 0, include_traces))["segments"]


def memory_allocated(device=None):
    return memory_stats(device=device).get("allocated_bytes.all.current", 0)


def max_memory_allocated(device=None):
    return memory_stats(device=device).get("allocated_bytes.all.peak", 0)


def memory_reserved(device=None):
    return memory_stats(device=device).get("reserved_bytes.all.current", 0)


def empty_cache():
    if is_initialized():
        _C._cuda_emptyCache()


del torch, _lazy_init
