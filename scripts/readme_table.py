"""Capture the live table from a real run of the README's first command and put it in README.md.

    .venv/bin/python scripts/readme_table.py          # rewrites the block between the markers
    .venv/bin/python scripts/readme_table.py --print  # prints the captured frame only

The command runs in a pseudo-terminal (standard library ``pty``) 120 columns wide, as a person
would see it; after a few frames Ctrl-C is typed, and the frame the agent leaves on the main
screen when it gives the terminal back is what goes into the README. So the README shows what
the code draws, never a table typed by hand; ``tests/test_table.py`` checks that the block has
the structure of a fresh capture (the values vary from run to run).
"""

from __future__ import annotations

import os
import pty
import re
import select
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BEGIN, END = "<!-- table: scripts/readme_table.py -->", "<!-- /table -->"
# the README's first command, run by the interpreter of this checkout
COMMAND = ("run", "--simulate", "healthy", "--interval", "2")
MAIN_SCREEN = "\x1b[?1049l\x1b[?25h"
_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def run_in_pty(args: tuple[str, ...] | list[str], *, frames: int = 0, cols: int = 120,
               rows: int = 40, timeout: float = 30, term: str | None = "xterm",
               interrupt_after: float | None = None) -> tuple[str, int]:
    """``python -m sidecar ARGS`` on a pseudo-terminal of ``cols`` x ``rows``: all it wrote
    (stdout and stderr share the terminal) and its exit status. With ``frames``, Ctrl-C is typed
    once that many frames were drawn (or, with ``interrupt_after``, after that many seconds);
    the process is killed if it outlives ``timeout``. ``term`` is TERM (None: unset)."""
    import fcntl
    import struct
    import termios

    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_SIDECAR_")}
    env.pop("TERM", None)
    env.update(PYTHONUNBUFFERED="1", **({} if term is None else {"TERM": term}))
    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its terminal, sized before the agent asks
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        os.chdir(ROOT)
        os.execve(sys.executable, [sys.executable, "-m", "sidecar", *args], env)
    out = b""
    sent = False
    began = time.monotonic()
    deadline = began + timeout
    try:
        while time.monotonic() < deadline:
            due = (out.count(b"\x1b[H") >= frames if interrupt_after is None
                   else time.monotonic() - began >= interrupt_after)
            if (frames or interrupt_after is not None) and not sent and due:
                os.write(fd, b"\x03")  # Ctrl-C, through the terminal's line discipline
                sent = True
            if not select.select([fd], [], [], 0.1)[0]:
                continue
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
    finally:
        if time.monotonic() >= deadline:
            os.kill(pid, 9)
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    return out.decode(errors="replace"), os.waitstatus_to_exitcode(status)


def last_frame(output: str) -> list[str]:
    """The frame left on the main screen at exit: from its title to the end of its legend (the
    line starting ``legend: `` and its indented continuations)."""
    after = _ESCAPE.sub("", output[output.rindex(MAIN_SCREEN):]).replace("\r", "").split("\n")
    start = next(i for i, line in enumerate(after) if line.startswith("gpu-sidecar "))
    end = next(i for i, line in enumerate(after) if line.startswith("legend: "))
    while end + 1 < len(after) and after[end + 1].startswith("  ") and after[end + 1].strip():
        end += 1
    return after[start:end + 1]


def capture(frames: int = 3) -> list[str]:
    output, code = run_in_pty(COMMAND, frames=frames)
    if code != 0:
        raise SystemExit(f"the command exited {code}:\n{output[-2000:]}")
    return last_frame(output)


def block(lines: list[str]) -> str:
    return "\n".join([BEGIN, "```text", *lines, "```", END])


def readme_block(text: str) -> list[str]:
    """The table lines now in the README between the markers."""
    inner = text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip().split("\n")
    return inner[1:-1]  # without the ``` fences


def main(argv: list[str]) -> int:
    lines = capture()
    if "--print" in argv:
        print("\n".join(lines))
        return 0
    text = README.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    README.write_text(text[:start] + block(lines) + text[end:])
    print(f"README.md: table of {len(lines)} lines from `gpu-sidecar {' '.join(COMMAND)}`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
