"""The injected publisher: allocator figures from a Python app with no code change.

``gpu-sidecar run`` places a standard-library app-side publisher and a ``sitecustomize.py``
(``payload/``), with the helpers it shares with ``sidecar.client`` (``sidecar/app_shared.py``,
byte for byte), in a directory of the socket volume before it binds the socket
(``placement``). An app container with that directory on ``PYTHONPATH`` runs it in every
interpreter it starts; it waits, at no cost, until the process has imported torch and
initialised CUDA, then publishes that process's devices over the socket. ``versions`` is the
agent's side of the publisher's release: said once when it is not the agent's own.
"""

INJECT_NAME = "gpu-sidecar-inject"  # the publisher names itself "<this>/<agent release>"
SITECUSTOMIZE = "sitecustomize.py"
PUBLISHER = "_gpu_sidecar_inject.py"
SHARED = "_gpu_sidecar_shared.py"  # sidecar/app_shared.py under a name of the agent's
FILES = (SITECUSTOMIZE, PUBLISHER, SHARED)
