"""The stand-in's ``torch._C``: what PyTorch's C++ extension gives ``torch.cuda``, over a model
of the CUDA "driver" (devices from ``TORCH_STANDIN_GPUS``) and of the caching allocator.

The functions keep the names and results of PyTorch's (torch/csrc/cuda/Module.cpp):
``_cuda_getDeviceCount``, ``_cuda_init``, ``_cuda_getDevice`` / ``_cuda_setDevice`` (the current
device is per thread, as CUDA's is), ``_cuda_hasPrimaryContext`` (asks without creating one),
``_cuda_isInBadFork`` (a process forked after CUDA was initialised), ``_cuda_memoryStats`` (the
nested dictionary ``memory_stats_as_nested_dict`` returns), ``_cuda_memorySnapshot`` (``{"segments":
[...], "device_traces": [...]}``), ``_cuda_emptyCache`` and ``_get_device_properties``, whose
``uuid`` is a ``_CUuuid`` printed as the bare 8-4-4-4-12 hex UUID.

The allocator follows CUDACachingAllocator's sizes: requests rounded to 512 bytes; up to 1 MiB
from 2 MiB segments of the small pool, up to 10 MiB from 20 MiB segments of the large pool,
larger ones in segments rounded to 2 MiB; best fit among cached blocks; a block split when the
rest is at least 512 bytes (small) or more than 1 MiB (large); frees merge neighbours; an
allocation that does not fit frees the cached segments and retries (``num_alloc_retries``), then
raises ``OutOfMemoryError`` (``num_ooms``).

``driver_calls()`` lists every call that reached the "driver", with the calling thread's name:
the tests read it to show that the injected publisher touches CUDA only after the app did.
"""

import itertools
import os
import threading

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
MIN_BLOCK = 512
SMALL_SIZE = 1 * MIB
SMALL_BUFFER = 2 * MIB
LARGE_BUFFER = 20 * MIB
MIN_LARGE_ALLOC = 10 * MIB
ROUND_LARGE = 2 * MIB
STATS = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
         "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
POOLS = ("all", "large_pool", "small_pool")

_lock = threading.RLock()
_calls = []
_tls = threading.local()
_state = {"initialised": False, "bad_fork": False, "contexts": set(), "visible": None,
          "allocators": {}, "fork_hook": False}
_addresses = itertools.count(0x7F0000000000, 1 << 30)


class OutOfMemoryError(RuntimeError):
    pass


def _log(name):
    with _lock:
        _calls.append((name, threading.current_thread().name))


def driver_calls():
    """(function, thread name) of every call that reached the stand-in driver, in order."""
    with _lock:
        return list(_calls)


# -- devices -----------------------------------------------------------------------------------

def _physical():
    raw = os.environ.get("TORCH_STANDIN_GPUS", "")
    return [u.strip() for u in raw.split(",") if u.strip()]


def _visible():
    """The physical GPUs this process sees, in CUDA's order: CUDA_VISIBLE_DEVICES by index or by
    UUID (a unique prefix), ending at the first entry that names no device."""
    if _state["visible"] is not None:
        return _state["visible"]
    physical = _physical()
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        seen = list(physical)
    else:
        seen = []
        for token in (t.strip() for t in spec.split(",")):
            if token.isdigit() and int(token) < len(physical):
                found = physical[int(token)]
            else:
                matches = [u for u in physical if token and u.startswith(token)]
                if len(matches) != 1:
                    break
                found = matches[0]
            if found in seen:
                break
            seen.append(found)
    if _state["initialised"]:
        _state["visible"] = seen  # read once, at initialisation, as cuInit does
    return seen


def _cuda_getDeviceCount():
    _log("_cuda_getDeviceCount")
    return len(_visible())


def _cuda_isDriverSufficient():
    return bool(_physical())


def _cuda_isInBadFork():
    return _state["bad_fork"]


def _forked_child():
    _state["bad_fork"] = True
    _state["initialised"] = False


def _cuda_init():
    _log("_cuda_init")
    if _state["bad_fork"]:
        raise RuntimeError("Cannot re-initialize CUDA in forked subprocess.")
    if not _physical():
        raise RuntimeError("Found no NVIDIA driver on your system.")
    with _lock:
        _state["initialised"] = True
        _state["visible"] = None
        _visible()
        if not _state["fork_hook"]:
            _state["fork_hook"] = True
            os.register_at_fork(after_in_child=_forked_child)


