"""Tensors of the stand-in: a shape, a dtype and, on a CUDA device, one allocation of the
caching allocator, returned to its cache when the tensor is garbage-collected."""

import math

from torch import _C  # imported first by torch/__init__.py


class dtype:
    def __init__(self, name, itemsize):
        self.name, self.itemsize = name, itemsize

    def __repr__(self):
        return f"torch.{self.name}"


uint8 = dtype("uint8", 1)
float16 = dtype("float16", 2)
float32 = dtype("float32", 4)


class device:
    def __init__(self, spec, index=None):
        if isinstance(spec, device):
            spec, index = spec.type, spec.index
        elif isinstance(spec, int):
            spec, index = "cuda", spec
        kind, _, number = str(spec).partition(":")
        if kind not in ("cpu", "cuda"):
            raise RuntimeError(f"Expected one of cpu, cuda device type at start of device string: {spec}")
        self.type = kind
        self.index = int(number) if number else index

    def __repr__(self):
        return f"device(type='{self.type}'" + (f", index={self.index})" if self.index is not None else ")")


class Tensor:
    def __init__(self, shape, dtype_, dev, block=None):
        self.shape, self.dtype, self.device, self._block = tuple(shape), dtype_, dev, block

    @property
    def is_cuda(self):
        return self.device.type == "cuda"

    def numel(self):
        return math.prod(self.shape)

    def element_size(self):
        return self.dtype.itemsize

    @property
    def nbytes(self):
        return self.numel() * self.element_size()

    def __del__(self):
        block, self._block = getattr(self, "_block", None), None
        if block is not None:
            _C._cuda_free(self.device.index, block)


def empty(*size, dtype=float32, device=None):
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    dev = globals()["device"](device if device is not None else "cpu")
    tensor = Tensor(size, dtype, dev)
    if dev.type == "cuda":
        import torch.cuda

        torch.cuda._lazy_init()  # a CUDA tensor initialises CUDA, as in PyTorch
        index = torch.cuda.current_device() if dev.index is None else dev.index
        tensor.device = globals()["device"]("cuda", index)
        tensor._block = _C._cuda_malloc(index, max(tensor.nbytes, 0))
    return tensor


zeros = empty
