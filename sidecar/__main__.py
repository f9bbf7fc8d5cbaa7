"""``python -m sidecar`` and the ``gpu-sidecar`` command: stop signals first, then the rest.

The handlers go in before anything heavy is imported, so that a signal during start-up is
honoured (``sidecar/signals.py``). Everything else loads the ordinary way, the same modules as
an in-process ``sidecar.cli.main()``.
"""

from __future__ import annotations

from sidecar import signals


def main() -> int:
    signals.install()
    from sidecar.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    raise SystemExit(main())