def _check(index):
    if not _state["initialised"]:
        raise RuntimeError("CUDA is not initialised: the stand-in driver was called too early")
    if not 0 <= index < len(_visible()):
        raise RuntimeError("CUDA error: invalid device ordinal")


def _cuda_getDevice():
    _log("_cuda_getDevice")
    return getattr(_tls, "device", 0)


def _cuda_setDevice(index):
    _log("_cuda_setDevice")
    import torch.cuda

    torch.cuda._lazy_init()  # as torch::utils::device_lazy_init does
    _check(index)
    _tls.device = index
    with _lock:
        _state["contexts"].add(index)  # CUDA 12: cudaSetDevice creates the primary context


def _cuda_hasPrimaryContext(index):
    _log("_cuda_hasPrimaryContext")
    return index in _state["contexts"]


class _CUuuid:
    def __init__(self, text):
        self._text = text

    @property
    def bytes(self):
        return list(bytearray.fromhex(self._text.replace("-", "")))

    def __str__(self):
        return self._text

    def __repr__(self):
        return self._text


class _CudaDeviceProperties:
    def __init__(self, uuid, total):
        self.name = "Stand-in NVIDIA H200"
        self.major, self.minor = 9, 0
        self.total_memory = total
        self.multi_processor_count = 132
        self.is_integrated = 0
        self.is_multi_gpu_board = 0
        self.L2_cache_size = 60 * MIB
        self.uuid = _CUuuid(uuid[4:] if uuid.startswith(("GPU-", "MIG-")) else uuid)

    def __repr__(self):
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, "
                f"minor={self.minor}, total_memory={self.total_memory // MIB}MB, "
                f"multi_processor_count={self.multi_processor_count}, uuid={self.uuid}, "
                f"L2_cache_size={self.L2_cache_size // MIB}MB)")


def _total_memory():
    return int(os.environ.get("TORCH_STANDIN_MEMORY", str(141 * GIB)))


def _get_device_properties(index):
    _log("_get_device_properties")
    _check(index)
    return _CudaDeviceProperties(_visible()[index], _total_memory())


# -- the caching allocator ---------------------------------------------------------------------

class _Block:
    __slots__ = ("address", "requested", "segment", "size", "state")

    def __init__(self, address, size, segment):
        self.address, self.size, self.requested = address, size, 0
        self.state, self.segment = "inactive", segment


class _Segment:
    def __init__(self, address, size, pool):
        self.address, self.size, self.pool = address, size, pool
        self.blocks = [_Block(address, size, self)]


