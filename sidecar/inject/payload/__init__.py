"""The files ``gpu-sidecar run`` places in the socket volume (``--inject-dir``): they run inside
the app's processes, on the app's Python (3.9 to 3.13), so they are written for 3.9 and the
standard library only (ruff holds them to py39). The agent never imports them: it reads them as
text (``sidecar.inject.placement``), sets the constants of its own release and writes them."""
