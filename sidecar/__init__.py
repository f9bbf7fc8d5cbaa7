"""gpu-sidecar: the three layers GPU utilization hides, pushed from beside the model server.

Kept import-free on purpose: ``sidecar.client`` is imported into model servers, and importing it
must not drag in NVML, structlog or anything else the agent needs.
"""

__version__ = "0.1.0"
