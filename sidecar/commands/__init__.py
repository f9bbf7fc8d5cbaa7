"""The commands a person runs, above the wiring: ``diagnose``, ``probe``, ``status`` and
``run --dry-run``. Each builds what it needs through ``sidecar.wiring`` and prints through the
pure renderers of ``sidecar.views``; nothing below imports them."""
