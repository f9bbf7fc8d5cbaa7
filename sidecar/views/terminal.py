"""Whether a stream is a person's terminal: the one test behind ``--output auto`` and the live
table's redrawing, kept light because the stdout sink asks it on every start."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TextIO


def capable_terminal(stream: TextIO, environ: Mapping[str, str] | None = None) -> bool:
    """A terminal that understands cursor addressing: a tty whose TERM is set and not dumb (an
    editor's shell buffer says dumb, a container's pipe has no tty)."""
    term = (os.environ if environ is None else environ).get("TERM", "")
    return term not in ("", "dumb") and isatty(stream)


def isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a stream without a descriptor, or a closed one
        return False
