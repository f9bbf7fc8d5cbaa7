"""``python -m sidecar`` and the ``gpu-sidecar`` command: stop signals first, then the rest."""

from sidecar import signals


def main() -> int:
    signals.install()
    from sidecar.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    raise SystemExit(main())