class _Allocator:
    def __init__(self, index):
        self.index = index
        self.segments = []
        self.current = {(s, p): 0 for s in STATS for p in POOLS}
        self.peak = dict(self.current)
        self.allocated = dict(self.current)
        self.freed = dict(self.current)
        self.counters = {"num_alloc_retries": 0, "num_ooms": 0, "num_sync_all_streams": 0,
                         "num_device_alloc": 0, "num_device_free": 0}

    # sizes as CUDACachingAllocator computes them
    @staticmethod
    def round_size(size):
        return MIN_BLOCK if size < MIN_BLOCK else MIN_BLOCK * ((size + MIN_BLOCK - 1) // MIN_BLOCK)

    @staticmethod
    def segment_size(size):
        if size <= SMALL_SIZE:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:
            return LARGE_BUFFER
        return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)

    def reserved(self):
        return sum(s.size for s in self.segments)

    def malloc(self, nbytes):
        size = self.round_size(max(int(nbytes), 1))
        pool = "small" if size <= SMALL_SIZE else "large"
        block = self._best_fit(size, pool)
        if block is None:
            need = self.segment_size(size)
            if self.reserved() + need > _total_memory():
                self.counters["num_alloc_retries"] += 1
                self.release_cached()
                if self.reserved() + need > _total_memory():
                    self.counters["num_ooms"] += 1
                    self._account()
                    raise OutOfMemoryError(
                        f"CUDA out of memory. Tried to allocate {size / MIB:.2f} MiB.")
            segment = _Segment(next(_addresses), need, pool)
            self.segments.append(segment)
            self.counters["num_device_alloc"] += 1
            block = segment.blocks[0]
        rest = block.size - size
        if (rest >= MIN_BLOCK) if pool == "small" else (rest > SMALL_SIZE):
            tail = _Block(block.address + size, rest, block.segment)
            block.size = size
            blocks = block.segment.blocks
            blocks.insert(blocks.index(block) + 1, tail)
        block.state, block.requested = "active_allocated", int(nbytes)
        self._account()
        return block

    def _best_fit(self, size, pool):
        fits = [b for s in self.segments if s.pool == pool for b in s.blocks
                if b.state == "inactive" and b.size >= size]
        return min(fits, key=lambda b: (b.size, b.address)) if fits else None

    def free(self, block):
        block.state, block.requested = "inactive", 0
        blocks = block.segment.blocks
        i = blocks.index(block)
        for j in (i + 1, i - 1):  # merge with inactive neighbours
            if 0 <= j < len(blocks) and blocks[j].state == "inactive":
                lo, hi = sorted((blocks[i], blocks[j]), key=lambda b: b.address)
                lo.size += hi.size
                blocks.remove(hi)
                i = blocks.index(lo)
        self._account()

    def release_cached(self):
        kept = [s for s in self.segments if any(b.state != "inactive" for b in s.blocks)]
        self.counters["num_device_free"] += len(self.segments) - len(kept)
        self.segments = kept
        self._account()

    def _account(self):
        """Each statistic's current value from the segments; peak, allocated and freed follow."""
        now = {k: 0 for k in self.current}
        for seg in self.segments:
            pools = ("all", f"{seg.pool}_pool")
            split = len(seg.blocks) > 1
            for p in pools:
                now[("segment", p)] += 1
                now[("reserved_bytes", p)] += seg.size
            for b in seg.blocks:
                for p in pools:
                    if b.state == "active_allocated":
                        now[("allocation", p)] += 1
                        now[("active", p)] += 1
                        now[("allocated_bytes", p)] += b.size
                        now[("active_bytes", p)] += b.size
                        now[("requested_bytes", p)] += b.requested
                    elif split:
                        now[("inactive_split", p)] += 1
                        now[("inactive_split_bytes", p)] += b.size
        for k, v in now.items():
            delta = v - self.current[k]
            if delta > 0:
                self.allocated[k] += delta
            else:
                self.freed[k] -= delta
            self.current[k] = v
            self.peak[k] = max(self.peak[k], v)

    def stats(self):
        out = {}
        for s in STATS:
            out[s] = {p: {"current": self.current[(s, p)], "peak": self.peak[(s, p)],
                          "allocated": self.allocated[(s, p)], "freed": self.freed[(s, p)]}
                      for p in POOLS}
        zero = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}
        out["oversize_allocations"] = dict(zero)
        out["oversize_segments"] = dict(zero)
        out["max_split_size"] = -1
        out.update(self.counters)
        return out

    def segments_snapshot(self):
        out = []
        for seg in sorted(self.segments, key=lambda s: s.address):
            blocks = [{"address": b.address, "size": b.size, "requested_size": b.requested,
                       "state": b.state, "frames": []} for b in seg.blocks]
            active = sum(b["size"] for b in blocks if b["state"] != "inactive")
            out.append({"device": self.index, "address": seg.address, "total_size": seg.size,
                        "allocated_size": active, "active_size": active,
                        "requested_size": sum(b["requested_size"] for b in blocks),
                        "stream": 0, "segment_type": seg.pool, "segment_pool_id": (0, 0),
                        "is_expandable": False, "frames": [], "blocks": blocks})
        return out


def _allocator(index):
    with _lock:
        found = _state["allocators"].get(index)
        if found is None:
            found = _state["allocators"][index] = _Allocator(index)
        return found


def _cuda_malloc(index, nbytes):
    _log("_cuda_malloc")
    _check(index)
    with _lock:
        _state["contexts"].add(index)
        return _allocator(index).malloc(nbytes)


def _cuda_free(index, block):
    with _lock:
        if not _state["bad_fork"]:
            _allocator(index).free(block)


def _cuda_memoryStats(index):
    _log("_cuda_memoryStats")
    _check(index)
    with _lock:
        return _allocator(index).stats()


def _cuda_memorySnapshot(args=None):
    _log("_cuda_memorySnapshot")
    with _lock:
        segments = [s for i in sorted(_state["allocators"])
                    for s in _state["allocators"][i].segments_snapshot()]
    return {"segments": segments, "device_traces": [[] for _ in _visible()]}


def _cuda_emptyCache():
    _log("_cuda_emptyCache")
    with _lock:
        for allocator in _state["allocators"].values():
            allocator.release_cached()
