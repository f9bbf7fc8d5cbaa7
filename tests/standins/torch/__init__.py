"""Stand-in for PyTorch (tests/standins/README.md): ``torch.cuda`` with PyTorch's lazy CUDA
initialisation, device selection and caching-allocator statistics, and CUDA tensors that are
only their allocations. Imported by the tests' app processes, never by the tests themselves."""

from torch import _C, cuda
from torch._tensor import Tensor, device, dtype, empty, float16, float32, uint8, zeros

__version__ = "2.13.0+standin"
__all__ = ["_C", "Tensor", "cuda", "device", "dtype", "empty", "float16", "float32", "uint8",
           "zeros"]
