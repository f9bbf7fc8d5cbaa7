"""The NVML source: per-GPU readings of the compute, memory and IO layers.

- ``capabilities``: what each GPU can give and why the rest is absent, detected once at open;
- ``devices``: opening GPUs and MIG instances (identity, handles) and finding a lost one again;
- ``reading``: one cycle's reading of one GPU, following what detection chose;
- ``source``: ``NvmlSource``, which reads the selected GPUs each cycle and sets lost ones aside;
- ``errors``: what an NVML error means here (unsupported, lost, passing) and logging it once.

Every NVML call goes through pynvml's public functions, so the stand-in library
(``sidecar/simulate/fake_nvml.py``) is exercised under the same pynvml code a real driver is.
"""

from sidecar.sources.nvml.errors import NvmlUnavailable
from sidecar.sources.nvml.reading import NvmlReading
from sidecar.sources.nvml.source import NvmlSource

__all__ = ["NvmlReading", "NvmlSource", "NvmlUnavailable"]
